//! The decode kernel on AVX2 (a child of `decode`): `decode_group_avx512`'s work on 8-lane
//! vectors, for CPUs without AVX-512. Each key row meets up to four query rows at once, two
//! chains of sums a row; the softmax runs 8 scores at a time in base 2 (`avx2::exp2`); each
//! value row is read once per block of `PV_KEYS` keys for up to four query rows and 16 of their
//! output lanes. The loop it replaces computed one dot product at a time and a scalar `exp` per
//! score.

use std::arch::x86_64::*;

use candle_core::DType;

use super::{DecodeGroup, KvElem};
use crate::avx2::hsum;

/// Keys a block of the weighted sums of value rows covers (as `decode_group_avx512`'s).
const PV_KEYS: usize = 64;

/// 8 elements at `p` widened to f32 (exact).
///
/// # Safety
/// The CPU has AVX2 and F16C; `p` is readable for 8 elements.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load8<E: KvElem>(p: *const E) -> __m256 {
    // SAFETY: the operations below need no more than this function's `# Safety` contract.
    unsafe {
        match E::DTYPE {
            DType::F16 => _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)),
            DType::BF16 => {
                _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i)), 16))
            }
            _ => _mm256_loadu_ps(p as *const f32),
        }
    }
}

/// The largest of a vector's 8 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hmax(v: __m256) -> f32 {
    let s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_max_ss(s, _mm_shuffle_ps(s, s, 1)))
}

/// `decode_group` on AVX2, FMA and F16C, head size `d` a multiple of 8.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C. The slices are checked on entry (`d` a multiple of 8, `q` rep
/// x d, keys and values `total` rows `k_row` / `v_row` apart, `scores` rep x (total + 1), `out`
/// rep x d), so every pointer access below stays inside them.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn decode_group_avx2<E: KvElem>(g: &DecodeGroup<'_, E>, scores: &mut [f32], out: &mut [f32]) {
    // SAFETY: the operations below need no more than this function's `# Safety` contract.
    unsafe {
        use crate::avx2::exp2;
        let &DecodeGroup { q, k, k_row, v, v_row, total, d, rep, scale } = g;
        if total == 0 {
            out[..rep * d].fill(0.0);
            return;
        }
        assert!(d.is_multiple_of(8) && q.len() >= rep * d && scores.len() >= rep * (total + 1) && out.len() >= rep * d);
        assert!(k.len() >= (total - 1) * k_row + d && v.len() >= (total - 1) * v_row + d);
        let scale2 = scale * std::f32::consts::LOG2_E;
        let (scores, sums) = scores.split_at_mut(rep * total);
        let (qp, sp) = (q.as_ptr(), scores.as_mut_ptr());
        // Scores, in base 2: row r's key j at sp[r * total + j].
        for j in 0..total {
            let kj = k.as_ptr().add(j * k_row);
            let mut r = 0;
            while r < rep {
                let n = (rep - r).min(4);
                let (qr, s) = (qp.add(r * d), sp.add(r * total + j));
                match n {
                    4 => qk_rows::<E, 4>(qr, d, kj, s, total, scale2),
                    3 => qk_rows::<E, 3>(qr, d, kj, s, total, scale2),
                    2 => qk_rows::<E, 2>(qr, d, kj, s, total, scale2),
                    _ => qk_rows::<E, 1>(qr, d, kj, s, total, scale2),
                }
                r += n;
            }
        }
        // Softmax numerators in place; their sums kept for the end. The last partial vector of a
        // row is read and written under a mask.
        let full = total / 8 * 8;
        let tail =
            _mm256_cmpgt_epi32(_mm256_set1_epi32((total - full) as i32), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        for (r, sum) in sums[..rep].iter_mut().enumerate() {
            let row = sp.add(r * total);
            let mut m = _mm256_set1_ps(f32::NEG_INFINITY);
            for j in (0..full).step_by(8) {
                m = _mm256_max_ps(m, _mm256_loadu_ps(row.add(j)));
            }
            let mut max = hmax(m);
            for j in full..total {
                max = max.max(*row.add(j));
            }
            let m = _mm256_set1_ps(max);
            let mut acc = _mm256_setzero_ps();
            for j in (0..full).step_by(8) {
                let e = exp2(_mm256_sub_ps(_mm256_loadu_ps(row.add(j)), m));
                _mm256_storeu_ps(row.add(j), e);
                acc = _mm256_add_ps(acc, e);
            }
            if full < total {
                let e = exp2(_mm256_sub_ps(_mm256_maskload_ps(row.add(full), tail), m));
                _mm256_maskstore_ps(row.add(full), tail, e);
                acc = _mm256_add_ps(acc, _mm256_and_ps(e, _mm256_castsi256_ps(tail)));
            }
            *sum = hsum(acc);
        }
        // Weighted sums of the value rows, 16 lanes (8 where d is not a multiple of 16) of up to
        // four rows at a time, over blocks of PV_KEYS keys whose value rows stay in cache while
        // every slice of every row group meets them.
        let op = out.as_mut_ptr();
        let wide = d.is_multiple_of(16);
        let step = if wide { 16 } else { 8 };
        let mut j0 = 0;
        while j0 < total {
            let kn = PV_KEYS.min(total - j0);
            let first = j0 == 0;
            let mut r = 0;
            while r < rep {
                let n = (rep - r).min(4);
                for c in (0..d).step_by(step) {
                    let (p, vc, o) = (sp.add(r * total + j0), v.as_ptr().add(j0 * v_row + c), op.add(r * d + c));
                    let rows = (total, kn, first);
                    match (n, wide) {
                        (4, true) => pv_rows::<E, 4, 2>(p, rows, vc, v_row, o, d),
                        (3, true) => pv_rows::<E, 3, 2>(p, rows, vc, v_row, o, d),
                        (2, true) => pv_rows::<E, 2, 2>(p, rows, vc, v_row, o, d),
                        (_, true) => pv_rows::<E, 1, 2>(p, rows, vc, v_row, o, d),
                        (4, false) => pv_rows::<E, 4, 1>(p, rows, vc, v_row, o, d),
                        (3, false) => pv_rows::<E, 3, 1>(p, rows, vc, v_row, o, d),
                        (2, false) => pv_rows::<E, 2, 1>(p, rows, vc, v_row, o, d),
                        (_, false) => pv_rows::<E, 1, 1>(p, rows, vc, v_row, o, d),
                    }
                }
                r += n;
            }
            j0 += kn;
        }
        for (r, sum) in sums[..rep].iter().enumerate() {
            let inv = _mm256_set1_ps(1.0 / sum);
            for c in (0..d).step_by(8) {
                let o = op.add(r * d + c);
                _mm256_storeu_ps(o, _mm256_mul_ps(_mm256_loadu_ps(o), inv));
            }
        }
    }
}

/// N query rows (`d` apart from `q`) dotted with one key row, scaled, written `stride` apart
/// from `s`; two chains of sums a row (even and odd 8-lane slices).
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `d` is a multiple of 8; `q` is readable for N rows of `d`
/// floats (`d` apart), `kj` for `d` elements, and `s + i * stride` is writable for each i < N.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn qk_rows<E: KvElem, const N: usize>(
    q: *const f32,
    d: usize,
    kj: *const E,
    s: *mut f32,
    stride: usize,
    scale: f32,
) {
    // SAFETY: the operations below need no more than this function's `# Safety` contract.
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); 2]; N];
        for c in (0..d).step_by(8) {
            let kv = load8(kj.add(c));
            let h = (c / 8) % 2;
            for (i, a) in acc.iter_mut().enumerate() {
                a[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q.add(i * d + c)), kv, a[h]);
            }
        }
        for (i, a) in acc.iter().enumerate() {
            *s.add(i * stride) = hsum(_mm256_add_ps(a[0], a[1])) * scale;
        }
    }
}

/// `out[i][0..8 W] (+)= sum_j p[i][j] v[j][0..8 W]` for N rows of weights (`stride` apart from
/// `p`) over `count` keys, value rows `v_row` apart from `v`, output rows `d` apart from `o`;
/// `first`: the sums start from zero, else from what `o` holds.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `p` is readable for N rows of `count` weights (`stride`
/// apart), `v` for `count` rows of 8 W elements (`v_row` apart), and `o` readable and writable
/// for N rows of 8 W floats (`d` apart).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pv_rows<E: KvElem, const N: usize, const W: usize>(
    p: *const f32,
    (stride, count, first): (usize, usize, bool),
    v: *const E,
    v_row: usize,
    o: *mut f32,
    d: usize,
) {
    // SAFETY: the operations below need no more than this function's `# Safety` contract.
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); W]; N];
        if !first {
            for (i, row) in acc.iter_mut().enumerate() {
                for (w, a) in row.iter_mut().enumerate() {
                    *a = _mm256_loadu_ps(o.add(i * d + 8 * w));
                }
            }
        }
        for j in 0..count {
            let vj = v.add(j * v_row);
            let mut vs = [_mm256_setzero_ps(); W];
            for (w, x) in vs.iter_mut().enumerate() {
                *x = load8(vj.add(8 * w));
            }
            for (i, row) in acc.iter_mut().enumerate() {
                let pi = _mm256_set1_ps(*p.add(i * stride + j));
                for (a, x) in row.iter_mut().zip(vs) {
                    *a = _mm256_fmadd_ps(pi, x, *a);
                }
            }
        }
        for (i, row) in acc.iter().enumerate() {
            for (w, a) in row.iter().enumerate() {
                _mm256_storeu_ps(o.add(i * d + 8 * w), *a);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::decode_group_generic;
    use super::*;
    use half::{bf16, f16};

    /// The kernel against the plain loop (`decode_group_generic`) on the same cache, whatever
    /// kernel this CPU's `decode_group` picks (an AVX-512 CPU takes its own, so this test is
    /// where the AVX2 kernel meets it there): head sizes 8 to 256, 1 to 5 query rows a KV head,
    /// key counts around the 8-lane tail and the 64-key blocks, rows padded apart.
    fn matches_the_plain_loop<E: KvElem>(from: fn(f32) -> E) {
        if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")) {
            eprintln!("no AVX2 / FMA / F16C here: the kernel does not run");
            return;
        }
        for (rep, d, total) in [(1, 8, 1), (2, 24, 7), (4, 128, 8), (5, 128, 65), (3, 256, 130), (4, 64, 200)] {
            let row = d + 8;
            let q = crate::testing::randn(40 + d as u64, 1.0, (rep * d,)).unwrap().to_vec1::<f32>().unwrap();
            let kv = |seed: u64| -> Vec<E> {
                let x = crate::testing::randn(seed, 1.0, (total * row,)).unwrap().to_vec1::<f32>().unwrap();
                x.into_iter().map(from).collect()
            };
            let (k, v) = (kv(41 + total as u64), kv(42 + total as u64));
            let g = DecodeGroup { q: &q, k: &k, k_row: row, v: &v, v_row: row, total, d, rep, scale: 0.3 };
            let (mut s1, mut s2) = (vec![0f32; rep * (total + 1)], vec![0f32; rep * (total + 1)]);
            let (mut want, mut got) = (vec![0f32; rep * d], vec![0f32; rep * d]);
            decode_group_generic(&g, &mut s1, &mut want);
            // SAFETY: AVX2, FMA and F16C checked above; d is a multiple of 8.
            unsafe { decode_group_avx2(&g, &mut s2, &mut got) };
            let err = got.iter().zip(&want).fold(0f32, |a, (x, y)| a.max((x - y).abs()));
            assert!(err <= 1e-5, "{:?} rep {rep} d {d} total {total}: {err}", E::DTYPE);
        }
    }

    #[test]
    fn f32_rows_match_the_plain_loop() {
        matches_the_plain_loop::<f32>(|x| x);
    }

    #[test]
    fn half_rows_match_the_plain_loop() {
        matches_the_plain_loop::<f16>(f16::from_f32);
        matches_the_plain_loop::<bf16>(bf16::from_f32);
    }
}
