//! Qwen3.5 / 3.6 / 3.8 (`Qwen3_5ForConditionalGeneration`, model_type `qwen3_5`), mirroring
//! transformers' `models/qwen3_5/`: Qwen3-VL's vision tower (patch 16, no DeepStack), processor,
//! video and grounding code before a hybrid decoder: Gated DeltaNet layers (`vl_nn::GatedDeltaNet`,
//! a recurrent state per sequence) among gated full-attention layers (q_proj yields a per-head
//! output gate; partial interleaved M-RoPE; (1 + weight) RMSNorms). It loads through the
//! `qwen3_vl` family's code, whose config carries the layer pattern (`TextConfig::hybrid`) and
//! whose decoder builds a DeltaNet mixer for each linear layer and a recurrent `LayerState` for it.
//!
//! Loaded: checkpoint directories (safetensors, sharded or not; the `mtp.*` head, which
//! transformers skips, loaded for `speculative: mtp`: `qwen3_vl/text.rs`, `MtpHead`) and llama.cpp's GGUF
//! pairs (`qwen35` text: its MTP block, counted in `block_count`, read as that head; the layer
//! pattern from `recurrent_layers`; value heads in the
//! converter's tiled order; plus the `qwen3vl_merger` mmproj). MoE (`qwen3_5_moe`, `MOE_ENTRY`):
//! checkpoint directories and `qwen35moe` GGUF files (the pattern from `recurrent_layers`: the
//! converter writes `full_attention_interval` 4 whatever the config said). `vl quantize` writes
//! the GGUF pair as llama.cpp's converter and llama-quantize do (`qwen3_vl::gguf_hybrid`).
//! mlx-vlm's conversions load too: their decoder norms stored with +1
//! (`HybridConfig::norms_plus_one`), the convolution as [C, K, 1] (`Storage::KernelFirst`).

use std::path::Path;

use crate::error::Result;
use crate::family::{FamilyEntry, ModelOptions, Source};

/// The registry's entry for Qwen3.5.
pub static ENTRY: FamilyEntry = FamilyEntry {
    name: "qwen3_5",
    architectures: &["Qwen3_5ForConditionalGeneration"],
    model_types: &["qwen3_5"],
    gguf_architectures: &["qwen35"],
    heads: &[],
    open: open_entry,
    inspect: inspect_entry,
    quantize: quantize_entry,
    default_quant: crate::qwen3_vl::family::default_quant_entry,
};

/// The registry's entry for Qwen3.5 MoE (`Qwen3_5MoeForConditionalGeneration`): the same decoder
/// with routed experts and a gated shared expert in every layer, the experts stored one tensor
/// each as the hub has them (or fused, as transformers 5 holds them).
pub static MOE_ENTRY: FamilyEntry = FamilyEntry {
    name: "qwen3_5_moe",
    architectures: &["Qwen3_5MoeForConditionalGeneration"],
    model_types: &["qwen3_5_moe"],
    gguf_architectures: &["qwen35moe"],
    heads: &[],
    open: open_entry,
    inspect: inspect_entry,
    quantize: quantize_entry,
    default_quant: crate::qwen3_vl::family::default_quant_entry,
};

fn open_entry(source: &Source<'_>, opts: &ModelOptions, staged: bool) -> Result<Box<dyn crate::family::Family>> {
    (crate::qwen3_vl::family::ENTRY.open)(source, opts, staged)
}

fn inspect_entry(source: &Source<'_>, json: bool) -> Result<String> {
    (crate::qwen3_vl::family::ENTRY.inspect)(source, json)
}

fn quantize_entry(
    model: &Path,
    recipe: crate::gguf::Recipe,
    out: &Path,
    overwrite: bool,
    progress: &mut dyn FnMut(&str),
) -> Result<crate::gguf::Written> {
    crate::qwen3_vl::family::quantize_entry(model, recipe, out, overwrite, progress)
}
