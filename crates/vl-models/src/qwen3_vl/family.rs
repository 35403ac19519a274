//! Qwen3-VL through the family seam (`crate::family`): loading (checkpoint directories and
//! GGUF pairs, resident or in stages), a request made into prompt tokens and media the way
//! transformers' `Qwen3VLProcessor` does, and the model's prefill and batched decode.

use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};

use candle_core::{DType, Device, Tensor};
use sha2::{Digest, Sha256};

use super::gguf::{self, GgufModel};
use super::plan::VISION_PREFIX;
use super::video_processor::{ProcessedVideo, VideoOptions, VideoPlan, VideoProcessor};
use super::{
    Content, ImageFile, Message, ModelDir, Processor, Prompt, QuantLoad, Qwen3VlConfig, TemplateToolCall, TextModel,
    VisionTower, Weights,
};
use crate::error::{Error, Result};
use crate::family::{
    Family, FamilyEntry, Generator, Identity, ImageSizing, ModelOptions, Prepared, Sizing, Source, Task,
};
use crate::media::{image_key, pixels_key, CachedClip, Media, MediaContext, MediaKind, VisionOutput};
use crate::request::{ImageReport, Part, Request, VideoData, VideoReport};
use crate::sampling::GenerationOptions;
use crate::state::SeqState;
use crate::video::VideoSource;

/// The registry's entry for Qwen3-VL.
pub static ENTRY: FamilyEntry = FamilyEntry {
    name: "qwen3_vl",
    architectures: &["Qwen3VLForConditionalGeneration"],
    model_types: &["qwen3_vl"],
    gguf_architectures: &["qwen3vl"],
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

fn quantize_entry(
    model: &Path,
    recipe: crate::gguf::Recipe,
    out: &Path,
    overwrite: bool,
    progress: &mut dyn FnMut(&str),
) -> Result<crate::gguf::Written> {
    super::gguf_write::save(&ModelDir::open(model)?, recipe, out, overwrite, progress)
}

fn default_quant_entry(model: &Path) -> Result<Option<vl_nn::QuantType>> {
    if gguf::is_gguf(model) {
        return Ok(None);
    }
    Ok(Weights::open(model)?.default_quant())
}

fn open_entry(source: &Source<'_>, opts: &ModelOptions, staged: bool) -> Result<Box<dyn Family>> {
    if gguf::is_gguf(source.model) {
        return Ok(Box::new(Qwen3Vl::open_gguf(source.model, source.mmproj, opts, staged)?));
    }
    if let Some(m) = source.mmproj {
        return Err(Error::Input {
            what: m.display().to_string(),
            message: "--mmproj goes with a GGUF text model, not a checkpoint directory".into(),
        });
    }
    let dir = ModelDir::open(source.model)?;
    Ok(Box::new(Qwen3Vl::from_dir(dir, opts, staged, source.progress.cloned())?))
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
    config: Qwen3VlConfig,
    processor: Processor,
    eos: Vec<u32>,
    device: Device,
    /// The compute dtype (activations and the KV cache).
    dtype: DType,
    vision: Mutex<VisionSlot>,
    text: OnceLock<TextModel>,
    text_loader: Mutex<Option<TextLoader>>,
    /// Sampled, preprocessed videos by `clip_key` (None: disabled).
    /// The checkpoint's own pixel budgets (with the engine's sampling settings), for reports.
    checkpoint: Checkpoint,
    /// Tensors the load reads (0 for GGUF, which reports none).
    tensors: usize,
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
            let (w, cfg, p) = (weights.clone(), config.vision.clone(), progress.clone());
            let dev = device.clone();
            VisionSlot::Pending(Box::new(move || {
                VisionTower::load(&cfg, w.var_builder(dtype, &dev, p).pp(VISION_PREFIX))
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
        let think = crate::reasoning::Markers::from_tokenizer(&processor.tokenizer, "<think>", "</think>");
        let m = Self {
            think,
            config,
            processor,
            eos,
            device: opts.device.clone(),
            dtype: opts.dtype,
            vision: Mutex::new(vision),
            text: OnceLock::new(),
            text_loader: Mutex::new(Some(text)),
            checkpoint,
            tensors: 0,
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
                let _ = self.text.set(load()?);
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

impl Family for Qwen3Vl {
    fn task(&self) -> Task<'_> {
        Task::Generate(self)
    }

    fn name(&self) -> &'static str {
        match self.config.text.moe {
            Some(_) => super::config::MOE_MODEL_TYPE,
            None => ENTRY.name,
        }
    }

    fn context(&self) -> usize {
        self.config.text.max_position_embeddings
    }

    fn vocab_size(&self) -> usize {
        self.config.text.vocab_size
    }

    fn tokenizer(&self) -> &tokenizers::Tokenizer {
        &self.processor.tokenizer
    }

    fn prepare(&self, req: &Request, ctx: &MediaContext<'_>) -> Result<Prepared> {
        prepare(&self.processor, &self.config, &self.eos, &self.device, req, ctx)
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
}

impl Generator for Qwen3Vl {
    fn eos_token_ids(&self) -> &[u32] {
        &self.eos
    }

    fn kv_bytes_per_position(&self) -> usize {
        // Keys and values per layer, in the compute dtype (known before the decoder loads).
        let c = &self.config.text;
        c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * self.dtype.size_in_bytes()
    }

    fn new_state(&self) -> SeqState {
        SeqState::kv(self.config.text.num_hidden_layers)
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
        let text = self.text()?;
        let of = |kind: MediaKind| {
            let parts: Vec<&VisionOutput> =
                media.iter().zip(features).filter(|(m, _)| m.kind == kind).map(|(_, f)| f).collect();
            VisionOutput::concat(&parts)
        };
        let (images, videos) = (of(MediaKind::Image), of(MediaKind::Video));
        let model = super::model::TextSide { cfg: &self.config, text };
        let prompt = Prompt { input_ids: ids.to_vec(), images: None, videos: None, generated_from: Some(prompt_len) };
        let out = model.prefill_until(&prompt, images.as_ref(), videos.as_ref(), cache, end, &mut |_, _| {})?;
        if end < ids.len() {
            return Ok(None);
        }
        Ok(Some(model.last_logits(&out)?))
    }

    fn decode(&self, tokens: &[u32], caches: &mut [&mut SeqState]) -> Result<Tensor> {
        super::model::TextSide { cfg: &self.config, text: self.text()? }.decode_rows(tokens, caches)
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
/// A video of a request: sampled and preprocessed before (from the clip cache), or to be decoded.
/// One per video of a request, consumed at once: the fresh variant's size is no concern.
#[allow(clippy::large_enum_variant)]
enum Clip {
    Cached(ProcessedVideo),
    Fresh { src: VideoSource, proc: VideoProcessor, plan: VideoPlan, key: Option<[u8; 32]> },
}

impl Clip {
    fn plan(&self) -> &VideoPlan {
        match self {
            Clip::Cached(v) => &v.plan,
            Clip::Fresh { plan, .. } => plan,
        }
    }
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

/// The video processor for one video: the engine's, narrowed by the request's options (fewer
/// frames and pixels only; any sampling rate within bounds).
fn video_processor(base: &VideoProcessor, o: &VideoOptions) -> Result<VideoProcessor> {
    let c = &base.config;
    let over = |name: &str, v: usize, most: usize| {
        (v > most).then(|| Error::Input {
            what: format!("video {name}"),
            message: format!("{v} is above the server's {most}"),
        })
    };
    if let Some(e) = o.max_frames.and_then(|v| over("max_frames", v, c.max_frames)) {
        return Err(e);
    }
    if let Some(e) = o.max_pixels.and_then(|v| over("max_pixels", v, c.base.max_pixels)) {
        return Err(e);
    }
    let narrowed = VideoOptions { min_pixels: None, cap_pixels_per_frame: None, ..*o };
    let mut p = base.clone().with_options(&narrowed).map_err(|e| e.rename_input(|w| format!("video {w}")))?;
    p.limits = base.limits;
    Ok(p)
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

/// The image processor for one image: the engine's, narrowed by the request's budget.
fn image_processor(
    base: &super::ImageProcessor,
    min_pixels: Option<usize>,
    max_pixels: Option<usize>,
) -> Result<super::ImageProcessor> {
    let (lo, hi) = (base.config.min_pixels, base.config.max_pixels);
    for (name, v) in [("min_pixels", min_pixels), ("max_pixels", max_pixels)] {
        if let Some(v) = v {
            if v < lo || v > hi {
                return Err(Error::Input {
                    what: name.into(),
                    message: format!("{v} is outside the server's image budget [{lo}, {hi}] pixels"),
                });
            }
        }
    }
    if min_pixels.is_none() && max_pixels.is_none() {
        return Ok(base.clone());
    }
    let mut p = base.clone().with_pixel_budget(min_pixels, max_pixels)?;
    p.limits = base.limits;
    Ok(p)
}

/// A raw prompt (no chat template): its tokens as the tokenizer gives them, no media.
fn raw_prompt(
    processor: &Processor,
    config: &super::Qwen3VlConfig,
    options: GenerationOptions,
    req: &Request,
    text: &str,
) -> Result<Prepared> {
    if !req.messages.is_empty() || !req.tools.is_empty() {
        return Err(Error::Input {
            what: "prompt".into(),
            message: "a raw prompt goes without messages and tools".into(),
        });
    }
    let ids = processor
        .tokenizer
        .encode(text, false)
        .map_err(|e| Error::Input { what: "prompt".into(), message: e.to_string() })?
        .get_ids()
        .to_vec();
    let context = config.text.max_position_embeddings;
    if ids.is_empty() {
        return Err(Error::Input { what: "prompt".into(), message: "no tokens".into() });
    }
    if ids.len() >= context {
        return Err(Error::Limit {
            what: "prompt".into(),
            message: format!("the prompt is {} tokens, longer than the model's context of {context} tokens", ids.len()),
            kind: crate::limits::LimitKind::Context,
        });
    }
    let ident = ids.iter().map(|&t| Identity::text(t)).collect();
    Ok(Prepared {
        options,
        ids,
        ident,
        media: vec![],
        image_tokens: 0,
        video_tokens: 0,
        videos: vec![],
        images: vec![],
    })
}

/// Checks a request and prepares its prompt: options, image headers and budgets, the prompt's
/// length against the context (before any pixel is decoded), then pixels and tokens.
fn prepare(
    processor: &Processor,
    config: &super::Qwen3VlConfig,
    eos: &[u32],
    device: &Device,
    req: &Request,
    ctx: &MediaContext<'_>,
) -> Result<Prepared> {
    // The engine checked the options, the messages and the stop strings (`check_request`).
    let opts = GenerationOptions { eos_token_ids: eos.to_vec(), ..req.options.clone() };
    if let Some(text) = &req.prompt {
        return raw_prompt(processor, config, opts, req, text);
    }
    let mut messages = Vec::with_capacity(req.messages.len());
    let mut files = Vec::new();
    let mut clips: Vec<Clip> = Vec::new();
    let mut reports = Vec::new();
    let mut video_tokens = 0usize;
    let decode_left = || ctx.decode_left();
    for m in &req.messages {
        let mut content = Vec::with_capacity(m.parts.len());
        for p in &m.parts {
            match p {
                Part::Text(t) => content.push(Content::Text { text: t.clone() }),
                Part::Image { data, name, min_pixels, max_pixels } => {
                    let proc = image_processor(&processor.images, *min_pixels, *max_pixels)?;
                    let file = ImageFile::from_bytes(data.clone(), Path::new(name), &proc.limits)?;
                    content.push(Content::Image { image: name.clone() });
                    files.push((file, proc, Sha256::digest(data)));
                }
                Part::Video { source, name, options } => {
                    let mut proc = video_processor(&processor.videos, options)?;
                    proc.limits.max_decode_time = decode_left()?;
                    let key = ctx.clip_key(source, &format!("{:?}", proc.config));
                    let cached = key.and_then(|k| ctx.cached_clip(&k)).and_then(|c| {
                        let video = c.data.downcast_ref::<ProcessedVideo>()?.clone();
                        Some((c.info, video))
                    });
                    let (info, clip) = match cached {
                        Some((info, video)) => (info, Clip::Cached(video)),
                        None => {
                            let src = match source {
                                VideoData::Path(p) => VideoSource::open(p, proc.config.fps, &proc.limits)?,
                                VideoData::Bytes(b) => {
                                    VideoSource::from_bytes(b.clone(), Path::new(name), &proc.limits)?
                                }
                            };
                            let plan = proc.plan_source(&src)?;
                            (src.info().clone(), Clip::Fresh { src, proc, plan, key })
                        }
                    };
                    content.push(Content::Video { video: name.clone() });
                    let plan = clip.plan().clone();
                    let tokens = plan.num_tokens(processor.videos.config.base.merge_size);
                    // Cheap check first: the videos planned so far already overflow the context,
                    // so the others are not probed (a probe lists a frame directory or runs
                    // ffprobe over the whole file).
                    video_tokens += tokens;
                    let context = config.text.max_position_embeddings;
                    if video_tokens >= context {
                        return Err(Error::Limit {
                            what: "prompt".into(),
                            message: format!(
                                "the prompt is at least {video_tokens} tokens from its first {} video(s), longer than the model's context of {context} tokens",
                                reports.len() + 1
                            ),
                            kind: crate::limits::LimitKind::Context,
                        });
                    }
                    let from_cache = matches!(clip, Clip::Cached(_));
                    reports.push(VideoReport { name: name.clone(), info, plan, tokens, from_cache });
                    clips.push(clip);
                }
            }
        }
        let mut msg = Message::new(&m.role, content);
        msg.tool_calls = m
            .tool_calls
            .iter()
            .map(|c| TemplateToolCall::function(&c.name, serde_json::Value::String(c.arguments.clone())))
            .collect();
        msg.reasoning_content = m.reasoning.clone();
        messages.push(msg);
    }
    let tokens: Vec<usize> = files.iter().map(|(f, p, _)| p.tokens_for(f)).collect::<Result<_>>()?;
    let context = config.text.max_position_embeddings;
    let tools = (!req.tools.is_empty()).then_some(req.tools.as_slice());
    let plans: Vec<&VideoPlan> = clips.iter().map(Clip::plan).collect();
    // The template renders once (a template runs in a child process, bounded in time).
    let rendered = processor.render(&messages, tools, &req.template_kwargs)?;
    let prompt_len = processor.rendered_len(&rendered, &tokens, &plans)?;
    if prompt_len >= context {
        let merge = processor.videos.config.base.merge_size;
        let video_tokens: usize = plans.iter().map(|p| p.num_tokens(merge)).sum();
        let videos =
            if plans.is_empty() { String::new() } else { format!(", {video_tokens} from {} video(s)", plans.len()) };
        return Err(Error::Limit {
            what: "prompt".into(),
            message: format!(
                "the prompt is {prompt_len} tokens ({} from {} image(s){videos}), longer than the model's context of {context} tokens",
                tokens.iter().sum::<usize>(),
                tokens.len()
            ),
            kind: crate::limits::LimitKind::Context,
        });
    }
    let processed: Vec<_> = files.iter().map(|(f, p, _)| p.process_opened(f)).collect::<Result<_>>()?;
    let keys: Vec<u64> = files.iter().zip(&processed).map(|((_, _, h), img)| image_key(h, img.resized)).collect();
    let mut videos: Vec<ProcessedVideo> = Vec::with_capacity(clips.len());
    for (clip, report) in clips.into_iter().zip(&reports) {
        videos.push(match clip {
            Clip::Cached(video) => video,
            Clip::Fresh { mut src, proc, plan, key } => {
                src.set_max_decode_time(decode_left()?);
                let video = proc.process_planned(&src, plan)?;
                if let Some(k) = key {
                    let bytes = video.pixels.len() * std::mem::size_of::<f32>();
                    let data = Arc::new(video.clone());
                    ctx.keep_clip(k, CachedClip { info: report.info.clone(), data }, bytes);
                }
                video
            }
        });
    }
    let video_keys: Vec<u64> = videos.iter().map(|v| pixels_key(&v.pixels, v.plan.grid)).collect();
    let ids = processor.rendered_ids(&rendered, &processed, &videos)?;
    let count = |id: u32| ids.iter().filter(|&&t| t == id).count();
    let (image_tokens, video_tokens) = (count(config.image_token_id), count(config.video_token_id));
    // Identities: which image or video each placeholder belongs to, in prompt order (a video's
    // frame pairs are runs of one video, separated by their timestamps).
    let mut ident: Vec<Identity> = Vec::with_capacity(ids.len());
    let mut runs = [(config.image_token_id, &keys, 0usize, false), (config.video_token_id, &video_keys, 0, false)];
    let mut pairs_left = videos.first().map_or(0, |v| v.plan.grid[0]);
    for &t in &ids {
        let mut key = 0;
        for (kind, (id, keys, at, in_run)) in runs.iter_mut().enumerate() {
            if t == *id {
                *in_run = true;
                key = keys.get(*at).copied().unwrap_or(0);
            } else if *in_run {
                *in_run = false;
                if kind == 0 {
                    *at += 1;
                } else {
                    pairs_left -= 1;
                    if pairs_left == 0 {
                        *at += 1;
                        pairs_left = videos.get(*at).map_or(0, |v| v.plan.grid[0]);
                    }
                }
            }
        }
        ident.push(Identity { token: t, media: key });
    }
    let mut media = Vec::with_capacity(processed.len() + videos.len());
    for (img, &key) in processed.iter().zip(&keys) {
        let input = processor.images.batch(std::slice::from_ref(img), device)?;
        media.push(Media { kind: MediaKind::Image, key, input });
    }
    for (video, &key) in videos.iter().zip(&video_keys) {
        let input = processor.videos.batch(std::slice::from_ref(video), device)?;
        media.push(Media { kind: MediaKind::Video, key, input });
    }
    let images = files
        .iter()
        .zip(&processed)
        .map(|((f, p, _), img)| ImageReport {
            name: f.path().display().to_string(),
            width: img.original.1,
            height: img.original.0,
            resized: img.resized,
            tokens: img.num_tokens(p.config.merge_size),
        })
        .collect();
    Ok(Prepared { options: opts, ids, ident, media, image_tokens, video_tokens, videos: reports, images })
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
            "needs AMX-BF16 tiles granted by Linux on x86_64 (Intel Xeon since Sapphire Rapids); this CPU or OS has none"
                .into(),
        );
    }
    Ok(())
}
