//! Which implementation each of our own kernels takes on a device, in one place: the CPU kernels
//! of this crate where they apply (CPU tensors, mostly f32), candle's device-generic ops
//! everywhere else (CUDA, Metal, other dtypes). The choice depends only on the device kind and
//! the dtype, so it is tested here for every device on a machine that has only a CPU; the
//! generic paths themselves run on CPU too (bf16 and f16 tensors take them), where the tests
//! compare them with the kernels.
//!
//! The table of which candle ops have GPU kernels is in docs/gpu.md.

use candle_core::{DType, Device, Tensor};

/// The kind of a candle device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceKind {
    Cpu,
    Cuda,
    Metal,
}

impl DeviceKind {
    pub const ALL: [DeviceKind; 3] = [DeviceKind::Cpu, DeviceKind::Cuda, DeviceKind::Metal];

    pub fn of(device: &Device) -> Self {
        match device {
            Device::Cpu => DeviceKind::Cpu,
            Device::Cuda(_) => DeviceKind::Cuda,
            Device::Metal(_) => DeviceKind::Metal,
        }
    }
}

/// Our kernels that have a device-generic alternative.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    /// The vision tower's fused segment attention (`kernels::segment_attention_with`); else
    /// candle's matmul/softmax per block of queries.
    SegmentAttention,
    /// The text prefill's fused causal attention (`kernels::causal_attention`); else candle's
    /// matmul, mask and softmax.
    CausalAttention,
    /// One-row decode attention read in place from the KV cache; else candle's ops.
    DecodeAttention,
    /// `Dense`'s tiled products (gemm per tile, AVX2 panels); else candle's `Linear`.
    DenseLinear,
    /// Packing a dense weight into 16-column panels at load (AVX2-only CPUs); else none.
    PanelPacking,
    /// In-place vectorized GELU (tanh and erf); else candle's `gelu` / `gelu_erf`.
    Gelu,
    /// SwiGLU's `silu(gate) * up` in one vectorized pass; else candle's `silu` and product.
    SiluMul,
    /// The tiled transpose; else candle's `t().contiguous()`.
    Transpose,
    /// The bilinear position-embedding gather (`weighted_row_sum`); else candle's
    /// `index_select` and a weighted sum.
    RowGather,
    /// Our multi-threaded Q4K quantizer (byte-identical to candle's); else candle's
    /// `QTensor::quantize` (on the tensor's device).
    Q4kQuantizer,
    /// Row-parallel quantization of the other block types; else candle's, single call.
    ParallelQuantizer,
    /// Quantized embedding tables (rows dequantized on lookup); else a dense table.
    QuantEmbedding,
    /// Paying candle's CPU k-quant repack at load (`QLinear::prepare`); else nothing to do.
    KQuantRepack,
}

impl Op {
    #[cfg(test)]
    pub(crate) const ALL: [Op; 13] = [
        Op::SegmentAttention,
        Op::CausalAttention,
        Op::DecodeAttention,
        Op::DenseLinear,
        Op::PanelPacking,
        Op::Gelu,
        Op::SiluMul,
        Op::Transpose,
        Op::RowGather,
        Op::Q4kQuantizer,
        Op::ParallelQuantizer,
        Op::QuantEmbedding,
        Op::KQuantRepack,
    ];
}

/// Whether `op` takes our CPU kernel for tensors of `dtype` on a `kind` device (else candle's
/// device-generic ops). Every GPU takes candle's.
pub(crate) fn own_kernel(op: Op, kind: DeviceKind, dtype: DType) -> bool {
    if kind != DeviceKind::Cpu {
        return false;
    }
    let float = matches!(dtype, DType::F32 | DType::BF16 | DType::F16);
    match op {
        Op::SegmentAttention | Op::CausalAttention | Op::DecodeAttention | Op::DenseLinear | Op::Gelu | Op::SiluMul => {
            dtype == DType::F32
        }
        Op::RowGather => dtype == DType::F32,
        Op::Transpose | Op::KQuantRepack => true,
        Op::PanelPacking | Op::Q4kQuantizer | Op::ParallelQuantizer | Op::QuantEmbedding => float,
    }
}

/// `own_kernel` for these tensors: all on one device kind, all of one dtype, else false.
pub(crate) fn own_kernel_for(op: Op, tensors: &[&Tensor]) -> bool {
    let Some(first) = tensors.first() else { return false };
    let (kind, dtype) = (DeviceKind::of(first.device()), first.dtype());
    tensors.iter().all(|t| DeviceKind::of(t.device()) == kind && t.dtype() == dtype) && own_kernel(op, kind, dtype)
}

/// The compute dtype when none is asked for: f32 on CPU (bf16 matmuls there are far slower than
/// f32: docs/performance.md), bf16 on GPUs (half the memory, tensor cores).
pub fn default_dtype(kind: DeviceKind) -> DType {
    match kind {
        DeviceKind::Cpu => DType::F32,
        DeviceKind::Cuda | DeviceKind::Metal => DType::BF16,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_gpu_takes_candles_ops_for_every_op_and_dtype() {
        for op in Op::ALL {
            for kind in [DeviceKind::Cuda, DeviceKind::Metal] {
                for dtype in [DType::F32, DType::BF16, DType::F16] {
                    assert!(!own_kernel(op, kind, dtype), "{op:?} on {kind:?} {dtype:?}");
                }
            }
        }
    }

    #[test]
    fn the_cpu_takes_its_kernels_in_f32_and_candles_ops_for_half_types_where_they_have_none() {
        for op in Op::ALL {
            assert!(own_kernel(op, DeviceKind::Cpu, DType::F32), "{op:?} f32");
        }
        let f32_only = [
            Op::SegmentAttention,
            Op::CausalAttention,
            Op::DecodeAttention,
            Op::DenseLinear,
            Op::Gelu,
            Op::SiluMul,
            Op::RowGather,
        ];
        for op in Op::ALL {
            for dtype in [DType::BF16, DType::F16] {
                assert_eq!(own_kernel(op, DeviceKind::Cpu, dtype), !f32_only.contains(&op), "{op:?} {dtype:?}");
            }
        }
        // Integer tensors (ids, indices) never go to a float kernel that cares about the dtype.
        assert!(!own_kernel(Op::Gelu, DeviceKind::Cpu, DType::U32));
        assert!(!own_kernel(Op::Q4kQuantizer, DeviceKind::Cpu, DType::U32));
    }

    #[test]
    fn mixed_tensors_take_the_generic_path() {
        let a = Tensor::zeros(4, DType::F32, &Device::Cpu).unwrap();
        let b = Tensor::zeros(4, DType::BF16, &Device::Cpu).unwrap();
        assert!(own_kernel_for(Op::DecodeAttention, &[&a, &a]));
        assert!(!own_kernel_for(Op::DecodeAttention, &[&a, &b]));
        assert!(!own_kernel_for(Op::DecodeAttention, &[]));
        assert_eq!(DeviceKind::of(&Device::Cpu), DeviceKind::Cpu);
    }

    #[test]
    fn the_default_dtype_is_f32_on_cpu_and_bf16_on_gpus() {
        assert_eq!(default_dtype(DeviceKind::Cpu), DType::F32);
        assert_eq!(default_dtype(DeviceKind::Cuda), DType::BF16);
        assert_eq!(default_dtype(DeviceKind::Metal), DType::BF16);
    }
}
