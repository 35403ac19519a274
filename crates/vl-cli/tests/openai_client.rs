//! `vl serve` driven by a real OpenAI client library (async-openai): its request serialization,
//! response and SSE parsing, and error decoding all work against our server, and the answers
//! are the reference's.

mod common;

use async_openai::config::OpenAIConfig;
use async_openai::error::OpenAIError;
use async_openai::types::chat::CreateChatCompletionRequest;
use async_openai::Client;
use base64::Engine as _;
use common::{goldens, start};
use futures_util::StreamExt;
use serde_json::{json, Value};

fn request(g: &str, max: usize, stream: bool) -> CreateChatCompletionRequest {
    let png = std::fs::read(goldens().join("images/square.png")).unwrap();
    let url = format!("data:image/png;base64,{}", base64::engine::general_purpose::STANDARD.encode(png));
    let mut v = json!({
        "model": g,
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": "Describe this image."},
        ]}],
        "max_completion_tokens": max,
        "temperature": 0.0,
    });
    if stream {
        v["stream"] = json!(true);
        v["stream_options"] = json!({"include_usage": true});
    }
    serde_json::from_value(v).expect("the client's request type")
}

#[test]
fn the_openai_client_gets_the_reference_answer() {
    let g = "tiny-a";
    let meta: Value =
        serde_json::from_str(&std::fs::read_to_string(goldens().join(g).join("cases/one_image.json")).unwrap())
            .unwrap();
    let want = meta["greedy"]["text"].as_str().unwrap().to_string();
    let n = meta["greedy"]["ids"].as_array().unwrap().len();
    let prompt = meta["num_tokens"].as_u64().unwrap() as u32;
    let server = start(g, &["--strict-model-name"]);
    let base = server.base.clone();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let client =
            Client::with_config(OpenAIConfig::new().with_api_base(format!("{base}/v1")).with_api_key("unused"));

        let models = client.models().list().await.expect("models");
        assert_eq!(models.data[0].id, g);

        let r = client.chat().create(request(g, n, false)).await.expect("a completion");
        assert_eq!(r.choices[0].message.content.as_deref(), Some(want.as_str()));
        let usage = r.usage.expect("usage");
        assert_eq!((usage.prompt_tokens, usage.completion_tokens), (prompt, n as u32));

        let mut s = client.chat().create_stream(request(g, n, true)).await.expect("a stream");
        let (mut text, mut finish, mut usage) = (String::new(), None, None);
        while let Some(chunk) = s.next().await {
            let chunk = chunk.expect("a chunk");
            for c in &chunk.choices {
                if let Some(t) = &c.delta.content {
                    text.push_str(t);
                }
                if c.finish_reason.is_some() {
                    finish = c.finish_reason;
                }
            }
            if chunk.usage.is_some() {
                usage = chunk.usage;
            }
        }
        assert_eq!(text, want);
        assert!(finish.is_some());
        let usage = usage.expect("the usage chunk");
        assert_eq!(usage.completion_tokens, n as u32);
        let cached = usage.prompt_tokens_details.and_then(|d| d.cached_tokens);
        assert_eq!(cached, Some(prompt - 1), "the repeated prompt's prefix was reused");

        let err = client.chat().create(request("no-such-model", 2, false)).await.unwrap_err();
        match err {
            OpenAIError::ApiError(e) => {
                assert_eq!(e.status_code.as_u16(), 404);
                assert!(e.api_error.message.contains("no-such-model"), "{}", e.api_error.message);
                assert_eq!(e.api_error.code.as_deref(), Some("model_not_found"));
            }
            other => panic!("expected an API error, got {other}"),
        }
    });
}

/// `/v1/responses` through the client's Responses API: the reference's greedy answer as an
/// `output_text`, streamed as typed events in order, a required function call and a JSON-schema
/// answer that validate, and what it cannot serve refused by name.
#[test]
fn the_responses_api_answers_through_the_client() {
    use async_openai::types::responses::CreateResponse;
    let g = "tiny-a";
    let meta: Value =
        serde_json::from_str(&std::fs::read_to_string(goldens().join(g).join("cases/one_image.json")).unwrap())
            .unwrap();
    let want = meta["greedy"]["text"].as_str().unwrap().to_string();
    let n = meta["greedy"]["ids"].as_array().unwrap().len();
    let prompt = meta["num_tokens"].as_u64().unwrap();
    let png = std::fs::read(goldens().join("images/square.png")).unwrap();
    let url = format!("data:image/png;base64,{}", base64::engine::general_purpose::STANDARD.encode(png));
    let body = json!({
        "model": g,
        "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": url},
            {"type": "input_text", "text": "Describe this image."},
        ]}],
        "max_output_tokens": n,
        "temperature": 0.0,
        "store": false,
    });
    let req = |v: &Value| -> CreateResponse { serde_json::from_value(v.clone()).expect("the client's request type") };
    let server = start(g, &[]);
    let base = server.base.clone();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let client =
            Client::with_config(OpenAIConfig::new().with_api_base(format!("{base}/v1")).with_api_key("unused"));
        let r = client.responses().create(req(&body)).await.expect("a response");
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(v["object"], "response");
        // The answer ran to max_output_tokens.
        assert_eq!(v["status"], "incomplete", "{v}");
        assert_eq!(v["incomplete_details"]["reason"], "max_output_tokens");
        assert_eq!(v["output"].as_array().unwrap().len(), 1, "{v}");
        assert_eq!(v["output"][0]["type"], "message");
        assert_eq!(v["output"][0]["content"][0]["text"], want.as_str());
        assert_eq!(v["usage"]["input_tokens"], prompt);
        assert_eq!(v["usage"]["output_tokens"].as_u64().unwrap() as usize, n);

        // Streamed: typed events, numbered in order; the deltas add up to the answer and the
        // last event carries the whole response.
        let mut sb = body.clone();
        sb["stream"] = json!(true);
        let mut s = client.responses().create_stream(req(&sb)).await.expect("a stream");
        let (mut kinds, mut text, mut last) = (vec![], String::new(), Value::Null);
        while let Some(e) = s.next().await {
            let e = serde_json::to_value(e.expect("an event")).unwrap();
            assert_eq!(e["sequence_number"].as_u64().unwrap() as usize, kinds.len(), "{e}");
            let kind = e["type"].as_str().unwrap().to_string();
            if kind == "response.output_text.delta" {
                text.push_str(e["delta"].as_str().unwrap());
            }
            kinds.push(kind);
            last = e;
        }
        assert_eq!(text, want);
        assert_eq!(
            kinds.iter().filter(|k| !k.ends_with(".delta")).map(String::as_str).collect::<Vec<_>>(),
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.incomplete",
            ]
        );
        assert_eq!(last["response"]["output"][0]["content"][0]["text"], want.as_str());
        assert_eq!(last["response"]["usage"]["output_tokens"].as_u64().unwrap() as usize, n);

        // A required function call, its arguments valid against the function's parameters (on
        // tiny-b, whose template is the official one, with tools).
        let tools_server = start("tiny-b", &[]);
        let client = Client::with_config(
            OpenAIConfig::new().with_api_base(format!("{}/v1", tools_server.base)).with_api_key("unused"),
        );
        let g = "tiny-b";
        let params = json!({"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                            "required": ["city"], "additionalProperties": false});
        let call = json!({"model": g, "input": "Weather?", "max_output_tokens": 64, "temperature": 1.0, "seed": 3,
                          "tools": [{"type": "function", "name": "weather", "parameters": params, "strict": true}],
                          "tool_choice": "required"});
        let v = serde_json::to_value(client.responses().create(req(&call)).await.expect("a call")).unwrap();
        let item = v["output"].as_array().unwrap().iter().find(|i| i["type"] == "function_call").expect("a call");
        assert_eq!(item["name"], "weather");
        let args: Value = serde_json::from_str(item["arguments"].as_str().unwrap()).unwrap();
        assert!(jsonschema::is_valid(&params, &args), "{args}");
        assert!(item["call_id"].as_str().unwrap().starts_with("call_"));
        assert_eq!(v["tools"][0]["name"], "weather");
        // The call and its output sent back: the next turn's prompt has them.
        let follow = json!({"model": g, "max_output_tokens": 2, "input": [
            {"role": "user", "content": "Weather?"},
            {"type": "function_call", "call_id": item["call_id"], "name": "weather", "arguments": item["arguments"]},
            {"type": "function_call_output", "call_id": item["call_id"], "output": "sunny"},
        ]});
        let v = serde_json::to_value(client.responses().create(req(&follow)).await.expect("a follow-up")).unwrap();
        assert_eq!(v["usage"]["output_tokens"], 2);

        // A JSON-schema answer through `text.format`.
        let schema = json!({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
                            "required": ["n"], "additionalProperties": false});
        let j = json!({"model": g, "input": "A number?", "max_output_tokens": 64, "temperature": 1.0, "seed": 5,
                       "text": {"format": {"type": "json_schema", "name": "n", "schema": schema, "strict": true}}});
        let v = serde_json::to_value(client.responses().create(req(&j)).await.expect("a JSON answer")).unwrap();
        assert_eq!(v["status"], "completed", "{v}");
        let answer: Value = serde_json::from_str(v["output"][0]["content"][0]["text"].as_str().unwrap()).unwrap();
        assert!(jsonschema::is_valid(&schema, &answer), "{answer}");

        // A response never stored, state this server does not keep, tools it does not have:
        // refused by name.
        for (field, x) in [
            ("previous_response_id", json!("resp_999999")),
            ("conversation", json!("conv_1")),
            ("tools", json!([{"type": "web_search"}])),
            ("background", json!(true)),
        ] {
            let mut b = json!({"model": g, "input": "hi", "max_output_tokens": 1});
            b[field] = x;
            match client.responses().create(req(&b)).await.unwrap_err() {
                OpenAIError::ApiError(e) => {
                    assert_eq!(e.status_code.as_u16(), 400, "{field}");
                    assert!(e.api_error.message.contains(field), "{field}: {}", e.api_error.message);
                }
                other => panic!("{field}: expected an API error, got {other}"),
            }
        }
    });
}

/// `vl serve` on the tiny embedding checkpoint, through the client's `embeddings.create` (floats,
/// and base64 decoded by the client): the reference's vectors, the Matryoshka cut included.
#[test]
fn the_openai_client_embeds_as_the_reference() {
    use async_openai::types::embeddings::{CreateEmbeddingRequest, EmbeddingInput, EncodingFormat};
    let g = "tiny-embed";
    let golden: Value =
        serde_json::from_str(&std::fs::read_to_string(goldens().join(g).join("embeddings.json")).unwrap()).unwrap();
    let text = golden["cases"].as_array().unwrap().iter().find(|c| c["case"] == "text").unwrap().clone();
    let floats = |v: &Value| -> Vec<f32> { v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect() };
    let worst = |a: &[f32], b: &[f32]| {
        assert_eq!(a.len(), b.len());
        a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max)
    };
    let server = start(g, &[]);
    let base = server.base.clone();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let client =
            Client::with_config(OpenAIConfig::new().with_api_base(format!("{base}/v1")).with_api_key("unused"));
        let input = text["texts"][0].as_str().unwrap().to_string();
        let r = client
            .embeddings()
            .create(CreateEmbeddingRequest {
                model: g.into(),
                input: EmbeddingInput::StringArray(vec![input.clone(), input.clone()]),
                ..Default::default()
            })
            .await
            .expect("embeddings");
        assert_eq!(r.data.len(), 2);
        assert!(worst(&r.data[1].embedding, &floats(&text["embedding"])) <= 1e-4);
        assert!(r.usage.prompt_tokens > 0);
        let d = text["dims"].as_u64().unwrap() as u32;
        let r = client
            .embeddings()
            .create_base64(CreateEmbeddingRequest {
                model: g.into(),
                input: EmbeddingInput::String(input),
                dimensions: Some(d),
                encoding_format: Some(EncodingFormat::Base64),
                ..Default::default()
            })
            .await
            .expect("base64 embeddings");
        let v: Vec<f32> = r.data[0].embedding.clone().into();
        assert!(worst(&v, &floats(&text["truncated"])) <= 1e-4);
        // The chat endpoint refuses with the model's kind, decoded by the client as an API error.
        let err = client.chat().create(request(g, 4, false)).await.unwrap_err();
        match err {
            OpenAIError::ApiError(e) => {
                assert_eq!(e.status_code.as_u16(), 400);
                assert!(e.api_error.message.contains("an embedding model"), "{}", e.api_error.message);
            }
            other => panic!("not an API error: {other}"),
        }
    });
}
