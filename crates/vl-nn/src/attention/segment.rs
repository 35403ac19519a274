//! The vision tower's attention: fused qkv projection, rotary on q and k, attention confined to
//! each segment (one per image or video frame), output projection.

use candle_core::{DType, Tensor};
use candle_nn::Linear;

use crate::cpu::cpu_f32;
use crate::dispatch::{own_kernel_for, Op};
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
    /// The CPU f32 path: `kernels::segment_attention_with` on the projection's output, read in place.
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

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Reference implementation for tests: full score matrix per segment, no blocking.
    fn naive_segment_attention(q: &Tensor, k: &Tensor, v: &Tensor, cu: &[usize]) -> Result<Tensor> {
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
