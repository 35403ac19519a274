//! The openai Python SDK and instructor (pinned in tools/py-clients) against `vl serve` on
//! loopback, with an API key, on tiny-b: models, chat whole and streamed, the SDK's `parse`
//! helper, `parallel_tool_calls: false`, a grammar through `extra_body`, instructor's JSON,
//! JSON-schema, tools and Responses-tools modes, stored responses through the SDK, and an error's
//! `param`. The checks are in `tests/py/openai_clients.py`; the venv comes from
//! `tools/py-clients/setup` (.ci/run runs it first; the test touches no network). The second test
//! drives langchain-openai, openai-agents, litellm and llm (`tests/py/more_clients.py`).

mod common;

use std::path::Path;
use std::process::Command;

use common::start;

#[test]
fn the_openai_sdk_and_instructor_get_what_they_expect() {
    let server = start("tiny-b", &["--api-key", "sekret"]);
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/py/openai_clients.py");
    let out = Command::new(common::py_clients_python())
        .arg(script)
        .args([&server.base, "sekret"])
        // Anything but loopback goes to a dead proxy: a client that reached for the network
        // would fail the test.
        .env("NO_PROXY", "127.0.0.1,localhost")
        .env("HTTP_PROXY", "http://127.0.0.1:9")
        .env("HTTPS_PROXY", "http://127.0.0.1:9")
        .env("ALL_PROXY", "http://127.0.0.1:9")
        .output()
        .expect("run the openai clients");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "the clients failed\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let passed: Vec<&str> = stdout.lines().filter_map(|l| l.strip_prefix("ok: ")).collect();
    assert_eq!(
        passed,
        [
            "models",
            "chat",
            "parse",
            "one tool call",
            "structured_outputs",
            "instructor",
            "instructor responses",
            "responses",
            "errors"
        ]
    );
}

/// langchain-openai (a chat model whole and streamed, `with_structured_output`), openai-agents
/// (an agent's text and typed output), litellm (an `openai/` provider) and llm (an extra
/// OpenAI-compatible model, its command line) against `vl serve`, configured as their users
/// configure them; `tests/py/more_clients.py` (none of them reaches the network).
#[test]
fn langchain_agents_litellm_and_llm_get_what_they_expect() {
    let server = start("tiny-b", &["--api-key", "sekret"]);
    let llm_home = tempfile::tempdir().unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/py/more_clients.py");
    let out = Command::new(common::py_clients_python())
        .arg(script)
        .args([server.base.as_str(), "sekret"])
        .arg(llm_home.path())
        // Anything but loopback goes to a dead proxy: a client that reached for the network
        // would fail the test.
        .env("NO_PROXY", "127.0.0.1,localhost")
        .env("HTTP_PROXY", "http://127.0.0.1:9")
        .env("HTTPS_PROXY", "http://127.0.0.1:9")
        .env("ALL_PROXY", "http://127.0.0.1:9")
        .env("HOME", llm_home.path())
        .output()
        .expect("run the clients");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "the clients failed\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let passed: Vec<&str> = stdout.lines().filter_map(|l| l.strip_prefix("ok: ")).collect();
    assert_eq!(passed, ["langchain-openai", "openai-agents", "litellm", "llm"]);
}
