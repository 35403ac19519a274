//! Times decode steps of several sequences at once on a loaded model, in process (diagnosis of
//! batched decoding, without the server's HTTP, tokenizer or sampling around it):
//! `cargo run --release -p vl-models --example step_time -- MODEL [POSITIONS] [BATCHES] [STEPS] [ROUNDS]`
//! MODEL as `vl run --model` takes it (a checkpoint directory or a GGUF file). Each round and
//! batch size (BATCHES, e.g. `1,4`, alternating within a round) prefills that many sequences of
//! POSITIONS text tokens (untimed; seeded ids), then times STEPS decode steps of all of them
//! together. Prints each batch size's median step over all rounds, its rows a second, and that
//! rate against one sequence's.
use vl_models::{Engine, Result};

fn main() -> Result<()> {
    vl_models::alloc::keep_large_buffers();
    let args: Vec<String> = std::env::args().collect();
    let Some(model) = args.get(1) else {
        eprintln!("usage: step_time MODEL [POSITIONS] [BATCHES] [STEPS] [ROUNDS]");
        std::process::exit(2);
    };
    let arg = |i: usize, default: usize| args.get(i).map_or(default, |a| a.parse().expect("a number"));
    let positions = arg(2, 200);
    let batches: Vec<usize> =
        args.get(3).map_or("1,4", String::as_str).split(',').map(|b| b.parse().expect("a number")).collect();
    let (steps, rounds) = (arg(4, 32), arg(5, 3));
    let engine = Engine::builder(model).build()?;
    let g = engine.generator().expect("a generating model");
    // Seeded ordinary text ids (below the special tokens of every Qwen vocabulary).
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        1000 + (seed % 50_000) as u32
    };
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); batches.len()];
    for round in 0..rounds {
        for (bi, &b) in batches.iter().enumerate() {
            let mut states: Vec<_> = (0..b).map(|_| g.new_state()).collect();
            for s in &mut states {
                let ids: Vec<u32> = (0..positions).map(|_| next()).collect();
                g.prefill(&ids, ids.len(), &[], &[], s, ids.len())?;
                s.reserve(positions + steps + 1);
            }
            let mut refs: Vec<_> = states.iter_mut().collect();
            let mut step_times = Vec::with_capacity(steps);
            for _ in 0..steps {
                let tokens: Vec<u32> = (0..b).map(|_| next()).collect();
                let t = std::time::Instant::now();
                g.decode(&tokens, &mut refs)?;
                step_times.push(t.elapsed().as_secs_f64());
            }
            eprintln!("round {round}: {b} rows, median step {:.2} ms", 1e3 * median(step_times.clone()));
            times[bi].extend(step_times);
        }
    }
    let one = batches.iter().position(|&b| b == 1).map(|i| median(times[i].clone()));
    println!("| rows | median step ms | rows/s | against 1 row |");
    println!("|---|---|---|---|");
    for (bi, &b) in batches.iter().enumerate() {
        let m = median(times[bi].clone());
        let against = one.map_or("-".to_string(), |o| format!("{:.2}x", b as f64 * o / m));
        println!("| {b} | {:.2} | {:.1} | {against} |", 1e3 * m, b as f64 / m);
    }
    Ok(())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}
