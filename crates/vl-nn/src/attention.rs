//! Bidirectional rotary attention over packed segments (one segment per image or video frame):
//! fused qkv projection, rotary on q and k, attention confined to each segment, output
//! projection. On CPU in f32 the core is `kernels::segment_attention` (query and key tiles,
//! online softmax: the live scores are one tile per thread). Elsewhere queries are processed in
//! blocks, so the score matrix resident at once is `heads x query_block x segment_len`, never
//! `heads x segment_len^2`.

use candle_core::{DType, Tensor};
use candle_nn::Linear;

use crate::dispatch::{own_kernel_for, Op};
use crate::kernels::{cpu_f32, SendPtr};
use crate::linear::{Dense, Then};

use crate::{Error, Result};

/// Default number of query rows per block: with 16 heads and a 4096-patch image the live score
/// block is 16 x 256 x 4096 f32 = 64 MiB (a full matrix would be 1 GiB).
pub const DEFAULT_QUERY_BLOCK: usize = 256;

#[derive(Debug, Clone)]
pub struct SegmentRotaryAttention {
    qkv: Dense,
    proj: Dense,
    num_heads: usize,
    head_dim: usize,
    query_block: usize,
    key_block: usize,
    /// The CPU core's tile products on AMX bf16 tiles (`to_bf16`).
    bf16: bool,
}

impl SegmentRotaryAttention {
    /// `qkv` maps hidden -> 3 * hidden (q | k | v, heads contiguous within each); `proj` maps back.
    pub fn new(qkv: &Linear, proj: &Linear, num_heads: usize, head_dim: usize) -> Result<Self> {
        Ok(Self {
            qkv: Dense::from_linear(qkv)?,
            proj: Dense::from_linear(proj)?,
            num_heads,
            head_dim,
            query_block: DEFAULT_QUERY_BLOCK,
            key_block: crate::kernels::KEY_TILE,
            bf16: false,
        })
    }

    /// The same layer with its weights in `dtype` (stored weights upcast for a forward).
    pub fn to_dtype(&self, dtype: DType) -> Result<Self> {
        Ok(Self { qkv: self.qkv.to_dtype(dtype)?, proj: self.proj.to_dtype(dtype)?, ..self.clone() })
    }

    /// The same attention with both projections on bf16 products (`Dense::to_bf16`) and, for a
    /// head dimension of 64, the CPU core's two products on AMX bf16 tiles too
    /// (`kernels::TileKernel::AmxBf16`; its softmax stays f32).
    pub fn to_bf16(&self) -> Result<Self> {
        Ok(Self { qkv: self.qkv.to_bf16()?, proj: self.proj.to_bf16()?, bf16: true, ..self.clone() })
    }

    /// Rows of queries processed at once (the memory/speed trade-off), at least 1; the fused CPU
    /// kernel uses at most `kernels::QUERY_TILE` of them per tile.
    pub fn with_query_block(mut self, rows: usize) -> Self {
        self.query_block = rows.max(1);
        self
    }

    /// Rows of keys per tile of the fused CPU kernel (at least 1; default `kernels::KEY_TILE`).
    pub fn with_key_block(mut self, rows: usize) -> Self {
        self.key_block = rows.max(1);
        self
    }

    /// `x`: [seq, hidden]; `cos`/`sin`: [seq, head_dim / 2]; `cu_seqlens`: segment boundaries
    /// `[0, ..., seq]`. Returns [seq, hidden].
    pub fn forward(&self, x: &Tensor, cos: &Tensor, sin: &Tensor, cu_seqlens: &[usize]) -> Result<Tensor> {
        self.forward_then(x, cos, sin, cu_seqlens, Then::Nothing)
    }

    /// `residual + forward(x, ...)` (a pre-norm block's `h + attn(norm(h))`), the sum taken by the
    /// output projection as it writes its tiles (`Then::Add`).
    pub fn forward_add(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        cu_seqlens: &[usize],
        residual: &Tensor,
    ) -> Result<Tensor> {
        self.forward_then(x, cos, sin, cu_seqlens, Then::Add(residual))
    }

    fn forward_then(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        cu_seqlens: &[usize],
        then: Then<'_>,
    ) -> Result<Tensor> {
        let (seq, hidden) = x.dims2()?;
        if cu_seqlens.first() != Some(&0)
            || cu_seqlens.last() != Some(&seq)
            || cu_seqlens.windows(2).any(|w| w[0] > w[1])
        {
            return Err(Error::Shape {
                layer: "SegmentRotaryAttention",
                message: format!("segment boundaries {cu_seqlens:?} do not cover {seq} rows"),
            });
        }
        let (h, d) = (self.num_heads, self.head_dim);
        let qkv = self.qkv.forward(x)?;
        if let Some(out) = self.fused(&qkv, cos, sin, cu_seqlens)? {
            return self.proj.forward_then(&out, then);
        }
        // [seq, 3, heads, d] -> [3, heads, seq, d]
        let qkv = qkv.reshape((seq, 3, h, d))?.permute((1, 2, 0, 3))?;
        let q = qkv.get(0)?.unsqueeze(0)?.contiguous()?;
        let k = qkv.get(1)?.unsqueeze(0)?.contiguous()?;
        let v = qkv.get(2)?.contiguous()?;
        let dtype = q.dtype();
        // Rotary in f32, as the reference does, then back to the compute dtype.
        let (cos, sin) = (cos.to_dtype(DType::F32)?, sin.to_dtype(DType::F32)?);
        let q = candle_nn::rotary_emb::rope(&q.to_dtype(DType::F32)?, &cos, &sin)?.to_dtype(dtype)?.squeeze(0)?;
        let k = candle_nn::rotary_emb::rope(&k.to_dtype(DType::F32)?, &cos, &sin)?.to_dtype(dtype)?.squeeze(0)?;
        // Scaling q (seq x d values) instead of the scores (heads x rows x seq per block) saves a
        // full pass over the largest tensor of the layer.
        let q = (q * (1.0 / (d as f64).sqrt()))?;

        let mut outs = Vec::new();
        for w in cu_seqlens.windows(2) {
            let (start, len) = (w[0], w[1] - w[0]);
            if len == 0 {
                continue;
            }
            let ks = k.narrow(1, start, len)?.t()?.contiguous()?; // [h, d, len]
            let vs = v.narrow(1, start, len)?.contiguous()?; // [h, len, d]
            let mut qb = 0;
            while qb < len {
                let rows = self.query_block.min(len - qb);
                let qs = q.narrow(1, start + qb, rows)?.contiguous()?; // [h, rows, d]
                let scores = qs.matmul(&ks)?;
                let probs = candle_nn::ops::softmax_last_dim(&scores.to_dtype(DType::F32)?)?.to_dtype(dtype)?;
                outs.push(probs.matmul(&vs)?); // [h, rows, d]
                qb += rows;
            }
        }
        let out = Tensor::cat(&outs, 1)?.transpose(0, 1)?.reshape((seq, hidden))?;
        self.proj.forward_then(&out, then)
    }
}

impl SegmentRotaryAttention {
    /// The CPU f32 path: `kernels::segment_attention` on the projection's output, read in place.
    /// None elsewhere (other devices and dtypes take the blocked tensor path).
    fn fused(&self, qkv: &Tensor, cos: &Tensor, sin: &Tensor, cu: &[usize]) -> Result<Option<Tensor>> {
        if !own_kernel_for(Op::SegmentAttention, &[qkv]) {
            return Ok(None);
        }
        let (seq, cols) = qkv.dims2()?;
        let (h, d) = (self.num_heads, self.head_dim);
        let half = d / 2;
        if cols != 3 * h * d || d % 2 != 0 || cos.dims() != [seq, half] || sin.dims() != [seq, half] {
            return Err(Error::Shape {
                layer: "SegmentRotaryAttention",
                message: format!(
                    "qkv {:?}, cos {:?}, sin {:?} for {h} heads of {d}",
                    qkv.dims(),
                    cos.dims(),
                    sin.dims()
                ),
            });
        }
        let qkv = qkv.contiguous()?;
        let cos = cos.to_dtype(DType::F32)?.contiguous()?;
        let sin = sin.to_dtype(DType::F32)?.contiguous()?;
        let (qs, ql) = qkv.storage_and_layout();
        let (cs, cl) = cos.storage_and_layout();
        let (ss, sl) = sin.storage_and_layout();
        let (Some(qs), Some(cs), Some(ss)) = (cpu_f32(&qs), cpu_f32(&cs), cpu_f32(&ss)) else {
            return Ok(None);
        };
        let qkv_rows = &qs[ql.start_offset()..ql.start_offset() + seq * cols];
        let cos_rows = &cs[cl.start_offset()..cl.start_offset() + seq * half];
        let sin_rows = &ss[sl.start_offset()..sl.start_offset() + seq * half];
        let shape = crate::kernels::SegmentAttentionShape {
            seq,
            heads: h,
            head_dim: d,
            query_tile: self.query_block.min(crate::kernels::QUERY_TILE),
            key_tile: self.key_block,
        };
        let mut out = vec![0f32; seq * h * d];
        let kernel = if self.bf16 { crate::kernels::TileKernel::AmxBf16 } else { crate::kernels::TileKernel::best() };
        crate::kernels::segment_attention_with(kernel, qkv_rows, cos_rows, sin_rows, cu, shape, &mut out);
        Ok(Some(Tensor::from_vec(out, (seq, h * d), qkv.device())?))
    }
}

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
/// heads on candle's pool, key tiles with the online softmax, the cache's views read in place).
/// None when the inputs are not CPU f32 with unit-stride rows of `d` (the caller then takes the
/// general path).
fn causal_attention_cpu(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Option<Tensor>> {
    let (heads, new, d) = q.dims3()?;
    let (kv, total, _) = k.dims3()?;
    if !own_kernel_for(Op::CausalAttention, &[q, k, v]) || v.dims3()? != (kv, total, d) {
        return Ok(None);
    }
    let q = q.contiguous()?;
    let ((qs, ql), (ks, kl), (vs, vl)) = (q.storage_and_layout(), k.storage_and_layout(), v.storage_and_layout());
    let (Some(qs), Some(ks), Some(vs)) = (cpu_f32(&qs), cpu_f32(&ks), cpu_f32(&vs)) else {
        return Ok(None);
    };
    let (kst, vst) = (kl.stride(), vl.stride());
    // Rows of d contiguous floats, heads at one stride for k and v.
    if kst[2] != 1 || vst[2] != 1 || kst[1] != d || vst[1] != d || kst[0] != vst[0] || kst[0] < total * d {
        return Ok(None);
    }
    let span = (kv - 1) * kst[0] + total * d;
    let (qo, ko, vo) = (ql.start_offset(), kl.start_offset(), vl.start_offset());
    if ko + span > ks.len() || vo + span > vs.len() || qo + heads * new * d > qs.len() {
        return Ok(None);
    }
    let mut out = vec![0f32; heads * new * d];
    crate::kernels::causal_attention(
        &qs[qo..qo + heads * new * d],
        (heads, new, d),
        &ks[ko..ko + span],
        &vs[vo..vo + span],
        (kv, kst[0], total),
        &mut out,
    );
    Ok(Some(Tensor::from_vec(out, (heads, new, d), q.device())?))
}

/// One query row per head against the whole cache, read in place (decode): for each KV head,
/// each cached key row is read once for all `rep` query heads sharing it, then softmax, then the
/// weighted sum of value rows. Runs on candle's own worker pool (one KV head per work item), so
/// it never competes with the pool's spinning workers. None when the inputs are not CPU f32
/// with unit-stride rows; the caller then takes the general path.
fn decode_attention(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Option<Tensor>> {
    let (heads, _, d) = q.dims3()?;
    let (kv, total, _) = k.dims3()?;
    let rep = heads / kv;
    if !own_kernel_for(Op::DecodeAttention, &[q, k, v]) {
        return Ok(None);
    }
    let q = q.contiguous()?;
    let ((qs, ql), (ks, kl), (vs, vl)) = (q.storage_and_layout(), k.storage_and_layout(), v.storage_and_layout());
    let (Some(qs), Some(ks), Some(vs)) = (cpu_f32(&qs), cpu_f32(&ks), cpu_f32(&vs)) else {
        return Ok(None);
    };
    let (qo, ko, vo) = (ql.start_offset(), kl.start_offset(), vl.start_offset());
    let (kst, vst) = (kl.stride(), vl.stride());
    if kst[2] != 1 || vst[2] != 1 || (total > 1 && (kst[1] < d || vst[1] < d)) {
        return Ok(None);
    }
    let (k_head, k_row, v_head, v_row) = (kst[0], kst[1], vst[0], vst[1]);
    let last = |o: usize, hs: usize, rs: usize| o + (kv - 1) * hs + (total - 1) * rs + d;
    if last(ko, k_head, k_row) > ks.len() || last(vo, v_head, v_row) > vs.len() || qo + heads * d > qs.len() {
        return Ok(None);
    }
    let scale = 1.0 / (d as f32).sqrt();
    let mut out = vec![0f32; heads * d];
    let out_ptr = SendPtr(out.as_mut_ptr());
    candle_core::utils::barrier_pool().execute_chunked(kv, |range| {
        // Each query row's scores, then (AVX-512 kernel) each row's softmax sum.
        let mut scores = vec![0f32; rep * (total + 1)];
        for g in range {
            let group = DecodeGroup {
                q: &qs[qo + g * rep * d..qo + (g + 1) * rep * d],
                k: &ks[ko + g * k_head..],
                k_row,
                v: &vs[vo + g * v_head..],
                v_row,
                total,
                d,
                rep,
                scale,
            };
            // SAFETY: work items are distinct KV heads, writing disjoint rows of `out`.
            let og = unsafe { std::slice::from_raw_parts_mut(out_ptr.get().add(g * rep * d), rep * d) };
            decode_group(&group, &mut scores, og);
        }
    });
    Ok(Some(Tensor::from_vec(out, (heads, 1, d), q.device())?))
}

/// One KV head's decode work: its `rep` query rows, its cached key and value rows (`total` of
/// them, `k_row` / `v_row` floats apart), head size `d`.
struct DecodeGroup<'a> {
    q: &'a [f32],
    k: &'a [f32],
    k_row: usize,
    v: &'a [f32],
    v_row: usize,
    total: usize,
    d: usize,
    rep: usize,
    scale: f32,
}

/// `scores`: scratch of at least `rep * (total + 1)` floats.
fn decode_group(g: &DecodeGroup<'_>, scores: &mut [f32], out: &mut [f32]) {
    #[cfg(all(target_arch = "x86_64", not(vl_avx2_proxy)))]
    if g.d.is_multiple_of(16) && crate::has_avx512() {
        // SAFETY: the CPU has AVX-512F (checked above) and d is a multiple of 16.
        unsafe { decode_group_avx512(g, scores, out) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has AVX2 and FMA (checked above).
        unsafe { decode_group_avx2(g, scores, out) };
        return;
    }
    decode_group_generic(g, scores, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn decode_group_avx2(g: &DecodeGroup<'_>, scores: &mut [f32], out: &mut [f32]) {
    decode_group_generic(g, scores, out)
}

/// `decode_group` on AVX-512F, head size `d` a multiple of 16. The generic loop is latency-bound
/// (one dot product at a time into one vector of sums, then a scalar `exp` per score); here each
/// key row meets up to four query rows at once (four independent chains of sums sharing the
/// key's loads), the softmax runs 16 scores at a time in base 2 (`avx512::exp2`'s polynomial,
/// the scores scaled by `log2 e`), and each value row is read once for up to four query rows
/// and 64 of their output lanes held in registers. The normalization is applied to the output
/// rows at the end.
#[cfg(all(target_arch = "x86_64", not(vl_avx2_proxy)))]
#[target_feature(enable = "avx512f")]
unsafe fn decode_group_avx512(g: &DecodeGroup<'_>, scores: &mut [f32], out: &mut [f32]) {
    use crate::avx512::{exp2, LANES};
    use std::arch::x86_64::*;
    let &DecodeGroup { q, k, k_row, v, v_row, total, d, rep, scale } = g;
    if total == 0 {
        // No key: zeros, as the generic loop gives (not a softmax over nothing).
        out[..rep * d].fill(0.0);
        return;
    }
    assert!(d.is_multiple_of(LANES) && q.len() >= rep * d && scores.len() >= rep * (total + 1) && out.len() >= rep * d);
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
                4 => qk_rows::<4>(qr, d, kj, s, total, scale2),
                3 => qk_rows::<3>(qr, d, kj, s, total, scale2),
                2 => qk_rows::<2>(qr, d, kj, s, total, scale2),
                _ => qk_rows::<1>(qr, d, kj, s, total, scale2),
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
    // four rows at a time.
    let op = out.as_mut_ptr();
    let wide = d.is_multiple_of(4 * LANES);
    let step = if wide { 4 * LANES } else { LANES };
    let mut r = 0;
    while r < rep {
        let n = (rep - r).min(4);
        for c in (0..d).step_by(step) {
            let (p, vc, o) = (sp.add(r * total), v.as_ptr().add(c), op.add(r * d + c));
            match (n, wide) {
                (4, true) => pv_rows::<4, 4>(p, total, vc, v_row, o, d),
                (3, true) => pv_rows::<3, 4>(p, total, vc, v_row, o, d),
                (2, true) => pv_rows::<2, 4>(p, total, vc, v_row, o, d),
                (_, true) => pv_rows::<1, 4>(p, total, vc, v_row, o, d),
                (4, false) => pv_rows::<4, 1>(p, total, vc, v_row, o, d),
                (3, false) => pv_rows::<3, 1>(p, total, vc, v_row, o, d),
                (2, false) => pv_rows::<2, 1>(p, total, vc, v_row, o, d),
                (_, false) => pv_rows::<1, 1>(p, total, vc, v_row, o, d),
            }
        }
        r += n;
    }
    for (r, sum) in sums[..rep].iter().enumerate() {
        let inv = _mm512_set1_ps(1.0 / sum);
        for c in (0..d).step_by(LANES) {
            let o = op.add(r * d + c);
            _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_loadu_ps(o), inv));
        }
    }
}

/// N query rows (`d` apart from `q`) dotted with one key row, scaled, written `stride` apart
/// from `s`.
#[cfg(all(target_arch = "x86_64", not(vl_avx2_proxy)))]
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn qk_rows<const N: usize>(q: *const f32, d: usize, kj: *const f32, s: *mut f32, stride: usize, scale: f32) {
    use std::arch::x86_64::*;
    let mut acc = [_mm512_setzero_ps(); N];
    for c in (0..d).step_by(16) {
        let kv = _mm512_loadu_ps(kj.add(c));
        for (i, a) in acc.iter_mut().enumerate() {
            *a = _mm512_fmadd_ps(_mm512_loadu_ps(q.add(i * d + c)), kv, *a);
        }
    }
    for (i, a) in acc.iter().enumerate() {
        *s.add(i * stride) = _mm512_reduce_add_ps(*a) * scale;
    }
}

/// `out[i][0..16 W] = sum_j p[i][j] v[j][0..16 W]` for N rows of weights (`total` apart from `p`)
/// and of output (`d` apart from `o`), value rows `v_row` apart from `v`.
#[cfg(all(target_arch = "x86_64", not(vl_avx2_proxy)))]
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn pv_rows<const N: usize, const W: usize>(
    p: *const f32,
    total: usize,
    v: *const f32,
    v_row: usize,
    o: *mut f32,
    d: usize,
) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm512_setzero_ps(); W]; N];
    for j in 0..total {
        let vj = v.add(j * v_row);
        let mut vs = [_mm512_setzero_ps(); W];
        for (w, x) in vs.iter_mut().enumerate() {
            *x = _mm512_loadu_ps(vj.add(16 * w));
        }
        for (i, row) in acc.iter_mut().enumerate() {
            let pi = _mm512_set1_ps(*p.add(i * total + j));
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

/// Dot product with eight independent partial sums (vectorizes; the order is fixed).
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ac, ar) = a.as_chunks::<8>();
    let (bc, br) = b.as_chunks::<8>();
    for (x, y) in ac.iter().zip(bc) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (x, y) in ar.iter().zip(br) {
        s += x * y;
    }
    s
}

#[inline(always)]
fn decode_group_generic(g: &DecodeGroup<'_>, scores: &mut [f32], out: &mut [f32]) {
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
                *o += p * x;
            }
        }
    }
}

/// Reference implementation for tests: full score matrix per segment, no blocking.
#[cfg(test)]
pub(crate) fn naive_segment_attention(q: &Tensor, k: &Tensor, v: &Tensor, cu: &[usize]) -> Result<Tensor> {
    // q, k, v: [heads, seq, d]
    let d = q.dim(candle_core::D::Minus1)?;
    let mut outs = Vec::new();
    for w in cu.windows(2) {
        let (s, l) = (w[0], w[1] - w[0]);
        let (qs, ks, vs) = (q.narrow(1, s, l)?, k.narrow(1, s, l)?, v.narrow(1, s, l)?);
        let sc = (qs.matmul(&ks.t()?)? / (d as f64).sqrt())?;
        outs.push(candle_nn::ops::softmax_last_dim(&sc)?.matmul(&vs)?);
    }
    Ok(Tensor::cat(&outs, 1)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn identity_linear(n: usize) -> Linear {
        Linear::new(Tensor::eye(n, DType::F32, &Device::Cpu).unwrap(), None)
    }

    /// qkv that copies x into q, k and v; rotary with zero angles is the identity.
    fn attn(hidden: usize, heads: usize) -> SegmentRotaryAttention {
        let eye = Tensor::eye(hidden, DType::F32, &Device::Cpu).unwrap();
        let w = Tensor::cat(&[&eye, &eye, &eye], 0).unwrap();
        SegmentRotaryAttention::new(&Linear::new(w, None), &identity_linear(hidden), heads, hidden / heads).unwrap()
    }

    #[test]
    fn two_identical_rows_in_one_segment_average_their_values() {
        // Hand-computed: with equal keys, softmax is uniform, so each output is the mean of v.
        let a = attn(4, 1);
        let x = Tensor::new(&[[1f32, 0., 0., 0.], [1., 0., 0., 0.]], &Device::Cpu).unwrap();
        let zeros = Tensor::zeros((2, 2), DType::F32, &Device::Cpu).unwrap();
        let ones = Tensor::ones((2, 2), DType::F32, &Device::Cpu).unwrap();
        let y = a.forward(&x, &ones, &zeros, &[0, 2]).unwrap().to_vec2::<f32>().unwrap();
        assert_eq!(y, vec![vec![1.0, 0.0, 0.0, 0.0]; 2]);
    }

    #[test]
    fn segments_never_see_each_other() {
        // Each row alone in its segment attends only to itself: output == input.
        let a = attn(4, 2);
        let x = Tensor::new(&[[1f32, 2., 3., 4.], [-1., 5., 0.5, 2.], [3., -2., 1., 0.]], &Device::Cpu).unwrap();
        let zeros = Tensor::zeros((3, 1), DType::F32, &Device::Cpu).unwrap();
        let ones = Tensor::ones((3, 1), DType::F32, &Device::Cpu).unwrap();
        let y = a.forward(&x, &ones, &zeros, &[0, 1, 2, 3]).unwrap();
        assert_eq!(y.to_vec2::<f32>().unwrap(), x.to_vec2::<f32>().unwrap());
    }

    #[test]
    fn query_blocking_does_not_change_the_result() {
        let (hidden, heads, seq) = (8, 2, 37);
        let x = crate::testing::randn(201, 1., (seq, hidden)).unwrap();
        let wq = crate::testing::randn(202, 0.5, (3 * hidden, hidden)).unwrap();
        let a = SegmentRotaryAttention::new(
            &Linear::new(wq.clone(), None),
            &identity_linear(hidden),
            heads,
            hidden / heads,
        )
        .unwrap();
        let ang = crate::testing::randn(203, 1., (seq, 2)).unwrap();
        let (cos, sin) = (ang.cos().unwrap(), ang.sin().unwrap());
        let cu = [0, 20, 37];
        let full = a.clone().with_query_block(1000).forward(&x, &cos, &sin, &cu).unwrap();
        for block in [1, 3, 7, 16] {
            let b = a.clone().with_query_block(block).forward(&x, &cos, &sin, &cu).unwrap();
            let diff = (b - &full).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(diff < 1e-6, "block {block}: {diff}");
        }
        // And it equals the unblocked reference formula.
        let qkv =
            x.matmul(&wq.t().unwrap()).unwrap().reshape((seq, 3, heads, 4)).unwrap().permute((1, 2, 0, 3)).unwrap();
        let rot = |t: Tensor| {
            candle_nn::rotary_emb::rope(&t.unsqueeze(0).unwrap().contiguous().unwrap(), &cos, &sin)
                .unwrap()
                .squeeze(0)
                .unwrap()
        };
        let (q, k, v) = (rot(qkv.get(0).unwrap()), rot(qkv.get(1).unwrap()), qkv.get(2).unwrap().contiguous().unwrap());
        let want =
            naive_segment_attention(&q, &k, &v, &cu).unwrap().transpose(0, 1).unwrap().reshape((seq, hidden)).unwrap();
        let diff = (full - want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(diff < 1e-5, "{diff}");
    }

    #[test]
    fn bad_boundaries_are_an_error() {
        let a = attn(4, 1);
        let x = Tensor::zeros((3, 4), DType::F32, &Device::Cpu).unwrap();
        let t = Tensor::zeros((3, 2), DType::F32, &Device::Cpu).unwrap();
        let err = a.forward(&x, &t, &t, &[0, 2]).unwrap_err().to_string();
        assert!(err.contains("[0, 2]") && err.contains("3 rows"), "{err}");
    }
}

#[cfg(test)]
mod causal_tests {
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
