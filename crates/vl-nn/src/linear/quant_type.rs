//! The weight storage of a quantized layer: candle's GGML block types we quantize to or read.

use candle_core::quantized::GgmlDType;

/// Weight storage of a quantized layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantType {
    Q4K,
    Q5K,
    Q6K,
    Q8K,
    Q8_0,
    // Block types read from GGUF files as they are stored (not produced by our quantizer).
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q2K,
    Q3K,
}

impl QuantType {
    pub fn ggml(self) -> GgmlDType {
        match self {
            QuantType::Q4K => GgmlDType::Q4K,
            QuantType::Q5K => GgmlDType::Q5K,
            QuantType::Q6K => GgmlDType::Q6K,
            QuantType::Q8K => GgmlDType::Q8K,
            QuantType::Q8_0 => GgmlDType::Q8_0,
            QuantType::Q4_0 => GgmlDType::Q4_0,
            QuantType::Q4_1 => GgmlDType::Q4_1,
            QuantType::Q5_0 => GgmlDType::Q5_0,
            QuantType::Q5_1 => GgmlDType::Q5_1,
            QuantType::Q2K => GgmlDType::Q2K,
            QuantType::Q3K => GgmlDType::Q3K,
        }
    }

    /// The block types candle has kernels for; `None` for float types and the rest.
    pub fn from_ggml(d: GgmlDType) -> Option<Self> {
        Some(match d {
            GgmlDType::Q4K => QuantType::Q4K,
            GgmlDType::Q5K => QuantType::Q5K,
            GgmlDType::Q6K => QuantType::Q6K,
            GgmlDType::Q8K => QuantType::Q8K,
            GgmlDType::Q8_0 => QuantType::Q8_0,
            GgmlDType::Q4_0 => QuantType::Q4_0,
            GgmlDType::Q4_1 => QuantType::Q4_1,
            GgmlDType::Q5_0 => QuantType::Q5_0,
            GgmlDType::Q5_1 => QuantType::Q5_1,
            GgmlDType::Q2K => QuantType::Q2K,
            GgmlDType::Q3K => QuantType::Q3K,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            QuantType::Q4K => "q4k",
            QuantType::Q5K => "q5k",
            QuantType::Q6K => "q6k",
            QuantType::Q8K => "q8k",
            QuantType::Q8_0 => "q8_0",
            QuantType::Q4_0 => "q4_0",
            QuantType::Q4_1 => "q4_1",
            QuantType::Q5_0 => "q5_0",
            QuantType::Q5_1 => "q5_1",
            QuantType::Q2K => "q2k",
            QuantType::Q3K => "q3k",
        }
    }

    /// Rows of this many values quantize; others stay dense.
    pub fn block(self) -> usize {
        self.ggml().block_size()
    }
}
