//! The generation flags `vl run` and `vl chat` share (`--max-new-tokens`, `--temperature`,
//! `--top-k`, `--top-p`, `--min-p`, `--repetition-penalty`, `--seed`), checked into the engine's
//! `GenerationOptions`. `vl serve` takes sampling per request (and `--sampling`).
//!
//! Every default is the library's (`GenerationOptions::default()`: greedy decoding), but for
//! `--max-new-tokens`, which each command sets on purpose (`Defaults`).

use std::marker::PhantomData;

use anyhow::Result;
use clap::Args;
use vl_models::sampling::GenerationOptions;

/// The generation defaults a command sets itself.
pub trait Defaults: std::fmt::Debug + Send + Sync + 'static {
    /// `--max-new-tokens`' default, as `--help` shows it (a number).
    const MAX_NEW_TOKENS: &'static str;
}

/// `vl run`: the library's 256 tokens. One answer about the media given, often a description
/// read by a script; on the CPU it ends in seconds.
#[derive(Debug)]
pub struct RunDefaults;

impl Defaults for RunDefaults {
    const MAX_NEW_TOKENS: &'static str = "256";
}

/// `vl chat`: 1024 tokens, on purpose longer than `vl run`'s. A conversation's answers
/// (explanations, code, follow-ups) run longer than a one-shot description, and one too long is
/// stopped with Ctrl-C as it is written, keeping what was said.
#[derive(Debug)]
pub struct ChatDefaults;

impl Defaults for ChatDefaults {
    const MAX_NEW_TOKENS: &'static str = "1024";
}

/// How an answer is generated: the Generation heading's sampling flags, `D` the command's
/// defaults.
#[derive(Debug, Args)]
pub struct SamplingArgs<D: Defaults> {
    /// Tokens generated at most per answer (it stops earlier at an end-of-turn token).
    #[arg(long, default_value = D::MAX_NEW_TOKENS)]
    pub max_new_tokens: usize,
    /// Sampling temperature; 0 (the default) is greedy decoding.
    #[arg(long, default_value_t = GenerationOptions::default().temperature)]
    pub temperature: f64,
    /// Keep the k most likely tokens (0 = off).
    #[arg(long, default_value_t = GenerationOptions::default().top_k)]
    pub top_k: usize,
    /// Nucleus sampling mass (1 = off).
    #[arg(long, default_value_t = GenerationOptions::default().top_p)]
    pub top_p: f64,
    /// Drop tokens below min_p times the top probability (0 = off).
    #[arg(long, default_value_t = GenerationOptions::default().min_p)]
    pub min_p: f64,
    /// Penalize tokens already seen (1 = off).
    #[arg(long, default_value_t = GenerationOptions::default().repetition_penalty)]
    pub repetition_penalty: f64,
    /// Seed of the sampler's random numbers (with --temperature above 0): the same seed, the
    /// same answer.
    #[arg(long, default_value_t = GenerationOptions::default().seed)]
    pub seed: u64,
    /// llama.cpp's top-n-sigma: only tokens whose logit is within N standard deviations of the
    /// largest are kept (0 = off; with --temperature above 0).
    #[arg(long, default_value_t = 0.0, value_name = "N")]
    pub top_n_sigma: f64,
    /// llama.cpp's XTC: with this probability per step, the most likely tokens above
    /// --xtc-threshold are removed but the least likely of them (0 = off).
    #[arg(long, default_value_t = 0.0, value_name = "P")]
    pub xtc_probability: f64,
    /// XTC's probability threshold, in (0, 1].
    #[arg(long, default_value_t = 0.1, value_name = "P")]
    pub xtc_threshold: f64,
    /// llama.cpp's mirostat: 0 off, 1 (Mirostat), 2 (Mirostat 2.0); it replaces top-k, top-p,
    /// min-p, top-n-sigma and XTC (which must be off), with --temperature above 0.
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub mirostat: u8,
    /// Mirostat's target surprise, in bits.
    #[arg(long, default_value_t = 5.0, value_name = "TAU")]
    pub mirostat_tau: f64,
    /// Mirostat's learning rate, in (0, 1].
    #[arg(long, default_value_t = 0.1, value_name = "ETA")]
    pub mirostat_eta: f64,
    /// llama.cpp's DRY: a token that would extend a repetition of the prompt and answer longer
    /// than --dry-allowed-length has its logit lowered by this times --dry-base to the power of
    /// the excess (0 = off).
    #[arg(long, default_value_t = 0.0, value_name = "X")]
    pub dry_multiplier: f64,
    /// DRY's growth per token of repetition (>= 1).
    #[arg(long, default_value_t = GenerationOptions::default().dry_base, value_name = "X")]
    pub dry_base: f64,
    /// The longest repetition DRY leaves alone.
    #[arg(long, default_value_t = GenerationOptions::default().dry_allowed_length, value_name = "N")]
    pub dry_allowed_length: usize,
    /// The tokens DRY looks back over (-1 = all, 0 = off).
    #[arg(long, default_value_t = GenerationOptions::default().dry_penalty_last_n, value_name = "N", allow_hyphen_values = true)]
    pub dry_penalty_last_n: i64,
    /// A string that ends a repetition for DRY (repeat the flag; the default is llama.cpp's:
    /// newline, `:`, `"`, `*`; `\n` is a newline; `--dry-sequence-breaker none` for none).
    #[arg(long = "dry-sequence-breaker", value_name = "TEXT")]
    pub dry_sequence_breakers: Vec<String>,
    /// Tokens a thinking model's reasoning block (one its template opens, as Qwen3.5's and the
    /// Thinking checkpoints' do) may take: then a newline and `</think>` are written for it and
    /// the answer follows; 0 closes the block at once. Unbounded when not given.
    #[arg(long, value_name = "N")]
    pub reasoning_budget: Option<usize>,
    #[command(flatten)]
    pub speculative: super::SpeculativeArgs,
    #[arg(skip)]
    defaults: PhantomData<D>,
}

impl<D: Defaults> SamplingArgs<D> {
    /// The engine's options, checked: a value out of range is one line naming its flag.
    pub fn options(&self) -> Result<GenerationOptions> {
        let options = GenerationOptions {
            max_new_tokens: self.max_new_tokens,
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            seed: self.seed,
            reasoning_budget: self.reasoning_budget,
            top_n_sigma: self.top_n_sigma,
            xtc_probability: self.xtc_probability,
            xtc_threshold: self.xtc_threshold,
            mirostat: self.mirostat,
            mirostat_tau: self.mirostat_tau,
            mirostat_eta: self.mirostat_eta,
            dry_multiplier: self.dry_multiplier,
            dry_base: self.dry_base,
            dry_allowed_length: self.dry_allowed_length,
            dry_penalty_last_n: self.dry_penalty_last_n,
            dry_sequence_breakers: match self.dry_sequence_breakers.as_slice() {
                [] => GenerationOptions::default().dry_sequence_breakers,
                [none] if none == "none" => vec![],
                given => given.iter().map(|b| b.replace("\\n", "\n")).collect(),
            },
            ..Default::default()
        };
        let mut options = options;
        self.speculative.apply(&mut options)?;
        self.speculative.check_draft_used(&options)?;
        options.validate().map_err(|e| {
            let flag = e.to_string().replace('_', "-").replace("dry-sequence-breakers", "dry-sequence-breaker");
            anyhow::anyhow!("--{flag}")
        })?;
        Ok(options)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `vl run`'s default is the library's; `vl chat`'s is its own, and longer.
    #[test]
    fn the_max_new_tokens_defaults_are_numbers_and_run_s_is_the_library_s() {
        let run: usize = RunDefaults::MAX_NEW_TOKENS.parse().unwrap();
        let chat: usize = ChatDefaults::MAX_NEW_TOKENS.parse().unwrap();
        assert_eq!(run, GenerationOptions::default().max_new_tokens);
        assert!(chat > run);
    }
}
