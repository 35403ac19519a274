//! Qwen3-VL-Reranker through the engine against the pinned reference (goldens/tiny-rerank, made
//! by `tools/hf-reference/generate --reranker` with the official prompt and scoring): the
//! checkpoint is found as a reranker from its Sentence Transformers files, each case's prompt ids
//! equal the reference's, its score is within 1e-3 and the cases rank in the same order.

mod common;

use common::*;
use vl_models::engine::{Engine, EngineOptions};
use vl_models::family::Pooled;
use vl_models::{ChatMessage, Part, Request};

fn side(role: &str, v: &serde_json::Value) -> ChatMessage {
    let mut parts: Vec<Part> = v["texts"].as_array().unwrap().iter().map(|t| Part::text(t.as_str().unwrap())).collect();
    // Images after the texts here: the prompt puts them first whatever the order given.
    for n in v["images"].as_array().unwrap() {
        parts.push(Part::image_file(goldens().join("images").join(n.as_str().unwrap())).unwrap());
    }
    ChatMessage::new(role, parts)
}

fn request(case: &serde_json::Value) -> Request {
    let mut messages = vec![];
    if let Some(i) = case["instruction"].as_str() {
        messages.push(ChatMessage::text("system", i));
    }
    messages.push(side("query", &case["query"]));
    messages.push(side("document", &case["document"]));
    Request { messages, ..Default::default() }
}

#[test]
fn scores_match_the_official_reranker() {
    let golden = read_json(&goldens().join("tiny-rerank/scores.json"));
    let engine = Engine::load(&goldens().join("tiny-rerank/checkpoint"), EngineOptions::default()).unwrap();
    assert_eq!(engine.pooled(), Some(Pooled::Score), "not loaded as a reranker");
    let cases = golden["cases"].as_array().unwrap();
    let reqs: Vec<Request> = cases.iter().map(request).collect();
    let out = engine.pool(&reqs).unwrap();
    let mut got_scores = vec![];
    for (case, got) in cases.iter().zip(&out) {
        let name = case["case"].as_str().unwrap();
        let want = case["score"].as_f64().unwrap() as f32;
        assert_eq!(got.values.len(), 1);
        assert_eq!(got.prompt_tokens, case["ids"].as_array().unwrap().len(), "{name}: prompt length");
        let diff = (got.values[0] - want).abs();
        println!("{name}: score {:.6} (reference {want:.6}), |diff| {diff:.2e}", got.values[0]);
        assert!(diff <= 1e-3, "{name}: {} vs {want}", got.values[0]);
        got_scores.push((got.values[0], name));
    }
    // The same order as the reference's.
    let mut want_order: Vec<(f32, &str)> =
        cases.iter().map(|c| (c["score"].as_f64().unwrap() as f32, c["case"].as_str().unwrap())).collect();
    want_order.sort_by(|a, b| b.0.total_cmp(&a.0));
    got_scores.sort_by(|a, b| b.0.total_cmp(&a.0));
    assert_eq!(got_scores.iter().map(|s| s.1).collect::<Vec<_>>(), want_order.iter().map(|s| s.1).collect::<Vec<_>>());
    // A case alone scores as it did in the batch.
    let alone = engine.pool(&reqs[4..5]).unwrap();
    assert!((alone[0].values[0] - out[4].values[0]).abs() <= 1e-6);
    // The batch shared the system turn and instruction (prefilled once); each case alone,
    // prefilled whole without the prefix cache, scores the same.
    assert!(out.iter().filter(|o| o.cached_tokens >= 8).count() >= 2);
    let opts = EngineOptions { prefix_cache: false, ..Default::default() };
    let plain = Engine::load(&goldens().join("tiny-rerank/checkpoint"), opts).unwrap();
    for (r, batched) in reqs.iter().zip(&out) {
        let one = plain.pool(std::slice::from_ref(r)).unwrap();
        assert_eq!(one[0].cached_tokens, 0);
        assert!((one[0].values[0] - batched.values[0]).abs() <= 1e-5, "{} vs {}", one[0].values[0], batched.values[0]);
    }
    // It writes no text, and a request without a document is refused by name.
    let err = engine.generate(&reqs[0], &mut |_| true).unwrap_err().to_string();
    assert!(err.contains("is a reranker model"), "{err}");
    let no_doc = Request { messages: vec![ChatMessage::text("query", "q")], ..Default::default() };
    let err = engine.pool(&[no_doc]).unwrap_err().to_string();
    assert!(err.contains("inputs[0]") && err.contains("no document message"), "{err}");
}

#[test]
fn score_token_ids_are_checked_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let src = goldens().join("tiny-rerank/checkpoint");
    for e in std::fs::read_dir(&src).unwrap() {
        let e = e.unwrap();
        if e.file_name() == "1_LogitScore" {
            continue;
        }
        let to = std::fs::canonicalize(e.path()).unwrap();
        std::os::unix::fs::symlink(&to, dir.path().join(e.file_name())).unwrap();
    }
    std::fs::create_dir(dir.path().join("1_LogitScore")).unwrap();
    let cfg = dir.path().join("1_LogitScore/config.json");
    std::fs::write(&cfg, r#"{"true_token_id": 999999999, "false_token_id": 2152}"#).unwrap();
    let err = Engine::load(dir.path(), EngineOptions::default()).err().unwrap().to_string();
    assert!(err.contains("true_token_id") && err.contains("1_LogitScore/config.json"), "{err}");
    std::fs::write(&cfg, r#"{"true_token_id": 9693, "false_token_id": 9693}"#).unwrap();
    let err = Engine::load(dir.path(), EngineOptions::default()).err().unwrap().to_string();
    assert!(err.contains("false_token_id") && err.contains("constant"), "{err}");
    // Without ids the tokenizer's "yes" and "no" are taken, as the official code takes them.
    std::fs::write(&cfg, "{}").unwrap();
    let engine = Engine::load(dir.path(), EngineOptions::default()).unwrap();
    assert_eq!(engine.pooled(), Some(Pooled::Score));
}
