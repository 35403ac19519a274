//! The one AVX2 inner loop that the panel linears (`panels`) and the attention strips
//! (`kernels`) share: `N` scalars broadcast against a 16-float row, accumulated over a loop; and
//! the lane-wise operations of the strips' softmax, named as in `avx512` so one strip template
//! (`kernels::strips`'s `strip_kernel!`) compiles for both.

use std::arch::x86_64::*;

/// One vector: 8 lanes of f32.
pub(crate) type V = __m256;
/// f32 lanes per vector.
pub(crate) const LANES: usize = 8;

/// `N` pairs of 8-lane accumulators: `N` rows of 16 floats.
pub(crate) type Acc<const N: usize> = [[V; 2]; N];

/// `acc[j] += b[i * b_step + j * b_stride] * a[i * a_step..][..16]` for `i` in `0..len`: each
/// step loads one 16-float row of `a` as two vectors and broadcasts `N` scalars of `b`, `2N`
/// fused multiply-adds (N = 6: 12 accumulators, what 16 AVX2 registers leave room for).
///
/// # Safety
/// AVX2 and FMA are present; every address read is inside its allocation.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn accumulate<const N: usize>(
    acc: &mut Acc<N>,
    len: usize,
    a: *const f32,
    a_step: usize,
    b: *const f32,
    b_step: usize,
    b_stride: usize,
) {
    // SAFETY: the operations below need no more than this function's `# Safety` contract.
    unsafe {
        let mut lo: [__m256; N] = std::array::from_fn(|j| acc[j][0]);
        let mut hi: [__m256; N] = std::array::from_fn(|j| acc[j][1]);
        // Unrolled by 4: a quarter of the loop's own adds and compares beside the FMAs.
        let (mut a, mut b) = (a, b);
        let mut i = 0;
        while i + 4 <= len {
            for u in 0..4 {
                let a0 = _mm256_loadu_ps(a.add(u * a_step));
                let a1 = _mm256_loadu_ps(a.add(u * a_step + 8));
                for j in 0..N {
                    let s = _mm256_broadcast_ss(&*b.add(u * b_step + j * b_stride));
                    lo[j] = _mm256_fmadd_ps(a0, s, lo[j]);
                    hi[j] = _mm256_fmadd_ps(a1, s, hi[j]);
                }
            }
            a = a.add(4 * a_step);
            b = b.add(4 * b_step);
            i += 4;
        }
        while i < len {
            let a0 = _mm256_loadu_ps(a);
            let a1 = _mm256_loadu_ps(a.add(8));
            for j in 0..N {
                let s = _mm256_broadcast_ss(&*b.add(j * b_stride));
                lo[j] = _mm256_fmadd_ps(a0, s, lo[j]);
                hi[j] = _mm256_fmadd_ps(a1, s, hi[j]);
            }
            a = a.add(a_step);
            b = b.add(b_step);
            i += 1;
        }
        for j in 0..N {
            acc[j] = [lo[j], hi[j]];
        }
    }
}

/// `N` rows of 16 floats, `stride` apart.
///
/// # Safety
/// AVX (implied by the callers' AVX2); the rows are inside their allocation.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn load<const N: usize>(p: *const f32, stride: usize) -> Acc<N> {
    unsafe { std::array::from_fn(|j| [_mm256_loadu_ps(p.add(j * stride)), _mm256_loadu_ps(p.add(j * stride + 8))]) }
}

/// Stores `N` rows of 16 floats, `stride` apart.
///
/// # Safety
/// As `load`, and the rows are this caller's to write.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn store<const N: usize>(acc: &Acc<N>, p: *mut f32, stride: usize) {
    // SAFETY: the operations below need no more than this function's `# Safety` contract.
    unsafe {
        for (j, [lo, hi]) in acc.iter().enumerate() {
            _mm256_storeu_ps(p.add(j * stride), *lo);
            _mm256_storeu_ps(p.add(j * stride + 8), *hi);
        }
    }
}

/// Lane-wise operations (AVX2; the pointers as for `load` and `store`).
///
/// # Safety
/// The CPU has AVX2 and FMA (no memory is accessed).
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn splat(x: f32) -> V {
    _mm256_set1_ps(x)
}
/// # Safety
/// The CPU has AVX2 and FMA; `p` is readable for 8 floats.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn ld(p: *const f32) -> V {
    unsafe { _mm256_loadu_ps(p) }
}
/// # Safety
/// The CPU has AVX2 and FMA; `p` is writable for 8 floats, this caller's to write.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn st(p: *mut f32, v: V) {
    unsafe { _mm256_storeu_ps(p, v) }
}
/// # Safety
/// The CPU has AVX2 and FMA (no memory is accessed).
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn add(a: V, b: V) -> V {
    _mm256_add_ps(a, b)
}
/// # Safety
/// The CPU has AVX2 and FMA (no memory is accessed).
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn sub(a: V, b: V) -> V {
    _mm256_sub_ps(a, b)
}
/// # Safety
/// The CPU has AVX2 and FMA (no memory is accessed).
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn mul(a: V, b: V) -> V {
    _mm256_mul_ps(a, b)
}
/// # Safety
/// The CPU has AVX2 and FMA (no memory is accessed).
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn max(a: V, b: V) -> V {
    _mm256_max_ps(a, b)
}
/// # Safety
/// The CPU has AVX2 and FMA (no memory is accessed).
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn fmadd(a: V, b: V, c: V) -> V {
    _mm256_fmadd_ps(a, b, c)
}

/// The sum of a vector's 8 lanes.
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn hsum(v: V) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)))
}

/// `cpu::exp2_nonpositive` on eight lanes (the same clamp, rounding and polynomial).
///
/// # Safety
/// The CPU has AVX2 and FMA (no memory is accessed).
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn exp2(x: V) -> V {
    let magic = _mm256_set1_ps(12_582_912.0);
    let floor = _mm256_set1_ps(-126.0);
    let x = _mm256_blendv_ps(x, floor, _mm256_cmp_ps::<_CMP_LT_OQ>(x, floor));
    let t = _mm256_add_ps(x, magic);
    let n = _mm256_sub_ps(t, magic);
    let r = _mm256_sub_ps(x, n);
    let poly = crate::cpu::EXP2_POLY;
    let mut p = _mm256_set1_ps(poly[0]);
    for c in &poly[1..] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(*c));
    }
    let bits = _mm256_sub_epi32(_mm256_castps_si256(t), _mm256_castps_si256(magic));
    let bits = _mm256_slli_epi32::<23>(_mm256_add_epi32(bits, _mm256_set1_epi32(127)));
    _mm256_mul_ps(p, _mm256_castsi256_ps(bits))
}
