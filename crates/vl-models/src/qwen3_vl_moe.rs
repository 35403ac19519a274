//! Qwen3-VL MoE (`Qwen3VLMoeForConditionalGeneration`, model_type `qwen3_vl_moe`: 30B-A3B,
//! 235B-A22B), the second family of the registry. It is Qwen3-VL (the same vision tower,
//! processor, chat template, attention and M-RoPE) whose text MLPs are routed experts
//! (`vl_nn::SparseMoe`) except in `mlp_only_layers`, mirroring transformers'
//! `models/qwen3_vl_moe/`: so it loads through the `qwen3_vl` family's code, whose config carries
//! the experts (`TextConfig::moe`) and whose text decoder builds a sparse MLP for each sparse layer.
//!
//! Loaded: checkpoint directories (safetensors; the fused experts in transformers 5's
//! `[E, out, in]` layout or the hub's `[E, in, out]`), MLX-community conversions (the experts
//! stacked as `switch_mlp`, affine-quantized) and llama.cpp's GGUF files
//! (`qwen3vlmoe`: `ffn_gate_inp`, `ffn_{gate,up,down}_exps`, each expert's blocks used as
//! stored). `vl quantize` writes llama.cpp's `qwen3vlmoe` files from an all-sparse checkpoint.

use std::path::Path;

use crate::error::Result;
use crate::family::{FamilyEntry, Source};

/// The registry's entry for Qwen3-VL MoE.
pub static ENTRY: FamilyEntry = FamilyEntry {
    name: "qwen3_vl_moe",
    architectures: &["Qwen3VLMoeForConditionalGeneration"],
    model_types: &["qwen3_vl_moe"],
    gguf_architectures: &["qwen3vlmoe"],
    heads: &[],
    open: open_entry,
    inspect: inspect_entry,
    quantize: quantize_entry,
    default_quant: default_quant_entry,
};

fn open_entry(
    source: &Source<'_>,
    opts: &crate::family::ModelOptions,
    staged: bool,
) -> Result<Box<dyn crate::family::Family>> {
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
    (crate::qwen3_vl::family::ENTRY.quantize)(model, recipe, out, overwrite, progress)
}

fn default_quant_entry(model: &Path) -> Result<Option<vl_nn::QuantType>> {
    (crate::qwen3_vl::family::ENTRY.default_quant)(model)
}
