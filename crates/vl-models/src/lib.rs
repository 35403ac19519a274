//! Vision-language models on candle: Qwen3-VL (dense and MoE) from checkpoint directories,
//! GGUF and MLX files, answered by a resident engine with continuous batching.
//!
//! Load a checkpoint, ask about an image, stream the answer:
//!
//! ```
//! # fn main() -> vl_models::Result<()> {
//! # let model = concat!(env!("CARGO_MANIFEST_DIR"), "/../../goldens/tiny-a/checkpoint");
//! # let photo = concat!(env!("CARGO_MANIFEST_DIR"), "/../../goldens/images/square.png");
//! use vl_models::{Engine, Part, Request};
//!
//! let engine = Engine::builder(model).build()?;
//! let request = Request::user(vec![Part::image_file(photo)?, Part::text("Describe this image.")]);
//! let answer = engine.generate(&request.max_new_tokens(16), &mut |piece| {
//!     print!("{piece}");
//!     true // false cancels
//! })?;
//! println!("\n{} prompt tokens, {} generated", answer.prompt_tokens, answer.token_ids.len());
//! # Ok(())
//! # }
//! ```
//!
//! `Engine::builder(model)` takes a checkpoint directory, a `.gguf` file (its `mmproj*.gguf`
//! beside it, or `.mmproj(path)`) or a directory holding one; `.quantize(vl_nn::QuantType::Q4K)`
//! quantizes the text decoder at load (what `vl` does on a CPU by default), `.device(..)` picks
//! a CUDA or Metal device in builds with those features. Many threads may call
//! `Engine::generate` at once: their requests decode together. `Engine::stream` gives every
//! piece with its choice and log-probabilities, `Engine::generate_n` several answers from one
//! prefill, `Engine::pool` the rows of an embedding or reranker model.
//!
//! A downstream crate's debug build must optimise its dependencies, or the tensor kernels run
//! unoptimised (the tiny test model answered in 65 s instead of 4 s). In its `Cargo.toml`:
//!
//! ```toml
//! [profile.dev.package."*"]
//! opt-level = 3
//! ```
//!
//! The layout: generic layers live in `vl-nn`; here, `request` (what goes in and comes out),
//! `engine/` (the scheduler, caches and budgets), `family/` (the seam a model family
//! implements), `registry` (the one list of families), `state` (a sequence's KV or recurrent
//! state), `formats/` (safetensors, GGUF, MLX), `media/` (images, videos, encoded features),
//! `decoding/` (sampling, constraints, streaming, reasoning, tool calls, templates, grounding),
//! and one folder per family (`qwen3_vl/`; `qwen3_vl_moe` registers the MoE checkpoints on it).
//! The modules of `formats/`, `media/` and `decoding/` are re-exported at the root
//! (`vl_models::gguf`, `vl_models::video`, `vl_models::sampling`, ...).

#![deny(unsafe_op_in_unsafe_fn)]

pub mod alloc;
pub mod cache;
pub mod decoding;
pub mod engine;
pub mod error;
pub mod family;
pub mod formats;
pub mod hub;
pub mod limits;
pub mod media;
pub mod progress;
pub mod qwen3_5;
pub mod qwen3_vl;
pub mod qwen3_vl_embedding;
pub mod qwen3_vl_moe;
pub mod qwen3_vl_reranker;
pub mod registry;
pub mod request;
pub mod state;
pub mod vectors;

pub use decoding::{constraint, grounding, reasoning, sampling, speculative, stream, template, tool_calls};
pub use engine::{Engine, EngineBuilder, EngineOptions, ModelOptions};
pub use error::{Error, Result};
pub use formats::{affine, checkpoint, gguf, mapped};
pub use media::{image_file, video};
pub use request::{ChatMessage, Completion, Delta, Finish, Part, Request};
pub use sampling::GenerationOptions;
