//! The text decoder's MLPs, mirroring transformers' `Qwen3VLTextMLP`, the routed experts of
//! `Qwen3VLMoeTextSparseMoeBlock` (fused, stacked per matrix, one tensor per expert, or a GGUF
//! file's 3-D tensors) and Qwen3.5 MoE's gated shared expert; how the experts multiply
//! (`VL_MOE_EXPERTS`, `VL_MOE_STORED_ROWS`).

use candle_core::Tensor;
use candle_nn::VarBuilder;
use vl_nn::{QLinear, SparseMoe, SwiGluExpert};

use super::config::TextConfig;
use super::linears::{linear_no_bias, LoadPlan};
use crate::error::{Error, Result};

#[derive(Debug, Clone)]
pub(super) struct Mlp {
    gate: QLinear,
    up: QLinear,
    down: QLinear,
}

impl Mlp {
    fn load(cfg: &TextConfig, vb: VarBuilder, qt: LoadPlan) -> Result<Self> {
        Self::load_sized(cfg.hidden_size, cfg.intermediate_size, vb, qt)
    }

    fn load_sized(d: usize, i: usize, vb: VarBuilder, qt: LoadPlan) -> Result<Self> {
        Ok(Self {
            gate: linear_no_bias(d, i, vb.pp("gate_proj"), qt)?,
            up: linear_no_bias(d, i, vb.pp("up_proj"), qt)?,
            down: linear_no_bias(i, d, vb.pp("down_proj"), qt)?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let [gate, up] = QLinear::forward_each([&self.gate, &self.up], x)?;
        let h = vl_nn::kernels::silu_mul(&gate, &up)?;
        Ok(self.down.forward(&h)?)
    }
}

/// Qwen3.5 MoE's shared expert: a SwiGLU MLP whose output is scaled by
/// sigmoid(`gate` x) before it joins the routed experts'.
#[derive(Debug, Clone)]
pub(super) struct SharedExpert {
    mlp: Mlp,
    gate: QLinear,
}

/// A layer's MLP: dense SwiGLU, or routed experts (`Qwen3VLMoeTextSparseMoeBlock`; with a
/// shared expert, `Qwen3_5MoeSparseMoeBlock`).
#[derive(Debug, Clone)]
pub(super) enum Ffn {
    Dense(Mlp),
    Sparse(SparseMoe, Option<Box<SharedExpert>>),
}

impl Ffn {
    /// Layer `i`'s MLP (`vb` at `mlp`): routed experts where the config makes it sparse (with
    /// Qwen3.5 MoE's gated shared expert when it names one), else dense.
    pub(super) fn load(cfg: &TextConfig, i: usize, vb: VarBuilder, qt: LoadPlan) -> Result<Self> {
        if !cfg.is_sparse(i) {
            return Ok(Ffn::Dense(Mlp::load(cfg, vb, qt)?));
        }
        let shared = match cfg.moe.as_ref().and_then(|m| m.shared_intermediate_size) {
            Some(si) => Some(Box::new(SharedExpert {
                mlp: Mlp::load_sized(cfg.hidden_size, si, vb.pp("shared_expert"), qt)?,
                gate: linear_no_bias(cfg.hidden_size, 1, vb.pp("shared_expert_gate"), qt)?,
            })),
            None => None,
        };
        Ok(Ffn::Sparse(sparse_moe(cfg, vb, qt)?, shared))
    }

    pub(super) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Ffn::Dense(m) => m.forward(x),
            Ffn::Sparse(m, None) => Ok(m.forward(x)?),
            Ffn::Sparse(m, Some(s)) => {
                let routed = m.forward(x)?;
                let shared = s.mlp.forward(x)?.broadcast_mul(&candle_nn::ops::sigmoid(&s.gate.forward(x)?)?)?;
                Ok((routed + shared)?)
            }
        }
    }

    /// The linears a report or the repacking sees (the experts' are not repacked: a decode step
    /// multiplies only a few of them, one row each).
    pub(super) fn dense_linears(&self) -> Vec<&QLinear> {
        match self {
            Ffn::Dense(m) => vec![&m.gate, &m.up, &m.down],
            Ffn::Sparse(_, Some(s)) => vec![&s.mlp.gate, &s.mlp.up, &s.mlp.down],
            Ffn::Sparse(_, None) => vec![],
        }
    }
}

/// Routed experts from the fused tensors (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`)
/// in either layout: transformers 5's `[E, out, in]` or the hub's `[E, in, out]` (transposed at
/// load, as transformers' conversion does; a square tensor is taken as `[E, out, in]`, as
/// there). `gate_up` holds each expert's gate rows, then its up rows. Each expert is quantized
/// on its own, so a decode step reads only its rows.
fn sparse_moe(cfg: &TextConfig, vb: VarBuilder, qt: LoadPlan) -> Result<SparseMoe> {
    let m = cfg.moe.as_ref().expect("a sparse layer has a MoE config");
    let (e, d, mi) = (m.num_experts, cfg.hidden_size, m.moe_intermediate_size);
    let router = vb.pp("gate").get((e, d), "weight")?;
    // One tensor per expert and matrix (the Qwen3.5 MoE hub checkpoints).
    let evb = vb.pp("experts");
    if evb.contains_tensor("0.gate_proj.weight") {
        let experts = (0..e)
            .map(|x| {
                let xvb = evb.pp(x.to_string());
                Ok(SwiGluExpert {
                    gate: linear_no_bias(d, mi, xvb.pp("gate_proj"), qt)?,
                    up: linear_no_bias(d, mi, xvb.pp("up_proj"), qt)?,
                    down: linear_no_bias(mi, d, xvb.pp("down_proj"), qt)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        return Ok(SparseMoe::new(router, experts, m.top_k)?);
    }
    // A GGUF file's experts: one 3-D tensor per matrix, quantized as stored or in floats.
    let evb = vb.pp("experts");
    let split = ["gate_proj", "up_proj", "down_proj"].map(|n| format!("{n}.weight"));
    let stored = |n: &str| qt.stored_experts(&evb, n).is_some() || qt.stored(&evb, n).is_some();
    if split.iter().all(|n| stored(n) || evb.contains_tensor(n)) {
        let shapes = [(mi, d), (mi, d), (d, mi)];
        let mut parts: Vec<Vec<QLinear>> = Vec::with_capacity(3);
        for (name, (o, i)) in split.iter().zip(shapes) {
            let key = format!("{}.{name}", evb.prefix());
            if let Some(cut) = qt.stored_experts(&evb, name) {
                parts.push(experts_as_linears(cut, e, (o, i), &key)?);
                continue;
            }
            parts.push(match qt.stored(&evb, name) {
                Some(q) => experts_as_linears(&crate::gguf::cut_experts(&q)?, e, (o, i), &key)?,
                None => {
                    let t = evb.get((e, o, i), name)?;
                    (0..e)
                        .map(|x| {
                            let w = t.get(x)?.contiguous()?;
                            let qt = qt.quant.map(|q| q.qtype).filter(|q| i.is_multiple_of(q.block()));
                            Ok(QLinear::new(candle_nn::Linear::new(w, None), qt)?)
                        })
                        .collect::<Result<_>>()?
                }
            });
        }
        let (down, up, gate) = (parts.pop().unwrap(), parts.pop().unwrap(), parts.pop().unwrap());
        let experts =
            gate.into_iter().zip(up).zip(down).map(|((gate, up), down)| SwiGluExpert { gate, up, down }).collect();
        return Ok(SparseMoe::new(router, experts, m.top_k)?);
    }
    let read_as = qt.quant.map_or(vb.dtype(), |q| q.read_as);
    let fused = |name: &str, out: usize, inp: usize| -> Result<Tensor> {
        let key = format!("{}.experts.{name}", vb.prefix());
        experts_out_in(vb.pp("experts").get_unchecked_dtype(name, read_as)?, (e, out, inp), &key)
    };
    let gate_up = fused("gate_up_proj", 2 * mi, d)?;
    let down = fused("down_proj", d, mi)?;
    let q = qt.quant.map(|q| q.qtype);
    let to_model = |t: Tensor| -> Result<Tensor> { Ok(if q.is_some() { t } else { t.to_dtype(vb.dtype())? }) };
    let linear = |w: Tensor| -> Result<QLinear> {
        let qt = q.filter(|q| w.dim(1).is_ok_and(|i| i.is_multiple_of(q.block())));
        let w = if qt.is_some() { w } else { w.to_dtype(vb.dtype())? };
        Ok(QLinear::new(candle_nn::Linear::new(w.contiguous()?, None), qt)?)
    };
    let experts = (0..e)
        .map(|x| {
            let gu = to_model(gate_up.get(x)?)?;
            Ok(SwiGluExpert {
                gate: linear(gu.narrow(0, 0, mi)?)?,
                up: linear(gu.narrow(0, mi, mi)?)?,
                down: linear(to_model(down.get(x)?)?)?,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(SparseMoe::new(router, experts, m.top_k)?)
}

/// A fused expert tensor (`key`) as `[E, out, in]`: transformers 5's layout as is, the hub's
/// `[E, in, out]` transposed (a square one is taken as `[E, out, in]`, as transformers does).
pub(crate) fn experts_out_in(t: Tensor, (e, out, inp): (usize, usize, usize), key: &str) -> Result<Tensor> {
    match t.dims() {
        [n, o, i] if (*n, *o, *i) == (e, out, inp) => Ok(t),
        [n, i, o] if (*n, *i, *o) == (e, inp, out) => Ok(t.transpose(1, 2)?.contiguous()?),
        dims => Err(Error::Input {
            what: key.into(),
            message: format!("shape {dims:?}, expected [{e}, {out}, {inp}] or [{e}, {inp}, {out}]"),
        }),
    }
}

/// `e` experts' `[out, in]` tensors as linears, their count and shapes checked against `key`'s
/// plan.
fn experts_as_linears(
    cut: &[std::sync::Arc<candle_core::quantized::QTensor>],
    e: usize,
    (o, i): (usize, usize),
    key: &str,
) -> Result<Vec<QLinear>> {
    let bad = cut.len() != e || cut.iter().any(|q| q.shape().dims() != [o, i]);
    if bad {
        let found = cut.first().map(|q| q.shape().dims().to_vec()).unwrap_or_default();
        return Err(Error::Input {
            what: key.into(),
            message: format!("{} experts of shape {found:?}, expected {e} of [{o}, {i}]", cut.len()),
        });
    }
    cut.iter().map(|q| Ok(QLinear::from_qtensor(q.clone(), None)?)).collect()
}

/// Whether the routed experts multiply their compact blocks (`SparseMoe::set_compact`) rather
/// than candle's repacked tiles, which are made on an expert's first product and kept beside its
/// blocks: about one more copy of every expert once tokens have touched them all. Decided once the
/// weights are loaded: repacked (faster prefill) while such a copy, and 1 GiB for the run, fits
/// the memory still available (`limits::available_memory`), compact otherwise, so a MoE that fits
/// as stored keeps fitting however long it runs. `VL_MOE_EXPERTS=compact|repacked` overrides
/// (another value is refused).
pub(super) fn compact_experts<'a>(ffns: impl Iterator<Item = &'a Ffn>) -> Result<bool> {
    let bytes: u64 = ffns
        .filter_map(|f| match f {
            Ffn::Sparse(m, _) => Some(m.experts().iter().map(|x| x.weight_bytes() as u64).sum::<u64>()),
            Ffn::Dense(_) => None,
        })
        .sum();
    if bytes == 0 {
        return Ok(false);
    }
    match std::env::var("VL_MOE_EXPERTS") {
        Ok(v) if v == "compact" => Ok(true),
        Ok(v) if v == "repacked" => Ok(false),
        Ok(v) => Err(Error::Input {
            what: "VL_MOE_EXPERTS".into(),
            message: format!("{v:?} is neither \"compact\" nor \"repacked\""),
        }),
        Err(_) => Ok(crate::limits::available_memory().is_some_and(|available| bytes + (1 << 30) > available)),
    }
}

/// Rows per expert up to which the routed experts multiply their stored blocks
/// (`vl_nn::moe::default_stored_rows`); `VL_MOE_STORED_ROWS=N` overrides, for measuring (0: every
/// expert of a prompt through `QLinear::forward`: `stored_tiles` or candle; not a number is refused).
pub(super) fn stored_expert_rows() -> Result<usize> {
    match std::env::var("VL_MOE_STORED_ROWS") {
        Ok(v) => v.parse().map_err(|_| Error::Input {
            what: "VL_MOE_STORED_ROWS".into(),
            message: format!("{v:?} is not a number of rows"),
        }),
        Err(_) => Ok(vl_nn::moe::default_stored_rows()),
    }
}
