//! A pooling model's loop (embedding, reranker): the prompts that wait go through the model
//! together, up to `POOL_BATCH_TOKENS` positions a call, taken in turn from each caller so that
//! one caller's thousands of prompts do not hold up another's few; each caller gets its rows
//! once all of its prompts are pooled.

use std::collections::VecDeque;
use std::sync::mpsc;

use super::sequence::{Command, Event, PoolJob};
use crate::family::{PoolInput, Pooler};

/// Prompt positions pooled in one call at most (a single longer prompt goes alone).
const POOL_BATCH_TOKENS: usize = 16_384;

/// A caller's prompts, pooled so far up to `next`.
struct Active {
    job: Box<PoolJob>,
    next: usize,
    rows: Vec<Vec<f32>>,
}

/// Which prompts the next call pools: (caller, prompt), one from each caller in turn, until the
/// next would pass `POOL_BATCH_TOKENS` (the first is always taken).
fn pick(active: &VecDeque<Active>) -> Vec<(usize, usize)> {
    let mut picks = vec![];
    let mut taken = vec![0usize; active.len()];
    let mut tokens = 0usize;
    loop {
        let mut progress = false;
        for (c, a) in active.iter().enumerate() {
            let i = a.next + taken[c];
            let Some((p, _)) = a.job.inputs.get(i) else { continue };
            if !picks.is_empty() && tokens + p.ids.len() > POOL_BATCH_TOKENS {
                return picks;
            }
            tokens += p.ids.len();
            picks.push((c, i));
            taken[c] += 1;
            progress = true;
        }
        if !progress {
            return picks;
        }
    }
}

/// The loop of a pooling model: runs until every sender is gone.
pub(super) fn run_pooling(pooler: &dyn Pooler, rx: &mpsc::Receiver<Command>) {
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
        let picks = pick(&active);
        let inputs: Vec<PoolInput<'_>> = picks
            .iter()
            .map(|&(c, i)| {
                let (p, e) = &active[c].job.inputs[i];
                PoolInput { ids: &p.ids, media: &p.media, features: &e.features }
            })
            .collect();
        let pooled = if inputs.is_empty() { Ok(vec![]) } else { pooler.pool(&inputs) };
        drop(inputs);
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
                    .map(|((p, _), values)| super::PoolOutput {
                        values,
                        prompt_tokens: p.ids.len(),
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
        let first = pick(&active);
        assert!(first.contains(&(1, 0)), "{first:?}");
        assert_eq!(first.len(), 17, "{first:?}");
        // In each caller's own order, from where it stands.
        active[0].next = 30;
        active.pop_back();
        assert_eq!(pick(&active), (30..40).map(|i| (0, i)).collect::<Vec<_>>());
        // A prompt longer than the budget goes alone.
        let long: VecDeque<Active> = [caller(&[POOL_BATCH_TOKENS + 1, 5])].into();
        assert_eq!(pick(&long), [(0, 0)]);
    }
}
