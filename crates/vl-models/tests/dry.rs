//! llama.cpp's DRY sampler through the engine on the tiny random-weight checkpoint: with a
//! strong penalty no answer token extends a repetition of the context past
//! `dry_allowed_length` (checked by a naive scan written here), the greedy answer without it
//! does, and a seeded sampled answer is the same on every run.

mod common;

use common::*;
use vl_models::engine::{Engine, EngineOptions, ModelOptions};

fn engine() -> Engine {
    let opts = EngineOptions { model: ModelOptions { device: device(), ..Default::default() }, ..Default::default() };
    Engine::load(&goldens().join("tiny-a").join("checkpoint"), opts).unwrap()
}

/// For each answer token, the longest run of the context just before it that also ends
/// earlier, right before an earlier copy of that same token (the repetition it extends).
fn longest_extended(context: &[u32], answer_from: usize) -> usize {
    let mut most = 0;
    for p in answer_from..context.len() {
        for j in 0..p.saturating_sub(1) {
            if context[j + 1] != context[p] {
                continue;
            }
            let run = (0..=j).take_while(|&k| context[j - k] == context[p - 1 - k]).count();
            most = most.max(run);
        }
    }
    most
}

#[test]
fn a_strong_dry_penalty_leaves_no_repetition_past_the_allowed_length() {
    let e = engine();
    let mut req = golden_request("text_only", 80);
    // The reference's prompt ids (the engine renders the same: its greedy answers equal the
    // reference's in engine.rs).
    let prompt_ids = prompt("text_only").input_ids;
    let prompt = prompt_ids.len();
    assert_eq!(e.count_tokens(&req).unwrap(), prompt);
    let plain = e.generate(&req, &mut |_| true).unwrap();
    let ids = |c: &vl_models::engine::Completion| -> Vec<u32> { [&prompt_ids[..], &c.token_ids[..]].concat() };
    let without = longest_extended(&ids(&plain), prompt);
    println!("without DRY: the answer extends a repeat of {without} tokens");
    assert!(without >= 3, "the plain greedy answer repeats nothing: the test shows nothing");
    req.options.dry_multiplier = 50.0;
    req.options.dry_allowed_length = 2;
    req.options.dry_sequence_breakers = vec![];
    let t = std::time::Instant::now();
    let dry = e.generate(&req, &mut |_| true).unwrap();
    println!("with DRY (first request, the vocabulary scanned): {:.2?}", t.elapsed());
    let with = longest_extended(&ids(&dry), prompt);
    assert_eq!(dry.token_ids.len(), 80);
    assert!(with < 2, "with DRY the answer extends a repeat of {with} tokens: {:?}", dry.token_ids);
}

#[test]
fn a_seeded_answer_with_dry_is_the_same_every_time() {
    let e = engine();
    // Two candidates a step: the random model's answer repeats, so DRY has something to change.
    let mut req = golden_request("text_only", 60);
    req.options.temperature = 1.0;
    req.options.top_k = 2;
    req.options.seed = 7;
    let plain = e.generate(&req, &mut |_| true).unwrap().token_ids;
    req.options.dry_multiplier = 2.0;
    let first = e.generate(&req, &mut |_| true).unwrap().token_ids;
    for _ in 0..2 {
        assert_eq!(e.generate(&req, &mut |_| true).unwrap().token_ids, first);
    }
    assert_ne!(first, plain, "DRY changed nothing");
}
