//! The tensor plan: every key the config implies, with its shape, checked against a checkpoint
//! before anything is loaded. Key names are transformers' (`model.visual.*`,
//! `model.language_model.*`, `lm_head.weight`).

use std::collections::BTreeSet;

use crate::error::{Error, Result, ShapeMismatch};

use super::config::Qwen3VlConfig;
use super::weights::Weights;

/// Which part of the model a tensor belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Group {
    Vision,
    Text,
    LmHead,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedTensor {
    pub key: String,
    pub shape: Vec<usize>,
    pub group: Group,
    /// False for tensors that may be present but are not used (`lm_head.weight` when tied).
    pub required: bool,
    /// Another shape the tensor may be stored in (fused experts: the hub's `[E, in, out]` beside
    /// transformers 5's `[E, out, in]`).
    pub alt_shape: Option<Vec<usize>>,
}

pub use super::weights::{TEXT_PREFIX, VISION_PREFIX};
pub const LM_HEAD: &str = "lm_head.weight";
/// Tensors a checkpoint may hold that no family reads: Qwen3.5's multi-token-prediction head.
pub const MTP_PREFIX: &str = "mtp.";

/// All tensors a `Qwen3VLForConditionalGeneration` with this config holds.
pub fn tensor_plan(cfg: &Qwen3VlConfig) -> Vec<PlannedTensor> {
    let mut plan = Vec::new();
    let mut add = |key: String, shape: Vec<usize>, group: Group, required: bool| {
        plan.push(PlannedTensor { key, shape, group, required, alt_shape: None });
    };
    let v = &cfg.vision;
    let vp = VISION_PREFIX;
    let (h, vi) = (v.hidden_size, v.intermediate_size);
    let merged = h * v.spatial_merge_size * v.spatial_merge_size;
    let mut vis = |key: String, shape: Vec<usize>| add(key, shape, Group::Vision, true);
    vis(
        format!("{vp}.patch_embed.proj.weight"),
        vec![h, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size],
    );
    vis(format!("{vp}.patch_embed.proj.bias"), vec![h]);
    vis(format!("{vp}.pos_embed.weight"), vec![v.num_position_embeddings, h]);
    for i in 0..v.depth {
        let b = format!("{vp}.blocks.{i}");
        for n in ["norm1", "norm2"] {
            vis(format!("{b}.{n}.weight"), vec![h]);
            vis(format!("{b}.{n}.bias"), vec![h]);
        }
        vis(format!("{b}.attn.qkv.weight"), vec![3 * h, h]);
        vis(format!("{b}.attn.qkv.bias"), vec![3 * h]);
        vis(format!("{b}.attn.proj.weight"), vec![h, h]);
        vis(format!("{b}.attn.proj.bias"), vec![h]);
        vis(format!("{b}.mlp.linear_fc1.weight"), vec![vi, h]);
        vis(format!("{b}.mlp.linear_fc1.bias"), vec![vi]);
        vis(format!("{b}.mlp.linear_fc2.weight"), vec![h, vi]);
        vis(format!("{b}.mlp.linear_fc2.bias"), vec![h]);
    }
    let mergers = std::iter::once((format!("{vp}.merger"), h))
        .chain((0..v.deepstack_visual_indexes.len()).map(|j| (format!("{vp}.deepstack_merger_list.{j}"), merged)));
    for (m, norm_dim) in mergers {
        vis(format!("{m}.norm.weight"), vec![norm_dim]);
        vis(format!("{m}.norm.bias"), vec![norm_dim]);
        vis(format!("{m}.linear_fc1.weight"), vec![merged, merged]);
        vis(format!("{m}.linear_fc1.bias"), vec![merged]);
        vis(format!("{m}.linear_fc2.weight"), vec![v.out_hidden_size, merged]);
        vis(format!("{m}.linear_fc2.bias"), vec![v.out_hidden_size]);
    }

    let t = &cfg.text;
    let tp = TEXT_PREFIX;
    let (d, q, kv) = (t.hidden_size, t.num_attention_heads * t.head_dim, t.num_key_value_heads * t.head_dim);
    let mut txt = |key: String, shape: Vec<usize>| add(key, shape, Group::Text, true);
    txt(format!("{tp}.embed_tokens.weight"), vec![t.vocab_size, d]);
    for i in 0..t.num_hidden_layers {
        let l = format!("{tp}.layers.{i}");
        txt(format!("{l}.input_layernorm.weight"), vec![d]);
        txt(format!("{l}.post_attention_layernorm.weight"), vec![d]);
        match t.hybrid.as_ref().filter(|_| t.is_linear(i)) {
            Some(h) => {
                // A Gated DeltaNet layer (Qwen3.5).
                let s = h.shape(d);
                let (a, vh) = (format!("{l}.linear_attn"), h.value_heads);
                txt(format!("{a}.in_proj_qkv.weight"), vec![s.conv_dim(), d]);
                txt(format!("{a}.in_proj_z.weight"), vec![s.value_dim(), d]);
                txt(format!("{a}.in_proj_b.weight"), vec![vh, d]);
                txt(format!("{a}.in_proj_a.weight"), vec![vh, d]);
                txt(format!("{a}.conv1d.weight"), vec![s.conv_dim(), 1, h.conv_kernel]);
                txt(format!("{a}.dt_bias"), vec![vh]);
                txt(format!("{a}.A_log"), vec![vh]);
                txt(format!("{a}.norm.weight"), vec![h.value_head_dim]);
                txt(format!("{a}.out_proj.weight"), vec![d, s.value_dim()]);
            }
            None => {
                // Qwen3.5's q_proj also yields each head's output gate.
                let q_rows = if t.hybrid.is_some() { 2 * q } else { q };
                txt(format!("{l}.self_attn.q_proj.weight"), vec![q_rows, d]);
                txt(format!("{l}.self_attn.k_proj.weight"), vec![kv, d]);
                txt(format!("{l}.self_attn.v_proj.weight"), vec![kv, d]);
                txt(format!("{l}.self_attn.o_proj.weight"), vec![d, q]);
                txt(format!("{l}.self_attn.q_norm.weight"), vec![t.head_dim]);
                txt(format!("{l}.self_attn.k_norm.weight"), vec![t.head_dim]);
            }
        }
        match t.moe.as_ref().filter(|_| t.is_sparse(i)) {
            Some(m) => {
                let (e, mi) = (m.num_experts, m.moe_intermediate_size);
                txt(format!("{l}.mlp.gate.weight"), vec![e, d]);
                txt(format!("{l}.mlp.experts.gate_up_proj"), vec![e, 2 * mi, d]);
                txt(format!("{l}.mlp.experts.down_proj"), vec![e, d, mi]);
                if let Some(si) = m.shared_intermediate_size {
                    // Qwen3.5 MoE's gated shared expert.
                    txt(format!("{l}.mlp.shared_expert.gate_proj.weight"), vec![si, d]);
                    txt(format!("{l}.mlp.shared_expert.up_proj.weight"), vec![si, d]);
                    txt(format!("{l}.mlp.shared_expert.down_proj.weight"), vec![d, si]);
                    txt(format!("{l}.mlp.shared_expert_gate.weight"), vec![1, d]);
                }
            }
            None => {
                txt(format!("{l}.mlp.gate_proj.weight"), vec![t.intermediate_size, d]);
                txt(format!("{l}.mlp.up_proj.weight"), vec![t.intermediate_size, d]);
                txt(format!("{l}.mlp.down_proj.weight"), vec![d, t.intermediate_size]);
            }
        }
    }
    txt(format!("{tp}.norm.weight"), vec![d]);
    add(LM_HEAD.to_string(), vec![t.vocab_size, d], Group::LmHead, !cfg.tie_word_embeddings);
    // A DeltaNet convolution may be stored squeezed, [C, K] (llama.cpp).
    for p in plan.iter_mut().filter(|p| p.key.ends_with(".linear_attn.conv1d.weight")) {
        p.alt_shape = Some(vec![p.shape[0], p.shape[2]]);
    }
    // The fused experts may be stored as the hub has them, [E, in, out].
    for p in plan.iter_mut().filter(|p| p.key.contains(".mlp.experts.")) {
        p.alt_shape = Some(vec![p.shape[0], p.shape[2], p.shape[1]]);
    }
    plan
}

/// The plan with each layer's fused experts as three stacked tensors, as llama.cpp's GGUF files
/// and MLX-community conversions (`switch_mlp`) store them: `mlp.experts.{gate,up}_proj.weight`
/// `[E, moe_inter, hidden]` and `mlp.experts.down_proj.weight` `[E, hidden, moe_inter]`.
pub fn split_experts(plan: Vec<PlannedTensor>) -> Vec<PlannedTensor> {
    let mut out = vec![];
    for p in plan {
        let (base, gate_up) =
            match (p.key.strip_suffix(".experts.gate_up_proj"), p.key.strip_suffix(".experts.down_proj")) {
                (Some(b), _) => (b.to_string(), true),
                (_, Some(b)) => (b.to_string(), false),
                _ => {
                    out.push(p);
                    continue;
                }
            };
        let (e, rows, cols) = (p.shape[0], p.shape[1], p.shape[2]);
        let parts: &[&str] = if gate_up { &["gate_proj", "up_proj"] } else { &["down_proj"] };
        for part in parts {
            let rows = if gate_up { rows / 2 } else { rows };
            let key = format!("{base}.experts.{part}.weight");
            out.push(PlannedTensor { key, shape: vec![e, rows, cols], alt_shape: None, ..p.clone() });
        }
    }
    out
}

/// The plan with each expert's matrices as their own tensors, as the Qwen3.5 MoE hub
/// checkpoints store them (`mlp.experts.<e>.{gate,up,down}_proj.weight`).
pub fn per_expert(plan: Vec<PlannedTensor>) -> Vec<PlannedTensor> {
    let mut out = vec![];
    for p in split_experts(plan) {
        let Some((base, part)) = p.key.rsplit_once(".experts.") else {
            out.push(p);
            continue;
        };
        let (e, rows, cols) = (p.shape[0], p.shape[1], p.shape[2]);
        for x in 0..e {
            out.push(PlannedTensor { key: format!("{base}.experts.{x}.{part}"), shape: vec![rows, cols], ..p.clone() });
        }
    }
    out
}

/// The plan `w` is checked against: the experts fused (transformers, the hub), stacked per
/// matrix (MLX-community) or one tensor per expert (the Qwen3.5 MoE hub), as the checkpoint
/// stores them.
pub fn plan_for(cfg: &Qwen3VlConfig, w: &Weights) -> Vec<PlannedTensor> {
    let plan = tensor_plan(cfg);
    if w.entries().keys().any(|k| k.ends_with(".mlp.experts.0.gate_proj.weight")) {
        per_expert(plan)
    } else if w.entries().keys().any(|k| k.ends_with(".mlp.experts.gate_proj.weight")) {
        split_experts(plan)
    } else {
        plan
    }
}

/// What a checkpoint holds relative to the plan, once it has passed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PlanReport {
    /// Optional planned tensors present but unused (e.g. `lm_head.weight` of a tied model).
    pub ignored: Vec<String>,
}

/// Checks the checkpoint's key set and shapes against the plan; names every missing,
/// unexpected and wrongly shaped tensor.
pub fn check_plan(plan: &[PlannedTensor], ck: &Weights) -> Result<PlanReport> {
    let mut missing = Vec::new();
    let mut wrong_shape = Vec::new();
    let mut report = PlanReport::default();
    let planned: BTreeSet<&str> = plan.iter().map(|p| p.key.as_str()).collect();
    for p in plan {
        match ck.get(&p.key) {
            None if p.required => missing.push(p.key.clone()),
            None => {}
            Some(info) if info.shape != p.shape && p.alt_shape.as_ref() != Some(&info.shape) => wrong_shape
                .push(ShapeMismatch { key: p.key.clone(), expected: p.shape.clone(), found: info.shape.clone() }),
            Some(_) if !p.required => report.ignored.push(p.key.clone()),
            Some(_) => {}
        }
    }
    // Qwen3.5's multi-token-prediction head (`mtp.*`) is not the plan's (transformers skips it);
    // the decoder loads it when present (`qwen3_vl/text.rs`, `MtpHead`).
    let unexpected: Vec<String> =
        ck.entries().keys().filter(|k| !planned.contains(k.as_str()) && !k.starts_with(MTP_PREFIX)).cloned().collect();
    report.ignored.extend(ck.entries().keys().filter(|k| k.starts_with(MTP_PREFIX)).cloned());
    if missing.is_empty() && unexpected.is_empty() && wrong_shape.is_empty() {
        Ok(report)
    } else {
        Err(Error::TensorPlan { dir: ck.dir().to_path_buf(), missing, unexpected, wrong_shape })
    }
}
