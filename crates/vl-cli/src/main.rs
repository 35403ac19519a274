//! `vl`: run and inspect Qwen3-VL checkpoints.

mod chat;
mod flags;
mod help;
mod models;
mod pool;
mod reasoning;
mod run;
mod serve;

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// A line on stderr; a closed or full stderr is ignored (`eprintln!` would panic).
#[macro_export]
macro_rules! note {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

/// A loaded model's warnings (`Family::load_warnings`: what its files hold that the load left
/// unused) on stderr, a line each, naming the model.
pub(crate) fn note_load_warnings(model: &std::path::Path, family: &dyn vl_models::family::Family) {
    for w in family.load_warnings() {
        note!("warning: {}: {w}", model.display());
    }
}

#[derive(Parser)]
#[command(
    name = "vl",
    version,
    about = "Qwen3-VL in Rust: describe images and videos, embed and rerank, inspect checkpoints"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate a reply to a prompt about zero or more images and videos, streamed to stdout.
    Run(run::RunArgs),
    /// A multi-turn chat in the terminal (history kept; /image PATH, /video PATH, /save FILE and
    /// /load FILE keep a conversation, /reset, /exit).
    Chat(chat::ChatArgs),
    /// Serve the OpenAI API (`/v1/chat/completions`, `/v1/responses`, `/v1/completions`),
    /// Anthropic's (`/v1/messages`), or for an embedding or reranker model `/v1/embeddings`,
    /// `/v1/rerank` and `/v1/score`; with `/v1/models`, `/health`, `/metrics` and a web chat at
    /// `/`, from one resident model.
    Serve(serve::ServeArgs),
    /// Embed texts, images and videos with an embedding model (Qwen3-VL-Embedding): one
    /// L2-normalised vector per input, printed one line each (or --json).
    Embed(pool::EmbedArgs),
    /// Score documents (texts, images) against a query with a reranker (Qwen3-VL-Reranker), or
    /// by cosine similarity with an embedding model; printed best first.
    Rerank(pool::RerankArgs),
    /// Check a model directory as `run` would (config, weights, tokenizer, template, processor)
    /// without loading weights, and summarize it.
    Inspect {
        /// A local model directory (config.json + safetensors weights), GGUF weights (a .gguf
        /// text model or a directory holding one, with its mmproj), or a hub id in the local
        /// Hugging Face cache (inspect never downloads).
        #[arg(long)]
        model: String,
        /// The GGUF vision projector (default: the mmproj*.gguf beside the text model).
        #[arg(long)]
        mmproj: Option<PathBuf>,
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
    /// The models in the local Hugging Face cache: list them, pull one ahead of time (a hub id,
    /// or REPO:QUANT from a GGUF repository), remove one.
    Models {
        #[command(subcommand)]
        command: models::ModelsCommand,
    },
    /// Quantize a checkpoint once and write it as the GGUF pair llama.cpp uses (text model +
    /// mmproj), so later runs start without re-quantizing.
    Quantize {
        /// A local model directory or a Hugging Face hub id.
        #[arg(long)]
        model: String,
        /// The text model's block type, or a float type that quantizes nothing (the vision
        /// projector stays in floats). A matrix whose rows fill no block of it falls back per
        /// tensor, as llama.cpp's quantize does (q4k to Q5_0, q5k to Q5_1, q6k to Q8_0, then
        /// floats); the file keeps the requested type's name.
        #[arg(long, value_parser = quantize_values())]
        quantize: String,
        /// The output directory (created when missing).
        #[arg(long)]
        out: PathBuf,
        /// Replace files of the same names in --out (without it, they are left alone and the command fails).
        #[arg(long)]
        force: bool,
    },
}

fn main() -> ExitCode {
    // Started as a chat-template renderer (a child of this binary, bounded in memory and time):
    // render one job and exit.
    vl_models::template::renderer_main();
    // Library errors (candle's) capture a backtrace when RUST_BACKTRACE is set and print it as
    // part of their message; errors here are one line. Panics still honor RUST_BACKTRACE.
    // Set before any thread exists.
    std::env::set_var("RUST_LIB_BACKTRACE", "0");
    vl_models::alloc::keep_large_buffers();
    // Chat templates are programs a checkpoint ships: they render in a child process of this
    // binary, so a hostile one costs that child, never the server or the CLI.
    if let Ok(exe) = std::env::current_exe() {
        vl_models::template::render_in_child_processes(exe);
    }
    std::panic::set_hook(Box::new(|info| {
        let msg = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_default();
        let at = info.location().map(|l| format!(" at {}:{}", l.file(), l.line())).unwrap_or_default();
        note!("error: internal error (a bug; please report it): {}{at}", msg.replace('\n', " "));
    }));
    use clap::{CommandFactory, FromArgMatches};
    let command = help::command(Cli::command());
    let parsed = command.clone().try_get_matches().and_then(|m| Ok((Cli::from_arg_matches(&m)?, m)));
    let (cli, matches) = match parsed {
        Ok(parsed) => parsed,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(
                e.kind(),
                ErrorKind::DisplayHelp
                    | ErrorKind::DisplayVersion
                    | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
            ) {
                e.exit();
            }
            // clap's whole message: the error, its tip (a similar flag or subcommand, the allowed
            // values), the usage, and the subcommand's --help.
            let argv: Vec<String> = std::env::args().collect();
            note!("{}", help::usage_error(&e, &command, &argv));
            return ExitCode::from(2);
        }
    };
    let result = match cli.command {
        Command::Run(args) => run::run(args, run::media_order(matches.subcommand_matches("run"))),
        Command::Serve(args) => serve::serve(args),
        Command::Chat(args) => chat::chat(args),
        Command::Embed(args) => pool::embed(args),
        Command::Rerank(args) => pool::rerank(args),
        Command::Inspect { model, mmproj, json } => {
            vl_models::hub::resolve_cached(&model).and_then(|dir| inspect(&dir, mmproj.as_deref(), json))
        }
        Command::Models { command } => models::run(command),
        Command::Quantize { model, quantize, out, force } => quantize_cmd(&model, &quantize, &out, force),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        // The reader went away (`vl run | head -1`): nothing left to say to anyone.
        Err(e) if is_broken_pipe(&e) => ExitCode::SUCCESS,
        Err(e) => {
            note!("error: {}", one_line(&e));
            ExitCode::FAILURE
        }
    }
}

fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| c.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe))
}

/// One line: each cause once, outermost first.
fn one_line(e: &anyhow::Error) -> String {
    // A directory without a config.json is what --model named.
    if let Some(m @ vl_models::Error::NotAModelDir { .. }) = e.chain().find_map(|c| c.downcast_ref()) {
        return format!("--model {m}");
    }
    let mut parts: Vec<String> = Vec::new();
    for cause in e.chain() {
        let s = cause.to_string().split_whitespace().collect::<Vec<_>>().join(" ");
        if !s.is_empty() && !parts.iter().any(|p| p.contains(&s)) {
            parts.push(s);
        }
    }
    let mut line = parts.join(": ");
    if let Some(hint) = limit_hint(e) {
        line.push_str(hint);
    }
    line
}

/// For an input over a configurable limit, the flag that raises it.
fn limit_hint(e: &anyhow::Error) -> Option<&'static str> {
    use vl_models::limits::LimitKind;
    let kind = e.chain().find_map(|c| match c.downcast_ref::<vl_models::Error>() {
        Some(vl_models::Error::Limit { kind, .. }) => Some(*kind),
        _ => None,
    })?;
    match kind {
        LimitKind::ImageBytes => Some("; raise the limit with --max-image-bytes N"),
        LimitKind::ImagePixels => Some("; raise the limit with --max-image-pixels N"),
        LimitKind::KvCache => Some("; raise the budget with --kv-cache-mib N"),
        LimitKind::DecodeTime => Some("; raise the limit with --video-decode-timeout S (0: none)"),
        LimitKind::Fixed | LimitKind::Context => None,
    }
}

fn quantize_cmd(model: &str, quantize: &str, out: &std::path::Path, force: bool) -> anyhow::Result<()> {
    use vl_models::gguf::Recipe;
    use vl_nn::QuantType;
    let recipe = match quantize {
        "q4k" => Recipe::Uniform(QuantType::Q4K),
        "q5k" => Recipe::Uniform(QuantType::Q5K),
        "q6k" => Recipe::Uniform(QuantType::Q6K),
        "q8" | "q8_0" => Recipe::Uniform(QuantType::Q8_0),
        "q4k_m" => Recipe::Q4KM,
        "bf16" => Recipe::Float(candle_core::DType::BF16),
        "f16" => Recipe::Float(candle_core::DType::F16),
        "f32" => Recipe::Float(candle_core::DType::F32),
        other => anyhow::bail!("--quantize {other}: expected q4k, q5k, q6k, q8, q4k_m, bf16, f16 or f32"),
    };
    let dir = vl_models::hub::resolve(model)?;
    let t = std::time::Instant::now();
    let mut n = 0usize;
    let w = vl_models::registry::quantize(&dir, recipe, out, force, &mut |_| n += 1)?;
    let stored: Vec<String> = w.stored.iter().map(|(k, v)| format!("{v} {k}")).collect();
    note!(
        "wrote {} and {} ({} tensors; the text model's matrices: {}) in {:.1}s; run with: vl run --model {}",
        w.text.display(),
        w.mmproj.display(),
        w.tensors,
        stored.join(", "),
        t.elapsed().as_secs_f64(),
        out.display()
    );
    if w.fell_back > 0 {
        let to: Vec<String> = w.fell_back_to.iter().map(|(t, n)| format!("{n} to {t}")).collect();
        note!(
            "note: {} of the text model's {} matrices fell back from {} ({}): their rows do not fill its blocks; {} is named by the type asked for, as llama.cpp's quantize names its files",
            w.fell_back,
            w.stored.values().sum::<usize>(),
            recipe.file_tag(),
            to.join(", "),
            w.text.file_name().map_or(String::new(), |n| n.to_string_lossy().into_owned())
        );
    }
    Ok(())
}

/// `vl quantize --quantize`'s values, each explained in --help.
fn quantize_values() -> clap::builder::PossibleValuesParser {
    use clap::builder::PossibleValue;
    clap::builder::PossibleValuesParser::new([
        PossibleValue::new("q4k").help("Q4_K for every matrix (4.5 bits a weight)"),
        PossibleValue::new("q5k").help("Q5_K for every matrix (5.5 bits a weight)"),
        PossibleValue::new("q6k").help("Q6_K for every matrix (6.6 bits a weight)"),
        PossibleValue::new("q8").alias("q8_0").help("Q8_0 for every matrix (8.5 bits a weight)"),
        PossibleValue::new("q4k_m")
            .help("llama.cpp's Q4_K_M mix: mostly Q4_K; Q6_K for the output and some layers' attn_v, ffn_down"),
        PossibleValue::new("bf16")
            .help("no blocks: every matrix in bf16, as llama.cpp's converter writes --outtype bf16"),
        PossibleValue::new("f16").help("no blocks: every matrix in f16 (--outtype f16)"),
        PossibleValue::new("f32").help("no blocks: every matrix in f32 (--outtype f32)"),
    ])
}

fn inspect(model: &std::path::Path, mmproj: Option<&std::path::Path>, json: bool) -> anyhow::Result<()> {
    let text = vl_models::registry::inspect(&vl_models::family::Source { model, mmproj, progress: None }, json)?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{text}").and_then(|_| out.flush()).map_err(|e| anyhow::Error::new(e).context("writing to stdout"))
}
