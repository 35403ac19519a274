//! GGUF files as llama.cpp publishes Qwen3-VL: a text model (`general.architecture` `qwen3vl`)
//! and a vision projector (`clip`, projector type `qwen3vl_merger`). The hyperparameters come from
//! the metadata, the tokenizer from the GGUF vocabulary and merges, the chat template from
//! `tokenizer.chat_template`. Quantized text weights are used in their stored block type (no
//! dequantize-requantize round trip); float weights load as the model's dtype.
//!
//! Every header is walked with bounds before candle's reader sees it: counts, string and array
//! lengths and tensor extents are checked against the file's size, so a hostile or truncated
//! file is an error naming the file and the field, never a panic or a huge allocation.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use tokenizers::Tokenizer;

use super::config::{Qwen3VlConfig, TextConfig, VisionConfig};
use super::gguf_names::{text_key, text_name, vision_key, vision_name};
use super::image_processor::{ImageProcessor, PreprocessorConfig};
use super::model::Qwen3VlModel;
use super::processor::{ChatTemplate, Processor, TemplateSource};
use super::text::{LoadPlan, PreExperts, Prequantized, TextModel};
use super::video_processor::{VideoConfig, VideoProcessor};
use super::vision::VisionTower;
use crate::error::{Error, Result};
use crate::gguf::bad;
pub use crate::gguf::{check_header, find_files, is_gguf, GgufFile};

/// A Qwen3-VL GGUF pair: the text model and (for images) its vision projector.
pub struct GgufModel {
    pub text: GgufFile,
    pub mmproj: Option<GgufFile>,
    pub config: Qwen3VlConfig,
}

impl GgufModel {
    pub fn open(text: &Path, mmproj: Option<&Path>) -> Result<Self> {
        let text = GgufFile::open(text)?;
        let arch = text.str("general.architecture")?;
        if !["qwen3vl", "qwen3vlmoe", "qwen35", "qwen35moe"].contains(&arch) {
            return Err(bad(
                &text.path,
                format!("general.architecture = {arch:?}: not a Qwen3-VL or Qwen3.5 text model (qwen3vl, qwen3vlmoe, qwen35, qwen35moe)"),
            ));
        }
        let mmproj = mmproj.map(GgufFile::open).transpose()?;
        if let Some(m) = &mmproj {
            let arch = m.str("general.architecture")?;
            let proj = m.str("clip.projector_type").unwrap_or("");
            if arch != "clip" || proj != "qwen3vl_merger" {
                return Err(bad(
                    &m.path,
                    format!("not a Qwen3-VL vision projector (architecture {arch:?}, projector {proj:?})"),
                ));
            }
        }
        let config = Self::read_config(&text, mmproj.as_ref())?;
        let g = Self { text, mmproj, config };
        g.check_tensors()?;
        Ok(g)
    }

    /// The GGUF name of a checkpoint key (for messages).
    fn gguf_name(&self, key: &str) -> String {
        let vision = key.strip_prefix(&format!("{}.", super::plan::VISION_PREFIX));
        match vision {
            Some("patch_embed.proj.weight") => Some("v.patch_embd.weight".to_string()),
            Some(k) => vision_name(k, &self.config.vision.deepstack_visual_indexes),
            None => text_name(key).map(|(n, _)| n),
        }
        .unwrap_or_else(|| key.to_string())
    }

    /// The tensor set against the tensor plan of the config read from the metadata, before any
    /// tensor is read: missing, unexpected and wrongly shaped tensors named (by their GGUF names).
    fn check_tensors(&self) -> Result<()> {
        let mut have: HashMap<String, (String, Vec<usize>)> = HashMap::new();
        let mut unexpected = vec![];
        for (name, info) in &self.text.content.tensor_infos {
            if self.is_mtp(name) {
                continue;
            }
            match text_key(name) {
                Some(k) => {
                    have.insert(k, (name.clone(), info.shape.dims().to_vec()));
                }
                None => unexpected.push(name.clone()),
            }
        }
        if let Some(m) = &self.mmproj {
            let deep = &self.config.vision.deepstack_visual_indexes;
            for (name, info) in &m.content.tensor_infos {
                let dims = info.shape.dims().to_vec();
                if name == "v.patch_embd.weight.1" {
                    continue;
                }
                if name == "v.patch_embd.weight" {
                    let mut d = dims.clone();
                    if m.content.tensor_infos.contains_key("v.patch_embd.weight.1") && d.len() == 4 {
                        d.insert(2, 2);
                    }
                    have.insert(format!("{}.patch_embed.proj.weight", super::plan::VISION_PREFIX), (name.clone(), d));
                    continue;
                }
                match vision_key(name, deep) {
                    Some(k) => {
                        have.insert(format!("{}.{k}", super::plan::VISION_PREFIX), (name.clone(), dims));
                    }
                    None => unexpected.push(name.clone()),
                }
            }
        }
        let mut missing = vec![];
        let mut wrong_shape = vec![];
        for p in super::plan::split_experts(super::plan::tensor_plan(&self.config)) {
            if p.group == super::plan::Group::Vision && self.mmproj.is_none() {
                continue;
            }
            match have.get(&p.key) {
                None if p.required => missing.push(self.gguf_name(&p.key)),
                Some((name, dims)) if *dims != p.shape && p.alt_shape.as_ref() != Some(dims) => {
                    wrong_shape.push(crate::error::ShapeMismatch {
                        key: name.clone(),
                        expected: p.shape.clone(),
                        found: dims.clone(),
                    })
                }
                _ => {}
            }
        }
        if missing.is_empty() && unexpected.is_empty() && wrong_shape.is_empty() {
            return Ok(());
        }
        Err(Error::TensorPlan { dir: self.text.path.clone(), missing, unexpected, wrong_shape })
    }

    /// A tensor of the multi-token-prediction block that llama.cpp's converter appends after the
    /// decoder's (`blk.N` with N past the layers: Qwen3.5's `mtp.*`), read as the MTP head.
    fn is_mtp(&self, name: &str) -> bool {
        name.strip_prefix("blk.")
            .and_then(|r| r.split_once('.'))
            .and_then(|(i, _)| i.parse::<usize>().ok())
            .is_some_and(|i| i >= self.config.text.num_hidden_layers)
    }

    /// Qwen3.5's hybrid decoder from `qwen35.*`: the layer count without the MTP block the
    /// converter counts in `block_count` (`nextn_predict_layers`), the layer pattern from
    /// `attention.recurrent_layers` (read before `full_attention_interval`, which the MoE
    /// conversion writes as 4 whatever the config said), the DeltaNet widths from `ssm.*`, the
    /// rotary dims from `rope.dimension_count`.
    fn hybrid(t: &GgufFile, a: &str, blocks: usize) -> Result<(usize, super::config::HybridConfig, usize)> {
        let k = |s: &str| format!("{a}.{s}");
        let mtp = t.usize(&k("nextn_predict_layers"), blocks).unwrap_or(0);
        let layers = blocks.checked_sub(mtp).filter(|&n| n > 0).ok_or_else(|| {
            bad(&t.path, format!("block_count {blocks} leaves no decoder layer besides {mtp} MTP layers"))
        })?;
        let linear: Vec<bool> = match t.array(&k("attention.recurrent_layers")) {
            Ok(v) => {
                if v.len() < layers {
                    return Err(bad(
                        &t.path,
                        format!("attention.recurrent_layers has {} entries for {layers} layers", v.len()),
                    ));
                }
                v[..layers]
                    .iter()
                    .map(|x| {
                        x.to_bool().map_err(|_| bad(&t.path, "attention.recurrent_layers is not a list of booleans"))
                    })
                    .collect::<Result<_>>()?
            }
            Err(_) => {
                let every = t.usize(&k("full_attention_interval"), 1024)?.max(1);
                (0..layers).map(|i| !(i + 1).is_multiple_of(every)).collect()
            }
        };
        let groups = t.usize(&k("ssm.group_count"), 1024)?;
        let v_heads = t.usize(&k("ssm.time_step_rank"), 1024)?;
        let inner = t.usize(&k("ssm.inner_size"), 1 << 20)?;
        if groups == 0 || v_heads == 0 || !v_heads.is_multiple_of(groups) || !inner.is_multiple_of(v_heads) {
            return Err(bad(
                &t.path,
                format!(
                    "ssm.group_count {groups}, ssm.time_step_rank {v_heads} and ssm.inner_size {inner} do not divide"
                ),
            ));
        }
        let h = super::config::HybridConfig {
            linear,
            conv_kernel: t.usize(&k("ssm.conv_kernel"), 64)?,
            key_heads: groups,
            value_heads: v_heads,
            key_head_dim: t.usize(&k("ssm.state_size"), 1024)?,
            value_head_dim: inner / v_heads,
            gguf_layout: true,
            norms_plus_one: true,
        };
        Ok((layers, h, t.usize(&k("rope.dimension_count"), 1024)?))
    }

    fn read_config(t: &GgufFile, m: Option<&GgufFile>) -> Result<Qwen3VlConfig> {
        let a = t.str("general.architecture")?;
        let k = |s: &str| format!("{a}.{s}");
        let vocab = t.array("tokenizer.ggml.tokens")?.len();
        let heads = t.usize(&k("attention.head_count"), 1024)?;
        let kv = t.usize(&k("attention.head_count_kv"), 1024)?;
        if heads % kv != 0 {
            return Err(bad(&t.path, format!("head_count_kv {kv} does not divide head_count {heads}")));
        }
        let sections: Vec<usize> = t
            .array(&k("rope.dimension_sections"))?
            .iter()
            .map(|v| v.to_i32().map(|x| x.max(0) as usize).or_else(|_| v.to_u32().map(|x| x as usize)))
            .collect::<std::result::Result<_, _>>()
            .map_err(|_| bad(&t.path, "rope.dimension_sections is not a list of integers"))?;
        let head_dim = t.usize(&k("attention.key_length"), 1024)?;
        let blocks = t.usize(&k("block_count"), 1024)?;
        let (layers, hybrid, rotary_dim) = if a == "qwen35" || a == "qwen35moe" {
            let (layers, h, rotary) = Self::hybrid(t, a, blocks)?;
            (layers, Some(h), rotary)
        } else {
            (blocks, None, head_dim)
        };
        if rotary_dim > head_dim || sections.len() < 3 || sections[..3].iter().sum::<usize>() * 2 != rotary_dim {
            return Err(bad(
                &t.path,
                format!("rope.dimension_sections {sections:?} do not cover the {rotary_dim} rotary dims of head_dim {head_dim}"),
            ));
        }
        let text = TextConfig {
            vocab_size: vocab,
            hidden_size: t.usize(&k("embedding_length"), 65_536)?,
            intermediate_size: if t.content.metadata.contains_key(&k("feed_forward_length")) || a == "qwen3vl" {
                t.usize(&k("feed_forward_length"), 262_144)?
            } else {
                0
            },
            num_hidden_layers: layers,
            num_attention_heads: heads,
            num_key_value_heads: kv,
            head_dim,
            max_position_embeddings: t.usize(&k("context_length"), 1 << 24)?,
            rms_norm_eps: t.f64(&k("attention.layer_norm_rms_epsilon"))?,
            rope_theta: t.f64(&k("rope.freq_base"))?,
            mrope_section: sections[..3].to_vec(),
            rotary_dim,
            hybrid,
            // llama.cpp's qwen3vlmoe has routed experts in every layer.
            moe: if a == "qwen3vlmoe" || a == "qwen35moe" {
                let experts = t.usize(&k("expert_count"), 4096)?;
                let used = t.usize(&k("expert_used_count"), 4096)?;
                if used == 0 || used > experts {
                    return Err(bad(&t.path, format!("expert_used_count {used} is not in 1..={experts}")));
                }
                Some(super::config::MoeConfig {
                    num_experts: experts,
                    top_k: used,
                    moe_intermediate_size: t.usize(&k("expert_feed_forward_length"), 262_144)?,
                    decoder_sparse_step: 1,
                    mlp_only_layers: vec![],
                    // Qwen3.5 MoE's shared expert.
                    shared_intermediate_size: match t
                        .content
                        .metadata
                        .contains_key(&k("expert_shared_feed_forward_length"))
                    {
                        true => Some(t.usize(&k("expert_shared_feed_forward_length"), 262_144)?),
                        false => None,
                    },
                })
            } else {
                None
            },
        };
        let vision = match m {
            Some(m) => {
                let deep: Vec<usize> = m
                    .array("clip.vision.is_deepstack_layers")
                    .map(|l| {
                        l.iter().enumerate().filter(|(_, v)| v.to_bool().unwrap_or(false)).map(|(i, _)| i).collect()
                    })
                    .unwrap_or_default();
                let pos = m
                    .dims("v.position_embd.weight")
                    .and_then(|d| d.first().copied())
                    .ok_or_else(|| bad(&m.path, "tensor v.position_embd.weight is missing"))?;
                VisionConfig {
                    depth: m.usize("clip.vision.block_count", 256)?,
                    hidden_size: m.usize("clip.vision.embedding_length", 65_536)?,
                    intermediate_size: m.usize("clip.vision.feed_forward_length", 262_144)?,
                    num_heads: m.usize("clip.vision.attention.head_count", 1024)?,
                    in_channels: 3,
                    patch_size: m.usize("clip.vision.patch_size", 64)?,
                    spatial_merge_size: m.usize("clip.vision.spatial_merge_size", 8)?,
                    temporal_patch_size: 2,
                    out_hidden_size: m.usize("clip.vision.projection_dim", 65_536)?,
                    num_position_embeddings: pos,
                    deepstack_visual_indexes: deep,
                    rope_theta: 10_000.0,
                }
            }
            // Text only: a placeholder tower that is never loaded.
            None => VisionConfig {
                depth: 1,
                hidden_size: 16,
                intermediate_size: 16,
                num_heads: 1,
                in_channels: 3,
                patch_size: 16,
                spatial_merge_size: 2,
                temporal_patch_size: 2,
                out_hidden_size: text.hidden_size,
                num_position_embeddings: 4,
                deepstack_visual_indexes: vec![],
                rope_theta: 10_000.0,
            },
        };
        if let Some(m) = m {
            super::config::validate_vision(&vision, &text, &m.path)?;
        }
        let id_of = |s: &str| t.token_id(s).ok_or_else(|| bad(&t.path, format!("the vocabulary has no {s} token")));
        Ok(Qwen3VlConfig {
            tie_word_embeddings: t.dims("output.weight").is_none(),
            image_token_id: id_of("<|image_pad|>")?,
            video_token_id: id_of("<|video_pad|>")?,
            vision_start_token_id: id_of("<|vision_start|>")?,
            vision_end_token_id: id_of("<|vision_end|>")?,
            text,
            vision,
            unknown_keys: vec![],
        })
    }

    /// Tokenizer (from the GGUF vocabulary and merges), chat template and image processor.
    pub fn processor(&self) -> Result<Processor> {
        let t = &self.text;
        let tokenizer = tokenizer(t)?;
        let template = match t.str("tokenizer.chat_template") {
            Ok(s) => ChatTemplate::new(s.to_string(), TemplateSource::File(t.path.clone()), None, None)?,
            Err(_) => {
                ChatTemplate::new(super::processor::BUILTIN_TEMPLATE.into(), TemplateSource::BuiltIn, None, None)?
            }
        };
        let mut pp = PreprocessorConfig::default();
        if let Some(m) = &self.mmproj {
            pp.patch_size = self.config.vision.patch_size;
            pp.merge_size = self.config.vision.spatial_merge_size;
            // The pixel budget when the file has one (ours do; llama.cpp's converter leaves it out
            // and the Qwen3-VL preprocessor defaults apply).
            if let (Ok(min), Ok(max)) = (
                m.usize("clip.vision.image_min_pixels", super::image_processor::MAX_PIXEL_BUDGET),
                m.usize("clip.vision.image_max_pixels", super::image_processor::MAX_PIXEL_BUDGET),
            ) {
                if min <= max {
                    pp.min_pixels = min;
                    pp.max_pixels = max;
                }
            }
            for (key, dst) in
                [("clip.vision.image_mean", &mut pp.image_mean), ("clip.vision.image_std", &mut pp.image_std)]
            {
                if let Ok(v) = m.array(key) {
                    for (d, x) in dst.iter_mut().zip(v) {
                        *d = x.to_f32().map_err(|_| bad(&m.path, format!("{key} is not a list of numbers")))?;
                    }
                }
            }
        }
        // No video config in a GGUF: the one the hub checkpoints ship (the class defaults but
        // the pixel bounds) over the image geometry.
        let (min_pixels, max_pixels) = VideoConfig::HUB_BUDGET;
        let video =
            VideoConfig { base: PreprocessorConfig { min_pixels, max_pixels, ..pp.clone() }, ..Default::default() };
        Ok(Processor { tokenizer, template, images: ImageProcessor::new(pp), videos: VideoProcessor::new(video) })
    }

    /// End-of-turn ids: the GGUF's eos and `<|im_end|>` / `<|endoftext|>` when present.
    pub fn eos_token_ids(&self) -> Vec<u32> {
        let t = &self.text;
        let mut ids: Vec<u32> =
            t.get("tokenizer.ggml.eos_token_id").ok().and_then(|v| v.to_u32().ok()).into_iter().collect();
        for id in ["<|im_end|>", "<|endoftext|>"].into_iter().filter_map(|s| t.token_id(s)) {
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
        ids
    }

    /// What `vl inspect` reports: files, geometry, and the storage type of each tensor group.
    pub fn summary(&self) -> serde_json::Value {
        let c = &self.config;
        let mut groups: std::collections::BTreeMap<String, std::collections::BTreeMap<String, usize>> =
            Default::default();
        for f in std::iter::once(&self.text).chain(self.mmproj.as_ref()) {
            for (name, info) in &f.content.tensor_infos {
                let group = if name.starts_with("v.") || name.starts_with("mm.") {
                    "vision"
                } else if name == "token_embd.weight" {
                    "embeddings"
                } else if name == "output.weight" {
                    "lm_head"
                } else if name.ends_with("norm.weight") {
                    "norms"
                } else if name.contains("_exps.") {
                    "routed experts"
                } else if name.contains("ffn_gate_inp.") {
                    "routers"
                } else {
                    "text"
                };
                *groups.entry(group.into()).or_default().entry(format!("{:?}", info.ggml_dtype)).or_default() += 1;
            }
        }
        serde_json::json!({
            "format": "gguf",
            "text_file": self.text.path.display().to_string(),
            "mmproj_file": self.mmproj.as_ref().map(|m| m.path.display().to_string()),
            "text": {"layers": c.text.num_hidden_layers, "hidden": c.text.hidden_size, "heads": c.text.num_attention_heads,
                     "kv_heads": c.text.num_key_value_heads, "head_dim": c.text.head_dim, "vocab": c.text.vocab_size,
                     "context": c.text.max_position_embeddings, "mrope_section": c.text.mrope_section,
                     "tied_embeddings": c.tie_word_embeddings},
            "vision": self.mmproj.as_ref().map(|_| serde_json::json!({"depth": c.vision.depth, "hidden": c.vision.hidden_size,
                     "heads": c.vision.num_heads, "patch": c.vision.patch_size, "merge": c.vision.spatial_merge_size,
                     "deepstack": c.vision.deepstack_visual_indexes})),
            "experts": c.text.moe.as_ref().map(|m| serde_json::json!({"experts_per_layer": m.num_experts,
                     "active_per_token": m.top_k, "moe_intermediate_size": m.moe_intermediate_size})),
            "storage": groups,
            "chat_template": self.text.content.metadata.contains_key("tokenizer.chat_template"),
        })
    }

    /// Bytes of process memory the weights take once loaded as `load_text_quantized(dtype, _,
    /// quant)` and `load_vision` do: float text tensors in `dtype` (or `quant` where a 2-D one's
    /// rows fill its blocks), the projector in its stored float type, and quantized tensors as
    /// stored, unless `mapped` (the CPU): then their blocks are pages of the file, which the
    /// kernel can drop and read again, and only candle's repacked tiles of the 2-D ones count
    /// (Q4_K 6 bits a value for the stored 4.5, Q6_K 10 for 6.56, Q8_0 the same size; other
    /// types are not repacked; Q4_K and Q6_K none where the CPU has AVX-512 VNNI or AVX2 without
    /// AVX-512, whose kernels read the stored blocks, `vl_nn::stored_tiles` and `vl_nn::stored`).
    /// The routed experts stay mapped: a MoE larger than the memory left loads, and runs from the
    /// file's pages.
    pub fn resident_bytes(&self, dtype: DType, quant: Option<vl_nn::QuantType>, mapped: bool) -> u64 {
        let stored = vl_nn::stored_tiles::available() || vl_nn::stored::takes_prompts();
        let bytes = |f: &GgufFile, vision: bool| -> f64 {
            f.content
                .tensor_infos
                .values()
                .map(|i| {
                    let dims = i.shape.dims();
                    let elems = dims.iter().product::<usize>() as f64;
                    let t = i.ggml_dtype;
                    let float = matches!(t, GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16);
                    let tiles = match t {
                        GgmlDType::Q4K | GgmlDType::Q6K if stored => 0.0,
                        GgmlDType::Q4K => 6.0 / 4.5,
                        GgmlDType::Q6K => 10.0 / 6.5625,
                        GgmlDType::Q8_0 => 1.0,
                        _ => 0.0,
                    };
                    // The projector's quantized tensors, if any, are dequantized at load.
                    let per = if !float && mapped && !vision {
                        if dims.len() == 2 {
                            tiles * t.type_size() as f64 / t.block_size() as f64
                        } else {
                            0.0
                        }
                    } else if !float {
                        t.type_size() as f64 / t.block_size() as f64
                    } else if vision {
                        t.type_size() as f64
                    } else {
                        match quant {
                            Some(q) if dims.len() >= 2 && dims[dims.len() - 1].is_multiple_of(q.block()) => {
                                q.ggml().type_size() as f64 / q.block() as f64
                            }
                            _ => dtype.size_in_bytes() as f64,
                        }
                    };
                    elems * per
                })
                .sum()
        };
        (bytes(&self.text, false) + self.mmproj.as_ref().map_or(0.0, |m| bytes(m, true))) as u64
    }

    /// The text decoder: quantized tensors as stored, float tensors as `dtype` (the 2-D ones
    /// quantized to `quant` when given, e.g. `--quantize q4k` on an f16 GGUF).
    pub fn load_text(&self, dtype: DType, dev: &Device) -> Result<TextModel> {
        self.load_text_quantized(dtype, dev, None)
    }

    pub fn load_text_quantized(
        &self,
        dtype: DType,
        dev: &Device,
        quant: Option<vl_nn::QuantType>,
    ) -> Result<TextModel> {
        let cfg = &self.config;
        let mut floats = HashMap::new();
        let mut pre: Prequantized = HashMap::new();
        let mut experts: PreExperts = HashMap::new();
        for (name, info) in &self.text.content.tensor_infos {
            let hf = if self.is_mtp(name) {
                // The MTP block: the head's tensors under their checkpoint keys (`mtp.*`).
                match super::gguf_hybrid::mtp_key(name, cfg.text.num_hidden_layers) {
                    Some(k) => k,
                    None => continue,
                }
            } else {
                match text_key(name) {
                    Some(k) => k,
                    None => {
                        return Err(bad(&self.text.path, format!("unexpected tensor {name} in a Qwen3-VL text model")))
                    }
                }
            };
            if let Some(t) = self.text.float_tensor(name, dev)? {
                floats.insert(hf, t.to_dtype(dtype)?);
                continue;
            }
            if info.shape.rank() == 3 {
                // Views of the mapped file on the CPU; elsewhere cut as read, the 3-D bytes
                // dropped before the next tensor, so the experts are held once at the peak.
                experts.insert(hf, self.text.experts(name, dev)?);
                continue;
            }
            let q = self.text.tensor(name, dev)?;
            if q.shape().rank() == 1 {
                floats.insert(hf, q.dequantize(dev)?.to_dtype(dtype)?);
            } else {
                pre.insert(hf, Arc::new(q));
            }
        }
        // The stored weights whose kernels read only candle's repacked tiles (Q8_0 on AVX-512
        // VNNI; Q4_K on CPUs without AVX2): repacked here, on every core, each one's mapped
        // pages handed back as soon as its tiles exist, so the load never holds both copies. A
        // page read again later (an AVX2-only CPU's Q8_0 products, an embedding row) comes back
        // from the file. Q6_K keeps its blocks (candle's one-row products read them), and so does
        // Q4_K where `vl_nn::stored` decodes on them (and, with AVX-512 VNNI `stored_tiles`, with
        // AVX2 alone `stored` itself, multiplies prompts on them: no tiles at all).
        let q4k_stored = vl_nn::stored::available();
        if dev.is_cpu() {
            let tiled: Vec<(&str, vl_nn::QLinear)> = (self.text.content.tensor_infos.keys())
                .filter(|n| cfg.tie_word_embeddings || n.as_str() != "token_embd.weight")
                .filter_map(|n| Some((n.as_str(), pre.get(&text_key(n)?)?)))
                .filter(|(_, t)| t.dtype() == GgmlDType::Q8_0 || (t.dtype() == GgmlDType::Q4K && !q4k_stored))
                .map(|(n, t)| Ok((n, vl_nn::QLinear::from_qtensor(t.clone(), None)?)))
                .collect::<Result<_>>()?;
            let layers: Vec<&vl_nn::QLinear> = tiled.iter().map(|(_, l)| l).collect();
            vl_nn::linear::prepare_all_then(&layers, &|i| self.text.release(tiled[i].0))?;
        }
        let vb = VarBuilder::from_tensors(floats, dtype, dev);
        let quant = quant.map(|qtype| super::text::QuantLoad { qtype, read_as: dtype });
        let plan = LoadPlan { quant, pre: Some(&pre), experts: Some(&experts) };
        TextModel::load_plan(&cfg.text, cfg.tie_word_embeddings, vb, plan)
    }

    /// The vision tower from the mmproj file, computing in `dtype`. An f16/bf16 mmproj stays in
    /// its dtype, each block upcast for its own forward (as `VisionTower::load_stored`: the same
    /// arithmetic, half the resident memory of an f32 copy).
    pub fn load_vision(&self, dtype: DType, dev: &Device) -> Result<VisionTower> {
        let m =
            self.mmproj.as_ref().ok_or_else(|| bad(&self.text.path, "no mmproj file: images need one (--mmproj)"))?;
        let deep = &self.config.vision.deepstack_visual_indexes;
        let stored = match m.content.tensor_infos.get("v.blk.0.attn_qkv.weight").map(|i| i.ggml_dtype) {
            Some(GgmlDType::F16) if dtype == DType::F32 => DType::F16,
            Some(GgmlDType::BF16) if dtype == DType::F32 => DType::BF16,
            _ => dtype,
        };
        let mut map = HashMap::new();
        let mut patch = [None, None];
        // The linears' 2-D weights arrive as views of their transposes, written once from the
        // map (what `Dense` keeps), where their stored dtype is the one they are kept in and
        // `Dense` keeps W^T (not on AVX2-only CPUs, where it packs panels from W).
        let transposed = !vl_nn::panels::preferred();
        for name in m.content.tensor_infos.keys() {
            let kept = crate::gguf::float_dtype(m.content.tensor_infos[name].ggml_dtype) == Some(stored);
            let linear = transposed && kept && name.as_str() != "v.position_embd.weight";
            let t = match if linear { m.float_tensor_transposed(name, dev)? } else { None } {
                Some(t) => t,
                None => match m.float_tensor(name, dev)? {
                    Some(t) => t.to_dtype(stored)?,
                    None => m.tensor(name, dev)?.dequantize(dev)?.to_dtype(stored)?,
                },
            };
            match name.as_str() {
                "v.patch_embd.weight" => patch[0] = Some(t),
                "v.patch_embd.weight.1" => patch[1] = Some(t),
                _ => {
                    let hf = vision_key(name, deep)
                        .ok_or_else(|| bad(&m.path, format!("unexpected tensor {name} in a Qwen3-VL mmproj")))?;
                    map.insert(hf, t);
                }
            }
        }
        match patch {
            // Two temporal slices of the Conv3D kernel [out, in, kh, kw] -> [out, in, 2, kh, kw].
            [Some(a), Some(b)] => {
                map.insert("patch_embed.proj.weight".to_string(), Tensor::stack(&[a, b], 2)?);
            }
            _ => return Err(bad(&m.path, "v.patch_embd.weight and v.patch_embd.weight.1 are both needed")),
        }
        VisionTower::load_stored(&self.config.vision, VarBuilder::from_tensors(map, stored, dev), dtype)
    }

    pub fn load_model(&self, dtype: DType, dev: &Device) -> Result<Qwen3VlModel> {
        let vision = self.mmproj.as_ref().map(|_| self.load_vision(dtype, dev)).transpose()?;
        Ok(Qwen3VlModel::from_parts(self.config.clone(), vision, self.load_text(dtype, dev)?))
    }
}

/// `summary` as text lines.
pub fn summary_text(s: &serde_json::Value) -> String {
    let mut out = vec![format!("GGUF text model: {}", s["text_file"].as_str().unwrap_or(""))];
    match s["mmproj_file"].as_str() {
        Some(m) => out.push(format!("vision projector: {m}")),
        None => out.push("vision projector: none (text only)".into()),
    }
    out.push(format!("text: {}", s["text"]));
    if let Some(e) = s["experts"].as_object() {
        out.push(format!(
            "experts:      {} per layer, {} active per token, moe_intermediate {}",
            e["experts_per_layer"], e["active_per_token"], e["moe_intermediate_size"]
        ));
    }
    if !s["vision"].is_null() {
        out.push(format!("vision: {}", s["vision"]));
    }
    if let Some(groups) = s["storage"].as_object() {
        for (g, types) in groups {
            let t: Vec<String> = types.as_object().into_iter().flatten().map(|(k, v)| format!("{v} {k}")).collect();
            out.push(format!("  {g}: {}", t.join(", ")));
        }
    }
    out.join("\n")
}

/// The Qwen2 byte-level BPE tokenizer from a GGUF vocabulary: normal tokens and merges form the
/// BPE model; control tokens become special added tokens, user-defined ones (e.g. `<tool_call>`)
/// non-special added tokens, as in the checkpoint's tokenizer.json.
fn tokenizer(t: &GgufFile) -> Result<Tokenizer> {
    let model = t.str("tokenizer.ggml.model")?;
    let pre = t.str("tokenizer.ggml.pre").unwrap_or("");
    let pattern = match (model, pre) {
        ("gpt2", "qwen2") => QWEN2_PATTERN,
        ("gpt2", "qwen35") => QWEN35_PATTERN,
        _ => {
            return Err(bad(
                &t.path,
                format!("tokenizer {model:?} with pre-tokenizer {pre:?} is not supported (gpt2 / qwen2, qwen35)"),
            ))
        }
    };
    let tokens = t.array("tokenizer.ggml.tokens")?;
    let types = t.array("tokenizer.ggml.token_type").ok();
    let merges = t.array("tokenizer.ggml.merges")?;
    // The BPE model is built from the vocabulary and merges directly (through a tokenizer.json
    // they took ~0.8 s of a load: the JSON written, then parsed back); the rest of the
    // tokenizer (normalizer, pre-tokenizer, decoder: a few lines) still comes from JSON, and the
    // added tokens are added after the model, as `Tokenizer::from_bytes` does.
    let mut vocab = tokenizers::models::bpe::Vocab::with_capacity(tokens.len());
    let mut added = Vec::new();
    for (i, tok) in tokens.iter().enumerate() {
        let s = tok.to_string().map_err(|_| bad(&t.path, "tokenizer.ggml.tokens holds a non-string"))?;
        let ty = types.and_then(|ty| ty.get(i)).and_then(|v| v.to_i32().ok()).unwrap_or(1);
        let id = u32::try_from(i).map_err(|_| bad(&t.path, "tokenizer.ggml.tokens has more than 2^32 tokens"))?;
        match ty {
            1 => {
                vocab.insert(s.clone(), id);
            }
            3 | 4 => added.push(
                tokenizers::AddedToken::from(s.clone(), ty == 3)
                    .single_word(false)
                    .lstrip(false)
                    .rstrip(false)
                    .normalized(false),
            ),
            _ => {}
        }
    }
    let merges: Vec<(String, String)> = merges
        .iter()
        .map(|m| {
            let s = m.to_string().map_err(|_| bad(&t.path, "tokenizer.ggml.merges holds a non-string"))?;
            let (a, b) = s.split_once(' ').ok_or_else(|| bad(&t.path, format!("merge {s:?} is not a pair")))?;
            Ok((a.to_string(), b.to_string()))
        })
        .collect::<Result<_>>()?;
    let fail = |e: tokenizers::Error| bad(&t.path, format!("tokenizer: {}", e.to_string().replace('\n', " ")));
    let bpe = tokenizers::models::bpe::BPE::builder()
        .vocab_and_merges(vocab, merges)
        .continuing_subword_prefix(String::new())
        .end_of_word_suffix(String::new())
        .build()
        .map_err(fail)?;
    let byte_level =
        serde_json::json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false});
    let json = serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false},
            byte_level.clone()]},
        "post_processor": byte_level.clone(),
        "decoder": byte_level,
        "model": {"type": "BPE", "vocab": {}, "merges": []},
    });
    let mut tokenizer = Tokenizer::from_bytes(json.to_string().as_bytes()).map_err(fail)?;
    tokenizer.with_model(bpe);
    tokenizer.add_tokens(added).map_err(fail)?;
    Ok(tokenizer)
}

/// llama.cpp's `qwen2` pre-tokenizer: the split regex of Qwen2's tokenizer.json.
const QWEN2_PATTERN: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// llama.cpp's `qwen35` pre-tokenizer: Qwen3.5's split regex, marks (`\p{M}`) in the letter classes.
const QWEN35_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
