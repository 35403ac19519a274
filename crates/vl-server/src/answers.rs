//! The chat and text completions' answers, from their worker's messages: gathered into one
//! object, or streamed as SSE chunks; and their JSON parts (messages, tool calls, logprobs in
//! both shapes, usage, grounding).

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use tokio::sync::mpsc;
use vl_models::engine::{Completion, ToolCall};

use crate::error::ApiError;
use crate::guard::log_answer;
use crate::job::{engine_stopped, Msg};
use crate::state::App;

/// Which OpenAI endpoint a request came to: the answers' shape follows it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Chat,
    Text,
    Responses,
}

/// A chat or text completion request's answer: what its JSON says besides the completions.
pub(crate) struct Answer {
    pub app: Arc<App>,
    pub kind: Kind,
    /// `chatcmpl-N` or `cmpl-N`.
    pub id: String,
    pub created: u64,
    /// When the request came (the log line's total).
    pub started: Instant,
    pub want_logprobs: bool,
    /// Answers asked for (`n`).
    pub n: usize,
    /// `stream_options.include_usage`: a last chunk with the usage.
    pub include_usage: bool,
}

impl Answer {
    /// The endpoint, for the log line.
    fn path(&self) -> &'static str {
        if self.kind == Kind::Chat {
            "/v1/chat/completions"
        } else {
            "/v1/completions"
        }
    }

    /// The whole answer, once every choice has ended (`first` already received).
    pub(crate) async fn whole(self, first: Msg, mut rx: mpsc::Receiver<Msg>) -> Result<Response, ApiError> {
        let mut msg = first;
        loop {
            if let Msg::Done(done) = msg {
                let all = done?;
                log_answer(self.path(), &all, self.started);
                return Ok(axum::Json(self.whole_json(&all)).into_response());
            }
            msg = rx.recv().await.ok_or_else(engine_stopped)?;
        }
    }

    pub(crate) fn whole_json(&self, all: &[Completion]) -> Value {
        let object = if self.kind == Kind::Chat { "chat.completion" } else { "text_completion" };
        let choices: Vec<Value> = all.iter().enumerate().map(|(i, c)| self.choice_json(i, c)).collect();
        json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.app.config.id,
            "choices": choices,
            "usage": usage(all),
        })
    }

    /// Choice `i` of the whole answer.
    fn choice_json(&self, i: usize, c: &Completion) -> Value {
        let app = &self.app;
        let mut v = json!({
            "index": i,
            "finish_reason": c.finish.openai(),
            "logprobs": if self.want_logprobs { logprobs_json(app, &c.logprobs) } else { Value::Null },
        });
        match self.kind {
            Kind::Chat => v["message"] = message(&self.id, c),
            _ => {
                v["text"] = json!(c.text);
                if self.want_logprobs {
                    v["logprobs"] = legacy_logprobs(&v["logprobs"], &mut 0);
                }
            }
        }
        if let Some(g) = grounding_json(app, c) {
            v["grounding"] = g;
        }
        v
    }

    /// The answer streamed as SSE (`first` already received; an error there is the answer's
    /// status). A task turns the worker's messages into SSE lines; when the client goes away the
    /// stream (and its receiver) is dropped, the task's send fails, it drops the worker's
    /// channel, and the worker's next send fails: the generation is cancelled.
    pub(crate) fn stream(self, first: Msg, rx: mpsc::Receiver<Msg>) -> Result<Response, ApiError> {
        if let Msg::Done(Err(e)) = first {
            return Err(e);
        }
        let (lines, out) = mpsc::channel::<String>(64);
        tokio::spawn(self.relay(first, rx, lines));
        let stream = futures_util::stream::unfold(out, |mut out| async move {
            let line = out.recv().await?;
            Some((Ok::<_, std::convert::Infallible>(Event::default().data(line)), out))
        });
        Ok(Sse::new(stream)
            .keep_alive(axum::response::sse::KeepAlive::new().interval(Duration::from_secs(15)))
            .into_response())
    }

    /// The stream's lines: each choice's role (chat), the pieces, then the ends and `[DONE]`.
    async fn relay(self, first: Msg, mut rx: mpsc::Receiver<Msg>, lines: mpsc::Sender<String>) {
        let mut chunks = Chunks::new(&self);
        for i in (0..self.n).filter(|_| self.kind == Kind::Chat) {
            let role = chunks.chunk(i, json!({"role": "assistant", "content": ""}), Value::Null, Value::Null);
            if lines.send(role.to_string()).await.is_err() {
                return;
            }
        }
        let mut msg = Some(first);
        loop {
            let m = match msg.take() {
                Some(m) => m,
                None => match rx.recv().await {
                    Some(m) => m,
                    None => return,
                },
            };
            match m {
                Msg::Text { choice, text, reasoning, logprobs } => {
                    let delta = if reasoning { json!({"reasoning_content": text}) } else { json!({"content": text}) };
                    if lines.send(chunks.chunk(choice, delta, Value::Null, logprobs).to_string()).await.is_err() {
                        return;
                    }
                }
                Msg::Done(Ok(all)) => {
                    log_answer(self.path(), &all, self.started);
                    self.finish(&mut chunks, &all, &lines).await;
                    return;
                }
                Msg::Done(Err(e)) => {
                    let _ = lines.send(e.body().to_string()).await;
                    let _ = lines.send("[DONE]".to_string()).await;
                    return;
                }
            }
        }
    }

    /// The stream's end: each choice's calls and finish (with its grounding), the usage when
    /// asked, `[DONE]`.
    async fn finish(&self, chunks: &mut Chunks, all: &[Completion], lines: &mpsc::Sender<String>) {
        for (i, c) in all.iter().enumerate() {
            if !c.tool_calls.is_empty() {
                let calls = tool_calls_json(&self.id, &c.tool_calls, true);
                let _ = lines
                    .send(chunks.chunk(i, json!({"tool_calls": calls}), Value::Null, Value::Null).to_string())
                    .await;
            }
            let mut last = chunks.chunk(i, json!({}), json!(c.finish.openai()), Value::Null);
            if let Some(g) = grounding_json(&self.app, c) {
                last["choices"][0]["grounding"] = g;
            }
            let _ = lines.send(last.to_string()).await;
        }
        if self.include_usage {
            let v = json!({"id": self.id, "object": chunks.object, "created": self.created,
                           "model": self.app.config.id, "choices": [], "usage": usage(all)});
            let _ = lines.send(v.to_string()).await;
        }
        let _ = lines.send("[DONE]".to_string()).await;
    }
}

/// A streamed answer's chunks.
struct Chunks {
    kind: Kind,
    id: String,
    object: &'static str,
    created: u64,
    model: String,
    /// Each text completion choice's characters so far (the legacy logprobs' `text_offset`).
    offsets: Vec<usize>,
}

impl Chunks {
    fn new(a: &Answer) -> Self {
        let object = if a.kind == Kind::Chat { "chat.completion.chunk" } else { "text_completion" };
        Self {
            kind: a.kind,
            id: a.id.clone(),
            object,
            created: a.created,
            model: a.app.config.id.clone(),
            offsets: vec![0; a.n],
        }
    }

    /// A chunk of choice `index`: its delta (a chat's), finish reason and logprobs.
    fn chunk(&mut self, index: usize, delta: Value, finish: Value, logprobs: Value) -> Value {
        let mut choice = json!({"index": index, "finish_reason": finish, "logprobs": logprobs});
        match self.kind {
            Kind::Chat => choice["delta"] = delta,
            // A text completion's chunk carries the piece as `text`, its logprobs in the legacy
            // shape.
            _ => {
                choice["text"] = delta.get("content").cloned().unwrap_or(json!(""));
                if !choice["logprobs"].is_null() {
                    choice["logprobs"] = legacy_logprobs(&choice["logprobs"], &mut self.offsets[index]);
                }
            }
        }
        json!({"id": self.id, "object": self.object, "created": self.created, "model": self.model, "choices": [choice]})
    }
}

/// The response's assistant message: the text (null when the answer is only calls) and the calls.
fn message(id: &str, c: &Completion) -> Value {
    let mut m = if c.tool_calls.is_empty() {
        json!({"role": "assistant", "content": c.text})
    } else {
        let content = if c.text.trim().is_empty() { Value::Null } else { json!(c.text) };
        json!({"role": "assistant", "content": content, "tool_calls": tool_calls_json(id, &c.tool_calls, false)})
    };
    // A thinking checkpoint's reasoning block, apart from the answer (vLLM's and llama-server's
    // field).
    if let Some(r) = &c.reasoning {
        m["reasoning_content"] = json!(r);
    }
    m
}

/// OpenAI's `logprobs` object: `{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}`;
/// a token's text is its own decoding (a piece of a multi-byte character decodes to U+FFFD; its
/// `bytes` are those of that text).
pub(crate) fn logprobs_json(app: &App, lps: &[vl_models::engine::TokenLogprob]) -> Value {
    let tok = app.engine.family().tokenizer();
    let text = |t: u32| tok.decode(&[t], false).unwrap_or_default();
    let entry = |t: u32, lp: f32| {
        let s = text(t);
        json!({"token": s, "logprob": lp, "bytes": s.as_bytes()})
    };
    let content: Vec<Value> = lps
        .iter()
        .map(|l| {
            let mut e = entry(l.token, l.logprob);
            e["top_logprobs"] = l.top.iter().map(|&(t, lp)| entry(t, lp)).collect();
            e
        })
        .collect();
    json!({"content": content})
}

/// The legacy completions' `logprobs` (`{"tokens", "token_logprobs", "top_logprobs": [{token:
/// logprob}], "text_offset"}`) from the chat shape; `offset`: the characters of the choice's
/// text before these tokens, advanced past them.
fn legacy_logprobs(chat: &Value, offset: &mut usize) -> Value {
    let entries = chat["content"].as_array().cloned().unwrap_or_default();
    let mut text_offset = Vec::with_capacity(entries.len());
    for e in &entries {
        text_offset.push(*offset);
        *offset += e["token"].as_str().map_or(0, |t| t.chars().count());
    }
    json!({
        "tokens": entries.iter().map(|e| e["token"].clone()).collect::<Vec<_>>(),
        "token_logprobs": entries.iter().map(|e| e["logprob"].clone()).collect::<Vec<_>>(),
        "top_logprobs": entries
            .iter()
            .map(|e| {
                let top: serde_json::Map<String, Value> = e["top_logprobs"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|t| (t["token"].as_str().unwrap_or_default().to_string(), t["logprob"].clone()))
                    .collect();
                Value::Object(top)
            })
            .collect::<Vec<_>>(),
        "text_offset": text_offset,
    })
}

/// Ours, on a choice whose answer names boxes or points (`vl_models::grounding`): the shapes in
/// the answer's coordinates, then in pixels of each image of the request (as displayed, after
/// EXIF orientation), and what the parser noticed. None when the answer has neither.
/// docs/serving.md documents the shape.
fn grounding_json(app: &App, c: &Completion) -> Option<Value> {
    let g = app.engine.family().grounding()?;
    // Cheap test first: most answers name no shape.
    if !(c.text.contains("bbox_2d") || c.text.contains("point_2d")) {
        return None;
    }
    Some(vl_models::grounding::report(&c.text, g.coords, &c.images))
}

/// Usage of a request's choices: the prompt once, the completions summed.
fn usage(all: &[Completion]) -> Value {
    let c = &all[0];
    let completion: usize = all.iter().map(|c| c.token_ids.len()).sum();
    json!({
        "prompt_tokens": c.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": c.prompt_tokens + completion,
        // `image_tokens` and `video_tokens` are ours (OpenAI has no such fields; clients ignore
        // them): the prompt tokens that stand for images and videos, after their pixel budgets.
        "prompt_tokens_details": {
            "cached_tokens": c.cached_tokens,
            "image_tokens": c.image_tokens,
            "video_tokens": c.video_tokens,
        },
    })
}

/// The OpenAI shape of the answer's calls; ids are unique per response.
fn tool_calls_json(response_id: &str, calls: &[ToolCall], streaming: bool) -> Value {
    calls
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let mut v = json!({"id": format!("call_{}_{i}", response_id.trim_start_matches("chatcmpl-")),
                               "type": "function", "function": {"name": c.name, "arguments": c.arguments}});
            if streaming {
                v["index"] = json!(i);
            }
            v
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use vl_models::engine::Finish;

    fn completion(text: &str, calls: Vec<ToolCall>) -> Completion {
        Completion {
            text: text.into(),
            reasoning: None,
            finish: if calls.is_empty() { Finish::Stop } else { Finish::ToolCalls },
            tool_calls: calls,
            token_ids: vec![],
            prompt_tokens: 0,
            cached_tokens: 0,
            image_tokens: 0,
            video_tokens: 0,
            videos: vec![],
            images: vec![],
            image_cache_hits: 0,
            video_cache_hits: 0,
            vision_time: Duration::ZERO,
            prefill_time: Duration::ZERO,
            decode_time: Duration::ZERO,
            time_to_first_token: Duration::ZERO,
            first_logits: vec![],
            logprobs: vec![],
            kv_cache_bytes: 0,
            steps: Default::default(),
        }
    }

    #[test]
    fn calls_take_the_openai_shape() {
        let call = ToolCall { name: "get_weather".into(), arguments: r#"{"city": "Zürich"}"#.into() };
        let c = completion("\n", vec![call.clone(), call]);
        assert_eq!(c.finish.openai(), "tool_calls");
        let m = message("chatcmpl-7", &c);
        // Whitespace before the first call is no content.
        assert_eq!(m["content"], Value::Null);
        assert_eq!(m["tool_calls"][1]["id"], "call_7_1");
        assert_eq!(m["tool_calls"][0]["type"], "function");
        assert_eq!(m["tool_calls"][0]["function"]["name"], "get_weather");
        assert_eq!(m["tool_calls"][0]["function"]["arguments"], r#"{"city": "Zürich"}"#);
        assert!(m["tool_calls"][0].get("index").is_none());
        assert_eq!(tool_calls_json("chatcmpl-7", &c.tool_calls, true)[1]["index"], 1);
        let plain = message("chatcmpl-8", &completion("Hello", vec![]));
        assert_eq!(plain, json!({"role": "assistant", "content": "Hello"}));
    }
}
