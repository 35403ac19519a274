//! Qwen3-VL through the family seam (`crate::family`): loading (checkpoint directories and
//! GGUF pairs, resident or in stages), a request made into prompt tokens and media the way
//! transformers' `Qwen3VLProcessor` does, and the model's prefill and batched decode.

use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};

use candle_core::{DType, Device, Tensor};

use super::gguf::{self, GgufModel};
use super::plan::VISION_PREFIX;
use super::video_processor::{VideoOptions, VideoProcessor};
use super::{ModelDir, Processor, Prompt, QuantLoad, Qwen3VlConfig, TextModel, VisionTower, Weights};
use crate::error::{Error, Result};
use crate::family::{
    Family, FamilyEntry, Generator, ImageSizing, ModelOptions, PoolInput, Prepared, Sizing, Source, Task,
};
use crate::media::{Media, MediaContext, MediaKind, VisionOutput};
use crate::request::{Request, VideoReport};
use crate::state::SeqState;

/// The registry's entry for Qwen3-VL.
pub static ENTRY: FamilyEntry = FamilyEntry {
    name: "qwen3_vl",
    architectures: &["Qwen3VLForConditionalGeneration"],
    model_types: &["qwen3_vl"],
    gguf_architectures: &["qwen3vl"],
    heads: &[],
    open: open_entry,
    inspect: inspect_entry,
    quantize: quantize_entry,
    default_quant: default_quant_entry,
};

fn inspect_entry(source: &Source<'_>, json: bool) -> Result<String> {
    let to_json = |v: &serde_json::Value| {
        serde_json::to_string_pretty(v).map_err(|e| Error::Input { what: "summary".into(), message: e.to_string() })
    };
    if gguf::is_gguf(source.model) {
        let (text, mm) = gguf::find_files(source.model, source.mmproj)?;
        let g = GgufModel::open(&text, mm.as_deref())?;
        g.processor()?;
        let summary = g.summary();
        return if json { to_json(&summary) } else { Ok(gguf::summary_text(&summary)) };
    }
    if let Some(m) = source.mmproj {
        return Err(Error::Input {
            what: m.display().to_string(),
            message: format!(
                "--mmproj goes with a GGUF text model; {} is a checkpoint directory",
                source.model.display()
            ),
        });
    }
    let summary = super::inspect(source.model)?;
    if json {
        serde_json::to_value(&summary)
            .map_err(|e| Error::Input { what: "summary".into(), message: e.to_string() })
            .and_then(|v| to_json(&v))
    } else {
        Ok(summary.to_string())
    }
}

pub(crate) fn quantize_entry(
    model: &Path,
    recipe: crate::gguf::Recipe,
    out: &Path,
    overwrite: bool,
    progress: &mut dyn FnMut(&str),
) -> Result<crate::gguf::Written> {
    super::gguf_write::save(&ModelDir::open(model)?, recipe, out, overwrite, progress)
}

pub(crate) fn default_quant_entry(model: &Path) -> Result<Option<vl_nn::QuantType>> {
    if gguf::is_gguf(model) {
        return Ok(None);
    }
    Ok(Weights::open(model)?.default_quant())
}

fn open_entry(source: &Source<'_>, opts: &ModelOptions, staged: bool) -> Result<Box<dyn Family>> {
    Ok(Box::new(open(source, opts, staged)?))
}

/// A Qwen3-VL checkpoint directory or GGUF pair, loaded (the families built on this one wrap it).
pub(crate) fn open(source: &Source<'_>, opts: &ModelOptions, staged: bool) -> Result<Qwen3Vl> {
    if gguf::is_gguf(source.model) {
        return Qwen3Vl::open_gguf(source.model, source.mmproj, opts, staged);
    }
    if let Some(m) = source.mmproj {
        return Err(Error::Input {
            what: m.display().to_string(),
            message: "--mmproj goes with a GGUF text model, not a checkpoint directory".into(),
        });
    }
    let dir = ModelDir::open(source.model)?;
    Qwen3Vl::from_dir(dir, opts, staged, source.progress.cloned())
}

type VisionLoader = Box<dyn FnOnce() -> Result<VisionTower> + Send>;
type TextLoader = Box<dyn FnOnce() -> Result<TextModel> + Send>;

/// The vision tower: loaded, to be loaded at the first image (staged), or absent (released, or
/// a GGUF without its projector).
enum VisionSlot {
    Ready(Arc<VisionTower>),
    Pending(VisionLoader),
    /// Why there is none: (what is at fault, the message).
    Absent(String, String),
}

/// A loaded Qwen3-VL model.
pub struct Qwen3Vl {
    /// The reasoning markers, when the tokenizer has them.
    think: Option<crate::reasoning::Markers>,
    /// How the template writes a function call (read from it once, at load).
    call_format: crate::decoding::constraint::CallFormat,
    config: Qwen3VlConfig,
    processor: Processor,
    eos: Vec<u32>,
    device: Device,
    /// The dtype the KV cache keeps its rows in (`ModelOptions::kv_dtype`, else `dtype`).
    kv_dtype: DType,
    vision: Mutex<VisionSlot>,
    text: OnceLock<TextModel>,
    text_loader: Mutex<Option<TextLoader>>,
    /// Sampled, preprocessed videos by `clip_key` (None: disabled).
    /// The checkpoint's own pixel budgets (with the engine's sampling settings), for reports.
    checkpoint: Checkpoint,
    /// Tensors the load reads (0 for GGUF, which reports none).
    tensors: usize,
    /// `ModelOptions::draft_vocab`, and the lm_head's first rows it makes (at the first draft).
    draft_vocab: Option<usize>,
    draft_lm_head: OnceLock<vl_nn::QLinear>,
}

/// The processors with the checkpoint's own pixel budgets.
struct Checkpoint {
    images: super::ImageProcessor,
    videos: Option<VideoProcessor>,
}

impl Qwen3Vl {
    /// From a checked model directory; `staged` loads the vision tower at the first image and the
    /// text decoder at `finish_loading`, after the tower is released.
    pub fn from_dir(
        dir: ModelDir,
        opts: &ModelOptions,
        staged: bool,
        progress: Option<crate::checkpoint::LoadProgress>,
    ) -> Result<Self> {
        let ModelDir { config, weights, mut processor, generation, .. } = dir;
        check_vision_precision(opts)?;
        check_kv_dtype(opts)?;
        check_memory(&config, &weights, opts)?;
        let checkpoint = apply_image_options(&mut processor, opts)?;
        let tensors = weights.entries().len();
        let (dtype, device) = (opts.dtype, opts.device.clone());
        let (quant, bf16) = (opts.quant, opts.vision_bf16);
        let vision: VisionSlot = if staged && bf16 {
            // Read in the checkpoint's float dtype (no f32 copy), then rounded to bf16 panels.
            let (w, cfg, p) = (weights.clone(), config.vision.clone(), progress.clone());
            let dev = device.clone();
            VisionSlot::Pending(Box::new(move || {
                let stored = w.vision_float_dtype();
                VisionTower::load_stored(&cfg, w.var_builder(stored, &dev, p).pp(VISION_PREFIX), dtype)?
                    .into_bf16_products()
            }))
        } else if staged {
            // As the resident tower below: a bf16/f16 checkpoint's vision weights stay in that
            // dtype. An f32 copy made at load costs more than the per-block upcasts of an answer's
            // few images (docs/performance.md, "The bf16 load").
            let (w, cfg, p) = (weights.clone(), config.vision.clone(), progress.clone());
            let dev = device.clone();
            VisionSlot::Pending(Box::new(move || {
                let stored = if dtype == DType::F32 { w.vision_float_dtype() } else { dtype };
                VisionTower::load_stored(&cfg, w.var_builder(stored, &dev, p).pp(VISION_PREFIX), dtype)
            }))
        } else {
            // Resident for every request: a bf16/f16 checkpoint's vision weights stay in that
            // dtype and are upcast block by block when computing in f32 (exact; half the memory).
            let stored = if dtype == DType::F32 { weights.vision_float_dtype() } else { dtype };
            let tower = VisionTower::load_stored(
                &config.vision,
                weights.var_builder(stored, &device, None).pp(VISION_PREFIX),
                dtype,
            )?;
            let tower = if bf16 { tower.into_bf16_products()? } else { tower };
            VisionSlot::Ready(Arc::new(tower))
        };
        let (w, cfg, dev) = (weights, config.clone(), device.clone());
        let text_loader: TextLoader = Box::new(move || {
            let vb = w.var_builder(dtype, &dev, progress);
            load_text(&cfg, &w, vb, quant)
        });
        let mut m =
            Self::assemble(config, processor, generation.eos_token_ids, opts, vision, text_loader, staged, checkpoint)?;
        m.tensors = tensors;
        Ok(m)
    }

    /// From GGUF files (a .gguf file, or a directory holding one) and the vision projector
    /// (`mmproj`, or the `mmproj*.gguf` beside it; without one the model answers text only).
    /// Quantized tensors are used in their stored block type; `opts.quant` quantizes the float ones.
    pub fn open_gguf(model: &Path, mmproj: Option<&Path>, opts: &ModelOptions, staged: bool) -> Result<Self> {
        check_vision_precision(opts)?;
        check_kv_dtype(opts)?;
        let (text, mm) = gguf::find_files(model, mmproj)?;
        let g = Arc::new(GgufModel::open(&text, mm.as_deref())?);
        let floats = opts.quant.map_or_else(|| format!("{:?}", opts.dtype).to_lowercase(), |q| q.name().to_string());
        let how = if opts.device.is_cpu() {
            format!(
                "with quantized blocks mapped from the file (their repacked tiles, if any, counted), float tensors in {floats}"
            )
        } else {
            format!("as stored, float tensors in {floats}")
        };
        fits_memory(&text, g.resident_bytes(opts.dtype, opts.quant, opts.device.is_cpu()), &how, None, opts)?;
        let mut processor = g.processor()?;
        let checkpoint = apply_image_options(&mut processor, opts)?;
        let (dtype, device, quant) = (opts.dtype, opts.device.clone(), opts.quant);
        let eos = g.eos_token_ids();
        let config = g.config.clone();
        let vision = if g.mmproj.is_some() {
            let (gv, dev) = (g.clone(), device.clone());
            let bf16 = opts.vision_bf16;
            VisionSlot::Pending(Box::new(move || {
                let tower = gv.load_vision(dtype, &dev)?;
                if bf16 {
                    tower.into_bf16_products()
                } else {
                    Ok(tower)
                }
            }))
        } else {
            let name =
                text.file_name().map_or_else(|| text.display().to_string(), |n| n.to_string_lossy().into_owned());
            VisionSlot::Absent(
                name,
                "a GGUF text model without its vision projector (no mmproj*.gguf beside it); images and videos need one: pass --mmproj FILE.gguf".into(),
            )
        };
        let dev = device.clone();
        let text_loader: TextLoader = Box::new(move || g.load_text_quantized(dtype, &dev, quant));
        Self::assemble(config, processor, eos, opts, vision, text_loader, staged, checkpoint)
    }

    #[allow(clippy::too_many_arguments)]
    fn assemble(
        config: Qwen3VlConfig,
        processor: Processor,
        eos: Vec<u32>,
        opts: &ModelOptions,
        vision: VisionSlot,
        text: TextLoader,
        staged: bool,
        checkpoint: Checkpoint,
    ) -> Result<Self> {
        let kv_dtype = check_kv_dtype(opts)?;
        let think = crate::reasoning::Markers::from_tokenizer(&processor.tokenizer, "<think>", "</think>");
        // XML (`<function=NAME>`) when the template writes calls so (Qwen3.5's), JSON otherwise.
        let call_format = if processor.template.source_text().contains("<function=") {
            crate::decoding::constraint::CallFormat::Xml
        } else {
            crate::decoding::constraint::CallFormat::Json
        };
        let m = Self {
            think,
            call_format,
            config,
            processor,
            eos,
            device: opts.device.clone(),
            kv_dtype,
            vision: Mutex::new(vision),
            text: OnceLock::new(),
            text_loader: Mutex::new(Some(text)),
            checkpoint,
            tensors: 0,
            draft_vocab: opts.draft_vocab,
            draft_lm_head: OnceLock::new(),
        };
        if !staged {
            if matches!(*m.vision.lock().unwrap_or_else(|p| p.into_inner()), VisionSlot::Pending(_)) {
                m.vision_tower()?;
            }
            m.load_text()?;
        }
        Ok(m)
    }

    pub fn config(&self) -> &Qwen3VlConfig {
        &self.config
    }

    pub fn processor(&self) -> &Processor {
        &self.processor
    }

    /// How videos are counted and sized from now on (the embedding models' official code sizes
    /// them as qwen-vl-utils does).
    pub fn size_videos(&mut self, sizing: super::video_processor::ClipSizing) {
        self.processor.videos.config.sizing = sizing;
    }

    fn vision_tower(&self) -> Result<Arc<VisionTower>> {
        let mut slot = self.vision.lock().unwrap_or_else(|p| p.into_inner());
        let failed = VisionSlot::Absent("model".into(), "the vision tower failed to load".into());
        let tower = match std::mem::replace(&mut *slot, failed) {
            VisionSlot::Ready(t) => t,
            VisionSlot::Pending(load) => Arc::new(load()?),
            VisionSlot::Absent(what, message) => {
                *slot = VisionSlot::Absent(what.clone(), message.clone());
                return Err(Error::Input { what, message });
            }
        };
        *slot = VisionSlot::Ready(tower.clone());
        Ok(tower)
    }

    fn load_text(&self) -> Result<&TextModel> {
        if let Some(t) = self.text.get() {
            return Ok(t);
        }
        let load = self.text_loader.lock().unwrap_or_else(|p| p.into_inner()).take();
        match load {
            Some(load) => {
                let _ = self.text.set(load()?.with_kv_dtype(self.kv_dtype));
                self.text()
            }
            None => self.text(),
        }
    }

    fn text(&self) -> Result<&TextModel> {
        self.text.get().ok_or_else(|| Error::Input {
            what: "model".into(),
            message: "the text decoder is not loaded (finish_loading was not called)".into(),
        })
    }
}

impl Qwen3Vl {
    /// Prompts pooled together: `inputs[i]` is prefilled from `states[i].len()` (empty, or a
    /// prefix it shares with other prompts) to `ends[i]`, all in one forward pass. Returns the
    /// final-normed hidden rows `[inputs, hidden]` (f32) of each `ends[i] - 1` (what an
    /// embedding model pools; `logits` of them, what a reranker scores).
    pub fn prefill_rows(
        &self,
        inputs: &[PoolInput<'_>],
        states: &mut [&mut SeqState],
        ends: &[usize],
    ) -> Result<Tensor> {
        let text = self.text()?;
        let items: Vec<_> = inputs
            .iter()
            .map(|i| {
                let of = |kind: MediaKind| {
                    let parts: Vec<&VisionOutput> =
                        i.media.iter().zip(i.features).filter(|(m, _)| m.kind == kind).map(|(_, f)| f).collect();
                    VisionOutput::concat(&parts)
                };
                let prompt = Prompt { input_ids: i.ids.to_vec(), images: None, videos: None, generated_from: None };
                (prompt, of(MediaKind::Image), of(MediaKind::Video))
            })
            .collect();
        for (s, &end) in states.iter_mut().zip(ends) {
            s.reserve(end);
        }
        let model = super::model::TextSide { cfg: &self.config, text };
        Ok(model.prefill_rows(&items, states, ends)?.to_dtype(DType::F32)?)
    }

    /// f32 logits `[rows, vocab]` of final-normed hidden rows.
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        self.text()?.logits(&hidden.to_dtype(self.text()?.dtype())?)
    }

    /// Prefills `ids[state.len()..end]` with the prompt's media features (`generated_from`: where
    /// generated ids begin, text whatever their value).
    fn prefill_to(
        &self,
        ids: &[u32],
        generated_from: Option<usize>,
        media: &[Media],
        features: &[VisionOutput],
        state: &mut SeqState,
        end: usize,
    ) -> Result<super::PrefillOutput> {
        let text = self.text()?;
        let of = |kind: MediaKind| {
            let parts: Vec<&VisionOutput> =
                media.iter().zip(features).filter(|(m, _)| m.kind == kind).map(|(_, f)| f).collect();
            VisionOutput::concat(&parts)
        };
        let (images, videos) = (of(MediaKind::Image), of(MediaKind::Video));
        let model = super::model::TextSide { cfg: &self.config, text };
        let prompt = Prompt { input_ids: ids.to_vec(), images: None, videos: None, generated_from };
        model.prefill_until(&prompt, images.as_ref(), videos.as_ref(), state, end, &mut |_, _| {})
    }

    /// The text decoder's hidden size (an embedding's dimensions).
    pub fn hidden_size(&self) -> usize {
        self.config.text.hidden_size
    }
}

impl Family for Qwen3Vl {
    fn task(&self) -> Task<'_> {
        Task::Generate(self)
    }

    fn name(&self) -> &'static str {
        match (&self.config.text.moe, &self.config.text.hybrid) {
            (Some(_), Some(_)) => super::config::HYBRID_MOE_MODEL_TYPE,
            (None, Some(_)) => super::config::HYBRID_MODEL_TYPE,
            (Some(_), None) => super::config::MOE_MODEL_TYPE,
            (None, None) => ENTRY.name,
        }
    }

    fn context(&self) -> usize {
        self.config.text.max_position_embeddings
    }

    fn vocab_size(&self) -> usize {
        self.config.text.vocab_size
    }

    fn load_warnings(&self) -> Vec<String> {
        let keys = &self.config.unknown_keys;
        if keys.is_empty() {
            return Vec::new();
        }
        let names = super::config::shown_keys(keys);
        vec![format!("config.json: {} key(s) not understood, ignored: {names}", keys.len())]
    }

    fn tokenizer(&self) -> &tokenizers::Tokenizer {
        &self.processor.tokenizer
    }

    fn prepare(&self, req: &Request, ctx: &MediaContext<'_>) -> Result<Prepared> {
        super::prepare::prepare(&self.processor, &self.config, &self.eos, &self.device, req, ctx)
    }

    fn encode(&self, media: &Media) -> Result<VisionOutput> {
        self.vision_tower()?.forward(&media.input.pixels, &media.input.grids)
    }

    fn load_vision(&self) -> Result<()> {
        self.vision_tower().map(|_| ())
    }

    fn finish_loading(&self) -> Result<()> {
        let mut slot = self.vision.lock().unwrap_or_else(|p| p.into_inner());
        if matches!(*slot, VisionSlot::Ready(_) | VisionSlot::Pending(_)) {
            *slot = VisionSlot::Absent(
                "model".into(),
                "the vision tower was released after the images were encoded".into(),
            );
        }
        drop(slot);
        crate::alloc::give_back();
        self.load_text().map(|_| ())
    }

    fn storage(&self) -> Vec<(String, String, usize)> {
        self.text.get().map(TextModel::storage).unwrap_or_default()
    }

    fn image_sizing(&self, width: usize, height: usize) -> Result<ImageSizing> {
        let of = |p: &super::ImageProcessor| -> Result<Sizing> {
            let (h, w) = p.target_size(height, width)?;
            let unit = p.config.factor() * p.config.factor();
            Ok(Sizing { resized: (h, w), tokens: h * w / unit.max(1) })
        };
        Ok(ImageSizing { ours: of(&self.processor.images)?, checkpoint: of(&self.checkpoint.images)? })
    }

    fn checkpoint_video_sizing(&self, v: &VideoReport) -> Option<Sizing> {
        let p = self.checkpoint.videos.as_ref()?;
        let plan = p.plan(v.info.frames, v.info.fps, v.info.height as usize, v.info.width as usize).ok()?;
        Some(Sizing { resized: plan.resized, tokens: plan.num_tokens(p.config.base.merge_size) })
    }

    fn tensors_to_load(&self) -> usize {
        self.tensors
    }

    /// Qwen3-VL answers in 0..1000 of the original image (Qwen's cookbook scales `bbox_2d / 1000
    /// * width`); grounding wants at least `GROUNDING_MIN_TOKENS` visual tokens.
    fn grounding(&self) -> Option<crate::grounding::Grounding> {
        let c = &self.processor.images.config;
        let unit = c.factor() * c.factor();
        let min_pixels = (GROUNDING_MIN_TOKENS * unit).clamp(c.min_pixels, c.max_pixels);
        Some(crate::grounding::Grounding { coords: crate::grounding::Coords::Relative(1000.0), min_pixels })
    }

    /// `<think>` / `</think>`, single tokens of every Qwen3-VL tokenizer (the Thinking
    /// checkpoints write them; their template opens the block in the generation prompt).
    fn reasoning(&self) -> Option<&crate::reasoning::Markers> {
        self.think.as_ref()
    }

    /// XML (`<function=NAME>`) when the checkpoint's template writes calls so (Qwen3.5's),
    /// JSON otherwise (Qwen3-VL's).
    fn tool_call_format(&self) -> crate::decoding::constraint::CallFormat {
        self.call_format
    }
}

impl Generator for Qwen3Vl {
    fn eos_token_ids(&self) -> &[u32] {
        &self.eos
    }

    fn kv_bytes_per_position(&self) -> usize {
        // Keys and values per layer, in the cache's dtype (known before the decoder loads).
        let c = &self.config.text;
        c.attention_layers() * 2 * c.num_key_value_heads * c.head_dim * self.kv_dtype.size_in_bytes()
    }

    fn fixed_state_bytes(&self) -> usize {
        // Qwen3.5's DeltaNet layers: a window and a state matrix each, whatever the length.
        let c = &self.config.text;
        let linear = c.num_hidden_layers - c.attention_layers();
        c.hybrid.as_ref().map_or(0, |h| linear * h.shape(c.hidden_size).state_bytes())
    }

    fn new_state(&self) -> SeqState {
        super::text::new_state(&self.config.text, self.kv_dtype)
    }

    fn prefill(
        &self,
        ids: &[u32],
        prompt_len: usize,
        media: &[Media],
        features: &[VisionOutput],
        cache: &mut SeqState,
        end: usize,
    ) -> Result<Option<Tensor>> {
        let out = self.prefill_to(ids, Some(prompt_len), media, features, cache, end)?;
        if end < ids.len() {
            return Ok(None);
        }
        Ok(Some(super::model::TextSide { cfg: &self.config, text: self.text()? }.last_logits(&out)?))
    }

    fn decode(&self, tokens: &[u32], caches: &mut [&mut SeqState]) -> Result<Tensor> {
        super::model::TextSide { cfg: &self.config, text: self.text()? }.decode_rows(tokens, caches)
    }

    fn extend(&self, tokens: &[Vec<u32>], caches: &mut [&mut SeqState]) -> Result<Tensor> {
        super::model::TextSide { cfg: &self.config, text: self.text()? }.extend_rows(tokens, caches)
    }

    fn draft_head(&self) -> Option<&dyn crate::family::DraftHead> {
        self.text().ok().filter(|t| t.has_mtp()).map(|_| self as &dyn crate::family::DraftHead)
    }
}

/// Qwen3.5's multi-token-prediction head (`qwen3_vl/text.rs`, `MtpHead`).
impl crate::family::DraftHead for Qwen3Vl {
    fn kv_bytes_per_position(&self) -> usize {
        let c = &self.config.text;
        2 * c.num_key_value_heads * c.head_dim * self.kv_dtype.size_in_bytes()
    }

    fn new_state(&self) -> SeqState {
        SeqState::kv_in(1, self.kv_dtype)
    }

    fn forward(
        &self,
        tokens: &[u32],
        hidden: &Tensor,
        positions: &[[i64; 3]],
        states: &mut [&mut SeqState],
        lens: &[usize],
        picks: &[u32],
    ) -> Result<(Tensor, Tensor)> {
        let text = self.text()?;
        let head = match self.draft_vocab.filter(|&n| n < self.config.text.vocab_size) {
            Some(n) => {
                if self.draft_lm_head.get().is_none() {
                    let _ = self.draft_lm_head.set(text.lm_head_first_rows(n)?);
                }
                self.draft_lm_head.get()
            }
            None => None,
        };
        text.mtp_forward(tokens, hidden, positions, states, lens, picks, head)
    }
}

/// Bytes the weights of a checkpoint hold once loaded as `opts` asks: the text decoder's
/// matrices in `quant` where their rows fill its blocks, else in the compute dtype; the vision
/// tower in its stored dtype (f32 compute keeps a bf16 tower bf16). An estimate: the kernels'
/// repacked copies and the activations come on top.
pub fn resident_bytes(
    cfg: &Qwen3VlConfig,
    weights: &super::Weights,
    dtype: DType,
    quant: Option<vl_nn::QuantType>,
) -> u64 {
    let vision_dtype = if dtype == DType::F32 { weights.vision_float_dtype() } else { dtype };
    let mut total = 0f64;
    for p in super::plan::tensor_plan(cfg) {
        if p.group == super::plan::Group::LmHead && cfg.tie_word_embeddings {
            continue;
        }
        let elems = p.shape.iter().product::<usize>() as f64;
        let cols = *p.shape.last().unwrap_or(&1);
        let per = match (p.group, quant) {
            (super::plan::Group::Vision, _) => vision_dtype.size_in_bytes() as f64,
            (_, Some(q)) if p.shape.len() >= 2 && cols.is_multiple_of(q.block()) => {
                q.ggml().type_size() as f64 / q.block() as f64
            }
            _ => dtype.size_in_bytes() as f64,
        };
        total += elems * per;
    }
    total as u64
}

/// Refuses, before any weight is read, a load whose weights cannot fit the memory this process
/// may still fill (`limits::available_memory`), naming both and what `--quantize q4k` would take.
fn check_memory(cfg: &Qwen3VlConfig, weights: &super::Weights, opts: &ModelOptions) -> Result<()> {
    let need = resident_bytes(cfg, weights, opts.dtype, opts.quant);
    let q4k = resident_bytes(cfg, weights, opts.dtype, Some(vl_nn::QuantType::Q4K));
    let how = opts.quant.map_or_else(|| format!("{:?}", opts.dtype).to_lowercase(), |q| q.name().to_string());
    fits_memory(weights.dir(), need, &format!("as {how}"), Some(q4k), opts)
}

/// Refuses `need` bytes of weights over the memory available; `q4k`: what `--quantize q4k`
/// would need instead (said when smaller).
fn fits_memory(what: &Path, need: u64, how: &str, q4k: Option<u64>, opts: &ModelOptions) -> Result<()> {
    let Some(available) = crate::limits::available_memory() else { return Ok(()) };
    if need <= available {
        return Ok(());
    }
    let size = |b: u64| match b {
        b if b >= 1 << 30 => format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64),
        b => format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64),
    };
    let hint = match q4k {
        Some(q4k) if opts.quant != Some(vl_nn::QuantType::Q4K) && q4k < need => {
            format!("; with --quantize q4k it needs about {}", size(q4k))
        }
        _ => String::new(),
    };
    Err(Error::Limit {
        what: what.display().to_string(),
        message: format!(
            "its weights need about {} loaded {how}, more than the {} of memory available (VL_MEMORY_AVAILABLE overrides what is detected){hint}",
            size(need),
            size(available)
        ),
        kind: crate::limits::LimitKind::Fixed,
    })
}

/// Fewest visual tokens of an image in a grounding request (llama.cpp warns below 1024 for
/// Qwen3-VL grounding, #16842): 1024 tokens of 32x32 pixels, about 1 megapixel.
pub const GROUNDING_MIN_TOKENS: usize = 1024;

/// The text decoder, quantized as `quant` asks, reading weights in the checkpoint's dtype.
fn load_text(
    config: &Qwen3VlConfig,
    weights: &Weights,
    vb: candle_nn::VarBuilder<'static>,
    quant: Option<vl_nn::QuantType>,
) -> Result<TextModel> {
    let quant = quant.map(|qtype| QuantLoad { qtype, read_as: weights.text_float_dtype() });
    TextModel::load_with(&config.text, config.tie_word_embeddings, vb, quant)
}

/// The engine's pixel budgets, video settings and input limits on the checkpoint's processors.
/// Returns the checkpoint's processors with its own pixel budgets (and the engine's sampling).
fn apply_image_options(processor: &mut Processor, opts: &ModelOptions) -> Result<Checkpoint> {
    let checkpoint_videos = VideoOptions { min_pixels: None, max_pixels: None, ..opts.video };
    let checkpoint = Checkpoint {
        images: processor.images.clone(),
        videos: processor.videos.clone().with_options(&checkpoint_videos).ok(),
    };
    let (min, max) = image_budget(&processor.images.config, opts.min_pixels, opts.max_pixels, opts.max_image_tokens)?;
    processor.images = processor.images.clone().with_pixel_budget(min, max)?;
    processor.images.limits = opts.image_limits;
    let mut video = opts.video;
    if video.max_pixels.is_none() {
        let cap = opts.video_pixel_cap.map(|c| c.max(video.min_pixels.unwrap_or(0)));
        video.max_pixels = cap.filter(|&c| c < processor.videos.config.base.max_pixels);
    }
    processor.videos =
        processor.videos.clone().with_options(&video).map_err(|e| e.rename_input(|w| format!("video {w}")))?;
    processor.videos.limits = opts.video_limits;
    Ok(checkpoint)
}

/// The (min, max) pixel budget an engine applies over a checkpoint's preprocessor `config`:
/// explicit `max_pixels` wins; otherwise `max_image_tokens` caps the checkpoint's maximum at
/// `tokens x factor^2` pixels (raised to `min_pixels` when that asks for more), and leaves it
/// alone when the checkpoint's is smaller already. `None` means "the checkpoint's value".
pub fn image_budget(
    config: &super::PreprocessorConfig,
    min_pixels: Option<usize>,
    max_pixels: Option<usize>,
    max_image_tokens: Option<usize>,
) -> Result<(Option<usize>, Option<usize>)> {
    let Some(tokens) = max_image_tokens.filter(|_| max_pixels.is_none()) else {
        return Ok((min_pixels, max_pixels));
    };
    let unit = config.factor() * config.factor();
    let most = super::image_processor::MAX_PIXEL_BUDGET / unit.max(1);
    if tokens == 0 || tokens > most {
        return Err(Error::Input {
            what: "max_image_tokens".into(),
            message: format!("{tokens} is outside 1..={most}"),
        });
    }
    let cap = (tokens * unit).max(min_pixels.unwrap_or(0));
    Ok((min_pixels, (cap < config.max_pixels).then_some(cap)))
}

/// The dtype the KV cache keeps its rows in: `opts.kv_dtype`, else the compute dtype. Another
/// dtype than the compute one only under f32 compute on the CPU (where the decode kernel widens
/// f16 / bf16 rows as it reads them), and only a float one: refused otherwise.
fn check_kv_dtype(opts: &ModelOptions) -> Result<DType> {
    let Some(kv) = opts.kv_dtype.filter(|&d| d != opts.dtype) else { return Ok(opts.dtype) };
    let refuse = |message: String| Err(Error::Input { what: "KV cache dtype".into(), message });
    if !matches!(kv, DType::F32 | DType::F16 | DType::BF16) {
        return refuse(format!("{} is not one of f32, f16, bf16", format!("{kv:?}").to_lowercase()));
    }
    if !opts.device.is_cpu() || opts.dtype != DType::F32 {
        return refuse(format!(
            "{kv:?} needs f32 compute on the CPU (asked: {:?} on {:?}); elsewhere the cache is in the compute dtype",
            opts.dtype, opts.device
        ));
    }
    Ok(kv)
}

/// `opts.vision_bf16` refused up front (before any weight is read) where it cannot run.
fn check_vision_precision(opts: &ModelOptions) -> Result<()> {
    if !opts.vision_bf16 {
        return Ok(());
    }
    let refuse = |message: String| Err(Error::Input { what: "vision precision bf16".into(), message });
    if !opts.device.is_cpu() || opts.dtype != DType::F32 {
        return refuse(format!("needs f32 compute on the CPU (asked: {:?} on {:?})", opts.dtype, opts.device));
    }
    if !vl_nn::bf16::available() {
        return refuse(
            "needs AVX512-BF16 (AMD Zen 4 and later, Intel Cooper Lake) or AMX-BF16 tiles granted by Linux (Intel Xeon since Sapphire Rapids) on x86_64; this CPU or OS has neither"
                .into(),
        );
    }
    Ok(())
}
