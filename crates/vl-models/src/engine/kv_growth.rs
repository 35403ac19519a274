//! How the scheduler makes KV room for a decode step (a child of `scheduler`): each full cache
//! grows by a step in proportion to its length, or by one block, or another sequence is
//! preempted.

use vl_nn::kv_cache::{growth, BLOCK};

use super::super::sequence::Phase;
use super::super::Finish;
use super::Scheduler;
use crate::state::SeqState;

impl<'f> Scheduler<'f> {
    /// Makes room for one more position in each decoding sequence's cache, preempting the most
    /// recently admitted other sequences when the budget is spent.
    pub(super) fn grow_caches(&mut self) {
        let mut i = 0;
        while i < self.running.len() {
            let s = &self.running[i];
            // Only a sequence fed this step needs room: one waiting for its mask or its caller
            // grows (or preempts another) when it has a token to feed.
            if s.phase != Phase::Decode || s.pending.is_none() || s.paused() || s.state.len() < s.state.capacity() {
                i += 1;
                continue;
            }
            let (me, len) = (s.admitted, s.state.len());
            // A step in proportion to the length where the budget has room without evicting a
            // kept prefix (the cache is copied whole when it grows), else one block.
            let step = growth(len);
            let stepped = self.used() + step * self.per_position <= self.budget();
            if stepped {
                self.running[i].state.reserve(len + step);
            }
            // Without a step reserved the cache grows by one block.
            if stepped || self.make_room(BLOCK * self.per_position) {
                i += 1;
                continue;
            }
            let victim = self
                .running
                .iter()
                .enumerate()
                .filter(|(_, o)| o.admitted != me)
                .max_by_key(|(_, o)| o.admitted)
                .map(|(j, _)| j);
            match victim {
                Some(j) => {
                    let mut v = self.running.remove(j);
                    v.state = SeqState::default();
                    v.draft = None;
                    v.head = None;
                    v.verified.clear();
                    v.checkpoint = None;
                    v.reserved = 0;
                    v.phase = Phase::Waiting;
                    self.waiting.push_front(v);
                    self.preemptions += 1;
                    if j < i {
                        i -= 1;
                    }
                }
                None => {
                    let seq = self.running.remove(i);
                    self.finish(seq, Finish::ContextFull);
                }
            }
        }
    }
}
