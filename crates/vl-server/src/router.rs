//! The routes: `/v1/chat/completions` (streamed as SSE or gathered), `/v1/models`, `/health`,
//! `/metrics`; the guard every request passes (CORS, API key, one log line); and the worker
//! threads that hand requests to the engine and relay its stream.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, StatusCode};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::{json, Value};
use tokio::sync::mpsc;
use vl_models::engine::{Completion, Engine, Request, ToolCall};

use crate::error::ApiError;
use crate::metrics::{count, metrics, Metrics};
use crate::request::{parse, typed};
use crate::{ServerConfig, ServerError};

/// A parsed request and where its answer goes.
struct Job {
    req: Request,
    /// Answers asked for (`n`).
    n: usize,
    /// `parallel_tool_calls: false`: each answer keeps its first call.
    one_call: bool,
    tx: mpsc::Sender<Msg>,
    queued: Instant,
}

/// Messages a request's relay may hold unread: past them the worker waits for the client (and
/// the engine pauses the request's sequences once their own pieces pile up).
const RELAY_MESSAGES: usize = 32;

/// Hands `msg` to the request's relay, waiting while the relay is full (a client that stopped
/// reading) at most `limit`; false when the client is gone or stalled past `limit` (the request
/// is then cancelled and its slot freed).
fn relay(tx: &mpsc::Sender<Msg>, mut msg: Msg, limit: Duration) -> bool {
    let started = Instant::now();
    loop {
        match tx.try_send(msg) {
            Ok(()) => return true,
            Err(mpsc::error::TrySendError::Closed(_)) => return false,
            Err(mpsc::error::TrySendError::Full(m)) => {
                if started.elapsed() >= limit {
                    return false;
                }
                msg = m;
                std::thread::sleep(Duration::from_millis(2));
            }
        }
    }
}

/// One `Done` per request, after its texts: its size is no concern.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Msg {
    /// A piece of choice `.0`'s answer (of its reasoning when `.2`) and its tokens'
    /// log-probabilities (JSON, null when not asked).
    Text(usize, String, bool, Value),
    /// Every choice's completion, in order.
    Done(std::result::Result<Vec<Completion>, ApiError>),
}

pub(crate) struct App {
    pub config: ServerConfig,
    pub engine: Arc<Engine>,
    created: u64,
    /// The queue's sending side; taken (closing the queue) when the server stops.
    jobs: std::sync::Mutex<Option<std::sync::mpsc::SyncSender<Job>>>,
    /// Requests handed over and not yet answered, at most `workers`.
    in_flight: AtomicUsize,
    workers: usize,
    pub context: usize,
    pub metrics: Metrics,
    next_id: AtomicU64,
}

/// Serves the OpenAI API for `engine` on `listener` until SIGINT or SIGTERM; then stops
/// accepting, lets running requests finish, and returns.
pub fn serve(engine: Arc<Engine>, listener: std::net::TcpListener, config: ServerConfig) -> Result<(), ServerError> {
    // A library caller gets the same checks as `vl serve`: a key some request can send, origins
    // as browsers write them.
    if let Some(key) = config.api_key.as_deref() {
        crate::check_api_key(key)?;
    }
    let mut config = config;
    config.cors_origins = crate::cors_origins(&config.cors_origins)?;
    listener.set_nonblocking(true)?;
    let local = listener.local_addr()?;
    if !local.ip().is_loopback() && config.api_key.is_none() {
        note!(
            "warning: listening on {local}, reachable from other machines, without --api-key: anyone who can reach it can use the model"
        );
    }
    // Each request in flight holds a worker thread that relays the engine's stream: the engine's
    // parallel sequences plus `queue` waiting. A request finding no idle worker is refused (503).
    let workers_n = engine.options().parallel + config.queue;
    let (jobs, rx) = std::sync::mpsc::sync_channel::<Job>(workers_n);
    let rx = Arc::new(std::sync::Mutex::new(rx));
    let app = Arc::new(App {
        in_flight: AtomicUsize::new(0),
        workers: workers_n,
        context: engine.context(),
        engine,
        config,
        created: SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()),
        jobs: std::sync::Mutex::new(Some(jobs)),
        metrics: Metrics::new(),
        next_id: AtomicU64::new(1),
    });
    let mut workers = Vec::new();
    for i in 0..workers_n {
        let (app, rx) = (app.clone(), rx.clone());
        workers.push(std::thread::Builder::new().name(format!("vl-worker-{i}")).spawn(move || work(&app, &rx))?);
    }

    let mut router = Router::new();
    if app.config.ui {
        router = router
            .route("/", get(|| async { page(UI_HTML, "text/html; charset=utf-8") }))
            .route("/ui/app.js", get(|| async { page(UI_JS, "text/javascript; charset=utf-8") }))
            .route("/ui/app.css", get(|| async { page(UI_CSS, "text/css; charset=utf-8") }));
    }
    let router = router
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/responses", post(responses))
        .route("/v1/models", get(models))
        .route("/v1/models/{*name}", get(model))
        .route("/health", get(|| async { axum::Json(json!({"status": "ok"})) }))
        .route("/metrics", get(metrics))
        .fallback(|| async {
            ApiError::with(StatusCode::NOT_FOUND, "invalid_request_error", "not_found", "no such endpoint")
        })
        .method_not_allowed_fallback(|method: axum::http::Method, uri: axum::http::Uri| async move {
            ApiError::with(
                StatusCode::METHOD_NOT_ALLOWED,
                "invalid_request_error",
                "method_not_allowed",
                format!("{method} is not allowed on {}", uri.path()),
            )
        })
        .layer(axum::middleware::from_fn_with_state(app.clone(), guard))
        .layer(DefaultBodyLimit::disable())
        .with_state(app.clone());

    let (ui, limits) = (app.config.ui, app.config.connections);
    // When the stop signal came: the shutdown bound counts from there, for the connections and
    // the workers together.
    let stopped_at = Arc::new(std::sync::OnceLock::<Instant>::new());
    let stop_mark = stopped_at.clone();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let done = rt.block_on(async move {
        let listener = tokio::net::TcpListener::from_std(listener)?;
        note!("listening on http://{local}");
        if ui {
            note!("web chat: http://{local}/");
        }
        let stop = async move {
            shutdown_signal().await;
            let _ = stop_mark.set(Instant::now());
            note!(
                "stopping: no new connections; finishing the requests in flight (at most {} s)",
                limits.shutdown_timeout.as_secs_f64()
            );
        };
        Ok::<_, std::io::Error>(crate::conn::serve_connections(listener, router, limits, stop).await)
    })?;
    // Close the queue: the workers finish what they hold, then return, within what is left of
    // the shutdown bound.
    app.jobs.lock().unwrap_or_else(|p| p.into_inner()).take();
    let bound = app.config.connections.shutdown_timeout;
    drop(app);
    let (tx, all_joined) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for w in workers {
            let _ = w.join();
        }
        let _ = tx.send(());
    });
    let left = bound.saturating_sub(stopped_at.get().map_or(Duration::ZERO, |t| t.elapsed()));
    if !done || all_joined.recv_timeout(left).is_err() {
        note!("stopped at the shutdown bound of {} s: requests still running were cut", bound.as_secs_f64());
    } else {
        note!("stopped");
    }
    rt.shutdown_timeout(Duration::from_millis(100));
    Ok(())
}

/// The web chat (`crates/vl-server/ui`), embedded: one page, its script and its style.
const UI_HTML: &str = include_str!("../ui/index.html");
const UI_JS: &str = include_str!("../ui/app.js");
const UI_CSS: &str = include_str!("../ui/app.css");
/// The page loads and calls nothing outside this server; model output never becomes markup
/// (the script only writes text nodes), and the policy would stop an injected script anyway.
const UI_CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; \
    media-src 'self' data: blob:; connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// The web chat's paths, served without the API key (the page asks for it).
fn is_ui_path(path: &str) -> bool {
    matches!(path, "/" | "/ui/app.js" | "/ui/app.css")
}

fn page(body: &'static str, content_type: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CONTENT_SECURITY_POLICY, UI_CSP),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
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

/// A request's place among those in flight, given back when the worker is done with it.
struct Slot<'a>(&'a AtomicUsize);

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A worker: takes a request when idle, hands it to the engine (whose scheduler batches it with
/// the others) and relays its stream; a request whose client left is skipped.
fn work(app: &App, rx: &std::sync::Mutex<std::sync::mpsc::Receiver<Job>>) {
    loop {
        let next = rx.lock().unwrap_or_else(|p| p.into_inner()).recv();
        let Ok(job) = next else { return };
        app.metrics.queue_depth.dec();
        let _slot = Slot(&app.in_flight);
        if job.tx.is_closed() {
            continue;
        }
        app.metrics.queue_wait.observe(job.queued.elapsed().as_secs_f64());
        app.metrics.running.inc();
        let mut first = true;
        // The client stopped reading past the stall timeout (or left): the answer's end is not
        // waited for again.
        let mut gone = false;
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let want = job.req.options.logprobs.is_some();
            app.engine.stream(&job.req, job.n, &mut |d| {
                if first {
                    first = false;
                    app.metrics.ttft.observe(job.queued.elapsed().as_secs_f64());
                }
                let lp = if want { logprobs_json(app, d.logprobs) } else { Value::Null };
                let sent = relay(
                    &job.tx,
                    Msg::Text(d.choice, d.text.to_string(), d.reasoning, lp),
                    app.config.connections.stall_timeout,
                );
                gone |= !sent;
                sent
            })
        }));
        app.metrics.running.dec();
        let done = match result {
            Ok(Ok(mut all)) => {
                if job.one_call {
                    crate::request::keep_one_call(&mut all);
                }
                let c = &all[0];
                app.metrics.prompt_tokens.inc_by(c.prompt_tokens as u64);
                app.metrics.cached_tokens.inc_by(c.cached_tokens as u64);
                app.metrics.completion_tokens.inc_by(all.iter().map(|c| c.token_ids.len() as u64).sum());
                app.metrics.image_cache_hits.inc_by(c.image_cache_hits as u64);
                app.metrics.video_cache_hits.inc_by(c.video_cache_hits as u64);
                Ok(all)
            }
            Ok(Err(e)) => Err(ApiError::from_engine(&e)),
            Err(_) => Err(ApiError::with(
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                "internal_error",
                "internal error while generating (a bug; see the server log)",
            )),
        };
        let wait = if gone { Duration::ZERO } else { app.config.connections.stall_timeout };
        relay(&job.tx, Msg::Done(done), wait);
    }
}

/// Every request: CORS preflight answered, the API key checked, CORS headers added, and one
/// log line on stderr (a chat completion answered 200 logs its own line with token counts when
/// its answer ends).
async fn guard(State(app): State<Arc<App>>, req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let t = Instant::now();
    let (method, path) = (req.method().clone(), req.uri().path().to_string());
    let origin = req.headers().get(header::ORIGIN).and_then(|o| o.to_str().ok()).map(String::from);
    let allowed = origin.filter(|o| app.config.cors_origins.iter().any(|a| a == "*" || a.eq_ignore_ascii_case(o)));
    let preflight = method == axum::http::Method::OPTIONS;
    let mut resp = if preflight {
        let mut r = StatusCode::NO_CONTENT.into_response();
        if allowed.is_some() {
            // The headers the page asks to send (the openai SDK's `x-stainless-*` ones, ...),
            // echoed when each is a header name; the usual two otherwise.
            let asked = req.headers().get(header::ACCESS_CONTROL_REQUEST_HEADERS).and_then(requested_headers);
            let h = r.headers_mut();
            h.insert(header::ACCESS_CONTROL_ALLOW_METHODS, header::HeaderValue::from_static("GET, POST, OPTIONS"));
            h.insert(
                header::ACCESS_CONTROL_ALLOW_HEADERS,
                asked.unwrap_or(header::HeaderValue::from_static("authorization, content-type")),
            );
            h.insert(header::ACCESS_CONTROL_MAX_AGE, header::HeaderValue::from_static("600"));
        }
        r
    } else if path != "/health" && !(app.config.ui && is_ui_path(&path)) && !authorized(&app, req.headers()) {
        // The body is read (within the size limit) before the answer, so that a client still
        // sending it gets the 401 rather than a broken connection.
        let _ = axum::body::to_bytes(req.into_body(), app.config.max_body_bytes).await;
        ApiError::with(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            "invalid_api_key",
            "missing or wrong API key: send the header `Authorization: Bearer KEY`",
        )
        .into_response()
    } else {
        next.run(req).await
    };
    if let Some(o) = allowed.and_then(|o| header::HeaderValue::from_str(&o).ok()) {
        resp.headers_mut().insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, o);
        let vary =
            if preflight { "origin, access-control-request-method, access-control-request-headers" } else { "origin" };
        resp.headers_mut().insert(header::VARY, header::HeaderValue::from_static(vary));
    }
    let status = resp.status();
    // An answered completion logs its own line, with its token counts, when its answer ends.
    let answers = ["/v1/chat/completions", "/v1/completions", "/v1/responses"];
    if !(answers.contains(&path.as_str()) && status == StatusCode::OK) {
        // The method and path are the client's: escaped, so they cannot forge or hide log text.
        let (method, path) = (escape_log(method.as_str()), escape_log(&path));
        note!("{method} {path} {} total={:.3}s", status.as_u16(), t.elapsed().as_secs_f64());
    }
    resp
}

/// Whether the request carries the server's key (always, when it has none): `Authorization:
/// Bearer KEY`, the scheme in any case and the blanks around it and the key free (RFC 7235).
fn authorized(app: &App, headers: &axum::http::HeaderMap) -> bool {
    let Some(key) = &app.config.api_key else { return true };
    let blank = [' ', '\t'];
    let sent = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| {
        let (scheme, credentials) = v.trim_matches(blank).split_once(blank)?;
        scheme.eq_ignore_ascii_case("bearer").then(|| credentials.trim_matches(blank))
    });
    // Compared in full whatever the first difference, so the time taken says nothing of the key.
    sent.is_some_and(|s| s.len() == key.len() && s.bytes().zip(key.bytes()).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0)
}

/// Most header names a preflight's `Access-Control-Request-Headers` may list, and its length, for
/// the list to be echoed.
const MAX_REQUESTED_HEADERS: usize = 64;
const MAX_REQUESTED_HEADERS_BYTES: usize = 4096;

/// A preflight's `Access-Control-Request-Headers` as the `Access-Control-Allow-Headers` to
/// answer: the names lowercased, when every one is an HTTP token (RFC 9110 `tchar`s) and there
/// are at most `MAX_REQUESTED_HEADERS` in `MAX_REQUESTED_HEADERS_BYTES`; None otherwise.
fn requested_headers(v: &header::HeaderValue) -> Option<header::HeaderValue> {
    let v = v.to_str().ok().filter(|v| v.len() <= MAX_REQUESTED_HEADERS_BYTES)?;
    let tchar = |c: u8| c.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&c);
    let names: Vec<&str> = v.split(',').map(|n| n.trim_matches([' ', '\t'])).collect();
    let ok = names.len() <= MAX_REQUESTED_HEADERS && names.iter().all(|n| !n.is_empty() && n.bytes().all(tchar));
    if !ok {
        return None;
    }
    header::HeaderValue::from_str(&names.join(", ").to_ascii_lowercase()).ok()
}

/// Client-controlled text as it goes into a log line: every control and format character
/// (Unicode categories Cc, Cf, Zl, Zp: C0 and C1 controls, bidi overrides and isolates, zero-width
/// characters, line and paragraph separators) and the backslash written as `\u{XXXX}`, so a request
/// can neither break a line nor make one read otherwise than it is.
pub(crate) fn escape_log(s: &str) -> std::borrow::Cow<'_, str> {
    fn format_char(c: char) -> bool {
        matches!(c as u32,
            0xAD | 0x600..=0x605 | 0x61C | 0x6DD | 0x70F | 0x890..=0x891 | 0x8E2 | 0x180E
            | 0x200B..=0x200F | 0x2028..=0x202E | 0x2060..=0x2064 | 0x2066..=0x206F | 0xFEFF
            | 0xFFF9..=0xFFFB | 0x110BD | 0x110CD | 0x13430..=0x1343F | 0x1BCA0..=0x1BCA3
            | 0x1D173..=0x1D17A | 0xE0001 | 0xE0020..=0xE007F)
    }
    let escaped = |c: char| c.is_control() || c == '\\' || format_char(c);
    if !s.chars().any(escaped) {
        return std::borrow::Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 16);
    for c in s.chars() {
        if escaped(c) {
            out.push_str(&format!("\\u{{{:04X}}}", c as u32));
        } else {
            out.push(c);
        }
    }
    std::borrow::Cow::Owned(out)
}

/// The log line of an answered request to `path`.
pub(crate) fn log_answer(path: &str, all: &[Completion], started: Instant) {
    let c = &all[0];
    note!(
        "POST {path} 200 prompt={} cached={} completion={} ttft={:.3}s total={:.3}s",
        c.prompt_tokens,
        c.cached_tokens,
        all.iter().map(|c| c.token_ids.len()).sum::<usize>(),
        c.time_to_first_token.as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
}

/// The served model under `name` (its id or an alias), as OpenAI's model object.
fn model_object(app: &App, name: &str) -> Value {
    json!({"id": name, "object": "model", "created": app.created, "owned_by": "vl", "context_length": app.context})
}

/// `GET /v1/models`: the served model's id, then its aliases.
async fn models(State(app): State<Arc<App>>) -> Response {
    let names = std::iter::once(&app.config.id).chain(&app.config.aliases);
    axum::Json(json!({"object": "list", "data": names.map(|n| model_object(&app, n)).collect::<Vec<_>>()}))
        .into_response()
}

/// `GET /v1/models/{id}` (openai's `models.retrieve`): the model under that name, 404 for a name
/// the server does not list.
async fn model(State(app): State<Arc<App>>, axum::extract::Path(name): axum::extract::Path<String>) -> Response {
    if app.config.names(&name) {
        return axum::Json(model_object(&app, &name)).into_response();
    }
    ApiError::with(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        "model_not_found",
        format!("the model `{}` does not exist; this server serves `{}`", escape_log(&name), app.config.id),
    )
    .into_response()
}

async fn chat_completions(State(app): State<Arc<App>>, req: axum::extract::Request) -> Response {
    endpoint(app, req, Kind::Chat).await
}

/// `POST /v1/completions`: a raw prompt, no chat template.
async fn completions(State(app): State<Arc<App>>, req: axum::extract::Request) -> Response {
    endpoint(app, req, Kind::Text).await
}

/// `POST /v1/responses`: OpenAI's Responses API, stateless (`crate::responses`).
async fn responses(State(app): State<Arc<App>>, req: axum::extract::Request) -> Response {
    endpoint(app, req, Kind::Responses).await
}

/// Which OpenAI endpoint a request came to: the answers' shape follows it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Text,
    Responses,
}

async fn endpoint(app: Arc<App>, req: axum::extract::Request, kind: Kind) -> Response {
    let resp = match read_body(&app, req).await {
        Ok(body) => match handle(&app, body, kind).await {
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
            format!("the request body is {n} bytes, over the server's limit of {} bytes", app.config.max_body_bytes),
        )
    };
    let announced = req.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if let Some(n) = announced.filter(|&n| n > app.config.max_body_bytes as u64) {
        return Err(too_large(n.to_string()));
    }
    let timeout = app.config.connections.body_timeout;
    let read = tokio::time::timeout(timeout, axum::body::to_bytes(req.into_body(), app.config.max_body_bytes));
    let Ok(read) = read.await else {
        return Err(ApiError::with(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            "body_timeout",
            format!(
                "the request body did not arrive within {} s (--body-timeout){}",
                timeout.as_secs_f64(),
                announced.map(|n| format!("; Content-Length {n}")).unwrap_or_default()
            ),
        ));
    };
    read.map_err(|e| {
        // Over the limit, or a body that broke off (shorter than its Content-Length, a
        // connection closed mid-body): only the first is a 413.
        let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&e);
        let mut over = false;
        while let Some(s) = source {
            over |= s.to_string().contains("length limit exceeded");
            source = s.source();
        }
        if over {
            too_large(format!("more than {}", app.config.max_body_bytes))
        } else {
            let told = announced.map(|n| format!(" (Content-Length {n})")).unwrap_or_default();
            ApiError::with(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "incomplete_body",
                format!("the request body ended before it was complete{told}: {e}"),
            )
        }
    })
}

async fn handle(app: &Arc<App>, body: Bytes, kind: Kind) -> std::result::Result<Response, ApiError> {
    let started = Instant::now();
    // Parsing reads local media files and fetches remote ones: off the runtime's threads (the
    // runtime moves its other tasks to a fresh thread meanwhile).
    let (parsed, echo) = tokio::task::block_in_place(|| match kind {
        Kind::Chat => Ok((parse(app, typed(&body)?)?, None)),
        Kind::Text => Ok((crate::request::parse_completion(app, &body)?, None)),
        Kind::Responses => crate::responses::parse_responses(app, &body).map(|(p, e)| (p, Some(e))),
    })?;
    let stream = parsed.stream;
    let want_logprobs = parsed.req.options.logprobs.is_some();
    let (tx, mut rx) = mpsc::channel::<Msg>(RELAY_MESSAGES);
    let job = Job { req: parsed.req, n: parsed.n, one_call: parsed.one_call, tx, queued: Instant::now() };
    app.metrics.queue_depth.inc();
    // A place among the requests in flight (the engine's parallel sequences and the queue);
    // none left: 503.
    let sent = if app.in_flight.fetch_add(1, Ordering::SeqCst) >= app.workers {
        Err(std::sync::mpsc::TrySendError::Full(job))
    } else {
        match app.jobs.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            Some(q) => q.try_send(job),
            None => Err(std::sync::mpsc::TrySendError::Disconnected(job)),
        }
    };
    if let Err(e) = sent {
        app.in_flight.fetch_sub(1, Ordering::SeqCst);
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
    let prefix = if kind == Kind::Chat { "chatcmpl" } else { "cmpl" };
    let path = if kind == Kind::Chat { "/v1/chat/completions" } else { "/v1/completions" };
    let number = app.next_id.fetch_add(1, Ordering::Relaxed);
    let id = format!("{prefix}-{number}");
    let (object, chunk_object) = if kind == Kind::Chat {
        ("chat.completion", "chat.completion.chunk")
    } else {
        ("text_completion", "text_completion")
    };
    let created = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    // The first message decides the status: a request the engine refuses gets its error status
    // even when streaming.
    let first = rx.recv().await.ok_or_else(|| {
        ApiError::with(StatusCode::INTERNAL_SERVER_ERROR, "server_error", "internal_error", "the engine stopped")
    })?;
    if let Some(echo) = echo {
        return crate::responses::answer(app.clone(), echo, stream, first, rx, started, number).await;
    }
    if !stream {
        let mut msg = first;
        loop {
            match msg {
                Msg::Text(..) => {}
                Msg::Done(done) => {
                    let all = done?;
                    log_answer(path, &all, started);
                    let choices: Vec<Value> = all
                        .iter()
                        .enumerate()
                        .map(|(i, c)| {
                            let mut v = json!({
                                "index": i,
                                "finish_reason": c.finish.openai(),
                                "logprobs": if want_logprobs { logprobs_json(app, &c.logprobs) } else { Value::Null },
                            });
                            match kind {
                                Kind::Chat => v["message"] = message(&id, c),
                                _ => {
                                    v["text"] = json!(c.text);
                                    if want_logprobs {
                                        v["logprobs"] = legacy_logprobs(&v["logprobs"], &mut 0);
                                    }
                                }
                            }
                            if let Some(g) = grounding_json(app, c) {
                                v["grounding"] = g;
                            }
                            v
                        })
                        .collect();
                    return Ok(axum::Json(json!({
                        "id": id,
                        "object": object,
                        "created": created,
                        "model": app.config.id,
                        "choices": choices,
                        "usage": usage(&all),
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
    let model = app.config.id.clone();
    let (usage_id, usage_model) = (id.clone(), model.clone());
    let app2 = app.clone();
    let include_usage = parsed.include_usage;
    let n = parsed.n;
    // Each text completion choice's characters so far (the legacy logprobs' `text_offset`).
    let mut offsets = vec![0usize; n];
    let mut chunk = move |index: usize, delta: Value, finish: Value, logprobs: Value| {
        let mut choice = json!({"index": index, "finish_reason": finish, "logprobs": logprobs});
        match kind {
            Kind::Chat => choice["delta"] = delta,
            // A text completion's chunk carries the piece as `text`, its logprobs in the legacy
            // shape.
            _ => {
                choice["text"] = delta.get("content").cloned().unwrap_or(json!(""));
                if !choice["logprobs"].is_null() {
                    choice["logprobs"] = legacy_logprobs(&choice["logprobs"], &mut offsets[index]);
                }
            }
        }
        json!({"id": id, "object": chunk_object, "created": created, "model": model, "choices": [choice]})
    };
    // A task turns the worker's messages into SSE lines; when the client goes away the stream
    // (and its receiver) is dropped, the task's send fails, it drops the worker's channel, and
    // the worker's next send fails: the generation is cancelled.
    let (lines, out) = mpsc::channel::<String>(64);
    tokio::spawn(async move {
        let mut msg = Some(first);
        for i in (0..n).filter(|_| kind == Kind::Chat) {
            let role = chunk(i, json!({"role": "assistant", "content": ""}), Value::Null, Value::Null).to_string();
            if lines.send(role).await.is_err() {
                return;
            }
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
                Msg::Text(i, t, reasoning, lp) => {
                    let delta = if reasoning { json!({"reasoning_content": t}) } else { json!({"content": t}) };
                    if lines.send(chunk(i, delta, Value::Null, lp).to_string()).await.is_err() {
                        return;
                    }
                }
                Msg::Done(Ok(all)) => {
                    log_answer(path, &all, started);
                    for (i, c) in all.iter().enumerate() {
                        if !c.tool_calls.is_empty() {
                            let calls = tool_calls_json(&usage_id, &c.tool_calls, true);
                            let _ = lines
                                .send(chunk(i, json!({"tool_calls": calls}), Value::Null, Value::Null).to_string())
                                .await;
                        }
                        let mut last = chunk(i, json!({}), json!(c.finish.openai()), Value::Null);
                        if let Some(g) = grounding_json(&app2, c) {
                            last["choices"][0]["grounding"] = g;
                        }
                        let _ = lines.send(last.to_string()).await;
                    }
                    if include_usage {
                        let v = json!({"id": usage_id, "object": chunk_object, "created": created,
                                       "model": usage_model, "choices": [], "usage": usage(&all)});
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
    let mut m = if c.tool_calls.is_empty() {
        json!({"role": "assistant", "content": c.text})
    } else {
        let content = if c.text.trim().is_empty() { Value::Null } else { json!(c.text) };
        json!({"role": "assistant", "content": content, "tool_calls": tool_calls_json(id, &c.tool_calls, false)})
    };
    // A thinking checkpoint's reasoning block, apart from the answer (vLLM's and llama-server's
    // field).
    if let Some(r) = &c.reasoning {
        m["reasoning_content"] = json!(r);
    }
    m
}

/// OpenAI's `logprobs` object: `{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}`;
/// a token's text is its own decoding (a piece of a multi-byte character decodes to U+FFFD; its
/// `bytes` are those of that text).
fn logprobs_json(app: &App, lps: &[vl_models::engine::TokenLogprob]) -> Value {
    let tok = app.engine.family().tokenizer();
    let text = |t: u32| tok.decode(&[t], false).unwrap_or_default();
    let entry = |t: u32, lp: f32| {
        let s = text(t);
        json!({"token": s, "logprob": lp, "bytes": s.as_bytes()})
    };
    let content: Vec<Value> = lps
        .iter()
        .map(|l| {
            let mut e = entry(l.token, l.logprob);
            e["top_logprobs"] = l.top.iter().map(|&(t, lp)| entry(t, lp)).collect();
            e
        })
        .collect();
    json!({"content": content})
}

/// The legacy completions' `logprobs` (`{"tokens", "token_logprobs", "top_logprobs": [{token:
/// logprob}], "text_offset"}`) from the chat shape; `offset`: the characters of the choice's
/// text before these tokens, advanced past them.
fn legacy_logprobs(chat: &Value, offset: &mut usize) -> Value {
    let entries = chat["content"].as_array().cloned().unwrap_or_default();
    let mut text_offset = Vec::with_capacity(entries.len());
    for e in &entries {
        text_offset.push(*offset);
        *offset += e["token"].as_str().map_or(0, |t| t.chars().count());
    }
    json!({
        "tokens": entries.iter().map(|e| e["token"].clone()).collect::<Vec<_>>(),
        "token_logprobs": entries.iter().map(|e| e["logprob"].clone()).collect::<Vec<_>>(),
        "top_logprobs": entries
            .iter()
            .map(|e| {
                let top: serde_json::Map<String, Value> = e["top_logprobs"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|t| (t["token"].as_str().unwrap_or_default().to_string(), t["logprob"].clone()))
                    .collect();
                Value::Object(top)
            })
            .collect::<Vec<_>>(),
        "text_offset": text_offset,
    })
}

/// Ours, on a choice whose answer names boxes or points (`vl_models::grounding`): the shapes in
/// the answer's coordinates, then in pixels of each image of the request (as displayed, after
/// EXIF orientation), and what the parser noticed. None when the answer has neither.
/// docs/serving.md documents the shape.
fn grounding_json(app: &App, c: &Completion) -> Option<Value> {
    let g = app.engine.family().grounding()?;
    // Cheap test first: most answers name no shape.
    if !(c.text.contains("bbox_2d") || c.text.contains("point_2d")) {
        return None;
    }
    Some(vl_models::grounding::report(&c.text, g.coords, &c.images))
}

/// Usage of a request's choices: the prompt once, the completions summed.
fn usage(all: &[Completion]) -> Value {
    let c = &all[0];
    let completion: usize = all.iter().map(|c| c.token_ids.len()).sum();
    json!({
        "prompt_tokens": c.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": c.prompt_tokens + completion,
        // `image_tokens` and `video_tokens` are ours (OpenAI has no such fields; clients ignore
        // them): the prompt tokens that stand for images and videos, after their pixel budgets.
        "prompt_tokens_details": {
            "cached_tokens": c.cached_tokens,
            "image_tokens": c.image_tokens,
            "video_tokens": c.video_tokens,
        },
    })
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

#[cfg(test)]
mod tests {
    use super::*;
    use vl_models::engine::Finish;

    fn completion(text: &str, calls: Vec<ToolCall>) -> Completion {
        Completion {
            text: text.into(),
            reasoning: None,
            finish: if calls.is_empty() { Finish::Stop } else { Finish::ToolCalls },
            tool_calls: calls,
            token_ids: vec![],
            prompt_tokens: 0,
            cached_tokens: 0,
            image_tokens: 0,
            video_tokens: 0,
            videos: vec![],
            images: vec![],
            image_cache_hits: 0,
            video_cache_hits: 0,
            vision_time: Duration::ZERO,
            prefill_time: Duration::ZERO,
            decode_time: Duration::ZERO,
            time_to_first_token: Duration::ZERO,
            first_logits: vec![],
            logprobs: vec![],
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
