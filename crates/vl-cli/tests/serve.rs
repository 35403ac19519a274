//! `vl serve` end to end: a server on a free loopback port with a tiny checkpoint, driven over
//! HTTP as an OpenAI client drives it. Answers equal the reference's greedy text; every error
//! has its status and OpenAI-shaped body; concurrency, overload and disconnects are bounded.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::time::{Duration, Instant};

mod common;

use base64::Engine as _;
use common::{goldens, start, Server};
use serde_json::{json, Value};

fn read_json(p: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

fn agent() -> ureq::Agent {
    ureq::AgentBuilder::new().timeout(Duration::from_secs(120)).build()
}

/// (status, body as JSON) of a POST; error statuses are answers here, not failures.
fn post(s: &Server, path: &str, body: &str) -> (u16, Value) {
    let r = agent().post(&format!("{}{path}", s.base)).set("Content-Type", "application/json").send_string(body);
    let resp = match r {
        Ok(r) => r,
        Err(ureq::Error::Status(_, r)) => r,
        Err(e) => panic!("POST {path}: {e}"),
    };
    let status = resp.status();
    let text = resp.into_string().unwrap();
    (status, serde_json::from_str(&text).unwrap_or_else(|_| panic!("not JSON ({status}): {text}")))
}

/// Sends only the headers of a POST announcing `len` body bytes; the status and JSON body.
fn raw_post(s: &Server, path: &str, len: usize) -> (u16, Value) {
    partial_post(s, path, len, None)
}

/// A POST announcing `len` body bytes that sends only `sent` of them, then closes its side.
fn short_post(s: &Server, path: &str, len: usize, sent: &str) -> (u16, Value) {
    partial_post(s, path, len, Some(sent))
}

/// A POST's headers announcing `len` body bytes, then `sent` (if any) and the end of its side;
/// the status and JSON body of the answer.
fn partial_post(s: &Server, path: &str, len: usize, sent: Option<&str>) -> (u16, Value) {
    let addr = s.base.trim_start_matches("http://");
    let mut sock = std::net::TcpStream::connect(addr).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(
        sock,
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {len}\r\nConnection: close\r\n\r\n{}",
        sent.unwrap_or("")
    )
    .unwrap();
    if sent.is_some() {
        sock.shutdown(std::net::Shutdown::Write).unwrap();
    }
    let mut resp = String::new();
    let _ = sock.read_to_string(&mut resp);
    let status: u16 = resp.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or_else(|| panic!("{resp:?}"));
    let body = resp.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    (status, serde_json::from_str(body).unwrap_or_else(|_| panic!("not JSON ({status}): {body:?}")))
}

fn get(s: &Server, path: &str) -> (u16, String) {
    match agent().get(&format!("{}{path}", s.base)).call() {
        Ok(r) => (r.status(), r.into_string().unwrap()),
        Err(ureq::Error::Status(c, r)) => (c, r.into_string().unwrap()),
        Err(e) => panic!("GET {path}: {e}"),
    }
}

fn data_url(name: &str) -> String {
    let bytes = std::fs::read(goldens().join("images").join(name)).unwrap();
    format!("data:image/png;base64,{}", base64::engine::general_purpose::STANDARD.encode(bytes))
}

fn one_image(model: &str, max: usize, extra: Value) -> Value {
    let mut v = json!({
        "model": model,
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url("square.png")}},
            {"type": "text", "text": "Describe this image."},
        ]}],
        "max_tokens": max,
    });
    for (k, x) in extra.as_object().unwrap() {
        v[k] = x.clone();
    }
    v
}

fn golden(g: &str) -> (String, usize, usize) {
    let meta = read_json(&goldens().join(g).join("cases/one_image.json"));
    let n = meta["greedy"]["ids"].as_array().unwrap().len();
    (meta["greedy"]["text"].as_str().unwrap().to_string(), n, meta["num_tokens"].as_u64().unwrap() as usize)
}

fn assert_error(status: u16, body: &Value, want_status: u16, needle: &str) {
    assert_eq!(status, want_status, "{body}");
    let msg = body["error"]["message"].as_str().unwrap_or_else(|| panic!("no error.message: {body}"));
    assert!(body["error"]["type"].is_string(), "{body}");
    assert!(msg.contains(needle), "{msg:?} should mention {needle:?}");
}

/// The SSE data lines of a streamed answer.
fn stream(s: &Server, body: &Value) -> Vec<String> {
    let resp = agent()
        .post(&format!("{}/v1/chat/completions", s.base))
        .set("Content-Type", "application/json")
        .send_string(&body.to_string())
        .expect("stream");
    assert_eq!(resp.header("content-type"), Some("text/event-stream"));
    let mut out = Vec::new();
    for line in BufReader::new(resp.into_reader()).lines() {
        let line = line.unwrap();
        if let Some(d) = line.strip_prefix("data: ") {
            out.push(d.to_string());
            if d == "[DONE]" {
                break;
            }
        }
    }
    out
}

#[test]
fn answers_stream_and_report_usage_like_the_reference() {
    let g = "tiny-b";
    let s = start(g, &[]);
    let (want, n, prompt) = golden(g);

    let (status, v) = post(&s, "/v1/chat/completions", &one_image(g, n, json!({})).to_string());
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], g);
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["choices"][0]["message"]["content"], want.as_str());
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["prompt_tokens"], prompt);
    assert_eq!(v["usage"]["completion_tokens"], n);
    assert_eq!(v["usage"]["total_tokens"], prompt + n);
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    // square.png, 128x128: 8x8 patches merged 2x2.
    assert_eq!(v["usage"]["prompt_tokens_details"]["image_tokens"], 16);

    let lines = stream(&s, &one_image(g, n, json!({"stream": true, "stream_options": {"include_usage": true}})));
    assert_eq!(lines.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = lines[..lines.len() - 1].iter().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String =
        chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect::<Vec<_>>().concat();
    assert_eq!(text, want);
    assert!(chunks.iter().all(|c| c["object"] == "chat.completion.chunk"));
    let finish: Vec<&Value> =
        chunks.iter().map(|c| &c["choices"][0]["finish_reason"]).filter(|f| !f.is_null()).collect();
    assert_eq!(finish, vec![&json!("length")]);
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(usage["prompt_tokens"], prompt);
    assert_eq!(usage["completion_tokens"], n);
    // The second identical prompt reuses all but its last position.
    assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], prompt - 1);

    // A per-image budget within the server's: 64x64 pixels, 2x2 merged tokens.
    let small = json!({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url("square.png")}, "max_pixels": 4096},
        {"type": "text", "text": "Describe this image."}]}], "max_tokens": 1});
    let (status, v) = post(&s, "/v1/chat/completions", &small.to_string());
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["prompt_tokens_details"]["image_tokens"], 4);
    assert_eq!(v["usage"]["prompt_tokens"], prompt - 12);
    let (status, models) = get(&s, "/v1/models");
    assert_eq!(status, 200);
    let models: Value = serde_json::from_str(&models).unwrap();
    assert_eq!(models["data"][0]["id"], g);
    assert_eq!(get(&s, "/health").0, 200);
    let (status, metrics) = get(&s, "/metrics");
    assert_eq!(status, 200);
    assert!(metrics.contains("vl_requests_total{status=\"200\"} 3"), "{metrics}");
    assert!(metrics.contains(&format!("vl_completion_tokens_total {}", 2 * n + 1)), "{metrics}");
    assert!(metrics.contains("vl_image_cache_hits_total 1"), "{metrics}");
    assert!(metrics.contains("vl_queue_depth 0"), "{metrics}");
}

#[test]
fn every_bad_request_gets_its_status_and_an_openai_error() {
    let g = "tiny-a";
    let s = start(g, &["--max-body-bytes", "100000", "--strict-model-name"]);
    let c = "/v1/chat/completions";
    let ok = |extra: Value| one_image(g, 2, extra).to_string();
    let (st, b) = post(&s, c, "{\"messages\": [");
    assert_error(st, &b, 400, "malformed JSON");
    let (st, b) = post(&s, c, &ok(json!({"temperature": "hot"})));
    assert_error(st, &b, 400, "temperature");
    let (st, b) = post(&s, c, &ok(json!({"temperature": 3.5})));
    assert_error(st, &b, 400, "temperature");
    let (st, b) = post(&s, c, &ok(json!({"model": "gpt-4o"})));
    assert_error(st, &b, 404, "gpt-4o");
    let (st, b) = post(&s, c, &ok(json!({"n": 9})));
    assert_error(st, &b, 400, "n");
    let (st, b) = post(&s, c, &ok(json!({"tools": [{"type": "function"}]})));
    assert_error(st, &b, 400, "tools");
    // tiny-a's built-in template has no tools: refused, not silently dropped.
    let f = json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]);
    let (st, b) = post(&s, c, &ok(json!({"tools": f})));
    assert_error(st, &b, 400, "no `tools` variable");
    let (st, b) = post(&s, c, &ok(json!({"tools": f, "tool_choice": "required"})));
    assert_error(st, &b, 400, "no `tools` variable");
    let (st, b) = post(&s, c, &ok(json!({"tool_choice": "required"})));
    assert_error(st, &b, 400, "needs `tools`");
    let (st, b) = post(&s, c, &ok(json!({"tools": f, "tool_choice": {"type": "function", "function": {"name": "g"}}})));
    assert_error(st, &b, 400, "\"g\", which `tools` does not list");
    let (st, b) = post(&s, c, &ok(json!({"response_format": {"type": "yaml"}})));
    assert_error(st, &b, 400, "response_format");
    let (st, b) = post(&s, c, &ok(json!({"logit_bias": {"99999999": 5}})));
    assert_error(st, &b, 400, "logit_bias");
    let (st, b) = post(&s, c, &ok(json!({"logit_bias": {"5": 101}})));
    assert_error(st, &b, 400, "logit_bias.5");
    let bad_call = json!({"messages": [{"role": "assistant", "content": null, "tool_calls": [{"type": "function"}]},
                                       {"role": "user", "content": "hi"}]});
    let (st, b) = post(&s, c, &bad_call.to_string());
    assert_error(st, &b, 400, "tool_calls[0].function");
    let (st, b) = post(&s, c, &ok(json!({"max_tokens": 0})));
    assert_error(st, &b, 400, "max_tokens");
    let (st, b) = post(&s, c, &ok(json!({"stop": 7})));
    assert_error(st, &b, 400, "stop");
    let (st, b) = post(&s, c, &json!({"model": g}).to_string());
    assert_error(st, &b, 400, "messages");
    let (st, b) = post(&s, c, &json!({"messages": [{"role": "user", "content": 5}]}).to_string());
    assert_error(st, &b, 400, "content");
    let bad_image = json!({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}]}]});
    let (st, b) = post(&s, c, &bad_image.to_string());
    assert_error(st, &b, 400, "image");
    let remote = json!({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}]});
    let (st, b) = post(&s, c, &remote.to_string());
    assert_error(st, &b, 400, "remote");
    let local = json!({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "/etc/passwd"}}]}]});
    let (st, b) = post(&s, c, &local.to_string());
    assert_error(st, &b, 400, "allowed-media-dir");
    let long = json!({"messages": [{"role": "user", "content": "word ".repeat(3000)}]});
    let (st, b) = post(&s, c, &long.to_string());
    assert_error(st, &b, 400, "context of 2048");
    assert_eq!(b["error"]["code"], "context_length_exceeded");
    // A body announced over the limit is refused before it is read (a raw request: writing
    // the refused body would race the server closing the connection).
    let (st, b) = raw_post(&s, c, 200_000);
    assert_error(st, &b, 413, "");
    // A body shorter than its Content-Length (within the limit) is incomplete, not too large.
    for (len, sent) in [(1000, "{\"messages\": ["), (50_000, ""), (10, "{")] {
        let (st, b) = short_post(&s, c, len, sent);
        assert_error(st, &b, 400, &format!("ended before it was complete (Content-Length {len})"));
    }
    let (st, _) = get(&s, "/v1/nothing");
    assert_eq!(st, 404);
    // A GET on the POST route: 405 in OpenAI's error shape.
    let (st, b) = get(&s, c);
    assert_eq!(st, 405, "{b}");
    let b: Value = serde_json::from_str(&b).unwrap();
    assert_error(st, &b, 405, "GET is not allowed on /v1/chat/completions");
    // Any 64-bit seed, signed or not; a temperature below f32's range is greedy, not the least
    // likely tokens.
    let (want, n, _) = golden(g);
    for extra in [json!({"seed": u64::MAX}), json!({"seed": -1}), json!({"temperature": 1e-300, "seed": 7})] {
        let (st, v) = post(&s, c, &one_image(g, n, extra.clone()).to_string());
        assert_eq!(st, 200, "{extra}: {v}");
        assert_eq!(v["choices"][0]["message"]["content"], want.as_str(), "{extra}");
    }
    // After all that, a good request is answered correctly.
    let (want, n, _) = golden(g);
    let (st, v) = post(&s, c, &one_image(g, n, json!({})).to_string());
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], want.as_str());
}

/// The golden tool round (tool definitions, an assistant call, the tool's answer) in the
/// OpenAI request shape.
fn tool_round(max: usize, extra: Value) -> Value {
    let meta = read_json(&goldens().join("prompts/tool_round.json"));
    let call = &meta["messages"][2]["tool_calls"][0];
    let mut v = json!({
        "messages": [
            {"role": "system", "content": "You are a careful assistant."},
            {"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": data_url("square.png")}},
                {"type": "text", "text": "Where could this be? What is the weather there?"}]},
            {"role": "assistant", "content": "It looks like Zürich. Let me check.",
             "tool_calls": [{"id": "call_1", "type": "function", "function": call["function"]}]},
            {"role": "tool", "tool_call_id": "call_1", "content": meta["messages"][3]["content"][0]["text"]},
        ],
        "tools": meta["tools"],
        "max_tokens": max,
    });
    for (k, x) in extra.as_object().unwrap() {
        v[k] = x.clone();
    }
    v
}

#[test]
fn tools_and_tool_results_render_like_the_reference() {
    let g = "tiny-b";
    let s = start(g, &[]);
    let meta = read_json(&goldens().join(g).join("cases/tool_round.json"));
    let want = meta["greedy"]["text"].as_str().unwrap();
    let n = meta["greedy"]["ids"].as_array().unwrap().len();
    let prompt = meta["num_tokens"].as_u64().unwrap();
    let (st, v) = post(&s, "/v1/chat/completions", &tool_round(n, json!({})).to_string());
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], prompt);
    // The random weights call no function: the answer is the reference's text.
    assert_eq!(v["choices"][0]["message"]["content"], want);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert!(v["choices"][0]["message"].get("tool_calls").is_none(), "{v}");
    let lines = stream(&s, &tool_round(n, json!({"stream": true})));
    let text: String = lines[..lines.len() - 1]
        .iter()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str().map(String::from))
        .collect();
    assert_eq!(text, want);
    // tool_choice "none": the functions are left out of the prompt.
    let (st, v) = post(&s, "/v1/chat/completions", &tool_round(1, json!({"tool_choice": "none"})).to_string());
    assert_eq!(st, 200, "{v}");
    assert!(v["usage"]["prompt_tokens"].as_u64().unwrap() < prompt - 50, "{v}");
}

#[test]
fn concurrent_clients_overload_and_disconnects() {
    let g = "tiny-a";
    let s = start(g, &["--queue", "1"]);
    let (want, n, _) = golden(g);

    // Eight clients at once: the queue of 1 refuses some with 503; every answer given is right.
    let bodies: Vec<String> = (0..8).map(|_| one_image(g, n, json!({})).to_string()).collect();
    let results: Vec<(u16, Value)> = std::thread::scope(|sc| {
        let hs: Vec<_> = bodies.iter().map(|b| sc.spawn(|| post(&s, "/v1/chat/completions", b))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut answered = 0;
    for (st, v) in &results {
        match st {
            200 => {
                answered += 1;
                assert_eq!(v["choices"][0]["message"]["content"], want.as_str());
            }
            503 => assert_error(*st, v, 503, "busy"),
            other => panic!("status {other}: {v}"),
        }
    }
    assert!(answered >= 1);
    println!("{answered} of 8 answered, {} refused with 503", 8 - answered);
    // Eight clients one after another with a queue that holds them: all correct.
    let s = start(g, &["--queue", "8"]);
    let results: Vec<(u16, Value)> = std::thread::scope(|sc| {
        let hs: Vec<_> = bodies.iter().map(|b| sc.spawn(|| post(&s, "/v1/chat/completions", b))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (st, v) in &results {
        assert_eq!(*st, 200, "{v}");
        assert_eq!(v["choices"][0]["message"]["content"], want.as_str());
    }

    // A client that leaves mid-stream: the server cancels and keeps serving.
    let body = one_image(g, 2000, json!({"stream": true})).to_string();
    let addr = s.base.trim_start_matches("http://").to_string();
    let mut sock = std::net::TcpStream::connect(&addr).unwrap();
    write!(
        sock,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut buf = [0u8; 4096];
    let got = sock.read(&mut buf).unwrap();
    assert!(String::from_utf8_lossy(&buf[..got]).starts_with("HTTP/1.1 200"));
    drop(sock);
    let t = Instant::now();
    let (st, v) = post(&s, "/v1/chat/completions", &one_image(g, n, json!({})).to_string());
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], want.as_str());
    assert!(t.elapsed() < Duration::from_secs(60), "the abandoned generation was not cancelled");
    // Nine answers of n tokens, and the abandoned one stopped far short of its 2000.
    let (_, metrics) = get(&s, "/metrics");
    let total: usize = metrics
        .lines()
        .find_map(|l| l.strip_prefix("vl_completion_tokens_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("{metrics}"));
    let abandoned = total - 9 * n;
    println!("the abandoned stream generated {abandoned} tokens");
    assert!(abandoned < 1000, "the abandoned stream generated {abandoned} tokens");
}

/// A one-thread HTTP server on a free loopback port: `/square.png` is the golden image, `/big`
/// announces a gigabyte. Serves `n` connections, then stops.
fn media_server(n: usize) -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let png = std::fs::read(goldens().join("images/square.png")).unwrap();
    std::thread::spawn(move || {
        for conn in listener.incoming().take(n) {
            let Ok(mut c) = conn else { continue };
            c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            let mut req = Vec::new();
            let mut buf = [0u8; 1024];
            while !req.windows(4).any(|w| w == b"\r\n\r\n") {
                match c.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(k) => req.extend_from_slice(&buf[..k]),
                }
            }
            let head = String::from_utf8_lossy(&req);
            let redirect = |c: &mut std::net::TcpStream, to: &str| {
                let _ =
                    write!(c, "HTTP/1.1 302 Found\r\nLocation: {to}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
            };
            // /r/N: N+1 redirects in a row, the last to /square.png; /file: a redirect to file://.
            let path = head.split(' ').nth(1).unwrap_or("");
            if let Some(k) = path.strip_prefix("/r/").and_then(|k| k.parse::<usize>().ok()) {
                redirect(&mut c, &if k == 0 { "/square.png".to_string() } else { format!("/r/{}", k - 1) });
            } else if path == "/file" {
                redirect(&mut c, "file:///etc/hostname");
            } else if head.starts_with("GET /square.png") {
                let _ = write!(
                    c,
                    "HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                    png.len()
                );
                let _ = c.write_all(&png);
            } else {
                let _ = write!(c, "HTTP/1.1 200 OK\r\nContent-Length: 1000000000\r\nConnection: close\r\n\r\n");
            }
        }
    });
    format!("http://{addr}")
}

#[test]
fn remote_images_only_when_allowed_and_within_limits() {
    let g = "tiny-a";
    // 2 + 4 (three redirects) + 4 (the fourth refused) + 1 (to file://) connections.
    let media = media_server(11);
    let s = start(g, &["--allow-remote-media", "--remote-media-timeout", "30"]);
    let (want, n, prompt) = golden(g);
    let body = |url: String| {
        json!({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": "Describe this image."}]}], "max_tokens": n})
        .to_string()
    };
    let (st, v) = post(&s, "/v1/chat/completions", &body(format!("{media}/square.png")));
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], want.as_str());
    assert_eq!(v["usage"]["prompt_tokens"], prompt);
    let (st, b) = post(&s, "/v1/chat/completions", &body(format!("{media}/big")));
    assert_error(st, &b, 413, "1000000000 bytes");
    // Three redirects are followed (docs/limits.md), a fourth is not, nor one to file://.
    let (st, v) = post(&s, "/v1/chat/completions", &body(format!("{media}/r/2")));
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], want.as_str());
    let (st, b) = post(&s, "/v1/chat/completions", &body(format!("{media}/r/3")));
    assert_error(st, &b, 400, "more than 3 redirects");
    let (st, b) = post(&s, "/v1/chat/completions", &body(format!("{media}/file")));
    assert_error(st, &b, 400, "redirect to a file: URL refused");
    // Nothing listens on the media server's port any more: a clear 400.
    let (st, b) = post(&s, "/v1/chat/completions", &body(format!("{media}/square.png")));
    assert_error(st, &b, 400, "cannot fetch");
}

#[test]
fn sigterm_lets_the_running_answer_finish_then_exits() {
    let g = "tiny-a";
    let mut s = start(g, &[]);
    let (want, _, _) = golden(g);
    // A long answer (1500 tokens, seconds on the tiny model), so SIGTERM arrives mid-generation.
    let long = 1500;
    std::thread::scope(|sc| {
        let running = sc.spawn(|| post(&s, "/v1/chat/completions", &one_image(g, long, json!({})).to_string()));
        let t = Instant::now();
        loop {
            let (_, m) = get(&s, "/metrics");
            if m.contains("vl_requests_running 1") {
                break;
            }
            assert!(t.elapsed() < Duration::from_secs(60), "the request never started");
            std::thread::sleep(Duration::from_millis(5));
        }
        unsafe { libc::kill(s.child.id() as i32, libc::SIGTERM) };
        let (st, v) = running.join().unwrap();
        assert_eq!(st, 200, "{v}");
        assert_eq!(v["usage"]["completion_tokens"], long, "the running answer was cut short");
        assert!(v["choices"][0]["message"]["content"].as_str().unwrap().starts_with(want.as_str()));
    });
    let t = Instant::now();
    let status = loop {
        if let Some(st) = s.child.try_wait().unwrap() {
            break st;
        }
        assert!(t.elapsed() < Duration::from_secs(60), "the server did not exit after SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "exit status {status}");
}

fn video_b64(name: &str) -> String {
    base64::engine::general_purpose::STANDARD.encode(std::fs::read(goldens().join("videos").join(name)).unwrap())
}

/// The golden tiny-a video cases in the OpenAI request shape: `video_url` (data URL or a path
/// under --allowed-media-dir) and `input_video` (base64 data) give the reference's greedy text.
#[test]
fn video_parts_answer_like_the_reference() {
    let g = "tiny-a";
    let media = goldens().canonicalize().unwrap();
    let s = start(g, &["--allowed-media-dir", media.to_str().unwrap()]);
    let c = "/v1/chat/completions";
    let case = |name: &str| {
        let meta = read_json(&goldens().join(g).join("cases").join(format!("{name}.json")));
        let text = meta["greedy"]["text"].as_str().unwrap().to_string();
        (text, meta["greedy"]["ids"].as_array().unwrap().len())
    };
    let ask = |content: Value, max: usize| -> (u16, Value) {
        post(
            &s,
            c,
            &json!({"model": g, "messages": [{"role": "user", "content": content}], "max_tokens": max}).to_string(),
        )
    };
    // [image square, video odd5, text] as a data URL.
    let (want, n) = case("video_image");
    let url = format!("data:video/x-matroska;base64,{}", video_b64("odd5.mkv"));
    let (st, v) = ask(
        json!([{"type": "image_url", "image_url": {"url": data_url("square.png")}},
               {"type": "video_url", "video_url": {"url": url}},
               {"type": "text", "text": "Compare the picture with the clip."}]),
        n,
    );
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], want.as_str());
    // [video fps15, text]: base64 data, then a local path.
    let (want, n) = case("video");
    let text = json!({"type": "text", "text": "What happens in the video?"});
    let (st, v) = ask(json!([{"type": "input_video", "input_video": {"data": video_b64("fps15.mkv")}}, text]), n);
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], want.as_str());
    let path = media.join("videos/fps15.mkv").display().to_string();
    let (st, v) = ask(json!([{"type": "video_url", "video_url": {"url": path}}, text]), n);
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], want.as_str());
    assert_eq!(v["usage"]["prompt_tokens"].as_u64(), Some(52), "{v}");
    // The reference's grid [3, 4, 4] with 2x2 merging: 12 video tokens; the same clip twice, so
    // the second request took its features from the cache.
    let meta = read_json(&goldens().join(g).join("cases/video.json"));
    let grid: u64 = meta["video_grid_thw"][0].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).product();
    assert_eq!(v["usage"]["prompt_tokens_details"]["video_tokens"].as_u64(), Some(grid / 4), "{v}");
    assert_eq!(v["usage"]["prompt_tokens_details"]["image_tokens"].as_u64(), Some(0), "{v}");
    let metrics = get(&s, "/metrics").1;
    assert!(metrics.contains("vl_video_cache_hits_total 1"), "{metrics}");
    // Bad video parts: each a 4xx with the culprit named.
    let (st, b) = ask(json!([{"type": "input_video", "input_video": {"data": "%%%"}}]), 2);
    assert_error(st, &b, 400, "base64");
    let (st, b) = ask(json!([{"type": "input_video", "input_video": {"data": "aGVsbG8gd29ybGQ="}}]), 2);
    assert_error(st, &b, 400, "video");
    // An uploaded playlist naming a local file: refused, it must not read that file.
    let list = format!("#EXTM3U\n#EXTINF:10.0,\n{path}\n#EXT-X-ENDLIST\n");
    let data = base64::engine::general_purpose::STANDARD.encode(list);
    let (st, b) = ask(json!([{"type": "input_video", "input_video": {"data": data}}]), 2);
    assert_error(st, &b, 400, "cannot read it");
    let (st, b) = ask(json!([{"type": "video_url", "video_url": {"url": "/etc/hostname"}}]), 2);
    assert_error(st, &b, 403, "outside the allowed media directory");
    let (st, b) = ask(json!([{"type": "video_url", "video_url": {"url": path}, "fps": 0}]), 2);
    assert_error(st, &b, 400, "fps");
    let (st, b) = ask(json!([{"type": "video_url", "video_url": {"url": path, "max_frames": 100000}}]), 2);
    assert_error(st, &b, 400, "max_frames");
    let (st, b) = ask(json!([{"type": "video_url", "video_url": 7}]), 2);
    assert_error(st, &b, 400, "video_url");
}

#[test]
fn sixteen_clients_at_once_each_get_their_solo_answer() {
    // Four different requests (image or not, different lengths), each sent alone first, then
    // four times each all at once: every answer equals its solo one, none is lost or repeated.
    let g = "tiny-b";
    let s = start(g, &["--parallel", "4", "--queue", "16"]);
    let (_, n, _) = golden(g);
    let text = |t: &str, max: usize| {
        json!({"model": g, "messages": [{"role": "user", "content": t}], "max_tokens": max}).to_string()
    };
    let bodies = [
        one_image(g, n, json!({})).to_string(),
        text("Write a haiku about the sea.", 20),
        one_image(
            g,
            3,
            json!({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url("odd.png")}},
            {"type": "text", "text": "What is in the corner?"}]}]}),
        )
        .to_string(),
        text("Count to ten.", 12),
    ];
    let answer = |v: &Value| v["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    let solo: Vec<String> = bodies
        .iter()
        .map(|b| {
            let (st, v) = post(&s, "/v1/chat/completions", b);
            assert_eq!(st, 200, "{v}");
            answer(&v)
        })
        .collect();
    let t = Instant::now();
    let results: Vec<(usize, u16, Value)> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..16)
            .map(|i| {
                let b = &bodies[i % 4];
                let s = &s;
                sc.spawn(move || {
                    let (st, v) = post(s, "/v1/chat/completions", b);
                    (i % 4, st, v)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut ids = std::collections::HashSet::new();
    for (k, st, v) in &results {
        assert_eq!(*st, 200, "{v}");
        assert_eq!(answer(v), solo[*k], "request kind {k}");
        assert!(ids.insert(v["id"].as_str().unwrap().to_string()), "a repeated id: {v}");
    }
    println!("16 concurrent answers in {:.2}s", t.elapsed().as_secs_f64());
}

#[test]
fn api_key_cors_preflight_and_one_log_line_per_request() {
    let g = "tiny-a";
    let s = start(g, &["--api-key", "sekret", "--cors-origins", "http://app.example"]);
    let (want, n, _) = golden(g);
    let body = one_image(g, n, json!({})).to_string();
    let url = format!("{}/v1/chat/completions", s.base);
    let call = |key: Option<&str>| {
        let mut r = agent().post(&url).set("Content-Type", "application/json");
        if let Some(k) = key {
            r = r.set("Authorization", &format!("Bearer {k}"));
        }
        match r.send_string(&body) {
            Ok(r) => (r.status(), serde_json::from_str::<Value>(&r.into_string().unwrap()).unwrap()),
            Err(ureq::Error::Status(c, r)) => (c, serde_json::from_str::<Value>(&r.into_string().unwrap()).unwrap()),
            Err(e) => panic!("{e}"),
        }
    };
    let (st, v) = call(None);
    assert_error(st, &v, 401, "API key");
    assert_eq!(v["error"]["code"], "invalid_api_key");
    let (st, v) = call(Some("sekreT"));
    assert_error(st, &v, 401, "API key");
    let (st, v) = call(Some("sekret"));
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], want.as_str());
    assert_eq!(get(&s, "/health").0, 200, "/health needs no key");
    assert_eq!(get(&s, "/v1/models").0, 401);

    // CORS: the allowed origin's preflight is answered and named; another origin is not.
    let preflight = |origin: &str| {
        let r = agent()
            .request("OPTIONS", &url)
            .set("Origin", origin)
            .set("Access-Control-Request-Method", "POST")
            .call()
            .unwrap_or_else(|e| panic!("OPTIONS: {e}"));
        (
            r.status(),
            r.header("access-control-allow-origin").map(String::from),
            r.header("access-control-allow-headers").map(String::from),
        )
    };
    let (st, allow, headers) = preflight("http://app.example");
    assert_eq!((st, allow.as_deref()), (204, Some("http://app.example")));
    assert!(headers.unwrap().contains("authorization"));
    let (st, allow, _) = preflight("http://evil.example");
    assert_eq!((st, allow), (204, None));

    // One line per request: the answer with its token counts, the refusals with their status.
    let deadline = Instant::now() + Duration::from_secs(10);
    let log = loop {
        let log = s.log.lock().unwrap().clone();
        let preflights = log.iter().filter(|l| l.starts_with("OPTIONS ")).count();
        if (log.iter().filter(|l| l.contains(" 401 ")).count() >= 3 && preflights >= 2) || Instant::now() > deadline {
            break log;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let answered: Vec<&String> = log.iter().filter(|l| l.starts_with("POST /v1/chat/completions 200 ")).collect();
    assert_eq!(answered.len(), 1, "{log:?}");
    assert!(answered[0].contains(&format!("completion={n}")) && answered[0].contains("ttft="), "{}", answered[0]);
    assert_eq!(log.iter().filter(|l| l.starts_with("POST /v1/chat/completions 401 ")).count(), 2, "{log:?}");
    assert!(log.iter().any(|l| l.starts_with("GET /v1/models 401 ")), "{log:?}");
    assert_eq!(log.iter().filter(|l| l.starts_with("OPTIONS /v1/chat/completions 204 ")).count(), 2, "{log:?}");
}

#[test]
fn a_prompt_over_the_kv_budget_gets_503_and_the_server_keeps_serving() {
    // tiny-b's KV cache takes 1152 bytes a position (3 layers x 2 x 2 heads x 24 x f32): 1 MiB
    // holds 910 positions, so a ~1200-token prompt can never fit (its context is 2048).
    let g = "tiny-b";
    let s = start(g, &["--kv-cache-mib", "1"]);
    let long = json!({"messages": [{"role": "user", "content": "word ".repeat(1200)}], "max_tokens": 2});
    let (st, b) = post(&s, "/v1/chat/completions", &long.to_string());
    assert_error(st, &b, 503, "KV cache");
    assert_eq!(b["error"]["code"], "kv_cache_exhausted");
    assert!(b["error"]["message"].as_str().unwrap().contains("budget of 1.0 MiB"), "{b}");
    let (want, n, _) = golden(g);
    let (st, v) = post(&s, "/v1/chat/completions", &one_image(g, n, json!({})).to_string());
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], want.as_str());
}

/// A chat template whose loop only long conversations trigger (so inspect's test render passes):
/// that request gets a 400 naming the template within the instruction budget, and the server
/// keeps serving others.
#[test]
fn a_hostile_template_costs_one_request_not_the_server() {
    let dir = tempfile::tempdir().unwrap();
    // Links to the golden's files, but the template: it is written new (never through a link).
    for entry in std::fs::read_dir(goldens().join("tiny-a/checkpoint")).unwrap() {
        let p = entry.unwrap().path();
        if p.file_name().unwrap() != "chat_template.jinja" {
            let to = dir.path().join(p.file_name().unwrap());
            std::os::unix::fs::symlink(std::fs::canonicalize(&p).unwrap(), to).unwrap();
        }
    }
    std::fs::write(
        dir.path().join("chat_template.jinja"),
        "{% if messages|length > 3 %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}{% endif %}\
         {% if messages|length == 3 %}{% set ns = namespace(s='xxxxxxxx') %}{% for i in range(40) %}\
         {% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}{% endif %}\
         {% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}{% else %}\
         {% for c in m.content %}{% if c.type == 'text' %}{{ c.text }}{% elif c.type == 'image' %}\
         <|vision_start|><|image_pad|><|vision_end|>{% elif c.type == 'video' %}<|vision_start|><|video_pad|><|vision_end|>\
         {% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}\
         {% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    )
    .unwrap();
    let s = common::start_dir(dir.path(), &[]);
    let c = "/v1/chat/completions";
    let short = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).to_string();
    let long = json!({"messages": [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}, {"role": "user", "content": "e"}],
        "max_tokens": 2})
    .to_string();
    let (st, v) = post(&s, c, &short);
    assert_eq!(st, 200, "{v}");
    let t = Instant::now();
    let (st, b) = post(&s, c, &long);
    assert_error(st, &b, 400, "chat_template.jinja");
    assert!(b["error"]["message"].as_str().unwrap().contains("instructions"), "{b}");
    assert!(t.elapsed() < Duration::from_secs(30), "{:?}", t.elapsed());
    let (st, v) = post(&s, c, &short);
    assert_eq!(st, 200, "the server keeps serving: {v}");
    // A string doubled 40 times (8 TiB) when the conversation has 3 messages: the render's
    // child process runs out of its 256 MiB, the request gets 400, the server's own peak memory
    // stays far below that, and it keeps serving.
    let three = json!({"messages": [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
        "max_tokens": 2})
    .to_string();
    let t = Instant::now();
    let (st, b) = post(&s, c, &three);
    assert_error(st, &b, 400, "chat_template.jinja");
    assert!(b["error"]["message"].as_str().unwrap().contains("more than 256 MiB of memory"), "{b}");
    assert!(t.elapsed() < Duration::from_secs(30), "{:?}", t.elapsed());
    let status = std::fs::read_to_string(format!("/proc/{}/status", s.child.id())).unwrap();
    let peak_kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    assert!(peak_kb < 600 << 10, "the server's peak memory: {peak_kb} kB");
    let (st, v) = post(&s, c, &short);
    assert_eq!(st, 200, "the server keeps serving: {v}");
}

#[test]
fn serve_flags_out_of_range_are_refused_with_the_flag() {
    for (flag, value) in [
        ("--queue", "10000000000"),
        ("--queue", "4097"),
        ("--parallel", "0"),
        ("--max-connections", "0"),
        ("--max-connections", "100000000"),
        ("--header-timeout", "0"),
        ("--body-timeout", "NaN"),
        ("--shutdown-timeout", "1000000"),
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_vl"))
            .args(["serve", "--model", goldens().join("tiny-a/checkpoint").to_str().unwrap(), flag, value])
            .env("HF_HUB_OFFLINE", "1")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{flag} {value}");
        assert!(err.contains(flag) && err.contains(value), "{flag} {value}: {err}");
        assert!(!err.contains("panicked") && !err.contains("memory allocation"), "{err}");
    }
    // `--speculative mtp` on a model without a multi-token-prediction head: refused at start-up,
    // one line naming the flag, not on the first request (a server that starts anyway is
    // killed after 60 s and fails the test rather than hanging it).
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_vl"))
        .args(["serve", "--model", goldens().join("tiny-a/checkpoint").to_str().unwrap(), "--port", "0"])
        .args(["--speculative", "mtp"])
        .env("HF_HUB_OFFLINE", "1")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t.elapsed() > Duration::from_secs(60) {
            child.kill().unwrap();
            child.wait().unwrap();
            panic!("vl serve --speculative mtp on tiny-a did not exit");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("speculative") && err.contains("multi-token-prediction head"), "{err}");
    assert!(!err.contains("listening") && !err.contains("panicked"), "{err}");
}

/// Text that could not fit even at the vocabulary's longest token is refused before it is
/// tokenized: quickly, whatever its shape, and the server keeps serving.
#[test]
fn text_that_cannot_fit_is_refused_before_tokenizing() {
    let g = "tiny-a";
    let s = start(g, &[]);
    let c = "/v1/chat/completions";
    for (i, unit) in ["word ", "x", "\u{4e2d}", "  "].iter().enumerate() {
        let huge = json!({"messages": [{"role": "user", "content": unit.repeat((4 << 20) / unit.len())}],
                          "seed": i});
        let t = Instant::now();
        let (st, b) = post(&s, c, &huge.to_string());
        assert_error(st, &b, 400, "cannot fit the model's context of 2048 tokens");
        assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    }

    let (want, n, _) = golden(g);
    let (st, v) = post(&s, c, &one_image(g, n, json!({})).to_string());
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], want.as_str());
}

/// One allowed local image named many times: the request's media are counted and their bytes
/// bounded as each is read (a 24 KB body naming a 700 KB image 300 times was 6 GiB before).
#[test]
fn a_request_s_media_are_bounded_in_count_and_bytes() {
    let g = "tiny-a";
    let images = goldens().join("images");
    let s = start(g, &["--allowed-media-dir", images.to_str().unwrap(), "--max-body-bytes", "4000000"]);
    let c = "/v1/chat/completions";
    let path = images.join("large.png");
    let body = |n: usize| {
        let mut content: Vec<Value> =
            (0..n).map(|_| json!({"type": "image_url", "image_url": {"url": path.to_str().unwrap()}})).collect();
        content.push(json!({"type": "text", "text": "Compare."}));
        json!({"messages": [{"role": "user", "content": content}], "max_tokens": 1}).to_string()
    };
    // 717 KB each: the sixth is over 4 MB together.
    for n in [6, 40, 300] {
        let (st, b) = post(&s, c, &body(n));
        assert_error(st, &b, 413, "over 4000000 bytes together");
        assert!(b["error"]["message"].as_str().unwrap().contains("content[5]"), "{b}");
    }
    let small = images.join("gray.png");
    let many: Vec<Value> =
        (0..65).map(|_| json!({"type": "image_url", "image_url": {"url": small.to_str().unwrap()}})).collect();
    let (st, b) = post(&s, c, &json!({"messages": [{"role": "user", "content": many}]}).to_string());
    assert_error(st, &b, 400, "more than 64 images and videos");
    // The server keeps answering.
    let (want, n, _) = golden(g);
    let (st, v) = post(&s, c, &one_image(g, n, json!({})).to_string());
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], want.as_str());
}

#[test]
fn grounding_requests_get_the_minimum_and_their_boxes_in_pixels() {
    let s = common::start("tiny-a", &[]);
    let tokens = |v: &Value| v["usage"]["prompt_tokens_details"]["image_tokens"].as_u64().unwrap();
    // square.png is 128 x 128: 16 tokens of 32 x 32. A grounding request sizes it to the
    // grounding minimum (1024 tokens), clamped to this checkpoint's budget of 65536 pixels: 64.
    let (st, plain) =
        post(&s, "/v1/chat/completions", &one_image("tiny-a", 2, json!({"grounding": false})).to_string());
    assert_eq!(st, 200, "{plain}");
    assert_eq!(tokens(&plain), 16);
    let (_, forced) = post(&s, "/v1/chat/completions", &one_image("tiny-a", 2, json!({"grounding": true})).to_string());
    assert_eq!(tokens(&forced), 64);
    let mut by_prompt = one_image("tiny-a", 2, json!({}));
    by_prompt["messages"][0]["content"][1]["text"] = json!("Locate the square; report bbox_2d coordinates as JSON.");
    let (_, guessed) = post(&s, "/v1/chat/completions", &by_prompt.to_string());
    assert_eq!(tokens(&guessed), 64);
    // The client's own cap wins.
    let mut capped = one_image("tiny-a", 2, json!({"grounding": true}));
    capped["messages"][0]["content"][0]["image_url"]["max_pixels"] = json!(16384);
    let (_, capped) = post(&s, "/v1/chat/completions", &capped.to_string());
    assert_eq!(tokens(&capped), 16);
    let (st, bad) = post(&s, "/v1/chat/completions", &one_image("tiny-a", 2, json!({"grounding": "yes"})).to_string());
    assert_error(st, &bad, 400, "grounding");

    // Boxes from an answer constrained to the grounding schema, in pixels of the image.
    let schema: Value = read_json(&goldens().join("../docs/examples/grounding-schema.json"));
    let format = json!({"type": "json_schema", "json_schema": {"name": "boxes", "schema": schema}});
    let body = one_image("tiny-a", 400, json!({"response_format": format, "temperature": 0.0}));
    let (st, v) = post(&s, "/v1/chat/completions", &body.to_string());
    assert_eq!(st, 200, "{v}");
    let text = v["choices"][0]["message"]["content"].as_str().unwrap();
    let answer: Vec<Value> = serde_json::from_str(text).unwrap();
    let g = &v["choices"][0]["grounding"];
    assert_eq!(g["coords"], "relative_1000");
    assert_eq!(g["notes"], json!([]));
    assert_eq!((g["images"][0]["width"].as_u64(), g["images"][0]["height"].as_u64()), (Some(128), Some(128)));
    let shapes = g["images"][0]["shapes"].as_array().unwrap();
    assert_eq!(shapes.len(), answer.len(), "{g}");
    for (s, a) in shapes.iter().zip(&answer) {
        assert_eq!(s["type"], "box");
        assert_eq!(s["label"], a["label"]);
        let q: Vec<f64> = a["bbox_2d"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
        let want = [q[0].min(q[2]), q[1].min(q[3]), q[0].max(q[2]), q[1].max(q[3])].map(|c| c / 1000.0 * 128.0);
        for (got, want) in s["bbox"].as_array().unwrap().iter().zip(want) {
            assert!((got.as_f64().unwrap() - want).abs() <= 0.05 + 1e-9, "{s} vs {a}");
        }
    }
    // Streamed: the same object on the choice's last chunk.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let lines = stream(&s, &streamed);
    let last: Value = lines
        .iter()
        .filter(|l| *l != "[DONE]")
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .find(|c| !c["choices"][0]["finish_reason"].is_null())
        .unwrap();
    assert_eq!(&last["choices"][0]["grounding"], g);
    // A plain answer carries no grounding field.
    assert!(plain["choices"][0].get("grounding").is_none(), "{plain}");
}

#[test]
fn local_media_only_regular_files_inside_the_allowed_dir_and_no_probing() {
    let g = "tiny-a";
    let root = tempfile::tempdir().unwrap();
    let r = root.path().canonicalize().unwrap();
    let square = goldens().join("images/square.png");
    std::fs::copy(&square, r.join("ok.png")).unwrap();
    // A FIFO under the directory (opening it for reading would block), a link to a device and
    // one to a file outside it, and a directory of frames linking outside.
    let fifo = std::ffi::CString::new(r.join("pipe.png").to_str().unwrap()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
    std::os::unix::fs::symlink("/dev/zero", r.join("zero.png")).unwrap();
    std::os::unix::fs::symlink(&square, r.join("escape.png")).unwrap();
    std::fs::create_dir(r.join("frames")).unwrap();
    for i in 0..4 {
        std::os::unix::fs::symlink(&square, r.join(format!("frames/{i}.png"))).unwrap();
    }
    let s = start(g, &["--allowed-media-dir", r.to_str().unwrap()]);
    let ask = |kind: &str, url: &str| {
        let part = if kind == "image" {
            json!({"type": "image_url", "image_url": {"url": url}})
        } else {
            json!({"type": "video_url", "video_url": {"url": url}})
        };
        let body =
            json!({"messages": [{"role": "user", "content": [part, {"type": "text", "text": "hi"}]}], "max_tokens": 2});
        let t = Instant::now();
        let out = post(&s, "/v1/chat/completions", &body.to_string());
        assert!(t.elapsed() < Duration::from_secs(20), "{url}: took {:?}", t.elapsed());
        out
    };
    // Outside the directory one answer, whether the path exists or not: generated existing and
    // missing paths, absolute, relative and through `..`.
    let dotdots = "../".repeat(r.components().count() + 2);
    let mut outside = vec![];
    for existing in ["/etc/hostname", "/proc/self/environ", "/dev/null", "/tmp", square.to_str().unwrap()] {
        outside.push(existing.to_string());
        outside.push(format!("{existing}.missing-{}", outside.len()));
        outside.push(format!("{}/{dotdots}{}", r.display(), existing.trim_start_matches('/')));
        outside.push(format!("file://{existing}"));
    }
    outside.push(format!("{}/escape.png", r.display()));
    outside.push(format!("{}/zero.png", r.display()));
    for kind in ["image", "video"] {
        for path in &outside {
            let (st, b) = ask(kind, path);
            assert_error(st, &b, 403, "is outside the allowed media directory");
            assert_eq!(b["error"]["code"], "media_not_allowed", "{path}");
        }
        // Inside it: a FIFO is refused at once, not opened.
        let (st, b) = ask(kind, &format!("{}/pipe.png", r.display()));
        assert_error(st, &b, 400, "not a regular file");
        let (st, b) = ask(kind, &format!("{}/missing.png", r.display()));
        assert_error(st, &b, 400, "cannot open");
    }
    let (st, b) = ask("video", &format!("{}/frames", r.display()));
    assert_error(st, &b, 400, "is a link to a file outside the directory");
    // A normal request is still answered, by path and after all that.
    let (st, v) = ask("image", &format!("{}/ok.png", r.display()));
    assert_eq!(st, 200, "{v}");
    let (st, _) = get(&s, "/health");
    assert_eq!(st, 200);
}

/// What a raw socket reads until the server closes it or `limit` passes: (text, closed by the
/// server).
fn read_until_closed(sock: &mut std::net::TcpStream, limit: Duration) -> (String, bool) {
    sock.set_read_timeout(Some(limit)).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match sock.read(&mut buf) {
            Ok(0) => return (String::from_utf8_lossy(&got).into_owned(), true),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {
                return (String::from_utf8_lossy(&got).into_owned(), true)
            }
            Err(_) => return (String::from_utf8_lossy(&got).into_owned(), false),
        }
    }
}

#[test]
fn slow_and_idle_connections_are_timed_out_and_bounded() {
    // A 3 s header timeout: long enough that the idle sockets outlive the over-limit clients'
    // round even on a loaded 2-core machine, short enough to watch them be closed.
    let s = start("tiny-a", &["--max-connections", "8", "--header-timeout", "3"]);
    let addr = s.base.trim_start_matches("http://").to_string();
    let connect = || std::net::TcpStream::connect(&addr).unwrap();
    // Half-sent headers are closed after the header timeout (3 s), not held forever.
    let t = Instant::now();
    let mut half = connect();
    half.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Le").unwrap();
    let (_, closed) = read_until_closed(&mut half, Duration::from_secs(15));
    assert!(closed && t.elapsed() < Duration::from_secs(10), "half-sent headers held {:?}", t.elapsed());
    // Idle sockets fill the 8 connections: the next clients get 503 at once, with an OpenAI
    // error, and the server keeps its descriptors (generated: 2 rounds of 8 idle + 12 over).
    for round in 0..2 {
        let idle: Vec<_> = (0..8).map(|_| connect()).collect();
        let opened = Instant::now();
        std::thread::sleep(Duration::from_millis(300));
        let mut refused = 0;
        for _ in 0..12 {
            // Past 2 s the header timeout (3 s) may free a slot on a loaded machine: the clients
            // that connect before it are the ones that must be refused.
            if opened.elapsed() > Duration::from_secs(2) {
                break;
            }
            refused += 1;
            let mut c = connect();
            c.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
            let (text, closed) = read_until_closed(&mut c, Duration::from_secs(5));
            assert!(closed && text.starts_with("HTTP/1.1 503"), "round {round}: {text:?}");
            assert!(text.contains("\"code\":\"too_many_connections\"") && text.contains("--max-connections"), "{text}");
        }
        assert!(refused >= 3, "round {round}: only {refused} over-limit clients within 2 s");
        // The idle ones are closed after the header timeout; /health answers again.
        let t = Instant::now();
        loop {
            let mut c = connect();
            c.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
            let (text, _) = read_until_closed(&mut c, Duration::from_secs(5));
            if text.starts_with("HTTP/1.1 200") {
                break;
            }
            assert!(t.elapsed() < Duration::from_secs(15), "round {round}: still refused: {text:?}");
            std::thread::sleep(Duration::from_millis(100));
        }
        drop(idle);
        // /health answers once the first idle socket timed out; the others (opened within
        // milliseconds of it) time out just after. Until they have, the next round's idle
        // sockets would be refused instead of held, and its over-limit clients let in.
        std::thread::sleep(Duration::from_secs(1));
    }
    let (st, v) = post(&s, "/v1/chat/completions", &one_image("tiny-a", 2, json!({})).to_string());
    assert_eq!(st, 200, "{v}");
}

#[test]
fn a_stalled_body_gets_408_and_cannot_hold_shutdown() {
    let mut s = start("tiny-a", &["--body-timeout", "2", "--shutdown-timeout", "30"]);
    let addr = s.base.trim_start_matches("http://").to_string();
    let mut c = std::net::TcpStream::connect(&addr).unwrap();
    write!(c, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{{\"mess").unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let t = Instant::now();
    unsafe { libc::kill(s.child.id() as i32, libc::SIGTERM) };
    let (text, _) = read_until_closed(&mut c, Duration::from_secs(20));
    assert!(text.starts_with("HTTP/1.1 408") && text.contains("\"code\":\"body_timeout\""), "{text:?}");
    assert!(text.contains("--body-timeout"), "{text}");
    let status = loop {
        if let Some(st) = s.child.try_wait().unwrap() {
            break st;
        }
        assert!(t.elapsed() < Duration::from_secs(20), "the server did not exit after SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "exit status {status}");
    assert!(t.elapsed() < Duration::from_secs(10), "shutdown took {:?}", t.elapsed());
}

#[test]
fn shutdown_waits_at_most_its_bound() {
    // A long answer (1900 tokens, ~15 s on the tiny model) and --shutdown-timeout 1: the server
    // exits about a second after SIGTERM, and says the answer was cut.
    let mut s = start("tiny-a", &["--shutdown-timeout", "1"]);
    std::thread::scope(|sc| {
        let base = s.base.clone();
        sc.spawn(move || {
            let body = one_image("tiny-a", 1900, json!({})).to_string();
            let _ = agent().post(&format!("{base}/v1/chat/completions")).send_string(&body);
        });
        let t = Instant::now();
        loop {
            let (_, m) = get(&s, "/metrics");
            if m.contains("vl_requests_running 1") {
                break;
            }
            assert!(t.elapsed() < Duration::from_secs(60), "the request never started");
            std::thread::sleep(Duration::from_millis(5));
        }
        let t = Instant::now();
        unsafe { libc::kill(s.child.id() as i32, libc::SIGTERM) };
        let status = loop {
            if let Some(st) = s.child.try_wait().unwrap() {
                break st;
            }
            assert!(t.elapsed() < Duration::from_secs(8), "the server did not stop at its bound");
            std::thread::sleep(Duration::from_millis(20));
        };
        assert!(status.success(), "exit status {status}");
    });
    // The log reader thread may still be draining the pipe the server wrote before it exited.
    let t = Instant::now();
    loop {
        let log = s.log.lock().unwrap().join("\n");
        if log.contains("stopped at the shutdown bound of 1 s") {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "{log}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// One request written as raw bytes on a fresh connection (`Connection: close` and the body's
/// length added): the status, the headers (names lowercased) and the body. Lets a test send what
/// an HTTP client would refuse to (raw UTF-8 in a path, blanks in a header).
fn raw_request(
    s: &Server,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, Vec<(String, String)>, String) {
    let addr = s.base.trim_start_matches("http://");
    let mut sock = std::net::TcpStream::connect(addr).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str(&format!("Content-Length: {}\r\n\r\n{body}", body.len()));
    sock.write_all(req.as_bytes()).unwrap();
    let mut resp = Vec::new();
    let _ = sock.read_to_end(&mut resp);
    let resp = String::from_utf8_lossy(&resp).to_string();
    let (head, body) = resp.split_once("\r\n\r\n").unwrap_or_else(|| panic!("{resp:?}"));
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("{resp:?}"));
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    (status, headers, body.to_string())
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
}

/// `vl serve ARGS` (with `env`) that must exit before loading anything: its stderr, within a minute.
fn refused_at_startup(args: &[&str], env: &[(&str, &str)]) -> String {
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_vl"))
        .args(["serve", "--model", goldens().join("tiny-a/checkpoint").to_str().unwrap(), "--port", "0"])
        .args(args)
        .envs(env.iter().copied())
        .env("HF_HUB_OFFLINE", "1")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{args:?} {env:?}: still running after 60 s, not refused");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    assert_eq!(status.code(), Some(1), "{args:?} {env:?}: {err}");
    assert_eq!(err.trim_end().lines().count(), 1, "one line: {err:?}");
    assert!(err.starts_with("error: ") && !err.contains("panicked"), "{err}");
    err
}

/// The status, error message and `param` of a refusal, checked.
fn assert_refused(status: u16, body: &Value, needle: &str, param: Option<&str>) {
    assert_error(status, body, 400, needle);
    if let Some(p) = param {
        assert_eq!(body["error"]["param"], p, "{body}");
    }
}

#[test]
fn cors_preflight_echoes_requested_header_names_for_allowed_origins_only() {
    let s = start("tiny-a", &["--api-key", "sekret", "--cors-origins", " http://a.example ,HTTP://B.example:8080"]);
    let preflight = |origin: &str, asked: Option<&str>| {
        let mut h = vec![("Origin", origin), ("Access-Control-Request-Method", "POST")];
        if let Some(a) = asked {
            h.push(("Access-Control-Request-Headers", a));
        }
        let (st, headers, _) = raw_request(&s, "OPTIONS", "/v1/chat/completions", &h, "");
        assert_eq!(st, 204, "{origin} {asked:?}");
        (
            header(&headers, "access-control-allow-origin").map(String::from),
            header(&headers, "access-control-allow-headers").map(String::from),
        )
    };
    // Lists a browser sends for the openai SDK, under several spellings and separators.
    let pool = [
        "x-stainless-os",
        "X-Stainless-Lang",
        "x-stainless-package-version",
        "x-stainless-runtime",
        "x-stainless-runtime-version",
        "x-stainless-arch",
        "x-stainless-retry-count",
        "x-stainless-timeout",
        "authorization",
        "Content-Type",
        "openai-organization",
        "OpenAI-Project",
        "x-a!#$%&'*+-.^_`|~1",
    ];
    let seps = [",", ", ", " ,\t", "\t,  "];
    for seed in 0..16usize {
        let names: Vec<&str> = (0..1 + seed % pool.len()).map(|i| pool[(seed * 7 + i * 3) % pool.len()]).collect();
        let sent = names.join(seps[seed % seps.len()]);
        let want = names.iter().map(|n| n.to_ascii_lowercase()).collect::<Vec<_>>().join(", ");
        for origin in ["http://a.example", "http://b.example:8080"] {
            let (allow, headers) = preflight(origin, Some(&sent));
            assert_eq!(allow.as_deref(), Some(origin), "{sent:?}");
            assert_eq!(headers.as_deref(), Some(want.as_str()), "{origin} {sent:?}");
        }
        // Never for an origin not on the list.
        for origin in
            ["http://evil.example", "http://a.example.evil", "https://a.example", "http://a.example:81", "null"]
        {
            assert_eq!(preflight(origin, Some(&sent)), (None, None), "{origin} {sent:?}");
        }
    }
    // A list that is not header names, or too long: the usual two, nothing echoed.
    let many = (0..65).map(|i| format!("x-h{i}")).collect::<Vec<_>>().join(",");
    let long = format!("x-{}", "a".repeat(4100));
    for bad in [
        "x-ok, x bad",
        "x-ok,,x-two",
        "x-ok, ",
        ",x-ok",
        "x(y)",
        "x-ok, x:y",
        "x\"q",
        "x/y",
        "x-é",
        many.as_str(),
        long.as_str(),
    ] {
        let (allow, headers) = preflight("http://a.example", Some(bad));
        assert_eq!(allow.as_deref(), Some("http://a.example"));
        assert_eq!(headers.as_deref(), Some("authorization, content-type"), "{bad:?}");
    }
    assert_eq!(preflight("http://a.example", None).1.as_deref(), Some("authorization, content-type"));
    // 64 names are echoed.
    let most = (0..64).map(|i| format!("x-h{i}")).collect::<Vec<_>>().join(",");
    assert_eq!(preflight("http://a.example", Some(&most)).1, Some(most.replace(',', ", ")));

    // The list's spacing does not matter: every entry is trimmed.
    for list in [
        "http://a.example, http://b.example",
        " http://a.example ,http://b.example ",
        "http://a.example,\thttp://b.example\t",
    ] {
        let s = start("tiny-a", &["--cors-origins", list]);
        for origin in ["http://a.example", "http://b.example"] {
            let (st, headers, _) = raw_request(&s, "GET", "/v1/models", &[("Origin", origin)], "");
            assert_eq!((st, header(&headers, "access-control-allow-origin")), (200, Some(origin)), "{list:?}");
        }
    }
}

#[test]
fn cors_origins_and_api_keys_no_request_could_match_are_refused_at_startup() {
    for list in [
        "http://a.example,,http://b.example",
        "http://a.example,",
        ",http://a.example",
        " ",
        "http://a.example/",
        "http://a.example/app",
        "a.example",
        "http://",
        "http://a.example:99999",
        "http://a.example:x",
        "http://user@a.example",
        "http://a example",
        "*.example.com",
        "http://a.example?x=1",
        "http://[zz]",
    ] {
        let err = refused_at_startup(&["--cors-origins", list], &[]);
        assert!(err.contains("--cors-origins"), "{list:?}: {err}");
        let bad =
            list.split(',').map(str::trim).find(|e| *e != "http://a.example" && *e != "http://b.example").unwrap();
        let named = if bad.is_empty() { "empty entry".to_string() } else { format!("{bad:?}") };
        assert!(err.contains(&named), "{list:?}: {err}");
    }
    for key in ["sekrét", "key with space", "tab\tkey", "ключ", "k\u{7f}", "\u{202e}key", "trailing "] {
        for from_env in [false, true] {
            let err = if from_env {
                refused_at_startup(&[], &[("VL_API_KEY", key)])
            } else {
                refused_at_startup(&["--api-key", key], &[])
            };
            assert!(err.contains("--api-key") && err.contains("VL_API_KEY") && err.contains("visible ASCII"), "{err}");
            assert!(!err.contains(key), "the key itself is not printed: {err}");
        }
    }
    let err = refused_at_startup(&["--api-key", ""], &[]);
    assert!(err.contains("--api-key") && err.contains("empty"), "{err}");
}

#[test]
fn the_bearer_scheme_is_read_in_any_case_with_blanks_around() {
    let key = "s3kr3t-K3y_~!";
    let s = start("tiny-a", &["--api-key", key]);
    let models = |auth: &str| raw_request(&s, "GET", "/v1/models", &[("Authorization", auth)], "").0;
    for scheme in ["Bearer", "bearer", "BEARER", "bEaReR"] {
        for gap in [" ", "  ", "\t", " \t "] {
            for (lead, trail) in [("", ""), (" ", " "), ("", "\t"), ("\t", "  ")] {
                let auth = format!("{lead}{scheme}{gap}{key}{trail}");
                assert_eq!(models(&auth), 200, "{auth:?}");
            }
        }
    }
    let upper = format!("Bearer {}", key.to_ascii_uppercase());
    let refused = [
        "Bearer".to_string(),
        format!("Bearer{key}"),
        format!("Basic {key}"),
        format!("Bear {key}"),
        format!("Token {key}"),
        format!("Bearer {}", &key[..key.len() - 1]),
        format!("Bearer {key}x"),
        format!("Bearer {key} x"),
        format!("Bearer x{key}"),
        upper,
    ];
    for auth in &refused {
        let (st, _, body) = raw_request(&s, "GET", "/v1/models", &[("Authorization", auth)], "");
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_error(st, &v, 401, "API key");
        assert_eq!(v["error"]["code"], "invalid_api_key", "{auth:?}");
    }
}

#[test]
fn logit_bias_keys_are_canonical_token_ids() {
    let g = "tiny-a";
    let s = start(g, &[]);
    let ask = |bias: Value| {
        let body =
            json!({"model": g, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "logit_bias": bias});
        post(&s, "/v1/chat/completions", &body.to_string())
    };
    for key in [
        "+7",
        "0007",
        "07",
        "00",
        " 7",
        "7 ",
        "0x7",
        "-0",
        "-7",
        "",
        "99999999999",
        "4294967296",
        "7.0",
        "1e1",
        "٧",
        "７",
        "7\u{202e}",
    ] {
        let (st, b) = ask(json!({ key: 5 }));
        assert_refused(st, &b, &format!("the key {key:?} is not a token id"), Some("logit_bias"));
        // Beside its canonical spelling it does not stack either.
        let (st, b) = ask(json!({"7": 60, key: 60}));
        assert_refused(st, &b, "logit_bias", Some("logit_bias"));
    }
    // Within the vocabulary only.
    let (st, b) = ask(json!({"4294967295": 1}));
    assert_refused(st, &b, "below the vocabulary", Some("logit_bias"));
    for value in [json!(100.5), json!(-101), json!("5"), json!(null), json!([1]), json!(1e300)] {
        let (st, b) = ask(json!({ "7": value }));
        assert_refused(st, &b, "`logit_bias.7`", Some("logit_bias.7"));
    }
    for ok in [json!({"0": 100}), json!({"7": -100, "10": 0.5}), json!({})] {
        let (st, v) = ask(ok.clone());
        assert_eq!(st, 200, "{ok}: {v}");
    }
}

#[test]
fn control_and_format_characters_in_a_path_are_escaped_in_the_log() {
    let s = start("tiny-a", &[]);
    let chars = [
        '\u{85}',
        '\u{9b}',
        '\u{7f}',
        '\u{ad}',
        '\u{600}',
        '\u{61c}',
        '\u{200b}',
        '\u{200e}',
        '\u{202a}',
        '\u{202e}',
        '\u{2028}',
        '\u{2029}',
        '\u{2060}',
        '\u{2066}',
        '\u{2069}',
        '\u{feff}',
        '\u{fff9}',
        '\u{e0041}',
        '\\',
    ];
    for (i, c) in chars.iter().enumerate() {
        // Raw UTF-8 in the request target (percent-encoding would already be safe).
        let path = if *c == '\u{7f}' { format!("/v1/x%7Fy-{i}") } else { format!("/v1/x{c}y-{i}.exe{c}") };
        let (st, _, body) = raw_request(&s, "GET", &path, &[], "");
        assert_eq!(st, 404, "{c:?}: {body}");
    }
    // A forged second line: a separator then what a line of the log looks like.
    let forged = "/v1/evil\u{2028}GET\u{a0}/v1/models\u{a0}200";
    assert_eq!(raw_request(&s, "GET", forged, &[], "").0, 404);
    let deadline = Instant::now() + Duration::from_secs(10);
    let log = loop {
        let log = s.log.lock().unwrap().clone();
        if log.iter().filter(|l| l.contains(" 404 ")).count() > chars.len() || Instant::now() > deadline {
            break log;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    for (i, c) in chars.iter().enumerate() {
        let want = if *c == '\u{7f}' {
            format!("GET /v1/x%7Fy-{i} 404 ")
        } else {
            let e = format!("\\u{{{:04X}}}", *c as u32);
            format!("GET /v1/x{e}y-{i}.exe{e} 404 ")
        };
        assert_eq!(log.iter().filter(|l| l.starts_with(&want)).count(), 1, "{want:?} in {log:?}");
        if *c != '\\' {
            assert!(log.iter().all(|l| !l.contains(*c)), "{c:?} raw in {log:?}");
        }
    }
    assert!(log.iter().any(|l| l.starts_with("GET /v1/evil\\u{2028}GET\u{a0}/v1/models\u{a0}200 404 ")), "{log:?}");
}

#[test]
fn unknown_nested_fields_and_wrong_types_are_refused_by_path() {
    let g = "tiny-a";
    let s = start(g, &[]);
    let img = data_url("square.png");
    let c = "/v1/chat/completions";
    let chat = |parts: Value, extra: Value| {
        let mut b = json!({"model": g, "messages": [{"role": "user", "content": parts}], "max_tokens": 1});
        for (k, x) in extra.as_object().unwrap() {
            b[k] = x.clone();
        }
        post(&s, c, &b.to_string())
    };
    let text = json!({"type": "text", "text": "Hi"});
    let image = |inner: Value| json!({"type": "image_url", "image_url": inner});
    // Unknown keys anywhere in a part: refused with the field's path.
    for (part, path) in [
        (json!({"type": "text", "text": "Hi", "foo": 1}), "messages[0].content[0].foo"),
        (json!({"type": "text", "text": "Hi", "detail": "low"}), "messages[0].content[0].detail"),
        (image(json!({"url": img, "foo": true})), "messages[0].content[0].image_url.foo"),
        (
            image(json!({"url": img, "cache_control": {"type": "ephemeral"}})),
            "messages[0].content[0].image_url.cache_control",
        ),
        (json!({"type": "image_url", "image_url": {"url": img}, "detail": "low"}), "messages[0].content[0].detail"),
        (json!({"type": "image", "image": img, "url": img}), "messages[0].content[0].url"),
        (json!({"type": "video_url", "video_url": {"url": "v.mp4", "bar": 1}}), "messages[0].content[0].video_url.bar"),
        (
            json!({"type": "input_video", "input_video": {"data": "AA==", "format": "mp4"}}),
            "messages[0].content[0].input_video.format",
        ),
        (json!({"type": "video_url", "video_url": {"url": "v.mp4"}, "video": 1}), "messages[0].content[0].video"),
        (
            json!({"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral", "foo": 1}}),
            "messages[0].content[0].cache_control.foo",
        ),
    ] {
        let (st, b) = chat(json!([part]), json!({}));
        assert_refused(st, &b, &format!("`{path}` is not a known field"), Some(path));
    }
    // Wrongly typed (or valued) fields of parts: refused naming the field.
    for (part, path) in [
        (json!({"type": "text", "text": 5}), "messages[0].content[0].text"),
        (image(json!({"url": 5})), "messages[0].content[0].image_url.url"),
        (image(json!({"url": img, "detail": "ultra"})), "messages[0].content[0].image_url.detail"),
        (image(json!({"url": img, "detail": "LOW"})), "messages[0].content[0].image_url.detail"),
        (image(json!({"url": img, "detail": 1})), "messages[0].content[0].image_url.detail"),
        (image(json!({"url": img, "max_pixels": 0})), "messages[0].content[0].image_url.max_pixels"),
        (image(json!({"url": img, "min_pixels": "5"})), "messages[0].content[0].image_url.min_pixels"),
        (
            json!({"type": "image_url", "image_url": {"url": img}, "max_pixels": -1}),
            "messages[0].content[0].max_pixels",
        ),
        (json!({"type": "video_url", "video_url": {"url": 7}}), "messages[0].content[0].video_url.url"),
        (
            json!({"type": "video_url", "video_url": {"url": "v.mp4", "fps": "2"}}),
            "messages[0].content[0].video_url.fps",
        ),
        (
            json!({"type": "video_url", "video_url": {"url": "v.mp4"}, "max_frames": 0}),
            "messages[0].content[0].max_frames",
        ),
        (json!({"type": "text", "text": "Hi", "cache_control": "ephemeral"}), "messages[0].content[0].cache_control"),
        (
            json!({"type": "text", "text": "Hi", "cache_control": {"type": "persistent"}}),
            "messages[0].content[0].cache_control",
        ),
        (
            json!({"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral", "ttl": 300}}),
            "messages[0].content[0].cache_control.ttl",
        ),
    ] {
        let (st, b) = chat(json!([part]), json!({}));
        assert_refused(st, &b, &format!("`{path}`"), Some(path));
    }
    // Accepted: `detail` low, high and auto, and `cache_control` (the prefix cache reuses
    // prompts without being asked; docs/serving.md).
    for part in [
        image(json!({"url": img, "detail": "low"})),
        image(json!({"url": img, "detail": "high"})),
        image(json!({"url": img, "detail": "auto"})),
        image(json!({"url": img, "detail": null})),
        json!({"type": "image_url", "image_url": {"url": img}, "cache_control": {"type": "ephemeral"}}),
        json!({"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral", "ttl": "5m"}}),
    ] {
        let (st, v) = chat(json!([part.clone(), text.clone()]), json!({}));
        assert_eq!(st, 200, "{part}: {v}");
    }
    // Top-level fields accepted because they cannot change the answer are typed all the same.
    for (extra, path) in [
        (json!({"user": 5}), "user"),
        (json!({"metadata": "x"}), "metadata"),
        (json!({"metadata": {"a": 1}}), "metadata.a"),
        (json!({"store": "yes"}), "store"),
        (json!({"parallel_tool_calls": "true"}), "parallel_tool_calls"),
        (json!({"service_tier": 1}), "service_tier"),
        (json!({"stream_options": {"include_obfuscation": "no"}}), "stream_options.include_obfuscation"),
    ] {
        let (st, b) = chat(json!([text]), extra.clone());
        assert_refused(st, &b, &format!("`{path}`"), Some(path));
    }
    for extra in [
        json!({"user": "u1", "metadata": {"a": "b"}, "store": true, "parallel_tool_calls": false, "service_tier": "auto"}),
        json!({"store": false, "stream_options": {"include_obfuscation": false}}),
    ] {
        let (st, v) = chat(json!([text]), extra.clone());
        assert_eq!(st, 200, "{extra}: {v}");
    }
    // Nested objects of messages and tools.
    let call = |c: Value| {
        json!({"model": g, "max_tokens": 1, "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": null, "tool_calls": [c]},
            {"role": "tool", "content": "ok", "tool_call_id": "c1"},
        ]})
    };
    let f = json!({"name": "f", "arguments": "{}"});
    for (body, needle) in [
        (call(json!({"id": "c1", "type": "function", "function": f, "foo": 1})), "foo"),
        (call(json!({"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}", "bar": 1}})), "bar"),
        (call(json!({"id": "c1", "type": "custom", "function": f})), "messages[1].tool_calls[0].type"),
        (call(json!({"id": 1, "type": "function", "function": f})), "messages[1].tool_calls[0].id"),
    ] {
        let (st, b) = post(&s, c, &body.to_string());
        assert_error(st, &b, 400, needle);
    }
    let (st, v) = post(&s, c, &call(json!({"id": "c1", "type": "function", "function": f})).to_string());
    assert_eq!(st, 200, "{v}");
    let tool = json!({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}});
    for (tools, choice, path) in [
        (json!([{"type": "function", "function": {"name": "f"}, "foo": 1}]), json!("auto"), "tools[0].foo"),
        (
            json!([{"type": "function", "function": {"name": "f", "extra": 1}}]),
            json!("auto"),
            "tools[0].function.extra",
        ),
        (
            json!([{"type": "function", "function": {"name": "f", "description": 5}}]),
            json!("auto"),
            "tools[0].function.description",
        ),
        (
            json!([{"type": "function", "function": {"name": "f", "strict": "yes"}}]),
            json!("auto"),
            "tools[0].function.strict",
        ),
        (json!([tool]), json!({"type": "function", "function": {"name": "f"}, "x": 1}), "tool_choice.x"),
        (json!([tool]), json!({"type": "function", "function": {"name": "f", "x": 1}}), "tool_choice.function.x"),
    ] {
        let (st, b) = chat(json!([text]), json!({"tools": tools, "tool_choice": choice}));
        assert_refused(st, &b, &format!("`{path}`"), Some(path));
    }
    // What a client echoes back from an answer: accepted when empty, refused otherwise.
    let echoed = |field: &str, x: Value| {
        let mut m = json!({"role": "assistant", "content": "Hello"});
        m[field] = x;
        let body = json!({"model": g, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}, m,
                                                                    {"role": "user", "content": "Again"}]});
        post(&s, c, &body.to_string())
    };
    for (field, empty, full) in [
        ("refusal", json!(""), json!("no")),
        ("annotations", json!([]), json!([{"type": "url_citation"}])),
        ("audio", json!(null), json!({"id": "a"})),
    ] {
        let (st, v) = echoed(field, empty);
        assert_eq!(st, 200, "{field}: {v}");
        let (st, b) = echoed(field, full);
        let path = format!("messages[1].{field}");
        assert_refused(st, &b, &format!("`{path}`"), Some(&path));
    }
}

#[test]
fn responses_fields_are_type_checked_and_background_refused() {
    let g = "tiny-a";
    let s = start(g, &[]);
    let img = data_url("square.png");
    let r = "/v1/responses";
    let ask = |extra: Value| {
        let mut b = json!({"model": g, "input": "Hi", "max_output_tokens": 1});
        for (k, x) in extra.as_object().unwrap() {
            b[k] = x.clone();
        }
        post(&s, r, &b.to_string())
    };
    for (extra, path, needle) in [
        (json!({"store": "yes"}), "store", "`store` must be a boolean"),
        (json!({"store": 1}), "store", "`store` must be a boolean"),
        (json!({"conversation": "conv_1"}), "conversation", "keeps no conversation objects"),
        (json!({"background": "true"}), "background", "`background` must be a boolean"),
        (json!({"background": true}), "background", "`background` responses are not supported"),
        (json!({"prompt_cache_key": 5}), "prompt_cache_key", "must be a string"),
        (json!({"safety_identifier": []}), "safety_identifier", "must be a string"),
        (json!({"stream_options": {"foo": 1}}), "stream_options.foo", "is not a known field"),
        (json!({"stream_options": {"include_obfuscation": "no"}}), "stream_options.include_obfuscation", "boolean"),
        (json!({"stream_options": 1}), "stream_options", "must be an object"),
        (json!({"truncation": 5}), "truncation", "must be a string"),
        (json!({"truncation": "middle"}), "truncation", "is not one of"),
        (json!({"include": "x"}), "include", "must be a list"),
        (json!({"top_logprobs": "1"}), "top_logprobs", "must be an integer"),
        (json!({"user": 5}), "user", "`user`"),
        (json!({"metadata": {"a": 1}}), "metadata.a", "`metadata.a`"),
        (json!({"parallel_tool_calls": "no"}), "parallel_tool_calls", "`parallel_tool_calls`"),
        (json!({"frobnicate": 1}), "frobnicate", "unknown field `frobnicate`"),
        (json!({"max_output_tokens": "x"}), "max_output_tokens", "`max_output_tokens`"),
        (json!({"tools": [{"type": "function", "name": "f", "foo": 1}]}), "tools[0].foo", "is not a known field"),
        (json!({"tools": [{"type": "function", "name": "f", "strict": "yes"}]}), "tools[0].strict", "boolean"),
        (json!({"tool_choice": {"type": "function", "name": "f", "x": 1}}), "tool_choice.x", "is not a known field"),
        (
            json!({"text": {"format": {"type": "json_schema", "name": "n", "schema": {}, "extra": 1}}}),
            "text.format.extra",
            "is not a known field",
        ),
    ] {
        let (st, b) = ask(extra.clone());
        assert_refused(st, &b, needle, Some(path));
    }
    let item = |content: Value| json!({"input": [{"role": "user", "content": content}]});
    let text = json!({"type": "input_text", "text": "Hi"});
    for (extra, path, needle) in [
        (
            item(json!([{"type": "input_text", "text": "Hi", "foo": 1}])),
            "input[0].content[0].foo",
            "is not a known field",
        ),
        (
            item(json!([{"type": "input_text", "text": "Hi", "cache_control": {"type": "ephemeral"}}])),
            "input[0].content[0].cache_control",
            "is not a known field",
        ),
        (
            item(json!([{"type": "input_image", "image_url": img, "detail": "ultra"}, text])),
            "input[0].content[0].detail",
            "expected \"low\"",
        ),
        (
            item(json!([{"type": "input_image", "image_url": img, "detail": 2}, text])),
            "input[0].content[0].detail",
            "expected \"low\"",
        ),
        (
            item(json!([{"type": "input_image", "image_url": img, "url": img}, text])),
            "input[0].content[0].url",
            "is not a known field",
        ),
        (json!({"input": [{"role": "user", "content": "Hi", "foo": 1}]}), "input[0].foo", "is not a known field"),
        (json!({"input": [{"role": 5, "content": "Hi"}]}), "input[0].role", "must be a string"),
        (
            json!({"input": [{"role": "user", "content": "Hi"}, {"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]}),
            "input[1].arguments",
            "must be a string",
        ),
        (
            json!({"input": [{"role": "user", "content": "Hi"}, {"type": "function_call_output", "call_id": "c", "output": "x", "extra": 1}]}),
            "input[1].extra",
            "is not a known field",
        ),
        (
            json!({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}, {"role": "user", "content": "Hi"}]}),
            "input[0].encrypted_content",
            "encrypted",
        ),
        (
            json!({"input": [{"type": "reasoning", "summary": [{"type": "summary_text", "text": "t", "x": 1}]}, {"role": "user", "content": "Hi"}]}),
            "input[0].summary[0].x",
            "is not a known field",
        ),
    ] {
        let (st, b) = ask(extra.clone());
        assert_refused(st, &b, &format!("`{path}`"), Some(path));
        assert!(b["error"]["message"].as_str().unwrap().contains(needle), "{b}");
    }
    for extra in [
        json!({"store": false, "background": false, "truncation": "disabled", "include": [], "top_logprobs": 0}),
        json!({"prompt_cache_key": "k", "safety_identifier": "s", "stream_options": {"include_obfuscation": false}}),
        json!({"user": "u", "metadata": {"a": "b"}, "parallel_tool_calls": true, "service_tier": "auto"}),
        item(json!([{"type": "input_image", "image_url": img, "detail": "low"}, text])),
        item(json!([{"type": "input_image", "image_url": img, "detail": "auto", "file_id": null}, text])),
        json!({"input": [{"type": "message", "id": "msg_1", "status": "completed", "role": "user", "content": [text]}]}),
    ] {
        let (st, v) = ask(extra.clone());
        assert_eq!(st, 200, "{extra}: {v}");
    }
}

/// `detail: "low"` sizes an image to at most 512x512 pixels' worth (OpenAI's low detail);
/// `high` and `auto` keep the server's budget.
#[test]
fn image_detail_low_narrows_the_pixel_budget() {
    let g = "tiny-a";
    // tiny-a's own budget is under 512x512: raise it, so that low detail has something to narrow.
    let s = start(g, &["--max-pixels", "1048576"]);
    let large = {
        let bytes = std::fs::read(goldens().join("images/large.png")).unwrap();
        format!("data:image/png;base64,{}", base64::engine::general_purpose::STANDARD.encode(bytes))
    };
    let tokens = |detail: Option<&str>| {
        let mut iu = json!({"url": large});
        if let Some(d) = detail {
            iu["detail"] = json!(d);
        }
        let body = json!({"model": g, "max_tokens": 1, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": iu}, {"type": "text", "text": "Describe."}]}]});
        let (st, v) = post(&s, "/v1/chat/completions", &body.to_string());
        assert_eq!(st, 200, "{v}");
        v["usage"]["prompt_tokens_details"]["image_tokens"].as_u64().unwrap()
    };
    let full = tokens(None);
    // 640x480 at 32x32 pixels a token.
    assert_eq!(full, 300);
    assert_eq!(tokens(Some("high")), full);
    assert_eq!(tokens(Some("auto")), full);
    let low = tokens(Some("low"));
    assert!(low > 0 && low <= 256, "{low}");
    // The Responses API's `input_image.detail` too.
    let input = |detail: &str| {
        let body = json!({"model": g, "max_output_tokens": 1, "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": large, "detail": detail}, {"type": "input_text", "text": "Describe."}]}]});
        let (st, v) = post(&s, "/v1/responses", &body.to_string());
        assert_eq!(st, 200, "{v}");
        v["usage"]["input_tokens"].as_u64().unwrap()
    };
    assert_eq!(input("high") - input("low"), full - low);
}

/// Streaming clients that stop reading (with no, some and many log-probabilities per token) hold
/// a bounded number of pieces: their sequences pause, are cancelled after `--stall-timeout`, and
/// free their slots; the server's memory stays put and another client's stream flows meanwhile.
#[test]
fn clients_that_stop_reading_pause_then_lose_their_slot_and_stall_no_one() {
    fn metric(s: &Server, name: &str) -> f64 {
        let (_, m) = get(s, "/metrics");
        m.lines().find_map(|l| l.strip_prefix(&format!("{name} "))).and_then(|v| v.trim().parse().ok()).unwrap_or(0.0)
    }
    fn rss_kib(pid: u32) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .unwrap()
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap()
    }
    // Room for every stalled choice and the other client: what is measured is the pause, not a
    // queue.
    let s = common::start("tiny-a", &["--parallel", "20", "--stall-timeout", "2"]);
    let addr = s.base.trim_start_matches("http://").to_string();
    let max = 1500;
    // A warm-up answer, so that what is measured below is the stalled clients' cost alone.
    let _ = stream(
        &s,
        &json!({"model": "tiny-a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": true}),
    );
    let before = rss_kib(s.child.id());
    // A client socket with a 4 KiB receive buffer: the server's writes stop soon after the
    // client stops reading.
    fn small_window(addr: &str) -> std::net::TcpStream {
        use std::os::fd::FromRawFd;
        let sa: std::net::SocketAddrV4 = addr.parse().unwrap();
        // SAFETY: a fresh socket, options and address passed with their sizes; the descriptor is
        // owned by the TcpStream made from it.
        unsafe {
            let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0);
            assert!(fd >= 0);
            let size: libc::c_int = 4096;
            let p = &size as *const libc::c_int as *const libc::c_void;
            assert_eq!(libc::setsockopt(fd, libc::SOL_SOCKET, libc::SO_RCVBUF, p, 4), 0);
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: sa.port().to_be(),
                sin_addr: libc::in_addr { s_addr: u32::from(*sa.ip()).to_be() },
                sin_zero: [0; 8],
            };
            let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
            assert_eq!(libc::connect(fd, &sin as *const libc::sockaddr_in as *const libc::sockaddr, len), 0);
            std::net::TcpStream::from_raw_fd(fd)
        }
    }
    // Clients that read nothing, or the headers and a few chunks, then stop.
    // Eight choices of 20 log-probabilities a token: ~12 MB of stream each, past what the
    // kernel's socket buffers hold.
    let n = 8;
    let clients = [(20u32, 0usize), (20, 3)];
    let stalled: Vec<std::net::TcpStream> = clients
        .iter()
        .map(|&(top, read)| {
            let body = json!({"model": "tiny-a", "messages": [{"role": "user", "content": "Count to a thousand."}],
                              "max_tokens": max, "stream": true, "logprobs": true, "top_logprobs": top,
                              "temperature": 1, "seed": 7, "n": n});
            let body = body.to_string();
            let mut sock = small_window(&addr);
            write!(
                sock,
                "POST /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            )
            .unwrap();
            let mut buf = vec![0u8; 4096];
            for _ in 0..read {
                sock.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
                assert!(sock.read(&mut buf).unwrap() > 0);
            }
            sock
        })
        .collect();
    // Another client streams meanwhile: its largest gap between chunks.
    std::thread::sleep(Duration::from_millis(300));
    let resp = agent()
        .post(&format!("{}/v1/chat/completions", s.base))
        .set("Content-Type", "application/json")
        .send_string(
            &json!({"model": "tiny-a", "messages": [{"role": "user", "content": "Tell a story."}],
                              "max_tokens": 300, "stream": true, "temperature": 0})
            .to_string(),
        )
        .unwrap();
    let (mut last, mut largest, mut chunks) = (Instant::now(), Duration::ZERO, 0);
    for line in BufReader::new(resp.into_reader()).lines() {
        let line = line.unwrap();
        if line.starts_with("data: ") {
            largest = largest.max(last.elapsed());
            last = Instant::now();
            chunks += 1;
        }
    }
    let during = rss_kib(s.child.id());
    // Past the stall timeout the stalled requests are cancelled: no request runs, their slots
    // are free, and each generated a bounded number of tokens.
    let deadline = Instant::now() + Duration::from_secs(15);
    while metric(&s, "vl_requests_running") > 0.0 {
        assert!(Instant::now() < deadline, "stalled requests still running after the stall timeout");
        std::thread::sleep(Duration::from_millis(100));
    }
    let tokens = metric(&s, "vl_completion_tokens_total") - 8.0 - 300.0;
    let all = (clients.len() * n * max) as f64;
    println!(
        "other stream: {chunks} chunks, largest gap {largest:.2?}; RSS {before} -> {during} KiB; {tokens} of {all} tokens for the stalled clients"
    );
    assert!(chunks >= 300, "{chunks}");
    assert!(largest < Duration::from_secs(1), "another client's stream stalled for {largest:?}");
    assert!(tokens < all / 2.0, "{tokens} of {all} tokens generated for clients that stopped reading");
    assert!(during < before + 64 * 1024, "RSS grew from {before} to {during} KiB");
    // The slots are usable again.
    let (status, v) = post(
        &s,
        "/v1/chat/completions",
        &json!({"model": "tiny-a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).to_string(),
    );
    assert_eq!(status, 200, "{v}");
    drop(stalled);
}

/// Any model name is answered by the one model served unless `--strict-model-name`; aliases are
/// listed by `/v1/models` and retrievable by `/v1/models/{id}`.
#[test]
fn model_names_any_by_default_aliases_listed_strict_on_request() {
    let ask = |s: &Server, model: &str| {
        post(
            s,
            "/v1/chat/completions",
            &json!({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).to_string(),
        )
    };
    let names = ["tiny-a", "gpt-4o", "Qwen/Qwen3-VL-2B-Instruct", "llava:latest", "qwen"];
    let lenient = common::start("tiny-a", &["--alias", "qwen", "--alias", "Qwen/Qwen3-VL-2B-Instruct"]);
    for m in names {
        let (status, v) = ask(&lenient, m);
        assert_eq!(status, 200, "{m}: {v}");
        assert_eq!(v["model"], "tiny-a", "{m}: the answer names the served model");
    }
    let (_, listed) = get(&lenient, "/v1/models");
    let listed: Value = serde_json::from_str(&listed).unwrap();
    let ids: Vec<&str> = listed["data"].as_array().unwrap().iter().map(|m| m["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["tiny-a", "qwen", "Qwen/Qwen3-VL-2B-Instruct"]);
    for (path, want) in [("tiny-a", 200), ("qwen", 200), ("Qwen/Qwen3-VL-2B-Instruct", 200), ("gpt-4o", 404)] {
        let (status, body) = get(&lenient, &format!("/v1/models/{path}"));
        assert_eq!(status, want, "{path}: {body}");
        if want == 200 {
            let v: Value = serde_json::from_str(&body).unwrap();
            assert_eq!((v["id"].as_str(), v["object"].as_str()), (Some(path), Some("model")), "{body}");
        }
    }
    let strict = common::start("tiny-a", &["--alias", "qwen", "--strict-model-name"]);
    for m in names {
        let (status, v) = ask(&strict, m);
        if ["tiny-a", "qwen"].contains(&m) {
            assert_eq!(status, 200, "{m}: {v}");
        } else {
            assert_error(status, &v, 404, m);
            assert_eq!(v["error"]["code"], "model_not_found", "{v}");
        }
    }
    // A name no client could send is refused at startup.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_vl"))
        .args(["serve", "--model", "goldens/tiny-a/checkpoint", "--port", "0", "--alias", ""])
        .current_dir(env!("CARGO_MANIFEST_DIR").to_string() + "/../..")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--alias") && err.lines().count() == 1, "{err}");
}

/// The fields current OpenAI SDKs send on chat completions: accepted with their types where they
/// cannot change the answer, refused by name where they would; llama-server's `json_object` with
/// a `schema` holds the answer to it.
#[test]
fn current_sdk_fields_are_typed_and_json_object_takes_a_schema() {
    let s = start("tiny-a", &[]);
    let ask = |extra: Value| {
        let mut body = json!({"model": "tiny-a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        post(&s, "/v1/chat/completions", &body.to_string())
    };
    for ok in [
        json!({"prompt_cache_key": "user-42"}),
        json!({"prompt_cache_retention": "24h"}),
        json!({"safety_identifier": "hash-1"}),
        json!({"verbosity": "medium"}),
        json!({"modalities": ["text"]}),
        json!({"prediction": {"type": "content", "content": "hello"}}),
        json!({"prediction": {"type": "content", "content": [{"type": "text", "text": "hello"}]}}),
        json!({"prompt_cache_key": "k", "safety_identifier": "s", "verbosity": "medium", "modalities": ["text"]}),
    ] {
        let (status, v) = ask(ok.clone());
        assert_eq!(status, 200, "{ok}: {v}");
    }
    for (bad, needle) in [
        (json!({"prompt_cache_key": 7}), "prompt_cache_key"),
        (json!({"safety_identifier": ["x"]}), "safety_identifier"),
        (json!({"prompt_cache_retention": true}), "prompt_cache_retention"),
        (json!({"verbosity": "high"}), "verbosity"),
        (json!({"verbosity": 1}), "verbosity"),
        (json!({"modalities": ["text", "audio"]}), "modalities"),
        (json!({"modalities": []}), "modalities"),
        (json!({"prediction": {"type": "content"}}), "prediction"),
        (json!({"prediction": "hello"}), "prediction"),
        (json!({"response_format": {"type": "json_object", "schema": 3}}), "response_format"),
        (json!({"response_format": {"type": "text", "schema": {}}}), "response_format"),
    ] {
        let (status, v) = ask(bad.clone());
        assert_error(status, &v, 400, needle);
    }
    // `json_object` with a schema: the answer validates against it (temperature 1, three seeds).
    let schema = json!({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
                        "required": ["n"], "additionalProperties": false});
    for seed in [1, 2, 3] {
        let (status, v) = ask(json!({"max_tokens": 40, "temperature": 1, "seed": seed,
                                      "response_format": {"type": "json_object", "schema": schema}}));
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
        let text = v["choices"][0]["message"]["content"].as_str().unwrap();
        let answer: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        let n = answer["n"].as_u64().unwrap_or_else(|| panic!("{answer}"));
        assert!(n <= 9 && answer.as_object().unwrap().len() == 1, "{answer}");
    }
}

/// Every refusal that names a request field names it in `param` too, as OpenAI's errors do: a
/// generated family of bad requests on each endpoint (wrong types, values out of range, unknown
/// fields, unsupported values, and the engine's own refusals: a sampling option out of range,
/// a schema that cannot be compiled, a template without tools), each checked for its status,
/// its message and its `param`.
#[test]
fn every_refusal_names_its_field_in_param() {
    let s = start("tiny-a", &[]);
    let chat = |extra: &Value| {
        let mut b = json!({"model": "tiny-a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
        for (k, x) in extra.as_object().unwrap() {
            b[k] = x.clone();
        }
        post(&s, "/v1/chat/completions", &b.to_string())
    };
    let f = json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]);
    let mut cases: Vec<(Value, &str, String)> = vec![];
    // Numbers out of range and wrong types, field by field.
    for (field, out_of_range) in [
        ("temperature", json!(3)),
        ("top_p", json!(1.5)),
        ("min_p", json!(2)),
        ("presence_penalty", json!(5)),
        ("frequency_penalty", json!(-3)),
        ("repetition_penalty", json!(0)),
        ("top_k", json!(-2)),
        ("n", json!(9)),
        ("top_logprobs", json!(21)),
        ("max_tokens", json!(0)),
        ("max_completion_tokens", json!(0)),
    ] {
        cases.push((json!({ field: out_of_range }), field, field.to_string()));
        cases.push((json!({ field: "x" }), field, field.to_string()));
    }
    for field in
        ["user", "service_tier", "prompt_cache_key", "prompt_cache_retention", "safety_identifier", "verbosity"]
    {
        cases.push((json!({ field: 7 }), field, field.to_string()));
    }
    for field in ["store", "parallel_tool_calls", "stream", "logprobs"] {
        cases.push((json!({ field: "yes" }), field, field.to_string()));
    }
    for (extra, param, needle) in [
        (json!({"verbosity": "high"}), "verbosity", "\"high\""),
        (json!({"modalities": ["text", "audio"]}), "modalities", "\"audio\""),
        (json!({"modalities": "text"}), "modalities", "modalities"),
        (json!({"prediction": {"type": "content"}}), "prediction", "prediction"),
        (json!({"audio": {"voice": "x"}}), "audio", "audio"),
        (json!({"reasoning_effort": "hard"}), "reasoning_effort", "\"hard\""),
        (json!({"web_search_options": {}}), "web_search_options", "web_search_options"),
        (json!({"functions": [{"name": "f"}]}), "functions", "use `tools`"),
        (json!({"function_call": "auto"}), "function_call", "use `tools`"),
        (json!({"frobnicate": 1}), "frobnicate", "frobnicate"),
        (json!({"stop": ["a", ""]}), "stop", "stop"),
        (json!({"logit_bias": {"5": 101}}), "logit_bias.5", "logit_bias.5"),
        (json!({"logit_bias": {"x": 1}}), "logit_bias", "logit_bias"),
        (json!({"chat_template_kwargs": {"tools": []}}), "chat_template_kwargs.tools", "chat_template_kwargs.tools"),
        (json!({"chat_template_kwargs": 3}), "chat_template_kwargs", "chat_template_kwargs"),
        (json!({"messages": []}), "messages", "messages"),
        (json!({"messages": [{"role": "robot", "content": "hi"}]}), "messages[0].role", "messages[0].role"),
        (json!({"messages": [{"role": "user"}]}), "messages[0].content", "messages[0].content"),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:x"}}]}]}),
            "messages[0].content[0]",
            "malformed data URL",
        ),
        (json!({"tools": [{"type": "function"}]}), "tools[0]", "tools[0]"),
        (json!({"tools": f}), "tools", "no `tools` variable"),
        (json!({"tool_choice": "required"}), "tool_choice", "needs `tools`"),
        (json!({"tools": f, "tool_choice": "sometimes"}), "tool_choice", "tool_choice"),
        (
            json!({"tools": f, "tool_choice": {"type": "function", "function": {"name": "g"}}}),
            "tool_choice.function.name",
            "which `tools` does not list",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}], "tool_choice": "required"}),
            "tools[0].function.parameters",
            "must be a JSON schema",
        ),
        (json!({"response_format": {"type": "yaml"}}), "response_format.type", "\"yaml\""),
        (json!({"response_format": "json"}), "response_format", "response_format"),
        (json!({"response_format": {"type": "json_object", "schema": 3}}), "response_format.schema", "schema"),
        (json!({"response_format": {"type": "text", "schema": {}}}), "response_format.schema", "json_object"),
        (json!({"response_format": {"type": "json_object", "x": 1}}), "response_format.x", "not a known field"),
        (json!({"response_format": {"type": "json_schema"}}), "response_format.json_schema", "json_schema"),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}),
            "response_format.json_schema.name",
            "must be a string",
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "strict": "y"}}}),
            "response_format.json_schema.strict",
            "boolean",
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": 1}}}),
            "response_format.json_schema.schema",
            "JSON schema",
        ),
        // The engine's: a schema the library cannot compile.
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "n",
                "schema": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}}}),
            "response_format",
            "cannot be compiled",
        ),
    ] {
        cases.push((extra, param, needle.to_string()));
    }
    assert!(cases.len() > 60, "{}", cases.len());
    for (extra, param, needle) in &cases {
        let (st, b) = chat(extra);
        assert_eq!(st, 400, "{extra}: {b}");
        assert_refused(st, &b, needle, Some(param));
    }

    // /v1/completions: its own fields, and the chat checks it shares.
    let text = |extra: Value| {
        let mut b = json!({"model": "tiny-a", "prompt": "hi", "max_tokens": 2});
        for (k, x) in extra.as_object().unwrap() {
            b[k] = x.clone();
        }
        post(&s, "/v1/completions", &b.to_string())
    };
    for (extra, param, needle) in [
        (json!({"prompt": 5}), "prompt", "prompt"),
        (json!({"prompt": ""}), "prompt", "prompt"),
        (json!({"echo": true}), "echo", "echo"),
        (json!({"suffix": "x"}), "suffix", "suffix"),
        (json!({"logprobs": 30}), "logprobs", "logprobs"),
        (json!({"top_p": 0}), "top_p", "top_p"),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {}}}),
            "response_format.json_schema.name",
            "name",
        ),
    ] {
        let (st, b) = text(extra.clone());
        assert_refused(st, &b, needle, Some(param));
    }

    // /v1/responses: the Responses paths, chat checks renamed to them.
    let resp = |extra: Value| {
        let mut b = json!({"model": "tiny-a", "input": "hi", "max_output_tokens": 2});
        for (k, x) in extra.as_object().unwrap() {
            b[k] = x.clone();
        }
        post(&s, "/v1/responses", &b.to_string())
    };
    for (extra, param, needle) in [
        (json!({"prompt_cache_retention": 5}), "prompt_cache_retention", "must be a string"),
        (json!({"max_output_tokens": 0}), "max_output_tokens", "max_output_tokens"),
        (json!({"temperature": 9}), "temperature", "temperature"),
        (json!({"previous_response_id": "r"}), "previous_response_id", "no stored response"),
        (json!({"reasoning": {"effort": "lots"}}), "reasoning.effort", "\"lots\""),
        (json!({"reasoning": {"summary": "auto"}}), "reasoning.summary", "no summaries"),
        (json!({"tools": 3}), "tools", "must be a list"),
        (json!({"tools": [{"type": "web_search"}]}), "tools[0]", "only function tools"),
        (json!({"tool_choice": {"type": "function"}}), "tool_choice.name", "must be a string"),
        (json!({"text": {"verbosity": "low"}}), "text.verbosity", "text.verbosity"),
        (json!({"text": {"format": {"type": "yaml"}}}), "text.format.type", "text.format.type"),
        (json!({"text": {"format": {"type": "json_schema", "schema": {}}}}), "text.format.name", "must be a string"),
        (json!({"input": [{"type": "message", "role": "user", "content": 5}]}), "input[0].content", "input[0].content"),
        (json!({"input": [{"type": "function_call"}]}), "input[0].name", "input[0].name"),
        (json!({"input": [{"type": "bogus"}]}), "input[0].type", "input[0].type"),
        (json!({"input": [{"role": "robot", "content": "x"}]}), "input[0].role", "input[0].role"),
    ] {
        let (st, b) = resp(extra.clone());
        assert_refused(st, &b, needle, Some(param));
    }
    // Accepted on /v1/responses as on chat: a string.
    let (st, b) = resp(json!({"prompt_cache_retention": "24h"}));
    assert_eq!(st, 200, "{b}");
}

/// `vl serve --reasoning-budget 0` on the tiny Qwen3.5 (its template opens the reasoning block):
/// a request that sets no budget has the block closed at once and answers content; one that
/// sets its own budget keeps it.
#[test]
fn a_default_reasoning_budget_applies_to_requests_without_one() {
    let s = start("tiny-q35", &["--reasoning-budget", "0"]);
    let ask = |extra: Value| {
        let mut body = json!({"model": "tiny-q35", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        post(&s, "/v1/chat/completions", &body.to_string())
    };
    let (status, v) = ask(json!({}));
    assert_eq!(status, 200, "{v}");
    assert!(v["choices"][0]["message"]["content"].as_str().is_some_and(|c| !c.is_empty()), "{v}");
    let (status, v) = ask(json!({"reasoning_budget": 100}));
    assert_eq!(status, 200, "{v}");
    let m = &v["choices"][0]["message"];
    assert!(m["content"].is_null() || m["content"] == "", "{v}");
    assert!(m["reasoning_content"].as_str().is_some_and(|r| !r.is_empty()), "{v}");
}
