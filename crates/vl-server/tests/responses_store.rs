//! Stored `/v1/responses` answers on tiny-a: `previous_response_id` continues a conversation
//! with the same prompt as sending it whole (and without the earlier `instructions`), `GET` and
//! `DELETE /v1/responses/{id}`, `store: false`, a server that keeps none, the opaque reasoning
//! round trip, and `truncation: "auto"` dropping the oldest turns to fit the context.

mod common;

use common::*;
use serde_json::{json, Value};
use vl_server::ServerConfig;

fn delete(s: &Server, path: &str) -> (u16, Value) {
    let resp = match agent().delete(&format!("{}{path}", s.base)).call() {
        Ok(r) => r,
        Err(ureq::Error::Status(_, r)) => r,
        Err(e) => panic!("DELETE {path}: {e}"),
    };
    (resp.status(), json_body(resp))
}

fn text_of(r: &Value) -> String {
    r["output"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|i| i["type"] == "message")
        .map(|i| i["content"][0]["text"].as_str().unwrap())
        .collect()
}

#[test]
fn previous_response_id_continues_the_stored_conversation() {
    let s = Server::start(ServerConfig::default());
    let first =
        json!({"model": "tiny-a", "instructions": "Be brief.", "input": "Name a colour.", "max_output_tokens": 6});
    let (status, a) = post(&s, "/v1/responses", &first);
    assert_eq!(status, 200, "{a}");
    assert_eq!(a["store"], true, "stored by default: {a}");
    let id = a["id"].as_str().unwrap().to_string();
    // Unguessable: 128 bits in hex, not a counter (one API key reads every stored response).
    let hex = id.strip_prefix("resp_").unwrap();
    assert!(hex.len() == 32 && hex.chars().all(|c| c.is_ascii_hexdigit()), "{id}");
    for guess in ["resp_1", "resp_0", "resp_2"] {
        assert_eq!(get(&s, &format!("/v1/responses/{guess}")).0, 404);
    }
    // Read back as it was answered.
    let (status, got) = get(&s, &format!("/v1/responses/{id}"));
    assert_eq!((status, &got), (200, &a));

    // The next turn from the stored one, against the same conversation sent whole (without the
    // first turn's instructions, which are not carried over): the same prompt, the same answer.
    let next = json!({"model": "tiny-a", "previous_response_id": id, "input": "Another?", "max_output_tokens": 6});
    let (status, b) = post(&s, "/v1/responses", &next);
    assert_eq!(status, 200, "{b}");
    assert_eq!(b["previous_response_id"], id.as_str());
    let whole = json!({"model": "tiny-a", "store": false, "max_output_tokens": 6, "input": [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": text_of(&a)},
        {"role": "user", "content": "Another?"},
    ]});
    let (status, c) = post(&s, "/v1/responses", &whole);
    assert_eq!(status, 200, "{c}");
    assert_eq!(b["usage"]["input_tokens"], c["usage"]["input_tokens"], "{b}\n{c}");
    assert_eq!(text_of(&b), text_of(&c));
    assert_eq!(c["store"], false);
    let (status, _) = get(&s, &format!("/v1/responses/{}", c["id"].as_str().unwrap()));
    assert_eq!(status, 404, "store: false keeps nothing");
    // A chain of three: the third turn sees both earlier ones.
    let third =
        json!({"model": "tiny-a", "previous_response_id": b["id"], "input": "And one more?", "max_output_tokens": 2});
    let (status, t) = post(&s, "/v1/responses", &third);
    assert_eq!(status, 200, "{t}");
    assert!(t["usage"]["input_tokens"].as_u64() > b["usage"]["input_tokens"].as_u64(), "{t}");

    // Deleted: gone for GET and for previous_response_id.
    let (status, d) = delete(&s, &format!("/v1/responses/{id}"));
    assert_eq!((status, &d), (200, &json!({"id": id, "object": "response", "deleted": true})));
    assert_eq!(get(&s, &format!("/v1/responses/{id}")).0, 404);
    assert_eq!(delete(&s, &format!("/v1/responses/{id}")).0, 404);
    let (status, e) = post(&s, "/v1/responses", &next);
    assert_eq!((status, &e["error"]["param"]), (400, &json!("previous_response_id")), "{e}");
}

#[test]
fn a_server_that_keeps_no_responses_refuses_store_true() {
    let s = Server::start(ServerConfig { responses_store_bytes: 0, ..Default::default() });
    let body = json!({"model": "tiny-a", "input": "Hi", "max_output_tokens": 2});
    let (status, r) = post(&s, "/v1/responses", &body);
    assert_eq!((status, &r["store"]), (200, &json!(false)), "{r}");
    let mut asked = body.clone();
    asked["store"] = json!(true);
    let (status, e) = post(&s, "/v1/responses", &asked);
    assert_eq!((status, &e["error"]["param"]), (400, &json!("store")), "{e}");
}

#[test]
fn reasoning_round_trips_as_opaque_content() {
    let s = Server::start_model("tiny-q35", ServerConfig::default());
    let body = json!({"model": "tiny-q35", "input": "Hi", "max_output_tokens": 24, "store": false,
                      "reasoning": {"effort": "none"}, "include": ["reasoning.encrypted_content"]});
    let (status, r) = post(&s, "/v1/responses", &body);
    assert_eq!(status, 200, "{r}");
    let item =
        r["output"].as_array().unwrap().iter().find(|i| i["type"] == "reasoning").expect("a reasoning item").clone();
    let sealed = item["encrypted_content"].as_str().expect("encrypted_content").to_string();
    // Sent back alone (no text), it is the same reasoning as sent back with its text.
    let turn = |reasoning: Value| {
        json!({"model": "tiny-q35", "store": false, "max_output_tokens": 1, "input": [
            {"role": "user", "content": "Hi"}, reasoning,
            {"role": "assistant", "content": text_of(&r)}, {"role": "user", "content": "Again"}]})
    };
    let opaque =
        post(&s, "/v1/responses", &turn(json!({"type": "reasoning", "summary": [], "encrypted_content": sealed})));
    let plain =
        post(&s, "/v1/responses", &turn(json!({"type": "reasoning", "summary": [], "content": item["content"]})));
    assert_eq!(opaque.0, 200, "{}", opaque.1);
    assert_eq!(opaque.1["usage"]["input_tokens"], plain.1["usage"]["input_tokens"]);
    let (status, e) =
        post(&s, "/v1/responses", &turn(json!({"type": "reasoning", "summary": [], "encrypted_content": "junk"})));
    assert_eq!((status, &e["error"]["param"]), (400, &json!("input[1].encrypted_content")), "{e}");
    let mut other = body.clone();
    other["include"] = json!(["file_search_call.results"]);
    assert_eq!(post(&s, "/v1/responses", &other).1["error"]["param"], "include[0]");
}

#[test]
fn truncation_auto_drops_the_oldest_turns_to_fit() {
    let s = Server::start(ServerConfig::default());
    // Three long turns (about 600 tokens each) and a short last one: over tiny-a's 2048.
    let long = "alpha beta gamma delta ".repeat(150);
    let mut input = vec![];
    for i in 0..3 {
        input.push(json!({"role": "user", "content": format!("{i}: {long}")}));
        input.push(json!({"role": "assistant", "content": format!("{i}: {long}")}));
    }
    input.push(json!({"role": "user", "content": "Sum it up."}));
    let body = |truncation: &str| json!({"model": "tiny-a", "store": false, "max_output_tokens": 2, "truncation": truncation, "input": input});
    let (status, e) = post(&s, "/v1/responses", &body("disabled"));
    assert_eq!(status, 400, "over the context: {e}");
    let (status, r) = post(&s, "/v1/responses", &body("auto"));
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["truncation"], "auto");
    let dropped = r["truncated_input_messages"].as_u64().unwrap();
    // Whole turns (a user message and its answer) go, oldest first: 2 or 4 messages.
    assert!(dropped == 2 || dropped == 4, "{r}");
    assert!(r["usage"]["input_tokens"].as_u64().unwrap() < 2048);
    // The same request with those turns left out by the client: the same prompt.
    let kept: Vec<Value> = input[dropped as usize..].to_vec();
    let (_, same) =
        post(&s, "/v1/responses", &json!({"model": "tiny-a", "store": false, "max_output_tokens": 2, "input": kept}));
    assert_eq!(same["usage"]["input_tokens"], r["usage"]["input_tokens"]);
}

/// `top_logprobs` (and `include: ["message.output_text.logprobs"]`): the answer's
/// log-probabilities on its `output_text`, equal to chat completions' for the same request,
/// whole and streamed.
#[test]
fn top_logprobs_fill_the_output_text() {
    let s = Server::start(ServerConfig::default());
    let body = json!({"model": "tiny-a", "input": "Name a colour.", "max_output_tokens": 5, "store": false, "top_logprobs": 3});
    let (status, r) = post(&s, "/v1/responses", &body);
    assert_eq!(status, 200, "{r}");
    let lps = r["output"][0]["content"][0]["logprobs"].as_array().unwrap().clone();
    assert_eq!(lps.len(), 5, "{r}");
    assert!(lps.iter().all(|e| e["top_logprobs"].as_array().unwrap().len() == 3), "{r}");
    let chat = json!({"model": "tiny-a", "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 5,
                      "logprobs": true, "top_logprobs": 3});
    let (_, c) = post(&s, "/v1/chat/completions", &chat);
    // The same tokens and alternatives; the values within 1e-3 (the chat request's prompt may
    // come partly from the prefix cache, a different order of sums).
    let close = |a: &[Value], b: &[Value]| {
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(b) {
            assert_eq!((&x["token"], &x["bytes"]), (&y["token"], &y["bytes"]));
            assert!((x["logprob"].as_f64().unwrap() - y["logprob"].as_f64().unwrap()).abs() < 1e-3, "{x} {y}");
            let (tx, ty) = (x["top_logprobs"].as_array().unwrap(), y["top_logprobs"].as_array().unwrap());
            assert_eq!(
                tx.iter().map(|t| &t["token"]).collect::<Vec<_>>(),
                ty.iter().map(|t| &t["token"]).collect::<Vec<_>>()
            );
        }
    };
    close(&lps, c["choices"][0]["logprobs"]["content"].as_array().unwrap());
    // Streamed: the deltas' entries add up to the same.
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    let text =
        agent().post(&format!("{}/v1/responses", s.base)).send_string(&sb.to_string()).unwrap().into_string().unwrap();
    let mut streamed = vec![];
    for d in text.lines().filter_map(|l| l.strip_prefix("data: ")) {
        let e: Value = serde_json::from_str(d).unwrap();
        if e["type"] == "response.output_text.delta" {
            streamed.extend(e["logprobs"].as_array().unwrap().iter().cloned());
        }
    }
    close(&streamed, &lps);
    let mut inc = body.clone();
    inc.as_object_mut().unwrap().remove("top_logprobs");
    inc["include"] = json!(["message.output_text.logprobs"]);
    let (_, r) = post(&s, "/v1/responses", &inc);
    assert_eq!(r["output"][0]["content"][0]["logprobs"].as_array().unwrap().len(), 5, "{r}");
}

/// The chat endpoint's extensions pass through `/v1/responses`: a grammar field holds the
/// answer, the samplers are taken, and two constraints at once are refused naming both.
#[test]
fn responses_take_the_grammar_fields_and_samplers() {
    let s = Server::start(ServerConfig::default());
    let body = json!({"model": "tiny-a", "input": "Pick one.", "max_output_tokens": 8, "store": false,
                      "temperature": 1.0, "seed": 2, "dry_multiplier": 0.5, "top_n_sigma": 2.0,
                      "structured_outputs": {"choice": ["left", "right", "up"]}});
    let (status, r) = post(&s, "/v1/responses", &body);
    assert_eq!(status, 200, "{r}");
    assert!(["left", "right", "up"].contains(&text_of(&r).as_str()), "{r}");
    let mut both = body.clone();
    both["text"] = json!({"format": {"type": "json_object"}});
    let (status, e) = post(&s, "/v1/responses", &both);
    assert_eq!(status, 400, "{e}");
    let m = e["error"]["message"].as_str().unwrap();
    assert!(m.contains("structured_outputs") && m.contains("text.format"), "{m}");
}

/// `speculative` and `forced_tokens` pass through `/v1/responses` as on chat completions: the
/// reference's greedy answer (square.png, "Describe this image.") with n-gram drafts and
/// without, forced tokens off taken, and a bad method a 400 naming `speculative`.
#[test]
fn responses_take_speculative_and_forced_tokens() {
    use base64::Engine as _;
    let s = Server::start(ServerConfig::default());
    let g = golden();
    let png = std::fs::read(goldens().join("images/square.png")).unwrap();
    let url = format!("data:image/png;base64,{}", base64::engine::general_purpose::STANDARD.encode(png));
    let body = json!({"model": "tiny-a", "max_output_tokens": g.tokens, "store": false, "input": [
    {"role": "user", "content": [
        {"type": "input_image", "image_url": url},
        {"type": "input_text", "text": "Describe this image."},
    ]}]});
    for (k, v) in [
        ("speculative", json!("off")),
        ("speculative", json!("ngram")),
        ("speculative", json!({"method": "ngram", "draft_max": 2, "ngram_min": 1})),
        ("forced_tokens", json!(false)),
    ] {
        let mut b = body.clone();
        b[k] = v.clone();
        let (status, r) = post(&s, "/v1/responses", &b);
        assert_eq!(status, 200, "{k}: {v}: {r}");
        assert_eq!(text_of(&r), g.text, "{k}: {v}");
    }
    for (k, bad) in [("speculative", json!("eagle")), ("forced_tokens", json!(1))] {
        let mut b = body.clone();
        b[k] = bad.clone();
        let (status, e) = post(&s, "/v1/responses", &b);
        assert_eq!(status, 400, "{k}: {e}");
        assert!(e["error"]["message"].as_str().unwrap().contains(k), "{k}: {e}");
    }
}
