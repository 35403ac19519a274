//! Linear layers and embeddings whose storage is chosen at load time: dense (any float dtype)
//! or a k-quant (candle's GGML block formats with fast AVX2/NEON kernels). Quantization is a
//! property of the layer, not a second copy of the model.
//!
//! Modules: `quant_type` (`QuantType`, the block types), `quantize` (`quantize_rows`, parallel
//! and our own Q4K), `dense` (`Dense`, the float layers' tiled products, `Then`), `qlinear`
//! (`QLinear`, dense or quantized, its stored-block and AMX choices, `prepare_all`),
//! `embedding` (`QEmbedding`).

use candle_core::DType;

use crate::Result;

mod dense;
mod embedding;
mod qlinear;
mod quant_type;
mod quantize;

pub use dense::{Dense, Then};
pub use embedding::QEmbedding;
pub use qlinear::{allow_amx, prepare_all, prepare_all_then, QLinear, StoredWeight};
pub use quant_type::QuantType;
pub use quantize::quantize_rows;

/// `n` with its parameters in `dtype`.
pub fn cast_layer_norm(n: &candle_nn::LayerNorm, dtype: DType) -> Result<candle_nn::LayerNorm> {
    let w = n.weight().to_dtype(dtype)?;
    Ok(match (n.bias(), n.remove_mean()) {
        (_, false) => candle_nn::LayerNorm::rms_norm(w, n.eps()),
        (Some(b), true) => candle_nn::LayerNorm::new(w, b.to_dtype(dtype)?, n.eps()),
        (None, true) => candle_nn::LayerNorm::new_no_bias(w, n.eps()),
    })
}

pub fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        DType::F64 => "f64",
        _ => "other",
    }
}
