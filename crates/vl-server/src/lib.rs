//! `vl-server`: the OpenAI-compatible HTTP API over a resident `vl_models::engine::Engine`
//! (axum + tokio), as `vl serve` runs it.
//!
//! Serving an engine from another crate: load it, bind a listener, and hand both to `serve` with
//! a `ServerConfig` (its `Default` is `vl serve`'s defaults), which blocks until SIGINT or
//! SIGTERM (`serve_until` stops when a future of yours resolves instead):
//!
//! ```no_run
//! use std::sync::Arc;
//!
//! use vl_models::Engine;
//! use vl_server::{ConnectionLimits, ServerConfig};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let engine = Arc::new(Engine::builder("goldens/tiny-a/checkpoint").build()?);
//! let listener = std::net::TcpListener::bind("127.0.0.1:8080")?;
//! let config = ServerConfig {
//!     id: "tiny-a".into(),
//!     aliases: vec!["gpt-4o-mini".into()],
//!     connections: ConnectionLimits { max_connections: 64, ..Default::default() },
//!     ..Default::default()
//! };
//! vl_server::serve(engine, listener, config)?;
//! # Ok(())
//! # }
//! ```
//!
//! The modules:
//! - `openai`: the request, typed; unknown fields refused with their name.
//! - `request`: a typed request checked and made into an engine request; `formats`: the
//!   answer's format (`response_format`, `structured_outputs`, `grammar`, ...) as a constraint.
//! - `responses/`: OpenAI's Responses API over the chat request it stands for (`parse`: the
//!   request; `answer`: the response object and its typed events).
//! - `media`: images and videos from data URLs, http(s) URLs and allowed local paths.
//! - `fields`: JSON fields read by hand, each error naming its path.
//! - `state`: `ServerConfig`, `ConnectionLimits`, the shared `App`: near the bottom (it imports
//!   only `job` and `metrics`); only `router` imports `handlers`. No import circle:
//!   `tools/lint/module_circles.py crates/vl-server/src`.
//! - `router`: the server assembled and run (`serve`, `serve_until`), its bounded shutdown.
//! - `handlers`: the endpoints; `answers`: chat and text completion answers, whole or streamed.
//! - `guard`: CORS, the API key, one log line per request, the body's size limit and timeout.
//! - `workers`: the threads that hand requests (`job::Job`) to the engine, whose scheduler
//!   decodes them together, and relay its stream (`job::Msg`).
//! - `conn`: the accept loop (connection limit, header timeout, graceful shutdown).
//! - `ui` (and `ui/` beside `src/`): the web chat at `/`, embedded in the binary.
//! - `metrics`: Prometheus `/metrics`; `error`: OpenAI-shaped errors.
//! - `embed`: `Chat`, the server's reading and answering of chat requests without HTTP, for
//!   programs that embed the engine (the Python package).

/// A line on stderr that never panics (a closed stderr is not an error worth dying for).
macro_rules! note {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

mod answers;
mod anthropic;
mod conn;
mod embed;
mod error;
mod fields;
mod formats;
mod guard;
mod handlers;
mod job;
mod media;
mod metrics;
pub mod openai;
mod pooling;
mod request;
mod responses;
mod router;
mod state;
mod ui;
mod workers;

pub use embed::{Chat, ChatRequest, RequestError};
pub use guard::{check_api_key, cors_origins};
pub use router::{serve, serve_until};
pub use state::{
    default_max_connections, descriptor_limit, ConnectionLimits, MediaDir, ServerConfig, DEFAULT_MODEL_ID,
    RESERVED_DESCRIPTORS,
};

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Config(String),
}
