//! What `vl` reads and writes on the local disk: `vl chat`'s `/load` takes media only as data
//! URLs (or a file attached in the same session), refusing a `file://` URL, a path, a network
//! URL, a `data:text/plain` "image" and undecodable bytes with one line, the conversation left
//! as it was; `vl run --draw-boxes` checks its target before any work (never an input, however
//! named; never a directory or a missing directory; an existing file only with `--force`) and
//! leaves no temporary file behind.

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use common::{error_lines, goldens};

fn checkpoint() -> String {
    goldens().join("tiny-a/checkpoint").display().to_string()
}

/// Runs `vl` in `cwd` with `stdin`, a private empty Hugging Face cache and no network:
/// (exit code, stdout, stderr).
fn vl_in(cwd: &Path, args: &[&str], stdin: &str) -> (i32, String, String) {
    use std::io::Write;
    let home = tempfile::tempdir().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_vl"))
        .args(args)
        .current_dir(cwd)
        .env("HF_HOME", home.path())
        .env_remove("HF_HUB_CACHE")
        .env("HF_HUB_OFFLINE", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run vl");
    child.stdin.take().unwrap().write_all(stdin.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    common::outcome(out)
}

fn listing(dir: &Path) -> BTreeSet<String> {
    std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect()
}

fn b64(data: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(data)
}

/// A one-message conversation whose image part has `url`.
fn conversation(url: &str) -> String {
    serde_json::json!([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "What is it?"},
    ]}])
    .to_string()
}

#[test]
fn chat_load_refuses_media_it_was_not_given_and_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let png = std::fs::read(goldens().join("images/square.png")).unwrap();
    std::fs::write(dir.path().join("secret.png"), &png).unwrap();
    let secret = dir.path().join("secret.png").display().to_string();
    // (url, what the one error line says besides the file and message index)
    let mut garbage = png[..8].to_vec();
    garbage.extend((0..300u32).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8));
    let cases: Vec<(String, &str)> = vec![
        ("file:///etc/passwd".into(), "a file: URL refused"),
        (format!("file://{secret}"), "a file: URL refused"),
        ("secret.png".into(), "a local path (no URL scheme) refused"),
        (secret.clone(), "a local path (no URL scheme) refused"),
        ("http://127.0.0.1:9/x.png".into(), "an http: URL refused"),
        (format!("data:text/plain;base64,{}", b64(b"not an image")), "a data: URL of type \"text/plain\" refused"),
        (format!("data:image/png;base64,{}", b64(&garbage)), "messages[0].content[0]: image data:"),
    ];
    let mut script = String::new();
    for (i, (url, _)) in cases.iter().enumerate() {
        std::fs::write(dir.path().join(format!("bad{i}.json")), conversation(url)).unwrap();
        // A refused file leaves the conversation as it was: the next turn is answered.
        script.push_str(&format!("/load bad{i}.json\nhi\n"));
    }
    std::fs::write(dir.path().join("good.json"), conversation(&format!("data:image/png;base64,{}", b64(&png))))
        .unwrap();
    script.push_str("/load good.json\nAnd now?\n/save saved.json\n");
    let args = ["chat", "--model", &checkpoint(), "--max-new-tokens", "2"];
    let (code, _, err) = vl_in(dir.path(), &args, &script);
    assert_eq!(code, 0, "{err}");
    let lines = error_lines(&err);
    assert_eq!(lines.len(), cases.len(), "{err}");
    for (i, ((url, want), line)) in cases.iter().zip(&lines).enumerate() {
        let head = format!("error: /load bad{i}.json: messages[0].content[0]: ");
        assert!(line.starts_with(&head), "{url}: {line}");
        assert!(line.contains(want), "{url}: {line}");
    }
    assert!(err.contains("(loaded 1 messages from good.json)"), "{err}");
    // Every turn was answered: none was broken by what a refused file held.
    assert_eq!(err.lines().filter(|l| l.contains("prompt tokens")).count(), cases.len() + 1, "{err}");
    // Nothing of /etc/passwd or secret.png went into the saved conversation.
    let saved = std::fs::read_to_string(dir.path().join("saved.json")).unwrap();
    assert!(!saved.contains("passwd") && !saved.contains("secret"), "{saved}");
    assert_eq!(saved.matches("data:image/png;base64,").count(), 1, "{saved}");

    // A file attached with /image in this session may be named by path; nothing else.
    std::fs::write(dir.path().join("mine.json"), conversation(&format!("file://{secret}"))).unwrap();
    let script = "/load mine.json\n/image secret.png\n/load mine.json\nhi\n";
    let (code, _, err) = vl_in(dir.path(), &args, script);
    assert_eq!(code, 0, "{err}");
    let lines = error_lines(&err);
    assert_eq!(lines.len(), 1, "{err}");
    assert!(lines[0].starts_with("error: /load mine.json: messages[0].content[0]: a file: URL refused"), "{err}");
    assert!(err.contains("(loaded 1 messages from mine.json)"), "{err}");
    // A text file given to /image is refused when attached, not by every later turn.
    std::fs::write(dir.path().join("notes.png"), "just text").unwrap();
    let (code, _, err) = vl_in(dir.path(), &args, "/image notes.png\nhi\nhi again\n");
    assert_eq!(code, 0, "{err}");
    let lines = error_lines(&err);
    assert_eq!(lines.len(), 1, "{err}");
    assert!(lines[0].starts_with("error: image notes.png: "), "{err}");
    assert_eq!(err.lines().filter(|l| l.contains("prompt tokens")).count(), 2, "{err}");
}

/// A work directory holding `in.png` (a copy of a golden image): `vl run --image in.png` with
/// `extra` flags, run inside it.
struct Work {
    dir: tempfile::TempDir,
    input: Vec<u8>,
}

impl Work {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let input = std::fs::read(goldens().join("images/square.png")).unwrap();
        std::fs::write(dir.path().join("in.png"), &input).unwrap();
        Work { dir, input }
    }

    fn path(&self, p: &str) -> PathBuf {
        self.dir.path().join(p)
    }

    /// `vl run` on `model` with `--image in.png` and `extra`: (exit code, stderr). The input's
    /// bytes are checked unchanged afterwards.
    fn run(&self, model: &str, extra: &[&str]) -> (i32, String) {
        let mut args =
            vec!["run", "--model", model, "--image", "in.png", "--prompt", "Say hello.", "--max-new-tokens", "2"];
        args.extend(extra);
        let (code, _, err) = vl_in(self.dir.path(), &args, "");
        assert_eq!(std::fs::read(self.path("in.png")).unwrap(), self.input, "the input changed: {args:?}\n{err}");
        (code, err)
    }
}

#[test]
fn draw_boxes_refuses_its_inputs_directories_and_existing_files_before_any_work() {
    let w = Work::new();
    std::fs::create_dir(w.path("sub")).unwrap();
    std::fs::create_dir(w.path("dir.png")).unwrap();
    std::fs::write(w.path("old.png"), b"kept").unwrap();
    std::os::unix::fs::symlink("in.png", w.path("link.png")).unwrap();
    std::fs::hard_link(w.path("in.png"), w.path("hard.png")).unwrap();
    let abs = w.path("in.png").display().to_string();
    let input = |flag: &str, target: &str, named: &str| {
        format!("error: {flag} {target}: is the input --image {named}; name another file (an input is never replaced)")
    };
    // (extra flags, the one error line). The model does not exist: each refusal comes before it
    // is looked at.
    let cases: Vec<(Vec<&str>, String)> = vec![
        (vec!["--draw-boxes", "in.png"], input("--draw-boxes", "in.png", "in.png")),
        (vec!["--draw-boxes", "in.png", "--force"], input("--draw-boxes", "in.png", "in.png")),
        (vec!["--draw-boxes", "./sub/../in.png"], input("--draw-boxes", "./sub/../in.png", "in.png")),
        (vec!["--draw-boxes", &abs, "--force"], input("--draw-boxes", &abs, "in.png")),
        (vec!["--draw-boxes", "link.png", "--force"], input("--draw-boxes", "link.png", "in.png")),
        (vec!["--draw-boxes", "hard.png", "--force"], input("--draw-boxes", "hard.png", "in.png")),
        (vec!["--logits-out", "in.png"], input("--logits-out", "in.png", "in.png")),
        (
            vec!["--draw-boxes", "old.png"],
            "error: --draw-boxes old.png: exists; pass --force to replace it".to_string(),
        ),
        (vec!["--draw-boxes", "dir.png"], "error: --draw-boxes dir.png: is a directory; name a file".to_string()),
        (vec!["--draw-boxes", "sub", "--force"], "error: --draw-boxes sub: is a directory; name a file".to_string()),
        (
            vec!["--draw-boxes", "missing/out.png"],
            "error: --draw-boxes missing/out.png: cannot create it: the directory missing does not exist".to_string(),
        ),
        (
            vec!["--draw-boxes", "old.png/out.png"],
            "error: --draw-boxes old.png/out.png: cannot create it: the directory old.png is not a directory"
                .to_string(),
        ),
    ];
    let before = listing(w.dir.path());
    for (extra, want) in &cases {
        let (code, err) = w.run("no-such-model-dir", extra);
        assert_eq!(code, 1, "{extra:?}: {err}");
        assert_eq!(error_lines(&err), [want.as_str()], "{extra:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{extra:?}: {err}");
        assert_eq!(listing(w.dir.path()), before, "{extra:?}: a file was left behind");
        assert_eq!(std::fs::read(w.path("old.png")).unwrap(), b"kept");
    }
}

#[test]
fn draw_boxes_replaces_an_existing_file_only_with_force() {
    let w = Work::new();
    std::fs::write(w.path("old.png"), b"kept").unwrap();
    let (code, err) = w.run(&checkpoint(), &["--draw-boxes", "old.png"]);
    assert_eq!(code, 1, "{err}");
    assert_eq!(error_lines(&err), ["error: --draw-boxes old.png: exists; pass --force to replace it"], "{err}");
    assert_eq!(std::fs::read(w.path("old.png")).unwrap(), b"kept");
    // With --force: written (the answer has no boxes, so it is the image as decoded), no
    // temporary file beside it.
    let before = listing(w.dir.path());
    let (code, err) = w.run(&checkpoint(), &["--draw-boxes", "old.png", "--force"]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("the answer has no boxes or points; old.png is in.png unchanged"), "{err}");
    let drawn = image::load_from_memory(&std::fs::read(w.path("old.png")).unwrap()).unwrap().to_rgb8();
    assert_eq!(drawn, image::load_from_memory(&w.input).unwrap().to_rgb8());
    assert_eq!(listing(w.dir.path()), before);
    // A new name needs no --force; a subdirectory's file is written there.
    std::fs::create_dir(w.path("sub")).unwrap();
    let (code, err) = w.run(&checkpoint(), &["--draw-boxes", "sub/new.png"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(listing(&w.path("sub")), BTreeSet::from(["new.png".to_string()]));
}
