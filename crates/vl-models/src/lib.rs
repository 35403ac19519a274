//! Vision-language models on candle, Qwen3-VL first.
//!
//! Layout follows the house style: generic layers live in `vl-nn`; this crate composes them.
//! Model-agnostic: `family` (the seam a model family implements, and the registry), `engine`
//! (the resident engine: scheduler with continuous batching, KV budget, prefix reuse),
//! `checkpoint` (safetensors access), `constraint` (constrained decoding), `gguf` (the GGUF container), `grounding` (boxes and points in answers: parsed, mapped, drawn), `media` (vision inputs and
//! features), `image_file` (image reading and decoding), `kv` (a sequence's KV cache), `cache` (byte-bounded LRU), `reasoning` (`<think>` blocks split from the answer), `sampling`, `stream`
//! (streaming detokenization), `template` (chat templates), `tools` (tool-call text format and transformers' `tojson`),
//! `video` (video sources). `qwen3_vl` holds everything Qwen-named; `qwen3_vl_moe` registers the MoE family on it.

pub mod affine;
pub mod alloc;
pub mod cache;
pub mod checkpoint;
pub mod constraint;
pub mod engine;
pub mod error;
pub mod family;
pub mod gguf;
pub mod grounding;
pub mod image_file;
pub mod limits;
pub mod mapped;
pub mod media;
pub mod progress;
pub mod qwen3_vl;
pub mod qwen3_vl_moe;
pub mod reasoning;
pub mod registry;
pub mod request;
pub mod sampling;
pub mod state;
pub mod stream;
pub mod template;
pub mod tools;
pub mod video;

pub use error::{Error, Result};
