//! `vl` against hostile and broken inputs: decompression bombs, absurd config values, bad flags,
//! closed or full output streams, broken checkpoint parts. Each case asserts the exit code, one
//! clear line naming the culprit, and, for inputs that claim huge sizes, that the process's peak
//! resident memory (its own `ru_maxrss`, read with `wait4`) stays under a bound.
//! RUST_BACKTRACE is set for every run: error lines must not grow backtraces.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Peak RSS allowed for a run that must fail before decoding or allocating what it was sent.
/// `vl inspect` on tiny-a peaks near 135 MB (mostly the 151k-token tokenizer).
const BOUND_BYTES: u64 = 400 << 20;

fn goldens() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../goldens")
}

fn checkpoint(g: &str) -> PathBuf {
    goldens().join(g).join("checkpoint")
}

fn image(name: &str) -> String {
    goldens().join("images").join(name).display().to_string()
}

struct Outcome {
    code: i32,
    stdout: String,
    stderr: String,
    peak_rss: u64,
}

#[derive(Clone, Copy, PartialEq)]
enum Out {
    Piped,
    /// The read end is closed before the child writes (`vl ... | true`).
    Closed,
    /// /dev/full: every write fails with ENOSPC.
    Full,
}

/// Runs `vl` (offline, private HF cache, RUST_BACKTRACE=1) and measures its peak RSS.
fn run_vl(args: &[&str], out: Out) -> Outcome {
    let home = tempfile::tempdir().unwrap();
    let stdout = match out {
        Out::Full => Stdio::from(std::fs::OpenOptions::new().write(true).open("/dev/full").unwrap()),
        _ => Stdio::piped(),
    };
    // Reaped below by wait4, for its rusage (clippy sees no `wait()`).
    #[allow(clippy::zombie_processes)]
    let mut child = Command::new(env!("CARGO_BIN_EXE_vl"))
        .args(args)
        .env("HF_HOME", home.path())
        .env_remove("HF_HUB_CACHE")
        .env("HF_HUB_OFFLINE", "1")
        .env("RUST_BACKTRACE", "1")
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn vl");
    let mut so = child.stdout.take();
    if out == Out::Closed {
        so = None; // dropping the read end closes the pipe
    }
    let mut se = child.stderr.take().unwrap();
    let t_out = std::thread::spawn(move || {
        let mut s = String::new();
        if let Some(mut o) = so {
            o.read_to_string(&mut s).unwrap();
        }
        s
    });
    let t_err = std::thread::spawn(move || {
        let mut s = String::new();
        se.read_to_string(&mut s).unwrap();
        s
    });
    let mut status = 0;
    // SAFETY: plain syscall on our own child; `rusage` is fully written by the kernel.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let pid = unsafe { libc::wait4(child.id() as libc::pid_t, &mut status, 0, &mut usage) };
    assert_eq!(pid, child.id() as libc::pid_t, "wait4 failed");
    let code = if libc::WIFEXITED(status) { libc::WEXITSTATUS(status) } else { -libc::WTERMSIG(status) };
    Outcome {
        code,
        stdout: t_out.join().unwrap(),
        stderr: t_err.join().unwrap(),
        peak_rss: usage.ru_maxrss as u64 * 1024,
    }
}

/// The run fails with exit code 1 and exactly one plain line naming each needle, within the
/// memory bound.
fn fails(args: &[&str], needles: &[&str]) -> Outcome {
    let o = run_vl(args, Out::Piped);
    let err = o.stderr.trim_end();
    assert_eq!(o.code, 1, "{args:?}: exit {} stderr {err} stdout {}", o.code, o.stdout);
    assert_eq!(err.lines().count(), 1, "{args:?}: one line expected: {err}");
    assert!(err.starts_with("error: "), "{err}");
    for bad in ["panicked", "backtrace", "stack backtrace", "Os {", "Custom {", "kind:", "internal error"] {
        assert!(!err.contains(bad), "{args:?}: {bad:?} in {err}");
    }
    for n in needles {
        assert!(err.contains(n), "{args:?}: {err:?} lacks {n:?}");
    }
    assert!(o.peak_rss < BOUND_BYTES, "{args:?}: peak RSS {} MiB", o.peak_rss >> 20);
    assert!(o.stdout.is_empty(), "{args:?}: junk on stdout: {}", o.stdout);
    o
}

/// A scratch copy of a golden checkpoint: small files copied, weights and tokenizer linked.
fn scratch(g: &str) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(checkpoint(g)).unwrap() {
        let p = entry.unwrap().path();
        let name = p.file_name().unwrap();
        if name.to_str().unwrap().starts_with("model") || name == "tokenizer.json" {
            std::os::unix::fs::symlink(std::fs::canonicalize(&p).unwrap(), tmp.path().join(name)).unwrap();
        } else {
            std::fs::copy(std::fs::canonicalize(&p).unwrap(), tmp.path().join(name)).unwrap();
        }
    }
    tmp
}

/// Edits `file` (JSON) of a scratch checkpoint at a JSON pointer.
fn with_json(g: &str, file: &str, edits: &[(&str, serde_json::Value)]) -> tempfile::TempDir {
    let dir = scratch(g);
    let p = dir.path().join(file);
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    for (ptr, val) in edits {
        *v.pointer_mut(ptr).unwrap_or_else(|| panic!("{file} has no {ptr}")) = val.clone();
    }
    std::fs::write(&p, v.to_string()).unwrap();
    dir
}

/// Rewrites a scratch checkpoint's weights, `edit` seeing every (name, dtype, shape, bytes).
type RawAll = Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)>;
fn with_weights(dir: &Path, edit: impl Fn(&mut RawAll)) {
    use vl_models::checkpoint::{write_safetensors, Checkpoint, RawTensor};
    let ck = Checkpoint::open(dir).unwrap();
    let mut all: RawAll = ck
        .tensors()
        .keys()
        .map(|k| {
            let (info, bytes) = ck.raw(k).unwrap();
            (k.clone(), info.dtype, info.shape.clone(), bytes.to_vec())
        })
        .collect();
    let files: Vec<PathBuf> = ck.files().to_vec();
    drop(ck);
    edit(&mut all);
    for f in files {
        std::fs::remove_file(f).unwrap();
    }
    let _ = std::fs::remove_file(dir.join("model.safetensors.index.json"));
    let raws: Vec<RawTensor> =
        all.iter().map(|(n, d, s, b)| RawTensor { name: n.clone(), dtype: *d, shape: s.clone(), data: b }).collect();
    write_safetensors(&dir.join("model.safetensors"), &raws).unwrap();
}

fn crc32(bytes: &[u8]) -> u32 {
    let mut c = !0u32;
    for &b in bytes {
        c ^= b as u32;
        for _ in 0..8 {
            c = if c & 1 != 0 { 0xEDB8_8320 ^ (c >> 1) } else { c >> 1 };
        }
    }
    !c
}

fn png_chunk(out: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) {
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    let start = out.len();
    out.extend_from_slice(kind);
    out.extend_from_slice(data);
    let crc = crc32(&out[start..]);
    out.extend_from_slice(&crc.to_be_bytes());
}

/// A valid-looking PNG whose header claims w x h RGB pixels, with a few bytes of image data.
fn png_bomb(w: u32, h: u32) -> Vec<u8> {
    let mut out = b"\x89PNG\r\n\x1a\n".to_vec();
    let mut ihdr = Vec::new();
    ihdr.extend_from_slice(&w.to_be_bytes());
    ihdr.extend_from_slice(&h.to_be_bytes());
    ihdr.extend_from_slice(&[8, 2, 0, 0, 0]);
    png_chunk(&mut out, b"IHDR", &ihdr);
    png_chunk(&mut out, b"IDAT", &[0x78, 0x9c, 0x03, 0x00, 0x00, 0x00, 0x00, 0x01]);
    png_chunk(&mut out, b"IEND", &[]);
    out
}

/// A real 1-bit PNG of w x h pixels, all black: megapixels in a few kilobytes.
fn png_real_1bit(w: u32, h: u32) -> Vec<u8> {
    let mut out = Vec::new();
    {
        let mut enc = png::Encoder::new(&mut out, w, h);
        enc.set_color(png::ColorType::Grayscale);
        enc.set_depth(png::BitDepth::One);
        enc.set_compression(png::Compression::Balanced);
        let mut wr = enc.write_header().unwrap();
        let mut stream = wr.stream_writer().unwrap();
        let row = vec![0u8; (w as usize).div_ceil(8)];
        for _ in 0..h {
            std::io::Write::write_all(&mut stream, &row).unwrap();
        }
        stream.finish().unwrap();
    }
    out
}

/// A 40-byte GIF whose screen and frame claim 65535 x 65535.
fn gif_bomb() -> Vec<u8> {
    let mut g = b"GIF89a".to_vec();
    g.extend_from_slice(&[0xff, 0xff, 0xff, 0xff, 0x00, 0x00, 0x00]);
    g.extend_from_slice(&[0x2c, 0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0x00]);
    g.extend_from_slice(&[0x02, 0x02, 0x4c, 0x01, 0x00, 0x3b]);
    g
}

/// The golden photo with its frame header patched to claim 65535 x 65535.
fn jpeg_bomb() -> Vec<u8> {
    let mut b = std::fs::read(image("photo.jpg")).unwrap();
    let sof = b.windows(2).position(|w| w == [0xff, 0xc0]).expect("baseline JPEG");
    b[sof + 5..sof + 9].copy_from_slice(&[0xff, 0xff, 0xff, 0xff]);
    b
}

#[test]
fn decompression_bombs_fail_from_the_header_within_bounded_memory() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = checkpoint("tiny-a").display().to_string();
    let cases: Vec<(&str, Vec<u8>, Vec<&str>)> = vec![
        ("bomb.png", png_bomb(60000, 60000), vec!["60000x60000", "3600000000 pixels", "67108864"]),
        ("bomb65535.png", png_bomb(65535, 65535), vec!["65535x65535", "pixels"]),
        ("bomb.gif", gif_bomb(), vec!["bomb.gif", "65535x65535"]),
        ("bomb.jpg", jpeg_bomb(), vec!["bomb.jpg", "65535x65535"]),
        ("real-1bit.png", png_real_1bit(20000, 20000), vec!["20000x20000", "400000000 pixels"]),
    ];
    for (name, bytes, needles) in &cases {
        let p = tmp.path().join(name);
        std::fs::write(&p, bytes).unwrap();
        let ps = p.to_str().unwrap();
        let mut needles = needles.clone();
        needles.extend([name, "--max-image-pixels"]);
        let o = fails(&["run", "--model", &ck, "--image", ps], &needles);
        println!("{name} ({} bytes): peak RSS {} MiB: {}", bytes.len(), o.peak_rss >> 20, o.stderr.trim());
    }
    assert!(cases[0].1.len() < 100 && cases[2].1.len() <= 40 && cases[4].1.len() < 400_000);
    // As a video: the canvas is refused from the header too (the per-frame pixel limit).
    let gif = tmp.path().join("bomb.gif").display().to_string();
    let o = fails(&["run", "--model", &ck, "--video", &gif], &["video", "bomb.gif", "65535x65535", "pixels per frame"]);
    println!("bomb.gif as a video: peak RSS {} MiB", o.peak_rss >> 20);
    // Endless input: read up to the byte limit, then refused.
    let o =
        fails(&["run", "--model", &ck, "--image", "/dev/zero"], &["/dev/zero", "134217728 bytes", "--max-image-bytes"]);
    println!("/dev/zero: peak RSS {} MiB", o.peak_rss >> 20);
    // Lower limits refuse ordinary files, naming the value.
    fails(
        &["run", "--model", &ck, "--image", &image("square.png"), "--max-image-bytes", "1000"],
        &["38627 bytes", "1000 bytes"],
    );
    fails(&["run", "--model", &ck, "--image", &image("square.png"), "--max-image-pixels", "1000"], &["pixels", "1000"]);
    // A truncated JPEG is an error, as in the reference (Pillow: "image file is truncated").
    let full = std::fs::read(image("photo.jpg")).unwrap();
    let cut = tmp.path().join("cut.jpg");
    std::fs::write(&cut, &full[..full.len() / 2]).unwrap();
    fails(&["run", "--model", &ck, "--image", cut.to_str().unwrap()], &["cut.jpg", "truncated JPEG"]);
}

#[test]
fn absurd_config_values_are_refused_before_allocating() {
    use serde_json::json;
    let img = image("square.png");
    // (file, edits, needles); each also fails `inspect` with the same line.
    type Case<'a> = (&'a str, Vec<(&'a str, serde_json::Value)>, Vec<&'a str>);
    let cases: Vec<Case> = vec![
        (
            "config.json",
            vec![("/text_config/num_hidden_layers", json!(1_000_000_000u64))],
            vec!["num_hidden_layers", "1000000000", "1..=1024"],
        ),
        (
            "config.json",
            vec![("/vision_config/depth", json!(1_000_000_000u64))],
            vec!["vision_config.depth", "1000000000"],
        ),
        (
            "config.json",
            vec![("/text_config/num_attention_heads", json!(0))],
            vec!["num_attention_heads", "0 is outside"],
        ),
        ("config.json", vec![("/text_config/rms_norm_eps", json!(-1e-6))], vec!["rms_norm_eps", "-0.000001"]),
        ("config.json", vec![("/text_config/rope_parameters/rope_theta", json!(0.0))], vec!["rope_theta", "0 must be"]),
        ("config.json", vec![("/text_config/vocab_size", json!(u64::MAX))], vec!["config.json"]),
        (
            "config.json",
            vec![("/vision_config/deepstack_visual_indexes", json!([0, 2, 2]))],
            vec!["deepstack_visual_indexes", "listed twice"],
        ),
        (
            "config.json",
            vec![("/image_token_id", json!(999_999_999u64))],
            vec!["image_token_id", "outside the vocabulary"],
        ),
        ("preprocessor_config.json", vec![("/patch_size", json!(0))], vec!["preprocessor_config.json", "patch_size"]),
        ("preprocessor_config.json", vec![("/merge_size", json!(0))], vec!["merge_size"]),
        ("preprocessor_config.json", vec![("/temporal_patch_size", json!(0))], vec!["temporal_patch_size"]),
        (
            "preprocessor_config.json",
            vec![("/patch_size", json!(14))],
            vec!["patch_size", "differs from config.json vision_config.patch_size 16"],
        ),
        ("preprocessor_config.json", vec![("/image_std", json!([0.5, 0.0, 0.5]))], vec!["image_std", "> 0"]),
        (
            "preprocessor_config.json",
            vec![("/size", json!({"shortest_edge": 4_000_000, "longest_edge": 65536}))],
            vec!["size.shortest_edge", "above max_pixels 65536"],
        ),
        (
            "video_preprocessor_config.json",
            vec![("/patch_size", json!(14))],
            vec![
                "video_preprocessor_config.json",
                "patch_size",
                "differs from config.json vision_config.patch_size 16",
            ],
        ),
        (
            "video_preprocessor_config.json",
            vec![("/size", json!({"shortest_edge": 4096, "longest_edge": 99_999_999_999u64}))],
            vec!["video_preprocessor_config.json", "size.longest_edge", "99999999999"],
        ),
        (
            "generation_config.json",
            vec![("/eos_token_id", json!([151645, 7_000_000]))],
            vec!["eos_token_id", "7000000"],
        ),
    ];
    for (file, edits, needles) in cases {
        let dir = with_json("tiny-a", file, &edits);
        let d = dir.path().to_str().unwrap();
        let run = fails(&["run", "--model", d, "--image", &img], &needles);
        let inspect = fails(&["inspect", "--model", d], &needles);
        assert_eq!(run.stderr, inspect.stderr, "inspect and run disagree");
    }
}

#[test]
fn bad_flags_are_refused_with_the_flag_and_value() {
    let ck = checkpoint("tiny-a").display().to_string();
    let q35 = checkpoint("tiny-q35").display().to_string();
    let embed = checkpoint("tiny-embed").display().to_string();
    let img = image("square.png");
    let cases: Vec<(Vec<&str>, Vec<&str>)> = vec![
        (vec!["--temperature", "NaN"], vec!["--temperature", "NaN"]),
        (vec!["--temperature=-1"], vec!["--temperature", "-1"]),
        (vec!["--temperature", "inf"], vec!["--temperature", "inf"]),
        (vec!["--top-p", "2"], vec!["--top-p", "2 must be in (0, 1]"]),
        (vec!["--top-p", "0"], vec!["--top-p"]),
        (vec!["--min-p", "2"], vec!["--min-p", "2 must be in [0, 1]"]),
        (vec!["--repetition-penalty", "0"], vec!["--repetition-penalty", "0 must be"]),
        (vec!["--max-new-tokens", "0"], vec!["--max-new-tokens"]),
        (vec!["--min-pixels", "18446744073709551615"], vec!["--min-pixels", "18446744073709551615", "33554432"]),
        (vec!["--min-pixels", "1000000000000"], vec!["--min-pixels", "1000000000000"]),
        (vec!["--min-pixels", "100000000"], vec!["--min-pixels", "100000000"]),
        (vec!["--min-pixels", "200000", "--max-pixels", "100000"], vec!["--min-pixels", "200000", "100000"]),
        (vec!["--max-pixels", "0"], vec!["--max-pixels", "0"]),
        (vec!["--speculative", "ngram", "--draft-max", "16"], vec!["--draft-max", "16 must be in 1..=15"]),
        (vec!["--speculative", "ngram", "--ngram-min", "5"], vec!["--ngram-min", "5 must be in 1..=4"]),
        (vec!["--ngram-max", "17"], vec!["--ngram-max", "17 must be in 1..=16"]),
        (vec!["--speculative", "draft"], vec!["--speculative draft", "--draft-model"]),
        (vec!["--speculative", "mtp"], vec!["speculative", "multi-token-prediction head"]),
        (vec!["--draft-model", "/nonexistent/draft"], vec!["--draft-model", "/nonexistent/draft"]),
        (vec!["--draft-model", &q35], vec!["draft model", "its tokenizer has 248"]),
        (vec!["--draft-model", &embed], vec!["draft model", "pools"]),
        (vec!["--draft-model", &ck, "--speculative", "ngram"], vec!["--draft-model", "--speculative ngram"]),
        (vec!["--speculative", "eagle3"], vec!["--speculative", "`eagle3`"]),
    ];
    for (flags, needles) in cases {
        let mut args = vec!["run", "--model", &ck, "--image", &img];
        args.extend(flags);
        fails(&args, &needles);
    }
    // Values that are not numbers are usage errors: one line, exit code 2.
    for (flag, value) in
        [("--min-pixels", "1e12"), ("--temperature", "warm"), ("--max-new-tokens", "many"), ("--draft-vocab", "0")]
    {
        let o = run_vl(&["run", "--model", &ck, "--image", &img, flag, value], Out::Piped);
        assert_eq!(o.code, 2, "{flag} {value}: {}", o.stderr);
        let err = o.stderr.trim_end();
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(err.starts_with("error: ") && err.contains(flag) && err.contains(value), "{err}");
    }
    // A pixel budget whose image alone overflows the 2048-token context fails from the header,
    // before the image is resized (2^25 pixels would be 800 MB of patch rows).
    let o = fails(
        &["run", "--model", &ck, "--image", &img, "--min-pixels", "33554432", "--max-pixels", "33554432"],
        &["from 1 image", "context of 2048", "--max-pixels"],
    );
    println!("context-overflowing budget: peak RSS {} MiB", o.peak_rss >> 20);
    // The KV budget: 0 is refused; a prompt whose cache exceeds it is refused naming the flag that
    // raises it (1,510 tokens of tiny-q35 need 1.5 MiB).
    fails(&["run", "--model", &ck, "--image", &img, "--kv-cache-mib", "0"], &["--kv-cache-mib 0"]);
    let long = vec!["river"; 1500].join(" ");
    fails(
        &["run", "--model", &q35, "--prompt", &long, "--kv-cache-mib", "1", "--max-new-tokens", "2"],
        &["1510 tokens", "1.5 MiB", "budget of 1.0 MiB", "--kv-cache-mib"],
    );
    // --logits-out to an unwritable place fails first, with plain text.
    let o = fails(
        &["run", "--model", &ck, "--logits-out", "/no/such/dir/logits.safetensors"],
        &["--logits-out", "/no/such/dir", "No such file"],
    );
    assert!(!o.stderr.contains("prefill"));
}

#[test]
fn junk_weights_and_broken_parts_fail_in_run_and_inspect_alike() {
    let img = image("square.png");
    let check = |dir: &Path, needles: &[&str]| {
        let d = dir.to_str().unwrap();
        let run = fails(&["run", "--model", d, "--image", &img, "--max-new-tokens", "2"], needles);
        let inspect = fails(&["inspect", "--model", d], needles);
        assert_eq!(run.stderr, inspect.stderr);
    };
    // An I32 tensor.
    let dir = scratch("tiny-a");
    let key = "model.language_model.norm.weight";
    with_weights(dir.path(), |all| {
        let t = all.iter_mut().find(|t| t.0 == key).unwrap();
        t.1 = safetensors::Dtype::I32;
    });
    check(dir.path(), &[key, "unsupported dtype", "i32"]);
    // An MLX-quantized weight without its biases.
    let dir = scratch("tiny-q-mlx4");
    let biases = "language_model.model.layers.0.mlp.up_proj.biases";
    with_weights(dir.path(), |all| all.retain(|t| t.0 != biases));
    check(dir.path(), &[biases, "missing"]);
    // A broken tokenizer.
    let dir = scratch("tiny-a");
    std::fs::remove_file(dir.path().join("tokenizer.json")).unwrap();
    std::fs::write(dir.path().join("tokenizer.json"), "{\"model\": 42}").unwrap();
    check(dir.path(), &["tokenizer.json", "invalid tokenizer"]);
    // A chat template that does not parse, and one that fails when rendered.
    let dir = scratch("tiny-a");
    std::fs::write(dir.path().join("chat_template.jinja"), "{% if %}").unwrap();
    check(dir.path(), &["chat_template.jinja", "invalid chat template"]);
    std::fs::write(dir.path().join("chat_template.jinja"), "{{ raise_exception('no images here') }}").unwrap();
    check(dir.path(), &["chat template", "no images here"]);
    // A template that drops the image placeholder.
    std::fs::write(dir.path().join("chat_template.jinja"), "{% for m in messages %}{{ m.role }}{% endfor %}").unwrap();
    check(dir.path(), &["chat template", "0 image placeholders for 1 images"]);
    // A preprocessor config that is not JSON.
    let dir = scratch("tiny-a");
    std::fs::write(dir.path().join("preprocessor_config.json"), "{\"patch_size\": ").unwrap();
    check(dir.path(), &["preprocessor_config.json", "invalid JSON"]);
}

#[test]
fn nan_weights_are_an_error_not_a_token() {
    let dir = scratch("tiny-a");
    with_weights(dir.path(), |all| {
        let t = all.iter_mut().find(|t| t.0 == "model.language_model.norm.weight").unwrap();
        t.3 = f32::NAN.to_le_bytes().repeat(t.3.len() / 4);
    });
    let d = dir.path().to_str().unwrap();
    fails(&["run", "--model", d, "--prompt", "hi", "--json"], &["non-finite logits", "NaN", d]);
}

#[test]
fn closed_and_full_output_streams_end_cleanly() {
    let ck = checkpoint("tiny-a").display().to_string();
    for args in [
        vec!["run", "--model", &ck, "--prompt", "hi", "--max-new-tokens", "4", "--json"],
        vec!["run", "--model", &ck, "--prompt", "hi", "--max-new-tokens", "4"],
        vec!["inspect", "--model", &ck],
        vec!["inspect", "--model", &ck, "--json"],
    ] {
        // A closed pipe: quietly.
        let o = run_vl(&args, Out::Closed);
        assert_eq!(o.code, 0, "{args:?}: {}", o.stderr);
        assert!(!o.stderr.contains("error") && !o.stderr.contains("panicked"), "{args:?}: {}", o.stderr);
        // A full disk: one line, exit code 1.
        let o = run_vl(&args, Out::Full);
        assert_eq!(o.code, 1, "{args:?}: {}", o.stderr);
        let last = o.stderr.trim_end().lines().last().unwrap_or("");
        assert!(
            last.starts_with("error: writing to stdout") && last.contains("No space left"),
            "{args:?}: {}",
            o.stderr
        );
        assert!(!o.stderr.contains("panicked"));
    }
}

#[test]
fn reports_say_what_happened() {
    let ck = checkpoint("tiny-a").display().to_string();
    // --quantize on dims that fit no k-quant block: the report shows every group still dense.
    let o = run_vl(
        &["run", "--model", &ck, "--prompt", "hi", "--max-new-tokens", "2", "--quantize", "q4k", "--json"],
        Out::Piped,
    );
    assert_eq!(o.code, 0, "{}", o.stderr);
    let v: serde_json::Value = serde_json::from_str(o.stdout.trim()).unwrap();
    assert_eq!(v["quantization"], "q4k");
    let groups = v["weights"].as_array().unwrap();
    assert_eq!(groups.len(), 3, "{groups:?}");
    assert!(groups.iter().all(|g| g["storage"] == "f32"), "{groups:?}");
    assert!(
        o.stderr.contains("--quantize q4k applied to no tensor") && o.stderr.contains("multiple of 256"),
        "{}",
        o.stderr
    );
    // A generation that runs into the context says so.
    let dir = with_json("tiny-a", "config.json", &[("/text_config/max_position_embeddings", serde_json::json!(40))]);
    let d = dir.path().to_str().unwrap();
    let o = run_vl(&["run", "--model", d, "--prompt", "hi", "--max-new-tokens", "100", "--json"], Out::Piped);
    assert_eq!(o.code, 0, "{}", o.stderr);
    let v: serde_json::Value = serde_json::from_str(o.stdout.trim()).unwrap();
    let prompt = v["prompt_tokens"].as_u64().unwrap();
    assert!(prompt < 40);
    assert_eq!(v["stop_reason"], "context_full", "{v}");
    assert_eq!(v["generated_tokens"].as_u64().unwrap(), 40 - prompt);
}

#[test]
fn broken_gguf_files_fail_in_run_and_inspect_alike() {
    let img = image("square.png");
    let text = std::fs::read(goldens().join("gguf/tiny-a-f32.gguf")).unwrap();
    let mmproj = goldens().join("gguf/mmproj-tiny-a-f32.gguf");
    let dir = tempfile::tempdir().unwrap();
    let check = |bytes: &[u8], needles: &[&str]| {
        let f = dir.path().join("model.gguf");
        std::fs::write(&f, bytes).unwrap();
        let (f, m) = (f.to_str().unwrap(), mmproj.to_str().unwrap());
        let run = fails(&["run", "--model", f, "--mmproj", m, "--image", &img, "--max-new-tokens", "2"], needles);
        let inspect = fails(&["inspect", "--model", f, "--mmproj", m], needles);
        assert_eq!(run.stderr, inspect.stderr);
    };
    // Truncated in the tensor data, and in the header.
    check(&text[..text.len() / 2], &["model.gguf", "past the end of the file"]);
    check(&text[..1000], &["model.gguf", "truncated header"]);
    check(b"not a gguf at all", &["model.gguf", "not a GGUF file"]);
    // A string length of 2^62 in the first key: refused from the header, nothing allocated.
    let mut huge = text[..24].to_vec();
    huge.extend((1u64 << 62).to_le_bytes());
    huge.extend(&text[32..4096]);
    check(&huge, &["model.gguf", "exceeds"]);
    // The mmproj given as the text model.
    let m = mmproj.to_str().unwrap();
    fails(&["run", "--model", m, "--max-new-tokens", "2"], &["not a text model", "clip", "--mmproj"]);
    // --mmproj with a checkpoint directory.
    let ck = checkpoint("tiny-a");
    fails(&["run", "--model", ck.to_str().unwrap(), "--mmproj", m], &["--mmproj goes with a GGUF"]);
}

/// Chat templates are programs a checkpoint ships. Generated hostile ones (loops that never end
/// in practice, at several nestings and only on long conversations, endless recursion, output
/// bombs) end in a bounded time with one line naming the template, in run and inspect alike
/// (the server side: serve.rs).
#[test]
fn hostile_chat_templates_are_bounded_in_time_output_and_recursion() {
    let img = image("square.png");
    let dir = scratch("tiny-a");
    let file = dir.path().join("chat_template.jinja");
    let d = dir.path().to_str().unwrap().to_string();
    let mut cases: Vec<(String, &str)> = vec![];
    for depth in 2..=4 {
        let open: String = (0..depth).map(|i| format!("{{% for i{i} in range(100000) %}}")).collect();
        let close = "{% endfor %}".repeat(depth);
        cases.push((format!("{open}x{close}"), "instructions"));
    }
    cases.push(("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}".into(), "recursion"));
    for width in [1000, 4000] {
        cases.push((
            format!("{{% for a in range(100000) %}}{{% for b in range(100) %}}{{{{ 'x' * {width} }}}}{{% endfor %}}{{% endfor %}}"),
            "bytes",
        ));
    }
    // Memory: values that double (or square) in a loop through `namespace()` reach gigabytes in a
    // few dozen instructions; the render's child process is bounded (256 MiB), not this one.
    for grow in ["ns.s ~ ns.s", "ns.s + ns.s", "ns.s|replace('x', ns.s)", "[ns.s, ns.s]|join"] {
        cases.push((
            format!("{{% set ns = namespace(s='xx') %}}{{% for i in range(64) %}}{{% set ns.s = {grow} %}}{{% endfor %}}{{{{ ns.s|length }}}}"),
            "memory",
        ));
    }
    cases.push((
        "{% set ns = namespace(l=[1]) %}{% for i in range(64) %}{% set ns.l = ns.l + ns.l %}{% endfor %}{{ ns.l|length }}".into(),
        "memory",
    ));
    for (src, needle) in &cases {
        std::fs::write(&file, src).unwrap();
        let t = std::time::Instant::now();
        let run =
            fails(&["run", "--model", &d, "--image", &img, "--max-new-tokens", "2"], &["chat_template.jinja", needle]);
        let inspect = fails(&["inspect", "--model", &d], &["chat_template.jinja", needle]);
        assert_eq!(run.stderr, inspect.stderr);
        assert!(t.elapsed().as_secs() < 30, "{src}: {:?}", t.elapsed());
    }
}

/// Hostile grammars and sampler lists through `vl run`: each refused in one line naming the flag
/// and the bound, before the model loads, within the memory bound.
#[test]
fn hostile_grammars_and_sampler_lists_are_refused_by_their_bound() {
    let ck = checkpoint("tiny-a");
    let ck = ck.to_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let huge = dir.path().join("huge.gbnf");
    std::fs::write(&huge, format!("root ::= \"{}\"\n", "a".repeat(300 << 10))).unwrap();
    let deep = dir.path().join("deep.gbnf");
    std::fs::write(&deep, format!("root ::= {}\"a\"{}\n", "(".repeat(5000), ")".repeat(5000))).unwrap();
    let copies = dir.path().join("copies.gbnf");
    std::fs::write(&copies, "root ::= ((\"ab\"{100}){100}){100}\n").unwrap();
    let (h, d, c) = (huge.to_str().unwrap(), deep.to_str().unwrap(), copies.to_str().unwrap());
    let long = "x".repeat(41);
    let many: Vec<String> = (0..33).flat_map(|i| ["--dry-sequence-breaker".to_string(), format!("b{i}")]).collect();
    let mut too_many = vec!["run", "--model", ck, "--dry-multiplier", "1"];
    too_many.extend(many.iter().map(String::as_str));
    for (args, needles) in [
        (vec!["run", "--model", ck, "--grammar", h], vec!["--grammar", "huge.gbnf"]),
        (vec!["run", "--model", ck, "--grammar", d], vec!["--grammar", "nested more than 64"]),
        (vec!["run", "--model", ck, "--grammar", c], vec!["--grammar", "more than 10000"]),
        (vec!["run", "--model", ck, "--regex", "((a{100}){100}){100}"], vec!["--regex", "spells out"]),
        (vec!["run", "--model", ck, "--dry-sequence-breaker", &long], vec!["--dry-sequence-breaker", "41 characters"]),
        (too_many, vec!["--dry-sequence-breaker", "33 breakers"]),
    ] {
        fails(&args, &needles);
    }
}

/// A config key the loader does not understand is named on stderr at load (a line, with the
/// model's path), and the answer is the checkpoint's own: the key is ignored, not guessed at.
#[test]
fn unknown_config_keys_are_named_at_load() {
    for g in ["tiny-a", "tiny-q35"] {
        let dir = scratch(g);
        let p = dir.path().join("config.json");
        let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        v["frobnicate"] = serde_json::json!(true);
        // A key that would write escape codes and a line break to the terminal, and run long.
        v[format!("\u{1b}[31mred\nline{}", "x".repeat(100))] = serde_json::json!(1);
        v["text_config"]["future_knob"] = serde_json::json!(3);
        std::fs::write(&p, serde_json::to_string_pretty(&v).unwrap()).unwrap();
        let run = |model: &str| {
            let args = ["run", "--model", model, "--prompt", "Hello", "--max-new-tokens", "4", "--temperature", "0"];
            run_vl(&args, Out::Piped)
        };
        let plain = run(checkpoint(g).to_str().unwrap());
        let edited = run(dir.path().to_str().unwrap());
        assert_eq!((plain.code, edited.code), (0, 0), "{g}: {} / {}", plain.stderr, edited.stderr);
        assert!(!plain.stderr.contains("not understood"), "{g}: {}", plain.stderr);
        assert_eq!(edited.stdout, plain.stdout, "{g}");
        let line = edited.stderr.lines().find(|l| l.starts_with("warning:")).unwrap_or_default();
        // The hostile key escaped and cut to 64 characters; nothing raw reaches the terminal.
        assert!(!edited.stderr.contains('\u{1b}') && !edited.stderr.contains("red\nline"), "{g}: {}", edited.stderr);
        assert!(!line.contains(&"x".repeat(60)), "{g}: {line:?}");
        for needle in [
            dir.path().to_str().unwrap(),
            "config.json: 3 key(s) not understood",
            "frobnicate",
            "text_config.future_knob",
            "\\u{1b}[31mred\\nlinexx",
        ] {
            assert!(line.contains(needle), "{g}: {line:?} lacks {needle:?} ({})", edited.stderr);
        }
    }
}
