//! `vl`: run and inspect Qwen3-VL checkpoints.

mod chat;
mod hub;
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

#[derive(Parser)]
#[command(name = "vl", version, about = "Qwen3-VL in Rust: describe images, inspect checkpoints")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate a reply to a prompt about zero or more images, streamed to stdout.
    Run(run::RunArgs),
    /// A multi-turn chat in the terminal (history kept; /image PATH, /reset, /exit).
    Chat(chat::ChatArgs),
    /// Serve the OpenAI chat completions API (`/v1/chat/completions`, `/v1/models`, `/health`,
    /// `/metrics`) from one resident model.
    Serve(serve::ServeArgs),
    /// Check a model directory as `run` would (config, weights, tokenizer, template, processor)
    /// without loading weights, and summarize it.
    Inspect {
        /// A local model directory (config.json + safetensors weights).
        #[arg(long)]
        model: PathBuf,
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
}

fn main() -> ExitCode {
    // Library errors (candle's) capture a backtrace when RUST_BACKTRACE is set and print it as
    // part of their message; errors here are one line. Panics still honor RUST_BACKTRACE.
    // Set before any thread exists.
    std::env::set_var("RUST_LIB_BACKTRACE", "0");
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
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
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
            // Usage errors in one line too (clap adds a usage block and a hint).
            let text = e.render().to_string();
            let first = text.lines().find(|l| !l.trim().is_empty()).unwrap_or("error: invalid arguments");
            note!("{first} (see vl --help)");
            return ExitCode::from(2);
        }
    };
    let result = match cli.command {
        Command::Run(args) => run::run(args),
        Command::Serve(args) => serve::serve(args),
        Command::Chat(args) => chat::chat(args),
        Command::Inspect { model, json } => inspect(&model, json),
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
        LimitKind::Fixed => None,
    }
}

fn inspect(model: &std::path::Path, json: bool) -> anyhow::Result<()> {
    let summary = vl_models::qwen3_vl::inspect(model)?;
    let text = if json { serde_json::to_string_pretty(&summary)? } else { summary.to_string() };
    let mut out = std::io::stdout().lock();
    writeln!(out, "{text}").and_then(|_| out.flush()).map_err(|e| anyhow::Error::new(e).context("writing to stdout"))
}
