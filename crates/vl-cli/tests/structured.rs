//! Structured output through a real OpenAI client (async-openai): `response_format` (JSON schema,
//! JSON object), `tool_choice` that requires a call, and `logit_bias`. The checkpoints' weights
//! are random, so unconstrained text is noise: every answer that validates does so because of
//! the constraint. Answers are checked with an independent JSON-schema validator (jsonschema).

mod common;

use async_openai::config::OpenAIConfig;
use async_openai::error::OpenAIError;
use async_openai::types::chat::CreateChatCompletionRequest;
use async_openai::Client;
use common::{goldens, start};
use futures_util::StreamExt;
use serde_json::{json, Value};

fn client(base: &str) -> Client<OpenAIConfig> {
    Client::with_config(OpenAIConfig::new().with_api_base(format!("{base}/v1")).with_api_key("unused"))
}

fn request(v: Value) -> CreateChatCompletionRequest {
    serde_json::from_value(v).expect("the client's request type")
}

/// The answer's message, finish reason, and (streamed) the concatenated content and tool calls.
struct Answer {
    content: String,
    finish: String,
    /// (name, arguments JSON text)
    calls: Vec<(String, String)>,
}

async fn ask(c: &Client<OpenAIConfig>, body: &Value) -> Answer {
    let r = c.chat().create(request(body.clone())).await.expect("a completion");
    let v = serde_json::to_value(&r).unwrap();
    let choice = &v["choices"][0];
    let calls = choice["message"]["tool_calls"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|t| {
                    let f = &t["function"];
                    (f["name"].as_str().unwrap().to_string(), f["arguments"].as_str().unwrap().to_string())
                })
                .collect()
        })
        .unwrap_or_default();
    Answer {
        content: choice["message"]["content"].as_str().unwrap_or_default().to_string(),
        finish: choice["finish_reason"].as_str().unwrap().to_string(),
        calls,
    }
}

async fn ask_streamed(c: &Client<OpenAIConfig>, body: &Value) -> Answer {
    let mut body = body.clone();
    body["stream"] = json!(true);
    let mut s = c.chat().create_stream(request(body)).await.expect("a stream");
    let (mut content, mut finish) = (String::new(), String::new());
    let mut calls: Vec<(String, String)> = vec![];
    while let Some(chunk) = s.next().await {
        let v = serde_json::to_value(chunk.expect("a chunk")).unwrap();
        for ch in v["choices"].as_array().unwrap() {
            if let Some(t) = ch["delta"]["content"].as_str() {
                content.push_str(t);
            }
            for t in ch["delta"]["tool_calls"].as_array().into_iter().flatten() {
                let i = t["index"].as_u64().unwrap() as usize;
                if calls.len() <= i {
                    calls.resize(i + 1, Default::default());
                }
                if let Some(n) = t["function"]["name"].as_str() {
                    calls[i].0.push_str(n);
                }
                if let Some(a) = t["function"]["arguments"].as_str() {
                    calls[i].1.push_str(a);
                }
            }
            if let Some(f) = ch["finish_reason"].as_str() {
                finish = f.to_string();
            }
        }
    }
    Answer { content, finish, calls }
}

fn assert_valid(schema: &Value, text: &str, what: &str) -> Value {
    let doc: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{what}: not JSON ({e}): {text:?}"));
    let v = jsonschema::validator_for(schema).expect("a valid schema");
    let errors: Vec<String> = v.iter_errors(&doc).map(|e| e.to_string()).collect();
    assert!(errors.is_empty(), "{what}: {text:?} does not validate: {errors:?}");
    doc
}

/// Leading and inter-token whitespace stays bounded (one space, or a newline and <= 20 blanks).
fn assert_whitespace_bounded(text: &str) {
    let mut run = 0;
    let mut newlines = 0;
    for ch in text.chars() {
        if ch.is_whitespace() {
            run += 1;
            newlines += (ch == '\n') as usize;
            assert!(run <= 21 && newlines <= 1, "unbounded whitespace in {text:?}");
        } else {
            run = 0;
            newlines = 0;
        }
    }
}

#[test]
fn json_schema_answers_validate_streamed_or_not() {
    let g = "tiny-a";
    let server = start(g, &[]);
    let schema = json!({
        "type": "object",
        "properties": {
            "label": {"enum": ["cat", "dog", "bird"]},
            "count": {"type": "integer", "minimum": 0, "maximum": 20},
            "name": {"type": "string", "minLength": 1, "maxLength": 12},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3},
            "box": {
                "type": "object",
                "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 1000},
                               "ok": {"type": "boolean"}},
                "required": ["x", "ok"],
                "additionalProperties": false
            }
        },
        "required": ["label", "count", "name", "tags", "box"],
        "additionalProperties": false
    });
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let c = client(&server.base);
        let mut answers = std::collections::HashSet::new();
        for seed in 1..=6 {
            let body = json!({
                "model": g,
                "messages": [{"role": "user", "content": "Describe the animal as JSON."}],
                "temperature": 1.0,
                "seed": seed,
                "max_completion_tokens": 1500,
                "response_format": {"type": "json_schema",
                                    "json_schema": {"name": "animal", "schema": schema, "strict": true}},
            });
            let a = ask(&c, &body).await;
            assert_eq!(a.finish, "stop", "seed {seed}: {:?}", a.content);
            assert_valid(&schema, &a.content, &format!("seed {seed}"));
            assert_whitespace_bounded(&a.content);
            let s = ask_streamed(&c, &body).await;
            assert_eq!((s.content.as_str(), s.finish.as_str()), (a.content.as_str(), "stop"), "seed {seed}");
            answers.insert(a.content);
        }
        assert!(answers.len() >= 5, "seeds give different answers: {answers:?}");

        // Any JSON object. Random weights never close a string by themselves, so `logit_bias`
        // favours the tokens `":` and `"}`: the mask still admits each only where it keeps the
        // document valid.
        let tok: Value = serde_json::from_str(
            &std::fs::read_to_string(goldens().join(g).join("checkpoint/tokenizer.json")).unwrap(),
        )
        .unwrap();
        let id = |w: &str| tok["model"]["vocab"][w].as_u64().unwrap().to_string();
        for seed in 1..=4 {
            let body = json!({
                "model": g,
                "messages": [{"role": "user", "content": "JSON please."}],
                "temperature": 1.0,
                "seed": seed,
                "max_completion_tokens": 1500,
                "logit_bias": {id("\":"): 30, id("\"}"): 30},
                "response_format": {"type": "json_object"},
            });
            let a = ask(&c, &body).await;
            assert_eq!(a.finish, "stop", "seed {seed}: {:?}", a.content);
            assert!(serde_json::from_str::<Value>(&a.content).unwrap().is_object(), "{:?}", a.content);
            assert_whitespace_bounded(&a.content);
        }

        // A schema the library cannot compile: 400 naming the failing part.
        let body = json!({
            "model": g,
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "bad",
                "schema": {"type": "object", "properties": {"a": {"$ref": "#/definitions/nope"}}}}},
        });
        match c.chat().create(request(body)).await.unwrap_err() {
            OpenAIError::ApiError(e) => {
                assert_eq!(e.status_code.as_u16(), 400);
                let m = &e.api_error.message;
                assert!(m.contains("response_format") && m.contains("/definitions/nope"), "{m}");
            }
            other => panic!("expected an API error, got {other}"),
        }
    });
}

#[test]
fn required_and_named_tool_calls_validate_against_their_function() {
    let g = "tiny-b";
    let server = start(g, &[]);
    let weather = json!({
        "type": "object",
        "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 10},
                       "days": {"type": "integer", "minimum": 1, "maximum": 7},
                       "unit": {"enum": ["C", "F"]}},
        "required": ["city", "days"],
        "additionalProperties": false
    });
    let time = json!({
        "type": "object",
        "properties": {"zone": {"type": "string", "maxLength": 8}},
        "required": ["zone"],
        "additionalProperties": false
    });
    let tools = json!([
        {"type": "function", "function": {"name": "get_weather", "description": "Weather.", "parameters": weather}},
        {"type": "function", "function": {"name": "get_time", "description": "Time.", "parameters": time}},
        {"type": "function", "function": {"name": "ping", "description": "No arguments."}},
    ]);
    let schema_of = |name: &str| match name {
        "get_weather" => weather.clone(),
        "get_time" => time.clone(),
        "ping" => json!({"type": "object", "additionalProperties": false}),
        other => panic!("called an unknown function {other:?}"),
    };
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let c = client(&server.base);
        for (choice, only) in [
            (json!("required"), None),
            (json!({"type": "function", "function": {"name": "get_weather"}}), Some("get_weather")),
        ] {
            for seed in 1..=4 {
                let body = json!({
                    "model": g,
                    "messages": [{"role": "user", "content": "What is the weather in Bern?"}],
                    "temperature": 1.0,
                    "seed": seed,
                    "max_completion_tokens": 600,
                    "tools": tools,
                    "tool_choice": choice,
                });
                let a = ask(&c, &body).await;
                assert_eq!(a.finish, "tool_calls", "{choice} seed {seed}: {:?} {:?}", a.content, a.calls);
                assert!(!a.calls.is_empty());
                if only.is_some() {
                    assert_eq!(a.calls.len(), 1, "{:?}", a.calls);
                }
                for (name, args) in &a.calls {
                    if let Some(o) = only {
                        assert_eq!(name, o);
                    }
                    assert_valid(&schema_of(name), args, &format!("{choice} seed {seed} {name}"));
                }
                let s = ask_streamed(&c, &body).await;
                assert_eq!(s.finish, "tool_calls");
                assert_eq!(s.calls, a.calls, "{choice} seed {seed}: streamed and not agree");
            }
        }
    });
}

#[test]
fn logit_bias_promotes_and_bans_tokens() {
    let g = "tiny-a";
    let server = start(g, &[]);
    // Token ids from the checkpoint's own vocabulary (read here, not by the server).
    let tok: Value =
        serde_json::from_str(&std::fs::read_to_string(goldens().join(g).join("checkpoint/tokenizer.json")).unwrap())
            .unwrap();
    let id = |w: &str| tok["model"]["vocab"][w].as_u64().unwrap_or_else(|| panic!("{w} in the vocabulary"));
    let (cat, dog) = (id("cat"), id("dog"));
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let c = client(&server.base);
        let body = |bias: Value| {
            json!({"model": g, "messages": [{"role": "user", "content": "Say something."}],
                   "max_completion_tokens": 5, "logit_bias": bias})
        };
        let a = ask(&c, &body(json!({cat.to_string(): 100}))).await;
        assert_eq!(a.content, "catcatcatcatcat");
        // Banned, the favourite gives way to the next one.
        let a = ask(&c, &body(json!({cat.to_string(): -100, dog.to_string(): 60}))).await;
        assert_eq!(a.content, "dogdogdogdogdog");
        let a = ask(&c, &body(json!({cat.to_string(): 100, dog.to_string(): 100}))).await;
        assert!(a.content.chars().all(|ch| "catdog".contains(ch)), "{:?}", a.content);
    });
}

/// Each content token's logprob entry, from a non-streamed answer or the streamed chunks.
fn logprob_entries(v: &Value) -> Vec<Value> {
    v["logprobs"]["content"].as_array().cloned().unwrap_or_default()
}

#[test]
fn logprobs_streamed_or_not_in_openai_shape() {
    let g = "tiny-a";
    let server = start(g, &[]);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let c = client(&server.base);
        let body = json!({"model": g, "messages": [{"role": "user", "content": "Tell me about the sea."}],
                          "max_completion_tokens": 12, "logprobs": true, "top_logprobs": 5});
        let r = c.chat().create(request(body.clone())).await.expect("a completion");
        let v = serde_json::to_value(&r).unwrap();
        let entries = logprob_entries(&v["choices"][0]);
        assert_eq!(entries.len(), 12, "{v}");
        let mut text = String::new();
        for e in &entries {
            let top = e["top_logprobs"].as_array().unwrap();
            assert_eq!(top.len(), 5);
            // Greedy: the chosen token is the most likely one.
            assert_eq!(e["token"], top[0]["token"], "{e}");
            assert!((e["logprob"].as_f64().unwrap() - top[0]["logprob"].as_f64().unwrap()).abs() < 1e-6);
            let lps: Vec<f64> = top.iter().map(|t| t["logprob"].as_f64().unwrap()).collect();
            assert!(lps.windows(2).all(|w| w[0] >= w[1]) && lps[0] <= 0.0, "{lps:?}");
            // Probabilities of distinct tokens sum to at most 1.
            assert!(lps.iter().map(|l| l.exp()).sum::<f64>() <= 1.0 + 1e-5);
            let bytes: Vec<u8> = e["bytes"].as_array().unwrap().iter().map(|b| b.as_u64().unwrap() as u8).collect();
            assert_eq!(bytes, e["token"].as_str().unwrap().as_bytes());
            text.push_str(e["token"].as_str().unwrap());
        }
        assert_eq!(text, r.choices[0].message.content.clone().unwrap());

        // Streamed: the chunks' entries are the same tokens with the same logprobs.
        let mut body_s = body.clone();
        body_s["stream"] = json!(true);
        let mut s = c.chat().create_stream(request(body_s)).await.expect("a stream");
        let mut streamed = vec![];
        while let Some(chunk) = s.next().await {
            let v = serde_json::to_value(chunk.expect("a chunk")).unwrap();
            for ch in v["choices"].as_array().unwrap() {
                streamed.extend(logprob_entries(ch));
            }
        }
        assert_eq!(streamed.len(), entries.len());
        for (a, b) in streamed.iter().zip(&entries) {
            assert_eq!(a["token"], b["token"]);
            assert!((a["logprob"].as_f64().unwrap() - b["logprob"].as_f64().unwrap()).abs() < 1e-4);
        }

        // Off unless asked; out-of-range asks are refused.
        let r = c
            .chat()
            .create(request(json!({"model": g, "messages": [{"role": "user", "content": "x"}],
                                                "max_completion_tokens": 2})))
            .await
            .unwrap();
        assert!(serde_json::to_value(&r).unwrap()["choices"][0]["logprobs"].is_null());
        for bad in [json!({"logprobs": true, "top_logprobs": 21}), json!({"top_logprobs": 3})] {
            let mut b = json!({"model": g, "messages": [{"role": "user", "content": "x"}]});
            for (k, x) in bad.as_object().unwrap() {
                b[k] = x.clone();
            }
            match c.chat().create(request(b)).await.unwrap_err() {
                OpenAIError::ApiError(e) => {
                    assert_eq!(e.status_code.as_u16(), 400);
                    assert!(e.api_error.message.contains("top_logprobs"), "{}", e.api_error.message);
                }
                other => panic!("expected an API error, got {other}"),
            }
        }
    });
}

#[test]
fn n_choices_share_one_prefill_and_have_distinct_seeds() {
    let g = "tiny-a";
    let server = start(g, &[]);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let c = client(&server.base);
        let body = |n: u32, seed: u64| {
            json!({"model": g, "messages": [{"role": "user", "content": "Tell me a story."}],
                   "max_completion_tokens": 8, "temperature": 1.0, "seed": seed, "n": n})
        };
        let contents = |v: &Value| -> Vec<String> {
            v["choices"]
                .as_array()
                .unwrap()
                .iter()
                .map(|c| c["message"]["content"].as_str().unwrap().to_string())
                .collect()
        };
        let r = serde_json::to_value(c.chat().create(request(body(3, 40))).await.unwrap()).unwrap();
        let three = contents(&r);
        assert_eq!(three.len(), 3);
        let idx: Vec<u64> = r["choices"].as_array().unwrap().iter().map(|c| c["index"].as_u64().unwrap()).collect();
        assert_eq!(idx, [0, 1, 2]);
        assert_eq!(r["usage"]["completion_tokens"], 24, "{r}");
        let distinct: std::collections::HashSet<_> = three.iter().collect();
        assert!(distinct.len() >= 2, "{three:?}");
        // Reproducible, and choice i is what seed + i gives alone.
        let again = serde_json::to_value(c.chat().create(request(body(3, 40))).await.unwrap()).unwrap();
        assert_eq!(contents(&again), three);
        for (i, want) in three.iter().enumerate() {
            let alone = serde_json::to_value(c.chat().create(request(body(1, 40 + i as u64))).await.unwrap()).unwrap();
            assert_eq!(&contents(&alone)[0], want, "choice {i}");
        }
        // Streamed: each index's pieces add up to that choice.
        let mut b = body(3, 40);
        b["stream"] = json!(true);
        let mut s = c.chat().create_stream(request(b)).await.expect("a stream");
        let mut streamed = vec![String::new(); 3];
        let mut finished = 0;
        while let Some(chunk) = s.next().await {
            let v = serde_json::to_value(chunk.expect("a chunk")).unwrap();
            for ch in v["choices"].as_array().unwrap() {
                let i = ch["index"].as_u64().unwrap() as usize;
                streamed[i].push_str(ch["delta"]["content"].as_str().unwrap_or(""));
                finished += ch["finish_reason"].is_string() as usize;
            }
        }
        assert_eq!((streamed, finished), (three, 3));

        // Each choice holds to a constraint on its own.
        let schema = json!({"type": "object", "properties": {"k": {"enum": ["a", "b", "c"]},
                            "v": {"type": "integer", "minimum": 0, "maximum": 50}},
                            "required": ["k", "v"], "additionalProperties": false});
        let mut b = body(4, 3);
        b["max_completion_tokens"] = json!(300);
        b["response_format"] = json!({"type": "json_schema", "json_schema": {"name": "kv", "schema": schema}});
        let r = serde_json::to_value(c.chat().create(request(b)).await.unwrap()).unwrap();
        for (i, ch) in r["choices"].as_array().unwrap().iter().enumerate() {
            assert_eq!(ch["finish_reason"], "stop", "{ch}");
            assert_valid(&schema, ch["message"]["content"].as_str().unwrap(), &format!("choice {i}"));
        }
    });
}

/// `/v1/completions` takes the prompt as it is: the reference's rendered text-only prompt gives
/// the reference's greedy answer, streamed or not, through the client's completions API.
#[test]
fn completions_take_a_raw_prompt() {
    let g = "tiny-a";
    let server = start(g, &[]);
    let prompt: Value =
        serde_json::from_str(&std::fs::read_to_string(goldens().join("prompts/text_only.json")).unwrap()).unwrap();
    let case: Value =
        serde_json::from_str(&std::fs::read_to_string(goldens().join(g).join("cases/text_only.json")).unwrap())
            .unwrap();
    let want = case["greedy"]["text"].as_str().unwrap();
    let n = case["greedy"]["ids"].as_array().unwrap().len();
    let agent = ureq::AgentBuilder::new().timeout(std::time::Duration::from_secs(120)).build();
    let post = |body: Value| -> (u16, String) {
        match agent.post(&format!("{}/v1/completions", server.base)).send_string(&body.to_string()) {
            Ok(r) => (r.status(), r.into_string().unwrap()),
            Err(ureq::Error::Status(c, r)) => (c, r.into_string().unwrap()),
            Err(e) => panic!("{e}"),
        }
    };
    let body = json!({"model": g, "prompt": prompt["prompt"], "max_tokens": n, "temperature": 0});
    let (st, text) = post(body.clone());
    assert_eq!(st, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["text"], want, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["prompt_tokens"], case["num_tokens"]);
    // Streamed: `text` pieces add up to the same.
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    let (st, sse) = post(sb);
    assert_eq!(st, 200);
    let pieces: String = sse
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str::<Value>(d).unwrap())
        .map(|c| {
            assert_eq!(c["object"], "text_completion");
            c["choices"][0]["text"].as_str().unwrap_or("").to_string()
        })
        .collect();
    assert_eq!(pieces, want);
    // The legacy `logprobs`: the chosen tokens spell the answer, each with its log-probability
    // (the top one at greedy), `logprobs` alternatives and its character offset; streamed, the
    // offsets run on across chunks.
    let mut lb = body.clone();
    lb["logprobs"] = json!(3);
    let (st, text) = post(lb.clone());
    assert_eq!(st, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    let lp = &v["choices"][0]["logprobs"];
    let tokens: Vec<&str> = lp["tokens"].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
    assert_eq!(tokens.len(), n);
    assert_eq!(tokens.concat(), want);
    let mut at = 0;
    for (i, t) in tokens.iter().enumerate() {
        assert_eq!(lp["text_offset"][i].as_u64().unwrap() as usize, at, "{lp}");
        at += t.chars().count();
        let top = lp["top_logprobs"][i].as_object().unwrap();
        assert!(!top.is_empty() && top.len() <= 3, "{top:?}");
        let best = top.values().map(|x| x.as_f64().unwrap()).fold(f64::MIN, f64::max);
        assert!((lp["token_logprobs"][i].as_f64().unwrap() - best).abs() < 1e-6, "{lp}");
    }
    lb["stream"] = json!(true);
    let (st, sse) = post(lb);
    assert_eq!(st, 200);
    let (mut streamed, mut offsets) = (String::new(), vec![]);
    for c in sse.lines().filter_map(|l| l.strip_prefix("data: ")).filter(|d| *d != "[DONE]") {
        let c: Value = serde_json::from_str(c).unwrap();
        let lp = &c["choices"][0]["logprobs"];
        for (t, o) in
            lp["tokens"].as_array().into_iter().flatten().zip(lp["text_offset"].as_array().into_iter().flatten())
        {
            offsets.push(o.as_u64().unwrap() as usize);
            streamed.push_str(t.as_str().unwrap());
        }
    }
    assert_eq!(streamed, want);
    assert_eq!(
        offsets,
        v["choices"][0]["logprobs"]["text_offset"]
            .as_array()
            .unwrap()
            .iter()
            .map(|o| o.as_u64().unwrap() as usize)
            .collect::<Vec<_>>()
    );
    let mut bad = body.clone();
    bad["logprobs"] = json!(21);
    let (st, t) = post(bad);
    assert!(st == 400 && t.contains("logprobs"), "{t}");
    // What the legacy endpoint has and we do not: refused by name.
    for (k, x) in [("echo", json!(true)), ("suffix", json!("x")), ("best_of", json!(2))] {
        let mut b = body.clone();
        b[k] = x;
        let (st, t) = post(b);
        assert_eq!(st, 400, "{k}: {t}");
        assert!(t.contains(k), "{t}");
    }
    let (st, t) = post(json!({"model": g, "prompt": ["a", "b"]}));
    assert_eq!(st, 400, "{t}");
    let (st, t) = post(json!({"model": g}));
    assert!(st == 400 && t.contains("prompt"), "{t}");
}

/// tiny-a with `template` as its own chat template (the other files linked).
fn post_json(base: &str, path: &str, body: &Value) -> (u16, String) {
    let agent = ureq::AgentBuilder::new().timeout(std::time::Duration::from_secs(120)).build();
    match agent.post(&format!("{base}{path}")).send_string(&body.to_string()) {
        Ok(r) => (r.status(), r.into_string().unwrap()),
        Err(ureq::Error::Status(c, r)) => (c, r.into_string().unwrap()),
        Err(e) => panic!("{e}"),
    }
}

/// The data lines of an SSE answer, parsed.
fn sse_events(sse: &str) -> Vec<Value> {
    sse.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

/// A Thinking checkpoint's template opens `<think>` in the generation prompt: the answer's
/// reasoning comes as `reasoning_content` (message and deltas), apart from `content`, equal to the
/// reference's greedy answer read as the template reads it; an assistant turn's
/// `reasoning_content` goes back to the template, and `chat_template_kwargs` reach it (prompt
/// lengths equal the reference's renders, goldens/thinking).
#[test]
fn thinking_answers_split_reasoning_and_template_kwargs_reach_the_template() {
    let thinking = common::thinking_template();
    let g: Value =
        serde_json::from_str(&std::fs::read_to_string(goldens().join("thinking/thinking.json")).unwrap()).unwrap();
    let greedy = &g["greedy"];
    let render = |case: &str| g["renders"].as_array().unwrap().iter().find(|r| r["case"] == case).unwrap().clone();
    let dir = common::tiny_a_with_template(&thinking);
    let server = common::start_dir(dir.path(), &[]);
    let n = greedy["ids"].as_array().unwrap().len();
    let body = json!({"messages": [{"role": "user", "content": greedy["question"]}], "max_tokens": n});
    let (st, text) = post_json(&server.base, "/v1/chat/completions", &body);
    assert_eq!(st, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    let m = &v["choices"][0]["message"];
    assert_eq!(m["reasoning_content"], greedy["reasoning"], "{v}");
    assert_eq!(m["content"], greedy["content"], "{v}");
    assert_eq!(v["usage"]["prompt_tokens"].as_u64().unwrap() as usize, greedy["prompt_ids"].as_array().unwrap().len());
    assert_eq!(v["usage"]["completion_tokens"].as_u64().unwrap() as usize, n);
    // Streamed: reasoning deltas, then content deltas, add up to the same.
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    let (st, sse) = post_json(&server.base, "/v1/chat/completions", &sb);
    assert_eq!(st, 200, "{sse}");
    let (mut reasoning, mut content) = (String::new(), String::new());
    for e in sse_events(&sse) {
        let d = &e["choices"][0]["delta"];
        reasoning.push_str(d["reasoning_content"].as_str().unwrap_or(""));
        content.push_str(d["content"].as_str().unwrap_or(""));
    }
    assert_eq!(reasoning, greedy["reasoning"].as_str().unwrap());
    assert_eq!(content, greedy["content"].as_str().unwrap());
    // /v1/responses: the reasoning is an output item of its own, and its tokens are counted.
    let rb = json!({"input": greedy["question"], "max_output_tokens": n});
    let (st, text) = post_json(&server.base, "/v1/responses", &rb);
    assert_eq!(st, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["output"][0]["type"], "reasoning", "{v}");
    assert_eq!(v["output"][0]["content"][0]["text"], greedy["reasoning"]);
    assert_eq!(v["usage"]["output_tokens_details"]["reasoning_tokens"].as_u64().unwrap() as usize, n);
    let mut rb = rb.clone();
    rb["stream"] = json!(true);
    let (st, sse) = post_json(&server.base, "/v1/responses", &rb);
    assert_eq!(st, 200, "{sse}");
    let streamed: String = sse_events(&sse)
        .iter()
        .filter(|e| e["type"] == "response.reasoning_text.delta")
        .map(|e| e["delta"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(streamed, greedy["reasoning"].as_str().unwrap());
    // History: reasoning in an answer's content and in `reasoning_content`, as a client sends it
    // back; the prompt is the reference's render of it.
    for case in ["history", "tool_round"] {
        let r = render(case);
        let mut messages = r["messages"].clone();
        for m in messages.as_array_mut().unwrap() {
            for call in m["tool_calls"].as_array_mut().into_iter().flatten() {
                // The OpenAI shape: arguments as JSON text, as this server writes it (Python's
                // separators, as the template's `tojson` prints the reference's object).
                assert_eq!(call["function"]["arguments"], json!({"city": "Paris"}));
                call["function"]["arguments"] = json!(r#"{"city": "Paris"}"#);
            }
        }
        let body = json!({"messages": messages, "max_tokens": 1});
        let (st, text) = post_json(&server.base, "/v1/chat/completions", &body);
        assert_eq!(st, 200, "{case}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(
            v["usage"]["prompt_tokens"].as_u64().unwrap() as usize,
            r["ids"].as_array().unwrap().len(),
            "{case}"
        );
    }
    // Template arguments: `add_vision_id` numbers the pictures, as the reference rendered it.
    let r = render("vision_id");
    let png = std::fs::read(goldens().join("images/square.png")).unwrap();
    let url =
        format!("data:image/png;base64,{}", base64::Engine::encode(&base64::engine::general_purpose::STANDARD, png));
    let messages = json!([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is this?"}]}]);
    let mut tokens = vec![];
    for kwargs in [r["kwargs"].clone(), json!({})] {
        let body = json!({"messages": messages, "max_tokens": 1, "chat_template_kwargs": kwargs});
        let (st, text) = post_json(&server.base, "/v1/chat/completions", &body);
        assert_eq!(st, 200, "{text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        tokens.push(v["usage"]["prompt_tokens"].as_u64().unwrap());
    }
    assert_eq!(tokens[0], r["prompt_tokens"].as_u64().unwrap());
    assert!(tokens[1] < tokens[0], "{tokens:?}: without add_vision_id the prompt has no `Picture 1: `");
    // Refused by name: template arguments that are not an object or set what the request sets,
    // and reasoning on a message that is not the assistant's.
    for (bad, needle) in [
        (json!({"chat_template_kwargs": ["x"]}), "chat_template_kwargs"),
        (json!({"chat_template_kwargs": {"messages": []}}), "chat_template_kwargs.messages"),
        (json!({"messages": [{"role": "user", "content": "hi", "reasoning_content": "x"}]}), "reasoning_content"),
    ] {
        let mut b = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1});
        for (k, x) in bad.as_object().unwrap() {
            b[k] = x.clone();
        }
        let (st, t) = post_json(&server.base, "/v1/chat/completions", &b);
        assert_eq!(st, 400, "{bad}: {t}");
        assert!(t.contains(needle), "{t}");
    }
}

/// A schema without `additionalProperties` (as a plain Pydantic model sends it) holds the answer
/// to exactly its declared keys, at every level: objects are closed unless the schema opens them.
/// A free-form `{"type": "object"}` inside stays open (any object validates).
#[test]
fn schemas_without_additional_properties_get_exactly_the_declared_keys() {
    let g = "tiny-a";
    let server = start(g, &[]);
    let schema = json!({
        "title": "Pet",
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 30},
            "owner": {"$ref": "#/$defs/Owner"},
            "toys": {"type": "array", "items": {"type": "object", "properties": {"kind": {"enum": ["ball", "rope"]}},
                                                "required": ["kind"]}, "maxItems": 2},
        },
        "required": ["name", "age", "owner", "toys"],
        "$defs": {"Owner": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}},
                            "required": ["id"]}},
    });
    let keys = |v: &Value| -> Vec<String> {
        let mut k: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
        k.sort();
        k
    };
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let c = client(&server.base);
        for seed in 1..=5 {
            for format in [
                json!({"type": "json_schema", "json_schema": {"name": "pet", "schema": schema}}),
                json!({"type": "json_schema", "json_schema": {"name": "pet", "schema": schema, "strict": false}}),
            ] {
                let body = json!({
                    "model": g,
                    "messages": [{"role": "user", "content": "A pet as JSON."}],
                    "temperature": 1.0,
                    "seed": seed,
                    "max_completion_tokens": 400,
                    "response_format": format,
                });
                let a = ask(&c, &body).await;
                assert_eq!(a.finish, "stop", "seed {seed}: {:?}", a.content);
                let doc = assert_valid(&schema, &a.content, &format!("seed {seed}"));
                assert_eq!(keys(&doc), ["age", "name", "owner", "toys"], "seed {seed}: {doc}");
                assert_eq!(keys(&doc["owner"]), ["id"], "seed {seed}: {doc}");
                for t in doc["toys"].as_array().unwrap() {
                    assert_eq!(keys(t), ["kind"], "seed {seed}: {doc}");
                }
            }
        }
    });
    // llama-server's `json_object` with a `schema` (older instructor; async-openai's type has no
    // place for it, so sent as JSON) is held to it the same way.
    for seed in [7, 8] {
        let body = json!({
            "model": g,
            "messages": [{"role": "user", "content": "A pet as JSON."}],
            "temperature": 1.0,
            "seed": seed,
            "max_completion_tokens": 400,
            "response_format": {"type": "json_object", "schema": schema},
        });
        let (st, text) = post_json(&server.base, "/v1/chat/completions", &body);
        assert_eq!(st, 200, "{text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
        let doc = assert_valid(&schema, v["choices"][0]["message"]["content"].as_str().unwrap(), "json_object");
        assert_eq!(keys(&doc), ["age", "name", "owner", "toys"], "seed {seed}: {doc}");
    }
}

/// `parallel_tool_calls: false` means at most one call: with `tool_choice: "required"` the
/// constraint admits exactly one (the same seeds make several without it), streamed or not.
#[test]
fn parallel_tool_calls_false_makes_exactly_one_call() {
    let g = "tiny-b";
    let server = start(g, &[]);
    let weather = json!({"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
                         "required": ["city"], "additionalProperties": false});
    let tools = json!([
        {"type": "function", "function": {"name": "get_weather", "parameters": weather}},
        {"type": "function", "function": {"name": "ping"}},
    ]);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let c = client(&server.base);
        let body = |seed: u64, parallel: Option<bool>, choice: Value| {
            let mut b = json!({
                "model": g,
                "messages": [{"role": "user", "content": "Weather in Bern?"}],
                "temperature": 1.0,
                "seed": seed,
                "max_completion_tokens": 300,
                "tools": tools,
                "tool_choice": choice,
            });
            if let Some(p) = parallel {
                b["parallel_tool_calls"] = json!(p);
            }
            b
        };
        let mut several = 0;
        for seed in 1..=6 {
            let free = ask(&c, &body(seed, None, json!("required"))).await;
            let also = ask(&c, &body(seed, Some(true), json!("required"))).await;
            assert_eq!(free.calls, also.calls, "seed {seed}: `true` is the default");
            several += (free.calls.len() > 1) as usize;
            for choice in [json!("required"), json!({"type": "function", "function": {"name": "get_weather"}})] {
                let b = body(seed, Some(false), choice.clone());
                let a = ask(&c, &b).await;
                assert_eq!(a.finish, "tool_calls", "{choice} seed {seed}: {:?}", a.content);
                assert_eq!(a.calls.len(), 1, "{choice} seed {seed}: {:?}", a.calls);
                let (name, args) = &a.calls[0];
                let schema =
                    if name == "ping" { json!({"type": "object", "maxProperties": 0}) } else { weather.clone() };
                assert_valid(&schema, args, &format!("{choice} seed {seed}"));
                let s = ask_streamed(&c, &b).await;
                assert_eq!((s.calls, s.finish), (a.calls, a.finish), "{choice} seed {seed}: streamed");
                // The answer itself is one call (the constraint admits no second), not several
                // cut to one: its tokens spell one block.
                let mut raw = b.clone();
                raw["logprobs"] = json!(true);
                let (st, text) = post_json(&server.base, "/v1/chat/completions", &raw);
                assert_eq!(st, 200, "{text}");
                let v: Value = serde_json::from_str(&text).unwrap();
                let tokens: String = v["choices"][0]["logprobs"]["content"]
                    .as_array()
                    .unwrap_or_else(|| panic!("{v}"))
                    .iter()
                    .map(|t| t["token"].as_str().unwrap())
                    .collect();
                assert_eq!(tokens.matches("<tool_call>").count(), 1, "{choice} seed {seed}: {tokens:?}");
            }
        }
        assert!(several > 0, "no seed made several calls without `parallel_tool_calls: false`");
    });
}

/// A tool call that is required wins over a JSON `response_format` / `text.format` (instructor's
/// tools modes send both; OpenAI answers with the call): the answer is the call.
#[test]
fn a_required_tool_call_wins_over_a_json_format() {
    let g = "tiny-b";
    let server = start(g, &[]);
    let weather = json!({"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
                         "required": ["city"]});
    let answer_schema = json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]});
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let c = client(&server.base);
        for (choice, format) in [
            (json!("required"), json!({"type": "json_schema", "json_schema": {"name": "a", "schema": answer_schema}})),
            (json!({"type": "function", "function": {"name": "get_weather"}}), json!({"type": "json_object"})),
        ] {
            let body = json!({
                "model": g,
                "messages": [{"role": "user", "content": "Weather in Bern?"}],
                "temperature": 1.0,
                "seed": 3,
                "max_completion_tokens": 300,
                "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": weather}}],
                "tool_choice": choice,
                "response_format": format,
            });
            let a = ask(&c, &body).await;
            assert_eq!(a.finish, "tool_calls", "{choice} {format}: {:?}", a.content);
            assert!(!a.calls.is_empty() && a.calls.iter().all(|(n, _)| n == "get_weather"), "{:?}", a.calls);
            for (_, args) in &a.calls {
                let doc = assert_valid(&weather, args, &format!("{choice}"));
                assert_eq!(doc.as_object().unwrap().len(), 1, "closed: {doc}");
            }
        }
    });
    // The Responses API, as instructor's RESPONSES_TOOLS mode sends it.
    let body = json!({
        "model": g,
        "input": "Weather in Bern?",
        "temperature": 1.0,
        "seed": 3,
        "max_output_tokens": 300,
        "tools": [{"type": "function", "name": "get_weather", "parameters": weather, "strict": true}],
        "tool_choice": "required",
        "parallel_tool_calls": false,
        "text": {"format": {"type": "json_schema", "name": "a", "schema": answer_schema, "strict": true}},
    });
    let (st, text) = post_json(&server.base, "/v1/responses", &body);
    assert_eq!(st, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    let calls: Vec<&Value> = v["output"].as_array().unwrap().iter().filter(|o| o["type"] == "function_call").collect();
    assert_eq!(calls.len(), 1, "{v}");
    assert_eq!(calls[0]["name"], "get_weather", "{v}");
    assert_valid(&weather, calls[0]["arguments"].as_str().unwrap(), "responses");
    assert_eq!(v["status"], "completed", "{v}");
}
