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

/// `v / |v|` (as torch's `F.normalize`: the norm floored at 1e-12).
pub fn normalized(mut v: Vec<f32>) -> Vec<f32> {
    let norm = v.iter().map(|x| (*x as f64) * (*x as f64)).sum::<f64>().sqrt().max(1e-12);
    v.iter_mut().for_each(|x| *x = (*x as f64 / norm) as f32);
    v
}

/// An embedding cut to its first `dims` values and normalised again (Matryoshka truncation, as
/// vLLM serves `dimensions`); an error names the value when it is 0 or above the model's.
pub fn truncated(v: &[f32], dims: usize) -> crate::Result<Vec<f32>> {
    if dims == 0 || dims > v.len() {
        return Err(crate::Error::Input {
            what: "dimensions".into(),
            message: format!("{dims} is outside 1..={} (the model's embedding size)", v.len()),
        });
    }
    Ok(normalized(v[..dims].to_vec()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truncation_renormalises_and_refuses_out_of_range() {
        let v = normalized(vec![3.0, 4.0, 12.0]);
        assert!((v.iter().map(|x| x * x).sum::<f32>() - 1.0).abs() < 1e-6);
        let cut = truncated(&v, 2).unwrap();
        assert!((cut[0] - 0.6).abs() < 1e-6 && (cut[1] - 0.8).abs() < 1e-6, "{cut:?}");
        assert!(truncated(&v, 0).is_err() && truncated(&v, 4).unwrap_err().to_string().contains("1..=3"));
    }
}
