//! Anthropic's Messages API over HTTP on tiny-a: the greedy answer equals the Python reference's
//! (`goldens/tiny-a/cases/one_image.json`) whole and streamed as Anthropic's SSE events;
//! count_tokens counts the reference's prompt; errors take Anthropic's shape and name the field;
//! `x-api-key` is a key.

mod common;

use std::time::Duration;

use base64::Engine as _;
use common::*;
use serde_json::{json, Value};
use vl_server::ServerConfig;

/// The reference's case in Messages' shape: square.png, then "Describe this image.".
fn one_image(max_tokens: usize) -> Value {
    let png = std::fs::read(goldens().join("images/square.png")).unwrap();
    let data = base64::engine::general_purpose::STANDARD.encode(png);
    json!({
        "model": "tiny-a", "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
            {"type": "text", "text": "Describe this image."},
        ]}],
    })
}

#[test]
fn a_message_equals_the_reference_whole_and_streamed() {
    let s = Server::start(ServerConfig::default());
    let g = golden();
    let (status, r) = post(&s, "/v1/messages", &one_image(g.tokens));
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["type"], "message");
    assert_eq!(r["role"], "assistant");
    assert_eq!(r["content"][0], json!({"type": "text", "text": g.text}));
    assert_eq!(r["stop_reason"], "max_tokens");
    assert_eq!(r["usage"]["output_tokens"], g.tokens);
    let input = r["usage"]["input_tokens"].as_u64().unwrap() + r["usage"]["cache_read_input_tokens"].as_u64().unwrap();
    assert_eq!(input as usize, g.prompt_tokens);

    let (status, count) = post(&s, "/v1/messages/count_tokens", &one_image(1));
    assert_eq!((status, count), (200, json!({"input_tokens": g.prompt_tokens})));

    // Streamed: the events in Anthropic's order, the text deltas adding up to the reference.
    let mut body = one_image(g.tokens);
    body["stream"] = json!(true);
    let (mut events, mut text, mut stop) = (vec![], String::new(), Value::Null);
    let mut name = String::new();
    for line in post_stream(&s, "/v1/messages", &body).1 {
        if let Some(n) = line.strip_prefix("event: ") {
            name = n.to_string();
        } else if let Some(d) = line.strip_prefix("data: ") {
            let v: Value = serde_json::from_str(d).unwrap();
            assert_eq!(v["type"], name.as_str(), "{d}");
            if name == "content_block_delta" {
                text.push_str(v["delta"]["text"].as_str().unwrap());
            }
            if name == "message_delta" {
                stop = v["delta"]["stop_reason"].clone();
            }
            events.push(name.clone());
            if name == "message_stop" {
                break;
            }
        }
    }
    assert_eq!(text, g.text);
    assert_eq!(stop, "max_tokens");
    assert_eq!(events.first().map(String::as_str), Some("message_start"));
    assert_eq!(events[1], "content_block_start");
    assert_eq!(&events[events.len() - 3..], ["content_block_stop", "message_delta", "message_stop"]);
}

#[test]
fn errors_take_anthropic_s_shape_and_x_api_key_is_a_key() {
    let s = Server::start(ServerConfig { api_key: Some("k3y".into()), ..Default::default() });
    let send = |headers: &[(&str, &str)], body: &Value| {
        let mut r = agent().post(&format!("{}/v1/messages", s.base)).set("Content-Type", "application/json");
        for (k, v) in headers {
            r = r.set(k, v);
        }
        match r.timeout(Duration::from_secs(60)).send_string(&body.to_string()) {
            Ok(r) => (r.status(), json_body(r)),
            Err(ureq::Error::Status(c, r)) => (c, json_body(r)),
            Err(e) => panic!("{e}"),
        }
    };
    let ok = json!({"max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]});
    let (status, r) = send(&[], &ok);
    assert_eq!(
        (status, &r["type"], &r["error"]["type"]),
        (401, &json!("error"), &json!("authentication_error")),
        "{r}"
    );
    let (status, r) = send(&[("x-api-key", "k3y"), ("anthropic-version", "2023-06-01")], &ok);
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["usage"]["output_tokens"], 2);
    let (status, r) = send(&[("x-api-key", "k3y")], &json!({"messages": [{"role": "user", "content": "Hi"}]}));
    assert_eq!((status, &r["error"]["type"]), (400, &json!("invalid_request_error")), "{r}");
    assert!(r["error"]["message"].as_str().unwrap().contains("max_tokens"), "{r}");
}

#[test]
fn a_forced_tool_is_a_tool_use_block_and_its_result_goes_back() {
    let dir = tiny_a_with_tools();
    let s = Server::start_dir(dir.path(), "tiny-a", ServerConfig::default());
    let tools = json!([{"name": "get_weather", "description": "The weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"enum": ["Bern", "Oslo"]}}, "required": ["city"],
                         "additionalProperties": false}}]);
    let body = json!({"max_tokens": 64, "tools": tools, "tool_choice": {"type": "tool", "name": "get_weather"},
                      "messages": [{"role": "user", "content": "Weather in Bern?"}]});
    let (status, r) = post(&s, "/v1/messages", &body);
    assert_eq!(status, 200, "{r}");
    let call =
        r["content"].as_array().unwrap().iter().find(|b| b["type"] == "tool_use").expect("a tool_use block").clone();
    assert_eq!(call["name"], "get_weather");
    assert!(["Bern", "Oslo"].contains(&call["input"]["city"].as_str().unwrap()), "{r}");
    assert_eq!(r["stop_reason"], "tool_use");
    // The call and its result go back as the SDK sends them.
    let next = json!({"max_tokens": 4, "tools": tools, "messages": [
        {"role": "user", "content": "Weather in Bern?"},
        {"role": "assistant", "content": [call.clone()]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call["id"], "content": [{"type": "text", "text": "sunny"}]}]}]});
    let (status, r) = post(&s, "/v1/messages", &next);
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["usage"]["output_tokens"], 4, "{r}");
}

/// `speculative` and `forced_tokens` pass through `/v1/messages` as on chat completions: the
/// reference's greedy answer with n-gram drafts and without, forced tokens off taken, and a bad
/// method a 400 naming `speculative`.
#[test]
fn messages_take_speculative_and_forced_tokens() {
    let s = Server::start(ServerConfig::default());
    let g = golden();
    for (k, v) in [
        ("speculative", json!("off")),
        ("speculative", json!("ngram")),
        ("speculative", json!({"method": "ngram", "draft_max": 2, "ngram_min": 1})),
        ("forced_tokens", json!(false)),
    ] {
        let mut body = one_image(g.tokens);
        body[k] = v.clone();
        let (status, r) = post(&s, "/v1/messages", &body);
        assert_eq!(status, 200, "{k}: {v}: {r}");
        assert_eq!(r["content"][0], json!({"type": "text", "text": g.text}), "{k}: {v}");
    }
    for (k, bad) in [("speculative", json!({"method": "ngram", "draft_max": 0})), ("forced_tokens", json!("no"))] {
        let mut body = one_image(2);
        body[k] = bad.clone();
        let (status, e) = post(&s, "/v1/messages", &body);
        assert_eq!(status, 400, "{k}: {e}");
        assert_eq!(e["type"], "error", "{e}");
        assert!(e["error"]["message"].as_str().unwrap().contains(k), "{k}: {e}");
    }
}
