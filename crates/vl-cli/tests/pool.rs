//! `vl embed` and `vl rerank` on the tiny embedding and reranker checkpoints: the vectors and
//! scores the pinned reference computed (goldens/tiny-embed, goldens/tiny-rerank), best first;
//! a model of the wrong kind and missing inputs refused in one line, exit 1.

mod common;

use std::process::Command;

use common::{goldens, outcome};
use serde_json::Value;

fn vl(args: &[&str]) -> (i32, String, String) {
    outcome(Command::new(env!("CARGO_BIN_EXE_vl")).args(args).env("HF_HUB_OFFLINE", "1").output().unwrap())
}

fn golden(file: &str, name: &str) -> Value {
    let all: Value = serde_json::from_str(&std::fs::read_to_string(goldens().join(file)).unwrap()).unwrap();
    all["cases"].as_array().unwrap().iter().find(|c| c["case"] == name).unwrap().clone()
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()
}

#[test]
fn embed_prints_the_reference_vectors() {
    let ck = goldens().join("tiny-embed/checkpoint");
    let text = golden("tiny-embed/embeddings.json", "text");
    let image = golden("tiny-embed/embeddings.json", "image");
    let img = goldens().join("images/square.png");
    let (code, out, err) = vl(&[
        "embed",
        "--model",
        ck.to_str().unwrap(),
        "--quantize",
        "off",
        "--json",
        "--text",
        text["texts"][0].as_str().unwrap(),
        "--image",
        img.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    let body: Value = serde_json::from_str(&out).unwrap();
    for (i, want) in [&text, &image].iter().enumerate() {
        let got = floats(&body["data"][i]["embedding"]);
        let worst = got.iter().zip(floats(&want["embedding"])).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(worst <= 1e-4, "input {i}: {worst}");
    }
    assert!(err.contains("cosine similarities"), "{err}");
    // Plain output: one line of values per input; --dimensions cuts them.
    let d = text["dims"].as_u64().unwrap().to_string();
    let (code, out, err) = vl(&[
        "embed",
        "--model",
        ck.to_str().unwrap(),
        "--quantize",
        "off",
        "--dimensions",
        &d,
        "--text",
        text["texts"][0].as_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    let got: Vec<f32> = out.split_whitespace().map(|x| x.parse().unwrap()).collect();
    let worst = got.iter().zip(floats(&text["truncated"])).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(worst <= 1e-4, "{worst}");
}

#[test]
fn rerank_prints_the_reference_scores_best_first() {
    let ck = goldens().join("tiny-rerank/checkpoint");
    let text = golden("tiny-rerank/scores.json", "text");
    let other = golden("tiny-rerank/scores.json", "other_text");
    let (code, out, err) = vl(&[
        "rerank",
        "--model",
        ck.to_str().unwrap(),
        "--quantize",
        "off",
        "--json",
        "--query",
        text["query"]["texts"][0].as_str().unwrap(),
        "--doc",
        other["document"]["texts"][0].as_str().unwrap(),
        "--doc",
        text["document"]["texts"][0].as_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    let body: Value = serde_json::from_str(&out).unwrap();
    let want = [other["score"].as_f64().unwrap(), text["score"].as_f64().unwrap()];
    let best = if want[0] >= want[1] { 0 } else { 1 };
    let results = body["results"].as_array().unwrap();
    assert_eq!(results[0]["index"].as_u64(), Some(best as u64), "{body}");
    for r in results {
        let i = r["index"].as_u64().unwrap() as usize;
        assert!((r["relevance_score"].as_f64().unwrap() - want[i]).abs() <= 1e-3, "{body}");
    }
}

#[test]
fn the_wrong_kind_and_missing_inputs_are_refused_in_one_line() {
    let chat = goldens().join("tiny-a/checkpoint");
    let (code, _, err) = vl(&["embed", "--model", chat.to_str().unwrap(), "--text", "x"]);
    assert_eq!(code, 1);
    assert!(err.lines().last().unwrap().contains("is a chat model"), "{err}");
    let rerank = goldens().join("tiny-rerank/checkpoint");
    let (code, _, err) = vl(&["rerank", "--model", rerank.to_str().unwrap(), "--query", "q"]);
    assert_eq!(code, 1);
    assert!(err.contains("no documents"), "{err}");
    let embed = goldens().join("tiny-embed/checkpoint");
    let (code, _, err) = vl(&["embed", "--model", embed.to_str().unwrap(), "--text", "x", "--dimensions", "100000"]);
    assert_eq!(code, 1);
    assert!(err.contains("--dimensions 100000"), "{err}");
}
