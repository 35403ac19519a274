//! Sampling, model-agnostic: options and their ranges, transformers' order of logits processors
//! (repetition penalty, temperature, top-k, top-p, min-p), OpenAI's presence and frequency
//! penalties, llama.cpp's DRY (after the repetition penalty, `dry`), top-n-sigma and XTC, and the
//! NaN/inf check that runs before every sampling step.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::error::{Error, Result};

#[derive(Debug, Clone, PartialEq)]
pub struct GenerationOptions {
    pub max_new_tokens: usize,
    /// 0 means greedy.
    pub temperature: f64,
    /// 0 disables.
    pub top_k: usize,
    /// 1.0 disables.
    pub top_p: f64,
    /// 0.0 disables.
    pub min_p: f64,
    /// 1.0 disables; >1 discourages tokens already in the prompt or output.
    pub repetition_penalty: f64,
    /// llama.cpp's top-n-sigma: only tokens whose logit is within this many standard deviations
    /// of the largest (over the candidates) are kept. 0 disables.
    pub top_n_sigma: f64,
    /// llama.cpp's XTC ("exclude top choices"): with this probability per step, every token at
    /// least `xtc_threshold` likely but the least likely of them is removed (when two or more
    /// are). 0 disables.
    pub xtc_probability: f64,
    /// XTC's probability threshold, in (0, 1].
    pub xtc_threshold: f64,
    /// llama.cpp's DRY (`dry`): the penalty's scale; 0 disables.
    pub dry_multiplier: f64,
    /// DRY's growth per token of repetition past `dry_allowed_length` (>= 1).
    pub dry_base: f64,
    /// The longest repetition DRY leaves unpenalized (>= 1).
    pub dry_allowed_length: usize,
    /// The tokens of the prompt and answer DRY looks back over: -1 all, 0 none (off).
    pub dry_penalty_last_n: i64,
    /// Strings that end a repetition for DRY (at most `dry::MAX_BREAKERS`, each 1 to
    /// `dry::MAX_BREAKER_CHARS` characters).
    pub dry_sequence_breakers: Vec<String>,
    /// OpenAI's: subtracted once from every token already generated (0 = off, in [-2, 2]).
    pub presence_penalty: f64,
    /// OpenAI's: subtracted per occurrence in the generated tokens (0 = off, in [-2, 2]).
    pub frequency_penalty: f64,
    pub seed: u64,
    /// llama.cpp's mirostat: 0 off, 1 (Mirostat), 2 (Mirostat 2.0). On, it replaces the
    /// truncation samplers (top-k, top-p, min-p, top-n-sigma, XTC must be off): after the
    /// temperature, the candidates are cut to a surprise that tracks `mirostat_tau` (bits) at
    /// the learning rate `mirostat_eta`. Penalties, DRY, logit_bias and masks apply before.
    pub mirostat: u8,
    pub mirostat_tau: f64,
    pub mirostat_eta: f64,
    /// Generation stops after emitting one of these.
    pub eos_token_ids: Vec<u32>,
    /// Generation goes on past end-of-sequence tokens, to `max_new_tokens` or a stop string
    /// (vLLM's and SGLang's `ignore_eos`, for benchmarks); a constraint still ends the answer
    /// where its grammar does.
    pub ignore_eos: bool,
    /// OpenAI's `logit_bias`: (token, bias in [-100, 100]) added to the token's logit before
    /// sampling; -100 bans the token.
    pub logit_bias: Vec<(u32, f32)>,
    /// Report each picked token's log-probability and this many most likely alternatives
    /// (OpenAI's `logprobs` / `top_logprobs`, at most `MAX_TOP_LOGPROBS`); None: off.
    pub logprobs: Option<usize>,
    /// Tokens the reasoning block a template opened may take: once they are spent inside it,
    /// the engine writes a newline and the family's closing marker for the model and the answer
    /// follows (llama.cpp's reasoning budget); 0 closes it at once. None: unbounded.
    pub reasoning_budget: Option<usize>,
    /// Drafted tokens verified in one forward pass (`speculative`): the answer is the same,
    /// in fewer steps when drafts are accepted. Off by default.
    pub speculative: crate::decoding::speculative::Speculative,
    /// Where a constraint allows one continuation only, its tokens are written without sampling
    /// and fed in one forward pass (llguidance's fast-forward tokens, in its canonical
    /// tokenization). On by default.
    pub forced_tokens: bool,
}

/// Temperatures below this are greedy decoding.
pub const GREEDY_BELOW: f64 = 1e-5;

/// Most alternatives `logprobs` reports per token (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// One picked token's log-probability and the most likely alternatives, under the distribution
/// the sampler saw before temperature and truncation: the model's logits after the presence and
/// frequency penalties, `logit_bias`, a constraint's mask, the repetition penalty and DRY.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    /// (token, logprob), most likely first.
    pub top: Vec<(u32, f32)>,
}

/// `TokenLogprob` of `token` under `logits`, with the `top` most likely.
pub fn logprob_of(logits: &[f32], token: u32, top: usize) -> TokenLogprob {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&x| ((x - max) as f64).exp()).sum();
    let norm = max + sum.ln() as f32;
    let lp = |t: usize| logits[t] - norm;
    let mut idx: Vec<usize> = (0..logits.len()).collect();
    let k = top.min(idx.len());
    let by_logit = |a: &usize, b: &usize| logits[*b].total_cmp(&logits[*a]).then(a.cmp(b));
    if k > 0 && k < idx.len() {
        idx.select_nth_unstable_by(k - 1, by_logit);
    }
    idx.truncate(k);
    idx.sort_unstable_by(by_logit);
    TokenLogprob { token, logprob: lp(token as usize), top: idx.into_iter().map(|t| (t as u32, lp(t))).collect() }
}

impl Default for GenerationOptions {
    fn default() -> Self {
        Self {
            max_new_tokens: 256,
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            top_n_sigma: 0.0,
            xtc_probability: 0.0,
            xtc_threshold: 0.1,
            dry_multiplier: 0.0,
            dry_base: 1.75,
            dry_allowed_length: 2,
            dry_penalty_last_n: -1,
            dry_sequence_breakers: crate::decoding::dry::DEFAULT_BREAKERS.iter().map(|s| s.to_string()).collect(),
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 0,
            mirostat: 0,
            mirostat_tau: 5.0,
            mirostat_eta: 0.1,
            eos_token_ids: vec![],
            ignore_eos: false,
            logit_bias: vec![],
            logprobs: None,
            reasoning_budget: None,
            speculative: Default::default(),
            forced_tokens: true,
        }
    }
}

impl GenerationOptions {
    /// The DRY options.
    pub fn dry(&self) -> crate::decoding::dry::Dry {
        crate::decoding::dry::Dry {
            multiplier: self.dry_multiplier,
            base: self.dry_base,
            allowed_length: self.dry_allowed_length,
            penalty_last_n: self.dry_penalty_last_n,
        }
    }

    /// Checks every option's range; the message names the option and its value.
    pub fn validate(&self) -> Result<()> {
        let bad = |what: &str, message: String| Err(Error::Input { what: what.into(), message });
        self.speculative.validate()?;
        if self.max_new_tokens == 0 {
            return bad("max_new_tokens", "0: at least one token must be generated".into());
        }
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return bad("temperature", format!("{} must be a finite number >= 0 (0 = greedy)", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", format!("{} must be in (0, 1] (1 = off)", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad("min_p", format!("{} must be in [0, 1] (0 = off)", self.min_p));
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return bad(
                "repetition_penalty",
                format!("{} must be a finite number > 0 (1 = off)", self.repetition_penalty),
            );
        }
        for (name, v) in [("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)] {
            if !(v.is_finite() && (-2.0..=2.0).contains(&v)) {
                return bad(name, format!("{v} must be in [-2, 2] (0 = off)"));
            }
        }
        if !(self.top_n_sigma.is_finite() && self.top_n_sigma >= 0.0) {
            return bad("top_n_sigma", format!("{} must be a finite number >= 0 (0 = off)", self.top_n_sigma));
        }
        if !(0.0..=1.0).contains(&self.xtc_probability) {
            return bad("xtc_probability", format!("{} must be in [0, 1] (0 = off)", self.xtc_probability));
        }
        if !(self.xtc_threshold > 0.0 && self.xtc_threshold <= 1.0) {
            return bad("xtc_threshold", format!("{} must be in (0, 1]", self.xtc_threshold));
        }
        if !(self.dry_multiplier.is_finite() && self.dry_multiplier >= 0.0) {
            return bad("dry_multiplier", format!("{} must be a finite number >= 0 (0 = off)", self.dry_multiplier));
        }
        if !(self.dry_base.is_finite() && self.dry_base >= 1.0) {
            return bad("dry_base", format!("{} must be a finite number >= 1", self.dry_base));
        }
        if self.dry_allowed_length == 0 {
            return bad("dry_allowed_length", "0 must be at least 1".into());
        }
        if self.dry_penalty_last_n < -1 {
            return bad("dry_penalty_last_n", format!("{} must be -1 (all), 0 (off) or more", self.dry_penalty_last_n));
        }
        {
            use crate::decoding::dry::{MAX_BREAKERS, MAX_BREAKER_CHARS};
            let b = &self.dry_sequence_breakers;
            if b.len() > MAX_BREAKERS {
                return bad("dry_sequence_breakers", format!("{} breakers, at most {MAX_BREAKERS}", b.len()));
            }
            for (i, s) in b.iter().enumerate() {
                let n = s.chars().count();
                if n == 0 || n > MAX_BREAKER_CHARS {
                    return bad(
                        "dry_sequence_breakers",
                        format!("breaker {i} has {n} characters: each has 1 to {MAX_BREAKER_CHARS}"),
                    );
                }
            }
        }
        if self.mirostat > 2 {
            return bad("mirostat", format!("{} must be 0 (off), 1 or 2", self.mirostat));
        }
        if !(self.mirostat_tau.is_finite() && self.mirostat_tau > 0.0 && self.mirostat_tau <= 100.0) {
            return bad("mirostat_tau", format!("{} must be in (0, 100] (bits of surprise)", self.mirostat_tau));
        }
        if !(self.mirostat_eta.is_finite() && self.mirostat_eta > 0.0 && self.mirostat_eta <= 1.0) {
            return bad("mirostat_eta", format!("{} must be in (0, 1]", self.mirostat_eta));
        }
        if self.mirostat != 0 {
            let on = [
                ("top_k", self.top_k != 0),
                ("top_p", self.top_p != 1.0),
                ("min_p", self.min_p != 0.0),
                ("top_n_sigma", self.top_n_sigma != 0.0),
                ("xtc_probability", self.xtc_probability != 0.0),
            ];
            if let Some((name, _)) = on.iter().find(|(_, on)| *on) {
                return bad(
                    "mirostat",
                    format!("does not combine with {name} (mirostat cuts the candidates itself, as llama.cpp's does): leave {name} off"),
                );
            }
        }
        if let Some(n) = self.logprobs.filter(|&n| n > MAX_TOP_LOGPROBS) {
            return bad("top_logprobs", format!("{n} is above {MAX_TOP_LOGPROBS}"));
        }
        for &(t, b) in &self.logit_bias {
            if !(b.is_finite() && (-100.0..=100.0).contains(&b)) {
                return bad("logit_bias", format!("token {t}: {b} must be in [-100, 100]"));
            }
        }
        Ok(())
    }
}

/// Adds each (token, bias) to the token's logit; a bias of -100 bans the token (OpenAI: "-100
/// should result in a ban"). Tokens past the logits are ignored (checked against the
/// vocabulary by the caller).
pub fn apply_logit_bias(logits: &mut [f32], bias: &[(u32, f32)]) {
    for &(t, b) in bias {
        if let Some(x) = logits.get_mut(t as usize) {
            *x = if b <= -100.0 { f32::NEG_INFINITY } else { *x + b };
        }
    }
}

/// Leaves only the tokens set in `allowed` (a bit set: token t is bit t % 32 of word t / 32);
/// the others get -inf.
pub fn apply_mask(logits: &mut [f32], allowed: &[u32]) {
    for (i, x) in logits.iter_mut().enumerate() {
        let on = allowed.get(i / 32).is_some_and(|w| w >> (i % 32) & 1 == 1);
        if !on {
            *x = f32::NEG_INFINITY;
        }
    }
}

/// OpenAI's presence and frequency penalties over the tokens generated so far:
/// `logit[t] -= presence * (count[t] > 0) + frequency * count[t]`.
pub fn apply_presence_frequency(logits: &mut [f32], generated: &[u32], opts: &GenerationOptions) {
    if opts.presence_penalty == 0.0 && opts.frequency_penalty == 0.0 {
        return;
    }
    let mut counts: std::collections::HashMap<u32, usize> = Default::default();
    for &t in generated {
        *counts.entry(t).or_default() += 1;
    }
    for (t, c) in counts {
        if let Some(x) = logits.get_mut(t as usize) {
            *x -= (opts.presence_penalty + opts.frequency_penalty * c as f64) as f32;
        }
    }
}

/// Fails on NaN or infinite logits (broken weights or config values) instead of sampling junk.
pub fn check_logits(logits: &[f32], step: usize) -> Result<()> {
    if let Some(i) = logits.iter().position(|x| !x.is_finite()) {
        let n = logits.iter().filter(|x| !x.is_finite()).count();
        return Err(Error::NonFinite {
            message: format!(
                "the model produced {n} non-finite logits at generated position {step} (token {i}: {}); its weights \
                 hold NaN/inf values or its config (rms_norm_eps, rope_theta) breaks the arithmetic",
                logits[i]
            ),
        });
    }
    Ok(())
}

/// Picks the next token from f32 `logits` given the tokens seen so far.
pub fn sample(logits: &[f32], seen: &[u32], opts: &GenerationOptions, rng: &mut StdRng) -> u32 {
    let mut l: Vec<f32> = logits.to_vec();
    apply_repetition_penalty(&mut l, seen, opts.repetition_penalty);
    sample_processed(l, opts, rng)
}

/// transformers' repetition penalty over the tokens `seen` (once per distinct token).
pub fn apply_repetition_penalty(l: &mut [f32], seen: &[u32], penalty: f64) {
    if penalty != 1.0 {
        let p = penalty as f32;
        let mut done = std::collections::HashSet::new();
        for &t in seen {
            if done.insert(t) {
                if let Some(x) = l.get_mut(t as usize) {
                    *x = if *x < 0.0 { *x * p } else { *x / p };
                }
            }
        }
    }
}

/// The logits divided by the temperature and the candidates' ids sorted by logit, descending
/// (ties by id, for determinism; banned or masked tokens, -inf, are no candidates); or the
/// argmax, where the temperature is greedy or nothing is a candidate.
fn tempered(mut l: Vec<f32>, opts: &GenerationOptions) -> std::result::Result<(Vec<f32>, Vec<usize>), u32> {
    // Below GREEDY_BELOW the division overflows f32 (1e-300 is 0 in f32): greedy, as vLLM does
    // under its 1e-5.
    if opts.temperature < GREEDY_BELOW {
        return Err(argmax(&l));
    }
    let t = opts.temperature as f32;
    l.iter_mut().for_each(|x| *x /= t);
    let mut idx: Vec<usize> = (0..l.len()).filter(|&i| l[i] > f32::NEG_INFINITY).collect();
    if idx.is_empty() {
        return Err(argmax(&l));
    }
    idx.sort_unstable_by(|&a, &b| l[b].total_cmp(&l[a]).then(a.cmp(&b)));
    Ok((l, idx))
}

/// `sample` after the repetition penalty: temperature, top-n-sigma, top-k, top-p, min-p, XTC,
/// the draw.
fn sample_processed(l: Vec<f32>, opts: &GenerationOptions, rng: &mut StdRng) -> u32 {
    let (l, mut idx) = match tempered(l, opts) {
        Ok(c) => c,
        Err(greedy) => return greedy,
    };
    if opts.top_n_sigma > 0.0 {
        // Over the candidates' (tempered) logits: the set is the same at any temperature.
        let n = idx.len() as f64;
        let mean = idx.iter().map(|&i| l[i] as f64).sum::<f64>() / n;
        let var = idx.iter().map(|&i| (l[i] as f64 - mean).powi(2)).sum::<f64>() / n;
        let floor = l[idx[0]] as f64 - opts.top_n_sigma * var.sqrt();
        let keep = idx.iter().take_while(|&&i| l[i] as f64 >= floor).count().max(1);
        idx.truncate(keep);
    }
    if opts.top_k > 0 {
        idx.truncate(opts.top_k.max(1));
    }
    let max = l[idx[0]];
    let mut probs: Vec<f64> = idx.iter().map(|&i| ((l[i] - max) as f64).exp()).collect();
    let total: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|p| *p /= total);
    if opts.top_p < 1.0 {
        let mut cum = 0.0;
        let keep = probs
            .iter()
            .take_while(|&&p| {
                let before = cum;
                cum += p;
                before < opts.top_p
            })
            .count()
            .max(1);
        idx.truncate(keep);
        probs.truncate(keep);
    }
    if opts.min_p > 0.0 {
        let floor = probs[0] * opts.min_p;
        let keep = probs.iter().take_while(|&&p| p >= floor).count().max(1);
        idx.truncate(keep);
        probs.truncate(keep);
    }
    if opts.xtc_probability > 0.0 {
        // The draw is made only with XTC on: other answers keep their random sequence.
        let total: f64 = probs.iter().sum();
        let above = probs.iter().take_while(|&&p| p / total >= opts.xtc_threshold).count();
        if above >= 2 && rng.random::<f64>() < opts.xtc_probability {
            idx.drain(..above - 1);
            probs.drain(..above - 1);
        }
    }
    let total: f64 = probs.iter().sum();
    let mut r = rng.random::<f64>() * total;
    for (k, p) in probs.iter().enumerate() {
        r -= p;
        if r <= 0.0 {
            return idx[k] as u32;
        }
    }
    *idx.last().unwrap() as u32
}

pub(crate) fn argmax(l: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in l.iter().enumerate() {
        if x > l[best] {
            best = i;
        }
    }
    best as u32
}

/// One sequence's choice of each next token: the logits checked, OpenAI's penalties applied over
/// what it generated, then `sample` with its own seeded generator over the prompt and output. The
/// one place a token is picked, for the engine's scheduler and a model's own generate loop alike.
pub struct TokenPicker {
    opts: GenerationOptions,
    /// The last pick's log-probabilities (with `logprobs` on).
    last: Option<TokenLogprob>,
    rng: StdRng,
    seen: Vec<u32>,
    generated: Vec<u32>,
    /// DRY's breakers, when DRY is on.
    dry: Option<std::sync::Arc<crate::decoding::dry::Breakers>>,
    /// Mirostat's target surprise now (2 tau at the start).
    mu: f64,
}

impl TokenPicker {
    pub fn new(opts: GenerationOptions, prompt: &[u32]) -> Self {
        let rng = StdRng::seed_from_u64(opts.seed);
        let mu = 2.0 * opts.mirostat_tau;
        Self { opts, rng, seen: prompt.to_vec(), generated: Vec::new(), last: None, dry: None, mu }
    }

    /// DRY on (when the options enable it), with the breakers of its options as tokens.
    pub fn with_dry(mut self, breakers: Option<std::sync::Arc<crate::decoding::dry::Breakers>>) -> Self {
        self.dry = breakers;
        self
    }

    /// Picks the token after `logits` (f32 `[vocab]`); an error on NaN or infinite logits.
    pub fn pick(&mut self, logits: Vec<f32>) -> Result<u32> {
        self.pick_among(logits, None)
    }

    /// `pick`, among the tokens set in `allowed` only (a bit set, see `apply_mask`): an error
    /// when none of them is allowed after `logit_bias`.
    pub fn pick_among(&mut self, mut logits: Vec<f32>, allowed: Option<&[u32]>) -> Result<u32> {
        check_logits(&logits, self.generated.len())?;
        apply_presence_frequency(&mut logits, &self.generated, &self.opts);
        apply_logit_bias(&mut logits, &self.opts.logit_bias);
        if let Some(a) = allowed {
            apply_mask(&mut logits, a);
        }
        if logits.iter().all(|&x| x == f32::NEG_INFINITY) {
            return Err(Error::Input {
                what: "logit_bias".into(),
                message: "every token the answer may continue with is banned".into(),
            });
        }
        apply_repetition_penalty(&mut logits, &self.seen, self.opts.repetition_penalty);
        if let Some(b) = &self.dry {
            crate::decoding::dry::apply(&mut logits, &self.seen, &self.opts.dry(), b);
        }
        let draw = |l: Vec<f32>, me: &mut Self| {
            if me.opts.mirostat != 0 {
                let params = crate::decoding::mirostat::Params {
                    version: me.opts.mirostat,
                    tau: me.opts.mirostat_tau,
                    eta: me.opts.mirostat_eta,
                };
                match tempered(l, &me.opts) {
                    Ok((l, idx)) => crate::decoding::mirostat::pick(&l, idx, &params, &mut me.mu, &mut me.rng),
                    Err(greedy) => greedy,
                }
            } else {
                sample_processed(l, &me.opts, &mut me.rng)
            }
        };
        let next = match self.opts.logprobs {
            Some(top) => {
                // The distribution before temperature and truncation: the sampler gets a copy.
                let next = draw(logits.clone(), self);
                self.last = Some(logprob_of(&logits, next, top));
                next
            }
            None => draw(logits, self),
        };
        self.generated.push(next);
        self.seen.push(next);
        Ok(next)
    }

    /// Takes `token` as the next one whatever `logits` say (a token the engine writes for the
    /// model, e.g. closing a reasoning block past its budget); its log-probability under
    /// `logits` is reported as a pick's is.
    pub fn force(&mut self, logits: &[f32], token: u32) {
        self.last = self.opts.logprobs.map(|top| logprob_of(logits, token, top));
        self.generated.push(token);
        self.seen.push(token);
    }

    /// The last picked token's log-probabilities, when `logprobs` is on.
    pub fn take_logprob(&mut self) -> Option<TokenLogprob> {
        self.last.take()
    }

    /// Whether `token` ends the answer (an eos id, unless `ignore_eos`).
    pub fn is_eos(&self, token: u32) -> bool {
        !self.opts.ignore_eos && self.opts.eos_token_ids.contains(&token)
    }

    /// Tokens picked so far.
    pub fn generated(&self) -> &[u32] {
        &self.generated
    }

    pub fn options(&self) -> &GenerationOptions {
        &self.opts
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn opts() -> GenerationOptions {
        GenerationOptions { temperature: 1.0, ..Default::default() }
    }

    /// Which tokens 2,000 seeded draws pick under `o`.
    fn picked(logits: &[f32], o: &GenerationOptions) -> std::collections::BTreeSet<u32> {
        let mut rng = StdRng::seed_from_u64(7);
        (0..2000).map(|_| sample_processed(logits.to_vec(), o, &mut rng)).collect()
    }

    #[test]
    fn top_n_sigma_keeps_the_tokens_near_the_top() {
        // Logits 10, 9.5, 9, then 0 x 7: mean 2.85, sigma 4.36; n = 0.2 keeps >= 9.13 (2 tokens),
        // n = 2 keeps >= 1.28 (3), n = 3 all ten.
        let mut logits = vec![0.0f32; 10];
        logits[..3].copy_from_slice(&[10.0, 9.5, 9.0]);
        let o = GenerationOptions { temperature: 1.0, top_n_sigma: 0.2, ..Default::default() };
        assert_eq!(picked(&logits, &o), [0, 1].into());
        let o = GenerationOptions { temperature: 5.0, top_n_sigma: 0.2, ..Default::default() };
        assert_eq!(picked(&logits, &o), [0, 1].into(), "the same set at another temperature");
        let o = GenerationOptions { temperature: 5.0, top_n_sigma: 2.0, ..Default::default() };
        assert_eq!(picked(&logits, &o), [0, 1, 2].into());
        let o = GenerationOptions { temperature: 5.0, top_n_sigma: 3.0, ..Default::default() };
        assert_eq!(picked(&logits, &o).len(), 10);
    }

    #[test]
    fn xtc_removes_the_top_choices_but_the_least_of_them() {
        // Probabilities ~0.47, 0.29, 0.17, then 0.02 x 3: with threshold 0.15, the first two of
        // the three above it go whenever XTC fires.
        let logits = [3.0f32, 2.5, 2.0, -0.2, -0.2, -0.2];
        let always =
            GenerationOptions { temperature: 1.0, xtc_probability: 1.0, xtc_threshold: 0.15, ..Default::default() };
        let got = picked(&logits, &always);
        assert!(!got.contains(&0) && !got.contains(&1) && got.contains(&2), "{got:?}");
        // One token above the threshold: nothing removed.
        let one = GenerationOptions { xtc_threshold: 0.4, ..always.clone() };
        assert!(picked(&logits, &one).contains(&0));
        // Half the steps: the top token is picked sometimes, less than without XTC.
        let half = GenerationOptions { xtc_probability: 0.5, ..always.clone() };
        let count = |o: &GenerationOptions| {
            let mut rng = StdRng::seed_from_u64(9);
            (0..4000).filter(|_| sample_processed(logits.to_vec(), o, &mut rng) == 0).count()
        };
        let off = GenerationOptions { xtc_probability: 0.0, ..always.clone() };
        let (with, without) = (count(&half), count(&off));
        assert!(with > 0 && (with as f64) < 0.7 * without as f64, "{with} vs {without}");
        for (o, field) in [
            (GenerationOptions { top_n_sigma: -1.0, ..Default::default() }, "top_n_sigma"),
            (GenerationOptions { xtc_probability: 1.5, ..Default::default() }, "xtc_probability"),
            (GenerationOptions { xtc_threshold: 0.0, ..Default::default() }, "xtc_threshold"),
        ] {
            assert!(matches!(o.validate(), Err(Error::Input { what, .. }) if what == field), "{field}");
        }
    }

    #[test]
    fn a_mask_and_a_ban_leave_only_the_allowed_tokens() {
        // Tokens 1 and 33 allowed (bit 1 of word 0, bit 1 of word 1); the best logit is token 0.
        let mut logits = vec![0.0f32; 40];
        logits[0] = 9.0;
        logits[33] = 1.0;
        let mask = [1u32 << 1, 1u32 << 1];
        for temperature in [0.0, 1.0] {
            let o = GenerationOptions { temperature, ..opts() };
            for seed in 0..20 {
                let mut p = TokenPicker::new(GenerationOptions { seed, ..o.clone() }, &[]);
                let t = p.pick_among(logits.clone(), Some(&mask)).unwrap();
                assert!(t == 1 || t == 33, "{t}");
            }
        }
        // -100 bans; +100 on another makes it the choice.
        let o = GenerationOptions { logit_bias: vec![(0, -100.0), (5, 100.0)], ..opts() };
        assert_eq!(TokenPicker::new(o, &[]).pick(logits.clone()).unwrap(), 5);
        // Everything banned: an error, not a pick.
        let o = GenerationOptions { logit_bias: vec![(1, -100.0), (33, -100.0)], ..opts() };
        assert!(TokenPicker::new(o, &[]).pick_among(logits, Some(&mask)).is_err());
        let bad = GenerationOptions { logit_bias: vec![(1, 101.0)], ..opts() };
        assert!(bad.validate().is_err());
    }

    #[test]
    fn greedy_takes_the_argmax_and_penalty_can_change_it() {
        let mut rng = StdRng::seed_from_u64(0);
        let l = [1.0, 3.0, 2.9];
        assert_eq!(sample(&l, &[], &GenerationOptions::default(), &mut rng), 1);
        // Penalty 2 on token 1: 3.0 / 2 = 1.5 < 2.9.
        let o = GenerationOptions { repetition_penalty: 2.0, ..Default::default() };
        assert_eq!(sample(&l, &[1], &o, &mut rng), 2);
        // Negative logits are multiplied.
        let o = GenerationOptions { repetition_penalty: 2.0, ..Default::default() };
        assert_eq!(sample(&[-1.0, -1.5], &[0], &o, &mut rng), 1);
    }

    #[test]
    fn presence_and_frequency_penalties_follow_openai() {
        let o = GenerationOptions { presence_penalty: 0.5, frequency_penalty: 0.25, ..Default::default() };
        let mut l = [1.0f32, 1.0, 1.0];
        apply_presence_frequency(&mut l, &[0, 0, 2], &o);
        // token 0: 1 - 0.5 - 2 * 0.25 = 0; token 1 untouched; token 2: 1 - 0.5 - 0.25.
        assert_eq!(l, [0.0, 1.0, 0.25]);
        assert!(GenerationOptions { presence_penalty: 2.5, ..Default::default() }.validate().is_err());
        assert!(GenerationOptions { frequency_penalty: f64::NAN, ..Default::default() }.validate().is_err());
    }

    #[test]
    fn top_k_1_and_tiny_top_p_and_high_min_p_are_greedy() {
        let l = [0.5, 0.2, 0.9, 0.1];
        for o in [
            GenerationOptions { top_k: 1, ..opts() },
            GenerationOptions { top_p: 0.01, ..opts() },
            GenerationOptions { min_p: 0.999, ..opts() },
        ] {
            let mut rng = StdRng::seed_from_u64(7);
            for _ in 0..20 {
                assert_eq!(sample(&l, &[], &o, &mut rng), 2, "{o:?}");
            }
        }
    }

    #[test]
    fn sampling_is_seeded_and_follows_the_distribution() {
        let l = [0.0f32, (3.0f32).ln()]; // probabilities 1/4, 3/4
        let draw = |seed| {
            let mut rng = StdRng::seed_from_u64(seed);
            (0..4000).map(|_| sample(&l, &[], &opts(), &mut rng)).collect::<Vec<_>>()
        };
        assert_eq!(draw(3), draw(3));
        let ones = draw(3).iter().filter(|&&t| t == 1).count() as f64 / 4000.0;
        assert!((ones - 0.75).abs() < 0.03, "{ones}");
        // top_k 2 keeps both; top_p 0.7 keeps only the 3/4 token.
        let mut rng = StdRng::seed_from_u64(1);
        let o = GenerationOptions { top_p: 0.7, ..opts() };
        assert!((0..100).all(|_| sample(&l, &[], &o, &mut rng) == 1));
    }

    #[test]
    fn mirostat_is_refused_with_a_truncation_sampler_and_out_of_range() {
        for (o, what) in [
            (GenerationOptions { mirostat: 2, top_p: 0.9, ..opts() }, "top_p"),
            (GenerationOptions { mirostat: 1, top_k: 20, ..opts() }, "top_k"),
            (GenerationOptions { mirostat: 3, ..opts() }, "0 (off), 1 or 2"),
            (GenerationOptions { mirostat: 2, mirostat_tau: 0.0, ..opts() }, "(0, 100]"),
            (GenerationOptions { mirostat: 2, mirostat_eta: 2.0, ..opts() }, "(0, 1]"),
        ] {
            let e = o.validate().unwrap_err().to_string();
            assert!(e.contains(what), "{e}");
        }
    }
}
