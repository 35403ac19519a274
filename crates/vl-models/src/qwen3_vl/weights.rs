//! The logical weight view of a Qwen3-VL checkpoint: transformers key names and shapes, whatever
//! the stored layout. The one key-mapping place: MLX-community checkpoints (`vision_tower.*`,
//! `language_model.model.*`, `language_model.lm_head.*`, channels-last patch-embed conv,
//! affine-quantized linears and embeddings with `.scales` / `.biases`) map to the HF names here.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use candle_core::{DType, Device, Shape, Tensor};
use safetensors::Dtype as StDtype;
use serde_json::Value;

use crate::affine;
use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};

/// Where a checkpoint keeps the vision tower's and the text decoder's tensors.
pub const VISION_PREFIX: &str = "model.visual";
pub const TEXT_PREFIX: &str = "model.language_model";

pub use crate::checkpoint::LoadProgress;

/// Stored-to-HF prefix pairs of the MLX-community layout.
const MLX_PREFIXES: [(&str, &str); 3] = [
    ("vision_tower.", "model.visual."),
    ("language_model.model.", "model.language_model."),
    ("language_model.lm_head.", "lm_head."),
];

const PATCH_EMBED: &str = "model.visual.patch_embed.proj.weight";

/// The HF name of a stored key. Idempotent: HF names map to themselves. MLX's stacked experts
/// (`mlp.switch_mlp.{gate,up,down}_proj`) are named as the plan's stacked ones
/// (`mlp.experts.*`, `plan::split_experts`).
pub fn hf_key(stored: &str) -> String {
    for (from, to) in MLX_PREFIXES {
        if let Some(rest) = stored.strip_prefix(from) {
            return format!("{to}{}", rest.replacen(".mlp.switch_mlp.", ".mlp.experts.", 1));
        }
    }
    stored.to_string()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    HuggingFace,
    MlxCommunity,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Storage {
    /// Stored as is (any float dtype).
    Plain,
    /// MLX affine quantization; `dtype` is that of the scales and biases.
    Affine { bits: usize, group: usize },
    /// A 5-D conv weight stored (out, t, h, w, in) instead of (out, in, t, h, w).
    ChannelsLast,
    /// A depthwise 1-D conv weight stored [channels, kernel, 1] instead of [channels, 1, kernel]
    /// (mlx-vlm's Qwen3.5 DeltaNet convolution).
    KernelFirst,
}

#[derive(Debug, Clone)]
pub struct Entry {
    pub stored_key: String,
    /// Logical (HF) shape.
    pub shape: Vec<usize>,
    pub dtype: StDtype,
    pub storage: Storage,
}

impl Entry {
    /// "f32", "bf16", "mlx-affine-4bit/g64", ...
    pub fn describe(&self) -> String {
        let d = crate::checkpoint::dtype_name(self.dtype);
        match &self.storage {
            Storage::Affine { bits, group } => format!("mlx {bits}-bit (group {group}, {d} scales)"),
            _ => d,
        }
    }
}

/// Bits and group size of one quantized module.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AffineParams {
    pub bits: usize,
    pub group: usize,
}

pub struct Weights {
    ck: Arc<Checkpoint>,
    entries: BTreeMap<String, Entry>,
    pub layout: Layout,
}

/// Weights are stored as f32, f16 or bf16 (or packed u32 with float scales when affine-quantized).
fn is_float(d: StDtype) -> bool {
    matches!(d, StDtype::F32 | StDtype::F16 | StDtype::BF16)
}

fn quant_params(q: &Value) -> Option<AffineParams> {
    Some(AffineParams { bits: q.get("bits")?.as_u64()? as usize, group: q.get("group_size")?.as_u64()? as usize })
}

impl Weights {
    /// Opens the weights of `dir`, reading `config.json`'s `quantization` (global bits and group
    /// size, per-module overrides keyed by stored module path) when present.
    pub fn open(dir: &Path) -> Result<Self> {
        let ck = Arc::new(Checkpoint::open(dir)?);
        let cfg_path = dir.join("config.json");
        let cfg: Value = if cfg_path.is_file() {
            let t = crate::limits::read_text(&cfg_path, crate::limits::MAX_METADATA_FILE_BYTES)?;
            serde_json::from_str(&t).map_err(|source| Error::Json { path: cfg_path.clone(), source })?
        } else {
            Value::Null
        };
        let quant = cfg.get("quantization").or_else(|| cfg.get("quantization_config")).cloned().unwrap_or(Value::Null);
        Self::new(ck, &quant, &cfg_path)
    }

    pub fn new(ck: Arc<Checkpoint>, quant: &Value, cfg_path: &Path) -> Result<Self> {
        let layout = if ck.tensors().keys().any(|k| MLX_PREFIXES.iter().any(|(p, _)| k.starts_with(p))) {
            Layout::MlxCommunity
        } else {
            Layout::HuggingFace
        };
        let global = quant_params(quant);
        let mut entries = BTreeMap::new();
        for (key, info) in ck.tensors() {
            if (key.ends_with(".scales") || key.ends_with(".biases"))
                && ck.contains(&format!("{}.weight", &key[..key.len() - 7]))
            {
                continue;
            }
            let module = key.strip_suffix(".weight");
            let scales = module.map(|m| format!("{m}.scales"));
            let mut shape = info.shape.clone();
            let mut dtype = info.dtype;
            let storage = match scales.as_ref().and_then(|s| ck.info(s)) {
                Some(sinfo) => {
                    let m = module.unwrap();
                    let p = match quant.get(m) {
                        Some(Value::Bool(false)) => None,
                        Some(v) => quant_params(v).or(global),
                        None => global,
                    };
                    let p = p.ok_or_else(|| Error::Config {
                        path: cfg_path.to_path_buf(),
                        field: "quantization".into(),
                        message: format!("`{key}` is quantized but no bits / group_size apply to it"),
                    })?;
                    let file = ck.file_of(key).unwrap().to_path_buf();
                    let biases = format!("{m}.biases");
                    match ck.info(&biases) {
                        Some(b) if b.shape == sinfo.shape && b.dtype == sinfo.dtype => {}
                        found => {
                            return Err(Error::Safetensors {
                                path: file,
                                message: format!(
                                    "`{key}` is affine-quantized but `{biases}` is {}",
                                    match found {
                                        None => "missing".to_string(),
                                        Some(b) => format!(
                                            "{} {:?}, not {} {:?} like its scales",
                                            crate::checkpoint::dtype_name(b.dtype),
                                            b.shape,
                                            crate::checkpoint::dtype_name(sinfo.dtype),
                                            sinfo.shape
                                        ),
                                    }
                                ),
                            });
                        }
                    }
                    if !is_float(sinfo.dtype) {
                        return Err(Error::UnsupportedDtype {
                            key: format!("{m}.scales"),
                            path: file,
                            dtype: crate::checkpoint::dtype_name(sinfo.dtype),
                        });
                    }
                    let cols = sinfo.shape.last().copied().unwrap_or(0).checked_mul(p.group).unwrap_or(0);
                    let packed = info.shape.last().copied().unwrap_or(0);
                    let rows_match = info.shape.len() == sinfo.shape.len()
                        && info.shape[..info.shape.len().saturating_sub(1)]
                            == sinfo.shape[..sinfo.shape.len().saturating_sub(1)];
                    if info.dtype != StDtype::U32
                        || !rows_match
                        || packed.checked_mul(32) != cols.checked_mul(p.bits)
                        || cols == 0
                        || !affine::SUPPORTED_BITS.contains(&p.bits)
                    {
                        return Err(Error::Safetensors {
                            path: ck.file_of(key).unwrap().to_path_buf(),
                            message: format!(
                                "`{key}` ({:?} {:?}) does not match {} bits, group {} with scales {:?}",
                                info.dtype, info.shape, p.bits, p.group, sinfo.shape
                            ),
                        });
                    }
                    *shape.last_mut().unwrap() = cols;
                    dtype = sinfo.dtype;
                    Storage::Affine { bits: p.bits, group: p.group }
                }
                None if layout == Layout::MlxCommunity && hf_key(key) == PATCH_EMBED && shape.len() == 5 => {
                    shape = vec![shape[0], shape[4], shape[1], shape[2], shape[3]];
                    Storage::ChannelsLast
                }
                None if layout == Layout::MlxCommunity
                    && hf_key(key).ends_with(".linear_attn.conv1d.weight")
                    && shape.len() == 3
                    && shape[2] == 1
                    && shape[1] != 1 =>
                {
                    shape = vec![shape[0], 1, shape[1]];
                    Storage::KernelFirst
                }
                None => Storage::Plain,
            };
            if !matches!(storage, Storage::Affine { .. }) && !is_float(dtype) {
                return Err(Error::UnsupportedDtype {
                    key: key.clone(),
                    path: ck.file_of(key).unwrap().to_path_buf(),
                    dtype: crate::checkpoint::dtype_name(dtype),
                });
            }
            entries.insert(hf_key(key), Entry { stored_key: key.clone(), shape, dtype, storage });
        }
        Ok(Self { ck, entries, layout })
    }

    pub fn dir(&self) -> &Path {
        self.ck.dir()
    }
    pub fn checkpoint(&self) -> &Arc<Checkpoint> {
        &self.ck
    }
    pub fn entries(&self) -> &BTreeMap<String, Entry> {
        &self.entries
    }
    pub fn get(&self, key: &str) -> Option<&Entry> {
        self.entries.get(key)
    }

    /// The float dtype the text decoder's weights are stored in (bf16 or f16 when every text
    /// weight is stored so, plainly), else f32: what weights are read in before quantization,
    /// so that no wider copy is made and no precision is lost.
    pub fn text_float_dtype(&self) -> DType {
        self.float_dtype_under(TEXT_PREFIX)
    }

    /// The k-quant `vl run` requantizes an MLX-quantized checkpoint's text decoder to by default:
    /// that of its widest affine width (up to 4 bits Q4_K, 5 Q5_K, 6 Q6_K, more Q8_0), so no
    /// tensor of a mixed checkpoint loses bits; `None` for a checkpoint without affine tensors.
    pub fn default_quant(&self) -> Option<vl_nn::QuantType> {
        use vl_nn::QuantType;
        let bits = self
            .entries
            .values()
            .filter_map(|e| match e.storage {
                Storage::Affine { bits, .. } => Some(bits),
                _ => None,
            })
            .max()?;
        Some(match bits {
            0..=4 => QuantType::Q4K,
            5 => QuantType::Q5K,
            6 => QuantType::Q6K,
            _ => QuantType::Q8_0,
        })
    }

    /// Like `text_float_dtype`, for the vision tower: what its weights can be kept in when they
    /// are computed in f32 (`VisionTower::load_stored`; exact for a bf16 checkpoint).
    pub fn vision_float_dtype(&self) -> DType {
        self.float_dtype_under(VISION_PREFIX)
    }

    fn float_dtype_under(&self, prefix: &str) -> DType {
        let prefix = format!("{prefix}.");
        let mut kinds =
            self.entries.iter().filter(|(k, e)| k.starts_with(&prefix) && e.shape.len() == 2).map(|(_, e)| {
                match (&e.storage, e.dtype) {
                    (Storage::Plain, StDtype::BF16) => DType::BF16,
                    (Storage::Plain, StDtype::F16) => DType::F16,
                    _ => DType::F32,
                }
            });
        match kinds.next() {
            Some(first) if kinds.all(|d| d == first) => first,
            _ => DType::F32,
        }
    }

    /// Loads a logical tensor in `dtype`: affine tensors are dequantized exactly in f32,
    /// channels-last convs permuted.
    pub fn load(&self, key: &str, dtype: DType, dev: &Device) -> Result<Tensor> {
        let e = self.entries.get(key).ok_or_else(|| Error::MissingTensor { key: key.to_string() })?;
        let t = match &e.storage {
            Storage::Plain => self.ck.load(&e.stored_key, dev)?,
            Storage::ChannelsLast => self.ck.load(&e.stored_key, dev)?.permute((0, 4, 1, 2, 3))?.contiguous()?,
            Storage::KernelFirst => self.ck.load(&e.stored_key, dev)?.permute((0, 2, 1))?.contiguous()?,
            Storage::Affine { bits, group } => {
                let module = &e.stored_key[..e.stored_key.len() - ".weight".len()];
                let f32s = |k: &str| -> Result<Vec<f32>> {
                    Ok(self.ck.load(k, &Device::Cpu)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
                };
                let scales = f32s(&format!("{module}.scales"))?;
                let biases = f32s(&format!("{module}.biases"))?;
                let (_, packed) = self.ck.raw(&e.stored_key).expect("indexed");
                let cols = *e.shape.last().unwrap();
                let rows = e.shape.iter().product::<usize>() / cols;
                let w = affine::dequantize(packed, &scales, &biases, rows, cols, *bits, *group).map_err(
                    |err| match err {
                        Error::Input { message, .. } => {
                            Error::Input { what: format!("tensor `{}`", e.stored_key), message }
                        }
                        other => other,
                    },
                )?;
                Tensor::from_vec(w, e.shape.as_slice(), dev)?
            }
        };
        let t = t.to_dtype(dtype)?;
        // The bytes are copied into `t`: the mapped pages can leave this process's memory.
        self.ck.release(&e.stored_key);
        if let Storage::Affine { .. } = e.storage {
            let module = &e.stored_key[..e.stored_key.len() - ".weight".len()];
            self.ck.release(&format!("{module}.scales"));
            self.ck.release(&format!("{module}.biases"));
        }
        Ok(t)
    }

    /// A `VarBuilder` over the logical view, checking shapes, calling `progress` per tensor.
    pub fn var_builder(
        self: &Arc<Self>,
        dtype: DType,
        dev: &Device,
        progress: Option<LoadProgress>,
    ) -> candle_nn::VarBuilder<'static> {
        candle_nn::VarBuilder::from_backend(Box::new(Backend(self.clone(), progress)), dtype, dev.clone())
    }
}

struct Backend(Arc<Weights>, Option<LoadProgress>);

impl candle_nn::var_builder::SimpleBackend for Backend {
    fn get(&self, s: Shape, name: &str, _: candle_nn::Init, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        let e = self.0.get(name).ok_or_else(|| candle_core::Error::wrap(Error::MissingTensor { key: name.into() }))?;
        if e.shape != s.dims() {
            return Err(candle_core::Error::wrap(Error::TensorPlan {
                dir: self.0.dir().to_path_buf(),
                missing: vec![],
                unexpected: vec![],
                wrong_shape: vec![crate::error::ShapeMismatch {
                    key: name.into(),
                    expected: s.dims().to_vec(),
                    found: e.shape.clone(),
                }],
            }));
        }
        let t = self.0.load(name, dtype, dev).map_err(candle_core::Error::wrap)?;
        if let Some(p) = &self.1 {
            p(name);
        }
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        self.0.load(name, dtype, dev).map_err(candle_core::Error::wrap)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.0.get(name).is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_mapping_is_idempotent() {
        for (stored, hf) in [
            ("vision_tower.blocks.0.attn.qkv.weight", "model.visual.blocks.0.attn.qkv.weight"),
            ("language_model.model.layers.3.mlp.up_proj.scales", "model.language_model.layers.3.mlp.up_proj.scales"),
            ("language_model.lm_head.weight", "lm_head.weight"),
            ("model.visual.merger.norm.bias", "model.visual.merger.norm.bias"),
            ("lm_head.weight", "lm_head.weight"),
        ] {
            assert_eq!(hf_key(stored), hf);
            assert_eq!(hf_key(&hf_key(stored)), hf_key(stored));
        }
    }
}
