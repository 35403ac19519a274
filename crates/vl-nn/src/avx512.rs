//! The AVX-512 twin of `avx2`: the inner loop of the attention strips (`N` scalars broadcast
//! against a row of `W` vectors, accumulated over a loop) and the few lane-wise operations the strips'
//! softmax needs, with the same names, so one strip template (`kernels::strips`'s `strip_kernel!`) compiles
//! for both.

use std::arch::x86_64::*;

/// One vector: 16 lanes of f32.
pub(crate) type V = __m512;
/// f32 lanes per vector.
pub(crate) const LANES: usize = 16;

/// `N` rows of `W` 16-lane accumulators: `N` rows of `16 W` floats.
pub(crate) type Acc<const N: usize, const W: usize> = [[V; W]; N];

/// `acc[j] += b[i * b_step + j * b_stride] * a[i * a_step..][..16 W]` for `i` in `0..len`: each
/// step loads one `16 W`-float row of `a` as `W` vectors and broadcasts `N` scalars of `b`, `N W`
/// fused multiply-adds (W = 3, N = 8: 24 accumulators of the 32 registers, 11 loads per 24
/// multiply-adds).
///
/// # Safety
/// AVX-512F is present; every address read is inside its allocation.
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn accumulate<const N: usize, const W: usize>(
    acc: &mut Acc<N, W>,
    len: usize,
    a: *const f32,
    a_step: usize,
    b: *const f32,
    b_step: usize,
    b_stride: usize,
) {
    // SAFETY: the operations below need no more than this function's `# Safety` contract.
    unsafe {
        let mut c = *acc;
        // Unrolled by 4: a quarter of the loop's own adds and compares beside the FMAs.
        let (mut a, mut b) = (a, b);
        let mut i = 0;
        while i + 4 <= len {
            for u in 0..4 {
                let v: [V; W] = std::array::from_fn(|w| _mm512_loadu_ps(a.add(u * a_step + w * LANES)));
                for (j, row) in c.iter_mut().enumerate() {
                    let s = _mm512_set1_ps(*b.add(u * b_step + j * b_stride));
                    for w in 0..W {
                        row[w] = _mm512_fmadd_ps(v[w], s, row[w]);
                    }
                }
            }
            a = a.add(4 * a_step);
            b = b.add(4 * b_step);
            i += 4;
        }
        while i < len {
            let v: [V; W] = std::array::from_fn(|w| _mm512_loadu_ps(a.add(w * LANES)));
            for (j, row) in c.iter_mut().enumerate() {
                let s = _mm512_set1_ps(*b.add(j * b_stride));
                for w in 0..W {
                    row[w] = _mm512_fmadd_ps(v[w], s, row[w]);
                }
            }
            a = a.add(a_step);
            b = b.add(b_step);
            i += 1;
        }
        *acc = c;
    }
}

/// `N` rows of `16 W` floats, `stride` apart.
///
/// # Safety
/// AVX-512F; the rows are inside their allocation.
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn load<const N: usize, const W: usize>(p: *const f32, stride: usize) -> Acc<N, W> {
    unsafe { std::array::from_fn(|j| std::array::from_fn(|w| _mm512_loadu_ps(p.add(j * stride + w * LANES)))) }
}

/// Stores `N` rows of `16 W` floats, `stride` apart.
///
/// # Safety
/// As `load`, and the rows are this caller's to write.
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn store<const N: usize, const W: usize>(acc: &Acc<N, W>, p: *mut f32, stride: usize) {
    // SAFETY: the operations below need no more than this function's `# Safety` contract.
    unsafe {
        for (j, row) in acc.iter().enumerate() {
            for (w, v) in row.iter().enumerate() {
                _mm512_storeu_ps(p.add(j * stride + w * LANES), *v);
            }
        }
    }
}

/// Lane-wise operations (AVX-512F; the pointers as for `load` and `store`).
///
/// # Safety
/// The CPU has AVX-512F (no memory is accessed).
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn splat(x: f32) -> V {
    _mm512_set1_ps(x)
}
/// # Safety
/// The CPU has AVX-512F; `p` is readable for 16 floats.
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn ld(p: *const f32) -> V {
    unsafe { _mm512_loadu_ps(p) }
}
/// # Safety
/// The CPU has AVX-512F; `p` is writable for 16 floats, this caller's to write.
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn st(p: *mut f32, v: V) {
    unsafe { _mm512_storeu_ps(p, v) }
}
/// # Safety
/// The CPU has AVX-512F (no memory is accessed).
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn add(a: V, b: V) -> V {
    _mm512_add_ps(a, b)
}
/// # Safety
/// The CPU has AVX-512F (no memory is accessed).
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn sub(a: V, b: V) -> V {
    _mm512_sub_ps(a, b)
}
/// # Safety
/// The CPU has AVX-512F (no memory is accessed).
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn mul(a: V, b: V) -> V {
    _mm512_mul_ps(a, b)
}
/// # Safety
/// The CPU has AVX-512F (no memory is accessed).
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn max(a: V, b: V) -> V {
    _mm512_max_ps(a, b)
}
/// # Safety
/// The CPU has AVX-512F (no memory is accessed).
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn fmadd(a: V, b: V, c: V) -> V {
    _mm512_fmadd_ps(a, b, c)
}

/// `cpu::exp2_nonpositive` on 16 lanes: the same clamp, rounding (to nearest, even) and
/// polynomial, with `2^n` applied by `vscalefps` (exact here: n is in [-126, 0]) instead of
/// through the exponent bits, three operations fewer.
///
/// # Safety
/// The CPU has AVX-512F (no memory is accessed).
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn exp2(x: V) -> V {
    // `vmaxps` returns its second operand when either is NaN: NaN passes through.
    let x = _mm512_max_ps(_mm512_set1_ps(-126.0), x);
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x);
    let r = _mm512_sub_ps(x, n);
    let poly = crate::cpu::EXP2_POLY;
    let mut p = _mm512_set1_ps(poly[0]);
    for c in &poly[1..] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(*c));
    }
    _mm512_scalef_ps(p, n)
}
