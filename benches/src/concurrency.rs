//! Many clients at once on an OpenAI-compatible server (ours, or a peer's such as llama-server
//! on the same machine): for 1, 2, 4 and 8 streamed clients sent together, the aggregate decode
//! throughput and each client's time to first token and inter-token latency; then a short request
//! sent while a long one decodes, against the short one alone; and the server's peak resident
//! memory. Every figure is the client's view over HTTP.

use std::time::{Duration, Instant};

use anyhow::Result;
use serde_json::json;

/// One streamed answer as its client saw it.
struct Seen {
    ttft: Duration,
    total: Duration,
    tokens: u64,
}

impl Seen {
    /// Mean time between the streamed tokens after the first.
    fn itl(&self) -> f64 {
        (self.total - self.ttft).as_secs_f64() / self.tokens.saturating_sub(1).max(1) as f64
    }
}

/// Topics that make the clients' prompts differ (no prefix shared beyond the template).
const TOPICS: [&str; 8] =
    ["the sea", "a city at night", "a mountain", "a forest", "a desert", "a river", "the moon", "a train"];

fn ask(base: &str, model: &str, prompt: &str, max_tokens: usize) -> Result<Seen> {
    let mut body = json!({"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                          "temperature": 0, "stream": true, "stream_options": {"include_usage": true}});
    if !model.is_empty() {
        body["model"] = json!(model);
    }
    let r = crate::serve::stream(base, &body)?;
    let tokens = r.usage["completion_tokens"].as_u64().unwrap_or(r.pieces);
    Ok(Seen { ttft: r.ttft, total: r.total, tokens })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The server's peak resident memory (VmHWM) in MB, when its pid is known.
fn peak_mb(pid: Option<u32>) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{}/status", pid?)).ok()?;
    let kb: f64 = status.lines().find(|l| l.starts_with("VmHWM:"))?.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}

/// `words` filler words after a client's question (0: none): long prompts to load the KV cache.
fn prompt(topic: &str, words: usize) -> String {
    let filler: Vec<&str> = (0..words).map(|i| ["sea", "salt", "wind", "light", "stone"][i % 5]).collect();
    format!("Write a long story about {topic}. {}", filler.join(" "))
}

/// Runs the scenarios against `base` (`name` labels the rows) and prints markdown rows.
/// `words`: filler words per prompt (about 1.4 tokens each with Qwen's tokenizer).
pub fn bench(
    name: &str,
    base: &str,
    model: &str,
    pid: Option<u32>,
    clients: &[usize],
    new_tokens: usize,
    words: usize,
) -> Result<()> {
    // Warm-up: the first request of a process pays one-time costs.
    ask(base, model, "Say hello.", 4)?;
    println!("| server | clients | aggregate tok/s | TTFT median s | TTFT max s | inter-token median ms | wall s |");
    println!("|---|---|---|---|---|---|---|");
    for &n in clients {
        let t = Instant::now();
        let seen: Vec<Seen> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..n)
                .map(|i| {
                    let p = prompt(TOPICS[i % TOPICS.len()], words);
                    s.spawn(move || ask(base, model, &p, new_tokens))
                })
                .collect();
            hs.into_iter().map(|h| h.join().expect("client thread")).collect::<Result<Vec<_>>>()
        })?;
        let wall = t.elapsed().as_secs_f64();
        let tokens: u64 = seen.iter().map(|s| s.tokens).sum();
        let ttfts: Vec<f64> = seen.iter().map(|s| s.ttft.as_secs_f64()).collect();
        println!(
            "| {name} | {n} | {:.2} | {:.2} | {:.2} | {:.1} | {wall:.1} |",
            tokens as f64 / wall,
            median(ttfts.clone()),
            ttfts.iter().copied().fold(0.0, f64::max),
            1e3 * median(seen.iter().map(Seen::itl).collect()),
        );
    }
    // A short request alone, then the same while a long one decodes.
    let short = |b: &str| ask(b, model, "Name three colors.", 16);
    let alone = short(base)?.total.as_secs_f64();
    let during = std::thread::scope(|s| -> Result<f64> {
        let long = s.spawn(|| ask(base, model, "Write a long story about a lighthouse.", 4 * new_tokens));
        std::thread::sleep(Duration::from_secs(2));
        let t = short(base)?.total.as_secs_f64();
        long.join().expect("long client")?;
        Ok(t)
    })?;
    println!(
        "\n{name}: a 16-token request alone {alone:.2} s, sent while a long one decodes {during:.2} s ({:.2}x)",
        during / alone
    );
    if let Some(mb) = peak_mb(pid) {
        println!("{name}: server peak RSS {mb:.0} MB");
    }
    // Our server's KV gauges (another server may not have them).
    let metrics = ureq::get(&format!("{base}/metrics")).call().ok().and_then(|r| r.into_string().ok());
    let gauge = |m: &str, g: &str| {
        m.lines().find_map(|l| l.strip_prefix(g).and_then(|v| v.trim().parse::<f64>().ok())).map(|b| b / 1048576.0)
    };
    if let Some(m) = metrics {
        if let (Some(held), Some(budget)) = (gauge(&m, "vl_kv_cache_bytes "), gauge(&m, "vl_kv_cache_budget_bytes ")) {
            println!("{name}: KV cache held at the end {held:.0} MiB (kept prefixes), budget {budget:.0} MiB");
        }
    }
    Ok(())
}
