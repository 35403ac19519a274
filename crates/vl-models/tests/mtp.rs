//! Speculative decoding with the model's own multi-token-prediction head (`speculative: mtp`,
//! Qwen3.5's `mtp.*`) through the engine on the tiny golden checkpoint that carries one: the
//! head drafts, the model verifies, and no answer changes (greedy or sampled with a seed; with
//! images, batching, forks, a constraint, a reused prefix, preemption; from the converter's
//! GGUF too). A model without a head is refused by name.

mod common;

use common::*;
use vl_models::engine::{Completion, Constraint, Engine, EngineOptions, ModelOptions, Request};
use vl_models::family::Task;
use vl_models::speculative::{Method, Speculative};
use vl_models::state::SeqState;

fn options(parallel: usize) -> EngineOptions {
    EngineOptions {
        model: ModelOptions { device: device(), ..Default::default() },
        parallel,
        prefix_cache: false,
        image_cache_bytes: 0,
        ..Default::default()
    }
}

fn open(g: &str, opts: EngineOptions) -> Engine {
    Engine::open(&goldens().join(g).join("checkpoint"), None, opts).unwrap()
}

fn mtp(draft_max: usize) -> Speculative {
    Speculative { method: Method::Mtp, draft_max, ..Default::default() }
}

fn with(mut r: Request, spec: Speculative) -> Request {
    r.options.speculative = spec;
    r
}

fn same(what: &str, off: &(Completion, String), on: &(Completion, String)) {
    assert_eq!(on.0.token_ids, off.0.token_ids, "{what}: ids with MTP drafts vs without");
    assert_eq!((&on.0.text, on.0.finish), (&off.0.text, off.0.finish), "{what}");
    assert_eq!(on.1, on.0.text, "{what}: streamed pieces");
}

const CASES: [(&str, usize); 4] = [("text_only", 40), ("one_image", 32), ("two_images", 24), ("multi_turn", 32)];

/// Drafts and kept drafts over `CASES` at each `k`, each answer checked against the one
/// without drafts.
fn greedy_cases(e: &Engine, what: &str) -> (usize, usize) {
    let (mut drafted, mut accepted) = (0, 0);
    for (case, n) in CASES {
        let req = golden_request(case, n);
        let off = answer_streamed(e, &req);
        for k in [1, 3, 6] {
            let on = answer_streamed(e, &with(req.clone(), mtp(k)));
            same(&format!("{what}: {case} k={k}"), &off, &on);
            assert!(on.0.steps.accepted <= on.0.steps.drafted);
            drafted += on.0.steps.drafted;
            accepted += on.0.steps.accepted;
        }
    }
    (drafted, accepted)
}

#[test]
fn mtp_drafts_change_no_greedy_answer() {
    // The dense family, and the MoE one whose head's layer routes to experts.
    for g in ["tiny-q35", "tiny-q35-moe-mtp"] {
        let e = open(g, options(1));
        let (drafted, accepted) = greedy_cases(&e, g);
        println!("{g} MTP: {accepted} of {drafted} drafted tokens kept");
        assert!(drafted > 0, "{g}: the head drafted nothing");
    }
}

#[test]
fn the_converters_gguf_drafts_with_its_nextn_block() {
    let dir = goldens().join("gguf-q35");
    let e = Engine::open(&dir.join("tiny-q35-bf16.gguf"), Some(&dir.join("mmproj-tiny-q35-bf16.gguf")), options(1))
        .unwrap();
    let (drafted, _) = greedy_cases(&e, "tiny-q35 GGUF");
    assert!(drafted > 0, "the GGUF's head drafted nothing");
}

#[test]
fn sampled_answers_with_mtp_drafts_are_the_same() {
    let e = open("tiny-q35", options(1));
    let (mut kept, mut rejected) = (0, 0);
    for seed in 0..6u64 {
        let mut req = golden_request(if seed % 2 == 0 { "one_image" } else { "text_only" }, 24);
        req.options.temperature = 0.7;
        req.options.top_k = 40;
        req.options.seed = seed;
        if seed % 2 == 1 {
            req.options.logit_bias = vec![(100, 30.0), (200, 30.0), (300, 30.0)];
        }
        let off = answer_streamed(&e, &req);
        let on = answer_streamed(&e, &with(req, mtp(3)));
        same(&format!("seed {seed}"), &off, &on);
        kept += on.0.steps.accepted;
        rejected += on.0.steps.drafted - on.0.steps.accepted;
    }
    assert!(kept + rejected > 0, "sampled: no drafts");
}

fn schema() -> Constraint {
    Constraint::JsonSchema(serde_json::json!({
        "type": "object",
        "properties": {
            "label": {"type": "string", "maxLength": 12},
            "count": {"type": "integer", "minimum": 0, "maximum": 99}
        },
        "required": ["label", "count"],
        "additionalProperties": false
    }))
}

#[test]
fn batched_forked_constrained_and_cached_requests_answer_as_alone() {
    let solo = open("tiny-q35", options(1));
    // Prefix reuse on: a request sent again restores the model's state, and its head starts
    // from the first row the restored state kept.
    let batched = open("tiny-q35", EngineOptions { prefix_cache: true, prefill_chunk: 32, ..options(4) });
    let mut reqs: Vec<Request> = CASES.iter().map(|&(case, n)| golden_request(case, n)).collect();
    reqs[1].constraint = Some(schema());
    reqs[1].options.max_new_tokens = 200;
    reqs[3].stop = vec![" ".into()];
    let alone: Vec<_> = reqs.iter().map(|r| answer_streamed(&solo, r)).collect();
    for round in 0..2 {
        let together: Vec<_> = std::thread::scope(|s| {
            let hs: Vec<_> = reqs
                .iter()
                .enumerate()
                .map(|(i, r)| {
                    let (e, r) = (&batched, with(r.clone(), mtp(1 + 2 * i)));
                    s.spawn(move || answer_streamed(e, &r))
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (((case, _), a), t) in CASES.iter().zip(&alone).zip(&together) {
            same(&format!("round {round}: {case}"), a, t);
        }
        if round == 1 {
            // Recurrent layers restore the prefixes they kept snapshots at (chunk ends).
            let cached: usize = together.iter().map(|t| t.0.cached_tokens).sum();
            assert!(cached > 0, "the second round reuses the first's prefixes");
        }
    }
    // Three choices from one prefill, each with its seed: as without drafts.
    let mut req = with(golden_request("one_image", 20), mtp(4));
    req.options.temperature = 0.9;
    req.options.seed = 5;
    let on = batched.generate_n(&req, 3, &mut |_, _, _| true).unwrap();
    let off = solo.generate_n(&with(req, Speculative::default()), 3, &mut |_, _, _| true).unwrap();
    for (a, b) in on.iter().zip(&off) {
        assert_eq!(a.token_ids, b.token_ids, "forks");
    }
    let st = batched.stats();
    assert!(st.draft_tokens > 0, "{st:?}");
    assert_eq!((st.running, st.waiting), (0, 0));
}

#[test]
fn preempted_sequences_rebuild_their_heads_and_answer_as_alone() {
    let probe = open("tiny-q35", options(1));
    let mut long = with(golden_request("text_only", 96), mtp(4));
    long.options.logit_bias = vec![(100, 3.0), (200, 3.0)];
    let alone = answer_streamed(&probe, &long);
    assert_eq!(alone.0.token_ids.len(), 96);
    let Task::Generate(g) = probe.family().task() else { unreachable!() };
    let (pp, fixed) = (g.kv_bytes_per_position(), g.fixed_state_bytes());
    let hpp = g.draft_head().expect("tiny-q35 carries mtp.*").kv_bytes_per_position();
    let positions = vl_nn::kv_cache::blocks_for(alone.0.prompt_tokens + 97);
    let one = positions * (pp + hpp) + fixed;
    let tight = Engine::open(
        &goldens().join("tiny-q35").join("checkpoint"),
        None,
        EngineOptions { kv_cache_bytes: one + pp * vl_nn::kv_cache::BLOCK / 2, ..options(4) },
    )
    .unwrap();
    let answers: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..3).map(|_| s.spawn(|| answer_streamed(&tight, &long))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for a in &answers {
        same("preempted", &alone, a);
    }
    let st = tight.stats();
    assert!(st.preemptions > 0, "the budget forced no preemption: {st:?}");
}

#[test]
fn a_model_without_a_head_is_refused_by_name() {
    for g in ["tiny-a", "tiny-q35-moe"] {
        let e = open(g, options(1));
        let err = e.generate(&with(golden_request("text_only", 4), mtp(2)), &mut |_| true).unwrap_err();
        assert!(matches!(&err, vl_models::Error::Input { what, .. } if what == "speculative"), "{g}: {err}");
        assert!(err.to_string().contains("multi-token-prediction head"), "{g}: {err}");
    }
}

/// The head against the reference (`goldens/tiny-q35/mtp`, tools/hf-reference/qwen35_mtp.py:
/// transformers' modules wired as vLLM's predictor): the model's hidden rows kept through a
/// chunked prefill, the head run over them in chunks of 37 (its KV carried): the last position's
/// logits and the second draft's row (the head's own output fed back one position on) within
/// 1e-3, every position's within the reference's own float32 drift, the first two drafts the
/// reference's.
#[test]
fn the_head_matches_the_reference() {
    head_matches("tiny-q35", "tiny-q35");
}

/// The same for the MoE family (`goldens/tiny-q35-moe-mtp`: tiny-q35-moe's weights and a head
/// whose layer has 6 routed experts and a gated shared expert), on tiny-q35-moe's prompts.
#[test]
fn the_moe_head_matches_the_reference() {
    head_matches("tiny-q35-moe-mtp", "tiny-q35-moe");
}

/// `fixture`'s checkpoint and `mtp/` reference, on `cases_of`'s prompts.
fn head_matches(fixture: &str, cases_of: &str) {
    use candle_core::{DType, Tensor};
    use vl_models::qwen3_vl::{Prompt, Qwen3VlModel, VisionInput};
    let dir = goldens().join(fixture);
    let m = Qwen3VlModel::load(&dir.join("checkpoint"), DType::F32, &device()).unwrap();
    assert!(m.text().has_mtp());
    let sampled = load(&goldens().join("sampled_vocab_ids.safetensors"))["vocab_ids"].to_dtype(DType::U32).unwrap();
    for name in ["long_text", "one_image"] {
        let case = load(&goldens().join(cases_of).join("cases").join(format!("{name}.safetensors")));
        let want = load(&dir.join("mtp").join(format!("{name}.safetensors")));
        let ids: Vec<u32> = case["input_ids"].to_vec1::<i64>().unwrap().iter().map(|&i| i as u32).collect();
        let images = case
            .get("pixel_values")
            .map(|px| VisionInput { pixels: px.clone(), grids: grids(&case["image_grid_thw"]) });
        let encoded = images.as_ref().map(|i| m.encode_vision(i).unwrap());
        let p = Prompt { input_ids: ids.clone(), images, videos: None, generated_from: None };
        let n = ids.len();
        let mut cache = m.new_cache();
        cache.keep_hidden(true);
        let mut out = None;
        let mut end = 0;
        while end < n {
            end = (end + 37).min(n);
            out = Some(m.side().prefill_until(&p, encoded.as_ref(), None, &mut cache, end, &mut |_, _| {}).unwrap());
        }
        let first = m.last_logits(&out.unwrap()).unwrap().argmax(0).unwrap().to_scalar::<u32>().unwrap();
        let tokens_want: Vec<i64> = want["tokens"].to_vec1().unwrap();
        assert_eq!(first as i64, tokens_want[0], "{name}: the model's first token");
        assert_eq!(cache.hidden_span(), 0..n, "{name}: every row kept");
        let mut next: Vec<u32> = ids[1..].to_vec();
        next.push(first);
        let mut head = SeqState::kv(1);
        let (mut outs, mut rows) = (vec![], vec![]);
        let mut at = 0;
        while at < n {
            let to = (at + 37).min(n);
            let (hidden, positions) = cache.hidden_rows(at, to).unwrap();
            let (o, _) = m
                .text()
                .mtp_forward(&next[at..to], &hidden, &positions, &mut [&mut head], &[to - at], &[], None)
                .unwrap();
            rows.push(m.text().logits(&o).unwrap().index_select(&sampled, 1).unwrap());
            outs.push(o);
            at = to;
        }
        let all = Tensor::cat(&rows, 0).unwrap();
        let d_all = max_abs_diff(&all, &want["logits.sampled"]);
        let out = Tensor::cat(&outs, 0).unwrap();
        let last_row = out.narrow(0, n - 1, 1).unwrap();
        let last = m.text().logits(&last_row).unwrap().squeeze(0).unwrap();
        let d_last = max_abs_diff(&last, &want["logits.last"]);
        let d1 = last.argmax(0).unwrap().to_scalar::<u32>().unwrap();
        assert_eq!(d1 as i64, tokens_want[1], "{name}: the first draft");
        // The second draft: the head's own row fed back, one position on.
        let (_, positions) = cache.hidden_rows(n - 1, n).unwrap();
        let pos = [positions[0].map(|a| a + 1)];
        let (_, chain) = m.text().mtp_forward(&[d1], &last_row, &pos, &mut [&mut head], &[1], &[0], None).unwrap();
        let chain = chain.squeeze(0).unwrap();
        let d_chain = max_abs_diff(&chain, &want["chain.logits"]);
        assert_eq!(
            chain.argmax(0).unwrap().to_scalar::<u32>().unwrap() as i64,
            tokens_want[2],
            "{name}: the second draft"
        );
        println!(
            "{fixture}/{name} ({n} positions): every position {d_all:.2e}, last {d_last:.2e}, second draft {d_chain:.2e}"
        );
        for (what, d) in [("last", d_last), ("second draft", d_chain)] {
            assert!(d <= tol(1e-3), "{name}: {what} {d:e}");
        }
        // Every position's row reads the model's hidden row there, which the reference's float32
        // chunked delta rule computes up to 2.2e-3 away from the exact values at early positions
        // of long_text (qwen35_parity.rs, `CHUNKED_F32_BOUND`): measured 1.5e-3 here.
        assert!(d_all <= tol(3e-3), "{name}: every position {d_all:e}");
    }
}
