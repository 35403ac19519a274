//! A Responses request's answer: a `response` object, or streamed as the API's typed events.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use tokio::sync::mpsc;
use vl_models::engine::{Completion, Finish};

use super::Echo;
use crate::error::ApiError;
use crate::guard::log_answer;
use crate::job::{engine_stopped, Msg};
use crate::state::{now, App};

/// Ids of one response's items.
struct Ids {
    response: String,
    n: u64,
}

impl Ids {
    fn item(&self, prefix: &str, i: usize) -> String {
        format!("{prefix}_{}_{i}", self.n)
    }
}

/// The response object: `status` and the output items so far.
fn response(
    app: &App,
    ids: &Ids,
    echo: &Echo,
    created: u64,
    status: &str,
    output: Vec<Value>,
    c: Option<&Completion>,
) -> Value {
    let mut r = json!({
        "id": ids.response,
        "object": "response",
        "created_at": created,
        "status": status,
        "model": app.config.id,
        "output": output,
        "error": null,
        "incomplete_details": null,
        "parallel_tool_calls": true,
        "tool_choice": "auto",
        "tools": echo.tools,
        "store": echo.store,
        "truncation": if echo.auto_truncation { "auto" } else { "disabled" },
        "usage": null,
        "metadata": {},
    });
    for (k, v) in &echo.fields {
        if !["tools", "model"].contains(&k.as_str()) {
            r[k] = v.clone();
        }
    }
    if echo.auto_truncation {
        // Ours: how many input messages `truncation: "auto"` dropped (oldest first).
        r["truncated_input_messages"] = json!(echo.truncated);
    }
    if let Some(c) = c {
        if matches!(c.finish, Finish::Length | Finish::ContextFull) {
            r["incomplete_details"] = json!({"reason": "max_output_tokens"});
        }
        let out = c.token_ids.len();
        let reasoning = match (&c.reasoning, echo.close) {
            (Some(_), Some(close)) => c.token_ids.iter().position(|&t| t == close).map_or(out, |p| p + 1),
            _ => 0,
        };
        r["usage"] = json!({
            "input_tokens": c.prompt_tokens,
            "input_tokens_details": {"cached_tokens": c.cached_tokens},
            "output_tokens": out,
            "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": c.prompt_tokens + out,
        });
    }
    r
}

fn status_of(c: &Completion) -> &'static str {
    match c.finish {
        Finish::Length | Finish::ContextFull => "incomplete",
        _ => "completed",
    }
}

/// A reasoning item; with `encrypted` (and its text complete) its opaque `encrypted_content`.
fn reasoning_item(id: &str, text: &str, status: &str, encrypted: bool) -> Value {
    let mut item = json!({"type": "reasoning", "id": id, "status": status, "summary": [],
           "content": [{"type": "reasoning_text", "text": text}]});
    if encrypted && status == "completed" {
        item["encrypted_content"] = json!(super::parse::encrypt_reasoning(text));
    }
    item
}

/// Keeps a finished answer when its request asked (`store`): the response and the conversation
/// it ends. A response over the store's bound is not kept, and says so (`store: false`).
fn keep(app: &App, echo: &Echo, ids: &Ids, c: &Completion, r: &mut Value) {
    if !echo.store {
        return;
    }
    let mut messages = echo.history.clone();
    messages.push(super::store::assistant_message(c, |i| format!("call_{}_{i}", ids.n)));
    let kept = app.responses.put(&ids.response, super::store::Stored { response: r.clone(), messages });
    if !kept {
        r["store"] = json!(false);
    }
}

fn message_item(id: &str, text: &str, status: &str, logprobs: &[Value]) -> Value {
    let content = if status == "in_progress" {
        json!([])
    } else {
        json!([{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}])
    };
    json!({"type": "message", "id": id, "status": status, "role": "assistant", "content": content})
}

fn call_item(ids: &Ids, i: usize, name: &str, arguments: &str, status: &str) -> Value {
    json!({"type": "function_call", "id": ids.item("fc", i), "call_id": format!("call_{}_{i}", ids.n),
           "name": name, "arguments": arguments, "status": status})
}

/// Every output item of a finished answer.
/// `logprobs`: the message's, OpenAI's entries (`{"token", "logprob", "bytes", "top_logprobs"}`).
fn output(ids: &Ids, c: &Completion, encrypted: bool, logprobs: &[Value]) -> Vec<Value> {
    let mut items = vec![];
    if let Some(r) = &c.reasoning {
        items.push(reasoning_item(&ids.item("rs", 0), r, "completed", encrypted));
    }
    // A message unless the answer is only calls or only reasoning (one that is neither has an
    // empty message).
    if !c.text.is_empty() || (c.tool_calls.is_empty() && c.reasoning.is_none()) {
        items.push(message_item(&ids.item("msg", 0), &c.text, status_of(c), logprobs));
    }
    for (i, call) in c.tool_calls.iter().enumerate() {
        items.push(call_item(ids, i, &call.name, &call.arguments, "completed"));
    }
    items
}

/// Answers a parsed Responses request from its job's messages (`first` already received).
pub(crate) async fn answer(
    app: Arc<App>,
    echo: Echo,
    stream: bool,
    first: Msg,
    mut rx: mpsc::Receiver<Msg>,
    started: Instant,
    n: u64,
) -> Result<Response, ApiError> {
    // Unguessable: a stored response is read by its id alone (one `--api-key` for all clients).
    let ids = Ids { response: super::store::new_id(), n };
    let created = now();
    if !stream {
        let mut msg = first;
        loop {
            if let Msg::Done(done) = msg {
                let all = done?;
                log_answer("/v1/responses", &all, started);
                let c = &all[0];
                let lps =
                    if echo.logprobs { entries(&crate::answers::logprobs_json(&app, &c.logprobs)) } else { vec![] };
                let out = output(&ids, c, echo.encrypted, &lps);
                let mut r = response(&app, &ids, &echo, created, status_of(c), out, Some(c));
                keep(&app, &echo, &ids, c, &mut r);
                return Ok(axum::Json(r).into_response());
            }
            msg = rx.recv().await.ok_or_else(engine_stopped)?;
        }
    }
    if let Msg::Done(Err(e)) = first {
        return Err(e);
    }
    let (lines, out) = mpsc::channel::<TypedEvent>(64);
    tokio::spawn(async move {
        let mut events = Events { lines, seq: 0, encrypted: echo.encrypted };
        let start = response(&app, &ids, &echo, created, "in_progress", vec![], None);
        if !events.send("response.created", json!({"response": start.clone()})).await
            || !events.send("response.in_progress", json!({"response": start})).await
        {
            return;
        }
        let mut open: Option<OpenItem> = None;
        let mut items: Vec<Value> = vec![];
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
                Msg::Text { text: t, reasoning, logprobs, .. } => {
                    if open.as_ref().is_some_and(|o| o.reasoning != reasoning) {
                        let o = open.take().expect("checked");
                        if !events.close(&mut items, o, "completed").await {
                            return;
                        }
                    }
                    if open.is_none() {
                        let index = items.len();
                        let id = ids.item(if reasoning { "rs" } else { "msg" }, 0);
                        let item = if reasoning {
                            reasoning_item(&id, "", "in_progress", false)
                        } else {
                            message_item(&id, "", "in_progress", &[])
                        };
                        let mut ok = events
                            .send("response.output_item.added", json!({"output_index": index, "item": item}))
                            .await;
                        if !reasoning {
                            let part = json!({"type": "output_text", "text": "", "annotations": [], "logprobs": []});
                            ok = ok
                                && events
                                    .send(
                                        "response.content_part.added",
                                        json!({"item_id": id, "output_index": index, "content_index": 0, "part": part}),
                                    )
                                    .await;
                        }
                        if !ok {
                            return;
                        }
                        items.push(Value::Null);
                        open = Some(OpenItem { index, id, reasoning, text: String::new(), logprobs: vec![] });
                    }
                    let o = open.as_mut().expect("opened");
                    o.text.push_str(&t);
                    let kind = if reasoning { "response.reasoning_text.delta" } else { "response.output_text.delta" };
                    let mut e = json!({"item_id": o.id, "output_index": o.index, "content_index": 0, "delta": t});
                    if !reasoning {
                        let piece = entries(&logprobs);
                        e["logprobs"] = json!(piece);
                        o.logprobs.extend(piece);
                    }
                    if !events.send(kind, e).await {
                        return;
                    }
                }
                Msg::Done(Ok(all)) => {
                    log_answer("/v1/responses", &all, started);
                    let c = &all[0];
                    if let Some(o) = open.take() {
                        if !events.close(&mut items, o, status_of(c)).await {
                            return;
                        }
                    }
                    // An answer that is only calls has no message; one with neither text nor
                    // calls has an empty one.
                    if items.is_empty() && c.tool_calls.is_empty() {
                        let index = items.len();
                        let item = message_item(&ids.item("msg", 0), "", status_of(c), &[]);
                        let _ = events
                            .send("response.output_item.added", json!({"output_index": index, "item": item.clone()}))
                            .await;
                        let _ = events
                            .send("response.output_item.done", json!({"output_index": index, "item": item.clone()}))
                            .await;
                        items.push(item);
                    }
                    for (i, call) in c.tool_calls.iter().enumerate() {
                        let index = items.len();
                        let added = call_item(&ids, i, &call.name, "", "in_progress");
                        let done = call_item(&ids, i, &call.name, &call.arguments, "completed");
                        let id = ids.item("fc", i);
                        let _ = events
                            .send("response.output_item.added", json!({"output_index": index, "item": added}))
                            .await;
                        let _ = events
                            .send(
                                "response.function_call_arguments.delta",
                                json!({"item_id": id, "output_index": index, "delta": call.arguments}),
                            )
                            .await;
                        let _ = events
                            .send(
                                "response.function_call_arguments.done",
                                json!({"item_id": id, "output_index": index, "name": call.name, "arguments": call.arguments}),
                            )
                            .await;
                        let _ = events
                            .send("response.output_item.done", json!({"output_index": index, "item": done.clone()}))
                            .await;
                        items.push(done);
                    }
                    let status = status_of(c);
                    let mut r = response(&app, &ids, &echo, created, status, items, Some(c));
                    keep(&app, &echo, &ids, c, &mut r);
                    let kind = if status == "completed" { "response.completed" } else { "response.incomplete" };
                    let _ = events.send(kind, json!({"response": r})).await;
                    return;
                }
                Msg::Done(Err(e)) => {
                    let b = e.body();
                    let err = &b["error"];
                    let _ = events
                        .send("error", json!({"code": err["code"], "message": err["message"], "param": err["param"]}))
                        .await;
                    return;
                }
            }
        }
    });
    let stream = futures_util::stream::unfold(out, |mut out| async move {
        let TypedEvent { kind, data } = out.recv().await?;
        Some((Ok::<_, std::convert::Infallible>(Event::default().event(kind).data(data)), out))
    });
    Ok(Sse::new(stream)
        .keep_alive(axum::response::sse::KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response())
}

/// The entries of a chat `logprobs` object (`{"content": [...]}`; none for null).
fn entries(chat: &Value) -> Vec<Value> {
    chat["content"].as_array().cloned().unwrap_or_default()
}

/// The item a stream is writing: a message or a reasoning block.
struct OpenItem {
    /// Its place in `output`.
    index: usize,
    id: String,
    /// A reasoning block (else a message).
    reasoning: bool,
    /// Its text so far.
    text: String,
    /// A message's log-probability entries so far (with `logprobs` asked).
    logprobs: Vec<Value>,
}

/// One SSE event of the stream: its type (`event:`) and JSON body (`data:`).
struct TypedEvent {
    kind: String,
    data: String,
}

/// The stream's typed events, numbered.
struct Events {
    lines: mpsc::Sender<TypedEvent>,
    seq: u64,
    /// Reasoning items carry their `encrypted_content`.
    encrypted: bool,
}

impl Events {
    /// Sends one event; false when the client has gone.
    async fn send(&mut self, kind: &str, mut body: Value) -> bool {
        body["type"] = json!(kind);
        body["sequence_number"] = json!(self.seq);
        self.seq += 1;
        self.lines.send(TypedEvent { kind: kind.to_string(), data: body.to_string() }).await.is_ok()
    }

    /// Closes the open item: its text's `done` event, then the item's.
    async fn close(&mut self, items: &mut [Value], open: OpenItem, status: &str) -> bool {
        let OpenItem { index, id, reasoning, text, logprobs } = open;
        let (item, ok) = if reasoning {
            let e = json!({"item_id": id, "output_index": index, "content_index": 0, "text": text});
            (
                reasoning_item(&id, &text, "completed", self.encrypted),
                self.send("response.reasoning_text.done", e).await,
            )
        } else {
            let e =
                json!({"item_id": id, "output_index": index, "content_index": 0, "text": text, "logprobs": logprobs});
            let part = json!({"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs});
            let p = json!({"item_id": id, "output_index": index, "content_index": 0, "part": part});
            let ok =
                self.send("response.output_text.done", e).await && self.send("response.content_part.done", p).await;
            (message_item(&id, &text, status, &logprobs), ok)
        };
        items[index] = item.clone();
        ok && self.send("response.output_item.done", json!({"output_index": index, "item": item})).await
    }
}
