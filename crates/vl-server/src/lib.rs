//! `vl-server`: the OpenAI-compatible HTTP API over a resident `vl_models::engine::Engine`
//! (axum + tokio), as `vl serve` runs it.
//!
//! - `openai`: the request, typed; unknown fields refused with their name.
//! - `request`: a typed request checked and made into an engine request.
//! - `responses`: OpenAI's Responses API over the chat request it stands for.
//! - `media`: images and videos from data URLs, http(s) URLs and allowed local paths.
//! - `router`: the routes, the guard (CORS, API key, one log line per request) and the workers
//!   that hand requests to the engine, whose scheduler decodes them together.
//! - `ui/` (beside `src/`): the web chat at `/`, embedded in the binary.
//! - `metrics`: Prometheus `/metrics`; `error`: OpenAI-shaped errors.

/// A line on stderr that never panics (a closed stderr is not an error worth dying for).
macro_rules! note {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

mod conn;
mod error;
mod media;
mod metrics;
pub mod openai;
mod request;
mod responses;
mod router;

use std::path::PathBuf;
use std::time::Duration;

pub use conn::{default_max_connections, descriptor_limit, ConnectionLimits, RESERVED_DESCRIPTORS};
pub use router::serve;
use vl_models::sampling::GenerationOptions;

/// What the server is told besides its engine.
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
    /// Bearer key every endpoint but /health requires.
    pub api_key: Option<String>,
    /// Origins a browser page may call from (`*` for any).
    pub cors_origins: Vec<String>,
    /// Serve the web chat at `/` (its assets under `/ui/`).
    pub ui: bool,
    /// Connection count, header and body timeouts, shutdown bound.
    pub connections: ConnectionLimits,
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
        Ok(Self { written: media::lexical(path), real })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Config(String),
}
