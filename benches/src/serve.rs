//! The server path: `vl serve` started once per configuration, driven over HTTP with streamed
//! answers as a chat client drives it. Per turn: prompt tokens, tokens reused from the previous
//! request, the client's time to first token and the decode speed it sees. Configurations: the
//! engine's caches on (default) and off (`--no-prefix-cache --image-cache-mib 0`).

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

pub struct Server {
    pub child: Child,
    pub base: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn start(vl: &Path, model: &Path, quantize: &str, media: &Path, extra: &[&str]) -> Result<Server> {
    let mut child = Command::new(vl)
        .args(["serve", "--port", "0", "--quantize", quantize, "--model"])
        .arg(model)
        .arg("--allowed-media-dir")
        .arg(media)
        .args(extra)
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .context("starting vl serve")?;
    let stderr = child.stderr.take().context("stderr")?;
    let mut lines = BufReader::new(stderr).lines();
    let base = loop {
        let Some(line) = lines.next() else { bail!("vl serve exited before listening") };
        let line = line?;
        if let Some(at) = line.find("listening on ") {
            break line[at + "listening on ".len()..].trim().to_string();
        }
    };
    // Keep draining stderr so the server never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines {});
    Ok(Server { child, base })
}

pub struct Turn {
    pub text: String,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub ttft: Duration,
    pub decode_tps: f64,
}

/// A streamed answer as its client saw it.
pub struct Streamed {
    pub text: String,
    /// Content pieces received.
    pub pieces: u64,
    pub ttft: Duration,
    /// From the request to the last content piece, and to the end of the stream.
    pub last: Duration,
    pub total: Duration,
    /// The final chunk's `usage` (null when the server sent none).
    pub usage: Value,
}

/// POSTs `body` (a streamed chat completion) to `base` and reads its SSE stream to `[DONE]`.
pub fn stream(base: &str, body: &Value) -> Result<Streamed> {
    let agent = ureq::AgentBuilder::new().timeout(Duration::from_secs(1800)).build();
    let t0 = Instant::now();
    let resp = agent
        .post(&format!("{base}/v1/chat/completions"))
        .set("Content-Type", "application/json")
        .send_string(&body.to_string())
        .map_err(|e| anyhow::anyhow!("request failed: {e}"))?;
    let (mut text, mut pieces, mut first, mut last, mut usage) = (String::new(), 0, None, t0, Value::Null);
    for line in BufReader::new(resp.into_reader()).lines() {
        let line = line?;
        let Some(d) = line.strip_prefix("data: ") else { continue };
        if d == "[DONE]" {
            break;
        }
        let v: Value = serde_json::from_str(d)?;
        if let Some(piece) = v["choices"][0]["delta"]["content"].as_str().filter(|p| !p.is_empty()) {
            first.get_or_insert_with(|| t0.elapsed());
            last = Instant::now();
            pieces += 1;
            text.push_str(piece);
        }
        if !v["usage"].is_null() {
            usage = v["usage"].clone();
        }
    }
    let ttft = first.context("no content streamed")?;
    Ok(Streamed { text, pieces, ttft, last: last - t0, total: t0.elapsed(), usage })
}

/// One streamed request of the three-turn scenario.
fn ask(s: &Server, messages: &Value, max_tokens: usize) -> Result<Turn> {
    let body = json!({"messages": messages, "max_tokens": max_tokens, "stream": true,
                      "stream_options": {"include_usage": true}});
    let r = stream(&s.base, &body)?;
    let n = r.usage["completion_tokens"].as_u64().unwrap_or(0);
    let decode = r.last.saturating_sub(r.ttft).as_secs_f64();
    Ok(Turn {
        text: r.text,
        prompt_tokens: r.usage["prompt_tokens"].as_u64().unwrap_or(0),
        cached_tokens: r.usage["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0),
        ttft: r.ttft,
        decode_tps: if decode > 0.0 { n.saturating_sub(1) as f64 / decode } else { f64::NAN },
    })
}

/// Runs the three-turn scenario on a server with and without the engine's caches and prints one
/// table row per turn.
pub fn bench(vl: &Path, model: &Path, quantize: &str, image: &Path, side: usize, new_tokens: usize) -> Result<()> {
    let image = image.canonicalize().with_context(|| image.display().to_string())?;
    let media = image.parent().context("image directory")?;
    let px = side * side;
    let img = json!({"type": "image_url", "image_url": {"url": image.display().to_string()},
                     "min_pixels": px, "max_pixels": px});
    println!("| server | request | prompt tokens | reused | TTFT s | decode tok/s |");
    println!("|---|---|---|---|---|---|");
    for (name, extra) in [("caches on", &[][..]), ("caches off", &["--no-prefix-cache", "--image-cache-mib", "0"][..])]
    {
        let s = start(vl, model, quantize, media, extra)?;
        let turn1 = json!([{"role": "user", "content": [img, {"type": "text", "text": "Describe this image."}]}]);
        let a = ask(&s, &turn1, new_tokens)?;
        let mut turn2 = turn1.as_array().unwrap().clone();
        turn2.push(json!({"role": "assistant", "content": a.text}));
        turn2.push(json!({"role": "user", "content": "Which colors stand out, and where are they?"}));
        let b = ask(&s, &Value::Array(turn2), new_tokens)?;
        let other =
            json!([{"role": "user", "content": [img, {"type": "text", "text": "Is there any text in this picture?"}]}]);
        let c = ask(&s, &other, new_tokens)?;
        for (what, t) in
            [("turn 1: image + question", &a), ("turn 2: follow-up (text)", &b), ("new conversation, same image", &c)]
        {
            println!(
                "| {name} | {what} | {} | {} | {:.2} | {:.2} |",
                t.prompt_tokens,
                t.cached_tokens,
                t.ttft.as_secs_f64(),
                t.decode_tps
            );
        }
    }
    Ok(())
}
