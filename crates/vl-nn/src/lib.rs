//! Generic vision-language layers on candle. Nothing here knows a model's name: Qwen3-VL (and
//! later models) are composed from these pieces in `vl-models`.

pub mod attention;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512;
pub mod error;
pub mod grid;
pub mod kernels;
pub mod kv_cache;
pub mod linear;
pub mod merger;
pub mod panels;
pub mod quant;
pub mod rope;
#[cfg(test)]
pub(crate) mod testing;

pub use attention::{causal_gqa_attention, SegmentRotaryAttention};
pub use error::{Error, Result};
pub use kv_cache::KvCache;
pub use linear::{QEmbedding, QLinear, QuantType};
pub use merger::PatchMerger;
pub use rope::{MultiAxisRope, TwoAxisRope};
