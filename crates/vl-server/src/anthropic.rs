//! Anthropic's Messages API: `POST /v1/messages` (whole or streamed as Anthropic's SSE events)
//! and `POST /v1/messages/count_tokens`. A body is checked in Anthropic's terms (every field
//! named in its errors), translated to a chat completions request and parsed by the same code
//! (`request::parse`: media rules, tools, ranges), run by the same workers, and answered in
//! Anthropic's shapes: content blocks (`thinking`, `text`, `tool_use`), `stop_reason`, usage, and
//! errors as `{"type": "error", "error": {"type", "message"}}`.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Map, Value};
use tokio::sync::mpsc;
use vl_models::engine::{Completion, Finish};

use crate::error::ApiError;
use crate::fields::{known_keys, opt_str, typed_field};
use crate::guard::{log_answer, read_body};
use crate::job::{engine_stopped, Job, Msg, RELAY_MESSAGES};
use crate::request::{parse, typed};
use crate::state::App;
use crate::workers::submit;

/// `router` with the Messages routes.
pub(crate) fn routes(router: axum::Router<Arc<App>>) -> axum::Router<Arc<App>> {
    use axum::routing::post;
    router.route("/v1/messages", post(messages)).route("/v1/messages/count_tokens", post(count_tokens))
}

const MESSAGE_KEYS: [&str; 15] = [
    "model",
    "max_tokens",
    "messages",
    "system",
    "stop_sequences",
    "temperature",
    "top_p",
    "top_k",
    "stream",
    "tools",
    "tool_choice",
    "metadata",
    "thinking",
    // Ours, as on chat completions (checked there, errors naming them).
    "speculative",
    "forced_tokens",
];

/// An error in Anthropic's shape, with the status it had.
pub(crate) fn error_response(e: &ApiError) -> Response {
    e.anthropic_response()
}

async fn messages(State(app): State<Arc<App>>, req: axum::extract::Request) -> Response {
    let resp = match read_body(&app, req).await {
        Ok(body) => handle(&app, body).await.unwrap_or_else(|e| error_response(&e)),
        Err(e) => error_response(&e),
    };
    app.metrics.count(resp.status());
    resp
}

async fn count_tokens(State(app): State<Arc<App>>, req: axum::extract::Request) -> Response {
    let resp = match read_body(&app, req).await {
        Ok(body) => count(&app, &body).await.unwrap_or_else(|e| error_response(&e)),
        Err(e) => error_response(&e),
    };
    app.metrics.count(resp.status());
    resp
}

/// A Messages body as a chat completions body; `counting`: `max_tokens` is not required.
fn translate(body: &[u8], counting: bool) -> Result<(Value, bool, Vec<String>), ApiError> {
    let o: Map<String, Value> = match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(o)) => o,
        Ok(_) => return Err(ApiError::bad("the body must be a JSON object")),
        Err(e) => return Err(ApiError::bad(format!("malformed JSON body: {e}"))),
    };
    known_keys(&o, &MESSAGE_KEYS, "")?;
    let mut out = Map::new();
    if let Some(m) = opt_str(&o, "model", "")? {
        out.insert("model".into(), json!(m));
    }
    match typed_field(&o, "max_tokens", "", "a positive integer", |x| x.as_u64().filter(|&n| n > 0))? {
        Some(n) => {
            out.insert("max_tokens".into(), json!(n));
        }
        None if !counting => return Err(ApiError::bad_at("max_tokens", "`max_tokens` is required")),
        None => {}
    }
    for k in ["temperature", "top_p"] {
        if let Some(x) = typed_field(&o, k, "", "a number", Value::as_f64)? {
            out.insert(k.into(), json!(x));
        }
    }
    if let Some(k) = typed_field(&o, "top_k", "", "a non-negative integer", Value::as_u64)? {
        out.insert("top_k".into(), json!(k));
    }
    let stream = typed_field(&o, "stream", "", "a boolean", Value::as_bool)?.unwrap_or(false);
    let stops: Vec<String> = match o.get("stop_sequences").filter(|v| !v.is_null()) {
        None => vec![],
        Some(Value::Array(a)) => a
            .iter()
            .enumerate()
            .map(|(i, s)| {
                s.as_str().map(String::from).ok_or_else(|| {
                    ApiError::bad_at(format!("stop_sequences[{i}]"), format!("`stop_sequences[{i}]` must be a string"))
                })
            })
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(ApiError::bad_at("stop_sequences", "`stop_sequences` must be an array of strings")),
    };
    if !stops.is_empty() {
        out.insert("stop".into(), json!(stops));
    }
    for k in ["speculative", "forced_tokens"] {
        if let Some(x) = o.get(k).filter(|v| !v.is_null()) {
            out.insert(k.into(), x.clone());
        }
    }
    if let Some(m) = o.get("metadata").filter(|v| !v.is_null()) {
        let mo = m.as_object().ok_or_else(|| ApiError::bad_at("metadata", "`metadata` must be an object"))?;
        known_keys(mo, &["user_id"], "metadata")?;
        opt_str(mo, "user_id", "metadata")?;
    }
    // Extended thinking: a reasoning budget for a model whose template opens the block
    // (`{"type": "enabled", "budget_tokens": N}`); "disabled" closes it at once.
    if let Some(t) = o.get("thinking").filter(|v| !v.is_null()) {
        let to = t.as_object().ok_or_else(|| ApiError::bad_at("thinking", "`thinking` must be an object"))?;
        known_keys(to, &["type", "budget_tokens"], "thinking")?;
        match to.get("type").and_then(Value::as_str) {
            Some("enabled") => {
                let b = to.get("budget_tokens").and_then(Value::as_u64).ok_or_else(|| {
                    ApiError::bad_at("thinking.budget_tokens", "`thinking.budget_tokens` must be an integer >= 0")
                })?;
                out.insert("reasoning_budget".into(), json!(b));
            }
            Some("disabled") => {
                out.insert("reasoning_budget".into(), json!(0));
            }
            other => {
                return Err(ApiError::bad_at(
                    "thinking.type",
                    format!("`thinking.type` = {other:?} is not \"enabled\" or \"disabled\""),
                ))
            }
        }
    }
    let mut messages: Vec<Value> = vec![];
    match o.get("system").filter(|v| !v.is_null()) {
        None => {}
        Some(Value::String(s)) => messages.push(json!({"role": "system", "content": s})),
        Some(Value::Array(blocks)) => {
            let mut text = String::new();
            for (i, b) in blocks.iter().enumerate() {
                let at = format!("system[{i}]");
                let bo = b
                    .as_object()
                    .ok_or_else(|| ApiError::bad_at(at.clone(), format!("`{at}` must be a text block")))?;
                known_keys(bo, &["type", "text", "cache_control", "citations"], &at)?;
                if bo.get("type").and_then(Value::as_str) != Some("text") {
                    return Err(ApiError::bad_at(format!("{at}.type"), format!("`{at}.type` must be \"text\"")));
                }
                text.push_str(opt_str(bo, "text", &at)?.unwrap_or_default());
            }
            messages.push(json!({"role": "system", "content": text}));
        }
        Some(_) => return Err(ApiError::bad_at("system", "`system` must be a string or an array of text blocks")),
    }
    let list = o
        .get("messages")
        .and_then(Value::as_array)
        .filter(|l| !l.is_empty())
        .ok_or_else(|| ApiError::bad_at("messages", "`messages` must be a non-empty array"))?;
    for (i, m) in list.iter().enumerate() {
        translate_message(m, &format!("messages[{i}]"), &mut messages)?;
    }
    out.insert("messages".into(), Value::Array(messages));
    if let Some(tools) = o.get("tools").filter(|v| !v.is_null()) {
        let tools = tools.as_array().ok_or_else(|| ApiError::bad_at("tools", "`tools` must be an array"))?;
        let mut t = vec![];
        for (i, tool) in tools.iter().enumerate() {
            let at = format!("tools[{i}]");
            let to =
                tool.as_object().ok_or_else(|| ApiError::bad_at(at.clone(), format!("`{at}` must be an object")))?;
            known_keys(to, &["name", "description", "input_schema", "type", "cache_control"], &at)?;
            if let Some(kind) = opt_str(to, "type", &at)? {
                if kind != "custom" {
                    return Err(ApiError::bad_at(
                        format!("{at}.type"),
                        format!("`{at}.type` = {kind:?}: only client tools (`custom`) run here, not Anthropic's server tools"),
                    ));
                }
            }
            let name = opt_str(to, "name", &at)?
                .ok_or_else(|| ApiError::bad_at(format!("{at}.name"), format!("`{at}.name` is required")))?;
            let mut f = json!({"name": name, "parameters": to.get("input_schema").cloned().unwrap_or(json!({"type": "object"}))});
            if let Some(d) = opt_str(to, "description", &at)? {
                f["description"] = json!(d);
            }
            t.push(json!({"type": "function", "function": f}));
        }
        out.insert("tools".into(), Value::Array(t));
    }
    if let Some(c) = o.get("tool_choice").filter(|v| !v.is_null()) {
        let co = c
            .as_object()
            .ok_or_else(|| ApiError::bad_at("tool_choice", "`tool_choice` must be an object with a `type`"))?;
        known_keys(co, &["type", "name", "disable_parallel_tool_use"], "tool_choice")?;
        let choice = match opt_str(co, "type", "tool_choice")? {
            Some("auto") => json!("auto"),
            Some("any") => json!("required"),
            Some("none") => json!("none"),
            Some("tool") => {
                let name = opt_str(co, "name", "tool_choice")?.ok_or_else(|| {
                    ApiError::bad_at("tool_choice.name", "`tool_choice.name` is required with type \"tool\"")
                })?;
                json!({"type": "function", "function": {"name": name}})
            }
            other => {
                return Err(ApiError::bad_at(
                    "tool_choice.type",
                    format!("`tool_choice.type` = {other:?}: expected auto, any, tool or none"),
                ))
            }
        };
        out.insert("tool_choice".into(), choice);
        if typed_field(co, "disable_parallel_tool_use", "tool_choice", "a boolean", Value::as_bool)? == Some(true) {
            out.insert("parallel_tool_calls".into(), json!(false));
        }
    }
    if stream {
        out.insert("stream".into(), json!(true));
    }
    Ok((Value::Object(out), stream, stops))
}

/// One Messages message as chat completions messages (its `tool_result` blocks become `tool`
/// messages, in order, before the rest of a user turn).
fn translate_message(m: &Value, at: &str, out: &mut Vec<Value>) -> Result<(), ApiError> {
    let mo = m.as_object().ok_or_else(|| ApiError::bad_at(at, format!("`{at}` must be an object")))?;
    known_keys(mo, &["role", "content"], at)?;
    let role = match opt_str(mo, "role", at)? {
        Some(r @ ("user" | "assistant")) => r,
        other => {
            return Err(ApiError::bad_at(
                format!("{at}.role"),
                format!("`{at}.role` = {other:?}: expected user or assistant"),
            ))
        }
    };
    let blocks = match mo.get("content") {
        Some(Value::String(s)) => {
            out.push(json!({"role": role, "content": s}));
            return Ok(());
        }
        Some(Value::Array(b)) => b,
        _ => {
            return Err(ApiError::bad_at(
                format!("{at}.content"),
                format!("`{at}.content` must be a string or an array of blocks"),
            ))
        }
    };
    let (mut parts, mut calls, mut reasoning) = (vec![], vec![], String::new());
    for (j, b) in blocks.iter().enumerate() {
        let at = format!("{at}.content[{j}]");
        let bo = b.as_object().ok_or_else(|| ApiError::bad_at(at.clone(), format!("`{at}` must be a block object")))?;
        let kind = opt_str(bo, "type", &at)?.unwrap_or_default();
        match (kind, role) {
            ("text", _) => {
                known_keys(bo, &["type", "text", "cache_control", "citations"], &at)?;
                let t = opt_str(bo, "text", &at)?
                    .ok_or_else(|| ApiError::bad_at(format!("{at}.text"), format!("`{at}.text` must be a string")))?;
                parts.push(json!({"type": "text", "text": t}));
            }
            ("image", "user") => {
                known_keys(bo, &["type", "source", "cache_control"], &at)?;
                let src_at = format!("{at}.source");
                let so = bo
                    .get("source")
                    .and_then(Value::as_object)
                    .ok_or_else(|| ApiError::bad_at(src_at.clone(), format!("`{src_at}` must be an object")))?;
                let url = match opt_str(so, "type", &src_at)? {
                    Some("base64") => {
                        known_keys(so, &["type", "media_type", "data"], &src_at)?;
                        let mt = opt_str(so, "media_type", &src_at)?.unwrap_or("image/png");
                        let data = opt_str(so, "data", &src_at)?.ok_or_else(|| {
                            ApiError::bad_at(format!("{src_at}.data"), format!("`{src_at}.data` must be a base64 string"))
                        })?;
                        format!("data:{mt};base64,{data}")
                    }
                    Some("url") => {
                        known_keys(so, &["type", "url"], &src_at)?;
                        opt_str(so, "url", &src_at)?
                            .ok_or_else(|| ApiError::bad_at(format!("{src_at}.url"), format!("`{src_at}.url` must be a string")))?
                            .to_string()
                    }
                    other => {
                        return Err(ApiError::bad_at(
                            format!("{src_at}.type"),
                            format!("`{src_at}.type` = {other:?}: expected base64 or url"),
                        ))
                    }
                };
                parts.push(json!({"type": "image_url", "image_url": {"url": url}}));
            }
            ("tool_use", "assistant") => {
                known_keys(bo, &["type", "id", "name", "input", "cache_control"], &at)?;
                let name = opt_str(bo, "name", &at)?
                    .ok_or_else(|| ApiError::bad_at(format!("{at}.name"), format!("`{at}.name` must be a string")))?;
                let id = opt_str(bo, "id", &at)?.unwrap_or_default();
                let input = bo.get("input").cloned().unwrap_or(json!({}));
                calls.push(json!({"id": id, "type": "function", "function": {"name": name, "arguments": input.to_string()}}));
            }
            ("tool_result", "user") => {
                known_keys(bo, &["type", "tool_use_id", "content", "is_error", "cache_control"], &at)?;
                let id = opt_str(bo, "tool_use_id", &at)?.ok_or_else(|| {
                    ApiError::bad_at(format!("{at}.tool_use_id"), format!("`{at}.tool_use_id` must be a string"))
                })?;
                typed_field(bo, "is_error", &at, "a boolean", Value::as_bool)?;
                let text = match bo.get("content") {
                    None | Some(Value::Null) => String::new(),
                    Some(Value::String(s)) => s.clone(),
                    Some(Value::Array(items)) => {
                        let mut t = String::new();
                        for (k, it) in items.iter().enumerate() {
                            let iat = format!("{at}.content[{k}]");
                            let io = it.as_object().filter(|io| io.get("type").and_then(Value::as_str) == Some("text"));
                            let io = io.ok_or_else(|| {
                                ApiError::bad_at(iat.clone(), format!("`{iat}`: a tool result's content here is text blocks"))
                            })?;
                            known_keys(io, &["type", "text", "cache_control", "citations"], &iat)?;
                            t.push_str(opt_str(io, "text", &iat)?.unwrap_or_default());
                        }
                        t
                    }
                    Some(_) => {
                        return Err(ApiError::bad_at(format!("{at}.content"), format!("`{at}.content` must be a string or text blocks")))
                    }
                };
                out.push(json!({"role": "tool", "tool_call_id": id, "content": text}));
            }
            ("thinking", "assistant") => {
                known_keys(bo, &["type", "thinking", "signature"], &at)?;
                reasoning.push_str(opt_str(bo, "thinking", &at)?.unwrap_or_default());
            }
            ("redacted_thinking", "assistant") => {}
            (k, r) => {
                return Err(ApiError::bad_at(
                    format!("{at}.type"),
                    format!("`{at}.type` = {k:?} is not a block a {r} message takes here (text, image, tool_use, tool_result, thinking)"),
                ))
            }
        }
    }
    if parts.is_empty() && calls.is_empty() && reasoning.is_empty() {
        return Ok(());
    }
    let mut msg = json!({"role": role, "content": parts});
    if !calls.is_empty() {
        msg["tool_calls"] = Value::Array(calls);
    }
    if !reasoning.is_empty() {
        msg["reasoning_content"] = json!(reasoning);
    }
    out.push(msg);
    Ok(())
}

async fn count(app: &Arc<App>, body: &[u8]) -> Result<Response, ApiError> {
    if app.engine.pooled().is_some() {
        return Err(crate::pooling::wrong_kind(app, "a chat model (`/v1/messages/count_tokens`)"));
    }
    let (chat, _, _) = translate(body, true)?;
    let bytes = serde_json::to_vec(&chat).map_err(|e| ApiError::bad(e.to_string()))?;
    let parsed = tokio::task::block_in_place(|| parse(app, typed(&bytes)?))?;
    let engine = app.engine.clone();
    let n = tokio::task::spawn_blocking(move || engine.count_tokens(&parsed.req))
        .await
        .map_err(|_| engine_stopped())?
        .map_err(|e| ApiError::from_engine(&e))?;
    Ok(axum::Json(json!({"input_tokens": n})).into_response())
}

async fn handle(app: &Arc<App>, body: Bytes) -> Result<Response, ApiError> {
    let started = Instant::now();
    if app.engine.pooled().is_some() {
        return Err(crate::pooling::wrong_kind(app, "a chat model (`/v1/messages`)"));
    }
    let (chat, stream, stops) = translate(&body, false)?;
    let bytes = serde_json::to_vec(&chat).map_err(|e| ApiError::bad(e.to_string()))?;
    let parsed = tokio::task::block_in_place(|| parse(app, typed(&bytes)?))?;
    let (tx, mut rx) = mpsc::channel::<Msg>(RELAY_MESSAGES);
    submit(
        app,
        Job {
            req: parsed.req,
            n: 1,
            one_call: parsed.one_call,
            format_field: parsed.format_field,
            tx,
            queued: Instant::now(),
        },
    )?;
    let id = format!("msg_{:016x}", app.next_id.fetch_add(1, Ordering::Relaxed));
    let first = rx.recv().await.ok_or_else(engine_stopped)?;
    let answer = Answer { app: app.clone(), id, stops, started };
    if !stream {
        let mut msg = first;
        loop {
            if let Msg::Done(done) = msg {
                let all = done?;
                log_answer("/v1/messages", &all, started);
                return Ok(axum::Json(answer.whole(&all[0])).into_response());
            }
            msg = rx.recv().await.ok_or_else(engine_stopped)?;
        }
    }
    if let Msg::Done(Err(e)) = first {
        return Err(e);
    }
    let (lines, out) = mpsc::channel::<(&'static str, Value)>(64);
    tokio::spawn(answer.relay(first, rx, lines));
    let events = futures_util::stream::unfold(out, |mut out| async move {
        let (name, data) = out.recv().await?;
        Some((Ok::<_, std::convert::Infallible>(Event::default().event(name).data(data.to_string())), out))
    });
    Ok(Sse::new(events)
        .keep_alive(axum::response::sse::KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response())
}

/// A Messages answer in the making.
struct Answer {
    app: Arc<App>,
    /// `msg_...`.
    id: String,
    /// The request's stop sequences (the one that ended an answer is named in it).
    stops: Vec<String>,
    started: Instant,
}

impl Answer {
    /// `stop_reason` and `stop_sequence` of a completion.
    fn stop(&self, c: &Completion) -> (&'static str, Value) {
        match c.finish {
            Finish::Length | Finish::ContextFull => ("max_tokens", Value::Null),
            Finish::ToolCalls => ("tool_use", Value::Null),
            Finish::Cancelled | Finish::Stop => {
                let eos = c.token_ids.last().is_some_and(|t| self.app.engine.eos_token_ids().contains(t));
                if eos || self.stops.is_empty() {
                    return ("end_turn", Value::Null);
                }
                // A stop sequence ended it: the one the generated tokens hold past the answer.
                let all = self.app.engine.family().tokenizer().decode(&c.token_ids, false).unwrap_or_default();
                let tail = all.rfind(c.text.as_str()).map_or(all.as_str(), |p| &all[p + c.text.len()..]);
                match self.stops.iter().find(|s| tail.contains(s.as_str())).or(self.stops.first()) {
                    Some(s) => ("stop_sequence", json!(s)),
                    None => ("end_turn", Value::Null),
                }
            }
        }
    }

    fn usage(c: &Completion) -> Value {
        json!({"input_tokens": c.prompt_tokens - c.cached_tokens.min(c.prompt_tokens), "output_tokens": c.token_ids.len(),
               "cache_read_input_tokens": c.cached_tokens, "cache_creation_input_tokens": 0})
    }

    /// The tool_use blocks of a completion (`input`: the arguments as JSON).
    fn tool_uses(&self, c: &Completion) -> Vec<Value> {
        c.tool_calls
            .iter()
            .enumerate()
            .map(|(i, call)| {
                let input = serde_json::from_str::<Value>(&call.arguments).unwrap_or_else(|_| json!({}));
                json!({"type": "tool_use", "id": format!("toolu_{}_{i}", self.id.trim_start_matches("msg_")),
                       "name": call.name, "input": input})
            })
            .collect()
    }

    fn whole(&self, c: &Completion) -> Value {
        let mut content = vec![];
        if let Some(r) = &c.reasoning {
            content.push(json!({"type": "thinking", "thinking": r, "signature": ""}));
        }
        if !c.text.trim().is_empty() || (c.tool_calls.is_empty() && content.is_empty()) {
            content.push(json!({"type": "text", "text": c.text}));
        }
        content.extend(self.tool_uses(c));
        let (reason, seq) = self.stop(c);
        json!({"id": self.id, "type": "message", "role": "assistant", "model": self.app.config.id,
               "content": content, "stop_reason": reason, "stop_sequence": seq, "usage": Self::usage(c)})
    }

    /// The stream's events: message_start, each block's start, deltas and stop (thinking, then
    /// text, then each tool_use with its input as one JSON delta), message_delta, message_stop.
    async fn relay(self, first: Msg, mut rx: mpsc::Receiver<Msg>, lines: mpsc::Sender<(&'static str, Value)>) {
        let start = json!({"type": "message_start", "message": {"id": self.id, "type": "message", "role": "assistant",
            "model": self.app.config.id, "content": [], "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": 0, "output_tokens": 0}}});
        if lines.send(("message_start", start)).await.is_err() {
            return;
        }
        // The open block: (index, is thinking).
        let mut open: Option<(usize, bool)> = None;
        let mut next = 0usize;
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
                Msg::Text { text, reasoning, .. } => {
                    if open.is_some_and(|(_, t)| t != reasoning) {
                        let (i, _) = open.take().expect("open");
                        if lines
                            .send(("content_block_stop", json!({"type": "content_block_stop", "index": i})))
                            .await
                            .is_err()
                        {
                            return;
                        }
                    }
                    if open.is_none() {
                        let block = if reasoning {
                            json!({"type": "thinking", "thinking": "", "signature": ""})
                        } else {
                            json!({"type": "text", "text": ""})
                        };
                        let ev = json!({"type": "content_block_start", "index": next, "content_block": block});
                        if lines.send(("content_block_start", ev)).await.is_err() {
                            return;
                        }
                        open = Some((next, reasoning));
                        next += 1;
                    }
                    let (i, _) = open.expect("open");
                    let delta = if reasoning {
                        json!({"type": "thinking_delta", "thinking": text})
                    } else {
                        json!({"type": "text_delta", "text": text})
                    };
                    let ev = json!({"type": "content_block_delta", "index": i, "delta": delta});
                    if lines.send(("content_block_delta", ev)).await.is_err() {
                        return;
                    }
                }
                Msg::Done(Ok(all)) => {
                    let c = &all[0];
                    log_answer("/v1/messages", &all, self.started);
                    if let Some((i, _)) = open.take() {
                        let _ =
                            lines.send(("content_block_stop", json!({"type": "content_block_stop", "index": i}))).await;
                    }
                    for block in self.tool_uses(c) {
                        let input = block["input"].to_string();
                        let mut empty = block.clone();
                        empty["input"] = json!({});
                        let _ = lines
                            .send((
                                "content_block_start",
                                json!({"type": "content_block_start", "index": next, "content_block": empty}),
                            ))
                            .await;
                        let delta = json!({"type": "input_json_delta", "partial_json": input});
                        let _ = lines
                            .send((
                                "content_block_delta",
                                json!({"type": "content_block_delta", "index": next, "delta": delta}),
                            ))
                            .await;
                        let _ = lines
                            .send(("content_block_stop", json!({"type": "content_block_stop", "index": next})))
                            .await;
                        next += 1;
                    }
                    let (reason, seq) = self.stop(c);
                    let delta = json!({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
                                       "usage": Self::usage(c)});
                    let _ = lines.send(("message_delta", delta)).await;
                    let _ = lines.send(("message_stop", json!({"type": "message_stop"}))).await;
                    return;
                }
                Msg::Done(Err(e)) => {
                    let kind =
                        if e.status() == StatusCode::SERVICE_UNAVAILABLE { "overloaded_error" } else { "api_error" };
                    let _ = lines
                        .send(("error", json!({"type": "error", "error": {"type": kind, "message": e.message()}})))
                        .await;
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_messages_body_becomes_a_chat_body() {
        let body = json!({
        "model": "m", "max_tokens": 16, "system": [{"type": "text", "text": "Be brief."}],
        "stop_sequences": ["END"], "top_k": 5,
        "tools": [{"name": "get_weather", "description": "d", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": true},
        "messages": [
            {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
                                         {"type": "text", "text": "Weather?"}]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Bern"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]},
        ]});
        let (chat, stream, stops) = translate(body.to_string().as_bytes(), false).unwrap();
        assert!(!stream);
        assert_eq!(stops, ["END"]);
        assert_eq!(chat["messages"][0], json!({"role": "system", "content": "Be brief."}));
        assert_eq!(chat["messages"][1]["content"][0]["image_url"]["url"], "data:image/png;base64,AAAA");
        assert_eq!(chat["messages"][2]["tool_calls"][0]["function"]["arguments"], r#"{"city":"Bern"}"#);
        assert_eq!(chat["messages"][3], json!({"role": "tool", "tool_call_id": "t1", "content": "sunny"}));
        assert_eq!((&chat["tool_choice"], &chat["parallel_tool_calls"]), (&json!("required"), &json!(false)));
        assert_eq!(chat["tools"][0]["function"]["parameters"], json!({"type": "object"}));
    }

    #[test]
    fn bad_fields_are_named() {
        let cases = [
            (json!({"messages": [{"role": "user", "content": "hi"}]}), "max_tokens"),
            (json!({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "frequency": 1}), "frequency"),
            (json!({"max_tokens": 4, "messages": [{"role": "system", "content": "hi"}]}), "messages[0].role"),
            (
                json!({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "tool_use"}]}]}),
                "messages[0].content[0].type",
            ),
            (
                json!({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "some"}}),
                "tool_choice.type",
            ),
            (
                json!({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "thinking": {"type": "enabled"}}),
                "thinking.budget_tokens",
            ),
            (
                json!({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "thinking": {"type": "on", "budget_tokens": 9}}),
                "thinking.type",
            ),
        ];
        for (body, param) in cases {
            let e = translate(body.to_string().as_bytes(), false).unwrap_err();
            assert_eq!(e.param(), Some(param), "{body}: {}", e.message());
        }
        // count_tokens needs no max_tokens.
        assert!(
            translate(json!({"messages": [{"role": "user", "content": "hi"}]}).to_string().as_bytes(), true).is_ok()
        );
    }
}
