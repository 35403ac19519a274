//! Speculative decoding's draft side, model-agnostic: the options a request or a command sets,
//! and prompt lookup (n-gram drafts: the tokens that followed the latest earlier occurrence of
//! the answer's last few tokens, in the prompt or the answer). Drafts from a second model
//! (`Method::Draft`) are the engine's (`engine/draft.rs`): it holds that model; so are those of
//! the model's own multi-token-prediction head (`Method::Mtp`, `engine/head.rs`).
//!
//! Drafts are verified by the scheduler in one batched forward pass with the token before them:
//! each drafted token is kept while the token the sampler picks from the previous row's logits
//! (the same picker, constraint and random stream as without drafts) equals it. Every draft
//! source here proposes one token per position (no distribution), so picking and comparing is
//! the speculative-sampling rule exactly: the answer is the one decoding without drafts gives,
//! greedy or sampled with a seed, only in fewer steps.

use crate::error::{Error, Result};

/// Where drafted tokens come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Method {
    /// No drafts: one token per step.
    #[default]
    Off,
    /// Prompt lookup: n-gram matches in the prompt and the answer so far.
    Ngram,
    /// A draft model's greedy picks: a smaller checkpoint of the same tokenizer the engine
    /// loaded beside the model (`--draft-model`).
    Draft,
    /// The model's own multi-token-prediction head's greedy picks (Qwen3.5's `mtp.*`).
    Mtp,
}

impl Method {
    /// `off`, `ngram`, `draft` or `mtp`.
    pub fn parse(s: &str) -> std::result::Result<Self, String> {
        match s {
            "off" | "none" => Ok(Self::Off),
            "ngram" => Ok(Self::Ngram),
            "draft" => Ok(Self::Draft),
            "mtp" => Ok(Self::Mtp),
            other => Err(format!("`{other}` is not a speculative method: expected `mtp`, `draft`, `ngram` or `off`")),
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Self::Off => "off",
            Self::Ngram => "ngram",
            Self::Draft => "draft",
            Self::Mtp => "mtp",
        }
    }
}

/// Most tokens drafted per step (`draft_max`): with the token before them, the rows one
/// product on the stored quantized blocks takes (`vl_nn::stored::SMALL_ROWS`), whose results are
/// bit for bit those of one row at a time.
pub const MAX_DRAFT: usize = vl_nn::stored::SMALL_ROWS - 1;
/// Longest n-gram looked up.
pub const MAX_NGRAM: usize = 16;

/// How a request drafts tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Speculative {
    pub method: Method,
    /// Tokens drafted at most per step (1..=`MAX_DRAFT`).
    pub draft_max: usize,
    /// The n-grams looked up: the longest first, down to the shortest
    /// (1 <= `ngram_min` <= `ngram_max` <= `MAX_NGRAM`).
    pub ngram_min: usize,
    pub ngram_max: usize,
}

impl Default for Speculative {
    fn default() -> Self {
        Self { method: Method::Off, draft_max: 4, ngram_min: 2, ngram_max: 4 }
    }
}

impl Speculative {
    /// The options in range; the error names the field.
    pub fn validate(&self) -> Result<()> {
        let bad = |what: &str, message: String| Err(Error::Input { what: what.into(), message });
        if !(1..=MAX_DRAFT).contains(&self.draft_max) {
            return bad("draft_max", format!("{} must be in 1..={MAX_DRAFT}", self.draft_max));
        }
        if !(1..=MAX_NGRAM).contains(&self.ngram_max) {
            return bad("ngram_max", format!("{} must be in 1..={MAX_NGRAM}", self.ngram_max));
        }
        if !(1..=self.ngram_max).contains(&self.ngram_min) {
            return bad("ngram_min", format!("{} must be in 1..={} (ngram_max)", self.ngram_min, self.ngram_max));
        }
        Ok(())
    }

    /// Up to `limit` (and `draft_max`) tokens to verify after `history` (the prompt, the answer
    /// so far and the token about to be fed); empty when off or nothing matches, and for a
    /// draft model or head (the engine runs them).
    pub fn draft(&self, history: &[u32], limit: usize) -> Vec<u32> {
        match self.method {
            Method::Off | Method::Draft | Method::Mtp => vec![],
            Method::Ngram => ngram_draft(history, self.ngram_min, self.ngram_max, self.draft_max.min(limit)),
        }
    }
}

/// Prompt lookup: for n from `max_n` down to `min_n`, the earlier occurrences of `history`'s
/// last n tokens; the (at most `k`) tokens that followed the latest one followed by `k` tokens,
/// else by the most (a repeated run's earliest). Linear in the history.
pub fn ngram_draft(history: &[u32], min_n: usize, max_n: usize, k: usize) -> Vec<u32> {
    let len = history.len();
    if k == 0 || min_n == 0 || len < min_n + 1 {
        return vec![];
    }
    for n in (min_n..=max_n.min(len - 1)).rev() {
        let tail = &history[len - n..];
        // (continuation start, its length), the longest so far.
        let mut best: Option<(usize, usize)> = None;
        // Starts of earlier occurrences, latest first (the tail itself excluded).
        for s in (0..len - n).rev() {
            if &history[s..s + n] != tail {
                continue;
            }
            let from = s + n;
            let got = k.min(len - from);
            if best.is_none_or(|(_, b)| got > b) {
                best = Some((from, got));
            }
            if got == k {
                break;
            }
        }
        if let Some((from, got)) = best {
            return history[from..from + got].to_vec();
        }
    }
    vec![]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_latest_longest_match_drafts_what_followed_it() {
        // "a b c d x | b c e | b c": the 2-gram "b c" last occurred before "e", which is
        // followed by 3 tokens; the earlier one by 7.
        let h = [1, 2, 3, 4, 9, 2, 3, 5, 2, 3];
        assert_eq!(ngram_draft(&h, 2, 4, 3), vec![5, 2, 3]);
        assert_eq!(ngram_draft(&h, 2, 4, 1), vec![5]);
        assert_eq!(ngram_draft(&h, 2, 4, 8), vec![4, 9, 2, 3, 5, 2, 3]);
        // A longer match wins over a later shorter one: "1 2 3" occurs once, at the start.
        let h = [1, 2, 3, 7, 7, 2, 3, 8, 1, 2, 3];
        assert_eq!(ngram_draft(&h, 2, 3, 2), vec![7, 7]);
        // No earlier occurrence of any n-gram in range: nothing.
        assert!(ngram_draft(&[1, 2, 3, 4], 1, 3, 4).is_empty());
        assert!(ngram_draft(&[5, 5], 2, 3, 4).is_empty());
        // A run of one token drafts more of it, as much as the run holds.
        assert_eq!(ngram_draft(&[5, 5, 5], 1, 2, 4), vec![5]);
        assert_eq!(ngram_draft(&[5; 7], 1, 2, 4), vec![5; 4]);
        assert_eq!(ngram_draft(&[5; 5], 1, 2, 8), vec![5; 3]);
        assert!(ngram_draft(&[], 1, 3, 4).is_empty());
    }

    #[test]
    fn options_out_of_range_are_named() {
        let ok = Speculative { method: Method::Ngram, ..Default::default() };
        assert!(ok.validate().is_ok());
        let named = |s: Speculative| s.validate().unwrap_err().to_string();
        assert!(named(Speculative { draft_max: 0, ..ok.clone() }).contains("draft_max"));
        assert!(named(Speculative { draft_max: MAX_DRAFT + 1, ..ok.clone() }).contains("draft_max"));
        assert!(named(Speculative { ngram_min: 5, ngram_max: 4, ..ok.clone() }).contains("ngram_min"));
        assert!(named(Speculative { ngram_max: MAX_NGRAM + 1, ..ok.clone() }).contains("ngram_max"));
        assert_eq!(Method::parse("ngram"), Ok(Method::Ngram));
        assert_eq!(Method::parse("draft"), Ok(Method::Draft));
        assert_eq!(Method::parse("mtp"), Ok(Method::Mtp));
        assert!(Method::parse("eagle").unwrap_err().contains("`eagle`"));
        assert!(ok.draft(&[1, 2, 1], 0).is_empty());
        assert!(Speculative::default().draft(&[1, 2, 1, 2], 4).is_empty());
    }
}
