//! The user-path benchmark: runs the `vl` binary (built next to this one) on a checkpoint file,
//! as a user would, and reports per mode: load, vision, prefill and decode at short, image-prompt
//! and long context, time to first token and peak RSS. Every figure comes from `vl run --json`.
//!
//! ```sh
//! tools/bench/make-checkpoint target/bench-2b        # bf16, 2B geometry, random weights
//! cargo build --release -p vl-cli -p vl-bench
//! target/release/vl-bench --model target/bench-2b [--modes f32,q8,q6k,q4k] [--repeat N]
//! target/release/vl-bench --model target/bench-2b --serve [--modes q4k]   # the server path
//! # many clients at once on `vl serve` (or, with --base, on any OpenAI-compatible server)
//! target/release/vl-bench --model FILE.gguf --concurrency 1,2,4,8 [--modes none] [--tokens 64]
//! target/release/vl-bench --concurrency 1,2,4,8 --base http://127.0.0.1:8081 --name llama-server --pid PID
//! # the cost of constrained decoding (response_format) on `vl serve`
//! target/release/vl-bench --model target/bench-2b --constrained [--modes q4k] [--tokens 64] [--repeat 3]
//! ```

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use serde_json::Value;

mod concurrency;
mod constrained;
mod serve;

/// Square side of the benchmark image after resizing: 448x448 = 196 image tokens.
const IMAGE_SIDE: usize = 448;
const NEW_TOKENS: &str = "32";
/// Words of the long prompt: about 2000 tokens with the chat template.
const LONG_WORDS: usize = 690;

struct Args {
    model: PathBuf,
    image: PathBuf,
    modes: Vec<String>,
    repeat: usize,
    serve: bool,
    constrained: bool,
    /// Client counts for the concurrency bench.
    concurrency: Vec<usize>,
    /// A running server to drive instead of starting `vl serve` (with its label and pid).
    base: Option<String>,
    name: String,
    pid: Option<u32>,
    tokens: usize,
    words: usize,
}

fn parse() -> Result<Args> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut a = Args {
        model: root.join("target/bench-2b"),
        image: root.join("goldens/images/photo.jpg"),
        modes: ["f32", "q8", "q6k", "q4k"].map(String::from).to_vec(),
        repeat: 1,
        serve: false,
        constrained: false,
        concurrency: vec![],
        base: None,
        name: "vl serve".into(),
        pid: None,
        tokens: 64,
        words: 0,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--model" => a.model = value()?.into(),
            "--image" => a.image = value()?.into(),
            "--modes" => a.modes = value()?.split(',').map(String::from).collect(),
            "--repeat" => a.repeat = value()?.parse().context("--repeat")?,
            "--serve" => a.serve = true,
            "--constrained" => a.constrained = true,
            "--concurrency" => {
                a.concurrency =
                    value()?.split(',').map(|n| n.parse().context("--concurrency")).collect::<Result<_>>()?
            }
            "--base" => a.base = Some(value()?),
            "--name" => a.name = value()?,
            "--pid" => a.pid = Some(value()?.parse().context("--pid")?),
            "--tokens" => a.tokens = value()?.parse().context("--tokens")?,
            "--prompt-words" => a.words = value()?.parse().context("--prompt-words")?,
            "--help" | "-h" => {
                println!(
                    "vl-bench [--model DIR|FILE.gguf] [--image FILE] [--modes f32,q8,q6k,q4k] [--repeat N] [--serve] [--constrained]\n\
                     \x20        [--concurrency 1,2,4,8 [--tokens N] [--prompt-words N] [--base URL --name NAME --pid PID]]"
                );
                std::process::exit(0);
            }
            other => bail!("unknown flag {other} (see --help)"),
        }
    }
    Ok(a)
}

fn vl_binary() -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let vl = exe.with_file_name("vl");
    if !vl.is_file() {
        bail!("{} not found: build it with `cargo build --release -p vl-cli`", vl.display());
    }
    Ok(vl)
}

fn quantize_flag(mode: &str) -> Result<&'static str> {
    Ok(match mode {
        "f32" => "none",
        "q8" => "q8",
        "q6k" => "q6k",
        "q5k" => "q5k",
        "q4k" => "q4k",
        "none" => "none",
        other => bail!("unknown mode {other} (f32, q8, q6k, q5k, q4k)"),
    })
}

/// One `vl run --json`; its JSON object.
fn run(vl: &Path, model: &Path, mode: &str, extra: &[String]) -> Result<Value> {
    let mut cmd = Command::new(vl);
    cmd.args(["run", "--model"]).arg(model);
    cmd.args(["--quantize", quantize_flag(mode)?, "--max-new-tokens", NEW_TOKENS, "--json"]);
    cmd.args(extra);
    let out = cmd.output().context("running vl")?;
    if !out.status.success() {
        bail!("vl run ({mode}) failed: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(serde_json::from_slice(&out.stdout)?)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}

fn main() -> Result<()> {
    let a = parse()?;
    let vl = vl_binary()?;
    let px = (IMAGE_SIDE * IMAGE_SIDE).to_string();
    let image_args: Vec<String> = vec![
        "--image".into(),
        a.image.display().to_string(),
        "--min-pixels".into(),
        px.clone(),
        "--max-pixels".into(),
        px,
        "--prompt".into(),
        "Describe this image.".into(),
    ];
    let short_args: Vec<String> = vec!["--prompt".into(), "Write a short story about the sea.".into()];
    let long_text: String = (0..LONG_WORDS).map(|i| format!("w{} ", i % 97)).collect();
    let long_args: Vec<String> = vec!["--prompt".into(), format!("Summarize: {long_text}")];
    // The concurrency bench gives each client --tokens; the per-mode runs NEW_TOKENS.
    let new_tokens = if a.concurrency.is_empty() { NEW_TOKENS.to_string() } else { a.tokens.to_string() };
    println!(
        "CPU: {} ({} threads); model {}; image {}x{IMAGE_SIDE}; {new_tokens} new tokens; median of {}",
        cpu_model(),
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        a.model.display(),
        IMAGE_SIDE,
        a.repeat
    );
    if !a.concurrency.is_empty() {
        if let Some(base) = &a.base {
            return concurrency::bench(&a.name, base, "", a.pid, &a.concurrency, a.tokens, a.words);
        }
        for mode in &a.modes {
            let media = a.image.parent().context("image directory")?;
            let s = serve::start(&vl, &a.model, quantize_flag(mode)?, media, &[])?;
            let name = format!("vl serve {mode}");
            concurrency::bench(&name, &s.base, "", Some(s.child.id()), &a.concurrency, a.tokens, a.words)?;
        }
        return Ok(());
    }
    if a.constrained {
        for mode in &a.modes {
            let media = a.image.parent().context("image directory")?;
            let s = serve::start(&vl, &a.model, quantize_flag(mode)?, media, &[])?;
            constrained::bench(&format!("vl serve {mode}"), &s.base, a.tokens, a.repeat)?;
        }
        return Ok(());
    }
    if a.serve {
        for mode in &a.modes {
            println!("mode {mode}:");
            serve::bench(&vl, &a.model, quantize_flag(mode)?, &a.image, IMAGE_SIDE, NEW_TOKENS.parse()?)?;
        }
        return Ok(());
    }
    println!(
        "| mode | load s | vision s | image prompt | prefill tok/s | TTFT s | decode tok/s @short | @image | @long | long prefill tok/s | peak RSS image | peak RSS long |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    for mode in &a.modes {
        let (mut rows, mut long_rows, mut short_rows) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..a.repeat {
            rows.push(run(&vl, &a.model, mode, &image_args)?);
            short_rows.push(run(&vl, &a.model, mode, &short_args)?);
            long_rows.push(run(&vl, &a.model, mode, &long_args)?);
        }
        let t = |rows: &[Value], k: &str| {
            median(rows.iter().map(|r| r["timings"][k].as_f64().unwrap_or(f64::NAN)).collect())
        };
        let rss =
            |rows: &[Value]| median(rows.iter().map(|r| r["peak_rss_bytes"].as_f64().unwrap_or(0.0) / 1e9).collect());
        println!(
            "| {mode} | {:.1} | {:.2} | {} tok | {:.1} | {:.1} | {:.2} | {:.2} | {:.2} (at {}) | {:.1} | {:.2} GB | {:.2} GB |",
            t(&rows, "load_s"),
            t(&rows, "vision_s"),
            rows[0]["prompt_tokens"],
            t(&rows, "prefill_tokens_per_s"),
            t(&rows, "time_to_first_token_s"),
            t(&short_rows, "decode_tokens_per_s"),
            t(&rows, "decode_tokens_per_s"),
            t(&long_rows, "decode_tokens_per_s"),
            long_rows[0]["prompt_tokens"],
            t(&long_rows, "prefill_tokens_per_s"),
            rss(&rows),
            rss(&long_rows),
        );
    }
    Ok(())
}
