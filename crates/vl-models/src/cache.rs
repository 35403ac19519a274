//! A map bounded by bytes, least recently used out first: the engine's feature cache and a
//! family's clip cache.

use std::collections::HashMap;

/// Values by key, least recently used out first past `limit` bytes (values larger than the limit
/// are not kept).
pub struct ByteLru<K, V> {
    limit: usize,
    bytes: usize,
    tick: u64,
    entries: HashMap<K, (V, usize, u64)>,
}

impl<K: std::hash::Hash + Eq + Copy, V: Clone> ByteLru<K, V> {
    pub fn new(limit: usize) -> Self {
        Self { limit, bytes: 0, tick: 0, entries: HashMap::new() }
    }

    pub fn get(&mut self, key: &K) -> Option<V> {
        self.tick += 1;
        let tick = self.tick;
        self.entries.get_mut(key).map(|e| {
            e.2 = tick;
            e.0.clone()
        })
    }

    pub fn contains(&self, key: &K) -> bool {
        self.entries.contains_key(key)
    }

    pub fn put(&mut self, key: K, value: V, size: usize) {
        if size > self.limit {
            return;
        }
        if let Some(e) = self.entries.remove(&key) {
            self.bytes -= e.1;
        }
        while self.bytes + size > self.limit {
            let Some((&old, _)) = self.entries.iter().min_by_key(|(_, e)| e.2) else { break };
            if let Some(e) = self.entries.remove(&old) {
                self.bytes -= e.1;
            }
        }
        self.tick += 1;
        self.bytes += size;
        self.entries.insert(key, (value, size, self.tick));
    }

    /// Takes the value of `key` out.
    pub fn remove(&mut self, key: &K) -> Option<V> {
        let (v, size, _) = self.entries.remove(key)?;
        self.bytes -= size;
        Some(v)
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}
