//! The first hour with `vl`, as a newcomer meets it: each error names the thing at fault once
//! (missing media before the model is resolved, a broken symlink as one), `vl quantize` refuses
//! what would write nothing quantized and keeps existing files, the progress bar shows on a
//! terminal only, and `vl chat` on a pseudo-terminal: Ctrl-C stops the answer and keeps the
//! conversation, `/save` and `/load` round-trip it, Ctrl-C twice exits.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::error_lines;

fn goldens() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../goldens")
}

fn checkpoint(g: &str) -> String {
    goldens().join(g).join("checkpoint").display().to_string()
}

/// Runs `vl` with a private, empty Hugging Face cache and no network: (exit code, stdout, stderr).
fn vl(args: &[&str]) -> (i32, String, String) {
    vl_stdin(args, "")
}

fn vl_stdin(args: &[&str], stdin: &str) -> (i32, String, String) {
    use std::io::Write;
    let home = tempfile::tempdir().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_vl"))
        .args(args)
        .env("HF_HOME", home.path())
        .env_remove("HF_HUB_CACHE")
        .env("HF_HUB_OFFLINE", "1")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run vl");
    child.stdin.take().unwrap().write_all(stdin.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    common::outcome(out)
}

#[test]
fn a_missing_media_file_is_named_before_the_model_is_resolved() {
    // With no --model, the default hub id would be resolved (and fail offline) after the file.
    for (flag, kind) in [("--video", "video"), ("--image", "image")] {
        for model in [None, Some(checkpoint("tiny-a"))] {
            let mut args = vec!["run", flag, "missing.mp4"];
            if let Some(m) = &model {
                args.extend(["--model", m.as_str()]);
            }
            let (code, _, err) = vl(&args);
            assert_eq!(code, 1, "{err}");
            assert_eq!(error_lines(&err), [format!("error: {kind} missing.mp4: no such file or directory")], "{err}");
            assert_eq!(err.matches("missing.mp4").count(), 1, "{err}");
        }
    }
}

#[test]
fn a_missing_gguf_file_is_named_as_a_file() {
    let (code, _, err) = vl(&["run", "--model", "nowhere/model-Q4_K_M.gguf", "--prompt", "hi"]);
    assert_eq!(code, 1);
    assert_eq!(error_lines(&err), ["error: GGUF file nowhere/model-Q4_K_M.gguf not found"], "{err}");
}

#[test]
fn a_broken_symlink_in_a_copied_checkpoint_is_named_as_one() {
    // `cp -r` of a checkpoint whose tokenizer links to ../../tokenizer/ elsewhere.
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    std::fs::create_dir(&ck).unwrap();
    for entry in std::fs::read_dir(goldens().join("tiny-a/checkpoint")).unwrap() {
        let p = entry.unwrap().path();
        let to = ck.join(p.file_name().unwrap());
        match std::fs::read_link(&p) {
            Ok(target) => std::os::unix::fs::symlink(target, &to).unwrap(),
            Err(_) => {
                std::fs::copy(&p, &to).unwrap();
            }
        }
    }
    let (code, _, err) = vl(&["run", "--model", ck.to_str().unwrap(), "--prompt", "hi"]);
    assert_eq!(code, 1);
    let lines = error_lines(&err);
    assert_eq!(lines.len(), 1, "{err}");
    assert!(lines[0].contains("tokenizer.json: broken symbolic link to ../../tokenizer/tokenizer.json"), "{err}");
    // A broken link given as the image is named as one too.
    std::os::unix::fs::symlink("gone.png", dir.path().join("pic.png")).unwrap();
    let pic = dir.path().join("pic.png");
    let (code, _, err) = vl(&["run", "--model", &checkpoint("tiny-a"), "--image", pic.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert_eq!(error_lines(&err), [format!("error: image {}: broken symbolic link to gone.png", pic.display())]);
}

#[test]
fn chat_names_a_missing_image_once_and_goes_on() {
    let (code, out, err) =
        vl_stdin(&["chat", "--model", &checkpoint("tiny-a"), "--max-new-tokens", "2"], "/image nonexistent.png\nhi\n");
    assert_eq!(code, 0, "{err}");
    assert_eq!(error_lines(&err), ["error: image nonexistent.png: no such file or directory"], "{err}");
    assert_eq!(err.matches("nonexistent.png").count(), 1, "{err}");
    // The message after it was answered.
    assert!(err.contains("prompt tokens") && !out.trim().is_empty(), "{err}");
}

#[test]
fn chat_saves_and_loads_the_conversation_as_openai_messages() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("conv.json");
    let image = goldens().join("images/square.png");
    let script = format!(
        "/image {}\nWhat is it?\n/save {f}\n/reset\n/load {f}\nAnd now?\n",
        image.display(),
        f = file.display()
    );
    let (code, _, err) = vl_stdin(&["chat", "--model", &checkpoint("tiny-a"), "--max-new-tokens", "3"], &script);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("(saved 2 messages to") && err.contains("(loaded 2 messages from"), "{err}");
    let saved: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    let m = saved.as_array().unwrap();
    assert_eq!(m[0]["role"], "user");
    assert_eq!(m[0]["content"][0]["type"], "image_url");
    let url = m[0]["content"][0]["image_url"]["url"].as_str().unwrap();
    assert!(url.starts_with("data:image/png;base64,"), "{url}");
    // The data URL holds the file's own bytes.
    use base64::Engine as _;
    let bytes = base64::engine::general_purpose::STANDARD.decode(&url["data:image/png;base64,".len()..]).unwrap();
    assert_eq!(bytes, std::fs::read(&image).unwrap());
    assert_eq!(m[0]["content"][1], serde_json::json!({"type": "text", "text": "What is it?"}));
    assert_eq!(m[1]["role"], "assistant");
    assert!(m[1]["content"].is_string());
    // After /reset and /load, the next turn reuses the whole loaded conversation as its prefix:
    // it rendered to the same tokens as before the save.
    let stats: Vec<&str> = err.lines().filter(|l| l.contains("prompt tokens")).collect();
    assert_eq!(stats.len(), 2, "{err}");
    let reused: usize = stats[1].split(", ").nth(1).unwrap().split(' ').next().unwrap().parse().unwrap();
    let first_prompt: usize = stats[0].trim_start_matches('[').split(' ').next().unwrap().parse().unwrap();
    assert!(reused > first_prompt, "{err}");

    // A file that is not a conversation: one line naming it, and the chat goes on.
    std::fs::write(dir.path().join("bad.json"), r#"[{"role": "robot", "content": "x"}]"#).unwrap();
    let script = format!("/load {}\nhi\n", dir.path().join("bad.json").display());
    let (code, _, err) = vl_stdin(&["chat", "--model", &checkpoint("tiny-a"), "--max-new-tokens", "2"], &script);
    assert_eq!(code, 0, "{err}");
    let lines = error_lines(&err);
    assert_eq!(lines.len(), 1, "{err}");
    assert!(lines[0].contains("bad.json") && lines[0].contains("messages[0].role = \"robot\""), "{err}");
}

#[test]
fn quantize_refuses_a_type_that_applies_to_no_tensor_and_keeps_existing_files() {
    let out = tempfile::tempdir().unwrap();
    let o = out.path().to_str().unwrap();
    // tiny-b's rows (48, 104, 144 values) fill neither Q4_K's 256-value blocks nor Q5_0's 32.
    let (code, _, err) = vl(&["quantize", "--model", &checkpoint("tiny-b"), "--quantize", "q4k_m", "--out", o]);
    assert_eq!(code, 1, "{err}");
    let lines = error_lines(&err);
    assert_eq!(lines.len(), 1, "{err}");
    assert!(lines[0].starts_with("error: quantization Q4_K_M: applies to no tensor of"), "{err}");
    assert!(lines[0].contains("nothing written"), "{err}");
    assert_eq!(std::fs::read_dir(out.path()).unwrap().count(), 0, "a file was written");

    // tiny-a: written, with the types it holds and a note for the matrices that fell back.
    let (code, _, err) = vl(&["quantize", "--model", &checkpoint("tiny-a"), "--quantize", "q4k_m", "--out", o]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("the text model's matrices:") && err.contains("Q5_0"), "{err}");
    assert!(err.contains("note:") && err.contains("fell back from Q4_K_M ("), "{err}");
    let text = out.path().join("checkpoint-Q4_K_M.gguf");
    let before = std::fs::metadata(&text).unwrap().modified().unwrap();
    // Again: refused, the files left alone; with --force, replaced.
    let (code, _, err) = vl(&["quantize", "--model", &checkpoint("tiny-a"), "--quantize", "q4k_m", "--out", o]);
    assert_eq!(code, 1);
    assert_eq!(error_lines(&err), [format!("error: {}: exists; pass --force to replace it", text.display())]);
    assert_eq!(std::fs::metadata(&text).unwrap().modified().unwrap(), before);
    std::thread::sleep(Duration::from_millis(20));
    let (code, _, err) =
        vl(&["quantize", "--model", &checkpoint("tiny-a"), "--quantize", "q4k_m", "--out", o, "--force"]);
    assert_eq!(code, 0, "{err}");
    assert_ne!(std::fs::metadata(&text).unwrap().modified().unwrap(), before);
}

/// `vl` on a pseudo-terminal (stdin, stdout and stderr all on it).
fn spawn_pty(args: &[&str], timeout: Duration) -> (rexpect::session::PtySession, tempfile::TempDir) {
    let home = tempfile::tempdir().unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_vl"));
    cmd.args(args).env("HF_HOME", home.path()).env_remove("HF_HUB_CACHE").env("HF_HUB_OFFLINE", "1");
    let s = rexpect::session::spawn_command(cmd, Some(timeout.as_millis() as u64)).expect("spawn vl on a pty");
    (s, home)
}

#[test]
fn progress_shows_on_a_terminal_and_never_in_a_pipe() {
    let image = goldens().join("images/square.png");
    let args = ["run", "--model", &checkpoint("tiny-a"), "--image", image.to_str().unwrap(), "--max-new-tokens", "2"];
    let (mut s, _home) = spawn_pty(&args, Duration::from_secs(60));
    let all = s.exp_eof().unwrap();
    // The bar redraws at most 20 times a second, so on the tiny model it may show only some of
    // the stages (which stages an answer reports: vl-models' tests/progress.rs).
    let stages = ["decoding media", "loading", "vision tower", "prefill"];
    assert!(stages.iter().any(|s| all.contains(&format!("{s} "))), "no progress bar on the terminal: {all:?}");
    assert!(all.contains("[load "), "{all:?}");
    // Piped: the answer and the one summary line, no bar.
    let (code, _, err) = vl(&args);
    assert_eq!(code, 0, "{err}");
    assert_eq!(err.lines().count(), 1, "{err:?}");
    assert!(err.starts_with("[load ") && !err.contains('\r') && !err.contains("tensors"), "{err:?}");
}

#[test]
fn chat_ctrl_c_stops_the_answer_keeps_the_history_and_twice_exits() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("conv.json");
    // 1900 new tokens take the tiny model about 15 s; Ctrl-C comes well before.
    let args = ["chat", "--model", &checkpoint("tiny-a"), "--max-new-tokens", "1900"];
    let (mut s, _home) = spawn_pty(&args, Duration::from_secs(60));
    s.exp_string("Ctrl-C stops an answer").unwrap();
    s.exp_string("> ").unwrap();
    s.send_line("tell me a long story").unwrap();
    // Let the line editor hand the terminal back, so Ctrl-C is then a signal, not a key (the
    // answer takes ~15 s; 700 ms is well inside it).
    std::thread::sleep(Duration::from_millis(700));
    s.send_control('c').unwrap();
    s.exp_string("(stopped; the conversation keeps the answer so far)").unwrap();
    let (_, stats) = s.exp_regex(r"\| (\d+) tokens,").unwrap();
    let n: usize = stats.trim_start_matches("| ").split(' ').next().unwrap().parse().unwrap();
    assert!(n > 0 && n < 1900, "{stats}");
    s.exp_string("> ").unwrap();
    s.send_line(&format!("/save {}", file.display())).unwrap();
    s.exp_string("(saved 2 messages").unwrap();
    // One Ctrl-C at the prompt warns; the second exits cleanly.
    s.send_control('c').unwrap();
    s.exp_string("Ctrl-C again, or Ctrl-D, exits").unwrap();
    s.send_control('c').unwrap();
    s.exp_eof().unwrap();
    let status = s.process().wait().unwrap();
    assert!(matches!(status, rexpect::process::wait::WaitStatus::Exited(_, 0)), "{status:?}");
    let saved: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    assert_eq!(saved[0]["content"], "tell me a long story");
    assert_eq!(saved[1]["role"], "assistant");
    assert!(!saved[1]["content"].as_str().unwrap().is_empty());
}

#[test]
fn quantize_that_cannot_write_leaves_nothing_and_names_the_file() {
    // A full disk, as the process sees it: a file-size limit (RLIMIT_FSIZE, SIGXFSZ ignored so
    // the write fails with EFBIG instead of killing the process).
    use std::os::unix::process::CommandExt;
    let out = tempfile::tempdir().unwrap();
    let home = tempfile::tempdir().unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_vl"));
    cmd.args(["quantize", "--model", &checkpoint("tiny-a"), "--quantize", "q8", "--out", out.path().to_str().unwrap()])
        .env("HF_HOME", home.path())
        .env("HF_HUB_OFFLINE", "1");
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            let lim = libc::rlimit { rlim_cur: 1 << 20, rlim_max: 1 << 20 };
            if libc::setrlimit(libc::RLIMIT_FSIZE, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let o = cmd.output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    let lines = error_lines(&err);
    assert_eq!(lines.len(), 1, "{err}");
    assert!(lines[0].contains("checkpoint-Q8_0.gguf.partial: cannot write"), "{err}");
    let left: Vec<_> = std::fs::read_dir(out.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert!(left.is_empty(), "files left behind: {left:?}");
}

#[test]
fn chat_skips_a_huge_line_and_one_not_utf8_and_goes_on() {
    // A 5 MiB line (over the 4 MiB bound), a line with an invalid byte, then a message.
    let mut input = "x".repeat(5 << 20);
    input.push('\n');
    let mut bytes = input.into_bytes();
    bytes.extend(b"caf\xe9\n");
    bytes.extend(b"hi\n");
    use std::io::Write;
    let home = tempfile::tempdir().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_vl"))
        .args(["chat", "--model", &checkpoint("tiny-a"), "--max-new-tokens", "2"])
        .env("HF_HOME", home.path())
        .env("HF_HUB_OFFLINE", "1")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let writer = std::thread::spawn(move || stdin.write_all(&bytes));
    let out = child.wait_with_output().unwrap();
    writer.join().unwrap().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert_eq!(
        error_lines(&err),
        [
            "error: a line of more than 4194304 bytes; skipped",
            "error: the line is not UTF-8 (invalid byte at offset 3); skipped"
        ],
        "{err}"
    );
    // Only "hi" was answered.
    assert_eq!(err.matches("prompt tokens").count(), 1, "{err}");
}

/// `vl chat` on a Thinking checkpoint (tiny-a with the Qwen3-VL Thinking template,
/// goldens/thinking): stdout is not a terminal, so the reasoning goes to stderr and stdout
/// carries the answers alone; `/save` keeps each turn's reasoning as `reasoning_content`, and
/// `--hide-reasoning` prints none of it.
#[test]
fn chat_prints_reasoning_apart_and_saves_it() {
    let dir = common::tiny_a_with_template(&common::thinking_template());
    let g: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(goldens().join("thinking/thinking.json")).unwrap()).unwrap();
    let g = &g["greedy"];
    let n = g["ids"].as_array().unwrap().len().to_string();
    let file = dir.path().join("conv.json");
    let script = format!("{}\n/save {}\n", g["question"].as_str().unwrap(), file.display());
    let model = dir.path().to_str().unwrap();
    let (code, out, err) = vl_stdin(&["chat", "--model", model, "--max-new-tokens", &n, "--quantize", "off"], &script);
    assert_eq!(code, 0, "{err}");
    let reasoning = g["reasoning"].as_str().unwrap();
    assert!(err.contains(reasoning), "{err}");
    assert!(!out.contains(reasoning), "{out}");
    let saved: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    assert_eq!(saved[1]["reasoning_content"], g["reasoning"]);
    assert_eq!(saved[1]["content"], g["content"]);
    let (code, out, err) =
        vl_stdin(&["chat", "--model", model, "--max-new-tokens", &n, "--hide-reasoning", "--quantize", "off"], &script);
    assert_eq!(code, 0, "{err}");
    assert!(!err.contains(reasoning) && !out.contains(reasoning), "{err}");
}
