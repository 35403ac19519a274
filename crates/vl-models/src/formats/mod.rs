//! The files models come in: safetensors checkpoints (`checkpoint`, read through `mapped` memory
//! maps), GGUF (`gguf`, the container and its k-quant blocks) and MLX's affine-quantized
//! tensors (`affine`); `generation_config` the stop ids and suggested sampling values; `sentence_transformers` reads the module files that make a checkpoint an
//! embedding model or a reranker.

pub mod affine;
pub mod checkpoint;
pub mod generation_config;
pub mod gguf;
pub mod mapped;
pub mod sentence_transformers;
