//! OpenAI chat requests read and answered as the server reads and answers them, without HTTP:
//! for programs that embed the engine (the Python package, `crates/vl-py`). The same checks,
//! media rules, constraints, tools and answer shapes as `POST /v1/chat/completions`.

use std::sync::Arc;
use std::time::Instant;

use serde_json::Value;
use vl_models::engine::{Completion, Engine, Request};

use crate::answers::{Answer, Kind};
use crate::error::ApiError;
use crate::state::{now, App, ServerConfig};

/// The server's reading of chat requests over one engine.
pub struct Chat {
    app: Arc<App>,
    /// The runtime the pooling answers run on (made at the first).
    rt: std::sync::OnceLock<tokio::runtime::Runtime>,
}

/// A chat request read: the engine's request and what shapes its answer.
pub struct ChatRequest {
    pub request: Request,
    /// Answers asked for (`n`).
    pub n: usize,
    /// `stream: true` was asked.
    pub stream: bool,
    one_call: bool,
    format_field: Option<String>,
}

/// A request refused, or an answer that failed, as the server would say it: a one-line message,
/// the field it is about (OpenAI's `param`), and the HTTP status it would have.
#[derive(Debug, Clone)]
pub struct RequestError {
    pub message: String,
    pub param: Option<String>,
    pub status: u16,
}

impl std::fmt::Display for RequestError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for RequestError {}

impl From<ApiError> for RequestError {
    fn from(e: ApiError) -> Self {
        let body = e.body();
        Self {
            message: e.message().to_string(),
            param: body["error"]["param"].as_str().map(String::from),
            status: e.status().as_u16(),
        }
    }
}

impl Chat {
    /// Reads requests as a server with `config` would (its media directory, remote media,
    /// limits and sampling defaults).
    pub fn new(engine: Arc<Engine>, config: ServerConfig) -> Self {
        // No worker takes jobs: the callers run the engine themselves, as many at once as they
        // like (the pooling answers count them against this bound).
        let (jobs, _) = std::sync::mpsc::sync_channel(0);
        Self { app: Arc::new(App::new(engine, config, 1 << 20, jobs)), rt: std::sync::OnceLock::new() }
    }

    pub fn engine(&self) -> &Arc<Engine> {
        &self.app.engine
    }

    /// A chat completions body (JSON) as the engine's request, with the server's checks.
    pub fn parse(&self, body: &[u8]) -> Result<ChatRequest, RequestError> {
        let parsed = crate::request::parse(&self.app, crate::request::typed(body)?)?;
        Ok(ChatRequest {
            request: parsed.req,
            n: parsed.n,
            stream: parsed.stream,
            one_call: parsed.one_call,
            format_field: parsed.format_field,
        })
    }

    /// A pooling body answered as `POST /v1/{endpoint}` answers it (`endpoint`: `embeddings`,
    /// `rerank` or `score`), on the caller's thread.
    pub fn pool(&self, endpoint: &str, body: &[u8]) -> Result<Value, RequestError> {
        if self.rt.get().is_none() {
            // A multi-threaded runtime: the answers move their blocking parts off its threads.
            let rt =
                tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().map_err(|e| {
                    RequestError { message: format!("cannot start a runtime: {e}"), param: None, status: 500 }
                })?;
            let _ = self.rt.set(rt);
        }
        let endpoint = match endpoint {
            "embeddings" => crate::pooling::Endpoint::Embeddings,
            "rerank" => crate::pooling::Endpoint::Rerank,
            "score" => crate::pooling::Endpoint::Score,
            other => return Err(ApiError::bad(format!("no pooling endpoint {other:?}")).into()),
        };
        let rt = self.rt.get().expect("set above");
        Ok(rt.block_on(crate::pooling::answer_json(&self.app, body, endpoint))?)
    }

    /// An engine error about `req` as the server would answer it.
    pub fn error(&self, req: &ChatRequest, e: &vl_models::Error) -> RequestError {
        ApiError::from_engine_for(e, req.format_field.as_deref()).into()
    }

    /// The answers as the server's `chat.completion` object (`want_logprobs`: the request asked
    /// for them), with ours `timings` (of the first answer, in seconds).
    pub fn completion(&self, req: &ChatRequest, mut all: Vec<Completion>) -> Value {
        if req.one_call {
            crate::request::keep_one_call(&mut all);
        }
        let n = self.app.next_id.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let answer = Answer {
            app: self.app.clone(),
            kind: Kind::Chat,
            id: format!("chatcmpl-{n}"),
            created: now(),
            started: Instant::now(),
            want_logprobs: req.request.options.logprobs.is_some(),
            n: all.len(),
            include_usage: false,
        };
        let mut v = answer.whole_json(&all);
        if let Some(c) = all.first() {
            let decode = c.decode_time.as_secs_f64();
            let tokens = c.token_ids.len();
            v["timings"] = serde_json::json!({
                "vision_s": c.vision_time.as_secs_f64(),
                "prefill_s": c.prefill_time.as_secs_f64(),
                "time_to_first_token_s": c.time_to_first_token.as_secs_f64(),
                "decode_s": decode,
                "decode_tokens_per_s": if decode > 0.0 && tokens > 1 { (tokens - 1) as f64 / decode } else { 0.0 },
            });
        }
        v
    }
}
