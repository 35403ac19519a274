//! The one AVX2 inner loop that the panel linears (`panels`) and the attention strips
//! (`kernels`) share: `N` scalars broadcast against a 16-float row, accumulated over a loop.

use std::arch::x86_64::*;

/// `N` pairs of 8-lane accumulators: `N` rows of 16 floats.
pub(crate) type Acc<const N: usize> = [[__m256; 2]; N];

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
    let mut lo: [__m256; N] = std::array::from_fn(|j| acc[j][0]);
    let mut hi: [__m256; N] = std::array::from_fn(|j| acc[j][1]);
    for i in 0..len {
        let a0 = _mm256_loadu_ps(a.add(i * a_step));
        let a1 = _mm256_loadu_ps(a.add(i * a_step + 8));
        for j in 0..N {
            let s = _mm256_broadcast_ss(&*b.add(i * b_step + j * b_stride));
            lo[j] = _mm256_fmadd_ps(a0, s, lo[j]);
            hi[j] = _mm256_fmadd_ps(a1, s, hi[j]);
        }
    }
    for j in 0..N {
        acc[j] = [lo[j], hi[j]];
    }
}

/// `N` rows of 16 floats, `stride` apart.
///
/// # Safety
/// AVX (implied by the callers' AVX2); the rows are inside their allocation.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn load<const N: usize>(p: *const f32, stride: usize) -> Acc<N> {
    std::array::from_fn(|j| [_mm256_loadu_ps(p.add(j * stride)), _mm256_loadu_ps(p.add(j * stride + 8))])
}

/// Stores `N` rows of 16 floats, `stride` apart.
///
/// # Safety
/// As `load`, and the rows are this caller's to write.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn store<const N: usize>(acc: &Acc<N>, p: *mut f32, stride: usize) {
    for (j, [lo, hi]) in acc.iter().enumerate() {
        _mm256_storeu_ps(p.add(j * stride), *lo);
        _mm256_storeu_ps(p.add(j * stride + 8), *hi);
    }
}
