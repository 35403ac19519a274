//! `vl serve` for tests: started on a free loopback port with a tiny golden checkpoint, killed
//! on drop.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub fn goldens() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../goldens")
}

pub struct Server {
    pub child: Child,
    pub base: String,
    /// The server's stderr lines after `listening on`.
    pub log: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn start(g: &str, extra: &[&str]) -> Server {
    serve_model(&goldens().join(g).join("checkpoint"), g, extra)
}

/// `vl serve` on the checkpoint directory `dir` (served as "local").
pub fn start_dir(dir: &Path, extra: &[&str]) -> Server {
    serve_model(dir, "local", extra)
}

fn serve_model(ck: &Path, g: &str, extra: &[&str]) -> Server {
    let mut child = Command::new(env!("CARGO_BIN_EXE_vl"))
        .args(["serve", "--model", ck.to_str().unwrap(), "--served-model-name", g, "--port", "0"])
        // Full precision: answers are compared with the reference's (on the CPU the default
        // would quantize the text decoder to q4k).
        .args(["--quantize", "off"])
        .args(extra)
        .env("HF_HUB_OFFLINE", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start vl serve");
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let deadline = Instant::now() + Duration::from_secs(120);
    let base = loop {
        assert!(Instant::now() < deadline, "the server did not start in time");
        let line = lines.next().expect("server exited before listening").unwrap();
        if let Some(url) = line.strip_prefix("listening on ") {
            break url.trim().to_string();
        }
    };
    assert!(base.starts_with("http://127.0.0.1:"), "{base}");
    // Keep draining stderr so the server never blocks on a full pipe.
    let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let sink = log.clone();
    std::thread::spawn(move || {
        for line in lines.map_while(|l| l.ok()) {
            sink.lock().unwrap().push(line);
        }
    });
    Server { child, base, log }
}

/// A private Hugging Face cache under `home` holding `tiny/qwen3-vl-a` (links to tiny-a's files),
/// as `hf-hub` lays one out.
pub fn fake_hub_cache(home: &Path) {
    let repo = home.join("hub/models--tiny--qwen3-vl-a");
    let snap = repo.join("snapshots/0123abcd");
    std::fs::create_dir_all(&snap).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), "0123abcd").unwrap();
    for entry in std::fs::read_dir(goldens().join("tiny-a/checkpoint")).unwrap() {
        let p = entry.unwrap().path();
        std::os::unix::fs::symlink(std::fs::canonicalize(&p).unwrap(), snap.join(p.file_name().unwrap())).unwrap();
    }
}

/// tiny-a's checkpoint with `template` as its chat template: a temporary directory of links to the
/// golden files and the template written in place.
pub fn tiny_a_with_template(template: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(goldens().join("tiny-a/checkpoint")).unwrap() {
        let p = entry.unwrap().path();
        if p.file_name().unwrap() != "chat_template.jinja" {
            std::os::unix::fs::symlink(std::fs::canonicalize(&p).unwrap(), dir.path().join(p.file_name().unwrap()))
                .unwrap();
        }
    }
    std::fs::write(dir.path().join("chat_template.jinja"), template).unwrap();
    dir
}

/// The Qwen3-VL Thinking checkpoints' chat template (the pinned fixture; goldens/thinking).
pub fn thinking_template() -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tools/hf-reference/templates");
    std::fs::read_to_string(root.join("Qwen3-VL-Thinking.jinja")).unwrap()
}

/// A finished `vl`'s exit code (-1 when killed by a signal), stdout and stderr.
pub fn outcome(out: std::process::Output) -> (i32, String, String) {
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The `error:` lines of a stderr.
pub fn error_lines(stderr: &str) -> Vec<&str> {
    stderr.lines().filter(|l| l.starts_with("error:")).collect()
}

/// The Python of the SDK clients' venv (`tools/py-clients/setup`, which .ci/run runs first;
/// `VL_PY_CLIENTS` names another venv).
#[allow(dead_code)]
pub fn py_clients_python() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let p = std::env::var_os("VL_PY_CLIENTS")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target/py-clients"))
        .join("bin/python");
    assert!(p.exists(), "{} is missing: run tools/py-clients/setup first (.ci/run does)", p.display());
    p
}
