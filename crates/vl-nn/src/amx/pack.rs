//! bf16 rounding and the operands' layouts (see the `amx` module's documentation): the weights'
//! panels of pairs, packed once at load, and the activations' tiles, rounded per call.

use super::{KSTEP, MR, NR, TILE_ROWS};

/// The float types weights arrive in (exact widening to f32).
pub(crate) trait Float: Copy + Send + Sync {
    /// `src` widened into `dst` (same length).
    fn widen(src: &[Self], dst: &mut [f32]);
}
impl Float for f32 {
    fn widen(src: &[Self], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
}
impl Float for half::f16 {
    fn widen(src: &[Self], dst: &mut [f32]) {
        use half::slice::HalfFloatSliceExt;
        src.convert_to_f32_slice(dst);
    }
}
impl Float for half::bf16 {
    fn widen(src: &[Self], dst: &mut [f32]) {
        use half::slice::HalfFloatSliceExt;
        src.convert_to_f32_slice(dst);
    }
}

/// bf16 bits of `v`, rounded to nearest even (NaN stays NaN).
pub(crate) fn round(v: f32) -> u16 {
    half::bf16::from_f32(v).to_bits()
}

/// Pairs per panel row for `k` input features.
pub(crate) fn pairs(k: usize) -> usize {
    k.next_multiple_of(KSTEP) / 2
}

/// `u32`s of the panels of an `n` x `k` weight.
pub(crate) fn packed_weight_len(n: usize, k: usize) -> usize {
    n.div_ceil(NR) * pairs(k) * NR
}

/// The panels' shape (panels, pair rows, columns) for an `n` x `k` weight.
pub(crate) fn packed_weight_shape(n: usize, k: usize) -> (usize, usize, usize) {
    (n.div_ceil(NR), pairs(k), NR)
}

/// `W^T` ([k, n] row-major, how `Dense` keeps its weights) as panels of pairs (layout above),
/// rounded to bf16: each pair row of a panel is two contiguous runs of `W^T`. Parallel over panels on candle's pool.
pub(crate) fn pack_weights_t<T: Float>(wt: &[T], n: usize, k: usize) -> Vec<u32> {
    assert!(wt.len() >= n * k, "pack_weights_t: {} floats for {k} x {n}", wt.len());
    let kp = pairs(k);
    let len = packed_weight_len(n, k);
    // Not zeroed first: every u32 (padding included) is written once below, by the thread that
    // owns its panel, so the new pages are faulted in by every thread.
    let mut dst: Vec<u32> = Vec::with_capacity(len);
    let ptr = crate::cpu::SendPtr(dst.as_mut_ptr());
    candle_core::utils::barrier_pool().execute_chunked(n.div_ceil(NR), |range| {
        for p in range {
            let (c0, cols) = (p * NR, NR.min(n - p * NR));
            let (mut wide, mut bits) = ([0f32; 2 * NR], [0u16; 2 * NR]);
            for i in 0..kp {
                let mut row = [0u32; NR];
                if 2 * i < k {
                    // The pair row's even and odd features side by side, widened, then rounded
                    // (vectors where the CPU has them), then interleaved into pairs.
                    T::widen(&wt[2 * i * n + c0..][..cols], &mut wide[..cols]);
                    if 2 * i + 1 < k {
                        T::widen(&wt[(2 * i + 1) * n + c0..][..cols], &mut wide[NR..NR + cols]);
                    } else {
                        wide[NR..].fill(0.0);
                    }
                    round_row(&wide, &mut bits);
                    for (c, o) in row[..cols].iter_mut().enumerate() {
                        *o = bits[c] as u32 | (bits[NR + c] as u32) << 16;
                    }
                }
                // SAFETY: panel p's pair rows belong to this work item, inside the capacity.
                unsafe { std::ptr::copy_nonoverlapping(row.as_ptr(), ptr.get().add((p * kp + i) * NR), NR) };
            }
        }
    });
    // SAFETY: the panels cover all `len` values, each written once above.
    unsafe { dst.set_len(len) };
    dst
}

/// `x`: `rows` rows of `k` features into `dst` (refilled) as bf16 tiles (layout above), rounded
/// to nearest even. Parallel over blocks of rows on candle's pool.
pub(crate) fn pack_rows(x: &[f32], rows: usize, k: usize, dst: &mut Vec<u16>) {
    assert!(x.len() >= rows * k, "pack_rows: {} floats for {rows} rows of {k}", x.len());
    let kpad = k.next_multiple_of(KSTEP);
    let padded = rows.next_multiple_of(MR);
    let steps = kpad / KSTEP;
    dst.clear();
    dst.resize(padded * kpad, 0);
    let ptr = crate::cpu::SendPtr(dst.as_mut_ptr());
    candle_core::utils::barrier_pool().execute_chunked(rows.div_ceil(MR), |range| {
        let mut bits = vec![0u16; kpad];
        for b in range {
            for r in b * MR..rows.min((b + 1) * MR) {
                round_row(&x[r * k..][..k], &mut bits[..k]);
                // Row r's 32-feature steps go to its row of each of its 16-row group's tiles.
                let base = (r / TILE_ROWS) * steps * TILE_ROWS * KSTEP + (r % TILE_ROWS) * KSTEP;
                for (st, chunk) in bits.chunks_exact(KSTEP).enumerate() {
                    // SAFETY: row r's slots of its group's tiles belong to this item (its block
                    // of 32 rows), inside `dst` (padded rows x kpad).
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            chunk.as_ptr(),
                            ptr.get().add(base + st * TILE_ROWS * KSTEP),
                            KSTEP,
                        )
                    };
                }
            }
        }
    });
}

/// `src` rounded to bf16 bits into `dst` (same length).
pub(crate) fn round_row(src: &[f32], dst: &mut [u16]) {
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::has_avx512()
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512vl")
        && std::arch::is_x86_feature_detected!("avx512bf16")
    {
        // SAFETY: AVX-512 F/BW/VL and AVX512-BF16 checked just above.
        return unsafe { x86::round_row(src, dst) };
    }
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = round(s);
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// `src` to bf16 bits, 16 at a time (`vcvtneps2bf16`, round to nearest even).
    ///
    /// # Safety
    /// The CPU has AVX-512 F/BW/VL and AVX512-BF16 (the loads and stores are masked to the shorter
    /// slice's length).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    pub(super) unsafe fn round_row(src: &[f32], dst: &mut [u16]) {
        // SAFETY: the operations below need no more than this function's `# Safety` contract.
        unsafe {
            let n = src.len().min(dst.len());
            let mut i = 0;
            while i < n {
                let m: __mmask16 = if n - i >= 16 { 0xffff } else { (1u16 << (n - i)) - 1 };
                let v = _mm512_maskz_loadu_ps(m, src.as_ptr().add(i));
                let h: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(v));
                _mm256_mask_storeu_epi16(dst.as_mut_ptr().add(i) as *mut i16, m, h);
                i += 16;
            }
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// The panels from `W` [n, k] row-major, scattered value by value: the reference layout
    /// `pack_weights_t` must produce.
    pub(crate) fn pack_weights(w: &[f32], n: usize, k: usize) -> Vec<u32> {
        assert!(w.len() >= n * k, "pack_weights: {} floats for {n} x {k}", w.len());
        let kp = pairs(k);
        let mut dst = vec![0u32; packed_weight_len(n, k)];
        let ptr = crate::cpu::SendPtr(dst.as_mut_ptr());
        candle_core::utils::barrier_pool().execute_chunked(n.div_ceil(NR), |range| {
            for p in range {
                for c in 0..NR.min(n - p * NR) {
                    let row = &w[(p * NR + c) * k..][..k];
                    for (i, pair) in row.chunks(2).enumerate() {
                        let hi = pair.get(1).map_or(0, |&v| round(v));
                        let v = round(pair[0]) as u32 | (hi as u32) << 16;
                        // SAFETY: panel p's pairs belong to this work item, inside `dst`.
                        unsafe { ptr.get().add((p * kp + i) * NR + c).write(v) };
                    }
                }
            }
        });
        dst
    }

    /// Element (`out` column `c`, input feature `i`) of packed panels, as f32 (for unpacking).
    fn weight_at(panels: &[u32], k: usize, c: usize, i: usize) -> f32 {
        let v = panels[((c / NR) * pairs(k) + i / 2) * NR + c % NR];
        half::bf16::from_bits((v >> (16 * (i % 2))) as u16).to_f32()
    }

    pub(crate) fn rand(seed: u64, std: f32, len: usize) -> Vec<f32> {
        crate::testing::randn(seed, std, len).unwrap().to_vec1().unwrap()
    }

    #[test]
    fn rounding_is_to_nearest_even_in_the_scalar_and_vector_paths() {
        // 1 + 2^-8 is halfway between two bf16 values: ties go to the even one (1.0); a hair
        // above goes up; NaN stays NaN.
        let src = [1.0 + 2f32.powi(-8), 1.0 + 2f32.powi(-8) + 2f32.powi(-20), -3.0, f32::NAN];
        let want = [0x3f80u16, 0x3f81, 0xc040];
        let mut got = [0u16; 4];
        round_row(&src, &mut got);
        assert_eq!(&got[..3], &want);
        assert!(half::bf16::from_bits(got[3]).is_nan());
        for (s, w) in src.iter().zip(want) {
            assert_eq!(round(*s), w);
        }
    }

    #[test]
    fn packed_weights_unpack_to_the_rounded_values() {
        let (n, k) = (37, 7);
        let w = rand(3, 1.0, n * k);
        let p = pack_weights(&w, n, k);
        let wt: Vec<f32> = (0..k * n).map(|j| w[(j % n) * k + j / n]).collect();
        assert_eq!(pack_weights_t(&wt, n, k), p);
        for c in 0..n {
            for i in 0..k {
                assert_eq!(weight_at(&p, k, c, i), half::bf16::from_f32(w[c * k + i]).to_f32());
            }
        }
    }
}
