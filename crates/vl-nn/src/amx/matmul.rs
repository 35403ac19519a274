//! A dense product's output tile on AMX tiles: blocks of 32 rows x 32 columns, their f32 sums in
//! four 16 x 16 tiles, the bias added as they are written.

use super::config;
use super::pack::pairs;
use super::{KSTEP, MR, NR, ROW_BLOCK};

/// Rows r0..r1 (r0 a multiple of `MR`), columns c0..c1 (c0 a multiple of `NR`) of `y = x W^T +
/// b`: `rows` packed by `pack_rows`, `panels` by `pack_weights_t` (`k` input features), `y` with
/// row stride `n`, `bias` (n values) added to the sums.
///
/// # Safety
/// `available()` must be true; `y` must have room for r1 rows of `n` and this tile must be
/// written by no one else meanwhile; `rows` must hold r1's block of rows, `panels` c1's panel.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn tile(
    rows: &[u16],
    k: usize,
    panels: &[u32],
    n: usize,
    bias: Option<&[f32]>,
    y: *mut f32,
    (r0, r1): (usize, usize),
    (c0, c1): (usize, usize),
) {
    // SAFETY: the operations below need no more than this function's `# Safety` contract.
    unsafe {
        let (kpad, kp) = (k.next_multiple_of(KSTEP), pairs(k));
        assert!(r0 % MR == 0 && c0 % NR == 0 && r1 > r0 && c1 > c0 && c1 <= n, "bf16::tile {r0}..{r1} x {c0}..{c1}");
        assert!(rows.len() >= r1.next_multiple_of(MR) * kpad && panels.len() >= c1.div_ceil(NR) * kp * NR);
        config::configure();
        let mut sums = x86::Sums([0.0; 4 * 256]);
        for b0 in (r0..r1).step_by(ROW_BLOCK) {
            let b1 = r1.min(b0 + ROW_BLOCK);
            for c in (c0..c1).step_by(NR) {
                let w = panels.as_ptr().add(c / NR * kp * NR);
                for r in (b0..b1).step_by(MR) {
                    x86::block(rows.as_ptr().add(r * kpad), kpad, w, &mut sums);
                    // (Rows r..r+32 are groups r/16 and r/16 + 1: contiguous, 16 x kpad each.)
                    x86::write(
                        &sums,
                        bias.map(|b| b.as_ptr().add(c)),
                        y.add(r * n + c),
                        n,
                        MR.min(b1 - r),
                        NR.min(c1 - c),
                    );
                }
            }
        }
        config::release();
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::asm;
    use std::arch::x86_64::*;

    /// Four 16 x 16 tiles of f32 sums (rows 0-15 x columns 0-15, 0-15 x 16-31, 16-31 x 0-15,
    /// 16-31 x 16-31), 64-byte aligned.
    #[repr(C, align(64))]
    pub(super) struct Sums(pub(super) [f32; 4 * 256]);

    /// The sums of 32 activation rows at `a` (`kpad` bf16 each) against a panel at `w` (`kpad /
    /// 2` rows of 32 pairs), into `sums`.
    ///
    /// # Safety
    /// The tiles configured on this thread (`configure`); `a` and `w` readable for those sizes.
    pub(super) unsafe fn block(a: *const u16, kpad: usize, w: *const u32, sums: &mut Sums) {
        // SAFETY: the operations below need no more than this function's `# Safety` contract.
        unsafe {
            asm!("tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3", options(nostack, nomem));
            // Group 0 (rows 0-15) at `a`, group 1 at `a + 16 kpad`; each 32-feature step's tile is
            // 16 rows of 64 contiguous bytes.
            let a_stride = crate::amx::KSTEP * 2;
            let mut k = 0;
            while k < kpad {
                asm!(
                    "tileloadd tmm4, [{a0} + {sa}*1]",
                    "tileloadd tmm6, [{w} + {sw}*1]",
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    "tileloadd tmm7, [{w} + {sw}*1 + 64]",
                    "tdpbf16ps tmm1, tmm4, tmm7",
                    "tileloadd tmm5, [{a1} + {sa}*1]",
                    "tdpbf16ps tmm2, tmm5, tmm6",
                    "tdpbf16ps tmm3, tmm5, tmm7",
                    a0 = in(reg) a.add(k * 16),
                    a1 = in(reg) a.add(16 * kpad + k * 16),
                    w = in(reg) w.add(k / 2 * crate::amx::NR),
                    sa = in(reg) a_stride,
                    sw = in(reg) crate::amx::NR * 4,
                    options(nostack, readonly),
                );
                k += crate::amx::KSTEP;
            }
            asm!(
                "tilestored [{s} + {st}*1], tmm0",
                "tilestored [{s} + {st}*1 + 1024], tmm1",
                "tilestored [{s} + {st}*1 + 2048], tmm2",
                "tilestored [{s} + {st}*1 + 3072], tmm3",
                s = in(reg) sums.0.as_mut_ptr(),
                st = in(reg) 64usize,
                options(nostack),
            );
        }
    }

    /// `rows` x `cols` of `sums` (plus the bias at the block's first column) into `y` (row
    /// stride `ldy`).
    ///
    /// # Safety
    /// The CPU has AVX-512F; `rows` and `cols` at most 32 (one block of `sums`); `y` has `rows`
    /// rows of `cols` floats, `ldy` apart, that are this caller's to write; `bias`, when given, is
    /// readable for `cols` floats.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn write(
        sums: &Sums,
        bias: Option<*const f32>,
        y: *mut f32,
        ldy: usize,
        rows: usize,
        cols: usize,
    ) {
        // SAFETY: the operations below need no more than this function's `# Safety` contract.
        unsafe {
            let lo: __mmask16 = if cols >= 16 { 0xffff } else { (1u16 << cols) - 1 };
            let hi: __mmask16 = if cols >= 32 {
                0xffff
            } else if cols > 16 {
                (1u16 << (cols - 16)) - 1
            } else {
                0
            };
            let (b0, b1) = match bias {
                Some(b) => (_mm512_maskz_loadu_ps(lo, b), _mm512_maskz_loadu_ps(hi, b.add(16))),
                None => (_mm512_setzero_ps(), _mm512_setzero_ps()),
            };
            for r in 0..rows {
                let t = (r / 16) * 2;
                let s = sums.0.as_ptr().add(t * 256 + (r % 16) * 16);
                let out = y.add(r * ldy);
                _mm512_mask_storeu_ps(out, lo, _mm512_add_ps(_mm512_load_ps(s), b0));
                if hi != 0 {
                    _mm512_mask_storeu_ps(out.add(16), hi, _mm512_add_ps(_mm512_load_ps(s.add(256)), b1));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::amx::available;
    use crate::amx::pack::tests::{pack_weights, rand};
    use crate::amx::pack::{pack_rows, round};

    /// The product of the bf16-rounded operands in f64, as the kernel's exact target.
    fn reference(x: &[f32], w: &[f32], bias: Option<&[f32]>, m: usize, n: usize, k: usize) -> Vec<f64> {
        let r = |v: f32| half::bf16::from_f32(v).to_f64();
        let mut y = vec![0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                let s: f64 = (0..k).map(|t| r(x[i * k + t]) * r(w[j * k + t])).sum();
                y[i * n + j] = s + bias.map_or(0.0, |b| b[j] as f64);
            }
        }
        y
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn tiles_equal_the_rounded_operands_product() {
        // The activations' tile layout, on every CPU: row r's feature i at its group's step tile.
        let (m, k) = (45, 70);
        let x = rand(10, 1.0, m * k);
        let mut rows: Vec<u16> = Vec::new();
        pack_rows(&x, m, k, &mut rows);
        let kpad = k.next_multiple_of(KSTEP);
        assert_eq!(rows.len(), m.next_multiple_of(MR) * kpad);
        for r in 0..m.next_multiple_of(MR) {
            for i in 0..kpad {
                let want = if r < m && i < k { round(x[r * k + i]) } else { 0 };
                let at = ((r / 16) * (kpad / KSTEP) + i / KSTEP) * 16 * KSTEP + (r % 16) * KSTEP + i % KSTEP;
                assert_eq!(rows[at], want, "row {r} feature {i}");
            }
        }
        if !available() {
            // No tiles here: the layer refuses the path (tested in linear.rs).
            return;
        }
        // Ragged in every direction: rows not a multiple of 32 and more than one row block,
        // columns not of 32, features odd; tiles split mid-matrix.
        for &(m, n, k) in &[(1, 1, 1), (13, 33, 5), (45, 70, 301), (300, 64, 67)] {
            let x = rand(11, 1.0, m * k);
            let w = rand(12, 0.5, n * k);
            let bias = rand(13, 1.0, n);
            let panels = pack_weights(&w, n, k);
            let mut rows: Vec<u16> = Vec::new();
            pack_rows(&x, m, k, &mut rows);
            for bias in [None, Some(&bias[..])] {
                let want = reference(&x, &w, bias, m, n, k);
                let mut y = vec![f32::NAN; m * n];
                let rm = (m.div_ceil(2)).next_multiple_of(MR).min(m);
                let cm = (n.div_ceil(2)).next_multiple_of(NR).min(n);
                for (rr, cc) in [((0, rm), (0, cm)), ((0, rm), (cm, n)), ((rm, m), (0, cm)), ((rm, m), (cm, n))] {
                    if rr.0 < rr.1 && cc.0 < cc.1 {
                        // SAFETY: available() checked; disjoint tiles of an m x n output.
                        unsafe { tile(&rows, k, &panels, n, bias, y.as_mut_ptr(), rr, cc) };
                    }
                }
                for (i, (&g, &e)) in y.iter().zip(&want).enumerate() {
                    // f32 sums of exact products: relative to the sum of magnitudes.
                    let scale: f64 = 1.0 + (k as f64).sqrt();
                    assert!(
                        (g as f64 - e).abs() <= 1e-5 * scale,
                        "{m}x{n}x{k} bias {} at {i}: {g} vs {e}",
                        bias.is_some()
                    );
                }
            }
        }
    }
}
