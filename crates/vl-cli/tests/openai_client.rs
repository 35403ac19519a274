//! `vl serve` driven by a real OpenAI client library (async-openai): its request serialization,
//! response and SSE parsing, and error decoding all work against our server, and the answers
//! are the reference's.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use async_openai::config::OpenAIConfig;
use async_openai::error::OpenAIError;
use async_openai::types::chat::CreateChatCompletionRequest;
use async_openai::Client;
use base64::Engine as _;
use futures_util::StreamExt;
use serde_json::{json, Value};

fn goldens() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../goldens")
}

struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start(g: &str) -> (Server, String) {
    let ck = goldens().join(g).join("checkpoint");
    let mut child = Command::new(env!("CARGO_BIN_EXE_vl"))
        .args(["serve", "--model", ck.to_str().unwrap(), "--served-model-name", g, "--port", "0"])
        .env("HF_HUB_OFFLINE", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start vl serve");
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let deadline = Instant::now() + Duration::from_secs(120);
    let base = loop {
        assert!(Instant::now() < deadline, "the server did not start in time");
        let line = lines.next().expect("server exited before listening").unwrap();
        if let Some(url) = line.strip_prefix("listening on ") {
            break url.trim().to_string();
        }
    };
    std::thread::spawn(move || for _ in lines {});
    (Server(child), base)
}

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
    let (_server, base) = start(g);
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
