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
    let server = start(g, &[]);
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
