//! The README's commands work as written. Each fenced block after a `<!-- readme-check -->`
//! line runs as a bash script (`set -euo pipefail`) in a scratch directory that sees the
//! checkout's `goldens/` and `docs/`, with this build's `vl` on PATH and a private, empty,
//! offline Hugging Face cache:
//! - `vl` runs when its `--model` is a local path (the bundled checkpoints, or a file an earlier
//!   command wrote); a hub id or a file the reader would have downloaded is skipped and listed;
//! - `cargo run --release -p vl-cli -- ARGS` is `vl ARGS`; other cargo commands (and `.ci/run`,
//!   the test command itself) are skipped;
//! - `vl serve` starts in the background on a free loopback port and stays up for the blocks
//!   after it: every fixed port is replaced (`--port N` or `--port=N` by 0, and a serve without
//!   `--port`, which would bind the CLI's default 8080, gets `--port 0`; `--host` is 127.0.0.1), so
//!   a port held by anything else never fails the test; `curl` to `localhost:N` or
//!   `127.0.0.1:N`, N the port as written, goes to it (with the key the README's `$KEY` stands
//!   for), and fails on an HTTP error status;
//! - `vl chat` reads an empty stdin (it loads, then ends).
//!
//! Every marked block must run at least one command.

use std::path::{Path, PathBuf};
use std::process::Command;

const PRELUDE: &str = r#"
set -euo pipefail
KEY=readme-check-key
SERVER_PID=
SERVER_ADDR=
SERVER_PORT_WRITTEN=8080
cleanup() { if [ -n "$SERVER_PID" ]; then kill "$SERVER_PID" 2>/dev/null || true; fi; }
trap cleanup EXIT
ran() { echo "README-CHECK ran: $*" >&2; }
skipped() { echo "README-CHECK skipped: $*" >&2; }
model_of() {
  local prev=""
  for a in "$@"; do
    if [ "$prev" = "--model" ]; then echo "$a"; return; fi
    prev="$a"
  done
}
vl() {
  local model
  model="$(model_of "$@")"
  if [ -z "$model" ] || [ ! -e "$model" ]; then skipped "vl $* (the model is not local: a download)"; return 0; fi
  case "$1" in
    serve)
      cleanup
      # Every fixed port becomes a free one: `--port N` (or `--port=N`) is 0, a serve without
      # `--port` (the CLI's default, 8080) gets `--port 0`; the host is loopback. Requests to the
      # port as written go to the port the server took.
      local args=() prev="" port_given=
      SERVER_PORT_WRITTEN=8080
      for a in "$@"; do
        case "$prev" in
          --port) SERVER_PORT_WRITTEN="$a"; a=0 ;;
          --host) a=127.0.0.1 ;;
        esac
        case "$a" in
          --port) port_given=1 ;;
          --port=*) port_given=1; SERVER_PORT_WRITTEN="${a#--port=}"; a=--port=0 ;;
          --host=*) a=--host=127.0.0.1 ;;
        esac
        args+=("$a"); prev="$a"
      done
      if [ -z "$port_given" ]; then args+=(--port 0); fi
      ran "vl $*"
      local log; log="$(mktemp)"
      command vl "${args[@]}" 2>"$log" &
      SERVER_PID=$!
      for _ in $(seq 1 300); do
        SERVER_ADDR="$(sed -n 's|.*listening on http://\([0-9.:]*\).*|\1|p' "$log" | head -1)"
        [ -n "$SERVER_ADDR" ] && break
        kill -0 "$SERVER_PID" 2>/dev/null || { cat "$log" >&2; echo "vl serve exited" >&2; return 1; }
        sleep 0.1
      done
      [ -n "$SERVER_ADDR" ] || { cat "$log" >&2; echo "vl serve did not start" >&2; return 1; }
      ;;
    chat) ran "vl $*"; command vl "$@" </dev/null ;;
    *) ran "vl $*"; command vl "$@" ;;
  esac
}
cargo() {
  if [ "${1:-}" = run ] && [ "${2:-}" = --release ] && [ "${3:-}" = -p ] && [ "${4:-}" = vl-cli ] && [ "${5:-}" = -- ]; then
    shift 5; vl "$@"
  else
    skipped "cargo $*"
  fi
}
.ci/run() { skipped ".ci/run (the test command itself)"; }
curl() {
  [ -n "$SERVER_ADDR" ] || { echo "curl before any vl serve" >&2; return 1; }
  local args=()
  for a in "$@"; do
    a="${a//localhost:$SERVER_PORT_WRITTEN/$SERVER_ADDR}"
    args+=("${a//127.0.0.1:$SERVER_PORT_WRITTEN/$SERVER_ADDR}")
  done
  ran "curl (to vl serve)"
  command curl --fail-with-body --max-time 120 -H "Authorization: Bearer $KEY" "${args[@]}"
  echo
}
"#;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().unwrap()
}

/// The marked blocks: (line of the marker, the block's text without its indentation).
fn marked_blocks(readme: &str) -> Vec<(usize, String)> {
    let lines: Vec<&str> = readme.lines().collect();
    let mut blocks = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        if lines[i].trim() == "<!-- readme-check -->" {
            let fence = lines.get(i + 1).copied().unwrap_or("");
            let indent = fence.len() - fence.trim_start().len();
            assert!(fence.trim_start().starts_with("```sh"), "README.md:{}: a marker not followed by ```sh", i + 1);
            let mut body = String::new();
            let mut j = i + 2;
            while j < lines.len() && lines[j].trim() != "```" {
                body.push_str(lines[j].get(indent..).unwrap_or(lines[j].trim_start()));
                body.push('\n');
                j += 1;
            }
            assert!(j < lines.len(), "README.md:{}: unclosed block", i + 1);
            blocks.push((i + 1, body));
            i = j;
        }
        i += 1;
    }
    blocks
}

#[test]
fn the_readme_commands_on_local_models_run() {
    let root = root();
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let blocks = marked_blocks(&readme);
    assert!(blocks.len() >= 5, "only {} marked blocks", blocks.len());
    let work = tempfile::tempdir().unwrap();
    for d in ["goldens", "docs"] {
        std::os::unix::fs::symlink(root.join(d), work.path().join(d)).unwrap();
    }
    let home = tempfile::tempdir().unwrap();
    let bin = Path::new(env!("CARGO_BIN_EXE_vl")).parent().unwrap().to_path_buf();
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default());
    // One script: a server started in one block answers the requests of the next.
    let mut script = PRELUDE.to_string();
    for (line, body) in &blocks {
        script.push_str(&format!("echo 'README-CHECK block {line}' >&2\n{body}\n"));
    }
    let out = Command::new("timeout")
        .args(["300", "bash", "-c", &script])
        .current_dir(work.path())
        .env("PATH", path)
        .env("HF_HOME", home.path())
        .env_remove("HF_HUB_CACHE")
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "the README's commands failed ({}):\n{err}\n{stdout}", out.status);
    // Every block ran something.
    let mut ran_in_block = std::collections::BTreeMap::new();
    let mut current = 0;
    for l in err.lines() {
        if let Some(n) = l.strip_prefix("README-CHECK block ") {
            current = n.parse().unwrap();
            ran_in_block.insert(current, 0);
        } else if l.starts_with("README-CHECK ran: ") {
            *ran_in_block.get_mut(&current).unwrap() += 1;
        }
    }
    for (line, _) in &blocks {
        assert!(
            ran_in_block.get(line).copied().unwrap_or(0) > 0,
            "README.md:{line}: no command of this block ran\n{err}"
        );
    }
    println!("{}", err.lines().filter(|l| l.starts_with("README-CHECK")).collect::<Vec<_>>().join("\n"));
    // The structured-output request answered JSON that names an animal's legs.
    assert!(stdout.contains("\"legs\""), "{stdout}");
}
