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
//! - Speculative decoding (`speculative`): drafted tokens (n-gram lookup, a draft model loaded
//!   beside the model: `draft`) verified in one forward pass, the answer unchanged.
//!
//! A callback that returns `false` cancels that request only.

mod admission;
mod draft;
mod head;
mod pool;
mod prefix;
mod scheduler;
mod sequence;
mod stop;

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use crate::cache::ByteLru;
use crate::constraint::Guide;
use crate::error::{Error, Result};
use crate::family::{Family, Generator, Pooled, Prepared, Source, Task};
pub use crate::family::{ModelOptions, DEFAULT_MAX_IMAGE_TOKENS, DEFAULT_MAX_VIDEO_PIXELS};
use crate::media::{ClipCache, MediaContext, VisionOutput};
pub use crate::request::{
    ChatMessage, Completion, Constraint, Delta, Finish, ImageReport, Part, Request, StepReport, TokenLogprob, ToolCall,
    VideoData, VideoReport,
};
pub use crate::vectors::{normalized, truncated};
use admission::{check_fits, check_request, check_text_fits, generator, guides, CompilerCell};
pub use draft::check_pair as check_draft_pair;
pub use prefix::MESSAGE_SNAPSHOT_MIN;
use sequence::{Command, Event, Fork, Job};

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

/// How an engine loads its model and schedules its requests.
#[derive(Debug, Clone)]
pub struct EngineOptions {
    /// What the family sees: how the model loads and the media budget.
    pub model: ModelOptions,
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
            model: ModelOptions::default(),
            image_cache_bytes: 256 << 20,
            clip_cache_bytes: 256 << 20,
            prefix_cache: true,
            parallel: DEFAULT_PARALLEL,
            kv_cache_bytes: default_kv_cache_bytes(),
            prefill_chunk: DEFAULT_PREFILL_CHUNK,
        }
    }
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
    /// Of the answers ended: tokens drafted for verification (`speculative`), drafted tokens
    /// kept, and tokens a constraint forced (written without sampling).
    pub draft_tokens: u64,
    pub accepted_draft_tokens: u64,
    pub forced_tokens: u64,
    pub image_cache_bytes: usize,
    pub image_cache_entries: usize,
}

/// What the scheduler thread and the callers share.
pub(crate) struct Shared {
    pub family: Box<dyn Family>,
    /// The draft model requests with `speculative: draft` draft with.
    draft: Option<draft::Draft>,
    pub opts: EngineOptions,
    /// Vision features by media key.
    features: Mutex<ByteLru<u64, VisionOutput>>,
    /// Preprocessed videos by source and settings (`MediaContext::clip_key`).
    clips: Option<Mutex<ClipCache>>,
    /// One request runs the vision tower at a time.
    vision: Mutex<()>,
    pub stats: Mutex<EngineStats>,
    /// Compiles constraints; built at the first constrained request (about a second).
    compiler: CompilerCell,
    /// Each token's text (`admission::token_texts`, read at the first request that needs it:
    /// a long one, or one with DRY), and DRY's default breakers as tokens.
    token_texts: std::sync::OnceLock<Vec<String>>,
    default_breakers: std::sync::OnceLock<Arc<crate::decoding::dry::Breakers>>,
}

pub struct Engine {
    shared: Arc<Shared>,
    tx: Option<mpsc::Sender<Command>>,
    worker: Option<std::thread::JoinHandle<()>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Every guarded value is replaced or updated whole, so a poisoned lock's data is consistent.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn stopped() -> Error {
    Error::Internal { message: "the engine stopped".into() }
}

impl Engine {
    /// Loads a checkpoint directory (every file checked first, as `vl run` does), both towers.
    pub fn load(dir: &Path, opts: EngineOptions) -> Result<Self> {
        Self::open(dir, None, opts)
    }

    /// A builder for the common case: the model, then what to change of the defaults.
    pub fn builder(model: impl Into<std::path::PathBuf>) -> EngineBuilder {
        EngineBuilder { model: model.into(), mmproj: None, draft: None, opts: EngineOptions::default() }
    }

    /// Loads `model`: a checkpoint directory or GGUF files (a .gguf file, or a directory holding
    /// one, and its vision projector: `mmproj`, or the `mmproj*.gguf` beside it), with the family
    /// its files name.
    pub fn open(model: &Path, mmproj: Option<&Path>, opts: EngineOptions) -> Result<Self> {
        Self::open_with_draft(model, mmproj, None, opts)
    }

    /// `open`, with a draft model (`Method::Draft`): a loaded checkpoint of the same tokenizer,
    /// usually a smaller one of the same family (`check_draft_pair`).
    pub fn open_with_draft(
        model: &Path,
        mmproj: Option<&Path>,
        draft: Option<Box<dyn Family>>,
        opts: EngineOptions,
    ) -> Result<Self> {
        let family = crate::registry::open(&Source { model, mmproj, progress: None }, &opts.model)?;
        Self::from_families(family, draft, opts)
    }

    /// An engine over a loaded model; starts the scheduler thread.
    pub fn from_family(family: Box<dyn Family>, opts: EngineOptions) -> Result<Self> {
        Self::from_families(family, None, opts)
    }

    /// An engine over a loaded model and, optionally, the draft model its requests with
    /// `speculative: draft` draft with (refused when the two do not pair: `check_draft_pair`).
    pub fn from_families(family: Box<dyn Family>, draft: Option<Box<dyn Family>>, opts: EngineOptions) -> Result<Self> {
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
        let clips = (opts.clip_cache_bytes > 0).then(|| Mutex::new(ClipCache::new(opts.clip_cache_bytes)));
        let draft = draft.map(|d| draft::Draft::new(&*family, d, opts.image_cache_bytes)).transpose()?;
        let shared = Arc::new(Shared {
            family,
            draft,
            opts,
            features,
            clips,
            vision: Mutex::new(()),
            stats,
            compiler,
            token_texts: Default::default(),
            default_breakers: Default::default(),
        });
        let (tx, rx) = mpsc::channel();
        let s = shared.clone();
        let worker = std::thread::Builder::new()
            .name("vl-scheduler".into())
            .spawn(move || scheduler::run(&s, rx))
            .map_err(|e| Error::Internal { message: format!("cannot start the scheduler: {e}") })?;
        Ok(Self { shared, tx: Some(tx), worker: Some(worker) })
    }

    pub fn family(&self) -> &dyn Family {
        &*self.shared.family
    }

    /// The draft model, when one was loaded.
    pub fn draft_family(&self) -> Option<&dyn Family> {
        self.shared.draft.as_ref().map(|d| &*d.family)
    }

    /// Whether the model carries a draft head of its own (`speculative: mtp`: Qwen3.5's
    /// multi-token prediction, loaded from its `mtp.*` tensors).
    pub fn has_draft_head(&self) -> bool {
        matches!(self.shared.family.task(), Task::Generate(g) if g.draft_head().is_some())
    }

    /// The model's context in tokens.
    pub fn context(&self) -> usize {
        self.shared.family.context()
    }

    /// The ids that end an answer (none for a model that pools).
    pub fn eos_token_ids(&self) -> &[u32] {
        match self.shared.family.task() {
            Task::Generate(g) => g.eos_token_ids(),
            Task::Pool(_) => &[],
        }
    }

    /// The model's generating half (None for a model that pools).
    pub fn generator(&self) -> Option<&dyn Generator> {
        match self.shared.family.task() {
            Task::Generate(g) => Some(g),
            Task::Pool(_) => None,
        }
    }

    /// What each pooled row is, for a model that pools (None for one that generates).
    pub fn pooled(&self) -> Option<Pooled> {
        match self.shared.family.task() {
            Task::Pool(p) => Some(p.pooled()),
            Task::Generate(_) => None,
        }
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
        let generator = generator(&*self.shared.family)?;
        check_request(req)?;
        // Cheap checks first: text that cannot fit costs no tokenizing.
        check_text_fits(&*self.shared.family, &self.shared.token_texts, req)?;
        // The constraint compiles first: a bad schema costs no media decoding.
        // Compiled once, its first token mask computed here (bounded), copied per choice.
        let guides = guides(&*self.shared.family, generator, &self.shared.compiler, req, n)?;
        let s = &self.shared;
        let draft = drafter(s.draft.as_ref(), req)?;
        if req.options.speculative.method == crate::speculative::Method::Mtp && generator.draft_head().is_none() {
            return Err(scheduler::no_head());
        }
        let prepared = s.family.prepare(req, &self.media_context())?;
        check_fits(generator, s.opts.kv_cache_bytes, &prepared)?;
        let mut encoded = encode(&*s.family, &prepared, &s.features, &s.vision)?;
        if let Some(d) = draft {
            encoded.draft = Some(encode(&*d.family, &prepared, &d.features, &s.vision)?.features);
        }
        self.run(prepared, encoded, guides, req, on, t0)
    }

    /// Pools each request's prompt into one row (an embedding model's vector, a reranker's
    /// score: `pooled`), in order. The prompts are prepared and their media encoded here (the
    /// feature cache serves repeats), then pooled by the scheduler in batches with other
    /// callers' prompts. An error names the request it is about (`inputs[i]`).
    pub fn pool(&self, reqs: &[Request]) -> Result<Vec<PoolOutput>> {
        if let Task::Generate(_) = self.shared.family.task() {
            return Err(Error::Input {
                what: "model".into(),
                message: format!(
                    "{} generates text and does not pool: load an embedding or reranker checkpoint",
                    self.shared.family.name()
                ),
            });
        }
        let at = |i: usize| move |e: Error| e.rename_input(|w| format!("inputs[{i}]: {w}"));
        let mut jobs = Vec::with_capacity(reqs.len());
        for (i, req) in reqs.iter().enumerate() {
            check_text_fits(&*self.shared.family, &self.shared.token_texts, req).map_err(at(i))?;
            // Fields about an answer are refused, not ignored: a pooling model writes none.
            let answer_field = if req.constraint.is_some() {
                Some("constraint")
            } else if !req.stop.is_empty() || req.include_stop {
                Some("stop")
            } else {
                None
            };
            if let Some(what) = answer_field {
                return Err(at(i)(Error::Input {
                    what: what.into(),
                    message: "a pooling model writes no answer to constrain or stop".into(),
                }));
            }
            check_request(req).map_err(at(i))?;
            let prepared = self.shared.family.prepare(req, &self.media_context()).map_err(at(i))?;
            let s = &self.shared;
            let encoded = encode(&*s.family, &prepared, &s.features, &s.vision).map_err(at(i))?;
            jobs.push((prepared, encoded));
        }
        let (tx, rx) = mpsc::channel();
        let job = sequence::PoolJob { inputs: jobs, reply: tx };
        self.tx.as_ref().ok_or_else(stopped)?.send(Command::Pool(Box::new(job))).map_err(|_| stopped())?;
        rx.recv().map_err(|_| stopped())?
    }

    /// The prompt tokens `req` would take (its template rendered, its media sized; images and
    /// videos are read and probed, not encoded), with the checks a request gets before any cost.
    pub fn count_tokens(&self, req: &Request) -> Result<usize> {
        check_text_fits(&*self.shared.family, &self.shared.token_texts, req)?;
        check_request(req)?;
        Ok(self.shared.family.prepare(req, &self.media_context())?.ids.len())
    }

    /// A request's media budget: the decode time the engine allows, and its clip cache.
    fn media_context(&self) -> MediaContext<'_> {
        MediaContext::new(self.shared.opts.model.video_limits.max_decode_time, self.shared.clips.as_ref())
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
        let dry = dry_breakers(&self.shared, &prepared.options);
        let job = Job {
            prepared,
            encoded,
            guide,
            dry,
            choice: 0,
            forks,
            stop: req.stop.clone(),
            include_stop: req.include_stop,
            tools: req.tools.clone(),
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
    ///
    /// A `draft` model (loaded whole) drafts for a request with `speculative: draft`; it encodes
    /// the media after the model's tower is released.
    pub fn answer_once(
        family: Box<dyn Family>,
        draft: Option<Box<dyn Family>>,
        opts: EngineOptions,
        req: &Request,
        on: &mut dyn FnMut(&Delta<'_>) -> bool,
    ) -> Result<OneShot> {
        let generator = generator(&*family)?;
        let draft = draft.map(|d| draft::Draft::new(&*family, d, 0)).transpose()?;
        let drafts = drafter(draft.as_ref(), req)?.is_some();
        check_text_fits(&*family, &std::sync::OnceLock::new(), req)?;
        // The constraint compiles first (a bad schema costs nothing else).
        let guide = guides(&*family, generator, &CompilerCell::new(), req, 1)?.remove(0);
        let t0 = Instant::now();
        let media = req.messages.iter().flat_map(|m| &m.parts).filter(|p| !matches!(p, Part::Text(_))).count();
        if media > 0 {
            crate::progress::report("decoding media", "files", 0, media);
        }
        check_request(req)?;
        let ctx = MediaContext::new(opts.model.video_limits.max_decode_time, None);
        let prepared = family.prepare(req, &ctx)?;
        if media > 0 {
            crate::progress::report("decoding media", "files", media, media);
        }
        let media_time = t0.elapsed();
        // Cheap checks first: the prompt's KV cache against the budget, before any weight.
        check_fits(generator, opts.kv_cache_bytes, &prepared)?;
        let mut encoded = Encoded::default();
        if !prepared.media.is_empty() {
            family.load_vision()?;
            // Every medium once: a repeat within the prompt is a hit.
            encoded = encode(&*family, &prepared, &Mutex::new(ByteLru::new(usize::MAX)), &Mutex::new(()))?;
        }
        family.finish_loading()?;
        if let Some(d) = draft.as_ref().filter(|_| drafts) {
            let features = encode(&*d.family, &prepared, &Mutex::new(ByteLru::new(usize::MAX)), &Mutex::new(()))?;
            encoded.time += features.time;
            encoded.draft = Some(features.features);
        }
        let vision_time = encoded.time;
        let load_time = t0.elapsed().saturating_sub(vision_time + media_time);
        let storage = family.storage();
        let opts = EngineOptions { prefix_cache: false, image_cache_bytes: 0, parallel: 1, ..opts };
        let engine = Self::from_families(family, draft.map(|d| d.family), opts)?;
        let generate_started = Instant::now();
        let completion = engine.run(prepared, encoded, vec![guide], req, on, generate_started)?.remove(0);
        let checkpoint_videos = completion.videos.iter().map(|v| engine.family().checkpoint_video_sizing(v)).collect();
        Ok(OneShot { completion, load_time, media_time, vision_time, storage, generate_started, checkpoint_videos })
    }
}

/// The draft model `req` drafts with (`speculative: draft`); refused, naming the field, when the
/// engine holds none; None for any other method.
fn drafter<'a>(draft: Option<&'a draft::Draft>, req: &Request) -> Result<Option<&'a draft::Draft>> {
    if req.options.speculative.method != crate::speculative::Method::Draft {
        return Ok(None);
    }
    match draft {
        Some(d) => Ok(Some(d)),
        None => Err(Error::Input {
            what: "speculative".into(),
            message: "`draft` needs a draft model, and this engine loaded none (`--draft-model`)".into(),
        }),
    }
}

/// DRY's sequence breakers as tokens when the request's options turn DRY on; the default list's
/// built once per engine (a scan of the vocabulary).
fn dry_breakers(s: &Shared, o: &crate::GenerationOptions) -> Option<Arc<crate::decoding::dry::Breakers>> {
    use crate::decoding::dry::{Breakers, DEFAULT_BREAKERS};
    if !o.dry().is_on() {
        return None;
    }
    let tok = s.family.tokenizer();
    let texts = s.token_texts.get_or_init(|| admission::token_texts(&*s.family));
    let tokenize = |t: &str| tok.encode(t, false).map(|e| e.get_ids().to_vec()).unwrap_or_default();
    let build = || Arc::new(Breakers::new(texts, &tokenize, &o.dry_sequence_breakers));
    if o.dry_sequence_breakers.iter().map(String::as_str).eq(DEFAULT_BREAKERS) {
        Some(s.default_breakers.get_or_init(build).clone())
    } else {
        Some(build())
    }
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

/// `Engine::builder`: a model path (a checkpoint directory, a GGUF file or a directory holding
/// one), then what to change of `EngineOptions::default()`.
pub struct EngineBuilder {
    model: std::path::PathBuf,
    mmproj: Option<std::path::PathBuf>,
    draft: Option<std::path::PathBuf>,
    opts: EngineOptions,
}

impl EngineBuilder {
    /// The vision projector of a GGUF text model (else the `mmproj*.gguf` beside it).
    pub fn mmproj(mut self, path: impl Into<std::path::PathBuf>) -> Self {
        self.mmproj = Some(path.into());
        self
    }
    /// Quantize the text decoder's weights at load (`Q4K` is what `vl` loads on a CPU by default).
    pub fn quantize(mut self, q: vl_nn::QuantType) -> Self {
        self.opts.model.quant = Some(q);
        self
    }
    /// Where the model runs (`candle_core::Device::Cpu`, or a CUDA / Metal device in builds with
    /// those features) and its compute dtype (f32 on a CPU, bf16 on a GPU).
    pub fn device(mut self, device: candle_core::Device) -> Self {
        self.opts.model.dtype = vl_nn::dispatch::default_dtype(vl_nn::dispatch::DeviceKind::of(&device));
        self.opts.model.device = device;
        self
    }
    /// Every option at once (replaces what the other calls set, except the paths).
    pub fn options(mut self, opts: EngineOptions) -> Self {
        self.opts = opts;
        self
    }
    /// A draft model for `speculative: draft` (a checkpoint of the same tokenizer, loaded with
    /// the same options; a GGUF one finds its mmproj beside it).
    pub fn draft_model(mut self, path: impl Into<std::path::PathBuf>) -> Self {
        self.draft = Some(path.into());
        self
    }
    /// Loads the model (every file checked first) and starts the engine.
    pub fn build(self) -> Result<Engine> {
        let draft = match &self.draft {
            Some(p) => {
                Some(crate::registry::open(&Source { model: p, mmproj: None, progress: None }, &self.opts.model)?)
            }
            None => None,
        };
        Engine::open_with_draft(&self.model, self.mmproj.as_deref(), draft, self.opts)
    }
}

/// One pooled prompt: its row and its token counts.
#[derive(Debug, Clone)]
pub struct PoolOutput {
    /// The embedding (`Pooled::Embedding`) or the one score (`Pooled::Score`).
    pub values: Vec<f32>,
    pub prompt_tokens: usize,
    /// Prompt positions served from a prefix the engine kept (prefilled once for the prompts
    /// that share it: an instruction, a query).
    pub cached_tokens: usize,
    pub image_tokens: usize,
    pub video_tokens: usize,
}

/// A request's media features and what encoding them took.
#[derive(Default, Clone)]
pub(crate) struct Encoded {
    pub features: Vec<VisionOutput>,
    /// The draft model's features of the same media, when the request drafts with it (empty
    /// without media).
    pub draft: Option<Vec<VisionOutput>>,
    pub time: Duration,
    pub image_hits: usize,
    pub video_hits: usize,
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
