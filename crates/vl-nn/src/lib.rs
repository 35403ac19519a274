//! Generic vision-language layers on candle. Nothing here knows a model's name: Qwen3-VL (and
//! later models) are composed from these pieces in `vl-models`.
//!
//! The layers are re-exported here; the modules kept public are those whose paths other crates
//! use (`dispatch`, `grid`, `kernels`, `kv_cache`, `linear`, `moe`, `panels`, `stored`,
//! `stored_tiles`, `bf16`, `widen`), each exposing only what those crates take. `testing` (seeded random
//! tensors) is behind the `testing` feature.

#![deny(unsafe_op_in_unsafe_fn)]

mod amx;
mod attention;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(all(target_arch = "x86_64", not(vl_avx2_proxy)))]
mod avx512;
mod cpu;
pub mod delta_net;
pub mod dispatch;
mod error;
pub mod grid;
pub mod kernels;
pub mod kv_cache;
pub mod linear;
mod merger;
pub mod moe;
mod norm;
pub mod panels;
mod q8k;
mod quant;
mod rope;
pub mod stored;
pub mod stored_tiles;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod widen;

/// The reduced-precision products (`--vision-precision bf16`): bf16 operands with f32 sums on
/// AMX tiles, or with AVX512-BF16's `vdpbf16ps` where there is no AMX (the dense products; the
/// attention's then stay f32).
pub mod bf16 {
    /// Whether this CPU runs them (AMX-BF16 tiles granted by the OS, or AVX512-BF16).
    pub fn available() -> bool {
        crate::amx::products_available()
    }
    /// Whether it runs them on AMX tiles (then the attention's products too, head dimension 64).
    pub use crate::cpu::amx_bf16 as tiles;
}

pub use attention::{causal_gqa_attention, decode_attention_many, SegmentRotaryAttention};
pub use delta_net::{DeltaNetShape, DeltaState, GatedDeltaNet};
pub use error::{Error, Result};
pub use kernels::delta::DeltaShape;
pub use kv_cache::KvCache;
pub use linear::{QEmbedding, QLinear, QuantType};
pub use merger::PatchMerger;
pub use moe::{SparseMoe, SwiGluExpert};
pub use norm::RmsNorm;
pub use rope::{rope, MultiAxisRope, TwoAxisRope};
