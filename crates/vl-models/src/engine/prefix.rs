//! Kept prefixes: the KV caches of finished sequences, by what their positions hold, so that a
//! conversation's next turn (or any prompt sharing a start with one) prefills only the rest.
//! Many conversations are kept at once; the engine evicts the least recently used when running
//! sequences need the memory.

use crate::error::Result;
use crate::family::Identity;
use crate::state::SeqState;

/// Kept prefixes at most, whatever their size (each is matched against every new prompt).
const MAX_ENTRIES: usize = 256;

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
