//! How `vl run` and `vl chat` show a thinking checkpoint's reasoning: apart from the answer.
//! On a terminal it is written dimmed before the answer; when stdout is not a terminal it goes
//! to stderr, so stdout carries the answer alone; `--hide-reasoning` drops it.

use std::io::Write;

use clap::Args;

#[derive(Debug, Args, Clone)]
pub struct ReasoningArgs {
    /// Do not print a thinking model's reasoning (its `<think>` block); only the answer.
    #[arg(long)]
    pub hide_reasoning: bool,
    /// Extra variables for the chat template, as a JSON object (e.g. '{"enable_thinking":
    /// false}' for templates that read it).
    #[arg(long, value_name = "JSON", value_parser = parse_kwargs)]
    pub chat_template_kwargs: Option<serde_json::Map<String, serde_json::Value>>,
}

fn parse_kwargs(s: &str) -> Result<serde_json::Map<String, serde_json::Value>, String> {
    match serde_json::from_str::<serde_json::Value>(s) {
        Ok(serde_json::Value::Object(o)) => {
            if let Some(k) = o.keys().find(|k| vl_models::template::RESERVED_TEMPLATE_VARIABLES.contains(&k.as_str())) {
                return Err(format!("`{k}` is set by vl itself, not by template arguments"));
            }
            Ok(o)
        }
        Ok(_) => Err("must be a JSON object of template variables".into()),
        Err(e) => Err(format!("not JSON: {e}")),
    }
}

/// Writes an answer's pieces: reasoning apart, the answer to `out`.
pub struct Printer {
    hide: bool,
    /// stdout is a terminal: reasoning dimmed on it; else on stderr.
    terminal: bool,
    in_reasoning: bool,
}

const DIM: &str = "\x1b[2m";
const RESET: &str = "\x1b[0m";

impl Printer {
    pub fn new(args: &ReasoningArgs, terminal: bool) -> Self {
        Self { hide: args.hide_reasoning, terminal, in_reasoning: false }
    }

    /// Writes one piece.
    pub fn piece(&mut self, out: &mut dyn Write, text: &str, reasoning: bool) -> std::io::Result<()> {
        if reasoning {
            if self.hide {
                return Ok(());
            }
            if self.terminal {
                if !self.in_reasoning {
                    out.write_all(DIM.as_bytes())?;
                }
                out.write_all(text.as_bytes())?;
                out.flush()?;
            } else {
                let mut err = std::io::stderr().lock();
                err.write_all(text.as_bytes())?;
                err.flush()?;
            }
            self.in_reasoning = true;
            return Ok(());
        }
        self.end_reasoning(out)?;
        out.write_all(text.as_bytes())?;
        out.flush()
    }

    /// Closes a reasoning block still open (before the answer, or at its end).
    pub fn end_reasoning(&mut self, out: &mut dyn Write) -> std::io::Result<()> {
        if !self.in_reasoning {
            return Ok(());
        }
        self.in_reasoning = false;
        if self.terminal {
            out.write_all(RESET.as_bytes())?;
            out.write_all(b"\n\n")?;
        } else {
            std::io::stderr().lock().write_all(b"\n")?;
        }
        out.flush()
    }
}
