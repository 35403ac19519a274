//! Qwen3-VL on candle: configuration, checkpoint loading and (in later modules) the model.
//!
//! Layout follows the house style: generic layers live in `vl-nn`; this crate composes them.
//! Model-agnostic: `checkpoint` (safetensors access), `sampling`, `stream` (streaming
//! detokenization), `engine` (the resident engine's API), `tools` (tool-call text
//! format and transformers' `tojson`); `qwen3_vl` holds everything Qwen-named.

pub mod affine;
pub mod alloc;
pub mod checkpoint;
pub mod engine;
pub mod error;
pub mod limits;
pub mod qwen3_vl;
pub mod sampling;
pub mod stream;
pub mod tools;
pub mod video;

pub use error::{Error, Result};
