//! A pooling model's loop (embedding, reranker): prompts that wait together go through the
//! model in one call; each caller gets its rows.

use std::collections::VecDeque;
use std::sync::mpsc;

use super::sequence::{Command, Event, PoolJob};
use crate::family::{PoolInput, Pooler};

/// Prompt positions pooled in one call at most, jobs together (one job alone may exceed it).
const POOL_BATCH_TOKENS: usize = 16_384;

/// The loop of a pooling model: the prompts waiting when it looks (up to `POOL_BATCH_TOKENS`
/// positions) go through the model in one call; each job gets its rows.
pub(super) fn run_pooling(pooler: &dyn Pooler, rx: &mpsc::Receiver<Command>) {
    let mut waiting: VecDeque<Box<PoolJob>> = VecDeque::new();
    loop {
        if waiting.is_empty() {
            match rx.recv() {
                Ok(c) => waiting.push_back(pool_job(c)),
                Err(_) => return,
            }
        }
        while let Ok(c) = rx.try_recv() {
            waiting.push_back(pool_job(c));
        }
        let mut batch = vec![waiting.pop_front().expect("one waits")];
        let mut tokens: usize = batch[0].inputs.iter().map(|(p, _)| p.ids.len()).sum();
        while let Some(next) = waiting.front() {
            let more: usize = next.inputs.iter().map(|(p, _)| p.ids.len()).sum();
            if tokens + more > POOL_BATCH_TOKENS {
                break;
            }
            tokens += more;
            batch.push(waiting.pop_front().expect("front exists"));
        }
        let inputs: Vec<PoolInput<'_>> = batch
            .iter()
            .flat_map(|j| &j.inputs)
            .map(|(p, e)| PoolInput { ids: &p.ids, media: &p.media, features: &e.features })
            .collect();
        let pooled = pooler.pool(&inputs);
        drop(inputs);
        let mut rows = match pooled {
            Ok(rows) if rows.len() == batch.iter().map(|j| j.inputs.len()).sum::<usize>() => Ok(rows.into_iter()),
            Ok(rows) => Err(format!("the model pooled {} rows for {} prompts", rows.len(), tokens)),
            Err(e) => Err(e.to_string()),
        };
        for job in batch {
            let answer = match &mut rows {
                Ok(rows) => Ok(job
                    .inputs
                    .iter()
                    .zip(rows.by_ref())
                    .map(|((p, _), values)| super::PoolOutput {
                        values,
                        prompt_tokens: p.ids.len(),
                        image_tokens: p.image_tokens,
                        video_tokens: p.video_tokens,
                    })
                    .collect()),
                Err(why) => Err(crate::Error::Internal { message: format!("pooling failed: {why}") }),
            };
            let _ = job.reply.send(answer);
        }
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
