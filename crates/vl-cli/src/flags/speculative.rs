//! How tokens are decoded, the flags `run`, `chat` and `serve` share: speculative decoding
//! (`--speculative mtp|draft|ngram`, `--draft-model`, `--draft-max`, `--ngram-min`, `--ngram-max`)
//! and a constraint's forced tokens (`--no-forced-tokens`). Neither changes an answer's distribution; they change
//! how many forward passes it takes. For `serve` they are the defaults a request's own
//! `speculative` and `forced_tokens` fields override.

use anyhow::Result;
use clap::Args;
use vl_models::sampling::GenerationOptions;
use vl_models::speculative::{Method, Speculative};

#[derive(Debug, Args)]
pub struct SpeculativeArgs {
    /// Draft tokens and verify them with the next one in a single forward pass: `mtp` (the
    /// greedy picks of the model's own multi-token-prediction head: Qwen3.5 checkpoints),
    /// `draft` (those of `--draft-model`), `ngram` (prompt lookup: what followed the answer's
    /// last tokens earlier in the prompt or the answer; pays where the answer repeats its prompt:
    /// documents, code, edits) or `off`. The answer is the same (greedy, or sampled with a
    /// seed). Default: `draft` with `--draft-model`, else `off`.
    #[arg(long, value_name = "METHOD")]
    pub speculative: Option<String>,
    /// A smaller model of the same tokenizer that drafts for `--speculative draft` (a
    /// directory, a hub id or a GGUF file, loaded with the model's device, dtype and
    /// quantization rule), e.g. Qwen3-VL-2B for 8B or 32B. It sees the images and videos
    /// through its own vision tower.
    #[arg(long, value_name = "MODEL")]
    pub draft_model: Option<String>,
    /// `mtp` drafts among the first N token ids only (Qwen's BPE ranks its frequent tokens
    /// first): the head's vocabulary product, most of a draft's cost, shrinks by the vocabulary
    /// over N; drafts of rarer tokens are lost, answers never change. Default: the whole
    /// vocabulary.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub draft_vocab: Option<u32>,
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
        let method = match &self.speculative {
            Some(m) => Method::parse(m).map_err(|e| anyhow::anyhow!("--speculative {e}"))?,
            None if self.draft_model.is_some() => Method::Draft,
            None => Method::Off,
        };
        if method == Method::Draft && self.draft_model.is_none() {
            anyhow::bail!("--speculative draft: needs a draft model (--draft-model MODEL)");
        }
        o.speculative =
            Speculative { method, draft_max: self.draft_max, ngram_min: self.ngram_min, ngram_max: self.ngram_max };
        o.forced_tokens = !self.no_forced_tokens;
        o.speculative.validate().map_err(|e| anyhow::anyhow!("--{}", e.to_string().replace('_', "-")))
    }

    /// For one answer at a time (`run`, `chat`): a `--draft-model` that `--speculative` does not
    /// use is refused rather than loaded for nothing (`serve` keeps it for requests that ask).
    pub fn check_draft_used(&self, o: &GenerationOptions) -> Result<()> {
        if self.draft_model.is_some() && o.speculative.method != Method::Draft {
            anyhow::bail!(
                "--draft-model drafts only for --speculative draft, not --speculative {}: leave one of them out",
                self.speculative.as_deref().unwrap_or("off")
            );
        }
        Ok(())
    }

    /// The `--draft-model`, loaded whole with `base`'s device and dtype and the quantization
    /// `model`'s flags choose for its files; None without one.
    pub fn open_draft(
        &self,
        model: &super::ModelArgs,
        base: &vl_models::engine::ModelOptions,
    ) -> Result<Option<Box<dyn vl_models::family::Family>>> {
        use anyhow::Context;
        let Some(name) = &self.draft_model else { return Ok(None) };
        let dir = vl_models::hub::resolve(name).with_context(|| format!("--draft-model {name}"))?;
        let (quant, _) = model.quant_choice(&dir, base.dtype)?;
        let opts = vl_models::engine::ModelOptions { quant, ..base.clone() };
        let source = vl_models::family::Source { model: &dir, mmproj: None, progress: None };
        let family =
            vl_models::registry::open(&source, &opts).with_context(|| format!("--draft-model {}", dir.display()))?;
        crate::note_load_warnings(&dir, &*family);
        Ok(Some(family))
    }
}
