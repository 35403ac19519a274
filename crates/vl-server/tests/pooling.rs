//! The pooling endpoints over HTTP: `/v1/embeddings` on the tiny embedding checkpoint and
//! `/v1/rerank` and `/v1/score` on the tiny reranker answer what the pinned reference computed
//! (goldens/tiny-embed, goldens/tiny-rerank: 1e-4 per embedding component, 1e-3 per score), in
//! each of their request shapes; a chat model asked for them, or a pooling model asked for chat,
//! is refused naming its kind; bad fields are refused by name.

mod common;

use base64::Engine as _;
use common::*;
use serde_json::{json, Value};
use vl_server::ServerConfig;

fn data_url(name: &str) -> String {
    let png = std::fs::read(goldens().join("images").join(name)).unwrap();
    format!("data:image/png;base64,{}", base64::engine::general_purpose::STANDARD.encode(png))
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()
}

fn worst(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max)
}

/// The golden case named `name` of `file`.
fn case(file: &str, name: &str) -> Value {
    let all = serde_json::from_str::<Value>(&std::fs::read_to_string(goldens().join(file)).unwrap()).unwrap();
    all["cases"].as_array().unwrap().iter().find(|c| c["case"] == name).unwrap().clone()
}

#[test]
fn embeddings_in_every_input_shape_match_the_reference() {
    let s = Server::start_model("tiny-embed", ServerConfig::default());
    let text = case("tiny-embed/embeddings.json", "text");
    let instructed = case("tiny-embed/embeddings.json", "instruction");
    let image_text = case("tiny-embed/embeddings.json", "image_text");
    // A list of strings: one vector each, in order, with usage.
    let (status, r) = post(
        &s,
        "/v1/embeddings",
        &json!({"model": "tiny-embed", "input": [
        text["texts"][0], instructed["texts"][0]]}),
    );
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["object"], "list");
    assert_eq!(r["data"][0]["index"], 0);
    assert!(worst(&floats(&r["data"][0]["embedding"]), &floats(&text["embedding"])) <= 1e-4);
    let tokens = r["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
    assert!(tokens > text["ids"].as_array().unwrap().len(), "{r}");
    // Two inputs with the default instruction share its turn: prefilled once, and reported.
    let (status, r) = post(&s, "/v1/embeddings", &json!({"input": ["a cat", "a dog on a mat"]}));
    assert_eq!(status, 200, "{r}");
    assert!(r["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap() >= 16, "{r}");
    // The instruction, and one string alone.
    let (status, r) = post(
        &s,
        "/v1/embeddings",
        &json!({"input": instructed["texts"][0],
        "instruction": instructed["instruction"]}),
    );
    assert_eq!(status, 200, "{r}");
    assert!(worst(&floats(&r["data"][0]["embedding"]), &floats(&instructed["embedding"])) <= 1e-4);
    // An image and a text as one input, in the list-of-parts form and in vLLM's `messages`.
    let parts = json!([{"type": "text", "text": image_text["texts"][0]},
                       {"type": "image_url", "image_url": {"url": data_url("palette.png")}}]);
    let want = floats(&image_text["embedding"]);
    let (status, r) = post(
        &s,
        "/v1/embeddings",
        &json!({"input": [{"content": parts}],
        "instruction": image_text["instruction"]}),
    );
    assert_eq!(status, 200, "{r}");
    assert!(worst(&floats(&r["data"][0]["embedding"]), &want) <= 1e-4);
    let (status, r) = post(
        &s,
        "/v1/embeddings",
        &json!({"messages": [
        {"role": "system", "content": image_text["instruction"]}, {"role": "user", "content": parts}]}),
    );
    assert_eq!(status, 200, "{r}");
    assert!(worst(&floats(&r["data"][0]["embedding"]), &want) <= 1e-4);
    // Token ids are decoded and templated: the same vector as the text.
    let vocab =
        serde_json::from_str::<Value>(&std::fs::read_to_string(goldens().join("tokenizer/tokenizer.json")).unwrap())
            .unwrap()["model"]["vocab"]
            .clone();
    let ids = json!([vocab["Hello"], vocab["\u{120}world"]]);
    let (_, by_text) = post(&s, "/v1/embeddings", &json!({"input": "Hello world"}));
    let (status, by_ids) = post(&s, "/v1/embeddings", &json!({"input": ids}));
    assert_eq!(status, 200, "{by_ids}");
    assert!(worst(&floats(&by_ids["data"][0]["embedding"]), &floats(&by_text["data"][0]["embedding"])) <= 1e-6);
    // dimensions and base64.
    let d = text["dims"].as_u64().unwrap();
    let (status, r) =
        post(&s, "/v1/embeddings", &json!({"input": text["texts"][0], "dimensions": d, "encoding_format": "base64"}));
    assert_eq!(status, 200, "{r}");
    let bytes = base64::engine::general_purpose::STANDARD.decode(r["data"][0]["embedding"].as_str().unwrap()).unwrap();
    let got: Vec<f32> = bytes.chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    assert!(worst(&got, &floats(&text["truncated"])) <= 1e-4);
    // Refusals name the field.
    for (body, param) in [
        (json!({"input": "x", "dimensions": 100000}), "dimensions"),
        (json!({"input": "x", "encoding_format": "int8"}), "encoding_format"),
        (json!({"input": []}), "input"),
        (json!({"input": "x", "truncate": true}), "truncate"),
        (json!({"input": [[1, 999999999]]}), "input[0][1]"),
        (json!({"input": [{"content": [{"type": "audio"}]}]}), "input[0].content[0].type"),
    ] {
        let (status, r) = post(&s, "/v1/embeddings", &body);
        assert_eq!((status, r["error"]["param"].as_str()), (400, Some(param)), "{body}: {r}");
    }
    // At most 256 images and videos in one request, however the inputs split them.
    let img = json!({"type": "image_url", "image_url": {"url": data_url("square.png")}});
    let many: Vec<Value> = (0..129).map(|_| json!({"content": [img, img]})).collect();
    let (status, r) = post(&s, "/v1/embeddings", &json!({"input": many}));
    assert_eq!((status, r["error"]["param"].as_str()), (400, Some("input[128].content[0]")), "{r}");
    // Chat is refused naming the kind; /v1/models says what it serves.
    let (status, r) = post(&s, "/v1/chat/completions", &json!({"messages": [{"role": "user", "content": "hi"}]}));
    assert_eq!(status, 400, "{r}");
    assert!(r["error"]["message"].as_str().unwrap().contains("an embedding model"), "{r}");
    let (_, models) = get(&s, "/v1/models");
    assert_eq!(models["data"][0]["kind"], "embedding");
    assert!(models["data"][0]["endpoints"].as_array().unwrap().contains(&json!("/v1/embeddings")));
}

#[test]
fn rerank_and_score_match_the_reference() {
    let s = Server::start_model("tiny-rerank", ServerConfig::default());
    let text = case("tiny-rerank/scores.json", "text");
    let other = case("tiny-rerank/scores.json", "other_text");
    let image = case("tiny-rerank/scores.json", "image_doc");
    let docs = json!([
        other["document"]["texts"][0],
        {"content": [{"type": "image_url", "image_url": {"url": data_url("square.png")}}]},
        {"text": text["document"]["texts"][0]},
    ]);
    let want = [other["score"].as_f64().unwrap(), image["score"].as_f64().unwrap(), text["score"].as_f64().unwrap()];
    let (status, r) = post(
        &s,
        "/v1/rerank",
        &json!({"model": "tiny-rerank", "query": text["query"]["texts"][0],
        "documents": docs, "top_n": 2}),
    );
    assert_eq!(status, 200, "{r}");
    let results = r["results"].as_array().unwrap();
    assert_eq!(results.len(), 2, "top_n");
    let mut order: Vec<usize> = (0..3).collect();
    order.sort_by(|&a, &b| want[b].total_cmp(&want[a]));
    for (k, res) in results.iter().enumerate() {
        let i = res["index"].as_u64().unwrap() as usize;
        assert_eq!(i, order[k], "{r}");
        assert!((res["relevance_score"].as_f64().unwrap() - want[i]).abs() <= 1e-3, "{r}");
        assert!(res["document"].is_object(), "return_documents defaults to true: {r}");
    }
    assert!(r["usage"]["total_tokens"].as_u64().unwrap() > 0);
    // The instruction reaches the prompt.
    let inst = case("tiny-rerank/scores.json", "instruction");
    let (status, r) = post(
        &s,
        "/rerank",
        &json!({"query": inst["query"]["texts"][0],
        "documents": [inst["document"]["texts"][0]], "instruction": inst["instruction"], "return_documents": false}),
    );
    assert_eq!(status, 200, "{r}");
    assert!((r["results"][0]["relevance_score"].as_f64().unwrap() - inst["score"].as_f64().unwrap()).abs() <= 1e-3);
    assert!(r["results"][0].get("document").is_none(), "{r}");
    // /v1/score: one against many, in both field spellings.
    for (a, b) in [("text_1", "text_2"), ("queries", "documents")] {
        let (status, r) = post(
            &s,
            "/v1/score",
            &json!({a: text["query"]["texts"][0],
            b: [text["document"]["texts"][0], other["document"]["texts"][0]]}),
        );
        assert_eq!(status, 200, "{r}");
        assert!((r["data"][0]["score"].as_f64().unwrap() - want[2]).abs() <= 1e-3, "{r}");
        assert!((r["data"][1]["score"].as_f64().unwrap() - want[0]).abs() <= 1e-3, "{r}");
    }
    // Refusals.
    let (status, r) = post(&s, "/v1/rerank", &json!({"query": "q"}));
    assert_eq!((status, r["error"]["param"].as_str()), (400, Some("documents")), "{r}");
    let (status, r) = post(&s, "/v1/score", &json!({"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}));
    assert_eq!((status, r["error"]["param"].as_str()), (400, Some("text_1")), "{r}");
    let (status, r) = post(&s, "/v1/embeddings", &json!({"input": "x"}));
    assert_eq!(status, 400, "{r}");
    assert!(r["error"]["message"].as_str().unwrap().contains("a reranker"), "{r}");
}

#[test]
fn a_chat_model_refuses_the_pooling_endpoints_naming_its_kind() {
    let s = Server::start(ServerConfig::default());
    for path in ["/v1/embeddings", "/v1/rerank", "/v1/score"] {
        let (status, r) = post(&s, path, &json!({"input": "x", "query": "q", "documents": ["d"]}));
        assert_eq!(status, 400, "{path}: {r}");
        assert_eq!(r["error"]["code"], "wrong_model_kind", "{path}: {r}");
        assert!(r["error"]["message"].as_str().unwrap().contains("a chat model"), "{path}: {r}");
    }
    let (_, models) = get(&s, "/v1/models");
    assert_eq!(models["data"][0]["kind"], "chat");
}
