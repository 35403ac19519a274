//! The worker threads between the routes and the engine: a request in flight holds one, which
//! hands it to the engine (whose scheduler batches it with the others) and relays its stream to
//! the route as `Msg`s. A request finding no idle worker is refused (503).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use serde_json::Value;
use tokio::sync::mpsc;
use vl_models::engine::{Completion, Engine};

use crate::error::ApiError;
use crate::job::{Job, Msg};
use crate::state::{App, ServerConfig};

/// The worker threads of a running server.
pub(crate) struct Workers {
    threads: Vec<std::thread::JoinHandle<()>>,
}

/// The server's state over `engine` and its workers, started: the engine's parallel sequences
/// plus `config.queue` waiting, each request in flight holding one.
pub(crate) fn start(engine: Arc<Engine>, config: ServerConfig) -> std::io::Result<(Arc<App>, Workers)> {
    let n = engine.options().parallel + config.queue;
    let (jobs, rx) = std::sync::mpsc::sync_channel::<Job>(n);
    let rx = Arc::new(std::sync::Mutex::new(rx));
    let app = Arc::new(App::new(engine, config, n, jobs));
    let mut threads = Vec::with_capacity(n);
    for i in 0..n {
        let (app, rx) = (app.clone(), rx.clone());
        threads.push(std::thread::Builder::new().name(format!("vl-worker-{i}")).spawn(move || work(&app, &rx))?);
    }
    Ok((app, Workers { threads }))
}

impl Workers {
    /// Closes the queue (`app` is dropped): the workers finish what they hold, then return.
    /// Whether all returned within `left`.
    pub(crate) fn stop(self, app: Arc<App>, left: Duration) -> bool {
        app.jobs.lock().unwrap_or_else(|p| p.into_inner()).take();
        drop(app);
        let (tx, all_joined) = std::sync::mpsc::channel();
        let threads = self.threads;
        std::thread::spawn(move || {
            for w in threads {
                let _ = w.join();
            }
            let _ = tx.send(());
        });
        all_joined.recv_timeout(left).is_ok()
    }
}

/// Hands `job` to an idle worker: a place among the requests in flight (the engine's parallel
/// sequences and the queue), or 503 when none is left or the server is stopping.
pub(crate) fn submit(app: &App, job: Job) -> Result<(), ApiError> {
    app.metrics.queue_depth.inc();
    let sent = if app.in_flight.fetch_add(1, Ordering::SeqCst) >= app.workers {
        Err(std::sync::mpsc::TrySendError::Full(job))
    } else {
        match app.jobs.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            Some(q) => q.try_send(job),
            None => Err(std::sync::mpsc::TrySendError::Disconnected(job)),
        }
    };
    let Err(e) = sent else { return Ok(()) };
    app.in_flight.fetch_sub(1, Ordering::SeqCst);
    app.metrics.queue_depth.dec();
    Err(match e {
        std::sync::mpsc::TrySendError::Full(_) => ApiError::with(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "overloaded",
            "the server is busy (request queue full); retry later",
        ),
        std::sync::mpsc::TrySendError::Disconnected(_) => {
            ApiError::with(StatusCode::SERVICE_UNAVAILABLE, "server_error", "shutting_down", "the server is stopping")
        }
    })
}

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

/// A request's place among those in flight, given back when the worker is done with it.
struct Slot<'a>(&'a std::sync::atomic::AtomicUsize);

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A worker: takes a request when idle, runs it and relays its end; a request whose client left
/// is skipped.
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
        let ran = run(app, &job);
        app.metrics.running.dec();
        if let Ok(all) = &ran.done {
            record(app, all);
        }
        // The client stopped reading past the stall timeout (or left): the answer's end is not
        // waited for again.
        let wait = if ran.client_gone { Duration::ZERO } else { app.config.connections.stall_timeout };
        relay(&job.tx, Msg::Done(ran.done), wait);
    }
}

/// How a job's run ended.
struct Ran {
    /// Every choice's completion, or the error.
    done: Result<Vec<Completion>, ApiError>,
    /// The client went away (or stalled past the stall timeout) meanwhile.
    client_gone: bool,
}

/// Runs `job` on the engine, relaying its pieces.
fn run(app: &App, job: &Job) -> Ran {
    let mut first = true;
    let mut gone = false;
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let want = job.req.options.logprobs.is_some();
        app.engine.stream(&job.req, job.n, &mut |d| {
            if first {
                first = false;
                app.metrics.ttft.observe(job.queued.elapsed().as_secs_f64());
            }
            let logprobs = if want { crate::answers::logprobs_json(app, d.logprobs) } else { Value::Null };
            let piece = Msg::Text { choice: d.choice, text: d.text.to_string(), reasoning: d.reasoning, logprobs };
            let sent = relay(&job.tx, piece, app.config.connections.stall_timeout);
            gone |= !sent;
            sent
        })
    }));
    let done = match result {
        Ok(Ok(mut all)) => {
            if job.one_call {
                crate::request::keep_one_call(&mut all);
            }
            Ok(all)
        }
        Ok(Err(e)) => Err(ApiError::from_engine_for(&e, job.format_field.as_deref())),
        Err(_) => Err(ApiError::with(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            "internal_error",
            "internal error while generating (a bug; see the server log)",
        )),
    };
    Ran { done, client_gone: gone }
}

/// An answered request's tokens and cache hits, counted in the metrics.
fn record(app: &App, all: &[Completion]) {
    let m = &app.metrics;
    let c = &all[0];
    m.prompt_tokens.inc_by(c.prompt_tokens as u64);
    m.cached_tokens.inc_by(c.cached_tokens as u64);
    m.completion_tokens.inc_by(all.iter().map(|c| c.token_ids.len() as u64).sum());
    m.image_cache_hits.inc_by(c.image_cache_hits as u64);
    m.video_cache_hits.inc_by(c.video_cache_hits as u64);
}
