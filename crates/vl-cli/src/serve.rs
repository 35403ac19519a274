//! `vl serve`: the OpenAI chat completions API on the resident engine (axum + tokio).
//!
//! Worker threads (`--parallel` + `--queue`) hand requests to the engine, whose scheduler
//! decodes up to `--parallel` of them together (continuous batching); with every worker busy a
//! request is refused (503). Handlers parse and check the request, hand it over, and stream the
//! text pieces back (SSE) or gather them. A client that goes away cancels its generation. SIGINT and
//! SIGTERM stop accepting, let running requests finish, and exit.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, StatusCode};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use base64::Engine as _;
use clap::Args;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use serde_json::{json, Value};
use tokio::sync::mpsc;
use vl_models::engine::{ChatMessage, Completion, Engine, EngineOptions, Part, Request, ToolCall, VideoData};
use vl_models::limits::LimitKind;
use vl_models::qwen3_vl::GenerationOptions;

use crate::note;
use crate::run::{device, dtype, quant_of, LoadArgs};

#[derive(Debug, Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub(crate) load: LoadArgs,
    /// Address to bind (loopback by default; 0.0.0.0 exposes the server to the network).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port (0 picks a free one; the address is printed on stderr).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// The model id clients send and `/v1/models` lists (default: the --model value).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Largest request body in bytes (base64 images included).
    #[arg(long, default_value_t = 64 << 20)]
    max_body_bytes: usize,
    /// Requests waiting beyond the running ones; more are refused with 503.
    #[arg(long, default_value_t = 16)]
    queue: usize,
    /// Sequences decoded together (continuous batching): each decode step multiplies every
    /// running sequence's row at once, so the weights are read once per step for all of them.
    #[arg(long, default_value_t = vl_models::engine::DEFAULT_PARALLEL)]
    parallel: usize,
    /// KV cache budget in MiB, running sequences and kept prefixes together (default: a quarter
    /// of the machine's memory). A request whose prompt cannot fit in it is refused with 503; one
    /// that cannot fit now waits.
    #[arg(long)]
    kv_cache_mib: Option<usize>,
    /// Local image paths (and file:// URLs) are read only under this directory.
    #[arg(long)]
    allowed_media_dir: Option<PathBuf>,
    /// Fetch http(s) image URLs (off by default: the server would make requests on clients'
    /// behalf). Each fetch is bounded by --max-image-bytes and --remote-media-timeout.
    #[arg(long)]
    allow_remote_media: bool,
    /// Seconds a remote image fetch may take in all.
    #[arg(long, default_value_t = 20)]
    remote_media_timeout: u64,
    /// Vision features kept for repeated images, in MiB (0 = off).
    #[arg(long, default_value_t = 256)]
    image_cache_mib: usize,
    /// Sampled, preprocessed video frames kept for repeated videos, in MiB (0 = off): a video
    /// sent again (same file path, size and modification time, or the same bytes) is not decoded
    /// again.
    #[arg(long, default_value_t = 256)]
    clip_cache_mib: usize,
    /// Seconds one video's decoding may take before it is refused (0: no limit); a long video in
    /// one request would otherwise hold the server's worker.
    #[arg(long, default_value_t = 120.0)]
    video_decode_timeout: f64,
    /// Prefill every prompt in full (by default a request reuses the KV cache of the longest
    /// prefix it shares with an earlier conversation's; many are kept, least recently used out
    /// first, within --kv-cache-mib).
    #[arg(long)]
    no_prefix_cache: bool,
    /// Default sampling when a request sets none: `greedy`, or `model` (generation_config.json's
    /// temperature, top_k, top_p).
    #[arg(long, default_value = "greedy")]
    sampling: String,
}

/// Most sequences `--parallel` may ask to decode together.
const MAX_PARALLEL: usize = 64;

/// A parsed request and where its answer goes.
struct Job {
    req: Request,
    tx: mpsc::UnboundedSender<Msg>,
    queued: Instant,
}

/// One `Done` per request, after its texts: its size is no concern.
#[allow(clippy::large_enum_variant)]
enum Msg {
    Text(String),
    Done(std::result::Result<Completion, ApiError>),
}

#[derive(Debug)]
struct ApiError {
    status: StatusCode,
    kind: &'static str,
    code: Option<&'static str>,
    message: String,
}

impl ApiError {
    fn bad(message: impl Into<String>) -> Self {
        Self { status: StatusCode::BAD_REQUEST, kind: "invalid_request_error", code: None, message: message.into() }
    }
    fn with(status: StatusCode, kind: &'static str, code: &'static str, message: impl Into<String>) -> Self {
        Self { status, kind, code: Some(code), message: message.into() }
    }
    fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind, "code": self.code, "param": Value::Null}})
    }
    fn from_engine(e: &vl_models::Error) -> Self {
        let message = e.to_string().split_whitespace().collect::<Vec<_>>().join(" ");
        match e {
            vl_models::Error::Limit { what, kind, .. } if what == "prompt" && *kind == LimitKind::Fixed => {
                Self::with(StatusCode::BAD_REQUEST, "invalid_request_error", "context_length_exceeded", message)
            }
            vl_models::Error::Limit { kind: LimitKind::KvCache, .. } => {
                Self::with(StatusCode::SERVICE_UNAVAILABLE, "server_error", "kv_cache_exhausted", message)
            }
            vl_models::Error::Limit { .. } => {
                Self::with(StatusCode::PAYLOAD_TOO_LARGE, "invalid_request_error", "image_too_large", message)
            }
            vl_models::Error::Input { .. } => Self::bad(message),
            _ => Self::with(StatusCode::INTERNAL_SERVER_ERROR, "server_error", "internal_error", message),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}

struct Metrics {
    registry: Registry,
    requests: Family<Vec<(String, String)>, Counter>,
    prompt_tokens: Counter,
    cached_tokens: Counter,
    completion_tokens: Counter,
    image_cache_hits: Counter,
    video_cache_hits: Counter,
    queue_depth: Gauge,
    running: Gauge,
    ttft: Histogram,
    queue_wait: Histogram,
}

impl Metrics {
    fn new() -> Self {
        let buckets = || Histogram::new([0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0]);
        let m = Self {
            registry: Registry::with_prefix("vl"),
            requests: Family::default(),
            prompt_tokens: Counter::default(),
            cached_tokens: Counter::default(),
            completion_tokens: Counter::default(),
            image_cache_hits: Counter::default(),
            video_cache_hits: Counter::default(),
            queue_depth: Gauge::default(),
            running: Gauge::default(),
            ttft: buckets(),
            queue_wait: buckets(),
        };
        let mut m = m;
        let r = &mut m.registry;
        r.register("requests", "Chat completion requests by HTTP status", m.requests.clone());
        r.register("prompt_tokens", "Prompt tokens of answered requests", m.prompt_tokens.clone());
        r.register("cached_prompt_tokens", "Prompt tokens served from the prefix cache", m.cached_tokens.clone());
        r.register("completion_tokens", "Generated tokens", m.completion_tokens.clone());
        r.register("image_cache_hits", "Images whose features came from the feature cache", m.image_cache_hits.clone());
        r.register("video_cache_hits", "Videos whose features came from the feature cache", m.video_cache_hits.clone());
        r.register("queue_depth", "Requests waiting for the engine", m.queue_depth.clone());
        r.register("requests_running", "Requests being generated", m.running.clone());
        r.register("time_to_first_token_seconds", "Time from queueing to the first token", m.ttft.clone());
        r.register("queue_wait_seconds", "Time a request waited in the queue", m.queue_wait.clone());
        m
    }
}

struct App {
    id: String,
    created: u64,
    /// The queue's sending side; taken (closing the queue) when the server stops.
    jobs: std::sync::Mutex<Option<std::sync::mpsc::SyncSender<Job>>>,
    context: usize,
    defaults: GenerationOptions,
    allowed_media_dir: Option<PathBuf>,
    /// Some(timeout) when http(s) image URLs may be fetched.
    remote_media: Option<Duration>,
    max_image_bytes: u64,
    max_body_bytes: usize,
    metrics: Metrics,
    next_id: AtomicU64,
}

pub fn serve(args: ServeArgs) -> Result<()> {
    let t = args.video_decode_timeout;
    if !(t.is_finite() && t >= 0.0) {
        anyhow::bail!("--video-decode-timeout {t}: must be a number of seconds >= 0 (0: no limit)");
    }
    let dev = device(args.load.device)?;
    let dtype = dtype(args.load.dtype, &dev);
    let dir = crate::hub::resolve(&args.load.model)?;
    let defaults = match args.sampling.as_str() {
        "greedy" => GenerationOptions::default(),
        "model" => model_sampling(&dir)?,
        other => anyhow::bail!("--sampling {other}: expected `greedy` or `model`"),
    };
    let allowed_media_dir = args
        .allowed_media_dir
        .as_ref()
        .map(|d| d.canonicalize().with_context(|| format!("--allowed-media-dir {}", d.display())))
        .transpose()?;
    // Bind first: a taken port fails before minutes of loading.
    let addr = format!("{}:{}", args.host, args.port);
    let listener = std::net::TcpListener::bind(&addr).with_context(|| format!("binding {addr}"))?;
    listener.set_nonblocking(true)?;
    let local = listener.local_addr()?;

    let (video, video_pixel_cap) = args.load.video_options()?;
    let opts = EngineOptions {
        dtype,
        device: dev,
        quant: quant_of(args.load.quantize, &dir)?,
        min_pixels: args.load.min_pixels,
        max_pixels: args.load.max_pixels,
        max_image_tokens: args.load.max_image_tokens(),
        image_limits: args.load.image_limits(),
        video,
        video_pixel_cap,
        video_limits: vl_models::video::VideoLimits {
            max_decode_time: (args.video_decode_timeout > 0.0)
                .then(|| Duration::from_secs_f64(args.video_decode_timeout.min(86_400.0))),
            ..Default::default()
        },
        image_cache_bytes: args.image_cache_mib << 20,
        clip_cache_bytes: args.clip_cache_mib.saturating_mul(1 << 20),
        prefix_cache: !args.no_prefix_cache,
        parallel: args.parallel,
        kv_cache_bytes: args
            .kv_cache_mib
            .map_or_else(vl_models::engine::default_kv_cache_bytes, |m| m.saturating_mul(1 << 20)),
        prefill_chunk: vl_models::engine::DEFAULT_PREFILL_CHUNK,
    };
    if args.parallel == 0 || args.parallel > MAX_PARALLEL {
        anyhow::bail!("--parallel {}: must be in 1..={MAX_PARALLEL}", args.parallel);
    }
    if args.kv_cache_mib == Some(0) {
        anyhow::bail!("--kv-cache-mib 0: the KV cache needs at least one block");
    }
    let id = args.served_model_name.clone().unwrap_or_else(|| args.load.model.clone());
    let t = Instant::now();
    let engine = Arc::new(
        Engine::open(&dir, args.load.mmproj.as_deref(), &id, opts)
            .with_context(|| format!("model {}", dir.display()))?,
    );
    note!("loaded {} in {:.1}s", dir.display(), t.elapsed().as_secs_f64());

    // Each request in flight holds a worker thread that relays the engine's stream: --parallel
    // decoding plus --queue waiting. A request finding no idle worker is refused (503).
    let (jobs, rx) = std::sync::mpsc::sync_channel::<Job>(0);
    let rx = Arc::new(std::sync::Mutex::new(rx));
    let app = Arc::new(App {
        id,
        created: SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()),
        jobs: std::sync::Mutex::new(Some(jobs)),
        context: engine.context(),
        defaults,
        allowed_media_dir,
        remote_media: args.allow_remote_media.then(|| Duration::from_secs(args.remote_media_timeout.max(1))),
        max_image_bytes: args.load.max_image_bytes,
        max_body_bytes: args.max_body_bytes,
        metrics: Metrics::new(),
        next_id: AtomicU64::new(1),
    });
    let mut workers = Vec::new();
    for i in 0..args.parallel + args.queue {
        let (app, engine, rx) = (app.clone(), engine.clone(), rx.clone());
        workers
            .push(std::thread::Builder::new().name(format!("vl-worker-{i}")).spawn(move || work(&engine, &app, &rx))?);
    }

    let router = Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(|| async { axum::Json(json!({"status": "ok"})) }))
        .route("/metrics", get(metrics))
        .fallback(|| async {
            ApiError::with(StatusCode::NOT_FOUND, "invalid_request_error", "not_found", "no such endpoint")
        })
        .layer(DefaultBodyLimit::disable())
        .with_state(app.clone());

    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::from_std(listener)?;
        note!("listening on http://{local}");
        axum::serve(listener, router).with_graceful_shutdown(shutdown_signal()).await
    })?;
    // Close the queue: the worker finishes what is queued, then returns.
    app.jobs.lock().unwrap_or_else(|p| p.into_inner()).take();
    drop(app);
    note!("stopping: finishing queued requests");
    for w in workers {
        let _ = w.join();
    }
    note!("stopped");
    Ok(())
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        if let Ok(mut s) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            s.recv().await;
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! { _ = ctrl_c => {}, _ = term => {} }
}

/// generation_config.json's sampling values (temperature, top_k, top_p), for `--sampling model`.
fn model_sampling(dir: &std::path::Path) -> Result<GenerationOptions> {
    let path = dir.join("generation_config.json");
    let mut o = GenerationOptions::default();
    if !path.is_file() {
        return Ok(o);
    }
    let text = vl_models::limits::read_text(&path, vl_models::limits::MAX_METADATA_FILE_BYTES)?;
    let v: Value = serde_json::from_str(&text).with_context(|| format!("{}", path.display()))?;
    if v.get("do_sample").and_then(Value::as_bool) != Some(false) {
        if let Some(t) = v.get("temperature").and_then(Value::as_f64) {
            o.temperature = t;
        }
        if let Some(k) = v.get("top_k").and_then(Value::as_u64) {
            o.top_k = k as usize;
        }
        if let Some(p) = v.get("top_p").and_then(Value::as_f64) {
            o.top_p = p;
        }
        if let Some(p) = v.get("repetition_penalty").and_then(Value::as_f64) {
            o.repetition_penalty = p;
        }
    }
    o.validate().with_context(|| format!("{}", path.display()))?;
    Ok(o)
}

/// A worker: takes a request when idle, hands it to the engine (whose scheduler batches it with
/// the others) and relays its stream; a request whose client left is skipped.
fn work(engine: &Engine, app: &App, rx: &std::sync::Mutex<std::sync::mpsc::Receiver<Job>>) {
    loop {
        let next = rx.lock().unwrap_or_else(|p| p.into_inner()).recv();
        let Ok(job) = next else { return };
        app.metrics.queue_depth.dec();
        if job.tx.is_closed() {
            continue;
        }
        app.metrics.queue_wait.observe(job.queued.elapsed().as_secs_f64());
        app.metrics.running.inc();
        let mut first = true;
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            engine.generate(&job.req, &mut |piece| {
                if first {
                    first = false;
                    app.metrics.ttft.observe(job.queued.elapsed().as_secs_f64());
                }
                job.tx.send(Msg::Text(piece.to_string())).is_ok()
            })
        }));
        app.metrics.running.dec();
        let done = match result {
            Ok(Ok(c)) => {
                app.metrics.prompt_tokens.inc_by(c.prompt_tokens as u64);
                app.metrics.cached_tokens.inc_by(c.cached_tokens as u64);
                app.metrics.completion_tokens.inc_by(c.token_ids.len() as u64);
                app.metrics.image_cache_hits.inc_by(c.image_cache_hits as u64);
                app.metrics.video_cache_hits.inc_by(c.video_cache_hits as u64);
                Ok(c)
            }
            Ok(Err(e)) => Err(ApiError::from_engine(&e)),
            Err(_) => Err(ApiError::with(
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                "internal_error",
                "internal error while generating (a bug; see the server log)",
            )),
        };
        let _ = job.tx.send(Msg::Done(done));
    }
}

async fn models(State(app): State<Arc<App>>) -> Response {
    axum::Json(json!({
        "object": "list",
        "data": [{"id": app.id, "object": "model", "created": app.created, "owned_by": "vl",
                  "context_length": app.context}],
    }))
    .into_response()
}

async fn metrics(State(app): State<Arc<App>>) -> Response {
    let mut text = String::new();
    if encode(&mut text, &app.metrics.registry).is_err() {
        return StatusCode::INTERNAL_SERVER_ERROR.into_response();
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text).into_response()
}

fn count(app: &App, status: StatusCode) {
    app.metrics.requests.get_or_create(&vec![("status".to_string(), status.as_u16().to_string())]).inc();
}

async fn chat_completions(State(app): State<Arc<App>>, req: axum::extract::Request) -> Response {
    let resp = match read_body(&app, req).await {
        Ok(body) => match handle(&app, body).await {
            Ok(r) => r,
            Err(e) => e.into_response(),
        },
        Err(e) => e.into_response(),
    };
    count(&app, resp.status());
    resp
}

/// The body within the size limit; a body announced over it is refused before it is read.
async fn read_body(app: &App, req: axum::extract::Request) -> std::result::Result<Bytes, ApiError> {
    let too_large = |n: String| {
        ApiError::with(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            "body_too_large",
            format!("the request body is {n} bytes, over the server's limit of {} bytes", app.max_body_bytes),
        )
    };
    let announced = req.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if let Some(n) = announced.filter(|&n| n > app.max_body_bytes as u64) {
        return Err(too_large(n.to_string()));
    }
    axum::body::to_bytes(req.into_body(), app.max_body_bytes)
        .await
        .map_err(|_| too_large(format!("more than {}", app.max_body_bytes)))
}

async fn handle(app: &Arc<App>, body: Bytes) -> std::result::Result<Response, ApiError> {
    let v: Value = serde_json::from_slice(&body).map_err(|e| ApiError::bad(format!("malformed JSON body: {e}")))?;
    let parsed = parse_request(app, &v)?;
    let (tx, mut rx) = mpsc::unbounded_channel::<Msg>();
    let job = Job { req: parsed.req, tx, queued: Instant::now() };
    app.metrics.queue_depth.inc();
    let sent = match app.jobs.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
        Some(q) => q.try_send(job),
        None => Err(std::sync::mpsc::TrySendError::Disconnected(job)),
    };
    if let Err(e) = sent {
        app.metrics.queue_depth.dec();
        return Err(match e {
            std::sync::mpsc::TrySendError::Full(_) => ApiError::with(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "overloaded",
                "the server is busy (request queue full); retry later",
            ),
            std::sync::mpsc::TrySendError::Disconnected(_) => ApiError::with(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "shutting_down",
                "the server is stopping",
            ),
        });
    }
    let id = format!("chatcmpl-{}", app.next_id.fetch_add(1, Ordering::Relaxed));
    let created = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    // The first message decides the status: a request the engine refuses gets its error status
    // even when streaming.
    let first = rx.recv().await.ok_or_else(|| {
        ApiError::with(StatusCode::INTERNAL_SERVER_ERROR, "server_error", "internal_error", "the engine stopped")
    })?;
    if !parsed.stream {
        let mut text = String::new();
        let mut msg = first;
        loop {
            match msg {
                Msg::Text(t) => text.push_str(&t),
                Msg::Done(done) => {
                    let c = done?;
                    return Ok(axum::Json(json!({
                        "id": id,
                        "object": "chat.completion",
                        "created": created,
                        "model": app.id,
                        "choices": [{
                            "index": 0,
                            "message": message(&id, &c),
                            "finish_reason": c.finish.openai(),
                            "logprobs": Value::Null,
                        }],
                        "usage": usage(&c),
                    }))
                    .into_response());
                }
            }
            msg = rx.recv().await.ok_or_else(|| {
                ApiError::with(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "server_error",
                    "internal_error",
                    "the engine stopped",
                )
            })?;
        }
    }
    if let Msg::Done(Err(e)) = first {
        return Err(e);
    }
    let model = app.id.clone();
    let (usage_id, usage_model) = (id.clone(), model.clone());
    let include_usage = parsed.include_usage;
    let chunk = move |delta: Value, finish: Value| {
        json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": model,
               "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": Value::Null}]})
        .to_string()
    };
    // A task turns the worker's messages into SSE lines; when the client goes away the stream
    // (and its receiver) is dropped, the task's send fails, it drops the worker's channel, and
    // the worker's next send fails: the generation is cancelled.
    let (lines, out) = mpsc::channel::<String>(64);
    tokio::spawn(async move {
        let mut msg = Some(first);
        if lines.send(chunk(json!({"role": "assistant", "content": ""}), Value::Null)).await.is_err() {
            return;
        }
        loop {
            let m = match msg.take() {
                Some(m) => m,
                None => match rx.recv().await {
                    Some(m) => m,
                    None => return,
                },
            };
            match m {
                Msg::Text(t) => {
                    if lines.send(chunk(json!({"content": t}), Value::Null)).await.is_err() {
                        return;
                    }
                }
                Msg::Done(Ok(c)) => {
                    if !c.tool_calls.is_empty() {
                        let calls = tool_calls_json(&usage_id, &c.tool_calls, true);
                        let _ = lines.send(chunk(json!({"tool_calls": calls}), Value::Null)).await;
                    }
                    let _ = lines.send(chunk(json!({}), json!(c.finish.openai()))).await;
                    if include_usage {
                        let v = json!({"id": usage_id, "object": "chat.completion.chunk", "created": created,
                                       "model": usage_model, "choices": [], "usage": usage(&c)});
                        let _ = lines.send(v.to_string()).await;
                    }
                    let _ = lines.send("[DONE]".to_string()).await;
                    return;
                }
                Msg::Done(Err(e)) => {
                    let _ = lines.send(e.body().to_string()).await;
                    let _ = lines.send("[DONE]".to_string()).await;
                    return;
                }
            }
        }
    });
    let stream = futures_util::stream::unfold(out, |mut out| async move {
        let line = out.recv().await?;
        Some((Ok::<_, std::convert::Infallible>(Event::default().data(line)), out))
    });
    Ok(Sse::new(stream)
        .keep_alive(axum::response::sse::KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response())
}

/// The response's assistant message: the text (null when the answer is only calls) and the calls.
fn message(id: &str, c: &Completion) -> Value {
    if c.tool_calls.is_empty() {
        return json!({"role": "assistant", "content": c.text});
    }
    let content = if c.text.trim().is_empty() { Value::Null } else { json!(c.text) };
    json!({"role": "assistant", "content": content, "tool_calls": tool_calls_json(id, &c.tool_calls, false)})
}

fn usage(c: &Completion) -> Value {
    json!({
        "prompt_tokens": c.prompt_tokens,
        "completion_tokens": c.token_ids.len(),
        "total_tokens": c.prompt_tokens + c.token_ids.len(),
        // `image_tokens` and `video_tokens` are ours (OpenAI has no such fields; clients ignore
        // them): the prompt tokens that stand for images and videos, after their pixel budgets.
        "prompt_tokens_details": {
            "cached_tokens": c.cached_tokens,
            "image_tokens": c.image_tokens,
            "video_tokens": c.video_tokens,
        },
    })
}

struct Parsed {
    req: Request,
    stream: bool,
    include_usage: bool,
}

fn field<'a>(v: &'a Value, name: &str) -> Option<&'a Value> {
    v.get(name).filter(|x| !x.is_null())
}

fn num(v: &Value, name: &str) -> std::result::Result<Option<f64>, ApiError> {
    match field(v, name) {
        None => Ok(None),
        Some(x) => x.as_f64().map(Some).ok_or_else(|| ApiError::bad(format!("`{name}` must be a number, got {x}"))),
    }
}

fn uint(v: &Value, name: &str) -> std::result::Result<Option<u64>, ApiError> {
    match field(v, name) {
        None => Ok(None),
        Some(x) => x
            .as_u64()
            .map(Some)
            .ok_or_else(|| ApiError::bad(format!("`{name}` must be a non-negative integer, got {x}"))),
    }
}

fn parse_request(app: &App, v: &Value) -> std::result::Result<Parsed, ApiError> {
    if !v.is_object() {
        return Err(ApiError::bad("the body must be a JSON object"));
    }
    if let Some(m) = field(v, "model") {
        let m = m.as_str().ok_or_else(|| ApiError::bad("`model` must be a string"))?;
        if m != app.id {
            return Err(ApiError::with(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                "model_not_found",
                format!("the model `{m}` does not exist; this server serves `{}`", app.id),
            ));
        }
    }
    if let Some(n) = uint(v, "n")? {
        if n != 1 {
            return Err(ApiError::bad(format!("`n` = {n}: only one choice per request is supported")));
        }
    }
    if field(v, "functions").is_some() || field(v, "function_call").is_some() {
        return Err(ApiError::bad("`functions` / `function_call` (deprecated) are not supported: use `tools`"));
    }
    let mut tools = match field(v, "tools") {
        None => vec![],
        Some(Value::Array(list)) => list.clone(),
        Some(_) => return Err(ApiError::bad("`tools` must be a list")),
    };
    if tools.len() > 128 {
        return Err(ApiError::bad(format!("`tools`: {} functions, at most 128", tools.len())));
    }
    for (i, t) in tools.iter().enumerate() {
        if t.get("type").and_then(Value::as_str) != Some("function")
            || t.get("function").and_then(|f| f.get("name")).and_then(Value::as_str).is_none()
        {
            return Err(ApiError::bad(format!(
                "`tools[{i}]` must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"
            )));
        }
    }
    match field(v, "tool_choice") {
        None | Some(Value::Null) => {}
        Some(Value::String(c)) if c == "auto" => {}
        // The model is not told about the functions.
        Some(Value::String(c)) if c == "none" => tools.clear(),
        Some(c) => {
            return Err(ApiError::bad(format!(
                "`tool_choice` = {c}: only \"auto\" and \"none\" are supported (no constrained decoding)"
            )))
        }
    }
    if field(v, "logprobs").and_then(Value::as_bool) == Some(true) {
        return Err(ApiError::bad("`logprobs` is not supported by this server yet"));
    }
    let stream = match field(v, "stream") {
        None => false,
        Some(s) => s.as_bool().ok_or_else(|| ApiError::bad("`stream` must be a boolean"))?,
    };
    let include_usage = field(v, "stream_options")
        .and_then(|o| o.get("include_usage"))
        .map(|b| b.as_bool().ok_or_else(|| ApiError::bad("`stream_options.include_usage` must be a boolean")))
        .transpose()?
        .unwrap_or(false);

    let mut o = app.defaults.clone();
    let max = match (uint(v, "max_completion_tokens")?, uint(v, "max_tokens")?) {
        (Some(a), _) => Some(a),
        (None, b) => b,
    };
    if let Some(m) = max {
        if m == 0 {
            return Err(ApiError::bad("`max_tokens` must be at least 1"));
        }
        o.max_new_tokens = m.min(app.context as u64) as usize;
    } else {
        o.max_new_tokens = app.context;
    }
    if let Some(t) = num(v, "temperature")? {
        if !(0.0..=2.0).contains(&t) {
            return Err(ApiError::bad(format!("`temperature` = {t} must be in [0, 2]")));
        }
        o.temperature = t;
    }
    if let Some(p) = num(v, "top_p")? {
        o.top_p = p;
    }
    if let Some(k) = field(v, "top_k") {
        // vLLM's convention: -1 disables.
        o.top_k = match k.as_i64() {
            Some(-1) => 0,
            Some(k) if k >= 0 => k as usize,
            _ => return Err(ApiError::bad(format!("`top_k` must be an integer >= 0 (or -1), got {k}"))),
        };
    }
    if let Some(p) = num(v, "min_p")? {
        o.min_p = p;
    }
    if let Some(p) = num(v, "presence_penalty")? {
        o.presence_penalty = p;
    }
    if let Some(p) = num(v, "frequency_penalty")? {
        o.frequency_penalty = p;
    }
    if let Some(p) = num(v, "repetition_penalty")? {
        o.repetition_penalty = p;
    }
    if let Some(s) = field(v, "seed") {
        o.seed = match s.as_i64() {
            Some(s) => s as u64,
            None => return Err(ApiError::bad(format!("`seed` must be an integer, got {s}"))),
        };
    }
    o.validate().map_err(|e| ApiError::bad(e.to_string()))?;
    let stop: Vec<String> = match field(v, "stop") {
        None => vec![],
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|s| {
                s.as_str()
                    .map(String::from)
                    .ok_or_else(|| ApiError::bad("`stop` must be a string or a list of strings"))
            })
            .collect::<std::result::Result<_, _>>()?,
        Some(_) => return Err(ApiError::bad("`stop` must be a string or a list of strings")),
    };
    if stop.len() > 16 || stop.iter().any(|s| s.is_empty() || s.len() > 256) {
        return Err(ApiError::bad("`stop`: at most 16 non-empty strings of at most 256 bytes"));
    }

    let msgs = field(v, "messages")
        .ok_or_else(|| ApiError::bad("`messages` is required"))?
        .as_array()
        .ok_or_else(|| ApiError::bad("`messages` must be a list"))?;
    if msgs.is_empty() {
        return Err(ApiError::bad("`messages` must not be empty"));
    }
    let mut messages = Vec::with_capacity(msgs.len());
    for (i, m) in msgs.iter().enumerate() {
        let role = m
            .get("role")
            .and_then(Value::as_str)
            .ok_or_else(|| ApiError::bad(format!("`messages[{i}].role` must be a string")))?;
        let role = match role {
            "system" | "user" | "assistant" | "tool" => role,
            "developer" => "system",
            other => return Err(ApiError::bad(format!("`messages[{i}].role` = {other:?} is not a known role"))),
        };
        let tool_calls = match m.get("tool_calls") {
            None | Some(Value::Null) => vec![],
            Some(Value::Array(calls)) if role == "assistant" => calls
                .iter()
                .enumerate()
                .map(|(j, c)| tool_call(c, &format!("messages[{i}].tool_calls[{j}]")))
                .collect::<std::result::Result<_, _>>()?,
            Some(_) => {
                return Err(ApiError::bad(format!("`messages[{i}].tool_calls` must be a list on an assistant message")))
            }
        };
        let parts = match m.get("content") {
            None | Some(Value::Null) if role == "assistant" => vec![],
            Some(Value::String(s)) => vec![Part::Text(s.clone())],
            Some(Value::Array(items)) => items
                .iter()
                .enumerate()
                .map(|(j, p)| part(app, p, &format!("messages[{i}].content[{j}]")))
                .collect::<std::result::Result<_, _>>()?,
            _ => return Err(ApiError::bad(format!("`messages[{i}].content` must be a string or a list of parts"))),
        };
        let mut msg = ChatMessage::new(role, parts);
        msg.tool_calls = tool_calls;
        messages.push(msg);
    }
    Ok(Parsed { req: Request { messages, options: o, stop, tools }, stream, include_usage })
}

/// An assistant message's call, `{"type": "function", "function": {"name", "arguments"}}`
/// (arguments as JSON text, or an object).
fn tool_call(c: &Value, at: &str) -> std::result::Result<ToolCall, ApiError> {
    let f = c.get("function").ok_or_else(|| ApiError::bad(format!("`{at}.function` is required")))?;
    let name = f
        .get("name")
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::bad(format!("`{at}.function.name` must be a string")))?;
    let arguments = match f.get("arguments") {
        None | Some(Value::Null) => "{}".to_string(),
        Some(Value::String(s)) => s.clone(),
        Some(a @ Value::Object(_)) => a.to_string(),
        Some(_) => return Err(ApiError::bad(format!("`{at}.function.arguments` must be a JSON string"))),
    };
    Ok(ToolCall { name: name.into(), arguments })
}

/// The OpenAI shape of the answer's calls; ids are unique per response.
fn tool_calls_json(response_id: &str, calls: &[ToolCall], streaming: bool) -> Value {
    calls
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let mut v = json!({"id": format!("call_{}_{i}", response_id.trim_start_matches("chatcmpl-")),
                               "type": "function", "function": {"name": c.name, "arguments": c.arguments}});
            if streaming {
                v["index"] = json!(i);
            }
            v
        })
        .collect()
}

fn part(app: &App, p: &Value, at: &str) -> std::result::Result<Part, ApiError> {
    let kind =
        p.get("type").and_then(Value::as_str).ok_or_else(|| ApiError::bad(format!("`{at}.type` must be a string")))?;
    match kind {
        "text" => Ok(Part::Text(
            p.get("text")
                .and_then(Value::as_str)
                .ok_or_else(|| ApiError::bad(format!("`{at}.text` must be a string")))?
                .into(),
        )),
        "image_url" | "image" => {
            let iu = p.get("image_url").or_else(|| p.get("image"));
            let url = match iu {
                Some(Value::String(s)) => s.as_str(),
                Some(o @ Value::Object(_)) => o
                    .get("url")
                    .and_then(Value::as_str)
                    .ok_or_else(|| ApiError::bad(format!("`{at}.image_url.url` must be a string")))?,
                _ => return Err(ApiError::bad(format!("`{at}.image_url` must be an object with a `url`"))),
            };
            let budget = |name: &str| -> std::result::Result<Option<usize>, ApiError> {
                let from = [Some(p), iu].into_iter().flatten().find_map(|o| field(o, name));
                match from {
                    None => Ok(None),
                    Some(x) => x
                        .as_u64()
                        .map(|n| Some(n as usize))
                        .ok_or_else(|| ApiError::bad(format!("`{at}.{name}` must be a positive integer"))),
                }
            };
            let (min_pixels, max_pixels) = (budget("min_pixels")?, budget("max_pixels")?);
            let (data, name) = media_bytes(app, url, at, "image")?;
            Ok(Part::Image { data, name, min_pixels, max_pixels })
        }
        "video_url" | "video" | "input_video" => video_part(app, p, kind, at),
        other => Err(ApiError::bad(format!(
            "`{at}.type` = {other:?}: expected `text`, `image_url`, `video_url` or `input_video`"
        ))),
    }
}

/// A video part: `{"type": "video_url", "video_url": {"url": ...}}` (data URL, http(s) URL with
/// --allow-remote-media, or a path under --allowed-media-dir: a file or a directory of frames)
/// or `{"type": "input_video", "input_video": {"data": BASE64}}` (or `{"url": ...}`), with
/// optional `fps`, `max_frames`, `max_pixels` beside or inside the object.
fn video_part(app: &App, p: &Value, kind: &str, at: &str) -> std::result::Result<Part, ApiError> {
    let inner = p.get(kind);
    let (url, data) = match inner {
        Some(Value::String(s)) => (Some(s.as_str()), None),
        Some(o @ Value::Object(_)) => (o.get("url").and_then(Value::as_str), o.get("data").and_then(Value::as_str)),
        _ => return Err(ApiError::bad(format!("`{at}.{kind}` must be an object with a `url` (or `data`)"))),
    };
    let from = |name: &str| [Some(p), inner].into_iter().flatten().find_map(|o| field(o, name));
    let count = |name: &str| -> std::result::Result<Option<usize>, ApiError> {
        from(name)
            .map(|x| {
                x.as_u64()
                    .map(|n| n as usize)
                    .ok_or_else(|| ApiError::bad(format!("`{at}.{name}` must be a positive integer")))
            })
            .transpose()
    };
    let fps = from("fps")
        .map(|x| x.as_f64().ok_or_else(|| ApiError::bad(format!("`{at}.fps` must be a number"))))
        .transpose()?;
    let options = vl_models::qwen3_vl::VideoOptions {
        fps,
        max_frames: count("max_frames")?,
        max_pixels: count("max_pixels")?,
        ..Default::default()
    };
    let (source, name) = match (data, url) {
        (Some(b64), _) => {
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(b64.trim())
                .map_err(|e| ApiError::bad(format!("`{at}`: invalid base64 video data: {e}")))?;
            (VideoData::Bytes(bytes), format!("{at} (data)"))
        }
        (None, Some(url)) if url.starts_with("data:") || url.starts_with("http://") || url.starts_with("https://") => {
            let (bytes, name) = media_bytes(app, url, at, "video")?;
            (VideoData::Bytes(bytes), name)
        }
        (None, Some(url)) => {
            let path = url.strip_prefix("file://").unwrap_or(url);
            (VideoData::Path(allowed_path(app, path, at, "video")?), path.to_string())
        }
        (None, None) => return Err(ApiError::bad(format!("`{at}.{kind}` needs a `url` or `data`"))),
    };
    Ok(Part::Video { source, name, options })
}

/// `path` resolved, when it lies under --allowed-media-dir.
fn allowed_path(app: &App, path: &str, at: &str, what: &str) -> std::result::Result<PathBuf, ApiError> {
    let Some(root) = &app.allowed_media_dir else {
        return Err(ApiError::bad(format!(
            "`{at}`: local {what} paths are disabled; start the server with --allowed-media-dir DIR or send a data URL"
        )));
    };
    let real = std::path::Path::new(path)
        .canonicalize()
        .map_err(|e| ApiError::bad(format!("`{at}`: cannot open {path}: {e}")))?;
    if !real.starts_with(root) {
        return Err(ApiError::with(
            StatusCode::FORBIDDEN,
            "invalid_request_error",
            "media_not_allowed",
            format!("`{at}`: {path} is outside the allowed media directory"),
        ));
    }
    Ok(real)
}

enum Fetch {
    TooLarge(u64),
    Failed(String),
}

/// GETs `url` within `timeout` in all and at most `max` bytes (an announced or actual larger
/// body is refused without reading it all).
fn fetch(url: &str, timeout: Duration, max: u64) -> std::result::Result<Vec<u8>, Fetch> {
    use std::io::Read;
    let agent = ureq::AgentBuilder::new().timeout(timeout).redirects(3).build();
    let resp = agent.get(url).call().map_err(|e| Fetch::Failed(e.to_string()))?;
    if let Some(n) = resp.header("content-length").and_then(|v| v.parse::<u64>().ok()) {
        if n > max {
            return Err(Fetch::TooLarge(n));
        }
    }
    let mut data = Vec::new();
    resp.into_reader().take(max + 1).read_to_end(&mut data).map_err(|e| Fetch::Failed(e.to_string()))?;
    if data.len() as u64 > max {
        return Err(Fetch::TooLarge(data.len() as u64));
    }
    Ok(data)
}

/// An image's (a video's) bytes from a data URL, an http(s) URL (with --allow-remote-media) or, under
/// --allowed-media-dir, a local path.
fn media_bytes(app: &App, url: &str, at: &str, what: &str) -> std::result::Result<(Vec<u8>, String), ApiError> {
    let too_big = |n: u64| {
        ApiError::with(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            if what == "video" { "video_too_large" } else { "image_too_large" },
            format!("`{at}`: the {what} is {n} bytes, over the server's limit of {} bytes", app.max_image_bytes),
        )
    };
    if let Some(rest) = url.strip_prefix("data:") {
        let (meta, payload) =
            rest.split_once(',').ok_or_else(|| ApiError::bad(format!("`{at}`: malformed data URL")))?;
        if !meta.ends_with(";base64") {
            return Err(ApiError::bad(format!("`{at}`: only base64 data URLs are supported")));
        }
        if payload.len() as u64 / 4 * 3 > app.max_image_bytes + 3 {
            return Err(too_big(payload.len() as u64 / 4 * 3));
        }
        let data = base64::engine::general_purpose::STANDARD
            .decode(payload.trim())
            .map_err(|e| ApiError::bad(format!("`{at}`: invalid base64 {what} data: {e}")))?;
        return Ok((data, format!("{at} (data URL)")));
    }
    if url.starts_with("http://") || url.starts_with("https://") {
        let Some(timeout) = app.remote_media else {
            return Err(ApiError::bad(format!(
                "`{at}`: remote {what} URLs are disabled; start the server with --allow-remote-media or send a base64 data URL"
            )));
        };
        // A blocking fetch on this worker thread (the runtime keeps serving on the other).
        let data = tokio::task::block_in_place(|| fetch(url, timeout, app.max_image_bytes)).map_err(|e| match e {
            Fetch::TooLarge(n) => too_big(n),
            Fetch::Failed(m) => ApiError::bad(format!("`{at}`: cannot fetch {url}: {m}")),
        })?;
        return Ok((data, url.to_string()));
    }
    let path = url.strip_prefix("file://").unwrap_or(url);
    let real = allowed_path(app, path, at, "image")?;
    let data =
        vl_models::limits::read_bytes(&real, app.max_image_bytes, LimitKind::ImageBytes).map_err(|e| match e {
            vl_models::Error::Limit { .. } => too_big(std::fs::metadata(&real).map_or(0, |m| m.len())),
            other => ApiError::bad(format!("`{at}`: {other}")),
        })?;
    Ok((data, path.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use vl_models::engine::Finish;

    fn completion(text: &str, calls: Vec<ToolCall>) -> Completion {
        Completion {
            text: text.into(),
            finish: if calls.is_empty() { Finish::Stop } else { Finish::ToolCalls },
            tool_calls: calls,
            token_ids: vec![],
            prompt_tokens: 0,
            cached_tokens: 0,
            image_tokens: 0,
            video_tokens: 0,
            videos: vec![],
            image_cache_hits: 0,
            video_cache_hits: 0,
            vision_time: Duration::ZERO,
            prefill_time: Duration::ZERO,
            decode_time: Duration::ZERO,
            time_to_first_token: Duration::ZERO,
            first_logits: vec![],
            kv_cache_bytes: 0,
        }
    }

    #[test]
    fn calls_take_the_openai_shape() {
        let call = ToolCall { name: "get_weather".into(), arguments: r#"{"city": "Zürich"}"#.into() };
        let c = completion("\n", vec![call.clone(), call]);
        assert_eq!(c.finish.openai(), "tool_calls");
        let m = message("chatcmpl-7", &c);
        // Whitespace before the first call is no content.
        assert_eq!(m["content"], Value::Null);
        assert_eq!(m["tool_calls"][1]["id"], "call_7_1");
        assert_eq!(m["tool_calls"][0]["type"], "function");
        assert_eq!(m["tool_calls"][0]["function"]["name"], "get_weather");
        assert_eq!(m["tool_calls"][0]["function"]["arguments"], r#"{"city": "Zürich"}"#);
        assert!(m["tool_calls"][0].get("index").is_none());
        assert_eq!(tool_calls_json("chatcmpl-7", &c.tool_calls, true)[1]["index"], 1);
        let plain = message("chatcmpl-8", &completion("Hello", vec![]));
        assert_eq!(plain, json!({"role": "assistant", "content": "Hello"}));
    }
}
