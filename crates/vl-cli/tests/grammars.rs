//! Grammars beyond JSON through `vl serve`, in each field a peer's client sends them: vLLM's
//! `structured_outputs` (`regex`, `choice`, `grammar`, `json`), llama-server's `grammar` (GBNF)
//! and `json_schema`, SGLang's `regex` and `ebnf`, and `response_format` types naming them; on
//! chat completions and `/v1/completions`, streamed and not. The checkpoint's weights are random,
//! so every answer inside its language is there because of the constraint; each is checked by
//! the `regex` crate against a regex written here by hand for the same language.

mod common;

use common::start;
use serde_json::{json, Value};

fn post(base: &str, path: &str, body: &Value) -> (u16, String) {
    let agent = ureq::AgentBuilder::new().timeout(std::time::Duration::from_secs(120)).build();
    match agent.post(&format!("{base}{path}")).send_string(&body.to_string()) {
        Ok(r) => (r.status(), r.into_string().unwrap()),
        Err(ureq::Error::Status(c, r)) => (c, r.into_string().unwrap()),
        Err(e) => panic!("{e}"),
    }
}

/// The answer's text and finish reason, from a whole answer or an SSE stream.
fn answer(path: &str, status: u16, body: &str, streamed: bool) -> (String, String) {
    assert_eq!(status, 200, "{body}");
    let key = if path.ends_with("chat/completions") { "content" } else { "text" };
    if !streamed {
        let v: Value = serde_json::from_str(body).unwrap();
        let c = &v["choices"][0];
        let text = if key == "content" { &c["message"]["content"] } else { &c["text"] };
        return (text.as_str().unwrap().to_string(), c["finish_reason"].as_str().unwrap().to_string());
    }
    let (mut text, mut finish) = (String::new(), String::new());
    for d in body.lines().filter_map(|l| l.strip_prefix("data: ")).filter(|d| *d != "[DONE]") {
        let v: Value = serde_json::from_str(d).unwrap();
        for c in v["choices"].as_array().unwrap() {
            let piece = if key == "content" { &c["delta"]["content"] } else { &c["text"] };
            text.push_str(piece.as_str().unwrap_or_default());
            if let Some(f) = c["finish_reason"].as_str() {
                finish = f.to_string();
            }
        }
    }
    (text, finish)
}

#[test]
fn every_grammar_field_holds_the_answer_to_its_language_streamed_or_not() {
    let server = start("tiny-a", &[]);
    let gbnf = "root ::= greeting \" \" name \"!\"\ngreeting ::= \"hi\" | \"hello\"\nname ::= [A-Z] [a-z]{1,6}\n";
    let gbnf_re = r"^(hi|hello) [A-Z][a-z]{1,6}!$";
    let lark = "start: \"(\" num (\",\" \" \"? num){0,3} \")\"\nnum: /[1-9][0-9]{0,2}/ | \"0\"\n";
    let lark_re = r"^\(([1-9][0-9]{0,2}|0)(, ?([1-9][0-9]{0,2}|0)){0,3}\)$";
    let rx = r"[a-z]{2,8}(-[0-9]{1,3}){1,3}";
    let rx_re = r"^[a-z]{2,8}(-[0-9]{1,3}){1,3}$";
    let colors = json!(["red", "green", "blue violet", "bluebird"]);
    let colors_re = r"^(red|green|blue violet|bluebird)$";
    let schema = json!({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
                        "required": ["n"]});
    let schema_re = r#"^\{\s*"n"\s*:\s*[0-9]\s*\}$"#;
    // (the fields to add, the language)
    let cases: Vec<(Value, &str)> = vec![
        (json!({"structured_outputs": {"regex": rx}}), rx_re),
        (json!({"structured_outputs": {"choice": colors}}), colors_re),
        (json!({"structured_outputs": {"grammar": lark}}), lark_re),
        (json!({"structured_outputs": {"grammar": gbnf, "disable_fallback": true}}), gbnf_re),
        (json!({"structured_outputs": {"json": schema.to_string()}}), schema_re),
        (json!({"grammar": gbnf}), gbnf_re),
        (json!({"grammar": format!("%llguidance {{}}\n{lark}")}), lark_re),
        (json!({"json_schema": schema}), schema_re),
        (json!({"regex": format!("^{rx}$")}), rx_re),
        (json!({"ebnf": gbnf}), gbnf_re),
        (json!({"response_format": {"type": "regex", "regex": rx}}), rx_re),
        (json!({"response_format": {"type": "choice", "choice": colors}}), colors_re),
        (json!({"response_format": {"type": "grammar", "grammar": gbnf, "syntax": "gbnf"}}), gbnf_re),
        (json!({"response_format": {"type": "grammar", "grammar": lark}}), lark_re),
    ];
    for (i, (fields, lang)) in cases.iter().enumerate() {
        let re = regex::Regex::new(lang).unwrap();
        for (seed, path, streamed) in [
            (1, "/v1/chat/completions", false),
            (2, "/v1/chat/completions", true),
            (3, "/v1/completions", false),
            (4, "/v1/completions", true),
        ] {
            let mut body = json!({"model": "tiny-a", "max_tokens": 60, "temperature": 1.0, "seed": seed,
                                  "stream": streamed});
            if path.ends_with("chat/completions") {
                body["messages"] = json!([{"role": "user", "content": "Answer."}]);
            } else {
                body["prompt"] = json!("Answer: ");
            }
            for (k, v) in fields.as_object().unwrap() {
                body[k] = v.clone();
            }
            let (status, text) = post(&server.base, path, &body);
            let (got, finish) = answer(path, status, &text, streamed);
            assert!(re.is_match(&got), "case {i} {fields} {path} streamed {streamed}: {got:?} is not in {lang}");
            assert_eq!(finish, "stop", "case {i} {path}: {got:?}");
        }
    }
}

#[test]
fn a_broken_or_doubled_grammar_is_a_400_naming_its_field() {
    let server = start("tiny-a", &[]);
    // (fields, param, what the message says)
    let cases: Vec<(Value, &str, &str)> = vec![
        (json!({"grammar": "root ::= word\n"}), "grammar", "rule `root` uses `word`, which is never defined"),
        (json!({"ebnf": "root ::= [z-a]\n"}), "ebnf", "reversed"),
        (json!({"structured_outputs": {"regex": "(a"}}), "structured_outputs.regex", "the regex cannot be read"),
        (json!({"structured_outputs": {"grammar": "start: nope\n"}}), "structured_outputs.grammar", "nope"),
        (json!({"structured_outputs": {"choice": []}}), "structured_outputs.choice", "non-empty list"),
        (json!({"structured_outputs": {"regex": "a", "choice": ["a"]}}), "structured_outputs.choice", "both"),
        (
            json!({"structured_outputs": {"whitespace_pattern": " "}}),
            "structured_outputs.whitespace_pattern",
            "not supported",
        ),
        (json!({"structured_outputs": {}}), "structured_outputs", "must set one of"),
        (
            json!({"grammar": "root ::= \"a\"\n", "response_format": {"type": "json_object"}}),
            "grammar",
            "both constrain",
        ),
        (json!({"grammar": {"type": "lark"}}), "grammar", "must be a string"),
        (
            json!({"response_format": {"type": "grammar", "grammar": "root ::= \"a\"", "syntax": "ebnf"}}),
            "response_format.syntax",
            "not one of",
        ),
        (json!({"response_format": {"type": "regex", "pattern": "a"}}), "response_format.pattern", "not a known field"),
        (json!({"regex": "(a{300}){300}"}), "regex", "90000"),
    ];
    for (i, (fields, param, says)) in cases.iter().enumerate() {
        let mut body = json!({"model": "tiny-a", "max_tokens": 8,
                              "messages": [{"role": "user", "content": "Answer."}]});
        for (k, v) in fields.as_object().unwrap() {
            body[k] = v.clone();
        }
        let (status, text) = post(&server.base, "/v1/chat/completions", &body);
        assert_eq!(status, 400, "case {i}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["error"]["param"], *param, "case {i}: {v}");
        let m = v["error"]["message"].as_str().unwrap();
        assert!(m.contains(says) && m.contains(param), "case {i}: {m:?} does not say {says:?} about {param}");
    }
}
