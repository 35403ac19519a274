//! How tokens are decoded, the flags `run`, `chat` and `serve` share: speculative decoding
//! (`--speculative ngram`, `--draft-max`, `--ngram-min`, `--ngram-max`) and a constraint's
//! forced tokens (`--no-forced-tokens`). Neither changes an answer's distribution; they change
//! how many forward passes it takes. For `serve` they are the defaults a request's own
//! `speculative` and `forced_tokens` fields override.

use anyhow::Result;
use clap::Args;
use vl_models::sampling::GenerationOptions;
use vl_models::speculative::{Method, Speculative};

#[derive(Debug, Args)]
pub struct SpeculativeArgs {
    /// Draft tokens and verify them with the next one in a single forward pass: `ngram` (prompt
    /// lookup: what followed the answer's last tokens earlier in the prompt or the answer; pays
    /// where the answer repeats its prompt: documents, code, edits) or `off`. The answer is the
    /// same (greedy, or sampled with a seed); `draft` and `mtp` are not available yet.
    #[arg(long, value_name = "METHOD", default_value = "off")]
    pub speculative: String,
    /// Tokens drafted at most per step (1 to 15).
    #[arg(long, value_name = "N", default_value_t = Speculative::default().draft_max)]
    pub draft_max: usize,
    /// The shortest n-gram `ngram` looks up (it tries the longest first).
    #[arg(long, value_name = "N", default_value_t = Speculative::default().ngram_min)]
    pub ngram_min: usize,
    /// The longest n-gram `ngram` looks up (at most 16).
    #[arg(long, value_name = "N", default_value_t = Speculative::default().ngram_max)]
    pub ngram_max: usize,
    /// Sample every token of a constrained answer, one forward pass each, even where the
    /// constraint allows one continuation only (by default those tokens are written without
    /// sampling, in the tokenizer's canonical tokenization, and fed in one pass).
    #[arg(long)]
    pub no_forced_tokens: bool,
}

impl SpeculativeArgs {
    /// Sets `o`'s `speculative` and `forced_tokens`; a value out of range names its flag.
    pub fn apply(&self, o: &mut GenerationOptions) -> Result<()> {
        let method = Method::parse(&self.speculative).map_err(|e| anyhow::anyhow!("--speculative {e}"))?;
        o.speculative =
            Speculative { method, draft_max: self.draft_max, ngram_min: self.ngram_min, ngram_max: self.ngram_max };
        o.forced_tokens = !self.no_forced_tokens;
        o.speculative.validate().map_err(|e| anyhow::anyhow!("--{}", e.to_string().replace('_', "-")))
    }
}
