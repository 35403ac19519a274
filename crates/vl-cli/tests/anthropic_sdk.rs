//! The official `anthropic` Python SDK (pinned in tools/py-clients) against `vl serve` on
//! loopback, with an API key: text, an image answered as the reference answers it, the stream
//! helper, system prompts, stop sequences, count_tokens, x-api-key and error shapes on tiny-a;
//! forced tool_use and a tool_result round trip on tiny-b (its template offers tools); thinking blocks (whole and streamed) on
//! tiny-a with the Thinking template. The checks are in `tests/py/anthropic_client.py`; the venv
//! comes from `tools/py-clients/setup` (.ci/run runs it first; the test touches no network).

mod common;

use std::path::Path;
use std::process::Command;

use common::{goldens, start, start_dir, thinking_template, tiny_a_with_template};

/// Runs the client script in `mode` against `base`; returns the checks it passed.
fn run_client(base: &str, mode: &str) -> Vec<String> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/py/anthropic_client.py");
    let out = Command::new(common::py_clients_python())
        .arg(script)
        .args([base, "sekret", mode])
        .arg(goldens().join("tiny-a/cases/one_image.json"))
        .arg(goldens().join("images/square.png"))
        // Anything but loopback goes to a dead proxy: a client that reached for the network
        // would fail the test.
        .env("NO_PROXY", "127.0.0.1,localhost")
        .env("HTTP_PROXY", "http://127.0.0.1:9")
        .env("HTTPS_PROXY", "http://127.0.0.1:9")
        .env("ALL_PROXY", "http://127.0.0.1:9")
        .output()
        .expect("run the anthropic client");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{mode}: the client failed\n{stdout}\n{stderr}");
    stdout.lines().filter_map(|l| l.strip_prefix("ok: ")).map(str::to_string).collect()
}

#[test]
fn the_official_anthropic_sdk_gets_every_shape_it_expects() {
    let server = start("tiny-a", &["--api-key", "sekret"]);
    let passed = run_client(&server.base, "instruct");
    let want = ["text", "image", "stream helper", "system", "stop sequences", "count_tokens", "x-api-key", "errors"];
    assert_eq!(passed, want);
    drop(server);
    let server = start("tiny-b", &["--api-key", "sekret"]);
    assert_eq!(run_client(&server.base, "tools"), ["forced tool_use", "tool_result round trip"]);
    drop(server);
    let dir = tiny_a_with_template(&thinking_template());
    let server = start_dir(dir.path(), &["--api-key", "sekret"]);
    assert_eq!(run_client(&server.base, "thinking"), ["thinking", "thinking streamed", "thinking disabled"]);
}
