//! Speculative decoding and forced tokens through the engine on the tiny golden checkpoints:
//! drafted tokens verified in one forward pass change no answer (greedy or sampled with a seed,
//! batched, with images, a constraint, stop strings, a recurrent decoder), and a constraint's
//! forced tokens are written without sampling in fewer forward passes.

mod common;

use common::*;
use vl_models::engine::{Completion, Constraint, Engine, EngineOptions, Finish, ModelOptions, Request};
use vl_models::speculative::{Method, Speculative};

fn engine(g: &str, parallel: usize) -> Engine {
    let opts = EngineOptions {
        model: ModelOptions { device: device(), ..Default::default() },
        parallel,
        prefix_cache: false,
        image_cache_bytes: 0,
        ..Default::default()
    };
    Engine::load(&goldens().join(g).join("checkpoint"), opts).unwrap()
}

fn ngram(draft_max: usize) -> Speculative {
    Speculative { method: Method::Ngram, draft_max, ngram_min: 1, ngram_max: 3 }
}

fn with(mut r: Request, spec: Speculative) -> Request {
    r.options.speculative = spec;
    r
}

fn run(e: &Engine, r: &Request) -> (Completion, String) {
    answer_streamed(e, r)
}

/// The same request with drafts and without: equal ids, text, finish and streamed text.
fn same(g: &str, what: &str, off: &(Completion, String), on: &(Completion, String)) {
    assert_eq!(on.0.token_ids, off.0.token_ids, "{g} {what}: ids with drafts vs without");
    assert_eq!((&on.0.text, on.0.finish), (&off.0.text, off.0.finish), "{g} {what}");
    assert_eq!(on.1, on.0.text, "{g} {what}: streamed pieces with drafts");
    assert_eq!(off.0.steps.drafted, 0, "{g} {what}: drafts while off");
}

const CASES: [(&str, usize); 4] = [("text_only", 40), ("one_image", 32), ("two_images", 24), ("multi_turn", 32)];

#[test]
fn drafts_change_no_greedy_answer_of_any_family() {
    for g in ["tiny-a", "tiny-b", "tiny-moe", "tiny-q35", "tiny-q35-moe"] {
        let e = engine(g, 1);
        let (mut drafted, mut accepted) = (0, 0);
        for (case, n) in CASES {
            let req = golden_request(case, n);
            let off = run(&e, &req);
            for k in [1, 4, 8] {
                let on = run(&e, &with(req.clone(), ngram(k)));
                same(g, &format!("{case} k={k}"), &off, &on);
                assert!(on.0.steps.accepted <= on.0.steps.drafted);
                drafted += on.0.steps.drafted;
                accepted += on.0.steps.accepted;
            }
        }
        println!("{g}: {accepted} of {drafted} drafted tokens kept");
        // Random weights repeat themselves, or not (tiny-q35's answers never do: the repeating
        // answer below keeps its drafts); every family has drafts rejected and taken back.
        assert!(drafted > 0 && accepted < drafted, "{g}: no draft was ever rejected ({accepted}/{drafted})");
    }
}

#[test]
fn a_repeating_answer_takes_fewer_forward_passes() {
    // logit_bias makes the answer one token repeated: every draft after the first is kept.
    for g in ["tiny-a", "tiny-q35"] {
        let e = engine(g, 1);
        let mut req = golden_request("one_image", 33);
        let off = run(&e, &req);
        req.options.logit_bias = vec![(off.0.token_ids[0], 100.0)];
        let off = run(&e, &req);
        assert_eq!(off.0.token_ids, vec![off.0.token_ids[0]; 33], "{g}");
        let on = run(&e, &with(req, ngram(8)));
        same(g, "repeating", &off, &on);
        // The first token comes from the prefill, then 32 in passes of up to 9 (the drafts
        // grow with the run: 0, 1, 3, 7, 8, 8 ...).
        let passes = on.0.steps.forward_passes;
        assert!(passes <= 8, "{g}: {passes} forward passes for 32 tokens with 8 drafts each");
        assert_eq!(off.0.steps.forward_passes, 32, "{g}");
        assert!(on.0.steps.accepted >= 20, "{g}: {:?}", on.0.steps);
    }
}

#[test]
fn sampled_answers_with_a_seed_are_the_same_with_drafts() {
    // The drafts are checked against the token the sampler picks with the same random stream:
    // the sampled answer is identical, not only equally distributed.
    for g in ["tiny-a", "tiny-q35"] {
        let e = engine(g, 1);
        let (mut kept, mut rejected) = (0, 0);
        for seed in 0..12u64 {
            let mut req = golden_request(if seed % 2 == 0 { "one_image" } else { "text_only" }, 32);
            req.options.temperature = 0.8;
            req.options.top_p = 0.95;
            req.options.repetition_penalty = if seed % 3 == 0 { 1.2 } else { 1.0 };
            req.options.seed = seed;
            if seed % 2 == 1 {
                // Three likely tokens: answers that repeat themselves, some drafts kept, some not.
                req.options.logit_bias = vec![(100, 30.0), (200, 30.0), (300, 30.0)];
            }
            let off = run(&e, &req);
            let on = run(&e, &with(req, ngram(4)));
            same(g, &format!("seed {seed}"), &off, &on);
            kept += on.0.steps.accepted;
            rejected += on.0.steps.drafted - on.0.steps.accepted;
        }
        assert!(kept > 0 && rejected > 0, "{g}: sampled drafts: {kept} kept, {rejected} rejected");
    }
}

#[test]
fn batched_drafts_answer_as_each_alone_without() {
    let g = "tiny-a";
    let solo = engine(g, 1);
    let batched = engine(g, 4);
    let reqs: Vec<Request> = CASES
        .iter()
        .enumerate()
        .map(|(i, &(case, n))| {
            let mut r = golden_request(case, n);
            if i == 2 {
                r.stop = vec![solo_text_piece(&solo, &golden_request(case, n))];
            }
            r
        })
        .collect();
    let alone: Vec<_> = reqs.iter().map(|r| run(&solo, r)).collect();
    let together: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = reqs
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let (e, r) = (&batched, with(r.clone(), ngram(2 + 2 * i)));
                s.spawn(move || run(e, &r))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (((case, _), a), t) in CASES.iter().zip(&alone).zip(&together) {
        same(g, case, a, t);
    }
    assert_eq!(alone[2].0.finish, Finish::Stop, "the stop string ends the third answer");
    let st = batched.stats();
    assert!(st.draft_tokens > 0 && st.accepted_draft_tokens <= st.draft_tokens, "{st:?}");
    assert_eq!((st.running, st.waiting), (0, 0));
}

/// Some text from the middle of `r`'s answer (a stop string that cuts it).
fn solo_text_piece(e: &Engine, r: &Request) -> String {
    let text = run(e, r).0.text;
    let chars: Vec<char> = text.chars().collect();
    assert!(chars.len() > 12, "{text:?}");
    chars[chars.len() / 2..chars.len() / 2 + 3].iter().collect()
}

fn schema() -> serde_json::Value {
    serde_json::json!({"type": "object",
        "properties": {
            "description_of_the_image": {"type": "string", "maxLength": 12},
            "kind": {"enum": ["photograph_of_a_square", "drawing_of_a_circle"]},
            "count": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["description_of_the_image", "kind", "count"], "additionalProperties": false})
}

fn check(text: &str) {
    let v: serde_json::Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
    let o = v.as_object().unwrap();
    assert_eq!(o.len(), 3, "{v}");
    assert!(v["description_of_the_image"].as_str().unwrap().chars().count() <= 12, "{v}");
    assert!(["photograph_of_a_square", "drawing_of_a_circle"].contains(&v["kind"].as_str().unwrap()), "{v}");
    assert!(v["count"].as_u64().unwrap() <= 99, "{v}");
}

#[test]
fn forced_tokens_are_written_without_sampling_in_fewer_passes() {
    let mut drafted_beside = 0;
    for g in ["tiny-a", "tiny-q35"] {
        let e = engine(g, 1);
        for seed in 0..4u64 {
            let mut req = golden_request("one_image", 120);
            // Qwen3.5's template opens a reasoning block by default, where no constraint applies.
            req.template_kwargs.insert("enable_thinking".into(), false.into());
            req.constraint = Some(Constraint::JsonSchema(schema()));
            req.options.temperature = if seed == 0 { 0.0 } else { 1.0 };
            req.options.seed = seed;
            let mut plain = req.clone();
            plain.options.forced_tokens = false;
            let (without, _) = run(&e, &plain);
            let (with_forced, streamed) = run(&e, &req);
            for c in [&without, &with_forced] {
                assert_eq!(c.finish, Finish::Stop, "{g} seed {seed}: {:?}", c.text);
                check(&c.text);
            }
            assert_eq!(streamed, with_forced.text);
            assert_eq!(without.steps.forced, 0);
            let s = with_forced.steps;
            // The keys and the rest of the chosen enum value are forced.
            assert!(s.forced >= 8, "{g} seed {seed}: {s:?} for {:?}", with_forced.text);
            let generated = with_forced.token_ids.len();
            assert!(
                s.forward_passes + s.forced < generated + 2,
                "{g} seed {seed}: {s:?}, {generated} tokens: forced tokens fed one pass each"
            );
            assert!(without.steps.forward_passes + 1 >= without.token_ids.len(), "{:?}", without.steps);
            // With drafts on too (after the forced tokens, in the same pass), the answer is the
            // same.
            let (both, _) = run(&e, &with(req.clone(), ngram(4)));
            assert_eq!(both.token_ids, with_forced.token_ids, "{g} seed {seed}: drafts beside forced tokens");
            assert_eq!(both.steps.forced, s.forced, "{g} seed {seed}");
            drafted_beside += both.steps.drafted;
        }
    }
    assert!(drafted_beside > 0, "no draft ever followed forced tokens");
}

#[test]
fn drafts_under_a_constraint_change_no_answer() {
    let g = "tiny-a";
    let e = engine(g, 2);
    for seed in 0..4u64 {
        let mut req = golden_request("text_only", 80);
        req.constraint = Some(Constraint::JsonSchema(serde_json::json!({
            "type": "array", "items": {"type": "string", "enum": ["aaa", "bbb aaa", "aaa bbb"]}, "maxItems": 6})));
        req.options.temperature = 1.0;
        req.options.seed = seed;
        req.options.forced_tokens = false;
        let off = run(&e, &req);
        let on = run(&e, &with(req, ngram(6)));
        same(g, &format!("constrained seed {seed}"), &off, &on);
        let v: serde_json::Value = serde_json::from_str(&on.0.text).unwrap();
        assert!(v.as_array().unwrap().len() <= 6);
    }
}
