//! Kept prefixes: the KV caches of finished sequences, by what their positions hold, so that a
//! conversation's next turn (or any prompt sharing a start with one) prefills only the rest.
//! Many conversations are kept at once; the engine evicts the least recently used when running
//! sequences need the memory.

use crate::error::Result;
use crate::family::Identity;
use crate::state::SeqState;

/// Kept prefixes at most, whatever their size (each is matched against every new prompt).
const MAX_ENTRIES: usize = 256;

/// The shortest prompt prefix, up to its last message's end, that a prefill keeps a recurrent
/// state's snapshot at (a chunk split there: one more pass over the weights, about a decode
/// step, against the prefill of this many positions or more on the next turn).
pub const MESSAGE_SNAPSHOT_MIN: usize = 64;

/// Where a prefill chunk of `prompt` from `from` to `end` ends: at the prompt's last message end
/// (after its last end-of-turn token, one of `eos`) when that falls inside the chunk and is
/// `MESSAGE_SNAPSHOT_MIN` positions or more in, else at `end`. A conversation's next turn shares
/// the prompt up to there: the official templates render an earlier answer otherwise than as
/// generated (Qwen3.5's without its reasoning), so the prompt's own end is not shared.
pub(crate) fn message_end(prompt: &[u32], eos: &[u32], from: usize, end: usize) -> usize {
    match prompt.iter().rposition(|t| eos.contains(t)).map(|p| p + 1) {
        Some(b) if from < b && b < end && b >= MESSAGE_SNAPSHOT_MIN => b,
        _ => end,
    }
}

struct Entry {
    ident: Vec<Identity>,
    state: SeqState,
    used: u64,
}

#[derive(Default)]
pub(crate) struct PrefixStore {
    entries: Vec<Entry>,
    tick: u64,
}

/// Positions of `ident` a cache of `cached` may serve: the common prefix, never all of the
/// prompt (the last position's logits are needed), never ending inside a media placeholder run.
pub(crate) fn reusable(cached: &[Identity], ident: &[Identity]) -> usize {
    let n = ident.len();
    let mut common = cached.iter().zip(ident).take_while(|(a, b)| a == b).count().min(n.saturating_sub(1));
    while common > 0 && ident[common].media != 0 && ident[common - 1] == ident[common] {
        common -= 1;
    }
    common
}

impl PrefixStore {
    pub fn bytes(&self) -> usize {
        self.entries.iter().map(|e| e.state.bytes()).sum()
    }

    pub fn positions(&self) -> usize {
        self.entries.iter().map(|e| e.state.len()).sum()
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// The state that serves the most of `ident`, with the positions it serves: the entry itself
    /// when all of it is used (the conversation goes on), else a copy of the prefix (the entry
    /// stays for its own conversation). A state is served up to a position it can be brought
    /// back to (`SeqState::restorable`: anywhere for KV, a kept snapshot for recurrent layers).
    pub fn take(&mut self, ident: &[Identity]) -> Result<Option<(SeqState, usize)>> {
        let best =
            self.entries.iter().enumerate().map(|(i, e)| (e.state.restorable(reusable(&e.ident, ident)), i)).max();
        let Some((common, i)) = best.filter(|&(c, _)| c > 0) else { return Ok(None) };
        self.tick += 1;
        if common == self.entries[i].ident.len() {
            let e = self.entries.swap_remove(i);
            return Ok(Some((e.state, common)));
        }
        let e = &mut self.entries[i];
        e.used = self.tick;
        Ok(Some((e.state.copy_prefix(common)?, common)))
    }

    /// Positions of `ident` the best entry can serve (what `copy` would give).
    pub fn serves(&self, ident: &[Identity]) -> usize {
        self.entries.iter().map(|e| e.state.restorable(reusable(&e.ident, ident))).max().unwrap_or(0)
    }

    /// Like `take`, but the entry always stays (a prefix many prompts share): a copy of the
    /// most of `ident` an entry serves, with the positions it serves.
    pub fn copy(&mut self, ident: &[Identity]) -> Result<Option<(SeqState, usize)>> {
        let best =
            self.entries.iter().enumerate().map(|(i, e)| (e.state.restorable(reusable(&e.ident, ident)), i)).max();
        let Some((common, i)) = best.filter(|&(c, _)| c > 0) else { return Ok(None) };
        self.tick += 1;
        let e = &mut self.entries[i];
        e.used = self.tick;
        Ok(Some((e.state.copy_prefix(common)?, common)))
    }

    /// Keeps a finished sequence's state; entries it extends are dropped (it serves them all).
    pub fn put(&mut self, ident: Vec<Identity>, state: SeqState) {
        if state.is_empty() || ident.len() != state.len() {
            return;
        }
        self.entries.retain(|e| !(e.ident.len() <= ident.len() && ident.starts_with(&e.ident)));
        while self.entries.len() >= MAX_ENTRIES {
            self.evict();
        }
        self.tick += 1;
        self.entries.push(Entry { ident, state, used: self.tick });
    }

    /// Drops the least recently used entry; false when there is none.
    pub fn evict(&mut self) -> bool {
        match self.entries.iter().enumerate().min_by_key(|(_, e)| e.used).map(|(i, _)| i) {
            Some(i) => {
                self.entries.swap_remove(i);
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::reusable;
    use crate::family::Identity;

    fn ids(pairs: &[(u32, u64)]) -> Vec<Identity> {
        pairs.iter().map(|&(token, media)| Identity { token, media }).collect()
    }

    #[test]
    fn reuse_stops_before_the_last_position_and_outside_media_runs() {
        let text = |t: &[u32]| t.iter().map(|&t| Identity::text(t)).collect::<Vec<_>>();
        assert_eq!(reusable(&text(&[1, 2, 3]), &text(&[1, 2, 3])), 2);
        assert_eq!(reusable(&text(&[1, 2, 3]), &text(&[1, 2, 4, 5])), 2);
        assert_eq!(reusable(&text(&[9]), &text(&[1, 2])), 0);
        // The cache ends inside an image's placeholder run (key 5): reuse stops before the run.
        let cached = ids(&[(1, 0), (7, 5), (7, 5)]);
        let prompt = ids(&[(1, 0), (7, 5), (7, 5), (7, 5), (2, 0)]);
        assert_eq!(reusable(&cached, &prompt), 1);
        // Another image at the same place shares only the text before it.
        let other = ids(&[(1, 0), (7, 6), (7, 6), (7, 6), (2, 0)]);
        assert_eq!(reusable(&prompt, &other), 1);
        assert_eq!(reusable(&prompt, &prompt), 4);
    }
}

#[cfg(test)]
mod message_end_tests {
    use super::{message_end, MESSAGE_SNAPSHOT_MIN as MIN};

    #[test]
    fn a_chunk_ends_at_the_last_message_end_past_the_minimum() {
        // End-of-turn id 7 at positions 9 and MIN + 20: the message ends after the last one.
        let mut prompt = vec![1u32; MIN + 30];
        prompt[9] = 7;
        prompt[MIN + 20] = 7;
        let b = MIN + 21;
        assert_eq!(message_end(&prompt, &[7], 0, prompt.len()), b);
        assert_eq!(message_end(&prompt, &[2, 7], 0, 50), 50, "past the chunk: the chunk's own end");
        assert_eq!(message_end(&prompt, &[7], b, prompt.len()), prompt.len(), "already there");
        assert_eq!(message_end(&prompt, &[7], 0, b), b, "the chunk ends there anyway");
        assert_eq!(message_end(&prompt, &[3], 0, prompt.len()), prompt.len(), "no end-of-turn token");
        // Under the minimum: no split.
        let mut short = vec![1u32; MIN];
        short[MIN - 5] = 7;
        assert_eq!(message_end(&short, &[7], 0, MIN), MIN);
    }
}
