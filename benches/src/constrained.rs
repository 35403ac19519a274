//! The cost of constrained decoding on the server path: the same streamed request to one `vl
//! serve`, unconstrained and with each kind of constraint (a JSON schema whose answer is one long
//! string, any JSON object, and the same one-string document as a regex, a Lark grammar and a
//! GBNF grammar), in alternating rounds; the decode speed its client sees, median per kind. A
//! random-weight checkpoint never closes a string, so every answer runs to `max_tokens`: the
//! same number of tokens in each kind.

use anyhow::{bail, Result};
use serde_json::{json, Value};

use crate::serve::stream;

pub fn bench(name: &str, base: &str, tokens: usize, rounds: usize) -> Result<()> {
    let schema = json!({"type": "object", "properties": {"caption": {"type": "string"}},
                        "required": ["caption"], "additionalProperties": false});
    // (kind, the request fields that constrain it)
    let kinds: [(&str, Value); 6] = [
        ("unconstrained", json!({})),
        (
            "json_schema",
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "caption", "schema": schema}}}),
        ),
        ("json_object", json!({"response_format": {"type": "json_object"}})),
        ("regex", json!({"structured_outputs": {"regex": r#"\{"caption": "[^"\\]*"\}"#}})),
        ("lark", json!({"structured_outputs": {"grammar": r#"start: "{\"caption\": \"" /[^"\\]*/ "\"}""#}})),
        ("gbnf", json!({"grammar": r#"root ::= "{\"caption\": \"" [^"\\]* "\"}""#})),
    ];
    let mut tps: Vec<Vec<f64>> = vec![vec![]; kinds.len()];
    for round in 0..rounds.max(1) {
        for (k, (kind, format)) in kinds.iter().enumerate() {
            let mut body = json!({
                "messages": [{"role": "user", "content": "Describe a harbour at dawn as JSON."}],
                "max_tokens": tokens, "temperature": 0.0, "stream": true,
                "stream_options": {"include_usage": true},
            });
            for (k, v) in format.as_object().into_iter().flatten() {
                body[k] = v.clone();
            }
            let r = stream(base, &body)?;
            let n = r.usage["completion_tokens"].as_u64().unwrap_or(0);
            if n as usize != tokens {
                bail!("{kind}: {n} tokens, not {tokens}: the answer ended early");
            }
            let decode = r.last.saturating_sub(r.ttft).as_secs_f64();
            let t = (n - 1) as f64 / decode;
            eprintln!("round {round} {kind}: {t:.2} tok/s");
            tps[k].push(t);
        }
    }
    println!("| {name} | kind | decode tok/s (median of {rounds}) | vs unconstrained |");
    println!("|---|---|---|---|");
    let base_tps = crate::median(tps[0].clone());
    for (k, (kind, _)) in kinds.iter().enumerate() {
        let m = crate::median(tps[k].clone());
        println!("| | {kind} | {m:.2} | {:.3} |", m / base_tps);
    }
    Ok(())
}
