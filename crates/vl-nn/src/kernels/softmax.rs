//! The online softmax step of the attention tiles through `gemm` (`tile::attend_gemm`): base-2
//! scores, running max and sum per query row, the output rescaled as the max rises.

use multiversion::multiversion;

use crate::cpu::exp2_nonpositive;

/// For each query row of the column-major score tile `s` ([n][m], scores in base 2): raise the
/// running max, turn the scores into `2^(s - max)` in place, rescale the row's sum and output
/// accumulator by `2^(old - new)`. Rows go in blocks across the vector lanes (64 at a time: four AVX-512 or
/// eight AVX2 registers of independent maxima and sums), so no reduction crosses lanes.
#[multiversion(targets = "simd")]
pub(super) fn online_softmax(s: &mut [f32], m: usize, max: &mut [f32], sum: &mut [f32], o: &mut [f32], d: usize) {
    let mut i0 = 0;
    while i0 + 64 <= m {
        softmax_rows::<64>(s, m, i0, max, sum, o, d);
        i0 += 64;
    }
    while i0 + 8 <= m {
        softmax_rows::<8>(s, m, i0, max, sum, o, d);
        i0 += 8;
    }
    while i0 < m {
        softmax_rows::<1>(s, m, i0, max, sum, o, d);
        i0 += 1;
    }
}

/// `online_softmax` for query rows `i0..i0 + W`.
#[inline(always)]
fn softmax_rows<const W: usize>(
    s: &mut [f32],
    m: usize,
    i0: usize,
    max: &mut [f32],
    sum: &mut [f32],
    o: &mut [f32],
    d: usize,
) {
    let n = s.len() / m;
    let mut mx = [0f32; W];
    mx.copy_from_slice(&max[i0..i0 + W]);
    for j in 0..n {
        let c: &[f32; W] = s[j * m + i0..][..W].try_into().unwrap();
        for l in 0..W {
            mx[l] = if c[l] > mx[l] { c[l] } else { mx[l] };
        }
    }
    let mut acc = [0f32; W];
    for j in 0..n {
        let c: &mut [f32; W] = (&mut s[j * m + i0..][..W]).try_into().unwrap();
        for l in 0..W {
            c[l] = exp2_nonpositive(c[l] - mx[l]);
            acc[l] += c[l];
        }
    }
    for l in 0..W {
        let i = i0 + l;
        if max[i] == f32::NEG_INFINITY {
            sum[i] = acc[l];
        } else {
            let r = exp2_nonpositive(max[i] - mx[l]);
            sum[i] = sum[i] * r + acc[l];
            for y in &mut o[i * d..(i + 1) * d] {
                *y *= r;
            }
        }
        max[i] = mx[l];
    }
}
