//! `vl inspect`: what a checkpoint directory holds, after checking it against its config.

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;

use serde::Serialize;

use crate::checkpoint::SHARD_INDEX;
use crate::error::Result;

use super::config::{ARCHITECTURE, MODEL_TYPE, MOE_ARCHITECTURE, MOE_MODEL_TYPE};
use super::plan::Group;
use super::preflight::ModelDir;
use super::weights::{Layout, Storage};

/// A checked checkpoint, summarized.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub architecture: String,
    pub model_type: String,
    pub files: usize,
    pub sharded: bool,
    /// Key layout: "transformers" or "mlx-community".
    pub layout: String,
    /// Stored format per tensor group, e.g. "text decoder: mlx 4-bit (group 64, f32 scales) (14 tensors)".
    pub storage: Vec<String>,
    /// How the stored formats are computed.
    pub compute: String,
    pub tensors: usize,
    /// Stored dtype -> number of tensors.
    pub dtypes: BTreeMap<String, usize>,
    pub parameters: ParameterCounts,
    pub text_layers: usize,
    pub vision_blocks: usize,
    pub deepstack_mergers: usize,
    pub tied_lm_head: bool,
    pub text: String,
    pub vision: String,
    /// The routed experts of a MoE checkpoint (None for a dense one).
    pub experts: Option<Experts>,
    /// Tensors present but unused (e.g. lm_head.weight of a tied model).
    pub ignored_tensors: Vec<String>,
    /// The multi-token-prediction head's tensors (`mtp.*`, Qwen3.5): transformers skips them,
    /// `--speculative mtp` drafts with them.
    pub mtp_head_tensors: usize,
    /// config.json keys neither read nor ignored on purpose.
    pub unknown_config_keys: Vec<String>,
}

/// A MoE checkpoint's experts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Experts {
    pub experts_per_layer: usize,
    /// Experts each token is routed to.
    pub active_per_token: usize,
    pub moe_intermediate_size: usize,
    /// Layers with routed experts, and the dense ones (`mlp_only_layers`, `decoder_sparse_step`).
    pub sparse_layers: Vec<usize>,
    pub dense_layers: Vec<usize>,
    /// Text parameters a token uses: the dense ones and its experts' (without the embeddings).
    pub active_text_parameters: usize,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ParameterCounts {
    pub vision: usize,
    pub text: usize,
    /// Zero when the lm_head is tied to the token embeddings.
    pub lm_head: usize,
    pub total: usize,
}

/// Runs every check that loading `dir` runs (`ModelDir::open`: config, weights, tokenizer,
/// template, processor, generation config), without loading weights, and summarizes.
pub fn inspect(dir: &Path) -> Result<Summary> {
    let m = ModelDir::open(dir)?;
    let (cfg, w, plan, report) = (m.config, m.weights, m.plan, m.plan_report);
    let mut params = ParameterCounts::default();
    let mut dtypes = BTreeMap::new();
    let mut storage: BTreeMap<&str, BTreeMap<String, usize>> = BTreeMap::new();
    let mut quantized = false;
    for p in &plan {
        let Some(e) = w.get(&p.key) else {
            continue;
        };
        if !p.required {
            continue;
        }
        *dtypes.entry(e.describe()).or_insert(0) += 1;
        quantized |= matches!(e.storage, Storage::Affine { .. });
        let n: usize = e.shape.iter().product();
        let group = match p.group {
            Group::Vision => {
                params.vision += n;
                "vision tower"
            }
            Group::Text => {
                params.text += n;
                "text decoder"
            }
            Group::LmHead => {
                params.lm_head += n;
                "lm_head"
            }
        };
        *storage.entry(group).or_default().entry(e.describe()).or_insert(0) += 1;
    }
    let compute = match (quantized, w.default_quant()) {
        (true, Some(q)) => {
            // As `vl run` loads it: rows that fill whole k-quant blocks are requantized.
            let affine_text = plan.iter().filter(|p| p.required && p.group != Group::Vision).filter_map(|p| {
                w.get(&p.key).filter(|e| matches!(e.storage, Storage::Affine { .. }) && e.shape.len() >= 2)
            });
            let (mut fit, mut dense) = (0, 0);
            for e in affine_text {
                if e.shape[1] % q.block() == 0 {
                    fit += 1;
                } else {
                    dense += 1;
                }
            }
            format!(
                "CPU, vl run's default: MLX-quantized text tensors requantized to {} (the quant of the widest stored width) where rows fill {}-value blocks ({fit} tensors), the others dequantized exactly to f32 ({dense} tensors); --quantize off: every tensor dequantized exactly, f32; GPU: bf16",
                q.name(),
                q.block()
            )
        }
        _ => "CPU: f32 (stored bf16/f16 upcast at load; --quantize q4k|q6k|q8 quantizes the text decoder); GPU: bf16"
            .into(),
    };
    let storage = storage
        .into_iter()
        .map(|(g, m)| {
            let parts: Vec<String> = m.into_iter().map(|(d, n)| format!("{d} ({n} tensors)")).collect();
            format!("{g}: {}", parts.join(", "))
        })
        .collect();
    params.total = params.vision + params.text + params.lm_head;
    let (t, v) = (&cfg.text, &cfg.vision);
    let side = v.num_grid_per_side();
    let experts = t.moe.as_ref().map(|m| {
        let (sparse, dense): (Vec<usize>, Vec<usize>) = (0..t.num_hidden_layers).partition(|&i| t.is_sparse(i));
        let per_expert = 3 * t.hidden_size * m.moe_intermediate_size;
        let all_experts = sparse.len() * m.num_experts * per_expert;
        let embed = t.vocab_size * t.hidden_size;
        Experts {
            experts_per_layer: m.num_experts,
            active_per_token: m.top_k,
            moe_intermediate_size: m.moe_intermediate_size,
            active_text_parameters: params.text - embed - all_experts + sparse.len() * m.top_k * per_expert,
            sparse_layers: sparse,
            dense_layers: dense,
        }
    });
    let moe = experts.is_some();
    let (architecture, model_type) = match (moe, t.hybrid.is_some()) {
        (false, false) => (ARCHITECTURE, MODEL_TYPE),
        (true, false) => (MOE_ARCHITECTURE, MOE_MODEL_TYPE),
        (false, true) => (super::config::HYBRID_ARCHITECTURE, super::config::HYBRID_MODEL_TYPE),
        (true, true) => (super::config::HYBRID_MOE_ARCHITECTURE, super::config::HYBRID_MOE_MODEL_TYPE),
    };
    // Qwen3.5: which layers are Gated DeltaNet, their widths, the rotary share.
    let hybrid = t.hybrid.as_ref().map_or(String::new(), |h| {
        let linear: Vec<usize> = (0..t.num_hidden_layers).filter(|&i| t.is_linear(i)).collect();
        format!(
            "; Gated DeltaNet layers {linear:?} (key heads {} x {}, value heads {} x {}, conv {}), rotary dims {} of {}",
            h.key_heads, h.key_head_dim, h.value_heads, h.value_head_dim, h.conv_kernel, t.rotary_dim, t.head_dim
        )
    });
    Ok(Summary {
        experts,
        architecture: architecture.into(),
        model_type: model_type.into(),
        files: w.checkpoint().files().len(),
        sharded: dir.join(SHARD_INDEX).is_file(),
        tensors: w.checkpoint().tensors().len(),
        layout: match w.layout {
            Layout::HuggingFace => "transformers".into(),
            Layout::MlxCommunity => "mlx-community".into(),
        },
        storage,
        compute,
        dtypes,
        parameters: params,
        text_layers: t.num_hidden_layers,
        vision_blocks: v.depth,
        deepstack_mergers: v.deepstack_visual_indexes.len(),
        tied_lm_head: cfg.tie_word_embeddings,
        text: format!(
            "hidden {}, {} heads ({} kv, head_dim {}), mlp {}, vocab {}, rope_theta {}, mrope {:?} interleaved, rms_eps {:e}",
            t.hidden_size, t.num_attention_heads, t.num_key_value_heads, t.head_dim, t.intermediate_size,
            t.vocab_size, t.rope_theta, t.mrope_section, t.rms_norm_eps
        ) + &hybrid,
        vision: format!(
            "hidden {}, {} heads, mlp {}, patch {}x{}x{}, merge {}, {side}x{side} position grid, deepstack taps {:?}, out {}",
            v.hidden_size, v.num_heads, v.intermediate_size, v.temporal_patch_size, v.patch_size, v.patch_size,
            v.spatial_merge_size, v.deepstack_visual_indexes, v.out_hidden_size
        ),
        mtp_head_tensors: report.ignored.iter().filter(|n| n.starts_with(super::plan::MTP_PREFIX)).count(),
        ignored_tensors: report.ignored.into_iter().filter(|n| !n.starts_with(super::plan::MTP_PREFIX)).collect(),
        unknown_config_keys: cfg.unknown_keys,
    })
}

impl Summary {
    /// The one-line layout, e.g. "28 text layers, 24 vision blocks, 3 deepstack mergers, merger, tied lm_head".
    pub fn layout(&self) -> String {
        format!(
            "{}, {}, {}, merger, {}",
            plural(self.text_layers, "text layer"),
            plural(self.vision_blocks, "vision block"),
            plural(self.deepstack_mergers, "deepstack merger"),
            if self.tied_lm_head { "tied lm_head" } else { "untied lm_head" }
        )
    }
}

fn plural(n: usize, what: &str) -> String {
    format!("{n} {what}{}", if n == 1 { "" } else { "s" })
}

fn human(n: usize) -> String {
    match n {
        n if n >= 1_000_000_000 => format!("{:.2}B", n as f64 / 1e9),
        n if n >= 1_000_000 => format!("{:.2}M", n as f64 / 1e6),
        n if n >= 1_000 => format!("{:.1}K", n as f64 / 1e3),
        n => n.to_string(),
    }
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let p = &self.parameters;
        writeln!(f, "architecture: {} ({})", self.architecture, self.model_type)?;
        writeln!(f, "layout:       {}", self.layout())?;
        let dt: Vec<String> = self.dtypes.iter().map(|(k, n)| format!("{k} ({n} tensors)")).collect();
        writeln!(
            f,
            "weights:      {} tensors in {} file{}{}, {}",
            self.tensors,
            self.files,
            if self.files == 1 { "" } else { "s" },
            if self.sharded { " (sharded)" } else { "" },
            dt.join(", ")
        )?;
        let head = if self.tied_lm_head { "tied".to_string() } else { format!("{} ({})", human(p.lm_head), p.lm_head) };
        writeln!(
            f,
            "parameters:   {} ({}): vision {} ({}), text {} ({}), lm_head {}",
            human(p.total),
            p.total,
            human(p.vision),
            p.vision,
            human(p.text),
            p.text,
            head
        )?;
        writeln!(f, "storage:      {} layout; {}", self.layout, self.storage.join("; "))?;
        writeln!(f, "compute:      {}", self.compute)?;
        writeln!(f, "text:         {}", self.text)?;
        if let Some(e) = &self.experts {
            writeln!(
                f,
                "experts:      {} per layer, {} active per token, moe_intermediate {}; sparse layers {:?}, dense {:?}; {} ({}) text parameters active per token",
                e.experts_per_layer,
                e.active_per_token,
                e.moe_intermediate_size,
                e.sparse_layers,
                e.dense_layers,
                human(e.active_text_parameters),
                e.active_text_parameters
            )?;
        }
        write!(f, "vision:       {}", self.vision)?;
        if self.mtp_head_tensors > 0 {
            write!(
                f,
                "\nmtp head:     {} tensors (mtp.*; transformers skips them, --speculative mtp drafts with them)",
                self.mtp_head_tensors
            )?;
        }
        if !self.ignored_tensors.is_empty() {
            write!(f, "\nignored:      {}", self.ignored_tensors.join(", "))?;
        }
        if !self.unknown_config_keys.is_empty() {
            write!(
                f,
                "\nwarning:      config keys not understood: {}",
                super::config::shown_keys(&self.unknown_config_keys)
            )?;
        }
        Ok(())
    }
}
