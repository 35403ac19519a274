//! A dense product's output tile with AVX512-BF16's `vdpbf16ps` (x86_64 CPUs with AVX512-BF16 and
//! no AMX: AMD Zen 4 and Zen 5, Intel Cooper Lake): the same operands as the AMX tiles (the
//! weights' panels, the activations packed in tile order), the same products (bf16 values
//! multiplied exactly, f32 sums), in zmm registers. Each `vdpbf16ps` does 32 products (16 lanes x
//! a pair) where an f32 FMA does 16.
//!
//! A block is 8 rows x 32 columns: 16 accumulators, each pair step loading the panel's 32
//! columns (two vectors) and broadcasting each row's pair from memory.

use super::pack::pairs;
use super::{KSTEP, MR, NR};

/// Whether this CPU (and OS) runs `vdpbf16ps` on zmm registers.
pub(crate) fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        crate::cpu::has_avx512() && std::arch::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Rows of a block.
const ROWS: usize = 8;
/// Rows of a packed group (`pack_rows`' tile order: 16 rows per 32-feature step).
const GROUP: usize = 16;
/// Rows swept by each panel before the next rows (kept in L2 meanwhile).
const ROW_BLOCK: usize = 128;

/// Rows r0..r1 (r0 a multiple of `MR`), columns c0..c1 (c0 a multiple of `NR`) of `y = x W^T +
/// b`, as `amx::tile` computes them: `rows` packed by `pack_rows`, `panels` by
/// `pack_weights_t` (`k` input features), `y` with row stride `n`, `bias` added to the sums.
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
    let (kpad, kp) = (k.next_multiple_of(KSTEP), pairs(k));
    assert!(r0 % MR == 0 && c0 % NR == 0 && r1 > r0 && c1 > c0 && c1 <= n, "dpbf16::tile {r0}..{r1} x {c0}..{c1}");
    assert!(rows.len() >= r1.next_multiple_of(MR) * kpad && panels.len() >= c1.div_ceil(NR) * kp * NR);
    assert!(kp * 2 == kpad);
    #[cfg(target_arch = "x86_64")]
    for b0 in (r0..r1).step_by(ROW_BLOCK) {
        let b1 = r1.min(b0 + ROW_BLOCK);
        for c in (c0..c1).step_by(NR) {
            let w = &panels[c / NR * kp * NR..][..kp * NR];
            for g in (b0..b1).step_by(GROUP) {
                let group = &rows[g * kpad..][..GROUP * kpad];
                for half in [0, ROWS] {
                    if g + half >= b1 {
                        break;
                    }
                    let mut sums = [[0f32; NR]; ROWS];
                    // SAFETY: `available()` (this function's contract); the slices hold the
                    // group's steps and the panel's pairs.
                    unsafe { x86::block(group, kpad, w, half, &mut sums) };
                    for (i, s) in sums.iter().enumerate().take((b1 - g - half).min(ROWS)) {
                        let cols = NR.min(c1 - c);
                        // SAFETY: row g + half + i < r1 and columns c..c + cols < n are this
                        // tile's own (the caller's contract).
                        let out = unsafe { std::slice::from_raw_parts_mut(y.add((g + half + i) * n + c), cols) };
                        match bias {
                            Some(b) => out.iter_mut().zip(&s[..cols]).zip(&b[c..]).for_each(|((o, s), b)| *o = s + b),
                            None => out.copy_from_slice(&s[..cols]),
                        }
                    }
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{GROUP, ROWS};
    use crate::amx::{KSTEP, NR};

    /// The sums of rows half..half + 8 of a packed group (`kpad` bf16 a row, in tile order:
    /// `[kpad / 32][16][32]`) against a panel (`kpad / 2` rows of 32 pairs), into `sums`.
    ///
    /// # Safety
    /// AVX-512F and AVX512-BF16 present; `group` and `w` hold those sizes.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn block(group: &[u16], kpad: usize, w: &[u32], half: usize, sums: &mut [[f32; NR]; ROWS]) {
        // SAFETY: the operations below need no more than this function's `# Safety` contract.
        unsafe {
            let a = group.as_ptr() as *const u32;
            let w = w.as_ptr();
            let mut acc = [[_mm512_setzero_ps(); 2]; ROWS];
            for s in 0..kpad / KSTEP {
                // This step's 16 rows x 16 pairs, as u32 pairs.
                let step = a.add(s * GROUP * KSTEP / 2 + half * KSTEP / 2);
                for q in 0..KSTEP / 2 {
                    let p = w.add((s * KSTEP / 2 + q) * NR);
                    let b0: __m512bh = std::mem::transmute(_mm512_loadu_si512(p as *const _));
                    let b1: __m512bh = std::mem::transmute(_mm512_loadu_si512(p.add(16) as *const _));
                    for (i, acc) in acc.iter_mut().enumerate() {
                        let x: __m512bh = std::mem::transmute(_mm512_set1_epi32(*step.add(i * KSTEP / 2 + q) as i32));
                        acc[0] = _mm512_dpbf16_ps(acc[0], x, b0);
                        acc[1] = _mm512_dpbf16_ps(acc[1], x, b1);
                    }
                }
            }
            for (s, acc) in sums.iter_mut().zip(&acc) {
                _mm512_storeu_ps(s.as_mut_ptr(), acc[0]);
                _mm512_storeu_ps(s.as_mut_ptr().add(16), acc[1]);
            }
        }
    }
}
