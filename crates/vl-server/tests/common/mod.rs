//! The harness of vl-server's tests: a checkpoint under goldens/ served by
//! `vl_server::serve_until` on a free loopback port, stopped when dropped, and a plain HTTP
//! client (ureq) with a timeout on every request.
#![allow(dead_code)]

use std::net::TcpListener;
use std::path::PathBuf;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::Value;
use vl_models::engine::Engine;
use vl_server::{ConnectionLimits, ServerConfig, ServerError};

pub fn goldens() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../goldens")
}

/// A server on a free loopback port, stopped when dropped.
pub struct Server {
    pub base: String,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<Result<(), ServerError>>>,
}

/// Most a server may take to stop once told (its shutdown bound, and a margin).
pub const SHUTDOWN: Duration = Duration::from_secs(5);

impl Server {
    /// tiny-a served under the id `tiny-a` with `config`'s other settings.
    pub fn start(config: ServerConfig) -> Self {
        Self::start_model("tiny-a", config)
    }

    /// `goldens/<name>/checkpoint` served under the id `name` with `config`'s other settings.
    pub fn start_model(name: &str, config: ServerConfig) -> Self {
        Self::start_dir(&goldens().join(name).join("checkpoint"), name, config)
    }

    /// The checkpoint directory `dir` served under the id `name`.
    pub fn start_dir(dir: &std::path::Path, name: &str, config: ServerConfig) -> Self {
        Self::start_engine(Engine::builder(dir).build().expect("the checkpoint loads"), name, config)
    }

    /// `engine` served under the id `name`.
    pub fn start_engine(engine: Engine, name: &str, config: ServerConfig) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let config = ServerConfig {
            id: name.into(),
            connections: ConnectionLimits { shutdown_timeout: Duration::from_secs(2), ..config.connections },
            ..config
        };
        let thread = std::thread::spawn(move || {
            vl_server::serve_until(Arc::new(engine), listener, config, async move {
                let _ = stopped.await;
            })
        });
        Self { base, stop: Some(stop), thread: Some(thread) }
    }

    /// Stops the server; what `serve_until` returned, within `SHUTDOWN`.
    pub fn stop(&mut self) -> Result<(), ServerError> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        let Some(thread) = self.thread.take() else { return Ok(()) };
        let t = Instant::now();
        while !thread.is_finished() {
            assert!(t.elapsed() < SHUTDOWN, "the server did not stop within {SHUTDOWN:?}");
            std::thread::sleep(Duration::from_millis(10));
        }
        thread.join().expect("the server thread panicked")
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            self.stop().expect("the server stopped with an error");
        } else if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}

pub fn agent() -> ureq::Agent {
    ureq::AgentBuilder::new().timeout(Duration::from_secs(60)).build()
}

/// (status, body) of a GET; error statuses are answers here, not failures.
pub fn get(s: &Server, path: &str) -> (u16, Value) {
    let resp = match agent().get(&format!("{}{path}", s.base)).call() {
        Ok(r) => r,
        Err(ureq::Error::Status(_, r)) => r,
        Err(e) => panic!("GET {path}: {e}"),
    };
    (resp.status(), json_body(resp))
}

pub fn json_body(resp: ureq::Response) -> Value {
    let text = resp.into_string().expect("a body");
    serde_json::from_str(&text).unwrap_or_else(|_| panic!("not JSON: {text}"))
}

/// (status, body) of a POST of `body` as JSON.
pub fn post(s: &Server, path: &str, body: &Value) -> (u16, Value) {
    let r = agent().post(&format!("{}{path}", s.base)).set("Content-Type", "application/json");
    let resp = match r.send_string(&body.to_string()) {
        Ok(r) => r,
        Err(ureq::Error::Status(_, r)) => r,
        Err(e) => panic!("POST {path}: {e}"),
    };
    (resp.status(), json_body(resp))
}

/// A streamed POST of `body` as JSON (a success expected): the response's content type and the
/// event stream's lines, read to its end (the server closes it after the last event; the agent's
/// timeout bounds the wait).
pub fn post_stream(s: &Server, path: &str, body: &Value) -> (Option<String>, Vec<String>) {
    use std::io::BufRead;
    let r = agent().post(&format!("{}{path}", s.base)).set("Content-Type", "application/json");
    let resp = r.send_string(&body.to_string()).unwrap_or_else(|e| panic!("POST {path}: {e}"));
    let kind = resp.header("content-type").map(String::from);
    let lines = std::io::BufReader::new(resp.into_reader()).lines().map(|l| l.expect("a stream line")).collect();
    (kind, lines)
}

/// tiny-a with the Qwen3-VL Instruct checkpoints' own template (tools, tool calls, tool
/// responses; the pinned fixture), in a temporary directory of links.
pub fn tiny_a_with_tools() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(goldens().join("tiny-a/checkpoint")).unwrap() {
        let e = e.unwrap();
        if e.file_name() != "chat_template.jinja" {
            std::os::unix::fs::symlink(std::fs::canonicalize(e.path()).unwrap(), dir.path().join(e.file_name()))
                .unwrap();
        }
    }
    let template =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tools/hf-reference/templates/Qwen3-VL-Instruct.jinja");
    std::fs::copy(template, dir.path().join("chat_template.jinja")).unwrap();
    dir
}

/// The reference's greedy answer to tiny-a's `one_image` case: its text, its token count, the
/// prompt's tokens.
pub struct Golden {
    pub text: String,
    pub tokens: usize,
    pub prompt_tokens: usize,
}

pub fn golden() -> Golden {
    let path = goldens().join("tiny-a/cases/one_image.json");
    let meta: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    Golden {
        text: meta["greedy"]["text"].as_str().unwrap().to_string(),
        tokens: meta["greedy"]["ids"].as_array().unwrap().len(),
        prompt_tokens: meta["num_tokens"].as_u64().unwrap() as usize,
    }
}
