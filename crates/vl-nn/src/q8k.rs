//! Activation rows quantized to Q8_K blocks (f32 d, 256 i8, 16 i16 sums of 16), exactly as
//! candle's `BlockQ8K::from_float` does: the scale -127 / (the value of largest magnitude, the
//! first such), values rounded half away from zero and clamped to [-128, 127], NaN to 0.
//!
//! candle's loop rounds each value with a scalar `f32::round` call: ~3.7 ns a value on a Zen 4,
//! so quantizing 8 rows of 6144 took 0.18 ms, a third of their product with a 6144 x 2048 Q4_K
//! weight (`examples/qmatmul_time 8 6144 32`). Every decode step quantizes each of its inputs,
//! single-threaded, before the products start. With AVX-512 the same blocks come out of a few
//! vector operations per 16 values, with AVX2 per 8.

use candle_core::quantized::k_quants::{BlockQ8K, GgmlType};

const QK: usize = 256;
const Q8K_BYTES: usize = 292;

/// `x` (whole blocks of 256) into `blocks`, bit for bit what `BlockQ8K::from_float` writes.
pub(crate) fn quantize(x: &[f32], blocks: &mut [BlockQ8K]) {
    debug_assert_eq!(x.len(), blocks.len() * QK);
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::has_avx512() && is_x86_feature_detected!("avx512bw") {
        // SAFETY: AVX-512 F and BW checked just above; `blocks` holds x.len() / 256 blocks.
        unsafe { quantize_avx512(x, blocks) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 checked just above; `blocks` holds x.len() / 256 blocks.
        unsafe { quantize_avx2(x, blocks) };
        return;
    }
    BlockQ8K::from_float(x, blocks);
}

/// `quantize_avx512` on 8-lane vectors: the same operations, the same bits.
///
/// # Safety
/// The CPU has AVX2; `blocks` holds at least `x.len() / 256` blocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quantize_avx2(x: &[f32], blocks: &mut [BlockQ8K]) {
    // SAFETY: the operations below need no more than this function's `# Safety` contract.
    unsafe {
        use std::arch::x86_64::*;
        let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
        // The i32 lanes of two `packs` rounds back in order.
        let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        for (xs, blk) in x.chunks_exact(QK).zip(blocks.iter_mut()) {
            let out = blk as *mut BlockQ8K as *mut u8;
            let load = |j: usize| _mm256_loadu_ps(xs.as_ptr().add(8 * j));
            // |x| with NaN as 0 (see `quantize_avx512`).
            let magnitude = |v: __m256| _mm256_and_ps(_mm256_and_ps(v, abs), _mm256_cmp_ps::<_CMP_ORD_Q>(v, v));
            let mut amax = _mm256_setzero_ps();
            for j in 0..32 {
                amax = _mm256_max_ps(amax, magnitude(load(j)));
            }
            let m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
            let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
            let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
            if amax == 0.0 {
                std::ptr::write_bytes(out, 0, Q8K_BYTES);
                continue;
            }
            let mut max = amax;
            for j in 0..32 {
                let hit = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_EQ_OQ>(magnitude(load(j)), _mm256_set1_ps(amax)));
                if hit != 0 {
                    max = xs[8 * j + hit.trailing_zeros() as usize];
                    break;
                }
            }
            let iscale = -127f32 / max;
            let scale = _mm256_set1_ps(iscale);
            let (half, one, sign) = (_mm256_set1_ps(0.5), _mm256_set1_epi32(0x3f80_0000), _mm256_set1_epi32(i32::MIN));
            let (lo, hi) = (_mm256_set1_ps(-128.0), _mm256_set1_ps(127.0));
            for g in 0..8 {
                let q: [__m256i; 4] = std::array::from_fn(|t| {
                    let p = _mm256_mul_ps(load(4 * g + t), scale);
                    let tr = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(p);
                    let away = _mm256_cmp_ps::<_CMP_GE_OQ>(_mm256_and_ps(_mm256_sub_ps(p, tr), abs), half);
                    let step =
                        _mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(_mm256_castps_si256(p), sign), one));
                    let r = _mm256_add_ps(tr, _mm256_and_ps(step, away));
                    let r = _mm256_min_ps(_mm256_max_ps(r, lo), hi);
                    _mm256_and_si256(_mm256_cvttps_epi32(r), _mm256_castps_si256(_mm256_cmp_ps::<_CMP_ORD_Q>(p, p)))
                });
                // In [-128, 127]: the saturating packs change nothing.
                let bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
                _mm256_storeu_si256(out.add(4 + 32 * g) as *mut __m256i, _mm256_permutevar8x32_epi32(bytes, order));
                // The sums of values 32g..32g + 16 and 32g + 16..32g + 32.
                let h = _mm256_hadd_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
                let h = _mm256_hadd_epi32(h, h);
                let h = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
                std::ptr::write_unaligned(out.add(4 + QK + 4 * g) as *mut i16, _mm_cvtsi128_si32(h) as i16);
                std::ptr::write_unaligned(out.add(4 + QK + 4 * g + 2) as *mut i16, _mm_extract_epi32(h, 1) as i16);
            }
            std::ptr::write_unaligned(out as *mut f32, 1.0 / iscale);
        }
    }
}

/// # Safety
/// The CPU has AVX-512 F and BW; `blocks` holds at least `x.len() / 256` blocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn quantize_avx512(x: &[f32], blocks: &mut [BlockQ8K]) {
    // SAFETY: the operations below need no more than this function's `# Safety` contract.
    unsafe {
        use std::arch::x86_64::*;
        for (xs, blk) in x.chunks_exact(QK).zip(blocks.iter_mut()) {
            // BlockQ8K is `#[repr(C)]` of exactly Q8K_BYTES (candle asserts its size): d, then the
            // values at 4, then the sums at 4 + 256.
            let out = blk as *mut BlockQ8K as *mut u8;
            let load = |j: usize| _mm512_loadu_ps(xs.as_ptr().add(16 * j));
            // |x| with NaN as 0: candle's `amax < x.abs()` never takes a NaN.
            let magnitude = |v: __m512| _mm512_maskz_mov_ps(_mm512_cmp_ps_mask::<_CMP_ORD_Q>(v, v), _mm512_abs_ps(v));
            let mut amax = _mm512_setzero_ps();
            for j in 0..16 {
                amax = _mm512_max_ps(amax, magnitude(load(j)));
            }
            let amax = _mm512_reduce_max_ps(amax);
            if amax == 0.0 {
                std::ptr::write_bytes(out, 0, Q8K_BYTES);
                continue;
            }
            // The first value of that magnitude (candle's strict `<` keeps the first).
            let mut max = amax;
            for j in 0..16 {
                let hit = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(magnitude(load(j)), _mm512_set1_ps(amax));
                if hit != 0 {
                    max = xs[16 * j + hit.trailing_zeros() as usize];
                    break;
                }
            }
            let iscale = -127f32 / max;
            let scale = _mm512_set1_ps(iscale);
            let (half, one, sign) = (_mm512_set1_ps(0.5), _mm512_set1_epi32(0x3f80_0000), _mm512_set1_epi32(i32::MIN));
            let (lo, hi) = (_mm512_set1_ps(-128.0), _mm512_set1_ps(127.0));
            for j in 0..16 {
                let p = _mm512_mul_ps(load(j), scale);
                // Round half away from zero (`f32::round`): truncate, then a step away from zero
                // where the exact fraction is at least a half.
                let t = _mm512_roundscale_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(p);
                let away = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(_mm512_abs_ps(_mm512_sub_ps(p, t)), half);
                // +-1.0 with p's sign (integer ops: the f32 ones need AVX512-DQ).
                let step = _mm512_castsi512_ps(_mm512_or_si512(_mm512_and_si512(_mm512_castps_si512(p), sign), one));
                let r = _mm512_mask_add_ps(t, away, t, step);
                let r = _mm512_min_ps(_mm512_max_ps(r, lo), hi);
                // NaN (only from a NaN value or 0 x inf) becomes 0, as `NaN as i8` does.
                let q = _mm512_maskz_cvttps_epi32(_mm512_cmp_ps_mask::<_CMP_ORD_Q>(p, p), r);
                _mm_storeu_si128(out.add(4 + 16 * j) as *mut __m128i, _mm512_cvtepi32_epi8(q));
                let sum = _mm512_reduce_add_epi32(q) as i16;
                std::ptr::write_unaligned(out.add(4 + QK + 2 * j) as *mut i16, sum);
            }
            std::ptr::write_unaligned(out as *mut f32, 1.0 / iscale);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(b: &[BlockQ8K]) -> &[u8] {
        // SAFETY: `#[repr(C)]` blocks of Q8K_BYTES each.
        unsafe { std::slice::from_raw_parts(b.as_ptr() as *const u8, b.len() * Q8K_BYTES) }
    }

    #[test]
    fn blocks_are_bit_for_bit_candles() {
        #[cfg(target_arch = "x86_64")]
        if !(crate::cpu::has_avx512() && is_x86_feature_detected!("avx512bw")) {
            eprintln!("no AVX-512 BW here: `quantize` is the AVX2 loop or candle's own");
        }
        // Random rows at several scales, halves exactly (ties round away from zero), a row whose
        // largest magnitude appears with both signs, zeros, NaN and infinities.
        let mut x = crate::testing::randn(3, 2.0, (12, QK)).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for (i, v) in x[QK..2 * QK].iter_mut().enumerate() {
            // -127 / max = -1: each value is its own scaled value, so these are exact halves.
            *v = if i == 0 { -127.0 } else { (i as f32 - 128.0) * 0.5 };
        }
        x[2 * QK..3 * QK].fill(0.0);
        x[3 * QK + 5] = 9.0;
        x[3 * QK + 9] = -9.0;
        x[4 * QK + 7] = f32::NAN;
        x[5 * QK + 3] = f32::INFINITY;
        x[6 * QK + 200] = f32::NEG_INFINITY;
        for v in &mut x[7 * QK..8 * QK] {
            *v *= 1e-30;
        }
        for v in &mut x[8 * QK..9 * QK] {
            *v *= 1e20;
        }
        // A largest magnitude so small that -127 / max overflows to -inf: nonzero values go to
        // +-inf and clamp, zeros (0 x inf) are NaN and go to 0.
        for (i, v) in x[9 * QK..10 * QK].iter_mut().enumerate() {
            *v = if i % 3 == 0 { 0.0 } else { 1e-38 * (i as f32 - 128.0).signum() };
        }
        let blocks = x.len() / QK;
        let mut want = vec![BlockQ8K::zeros(); blocks];
        BlockQ8K::from_float(&x, &mut want);
        let mut got = vec![BlockQ8K::zeros(); blocks];
        quantize(&x, &mut got);
        let mut each = vec![("quantize", got)];
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") {
            // The AVX2 loop too where AVX-512 takes `quantize`.
            let mut got = vec![BlockQ8K::zeros(); blocks];
            // SAFETY: AVX2 checked just above; `got` holds x.len() / 256 blocks.
            unsafe { quantize_avx2(&x, &mut got) };
            each.push(("quantize_avx2", got));
        }
        for (name, got) in each {
            for b in 0..blocks {
                let (g, w) = (&bytes(&got)[b * Q8K_BYTES..][..Q8K_BYTES], &bytes(&want)[b * Q8K_BYTES..][..Q8K_BYTES]);
                assert_eq!(g, w, "{name}: block {b}");
            }
        }
    }
}
