//! The model flags (`--model`, `--mmproj`, `--device`, `--dtype`, `--vision-precision`,
//! `--quantize`) and what they resolve to: the device, the compute dtype, the text decoder's
//! quantization (`quant_choice`: q4k by default on the CPU for a float checkpoint).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};
use clap::{Args, ValueEnum};
use vl_nn::QuantType;

use crate::note;

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum DeviceArg {
    /// The CPU (every build; its own kernels for x86-64 AVX2 / AVX-512 and Arm).
    Cpu,
    /// Apple's GPU (a build with `--features metal`).
    Metal,
    /// An NVIDIA GPU, the first one (a build with `--features cuda`).
    Cuda,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum DtypeArg {
    /// 32-bit floats (the CPU default; the reference's numbers).
    F32,
    /// bfloat16 (the GPU default; slow on most CPUs).
    Bf16,
    /// IEEE half precision.
    F16,
}

/// Precision of the vision tower's linear layers on the CPU.
#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum VisionPrecisionArg {
    /// f32 products: the reference's numbers (vision features within 1e-4 of the goldens).
    F32,
    /// bf16 products with f32 sums: on AMX tiles (Intel Xeon since Sapphire Rapids, Linux) the
    /// linears and (head dimension 64) the attention's products, ~2.5x faster products; with
    /// AVX512-BF16 and no AMX (AMD Zen 4 and later) the linears; features within the bound in
    /// docs/parity.md. Refused elsewhere.
    Bf16,
}

/// The dtype the KV cache keeps its keys and values in.
#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum KvDtypeArg {
    /// 32-bit floats: the reference's numbers (the CPU default, the compute dtype).
    F32,
    /// IEEE half precision: half the cache's memory and of what a long context's decode step
    /// reads (llama.cpp's default); logits within the bound in docs/parity.md. CPU, f32 compute.
    F16,
    /// bfloat16: half the memory as f16, fewer fraction bits (8 against 11), f32's range. CPU,
    /// f32 compute.
    Bf16,
}

#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum QuantArg {
    /// Keep the stored weights: a float checkpoint stays in floats (MLX-quantized checkpoints are
    /// requantized to the nearest k-quant; GGUF blocks stay as stored).
    None,
    /// 4.5 bits a weight (Q4_K blocks of 256): the fastest, the CPU default.
    Q4k,
    /// 5.5 bits a weight (Q5_K blocks of 256).
    Q5k,
    /// 6.6 bits a weight (Q6_K blocks of 256): closest to full precision of the k-quants.
    Q6k,
    /// 8.5 bits a weight (Q8_0 blocks of 32).
    Q8,
    /// Full precision: everything in the compute dtype, MLX weights dequantized exactly (no
    /// quantized matmuls; what the parity tests run).
    Off,
}

/// Which model, where and in what precision: the Model heading of `run`, `serve` and `chat`.
#[derive(Debug, Args)]
pub struct ModelArgs {
    /// A local model directory, a Hugging Face hub id (from the local cache, downloaded when
    /// absent), or GGUF weights (a .gguf text model, or a directory holding one).
    #[arg(long, default_value = "Qwen/Qwen3-VL-2B-Instruct")]
    pub model: String,
    /// The GGUF vision projector (mmproj) for a GGUF text model; default: the `mmproj*.gguf`
    /// beside it. Without one, a GGUF model answers text only.
    #[arg(long)]
    pub mmproj: Option<PathBuf>,
    /// Compute dtype (default: f32 on CPU, bf16 on GPUs).
    #[arg(long, value_enum)]
    pub dtype: Option<DtypeArg>,
    /// Where to compute: cpu, or a GPU (metal, cuda: a build with that cargo feature).
    #[arg(long, value_enum, default_value = "cpu")]
    pub device: DeviceArg,
    /// Precision of the vision tower's products (CPU, f32 compute): f32, or bf16 on AMX tiles or
    /// AVX512-BF16 (faster images, reduced precision; docs/parity.md has its bound).
    #[arg(long, value_enum, default_value = "f32")]
    pub vision_precision: VisionPrecisionArg,
    /// The dtype the KV cache keeps keys and values in (default: the compute dtype). f16 or bf16
    /// under f32 compute on the CPU: half the cache's memory, faster long-context decoding,
    /// reduced precision (docs/parity.md has the bound).
    #[arg(long, value_enum)]
    pub kv_cache_dtype: Option<KvDtypeArg>,
    /// Quantize the text decoder's linears, embeddings and lm_head at load (CPU decoding speed).
    /// Default on CPU: q4k for a float checkpoint, the stored quantization for GGUF and MLX ones;
    /// on GPUs: none. `off` for full precision.
    #[arg(long, value_enum)]
    pub quantize: Option<QuantArg>,
}

impl ModelArgs {
    /// The `--kv-cache-dtype` asked for (None: the compute dtype).
    pub fn kv_dtype(&self) -> Option<DType> {
        self.kv_cache_dtype.map(|d| match d {
            KvDtypeArg::F32 => DType::F32,
            KvDtypeArg::F16 => DType::F16,
            KvDtypeArg::Bf16 => DType::BF16,
        })
    }

    /// Whether `--vision-precision bf16` was asked for.
    pub fn vision_bf16(&self) -> bool {
        self.vision_precision == VisionPrecisionArg::Bf16
    }

    /// The `--device` asked for, refused (one line) when this build cannot reach it.
    pub fn device(&self) -> Result<Device> {
        match self.device {
            DeviceArg::Cpu => Ok(Device::Cpu),
            DeviceArg::Cuda if !candle_core::utils::cuda_is_available() => {
                bail!("--device cuda: this build has no CUDA support; rebuild with `--features cuda`")
            }
            DeviceArg::Metal if !candle_core::utils::metal_is_available() => {
                bail!("--device metal: this build has no Metal support; rebuild with `--features metal` on macOS")
            }
            DeviceArg::Cuda => Ok(Device::new_cuda(0).context("--device cuda")?),
            DeviceArg::Metal => Ok(Device::new_metal(0).context("--device metal")?),
        }
    }

    /// The compute dtype on `dev`: `--dtype`, else f32 on CPU and bf16 on GPUs.
    pub fn dtype(&self, dev: &Device) -> DType {
        match self.dtype {
            Some(DtypeArg::F32) => DType::F32,
            Some(DtypeArg::Bf16) => DType::BF16,
            Some(DtypeArg::F16) => DType::F16,
            None => vl_nn::dispatch::default_dtype(vl_nn::dispatch::DeviceKind::of(dev)),
        }
    }

    /// The text decoder's quantization for the model at `path`, and how it was chosen.
    /// `--quantize` given: that one (`none`: the checkpoint's own, for an MLX-quantized
    /// checkpoint its nearest k-quant; `off`: none). Not given: on the CPU in f32, q4k unless the
    /// checkpoint is already quantized (GGUF, MLX); elsewhere the checkpoint's own.
    pub fn quant_choice(&self, path: &Path, dtype: DType) -> Result<(Option<QuantType>, QuantSource)> {
        let explicit = match self.quantize {
            Some(QuantArg::Q4k) => Some(QuantType::Q4K),
            Some(QuantArg::Q5k) => Some(QuantType::Q5K),
            Some(QuantArg::Q6k) => Some(QuantType::Q6K),
            Some(QuantArg::Q8) => Some(QuantType::Q8_0),
            Some(QuantArg::Off) => None,
            Some(QuantArg::None) => vl_models::registry::default_quant(path)?,
            None => {
                let stored = vl_models::registry::default_quant(path)?;
                let cpu = matches!(self.device, DeviceArg::Cpu) && dtype == DType::F32;
                if stored.is_none() && cpu && !vl_models::gguf::is_gguf(path) {
                    return Ok((Some(QuantType::Q4K), QuantSource::CpuDefault));
                }
                return Ok((stored, QuantSource::Checkpoint));
            }
        };
        Ok((explicit, QuantSource::Flag))
    }

    /// `quant_choice` for `vl serve` and `vl chat`, the CPU default said on stderr.
    pub fn quant_of(&self, path: &Path, dtype: DType) -> Result<Option<QuantType>> {
        let (quant, source) = self.quant_choice(path, dtype)?;
        if source == QuantSource::CpuDefault {
            note!("quantized: q4k (the CPU default; --quantize off for full precision)");
        }
        Ok(quant)
    }
}

/// How the text decoder's quantization was chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantSource {
    /// `--quantize` was given.
    Flag,
    /// Not given: the checkpoint's own (an MLX-quantized one's nearest k-quant; GGUF blocks as
    /// stored), or none on a GPU.
    Checkpoint,
    /// Not given, on the CPU, for a float checkpoint: the fast default, q4k.
    CpuDefault,
}
