//! The first hour, round two: usage errors with clap's suggestions and the subcommand's help,
//! negative numbers reaching the range checks, `--help` under headings with every flag
//! described, the uneven errors made one line naming the flag and the file, and the CPU's
//! default quantization said in the stats line and `--json`.

mod common;

use std::process::Command;

use common::{error_lines, goldens};

fn checkpoint(g: &str) -> String {
    goldens().join(g).join("checkpoint").display().to_string()
}

/// Runs `vl` with a private, empty Hugging Face cache and no network: (exit code, stdout, stderr).
fn vl(args: &[&str]) -> (i32, String, String) {
    let home = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_vl"))
        .args(args)
        .env("HF_HOME", home.path())
        .env_remove("HF_HUB_CACHE")
        .env("HF_HUB_OFFLINE", "1")
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run vl");
    common::outcome(out)
}

#[test]
fn usage_errors_carry_clap_s_suggestions_and_the_subcommand_s_help() {
    let (code, _, err) = vl(&["run", "--modle", "x"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.starts_with("error: unexpected argument '--modle' found"), "{err}");
    assert!(err.contains("tip: a similar argument exists: '--model'"), "{err}");
    assert!(err.contains("For more information, try 'vl run --help'."), "{err}");
    assert!(!err.contains("(see vl --help)"), "{err}");

    let (code, _, err) = vl(&["rum", "--prompt", "hi"]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("unrecognized subcommand 'rum'") && err.contains("a similar subcommand exists: 'run'"),
        "{err}"
    );
    assert!(err.contains("For more information, try 'vl --help'."), "{err}");

    let (code, _, err) = vl(&["serve", "--device", "tpu"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("invalid value 'tpu' for '--device <DEVICE>'"), "{err}");
    assert!(err.contains("[possible values: cpu, metal, cuda]"), "{err}");
    assert!(err.contains("For more information, try 'vl serve --help'."), "{err}");

    let (code, _, err) = vl(&["quantize", "--model", "m", "--out", "o", "--quantize", "q3k"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("[possible values: q4k, q5k, q6k, q8, q4k_m, bf16, f16, f32]"), "{err}");
}

#[test]
fn negative_numbers_reach_the_range_checks() {
    let ck = checkpoint("tiny-a");
    for (args, line) in [
        (vec!["run", "--temperature", "-1"], "error: --temperature: -1 must be a finite number >= 0 (0 = greedy)"),
        (vec!["chat", "--temperature", "-1"], "error: --temperature: -1 must be a finite number >= 0 (0 = greedy)"),
        (vec!["run", "--video-fps", "-2"], "error: --video-fps -2"),
    ] {
        let mut args = args.clone();
        args.extend(["--model", ck.as_str()]);
        let (code, _, err) = vl(&args);
        assert_eq!(code, 1, "{args:?}: {err}");
        let lines = error_lines(&err);
        assert_eq!(lines.len(), 1, "{args:?}: {err}");
        assert!(lines[0].starts_with(line), "{args:?}: {err}");
        assert!(!err.contains("unexpected argument"), "{err}");
    }
    // An unsigned count: clap's own invalid-value message, not "unexpected argument".
    let (code, _, err) = vl(&["run", "--max-new-tokens", "-3"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("invalid value '-3' for '--max-new-tokens"), "{err}");
}

/// Each flag line of `vl SUB --help` (long help) and whether a description follows it.
fn flags_without_description(help: &str) -> Vec<String> {
    let lines: Vec<&str> = help.lines().collect();
    let mut missing = Vec::new();
    for (i, l) in lines.iter().enumerate() {
        let t = l.trim_start();
        let indent = l.len() - t.len();
        if !(t.starts_with("--") || t.starts_with("-h")) || indent > 6 {
            continue;
        }
        let next = lines.get(i + 1).copied().unwrap_or("");
        // On the same line after two spaces (short help), or on the next, indented further.
        let same_line = t.split_once("  ").is_some_and(|(_, d)| !d.trim().is_empty());
        let described = same_line || (next.len() - next.trim_start().len() > indent && !next.trim().is_empty());
        if !described {
            missing.push(t.to_string());
        }
    }
    missing
}

#[test]
fn help_is_grouped_under_headings_and_every_flag_is_described() {
    let want: &[(&str, &[&str])] = &[
        ("run", &["Model:", "Input:", "Generation:", "Output:", "Limits:"]),
        ("chat", &["Model:", "Input:", "Generation:", "Limits:"]),
        ("serve", &["Model:", "Input:", "Generation:", "Limits:", "Performance:", "Server:"]),
        ("inspect", &["Model:", "Output:"]),
        ("quantize", &["Model:", "Output:"]),
    ];
    for (sub, headings) in want {
        let (code, out, err) = vl(&[sub, "--help"]);
        assert_eq!(code, 0, "{err}");
        for h in *headings {
            assert!(out.lines().any(|l| l == *h), "vl {sub} --help has no {h}:\n{out}");
        }
        let missing = flags_without_description(&out);
        assert!(missing.is_empty(), "vl {sub} --help: undescribed {missing:?}\n{out}");
        // Only --help is left under the plain Options heading.
        let options: Vec<&str> = out
            .lines()
            .skip_while(|l| *l != "Options:")
            .skip(1)
            .take_while(|l| l.is_empty() || l.starts_with(' '))
            .filter(|l| l.trim_start().starts_with("--") && !l.trim_start().starts_with("--help"))
            .collect();
        assert!(options.is_empty(), "vl {sub} --help: flags without a heading: {options:?}");
    }
    // Every value explained.
    let (_, out, _) = vl(&["run", "--help"]);
    for v in ["- cpu:", "- cuda:", "- q4k:", "- q5k:", "- q6k:", "- q8:", "- off:", "- none:"] {
        assert!(out.contains(v), "vl run --help does not explain {v}\n{out}");
    }
    assert!(out.contains("--seed") && out.contains("Seed of the sampler"), "{out}");
    let (_, out, _) = vl(&["quantize", "--help"]);
    for v in ["- q4k:", "- q5k:", "- q6k:", "- q8:", "- q4k_m:"] {
        assert!(out.contains(v), "vl quantize --help does not explain {v}\n{out}");
    }
    // The top-level about lines.
    let (_, out, _) = vl(&["--help"]);
    let line = |name: &str| out.lines().find(|l| l.trim_start().starts_with(name)).unwrap_or("").to_string();
    assert!(line("serve").contains("/v1/responses") && line("serve").contains("web chat"), "{out}");
    assert!(line("chat").contains("/save") && line("chat").contains("/load"), "{out}");
}

#[test]
fn the_folder_above_a_checkpoint_points_at_it_in_run_and_inspect_alike() {
    let above = goldens().join("tiny-a").display().to_string();
    let inside = goldens().join("tiny-a").join("checkpoint").display().to_string();
    let want = format!(
        "error: --model {above}: not a model directory (no config.json); its subdirectory {inside} holds one: pass --model {inside}"
    );
    for args in [vec!["run", "--prompt", "hi", "--model", &above], vec!["inspect", "--model", &above]] {
        let (code, _, err) = vl(&args);
        assert_eq!(code, 1, "{err}");
        assert_eq!(error_lines(&err), [want.as_str()], "{args:?}");
        assert!(!err.contains("no weights found"), "{err}");
    }
    // No such subdirectory: no suggestion.
    let empty = tempfile::tempdir().unwrap();
    let (code, _, err) = vl(&["inspect", "--model", empty.path().to_str().unwrap()]);
    assert_eq!(code, 1);
    assert_eq!(
        error_lines(&err),
        [format!("error: --model {}: not a model directory (no config.json)", empty.path().display())]
    );
}

#[test]
fn a_missing_mmproj_names_the_flag() {
    let gguf = goldens().join("gguf/tiny-a-f32.gguf").display().to_string();
    for sub in ["run", "inspect"] {
        let (code, _, err) = vl(&[sub, "--model", &gguf, "--mmproj", "nope.gguf"]);
        assert_eq!(code, 1, "{err}");
        assert_eq!(error_lines(&err), ["error: --mmproj nope.gguf: no such file"], "{sub}");
    }
}

#[test]
fn a_gguf_without_its_projector_names_the_file_and_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("tiny-a-f32.gguf");
    std::fs::copy(goldens().join("gguf/tiny-a-f32.gguf"), &text).unwrap();
    let image = goldens().join("images/square.png").display().to_string();
    let (code, _, err) = vl(&["run", "--model", text.to_str().unwrap(), "--image", &image, "--quantize", "off"]);
    assert_eq!(code, 1, "{err}");
    let lines = error_lines(&err);
    assert_eq!(lines.len(), 1, "{err}");
    assert!(lines[0].starts_with("error: tiny-a-f32.gguf: a GGUF text model without its vision projector"), "{err}");
    assert!(lines[0].ends_with("pass --mmproj FILE.gguf"), "{err}");
    assert!(!lines[0].contains("model:"), "{err}");
}

#[test]
fn draw_boxes_in_a_missing_directory_names_no_temporary_file() {
    let image = goldens().join("images/square.png").display().to_string();
    let (code, _, err) =
        vl(&["run", "--model", &checkpoint("tiny-a"), "--image", &image, "--draw-boxes", "/missing/dir/b.png"]);
    assert_eq!(code, 1, "{err}");
    assert_eq!(
        error_lines(&err),
        ["error: --draw-boxes /missing/dir/b.png: cannot create it: the directory /missing/dir does not exist"]
    );
    assert!(!err.contains(".tmp"), "{err}");
}

#[test]
fn quantize_says_in_one_line_which_tensors_fell_back_to_what() {
    let out = tempfile::tempdir().unwrap();
    // tiny-a's rows (32 values) fill no Q4_K block (256): every matrix falls back to Q5_0 (32).
    let (code, _, err) =
        vl(&["quantize", "--model", &checkpoint("tiny-a"), "--quantize", "q4k", "--out", out.path().to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    let notes: Vec<&str> = err.lines().filter(|l| l.starts_with("note:")).collect();
    assert_eq!(notes.len(), 1, "{err}");
    assert!(notes[0].contains("matrices fell back from Q4_K (") && notes[0].contains("to Q5_0"), "{err}");
    assert!(notes[0].contains("checkpoint-Q4_K.gguf is named by the type asked for"), "{err}");
}

#[test]
fn the_cpu_default_quantization_is_reported_in_the_stats_line_and_json() {
    let ck = checkpoint("tiny-a");
    let (code, out, err) = vl(&["run", "--model", &ck, "--prompt", "hi", "--max-new-tokens", "2", "--json"]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["quantization"], "q4k");
    assert_eq!(v["quantization_source"], "default");
    // tiny-a's rows (32 values) fit no Q4_K block: said, and no separate note.
    assert_eq!(v["quantized"], "none (the default q4k fits no tensor: input dimensions are not multiples of 256)");
    assert!(!err.contains("applied to no tensor"), "{err}");

    let (code, _, err) = vl(&["run", "--model", &ck, "--prompt", "hi", "--max-new-tokens", "2"]);
    assert_eq!(code, 0, "{err}");
    let stats = err.lines().find(|l| l.starts_with("[load")).unwrap_or_else(|| panic!("{err}"));
    assert!(stats.contains("| quantized: none (the default q4k fits no tensor"), "{stats}");

    // --quantize off: full precision, said so; the flag is what chose it.
    let (code, out, err) =
        vl(&["run", "--model", &ck, "--prompt", "hi", "--max-new-tokens", "2", "--quantize", "off", "--json"]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["quantization"], serde_json::Value::Null);
    assert_eq!((v["quantization_source"].as_str(), v["quantized"].as_str()), (Some("flag"), Some("off")));

    // An MLX-quantized checkpoint keeps its own (8 bits: q8_0), whatever the device default.
    let (code, out, err) =
        vl(&["run", "--model", &checkpoint("tiny-q-mlx8"), "--prompt", "hi", "--max-new-tokens", "2", "--json"]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!((v["quantization"].as_str(), v["quantization_source"].as_str()), (Some("q8_0"), Some("checkpoint")));
}
