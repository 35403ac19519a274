//! `quant`'s Q4_K search with AVX2 intrinsics (its child), for CPUs without AVX-512: four
//! super-blocks at a time, a sub-block a lane, four registers of 8 lanes; the masks are vectors.
//! Every lane performs the float operations of `make_qkx1_quants_lanes` in their order (the same
//! transformations as `quant_avx512`: the rounding on the clamped value in f32, the levels in f32,
//! an exact FMA for the sums of their squares), so the bytes are candle's; the packing is the
//! portable `pack_block`.

use std::arch::x86_64::*;

use super::{pack_block, LANES, Q4K_BLOCK_BYTES, QK_K};

/// Super-blocks a call.
pub(super) const BLOCKS: usize = 4;
/// Registers of 8 lanes: the `BLOCKS * 8` sub-blocks.
const REGS: usize = BLOCKS * LANES / 8;
/// Values per sub-block.
const N: usize = 32;

/// `BLOCKS` super-blocks into their bytes.
///
/// # Safety
/// The CPU has AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn q4k_blocks(x: &[[f32; QK_K]; BLOCKS], out: [&mut [u8; Q4K_BLOCK_BYTES]; BLOCKS]) {
    let (scales, mins) = search(x);
    for (b, o) in out.into_iter().enumerate() {
        let pick = |v: &[f32; BLOCKS * LANES]| -> [f32; LANES] { std::array::from_fn(|j| v[b * LANES + j]) };
        pack_block(&x[b], &pick(&scales), &pick(&mins), o);
    }
}

/// `make_qkx1_quants_lanes::<32>(15, 5, x)`: (scale, -min) of each sub-block, lane `8b + j`
/// sub-block j of `x[b]`.
#[target_feature(enable = "avx2,fma")]
fn search(x: &[[f32; QK_K]; BLOCKS]) -> ([f32; BLOCKS * LANES], [f32; BLOCKS * LANES]) {
    let base = x.as_ptr() as *const f32;
    // Register k is super-block k: lane m its sub-block m, whose value i is at 256 k + 32 m + i.
    let mut xt = [[_mm256_setzero_ps(); REGS]; N];
    for k in 0..REGS {
        for h in 0..N / 8 {
            // SAFETY: 256 k + 32 m + 8 h + 8 <= 1024 = BLOCKS * QK_K.
            let rows = std::array::from_fn(|m| unsafe { _mm256_loadu_ps(base.add(256 * k + 32 * m + 8 * h)) });
            for (row, v) in xt[8 * h..].iter_mut().zip(transpose8(rows)) {
                row[k] = v;
            }
        }
    }
    let (zero, one, half, fifteen) =
        (_mm256_setzero_ps(), _mm256_set1_ps(1.0), _mm256_set1_ps(0.5), _mm256_set1_ps(15.0));
    let (mut lo, mut hi) = (xt[0], xt[0]);
    for row in &xt[1..] {
        for k in 0..REGS {
            // `if v < lo { v } else { lo }` and `if v > hi { v } else { hi }`.
            lo[k] = _mm256_min_ps(row[k], lo[k]);
            hi[k] = _mm256_max_ps(row[k], hi[k]);
        }
    }
    // candle returns (0, 0) where hi == lo; those lanes never search (all-ones lanes: active).
    let mut active: [__m256; REGS] = std::array::from_fn(|k| _mm256_cmp_ps::<_CMP_NEQ_UQ>(hi[k], lo[k]));
    let mut min: [__m256; REGS] = std::array::from_fn(|k| _mm256_and_ps(active[k], _mm256_min_ps(lo[k], zero)));
    let mut iscale: [__m256; REGS] =
        std::array::from_fn(|k| _mm256_and_ps(active[k], _mm256_div_ps(fifteen, _mm256_sub_ps(hi[k], min[k]))));
    let mut scale = [zero; REGS];
    let mut l = [[zero; REGS]; N];
    for _ in 0..5 {
        if active.iter().all(|&a| _mm256_movemask_ps(a) == 0) {
            break;
        }
        let (mut sumlx, mut suml2, mut changed) = ([zero; REGS], [zero; REGS], [zero; REGS]);
        for (row, li) in xt.iter().zip(l.iter_mut()) {
            for k in 0..REGS {
                let d = _mm256_sub_ps(row[k], min[k]);
                // nearest_int(iscale * d).clamp(0, 15), as in `quant_avx512`.
                let c = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(iscale[k], d), zero), fifteen);
                let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(c);
                let up = _mm256_cmp_ps::<_CMP_GE_OQ>(_mm256_sub_ps(c, t), half);
                let lf = _mm256_add_ps(t, _mm256_and_ps(up, one));
                changed[k] = _mm256_or_ps(changed[k], _mm256_cmp_ps::<_CMP_NEQ_OQ>(lf, li[k]));
                li[k] = lf;
                sumlx[k] = _mm256_add_ps(sumlx[k], _mm256_mul_ps(d, lf));
                suml2[k] = _mm256_fmadd_ps(lf, lf, suml2[k]);
            }
        }
        let new_scale: [__m256; REGS] = std::array::from_fn(|k| _mm256_div_ps(sumlx[k], suml2[k]));
        let mut sum = [zero; REGS];
        for (row, li) in xt.iter().zip(&l) {
            for k in 0..REGS {
                sum[k] = _mm256_add_ps(sum[k], _mm256_sub_ps(row[k], _mm256_mul_ps(new_scale[k], li[k])));
            }
        }
        for k in 0..REGS {
            let a = active[k];
            scale[k] = _mm256_blendv_ps(scale[k], new_scale[k], a);
            let m = _mm256_div_ps(sum[k], _mm256_set1_ps(N as f32));
            // `if m > 0.0 { m = 0.0 }` (a NaN stays).
            let m = _mm256_blendv_ps(m, zero, _mm256_cmp_ps::<_CMP_GT_OQ>(m, zero));
            min[k] = _mm256_blendv_ps(min[k], m, a);
            iscale[k] = _mm256_blendv_ps(iscale[k], _mm256_div_ps(one, new_scale[k]), a);
            active[k] = _mm256_and_ps(a, changed[k]);
        }
    }
    let (mut scales, mut neg_mins) = ([0f32; BLOCKS * LANES], [0f32; BLOCKS * LANES]);
    for k in 0..REGS {
        // -min, and 0 where both are zero.
        let zeros =
            _mm256_and_ps(_mm256_cmp_ps::<_CMP_EQ_OQ>(scale[k], zero), _mm256_cmp_ps::<_CMP_EQ_OQ>(min[k], zero));
        let neg = _mm256_xor_ps(min[k], _mm256_set1_ps(-0.0));
        // SAFETY: 8 lanes at 8k of 32.
        unsafe {
            _mm256_storeu_ps(scales.as_mut_ptr().add(8 * k), scale[k]);
            _mm256_storeu_ps(neg_mins.as_mut_ptr().add(8 * k), _mm256_blendv_ps(neg, zero, zeros));
        }
    }
    (scales, neg_mins)
}

/// `out[c]`'s lane r is `rows[r]`'s lane c.
#[target_feature(enable = "avx2")]
fn transpose8(r: [__m256; 8]) -> [__m256; 8] {
    // Within 128-bit lanes: pairs of rows interleaved, then 4 rows a lane's column.
    let t: [__m256; 8] = std::array::from_fn(|j| {
        let (a, b) = (r[j & !1], r[j | 1]);
        if j % 2 == 0 {
            _mm256_unpacklo_ps(a, b)
        } else {
            _mm256_unpackhi_ps(a, b)
        }
    });
    // u[4i + c], 128-bit lane L: rows 4i..4i + 4 at column 4L + c.
    let u: [__m256; 8] = std::array::from_fn(|j| {
        let (i, c) = (j / 4, j % 4);
        let (a, b) = (_mm256_castps_pd(t[4 * i + c / 2]), _mm256_castps_pd(t[4 * i + 2 + c / 2]));
        _mm256_castpd_ps(if c % 2 == 0 { _mm256_unpacklo_pd(a, b) } else { _mm256_unpackhi_pd(a, b) })
    });
    // The low lanes of rows 0..4 and 4..8 make columns 0..4, the high lanes columns 4..8.
    std::array::from_fn(|c| {
        if c < 4 {
            _mm256_permute2f128_ps::<0x20>(u[c], u[4 + c])
        } else {
            _mm256_permute2f128_ps::<0x31>(u[c - 4], u[c])
        }
    })
}
