//! A resident engine: loads a checkpoint once (both towers) and answers many requests in turn:
//! messages with text, images and videos in, a stream of text out, with the stop reason, token counts
//! and timings. What makes a conversation cheap lives here:
//! - prefix reuse: the KV cache of the last request is kept; a request whose prompt starts with
//!   the same tokens (and, at image placeholders, the same image content) prefills only the rest;
//! - an image cache keyed by the image's content hash and resized size: a repeated image skips
//!   the vision tower (bounded by bytes, least recently used out first);
//! - the KV cache reserved for prompt + max new tokens (no doubling copy while decoding).
//!
//! Requests are served one at a time (the caller queues them); a callback that returns `false`
//! cancels a generation, leaving the engine ready for the next request.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use candle_core::{DType, Device};
use rand::rngs::StdRng;
use rand::SeedableRng;
use sha2::{Digest, Sha256};
use vl_nn::QuantType;

use crate::error::{Error, Result};
use crate::limits::ImageLimits;
use crate::qwen3_vl::gguf::{self, GgufModel};
use crate::qwen3_vl::plan::VISION_PREFIX;
use crate::qwen3_vl::video::{ProcessedVideo, VideoOptions, VideoPlan, VideoProcessor};
use crate::qwen3_vl::weights::LoadProgress;
use crate::qwen3_vl::{
    Content, GenerationOptions, ImageFile, Message, ModelDir, Processor, QuantLoad, Qwen3VlModel, TemplateToolCall,
    TextCache, TextModel, VisionOutput, VisionTower,
};
use crate::sampling::{apply_presence_frequency, check_logits, sample};
pub use crate::tools::ToolCall;
use crate::tools::{split_tool_calls, CallHold};
use crate::video::{VideoLimits, VideoSource};

/// Visual tokens per image an engine allows unless told otherwise: the Qwen team's suggested
/// balance (1280 x 32 x 32 pixels for Qwen3-VL). The checkpoints' own budget (16384 tokens, 16.7 M
/// pixels) turns a 12 MP photo into ~47k patches: hours of vision tower on a CPU.
pub const DEFAULT_MAX_IMAGE_TOKENS: usize = 1280;

/// A video's pixel budget (frames x height x width over the sampled clip) an engine allows
/// unless told otherwise: 2560 visual tokens (frame pairs of 32x32-pixel tokens), about a 10 s
/// clip at 2 frames a second at 512x512. The checkpoints' own (25 M pixels, ~12k tokens) takes
/// many minutes of vision tower and prefill on a CPU.
pub const DEFAULT_MAX_VIDEO_PIXELS: usize = 2560 * 2 * 32 * 32;

/// How an engine loads and what it bounds.
#[derive(Debug, Clone)]
pub struct EngineOptions {
    pub dtype: DType,
    pub device: Device,
    pub quant: Option<QuantType>,
    /// Server-wide image budget (defaults from preprocessor_config.json); a request may ask for
    /// less, never more.
    pub min_pixels: Option<usize>,
    pub max_pixels: Option<usize>,
    /// Cap on visual tokens per image when `max_pixels` is not given (`None`: the checkpoint's
    /// own budget). Default `DEFAULT_MAX_IMAGE_TOKENS`. See `image_budget`.
    pub max_image_tokens: Option<usize>,
    pub image_limits: ImageLimits,
    /// Server-wide video settings over the checkpoint's video processor (a request may ask for
    /// fewer frames or pixels, never more). `max_pixels` given here wins over `video_pixel_cap`.
    pub video: VideoOptions,
    /// Cap on a video's pixel budget when `video.max_pixels` is not given (`None`: the
    /// checkpoint's own). Default `DEFAULT_MAX_VIDEO_PIXELS`.
    pub video_pixel_cap: Option<usize>,
    pub video_limits: VideoLimits,
    /// Bytes of vision features kept for repeated images (0 disables the cache).
    pub image_cache_bytes: usize,
    /// Bytes of sampled, preprocessed video pixels kept for repeated videos, so that a video
    /// sent again (`vl chat` resends its history every turn) is not decoded again (0 disables).
    pub clip_cache_bytes: usize,
    /// Keep the last request's KV cache for prefix reuse.
    pub prefix_cache: bool,
}

impl Default for EngineOptions {
    fn default() -> Self {
        Self {
            dtype: DType::F32,
            device: Device::Cpu,
            quant: None,
            min_pixels: None,
            max_pixels: None,
            max_image_tokens: Some(DEFAULT_MAX_IMAGE_TOKENS),
            image_limits: ImageLimits::default(),
            video: VideoOptions::default(),
            video_pixel_cap: Some(DEFAULT_MAX_VIDEO_PIXELS),
            video_limits: VideoLimits::default(),
            image_cache_bytes: 256 << 20,
            clip_cache_bytes: 256 << 20,
            prefix_cache: true,
        }
    }
}

/// One part of a request message.
#[derive(Debug, Clone)]
pub enum Part {
    Text(String),
    /// Encoded image bytes (PNG, JPEG, WebP, GIF, BMP); `name` stands for it in errors. A
    /// per-image pixel budget may narrow the engine's.
    Image {
        data: Vec<u8>,
        name: String,
        min_pixels: Option<usize>,
        max_pixels: Option<usize>,
    },
    /// A video: a file (decoded by ffmpeg; animated GIF/PNG/WebP in-process), a directory of
    /// frames, or encoded bytes; `name` stands for it in errors. `options` may narrow the
    /// engine's video settings (fewer frames or pixels, another sampling rate).
    Video {
        source: VideoData,
        name: String,
        options: VideoOptions,
    },
}

/// A video as the engine read it.
#[derive(Debug, Clone)]
pub struct VideoReport {
    pub name: String,
    pub info: crate::video::VideoInfo,
    pub plan: VideoPlan,
    /// Video pad tokens (without the timestamp text and frame markers).
    pub tokens: usize,
    /// The frames came from the engine's clip cache: the same file (path, size, modification
    /// time) or bytes with the same settings were read before, so nothing was decoded.
    pub from_cache: bool,
}

/// Where a video part's data is.
#[derive(Debug, Clone)]
pub enum VideoData {
    /// A file or a directory of frames on this machine.
    Path(std::path::PathBuf),
    /// Encoded bytes (e.g. a data URL's).
    Bytes(Vec<u8>),
}

#[derive(Debug, Clone)]
pub struct ChatMessage {
    pub role: String,
    pub parts: Vec<Part>,
    /// An assistant turn's function calls (given back with the tools' answers in `tool`
    /// messages).
    pub tool_calls: Vec<ToolCall>,
}

impl ChatMessage {
    pub fn new(role: &str, parts: Vec<Part>) -> Self {
        Self { role: role.into(), parts, tool_calls: vec![] }
    }
    pub fn text(role: &str, text: &str) -> Self {
        Self::new(role, vec![Part::Text(text.into())])
    }
}

#[derive(Debug, Clone, Default)]
pub struct Request {
    pub messages: Vec<ChatMessage>,
    pub options: GenerationOptions,
    /// Generation stops before any of these strings would be emitted (the string is not part
    /// of the answer).
    pub stop: Vec<String>,
    /// Function definitions the model may call (OpenAI's `tools`: `{"type": "function",
    /// "function": {"name", "description", "parameters"}}`), rendered by the chat template.
    /// With tools, an answer's `<tool_call>` blocks become `Completion::tool_calls` and are not
    /// streamed as text.
    pub tools: Vec<serde_json::Value>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// An end-of-sequence token or a stop string.
    Stop,
    /// `max_new_tokens` reached.
    Length,
    /// The model's context is full.
    ContextFull,
    /// The callback asked to stop (e.g. the client went away).
    Cancelled,
    /// The answer is function calls (`Completion::tool_calls`).
    ToolCalls,
}

impl Finish {
    /// The OpenAI `finish_reason`.
    pub fn openai(self) -> &'static str {
        match self {
            Finish::Stop | Finish::Cancelled => "stop",
            Finish::Length | Finish::ContextFull => "length",
            Finish::ToolCalls => "tool_calls",
        }
    }
}

#[derive(Debug, Clone)]
pub struct Completion {
    /// The answer's text (with tool calls, the text before the first call).
    pub text: String,
    /// Function calls the answer made (only when the request offered tools).
    pub tool_calls: Vec<ToolCall>,
    /// Generated ids (an eos id included when it ended the answer).
    pub token_ids: Vec<u32>,
    pub prompt_tokens: usize,
    /// Prompt positions whose KV came from the previous request (not prefilled again).
    pub cached_tokens: usize,
    pub image_tokens: usize,
    pub video_tokens: usize,
    /// Each video of the request: its source and what sampling and resizing made of it.
    pub videos: Vec<VideoReport>,
    /// Images whose features came from the feature cache.
    pub image_cache_hits: usize,
    /// Videos whose features came from the feature cache (keyed by the preprocessed pixels).
    pub video_cache_hits: usize,
    pub finish: Finish,
    pub vision_time: Duration,
    pub prefill_time: Duration,
    pub decode_time: Duration,
    pub time_to_first_token: Duration,
    /// f32 logits that chose the first generated token.
    pub first_logits: Vec<f32>,
}

/// What the KV cache holds: per position the token id and, at image placeholders, the image's
/// content key (0 elsewhere).
type Identity = (u32, u64);

/// Values by key, least recently used out first past `limit` bytes (values larger than the limit
/// are not kept). The feature cache and the clip cache.
struct ByteLru<K, V> {
    limit: usize,
    bytes: usize,
    tick: u64,
    entries: HashMap<K, (V, usize, u64)>,
}

impl<K: std::hash::Hash + Eq + Copy, V: Clone> ByteLru<K, V> {
    fn new(limit: usize) -> Self {
        Self { limit, bytes: 0, tick: 0, entries: HashMap::new() }
    }

    fn get(&mut self, key: &K) -> Option<V> {
        self.tick += 1;
        let tick = self.tick;
        self.entries.get_mut(key).map(|e| {
            e.2 = tick;
            e.0.clone()
        })
    }

    fn put(&mut self, key: K, value: V, size: usize) {
        if size > self.limit {
            return;
        }
        if let Some(e) = self.entries.remove(&key) {
            self.bytes -= e.1;
        }
        while self.bytes + size > self.limit {
            let Some((&old, _)) = self.entries.iter().min_by_key(|(_, e)| e.2) else { break };
            if let Some(e) = self.entries.remove(&old) {
                self.bytes -= e.1;
            }
        }
        self.tick += 1;
        self.bytes += size;
        self.entries.insert(key, (value, size, self.tick));
    }
}

/// Vision features by `image_key` / `video_key`.
type ImageCache = ByteLru<u64, VisionOutput>;

fn feature_bytes(out: &VisionOutput) -> usize {
    out.merged.iter().chain(out.deepstack.iter().flatten()).map(|t| t.elem_count() * t.dtype().size_in_bytes()).sum()
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

#[derive(Clone)]
struct CachedClip {
    info: crate::video::VideoInfo,
    video: ProcessedVideo,
}

/// Sampled, preprocessed videos by `clip_key`, bounded by their pixels' bytes.
type ClipCache = ByteLru<[u8; 32], CachedClip>;

fn lock_clips(c: &Mutex<ClipCache>) -> std::sync::MutexGuard<'_, ClipCache> {
    // Entries are inserted whole, so a poisoned lock's map is still consistent.
    c.lock().unwrap_or_else(|p| p.into_inner())
}

/// What identifies a video's sampled frames: a regular file's canonical path, size and
/// modification time, or the bytes' SHA-256; and the processor's settings. None for frame
/// directories (a frame can change without the directory's time changing) and unreadable files.
fn clip_key(source: &VideoData, proc: &VideoProcessor) -> Option<[u8; 32]> {
    let mut h = Sha256::new();
    match source {
        VideoData::Path(p) => {
            let meta = std::fs::metadata(p).ok().filter(|m| m.is_file())?;
            let since = meta.modified().ok()?.duration_since(std::time::UNIX_EPOCH).ok()?;
            h.update(b"file\0");
            h.update(std::fs::canonicalize(p).ok()?.as_os_str().as_encoded_bytes());
            h.update(meta.len().to_le_bytes());
            h.update(since.as_nanos().to_le_bytes());
        }
        VideoData::Bytes(b) => {
            h.update(b"bytes\0");
            h.update(b);
        }
    }
    h.update(format!("{:?}", proc.config).as_bytes());
    Some(h.finalize().into())
}

struct State {
    cache: TextCache,
    cached: Vec<Identity>,
    images: ImageCache,
}

pub struct Engine {
    model: Qwen3VlModel,
    processor: Processor,
    eos: Vec<u32>,
    id: String,
    opts: EngineOptions,
    state: Mutex<State>,
    clips: Mutex<ClipCache>,
}

/// Statistics for `/metrics`-style reports.
#[derive(Debug, Clone, Copy, Default)]
pub struct EngineStats {
    pub kv_cache_bytes: usize,
    pub cached_positions: usize,
    pub image_cache_bytes: usize,
    pub image_cache_entries: usize,
}

impl Engine {
    /// Checks the model directory (as `vl run` does), then loads both towers once.
    pub fn load(dir: &Path, id: &str, opts: EngineOptions) -> Result<Self> {
        let ModelDir { config, weights, mut processor, generation, .. } = ModelDir::open(dir)?;
        apply_image_options(&mut processor, &opts)?;
        let vb = weights.var_builder(opts.dtype, &opts.device, None);
        // Resident for every request: a bf16/f16 checkpoint's vision weights stay in that dtype
        // and are upcast block by block when computing in f32 (exact; half the memory).
        let stored = if opts.dtype == DType::F32 { weights.vision_float_dtype() } else { opts.dtype };
        let vision = VisionTower::load_stored(
            &config.vision,
            weights.var_builder(stored, &opts.device, None).pp(VISION_PREFIX),
            opts.dtype,
        )?;
        let text = load_text(&config, &weights, vb, &opts)?;
        drop(weights);
        let model = Qwen3VlModel::from_parts(config, Some(vision), text);
        let images = ImageCache::new(opts.image_cache_bytes);
        Ok(Self::assemble(model, processor, generation.eos_token_ids, id, opts, images))
    }

    /// Loads `model`: a checkpoint directory (`load`) or GGUF files (`load_gguf`).
    pub fn open(model: &Path, mmproj: Option<&Path>, id: &str, opts: EngineOptions) -> Result<Self> {
        if gguf::is_gguf(model) {
            Self::load_gguf(model, mmproj, id, opts)
        } else if let Some(m) = mmproj {
            Err(Error::Input {
                what: m.display().to_string(),
                message: "--mmproj goes with a GGUF text model, not a checkpoint directory".into(),
            })
        } else {
            Self::load(model, id, opts)
        }
    }

    /// Loads a GGUF text model (a .gguf file, or a directory holding one) and its vision projector
    /// (`mmproj`, or the `mmproj*.gguf` beside it; without one the engine answers text only).
    /// Quantized tensors are used in their stored block type; `opts.quant` quantizes the float ones.
    pub fn load_gguf(model: &Path, mmproj: Option<&Path>, id: &str, opts: EngineOptions) -> Result<Self> {
        let (text, mm) = gguf::find_files(model, mmproj)?;
        let g = GgufModel::open(&text, mm.as_deref())?;
        let mut processor = g.processor()?;
        apply_image_options(&mut processor, &opts)?;
        let vision = g.mmproj.as_ref().map(|_| g.load_vision(opts.dtype, &opts.device)).transpose()?;
        let text = g.load_text_quantized(opts.dtype, &opts.device, opts.quant)?;
        let eos = g.eos_token_ids();
        let model = Qwen3VlModel::from_parts(g.config.clone(), vision, text);
        let images = ImageCache::new(opts.image_cache_bytes);
        Ok(Self::assemble(model, processor, eos, id, opts, images))
    }

    /// `answer_once` for GGUF files: the same sequence (the vision tower from the mmproj encodes
    /// the images and is released before the text model is read; the text weights are used as
    /// stored, so the load is a read, not a conversion).
    pub fn answer_once_gguf(
        model: &Path,
        mmproj: Option<&Path>,
        id: &str,
        opts: EngineOptions,
        req: &Request,
        on_text: &mut dyn FnMut(&str) -> bool,
    ) -> Result<OneShot> {
        let t0 = Instant::now();
        let (text, mm) = gguf::find_files(model, mmproj)?;
        let g = GgufModel::open(&text, mm.as_deref())?;
        let processor = g.processor()?;
        let parts =
            OneShotParts { config: g.config.clone(), processor, eos: g.eos_token_ids(), id, opts: opts.clone(), t0 };
        Self::answer_once_with(
            parts,
            req,
            || g.load_vision(opts.dtype, &opts.device),
            || g.load_text_quantized(opts.dtype, &opts.device, opts.quant),
            on_text,
        )
    }

    fn assemble(
        model: Qwen3VlModel,
        processor: Processor,
        eos: Vec<u32>,
        id: &str,
        opts: EngineOptions,
        images: ImageCache,
    ) -> Self {
        let cache = model.new_cache();
        let state = Mutex::new(State { cache, cached: Vec::new(), images });
        let clips = Mutex::new(ClipCache::new(opts.clip_cache_bytes));
        Self { model, processor, eos, id: id.to_string(), opts, state, clips }
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    pub fn model(&self) -> &Qwen3VlModel {
        &self.model
    }

    pub fn processor(&self) -> &Processor {
        &self.processor
    }

    /// The model's context in tokens.
    pub fn context(&self) -> usize {
        self.model.config().text.max_position_embeddings
    }

    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos
    }

    pub fn stats(&self) -> EngineStats {
        let s = self.lock();
        EngineStats {
            kv_cache_bytes: s.cache.bytes(),
            cached_positions: s.cached.len(),
            image_cache_bytes: s.images.bytes,
            image_cache_entries: s.images.entries.len(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic inside a generation cannot leave a half-written cache in use: the state is
        // reset below on every error, so a poisoned lock's data is still consistent.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Answers `req`, calling `on_text(piece)` with each new piece of the answer as it is
    /// decoded (returning `false` cancels).
    pub fn generate(&self, req: &Request, on_text: &mut dyn FnMut(&str) -> bool) -> Result<Completion> {
        let t0 = Instant::now();
        // A disabled clip cache (0 bytes) is not consulted, so no video is hashed for it.
        let clips = (self.opts.clip_cache_bytes > 0).then_some(&self.clips);
        let (opts, prepared) = prepare(&self.processor, self.model.config(), &self.eos, &self.opts.device, req, clips)?;
        self.generate_prepared(&prepared, &opts, req, on_text, t0)
    }

    fn generate_prepared(
        &self,
        p: &Prepared,
        opts: &GenerationOptions,
        req: &Request,
        on_text: &mut dyn FnMut(&str) -> bool,
        t0: Instant,
    ) -> Result<Completion> {
        let mut state = self.lock();
        let result = self.generate_locked(&mut state, p, opts, req, on_text, t0);
        if result.is_err() {
            state.cache.reset();
            state.cached.clear();
        }
        result.map(|mut c| {
            c.image_tokens = p.image_tokens;
            c.video_tokens = p.video_tokens;
            c.videos = p.reports.clone();
            c
        })
    }

    /// Answers one request from a cold start with the least memory, as `vl run` does: the
    /// request is checked and its prompt length counted from the image headers before any
    /// weight is read; the vision tower is loaded, encodes the images and is released before the
    /// text weights are read (the two never peak together); the encoded images enter the image
    /// cache, so the answer comes from `generate`'s own path. `model_dir` is the checked
    /// directory (`ModelDir::open`); `progress(key)` is called per tensor loaded.
    pub fn answer_once(
        model_dir: ModelDir,
        id: &str,
        opts: EngineOptions,
        req: &Request,
        progress: Option<LoadProgress>,
        on_text: &mut dyn FnMut(&str) -> bool,
    ) -> Result<OneShot> {
        let t0 = Instant::now();
        let ModelDir { config, weights, processor, generation, .. } = model_dir;
        let vb = weights.var_builder(opts.dtype, &opts.device, progress);
        let tvb = vb.clone();
        Self::answer_once_with(
            OneShotParts {
                config: config.clone(),
                processor,
                eos: generation.eos_token_ids,
                id,
                opts: opts.clone(),
                t0,
            },
            req,
            || VisionTower::load(&config.vision, vb.pp(VISION_PREFIX)),
            || {
                let text = load_text(&config, &weights, tvb, &opts);
                // The weights are built: unmap the checkpoint.
                drop(weights);
                text
            },
            on_text,
        )
    }

    /// The one-shot sequence over any weight source: check the request, load the vision tower
    /// and encode the images, release the tower, load the text decoder, answer.
    fn answer_once_with(
        parts: OneShotParts<'_>,
        req: &Request,
        load_vision: impl FnOnce() -> Result<VisionTower>,
        load_text: impl FnOnce() -> Result<TextModel>,
        on_text: &mut dyn FnMut(&str) -> bool,
    ) -> Result<OneShot> {
        let OneShotParts { config, mut processor, eos, id, opts, t0 } = parts;
        apply_image_options(&mut processor, &opts)?;
        let t_media = Instant::now();
        let (gen_opts, prepared) = prepare(&processor, &config, &eos, &opts.device, req, None)?;
        let media_time = t_media.elapsed();
        let mut images = ImageCache::new(usize::MAX);
        let mut vision_time = Duration::ZERO;
        if !prepared.processed.is_empty() || !prepared.videos.is_empty() {
            let tower = load_vision()?;
            let t = Instant::now();
            for (img, &key) in prepared.processed.iter().zip(&prepared.keys) {
                if images.entries.contains_key(&key) {
                    continue;
                }
                let input = processor.images.batch(std::slice::from_ref(img), &opts.device)?;
                let out = tower.forward(&input.pixels, &input.grids)?;
                images.put(key, out.clone(), feature_bytes(&out));
            }
            for (video, &key) in prepared.videos.iter().zip(&prepared.video_keys) {
                if images.entries.contains_key(&key) {
                    continue;
                }
                let input = processor.videos.batch(std::slice::from_ref(video), &opts.device)?;
                let out = tower.forward(&input.pixels, &input.grids)?;
                images.put(key, out.clone(), feature_bytes(&out));
            }
            vision_time = t.elapsed();
        }
        let text = load_text()?;
        let storage = text.storage();
        let model = Qwen3VlModel::from_parts(config, None, text);
        let load_time = t0.elapsed().saturating_sub(vision_time + media_time);
        let engine = Self::assemble(model, processor, eos, id, opts, images);
        let generate_started = Instant::now();
        let completion = engine.generate_prepared(&prepared, &gen_opts, req, on_text, generate_started)?;
        let kv_cache_bytes = engine.stats().kv_cache_bytes;
        Ok(OneShot { completion, load_time, media_time, vision_time, storage, kv_cache_bytes, generate_started })
    }

    fn generate_locked(
        &self,
        state: &mut State,
        p: &Prepared,
        opts: &GenerationOptions,
        req: &Request,
        on_text: &mut dyn FnMut(&str) -> bool,
        t0: Instant,
    ) -> Result<Completion> {
        let (prompt, ident) = (&p.prompt, &p.ident[..]);
        // Vision: each image and video once, from the cache when seen before.
        let tv = Instant::now();
        let (mut hits, mut video_hits) = (0, 0);
        let mut encode =
            |input: Result<crate::qwen3_vl::VisionInput>, key: u64, hits: &mut usize| -> Result<VisionOutput> {
                if let Some(out) = state.images.get(&key) {
                    *hits += 1;
                    return Ok(out);
                }
                let out = self.model.encode_vision(&input?)?;
                state.images.put(key, out.clone(), feature_bytes(&out));
                Ok(out)
            };
        let dev = &self.opts.device;
        let mut image_parts = Vec::with_capacity(p.processed.len());
        for (img, &key) in p.processed.iter().zip(&p.keys) {
            image_parts.push(encode(self.processor.images.batch(std::slice::from_ref(img), dev), key, &mut hits)?);
        }
        let mut video_parts = Vec::with_capacity(p.videos.len());
        for (video, &key) in p.videos.iter().zip(&p.video_keys) {
            let input = self.processor.videos.batch(std::slice::from_ref(video), dev);
            video_parts.push(encode(input, key, &mut video_hits)?);
        }
        let (vision, videos) = (concat_outputs(&image_parts), concat_outputs(&video_parts));
        let vision_time = tv.elapsed();

        // Prefix reuse: the longest common prefix, never all of the prompt (the last position's
        // logits are needed), never ending inside an image's placeholder run.
        let n = prompt.input_ids.len();
        let mut common = 0;
        if self.opts.prefix_cache {
            common = state.cached.iter().zip(ident).take_while(|(a, b)| a == b).count().min(n - 1);
            while common > 0 && ident[common].1 != 0 && ident[common - 1] == ident[common] {
                common -= 1;
            }
        }
        if common == 0 {
            state.cache.reset();
        } else {
            state.cache.truncate(common);
        }
        state.cached.truncate(common);
        let budget = opts.max_new_tokens.min(self.context().saturating_sub(n));
        state.cache.reserve(n + budget);

        let tp = Instant::now();
        let pre =
            self.model.prefill_from(prompt, vision.as_ref(), videos.as_ref(), &mut state.cache, &mut |_, _| {})?;
        state.cached = ident.to_vec();
        let mut logits = self.model.last_logits(&pre)?;
        let first_logits = logits.to_vec1::<f32>()?;
        let prefill_time = tp.elapsed();

        let td = Instant::now();
        let mut rng = StdRng::seed_from_u64(opts.seed);
        let mut seen = prompt.input_ids.clone();
        let mut tokens: Vec<u32> = Vec::new();
        let mut stream = self.processor.stream_decoder();
        let mut out = StopFilter::new(&req.stop);
        let mut hold = (!req.tools.is_empty()).then(CallHold::default);
        let mut finish = if budget < opts.max_new_tokens { Finish::ContextFull } else { Finish::Length };
        let mut ttft = None;
        for step in 0..budget {
            let mut l = if step == 0 { first_logits.clone() } else { logits.to_vec1::<f32>()? };
            check_logits(&l, step)?;
            apply_presence_frequency(&mut l, &tokens, opts);
            let next = sample(&l, &seen, opts, &mut rng);
            ttft.get_or_insert_with(|| t0.elapsed());
            tokens.push(next);
            seen.push(next);
            if opts.eos_token_ids.contains(&next) {
                finish = Finish::Stop;
                break;
            }
            if let Some(piece) = stream.push(next)? {
                let (mut emit, stopped) = out.push(&piece);
                if let Some(h) = &mut hold {
                    emit = h.push(&emit);
                }
                if !emit.is_empty() && !on_text(&emit) {
                    finish = Finish::Cancelled;
                    break;
                }
                if stopped {
                    finish = Finish::Stop;
                    break;
                }
            }
            if step + 1 == budget {
                break;
            }
            logits = self.model.decode_step(next, &pre, step, &mut state.cache)?;
            state.cached.push((next, 0));
        }
        let mut tail = String::new();
        if finish != Finish::Cancelled && !out.stopped {
            if let Some(rest) = stream.finish()? {
                tail.push_str(&out.push(&rest).0);
            }
            tail.push_str(&out.flush());
        }
        let mut text = out.text;
        let mut tool_calls = vec![];
        if let Some(h) = &mut hold {
            tail = h.push(&tail);
            match split_tool_calls(&text) {
                Some((content, calls)) if finish != Finish::Cancelled => {
                    text = content;
                    tool_calls = calls;
                    finish = Finish::ToolCalls;
                }
                // Not a call after all: what was held back is text.
                _ => tail.push_str(&h.take()),
            }
        }
        if !tail.is_empty() && finish != Finish::Cancelled {
            on_text(&tail);
        }
        Ok(Completion {
            text,
            tool_calls,
            token_ids: tokens,
            prompt_tokens: n,
            cached_tokens: common,
            image_tokens: 0,
            video_tokens: 0,
            videos: vec![],
            image_cache_hits: hits,
            video_cache_hits: video_hits,
            finish,
            vision_time,
            prefill_time,
            decode_time: td.elapsed(),
            time_to_first_token: ttft.unwrap_or_default(),
            first_logits,
        })
    }
}

/// The vision outputs of several inputs as one (rows in input order); `None` for none.
fn concat_outputs(parts: &[VisionOutput]) -> Option<VisionOutput> {
    (!parts.is_empty()).then(|| {
        let levels = parts.iter().map(|p| p.deepstack.len()).min().unwrap_or(0);
        VisionOutput {
            merged: parts.iter().flat_map(|p| p.merged.iter().cloned()).collect(),
            deepstack: (0..levels)
                .map(|l| parts.iter().flat_map(|p| p.deepstack[l].iter().cloned()).collect())
                .collect(),
            grids: parts.iter().flat_map(|p| p.grids.iter().copied()).collect(),
        }
    })
}

/// What the one-shot path needs besides the weights.
struct OneShotParts<'a> {
    config: crate::qwen3_vl::Qwen3VlConfig,
    processor: Processor,
    eos: Vec<u32>,
    id: &'a str,
    opts: EngineOptions,
    t0: Instant,
}

/// What `Engine::answer_once` did, for reports.
#[derive(Debug, Clone)]
pub struct OneShot {
    pub completion: Completion,
    /// Checking the directory and loading the weights (vision tower and text decoder), without
    /// the media preparation and the vision encoding.
    pub load_time: Duration,
    /// Reading, decoding and preprocessing the request's images and videos (video probing and
    /// frame decoding included).
    pub media_time: Duration,
    /// Encoding the request's images.
    pub vision_time: Duration,
    /// (group, storage, bytes) of the text decoder's weights.
    pub storage: Vec<(String, String, usize)>,
    pub kv_cache_bytes: usize,
    /// When generation (prefill) began; `time_to_first_token` counts from here.
    pub generate_started: Instant,
}

/// A request checked, its images read and resized, its prompt tokenized.
struct Prepared {
    prompt: crate::qwen3_vl::Prompt,
    ident: Vec<Identity>,
    processed: Vec<crate::qwen3_vl::ProcessedImage>,
    keys: Vec<u64>,
    image_tokens: usize,
    videos: Vec<ProcessedVideo>,
    video_keys: Vec<u64>,
    video_tokens: usize,
    reports: Vec<VideoReport>,
}

/// The engine's pixel budgets, video settings and input limits on the checkpoint's processors.
fn apply_image_options(processor: &mut Processor, opts: &EngineOptions) -> Result<()> {
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
    Ok(())
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
    config: &crate::qwen3_vl::PreprocessorConfig,
    min_pixels: Option<usize>,
    max_pixels: Option<usize>,
    max_image_tokens: Option<usize>,
) -> Result<(Option<usize>, Option<usize>)> {
    let Some(tokens) = max_image_tokens.filter(|_| max_pixels.is_none()) else {
        return Ok((min_pixels, max_pixels));
    };
    let unit = config.factor() * config.factor();
    let most = crate::qwen3_vl::processor::MAX_PIXEL_BUDGET / unit.max(1);
    if tokens == 0 || tokens > most {
        return Err(Error::Input {
            what: "max_image_tokens".into(),
            message: format!("{tokens} is outside 1..={most}"),
        });
    }
    let cap = (tokens * unit).max(min_pixels.unwrap_or(0));
    Ok((min_pixels, (cap < config.max_pixels).then_some(cap)))
}

/// The text decoder, quantized as `opts` asks, reading weights in the checkpoint's dtype.
fn load_text(
    config: &crate::qwen3_vl::Qwen3VlConfig,
    weights: &crate::qwen3_vl::Weights,
    vb: candle_nn::VarBuilder<'static>,
    opts: &EngineOptions,
) -> Result<TextModel> {
    let quant = opts.quant.map(|qtype| QuantLoad { qtype, read_as: weights.text_float_dtype() });
    TextModel::load_with(&config.text, config.tie_word_embeddings, vb, quant)
}

/// A preprocessed video's cache key: the hash of its patch rows and grid.
fn video_key(v: &ProcessedVideo) -> u64 {
    let mut h = Sha256::new();
    for chunk in v.pixels.chunks(1 << 14) {
        h.update(chunk.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>());
    }
    for g in v.plan.grid {
        h.update((g as u64).to_le_bytes());
    }
    let digest = h.finalize();
    let mut k = [0u8; 8];
    k.copy_from_slice(&digest[..8]);
    u64::from_le_bytes(k) | 1
}

/// An image's cache key: its content hash and its resized size.
fn image_key(hash: &[u8], resized: (usize, usize)) -> u64 {
    let mut k = [0u8; 8];
    k.copy_from_slice(&hash[..8]);
    u64::from_le_bytes(k) ^ ((resized.0 as u64) << 32 | resized.1 as u64).rotate_left(17) | 1
}

/// The image processor for one image: the engine's, narrowed by the request's budget.
fn image_processor(
    base: &crate::qwen3_vl::ImageProcessor,
    min_pixels: Option<usize>,
    max_pixels: Option<usize>,
) -> Result<crate::qwen3_vl::ImageProcessor> {
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

/// Checks a request and prepares its prompt: options, image headers and budgets, the prompt's
/// length against the context (before any pixel is decoded), then pixels and tokens.
fn prepare(
    processor: &Processor,
    config: &crate::qwen3_vl::Qwen3VlConfig,
    eos: &[u32],
    device: &Device,
    req: &Request,
    clip_cache: Option<&Mutex<ClipCache>>,
) -> Result<(GenerationOptions, Prepared)> {
    let opts = GenerationOptions { eos_token_ids: eos.to_vec(), ..req.options.clone() };
    opts.validate()?;
    if req.messages.is_empty() {
        return Err(Error::Input { what: "messages".into(), message: "no messages".into() });
    }
    if let Some(s) = req.stop.iter().find(|s| s.is_empty()) {
        return Err(Error::Input { what: "stop".into(), message: format!("{s:?}: stop strings must not be empty") });
    }
    let mut messages = Vec::with_capacity(req.messages.len());
    let mut files = Vec::new();
    let mut clips: Vec<Clip> = Vec::new();
    let mut reports = Vec::new();
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
                    let proc = video_processor(&processor.videos, options)?;
                    let key = clip_cache.and_then(|_| clip_key(source, &proc));
                    let cached = key.and_then(|k| clip_cache.and_then(|c| lock_clips(c).get(&k)));
                    let (info, clip) = match cached {
                        Some(c) => (c.info, Clip::Cached(c.video)),
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
        messages.push(msg);
    }
    let tokens: Vec<usize> = files.iter().map(|(f, p, _)| p.tokens_for(f)).collect::<Result<_>>()?;
    let context = config.text.max_position_embeddings;
    let tools = (!req.tools.is_empty()).then_some(req.tools.as_slice());
    let plans: Vec<&VideoPlan> = clips.iter().map(Clip::plan).collect();
    let prompt_len = processor.prompt_len_media(&messages, tools, &tokens, &plans)?;
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
            kind: crate::limits::LimitKind::Fixed,
        });
    }
    let processed: Vec<_> = files.iter().map(|(f, p, _)| p.process_opened(f)).collect::<Result<_>>()?;
    let keys: Vec<u64> = files.iter().zip(&processed).map(|((_, _, h), img)| image_key(h, img.resized)).collect();
    let mut videos: Vec<ProcessedVideo> = Vec::with_capacity(clips.len());
    for (clip, report) in clips.into_iter().zip(&reports) {
        videos.push(match clip {
            Clip::Cached(video) => video,
            Clip::Fresh { src, proc, plan, key } => {
                let video = proc.process_planned(&src, plan)?;
                if let (Some(k), Some(c)) = (key, clip_cache) {
                    let bytes = video.pixels.len() * std::mem::size_of::<f32>();
                    lock_clips(c).put(k, CachedClip { info: report.info.clone(), video: video.clone() }, bytes);
                }
                video
            }
        });
    }
    let video_keys: Vec<u64> = videos.iter().map(video_key).collect();
    let prompt = processor.prepare_media(&messages, tools, &processed, &videos, device)?;
    let count = |id: u32| prompt.input_ids.iter().filter(|&&t| t == id).count();
    let (image_tokens, video_tokens) = (count(config.image_token_id), count(config.video_token_id));
    // Identities: which image or video each placeholder belongs to, in prompt order (a video's
    // frame pairs are runs of one video, separated by their timestamps).
    let mut ident: Vec<Identity> = Vec::with_capacity(prompt.input_ids.len());
    let mut runs = [(config.image_token_id, &keys, 0usize, false), (config.video_token_id, &video_keys, 0, false)];
    let mut pairs_left = videos.first().map_or(0, |v| v.plan.grid[0]);
    for &t in &prompt.input_ids {
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
        ident.push((t, key));
    }
    Ok((opts, Prepared { prompt, ident, processed, keys, image_tokens, videos, video_keys, video_tokens, reports }))
}

/// Holds back text that may be the start of a stop string; cuts the answer at a stop string.
struct StopFilter<'a> {
    stops: &'a [String],
    /// Everything emitted so far.
    text: String,
    pending: String,
    stopped: bool,
}

impl<'a> StopFilter<'a> {
    fn new(stops: &'a [String]) -> Self {
        Self { stops, text: String::new(), pending: String::new(), stopped: false }
    }

    /// Adds a decoded piece; returns the text safe to emit and whether a stop string was hit.
    fn push(&mut self, piece: &str) -> (String, bool) {
        if self.stopped {
            return (String::new(), true);
        }
        self.pending.push_str(piece);
        if let Some(at) = self.stops.iter().filter_map(|s| self.pending.find(s.as_str())).min() {
            let emit = self.pending[..at].to_string();
            self.text.push_str(&emit);
            self.pending.clear();
            self.stopped = true;
            return (emit, true);
        }
        // Keep the longest tail that is a proper prefix of some stop string.
        let mut keep = 0;
        for s in self.stops {
            for (i, _) in s.char_indices().skip(1) {
                if self.pending.ends_with(&s[..i]) {
                    keep = keep.max(i);
                }
            }
        }
        let cut = self.pending.len() - keep;
        let emit = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        self.text.push_str(&emit);
        (emit, false)
    }

    fn flush(&mut self) -> String {
        let rest = std::mem::take(&mut self.pending);
        self.text.push_str(&rest);
        rest
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_strings_cut_the_answer_and_hold_back_partial_matches() {
        let stops = vec!["END".to_string(), "\n\n".to_string()];
        let mut f = StopFilter::new(&stops);
        assert_eq!(f.push("Hello E"), ("Hello ".to_string(), false));
        assert_eq!(f.push("N"), (String::new(), false));
        assert_eq!(f.push("Dless"), (String::new(), true));
        assert_eq!(f.text, "Hello ");
        let mut f = StopFilter::new(&stops);
        assert_eq!(f.push("a\n"), ("a".to_string(), false));
        assert_eq!(f.push("b"), ("\nb".to_string(), false));
        assert_eq!(f.flush(), "");
        assert_eq!(f.text, "a\nb");
        // No stops: everything passes at once.
        let none: Vec<String> = vec![];
        let mut f = StopFilter::new(&none);
        assert_eq!(f.push("xyz"), ("xyz".to_string(), false));
        // A multi-byte stop string never splits a character.
        let uni = vec!["é!".to_string()];
        let mut f = StopFilter::new(&uni);
        assert_eq!(f.push("caf é"), ("caf ".to_string(), false));
        assert_eq!(f.push("!"), (String::new(), true));
    }
}
