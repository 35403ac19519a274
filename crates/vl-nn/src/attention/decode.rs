//! One query row per head against the whole KV cache, read in place (a decode step): per KV
//! head its query rows' scores, softmax and weighted sum of value rows; on AVX-512 four query
//! rows of a KV head per key row (`decode_group_avx512`; on AVX2 alone `decode_avx2.rs`). The cache may hold f32, f16 or bf16
//! (`KvCache::in_dtype`): half-precision rows are widened to f32 as they are read, every sum in
//! f32.

use candle_core::{DType, Tensor};
use half::{bf16, f16};

use crate::cpu::{cpu_slice, SendPtr};
use crate::dispatch::{own_kernel_for, Op};
use crate::Result;

/// A cached key or value element the decode kernel reads in place, widened to f32.
pub(crate) trait KvElem: Copy + Send + Sync + candle_core::WithDType {
    fn widen(self) -> f32;
}
impl KvElem for f32 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
}
impl KvElem for f16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self.to_f32()
    }
}
impl KvElem for bf16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self.to_f32()
    }
}

/// 16 elements at `p` widened to f32 (exact: every f16 and bf16 value is an f32).
///
/// # Safety
/// The CPU has AVX-512F; `p` is readable for 16 elements.
#[cfg(all(target_arch = "x86_64", not(vl_avx2_proxy)))]
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn load16<E: KvElem>(p: *const E) -> std::arch::x86_64::__m512 {
    // SAFETY: the operations below need no more than this function's `# Safety` contract.
    unsafe {
        use std::arch::x86_64::*;
        match E::DTYPE {
            DType::F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)),
            DType::BF16 => _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256(p as *const __m256i)),
                16,
            )),
            _ => _mm512_loadu_ps(p as *const f32),
        }
    }
}

/// One query row per head against the whole cache, read in place (decode): for each KV head,
/// each cached key row is read once for all `rep` query heads sharing it, then softmax, then the
/// weighted sum of value rows. Runs on candle's own worker pool (one KV head per work item), so
/// it never competes with the pool's spinning workers. `q` is CPU f32; the cache's `k` and `v`
/// f32, f16 or bf16 (both the same). None otherwise, or without unit-stride rows; the caller
/// then takes the general path.
pub(super) fn decode_attention(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Option<Tensor>> {
    Ok(decode_attention_many(&[(q, k, v)])?.and_then(|mut o| o.pop()))
}

/// `decode_attention` for several sequences of one layer at once (a decode step's batch: each
/// `(q, k, v)` one sequence's query rows `[heads, 1, d]` and its cache `[kv, total, d]`), every
/// (sequence, KV head) a work item of one parallel region. Each output is bit for bit
/// `decode_attention`'s for that sequence alone. None where any sequence would be.
pub fn decode_attention_many(items: &[(&Tensor, &Tensor, &Tensor)]) -> Result<Option<Vec<Tensor>>> {
    let Some(&(q0, k0, _)) = items.first() else { return Ok(Some(vec![])) };
    let dtype = k0.dtype();
    let fits = |(q, k, v): &(&Tensor, &Tensor, &Tensor)| {
        own_kernel_for(Op::DecodeAttention, &[q, q0])
            && k.device().is_cpu()
            && k.dtype() == dtype
            && v.dtype() == dtype
            && q.dims().len() == 3
            && k.dims().len() == 3
            && q.dims()[1] == 1
    };
    if !items.iter().all(fits) {
        return Ok(None);
    }
    match dtype {
        DType::F32 => decode_in::<f32>(items),
        DType::F16 => decode_in::<f16>(items),
        DType::BF16 => decode_in::<bf16>(items),
        _ => Ok(None),
    }
}

/// One sequence's operands, checked: its query rows and cache read in place.
struct Operands<'a, E> {
    q: &'a [f32],
    k: &'a [E],
    v: &'a [E],
    /// Element strides: between KV heads and between cached rows, of k and of v.
    k_head: usize,
    k_row: usize,
    v_head: usize,
    v_row: usize,
    total: usize,
}

fn decode_in<E: KvElem>(items: &[(&Tensor, &Tensor, &Tensor)]) -> Result<Option<Vec<Tensor>>> {
    let (heads, _, d) = items[0].0.dims3()?;
    let kv = items[0].1.dim(0)?;
    if kv == 0 || heads % kv != 0 {
        return Ok(None);
    }
    let rep = heads / kv;
    let qs: Vec<Tensor> = items.iter().map(|(q, _, _)| q.contiguous()).collect::<candle_core::Result<_>>()?;
    let guards: Vec<_> = items
        .iter()
        .zip(&qs)
        .map(|((_, k, v), q)| (q.storage_and_layout(), k.storage_and_layout(), v.storage_and_layout()))
        .collect();
    let mut seqs = Vec::with_capacity(items.len());
    for (((qs, ql), (ks, kl), (vs, vl)), (q, k, v)) in guards.iter().zip(items) {
        let (Some(qs), Some(ks), Some(vs)) = (cpu_slice::<f32>(qs), cpu_slice::<E>(ks), cpu_slice::<E>(vs)) else {
            return Ok(None);
        };
        let (kv_k, total, dk) = k.dims3()?;
        if q.dims3()? != (heads, 1, d) || kv_k != kv || dk != d || total == 0 || v.dims() != [kv, total, d] {
            return Ok(None);
        }
        let (qo, ko, vo) = (ql.start_offset(), kl.start_offset(), vl.start_offset());
        let (kst, vst) = (kl.stride(), vl.stride());
        if kst[2] != 1 || vst[2] != 1 || (total > 1 && (kst[1] < d || vst[1] < d)) {
            return Ok(None);
        }
        let (k_head, k_row, v_head, v_row) = (kst[0], kst[1], vst[0], vst[1]);
        let last = |o: usize, hs: usize, rs: usize| o + (kv - 1) * hs + (total.max(1) - 1) * rs + d;
        if last(ko, k_head, k_row) > ks.len() || last(vo, v_head, v_row) > vs.len() || qo + heads * d > qs.len() {
            return Ok(None);
        }
        seqs.push(Operands { q: &qs[qo..], k: &ks[ko..], v: &vs[vo..], k_head, k_row, v_head, v_row, total });
    }
    let scale = 1.0 / (d as f32).sqrt();
    let most = seqs.iter().map(|s| s.total).max().unwrap_or(0);
    let mut outs: Vec<Vec<f32>> = seqs.iter().map(|_| vec![0f32; heads * d]).collect();
    let ptrs: Vec<SendPtr<f32>> = outs.iter_mut().map(|o| SendPtr(o.as_mut_ptr())).collect();
    candle_core::utils::barrier_pool().execute_chunked(seqs.len() * kv, |range| {
        // Each query row's scores, then (AVX-512 kernel) each row's softmax sum.
        let mut scores = vec![0f32; rep * (most + 1)];
        for item in range {
            let (s, g) = (&seqs[item / kv], item % kv);
            let group = DecodeGroup {
                q: &s.q[g * rep * d..(g + 1) * rep * d],
                k: &s.k[g * s.k_head..],
                k_row: s.k_row,
                v: &s.v[g * s.v_head..],
                v_row: s.v_row,
                total: s.total,
                d,
                rep,
                scale,
            };
            // SAFETY: work items are distinct (sequence, KV head) pairs, writing disjoint rows of
            // their sequence's output.
            let og = unsafe { std::slice::from_raw_parts_mut(ptrs[item / kv].get().add(g * rep * d), rep * d) };
            decode_group(&group, &mut scores, og);
        }
    });
    let device = items[0].0.device();
    let outs =
        outs.into_iter().map(|o| Tensor::from_vec(o, (heads, 1, d), device)).collect::<candle_core::Result<_>>()?;
    Ok(Some(outs))
}

/// One KV head's decode work: its `rep` query rows, its cached key and value rows (`total` of
/// them, `k_row` / `v_row` elements apart), head size `d`.
struct DecodeGroup<'a, E> {
    q: &'a [f32],
    k: &'a [E],
    k_row: usize,
    v: &'a [E],
    v_row: usize,
    total: usize,
    d: usize,
    rep: usize,
    scale: f32,
}

/// `scores`: scratch of at least `rep * (total + 1)` floats.
fn decode_group<E: KvElem>(g: &DecodeGroup<'_, E>, scores: &mut [f32], out: &mut [f32]) {
    #[cfg(all(target_arch = "x86_64", not(vl_avx2_proxy)))]
    if g.d.is_multiple_of(16) && crate::cpu::has_avx512() {
        // SAFETY: the CPU has AVX-512F (checked above) and d is a multiple of 16.
        unsafe { decode_group_avx512(g, scores, out) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if g.d.is_multiple_of(8)
        && std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
        && std::arch::is_x86_feature_detected!("f16c")
    {
        // SAFETY: the CPU has AVX2, FMA and F16C (checked above) and d is a multiple of 8.
        unsafe { avx2::decode_group_avx2(g, scores, out) };
        return;
    }
    decode_group_generic(g, scores, out)
}

#[cfg(target_arch = "x86_64")]
#[path = "decode_avx2.rs"]
mod avx2;

/// `decode_group` on AVX-512F, head size `d` a multiple of 16. The generic loop is latency-bound
/// (one dot product at a time into one vector of sums, then a scalar `exp` per score); here each
/// key row meets up to four query rows at once (four independent chains of sums sharing the
/// key's loads), the softmax runs 16 scores at a time in base 2 (`avx512::exp2`'s polynomial,
/// the scores scaled by `log2 e`), and each value row is read once for up to four query rows
/// and 64 of their output lanes held in registers. The normalization is applied to the output
/// rows at the end.
///
/// # Safety
/// The CPU has AVX-512F. The slices are checked on entry (`d` a multiple of 16, `q` rep x d, keys
/// and values `total` rows `k_row` / `v_row` apart, `scores` rep x (total + 1), `out` rep x d), so
/// every pointer access below stays inside them.
#[cfg(all(target_arch = "x86_64", not(vl_avx2_proxy)))]
#[target_feature(enable = "avx512f")]
unsafe fn decode_group_avx512<E: KvElem>(g: &DecodeGroup<'_, E>, scores: &mut [f32], out: &mut [f32]) {
    // SAFETY: the operations below need no more than this function's `# Safety` contract.
    unsafe {
        use crate::avx512::{exp2, LANES};
        use std::arch::x86_64::*;
        let &DecodeGroup { q, k, k_row, v, v_row, total, d, rep, scale } = g;
        if total == 0 {
            // No key: zeros, as the generic loop gives (not a softmax over nothing).
            out[..rep * d].fill(0.0);
            return;
        }
        assert!(
            d.is_multiple_of(LANES) && q.len() >= rep * d && scores.len() >= rep * (total + 1) && out.len() >= rep * d
        );
        assert!(k.len() >= (total - 1) * k_row + d && v.len() >= (total - 1) * v_row + d);
        let scale2 = scale * std::f32::consts::LOG2_E;
        // The scores, then each row's softmax sum (the caller's scratch holds both).
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
        // Softmax numerators in place; their sums kept for the end.
        for (r, sum) in sums[..rep].iter_mut().enumerate() {
            let row = sp.add(r * total);
            let tail = |j: usize| -> __mmask16 {
                if total - j >= LANES {
                    0xffff
                } else {
                    (1u16 << (total - j)) - 1
                }
            };
            let mut m = _mm512_set1_ps(f32::NEG_INFINITY);
            for j in (0..total).step_by(LANES) {
                m = _mm512_mask_max_ps(m, tail(j), m, _mm512_maskz_loadu_ps(tail(j), row.add(j)));
            }
            let m = _mm512_set1_ps(_mm512_reduce_max_ps(m));
            let mut acc = _mm512_setzero_ps();
            for j in (0..total).step_by(LANES) {
                let e = exp2(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail(j), row.add(j)), m));
                _mm512_mask_storeu_ps(row.add(j), tail(j), e);
                acc = _mm512_mask_add_ps(acc, tail(j), acc, e);
            }
            *sum = _mm512_reduce_add_ps(acc);
        }
        // Weighted sums of the value rows, 64 lanes (or 16 where d is not a multiple of 64) of up to
        // four rows at a time, over blocks of `PV_KEYS` keys: a block's value rows come from
        // memory once and stay in cache while every slice of every row group meets them (one pass
        // over all keys per slice read the values d / 64 times, past the L3 at long contexts);
        // the sums carry from block to block in `out`, the same additions in the same order.
        let op = out.as_mut_ptr();
        let wide = d.is_multiple_of(4 * LANES);
        let step = if wide { 4 * LANES } else { LANES };
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
                        (4, true) => pv_rows::<E, 4, 4>(p, rows, vc, v_row, o, d),
                        (3, true) => pv_rows::<E, 3, 4>(p, rows, vc, v_row, o, d),
                        (2, true) => pv_rows::<E, 2, 4>(p, rows, vc, v_row, o, d),
                        (_, true) => pv_rows::<E, 1, 4>(p, rows, vc, v_row, o, d),
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
            let inv = _mm512_set1_ps(1.0 / sum);
            for c in (0..d).step_by(LANES) {
                let o = op.add(r * d + c);
                _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_loadu_ps(o), inv));
            }
        }
    }
}

/// N query rows (`d` apart from `q`) dotted with one key row, scaled, written `stride` apart
/// from `s`.
///
/// # Safety
/// The CPU has AVX-512F; `d` is a multiple of 16; `q` is readable for N rows of `d` floats (`d`
/// apart), `kj` for `d` elements, and `s + i * stride` is writable for each i < N.
#[cfg(all(target_arch = "x86_64", not(vl_avx2_proxy)))]
#[inline]
#[target_feature(enable = "avx512f")]
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
        use std::arch::x86_64::*;
        let mut acc = [_mm512_setzero_ps(); N];
        for c in (0..d).step_by(16) {
            let kv = load16(kj.add(c));
            for (i, a) in acc.iter_mut().enumerate() {
                *a = _mm512_fmadd_ps(_mm512_loadu_ps(q.add(i * d + c)), kv, *a);
            }
        }
        for (i, a) in acc.iter().enumerate() {
            *s.add(i * stride) = _mm512_reduce_add_ps(*a) * scale;
        }
    }
}

/// Keys a block of the decode kernel's weighted sums of value rows covers.
#[cfg(all(target_arch = "x86_64", not(vl_avx2_proxy)))]
const PV_KEYS: usize = 64;

/// `out[i][0..16 W] (+)= sum_j p[i][j] v[j][0..16 W]` for N rows of weights (`stride` apart from
/// `p`) over `count` keys, value rows `v_row` apart from `v`, output rows `d` apart from `o`;
/// `first`: the sums start from zero, else from what `o` holds. `(stride, count, first)` is
/// `rows`.
///
/// # Safety
/// The CPU has AVX-512F; `p` is readable for N rows of `count` weights (`stride` apart), `v` for
/// `count` rows of 16 W elements (`v_row` apart), and `o` readable and writable for N rows of
/// 16 W floats (`d` apart).
#[cfg(all(target_arch = "x86_64", not(vl_avx2_proxy)))]
#[inline]
#[target_feature(enable = "avx512f")]
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
        use std::arch::x86_64::*;
        let mut acc = [[_mm512_setzero_ps(); W]; N];
        if !first {
            for (i, row) in acc.iter_mut().enumerate() {
                for (w, a) in row.iter_mut().enumerate() {
                    *a = _mm512_loadu_ps(o.add(i * d + 16 * w));
                }
            }
        }
        for j in 0..count {
            let vj = v.add(j * v_row);
            let mut vs = [_mm512_setzero_ps(); W];
            for (w, x) in vs.iter_mut().enumerate() {
                *x = load16(vj.add(16 * w));
            }
            for (i, row) in acc.iter_mut().enumerate() {
                let pi = _mm512_set1_ps(*p.add(i * stride + j));
                for (a, x) in row.iter_mut().zip(vs) {
                    *a = _mm512_fmadd_ps(pi, x, *a);
                }
            }
        }
        for (i, row) in acc.iter().enumerate() {
            for (w, a) in row.iter().enumerate() {
                _mm512_storeu_ps(o.add(i * d + 16 * w), *a);
            }
        }
    }
}

/// Dot product with eight independent partial sums (vectorizes; the order is fixed).
#[inline(always)]
fn dot<E: KvElem>(a: &[f32], b: &[E]) -> f32 {
    let mut acc = [0f32; 8];
    let (ac, ar) = a.as_chunks::<8>();
    let (bc, br) = b.as_chunks::<8>();
    for (x, y) in ac.iter().zip(bc) {
        for i in 0..8 {
            acc[i] += x[i] * y[i].widen();
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (x, y) in ar.iter().zip(br) {
        s += x * y.widen();
    }
    s
}

#[inline(always)]
fn decode_group_generic<E: KvElem>(g: &DecodeGroup<'_, E>, scores: &mut [f32], out: &mut [f32]) {
    let &DecodeGroup { q, k, k_row, v, v_row, total, d, rep, scale } = g;
    for j in 0..total {
        let kj = &k[j * k_row..j * k_row + d];
        for r in 0..rep {
            scores[r * total + j] = dot(&q[r * d..(r + 1) * d], kj) * scale;
        }
    }
    for r in 0..rep {
        let s = &mut scores[r * total..(r + 1) * total];
        let max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0f32;
        for x in s.iter_mut() {
            *x = (*x - max).exp();
            sum += *x;
        }
        let inv = 1.0 / sum;
        for x in s.iter_mut() {
            *x *= inv;
        }
    }
    out.fill(0.0);
    for j in 0..total {
        let vj = &v[j * v_row..j * v_row + d];
        for r in 0..rep {
            let p = scores[r * total + j];
            let o = &mut out[r * d..(r + 1) * d];
            for (o, &x) in o.iter_mut().zip(vj) {
                *o += p * x.widen();
            }
        }
    }
}
