//! A sequence's KV cache, family-agnostic: one `KvCache` per decoder layer, and the position
//! offset where decoding continues.

use vl_nn::KvCache;

/// One cache per decoder layer, and where decoding continues.
#[derive(Debug, Clone, Default)]
pub struct SeqCache {
    pub layers: Vec<KvCache>,
    /// Where decoding continues: the next position is `len() + position_offset` (a family with
    /// multi-axis positions sets it at prefill; Qwen3-VL's M-RoPE `rope_delta`).
    pub position_offset: i64,
}

impl SeqCache {
    /// Cached positions (equal across layers).
    pub fn len(&self) -> usize {
        self.layers.first().map_or(0, KvCache::len)
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Allocated positions (a multiple of `vl_nn::kv_cache::BLOCK`).
    pub fn capacity(&self) -> usize {
        self.layers.first().map_or(0, KvCache::capacity)
    }
    pub fn bytes(&self) -> usize {
        self.layers.iter().map(KvCache::bytes).sum()
    }
    pub fn reset(&mut self) {
        self.layers.iter_mut().for_each(KvCache::reset);
    }
    /// Reserve room for `positions` in total (see `KvCache::reserve`).
    pub fn reserve(&mut self, positions: usize) {
        self.layers.iter_mut().for_each(|c| c.reserve(positions));
    }
    pub fn truncate(&mut self, len: usize) {
        self.layers.iter_mut().for_each(|c| c.truncate(len));
    }
}
