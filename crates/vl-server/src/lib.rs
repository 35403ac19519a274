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
        Ok(Self { written: media::lexical(path), real })
    }
}

/// `--cors-origins` entries as the server compares them: each trimmed, and each `*` or an
/// origin `scheme://host[:port]` (no path, no slash after it) as a browser sends it: lowercased,
/// the scheme's default port dropped. An empty or malformed entry is an error naming it.
pub fn cors_origins(entries: &[String]) -> Result<Vec<String>, ServerError> {
    entries.iter().map(|e| origin(e.trim()).ok_or_else(|| ServerError::Config(origin_error(e)))).collect()
}

fn origin_error(entry: &str) -> String {
    if entry.trim().is_empty() {
        "an empty entry (two commas in a row, or one at an end)".into()
    } else {
        format!("{entry:?} is not an origin: expected `*` or scheme://host[:port], without a path")
    }
}

/// `e` as an origin, or None when it is not `*` or `scheme://host[:port]`.
fn origin(e: &str) -> Option<String> {
    if e == "*" {
        return Some(e.into());
    }
    let (scheme, authority) = e.split_once("://")?;
    let scheme_ok = scheme.starts_with(|c: char| c.is_ascii_alphabetic())
        && scheme.chars().all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c));
    let (host, port) = match authority.strip_prefix('[') {
        // An IPv6 literal.
        Some(rest) => {
            let (ip, after) = rest.split_once(']')?;
            if ip.is_empty() || !ip.chars().all(|c| c.is_ascii_hexdigit() || c == ':' || c == '.') {
                return None;
            }
            let port = if after.is_empty() { None } else { Some(after.strip_prefix(':')?) };
            (format!("[{ip}]"), port)
        }
        None => {
            let (h, port) = match authority.split_once(':') {
                Some((h, p)) => (h, Some(p)),
                None => (authority, None),
            };
            if h.is_empty() || !h.chars().all(|c| c.is_ascii_alphanumeric() || "-._~".contains(c)) {
                return None;
            }
            (h.to_string(), port)
        }
    };
    let port = match port {
        None => None,
        Some(p) if (1..=5).contains(&p.len()) && p.bytes().all(|b| b.is_ascii_digit()) => Some(p.parse::<u16>().ok()?),
        Some(_) => return None,
    };
    if !scheme_ok {
        return None;
    }
    let scheme = scheme.to_ascii_lowercase();
    let default = match scheme.as_str() {
        "http" => Some(80),
        "https" => Some(443),
        _ => None,
    };
    let host = host.to_ascii_lowercase();
    Some(match port.filter(|&p| Some(p) != default) {
        Some(p) => format!("{scheme}://{host}:{p}"),
        None => format!("{scheme}://{host}"),
    })
}

/// Refuses an API key no request could send: empty, or with a character outside visible ASCII
/// (bytes 0x21-0x7E; an HTTP header value carries nothing else, and blanks around a key are not
/// part of it).
pub fn check_api_key(key: &str) -> Result<(), ServerError> {
    if key.is_empty() {
        return Err(ServerError::Config("the key is empty".into()));
    }
    if let Some(i) = key.chars().position(|c| !c.is_ascii_graphic()) {
        return Err(ServerError::Config(format!(
            "the key's character {} is not visible ASCII (0x21-0x7E): no HTTP Authorization header could carry it",
            i + 1
        )));
    }
    Ok(())
}

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Config(String),
}
