//! The AVX512-VNNI kernels of `stored` and the reorder of their inputs (its child: `q4k_block!`
//! and `q6k_block!` come from there): the layout where each i32 lane of a `vpdpbusd` sum holds
//! one sub-block, and the Q4_K and Q6_K products of two weight rows at once on it.

use super::QK;
#[cfg(target_arch = "x86_64")]
use super::{FAR, MAX_ROWS, PREFETCH, Q4K_BYTES, Q6K_BYTES};

/// The VNNI kernels' layout of a block's 256 products: four 64-byte vectors T_c (c = 0..4),
/// each i32 lane of which holds 4 values of one sub-block, the same sub-block in all four, so one
/// lane's `vpdpbusd` sums over the four make a sub-block's partial sum, scaled per lane once a
/// block (`row_dots_vnni`, `q6k_dots_vnni`). The weight's vectors as unpacked, S_k (k = 0..4),
/// go through a 4 x 4 transpose of i32 within each 128-bit lane (`transpose4!`): T_c's lane
/// 4i + k is S_k's lane 4i + c. `vnni_order(q6)[o]` is the value (0..256 in the block) the
/// input byte o (= 64c + 4 lane + t) must hold to meet the weight's byte there.
/// - Q4_K: S_0..S_4 are the low and high nibbles of nibble bytes 0..64, then of 64..128 (the
///   block's bytes 16.. past d, dmin and the scales); nibble byte b's low nibble is value
///   64 (b / 32) + b % 32, its high nibble 32 more.
/// - Q6_K: S_k is values 64k..64k + 64 in order (`q6k_block!`).
const fn vnni_order(q6: bool) -> [u8; QK] {
    let mut order = [0u8; QK];
    let mut o = 0;
    while o < QK {
        let (c, lane, t) = (o / 64, (o % 64) / 4, o % 4);
        let (i, k) = (lane / 4, lane % 4);
        // Byte p of S_k.
        let p = 16 * i + 4 * c + t;
        order[o] = if q6 {
            64 * k + p
        } else {
            let b = 64 * (k / 2) + p;
            64 * (b / 32) + 32 * (k % 2) + b % 32
        } as u8;
        o += 1;
    }
    order
}
pub(super) const Q4K_VNNI_ORDER: [u8; QK] = vnni_order(false);
pub(super) const Q6K_VNNI_ORDER: [u8; QK] = vnni_order(true);

/// The sub-block each i32 lane of the VNNI layout sums (32 values a sub-block for Q4_K, 16 for
/// Q6_K), as `vpermd` indices into the block's scales.
const fn lane_subblocks(q6: bool) -> [i32; 16] {
    let order = vnni_order(q6);
    let mut lanes = [0i32; 16];
    let mut l = 0;
    while l < 16 {
        lanes[l] = (order[4 * l] as usize / if q6 { 16 } else { 32 }) as i32;
        l += 1;
    }
    lanes
}
/// The sub-blocks of a Q4_K block in the order `row_dots_vnni` sums them once a block's 16 lanes
/// are folded to 8 (lane l added to lane l + 4, which sums the same sub-block: see
/// `vnni_order`): folded lane i (< 4) is lane i's sub-block, lane 4 + i lane 8 + i's.
pub(super) const Q4K_FOLDED: [usize; 8] = {
    let lanes = lane_subblocks(false);
    let mut folded = [0usize; 8];
    let mut i = 0;
    while i < 4 {
        assert!(lanes[i] == lanes[i + 4] && lanes[i + 8] == lanes[i + 12]);
        folded[i] = lanes[i] as usize;
        folded[4 + i] = lanes[i + 8] as usize;
        i += 1;
    }
    folded
};
/// `vpshufb` controls and masks that decode a Q4_K block's packed 6-bit scales and mins (its
/// bytes 4..16; `scales_mins` is the scalar form) within one 128-bit lane holding the block's
/// first 16 bytes: output byte i < 8 is the scale of sub-block `Q4K_FOLDED[i]`, byte 8 + i its
/// min. Sub-block j < 4 keeps the low 6 bits of one byte (`LOW`); j >= 4 joins a nibble (the low
/// one for scales, the high one for mins: `HIGH_NIBBLE`) with the top 2 bits of another byte
/// (`TOP`, moved to bits 4-5).
#[derive(Clone, Copy)]
struct ScaleDecode {
    /// The byte whose low bits (or high nibble) each output byte takes.
    low_src: [u8; 16],
    /// The byte whose top 2 bits each output byte takes (0x80: none, `vpshufb` zeroes it).
    top_src: [u8; 16],
    /// Per output byte, the mask of the low source's bits kept in place.
    low_mask: [u8; 16],
    /// Per output byte, the mask of the low source's high nibble moved down (mins of j >= 4).
    high_nibble: [u8; 16],
}
const Q4K_SCALE_DECODE: ScaleDecode = {
    let mut d = ScaleDecode { low_src: [0; 16], top_src: [0x80; 16], low_mask: [0; 16], high_nibble: [0; 16] };
    let mut i = 0;
    while i < 16 {
        let (min, j) = (i >= 8, Q4K_FOLDED[i % 8] as u8);
        // Offsets into the block: the packed bytes q[0..12] start at 4.
        if j < 4 {
            d.low_src[i] = if min { 8 + j } else { 4 + j };
            d.low_mask[i] = 0x3f;
        } else {
            d.low_src[i] = 8 + j;
            d.top_src[i] = if min { 4 + j } else { j };
            if min {
                d.high_nibble[i] = 0x0f;
            } else {
                d.low_mask[i] = 0x0f;
            }
        }
        i += 1;
    }
    d
};
pub(super) const Q6K_LANE_SUBBLOCK: [i32; 16] = lane_subblocks(true);

/// Each Q8_K block's 256 values (of `bytes`, whole blocks) into `out` (256 a block) in
/// `order`: `out[o] = values[order[o]]`. With AVX512-VBMI, four byte permutes of two tables
/// each a block (`reorder_vbmi`); else byte by byte.
pub(super) fn reorder_blocks(order: &[u8; QK], bytes: &[u8], out: &mut [i8]) {
    #[cfg(target_arch = "x86_64")]
    if super::kernel() == Some(super::Kernel::Vnni) && vbmi() {
        // SAFETY: the CPU has AVX-512 F/BW (the VNNI kernel's check) and VBMI (checked above);
        // the function reads whole blocks of `bytes` and writes as many of `out`.
        unsafe { reorder_vbmi(order, bytes, out) };
        return;
    }
    reorder_scalar(order, bytes, out);
}

/// `reorder_blocks` byte by byte.
pub(super) fn reorder_scalar(order: &[u8; QK], bytes: &[u8], out: &mut [i8]) {
    for (blk, to) in bytes.chunks_exact(super::Q8K_BYTES).zip(out.chunks_exact_mut(QK)) {
        // A u8 index into 256 values: no bounds checks in the loop.
        let values: &[u8; QK] = blk[4..4 + QK].try_into().expect("a Q8_K block holds 256 values");
        for (o, &v) in to.iter_mut().zip(order) {
            *o = values[v as usize] as i8;
        }
    }
}

/// Whether this CPU has AVX512-VBMI (byte permutes), asked once.
#[cfg(target_arch = "x86_64")]
fn vbmi() -> bool {
    static VBMI: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *VBMI.get_or_init(|| is_x86_feature_detected!("avx512vbmi"))
}

/// `reorder_blocks` with AVX512-VBMI: each output vector of 64 bytes is two
/// two-table byte permutes (`vpermt2b`: values 0-127 and 128-255 by the index's low 7 bits)
/// blended by the index's top bit.
///
/// # Safety
/// The CPU has AVX-512 F/BW and VBMI. Reads the whole Q8_K blocks of `bytes` (`Q8K_BYTES` each)
/// and writes 256 bytes a block of `out`, as far as both reach.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
pub(super) unsafe fn reorder_vbmi(order: &[u8; QK], bytes: &[u8], out: &mut [i8]) {
    // SAFETY: the operations below need no more than this function's `# Safety` contract: each
    // block's values are bytes 4..260 of its Q8K_BYTES, and each output block is 256 bytes.
    unsafe {
        use std::arch::x86_64::*;
        let mut idx = [_mm512_setzero_si512(); 4];
        let mut high = [0u64; 4];
        for c in 0..4 {
            idx[c] = _mm512_loadu_si512(order.as_ptr().add(64 * c) as *const __m512i);
            high[c] = _mm512_movepi8_mask(idx[c]);
        }
        for (blk, to) in bytes.chunks_exact(super::Q8K_BYTES).zip(out.chunks_exact_mut(QK)) {
            let v = blk.as_ptr().add(4);
            let t: [__m512i; 4] = std::array::from_fn(|i| _mm512_loadu_si512(v.add(64 * i) as *const __m512i));
            for c in 0..4 {
                let lo = _mm512_permutex2var_epi8(t[0], idx[c], t[1]);
                let hi = _mm512_permutex2var_epi8(t[2], idx[c], t[3]);
                _mm512_storeu_si512(
                    to.as_mut_ptr().add(64 * c) as *mut __m512i,
                    _mm512_mask_blend_epi8(high[c], lo, hi),
                );
            }
        }
    }
}

/// The 4 x 4 transpose of i32 within each 128-bit lane of four vectors: out[c]'s lane 4i + k is
/// in[k]'s lane 4i + c (see `vnni_order`). A macro for the callers' `#[target_feature]` code.
macro_rules! transpose4 {
    ($s:expr) => {{
        let s: [__m512i; 4] = $s;
        let t0 = _mm512_unpacklo_epi32(s[0], s[1]);
        let t1 = _mm512_unpackhi_epi32(s[0], s[1]);
        let t2 = _mm512_unpacklo_epi32(s[2], s[3]);
        let t3 = _mm512_unpackhi_epi32(s[2], s[3]);
        [
            _mm512_unpacklo_epi64(t0, t2),
            _mm512_unpackhi_epi64(t0, t2),
            _mm512_unpacklo_epi64(t1, t3),
            _mm512_unpackhi_epi64(t1, t3),
        ]
    }};
}

/// The i32 sums of one input block (256 bytes at `yq`, in `vnni_order`) with the four vectors
/// of each of two weight blocks (`q`, `[[__m512i; 4]; 2]`): four `vpdpbusd` chained per weight
/// row, each input vector loaded once for both. A macro for the callers' `#[target_feature]` code.
macro_rules! dots_pair {
    ($q:expr, $yq:expr) => {{
        let (q, yq): (&[[__m512i; 4]; 2], *const i8) = (&$q, $yq);
        let mut sum = [_mm512_setzero_si512(); 2];
        for (c, (&a, &b)) in q[0].iter().zip(&q[1]).enumerate() {
            let y = _mm512_loadu_si512(yq.add(64 * c) as *const __m512i);
            sum[0] = _mm512_dpbusd_epi32(sum[0], a, y);
            sum[1] = _mm512_dpbusd_epi32(sum[1], b, y);
        }
        sum
    }};
}

/// Two Q4_K blocks' (at `b0` and `b1`) 8 scales and 8 mins in `Q4K_FOLDED` order as f32, times
/// their d and dmin: the first block's in lanes 0-7, the second's in 8-15 (`Q4K_SCALE_DECODE`;
/// `scales_mins` is the scalar form).
///
/// # Safety
/// The CPU has AVX-512 F and BW (with AVX2 and F16C); 16 bytes are readable at `b0` and at `b1`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx2,f16c")]
#[inline]
pub(super) unsafe fn q4k_pair_scales(
    b0: *const u8,
    b1: *const u8,
) -> (std::arch::x86_64::__m512, std::arch::x86_64::__m512) {
    // SAFETY: the operations below need no more than this function's `# Safety` contract.
    unsafe {
        use std::arch::x86_64::*;
        let dec = Q4K_SCALE_DECODE;
        let twice = |b: [u8; 16]| _mm256_broadcastsi128_si256(_mm_loadu_si128(b.as_ptr() as *const __m128i));
        let x = _mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128(b0 as *const __m128i)),
            _mm_loadu_si128(b1 as *const __m128i),
            1,
        );
        let a = _mm256_shuffle_epi8(x, twice(dec.low_src));
        let t = _mm256_shuffle_epi8(x, twice(dec.top_src));
        let bytes = _mm256_or_si256(
            _mm256_or_si256(
                _mm256_and_si256(a, twice(dec.low_mask)),
                _mm256_and_si256(_mm256_srli_epi16(a, 4), twice(dec.high_nibble)),
            ),
            _mm256_and_si256(_mm256_srli_epi16(t, 2), _mm256_set1_epi8(0x30)),
        );
        // 64-bit quarters: scales 0, mins 0, scales 1, mins 1 -> scales 0 and 1, mins 0 and 1.
        let bytes = _mm256_permute4x64_epi64(bytes, 0xd8);
        let sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(bytes)));
        let mn = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(bytes, 1)));
        // d, dmin of the first block, then of the second, as f32.
        let halves = _mm_unpacklo_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
        let dd = _mm512_castps128_ps512(_mm_cvtph_ps(halves));
        let d_lanes = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
        let dmin_lanes = _mm512_setr_epi32(1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3);
        (
            _mm512_mul_ps(_mm512_permutexvar_ps(d_lanes, dd), sc),
            _mm512_mul_ps(_mm512_permutexvar_ps(dmin_lanes, dd), mn),
        )
    }
}

/// `row_dots` for two weight rows at once with AVX512-VNNI, on the layout of `vnni_order`: per
/// block, weight row and input row, four `vpdpbusd` chained into one vector whose lanes each sum
/// 16 values of one sub-block (at most 16 x 15 x 128). The two weight rows' vectors are folded
/// into one (each lane added to the lane of the same sub-block: `Q4K_FOLDED`, 8 lanes a weight
/// row, exact in i32), converted once and scaled per lane by d x the sub-block's scale x the
/// input's block scale, less dmin x the sub-block's min x the input's sum of the sub-block
/// (`Input::folded_sums`, 8 a block, read into both halves): one conversion and three float
/// operations per input row and block for both weight rows. Each load of the input meets both weight rows, and a weight row's lanes are
/// its own whichever row it is paired with. `row_dots` instead scales each pair of sub-blocks in
/// i16 (`maddubs` + `madd` per 64 products), and its sums are grouped otherwise: a machine uses one
/// kernel or the other for every row count, so each row stays bit for bit its product alone.
///
/// # Safety
/// As for `row_dots` for each of `w`, with `scales`, `re` (`Q4K_VNNI_ORDER`) and `sums` an
/// `Input`'s `scales`, `reordered` and `folded_sums` for its M x kb blocks, and the CPU has
/// AVX512-VNNI.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn row_dots_vnni<const M: usize>(
    w: [*const u8; 2],
    kb: usize,
    scales: *const f32,
    re: *const i8,
    sums: *const f32,
    dots: &mut [[f32; MAX_ROWS]; 2],
) {
    // SAFETY: the operations below need no more than this function's `# Safety` contract.
    unsafe {
        use std::arch::x86_64::*;
        let low = _mm512_set1_epi8(0x0f);
        // Per input row, both weight rows' sums (lanes 0-7 and 8-15).
        let mut acc = [_mm512_setzero_ps(); M];
        for b in 0..kb {
            let mut q = [[_mm512_setzero_si512(); 4]; 2];
            for j in 0..2 {
                let blk = w[j].add(b * Q4K_BYTES);
                q4k_prefetch!(blk);
                let mut q4 = [_mm512_setzero_si512(); 4];
                for p in 0..2 {
                    let bytes = _mm512_loadu_si512(blk.add(16 + 64 * p) as *const __m512i);
                    q4[2 * p] = _mm512_and_si512(bytes, low);
                    q4[2 * p + 1] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low);
                }
                q[j] = transpose4!(q4);
            }
            let (dsc, dmn) = q4k_pair_scales(w[0].add(b * Q4K_BYTES), w[1].add(b * Q4K_BYTES));
            for (r, acc) in acc.iter_mut().enumerate() {
                let i = r * kb + b;
                let yd = _mm512_set1_ps(*scales.add(i));
                let yq = re.add(i * QK);
                let ys = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_loadu_pd(sums.add(i * 8) as *const f64)));
                let sum = dots_pair!(q, yq);
                // 128-bit lanes 0 + 1 and 2 + 3 of each weight row's sums.
                let (even, odd) =
                    (_mm512_shuffle_i32x4(sum[0], sum[1], 0x88), _mm512_shuffle_i32x4(sum[0], sum[1], 0xdd));
                let a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(even, odd)), _mm512_mul_ps(dsc, yd), *acc);
                *acc = _mm512_fnmadd_ps(dmn, ys, a);
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            let halves =
                [_mm512_castps512_ps256(*acc), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(*acc), 1))];
            for (j, h) in halves.into_iter().enumerate() {
                let x = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
                let x = _mm_add_ps(x, _mm_movehl_ps(x, x));
                dots[j][r] = _mm_cvtss_f32(_mm_add_ss(x, _mm_shuffle_ps(x, x, 1)));
            }
        }
    }
}

/// `q6k_dots` for two weight rows at once with AVX512-VNNI, on the layout of `vnni_order`: one
/// i32 lane a sub-block of 16 (four `vpdpbusd` chained, at most 16 x 63 x 128), converted once a
/// block and row, times the row's block scale, plus the row's offset term for the lane (an
/// `Input`'s `offsets6`, the block scale in it), then times d x the lane's scale. Each load of the
/// input meets both weight
/// rows. Grouped otherwise than `q6k_dots`: a machine uses one or the other for every row count.
///
/// # Safety
/// As for `q6k_dots` for each of `w`, with `scales` (an `Input`'s), `re` (`Q6K_VNNI_ORDER`) and
/// `offsets` (16 a block) readable for the M x kb blocks, and the CPU has AVX512-VNNI.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn q6k_dots_vnni<const M: usize>(
    w: [*const u8; 2],
    kb: usize,
    (scales, re, offsets): (*const f32, *const i8, *const f32),
    dots: &mut [[f32; MAX_ROWS]; 2],
) {
    // SAFETY: the operations below need no more than this function's `# Safety` contract.
    unsafe {
        use std::arch::x86_64::*;
        let lane_subblock = _mm512_loadu_si512(Q6K_LANE_SUBBLOCK.as_ptr() as *const __m512i);
        // Per input row, its two weight rows' accumulators.
        let mut acc = [[_mm512_setzero_ps(); 2]; M];
        for b in 0..kb {
            let mut q = [[_mm512_setzero_si512(); 4]; 2];
            let mut dsc = [_mm512_setzero_ps(); 2];
            for j in 0..2 {
                let (d, sc16, q6) = q6k_block!(w[j].add(b * Q6K_BYTES));
                q[j] = transpose4!(q6);
                let sc32 = _mm512_permutexvar_epi32(lane_subblock, _mm512_cvtepi16_epi32(sc16));
                dsc[j] = _mm512_mul_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(sc32));
            }
            for (r, acc) in acc.iter_mut().enumerate() {
                let i = r * kb + b;
                let yd = _mm512_set1_ps(*scales.add(i));
                let yq = re.add(i * QK);
                let off = _mm512_loadu_ps(offsets.add(i * 16));
                let sum = dots_pair!(q, yq);
                for j in 0..2 {
                    let t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[j]), yd, off);
                    acc[j] = _mm512_fmadd_ps(t, dsc[j], acc[j]);
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            for (j, &a) in acc.iter().enumerate() {
                dots[j][r] = _mm512_reduce_add_ps(a);
            }
        }
    }
}
