//! What the server holds: `ServerConfig` (what it is told besides its engine, with `vl serve`'s
//! defaults), `MediaDir`, `ConnectionLimits` (the default connection count from the descriptor
//! limit), and `App`, the state every route and worker shares. Below every route: it imports
//! only `job` and `metrics`.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use vl_models::engine::Engine;
use vl_models::sampling::GenerationOptions;

use crate::job::Job;
use crate::metrics::Metrics;

/// What the server is told besides its engine. `Default` is what `vl serve` runs with when given
/// no flag (but `id`, which it takes from `--model`), so a caller sets only what differs:
///
/// ```
/// let config = vl_server::ServerConfig { aliases: vec!["gpt-4o".into()], ..Default::default() };
/// assert_eq!((config.queue, config.ui), (16, true));
/// ```
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// The model id clients send and `/v1/models` lists.
    pub id: String,
    /// Sampling when a request sets none.
    pub defaults: GenerationOptions,
    /// Local media paths (and file:// URLs) are read only under this directory.
    pub allowed_media_dir: Option<MediaDir>,
    /// Some(timeout) when http(s) media URLs may be fetched.
    pub remote_media: Option<Duration>,
    /// Largest image or video a request may carry or fetch, in bytes.
    pub max_image_bytes: u64,
    /// Largest request body in bytes.
    pub max_body_bytes: usize,
    /// Requests that may wait beyond the engine's running ones; more get 503.
    pub queue: usize,
    /// Bearer key every endpoint but /health requires (visible ASCII: `check_api_key`).
    pub api_key: Option<String>,
    /// Origins a browser page may call from (`*` for any), as `cors_origins` makes them.
    pub cors_origins: Vec<String>,
    /// Serve the web chat at `/` (its assets under `/ui/`).
    pub ui: bool,
    /// Connection count, header and body timeouts, shutdown bound.
    pub connections: ConnectionLimits,
    /// Other names clients may send for the model; `/v1/models` lists them after `id`.
    pub aliases: Vec<String>,
    /// Refuse (404 `model_not_found`) a `model` that is neither `id` nor an alias. Without it,
    /// any name is answered by the one model served (clients with a hard-coded model name work,
    /// as with llama-server and Ollama).
    pub strict_model_name: bool,
    /// Bytes of stored `/v1/responses` answers kept (`store`, least recently used out first); 0
    /// keeps none.
    pub responses_store_bytes: usize,
}

/// The model id a `ServerConfig::default()` serves under.
pub const DEFAULT_MODEL_ID: &str = "vl";

impl Default for ServerConfig {
    /// `vl serve`'s defaults: greedy sampling, no local or remote media, 64 MiB bodies, the
    /// image reader's file limit, a queue of 16, no key, no CORS origin, the web chat on,
    /// `ConnectionLimits::default()`, any model name answered; the id `DEFAULT_MODEL_ID`.
    fn default() -> Self {
        Self {
            id: DEFAULT_MODEL_ID.into(),
            defaults: GenerationOptions::default(),
            allowed_media_dir: None,
            remote_media: None,
            max_image_bytes: vl_models::limits::ImageLimits::default().max_file_bytes,
            max_body_bytes: 64 << 20,
            queue: 16,
            api_key: None,
            cors_origins: vec![],
            ui: true,
            connections: ConnectionLimits::default(),
            aliases: vec![],
            strict_model_name: false,
            responses_store_bytes: 64 << 20,
        }
    }
}

impl ServerConfig {
    /// Whether `name` is the served model's id or one of its aliases.
    pub fn names(&self, name: &str) -> bool {
        name == self.id || self.aliases.iter().any(|a| a == name)
    }
}

/// The directory local media paths must lie under: as written (absolute, `.` and `..`
/// resolved) and resolved (links followed); a path is checked against both spellings.
#[derive(Debug, Clone)]
pub struct MediaDir {
    pub(crate) written: PathBuf,
    pub(crate) real: PathBuf,
}

impl MediaDir {
    /// The directory `path` (it must exist).
    pub fn new(path: &std::path::Path) -> std::io::Result<Self> {
        let real = path.canonicalize()?;
        if !real.is_dir() {
            return Err(std::io::Error::other("not a directory"));
        }
        Ok(Self { written: lexical(path), real })
    }
}

/// `path` made absolute (against the working directory) with `.` and `..` resolved as written,
/// without touching the filesystem.
pub(crate) fn lexical(path: &std::path::Path) -> PathBuf {
    use std::path::Component;
    let base = if path.is_absolute() { PathBuf::new() } else { std::env::current_dir().unwrap_or_default() };
    let mut out = PathBuf::new();
    for c in base.components().chain(path.components()) {
        match c {
            Component::CurDir => {}
            Component::ParentDir => {
                out.pop();
            }
            other => out.push(other),
        }
    }
    out
}

/// Bounds on connections (`vl serve` flags).
#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    /// Open connections at most; one more gets a 503 and is closed.
    pub max_connections: usize,
    /// Time a client has to send a request's headers, and the longest an idle keep-alive
    /// connection stays open.
    pub header_timeout: Duration,
    /// Time a client has to send a request's body once its headers are in.
    pub body_timeout: Duration,
    /// After SIGINT/SIGTERM, the longest the server waits for running requests and open
    /// connections before it exits anyway.
    pub shutdown_timeout: Duration,
    /// The longest a streamed answer waits for a client that stopped reading (its relay full):
    /// past it the request is cancelled and its slot freed.
    pub stall_timeout: Duration,
}

impl Default for ConnectionLimits {
    /// `vl serve`'s defaults: `default_max_connections()`, 15 s for headers, 60 s for a body,
    /// 60 s to shut down, 30 s for a stalled client.
    fn default() -> Self {
        Self {
            max_connections: default_max_connections(),
            header_timeout: Duration::from_secs(15),
            body_timeout: Duration::from_secs(60),
            shutdown_timeout: Duration::from_secs(60),
            stall_timeout: Duration::from_secs(30),
        }
    }
}

/// Descriptors kept free of connections: model files, ffmpeg's pipes, temporary video files,
/// remote media fetches.
pub const RESERVED_DESCRIPTORS: u64 = 128;

/// The process's open-file limit (soft), if known.
#[allow(clippy::unnecessary_cast)] // rlim_t is u64 on Linux and macOS, not everywhere
pub fn descriptor_limit() -> Option<u64> {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes the struct it is given.
    (unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0).then_some(lim.rlim_cur as u64)
}

/// The default connection limit: 1024, or fewer when the open-file limit leaves less than that
/// beside `RESERVED_DESCRIPTORS`.
pub fn default_max_connections() -> usize {
    let free = descriptor_limit().map_or(1024, |n| n.saturating_sub(RESERVED_DESCRIPTORS));
    free.clamp(8, 1024) as usize
}

/// The state every route and worker shares.
pub(crate) struct App {
    pub config: ServerConfig,
    pub engine: Arc<Engine>,
    /// When the server started (the models' `created`), in seconds since the epoch.
    pub created: u64,
    /// The queue's sending side; taken (closing the queue) when the server stops.
    pub jobs: std::sync::Mutex<Option<std::sync::mpsc::SyncSender<Job>>>,
    /// Requests handed over and not yet answered, at most `workers`.
    pub in_flight: AtomicUsize,
    pub workers: usize,
    pub context: usize,
    pub metrics: Metrics,
    pub next_id: AtomicU64,
    /// Stored `/v1/responses` answers.
    pub responses: crate::responses::ResponseStore,
}

impl App {
    /// The state of a server over `engine` with `workers` worker threads taking jobs from the
    /// queue `jobs` sends to.
    pub fn new(
        engine: Arc<Engine>,
        config: ServerConfig,
        workers: usize,
        jobs: std::sync::mpsc::SyncSender<Job>,
    ) -> Self {
        let responses = crate::responses::ResponseStore::new(config.responses_store_bytes);
        Self {
            in_flight: AtomicUsize::new(0),
            workers,
            context: engine.context(),
            engine,
            config,
            created: now(),
            jobs: std::sync::Mutex::new(Some(jobs)),
            metrics: Metrics::new(),
            next_id: AtomicU64::new(1),
            responses,
        }
    }
}

/// Seconds since the epoch (an answer's `created`).
pub(crate) fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}
