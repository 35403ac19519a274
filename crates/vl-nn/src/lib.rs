//! Generic vision-language layers on candle. Nothing here knows a model's name: Qwen3-VL (and
//! later models) are composed from these pieces in `vl-models`.

pub mod attention;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;
#[cfg(all(target_arch = "x86_64", not(vl_avx2_proxy)))]
pub(crate) mod avx512;
pub mod bf16;
pub mod dispatch;
pub mod error;
pub mod grid;
pub mod kernels;
pub mod kv_cache;
pub mod linear;
pub mod merger;
pub mod moe;
pub mod panels;
pub mod quant;
pub mod rope;
pub mod stored;
pub mod stored_tiles;
pub mod testing;

/// Whether this CPU has AVX-512F and this build may use it: the AVX2 stand-in build
/// (`--cfg vl_avx2_proxy`, from `tools/bench/vision-side-by-side` with `VL_VISION_ISA=avx2`)
/// never does, so on an AVX-512 machine it takes every path an AVX2-only CPU takes.
#[cfg(target_arch = "x86_64")]
pub(crate) fn has_avx512() -> bool {
    !cfg!(vl_avx2_proxy) && std::arch::is_x86_feature_detected!("avx512f")
}

pub use attention::{causal_gqa_attention, SegmentRotaryAttention};
pub use error::{Error, Result};
pub use kv_cache::KvCache;
pub use linear::{QEmbedding, QLinear, QuantType};
pub use merger::PatchMerger;
pub use moe::{SparseMoe, SwiGluExpert};
pub use rope::{MultiAxisRope, TwoAxisRope};
