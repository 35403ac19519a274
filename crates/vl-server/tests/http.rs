//! The server as a library, end to end: an `Engine` over the tiny checkpoint `goldens/tiny-a`,
//! `vl_server::serve_until` on a free loopback port, driven over HTTP with a plain client
//! (ureq). The greedy answer equals the Python reference's (`goldens/tiny-a/cases`), as
//! `crates/vl-cli/tests/serve.rs` checks it through the `vl` binary. Every request has a timeout;
//! each server stops when its test drops it, within a short shutdown bound.

mod common;

use std::time::Duration;

use base64::Engine as _;
use common::*;
use serde_json::{json, Value};
use vl_server::ServerConfig;

/// The reference's case: square.png and "Describe this image.", `max_tokens` tokens.
fn one_image(max_tokens: usize) -> Value {
    let png = std::fs::read(goldens().join("images/square.png")).unwrap();
    let url = format!("data:image/png;base64,{}", base64::engine::general_purpose::STANDARD.encode(png));
    json!({
        "model": "tiny-a",
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": "Describe this image."},
        ]}],
        "max_tokens": max_tokens,
    })
}

#[test]
fn health_and_models_list_the_id_then_the_aliases() {
    let s = Server::start(ServerConfig { aliases: vec!["gpt-4o-mini".into()], ..Default::default() });
    assert_eq!(get(&s, "/health"), (200, json!({"status": "ok"})));
    let (status, models) = get(&s, "/v1/models");
    assert_eq!(status, 200, "{models}");
    assert_eq!(models["object"], "list");
    let ids: Vec<&Value> = models["data"].as_array().unwrap().iter().map(|m| &m["id"]).collect();
    assert_eq!(ids, [&json!("tiny-a"), &json!("gpt-4o-mini")]);
    assert_eq!(models["data"][0]["object"], "model");
    assert!(models["data"][0]["context_length"].as_u64().unwrap() > 0, "{models}");
    let (status, alias) = get(&s, "/v1/models/gpt-4o-mini");
    assert_eq!((status, &alias["id"]), (200, &json!("gpt-4o-mini")));
    let (status, missing) = get(&s, "/v1/models/nothing");
    assert_eq!((status, &missing["error"]["code"]), (404, &json!("model_not_found")));
}

#[test]
fn a_greedy_answer_equals_the_reference() {
    let s = Server::start(ServerConfig::default());
    let want = golden();
    let (status, v) = post(&s, "/v1/chat/completions", &one_image(want.tokens));
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], "tiny-a");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["choices"][0]["message"]["content"], want.text.as_str());
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["prompt_tokens"], want.prompt_tokens);
    assert_eq!(v["usage"]["completion_tokens"], want.tokens);
    assert_eq!(v["usage"]["total_tokens"], want.prompt_tokens + want.tokens);
    // square.png, 128x128: 8x8 patches merged 2x2.
    assert_eq!(v["usage"]["prompt_tokens_details"]["image_tokens"], 16);
    let metrics = agent().get(&format!("{}/metrics", s.base)).call().unwrap().into_string().unwrap();
    assert!(metrics.contains("vl_requests_total{status=\"200\"} 1"), "{metrics}");
    assert!(metrics.contains(&format!("vl_completion_tokens_total {}", want.tokens)), "{metrics}");
}

#[test]
fn a_bad_field_is_a_400_naming_it_in_param() {
    let s = Server::start(ServerConfig::default());
    let mut body = one_image(2);
    body["temperature"] = json!(3.5);
    let (status, v) = post(&s, "/v1/chat/completions", &body);
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    assert_eq!(v["error"]["param"], "temperature", "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("temperature"), "{v}");
    // The server goes on answering.
    assert_eq!(get(&s, "/health").0, 200);
}

#[test]
fn a_streamed_answer_adds_up_to_the_reference() {
    let s = Server::start(ServerConfig::default());
    let want = golden();
    let mut body = one_image(want.tokens);
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let (kind, stream) = post_stream(&s, "/v1/chat/completions", &body);
    assert_eq!(kind.as_deref(), Some("text/event-stream"));
    let mut lines = vec![];
    for line in stream {
        if let Some(d) = line.strip_prefix("data: ") {
            lines.push(d.to_string());
            if d == "[DONE]" {
                break;
            }
        }
    }
    assert_eq!(lines.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = lines[..lines.len() - 1].iter().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert!(chunks.iter().all(|c| c["object"] == "chat.completion.chunk"));
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(text, want.text);
    let finish: Vec<&Value> =
        chunks.iter().map(|c| &c["choices"][0]["finish_reason"]).filter(|f| !f.is_null()).collect();
    assert_eq!(finish, [&json!("length")]);
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(usage["prompt_tokens"], want.prompt_tokens);
    assert_eq!(usage["completion_tokens"], want.tokens);
}

#[test]
fn the_server_stops_when_told_and_frees_its_port() {
    let mut s = Server::start(ServerConfig { ui: false, ..Default::default() });
    assert_eq!(get(&s, "/health").0, 200);
    // Without the web chat, `/` is no route.
    assert_eq!(get(&s, "/").0, 404);
    s.stop().expect("a clean stop");
    let addr = s.base.trim_start_matches("http://");
    assert!(std::net::TcpStream::connect_timeout(&addr.parse().unwrap(), Duration::from_secs(2)).is_err());
}

/// A thinking model's reasoning budget over HTTP, on the tiny Qwen3.5 (its template opens the
/// block): `reasoning_budget` 3 gives 3 tokens of reasoning, then the block is closed and the
/// answer follows as content; OpenAI's `reasoning_effort` "none" closes it at once; Anthropic's
/// `thinking.budget_tokens` and the Responses API's `reasoning.effort` are the same budget; an
/// unknown effort is a 400 naming the field.
#[test]
fn a_reasoning_budget_closes_the_thinking_block() {
    let s = Server::start_dir(&goldens().join("tiny-q35/checkpoint"), "tiny-q35", ServerConfig::default());
    let ask = |extra: Value| {
        let mut body = json!({"model": "tiny-q35", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 12});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        post(&s, "/v1/chat/completions", &body)
    };
    let (status, free) = ask(json!({}));
    assert_eq!(status, 200, "{free}");
    assert!(free["choices"][0]["message"]["content"].is_null() || free["choices"][0]["message"]["content"] == "");
    let (status, v) = ask(json!({"reasoning_budget": 3}));
    assert_eq!(status, 200, "{v}");
    let m = &v["choices"][0]["message"];
    assert!(m["reasoning_content"].as_str().is_some_and(|r| !r.is_empty()), "{v}");
    assert!(m["content"].as_str().is_some_and(|c| !c.is_empty()), "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 12, "{v}");
    let (status, v) = ask(json!({"reasoning_effort": "none"}));
    assert_eq!(status, 200, "{v}");
    assert!(v["choices"][0]["message"]["content"].as_str().is_some_and(|c| !c.is_empty()), "{v}");
    let (status, v) = ask(json!({"reasoning_effort": "extreme"}));
    assert_eq!((status, &v["error"]["param"]), (400, &json!("reasoning_effort")), "{v}");
    let (status, v) = ask(json!({"reasoning_effort": "low", "reasoning_budget": 3}));
    assert_eq!(status, 400, "{v}");
    // The Responses API's `reasoning.effort`: the same mapping ("none": closed at once, so the
    // answer is a message after an empty reasoning item).
    let (status, v) = post(
        &s,
        "/v1/responses",
        &json!({"model": "tiny-q35", "input": "Hi", "max_output_tokens": 12, "store": false, "reasoning": {"effort": "none"}}),
    );
    assert_eq!(status, 200, "{v}");
    let text =
        v["output"].as_array().unwrap().iter().find(|i| i["type"] == "message").map(|i| &i["content"][0]["text"]);
    assert!(text.and_then(Value::as_str).is_some_and(|t| !t.is_empty()), "{v}");
    let (status, v) = post(
        &s,
        "/v1/responses",
        &json!({"model": "tiny-q35", "input": "Hi", "max_output_tokens": 12, "store": false, "reasoning": {"effort": "max"}}),
    );
    assert_eq!((status, &v["error"]["param"]), (400, &json!("reasoning.effort")), "{v}");
    let anthropic = json!({"model": "tiny-q35", "max_tokens": 12, "messages": [{"role": "user", "content": "Hi"}],
        "thinking": {"type": "enabled", "budget_tokens": 3}});
    let (status, v) = post(&s, "/v1/messages", &anthropic);
    assert_eq!(status, 200, "{v}");
    let kinds: Vec<&str> = v["content"].as_array().unwrap().iter().map(|b| b["type"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["thinking", "text"], "{v}");
}

/// llama-server's samplers by its field names: top-n-sigma and XTC answered (a top-n-sigma of 0.01
/// keeps only the top token: the answer is the greedy one whatever the temperature), and a value
/// out of range is a 400 naming the field.
#[test]
fn top_n_sigma_and_xtc_are_taken_by_their_llama_server_names() {
    let s = Server::start(ServerConfig::default());
    let want = golden();
    let mut body = one_image(want.tokens);
    body["temperature"] = json!(1.5);
    body["seed"] = json!(3);
    body["top_n_sigma"] = json!(0.01);
    let (status, v) = post(&s, "/v1/chat/completions", &body);
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], want.text.as_str(), "{v}");
    let mut body = one_image(4);
    body["temperature"] = json!(1.0);
    body["xtc_probability"] = json!(0.5);
    body["xtc_threshold"] = json!(0.2);
    assert_eq!(post(&s, "/v1/chat/completions", &body).0, 200);
    for (field, value) in [("xtc_probability", json!(2.0)), ("xtc_threshold", json!(0.0)), ("top_n_sigma", json!(-1))] {
        let mut body = one_image(2);
        body[field] = value;
        let (status, v) = post(&s, "/v1/chat/completions", &body);
        assert_eq!((status, &v["error"]["param"]), (400, &json!(field)), "{v}");
    }
}

/// llama-server's DRY fields reach the sampler: a strong penalty without breakers changes the
/// reference's greedy answer (which repeats itself), a seeded DRY answer is the same twice, and
/// a value out of range is a 400 naming the field.
#[test]
fn mirostat_is_taken_by_its_llama_server_names() {
    // A server whose defaults sample with top-k and top-p (as `--sampling model` sets them):
    // mirostat drops them unless the request sets one, which is refused by name.
    let defaults = vl_models::sampling::GenerationOptions { top_k: 20, top_p: 0.8, ..Default::default() };
    let s = Server::start(ServerConfig { defaults, ..ServerConfig::default() });
    let want = golden();
    // At a target of 0.01 bits of surprise only the likeliest token is a candidate: the
    // reference's greedy answer, at temperature 1; the same request without mirostat samples
    // something else.
    let mut body = one_image(want.tokens);
    body["temperature"] = json!(1.0);
    body["seed"] = json!(11);
    let (status, v) = post(&s, "/v1/chat/completions", &body);
    assert_eq!(status, 200, "{v}");
    assert_ne!(v["choices"][0]["message"]["content"], want.text.as_str(), "{v}");
    body["mirostat"] = json!(2);
    body["mirostat_tau"] = json!(0.01);
    body["mirostat_eta"] = json!(0.01);
    let (status, v) = post(&s, "/v1/chat/completions", &body);
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], want.text.as_str(), "{v}");

    let mut body = one_image(8);
    body["temperature"] = json!(1.0);
    body["seed"] = json!(11);
    body["mirostat"] = json!(2);
    body["mirostat_tau"] = json!(4.0);
    body["mirostat_eta"] = json!(0.2);
    let first = post(&s, "/v1/chat/completions", &body);
    assert_eq!(first.0, 200, "{}", first.1);
    // Seeded: the same answer again.
    assert_eq!(post(&s, "/v1/chat/completions", &body).1["choices"], first.1["choices"]);
    // Mirostat 1 as well.
    body["mirostat"] = json!(1);
    assert_eq!(post(&s, "/v1/chat/completions", &body).0, 200);
    for (field, value, param) in [
        ("top_p", json!(0.9), "mirostat"),
        ("mirostat", json!(3), "mirostat"),
        ("mirostat_tau", json!(0.0), "mirostat_tau"),
        ("mirostat_eta", json!(1.5), "mirostat_eta"),
    ] {
        let mut body = body.clone();
        body[field] = value;
        let (status, v) = post(&s, "/v1/chat/completions", &body);
        assert_eq!((status, &v["error"]["param"]), (400, &json!(param)), "{field}: {v}");
    }
}

#[test]
fn dry_is_taken_by_its_llama_server_names() {
    let s = Server::start(ServerConfig::default());
    let want = golden();
    let mut body = one_image(want.tokens);
    body["dry_multiplier"] = json!(50.0);
    body["dry_allowed_length"] = json!(2);
    body["dry_sequence_breakers"] = json!([]);
    let (status, v) = post(&s, "/v1/chat/completions", &body);
    assert_eq!(status, 200, "{v}");
    assert_ne!(v["choices"][0]["message"]["content"], want.text.as_str(), "{v}");
    body["temperature"] = json!(1.0);
    body["top_k"] = json!(2);
    body["seed"] = json!(5);
    body["dry_multiplier"] = json!(1.5);
    body["dry_base"] = json!(2.0);
    body["dry_penalty_last_n"] = json!(64);
    body["dry_sequence_breakers"] = json!(["\n", "."]);
    let first = post(&s, "/v1/chat/completions", &body);
    assert_eq!(first.0, 200, "{}", first.1);
    assert_eq!(post(&s, "/v1/chat/completions", &body).1["choices"], first.1["choices"]);
    for (field, value) in [
        ("dry_multiplier", json!(-1.0)),
        ("dry_base", json!(0.5)),
        ("dry_allowed_length", json!(0)),
        ("dry_penalty_last_n", json!(-2)),
        ("dry_sequence_breakers", json!([""])),
    ] {
        let mut body = one_image(2);
        body["dry_multiplier"] = json!(1.0);
        body[field] = value;
        let (status, v) = post(&s, "/v1/chat/completions", &body);
        assert_eq!((status, &v["error"]["param"]), (400, &json!(field)), "{v}");
    }
}

#[test]
fn speculative_and_forced_tokens_are_request_fields() {
    // A server whose default drafts n-grams: the answer is the reference's, with the request's
    // own `speculative` or without; bad values are 400s naming the field.
    let mut defaults = vl_models::sampling::GenerationOptions::default();
    defaults.speculative.method = vl_models::speculative::Method::Ngram;
    let s = Server::start(ServerConfig { defaults, ..ServerConfig::default() });
    let want = golden();
    for spec in [
        None,
        Some(json!("off")),
        Some(json!("ngram")),
        Some(json!({"method": "ngram", "draft_max": 3, "ngram_min": 1})),
    ] {
        let mut body = one_image(want.tokens);
        if let Some(v) = &spec {
            body["speculative"] = v.clone();
        }
        let (status, v) = post(&s, "/v1/chat/completions", &body);
        assert_eq!(status, 200, "{spec:?}: {v}");
        assert_eq!(v["choices"][0]["message"]["content"], want.text.as_str(), "{spec:?}");
    }
    // A JSON answer with and without forced tokens: valid either way.
    for forced in [true, false] {
        let mut body = one_image(60);
        body["forced_tokens"] = json!(forced);
        body["response_format"] = json!({"type": "json_schema", "json_schema": {"name": "k", "schema":
            {"type": "object", "properties": {"kind": {"enum": ["a_long_value_name", "another_one"]}},
             "required": ["kind"], "additionalProperties": false}}});
        let (status, v) = post(&s, "/v1/chat/completions", &body);
        assert_eq!(status, 200, "{v}");
        let answer: Value = serde_json::from_str(v["choices"][0]["message"]["content"].as_str().unwrap()).unwrap();
        assert!(["a_long_value_name", "another_one"].contains(&answer["kind"].as_str().unwrap()), "{answer}");
    }
    for bad in [
        json!("eagle"),
        json!("draft"),
        json!("mtp"),
        json!(7),
        json!({"method": "ngram", "draft_max": 0}),
        json!({"method": "ngram", "ngram_min": 9}),
        json!({"window": 3}),
    ] {
        let mut body = one_image(2);
        body["speculative"] = bad.clone();
        let (status, v) = post(&s, "/v1/chat/completions", &body);
        assert_eq!((status, &v["error"]["param"]), (400, &json!("speculative")), "{bad}: {v}");
    }
    let mut body = one_image(2);
    body["forced_tokens"] = json!("yes");
    assert_eq!(post(&s, "/v1/chat/completions", &body).0, 400);
    let metrics = agent().get(&format!("{}/metrics", s.base)).call().unwrap().into_string().unwrap();
    let value = |name: &str| -> u64 {
        let line = metrics.lines().find(|l| l.starts_with(name)).unwrap_or_else(|| panic!("{name}: {metrics}"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    };
    assert!(value("vl_draft_tokens ") >= value("vl_accepted_draft_tokens "), "{metrics}");
    assert!(value("vl_forced_tokens ") > 0, "{metrics}");
    let (_, models) = get(&s, "/v1/models");
    assert_eq!(models["data"][0]["speculative"], json!(["off", "ngram"]), "{models}");
}

#[test]
fn a_server_with_a_draft_model_drafts_when_asked() {
    // tiny-b drafts for tiny-a: the answer is the reference's, streamed or whole.
    let ck = |g: &str| goldens().join(g).join("checkpoint");
    let engine = vl_models::engine::Engine::builder(ck("tiny-a")).draft_model(ck("tiny-b")).build().unwrap();
    let s = Server::start_engine(engine, "tiny-a", ServerConfig::default());
    let want = golden();
    for spec in [json!("draft"), json!({"method": "draft", "draft_max": 6}), json!("off")] {
        let mut body = one_image(want.tokens);
        body["speculative"] = spec.clone();
        let (status, v) = post(&s, "/v1/chat/completions", &body);
        assert_eq!(status, 200, "{spec}: {v}");
        assert_eq!(v["choices"][0]["message"]["content"], want.text.as_str(), "{spec}");
        body["stream"] = json!(true);
        assert_eq!(streamed_text(&s, &body), want.text, "{spec} streamed");
    }
    let (_, models) = get(&s, "/v1/models");
    assert_eq!(models["data"][0]["speculative"], json!(["off", "ngram", "draft"]), "{models}");
    let metrics = agent().get(&format!("{}/metrics", s.base)).call().unwrap().into_string().unwrap();
    assert!(metrics.lines().any(|l| l.starts_with("vl_draft_tokens ") && !l.ends_with(" 0")), "{metrics}");
}

#[test]
fn a_qwen35_server_drafts_with_its_own_head_when_asked() {
    // tiny-q35 carries an `mtp.*` head: `speculative: "mtp"` drafts with it and the answer is the
    // one without, streamed or whole.
    let ck = goldens().join("tiny-q35").join("checkpoint");
    let engine = vl_models::engine::Engine::builder(ck).build().unwrap();
    let s = Server::start_engine(engine, "tiny-q35", ServerConfig::default());
    let body = json!({"model": "tiny-q35", "max_tokens": 24, "temperature": 0,
                      "messages": [{"role": "user", "content": "Name three colours."}]});
    let (status, off) = post(&s, "/v1/chat/completions", &body);
    assert_eq!(status, 200, "{off}");
    let want = off["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    for spec in [json!("mtp"), json!({"method": "mtp", "draft_max": 3})] {
        let mut body = body.clone();
        body["speculative"] = spec.clone();
        let (status, v) = post(&s, "/v1/chat/completions", &body);
        assert_eq!(status, 200, "{spec}: {v}");
        assert_eq!(v["choices"][0]["message"]["content"], want.as_str(), "{spec}");
        body["stream"] = json!(true);
        assert_eq!(streamed_text(&s, &body), want, "{spec} streamed");
    }
    let (_, models) = get(&s, "/v1/models");
    assert_eq!(models["data"][0]["speculative"], json!(["off", "ngram", "mtp"]), "{models}");
    let metrics = agent().get(&format!("{}/metrics", s.base)).call().unwrap().into_string().unwrap();
    assert!(metrics.lines().any(|l| l.starts_with("vl_draft_tokens ") && !l.ends_with(" 0")), "{metrics}");
}

/// The content of a streamed chat answer to `body` (its `stream` set), the deltas joined.
fn streamed_text(s: &Server, body: &Value) -> String {
    let mut text = String::new();
    for line in post_stream(s, "/v1/chat/completions", body).1 {
        match line.strip_prefix("data: ") {
            Some("[DONE]") => break,
            Some(d) => {
                let c: Value = serde_json::from_str(d).unwrap();
                text.push_str(c["choices"][0]["delta"]["content"].as_str().unwrap_or(""));
            }
            None => {}
        }
    }
    text
}

/// Tool calls over HTTP on the tiny Qwen3.5, whose template writes them in its XML form
/// (`<tool_call>` `<function=NAME>` `<parameter=P>`): with `tool_choice` required and named, whole
/// and streamed, greedy and sampled, the answer is an OpenAI `tool_calls` list whose arguments
/// hold to the function's parameters; streamed, the deltas add up to the whole answer's call.
#[test]
fn qwen35_xml_tool_calls_are_openai_tool_calls_whole_and_streamed() {
    let s = Server::start_dir(&goldens().join("tiny-q35/checkpoint"), "tiny-q35", ServerConfig::default());
    let params = json!({"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["city", "days"], "additionalProperties": false});
    let tools = json!([
        {"type": "function", "function": {"name": "get_weather", "description": "A forecast.", "parameters": params}},
        {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
    ]);
    let valid = |name: &str, args: &str, at: &str| {
        let a: Value = serde_json::from_str(args).unwrap_or_else(|e| panic!("{at}: {args:?}: {e}"));
        if name == "get_weather" {
            assert!(a["city"].as_str().is_some_and(|c| c.chars().count() <= 12), "{at}: {a}");
            assert!(a["days"].as_i64().is_some_and(|d| (1..=9).contains(&d)), "{at}: {a}");
            assert_eq!(a.as_object().unwrap().len(), 2, "{at}: {a}");
        } else {
            assert_eq!(name, "get_time", "{at}");
        }
    };
    for (choice, sample) in [
        (json!("required"), None),
        (json!({"type": "function", "function": {"name": "get_weather"}}), None),
        (json!({"type": "function", "function": {"name": "get_weather"}}), Some(5)),
    ] {
        let mut body = json!({"model": "tiny-q35", "max_tokens": 96, "tools": tools, "tool_choice": choice,
            "chat_template_kwargs": {"enable_thinking": false},
            "messages": [{"role": "user", "content": "What is the weather in Oslo for three days?"}]});
        if let Some(seed) = sample {
            body["temperature"] = json!(1.0);
            body["seed"] = json!(seed);
        }
        let at = format!("{choice} {sample:?}");
        let (status, v) = post(&s, "/v1/chat/completions", &body);
        assert_eq!(status, 200, "{at}: {v}");
        let choice0 = &v["choices"][0];
        assert_eq!(choice0["finish_reason"], "tool_calls", "{at}: {v}");
        let calls = choice0["message"]["tool_calls"].as_array().unwrap_or_else(|| panic!("{at}: {v}"));
        assert!(!calls.is_empty(), "{at}: {v}");
        for c in calls {
            assert_eq!(c["type"], "function", "{at}: {c}");
            assert!(c["id"].as_str().is_some_and(|i| !i.is_empty()), "{at}: {c}");
            let name = c["function"]["name"].as_str().unwrap();
            if body["tool_choice"].is_object() {
                assert_eq!(name, "get_weather", "{at}");
            }
            valid(name, c["function"]["arguments"].as_str().unwrap(), &at);
        }
        // Streamed: the call's name once, its arguments in pieces adding up to the whole answer's.
        body["stream"] = json!(true);
        let (mut names, mut args, mut finish) = (Vec::<String>::new(), Vec::<String>::new(), Value::Null);
        for line in post_stream(&s, "/v1/chat/completions", &body).1 {
            let Some(d) = line.strip_prefix("data: ") else { continue };
            if d == "[DONE]" {
                break;
            }
            let chunk: Value = serde_json::from_str(d).unwrap();
            let c = &chunk["choices"][0];
            if !c["finish_reason"].is_null() {
                finish = c["finish_reason"].clone();
            }
            for t in c["delta"]["tool_calls"].as_array().into_iter().flatten() {
                let i = t["index"].as_u64().unwrap() as usize;
                if i == names.len() {
                    names.push(String::new());
                    args.push(String::new());
                }
                names[i].push_str(t["function"]["name"].as_str().unwrap_or(""));
                args[i].push_str(t["function"]["arguments"].as_str().unwrap_or(""));
            }
        }
        assert_eq!(finish, "tool_calls", "{at}");
        let whole: Vec<(String, String)> = calls
            .iter()
            .map(|c| {
                (c["function"]["name"].as_str().unwrap().into(), c["function"]["arguments"].as_str().unwrap().into())
            })
            .collect();
        let streamed: Vec<(String, String)> = names.into_iter().zip(args).collect();
        assert_eq!(streamed, whole, "{at}");
    }
}

/// An image request over HTTP on the tiny Qwen3.5 (its template opens the reasoning block, and
/// random weights never close it): the reasoning is the reference's greedy text for square.png,
/// the prompt its token count; with `logprobs`, one entry a generated token, each greedy token
/// the most likely of its `top_logprobs`.
#[test]
fn a_qwen35_image_request_answers_the_reference_with_logprobs() {
    let s = Server::start_dir(&goldens().join("tiny-q35/checkpoint"), "tiny-q35", ServerConfig::default());
    let meta: Value =
        serde_json::from_str(&std::fs::read_to_string(goldens().join("tiny-q35/cases/one_image.json")).unwrap())
            .unwrap();
    let n = meta["greedy"]["ids"].as_array().unwrap().len();
    let mut body = one_image(n);
    body["model"] = json!("tiny-q35");
    body["logprobs"] = json!(true);
    body["top_logprobs"] = json!(3);
    let (status, v) = post(&s, "/v1/chat/completions", &body);
    assert_eq!(status, 200, "{v}");
    let m = &v["choices"][0]["message"];
    assert_eq!(m["reasoning_content"], meta["greedy"]["text"], "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], meta["num_tokens"], "{v}");
    assert_eq!(v["usage"]["completion_tokens"], n, "{v}");
    let entries = v["choices"][0]["logprobs"]["content"].as_array().unwrap_or_else(|| panic!("{v}"));
    assert_eq!(entries.len(), n, "{v}");
    for e in entries {
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3, "{e}");
        assert_eq!(top[0]["token"], e["token"], "{e}");
        assert!(top.windows(2).all(|w| w[0]["logprob"].as_f64() >= w[1]["logprob"].as_f64()), "{e}");
    }
}
