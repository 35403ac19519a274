//! A resident engine: loads a model once (through its family, `crate::family`) and answers many
//! requests at once: messages with text, images and videos in, a stream of text out, with the
//! stop reason, token counts and timings.
//! - Continuous batching (`scheduler`): running sequences decode together, one batched step for
//!   all of them; a new request joins between steps, its prompt prefilled in chunks so the
//!   running streams keep flowing; a finished one leaves.
//! - KV memory by need: a sequence's cache grows in blocks as it grows, within one engine-wide
//!   budget (`EngineOptions::kv_cache_bytes`) enforced at admission; a request that cannot fit
//!   now waits, one whose prompt can never fit is refused.
//! - Prefix reuse across conversations (`prefix`): finished sequences' caches stay, least
//!   recently used out first within the budget; a request whose prompt starts with the same
//!   tokens (and, at image placeholders, the same image content) prefills only the rest.
//! - A feature cache keyed by an image's content hash and resized size: a repeated image skips
//!   the vision tower (bounded by bytes). The tower runs for one request at a time, in the
//!   caller's thread, beside the decoding.
//!
//! A callback that returns `false` cancels that request only.

mod prefix;
mod scheduler;
mod stop;

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use candle_core::{DType, Device};
use vl_nn::QuantType;

use crate::cache::ByteLru;
pub use crate::constraint::Constraint;
use crate::constraint::{Compiler, Guide};
use crate::error::{Error, Result};
use crate::family::{Family, Prepared, Source};
use crate::limits::{ImageLimits, LimitKind};
use crate::media::VisionOutput;
use crate::sampling::GenerationOptions;
pub use crate::sampling::TokenLogprob;
pub use crate::tools::ToolCall;
use crate::video::VideoLimits;
use scheduler::{Command, Event, Fork, Job};

/// Sequences decoded together unless told otherwise. On a 2-core CPU decode is bound by reading
/// the weights, so 4 sequences cost little more per step than one.
pub const DEFAULT_PARALLEL: usize = 4;

/// Most answers (`n`) one request may ask for.
pub const MAX_CHOICES: usize = 8;

/// Prompt positions prefilled per scheduler step unless told otherwise.
pub const DEFAULT_PREFILL_CHUNK: usize = 256;

/// The KV budget unless told otherwise: a quarter of the machine's memory (`/proc/meminfo`'s
/// MemTotal), 4 GiB where that cannot be read.
pub fn default_kv_cache_bytes() -> usize {
    let total = std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| {
        m.lines()
            .find(|l| l.starts_with("MemTotal:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kb| kb.parse::<usize>().ok())
            .map(|kb| kb.saturating_mul(1024))
    });
    total.map_or(4 << 30, |t| t / 4)
}

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
    /// Run the vision tower's linears (and, at head dimension 64, its attention products) on bf16
    /// operands with f32 sums (AMX tiles; reduced precision, bound in
    /// docs/parity.md) instead of f32. CPU, f32 compute, AMX-BF16 only: refused elsewhere.
    pub vision_bf16: bool,
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
    pub video: crate::video::VideoOptions,
    /// Cap on a video's pixel budget when `video.max_pixels` is not given (`None`: the
    /// checkpoint's own). Default `DEFAULT_MAX_VIDEO_PIXELS`.
    pub video_pixel_cap: Option<usize>,
    pub video_limits: VideoLimits,
    /// Bytes of vision features kept for repeated images (0 disables the cache).
    pub image_cache_bytes: usize,
    /// Bytes of sampled, preprocessed video pixels kept for repeated videos, so that a video
    /// sent again (`vl chat` resends its history every turn) is not decoded again (0 disables).
    pub clip_cache_bytes: usize,
    /// Keep finished conversations' KV caches for prefix reuse (many conversations, least
    /// recently used out first, within `kv_cache_bytes`).
    pub prefix_cache: bool,
    /// Sequences decoded together (continuous batching); more wait in the queue.
    pub parallel: usize,
    /// Bytes of KV cache the engine may hold, running sequences and kept prefixes together
    /// (`default_kv_cache_bytes`). A request whose prompt cannot fit is refused; one that cannot
    /// fit now waits.
    pub kv_cache_bytes: usize,
    /// Prompt positions prefilled per scheduler step, between decode steps of the running
    /// sequences (a long prompt does not stall their streams).
    pub prefill_chunk: usize,
}

impl Default for EngineOptions {
    fn default() -> Self {
        Self {
            dtype: DType::F32,
            device: Device::Cpu,
            quant: None,
            vision_bf16: false,
            min_pixels: None,
            max_pixels: None,
            max_image_tokens: Some(DEFAULT_MAX_IMAGE_TOKENS),
            image_limits: ImageLimits::default(),
            video: crate::video::VideoOptions::default(),
            video_pixel_cap: Some(DEFAULT_MAX_VIDEO_PIXELS),
            video_limits: VideoLimits::default(),
            image_cache_bytes: 256 << 20,
            clip_cache_bytes: 256 << 20,
            prefix_cache: true,
            parallel: DEFAULT_PARALLEL,
            kv_cache_bytes: default_kv_cache_bytes(),
            prefill_chunk: DEFAULT_PREFILL_CHUNK,
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
        options: crate::video::VideoOptions,
    },
}

/// A video as the engine read it.
#[derive(Debug, Clone)]
pub struct VideoReport {
    pub name: String,
    pub info: crate::video::VideoInfo,
    pub plan: crate::video::VideoPlan,
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
    /// An assistant turn's reasoning (`Completion::reasoning`), given back to the template as
    /// `reasoning_content`.
    pub reasoning: Option<String>,
}

impl ChatMessage {
    pub fn new(role: &str, parts: Vec<Part>) -> Self {
        Self { role: role.into(), parts, tool_calls: vec![], reasoning: None }
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
    /// What the answer must be (a JSON schema, any JSON object, tool calls): the sampler picks
    /// only tokens that keep it valid (`crate::constraint`).
    pub constraint: Option<Constraint>,
    /// A raw prompt, tokenized as it is without the chat template (OpenAI's `/v1/completions`);
    /// `messages` and `tools` must then be empty.
    pub prompt: Option<String>,
    /// Extra variables for the chat template (`chat_template_kwargs`, e.g. `enable_thinking`).
    pub template_kwargs: serde_json::Map<String, serde_json::Value>,
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
    /// The answer's text (with tool calls, the text before the first call; with a reasoning
    /// block, the text after it).
    pub text: String,
    /// The reasoning block's text (`<think>...</think>`, without the markers), when the answer
    /// has one (a thinking checkpoint; `Family::reasoning`).
    pub reasoning: Option<String>,
    /// Function calls the answer made (only when the request offered tools).
    pub tool_calls: Vec<ToolCall>,
    /// Generated ids (an eos id included when it ended the answer).
    pub token_ids: Vec<u32>,
    pub prompt_tokens: usize,
    /// Prompt positions whose KV came from an earlier request (not prefilled again).
    pub cached_tokens: usize,
    pub image_tokens: usize,
    pub video_tokens: usize,
    /// Each video of the request: its source and what sampling and resizing made of it.
    pub videos: Vec<VideoReport>,
    /// Each image of the request: its size as displayed and as the model saw it.
    pub images: Vec<crate::family::ImageReport>,
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
    /// Each answer token's log-probabilities, when `GenerationOptions::logprobs` asked (an
    /// end-of-sequence token that ended the answer is not among them).
    pub logprobs: Vec<TokenLogprob>,
    /// KV cache bytes the sequence held at its end.
    pub kv_cache_bytes: usize,
}

/// Statistics for `/metrics`-style reports.
#[derive(Debug, Clone, Copy, Default)]
pub struct EngineStats {
    /// KV cache bytes held: running sequences and kept prefixes.
    pub kv_cache_bytes: usize,
    /// The engine's KV budget.
    pub kv_budget_bytes: usize,
    /// Positions held by kept prefixes.
    pub cached_positions: usize,
    /// Kept prefixes (finished conversations).
    pub cached_prefixes: usize,
    /// Sequences being prefilled or decoded.
    pub running: usize,
    /// Requests waiting for a slot or for KV memory.
    pub waiting: usize,
    /// Batched decode steps run, and the sequence rows they decoded (rows / steps is the mean
    /// batch).
    pub decode_steps: u64,
    pub decode_rows: u64,
    /// Sequences preempted (their cache dropped, prefilled again later) for KV memory.
    pub preemptions: u64,
    pub image_cache_bytes: usize,
    pub image_cache_entries: usize,
}

/// What the scheduler thread and the callers share.
pub(crate) struct Shared {
    pub family: Box<dyn Family>,
    pub opts: EngineOptions,
    /// Vision features by media key.
    features: Mutex<ByteLru<u64, VisionOutput>>,
    /// One request runs the vision tower at a time.
    vision: Mutex<()>,
    pub stats: Mutex<EngineStats>,
    /// Compiles constraints; built at the first constrained request (about a second).
    compiler: CompilerCell,
    /// Bytes of the longest token's text (computed at the first long request).
    longest_token: std::sync::OnceLock<usize>,
}

pub struct Engine {
    shared: Arc<Shared>,
    tx: Option<mpsc::Sender<Command>>,
    worker: Option<std::thread::JoinHandle<()>>,
    id: String,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Every guarded value is replaced or updated whole, so a poisoned lock's data is consistent.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn stopped() -> Error {
    Error::Input { what: "engine".into(), message: "the engine stopped".into() }
}

impl Engine {
    /// Loads a checkpoint directory (every file checked first, as `vl run` does), both towers.
    pub fn load(dir: &Path, id: &str, opts: EngineOptions) -> Result<Self> {
        Self::open(dir, None, id, opts)
    }

    /// Loads `model`: a checkpoint directory or GGUF files (a .gguf file, or a directory holding
    /// one, and its vision projector: `mmproj`, or the `mmproj*.gguf` beside it), with the family
    /// its files name.
    pub fn open(model: &Path, mmproj: Option<&Path>, id: &str, opts: EngineOptions) -> Result<Self> {
        let family = crate::family::open(&Source { model, mmproj, progress: None }, &opts)?;
        Self::from_family(family, id, opts)
    }

    /// `open` for GGUF files.
    pub fn load_gguf(model: &Path, mmproj: Option<&Path>, id: &str, opts: EngineOptions) -> Result<Self> {
        Self::open(model, mmproj, id, opts)
    }

    /// An engine over a loaded model; starts the scheduler thread.
    pub fn from_family(family: Box<dyn Family>, id: &str, opts: EngineOptions) -> Result<Self> {
        if opts.parallel == 0 || opts.prefill_chunk == 0 {
            return Err(Error::Input {
                what: "engine options".into(),
                message: format!(
                    "parallel ({}) and prefill_chunk ({}) must be at least 1",
                    opts.parallel, opts.prefill_chunk
                ),
            });
        }
        let features = Mutex::new(ByteLru::new(opts.image_cache_bytes));
        let stats = Mutex::new(EngineStats { kv_budget_bytes: opts.kv_cache_bytes, ..Default::default() });
        let compiler = std::sync::OnceLock::new();
        let longest_token = std::sync::OnceLock::new();
        let shared =
            Arc::new(Shared { family, opts, features, vision: Mutex::new(()), stats, compiler, longest_token });
        let (tx, rx) = mpsc::channel();
        let s = shared.clone();
        let worker = std::thread::Builder::new()
            .name("vl-scheduler".into())
            .spawn(move || scheduler::run(&s, rx))
            .map_err(|e| Error::Input { what: "engine".into(), message: format!("cannot start the scheduler: {e}") })?;
        Ok(Self { shared, tx: Some(tx), worker: Some(worker), id: id.to_string() })
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    pub fn family(&self) -> &dyn Family {
        &*self.shared.family
    }

    /// The model's context in tokens.
    pub fn context(&self) -> usize {
        self.shared.family.context()
    }

    pub fn eos_token_ids(&self) -> &[u32] {
        self.shared.family.eos_token_ids()
    }

    pub fn options(&self) -> &EngineOptions {
        &self.shared.opts
    }

    pub fn stats(&self) -> EngineStats {
        let mut s = *lock(&self.shared.stats);
        let f = lock(&self.shared.features);
        s.image_cache_bytes = f.bytes();
        s.image_cache_entries = f.len();
        s
    }

    /// Answers `req`, calling `on_text(piece)` with each new piece of the answer as it is
    /// decoded (returning `false` cancels this request). Safe to call from many threads at once:
    /// their requests decode together.
    pub fn generate(&self, req: &Request, on_text: &mut dyn FnMut(&str) -> bool) -> Result<Completion> {
        self.generate_pieces(req, &mut |piece, _| on_text(piece))
    }

    /// `generate`, each piece with the log-probabilities of its tokens (empty unless the
    /// request's options ask for `logprobs`).
    pub fn generate_pieces(
        &self,
        req: &Request,
        on_text: &mut dyn FnMut(&str, &[TokenLogprob]) -> bool,
    ) -> Result<Completion> {
        let mut all = self.generate_n(req, 1, &mut |_, piece, lp| on_text(piece, lp))?;
        Ok(all.remove(0))
    }

    /// `n` answers to `req` (1..=`MAX_CHOICES`) from one prefill: choice `i` samples with seed
    /// `options.seed + i`. `on_text(choice, piece, logprobs)` with the answers' text (a
    /// reasoning block's text is not passed: it is in `Completion::reasoning`, and `stream`
    /// passes it); returning `false` cancels them all.
    pub fn generate_n(
        &self,
        req: &Request,
        n: usize,
        on_text: &mut dyn FnMut(usize, &str, &[TokenLogprob]) -> bool,
    ) -> Result<Vec<Completion>> {
        self.stream(req, n, &mut |d| d.reasoning || on_text(d.choice, d.text, d.logprobs))
    }

    /// `generate_n`, every piece of every answer passed as a `Delta` (reasoning included, marked
    /// as such); returning `false` cancels them all.
    pub fn stream(&self, req: &Request, n: usize, on: &mut dyn FnMut(&Delta<'_>) -> bool) -> Result<Vec<Completion>> {
        if n == 0 || n > MAX_CHOICES {
            return Err(Error::Input { what: "n".into(), message: format!("{n} is outside 1..={MAX_CHOICES}") });
        }
        let t0 = Instant::now();
        // Cheap checks first: text that cannot fit costs no tokenizing.
        check_text_fits(&*self.shared.family, &self.shared.longest_token, req)?;
        // The constraint compiles first: a bad schema costs no media decoding.
        // Compiled once, its first token mask computed here (bounded), copied per choice.
        let guides = guides(&*self.shared.family, &self.shared.compiler, req, n)?;
        let prepared = self.shared.family.prepare(req)?;
        check_fits(&*self.shared.family, self.shared.opts.kv_cache_bytes, &prepared)?;
        let s = &self.shared;
        let encoded = encode(&*s.family, &prepared, &s.features, &s.vision)?;
        self.run(prepared, encoded, guides, req, on, t0)
    }

    /// Hands a prepared request to the scheduler and relays its stream.
    fn run(
        &self,
        prepared: Prepared,
        encoded: Encoded,
        guides: Vec<Option<Guide>>,
        req: &Request,
        on: &mut dyn FnMut(&Delta<'_>) -> bool,
        t0: Instant,
    ) -> Result<Vec<Completion>> {
        let (events, rx) = mpsc::channel();
        let cancel = Arc::new(AtomicBool::new(false));
        let unread = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let n = guides.len();
        let seed = prepared.options.seed;
        let mut guides = guides.into_iter();
        let guide = guides.next().flatten();
        let forks = guides
            .enumerate()
            .map(|(i, guide)| Fork { choice: i + 1, seed: seed.wrapping_add(i as u64 + 1), guide })
            .collect();
        let job = Job {
            prepared,
            encoded,
            guide,
            choice: 0,
            forks,
            stop: req.stop.clone(),
            tools: !req.tools.is_empty(),
            // A raw prompt's answer is text as written.
            reasoning: req.prompt.is_none(),
            events,
            unread: unread.clone(),
            cancel: cancel.clone(),
            t0,
        };
        self.tx.as_ref().ok_or_else(stopped)?.send(Command::Submit(Box::new(job))).map_err(|_| stopped())?;
        // A caller that unwinds out of `on` (a panic) cancels its request: a paused sequence
        // sends nothing more, so it would never see that nobody reads it.
        struct CancelOnDrop(Arc<AtomicBool>);
        impl Drop for CancelOnDrop {
            fn drop(&mut self) {
                self.0.store(true, Ordering::Relaxed);
            }
        }
        let _cancel_on_drop = CancelOnDrop(cancel.clone());
        let mut done: Vec<Option<Result<Completion>>> = (0..n).map(|_| None).collect();
        let mut left = n;
        while left > 0 {
            match rx.recv() {
                Ok(Event::Text { choice, text, reasoning, logprobs }) => {
                    unread.fetch_sub(1, Ordering::Relaxed);
                    let d = Delta { choice, text: &text, reasoning, logprobs: &logprobs };
                    if !cancel.load(Ordering::Relaxed) && !on(&d) {
                        cancel.store(true, Ordering::Relaxed);
                    }
                }
                Ok(Event::Done(choice, result)) => {
                    if done[choice].replace(result).is_none() {
                        left -= 1;
                    }
                }
                Err(_) => return Err(stopped()),
            }
        }
        done.into_iter().map(|r| r.expect("every choice answered")).collect()
    }

    /// Answers one request from a cold start with the least memory, as `vl run` does: `family`
    /// comes from `family::open_staged` (every file checked, no weight read); the request is
    /// checked and its prompt length counted before any weight is read; the vision tower is
    /// loaded, encodes the media and is released before the text weights are read (the two never
    /// peak together); then the answer comes from the engine's own path.
    pub fn answer_once(
        family: Box<dyn Family>,
        id: &str,
        opts: EngineOptions,
        req: &Request,
        on: &mut dyn FnMut(&Delta<'_>) -> bool,
    ) -> Result<OneShot> {
        check_text_fits(&*family, &std::sync::OnceLock::new(), req)?;
        // The constraint compiles first (a bad schema costs nothing else).
        let guide = guides(&*family, &CompilerCell::new(), req, 1)?.remove(0);
        let t0 = Instant::now();
        let media = req.messages.iter().flat_map(|m| &m.parts).filter(|p| !matches!(p, Part::Text(_))).count();
        if media > 0 {
            crate::progress::report("decoding media", "files", 0, media);
        }
        let prepared = family.prepare(req)?;
        if media > 0 {
            crate::progress::report("decoding media", "files", media, media);
        }
        let media_time = t0.elapsed();
        // Cheap checks first: the prompt's KV cache against the budget, before any weight.
        check_fits(&*family, opts.kv_cache_bytes, &prepared)?;
        let mut encoded = Encoded::default();
        if !prepared.media.is_empty() {
            family.load_vision()?;
            // Every medium once: a repeat within the prompt is a hit.
            encoded = encode(&*family, &prepared, &Mutex::new(ByteLru::new(usize::MAX)), &Mutex::new(()))?;
        }
        let vision_time = encoded.time;
        family.finish_loading()?;
        let load_time = t0.elapsed().saturating_sub(vision_time + media_time);
        let storage = family.storage();
        let opts = EngineOptions { prefix_cache: false, image_cache_bytes: 0, parallel: 1, ..opts };
        let engine = Self::from_family(family, id, opts)?;
        let generate_started = Instant::now();
        let completion = engine.run(prepared, encoded, vec![guide], req, on, generate_started)?.remove(0);
        let checkpoint_videos = completion.videos.iter().map(|v| engine.family().checkpoint_video_sizing(v)).collect();
        Ok(OneShot { completion, load_time, media_time, vision_time, storage, generate_started, checkpoint_videos })
    }
}

/// Bytes a token stands for on average in ordinary text is about 4; past this many per position
/// of the context, a request's text is measured against the vocabulary's longest token.
const TEXT_BYTES_PER_TOKEN_CHECK: usize = 8;

/// Refuses a request whose text (messages and tools) could not fit the context even if every
/// token were the vocabulary's longest, before it is tokenized (a 57 MB message would otherwise
/// be tokenized first).
fn check_text_fits(family: &dyn Family, longest: &std::sync::OnceLock<usize>, req: &Request) -> Result<()> {
    let text: usize = req
        .messages
        .iter()
        .flat_map(|m| &m.parts)
        .map(|p| match p {
            Part::Text(t) => t.len(),
            _ => 0,
        })
        .sum::<usize>()
        + req.tools.iter().map(|t| t.to_string().len()).sum::<usize>()
        + req.prompt.as_ref().map_or(0, String::len);
    let context = family.context();
    if text <= context.saturating_mul(TEXT_BYTES_PER_TOKEN_CHECK) {
        return Ok(());
    }
    let longest = *longest.get_or_init(|| {
        let tok = family.tokenizer();
        (0..tok.get_vocab_size(true) as u32)
            .map(|id| tok.decode(&[id], false).map_or(0, |s| s.len()))
            .max()
            .unwrap_or(1)
            .max(1)
    });
    let most = context.saturating_mul(longest);
    if text > most {
        return Err(Error::Limit {
            what: "prompt".into(),
            message: format!(
                "the request's text is {text} bytes: even at {longest} bytes a token (the vocabulary's longest) it cannot fit the model's context of {context} tokens"
            ),
            kind: LimitKind::Fixed,
        });
    }
    Ok(())
}

type CompilerCell = std::sync::OnceLock<std::result::Result<Arc<Compiler>, String>>;

/// `req`'s constraint compiled for `family`, one guide per answer (`n`; all None without a
/// constraint), each holding its first token mask; the error names the field (`tool_choice` for
/// tool calls, `response_format` otherwise). The compiler is in `cell` (built once).
fn guides(family: &dyn Family, cell: &CompilerCell, req: &Request, n: usize) -> Result<Vec<Option<Guide>>> {
    let Some(c) = &req.constraint else { return Ok((0..n).map(|_| None).collect()) };
    let compiler = cell
        .get_or_init(|| {
            Compiler::new(family.tokenizer(), family.vocab_size(), family.eos_token_ids())
                .map(Arc::new)
                .map_err(|e| e.to_string())
        })
        .clone()
        .map_err(|message| Error::Input { what: "constrained decoding".into(), message })?;
    let what = match c {
        Constraint::ToolCalls { .. } => "tool_choice",
        _ => "response_format",
    };
    Ok(compiler.guides(c, what, n)?.into_iter().map(Some).collect())
}

/// Refuses a prompt whose KV cache alone exceeds `budget` bytes (it could never run).
fn check_fits(family: &dyn Family, budget: usize, p: &Prepared) -> Result<()> {
    let need = vl_nn::kv_cache::blocks_for(p.ids.len() + 1) * family.kv_bytes_per_position();
    if need > budget {
        return Err(Error::Limit {
            what: "prompt".into(),
            message: format!(
                "the prompt's {} tokens need {:.1} MiB of KV cache, more than the engine's budget of {:.1} MiB",
                p.ids.len(),
                need as f64 / 1048576.0,
                budget as f64 / 1048576.0
            ),
            kind: LimitKind::KvCache,
        });
    }
    Ok(())
}

/// Every image and video of the prompt encoded, from `cache` when seen before (a repeat within
/// the prompt included), else through the family's tower, one request at a time (`tower`).
fn encode(
    family: &dyn Family,
    p: &Prepared,
    cache: &Mutex<ByteLru<u64, VisionOutput>>,
    tower: &Mutex<()>,
) -> Result<Encoded> {
    let t = Instant::now();
    let mut e = Encoded { features: Vec::with_capacity(p.media.len()), ..Default::default() };
    for m in &p.media {
        let mut hit = lock(cache).get(&m.key);
        let _tower = hit.is_none().then(|| lock(tower));
        if hit.is_none() {
            // Another request may have encoded it while this one waited for the tower.
            hit = lock(cache).get(&m.key);
        }
        let out = match hit {
            Some(out) => {
                match m.kind {
                    crate::media::MediaKind::Image => e.image_hits += 1,
                    crate::media::MediaKind::Video => e.video_hits += 1,
                }
                out
            }
            None => {
                let out = family.encode(m)?;
                lock(cache).put(m.key, out.clone(), out.bytes());
                out
            }
        };
        e.features.push(out);
    }
    e.time = t.elapsed();
    Ok(e)
}

impl Drop for Engine {
    fn drop(&mut self) {
        // Closing the queue ends the scheduler once it is idle (no caller is waiting: `generate`
        // borrows the engine).
        self.tx.take();
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

/// A request's media features and what encoding them took.
#[derive(Default, Clone)]
pub(crate) struct Encoded {
    pub features: Vec<VisionOutput>,
    pub time: Duration,
    pub image_hits: usize,
    pub video_hits: usize,
}

/// A piece of a streamed answer.
#[derive(Debug, Clone, Copy)]
pub struct Delta<'a> {
    /// Which answer of the request (`n`).
    pub choice: usize,
    pub text: &'a str,
    /// A piece of the reasoning block (`Completion::reasoning`), not of the answer's text.
    pub reasoning: bool,
    /// The log-probabilities of the tokens picked since the last piece (when asked for).
    pub logprobs: &'a [TokenLogprob],
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
    /// When generation (prefill) began; `time_to_first_token` counts from here.
    pub generate_started: Instant,
    /// Each video's sizing under the checkpoint's own budget (`Family::checkpoint_video_sizing`).
    pub checkpoint_videos: Vec<Option<crate::family::Sizing>>,
}
