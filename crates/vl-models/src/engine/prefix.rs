//! Kept prefixes: the KV caches of finished sequences, by what their positions hold, so that a
//! conversation's next turn (or any prompt sharing a start with one) prefills only the rest.
//! Many conversations are kept at once; the engine evicts the least recently used when running
//! sequences need the memory.

use crate::error::Result;
use crate::family::Identity;
use crate::kv::SeqCache;

/// Kept prefixes at most, whatever their size (each is matched against every new prompt).
const MAX_ENTRIES: usize = 256;

struct Entry {
    ident: Vec<Identity>,
    cache: SeqCache,
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
    while common > 0 && ident[common].1 != 0 && ident[common - 1] == ident[common] {
        common -= 1;
    }
    common
}

impl PrefixStore {
    pub fn bytes(&self) -> usize {
        self.entries.iter().map(|e| e.cache.bytes()).sum()
    }

    pub fn positions(&self) -> usize {
        self.entries.iter().map(|e| e.cache.len()).sum()
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// The cache that serves the most of `ident`, with the positions it serves: the entry itself
    /// when all of it is used (the conversation goes on), else a copy of the prefix (the entry
    /// stays for its own conversation).
    pub fn take(&mut self, ident: &[Identity]) -> Result<Option<(SeqCache, usize)>> {
        let best = self.entries.iter().enumerate().map(|(i, e)| (reusable(&e.ident, ident), i)).max();
        let Some((common, i)) = best.filter(|&(c, _)| c > 0) else { return Ok(None) };
        self.tick += 1;
        if common == self.entries[i].ident.len() {
            let e = self.entries.swap_remove(i);
            return Ok(Some((e.cache, common)));
        }
        let e = &mut self.entries[i];
        e.used = self.tick;
        let layers = e.cache.layers.iter().map(|l| l.copy_prefix(common)).collect::<vl_nn::Result<Vec<_>>>()?;
        Ok(Some((SeqCache { layers, position_offset: e.cache.position_offset }, common)))
    }

    /// Keeps a finished sequence's cache; entries it extends are dropped (it serves them all).
    pub fn put(&mut self, ident: Vec<Identity>, mut cache: SeqCache) {
        if cache.is_empty() || ident.len() != cache.len() {
            return;
        }
        cache.truncate(ident.len());
        self.entries.retain(|e| !(e.ident.len() <= ident.len() && ident.starts_with(&e.ident)));
        while self.entries.len() >= MAX_ENTRIES {
            self.evict();
        }
        self.tick += 1;
        self.entries.push(Entry { ident, cache, used: self.tick });
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

    #[test]
    fn reuse_stops_before_the_last_position_and_outside_media_runs() {
        let text = |ids: &[u32]| ids.iter().map(|&t| (t, 0)).collect::<Vec<_>>();
        assert_eq!(reusable(&text(&[1, 2, 3]), &text(&[1, 2, 3])), 2);
        assert_eq!(reusable(&text(&[1, 2, 3]), &text(&[1, 2, 4, 5])), 2);
        assert_eq!(reusable(&text(&[9]), &text(&[1, 2])), 0);
        // The cache ends inside an image's placeholder run (key 5): reuse stops before the run.
        let cached = vec![(1, 0), (7, 5), (7, 5)];
        let prompt = vec![(1, 0), (7, 5), (7, 5), (7, 5), (2, 0)];
        assert_eq!(reusable(&cached, &prompt), 1);
        // Another image at the same place shares only the text before it.
        let other = vec![(1, 0), (7, 6), (7, 6), (7, 6), (2, 0)];
        assert_eq!(reusable(&prompt, &other), 1);
        assert_eq!(reusable(&prompt, &prompt), 4);
    }
}
