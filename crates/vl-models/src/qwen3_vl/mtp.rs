//! Qwen3.5's multi-token-prediction head (`mtp.*`, which transformers skips), as vLLM's
//! `qwen3_5_mtp.py` runs it: for a position p, the model's final (normed) hidden row h_p and the
//! token x_{p+1} after it become `fc(concat(pre_fc_norm_embedding(embed(x_{p+1})),
//! pre_fc_norm_hidden(h_p)))`, which one full-attention decoder layer (gated attention, M-RoPE at
//! p's position, its own KV cache; the model's MLP kind, routed experts for MoE) and `norm` turn
//! into a row whose logits (the model's lm_head) predict x_{p+2}. A further draft feeds that
//! output row back as h, with the drafted token, one position on.

use candle_core::{Module, Tensor};
use candle_nn::{RmsNorm, VarBuilder};
use vl_nn::QLinear;

use super::config::TextConfig;
use super::linears::{linear_no_bias, LoadPlan};
use super::text::{rms_norm, unit_offset_norms, Attend, DecoderLayer, TextCache};
use crate::error::Result;

/// The checkpoint key whose presence says a checkpoint carries the head.
pub const FC_KEY: &str = "mtp.fc.weight";

#[derive(Debug, Clone)]
pub(super) struct MtpHead {
    fc: QLinear,
    pre_embedding: RmsNorm,
    pre_hidden: RmsNorm,
    layer: DecoderLayer,
    norm: RmsNorm,
}

impl MtpHead {
    /// The head from `vb` at the checkpoint root (`mtp.*`): one layer (`mtp_num_hidden_layers`
    /// other than 1 is refused at config reading).
    pub(super) fn load(cfg: &TextConfig, vb: VarBuilder, plan: LoadPlan) -> Result<Self> {
        let (d, eps, offset) = (cfg.hidden_size, cfg.rms_norm_eps, unit_offset_norms(cfg));
        let vb = vb.pp("mtp");
        Ok(Self {
            fc: linear_no_bias(2 * d, d, vb.pp("fc"), plan)?,
            pre_embedding: rms_norm(d, eps, vb.pp("pre_fc_norm_embedding"), offset)?,
            pre_hidden: rms_norm(d, eps, vb.pp("pre_fc_norm_hidden"), offset)?,
            // Its MLP is the decoder's kind: numbered past the decoder's layers.
            layer: DecoderLayer::load_kind(cfg, cfg.num_hidden_layers, false, vb.pp("layers.0"), plan)?,
            norm: rms_norm(d, eps, vb.pp("norm"), offset)?,
        })
    }

    pub(super) fn layer(&self) -> &DecoderLayer {
        &self.layer
    }

    pub(super) fn layer_mut(&mut self) -> &mut DecoderLayer {
        &mut self.layer
    }

    pub(super) fn linears(&self) -> Vec<&QLinear> {
        let mut all = vec![&self.fc];
        all.extend(self.layer.linears());
        all
    }

    /// The head's output rows [rows, hidden] for embeddings `embedded` ([rows, hidden], the
    /// tokens after each position) and hidden rows `hidden`, rotated by `(cos, sin)`; `lens[i]`
    /// rows continue `states[i]` (one attention layer).
    pub(super) fn forward(
        &self,
        embedded: &Tensor,
        hidden: &Tensor,
        rope: (&Tensor, &Tensor),
        states: &mut [&mut TextCache],
        lens: &[usize],
        attend: Attend,
    ) -> Result<Tensor> {
        let e = self.pre_embedding.forward(embedded)?;
        let h = self.pre_hidden.forward(&hidden.to_dtype(e.dtype())?)?;
        let x = self.fc.forward(&Tensor::cat(&[&e, &h], 1)?)?;
        let x = self.layer.forward_rows(&x, rope, states, lens, 0, attend)?;
        Ok(self.norm.forward(&x)?)
    }
}
