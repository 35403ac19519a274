//! `vl`: run and inspect Qwen3-VL checkpoints.

mod hub;
mod run;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

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
    /// Check a model directory against its config and summarize it.
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
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(args) => run::run(args),
        Command::Inspect { model, json } => inspect(&model, json),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line: the outermost context and the root cause.
            eprintln!("error: {}", one_line(&e));
            ExitCode::FAILURE
        }
    }
}

fn one_line(e: &anyhow::Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    for cause in e.chain() {
        let s = cause.to_string().replace('\n', " ");
        if !parts.iter().any(|p| p.contains(&s)) {
            parts.push(s);
        }
    }
    parts.join(": ")
}

fn inspect(model: &std::path::Path, json: bool) -> anyhow::Result<()> {
    let summary = vl_models::qwen3_vl::inspect(model)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&summary)?);
    } else {
        println!("{summary}");
    }
    Ok(())
}
