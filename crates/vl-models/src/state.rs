//! A sequence's state, family-agnostic: what each decoder layer keeps between steps (an
//! attention layer's KV cache, or a recurrent layer's fixed-size state) and where decoding
//! continues. The scheduler holds it without looking inside: it grows it by blocks, counts its
//! bytes against the budget, keeps and restores reusable prefixes (truncation for KV, snapshots
//! for recurrent state), forks it for `n` and releases it, through the methods here. A family
//! reads and writes its layers (`kv_mut`, `recurrent_mut`).

use candle_core::Tensor;
use vl_nn::KvCache;

use crate::error::{Error, Result};

/// Snapshots a recurrent layer keeps at most (the oldest go first): each is a full copy of the
/// layer's state, so a conversation keeps the points a later prompt is likely to share (the end
/// of each prefilled chunk and of the prompt), not every position.
pub const MAX_SNAPSHOTS: usize = 8;

/// A recurrent layer's state: fixed-size tensors after `len` positions (for a gated delta rule,
/// the state matrix and the short convolution's window), and earlier states kept so that a
/// shorter prefix can be restored.
#[derive(Debug, Clone, Default)]
pub struct Recurrent {
    /// The state after `len` positions; empty before the first. A step replaces these tensors
    /// (`set`), never writes into them: snapshots and forks share them.
    pub tensors: Vec<Tensor>,
    len: usize,
    /// (position, state after it), ascending, at most `MAX_SNAPSHOTS`.
    snapshots: Vec<(usize, Vec<Tensor>)>,
    /// (position, state after it) within the last pass (drafted tokens verified together),
    /// ascending: the points that pass may be taken back to. Replaced by each step.
    trail: Vec<(usize, Vec<Tensor>)>,
}

impl Recurrent {
    /// Positions the state has consumed.
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The state after `len` positions (a family's step sets it).
    pub fn set(&mut self, tensors: Vec<Tensor>, len: usize) {
        self.tensors = tensors;
        self.len = len;
        self.trail.clear();
    }
    /// `set`, with the states after earlier positions of the same pass (`trail`: (position,
    /// state), ascending, before `len`) that it may be taken back to.
    pub fn set_with_trail(&mut self, tensors: Vec<Tensor>, len: usize, trail: Vec<(usize, Vec<Tensor>)>) {
        self.set(tensors, len);
        self.trail = trail;
    }
    fn bytes(&self) -> usize {
        let size = |ts: &[Tensor]| ts.iter().map(|t| t.elem_count() * t.dtype().size_in_bytes()).sum::<usize>();
        size(&self.tensors) + self.snapshots.iter().chain(&self.trail).map(|(_, s)| size(s)).sum::<usize>()
    }
    /// Keeps the current state as a point to restore (nothing before the first position).
    fn snapshot(&mut self) {
        if self.len == 0 || self.snapshots.last().is_some_and(|(p, _)| *p == self.len) {
            return;
        }
        self.snapshots.retain(|(p, _)| *p < self.len);
        if self.snapshots.len() == MAX_SNAPSHOTS {
            self.snapshots.remove(0);
        }
        self.snapshots.push((self.len, self.tensors.clone()));
    }
    /// Whether the state at `len` can be had: the current one, a snapshot, or the empty start.
    fn can_restore(&self, len: usize) -> bool {
        len == 0 || len == self.len || self.snapshots.iter().chain(&self.trail).any(|(p, _)| *p == len)
    }
    /// The state at `len` (see `can_restore`); later snapshots are dropped.
    fn restored(&self, len: usize) -> Option<Recurrent> {
        let tensors = if len == 0 {
            vec![]
        } else if len == self.len {
            self.tensors.clone()
        } else {
            self.snapshots.iter().chain(&self.trail).find(|(p, _)| *p == len)?.1.clone()
        };
        let snapshots = self.snapshots.iter().filter(|(p, _)| *p <= len).cloned().collect();
        Some(Recurrent { tensors, len, snapshots, trail: vec![] })
    }
}

/// A state's position and recurrent layers' tensors at one point (`SeqState::checkpoint`).
#[derive(Debug, Clone)]
pub struct Checkpoint {
    len: usize,
    /// Per layer: a recurrent layer's tensors, None for an attention layer.
    recurrent: Vec<Option<Vec<Tensor>>>,
}

/// What one decoder layer keeps between steps.
#[derive(Debug, Clone)]
pub enum LayerState {
    /// Attention keys and values, one row per position.
    Kv(KvCache),
    /// A recurrent layer's fixed-size state.
    Recurrent(Recurrent),
}

impl LayerState {
    fn len(&self) -> usize {
        match self {
            LayerState::Kv(c) => c.len(),
            LayerState::Recurrent(r) => r.len(),
        }
    }
    fn bytes(&self) -> usize {
        match self {
            LayerState::Kv(c) => c.bytes(),
            LayerState::Recurrent(r) => r.bytes(),
        }
    }
}

/// Final hidden rows kept at most per sequence (`SeqState::keep_hidden`): a draft head reads
/// them at the end of each prefill chunk and each decode step, so a sequence holds a chunk's
/// worth; past this the oldest go (its head then starts later).
pub const MAX_HIDDEN_ROWS: usize = 8192;

/// The model's final hidden rows of recent positions, for a draft head that reads them
/// (Qwen3.5's multi-token prediction): rows of positions `start..start + n`, with the positions
/// (one per rotary axis) the model ran them at.
#[derive(Debug, Clone)]
struct Hidden {
    start: usize,
    rows: Tensor,
    positions: Vec<[i64; 3]>,
}

/// One sequence's state: a `LayerState` per decoder layer, and where decoding continues.
#[derive(Debug, Clone, Default)]
pub struct SeqState {
    layers: Vec<LayerState>,
    /// Where decoding continues: the next position is `len() + position_offset` (a family with
    /// multi-axis positions sets it at prefill; Qwen3-VL's M-RoPE `rope_delta`).
    pub position_offset: i64,
    /// Whether the family records its final hidden rows here (`record_hidden`).
    keep_hidden: bool,
    hidden: Option<Hidden>,
}

impl SeqState {
    /// A state of these layers, empty.
    pub fn new(layers: Vec<LayerState>) -> Self {
        Self { layers, position_offset: 0, keep_hidden: false, hidden: None }
    }
    /// `n` attention layers, empty.
    pub fn kv(n: usize) -> Self {
        Self::new(vec![LayerState::Kv(KvCache::new()); n])
    }
    /// `n` attention layers, empty, keeping their rows in `dtype` (`KvCache::in_dtype`).
    pub fn kv_in(n: usize, dtype: candle_core::DType) -> Self {
        Self::new(vec![LayerState::Kv(KvCache::in_dtype(dtype)); n])
    }
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }
    /// Layer `i`'s KV cache; an error names the layer when it is not an attention layer.
    pub fn kv_mut(&mut self, i: usize) -> Result<&mut KvCache> {
        match self.layers.get_mut(i) {
            Some(LayerState::Kv(c)) => Ok(c),
            _ => Err(layer_error(i, "an attention layer's KV cache")),
        }
    }
    /// Layer `i`'s recurrent state; an error names the layer when it is not a recurrent layer.
    pub fn recurrent_mut(&mut self, i: usize) -> Result<&mut Recurrent> {
        match self.layers.get_mut(i) {
            Some(LayerState::Recurrent(r)) => Ok(r),
            _ => Err(layer_error(i, "a recurrent layer's state")),
        }
    }
    /// Positions the state holds (equal across layers).
    pub fn len(&self) -> usize {
        self.layers.first().map_or(0, LayerState::len)
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Positions it holds without growing: the KV caches' allocation (a multiple of
    /// `vl_nn::kv_cache::BLOCK`); unbounded for a state of recurrent layers only.
    pub fn capacity(&self) -> usize {
        self.layers
            .iter()
            .filter_map(|l| match l {
                LayerState::Kv(c) => Some(c.capacity()),
                LayerState::Recurrent(_) => None,
            })
            .min()
            .unwrap_or(usize::MAX)
    }
    /// Bytes held: KV rows allocated, recurrent states and their snapshots, kept hidden rows.
    pub fn bytes(&self) -> usize {
        let hidden = self.hidden.as_ref().map_or(0, |h| h.rows.elem_count() * h.rows.dtype().size_in_bytes());
        self.layers.iter().map(LayerState::bytes).sum::<usize>() + hidden
    }
    /// Asks the family to record its final hidden rows (`record_hidden`) from now on, for a
    /// draft head; off drops what is kept.
    pub fn keep_hidden(&mut self, on: bool) {
        self.keep_hidden = on;
        if !on {
            self.hidden = None;
        }
    }
    pub fn keeps_hidden(&self) -> bool {
        self.keep_hidden
    }
    /// A family's forward pass records its final hidden rows `rows` ([n, hidden]) of positions
    /// `start..start + n`, run at `positions`, when asked (`keep_hidden`); they replace kept
    /// rows from `start` on. At most `MAX_HIDDEN_ROWS` are kept, the latest.
    pub fn record_hidden(&mut self, start: usize, rows: &Tensor, positions: &[[i64; 3]]) -> Result<()> {
        if !self.keep_hidden {
            return Ok(());
        }
        let n = rows.dim(0)?;
        if n != positions.len() {
            return Err(Error::Internal { message: format!("{n} hidden rows for {} positions", positions.len()) });
        }
        let mut next = match self.hidden.take() {
            Some(h) if start > h.start && start <= h.start + h.positions.len() => {
                let keep = start - h.start;
                let mut all = h.positions[..keep].to_vec();
                all.extend_from_slice(positions);
                Hidden { start: h.start, rows: Tensor::cat(&[&h.rows.narrow(0, 0, keep)?, rows], 0)?, positions: all }
            }
            _ => Hidden { start, rows: rows.clone(), positions: positions.to_vec() },
        };
        let over = next.positions.len().saturating_sub(MAX_HIDDEN_ROWS);
        if over > 0 {
            next.rows = next.rows.narrow(0, over, MAX_HIDDEN_ROWS)?;
            next.positions.drain(..over);
            next.start += over;
        }
        self.hidden = Some(next);
        Ok(())
    }
    /// The positions whose hidden rows are kept: `start..end` (empty when none).
    pub fn hidden_span(&self) -> std::ops::Range<usize> {
        self.hidden.as_ref().map_or(0..0, |h| h.start..h.start + h.positions.len())
    }
    /// The kept hidden rows of positions `from..to` (within `hidden_span`) and their positions.
    pub fn hidden_rows(&self, from: usize, to: usize) -> Result<(Tensor, Vec<[i64; 3]>)> {
        let span = self.hidden_span();
        let h = self
            .hidden
            .as_ref()
            .filter(|_| span.start <= from && from < to && to <= span.end)
            .ok_or_else(|| Error::Internal { message: format!("hidden rows {from}..{to} asked, {span:?} kept") })?;
        let (a, b) = (from - h.start, to - h.start);
        Ok((h.rows.narrow(0, a, b - a)?, h.positions[a..b].to_vec()))
    }
    /// Drops the kept hidden rows of positions before `pos` (a draft head has read them).
    pub fn forget_hidden_before(&mut self, pos: usize) -> Result<()> {
        let Some(h) = self.hidden.as_mut() else { return Ok(()) };
        let drop = pos.saturating_sub(h.start).min(h.positions.len());
        if drop == h.positions.len() {
            self.hidden = None;
        } else if drop > 0 {
            // A copy, so that the rows read go with their storage.
            h.rows = h.rows.narrow(0, drop, h.positions.len() - drop)?.contiguous()?.copy()?;
            h.positions.drain(..drop);
            h.start += drop;
        }
        Ok(())
    }

    /// Grows the KV caches to room for `positions` in all, by whole blocks.
    pub fn reserve(&mut self, positions: usize) {
        for l in &mut self.layers {
            if let LayerState::Kv(c) = l {
                c.reserve(positions);
            }
        }
    }
    /// Keeps the current position as one a later prefix may restore: a snapshot of each
    /// recurrent layer (KV layers can be cut anywhere already).
    pub fn mark(&mut self) {
        for l in &mut self.layers {
            if let LayerState::Recurrent(r) = l {
                r.snapshot();
            }
        }
    }
    /// The longest prefix of at most `len` positions this state can be brought back to: `len`
    /// when every layer is attention; else the latest position every recurrent layer kept
    /// (`mark`), or 0.
    pub fn restorable(&self, len: usize) -> usize {
        let len = len.min(self.len());
        (0..=len)
            .rev()
            .find(|&p| {
                self.layers.iter().all(|l| match l {
                    LayerState::Kv(_) => true,
                    LayerState::Recurrent(r) => r.can_restore(p),
                })
            })
            .unwrap_or(0)
    }
    /// A copy of the first `len` positions (`restorable(len) == len`), its KV rows copied into
    /// fresh blocks; the source is left as it is.
    pub fn copy_prefix(&self, len: usize) -> Result<SeqState> {
        let layers = self
            .layers
            .iter()
            .enumerate()
            .map(|(i, l)| {
                Ok(match l {
                    LayerState::Kv(c) => LayerState::Kv(c.copy_prefix(len)?),
                    LayerState::Recurrent(r) => LayerState::Recurrent(
                        r.restored(len).ok_or_else(|| layer_error(i, &format!("a state kept at position {len}")))?,
                    ),
                })
            })
            .collect::<Result<_>>()?;
        // Kept hidden rows of the positions copied (a fork's head drafts from them).
        let hidden = self.hidden.as_ref().and_then(|h| {
            let n = len.saturating_sub(h.start).min(h.positions.len());
            let rows = h.rows.narrow(0, 0, n).ok()?;
            (n > 0).then(|| Hidden { start: h.start, rows, positions: h.positions[..n].to_vec() })
        });
        Ok(SeqState { layers, position_offset: self.position_offset, keep_hidden: self.keep_hidden, hidden })
    }
    /// A copy of all of it (a choice forked from one prefill).
    pub fn fork(&self) -> Result<SeqState> {
        self.copy_prefix(self.len())
    }
    /// Cuts it back to its first `len` positions (`restorable(len) == len`).
    pub fn rewind(&mut self, len: usize) -> Result<()> {
        if self.restorable(len) != len {
            return Err(Error::Internal {
                message: format!("a sequence's state cannot be brought back to position {len}"),
            });
        }
        for (i, l) in self.layers.iter_mut().enumerate() {
            match l {
                LayerState::Kv(c) => c.truncate(len),
                LayerState::Recurrent(r) => {
                    *r = r.restored(len).ok_or_else(|| layer_error(i, &format!("a state kept at position {len}")))?
                }
            }
        }
        Ok(())
    }
    /// Whether any layer is recurrent (its state cannot be cut back to any position).
    pub fn has_recurrent(&self) -> bool {
        self.layers.iter().any(|l| matches!(l, LayerState::Recurrent(_)))
    }
    /// Where it stands now, to come back to after positions that may be taken back (drafted
    /// tokens being verified): the recurrent layers' states (shared tensors, no copy).
    pub fn checkpoint(&self) -> Checkpoint {
        let recurrent = self
            .layers
            .iter()
            .map(|l| match l {
                LayerState::Recurrent(r) => Some(r.tensors.clone()),
                LayerState::Kv(_) => None,
            })
            .collect();
        Checkpoint { len: self.len(), recurrent }
    }
    /// Takes back positions past `len`: exactly to `len` where every layer can be cut there
    /// (`restorable`), else to `checkpoint` (taken at `len` or before, this state grown from it
    /// since). Returns the positions it holds after; the caller feeds the rest again.
    pub fn take_back(&mut self, len: usize, checkpoint: Option<&Checkpoint>) -> Result<usize> {
        if self.len() <= len {
            return Ok(self.len());
        }
        if self.restorable(len) == len {
            self.rewind(len)?;
            return Ok(len);
        }
        let Some(cp) = checkpoint.filter(|c| c.len <= len && c.recurrent.len() == self.layers.len()) else {
            return Err(Error::Internal {
                message: format!("a sequence's state cannot be brought back to position {len}"),
            });
        };
        for (l, saved) in self.layers.iter_mut().zip(&cp.recurrent) {
            match (l, saved) {
                (LayerState::Kv(c), None) => c.truncate(cp.len),
                (LayerState::Recurrent(r), Some(t)) => {
                    r.snapshots.retain(|(p, _)| *p <= cp.len);
                    r.set(t.clone(), cp.len);
                }
                _ => return Err(Error::Internal { message: "a checkpoint of another state".into() }),
            }
        }
        Ok(cp.len)
    }
    /// Empties every layer, keeping nothing.
    pub fn release(&mut self) {
        self.hidden = None;
        for l in &mut self.layers {
            match l {
                LayerState::Kv(c) => c.reset(),
                LayerState::Recurrent(r) => *r = Recurrent::default(),
            }
        }
    }
}

fn layer_error(i: usize, wanted: &str) -> Error {
    Error::Internal { message: format!("decoder layer {i} holds no {wanted}") }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    fn value(t: &Tensor) -> f32 {
        t.to_vec1::<f32>().unwrap()[0]
    }

    /// A recurrent layer whose state is the running sum of the inputs, beside a KV layer.
    fn step(s: &mut SeqState, x: f32) {
        let len = s.len() + 1;
        let r = s.recurrent_mut(1).unwrap();
        let sum = r.tensors.first().map_or(0.0, value) + x;
        r.set(vec![Tensor::new(&[sum], &Device::Cpu).unwrap()], len);
        let k = Tensor::new(&[[[x]]], &Device::Cpu).unwrap();
        s.kv_mut(0).unwrap().append(&k, &k).unwrap();
    }

    #[test]
    fn recurrent_prefixes_come_back_from_snapshots_and_kv_from_truncation() {
        let mut s = SeqState::new(vec![LayerState::Kv(KvCache::new()), LayerState::Recurrent(Recurrent::default())]);
        s.reserve(4);
        for (i, x) in [1.0, 2.0, 4.0, 8.0].into_iter().enumerate() {
            step(&mut s, x);
            if i == 1 {
                s.mark();
            }
        }
        assert_eq!(s.len(), 4);
        assert!(s.kv_mut(1).is_err() && s.recurrent_mut(0).is_err());
        // Position 2 was kept; 3 was not: the longest restorable prefix of 3 is 2.
        assert_eq!(s.restorable(3), 2);
        assert_eq!(s.restorable(4), 4);
        assert_eq!(s.restorable(1), 0);
        let copy = s.copy_prefix(2).unwrap();
        assert_eq!(copy.len(), 2);
        let mut copy = copy;
        assert_eq!(value(&copy.recurrent_mut(1).unwrap().tensors[0]), 3.0);
        // The source is unchanged; a fork holds everything.
        let mut fork = s.fork().unwrap();
        assert_eq!(value(&fork.recurrent_mut(1).unwrap().tensors[0]), 15.0);
        assert!(s.copy_prefix(3).is_err());
        assert!(s.rewind(3).is_err());
        s.rewind(2).unwrap();
        assert_eq!(s.len(), 2);
        assert_eq!(value(&s.recurrent_mut(1).unwrap().tensors[0]), 3.0);
        step(&mut s, 16.0);
        assert_eq!(value(&s.recurrent_mut(1).unwrap().tensors[0]), 19.0);
        assert!(s.bytes() > 0);
        s.release();
        assert_eq!((s.len(), s.restorable(5)), (0, 0));
    }

    #[test]
    fn snapshots_are_bounded_and_a_kv_state_cuts_anywhere() {
        let mut r = Recurrent::default();
        for len in 1..=20 {
            r.set(vec![Tensor::new(&[len as f32], &Device::Cpu).unwrap()], len);
            r.snapshot();
        }
        assert_eq!(r.snapshots.len(), MAX_SNAPSHOTS);
        assert_eq!(r.snapshots[0].0, 20 - MAX_SNAPSHOTS + 1);
        let kv = SeqState::kv(3);
        assert_eq!((kv.num_layers(), kv.restorable(7), kv.capacity()), (3, 0, 0));
        let only_recurrent = SeqState::new(vec![LayerState::Recurrent(Recurrent::default())]);
        assert_eq!(only_recurrent.capacity(), usize::MAX);
    }

    #[test]
    fn drafted_positions_are_taken_back_by_truncation_or_to_the_checkpoint() {
        // Attention only: cut back to any position, no checkpoint needed.
        let mut kv = SeqState::kv(1);
        for x in [1.0, 2.0, 3.0] {
            let k = Tensor::new(&[[[x]]], &Device::Cpu).unwrap();
            kv.kv_mut(0).unwrap().append(&k, &k).unwrap();
        }
        assert!(!kv.has_recurrent());
        assert_eq!(kv.take_back(1, None).unwrap(), 1);
        // A recurrent layer: back to the checkpoint, the accepted positions to be fed again.
        let mut s = SeqState::new(vec![LayerState::Kv(KvCache::new()), LayerState::Recurrent(Recurrent::default())]);
        step(&mut s, 1.0);
        step(&mut s, 2.0);
        let cp = s.checkpoint();
        for x in [4.0, 8.0, 16.0] {
            step(&mut s, x);
        }
        assert_eq!(s.len(), 5);
        assert!(s.take_back(4, None).is_err(), "no snapshot at 4 and no checkpoint");
        assert_eq!(s.take_back(4, Some(&cp)).unwrap(), 2);
        assert_eq!(s.len(), 2);
        assert_eq!(value(&s.recurrent_mut(1).unwrap().tensors[0]), 3.0);
        step(&mut s, 4.0);
        assert_eq!(value(&s.recurrent_mut(1).unwrap().tensors[0]), 7.0);
        // Its current length: nothing to take back.
        assert_eq!(s.take_back(3, Some(&cp)).unwrap(), 3);
        // A pass that kept the states after its rows (`set_with_trail`: drafted tokens verified
        // together) is taken back to any of them exactly, without a checkpoint.
        let base = value(&s.recurrent_mut(1).unwrap().tensors[0]);
        let len = s.len();
        let t = |x: f32| vec![Tensor::new(&[x], &Device::Cpu).unwrap()];
        let trail = vec![(len + 1, t(base + 1.0)), (len + 2, t(base + 3.0))];
        s.recurrent_mut(1).unwrap().set_with_trail(t(base + 7.0), len + 3, trail);
        for x in [1f32, 2.0, 4.0] {
            let k = Tensor::new(&[[[x]]], &Device::Cpu).unwrap();
            s.kv_mut(0).unwrap().append(&k, &k).unwrap();
        }
        assert_eq!(s.restorable(len + 2), len + 2);
        assert_eq!(s.take_back(len + 2, None).unwrap(), len + 2);
        assert_eq!(value(&s.recurrent_mut(1).unwrap().tensors[0]), base + 3.0);
        assert_eq!(s.restorable(len + 1), 0, "the trail goes with the step taken back");
        // A checkpoint later than the position asked for cannot serve.
        step(&mut s, 1.0);
        let late = s.checkpoint();
        step(&mut s, 1.0);
        assert!(s.take_back(2, Some(&late)).is_err());
    }

    #[test]
    fn kept_hidden_rows_are_replaced_from_where_a_pass_starts_and_forgotten_once_read() {
        let rows = |from: usize, to: usize| {
            let v: Vec<f32> = (from..to).map(|p| p as f32).collect();
            (
                Tensor::from_vec(v, (to - from, 1), &Device::Cpu).unwrap(),
                (from..to).map(|p| [p as i64; 3]).collect::<Vec<_>>(),
            )
        };
        let values = |s: &SeqState, a: usize, b: usize| {
            s.hidden_rows(a, b).unwrap().0.flatten_all().unwrap().to_vec1::<f32>().unwrap()
        };
        let mut s = SeqState::kv(1);
        let (r, p) = rows(0, 4);
        s.record_hidden(0, &r, &p).unwrap();
        assert_eq!(s.hidden_span(), 0..0, "not asked to keep them");
        s.keep_hidden(true);
        s.record_hidden(0, &r, &p).unwrap();
        // A later pass from position 2 (rows taken back) replaces rows 2.. and appends.
        let (r, p) = rows(2, 6);
        s.record_hidden(2, &(r + 10.0).unwrap(), &p).unwrap();
        assert_eq!(s.hidden_span(), 0..6);
        assert_eq!(values(&s, 1, 4), vec![1.0, 12.0, 13.0]);
        assert!(s.hidden_rows(3, 7).is_err());
        s.forget_hidden_before(3).unwrap();
        assert_eq!(s.hidden_span(), 3..6);
        // A fork keeps the rows of the positions it copies.
        let fork = s.copy_prefix(0).unwrap();
        assert!(fork.keeps_hidden());
        assert_eq!(fork.hidden_span(), 0..0);
        // A pass that leaves a gap starts the rows anew.
        let (r, p) = rows(9, 10);
        s.record_hidden(9, &r, &p).unwrap();
        assert_eq!(s.hidden_span(), 9..10);
        // At most MAX_HIDDEN_ROWS, the latest.
        let (r, p) = rows(10, 10 + MAX_HIDDEN_ROWS);
        s.record_hidden(10, &r, &p).unwrap();
        assert_eq!(s.hidden_span(), 10..10 + MAX_HIDDEN_ROWS);
        assert!(s.bytes() >= MAX_HIDDEN_ROWS * 4);
        s.keep_hidden(false);
        assert_eq!((s.hidden_span(), s.bytes()), (0..0, 0));
    }
}
