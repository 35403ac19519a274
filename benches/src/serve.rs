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

/// One streamed request; the client's view of it.
fn ask(s: &Server, messages: &Value, max_tokens: usize) -> Result<Turn> {
    let body = json!({"messages": messages, "max_tokens": max_tokens, "stream": true,
                      "stream_options": {"include_usage": true}});
    let agent = ureq::AgentBuilder::new().timeout(Duration::from_secs(900)).build();
    let t0 = Instant::now();
    let resp = agent
        .post(&format!("{}/v1/chat/completions", s.base))
        .set("Content-Type", "application/json")
        .send_string(&body.to_string())
        .map_err(|e| anyhow::anyhow!("request failed: {e}"))?;
    let (mut text, mut first, mut last, mut usage) = (String::new(), None, t0, Value::Null);
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
            text.push_str(piece);
        }
        if !v["usage"].is_null() {
            usage = v["usage"].clone();
        }
    }
    let ttft = first.context("no content streamed")?;
    let n = usage["completion_tokens"].as_u64().unwrap_or(0);
    let decode = (last - t0).saturating_sub(ttft).as_secs_f64();
    Ok(Turn {
        text,
        prompt_tokens: usage["prompt_tokens"].as_u64().unwrap_or(0),
        cached_tokens: usage["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0),
        ttft,
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
