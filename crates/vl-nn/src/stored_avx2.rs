//! The AVX2 kernels of `stored` (its child), for CPUs without AVX-512 (Zen 2 and 3, Intel's
//! client cores since Alder Lake): the Q4_K and Q6_K products of one weight row with up to
//! `MAX_ROWS` input rows on 256-bit vectors, reading the stored blocks in place. candle's AVX2
//! path repacks a Q4_K weight into tiles of 6 bits a value (192 bytes a block against the
//! stored 144) and a Q6_K one, for more than one row, into 10 bits a value (320 against 210):
//! a decode step, which reads every weight once, moves that much more.
//!
//! With 256-bit vectors the stored order needs no reordering of the input: 32 nibble bytes of a
//! Q4_K block hold one sub-block of 32 values in their low nibbles and the next in their high
//! ones, and 32 consecutive Q6_K values span two sub-blocks of 16, each half of a `maddubs`'s
//! 16 pair sums one of them. Each sub-block's scale is applied in i16 (`madd`), as ggml's AVX2
//! dot products do.

#[cfg(target_arch = "x86_64")]
use super::{FAR, MAX_ROWS, PREFETCH, Q4K_BYTES, Q6K_BYTES, Q8K_BYTES, QK};

#[cfg(target_arch = "x86_64")]
use crate::avx2::hsum;

/// The 6-bit scales (low u64) and mins (high u64) of a Q4_K block's 8 sub-blocks, one byte
/// each, from its 12 scale bytes read as three little-endian u32 (ggml's packing: bytes 0-3 hold
/// scales 0-3 and bytes 4-7 mins 0-3 in their low 6 bits, their top 2 bits the high bits of
/// scales / mins 4-7, whose low 4 bits are the nibbles of bytes 8-11). `q4k_head!` calls it for
/// the AVX-512 and the AVX2 row kernels alike.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) fn scales_mins(a: [u32; 3]) -> (u64, u64) {
    const SIX: u32 = 0x3f3f_3f3f;
    const FOUR: u32 = 0x0f0f_0f0f;
    const TWO: u32 = 0x0303_0303;
    let sc_lo = a[0] & SIX;
    let mn_lo = a[1] & SIX;
    let sc_hi = (a[2] & FOUR) | (((a[0] >> 6) & TWO) << 4);
    let mn_hi = ((a[2] >> 4) & FOUR) | (((a[1] >> 6) & TWO) << 4);
    (sc_lo as u64 | (sc_hi as u64) << 32, mn_lo as u64 | (mn_hi as u64) << 32)
}

/// `shuffle_epi8` masks that broadcast i16 lane `s` of a 128-bit lane to all eight of its i16
/// lanes (the scale of Q4_K sub-block `s`).
#[cfg(target_arch = "x86_64")]
const fn broadcast16(s: u8) -> [u8; 32] {
    let mut m = [0u8; 32];
    let mut i = 0;
    while i < 32 {
        m[i] = 2 * s + (i % 2) as u8;
        i += 1;
    }
    m
}
#[cfg(target_arch = "x86_64")]
const Q4K_SCALE_PICKS: [[u8; 32]; 8] = {
    let mut p = [[0u8; 32]; 8];
    let mut s = 0;
    while s < 8 {
        p[s] = broadcast16(s as u8);
        s += 1;
    }
    p
};

/// `shuffle_epi8` masks on a block's 16 i8 scales: for the 32 values 32v..32v + 32 (v = 0..8),
/// eight copies of scale 2v then eight of scale 2v + 1 (sign-extended to i16 afterwards).
#[cfg(target_arch = "x86_64")]
const Q6K_SCALE_PICKS: [[u8; 16]; 8] = {
    let mut p = [[0u8; 16]; 8];
    let mut v = 0;
    while v < 8 {
        let mut i = 0;
        while i < 16 {
            p[v][i] = (2 * v + i / 8) as u8;
            i += 1;
        }
        v += 1;
    }
    p
};

/// One Q4_K weight row (kb blocks at `w`) dotted with M Q8_K rows (M * kb blocks at `q8`, their
/// values in natural order; `pairs` holds each block's 8 sub-block sums, an `Input`'s `pairs`).
/// Per block and input row: eight `maddubs` (a nibble vector of one sub-block against its 32
/// input values), each scaled in i16 by its sub-block's scale (`madd`), summed in i32, converted
/// once and scaled by d x the input's d; less dmin x the mins against the sub-block sums.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `w` is readable for `kb` Q4_K blocks, `q8` for M x kb Q8_K
/// blocks and `pairs` for their 8 sums each.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn row_dots_avx2<const M: usize>(
    w: *const u8,
    kb: usize,
    q8: *const u8,
    pairs: *const i16,
    dots: &mut [f32; MAX_ROWS],
) {
    // SAFETY: the operations below need no more than this function's `# Safety` contract.
    unsafe {
        use std::arch::x86_64::*;
        let low = _mm256_set1_epi8(0x0f);
        let picks: [__m256i; 8] =
            std::array::from_fn(|s| _mm256_loadu_si256(Q4K_SCALE_PICKS[s].as_ptr() as *const __m256i));
        let mut acc = [_mm256_setzero_ps(); M];
        for b in 0..kb {
            let blk = w.add(b * Q4K_BYTES);
            let (d, dmin, sc, mn) = q4k_head!(blk);
            let sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(sc as i64)));
            let mn16 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(mn as i64));
            let mut sum = [_mm256_setzero_si256(); M];
            for c in 0..4 {
                let bytes = _mm256_loadu_si256(blk.add(16 + 32 * c) as *const __m256i);
                let lo = _mm256_and_si256(bytes, low);
                let hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
                let (s_lo, s_hi) =
                    (_mm256_shuffle_epi8(sc16, picks[2 * c]), _mm256_shuffle_epi8(sc16, picks[2 * c + 1]));
                for (r, sum) in sum.iter_mut().enumerate() {
                    let yq = q8.add((r * kb + b) * Q8K_BYTES + 4 + 64 * c);
                    let p_lo = _mm256_maddubs_epi16(lo, _mm256_loadu_si256(yq as *const __m256i));
                    let p_hi = _mm256_maddubs_epi16(hi, _mm256_loadu_si256(yq.add(32) as *const __m256i));
                    let p = _mm256_add_epi32(_mm256_madd_epi16(p_lo, s_lo), _mm256_madd_epi16(p_hi, s_hi));
                    *sum = _mm256_add_epi32(*sum, p);
                }
            }
            for (r, acc) in acc.iter_mut().enumerate() {
                let i = r * kb + b;
                let yd = std::ptr::read_unaligned(q8.add(i * Q8K_BYTES) as *const f32);
                *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r]), _mm256_set1_ps(d * yd), *acc);
                let p = _mm_loadu_si128(pairs.add(i * 8) as *const __m128i);
                let m = _mm256_zextps128_ps256(_mm_cvtepi32_ps(_mm_madd_epi16(mn16, p)));
                *acc = _mm256_fnmadd_ps(m, _mm256_set1_ps(dmin * yd), *acc);
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            dots[r] = hsum(*acc);
        }
    }
}

/// One Q6_K weight row (kb blocks at `w`) dotted with M Q8_K rows (M * kb blocks at `q8`). Per
/// block and input row: eight `maddubs` of 32 six-bit quants (0..64) with their input values,
/// each half scaled in i16 by its sub-block's scale, summed in i32 with the quants' offset of 32
/// taken off in i32 (32 x the scales against the input's 16-value sums), converted once and
/// scaled by d x the input's d.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `w` is readable for `kb` Q6_K blocks and `q8` for M x kb Q8_K
/// blocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q6k_dots_avx2<const M: usize>(w: *const u8, kb: usize, q8: *const u8, dots: &mut [f32; MAX_ROWS]) {
    // SAFETY: the operations below need no more than this function's `# Safety` contract.
    unsafe {
        use std::arch::x86_64::*;
        let low = _mm256_set1_epi8(0x0f);
        let pair = _mm256_set1_epi8(0x30);
        let picks: [__m128i; 8] =
            std::array::from_fn(|v| _mm_loadu_si128(Q6K_SCALE_PICKS[v].as_ptr() as *const __m128i));
        let mut acc = [_mm256_setzero_ps(); M];
        for b in 0..kb {
            let blk = w.add(b * Q6K_BYTES);
            for line in 0..4 {
                _mm_prefetch::<_MM_HINT_T0>(blk.wrapping_add(PREFETCH + 64 * line) as *const i8);
                _mm_prefetch::<_MM_HINT_T1>(blk.wrapping_add(FAR + 64 * line) as *const i8);
            }
            let (ql, qh, scales) = (blk, blk.add(128), blk.add(192));
            let d = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(
                std::ptr::read_unaligned(blk.add(208) as *const u16) as i32,
            )));
            let sc8 = _mm_loadu_si128(scales as *const __m128i);
            // The quants' offset: 32 x each scale against the input's matching 16-value sum.
            let sc16 = _mm256_cvtepi8_epi16(sc8);
            let mut sum = [_mm256_setzero_si256(); M];
            for (r, sum) in sum.iter_mut().enumerate() {
                let bsums = _mm256_loadu_si256(q8.add((r * kb + b) * Q8K_BYTES + 4 + QK) as *const __m256i);
                *sum = _mm256_sub_epi32(*sum, _mm256_slli_epi32(_mm256_madd_epi16(sc16, bsums), 5));
            }
            for h in 0..2 {
                // Values 128h + 32j.. (j = 0..4): low nibbles of low bytes 64h.. and 64h + 32..,
                // then their high nibbles, each with its pair of bits from pair bytes 32h..
                let q0 = _mm256_loadu_si256(ql.add(64 * h) as *const __m256i);
                let q1 = _mm256_loadu_si256(ql.add(64 * h + 32) as *const __m256i);
                let hb = _mm256_loadu_si256(qh.add(32 * h) as *const __m256i);
                let v = [
                    _mm256_or_si256(_mm256_and_si256(q0, low), _mm256_and_si256(_mm256_slli_epi16(hb, 4), pair)),
                    _mm256_or_si256(_mm256_and_si256(q1, low), _mm256_and_si256(_mm256_slli_epi16(hb, 2), pair)),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q0, 4), low), _mm256_and_si256(hb, pair)),
                    _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16(q1, 4), low),
                        _mm256_and_si256(_mm256_srli_epi16(hb, 2), pair),
                    ),
                ];
                for (j, &v) in v.iter().enumerate() {
                    let at = 4 * h + j;
                    let scale = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc8, picks[at]));
                    for (r, sum) in sum.iter_mut().enumerate() {
                        let yq = q8.add((r * kb + b) * Q8K_BYTES + 4 + 32 * at);
                        let p = _mm256_maddubs_epi16(v, _mm256_loadu_si256(yq as *const __m256i));
                        *sum = _mm256_add_epi32(*sum, _mm256_madd_epi16(p, scale));
                    }
                }
            }
            for (r, acc) in acc.iter_mut().enumerate() {
                let yd = std::ptr::read_unaligned(q8.add((r * kb + b) * Q8K_BYTES) as *const f32);
                *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r]), _mm256_set1_ps(d * yd), *acc);
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            dots[r] = hsum(*acc);
        }
    }
}
