//! `quant`'s Q4_K search and packing written with AVX-512 intrinsics (its child): eight
//! super-blocks at a time, a sub-block a lane, four registers of 16 lanes. Every lane performs
//! the float operations of `make_qkx1_quants_lanes` and `pack_block` in their order, so the bytes
//! are those of candle's quantizer, as on every other path (`quant`'s tests compare them).
//!
//! What the compiler made of the portable loops spent about 24 vector operations a register on
//! each value of each try; here it is 15: the rounding works in f32 on the clamped value
//! (exact: a value in [0, 15] less its truncation, against one half), the levels stay f32 (the
//! sums of their squares are integers below 2^24, so an FMA is exact), and "changed" is a mask.

use std::arch::x86_64::*;

use half::{bf16, f16};

use super::{LANES, Q4K_BLOCK_BYTES, QK_K};

/// Super-blocks a call.
pub(super) const BLOCKS: usize = 8;
/// Registers of 16 lanes: the `BLOCKS * 8` sub-blocks.
const REGS: usize = BLOCKS * LANES / 16;
/// Values per sub-block.
const N: usize = 32;

/// The float formats a group is read from, 16 values widened to f32 at a time.
pub(super) trait Source {
    /// How many values there are.
    fn count(&self) -> usize;

    /// Values `at..at + 16`, widened exactly.
    ///
    /// # Safety
    /// The CPU has AVX-512 F; `at + 16 <= self.len()`.
    unsafe fn load16(&self, at: usize) -> __m512;
}

impl Source for [f32] {
    fn count(&self) -> usize {
        self.len()
    }

    #[inline(always)]
    unsafe fn load16(&self, at: usize) -> __m512 {
        debug_assert!(at + 16 <= self.len());
        // SAFETY: in bounds (the contract).
        unsafe { _mm512_loadu_ps(self.as_ptr().add(at)) }
    }
}

impl Source for [bf16] {
    fn count(&self) -> usize {
        self.len()
    }

    #[inline(always)]
    unsafe fn load16(&self, at: usize) -> __m512 {
        debug_assert!(at + 16 <= self.len());
        // SAFETY: in bounds (the contract); a bf16 is the top half of its f32.
        unsafe {
            let v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(self.as_ptr().add(at) as *const __m256i));
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(v))
        }
    }
}

impl Source for [f16] {
    fn count(&self) -> usize {
        self.len()
    }

    #[inline(always)]
    unsafe fn load16(&self, at: usize) -> __m512 {
        debug_assert!(at + 16 <= self.len());
        // SAFETY: in bounds (the contract); `vcvtph2ps` widens exactly.
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(self.as_ptr().add(at) as *const __m256i)) }
    }
}

/// `BLOCKS` super-blocks (`x`: `BLOCKS * QK_K` values, else it panics) into their bytes.
///
/// # Safety
/// The CPU has AVX-512 F.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn q4k_blocks<S: Source + ?Sized>(x: &S, out: [&mut [u8; Q4K_BLOCK_BYTES]; BLOCKS]) {
    assert_eq!(x.count(), BLOCKS * QK_K, "q4k_blocks: a group is {BLOCKS} super-blocks");
    // SAFETY: the CPU has AVX-512 F; x holds the group (checked above).
    let (scales, mins) = unsafe { search(x) };
    for (b, o) in out.into_iter().enumerate() {
        let pick = |v: &[f32; BLOCKS * LANES]| -> [f32; LANES] { std::array::from_fn(|j| v[b * LANES + j]) };
        // SAFETY: as above; super-block b is values 256 b..256 (b + 1) of the group.
        unsafe { pack(x, b * QK_K, &pick(&scales), &pick(&mins), o) };
    }
}

/// `make_qkx1_quants_lanes::<64>(15, 5, x)`: (scale, -min) of each sub-block, lane `8b + j`
/// sub-block j of `x[b]`.
///
/// # Safety
/// The CPU has AVX-512 F; `x` holds `BLOCKS * QK_K` values.
#[target_feature(enable = "avx512f")]
unsafe fn search<S: Source + ?Sized>(x: &S) -> ([f32; BLOCKS * LANES], [f32; BLOCKS * LANES]) {
    // Lane m of register k is sub-block 16k + m, whose value i is at 32 (16k + m) + i: two 16 x
    // 16 transposes a register.
    let mut xt = [[_mm512_setzero_ps(); REGS]; N];
    for k in 0..REGS {
        for h in 0..2 {
            // SAFETY: rows 16k..16k + 16 of 32 values (512 k + 32 m + 16 h + 16 <= 2048).
            let rows = std::array::from_fn(|m| unsafe { x.load16(512 * k + 32 * m + 16 * h) });
            for (row, v) in xt[16 * h..].iter_mut().zip(transpose16(rows)) {
                row[k] = v;
            }
        }
    }
    let (zero, one, half, fifteen) =
        (_mm512_setzero_ps(), _mm512_set1_ps(1.0), _mm512_set1_ps(0.5), _mm512_set1_ps(15.0));
    let (mut lo, mut hi) = (xt[0], xt[0]);
    for row in &xt[1..] {
        for k in 0..REGS {
            // `if v < lo { v } else { lo }` and `if v > hi { v } else { hi }`.
            lo[k] = _mm512_min_ps(row[k], lo[k]);
            hi[k] = _mm512_max_ps(row[k], hi[k]);
        }
    }
    // candle returns (0, 0) where hi == lo; those lanes never search.
    let mut active: [__mmask16; REGS] = std::array::from_fn(|k| _mm512_cmp_ps_mask::<_CMP_NEQ_UQ>(hi[k], lo[k]));
    let mut min: [__m512; REGS] = std::array::from_fn(|k| _mm512_maskz_mov_ps(active[k], _mm512_min_ps(lo[k], zero)));
    let mut iscale: [__m512; REGS] =
        std::array::from_fn(|k| _mm512_maskz_div_ps(active[k], fifteen, _mm512_sub_ps(hi[k], min[k])));
    let mut scale = [zero; REGS];
    let mut l = [[zero; REGS]; N];
    for _ in 0..5 {
        if active.iter().all(|&a| a == 0) {
            break;
        }
        let (mut sumlx, mut suml2, mut changed) = ([zero; REGS], [zero; REGS], [0 as __mmask16; REGS]);
        for (row, li) in xt.iter().zip(l.iter_mut()) {
            for k in 0..REGS {
                let d = _mm512_sub_ps(row[k], min[k]);
                // nearest_int(iscale * d).clamp(0, 15): clamped first (NaN to 0), then half away
                // from zero, which for [0, 15] is the truncation plus one where the exact
                // fraction is at least a half.
                let c = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(iscale[k], d), zero), fifteen);
                let t = _mm512_roundscale_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(c);
                let up = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(_mm512_sub_ps(c, t), half);
                let lf = _mm512_mask_add_ps(t, up, t, one);
                changed[k] |= _mm512_cmp_ps_mask::<_CMP_NEQ_OQ>(lf, li[k]);
                li[k] = lf;
                sumlx[k] = _mm512_add_ps(sumlx[k], _mm512_mul_ps(d, lf));
                suml2[k] = _mm512_fmadd_ps(lf, lf, suml2[k]);
            }
        }
        let new_scale: [__m512; REGS] = std::array::from_fn(|k| _mm512_div_ps(sumlx[k], suml2[k]));
        let mut sum = [zero; REGS];
        for (row, li) in xt.iter().zip(&l) {
            for k in 0..REGS {
                sum[k] = _mm512_add_ps(sum[k], _mm512_sub_ps(row[k], _mm512_mul_ps(new_scale[k], li[k])));
            }
        }
        for k in 0..REGS {
            let a = active[k];
            scale[k] = _mm512_mask_mov_ps(scale[k], a, new_scale[k]);
            let m = _mm512_div_ps(sum[k], _mm512_set1_ps(N as f32));
            // `if m > 0.0 { m = 0.0 }` (a NaN stays).
            let m = _mm512_mask_mov_ps(m, _mm512_cmp_ps_mask::<_CMP_GT_OQ>(m, zero), zero);
            min[k] = _mm512_mask_mov_ps(min[k], a, m);
            iscale[k] = _mm512_mask_div_ps(iscale[k], a, one, new_scale[k]);
            active[k] = a & changed[k];
        }
    }
    let (mut scales, mut neg_mins) = ([0f32; BLOCKS * LANES], [0f32; BLOCKS * LANES]);
    for k in 0..REGS {
        // -min, and 0 where both are zero.
        let zeros = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(scale[k], zero) & _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(min[k], zero);
        let neg = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(min[k]), _mm512_set1_epi32(i32::MIN)));
        // SAFETY: 16 lanes at 16k of 64.
        unsafe {
            _mm512_storeu_ps(scales.as_mut_ptr().add(16 * k), scale[k]);
            _mm512_storeu_ps(neg_mins.as_mut_ptr().add(16 * k), _mm512_mask_mov_ps(neg, zeros, zero));
        }
    }
    (scales, neg_mins)
}

/// `pack_block`: the scales as `scale_bytes` makes them, then each value's level
/// `round_clamp((x + dm) / dj, 15)` 16 at a time, two sub-blocks' levels a nibble byte; the
/// super-block's values at `x[at..at + QK_K]`.
///
/// # Safety
/// The CPU has AVX-512 F; `at + QK_K <= x.len()`.
#[target_feature(enable = "avx512f")]
unsafe fn pack<S: Source + ?Sized>(
    x: &S,
    at: usize,
    scales: &[f32; LANES],
    mins: &[f32; LANES],
    out: &mut [u8; Q4K_BLOCK_BYTES],
) {
    let (d16, dmin16, sc) = scale_bytes(scales, mins);
    let (d, dmin) = (d16.to_f32(), dmin16.to_f32());
    let (zero, one, half, fifteen) =
        (_mm512_setzero_ps(), _mm512_set1_ps(1.0), _mm512_set1_ps(0.5), _mm512_set1_ps(15.0));
    let mut level = [[_mm512_setzero_si512(); 2]; LANES];
    for (j, halves) in level.iter_mut().enumerate() {
        let (s, m) = super::get_scale_min_k4(j, &sc);
        let dj = d * s as f32;
        if dj == 0.0 {
            continue;
        }
        let (dm, dj) = (_mm512_set1_ps(dmin * m as f32), _mm512_set1_ps(dj));
        for (h, l) in halves.iter_mut().enumerate() {
            // SAFETY: 16 values at 32 j + 16 h of the super-block's 256.
            let v = unsafe { x.load16(at + 32 * j + 16 * h) };
            let c = _mm512_min_ps(_mm512_max_ps(_mm512_div_ps(_mm512_add_ps(v, dm), dj), zero), fifteen);
            let t = _mm512_roundscale_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(c);
            let up = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(_mm512_sub_ps(c, t), half);
            *l = _mm512_cvttps_epi32(_mm512_mask_add_ps(t, up, t, one));
        }
    }
    out[0..2].copy_from_slice(&d16.to_bits().to_le_bytes());
    out[2..4].copy_from_slice(&dmin16.to_bits().to_le_bytes());
    out[4..16].copy_from_slice(&sc);
    for (p, pair) in level.chunks_exact(2).enumerate() {
        for (h, (&lo, &hi)) in pair[0].iter().zip(&pair[1]).enumerate() {
            let byte = _mm512_or_si512(lo, _mm512_slli_epi32::<4>(hi));
            // SAFETY: 16 bytes at 16 + 32 p + 16 h of 144.
            unsafe {
                _mm_storeu_si128(out.as_mut_ptr().add(16 + 32 * p + 16 * h) as *mut __m128i, _mm512_cvtepi32_epi8(byte))
            };
        }
    }
}

/// `quant::scale_bytes` with the 16 roundings in one register: the scales and mins the search
/// gives are at least 0 or NaN, for which `nearest_int(v).min(63)` is the rounding of v clamped
/// to [0, 63] (NaN to 0); any other input takes the scalar code.
#[target_feature(enable = "avx512f")]
fn scale_bytes(scales: &[f32; LANES], mins: &[f32; LANES]) -> (f16, f16, [u8; 12]) {
    let max_scale = scales.iter().fold(0.0f32, |max, &v| v.max(max));
    let max_min = mins.iter().fold(0.0f32, |max, &v| v.max(max));
    let inv_scale = if max_scale > 0.0 { 63.0 / max_scale } else { 0.0 };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let mut both = [0f32; 16];
    for j in 0..LANES {
        both[j] = inv_scale * scales[j];
        both[LANES + j] = inv_min * mins[j];
    }
    // SAFETY: 16 values.
    let v = unsafe { _mm512_loadu_ps(both.as_ptr()) };
    if _mm512_cmp_ps_mask::<_CMP_LT_OQ>(v, _mm512_setzero_ps()) != 0 {
        return super::scale_bytes(scales, mins);
    }
    let c = _mm512_min_ps(_mm512_max_ps(v, _mm512_setzero_ps()), _mm512_set1_ps(63.0));
    let t = _mm512_roundscale_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(c);
    let up = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(_mm512_sub_ps(c, t), _mm512_set1_ps(0.5));
    let mut l = [0u8; 16];
    // SAFETY: 16 bytes.
    unsafe {
        _mm_storeu_si128(
            l.as_mut_ptr() as *mut __m128i,
            _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(_mm512_mask_add_ps(t, up, t, _mm512_set1_ps(1.0)))),
        )
    };
    let (ls, lm) = (std::array::from_fn(|j| l[j]), std::array::from_fn(|j| l[LANES + j]));
    (f16::from_f32(max_scale / 63.0), f16::from_f32(max_min / 63.0), super::scale_min_k4(&ls, &lm))
}

/// `out[c]`'s lane r is `rows[r]`'s lane c.
#[target_feature(enable = "avx512f")]
fn transpose16(r: [__m512; 16]) -> [__m512; 16] {
    // Within 128-bit lanes: pairs of rows interleaved, then 4 rows a lane's column.
    let t: [__m512; 16] = std::array::from_fn(|j| {
        let (a, b) = (r[j & !1], r[j | 1]);
        if j % 2 == 0 {
            _mm512_unpacklo_ps(a, b)
        } else {
            _mm512_unpackhi_ps(a, b)
        }
    });
    // u[4i + c], 128-bit lane L: rows 4i..4i + 4 at column 4L + c.
    let u: [__m512; 16] = std::array::from_fn(|j| {
        let (i, c) = (j / 4, j % 4);
        let (a, b) = (_mm512_castps_pd(t[4 * i + c / 2]), _mm512_castps_pd(t[4 * i + 2 + c / 2]));
        _mm512_castpd_ps(if c % 2 == 0 { _mm512_unpacklo_pd(a, b) } else { _mm512_unpackhi_pd(a, b) })
    });
    // Lanes gathered across the four groups of rows.
    let mut out = [_mm512_setzero_ps(); 16];
    for c in 0..4 {
        let v0 = _mm512_shuffle_f32x4::<0x88>(u[c], u[4 + c]);
        let w0 = _mm512_shuffle_f32x4::<0xdd>(u[c], u[4 + c]);
        let v1 = _mm512_shuffle_f32x4::<0x88>(u[8 + c], u[12 + c]);
        let w1 = _mm512_shuffle_f32x4::<0xdd>(u[8 + c], u[12 + c]);
        out[c] = _mm512_shuffle_f32x4::<0x88>(v0, v1);
        out[8 + c] = _mm512_shuffle_f32x4::<0xdd>(v0, v1);
        out[4 + c] = _mm512_shuffle_f32x4::<0x88>(w0, w1);
        out[12 + c] = _mm512_shuffle_f32x4::<0xdd>(w0, w1);
    }
    out
}
