//! A pooling model's loop (embedding, reranker): the prompts that wait go through the model
//! together in one forward pass, up to `POOL_BATCH_TOKENS` positions and the KV budget a call,
//! taken in turn from each caller so that one caller's thousands of prompts do not hold up
//! another's few; each caller gets its rows once all of its prompts are pooled.
//!
//! Prompts share prefixes: the instruction's system turn, a reranker's query before each
//! document. A prefix that prompts of one call share (or that one prompt shares with a recent
//! one) is prefilled once, kept in a prefix store, and each prompt prefills only the rest of it.

use std::collections::VecDeque;
use std::sync::mpsc;

use super::prefix::{reusable, PrefixStore};
use super::sequence::{Command, Event, PoolJob};
use crate::error::Result;
use crate::family::{Identity, PoolInput, Pooler};
use crate::state::SeqState;

/// Prompt positions pooled in one call at most (a single longer prompt goes alone).
const POOL_BATCH_TOKENS: usize = 4096;
/// A shared prefix shorter than this is prefilled with each prompt.
const MIN_SHARED: usize = 8;
/// Recent prompts remembered by what their first positions hold, so that a prefix a later
/// prompt shares with one of them is kept.
const RECENT: usize = 64;
const RECENT_POSITIONS: usize = 1024;

/// How the loop runs: the engine's KV budget, and whether shared prefixes are kept.
pub(super) struct PoolSettings {
    pub budget: usize,
    pub reuse: bool,
}

/// A caller's prompts, pooled so far up to `next`.
struct Active {
    job: Box<PoolJob>,
    next: usize,
    /// Each pooled prompt's row and the positions a kept prefix served.
    rows: Vec<(Vec<f32>, usize)>,
}

/// Which prompts the next call pools: (caller, prompt), one from each caller in turn, until the
/// next would pass `max_positions` KV positions (each prompt's rounded up to whole KV blocks;
/// the first is always taken).
fn pick(active: &VecDeque<Active>, max_positions: usize) -> Vec<(usize, usize)> {
    let mut picks = vec![];
    let mut taken = vec![0usize; active.len()];
    let mut tokens = 0usize;
    loop {
        let mut progress = false;
        for (c, a) in active.iter().enumerate() {
            let i = a.next + taken[c];
            let Some((p, _)) = a.job.inputs.get(i) else { continue };
            let positions = vl_nn::kv_cache::blocks_for(p.ids.len());
            if !picks.is_empty() && tokens + positions > max_positions {
                return picks;
            }
            tokens += positions;
            picks.push((c, i));
            taken[c] += 1;
            progress = true;
        }
        if !progress {
            return picks;
        }
    }
}

/// The positions `ident` may take from a prefix of `len` positions it shares: never all of it
/// (its last row is pooled), never ending inside a media placeholder run.
fn cut(ident: &[Identity], len: usize) -> usize {
    reusable(&ident[..len.min(ident.len())], ident)
}

/// The prefixes worth prefilling once for a call's prompts: (prompt, length), one for each run
/// of prompts that share at least `MIN_SHARED` positions (what all of the run shares), and for
/// a prompt that shares none in the call, what it shares with a `recent` one.
fn shared_prefixes(idents: &[&[Identity]], recent: &VecDeque<Vec<Identity>>) -> Vec<(usize, usize)> {
    let key = |x: &[Identity]| x.iter().map(|i| (i.token, i.media)).collect::<Vec<_>>();
    let mut order: Vec<usize> = (0..idents.len()).collect();
    order.sort_by_cached_key(|&i| key(idents[i]));
    let common = |a: &[Identity], b: &[Identity]| a.iter().zip(b).take_while(|(x, y)| x == y).count();
    let mut out = vec![];
    let mut run = vec![order.first().copied().unwrap_or(0)];
    let mut shared = usize::MAX;
    for k in 1..=order.len() {
        let next = order.get(k).map(|&j| (j, common(idents[run[run.len() - 1]], idents[j])));
        match next {
            Some((j, c)) if c >= MIN_SHARED => {
                run.push(j);
                shared = shared.min(c);
            }
            _ => {
                if run.len() > 1 {
                    // The member with the longest prompt carries the prefix.
                    let &i = run.iter().max_by_key(|&&i| idents[i].len()).unwrap_or(&run[0]);
                    out.push((i, cut(idents[i], shared)));
                } else if let Some(&i) = run.first().filter(|_| !idents.is_empty()) {
                    let best = recent.iter().map(|r| reusable(r, idents[i])).max().unwrap_or(0);
                    out.push((i, best));
                }
                run = next.map(|(j, _)| vec![j]).unwrap_or_default();
                shared = usize::MAX;
            }
        }
    }
    out.retain(|&(_, len)| len >= MIN_SHARED);
    out
}

/// The loop's state between calls.
struct Pooling<'p> {
    pooler: &'p dyn Pooler,
    per_position: usize,
    settings: PoolSettings,
    store: PrefixStore,
    recent: VecDeque<Vec<Identity>>,
}

impl Pooling<'_> {
    /// KV positions a call may take: the batch's KV within the budget.
    fn max_positions(&self) -> usize {
        POOL_BATCH_TOKENS.min(self.settings.budget / self.per_position.max(1)).max(1)
    }

    /// Pools one call's prompts in one forward pass (after one pass for the shared prefixes the
    /// store lacks).
    fn call(&mut self, inputs: &[PoolInput<'_>], idents: &[&[Identity]]) -> Result<Vec<(Vec<f32>, usize)>> {
        let need: usize = inputs.iter().map(|i| vl_nn::kv_cache::blocks_for(i.ids.len()) * self.per_position).sum();
        while self.store.bytes() + need > self.settings.budget && self.store.evict() {}
        // A prefix that fails to build is only work not saved: the prompts are pooled whole (and
        // a fault of the model shows there).
        let built = if self.settings.reuse { self.keep_prefixes(inputs, idents).unwrap_or_default() } else { vec![] };
        let mut states = Vec::with_capacity(inputs.len());
        for ident in idents {
            let kept = if self.settings.reuse { self.store.copy(ident)? } else { None };
            states.push(kept.map_or_else(|| self.pooler.new_state(), |(s, _)| s));
        }
        // Positions computed for another prompt or an earlier call: a prefix built in this call
        // is charged to the prompt that carried it.
        let cached: Vec<usize> = states
            .iter()
            .enumerate()
            .map(|(i, s)| built.iter().find(|b| b.0 == i).map_or(s.len(), |b| b.1.min(s.len())))
            .collect();
        let mut refs: Vec<&mut SeqState> = states.iter_mut().collect();
        let rows = self.pooler.pool(inputs, &mut refs)?;
        if rows.len() != inputs.len() {
            return Err(crate::Error::Internal {
                message: format!("the model pooled {} rows for {} prompts", rows.len(), inputs.len()),
            });
        }
        while self.store.bytes() > self.settings.budget / 4 && self.store.evict() {}
        if self.settings.reuse {
            for ident in idents {
                if self.recent.len() == RECENT {
                    self.recent.pop_front();
                }
                self.recent.push_back(ident[..ident.len().min(RECENT_POSITIONS)].to_vec());
            }
        }
        Ok(rows.into_iter().zip(cached).collect())
    }

    /// Prefills, in one pass, the shared prefixes the store cannot serve (or serves at least
    /// `MIN_SHARED` positions fewer of), within a quarter of the KV budget each, and keeps them.
    /// Returns (prompt that carried it, positions the store gave it) for each.
    fn keep_prefixes(&mut self, inputs: &[PoolInput<'_>], idents: &[&[Identity]]) -> Result<Vec<(usize, usize)>> {
        let most = self.settings.budget / 4;
        let builds: Vec<(usize, usize)> = shared_prefixes(idents, &self.recent)
            .into_iter()
            .filter(|&(i, len)| {
                let fits = vl_nn::kv_cache::blocks_for(len) * self.per_position <= most;
                fits && self.store.serves(&idents[i][..len + 1]) + MIN_SHARED <= len
            })
            .collect();
        if builds.is_empty() {
            return Ok(vec![]);
        }
        let mut states = Vec::with_capacity(builds.len());
        let mut given = Vec::with_capacity(builds.len());
        for &(i, len) in &builds {
            let kept = self.store.copy(&idents[i][..len + 1])?;
            given.push((i, kept.as_ref().map_or(0, |k| k.1)));
            states.push(kept.map_or_else(|| self.pooler.new_state(), |(s, _)| s));
        }
        let chosen: Vec<PoolInput<'_>> = builds.iter().map(|&(i, _)| inputs[i]).collect();
        let ends: Vec<usize> = builds.iter().map(|&(_, len)| len).collect();
        let mut refs: Vec<&mut SeqState> = states.iter_mut().collect();
        self.pooler.prefill(&chosen, &mut refs, &ends)?;
        for ((i, len), mut state) in builds.into_iter().zip(states) {
            state.mark();
            self.store.put(idents[i][..len].to_vec(), state);
        }
        Ok(given)
    }
}

/// The loop of a pooling model: runs until every sender is gone. After each call `publish`
/// sees the kept prefixes' bytes, positions and count.
pub(super) fn run_pooling(
    pooler: &dyn Pooler,
    rx: &mpsc::Receiver<Command>,
    settings: PoolSettings,
    publish: &dyn Fn(usize, usize, usize),
) {
    let per_position = pooler.kv_bytes_per_position();
    let mut pooling =
        Pooling { pooler, per_position, settings, store: PrefixStore::default(), recent: VecDeque::new() };
    let mut active: VecDeque<Active> = VecDeque::new();
    loop {
        if active.is_empty() {
            match rx.recv() {
                Ok(c) => active.push_back(Active { job: pool_job(c), next: 0, rows: vec![] }),
                Err(_) => return,
            }
        }
        while let Ok(c) = rx.try_recv() {
            active.push_back(Active { job: pool_job(c), next: 0, rows: vec![] });
        }
        let picks = pick(&active, pooling.max_positions());
        let inputs: Vec<PoolInput<'_>> = picks
            .iter()
            .map(|&(c, i)| {
                let (p, e) = &active[c].job.inputs[i];
                PoolInput { ids: &p.ids, media: &p.media, features: &e.features }
            })
            .collect();
        // A prompt whose identities do not cover its ids (a family that leaves them out) shares
        // nothing.
        let idents: Vec<&[Identity]> = picks
            .iter()
            .map(|&(c, i)| {
                let p = &active[c].job.inputs[i].0;
                if p.ident.len() == p.ids.len() {
                    p.ident.as_slice()
                } else {
                    &[]
                }
            })
            .collect();
        let pooled = if inputs.is_empty() { Ok(vec![]) } else { pooling.call(&inputs, &idents) };
        drop((inputs, idents));
        publish(pooling.store.bytes(), pooling.store.positions(), pooling.store.len());
        let failed = match pooled {
            Ok(rows) if rows.len() == picks.len() => {
                for (&(c, _), row) in picks.iter().zip(rows) {
                    active[c].rows.push(row);
                    active[c].next += 1;
                }
                None
            }
            Ok(rows) => Some(format!("the model pooled {} rows for {} prompts", rows.len(), picks.len())),
            Err(e) => Some(e.to_string()),
        };
        // A failed call fails each caller it had prompts of; a caller whose prompts are all
        // pooled gets its rows.
        let in_call: Vec<bool> = (0..active.len()).map(|c| picks.iter().any(|&(p, _)| p == c)).collect();
        let mut kept = VecDeque::with_capacity(active.len());
        for (a, in_call) in active.drain(..).zip(in_call) {
            let answer = match &failed {
                Some(why) if in_call => Err(crate::Error::Internal { message: format!("pooling failed: {why}") }),
                _ if a.next < a.job.inputs.len() => {
                    kept.push_back(a);
                    continue;
                }
                _ => Ok(a
                    .job
                    .inputs
                    .iter()
                    .zip(a.rows)
                    .map(|((p, _), (values, cached_tokens))| super::PoolOutput {
                        values,
                        prompt_tokens: p.ids.len(),
                        cached_tokens,
                        image_tokens: p.image_tokens,
                        video_tokens: p.video_tokens,
                    })
                    .collect()),
            };
            let _ = a.job.reply.send(answer);
        }
        active = kept;
    }
}

/// A command to a pooling model's loop: a generation request is answered with an error.
fn pool_job(c: Command) -> Box<PoolJob> {
    match c {
        Command::Pool(job) => job,
        Command::Submit(job) => {
            let _ = job.events.send(Event::Done(
                job.choice,
                Err(crate::Error::Internal { message: "a pooling model got a generation request".into() }),
            ));
            Box::new(PoolJob { inputs: vec![], reply: mpsc::channel().0 })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caller(lengths: &[usize]) -> Active {
        let inputs = lengths
            .iter()
            .map(|&n| (crate::family::Prepared { ids: vec![1; n], ..Default::default() }, Default::default()))
            .collect();
        Active { job: Box::new(PoolJob { inputs, reply: mpsc::channel().0 }), next: 0, rows: vec![] }
    }

    #[test]
    fn each_call_takes_prompts_in_turn_from_every_caller_within_the_budget() {
        // A caller of 40 prompts of 1,000 positions and one of a single short prompt: the first
        // call holds the short one, and no call passes the budget.
        let mut active: VecDeque<Active> = [caller(&[1000; 40]), caller(&[10])].into();
        let first = pick(&active, 16_384);
        assert!(first.contains(&(1, 0)), "{first:?}");
        assert_eq!(first.len(), 16, "{first:?}");
        // In each caller's own order, from where it stands.
        active[0].next = 30;
        active.pop_back();
        assert_eq!(pick(&active, 16_384), (30..40).map(|i| (0, i)).collect::<Vec<_>>());
        // A prompt longer than the budget goes alone.
        let long: VecDeque<Active> = [caller(&[POOL_BATCH_TOKENS + 1, 5])].into();
        assert_eq!(pick(&long, POOL_BATCH_TOKENS), [(0, 0)]);
    }

    fn text(tokens: &[u32]) -> Vec<Identity> {
        tokens.iter().map(|&t| Identity::text(t)).collect()
    }

    #[test]
    fn prompts_that_share_a_prefix_have_it_prefilled_once() {
        let system: Vec<u32> = (100..112).collect();
        let with = |rest: &[u32]| text(&[system.as_slice(), rest].concat());
        // Three prompts share the 12-position system turn, two of them 3 more; one shares
        // nothing: one prefix, of what all three share, carried by the longest.
        let a = with(&[1, 2, 3, 4]);
        let b = with(&[1, 2, 3, 5, 6]);
        let c = with(&[7]);
        let d = text(&[9; 20]);
        let idents: Vec<&[Identity]> = vec![&a, &d, &b, &c];
        assert_eq!(shared_prefixes(&idents, &VecDeque::new()), [(2, 12)]);
        // Two runs: each its own prefix.
        let e = text(&[9; 25]);
        let idents: Vec<&[Identity]> = vec![&a, &d, &b, &e];
        let mut got = shared_prefixes(&idents, &VecDeque::new());
        got.sort_unstable();
        // d is all within e: e carries 20 positions, of which d takes all but its last.
        assert_eq!(got, [(2, 15), (3, 20)]);
        // Fewer than MIN_SHARED positions shared: nothing.
        let short = |t: u32| text(&[1, 2, 3, t, t, t, t, t, t, t]);
        let (f, g) = (short(4), short(5));
        assert!(shared_prefixes(&[&f, &g], &VecDeque::new()).is_empty());
        // A prompt alone in its call shares with a recent one.
        let recent: VecDeque<Vec<Identity>> = [d.clone(), a.clone()].into();
        assert_eq!(shared_prefixes(&[&c], &recent), [(0, 12)]);
        assert!(shared_prefixes(&[&c], &VecDeque::new()).is_empty());
    }

    #[test]
    fn a_shared_prefix_never_ends_inside_an_image() {
        // Both prompts hold the same image (key 9) after 10 text positions, then differ: the
        // prefix takes the image whole; cut where only part of the run is shared, it backs off
        // to the text before it.
        let image = |n: usize| vec![Identity { token: 7, media: 9 }; n];
        let head = text(&(100..110).collect::<Vec<_>>());
        let a = [head.clone(), image(4), text(&[1])].concat();
        let b = [head.clone(), image(4), text(&[2])].concat();
        let got = shared_prefixes(&[&a, &b], &VecDeque::new());
        assert_eq!(got.iter().map(|p| p.1).collect::<Vec<_>>(), [14]);
        assert_eq!(cut(&a, 12), 10);
    }
}
