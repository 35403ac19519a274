//! Drafts from the model's own head (`speculative: mtp`, Qwen3.5's multi-token prediction): the
//! head reads the model's final hidden row at each position with the token after it, and its
//! greedy picks are verified by the model in one forward pass like any draft (the answer is the
//! model's own, token for token).
//!
//! A sequence drafting with the head keeps its model state's final hidden rows
//! (`SeqState::keep_hidden`). The head's own state (one attention layer) holds an entry per
//! position p whose next token is known: entries `start..start + len`.
//! - After each prefill chunk it catches up with the chunk's rows (the last position waits for
//!   the token after it), as vLLM's proposer runs the head over the prompt.
//! - At a decode step, one pass catches up the positions the last verification kept (their
//!   rows were recorded by that forward pass) up to the pending token's; its last row's pick is
//!   the first draft. The forced tokens and each further draft are fed one pass each, with the
//!   head's own output row as the hidden row, one position on.
//! - Those drafting entries are cut back at once: the head holds only entries of known tokens.
//!
//! A gap in the kept rows (a prefix restored from the cache, a preempted sequence prefilled
//! again, rows past `MAX_HIDDEN_ROWS`) restarts the head at the first kept row: its attention
//! then sees fewer positions, which changes its drafts, never the answer.

use candle_core::Tensor;

use super::draft::take;
use crate::error::Result;
use crate::family::DraftHead;
use crate::state::SeqState;

/// A sequence's head state and the first position it holds an entry for.
pub(super) struct HeadSeq {
    pub state: SeqState,
    pub start: usize,
}

impl HeadSeq {
    pub fn new(h: &dyn DraftHead) -> Self {
        Self { state: h.new_state(), start: 0 }
    }
    /// Positions it has entries up to.
    fn covered(&self) -> usize {
        self.start + self.state.len()
    }
}

/// One sequence's drafting (or catching up, `want` 0) this step.
pub(super) struct Work<'a> {
    pub head: &'a mut HeadSeq,
    /// The model's state, whose kept hidden rows it reads (and forgets once read).
    pub model: &'a mut SeqState,
    /// The sequence's tokens, then its pending token when it has one.
    pub tokens: Vec<u32>,
    /// Tokens fed after the pending one before drafting (forced ones, other drafts).
    pub forced: Vec<u32>,
    pub want: usize,
}

/// What one sequence feeds in the catch-up pass.
struct Rows {
    from: usize,
    to: usize,
}

/// Catches each sequence's head up with the rows its model kept, and drafts up to `want` tokens
/// after the pending one and `forced` for those that want some: greedy picks, batched, one
/// pass per draft. A sequence stops at `want`, before an end-of-answer token or one the model
/// has no row for (`vocab`). Returns each sequence's drafts.
pub(super) fn propose(h: &dyn DraftHead, vocab: usize, eos: &[u32], mut work: Vec<Work<'_>>) -> Result<Vec<Vec<u32>>> {
    let mut out: Vec<Vec<u32>> = vec![Vec::new(); work.len()];
    // The catch-up pass: per sequence, entries [covered, target) where the hidden row and the
    // token after it are known.
    let mut plan: Vec<Option<Rows>> = Vec::with_capacity(work.len());
    for w in &mut work {
        let span = w.model.hidden_span();
        let target = span.end.min(w.tokens.len().saturating_sub(1));
        if span.is_empty() || target <= span.start {
            plan.push(None);
            continue;
        }
        if w.head.covered() < span.start || w.head.covered() > target {
            w.head.state.release();
            w.head.start = span.start;
        }
        if w.head.covered() == target && w.want > 0 {
            // Its last entry's output is needed again: computed anew.
            let len = w.head.state.len();
            if len == 0 || target - 1 < span.start {
                plan.push(None);
                continue;
            }
            w.head.state.take_back(len - 1, None)?;
        }
        let from = w.head.covered();
        plan.push((from < target).then_some(Rows { from, to: target }));
    }
    let who: Vec<usize> = (0..work.len()).filter(|&i| plan[i].is_some()).collect();
    if who.is_empty() {
        return Ok(out);
    }
    let mut tokens = Vec::new();
    let mut hidden = Vec::new();
    let mut positions = Vec::new();
    let mut lens = Vec::new();
    let mut picks = Vec::new();
    for &i in &who {
        let r = plan[i].as_ref().expect("planned");
        let w = &work[i];
        let (rows, pos) = w.model.hidden_rows(r.from, r.to)?;
        tokens.extend_from_slice(&w.tokens[r.from + 1..=r.to]);
        hidden.push(rows);
        positions.extend(pos);
        lens.push(r.to - r.from);
        if w.want > 0 && r.to + 1 == w.tokens.len() && w.forced.is_empty() {
            picks.push(tokens.len() as u32 - 1);
        }
    }
    let last_rows: Vec<usize> = lens
        .iter()
        .scan(0, |at, &n| {
            *at += n;
            Some(*at - 1)
        })
        .collect();
    let hidden = Tensor::cat(&hidden, 0)?;
    let (outputs, logits) = {
        let mut states: Vec<&mut SeqState> =
            work.iter_mut().enumerate().filter(|(i, _)| plan[*i].is_some()).map(|(_, w)| &mut w.head.state).collect();
        h.forward(&tokens, &hidden, &positions, &mut states, &lens, &picks)?
    };
    // Where the catch-up stopped, and what is known after it.
    let mut caught = vec![0usize; work.len()];
    for &i in &who {
        caught[i] = plan[i].as_ref().expect("planned").to;
    }
    // Per drafting sequence: its last output row, its last position, what it feeds next.
    struct Chain {
        i: usize,
        row: Tensor,
        position: [i64; 3],
        next: u32,
        forced_at: usize,
    }
    let mut chains: Vec<Chain> = Vec::new();
    let picked = argmax_rows(&logits)?;
    let mut p = picked.into_iter();
    for (k, &i) in who.iter().enumerate() {
        let w = &work[i];
        let r = plan[i].as_ref().expect("planned");
        if w.want == 0 || r.to + 1 != w.tokens.len() {
            continue;
        }
        let row = outputs.narrow(0, last_rows[k], 1)?;
        let position = positions[last_rows[k]];
        if let Some(&f) = w.forced.first() {
            chains.push(Chain { i, row, position, next: f, forced_at: 1 });
        } else {
            let t = p.next().expect("a pick per drafting sequence");
            if take(&mut out[i], t, w.want, vocab, eos) {
                chains.push(Chain { i, row, position, next: t, forced_at: w.forced.len() });
            }
        }
    }
    // Further passes: one row per sequence still drafting.
    while !chains.is_empty() {
        let tokens: Vec<u32> = chains.iter().map(|c| c.next).collect();
        let rows: Vec<&Tensor> = chains.iter().map(|c| &c.row).collect();
        let hidden = Tensor::cat(&rows, 0)?;
        let positions: Vec<[i64; 3]> = chains.iter().map(|c| c.position.map(|a| a + 1)).collect();
        let picks: Vec<u32> = (0..chains.len() as u32)
            .filter(|&k| chains[k as usize].forced_at >= work[chains[k as usize].i].forced.len())
            .collect();
        let (outputs, logits) = {
            let ids: Vec<usize> = chains.iter().map(|c| c.i).collect();
            let mut states: Vec<&mut SeqState> =
                work.iter_mut().enumerate().filter(|(i, _)| ids.contains(i)).map(|(_, w)| &mut w.head.state).collect();
            h.forward(&tokens, &hidden, &positions, &mut states, &vec![1; chains.len()], &picks)?
        };
        let mut picked = argmax_rows(&logits)?.into_iter();
        let mut next = Vec::with_capacity(chains.len());
        for (k, c) in chains.into_iter().enumerate() {
            let w = &work[c.i];
            let row = outputs.narrow(0, k, 1)?;
            let position = positions[k];
            if c.forced_at < w.forced.len() {
                next.push(Chain { i: c.i, row, position, next: w.forced[c.forced_at], forced_at: c.forced_at + 1 });
                continue;
            }
            let t = picked.next().expect("a pick per drafting sequence");
            if take(&mut out[c.i], t, w.want, vocab, eos) {
                next.push(Chain { i: c.i, row, position, next: t, forced_at: c.forced_at });
            }
        }
        chains = next;
    }
    // The drafting entries go; the rows read are forgotten but the last (its output may be
    // needed again: `covered == target`).
    for &i in &who {
        let w = &mut work[i];
        let keep = caught[i] - w.head.start;
        w.head.state.take_back(keep, None)?;
        w.model.forget_hidden_before(caught[i].saturating_sub(1))?;
    }
    Ok(out)
}

/// The index of the largest logit of each row (the first of equals).
fn argmax_rows(logits: &Tensor) -> Result<Vec<u32>> {
    if logits.dim(0)? == 0 {
        return Ok(vec![]);
    }
    let rows = logits.to_dtype(candle_core::DType::F32)?.to_vec2::<f32>()?;
    Ok(rows.iter().map(|r| crate::sampling::argmax(r)).collect())
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use candle_core::{Device, Tensor};

    use super::*;

    /// A head that records what it is fed: row r's hidden value, token and position; its output
    /// row is the hidden value + 100 (so a fed-back row is told apart), and it picks the token
    /// after the one fed (mod `VOCAB`).
    #[derive(Default)]
    struct Recorder {
        calls: Mutex<Vec<Vec<(f32, u32, i64)>>>,
    }

    const VOCAB: usize = 50;

    impl DraftHead for Recorder {
        fn kv_bytes_per_position(&self) -> usize {
            4
        }
        fn new_state(&self) -> SeqState {
            SeqState::kv(1)
        }
        fn forward(
            &self,
            tokens: &[u32],
            hidden: &Tensor,
            positions: &[[i64; 3]],
            states: &mut [&mut SeqState],
            lens: &[usize],
            picks: &[u32],
        ) -> Result<(Tensor, Tensor)> {
            let h: Vec<f32> = hidden.flatten_all()?.to_vec1()?;
            self.calls
                .lock()
                .unwrap()
                .push(h.iter().zip(tokens).zip(positions).map(|((&h, &t), p)| (h, t, p[0])).collect());
            let mut at = 0;
            for (s, &n) in states.iter_mut().zip(lens) {
                let k = Tensor::zeros((1, n, 1), candle_core::DType::F32, &Device::Cpu)?;
                s.kv_mut(0)?.append(&k, &k)?;
                at += n;
            }
            assert_eq!(at, tokens.len());
            let out = (hidden + 100.0)?;
            let mut logits = vec![0f32; picks.len() * VOCAB];
            for (k, &r) in picks.iter().enumerate() {
                logits[k * VOCAB + (tokens[r as usize] as usize + 1) % VOCAB] = 1.0;
            }
            Ok((out, Tensor::from_vec(logits, (picks.len(), VOCAB), &Device::Cpu)?))
        }
    }

    /// A model state that kept hidden rows of positions `from..to`, each its position's value.
    fn kept(model: &mut SeqState, from: usize, to: usize) {
        let rows: Vec<f32> = (from..to).map(|p| p as f32).collect();
        let positions: Vec<[i64; 3]> = (from..to).map(|p| [p as i64 + 7; 3]).collect();
        model.record_hidden(from, &Tensor::from_vec(rows, (to - from, 1), &Device::Cpu).unwrap(), &positions).unwrap();
    }

    #[test]
    fn entries_pair_each_row_with_the_token_after_it_and_drafts_go_on_from_the_heads_row() {
        let h = Recorder::default();
        let mut model = SeqState::kv(1);
        model.keep_hidden(true);
        let mut head = HeadSeq::new(&h);
        // A prefill chunk of positions 0..6 of tokens 10..16: the head's entries 0..5 (position
        // 5 waits for the token after it).
        kept(&mut model, 0, 6);
        let tokens: Vec<u32> = (10..16).collect();
        let w = Work { head: &mut head, model: &mut model, tokens: tokens.clone(), forced: vec![], want: 0 };
        assert!(propose(&h, VOCAB, &[], vec![w]).unwrap()[0].is_empty());
        let fed = h.calls.lock().unwrap().pop().unwrap();
        assert_eq!(fed, (0..5).map(|p| (p as f32, 11 + p as u32, p as i64 + 7)).collect::<Vec<_>>());
        assert_eq!((head.start, head.state.len()), (0, 5));
        // Decoding: pending token 20 after position 5; a forced token 30, then 3 drafts.
        let mut t = tokens.clone();
        t.push(20);
        let w = Work { head: &mut head, model: &mut model, tokens: t, forced: vec![30], want: 3 };
        let drafts = propose(&h, VOCAB, &[33], vec![w]).unwrap().remove(0);
        let calls = std::mem::take(&mut *h.calls.lock().unwrap());
        // Catch-up: position 5 with the pending token; then the forced token on the head's own
        // row (5 + 100) one position on, then the drafts, each on the previous row; the pick
        // after 32 is an end token (33): the drafts stop before it.
        assert_eq!(calls[0], vec![(5.0, 20, 12)]);
        assert_eq!(calls[1], vec![(105.0, 30, 13)]);
        assert_eq!(calls[2], vec![(205.0, 31, 14)]);
        assert_eq!(calls[3], vec![(305.0, 32, 15)]);
        assert_eq!((drafts, calls.len()), (vec![31, 32], 4));
        // Three wanted, the third not fed (its row would be needed by a fourth only).
        let mut t = tokens.clone();
        t.push(20);
        let w = Work { head: &mut head, model: &mut model, tokens: t, forced: vec![], want: 3 };
        assert_eq!(propose(&h, VOCAB, &[], vec![w]).unwrap()[0], vec![21, 22, 23]);
        assert_eq!(std::mem::take(&mut *h.calls.lock().unwrap()).len(), 3);
        // The drafting entries are cut back: entries of known tokens only.
        assert_eq!((head.start, head.state.len()), (0, 6));
        // The next step: the verification kept 20 and 30; rows of 6..8 recorded by it.
        kept(&mut model, 6, 9);
        let mut t: Vec<u32> = tokens.clone();
        t.extend([20, 30, 41]);
        let w = Work { head: &mut head, model: &mut model, tokens: t, forced: vec![], want: 1 };
        assert_eq!(propose(&h, VOCAB, &[], vec![w]).unwrap()[0], vec![42]);
        let fed = h.calls.lock().unwrap().pop().unwrap();
        assert_eq!(fed, vec![(6.0, 30, 13), (7.0, 41, 14)], "rows 6 and 7; row 8 is a rejected draft's");
        // A gap (a restored prefix: rows from 20 on only) restarts the head there.
        let mut model = SeqState::kv(1);
        model.keep_hidden(true);
        kept(&mut model, 20, 23);
        let t: Vec<u32> = (0..24).collect();
        let w = Work { head: &mut head, model: &mut model, tokens: t, forced: vec![], want: 2 };
        assert_eq!(propose(&h, VOCAB, &[], vec![w]).unwrap()[0], vec![24, 25]);
        assert_eq!((head.start, head.state.len()), (20, 3));
    }
}
