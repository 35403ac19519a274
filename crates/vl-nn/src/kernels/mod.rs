//! CPU f32 kernels that candle runs scalar or unfused: a vectorized `exp`, the tanh-approximated
//! GELU in place, and flash-style segment attention (rotary applied once, query/key tiles, online
//! softmax, no score matrix beyond one tile).
//!
//! One portable binary: the loops are written plainly so that LLVM vectorizes them, and each is
//! compiled once per instruction set by `multiversion` and picked at run time (AVX-512 where
//! present, AVX2+FMA, NEON on aarch64, the baseline otherwise), so the default build needs no
//! `-C target-cpu`. The attention tiles' products go to the `gemm` crate (what candle's own
//! matmul calls), single-threaded per tile, except on CPUs whose widest vectors are AVX2, where
//! register-blocked strips of 16 query rows (`std::arch` intrinsics, checked at run time) read
//! the operands in place and skip `gemm`'s per-tile packing (the same template builds 48-row
//! AVX-512 strips, `TileKernel::Avx512Strips`, measured even with `gemm` there and so not its
//! default); tiles run on candle's worker pool.
//!
//! Modules: `activation` (exp, GELU, SwiGLU's product), `layout` (transpose), `gather` (weighted row sums),
//! `tile` (shapes, `TileKernel`, scratch, the `gemm` tile loop), `softmax` (its online softmax
//! step), `segment` and `causal` (the two attentions), `strips` (the AVX2 / AVX-512 strip tile
//! kernels), `delta`, `delta_simd`, `delta_chunk` and `delta_conv` (a Gated DeltaNet layer's
//! rule, its vector blocks, its chunked form, its convolution and output norm). The pointer and
//! CPU-feature helpers they share are in `crate::cpu`.

mod activation;
mod causal;
pub mod delta;
mod delta_chunk;
pub mod delta_conv;
#[cfg(target_arch = "x86_64")]
mod delta_simd;
mod gather;
mod layout;
mod segment;
mod softmax;
#[cfg(target_arch = "x86_64")]
mod strips;
mod tile;

pub use activation::silu_mul;
pub(crate) use activation::{gelu_erf_tensor, gelu_slice, gelu_tanh_tensor};
pub(crate) use causal::{causal_attention, KvRows};
pub use gather::weighted_row_sum;
pub(crate) use layout::transpose;
pub use layout::transpose_slice;
pub use segment::segment_attention_with;
pub use tile::{SegmentAttentionShape, TileKernel, KEY_TILE, QUERY_TILE};
