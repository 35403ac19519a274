//! Thinking checkpoints: the Qwen3-VL Thinking template (tools/hf-reference/templates, origin in
//! docs/goldens.md) and template arguments render as transformers renders them, and tiny-a
//! under that template answers the reference's greedy ids, its reasoning split from the
//! answer as the template reads an assistant message (goldens/thinking, by the pinned
//! reference).

mod common;

use common::*;
use serde_json::Value;
use vl_models::engine::{ChatMessage, Engine, EngineOptions, ModelOptions, Part, Request};
use vl_models::template::{ChatTemplate, Content, Message, TemplateSource, TemplateToolCall};
use vl_models::GenerationOptions;

fn golden() -> Value {
    read_json(&goldens().join("thinking/thinking.json"))
}

fn thinking_template() -> String {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tools/hf-reference/templates");
    std::fs::read_to_string(root.join("Qwen3-VL-Thinking.jinja")).unwrap()
}

/// A golden case's messages as the template sees them.
fn messages(v: &Value) -> Vec<Message> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|m| {
            let content = match &m["content"] {
                Value::String(s) => vec![Content::Text { text: s.clone() }],
                Value::Array(parts) => parts
                    .iter()
                    .map(|p| match p["type"].as_str().unwrap() {
                        "image" => Content::Image { image: p["image"].as_str().unwrap().into() },
                        _ => Content::Text { text: p["text"].as_str().unwrap().into() },
                    })
                    .collect(),
                other => panic!("content {other}"),
            };
            let mut msg = Message::new(m["role"].as_str().unwrap(), content);
            msg.reasoning_content = m["reasoning_content"].as_str().map(String::from);
            if let Some(calls) = m["tool_calls"].as_array() {
                msg.tool_calls = calls
                    .iter()
                    .map(|c| {
                        TemplateToolCall::function(
                            c["function"]["name"].as_str().unwrap(),
                            c["function"]["arguments"].clone(),
                        )
                    })
                    .collect();
            }
            msg
        })
        .collect()
}

#[test]
fn thinking_and_kwarg_templates_render_as_transformers_does() {
    let g = golden();
    let tokenizer_config = read_json(&goldens().join("tokenizer/tokenizer_config.json"));
    let qwen3_text = tokenizer_config["chat_template"].as_str().unwrap().to_string();
    let tok = tokenizers::Tokenizer::from_file(goldens().join("tokenizer/tokenizer.json")).unwrap();
    let renders = g["renders"].as_array().unwrap();
    assert_eq!(renders.len(), 6);
    for r in renders {
        let case = r["case"].as_str().unwrap();
        let src = if r["template"] == "thinking" { thinking_template() } else { qwen3_text.clone() };
        let t = ChatTemplate::new(src, TemplateSource::BuiltIn, None, Some("<|im_end|>".into())).unwrap();
        let kwargs = r["kwargs"].as_object().unwrap().clone();
        let text = t.render_kw(&messages(&r["messages"]), None, &kwargs, true).unwrap();
        assert_eq!(text, r["text"].as_str().unwrap(), "{case}");
        let ids: Vec<u32> = tok.encode(text.as_str(), false).unwrap().get_ids().to_vec();
        let want: Vec<u32> = r["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        assert_eq!(ids, want, "{case}");
    }
    // The names a request sets itself are not template arguments.
    let t = ChatTemplate::new(thinking_template(), TemplateSource::BuiltIn, None, None).unwrap();
    let mut kw = serde_json::Map::new();
    kw.insert("add_generation_prompt".into(), Value::Bool(false));
    let e = t.render_kw(&[Message::text("user", "hi")], None, &kw, true).unwrap_err().to_string();
    assert!(e.contains("add_generation_prompt"), "{e}");
}

/// tiny-a with the Thinking template as its own.
fn thinking_checkpoint() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(goldens().join("tiny-a/checkpoint")).unwrap() {
        let p = entry.unwrap().path();
        if p.file_name().unwrap() != "chat_template.jinja" {
            std::os::unix::fs::symlink(std::fs::canonicalize(&p).unwrap(), dir.path().join(p.file_name().unwrap()))
                .unwrap();
        }
    }
    std::fs::write(dir.path().join("chat_template.jinja"), thinking_template()).unwrap();
    dir
}

#[test]
fn a_thinking_answer_is_split_as_the_template_reads_it() {
    let g = golden()["greedy"].clone();
    let dir = thinking_checkpoint();
    let opts = EngineOptions { model: ModelOptions { device: device(), ..Default::default() }, ..Default::default() };
    let engine = Engine::load(dir.path(), opts).unwrap();
    let ids: Vec<u32> = g["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    let req = Request {
        messages: vec![ChatMessage::new("user", vec![Part::Text(g["question"].as_str().unwrap().into())])],
        options: GenerationOptions { max_new_tokens: ids.len(), ..Default::default() },
        ..Default::default()
    };
    let (mut reasoning, mut content) = (String::new(), String::new());
    let c = engine
        .stream(&req, 1, &mut |d| {
            if d.reasoning {
                reasoning.push_str(d.text)
            } else {
                content.push_str(d.text)
            }
            true
        })
        .unwrap()
        .remove(0);
    assert_eq!(c.prompt_tokens, g["prompt_ids"].as_array().unwrap().len());
    assert_eq!(c.token_ids, ids);
    // The prompt opened the block: the whole answer is reasoning until `</think>`.
    assert_eq!(c.reasoning.as_deref(), g["reasoning"].as_str());
    assert_eq!(c.text, g["content"].as_str().unwrap());
    // Streamed pieces add up to the same split.
    assert_eq!(reasoning, g["reasoning"].as_str().unwrap());
    assert_eq!(content, g["content"].as_str().unwrap());
    // `generate` passes only the answer's text.
    let mut text = String::new();
    let again = engine.generate(&req, &mut |p| {
        text.push_str(p);
        true
    });
    assert_eq!(again.unwrap().token_ids, ids);
    assert_eq!(text, g["content"].as_str().unwrap());
}

#[test]
fn an_instruct_answer_has_no_reasoning() {
    let opts = EngineOptions { model: ModelOptions { device: device(), ..Default::default() }, ..Default::default() };
    let engine = Engine::load(&goldens().join("tiny-a/checkpoint"), opts).unwrap();
    let req = Request {
        messages: vec![ChatMessage::text("user", "Describe the weather.")],
        options: GenerationOptions { max_new_tokens: 6, ..Default::default() },
        ..Default::default()
    };
    let c = engine.generate(&req, &mut |_| true).unwrap();
    assert_eq!(c.reasoning, None);
    assert_eq!(c.token_ids.len(), 6);
}

/// With the block opened by the prompt, a request's constraint holds the answer after it: the
/// reasoning runs free until `</think>` (pushed first here by `logit_bias`), then the answer is
/// one of the schema's values.
#[test]
fn a_constraint_applies_after_the_reasoning_block() {
    let dir = thinking_checkpoint();
    let opts = EngineOptions { model: ModelOptions { device: device(), ..Default::default() }, ..Default::default() };
    let engine = Engine::load(dir.path(), opts).unwrap();
    let tok = engine.family().tokenizer();
    let close = tok.token_to_id("</think>").unwrap();
    for seed in 0..3 {
        let req = Request {
            messages: vec![ChatMessage::text("user", "Cat or dog?")],
            options: GenerationOptions {
                max_new_tokens: 16,
                temperature: 1.0,
                seed,
                logit_bias: vec![(close, 100.0)],
                ..Default::default()
            },
            constraint: Some(vl_models::engine::Constraint::JsonSchema(serde_json::json!({"enum": ["cat", "dog"]}))),
            ..Default::default()
        };
        let c = engine.generate(&req, &mut |_| true).unwrap();
        assert_eq!(c.token_ids[0], close, "seed {seed}");
        assert_eq!(c.reasoning.as_deref(), Some(""), "seed {seed}");
        let v: Value = serde_json::from_str(&c.text).unwrap_or_else(|e| panic!("seed {seed}: {:?}: {e}", c.text));
        assert!(v == "cat" || v == "dog", "seed {seed}: {v}");
        assert_eq!(c.finish, vl_models::engine::Finish::Stop, "seed {seed}");
    }
}
