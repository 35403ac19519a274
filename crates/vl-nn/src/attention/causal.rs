//! Causal grouped-query attention for one sequence (the text decoder's): the CPU f32 prefill on
//! the fused kernel (`kernels::causal_attention`), a one-row step on `decode` (which reads an
//! f16 or bf16 cache in place), blocks of queries through candle's ops elsewhere.

use candle_core::{DType, Tensor};

use super::decode::decode_attention;
use crate::cpu::cpu_f32;
use crate::dispatch::{own_kernel_for, Op};
use crate::{Error, Result};

/// Causal grouped-query attention for one sequence. `q`: [heads, new, d]; `k`, `v`:
/// [kv_heads, total, d] (cached positions first, the `new` ones last; views are fine). Query `i`
/// sits at absolute position `total - new + i` and sees keys up to it. Queries are processed in
/// blocks of `query_block` rows, bounding the live score matrix. Returns [heads, new, d].
pub fn causal_gqa_attention(q: &Tensor, k: &Tensor, v: &Tensor, query_block: usize) -> Result<Tensor> {
    let (heads, new, d) = q.dims3()?;
    let (kv, total, _) = k.dims3()?;
    if kv == 0 || heads % kv != 0 || total < new {
        return Err(Error::Shape {
            layer: "causal_gqa_attention",
            message: format!("q {:?} cannot attend to k {:?}", q.dims(), k.dims()),
        });
    }
    let rep = heads / kv;
    if new == 1 {
        if let Some(out) = decode_attention(q, k, v)? {
            return Ok(out);
        }
    }
    if let Some(out) = causal_attention_cpu(q, k, v)? {
        return Ok(out);
    }
    // A cache kept in another dtype than the queries (`KvCache::in_dtype`, e.g. f16 keys for f32
    // compute) where the fused kernel does not apply: widened whole for candle's products.
    let widened;
    let (k, v) = if k.dtype() != q.dtype() || v.dtype() != q.dtype() {
        widened = (k.to_dtype(q.dtype())?, v.to_dtype(q.dtype())?);
        (&widened.0, &widened.1)
    } else {
        (k, v)
    };
    let offset = total - new;
    let kt = k.t()?; // [kv, d, total]
    let q = (q * (1.0 / (d as f64).sqrt()))?.reshape((kv, rep, new, d))?;
    let block = query_block.max(1);
    let mut outs = Vec::new();
    let mut start = 0;
    while start < new {
        let rows = block.min(new - start);
        // Keys after the block's last query are never seen: skip them entirely.
        let visible = offset + start + rows;
        let qs = q.narrow(2, start, rows)?.reshape((kv, rep * rows, d))?;
        let ks = kt.narrow(2, 0, visible)?;
        let mut scores = qs.matmul(&ks)?.to_dtype(DType::F32)?.reshape((kv, rep, rows, visible))?;
        if rows > 1 {
            let mask: Vec<f32> = (0..rows)
                .flat_map(|i| (0..visible).map(move |j| if j > offset + start + i { f32::NEG_INFINITY } else { 0.0 }))
                .collect();
            let mask = Tensor::from_vec(mask, (rows, visible), q.device())?;
            scores = scores.broadcast_add(&mask)?;
        }
        let probs =
            candle_nn::ops::softmax_last_dim(&scores)?.to_dtype(v.dtype())?.reshape((kv, rep * rows, visible))?;
        let out = probs.matmul(&v.narrow(1, 0, visible)?)?.reshape((kv, rep, rows, d))?;
        outs.push(out);
        start += rows;
    }
    Ok(Tensor::cat(&outs, 2)?.reshape((heads, new, d))?)
}

/// Prefill on CPU in f32 through the fused kernel (`kernels::causal_attention`: query tiles x
/// heads on candle's pool, key tiles with the online softmax, the cache's views read in place;
/// an f16 / bf16 cache's rows widened key tile by key tile). None when `q` is not CPU f32, the
/// keys and values not CPU f32, f16 or bf16 (both the same) with unit-stride rows of `d` (the
/// caller then takes the general path).
fn causal_attention_cpu(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Option<Tensor>> {
    let (heads, new, d) = q.dims3()?;
    let (kv, total, _) = k.dims3()?;
    let kv_ok = k.device().is_cpu() && v.device().is_cpu() && k.dtype() == v.dtype();
    if !own_kernel_for(Op::CausalAttention, &[q]) || !kv_ok || v.dims3()? != (kv, total, d) {
        return Ok(None);
    }
    let q = q.contiguous()?;
    let ((qs, ql), (ks, kl), (vs, vl)) = (q.storage_and_layout(), k.storage_and_layout(), v.storage_and_layout());
    let Some(qs) = cpu_f32(&qs) else { return Ok(None) };
    let (kst, vst) = (kl.stride(), vl.stride());
    // Rows of d contiguous elements, heads at one stride for k and v.
    if kst[2] != 1 || vst[2] != 1 || kst[1] != d || vst[1] != d || kst[0] != vst[0] || kst[0] < total * d {
        return Ok(None);
    }
    let span = (kv - 1) * kst[0] + total * d;
    let (qo, ko, vo) = (ql.start_offset(), kl.start_offset(), vl.start_offset());
    if qo + heads * new * d > qs.len() {
        return Ok(None);
    }
    fn rows<E: candle_core::WithDType>(s: &candle_core::Storage, o: usize, span: usize) -> Option<&[E]> {
        crate::cpu::cpu_slice(s).and_then(|x: &[E]| x.get(o..o + span))
    }
    use crate::kernels::KvRows;
    let rows = match k.dtype() {
        DType::F32 => rows::<f32>(&ks, ko, span).zip(rows::<f32>(&vs, vo, span)).map(|(k, v)| KvRows::F32(k, v)),
        DType::F16 => rows(&ks, ko, span).zip(rows(&vs, vo, span)).map(|(k, v)| KvRows::F16(k, v)),
        DType::BF16 => rows(&ks, ko, span).zip(rows(&vs, vo, span)).map(|(k, v)| KvRows::Bf16(k, v)),
        _ => None,
    };
    let Some(rows) = rows else { return Ok(None) };
    let mut out = vec![0f32; heads * new * d];
    crate::kernels::causal_attention(
        &qs[qo..qo + heads * new * d],
        (heads, new, d),
        rows,
        (kv, kst[0], total),
        &mut out,
    );
    Ok(Some(Tensor::from_vec(out, (heads, new, d), q.device())?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Plain formula: repeat kv heads, full masked softmax.
    fn naive(q: &Tensor, k: &Tensor, v: &Tensor) -> Tensor {
        let (heads, new, d) = q.dims3().unwrap();
        let (kv, total, _) = k.dims3().unwrap();
        let rep = heads / kv;
        let mut outs = Vec::new();
        for h in 0..heads {
            let (qh, kh, vh) = (q.get(h).unwrap(), k.get(h / rep).unwrap(), v.get(h / rep).unwrap());
            let sc = (qh.matmul(&kh.t().unwrap()).unwrap() / (d as f64).sqrt()).unwrap();
            let mut rows = sc.to_vec2::<f32>().unwrap();
            for (i, r) in rows.iter_mut().enumerate() {
                for (j, x) in r.iter_mut().enumerate() {
                    if j > total - new + i {
                        *x = f32::NEG_INFINITY;
                    }
                }
            }
            let sc = Tensor::new(rows, &Device::Cpu).unwrap();
            outs.push(candle_nn::ops::softmax_last_dim(&sc).unwrap().matmul(&vh).unwrap());
        }
        Tensor::stack(&outs, 0).unwrap()
    }

    #[test]
    fn matches_the_plain_formula_for_prefill_and_decode() {
        let (heads, kv, d, total) = (6, 2, 4, 11);
        let k = crate::testing::randn(204, 1., (kv, total, d)).unwrap();
        let v = crate::testing::randn(205, 1., (kv, total, d)).unwrap();
        for new in [total, 3, 1] {
            let q = crate::testing::randn(206, 1., (heads, new, d)).unwrap();
            let want = naive(&q, &k, &v);
            for block in [1, 2, 5, 64] {
                let got = causal_gqa_attention(&q, &k, &v, block).unwrap();
                let diff = (got - &want)
                    .unwrap()
                    .abs()
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .max(0)
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap();
                assert!(diff < 1e-5, "new {new} block {block}: {diff}");
            }
        }
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
    }

    #[test]
    fn fused_prefill_matches_the_plain_formula_across_tiles_with_a_cached_prefix() {
        // More queries than one query tile (256) and more keys than one key tile (512), a cached
        // prefix (the queries sit at positions 130..530), GQA 2 and 3, head dims 128 (the text
        // decoder's) and 12, keys and values as views of a cache with spare capacity. (Sized to
        // stay quick under .ci/run's emulated CPUs.)
        for (heads, kv, d, prefix, new) in [(2, 1, 128, 130, 400), (3, 1, 12, 0, 300)] {
            let total = prefix + new;
            let k_all = crate::testing::randn(250 + d as u64, 1., (kv, total, d)).unwrap();
            let v_all = crate::testing::randn(260 + d as u64, 1., (kv, total, d)).unwrap();
            let mut cache = crate::KvCache::new();
            cache.reserve(total + 37);
            if prefix > 0 {
                cache.append(&k_all.narrow(1, 0, prefix).unwrap(), &v_all.narrow(1, 0, prefix).unwrap()).unwrap();
            }
            let (k, v) =
                cache.append(&k_all.narrow(1, prefix, new).unwrap(), &v_all.narrow(1, prefix, new).unwrap()).unwrap();
            assert!(cache.capacity() > total, "the views must be strided");
            let q = crate::testing::randn(270 + d as u64, 1.5, (heads, new, d)).unwrap();
            assert!(causal_attention_cpu(&q, &k, &v).unwrap().is_some(), "the fused path applies");
            let got = causal_gqa_attention(&q, &k, &v, 256).unwrap();
            let diff = max_diff(&got, &naive(&q, &k_all, &v_all));
            assert!(diff < 1e-5, "heads {heads} kv {kv} d {d} prefix {prefix}: {diff}");
        }
        // Rows that are not d contiguous floats take the general (query-block) path, which
        // agrees.
        let (k_all, v_all) = (
            crate::testing::randn(280, 1., (2, 40, 16)).unwrap(),
            crate::testing::randn(281, 1., (2, 40, 24)).unwrap(),
        );
        let v = v_all.narrow(2, 0, 16).unwrap();
        let q = crate::testing::randn(282, 1., (4, 30, 16)).unwrap();
        assert!(causal_attention_cpu(&q, &k_all, &v).unwrap().is_none());
        let diff =
            max_diff(&causal_gqa_attention(&q, &k_all, &v, 7).unwrap(), &naive(&q, &k_all, &v.contiguous().unwrap()));
        assert!(diff < 1e-5, "general path: {diff}");
    }

    #[test]
    fn decode_reads_cache_views_in_place_and_matches_the_plain_formula() {
        // Head dims 128 (the real one: full 8-wide chunks), 48 and 64 (AVX-512: 16-lane steps
        // of the value rows, blocks of 4 query rows and their remainders) and 12 and 8 (not 16
        // wide: the generic loop), GQA 1, 2, 3, 5 and 8 (the MoE's 32 over 4), keys and values as
        // views of a cache with spare capacity (strided rows of heads).
        for (heads, kv, d, total) in
            [(16, 8, 128, 300), (32, 4, 128, 700), (12, 4, 48, 45), (5, 1, 64, 17), (6, 2, 12, 37), (4, 4, 8, 1)]
        {
            let mut cache = crate::KvCache::new();
            let k_all = crate::testing::randn(210 + d as u64, 1., (kv, total, d)).unwrap();
            let v_all = crate::testing::randn(220 + d as u64, 1., (kv, total, d)).unwrap();
            if total > 1 {
                cache.append(&k_all.narrow(1, 0, total - 1).unwrap(), &v_all.narrow(1, 0, total - 1).unwrap()).unwrap();
            }
            let (k, v) =
                cache.append(&k_all.narrow(1, total - 1, 1).unwrap(), &v_all.narrow(1, total - 1, 1).unwrap()).unwrap();
            assert!(cache.capacity() > total, "the views must be strided");
            let q = crate::testing::randn(230 + d as u64, 1., (heads, 1, d)).unwrap();
            let fast = decode_attention(&q, &k, &v).unwrap().expect("the in-place path applies");
            let want = naive(&q, &k_all, &v_all);
            let diff = (fast - &want).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap();
            let diff = diff.to_scalar::<f32>().unwrap();
            assert!(diff < 1e-5, "heads {heads} kv {kv} d {d} total {total}: {diff}");
        }
        // Not f32: the general path.
        let q = crate::testing::randn(240, 1., (2, 1, 8)).unwrap().to_dtype(DType::BF16).unwrap();
        let k = crate::testing::randn(241, 1., (1, 5, 8)).unwrap().to_dtype(DType::BF16).unwrap();
        assert!(decode_attention(&q, &k, &k).unwrap().is_none());
        assert_eq!(causal_gqa_attention(&q, &k, &k, 64).unwrap().dims(), &[2, 1, 8]);
    }

    #[test]
    fn a_batch_of_sequences_decodes_each_as_it_alone() {
        // Three sequences of different lengths (one of them a single position), as f32 and f16
        // caches with spare capacity: one region for all gives each sequence's decode alone bit
        // for bit, and the plain formula.
        for dtype in [DType::F32, DType::F16] {
            let (heads, kv, d) = (16, 8, 128);
            let mut caches: Vec<crate::KvCache> = (0..3).map(|_| crate::KvCache::in_dtype(dtype)).collect();
            let mut items = Vec::new();
            for (i, (cache, total)) in caches.iter_mut().zip([300usize, 1, 77]).enumerate() {
                let k_all = crate::testing::randn(400 + i as u64, 1., (kv, total, d)).unwrap();
                let v_all = crate::testing::randn(410 + i as u64, 1., (kv, total, d)).unwrap();
                let (k, v) = cache.append(&k_all, &v_all).unwrap();
                let q = crate::testing::randn(420 + i as u64, 1., (heads, 1, d)).unwrap();
                let widen = |t: &Tensor| t.to_dtype(dtype).unwrap().to_dtype(DType::F32).unwrap();
                let want = naive(&q, &widen(&k_all), &widen(&v_all));
                items.push((q, k, v, want));
            }
            let refs: Vec<_> = items.iter().map(|(q, k, v, _)| (q, k, v)).collect();
            let all = crate::decode_attention_many(&refs).unwrap().expect("the in-place path applies");
            assert_eq!(all.len(), 3);
            for (out, (q, k, v, want)) in all.iter().zip(&items) {
                let alone = decode_attention(q, k, v).unwrap().unwrap();
                let (a, b) = (
                    out.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                    alone.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                );
                assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "{dtype:?}");
                assert!(max_diff(out, want) < 1e-5, "{dtype:?}");
            }
        }
        assert!(crate::decode_attention_many(&[]).unwrap().unwrap().is_empty());
        // A bf16 query: none, as for one sequence.
        let q = crate::testing::randn(430, 1., (2, 1, 8)).unwrap().to_dtype(DType::BF16).unwrap();
        let k = crate::testing::randn(431, 1., (1, 5, 8)).unwrap().to_dtype(DType::BF16).unwrap();
        assert!(crate::decode_attention_many(&[(&q, &k, &k)]).unwrap().is_none());
    }

    #[test]
    fn a_half_precision_cache_is_read_as_its_widened_values() {
        // An f16 / bf16 cache (`KvCache::in_dtype`) under f32 queries: decode reads its rows in
        // place, a prompt's block widens them; both give the plain formula on the rounded values
        // (the same f32 arithmetic on the same numbers), for the shapes of the test above and a
        // cached prefix under a prompt's queries.
        for dtype in [DType::F16, DType::BF16] {
            for (heads, kv, d, total) in
                [(16, 8, 128, 300), (32, 4, 128, 700), (12, 4, 48, 45), (5, 1, 64, 17), (6, 2, 12, 37), (4, 4, 8, 1)]
            {
                let mut cache = crate::KvCache::in_dtype(dtype);
                let k_all = crate::testing::randn(310 + d as u64, 1., (kv, total, d)).unwrap();
                let v_all = crate::testing::randn(320 + d as u64, 1., (kv, total, d)).unwrap();
                let new = 9.min(total);
                if total > new {
                    cache
                        .append(&k_all.narrow(1, 0, total - new).unwrap(), &v_all.narrow(1, 0, total - new).unwrap())
                        .unwrap();
                }
                let (k, v) = cache
                    .append(&k_all.narrow(1, total - new, new).unwrap(), &v_all.narrow(1, total - new, new).unwrap())
                    .unwrap();
                assert_eq!((k.dtype(), v.dtype()), (dtype, dtype));
                assert_eq!(cache.bytes(), 2 * kv * cache.capacity() * d * 2, "two bytes a value");
                let widen = |t: &Tensor| t.to_dtype(dtype).unwrap().to_dtype(DType::F32).unwrap();
                let (kw, vw) = (widen(&k_all), widen(&v_all));
                let q = crate::testing::randn(330 + d as u64, 1., (heads, 1, d)).unwrap();
                let fast = decode_attention(&q, &k, &v).unwrap().expect("the in-place path applies");
                let diff = max_diff(&fast, &naive(&q, &kw, &vw));
                assert!(diff < 1e-5, "{dtype:?} decode heads {heads} kv {kv} d {d} total {total}: {diff}");
                let q = crate::testing::randn(340 + d as u64, 1., (heads, new, d)).unwrap();
                assert!(causal_attention_cpu(&q, &k, &v).unwrap().is_some(), "the fused path applies");
                let diff = max_diff(&causal_gqa_attention(&q, &k, &v, 4).unwrap(), &naive(&q, &kw, &vw));
                assert!(diff < 1e-5, "{dtype:?} prompt heads {heads} kv {kv} d {d} total {total}: {diff}");
            }
            // Rows that are not d contiguous elements: the general path, the cache widened whole.
            let k = crate::testing::randn(350, 1., (2, 40, 16)).unwrap().to_dtype(dtype).unwrap();
            let v_all = crate::testing::randn(351, 1., (2, 40, 24)).unwrap().to_dtype(dtype).unwrap();
            let v = v_all.narrow(2, 0, 16).unwrap();
            let q = crate::testing::randn(352, 1., (4, 30, 16)).unwrap();
            assert!(causal_attention_cpu(&q, &k, &v).unwrap().is_none());
            let widen = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
            let want = naive(&q, &widen(&k), &widen(&v.contiguous().unwrap()));
            let diff = max_diff(&causal_gqa_attention(&q, &k, &v, 7).unwrap(), &want);
            assert!(diff < 1e-5, "{dtype:?} general path: {diff}");
        }
    }

    #[test]
    fn the_first_position_sees_only_itself() {
        // Hand-computed: row 0 of a prefill output equals v[0] whatever the scores.
        let dev = Device::Cpu;
        let q = crate::testing::randn(207, 1., (2, 3, 2)).unwrap();
        let k = crate::testing::randn(208, 1., (1, 3, 2)).unwrap();
        let v = Tensor::new(&[[[1f32, 2.], [3., 4.], [5., 6.]]], &dev).unwrap();
        let out = causal_gqa_attention(&q, &k, &v, 256).unwrap();
        for h in 0..2 {
            assert_eq!(out.get(h).unwrap().get(0).unwrap().to_vec1::<f32>().unwrap(), vec![1., 2.]);
        }
    }
}
