//! `vl`'s help and usage errors: every flag under a heading (Model, Input, Generation, Output,
//! Limits, Performance, Server), negative numbers taken as values (so `--temperature -1` reaches
//! its range check), and clap's error message (its suggestions, allowed values)
//! pointing at the subcommand's own `--help`.

use clap::Command;

/// The heading each flag is listed under, by its id (the field name), in every subcommand.
const HEADINGS: &[(&str, &[&str])] = &[
    ("Model", &["model", "mmproj", "device", "dtype", "quantize", "vision_precision", "kv_cache_dtype"]),
    (
        "Input",
        &[
            "images",
            "videos",
            "prompt",
            "system",
            "min_pixels",
            "max_pixels",
            "max_image_tokens",
            "video_fps",
            "video_max_frames",
            "video_max_pixels",
            "video_cap_pixels_per_frame",
            "chat_template_kwargs",
            "texts",
            "together",
            "instruction",
            "query",
            "query_images",
            "docs",
            "doc_images",
        ],
    ),
    (
        "Generation",
        &[
            "max_new_tokens",
            "temperature",
            "top_k",
            "top_p",
            "min_p",
            "repetition_penalty",
            "seed",
            "reasoning_budget",
            "top_n_sigma",
            "xtc_probability",
            "xtc_threshold",
            "mirostat",
            "mirostat_tau",
            "mirostat_eta",
            "dry_multiplier",
            "dry_base",
            "dry_allowed_length",
            "dry_penalty_last_n",
            "dry_sequence_breakers",
            "speculative",
            "draft_model",
            "draft_max",
            "draft_vocab",
            "ngram_min",
            "ngram_max",
            "no_forced_tokens",
            "sampling",
            "json_schema",
            "json_object",
            "regex",
            "grammar",
            "choice",
            "grounding",
        ],
    ),
    ("Output", &["json", "logits_out", "draw_boxes", "force", "out", "hide_reasoning", "dimensions", "top_n"]),
    (
        "Limits",
        &[
            "max_image_bytes",
            "max_image_pixels",
            "max_body_bytes",
            "queue",
            "max_connections",
            "header_timeout",
            "body_timeout",
            "shutdown_timeout",
            "stall_timeout",
            "video_decode_timeout",
            "remote_media_timeout",
        ],
    ),
    (
        "Performance",
        &["parallel", "kv_cache_mib", "no_prefix_cache", "image_cache_mib", "clip_cache_mib", "responses_store_mib"],
    ),
    (
        "Server",
        &[
            "host",
            "port",
            "served_model_name",
            "aliases",
            "strict_model_name",
            "allowed_media_dir",
            "allow_remote_media",
            "api_key",
            "cors_origins",
            "no_ui",
        ],
    ),
];

fn heading_of(id: &str) -> Option<&'static str> {
    HEADINGS.iter().find(|(_, ids)| ids.contains(&id)).map(|(h, _)| *h)
}

/// `cmd` and its subcommands with every flag under its heading (a `vl serve` flag not in the
/// table under Server) and negative numbers accepted as values.
pub fn command(cmd: Command) -> Command {
    let fallback = (cmd.get_name() == "serve").then_some("Server");
    let cmd = cmd.mut_args(|a| {
        let takes_values = a.get_action().takes_values();
        let heading = heading_of(a.get_id().as_str()).or(fallback);
        let a = if takes_values { a.allow_negative_numbers(true) } else { a };
        match heading {
            Some(h) if a.get_help_heading().is_none() => a.help_heading(h),
            _ => a,
        }
    });
    cmd.mut_subcommands(command)
}

/// clap's message for a usage error as clap renders it (the error, its tip: a similar flag or
/// subcommand, the allowed values), less the usage block, its last line pointing at
/// `vl SUBCOMMAND --help` for the subcommand in `argv`; an error with nothing more to say is one
/// line.
pub fn usage_error(e: &clap::Error, cmd: &Command, argv: &[String]) -> String {
    let sub = argv
        .iter()
        .skip(1)
        .find_map(|a| cmd.get_subcommands().find(|s| s.get_name() == a).map(|s| s.get_name().to_string()));
    let help = match &sub {
        Some(s) => format!("vl {s} --help"),
        None => "vl --help".to_string(),
    };
    let text = e.render().to_string();
    let mut out: Vec<String> = text
        .trim_end()
        .lines()
        .map(|l| {
            if l.starts_with("For more information, try '") {
                format!("For more information, try '{help}'.")
            } else {
                l.trim_end().to_string()
            }
        })
        .collect();
    out.retain(|l| !l.starts_with("For more information"));
    // The usage block repeats the flags given; --help has it whole.
    if let Some(at) = out.iter().position(|l| l.starts_with("Usage:")) {
        let end = out[at..].iter().position(|l| l.trim().is_empty()).map_or(out.len(), |n| at + n);
        out.drain(at..end);
    }
    out.dedup_by(|a, b| a.trim().is_empty() && b.trim().is_empty());
    while out.last().is_some_and(|l| l.trim().is_empty()) {
        out.pop();
    }
    // Nothing but the error itself (a value refused by its parser): one line.
    if let [line] = out.iter().filter(|l| !l.trim().is_empty()).collect::<Vec<_>>()[..] {
        return format!("{line} (see '{help}')");
    }
    out.push(String::new());
    out.push(format!("For more information, try '{help}'."));
    out.join("\n")
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    /// Every flag of every subcommand is described; those of run, chat, serve, inspect and
    /// quantize are under a heading, and each value of a value list is explained.
    #[test]
    fn every_flag_is_described_under_a_heading() {
        fn walk(cmd: &clap::Command, path: &str, headed: bool, missing: &mut Vec<String>) {
            for a in cmd.get_arguments() {
                let id = a.get_id().as_str();
                if id == "help" || id == "version" {
                    continue;
                }
                let at = format!("{path} --{}", a.get_long().unwrap_or(id));
                if a.get_help().is_none() && a.get_long_help().is_none() {
                    missing.push(format!("{at}: no description"));
                }
                if headed && a.get_help_heading().is_none() {
                    missing.push(format!("{at}: no heading"));
                }
                let values = a.get_possible_values();
                if values.len() > 1 && values.iter().any(|v| v.get_help().is_none()) {
                    missing.push(format!("{at}: a value without a description"));
                }
            }
            for sub in cmd.get_subcommands() {
                let name = sub.get_name();
                if name == "help" {
                    continue;
                }
                if sub.get_about().is_none() {
                    missing.push(format!("{path} {name}: no about line"));
                }
                let headed = ["run", "chat", "serve", "inspect", "quantize", "embed", "rerank"].contains(&name);
                walk(sub, &format!("{path} {name}"), headed, missing);
            }
        }
        let mut cmd = super::command(crate::Cli::command());
        cmd.build();
        let mut missing = Vec::new();
        walk(&cmd, "vl", false, &mut missing);
        assert!(missing.is_empty(), "{missing:#?}");
    }

    /// `--max-new-tokens`' default per command (`flags::sampling::Defaults`) is what `--help`,
    /// the README and docs/serving.md say.
    #[test]
    fn max_new_tokens_defaults_are_as_documented() {
        use crate::flags::sampling::{ChatDefaults, Defaults, RunDefaults};
        let cmd = super::command(crate::Cli::command());
        let (run, chat) = (RunDefaults::MAX_NEW_TOKENS, ChatDefaults::MAX_NEW_TOKENS);
        for (sub, want) in [("run", run), ("chat", chat)] {
            let sub = cmd.find_subcommand(sub).unwrap();
            let arg = sub.get_arguments().find(|a| a.get_id() == "max_new_tokens").unwrap();
            assert_eq!(arg.get_default_values(), [want], "vl {} --max-new-tokens", sub.get_name());
        }
        let readme = include_str!("../../../README.md");
        let want = format!("`--max-new-tokens` (default {run}; `vl chat`'s is {chat})");
        assert!(readme.contains(&want), "README.md does not say {want}");
        let serving = include_str!("../../../docs/serving.md");
        let want = format!("`--max-new-tokens` defaults to {chat} here and {run} in `vl run`");
        assert!(serving.contains(&want), "docs/serving.md does not say {want}");
    }

    /// Negative numbers reach the value parser (and then the range checks), not "unexpected
    /// argument".
    #[test]
    fn negative_numbers_are_values() {
        let cmd = super::command(crate::Cli::command());
        let m = cmd.clone().try_get_matches_from(["vl", "run", "--temperature", "-1", "--top-p", "-0.5"]).unwrap();
        let run = m.subcommand_matches("run").unwrap();
        assert_eq!(run.get_one::<f64>("temperature"), Some(&-1.0));
        assert_eq!(run.get_one::<f64>("top_p"), Some(&-0.5));
        let e = cmd.try_get_matches_from(["vl", "run", "--max-new-tokens", "-3"]).unwrap_err();
        assert_eq!(e.kind(), clap::error::ErrorKind::ValueValidation, "{e}");
    }
}
