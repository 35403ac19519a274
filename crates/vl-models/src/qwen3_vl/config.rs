//! Qwen3-VL configuration, mirroring transformers' `models/qwen3_vl/configuration_qwen3_vl.py`.
//!
//! Accepts both dialects found in the wild: transformers 4.57 (`rope_theta` + `rope_scaling`) and
//! transformers 5 (`rope_parameters`), and `tie_word_embeddings` at the top level or in
//! `text_config`. Every key is read, ignored on purpose (listed below), or reported as unknown;
//! an unsupported feature is an error naming the field.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::Value;

use crate::error::{Error, Result};

pub const ARCHITECTURE: &str = "Qwen3VLForConditionalGeneration";
pub const MODEL_TYPE: &str = "qwen3_vl";
/// The MoE checkpoints (30B-A3B, 235B-A22B): the same model with routed-expert MLPs.
pub const MOE_ARCHITECTURE: &str = "Qwen3VLMoeForConditionalGeneration";
pub const MOE_MODEL_TYPE: &str = "qwen3_vl_moe";
/// Qwen3.5 / 3.6 / 3.8 (`models/qwen3_5`): Qwen3-VL's vision tower (no DeepStack) before a
/// hybrid decoder of Gated DeltaNet and gated full-attention layers.
pub const HYBRID_ARCHITECTURE: &str = "Qwen3_5ForConditionalGeneration";
pub const HYBRID_MODEL_TYPE: &str = "qwen3_5";
/// Qwen3.5 MoE (`models/qwen3_5_moe`): the hybrid decoder with routed experts and a gated shared
/// expert in every layer.
pub const HYBRID_MOE_ARCHITECTURE: &str = "Qwen3_5MoeForConditionalGeneration";
pub const HYBRID_MOE_MODEL_TYPE: &str = "qwen3_5_moe";

/// The vision tower's rotary base: fixed in transformers 4.57, `rope_parameters.rope_theta` in 5.
const DEFAULT_VISION_ROPE_THETA: f64 = 10_000.0;
/// transformers' `Qwen3VLTextConfig.default_theta`.
const DEFAULT_TEXT_ROPE_THETA: f64 = 500_000.0;
/// transformers' fallback when `mrope_section` is absent.
const DEFAULT_MROPE_SECTION: [usize; 3] = [24, 20, 20];

/// Config key names for a line of text: at most 20 (then how many more), each escaped (no
/// control character reaches a terminal) and cut to 64 characters.
pub(crate) fn shown_keys(keys: &[String]) -> String {
    let shown = |k: &String| {
        let e: String = k.escape_debug().collect();
        if e.chars().count() > 64 {
            format!("{}...", e.chars().take(64).collect::<String>())
        } else {
            e
        }
    };
    let mut names = keys.iter().take(20).map(shown).collect::<Vec<_>>().join(", ");
    if keys.len() > 20 {
        names += &format!(" and {} more", keys.len() - 20);
    }
    names
}

/// Keys that carry no meaning for inference (training knobs, bookkeeping), ignored on purpose.
const IGNORED_TOP: &[&str] = &[
    // Read by `weights.rs` (MLX affine quantization).
    "quantization",
    "quantization_config",
    // A copy of generation_config.json that mlx-vlm embeds; the file is authoritative.
    "generation_config",
    "architectures",
    "model_type",
    "transformers_version",
    "dtype",
    "torch_dtype",
    "use_cache",
    "initializer_range",
    "_name_or_path",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "text_config",
    "vision_config",
];
const IGNORED_TEXT: &[&str] = &[
    "model_type",
    "initializer_range",
    "use_cache",
    "attention_dropout",
    "dtype",
    "torch_dtype",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "rope_scaling",
    "rope_parameters",
    "tie_word_embeddings",
    "transformers_version",
    // MoE training knobs (auxiliary load-balancing loss).
    "output_router_logits",
    "router_aux_loss_coef",
    // transformers (4.57 and 5.x alike) renormalizes the top-k weights whatever this says.
    "norm_topk_prob",
    "sliding_window",
    // Qwen3.5: the multi-token-prediction head (`mtp.*` tensors), which transformers skips; its
    // one layer loads from the tensors themselves (`qwen3_vl/text.rs`, `MtpHead`).
    "mtp_num_hidden_layers",
    "mtp_use_dedicated_embeddings",
];
const IGNORED_VISION: &[&str] =
    &["model_type", "initializer_range", "dtype", "torch_dtype", "rope_parameters", "transformers_version"];

/// Rotary parameters in either dialect (`rope_scaling` in 4.57, `rope_parameters` in 5).
#[derive(Debug, Clone, Default, Deserialize)]
struct RawRope {
    rope_type: Option<String>,
    #[serde(rename = "type")]
    type_alias: Option<String>,
    rope_theta: Option<f64>,
    mrope_section: Option<Vec<usize>>,
    mrope_interleaved: Option<bool>,
    partial_rotary_factor: Option<f64>,
    #[serde(flatten)]
    extra: BTreeMap<String, Value>,
}

#[derive(Debug, Deserialize)]
struct RawText {
    vocab_size: usize,
    hidden_size: usize,
    // Absent from Qwen3.5 MoE configs (every layer routed).
    intermediate_size: Option<usize>,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    #[serde(default = "default_silu")]
    hidden_act: String,
    #[serde(default = "default_max_pos")]
    max_position_embeddings: usize,
    #[serde(default = "default_rms_eps")]
    rms_norm_eps: f64,
    rope_theta: Option<f64>,
    rope_scaling: Option<RawRope>,
    rope_parameters: Option<RawRope>,
    #[serde(default)]
    attention_bias: bool,
    tie_word_embeddings: Option<bool>,
    // MoE (`qwen3_vl_moe` only): `num_experts` (4.57 dialect) or `num_local_experts` (5.x).
    num_experts: Option<usize>,
    num_local_experts: Option<usize>,
    num_experts_per_tok: Option<usize>,
    moe_intermediate_size: Option<usize>,
    decoder_sparse_step: Option<usize>,
    mlp_only_layers: Option<Vec<usize>>,
    shared_expert_intermediate_size: Option<usize>,
    // Qwen3.5 (`qwen3_5` only): the layer pattern in either dialect, the DeltaNet widths, the
    // rotary fraction (here or in rope_parameters) and the attention output gate (Qwen3-Next's key).
    layer_types: Option<Vec<String>>,
    full_attention_interval: Option<usize>,
    linear_conv_kernel_dim: Option<usize>,
    linear_key_head_dim: Option<usize>,
    linear_value_head_dim: Option<usize>,
    linear_num_key_heads: Option<usize>,
    linear_num_value_heads: Option<usize>,
    partial_rotary_factor: Option<f64>,
    attn_output_gate: Option<bool>,
    #[serde(flatten)]
    extra: BTreeMap<String, Value>,
}

#[derive(Debug, Deserialize)]
struct RawVision {
    depth: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_heads: usize,
    #[serde(default = "default_in_channels")]
    in_channels: usize,
    patch_size: usize,
    #[serde(default = "default_two")]
    spatial_merge_size: usize,
    #[serde(default = "default_two")]
    temporal_patch_size: usize,
    out_hidden_size: usize,
    #[serde(default = "default_num_pos")]
    num_position_embeddings: usize,
    #[serde(default)]
    deepstack_visual_indexes: Vec<usize>,
    #[serde(default = "default_gelu_tanh")]
    hidden_act: String,
    rope_parameters: Option<RawRope>,
    #[serde(flatten)]
    extra: BTreeMap<String, Value>,
}

#[derive(Debug, Deserialize)]
struct RawTop {
    // `architectures` and `model_type` are checked by `check_architecture` on the raw JSON.
    text_config: Value,
    vision_config: Value,
    image_token_id: Option<u32>,
    video_token_id: Option<u32>,
    vision_start_token_id: Option<u32>,
    vision_end_token_id: Option<u32>,
    tie_word_embeddings: Option<bool>,
    #[serde(flatten)]
    extra: BTreeMap<String, Value>,
}

fn default_silu() -> String {
    "silu".into()
}
fn default_gelu_tanh() -> String {
    "gelu_pytorch_tanh".into()
}
fn default_max_pos() -> usize {
    128_000
}
fn default_rms_eps() -> f64 {
    1e-6
}
fn default_in_channels() -> usize {
    3
}
fn default_two() -> usize {
    2
}
fn default_num_pos() -> usize {
    2304
}
/// transformers' defaults for (image, video, vision start, vision end) ids.
const QWEN3_VL_VISION_IDS: [u32; 4] = [151_655, 151_656, 151_652, 151_653];
const QWEN3_5_VISION_IDS: [u32; 4] = [248_056, 248_057, 248_053, 248_054];

/// Which of the configs this reader takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Dense,
    Moe,
    Hybrid,
    HybridMoe,
}

impl Kind {
    fn hybrid(self) -> bool {
        matches!(self, Kind::Hybrid | Kind::HybridMoe)
    }
    fn moe(self) -> bool {
        matches!(self, Kind::Moe | Kind::HybridMoe)
    }
}

/// The text decoder's geometry, resolved from either dialect.
#[derive(Debug, Clone, PartialEq)]
pub struct TextConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    /// Frequency slots per axis (t, h, w); laid out interleaved T,H,W,T,H,W,...
    pub mrope_section: Vec<usize>,
    /// Leading dims of each head that rotate (`partial_rotary_factor * head_dim`; all for Qwen3-VL).
    pub rotary_dim: usize,
    /// Routed experts (the MoE checkpoints); None for the dense ones.
    pub moe: Option<MoeConfig>,
    /// Qwen3.5's hybrid decoder; None for Qwen3-VL.
    pub hybrid: Option<HybridConfig>,
}

/// Qwen3.5's decoder (`Qwen3_5TextModel`): `linear[i]` layers are Gated DeltaNet token mixers,
/// the others full attention whose `q_proj` also yields a per-head output gate
/// (out * sigmoid(gate)); every decoder RMSNorm (layers, q/k, final) multiplies by (1 + weight).
#[derive(Debug, Clone, PartialEq)]
pub struct HybridConfig {
    pub linear: Vec<bool>,
    pub conv_kernel: usize,
    pub key_heads: usize,
    pub value_heads: usize,
    pub key_head_dim: usize,
    pub value_head_dim: usize,
    /// llama.cpp's `qwen35` layout (its converter's rewrites): value heads tiled across key
    /// heads, the decoder norms stored with their +1, `A_log` stored as -exp(A_log).
    pub gguf_layout: bool,
    /// The decoder norms are stored with their +1 added (llama.cpp's converter and mlx-vlm's
    /// `sanitize` both add it; transformers' checkpoints do not).
    pub norms_plus_one: bool,
}

impl Qwen3VlConfig {
    /// What the checkpoint's layout says beyond config.json: mlx-vlm's Qwen3.5 conversions store
    /// the decoder norms with their +1 (its `sanitize`).
    pub fn follow_layout(&mut self, weights: &super::weights::Weights) {
        if let (Some(h), super::weights::Layout::MlxCommunity) = (self.text.hybrid.as_mut(), weights.layout) {
            h.norms_plus_one = true;
        }
    }
}

impl HybridConfig {
    /// The DeltaNet widths for a decoder of `hidden`.
    pub fn shape(&self, hidden: usize) -> vl_nn::DeltaNetShape {
        vl_nn::DeltaNetShape {
            hidden,
            rule: vl_nn::DeltaShape {
                k_heads: self.key_heads,
                v_heads: self.value_heads,
                k_dim: self.key_head_dim,
                v_dim: self.value_head_dim,
                tiled: self.gguf_layout,
            },
            conv_kernel: self.conv_kernel,
        }
    }
}

/// The routed-expert MLPs of a MoE checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    pub num_experts: usize,
    /// Experts each token is routed to.
    pub top_k: usize,
    pub moe_intermediate_size: usize,
    pub decoder_sparse_step: usize,
    /// Layers whose MLP stays dense.
    pub mlp_only_layers: Vec<usize>,
    /// A shared expert beside the routed ones, scaled by sigmoid(shared_expert_gate(x))
    /// (Qwen3.5 MoE): its intermediate size.
    pub shared_intermediate_size: Option<usize>,
}

impl MoeConfig {
    /// Whether layer `i` has routed experts (transformers' rule: not in `mlp_only_layers`, and
    /// `(i + 1) % decoder_sparse_step == 0`).
    pub fn is_sparse(&self, i: usize) -> bool {
        !self.mlp_only_layers.contains(&i) && (i + 1).is_multiple_of(self.decoder_sparse_step)
    }
}

impl TextConfig {
    /// Whether layer `i`'s MLP is routed experts.
    pub fn is_sparse(&self, i: usize) -> bool {
        self.moe.as_ref().is_some_and(|m| m.is_sparse(i))
    }
    /// Whether layer `i` is a Gated DeltaNet layer (Qwen3.5), not attention.
    pub fn is_linear(&self, i: usize) -> bool {
        self.hybrid.as_ref().is_some_and(|h| h.linear.get(i).copied().unwrap_or(false))
    }
    /// Layers that keep keys and values (all but the DeltaNet ones).
    pub fn attention_layers(&self) -> usize {
        (0..self.num_hidden_layers).filter(|&i| !self.is_linear(i)).count()
    }
}

/// The vision tower's geometry.
#[derive(Debug, Clone, PartialEq)]
pub struct VisionConfig {
    pub depth: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_heads: usize,
    pub in_channels: usize,
    pub patch_size: usize,
    pub spatial_merge_size: usize,
    pub temporal_patch_size: usize,
    pub out_hidden_size: usize,
    pub num_position_embeddings: usize,
    /// Vision blocks after which a DeepStack merger taps the hidden states.
    pub deepstack_visual_indexes: Vec<usize>,
    pub rope_theta: f64,
}

impl VisionConfig {
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_heads
    }
    /// Side of the learned square position-embedding grid.
    pub fn num_grid_per_side(&self) -> usize {
        (self.num_position_embeddings as f64).sqrt().round() as usize
    }
    /// Values per patch row: C * T * P * P.
    pub fn patch_row_len(&self) -> usize {
        self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size
    }
}

/// A resolved `Qwen3VLForConditionalGeneration` configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Qwen3VlConfig {
    pub text: TextConfig,
    pub vision: VisionConfig,
    pub tie_word_embeddings: bool,
    pub image_token_id: u32,
    pub video_token_id: u32,
    pub vision_start_token_id: u32,
    pub vision_end_token_id: u32,
    /// Keys present in config.json that this runtime neither reads nor ignores on purpose
    /// (dotted paths, e.g. `text_config.foo`). Reported by `vl inspect`.
    pub unknown_keys: Vec<String>,
}

impl Qwen3VlConfig {
    /// Reads `dir/config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        if !path.is_file() {
            return Err(Error::not_a_model_dir(dir));
        }
        let text = crate::limits::read_text(&path, crate::limits::MAX_METADATA_FILE_BYTES)?;
        Self::from_json_str(&text, &path)
    }

    /// Parses a config.json body; `path` is used in error messages only.
    pub fn from_json_str(text: &str, path: &Path) -> Result<Self> {
        let json_err = |source| Error::Json { path: path.to_path_buf(), source };
        let value: Value = serde_json::from_str(text).map_err(json_err)?;
        let kind = check_architecture(&value, path)?;
        let is_moe = kind.moe();
        let top: RawTop = serde_json::from_value(value).map_err(json_err)?;
        let field_err = |field: &str, message: String| Error::Config {
            path: path.to_path_buf(),
            field: field.to_string(),
            message,
        };
        let raw_text: RawText =
            serde_json::from_value(top.text_config.clone()).map_err(|e| field_err("text_config", e.to_string()))?;
        let raw_vision: RawVision =
            serde_json::from_value(top.vision_config.clone()).map_err(|e| field_err("vision_config", e.to_string()))?;

        let mut unknown = Vec::new();
        collect_unknown(&top.extra, IGNORED_TOP, "", &mut unknown);
        collect_unknown(&raw_text.extra, IGNORED_TEXT, "text_config.", &mut unknown);
        collect_unknown(&raw_vision.extra, IGNORED_VISION, "vision_config.", &mut unknown);

        if raw_text.hidden_act != "silu" {
            return Err(field_err(
                "text_config.hidden_act",
                format!("{:?} is not supported (silu only)", raw_text.hidden_act),
            ));
        }
        if raw_text.attention_bias {
            return Err(field_err("text_config.attention_bias", "true is not supported".into()));
        }
        if raw_vision.hidden_act != "gelu_pytorch_tanh" {
            return Err(field_err(
                "vision_config.hidden_act",
                format!("{:?} is not supported (gelu_pytorch_tanh only)", raw_vision.hidden_act),
            ));
        }

        // transformers 5 `rope_parameters` wins over the 4.57 pair when both are present.
        let (rope_field, rope) = match (&raw_text.rope_parameters, &raw_text.rope_scaling) {
            (Some(r), _) => ("text_config.rope_parameters", r.clone()),
            (None, Some(r)) => ("text_config.rope_scaling", r.clone()),
            (None, None) => ("text_config.rope_parameters", RawRope::default()),
        };
        let rope_type = rope.rope_type.clone().or(rope.type_alias.clone()).unwrap_or_else(|| "default".into());
        if rope_type != "default" && rope_type != "mrope" {
            return Err(field_err(&format!("{rope_field}.rope_type"), format!("{rope_type:?} is not supported")));
        }
        let partial = rope.partial_rotary_factor.or(raw_text.partial_rotary_factor);
        if rope.mrope_interleaved == Some(false) {
            return Err(field_err(
                &format!("{rope_field}.mrope_interleaved"),
                "false (chunked M-RoPE) is not supported by Qwen3-VL".into(),
            ));
        }
        for k in rope.extra.keys() {
            unknown.push(format!("{rope_field}.{k}"));
        }
        let rope_theta = rope.rope_theta.or(raw_text.rope_theta).unwrap_or(DEFAULT_TEXT_ROPE_THETA);
        let mrope_section = rope.mrope_section.clone().unwrap_or_else(|| DEFAULT_MROPE_SECTION.to_vec());
        // Sizes first (bounds keep every product of them far from overflow), then relations.
        let b = Bounds { path };
        b.size("text_config.vocab_size", raw_text.vocab_size, MAX_VOCAB)?;
        b.size("text_config.hidden_size", raw_text.hidden_size, MAX_HIDDEN)?;
        let intermediate_size = match (raw_text.intermediate_size, kind) {
            (Some(i), _) => i,
            // Every layer routed: no dense MLP.
            (None, Kind::HybridMoe) => 0,
            (None, _) => return Err(field_err("text_config.intermediate_size", "missing".into())),
        };
        if kind != Kind::HybridMoe || intermediate_size > 0 {
            b.size("text_config.intermediate_size", intermediate_size, MAX_INTERMEDIATE)?;
        }
        b.size("text_config.num_hidden_layers", raw_text.num_hidden_layers, MAX_LAYERS)?;
        b.size("text_config.num_attention_heads", raw_text.num_attention_heads, MAX_HEADS)?;
        b.size("text_config.max_position_embeddings", raw_text.max_position_embeddings, MAX_POSITIONS)?;
        if let Some(hd) = raw_text.head_dim {
            b.size("text_config.head_dim", hd, MAX_HEAD_DIM)?;
        }
        let head_dim = raw_text.head_dim.unwrap_or(raw_text.hidden_size / raw_text.num_attention_heads);
        if head_dim == 0 || !head_dim.is_multiple_of(2) || head_dim > MAX_HEAD_DIM {
            return Err(field_err(
                "text_config.head_dim",
                format!("{head_dim} must be even and in 2..={MAX_HEAD_DIM} (rotary pairs)"),
            ));
        }
        b.positive_float("text_config.rms_norm_eps", raw_text.rms_norm_eps, MAX_NORM_EPS)?;
        b.positive_float(&format!("{rope_field}.rope_theta"), rope_theta, MAX_ROPE_THETA)?;
        // Qwen3.5 rotates the first quarter of each head by default; Qwen3-VL all of it.
        let factor = match (kind, partial) {
            (_, Some(f)) => f,
            (k, None) if k.hybrid() => 0.25,
            _ => 1.0,
        };
        let rotary_dim = (head_dim as f64 * factor) as usize;
        if !(factor > 0.0 && factor <= 1.0) || rotary_dim < 2 || !rotary_dim.is_multiple_of(2) {
            return Err(field_err(
                &format!("{rope_field}.partial_rotary_factor"),
                format!("{factor} of head_dim {head_dim} must give an even number of rotary dims in 2..={head_dim}"),
            ));
        }
        if !kind.hybrid() && rotary_dim != head_dim {
            return Err(field_err(
                &format!("{rope_field}.partial_rotary_factor"),
                format!("{factor} is not supported by Qwen3-VL (every head dim rotates)"),
            ));
        }
        if mrope_section.len() != 3 || mrope_section.iter().sum::<usize>() > rotary_dim / 2 {
            return Err(field_err(
                &format!("{rope_field}.mrope_section"),
                format!("{mrope_section:?} must be 3 sections summing to at most rotary dims/2 = {}", rotary_dim / 2),
            ));
        }
        let kv_heads = raw_text.num_key_value_heads.unwrap_or(raw_text.num_attention_heads);
        if kv_heads == 0 || kv_heads > MAX_HEADS || !raw_text.num_attention_heads.is_multiple_of(kv_heads) {
            return Err(field_err(
                "text_config.num_key_value_heads",
                format!("{kv_heads} does not divide num_attention_heads {}", raw_text.num_attention_heads),
            ));
        }
        let moe = if is_moe { Some(moe_config(&raw_text, &b, path)?) } else { None };
        if !is_moe {
            for (k, set) in [
                ("num_experts", raw_text.num_experts.is_some()),
                ("num_local_experts", raw_text.num_local_experts.is_some()),
                ("num_experts_per_tok", raw_text.num_experts_per_tok.is_some()),
                ("moe_intermediate_size", raw_text.moe_intermediate_size.is_some()),
                ("decoder_sparse_step", raw_text.decoder_sparse_step.is_some()),
                ("mlp_only_layers", raw_text.mlp_only_layers.is_some()),
                ("shared_expert_intermediate_size", raw_text.shared_expert_intermediate_size.is_some()),
            ] {
                if set {
                    unknown.push(format!("text_config.{k}"));
                }
            }
        }
        let hybrid = if kind.hybrid() { Some(hybrid_config(&raw_text, &b, path)?) } else { None };
        if !kind.hybrid() {
            for (k, set) in [
                ("layer_types", raw_text.layer_types.is_some()),
                ("full_attention_interval", raw_text.full_attention_interval.is_some()),
                ("linear_conv_kernel_dim", raw_text.linear_conv_kernel_dim.is_some()),
                ("linear_key_head_dim", raw_text.linear_key_head_dim.is_some()),
                ("linear_value_head_dim", raw_text.linear_value_head_dim.is_some()),
                ("linear_num_key_heads", raw_text.linear_num_key_heads.is_some()),
                ("linear_num_value_heads", raw_text.linear_num_value_heads.is_some()),
                ("attn_output_gate", raw_text.attn_output_gate.is_some()),
            ] {
                if set {
                    unknown.push(format!("text_config.{k}"));
                }
            }
        }
        let text = TextConfig {
            moe,
            hybrid,
            rotary_dim,
            vocab_size: raw_text.vocab_size,
            hidden_size: raw_text.hidden_size,
            intermediate_size,
            num_hidden_layers: raw_text.num_hidden_layers,
            num_attention_heads: raw_text.num_attention_heads,
            num_key_value_heads: kv_heads,
            head_dim,
            max_position_embeddings: raw_text.max_position_embeddings,
            rms_norm_eps: raw_text.rms_norm_eps,
            rope_theta,
            mrope_section,
        };

        let vrope = raw_vision.rope_parameters.clone().unwrap_or_default();
        if let Some(t) = vrope.rope_type.as_deref().or(vrope.type_alias.as_deref()) {
            if t != "axial" && t != "default" {
                return Err(field_err("vision_config.rope_parameters.rope_type", format!("{t:?} is not supported")));
            }
        }
        let vision = VisionConfig {
            depth: raw_vision.depth,
            hidden_size: raw_vision.hidden_size,
            intermediate_size: raw_vision.intermediate_size,
            num_heads: raw_vision.num_heads,
            in_channels: raw_vision.in_channels,
            patch_size: raw_vision.patch_size,
            spatial_merge_size: raw_vision.spatial_merge_size,
            temporal_patch_size: raw_vision.temporal_patch_size,
            out_hidden_size: raw_vision.out_hidden_size,
            num_position_embeddings: raw_vision.num_position_embeddings,
            deepstack_visual_indexes: raw_vision.deepstack_visual_indexes,
            rope_theta: vrope.rope_theta.unwrap_or(DEFAULT_VISION_ROPE_THETA),
        };
        validate_vision(&vision, &text, path)?;
        let defaults = if kind.hybrid() { QWEN3_5_VISION_IDS } else { QWEN3_VL_VISION_IDS };
        let ids = [
            ("image_token_id", top.image_token_id.unwrap_or(defaults[0])),
            ("video_token_id", top.video_token_id.unwrap_or(defaults[1])),
            ("vision_start_token_id", top.vision_start_token_id.unwrap_or(defaults[2])),
            ("vision_end_token_id", top.vision_end_token_id.unwrap_or(defaults[3])),
        ];
        for (i, (name, id)) in ids.iter().enumerate() {
            if *id as usize >= text.vocab_size {
                return Err(field_err(name, format!("{id} is outside the vocabulary of {}", text.vocab_size)));
            }
            if let Some((other, _)) = ids[..i].iter().find(|(_, o)| o == id) {
                return Err(field_err(name, format!("{id} is also the {other}")));
            }
        }

        Ok(Self {
            text,
            vision,
            // transformers 5 reads the top level; 4.57 checkpoints also carry it in text_config.
            tie_word_embeddings: top.tie_word_embeddings.or(raw_text.tie_word_embeddings).unwrap_or(false),
            image_token_id: ids[0].1,
            video_token_id: ids[1].1,
            vision_start_token_id: ids[2].1,
            vision_end_token_id: ids[3].1,
            unknown_keys: unknown,
        })
    }
}

/// The MoE fields of a `qwen3_vl_moe` text config, bounded and related to the layers.
fn moe_config(t: &RawText, b: &Bounds, path: &Path) -> Result<MoeConfig> {
    let field_err =
        |field: &str, message: String| Error::Config { path: path.to_path_buf(), field: field.into(), message };
    let (field, num_experts) = match (t.num_local_experts, t.num_experts) {
        (Some(n), _) => ("text_config.num_local_experts", n),
        (None, Some(n)) => ("text_config.num_experts", n),
        (None, None) => {
            return Err(field_err(
                "text_config.num_experts",
                "missing (a qwen3_vl_moe config names its experts: num_experts or num_local_experts)".into(),
            ))
        }
    };
    b.size(field, num_experts, MAX_EXPERTS)?;
    let top_k = t.num_experts_per_tok.ok_or_else(|| field_err("text_config.num_experts_per_tok", "missing".into()))?;
    if top_k == 0 || top_k > num_experts {
        return Err(field_err("text_config.num_experts_per_tok", format!("{top_k} must be in 1..={num_experts}")));
    }
    let inter =
        t.moe_intermediate_size.ok_or_else(|| field_err("text_config.moe_intermediate_size", "missing".into()))?;
    b.size("text_config.moe_intermediate_size", inter, MAX_INTERMEDIATE)?;
    let step = t.decoder_sparse_step.unwrap_or(1);
    b.size("text_config.decoder_sparse_step", step, MAX_LAYERS)?;
    let only = t.mlp_only_layers.clone().unwrap_or_default();
    if let Some(l) = only.iter().find(|&&l| l >= t.num_hidden_layers) {
        return Err(field_err(
            "text_config.mlp_only_layers",
            format!("layer {l} is past the model's {} layers", t.num_hidden_layers),
        ));
    }
    let shared = t.shared_expert_intermediate_size;
    if let Some(s) = shared {
        b.size("text_config.shared_expert_intermediate_size", s, MAX_INTERMEDIATE)?;
    }
    Ok(MoeConfig {
        num_experts,
        top_k,
        moe_intermediate_size: inter,
        decoder_sparse_step: step,
        mlp_only_layers: only,
        shared_intermediate_size: shared,
    })
}

/// The hybrid decoder's fields of a `qwen3_5` text config: the layer pattern (`layer_types`, or
/// every `full_attention_interval`-th layer full, transformers' rule, default 4) and the
/// DeltaNet widths (transformers' defaults when absent).
fn hybrid_config(t: &RawText, b: &Bounds, path: &Path) -> Result<HybridConfig> {
    let field_err =
        |field: &str, message: String| Error::Config { path: path.to_path_buf(), field: field.into(), message };
    if t.attn_output_gate == Some(false) {
        return Err(field_err(
            "text_config.attn_output_gate",
            "false is not supported (Qwen3.5 gates attention)".into(),
        ));
    }
    let n = t.num_hidden_layers;
    let linear: Vec<bool> = match (&t.layer_types, t.full_attention_interval) {
        (Some(types), _) => {
            if types.len() != n {
                return Err(field_err(
                    "text_config.layer_types",
                    format!("{} entries for {n} layers (num_hidden_layers)", types.len()),
                ));
            }
            types
                .iter()
                .map(|ty| match ty.as_str() {
                    "linear_attention" => Ok(true),
                    "full_attention" => Ok(false),
                    other => Err(field_err(
                        "text_config.layer_types",
                        format!("{other:?} is not a layer type (linear_attention or full_attention)"),
                    )),
                })
                .collect::<Result<_>>()?
        }
        (None, interval) => {
            let every = interval.unwrap_or(4);
            b.size("text_config.full_attention_interval", every, MAX_LAYERS)?;
            (0..n).map(|i| !(i + 1).is_multiple_of(every)).collect()
        }
    };
    let size = |field: &str, v: Option<usize>, default: usize, max: usize| -> Result<usize> {
        let v = v.unwrap_or(default);
        b.size(&format!("text_config.{field}"), v, max)?;
        Ok(v)
    };
    let h = HybridConfig {
        linear,
        conv_kernel: size("linear_conv_kernel_dim", t.linear_conv_kernel_dim, 4, MAX_CONV_KERNEL)?,
        key_heads: size("linear_num_key_heads", t.linear_num_key_heads, 16, MAX_HEADS)?,
        value_heads: size("linear_num_value_heads", t.linear_num_value_heads, 32, MAX_HEADS)?,
        key_head_dim: size("linear_key_head_dim", t.linear_key_head_dim, 128, MAX_HEAD_DIM)?,
        value_head_dim: size("linear_value_head_dim", t.linear_value_head_dim, 128, MAX_HEAD_DIM)?,
        gguf_layout: false,
        norms_plus_one: false,
    };
    if !h.value_heads.is_multiple_of(h.key_heads) {
        return Err(field_err(
            "text_config.linear_num_value_heads",
            format!("{} is not a multiple of linear_num_key_heads {}", h.value_heads, h.key_heads),
        ));
    }
    Ok(h)
}

/// Checks `architectures` / `model_type`: which of the configs this is.
fn check_architecture(value: &Value, path: &Path) -> Result<Kind> {
    let archs: Vec<String> = value
        .get("architectures")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(|v| v.as_str().map(String::from)).collect())
        .unwrap_or_default();
    let model_type = value.get("model_type").and_then(Value::as_str).map(String::from);
    for (arch, ty, kind) in [
        (ARCHITECTURE, MODEL_TYPE, Kind::Dense),
        (MOE_ARCHITECTURE, MOE_MODEL_TYPE, Kind::Moe),
        (HYBRID_ARCHITECTURE, HYBRID_MODEL_TYPE, Kind::Hybrid),
        (HYBRID_MOE_ARCHITECTURE, HYBRID_MOE_MODEL_TYPE, Kind::HybridMoe),
    ] {
        let arch_ok = archs.is_empty() || archs.iter().any(|a| a == arch);
        if arch_ok && model_type.as_deref() == Some(ty) {
            return Ok(kind);
        }
    }
    Err(Error::UnknownArchitecture {
        path: path.to_path_buf(),
        found: archs,
        model_type,
        supported: "Qwen3VLForConditionalGeneration (model_type qwen3_vl), Qwen3VLMoeForConditionalGeneration (model_type qwen3_vl_moe), Qwen3_5ForConditionalGeneration (model_type qwen3_5), Qwen3_5MoeForConditionalGeneration (model_type qwen3_5_moe)",
    })
}

// Upper bounds on config values: several times the largest released Qwen3-VL (32B: hidden 5120,
// 64 layers, vocab 151936, context 262144), low enough that nothing sized by them can exhaust
// memory before the checkpoint's own tensors are checked against them.
const MAX_VOCAB: usize = 1 << 22;
const MAX_HIDDEN: usize = 1 << 16;
const MAX_INTERMEDIATE: usize = 1 << 18;
const MAX_LAYERS: usize = 1024;
/// Routed experts per layer (the released MoE models have 128).
const MAX_EXPERTS: usize = 4096;
const MAX_HEADS: usize = 1024;
const MAX_HEAD_DIM: usize = 1024;
/// The DeltaNet convolution's taps (the released models have 4).
const MAX_CONV_KERNEL: usize = 64;
const MAX_POSITIONS: usize = 1 << 24;
const MAX_VISION_DEPTH: usize = 256;
const MAX_PATCH: usize = 64;
const MAX_MERGE: usize = 8;
const MAX_TEMPORAL_PATCH: usize = 16;
const MAX_POSITION_GRID: usize = 1 << 20;
const MAX_NORM_EPS: f64 = 0.1;
const MAX_ROPE_THETA: f64 = 1e12;

/// Range checks that name the file, field, value and bound.
struct Bounds<'a> {
    path: &'a Path,
}

impl Bounds<'_> {
    fn err(&self, field: &str, message: String) -> Error {
        Error::Config { path: self.path.to_path_buf(), field: field.into(), message }
    }
    fn size(&self, field: &str, v: usize, max: usize) -> Result<()> {
        if v == 0 || v > max {
            return Err(self.err(field, format!("{v} is outside 1..={max}")));
        }
        Ok(())
    }
    fn positive_float(&self, field: &str, v: f64, max: f64) -> Result<()> {
        if !(v.is_finite() && v > 0.0 && v <= max) {
            return Err(self.err(field, format!("{v} must be a finite number in (0, {max:e}]")));
        }
        Ok(())
    }
}

pub(crate) fn validate_vision(v: &VisionConfig, t: &TextConfig, path: &Path) -> Result<()> {
    let err = |field: &str, message: String| Error::Config { path: PathBuf::from(path), field: field.into(), message };
    let b = Bounds { path };
    b.size("vision_config.depth", v.depth, MAX_VISION_DEPTH)?;
    b.size("vision_config.hidden_size", v.hidden_size, MAX_HIDDEN)?;
    b.size("vision_config.intermediate_size", v.intermediate_size, MAX_INTERMEDIATE)?;
    b.size("vision_config.num_heads", v.num_heads, MAX_HEADS)?;
    b.size("vision_config.patch_size", v.patch_size, MAX_PATCH)?;
    b.size("vision_config.spatial_merge_size", v.spatial_merge_size, MAX_MERGE)?;
    b.size("vision_config.temporal_patch_size", v.temporal_patch_size, MAX_TEMPORAL_PATCH)?;
    b.size("vision_config.num_position_embeddings", v.num_position_embeddings, MAX_POSITION_GRID)?;
    b.positive_float("vision_config.rope_parameters.rope_theta", v.rope_theta, MAX_ROPE_THETA)?;
    if v.in_channels != 3 {
        return Err(err("vision_config.in_channels", format!("{} is not supported (RGB: 3)", v.in_channels)));
    }
    let mut seen = std::collections::BTreeSet::new();
    if let Some(dup) = v.deepstack_visual_indexes.iter().find(|&&i| !seen.insert(i)) {
        return Err(err(
            "vision_config.deepstack_visual_indexes",
            format!("block {dup} is listed twice in {:?}", v.deepstack_visual_indexes),
        ));
    }
    if v.num_heads == 0 || !v.hidden_size.is_multiple_of(v.num_heads) || !v.head_dim().is_multiple_of(4) {
        return Err(err(
            "vision_config.num_heads",
            format!("hidden_size {} / num_heads {} must give a head_dim divisible by 4", v.hidden_size, v.num_heads),
        ));
    }
    let side = v.num_grid_per_side();
    if side * side != v.num_position_embeddings {
        return Err(err(
            "vision_config.num_position_embeddings",
            format!("{} is not a square", v.num_position_embeddings),
        ));
    }
    if let Some(&bad) = v.deepstack_visual_indexes.iter().find(|&&i| i >= v.depth) {
        return Err(err("vision_config.deepstack_visual_indexes", format!("index {bad} >= depth {}", v.depth)));
    }
    if v.deepstack_visual_indexes.len() > t.num_hidden_layers {
        return Err(err(
            "vision_config.deepstack_visual_indexes",
            format!(
                "{} levels but only {} text layers to inject into",
                v.deepstack_visual_indexes.len(),
                t.num_hidden_layers
            ),
        ));
    }
    if v.out_hidden_size != t.hidden_size {
        return Err(err(
            "vision_config.out_hidden_size",
            format!("{} differs from text_config.hidden_size {}", v.out_hidden_size, t.hidden_size),
        ));
    }
    Ok(())
}

fn collect_unknown(extra: &BTreeMap<String, Value>, ignored: &[&str], prefix: &str, out: &mut Vec<String>) {
    out.extend(extra.keys().filter(|k| !ignored.contains(&k.as_str())).map(|k| format!("{prefix}{k}")));
}
