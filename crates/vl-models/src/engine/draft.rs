//! Drafts from a second model (`speculative: draft`, `--draft-model`): a smaller checkpoint of
//! the same tokenizer proposes the next tokens (its greedy picks), and the scheduler verifies
//! them with the model in one forward pass, so the answer is the model's own, token for token.
//!
//! The draft keeps a state of its own per sequence, fed the tokens the model's is:
//! - caught up with prefill chunks (the prompt beside the model's chunks; a prefix the model
//!   reused from its cache, a fork's history or a preempted sequence's, at decode steps);
//! - then, at each step, what it lacks, the pending token and the tokens forced before the
//!   drafts, in one pass that gives the first draft, and one decode pass per further draft;
//! - cut back after the verification to the tokens kept (`sync`).
//!
//! It sees the prompt's images and videos through its own vision tower, on the pixels the model's
//! processor prepared: the pair must size media the same way (checked at load, `check_pair`).
//! Its features are cached apart from the model's, within the same byte bound.

use std::sync::Mutex;

use candle_core::Tensor;

use crate::cache::ByteLru;
use crate::error::{Error, Result};
use crate::family::{Family, Generator, Task};
use crate::media::{Media, VisionOutput};
use crate::state::{Checkpoint, SeqState};

/// Tokens a draft may lag behind its sequence and still catch up in the drafting pass; past
/// that it is prefilled (a chunk per step) before it drafts again.
pub(super) const CATCH_UP: usize = 16;

/// The draft model an engine holds beside its model.
pub(crate) struct Draft {
    pub family: Box<dyn Family>,
    /// Its vision features by media key (the model's own are in `Shared::features`).
    pub features: Mutex<ByteLru<u64, VisionOutput>>,
}

impl Draft {
    /// `family` as `target`'s draft, once `check_pair` accepts the two.
    pub fn new(target: &dyn Family, family: Box<dyn Family>, cache_bytes: usize) -> Result<Self> {
        check_pair(target, &*family)?;
        Ok(Self { family, features: Mutex::new(ByteLru::new(cache_bytes)) })
    }

    pub fn generator(&self) -> &dyn Generator {
        match self.family.task() {
            Task::Generate(g) => g,
            Task::Pool(_) => unreachable!("check_pair refuses a pooling draft"),
        }
    }
}

/// Whether `draft` can draft for `target`: it generates, its tokenizer is the model's (the same
/// vocabulary and special tokens, the same ids), and it sizes images as the model does (its
/// tower reads the pixels the model's processor prepared). The error names what differs.
pub fn check_pair(target: &dyn Family, draft: &dyn Family) -> Result<()> {
    let bad = |message: String| Err(Error::Input { what: "draft model".into(), message });
    if let Task::Pool(_) = draft.task() {
        return bad(format!("{} pools (an embedding or reranker checkpoint); a draft must generate", draft.name()));
    }
    let (t, d) = (target.tokenizer(), draft.tokenizer());
    let (tn, dn) = (t.get_vocab_size(true), d.get_vocab_size(true));
    if tn != dn {
        return bad(format!("its tokenizer has {dn} tokens, the model's {tn}: a draft needs the model's tokenizer"));
    }
    let (tv, dv) = (t.get_vocab(true), d.get_vocab(true));
    if let Some((text, id)) = tv.iter().find(|(text, id)| dv.get(*text) != Some(id)) {
        let theirs = dv.get(text).map_or("no id".to_string(), |i| format!("id {i}"));
        return bad(format!("token {text:?} is id {id} in the model's tokenizer, {theirs} in the draft's"));
    }
    for (w, h) in [(448, 448), (1280, 720), (56, 900)] {
        let (a, b) = (target.image_sizing(w, h)?, draft.image_sizing(w, h)?);
        if a.ours != b.ours {
            return bad(format!(
                "it sizes a {w}x{h} image to {:?} ({} tokens), the model to {:?} ({} tokens): the two must share a processor",
                b.ours.resized, b.ours.tokens, a.ours.resized, a.ours.tokens
            ));
        }
    }
    Ok(())
}

/// A sequence's draft side: the draft model's state, fed the tokens the model's state is, and
/// where it stood before the last drafts (a recurrent state cannot be cut anywhere).
pub(super) struct DraftSeq {
    pub state: SeqState,
    pub checkpoint: Option<Checkpoint>,
}

impl DraftSeq {
    pub fn new(g: &dyn Generator) -> Self {
        Self { state: g.new_state(), checkpoint: None }
    }
}

/// What a sequence's draft is prefilled from: its ids (`prompt_len` of them the prompt), the
/// prompt's media and the draft's features of them.
pub(super) struct Prompt<'a> {
    pub ids: &'a [u32],
    pub prompt_len: usize,
    pub media: &'a [Media],
    pub features: &'a [VisionOutput],
}

impl DraftSeq {
    /// Prefills one chunk (at most `chunk` positions) towards `end` (at most the ids); nothing
    /// when it is there.
    pub fn catch_up(&mut self, g: &dyn Generator, p: &Prompt<'_>, end: usize, chunk: usize) -> Result<()> {
        let end = end.min(p.ids.len());
        if self.state.len() > end {
            self.state.take_back(end, None)?;
        }
        if self.state.len() == end {
            return Ok(());
        }
        let to = (self.state.len() + chunk).min(end);
        g.prefill(p.ids, p.prompt_len, p.media, p.features, &mut self.state, to)?;
        Ok(())
    }

    /// After a verification: its state cut back to the `len` tokens its sequence kept (to its
    /// checkpoint where it cannot be cut there; the rest is fed again next step).
    pub fn sync(&mut self, len: usize) -> Result<()> {
        let cp = self.checkpoint.take();
        if self.state.len() > len {
            self.state.take_back(len, cp.as_ref())?;
        }
        Ok(())
    }
}

/// One sequence's drafting this step: its draft, the tokens fed first (what the draft lacks,
/// the pending token, the forced tokens before the drafts), and how many tokens to propose.
pub(super) struct Work<'a> {
    pub draft: &'a mut DraftSeq,
    pub feed: Vec<u32>,
    pub want: usize,
}

/// The draft's greedy picks for each sequence, batched: one pass over every sequence's `feed`
/// (its last row's pick is the first draft), then one decode pass per further draft for the
/// sequences still drafting. A sequence stops at `want`, or before an end-of-answer token (the
/// model's pick ends the answer whatever it is) or one the model has no row for (`vocab`). The last pick is
/// not fed: the draft's state holds the feed and the drafts but the last.
pub(super) fn propose(g: &dyn Generator, vocab: usize, eos: &[u32], mut work: Vec<Work<'_>>) -> Result<Vec<Vec<u32>>> {
    let mut out: Vec<Vec<u32>> = vec![Vec::new(); work.len()];
    if work.is_empty() {
        return Ok(out);
    }
    for w in &mut work {
        w.draft.checkpoint = w.draft.state.has_recurrent().then(|| w.draft.state.checkpoint());
    }
    let feeds: Vec<Vec<u32>> = work.iter().map(|w| w.feed.clone()).collect();
    let logits = {
        let mut states: Vec<&mut SeqState> = work.iter_mut().map(|w| &mut w.draft.state).collect();
        if feeds.iter().all(|f| f.len() == 1) {
            let tokens: Vec<u32> = feeds.iter().map(|f| f[0]).collect();
            g.decode(&tokens, &mut states)?
        } else {
            g.extend(&feeds, &mut states)?
        }
    };
    // Each sequence's last row.
    let mut last = Vec::with_capacity(feeds.len());
    let mut at = 0u32;
    for f in &feeds {
        at += f.len() as u32;
        last.push(at - 1);
    }
    let picks = argmax_rows(&logits, &last)?;
    let mut live = Vec::new();
    for (i, t) in picks.into_iter().enumerate() {
        if take(&mut out[i], t, work[i].want, vocab, eos) {
            live.push(i);
        }
    }
    while !live.is_empty() {
        let tokens: Vec<u32> = live.iter().map(|&i| *out[i].last().expect("drafted")).collect();
        let logits = {
            let mut states: Vec<&mut SeqState> = work
                .iter_mut()
                .enumerate()
                .filter(|(i, _)| live.contains(i))
                .map(|(_, w)| &mut w.draft.state)
                .collect();
            g.decode(&tokens, &mut states)?
        };
        let rows: Vec<u32> = (0..live.len() as u32).collect();
        let picks = argmax_rows(&logits, &rows)?;
        let mut next = Vec::with_capacity(live.len());
        for (&i, t) in live.iter().zip(picks) {
            if take(&mut out[i], t, work[i].want, vocab, eos) {
                next.push(i);
            }
        }
        live = next;
    }
    Ok(out)
}

/// Adds `t` to `drafts` unless it ends the answer or the model has no row for it; whether to
/// draft on after it.
pub(super) fn take(drafts: &mut Vec<u32>, t: u32, want: usize, vocab: usize, eos: &[u32]) -> bool {
    if t as usize >= vocab || eos.contains(&t) || drafts.len() >= want {
        return false;
    }
    drafts.push(t);
    drafts.len() < want
}

/// The index of the largest logit of each of `rows` (the first of equals).
fn argmax_rows(logits: &Tensor, rows: &[u32]) -> Result<Vec<u32>> {
    let idx = Tensor::new(rows, logits.device())?;
    let picked = logits.index_select(&idx, 0)?.to_dtype(candle_core::DType::F32)?.to_vec2::<f32>()?;
    Ok(picked.iter().map(|r| crate::sampling::argmax(r)).collect())
}
