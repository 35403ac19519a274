//! llama.cpp's DRY ("don't repeat yourself") sampler, with its names and semantics: a token that
//! would extend a repetition of the context gets its logit lowered by `multiplier * base ^ (L -
//! allowed_length)`, L the length of the longest repeated run it would extend (at least
//! `allowed_length`), over the last `penalty_last_n` tokens of the prompt and answer. A
//! sequence breaker (a string such as a newline) ends the runs before it: a repetition is not
//! counted back past the last breaker in the context, and a token that is a breaker on its own
//! is never penalized.
//!
//! Breakers are found in the vocabulary as llama.cpp finds them: a token whose text holds the
//! breaker is one; a token whose text ends with the breaker's beginning is one when the tokens
//! after it spell the rest (the rest tokenized, at most `MAX_TAIL_TOKENS`).

use std::collections::HashMap;

/// llama.cpp's default breakers.
pub const DEFAULT_BREAKERS: [&str; 4] = ["\n", ":", "\"", "*"];

/// Most breakers a request may give.
pub const MAX_BREAKERS: usize = 32;

/// Longest breaker, in characters (llama.cpp's bound).
pub const MAX_BREAKER_CHARS: usize = 40;

/// Most tokens of a breaker's rest after its head token (llama.cpp's bound).
pub const MAX_TAIL_TOKENS: usize = 20;

/// The breakers as token sequences: by head token, the tokens that must follow it (none for a
/// token that holds a whole breaker).
#[derive(Debug, Default)]
pub struct Breakers {
    heads: HashMap<u32, Vec<Vec<u32>>>,
}

impl Breakers {
    /// `texts[id]`: each token's text; `tokenize`: text to ids (no special tokens added).
    pub fn new(texts: &[String], tokenize: &dyn Fn(&str) -> Vec<u32>, breakers: &[String]) -> Self {
        let mut heads: HashMap<u32, Vec<Vec<u32>>> = HashMap::new();
        for b in breakers.iter().filter(|b| !b.is_empty()) {
            for (id, word) in texts.iter().enumerate() {
                let id = id as u32;
                if word.contains(b.as_str()) {
                    heads.entry(id).or_default().push(vec![]);
                    continue;
                }
                // The token ends with a beginning of `b`: the rest must follow.
                for (start, _) in word.char_indices() {
                    let end = &word[start..];
                    if let Some(rest) = b.strip_prefix(end) {
                        let mut tail = tokenize(rest);
                        tail.truncate(MAX_TAIL_TOKENS);
                        let seqs = heads.entry(id).or_default();
                        if !seqs.contains(&tail) {
                            seqs.push(tail);
                        }
                    }
                }
            }
        }
        Self { heads }
    }

    /// Whether `token` is a breaker on its own.
    fn is_single(&self, token: u32) -> bool {
        self.heads.get(&token).is_some_and(|s| s.iter().any(Vec::is_empty))
    }
}

/// The DRY options of one request (validated by `GenerationOptions::validate`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Dry {
    pub multiplier: f64,
    pub base: f64,
    pub allowed_length: usize,
    /// -1: the whole context; 0: off.
    pub penalty_last_n: i64,
}

impl Dry {
    pub fn is_on(&self) -> bool {
        self.multiplier > 0.0 && self.penalty_last_n != 0
    }
}

/// Lowers the logits of the tokens that would extend a repetition of `context` (the prompt and
/// the answer so far).
pub fn apply(logits: &mut [f32], context: &[u32], dry: &Dry, breakers: &Breakers) {
    if !dry.is_on() {
        return;
    }
    let n = match dry.penalty_last_n {
        -1 => context.len(),
        k => context.len().min(k.max(0) as usize),
    };
    if n <= dry.allowed_length {
        return;
    }
    let w = &context[context.len() - n..];
    // `at(k)`: the k-th token from the end.
    let at = |k: usize| w[n - 1 - k];
    // Step 1: no run counts back past the last breaker (a head token with its tail after it).
    let mut limit = n;
    'find: for i in 0..n {
        let Some(seqs) = breakers.heads.get(&at(i)) else { continue };
        let mut longest: Option<usize> = None;
        for tail in seqs {
            let len = tail.len();
            if len <= i && longest.is_none_or(|l| len > l) && (0..len).all(|o| tail[o] == at(i - o - 1)) {
                longest = Some(len);
            }
        }
        if let Some(len) = longest {
            limit = i - len;
            break 'find;
        }
    }
    if limit < dry.allowed_length {
        return;
    }
    // Step 2: for each earlier position, the longest run ending there that equals the end of
    // the context (the Z-function of the reversed window), at most `limit`.
    let z = reversed_z(w);
    // Step 3: the token after each such run would extend it; the longest per token.
    let mut longest: HashMap<u32, usize> = HashMap::new();
    for k in 1..n {
        let run = z[k].min(limit);
        if run >= dry.allowed_length {
            // The run ends at forward position n-1-k; the token after it.
            let next = w[n - k];
            let e = longest.entry(next).or_insert(0);
            *e = (*e).max(run);
        }
    }
    // Step 4: the penalty, its exponent bounded so that it stays finite in f32.
    let max_exponent = if dry.base > 1.000001 { (88.722_839_1 / dry.base.ln()) as i64 } else { i64::MAX };
    for (token, run) in longest {
        if breakers.is_single(token) {
            continue;
        }
        let exponent = (run as i64 - dry.allowed_length as i64).min(max_exponent);
        let penalty = dry.multiplier * dry.base.powi(exponent.clamp(0, i32::MAX as i64) as i32);
        if let Some(x) = logits.get_mut(token as usize) {
            *x -= penalty as f32;
        }
    }
}

/// `z[k]` for the window reversed (`r[i] = w[n-1-i]`): the length of the longest common prefix
/// of `r` and `r[k..]` (`z[0]` unused).
fn reversed_z(w: &[u32]) -> Vec<usize> {
    let n = w.len();
    let r = |i: usize| w[n - 1 - i];
    let mut z = vec![0usize; n];
    let (mut left, mut right) = (0usize, 0usize);
    for k in 1..n {
        let mut len = if k < right { z[k - left].min(right - k) } else { 0 };
        while k + len < n && r(len) == r(k + len) {
            len += 1;
        }
        z[k] = len;
        if k + len > right {
            left = k;
            right = k + len;
        }
    }
    z
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A vocabulary of single letters (ids 0..26 for a..z), a newline (26) and "x:" (27).
    fn vocab() -> (Vec<String>, Breakers) {
        let mut texts: Vec<String> = ('a'..='z').map(|c| c.to_string()).collect();
        texts.push("\n".into());
        texts.push("x:".into());
        let tokenize = |s: &str| -> Vec<u32> { s.chars().map(|c| c as u32 - 'a' as u32).collect() };
        let b = Breakers::new(&texts, &tokenize, &["\n".into(), ":".into(), "qr".into()]);
        (texts, b)
    }

    fn ids(s: &str) -> Vec<u32> {
        s.chars().map(|c| if c == '\n' { 26 } else { c as u32 - 'a' as u32 }).collect()
    }

    #[test]
    fn breakers_are_found_whole_or_by_their_head_and_tail() {
        let (_, b) = vocab();
        assert!(b.is_single(26) && b.is_single(27));
        // "q" begins "qr": a head whose tail is "r".
        assert_eq!(b.heads[&16], vec![vec![17]]);
        assert!(!b.is_single(16));
        assert!(!b.heads.contains_key(&0));
    }

    #[test]
    fn the_token_that_extends_a_repeat_is_penalized_by_hand_computed_amounts() {
        let (_, b) = vocab();
        let dry = Dry { multiplier: 0.8, base: 1.75, allowed_length: 2, penalty_last_n: -1 };
        // "abcdxabc": the end "abc" repeats the start, and "d" followed it: a run of 3, penalty
        // 0.8 * 1.75^1 = 1.4; nothing else is lowered.
        let mut l = vec![0.0f32; 28];
        apply(&mut l, &ids("abcdxabc"), &dry, &b);
        let mut want = vec![0.0f32; 28];
        want[3] = -1.4;
        assert!(l.iter().zip(&want).all(|(a, b)| (a - b).abs() < 1e-6), "{l:?}");
        // Two earlier runs: "ab" then "e" (run 2: 0.8), "zab" then "f" (run 3: 1.4).
        let mut l = vec![0.0f32; 28];
        apply(&mut l, &ids("abezabfzab"), &dry, &b);
        assert!((l[4] + 0.8).abs() < 1e-6 && (l[5] + 1.4).abs() < 1e-6, "{l:?}");
        assert_eq!(l.iter().filter(|x| **x != 0.0).count(), 2);
        // A run shorter than allowed_length: nothing.
        let mut l = vec![0.0f32; 28];
        apply(&mut l, &ids("abxb"), &dry, &b);
        assert!(l.iter().all(|x| *x == 0.0));
        // The last 5 tokens only: "abcd" is out of sight.
        let mut l = vec![0.0f32; 28];
        apply(&mut l, &ids("abcdxyabc"), &Dry { penalty_last_n: 5, ..dry }, &b);
        assert!(l.iter().all(|x| *x == 0.0), "{l:?}");
    }

    #[test]
    fn a_breaker_limits_the_run_and_is_never_penalized() {
        let (_, b) = vocab();
        let dry = Dry { multiplier: 1.0, base: 2.0, allowed_length: 2, penalty_last_n: -1 };
        // "abcd\nbcd": "bcd" repeats, and a newline followed it: a breaker on its own, never
        // penalized.
        let mut l = vec![0.0f32; 28];
        apply(&mut l, &ids("abcd\nbcd"), &dry, &b);
        assert!(l.iter().all(|x| *x == 0.0), "{l:?}");
        // "\nabc\nab": the run "\nab" (3) is counted back only to the last breaker: 2, so "c"
        // gets 1 * 2^0, not 2^1.
        let mut l = vec![0.0f32; 28];
        apply(&mut l, &ids("\nabc\nab"), &dry, &b);
        assert!((l[2] + 1.0).abs() < 1e-6, "{l:?}");
        assert_eq!(l.iter().filter(|x| **x != 0.0).count(), 1);
        // A head with its tail after it ("q" then "r") is a breaker too: "qrab" (4) counts 2,
        // "z" gets 1; a head token itself is penalized like any other ("zab" then "q": 2^1).
        let mut l = vec![0.0f32; 28];
        apply(&mut l, &ids("qrabzqrab"), &dry, &b);
        assert!((l[25] + 1.0).abs() < 1e-6, "{l:?}");
        let mut l = vec![0.0f32; 28];
        apply(&mut l, &ids("zabqrzab"), &dry, &b);
        assert!((l[16] + 2.0).abs() < 1e-6, "{l:?}");
        // A breaker one token from the end leaves runs of 1 (< allowed_length): nothing.
        let mut l = vec![0.0f32; 28];
        apply(&mut l, &ids("abcab\nb"), &dry, &b);
        assert!(l.iter().all(|x| *x == 0.0), "{l:?}");
    }

    #[test]
    fn the_z_function_of_the_reversed_window_is_the_naive_one() {
        let w = ids("abaabaabab");
        let z = reversed_z(&w);
        let n = w.len();
        for k in 1..n {
            let naive = (0..n - k).take_while(|&i| w[n - 1 - i] == w[n - 1 - k - i]).count();
            assert_eq!(z[k], naive, "k {k}");
        }
    }
}
