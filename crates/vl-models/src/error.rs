//! The one error type of `vl-models`: every message names the file, key, shape or value at fault.

use std::path::PathBuf;

pub type Result<T> = std::result::Result<T, Error>;

/// A tensor whose shape differs from what the config implies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShapeMismatch {
    pub key: String,
    pub expected: Vec<usize>,
    pub found: Vec<usize>,
}

/// Which configurable limit an input exceeded (the CLI names the flag that raises it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitKind {
    ImageBytes,
    ImagePixels,
    /// A fixed bound, not configurable.
    Fixed,
    /// The model's context length: the prompt (or its text, or its videos' tokens) cannot fit.
    Context,
    /// The time a request's media may take to decode (`VideoLimits::max_decode_time`).
    DecodeTime,
    /// The engine's KV cache budget (`EngineOptions::kv_cache_bytes`, `--kv-cache-mib`).
    KvCache,
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: invalid JSON: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error(
        "{path}: not a model directory (no config.json){}",
        inside.as_ref().map_or(String::new(), |d| format!("; its subdirectory {0} holds one: pass --model {0}", d.display()))
    )]
    NotAModelDir {
        path: PathBuf,
        /// The one subdirectory holding a config.json, when exactly one does (a checkpoint
        /// downloaded or unpacked one level down).
        inside: Option<PathBuf>,
    },
    #[error(
        "{path}: unsupported architecture {} (model_type {}); this build supports {supported}",
        if found.is_empty() { "(none listed)".to_string() } else { found.join(", ") },
        model_type.as_deref().unwrap_or("missing")
    )]
    UnknownArchitecture { path: PathBuf, found: Vec<String>, model_type: Option<String>, supported: &'static str },
    #[error("{path}: config field `{field}`: {message}")]
    Config { path: PathBuf, field: String, message: String },
    #[error("{path}: {message}")]
    Safetensors { path: PathBuf, message: String },
    #[error("{dir}: no weights found (expected model.safetensors or model.safetensors.index.json)")]
    NoWeights { dir: PathBuf },
    #[error("checkpoint {dir} does not match its config: {}", describe_mismatch(.missing, .unexpected, .wrong_shape))]
    TensorPlan { dir: PathBuf, missing: Vec<String>, unexpected: Vec<String>, wrong_shape: Vec<ShapeMismatch> },
    #[error("tensor `{key}` not found in the checkpoint")]
    MissingTensor { key: String },
    #[error("tensor `{key}` in {path}: unsupported dtype {dtype}")]
    UnsupportedDtype { key: String, path: PathBuf, dtype: String },
    #[error("{what}: {message}")]
    Input { what: String, message: String },
    /// An input over a size limit, found before the work it would cost.
    #[error("{what}: {message}")]
    Limit { what: String, message: String, kind: LimitKind },
    /// A fault inside the engine (a batched step failed, the scheduler stopped): not the
    /// request's doing.
    #[error("internal error: {message}")]
    Internal { message: String },
    /// The model produced NaN or infinite logits: broken weights or config values.
    #[error("{message}")]
    NonFinite { message: String },
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error(transparent)]
    Nn(#[from] vl_nn::Error),
}

impl Error {
    /// `dir` has no config.json: `NotAModelDir`, naming the subdirectory that holds one when
    /// exactly one does (among its first 4096 entries).
    pub fn not_a_model_dir(dir: &std::path::Path) -> Self {
        let mut found = std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .take(4096)
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.is_dir() && p.join("config.json").is_file());
        let inside = match (found.next(), found.next()) {
            (Some(one), None) => Some(one),
            _ => None,
        };
        Error::NotAModelDir { path: dir.to_path_buf(), inside }
    }
}

fn describe_mismatch(missing: &[String], unexpected: &[String], wrong: &[ShapeMismatch]) -> String {
    const SHOWN: usize = 8;
    fn list(items: Vec<String>) -> String {
        let n = items.len();
        let mut s = items.into_iter().take(SHOWN).collect::<Vec<_>>().join(", ");
        if n > SHOWN {
            s.push_str(&format!(" and {} more", n - SHOWN));
        }
        s
    }
    let mut parts = Vec::new();
    if !missing.is_empty() {
        parts.push(format!("{} missing tensor(s): {}", missing.len(), list(missing.to_vec())));
    }
    if !wrong.is_empty() {
        let items =
            wrong.iter().map(|w| format!("{} has shape {:?}, expected {:?}", w.key, w.found, w.expected)).collect();
        parts.push(format!("{} wrongly shaped: {}", wrong.len(), list(items)));
    }
    if !unexpected.is_empty() {
        parts.push(format!("{} unexpected tensor(s): {}", unexpected.len(), list(unexpected.to_vec())));
    }
    parts.join("; ")
}

impl Error {
    /// An input error with its subject rewritten (`what` -> `f(what)`); other errors unchanged.
    pub(crate) fn rename_input(self, f: impl FnOnce(String) -> String) -> Self {
        match self {
            Error::Input { what, message } => Error::Input { what: f(what), message },
            other => other,
        }
    }

    /// An I/O error on `path`. A path that is a symbolic link to nothing (a `cp -r` of a
    /// checkpoint whose files link elsewhere) is named as one, with its target.
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        let path = path.into();
        let source = match broken_link(&path) {
            Some(target) if source.kind() == std::io::ErrorKind::NotFound => std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!(
                    "broken symbolic link to {} (copy a checkpoint with `cp -rL` to copy the files)",
                    target.display()
                ),
            ),
            _ => source,
        };
        Error::Io { path, source }
    }
}

/// The target of `path` when it is a symbolic link whose target does not exist.
pub fn broken_link(path: &std::path::Path) -> Option<PathBuf> {
    let target = std::fs::read_link(path).ok()?;
    (!path.exists()).then_some(target)
}
