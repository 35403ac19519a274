//! The Qwen3-VL text decoder, mirroring `Qwen3VLTextModel` in transformers'
//! `models/qwen3_vl/modeling_qwen3_vl.py`: RMSNorm pre-norm layers, attention with per-head
//! RMSNorm on q and k before interleaved M-RoPE, GQA, SwiGLU MLP, DeepStack rows added to the
//! visual positions after the first layers, final norm, lm_head (tied or not).

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::VarBuilder;
use vl_nn::RmsNorm;
use vl_nn::{causal_gqa_attention, KvCache, MultiAxisRope, QEmbedding, QLinear, QuantType};

use super::config::TextConfig;
pub(crate) use super::ffn::experts_out_in;
use super::ffn::{compact_experts, stored_expert_rows, Ffn};
use super::linears::{check_stored, linear_no_bias, weight};
pub use super::linears::{LoadPlan, PreExperts, Prequantized, QuantLoad};
use crate::error::{Error, Result};

/// Query rows per attention block during prefill (bounds the live score matrix).
const PREFILL_QUERY_BLOCK: usize = 512;

/// An RMSNorm; `unit_offset`: Qwen3.5's, which multiplies by (1 + weight) (the sum taken in
/// f32 at load).
fn rms_norm(dim: usize, eps: f64, vb: VarBuilder, unit_offset: bool) -> Result<RmsNorm> {
    if !unit_offset {
        return Ok(RmsNorm::load(dim, eps, vb)?);
    }
    let w = vb.get(dim, "weight")?;
    let w = (w.to_dtype(DType::F32)? + 1.0)?.to_dtype(w.dtype())?;
    Ok(RmsNorm::new(w, eps))
}

#[derive(Debug, Clone)]
struct Attention {
    q_proj: QLinear,
    k_proj: QLinear,
    v_proj: QLinear,
    o_proj: QLinear,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    /// Leading dims of each head that rotate (the rest pass through).
    rotary_dim: usize,
    /// Whether `q_proj` also yields a per-head output gate (Qwen3.5): out * sigmoid(gate).
    gated: bool,
}

impl Attention {
    fn load(cfg: &TextConfig, vb: VarBuilder, qt: LoadPlan) -> Result<Self> {
        let (d, hd) = (cfg.hidden_size, cfg.head_dim);
        let (q, kv) = (cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd);
        let gated = cfg.hybrid.is_some();
        let offset = unit_offset_norms(cfg);
        Ok(Self {
            q_proj: linear_no_bias(d, if gated { 2 * q } else { q }, vb.pp("q_proj"), qt)?,
            k_proj: linear_no_bias(d, kv, vb.pp("k_proj"), qt)?,
            v_proj: linear_no_bias(d, kv, vb.pp("v_proj"), qt)?,
            o_proj: linear_no_bias(q, d, vb.pp("o_proj"), qt)?,
            q_norm: rms_norm(hd, cfg.rms_norm_eps, vb.pp("q_norm"), offset)?,
            k_norm: rms_norm(hd, cfg.rms_norm_eps, vb.pp("k_norm"), offset)?,
            heads: cfg.num_attention_heads,
            kv_heads: cfg.num_key_value_heads,
            head_dim: hd,
            rotary_dim: cfg.rotary_dim,
            gated,
        })
    }

    /// Rotates the first `rotary_dim` dims of `x` ([1, heads, rows, hd], contiguous).
    fn rope(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        if self.rotary_dim == self.head_dim {
            return Ok(vl_nn::rope(x, cos, sin)?);
        }
        let r = self.rotary_dim;
        let rot = vl_nn::rope(&x.narrow(3, 0, r)?.contiguous()?, cos, sin)?;
        Ok(Tensor::cat(&[&rot, &x.narrow(3, r, self.head_dim - r)?], 3)?.contiguous()?)
    }

    /// The attention output `out` [rows, heads * hd] times sigmoid(gate) when gated, projected.
    fn output(&self, out: &Tensor, gate: Option<&Tensor>) -> Result<Tensor> {
        let out = match gate {
            Some(g) => (out * candle_nn::ops::sigmoid(g)?)?,
            None => out.clone(),
        };
        Ok(self.o_proj.forward(&out)?)
    }

    /// q [heads, rows, hd], k and v [kv_heads, rows, hd] of `x` ([rows, hidden]): projected,
    /// q and k normed per head and rotated at their rows' `cos`/`sin` ([rows, rotary_dim / 2]);
    /// and the output gate [rows, heads * hd] when gated.
    fn qkv(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<(Tensor, Tensor, Tensor, Option<Tensor>)> {
        let (n, _) = x.dims2()?;
        let hd = self.head_dim;
        // [rows, heads, hd] -> per-head norm -> [1, heads, rows, hd] for rope
        let [q, k, v] = QLinear::forward_each([&self.q_proj, &self.k_proj, &self.v_proj], x)?;
        let (q, gate) = if self.gated {
            // Per head: hd query dims, then hd gate dims.
            let both = q.reshape((n, self.heads, 2 * hd))?;
            let gate = both.narrow(2, hd, hd)?.contiguous()?.reshape((n, self.heads * hd))?;
            (both.narrow(2, 0, hd)?.contiguous()?, Some(gate))
        } else {
            (q.reshape((n, self.heads, hd))?, None)
        };
        let q = self.q_norm.forward(&q)?;
        let k = self.k_norm.forward(&k.reshape((n, self.kv_heads, hd))?)?;
        let v = v.reshape((n, self.kv_heads, hd))?.transpose(0, 1)?.contiguous()?;
        let q = self.rope(&q.transpose(0, 1)?.unsqueeze(0)?.contiguous()?, cos, sin)?.squeeze(0)?;
        let k = self.rope(&k.transpose(0, 1)?.unsqueeze(0)?.contiguous()?, cos, sin)?.squeeze(0)?;
        Ok((q, k, v, gate))
    }

    /// `x`: [new, hidden]; `cos`/`sin`: [new, head_dim / 2].
    fn forward(&self, x: &Tensor, cos: &Tensor, sin: &Tensor, cache: &mut KvCache) -> Result<Tensor> {
        let (n, _) = x.dims2()?;
        let hd = self.head_dim;
        let (q, k, v, gate) = self.qkv(x, cos, sin)?;
        let (k, v) = cache.append(&k, &v)?;
        let out = causal_gqa_attention(&q, &k, &v, PREFILL_QUERY_BLOCK)?; // [heads, new, hd]
        let out = out.transpose(0, 1)?.reshape((n, self.heads * hd))?;
        self.output(&out, gate.as_ref())
    }

    /// New positions for each of several sequences: `lens[i]` consecutive rows of `x`
    /// ([rows, hidden]) belong to `caches[i]`. The projections multiply all rows at once (the
    /// weights are read once for the batch); each sequence's rows attend causally to its own
    /// cache: row by row with the decode kernel (`Attend::AsDecoding`), or in query blocks as a
    /// prompt's prefill does (`Attend::AsPrefill`).
    fn forward_rows(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        caches: &mut [&mut KvCache],
        lens: &[usize],
        attend: Attend,
    ) -> Result<Tensor> {
        let (n, _) = x.dims2()?;
        if caches.len() != lens.len() || lens.iter().sum::<usize>() != n {
            return Err(Error::Input {
                what: "batch".into(),
                message: format!("{n} rows for {} caches of {lens:?} rows", caches.len()),
            });
        }
        let hd = self.head_dim;
        let (q, k, v, gate) = self.qkv(x, cos, sin)?;
        let out = if let ([cache], [1]) = (&mut *caches, lens) {
            // One sequence, one row: as it is (no slicing, no join).
            let (ck, cv) = cache.append(&k, &v)?;
            causal_gqa_attention(&q, &ck, &cv, PREFILL_QUERY_BLOCK)?
        } else {
            let mut outs = Vec::with_capacity(n);
            // Decoding: each row's query and the keys and values it sees.
            let mut rows = Vec::new();
            let mut at = 0;
            for (cache, &len) in caches.iter_mut().zip(lens) {
                let (ck, cv) = cache.append(&k.narrow(1, at, len)?, &v.narrow(1, at, len)?)?;
                if attend == Attend::AsPrefill {
                    let qs = q.narrow(1, at, len)?.contiguous()?;
                    outs.push(causal_gqa_attention(&qs, &ck, &cv, PREFILL_QUERY_BLOCK)?);
                    at += len;
                    continue;
                }
                let total = ck.dim(1)?;
                // Row by row with the decode kernel, each seeing the keys up to its own position:
                // the logits of drafted tokens are then bit for bit those decoding them one at a
                // time gives, so verification keeps exactly the answer decoding would write.
                for j in 0..len {
                    let seen = total - len + j + 1;
                    rows.push((q.narrow(1, at + j, 1)?.contiguous()?, ck.narrow(1, 0, seen)?, cv.narrow(1, 0, seen)?));
                }
                at += len;
            }
            // Every row of every sequence in one parallel region where the decode kernel
            // applies (each [heads, 1, hd] as it alone gives), else one at a time.
            let refs: Vec<(&Tensor, &Tensor, &Tensor)> = rows.iter().map(|(q, k, v)| (q, k, v)).collect();
            match vl_nn::decode_attention_many(&refs)? {
                Some(o) => outs.extend(o),
                None => {
                    for (qj, kj, vj) in &rows {
                        outs.push(causal_gqa_attention(qj, kj, vj, 1)?);
                    }
                }
            }
            Tensor::cat(&outs, 1)?
        };
        let out = out.transpose(0, 1)?.reshape((n, self.heads * hd))?;
        self.output(&out, gate.as_ref())
    }
}

/// `VL_CPU_AMX=on` lets Q4_K prefill products take candle's AMX tiles (`vl_nn::linear::allow_amx`:
/// faster, at a third copy of those weights); unset or `off`, they stay on the VNNI tiles.
fn amx_setting() -> Result<()> {
    match std::env::var("VL_CPU_AMX") {
        Ok(v) if v == "on" => vl_nn::linear::allow_amx(true),
        Ok(v) if v == "off" => vl_nn::linear::allow_amx(false),
        Ok(v) => {
            return Err(Error::Input {
                what: "VL_CPU_AMX".into(),
                message: format!("{v:?} is neither \"on\" nor \"off\""),
            })
        }
        Err(_) => {}
    }
    Ok(())
}

/// A layer's token mixer: attention over the KV cache, or a Gated DeltaNet over its
/// recurrent state (Qwen3.5).
#[derive(Debug, Clone)]
enum Mixer {
    Attention(Attention),
    Linear(vl_nn::GatedDeltaNet),
}

impl Mixer {
    fn linears(&self) -> Vec<&QLinear> {
        match self {
            Mixer::Attention(a) => vec![&a.q_proj, &a.k_proj, &a.v_proj, &a.o_proj],
            Mixer::Linear(l) => vec![&l.in_qkv, &l.in_z, &l.in_b, &l.in_a, &l.out],
        }
    }
}

/// Whether the decoder's RMSNorms add 1 to their stored weights at load (Qwen3.5 from
/// transformers' safetensors; llama.cpp's converter and mlx-vlm store them with the 1 added).
fn unit_offset_norms(cfg: &TextConfig) -> bool {
    cfg.hybrid.as_ref().is_some_and(|h| !h.norms_plus_one)
}

/// A Gated DeltaNet layer's weights (`linear_attn.*`).
fn delta_net(cfg: &TextConfig, vb: VarBuilder, qt: LoadPlan) -> Result<vl_nn::GatedDeltaNet> {
    let h = cfg.hybrid.as_ref().expect("a linear layer has a hybrid config");
    let d = cfg.hidden_size;
    let s = h.shape(d);
    let vh = h.value_heads;
    let linears = [
        linear_no_bias(d, s.conv_dim(), vb.pp("in_proj_qkv"), qt)?,
        linear_no_bias(d, s.value_dim(), vb.pp("in_proj_z"), qt)?,
        linear_no_bias(d, vh, vb.pp("in_proj_b"), qt)?,
        linear_no_bias(d, vh, vb.pp("in_proj_a"), qt)?,
        linear_no_bias(s.value_dim(), d, vb.pp("out_proj"), qt)?,
    ];
    let f32s = |name: &str, shape: &[usize]| -> Result<Tensor> { Ok(vb.get(shape, name)?.to_dtype(DType::F32)?) };
    // The convolution as transformers stores it [C, 1, K], or squeezed [C, K] (llama.cpp).
    let conv = vb.get_unchecked_dtype("conv1d.weight", DType::F32)?;
    if conv.elem_count() != s.conv_dim() * h.conv_kernel {
        return Err(Error::Input {
            what: format!("{}.conv1d.weight", vb.prefix()),
            message: format!("shape {:?}, expected [{}, 1, {}]", conv.dims(), s.conv_dim(), h.conv_kernel),
        });
    }
    // llama.cpp stores -exp(A_log) (`ssm_a`).
    let a_log = f32s("A_log", &[vh])?;
    let a_log = if h.gguf_layout { a_log.neg()?.log()? } else { a_log };
    Ok(vl_nn::GatedDeltaNet::new(
        s,
        linears,
        &conv,
        &a_log,
        &f32s("dt_bias", &[vh])?,
        &vb.pp("norm").get(h.value_head_dim, "weight")?.to_dtype(DType::F32)?,
        cfg.rms_norm_eps,
    )?)
}

/// Layer `i`'s recurrent state as the DeltaNet takes it (None before its first position).
fn delta_state(state: &mut TextCache, i: usize) -> Result<Option<vl_nn::DeltaState>> {
    let r = state.recurrent_mut(i)?;
    Ok(match r.tensors.as_slice() {
        [w, s] => Some((w.clone(), s.clone())),
        _ => None,
    })
}

#[derive(Debug, Clone)]
struct DecoderLayer {
    input_norm: RmsNorm,
    attn: Mixer,
    post_attn_norm: RmsNorm,
    mlp: Ffn,
}

impl DecoderLayer {
    fn load(cfg: &TextConfig, i: usize, vb: VarBuilder, qt: LoadPlan) -> Result<Self> {
        Self::load_kind(cfg, i, cfg.is_linear(i), vb, qt)
    }

    /// Layer `i`'s MLP kind, a Gated DeltaNet mixer when `linear` (else attention).
    pub(super) fn load_kind(cfg: &TextConfig, i: usize, linear: bool, vb: VarBuilder, qt: LoadPlan) -> Result<Self> {
        let mlp = Ffn::load(cfg, i, vb.pp("mlp"), qt)?;
        let offset = unit_offset_norms(cfg);
        let attn = if linear {
            Mixer::Linear(delta_net(cfg, vb.pp("linear_attn"), qt)?)
        } else {
            Mixer::Attention(Attention::load(cfg, vb.pp("self_attn"), qt)?)
        };
        Ok(Self {
            input_norm: rms_norm(cfg.hidden_size, cfg.rms_norm_eps, vb.pp("input_layernorm"), offset)?,
            attn,
            post_attn_norm: rms_norm(cfg.hidden_size, cfg.rms_norm_eps, vb.pp("post_attention_layernorm"), offset)?,
            mlp,
        })
    }

    /// Its linears but the routed experts (repacked at load).
    pub(super) fn linears(&self) -> Vec<&QLinear> {
        let mut all = self.attn.linears();
        all.extend(self.mlp.dense_linears());
        all
    }

    pub(super) fn mlp_mut(&mut self) -> &mut Ffn {
        &mut self.mlp
    }

    /// Layer `i` on `x` [new, hidden], continuing `state`.
    fn forward(&self, x: &Tensor, cos: &Tensor, sin: &Tensor, state: &mut TextCache, i: usize) -> Result<Tensor> {
        let h = self.input_norm.forward(x)?;
        let mixed = match &self.attn {
            Mixer::Attention(a) => a.forward(&h, cos, sin, state.kv_mut(i)?)?,
            Mixer::Linear(l) => {
                let prev = delta_state(state, i)?;
                let (y, mut new) = l.forward(&h, &[h.dim(0)?], &[prev.as_ref()])?;
                let r = state.recurrent_mut(i)?;
                let len = r.len() + h.dim(0)?;
                let (w, s) = new.pop().expect("one state per sequence");
                r.set(vec![w, s], len);
                y
            }
        };
        let x = (x + mixed)?;
        Ok((&x + self.mlp.forward(&self.post_attn_norm.forward(&x)?)?)?)
    }

    /// Layer `i` on new rows of several sequences (`lens[j]` consecutive rows of `x` continue
    /// `states[j]`), rotated by `(cos, sin)`.
    pub(super) fn forward_rows(
        &self,
        x: &Tensor,
        (cos, sin): (&Tensor, &Tensor),
        states: &mut [&mut TextCache],
        lens: &[usize],
        i: usize,
        attend: Attend,
    ) -> Result<Tensor> {
        let h = self.input_norm.forward(x)?;
        let mixed = match &self.attn {
            Mixer::Attention(a) => {
                let mut caches: Vec<&mut KvCache> = states.iter_mut().map(|c| c.kv_mut(i)).collect::<Result<_>>()?;
                a.forward_rows(&h, cos, sin, &mut caches, lens, attend)?
            }
            Mixer::Linear(l) => {
                let prev: Vec<Option<vl_nn::DeltaState>> =
                    states.iter_mut().map(|c| delta_state(c, i)).collect::<Result<_>>()?;
                let refs: Vec<Option<&vl_nn::DeltaState>> = prev.iter().map(Option::as_ref).collect();
                // Rows verified together (drafted tokens) keep the state after each but the
                // last, so that the sequence can be taken back to any of them.
                let keep: Vec<usize> =
                    lens.iter().map(|&n| if attend == Attend::AsDecoding && n > 1 { n - 1 } else { 0 }).collect();
                let (y, new, kept) = l.forward_trail(&h, lens, &refs, &keep)?;
                drop(prev);
                for (((c, (w, s)), &n), kept) in states.iter_mut().zip(new).zip(lens).zip(kept) {
                    let r = c.recurrent_mut(i)?;
                    let before = r.len();
                    let trail = kept.into_iter().enumerate().map(|(j, (w, s))| (before + 1 + j, vec![w, s])).collect();
                    r.set_with_trail(vec![w, s], before + n, trail);
                }
                y
            }
        };
        let x = (x + mixed)?;
        Ok((&x + self.mlp.forward(&self.post_attn_norm.forward(&x)?)?)?)
    }
}

/// How `TextModel::forward_rows` attends a sequence's rows to its cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attend {
    /// Row by row with the decode kernel: each row's output is bit for bit what decoding its
    /// token alone gives (drafted tokens verified, batched decode steps).
    AsDecoding,
    /// In query blocks, as one sequence's prefill attends (prompts pooled together).
    AsPrefill,
}

/// DeepStack rows to add after the first decoder layers: `levels[k]` ([visual, hidden]) is added
/// after layer k at the sequence rows `positions` (ascending, relative to this forward's input).
#[derive(Debug, Clone, Copy)]
pub struct DeepStack<'a> {
    pub positions: &'a [u32],
    pub levels: &'a [Tensor],
}

pub use crate::state::SeqState as TextCache;

/// An empty state for a decoder of `cfg`: a KV cache per attention layer (its rows kept in
/// `kv_dtype`), a recurrent state per Gated DeltaNet layer.
pub fn new_state(cfg: &TextConfig, kv_dtype: DType) -> TextCache {
    use crate::state::{LayerState, Recurrent};
    TextCache::new(
        (0..cfg.num_hidden_layers)
            .map(|i| {
                if cfg.is_linear(i) {
                    LayerState::Recurrent(Recurrent::default())
                } else {
                    LayerState::Kv(KvCache::in_dtype(kv_dtype))
                }
            })
            .collect(),
    )
}

#[derive(Debug, Clone)]
pub struct TextModel {
    cfg: TextConfig,
    embed: QEmbedding,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    lm_head: QLinear,
    /// Qwen3.5's multi-token-prediction head, when the checkpoint carries one.
    mtp: Option<MtpHead>,
    rope: MultiAxisRope,
    dtype: DType,
    /// The dtype the KV cache keeps its rows in (default: `dtype`).
    kv_dtype: DType,
    device: Device,
}

impl TextModel {
    /// `vb` at the checkpoint root (`model.language_model.*`, `lm_head.weight`). With `quant`,
    /// every decoder linear, the embedding table and the lm_head whose input dimension fits
    /// the block size are quantized as they are loaded.
    pub fn load(cfg: &TextConfig, tie_word_embeddings: bool, vb: VarBuilder, quant: Option<QuantType>) -> Result<Self> {
        let read_as = vb.dtype();
        Self::load_with(cfg, tie_word_embeddings, vb, quant.map(|qtype| QuantLoad { qtype, read_as }))
    }

    /// `load`, reading the weights to be quantized in `quant.read_as` (the checkpoint's dtype:
    /// `Weights::stored_float_dtype`) instead of the model's dtype.
    pub fn load_with(
        cfg: &TextConfig,
        tie_word_embeddings: bool,
        vb: VarBuilder,
        quant: Option<QuantLoad>,
    ) -> Result<Self> {
        Self::load_plan(cfg, tie_word_embeddings, vb, LoadPlan { quant, pre: None, experts: None })
    }

    /// `load_with`, taking the weights in `plan.pre` as they are stored.
    pub fn load_plan(cfg: &TextConfig, tie_word_embeddings: bool, vb: VarBuilder, plan: LoadPlan) -> Result<Self> {
        amx_setting()?;
        let tvb = vb.pp("model.language_model");
        let evb = tvb.pp("embed_tokens");
        let embed = match plan.stored(&evb, "weight") {
            Some(t) => {
                check_stored(&t, (cfg.vocab_size, cfg.hidden_size), &evb)?;
                QEmbedding::from_qtensor(t, evb.dtype())?
            }
            None => {
                let (table, tq) = weight((cfg.vocab_size, cfg.hidden_size), "weight", &evb, plan.quant)?;
                QEmbedding::new(table, tq)?
            }
        };
        let lm_head = if tie_word_embeddings {
            embed.as_linear()?
        } else {
            linear_no_bias(cfg.hidden_size, cfg.vocab_size, vb.pp("lm_head"), plan)?
        };
        let mut layers: Vec<DecoderLayer> = (0..cfg.num_hidden_layers)
            .map(|i| DecoderLayer::load(cfg, i, tvb.pp(format!("layers.{i}")), plan))
            .collect::<Result<_>>()?;
        let has_mtp = cfg.hybrid.is_some()
            && (vb.contains_tensor(MTP_FC_KEY) || plan.pre.is_some_and(|p| p.contains_key(MTP_FC_KEY)));
        let mut mtp = has_mtp.then(|| MtpHead::load(cfg, vb.clone(), plan)).transpose()?;
        let compact = compact_experts(layers.iter().map(|l| &l.mlp).chain(mtp.as_ref().map(|m| &m.layer().mlp)))?;
        let stored_rows = stored_expert_rows()?;
        for mlp in layers.iter_mut().map(|l| &mut l.mlp).chain(mtp.as_mut().map(|m| m.layer_mut().mlp_mut())) {
            if let Ffn::Sparse(m, _) = mlp {
                m.set_compact(compact);
                m.set_stored_rows(stored_rows);
            }
        }
        let s = &cfg.mrope_section;
        let model = Self {
            cfg: cfg.clone(),
            embed,
            layers,
            norm: rms_norm(cfg.hidden_size, cfg.rms_norm_eps, tvb.pp("norm"), unit_offset_norms(cfg))?,
            lm_head,
            mtp,
            rope: MultiAxisRope::new(cfg.rotary_dim, cfg.rope_theta, [s[0], s[1], s[2]]),
            dtype: vb.dtype(),
            kv_dtype: vb.dtype(),
            device: vb.device().clone(),
        };
        model.prepare()?;
        Ok(model)
    }

    /// Quantized weights get their kernels' one-time repacking at load, on every core, so the
    /// first prefill runs at the speed of every later one. Where the CPU has AVX-512 VNNI, Q4_K
    /// and Q6_K weights have none to pay (`QLinear::prepare` is a no-op: `vl_nn::stored` and
    /// `vl_nn::stored_tiles` multiply every row count on the stored blocks). A Q6_K lm_head
    /// (llama.cpp's Q4_K_M files) is left as stored elsewhere too: it meets products of a few
    /// rows (a prefill's last position, a decode step of up to `vl_nn::stored::MAX_ROWS`
    /// sequences); its tiles (10 bits a weight, 389 MB for a 151k x 2048 head) are made only if
    /// a step batches more sequences than that.
    fn prepare(&self) -> Result<()> {
        let mut all: Vec<&QLinear> = vec![];
        if self.lm_head.storage() != vl_nn::QuantType::Q6K.name() {
            all.push(&self.lm_head);
        }
        for l in &self.layers {
            all.extend(l.linears());
        }
        if let Some(m) = &self.mtp {
            all.extend(m.linears());
        }
        Ok(vl_nn::linear::prepare_all(&all)?)
    }

    pub fn config(&self) -> &TextConfig {
        &self.cfg
    }

    /// (group, storage, weight bytes) of the decoder's big tensors, for reports.
    pub fn storage(&self) -> Vec<(String, String, usize)> {
        let mut layers: std::collections::BTreeMap<String, usize> = Default::default();
        let mut experts: std::collections::BTreeMap<String, usize> = Default::default();
        for l in &self.layers {
            for q in l.attn.linears().into_iter().chain(l.mlp.dense_linears()) {
                *layers.entry(q.storage()).or_default() += q.weight_bytes();
            }
            if let Ffn::Sparse(m, _) = &l.mlp {
                for x in m.experts() {
                    *experts.entry(x.gate.storage()).or_default() += x.weight_bytes();
                }
            }
        }
        let mut out: Vec<_> = layers.into_iter().map(|(s, b)| ("text decoder linears".to_string(), s, b)).collect();
        out.extend(experts.into_iter().map(|(s, b)| ("routed experts".to_string(), s, b)));
        out.push(("token embeddings".into(), self.embed.storage(), self.embed.weight_bytes()));
        out.push(("lm_head".into(), self.lm_head.storage(), self.lm_head.weight_bytes()));
        if let Some(m) = &self.mtp {
            let bytes = m.linears().iter().map(|q| q.weight_bytes()).sum::<usize>();
            out.push(("MTP head".into(), m.linears()[0].storage(), bytes));
        }
        out
    }

    /// The lm_head of the first `n` tokens only (drafts picked among them).
    pub fn lm_head_first_rows(&self, n: usize) -> Result<QLinear> {
        Ok(self.lm_head.first_rows(n)?)
    }

    /// Whether the checkpoint's multi-token-prediction head was loaded.
    pub fn has_mtp(&self) -> bool {
        self.mtp.is_some()
    }

    /// The multi-token-prediction head on new rows of several sequences (`DraftHead::forward`):
    /// row r joins `hidden` row r with the embedding of `tokens[r]` at `positions[r]`; `lens[i]`
    /// rows continue `states[i]`. Returns its output rows and the f32 logits of rows `picks`
    /// (by `lm_head` when given: the first rows of the model's, `lm_head_first_rows`).
    #[allow(clippy::too_many_arguments)]
    pub fn mtp_forward(
        &self,
        tokens: &[u32],
        hidden: &Tensor,
        positions: &[[i64; 3]],
        states: &mut [&mut TextCache],
        lens: &[usize],
        picks: &[u32],
        lm_head: Option<&QLinear>,
    ) -> Result<(Tensor, Tensor)> {
        let head = self.mtp.as_ref().ok_or_else(|| Error::Input {
            what: "speculative".into(),
            message: "the checkpoint has no multi-token-prediction head (mtp.*)".into(),
        })?;
        let n = tokens.len();
        if hidden.dim(0)? != n || positions.len() != n || lens.iter().sum::<usize>() != n || states.len() != lens.len()
        {
            return Err(Error::Internal {
                message: format!(
                    "MTP rows: {n} tokens, {} hidden, {} positions, lens {lens:?}",
                    hidden.dim(0)?,
                    positions.len()
                ),
            });
        }
        for s in states.iter_mut() {
            if s.num_layers() != 1 {
                **s = TextCache::kv(1);
            }
        }
        let (cos, sin) = self.rope.cos_sin(positions, &self.device)?;
        let (cos, sin) = (cos.to_dtype(self.dtype)?, sin.to_dtype(self.dtype)?);
        let attend = if lens.iter().all(|&l| l == 1) { Attend::AsDecoding } else { Attend::AsPrefill };
        let out = head.forward(&self.embed(tokens)?, hidden, (&cos, &sin), states, lens, attend)?;
        let logits = if picks.is_empty() {
            Tensor::zeros((0, self.cfg.vocab_size), DType::F32, &self.device)?
        } else {
            let rows = out.index_select(&Tensor::from_slice(picks, picks.len(), &self.device)?, 0)?;
            match lm_head {
                Some(h) => h.forward(&rows)?.to_dtype(DType::F32)?,
                None => self.logits(&rows)?,
            }
        };
        Ok((out, logits))
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    pub fn new_cache(&self) -> TextCache {
        new_state(&self.cfg, self.kv_dtype)
    }

    /// The model with its KV caches' rows kept in `dtype` (f16 or bf16 under f32 compute: half
    /// the bytes; `KvCache::in_dtype`).
    pub fn with_kv_dtype(mut self, dtype: DType) -> Self {
        self.kv_dtype = dtype;
        self
    }

    /// The dtype the KV cache keeps its rows in.
    pub fn kv_dtype(&self) -> DType {
        self.kv_dtype
    }

    /// Token embeddings [n, hidden]; ids must be below the vocabulary size.
    pub fn embed(&self, ids: &[u32]) -> Result<Tensor> {
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= self.cfg.vocab_size) {
            return Err(Error::Input {
                what: "token ids".into(),
                message: format!("id {bad} is outside the vocabulary of {}", self.cfg.vocab_size),
            });
        }
        Ok(self.embed.lookup(ids, self.dtype)?)
    }

    /// Runs the decoder on `x` ([new, hidden]) at M-RoPE `positions` (one (t, h, w) per row),
    /// appending to `cache`; returns the final-normed hidden states [new, hidden].
    /// `trace(k, h)` sees the input embeddings (k = 0) and the output of layer k - 1 (before
    /// DeepStack injection, as transformers' `output_hidden_states` records it).
    pub fn forward(
        &self,
        x: &Tensor,
        positions: &[[i64; 3]],
        cache: &mut TextCache,
        deepstack: Option<DeepStack<'_>>,
        trace: &mut dyn FnMut(usize, &Tensor),
    ) -> Result<Tensor> {
        let (n, _) = x.dims2()?;
        if positions.len() != n {
            return Err(Error::Input {
                what: "text positions".into(),
                message: format!("{} positions for {n} rows", positions.len()),
            });
        }
        if cache.num_layers() != self.layers.len() {
            *cache = self.new_cache();
        }
        let (cos, sin) = self.rope.cos_sin(positions, &self.device)?;
        let (cos, sin) = (cos.to_dtype(self.dtype)?, sin.to_dtype(self.dtype)?);
        let visual = match deepstack {
            Some(ds) if !ds.positions.is_empty() => {
                Some((Tensor::from_slice(ds.positions, ds.positions.len(), &self.device)?, ds.levels))
            }
            _ => None,
        };
        let mut x = x.clone();
        trace(0, &x);
        for (i, layer) in self.layers.iter().enumerate() {
            x = layer.forward(&x, &cos, &sin, cache, i)?;
            trace(i + 1, &x);
            if let Some((rows, levels)) = &visual {
                if let Some(level) = levels.get(i) {
                    x = x.index_add(rows, &level.to_dtype(self.dtype)?, 0)?;
                }
            }
        }
        Ok(self.norm.forward(&x)?)
    }

    /// New positions for several sequences (batched decode, drafted tokens verified, prompts
    /// pooled together): `lens[i]` consecutive rows of `x` ([rows, hidden]) append to
    /// `caches[i]`, row `r` at `positions[r]`; `deepstack` rows are relative to `x`. Returns the
    /// final-normed hidden states [rows, hidden], each equal to what `forward` gives that
    /// sequence's rows alone (to rounding with `Attend::AsPrefill`).
    pub fn forward_rows(
        &self,
        x: &Tensor,
        positions: &[[i64; 3]],
        caches: &mut [&mut TextCache],
        lens: &[usize],
        deepstack: Option<DeepStack<'_>>,
        attend: Attend,
    ) -> Result<Tensor> {
        let (n, _) = x.dims2()?;
        if positions.len() != n || caches.len() != lens.len() || lens.iter().sum::<usize>() != n {
            return Err(Error::Input {
                what: "batch".into(),
                message: format!("{n} rows, {} positions, {} caches of {lens:?} rows", positions.len(), caches.len()),
            });
        }
        for c in caches.iter_mut() {
            if c.num_layers() != self.layers.len() {
                **c = self.new_cache();
            }
        }
        let (cos, sin) = self.rope.cos_sin(positions, &self.device)?;
        let (cos, sin) = (cos.to_dtype(self.dtype)?, sin.to_dtype(self.dtype)?);
        let visual = match deepstack {
            Some(ds) if !ds.positions.is_empty() => {
                Some((Tensor::from_slice(ds.positions, ds.positions.len(), &self.device)?, ds.levels))
            }
            _ => None,
        };
        let mut x = x.clone();
        for (i, layer) in self.layers.iter().enumerate() {
            x = layer.forward_rows(&x, (&cos, &sin), caches, lens, i, attend)?;
            if let Some((rows, levels)) = &visual {
                if let Some(level) = levels.get(i) {
                    x = x.index_add(rows, &level.to_dtype(self.dtype)?, 0)?;
                }
            }
        }
        Ok(self.norm.forward(&x)?)
    }

    /// Logits [n, vocab] in f32 from final-normed hidden states.
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        Ok(self.lm_head.forward(hidden)?.to_dtype(DType::F32)?)
    }
}

/// The checkpoint key whose presence says a checkpoint carries Qwen3.5's MTP head.
pub const MTP_FC_KEY: &str = "mtp.fc.weight";

/// Qwen3.5's multi-token-prediction head (`mtp.*`, which transformers skips), as vLLM's
/// `qwen3_5_mtp.py` runs it: for a position p, the model's final (normed) hidden row h_p and the
/// token x_{p+1} after it become `fc(concat(pre_fc_norm_embedding(embed(x_{p+1})),
/// pre_fc_norm_hidden(h_p)))`, which one full-attention decoder layer (gated attention, M-RoPE at
/// p's position, its own KV cache; the model's MLP kind, routed experts for MoE) and `norm` turn
/// into a row whose logits (the model's lm_head) predict x_{p+2}. A further draft feeds that
/// output row back as h, with the drafted token, one position on.
#[derive(Debug, Clone)]
struct MtpHead {
    fc: QLinear,
    pre_embedding: RmsNorm,
    pre_hidden: RmsNorm,
    layer: DecoderLayer,
    norm: RmsNorm,
}

impl MtpHead {
    /// The head from `vb` at the checkpoint root (`mtp.*`): its layer `mtp.layers.0` (the
    /// released checkpoints have one, `mtp_num_hidden_layers` 1).
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
