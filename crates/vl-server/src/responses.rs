//! OpenAI's Responses API, `POST /v1/responses`, without stored state: a request is made into the
//! chat completions request it stands for (so it gets the same checks, sampling, constraints and
//! tools), and its answer is shaped as a `response` object or, streamed, as the API's typed
//! events. `previous_response_id`, `conversation`, `store: true` and `background: true` ask for
//! state this server does not keep and are refused; so are built-in tools (web search, file
//! search, ...) and the fields the table in docs/serving.md lists as refused.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Map, Value};
use tokio::sync::mpsc;
use vl_models::engine::{Completion, Finish};

use crate::error::ApiError;
use crate::request::{known_keys, opt_str, parse, typed, typed_field, Parsed};
use crate::router::{App, Msg};

/// Top-level fields passed on to the chat request under the same name (sampling extensions
/// vLLM's Responses API also takes).
const PASSED: [&str; 10] = [
    "seed",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "stop",
    "logit_bias",
    "chat_template_kwargs",
    "grounding",
];

/// What the response object echoes of its request.
pub(crate) struct Echo {
    fields: Map<String, Value>,
    /// The request's function tools in the Responses shape, echoed as sent.
    tools: Vec<Value>,
    /// The reasoning block's closing token (counts the answer's reasoning tokens).
    close: Option<u32>,
}

/// The body made into a chat completions request and parsed with its checks.
pub(crate) fn parse_responses(app: &App, body: &[u8]) -> Result<(Parsed, Echo), ApiError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| ApiError::bad(format!("malformed JSON body: {e}")))?;
    let Some(o) = v.as_object() else { return Err(ApiError::bad("the body must be a JSON object")) };
    let mut chat = Map::new();
    let mut fields = Map::new();
    for (k, x) in o {
        let set = !x.is_null();
        match k.as_str() {
            "model"
            | "temperature"
            | "top_p"
            | "stream"
            | "user"
            | "metadata"
            | "parallel_tool_calls"
            | "service_tier" => {
                chat.insert(k.clone(), x.clone());
            }
            "input" | "instructions" | "tools" | "tool_choice" | "text" | "max_output_tokens" => {}
            k if PASSED.contains(&k) => {
                chat.insert(k.into(), x.clone());
            }
            // Accepted and ignored: they cannot change the answer (typed all the same).
            "prompt_cache_key" | "safety_identifier" | "prompt_cache_retention" => {
                opt_str(o, k, "")?;
            }
            "stream_options" => {
                if let Some(so) = typed_field(o, k, "", "an object", Value::as_object)? {
                    known_keys(so, &["include_obfuscation"], k)?;
                    typed_field(so, "include_obfuscation", k, "a boolean", Value::as_bool)?;
                }
            }
            "store" if typed_field(o, k, "", "a boolean", Value::as_bool)? == Some(true) => {
                return Err(ApiError::bad_at("store", "`store`: this server keeps no responses; send `store: false`"))
            }
            "store" => {}
            "background" if typed_field(o, k, "", "a boolean", Value::as_bool)? == Some(true) => {
                return Err(ApiError::bad_at("background", "`background` responses are not supported"))
            }
            "background" => {}
            "truncation" => match opt_str(o, k, "")? {
                None | Some("disabled") => {}
                Some(t) => {
                    return Err(ApiError::bad_at(
                        "truncation",
                        format!("`truncation` = {t:?}: only \"disabled\" (a prompt over the context is refused)"),
                    ))
                }
            },
            "previous_response_id" | "conversation" if set => {
                return Err(ApiError::bad(format!(
                    "`{k}`: this server keeps no state; send the whole conversation as `input`"
                )))
            }
            "include" if typed_field(o, k, "", "a list", Value::as_array)?.is_some_and(|a| !a.is_empty()) => {
                return Err(ApiError::bad_at("include", format!("`include` = {x} is not supported")))
            }
            "top_logprobs" if typed_field(o, k, "", "an integer in 0..=20", Value::as_u64)?.is_some_and(|n| n > 0) => {
                return Err(ApiError::bad_at(
                    "top_logprobs",
                    "`top_logprobs` is not supported on /v1/responses (use /v1/chat/completions)",
                ))
            }
            "previous_response_id" | "conversation" | "include" | "top_logprobs" => {}
            "reasoning" | "max_tool_calls" | "prompt" | "context_management" if set => {
                return Err(ApiError::bad(format!("`{k}` is not supported by this server")))
            }
            "reasoning" | "max_tool_calls" | "prompt" | "context_management" => {}
            other => return Err(ApiError::bad_at(other, format!("unknown field `{other}`"))),
        }
        if set && !matches!(k.as_str(), "input" | "stream" | "stream_options" | "store") {
            fields.insert(k.clone(), x.clone());
        }
    }
    if let Some(m) = o.get("max_output_tokens").filter(|m| !m.is_null()) {
        chat.insert("max_completion_tokens".into(), m.clone());
    }
    if let Some(t) = o.get("text").filter(|t| !t.is_null()) {
        if let Some(f) = text_format(t)? {
            chat.insert("response_format".into(), f);
        }
    }
    let tools = match o.get("tools") {
        None | Some(Value::Null) => vec![],
        Some(Value::Array(a)) => a.clone(),
        Some(_) => return Err(ApiError::bad("`tools` must be a list")),
    };
    if !tools.is_empty() {
        chat.insert(
            "tools".into(),
            Value::Array(tools.iter().enumerate().map(|(i, t)| tool(i, t)).collect::<Result<_, _>>()?),
        );
    }
    if let Some(c) = o.get("tool_choice").filter(|c| !c.is_null()) {
        chat.insert("tool_choice".into(), tool_choice(c)?);
    }
    let (messages, paths) = messages(o.get("instructions"), o.get("input"))?;
    chat.insert("messages".into(), Value::Array(messages));
    let body = Value::Object(chat).to_string();
    let renamed = |e: ApiError| e.map_message(|m| rename_paths(m, &paths));
    let parsed = parse(app, typed(body.as_bytes()).map_err(renamed)?).map_err(renamed)?;
    let close = app.engine.family().reasoning().map(|m| m.close_id);
    Ok((parsed, Echo { fields, tools, close }))
}

/// `text.format` as a chat `response_format`: `{"type": "text" | "json_object"}` or `{"type":
/// "json_schema", "name", "schema", "strict", "description"}` (the schema's fields flat).
fn text_format(t: &Value) -> Result<Option<Value>, ApiError> {
    let Some(o) = t.as_object() else { return Err(ApiError::bad("`text` must be an object with a `format`")) };
    if let Some(k) = o.keys().find(|k| !["format", "verbosity"].contains(&k.as_str())) {
        return Err(ApiError::bad(format!("`text.{k}` is not a known field")));
    }
    if o.get("verbosity").is_some_and(|v| !v.is_null()) {
        return Err(ApiError::bad("`text.verbosity` is not supported"));
    }
    let Some(f) = o.get("format").filter(|f| !f.is_null()) else { return Ok(None) };
    let Some(fo) = f.as_object() else { return Err(ApiError::bad("`text.format` must be an object with a `type`")) };
    match fo.get("type").and_then(Value::as_str) {
        Some("text") | Some("json_object") => {
            if let Some(k) = fo.keys().find(|k| *k != "type") {
                return Err(ApiError::bad(format!("`text.format.{k}` is not a known field")));
            }
            Ok(Some(f.clone()))
        }
        Some("json_schema") => {
            known_keys(fo, &["type", "name", "schema", "strict", "description"], "text.format")?;
            let mut js = fo.clone();
            js.remove("type");
            Ok(Some(json!({"type": "json_schema", "json_schema": js})))
        }
        _ => Err(ApiError::bad("`text.format.type` must be \"text\", \"json_object\" or \"json_schema\"")),
    }
}

/// A Responses function tool (`{"type": "function", "name", "description", "parameters",
/// "strict"}`) as a chat tool; other tool types are refused.
fn tool(i: usize, t: &Value) -> Result<Value, ApiError> {
    let kind = t.get("type").and_then(Value::as_str).unwrap_or_default();
    if kind != "function" {
        return Err(ApiError::bad(format!(
            "`tools[{i}]`: only function tools are supported (got type {:?})",
            t.get("type").unwrap_or(&Value::Null)
        )));
    }
    let o = t.as_object().expect("has a type");
    let at = format!("tools[{i}]");
    known_keys(o, &["type", "name", "description", "parameters", "strict"], &at)?;
    opt_str(o, "description", &at)?;
    typed_field(o, "strict", &at, "a boolean", Value::as_bool)?;
    let mut f = o.clone();
    f.remove("type");
    f.remove("strict");
    Ok(json!({"type": "function", "function": f}))
}

fn tool_choice(c: &Value) -> Result<Value, ApiError> {
    match c {
        Value::String(_) => Ok(c.clone()),
        Value::Object(o) if o.get("type").and_then(Value::as_str) == Some("function") => {
            known_keys(o, &["type", "name"], "tool_choice")?;
            let name = o
                .get("name")
                .and_then(Value::as_str)
                .ok_or_else(|| ApiError::bad("`tool_choice.name` must be a string"))?;
            Ok(json!({"type": "function", "function": {"name": name}}))
        }
        _ => Err(ApiError::bad(format!(
            "`tool_choice` = {c}: must be \"auto\", \"none\", \"required\" or {{\"type\": \"function\", \"name\": ...}}"
        ))),
    }
}

/// `instructions` and `input` as chat messages, with the request path each came from.
fn messages(instructions: Option<&Value>, input: Option<&Value>) -> Result<(Vec<Value>, Vec<String>), ApiError> {
    let mut out: Vec<Value> = vec![];
    let mut paths: Vec<String> = vec![];
    match instructions {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => {
            out.push(json!({"role": "system", "content": s}));
            paths.push("instructions".into());
        }
        Some(_) => return Err(ApiError::bad("`instructions` must be a string")),
    }
    let items = match input {
        None | Some(Value::Null) => return Err(ApiError::bad("`input` is required")),
        Some(Value::String(s)) => {
            out.push(json!({"role": "user", "content": s}));
            paths.push("input".into());
            return Ok((out, paths));
        }
        Some(Value::Array(a)) => a,
        Some(_) => return Err(ApiError::bad("`input` must be a string or a list of items")),
    };
    // A reasoning item goes with the assistant turn that follows it.
    let mut reasoning: Option<String> = None;
    for (i, item) in items.iter().enumerate() {
        let at = format!("input[{i}]");
        let Some(o) = item.as_object() else { return Err(ApiError::bad(format!("`{at}` must be an object"))) };
        let kind = o.get("type").and_then(Value::as_str).unwrap_or("message");
        match kind {
            "message" => {
                known_keys(o, &["type", "role", "content", "id", "status"], &at)?;
                item_strings(o, &["id", "status"], &at)?;
                let role = opt_str(o, "role", &at)?.unwrap_or_default();
                let content = match o.get("content") {
                    Some(Value::String(s)) => json!(s),
                    Some(Value::Array(parts)) => Value::Array(
                        parts
                            .iter()
                            .enumerate()
                            .map(|(j, p)| content_part(p, &format!("{at}.content[{j}]")))
                            .collect::<Result<_, _>>()?,
                    ),
                    _ => return Err(ApiError::bad(format!("`{at}.content` must be a string or a list of parts"))),
                };
                let mut m = json!({"role": role, "content": content});
                if role == "assistant" {
                    if let Some(r) = reasoning.take() {
                        m["reasoning_content"] = json!(r);
                    }
                }
                out.push(m);
                paths.push(at);
            }
            "function_call" => {
                known_keys(o, &["type", "id", "call_id", "name", "arguments", "status"], &at)?;
                item_strings(o, &["id", "call_id", "arguments", "status"], &at)?;
                let name = o
                    .get("name")
                    .and_then(Value::as_str)
                    .ok_or_else(|| ApiError::bad(format!("`{at}.name` must be a string")))?;
                let arguments = o.get("arguments").and_then(Value::as_str).unwrap_or("{}");
                let call = json!({"type": "function", "function": {"name": name, "arguments": arguments}});
                // Calls of one turn join the assistant message right before them.
                let joins = out.last().is_some_and(|m| m["role"] == "assistant") && reasoning.is_none();
                if joins {
                    let last = out.last_mut().expect("checked");
                    match last["tool_calls"].as_array_mut() {
                        Some(calls) => calls.push(call),
                        None => last["tool_calls"] = json!([call]),
                    }
                } else {
                    let mut m = json!({"role": "assistant", "content": null, "tool_calls": [call]});
                    if let Some(r) = reasoning.take() {
                        m["reasoning_content"] = json!(r);
                    }
                    out.push(m);
                    paths.push(at);
                }
            }
            "function_call_output" => {
                known_keys(o, &["type", "id", "call_id", "output", "status"], &at)?;
                item_strings(o, &["id", "call_id", "status"], &at)?;
                let output = match o.get("output") {
                    Some(Value::String(s)) => s.clone(),
                    Some(Value::Array(parts)) => {
                        parts.iter().filter_map(|p| p.get("text").and_then(Value::as_str)).collect()
                    }
                    _ => return Err(ApiError::bad(format!("`{at}.output` must be a string"))),
                };
                let id = o.get("call_id").cloned().unwrap_or(Value::Null);
                out.push(json!({"role": "tool", "content": output, "tool_call_id": id}));
                paths.push(at);
            }
            "reasoning" => {
                known_keys(o, &["type", "id", "summary", "content", "encrypted_content", "status"], &at)?;
                item_strings(o, &["id", "status"], &at)?;
                if o.get("encrypted_content").is_some_and(|e| !e.is_null()) {
                    return Err(ApiError::bad_at(
                        format!("{at}.encrypted_content"),
                        format!("`{at}.encrypted_content`: this server cannot read encrypted reasoning; send its text"),
                    ));
                }
                for list in ["summary", "content"] {
                    let Some(parts) = typed_field(o, list, &at, "a list", Value::as_array)? else { continue };
                    for (j, p) in parts.iter().enumerate() {
                        let pat = format!("{at}.{list}[{j}]");
                        let po = p
                            .as_object()
                            .ok_or_else(|| ApiError::bad_at(pat.clone(), format!("`{pat}` must be an object")))?;
                        known_keys(po, &["type", "text"], &pat)?;
                        item_strings(po, &["type", "text"], &pat)?;
                    }
                }
                let text: String = o
                    .get("content")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                    .chain(o.get("summary").and_then(Value::as_array).into_iter().flatten())
                    .filter_map(|p| p.get("text").and_then(Value::as_str))
                    .collect::<Vec<_>>()
                    .join("\n");
                reasoning = Some(text);
            }
            other => {
                return Err(ApiError::bad(format!(
                    "`{at}.type` = {other:?}: expected message, function_call, function_call_output or reasoning"
                )))
            }
        }
    }
    if out.iter().all(|m| m["role"] == "system") {
        return Err(ApiError::bad("`input` has no message"));
    }
    Ok((out, paths))
}

/// Refuses a field of `names` present in `o` (at `at`) that is not a string.
fn item_strings(o: &Map<String, Value>, names: &[&str], at: &str) -> Result<(), ApiError> {
    for name in names {
        opt_str(o, name, at)?;
    }
    Ok(())
}

/// An input content part as a chat part: `input_text` / `output_text` as text, `input_image`
/// (`image_url`: a data URL, an http(s) URL or an allowed path; `detail`) as an image. Unknown
/// fields are refused with their path.
fn content_part(p: &Value, at: &str) -> Result<Value, ApiError> {
    let Some(o) = p.as_object() else { return Err(ApiError::bad_at(at, format!("`{at}` must be an object"))) };
    let known: &[&str] = match o.get("type").and_then(Value::as_str) {
        Some("input_text") => &["type", "text"],
        Some("output_text") => &["type", "text", "annotations", "logprobs"],
        Some("input_image") => &["type", "image_url", "file_id", "detail"],
        _ => &[],
    };
    if !known.is_empty() {
        known_keys(o, known, at)?;
    }
    match p.get("type").and_then(Value::as_str) {
        Some("input_text") | Some("output_text") => {
            let t = p
                .get("text")
                .and_then(Value::as_str)
                .ok_or_else(|| ApiError::bad(format!("`{at}.text` must be a string")))?;
            Ok(json!({"type": "text", "text": t}))
        }
        Some("input_image") => {
            if p.get("file_id").is_some_and(|f| !f.is_null()) {
                return Err(ApiError::bad(format!("`{at}.file_id`: this server has no files; send `image_url`")));
            }
            let url = p
                .get("image_url")
                .and_then(Value::as_str)
                .ok_or_else(|| ApiError::bad(format!("`{at}.image_url` must be a string")))?;
            let mut image = json!({"url": url});
            match o.get("detail").filter(|d| !d.is_null()) {
                None => {}
                Some(d) if ["low", "high", "auto"].iter().any(|x| d == x) => image["detail"] = d.clone(),
                Some(d) => {
                    return Err(ApiError::bad_at(
                        format!("{at}.detail"),
                        format!("`{at}.detail` = {d}: expected \"low\", \"high\" or \"auto\""),
                    ))
                }
            }
            Ok(json!({"type": "image_url", "image_url": image}))
        }
        Some(other) => {
            Err(ApiError::bad(format!("`{at}.type` = {other:?}: expected input_text, input_image or output_text")))
        }
        None => Err(ApiError::bad(format!("`{at}.type` is required"))),
    }
}

/// A chat error's `messages[K]` paths named as the Responses request has them.
fn rename_paths(m: &str, paths: &[String]) -> String {
    let mut s = m.to_string();
    for (k, p) in paths.iter().enumerate().rev() {
        for end in ['.', '`', ']'] {
            s = s.replace(&format!("messages[{k}]{end}"), &format!("{p}{end}"));
        }
    }
    s.replace("max_completion_tokens", "max_output_tokens")
        .replace("`max_tokens`", "`max_output_tokens`")
        // `text.format`'s schema fields are flat where the chat request nests them.
        .replace("`response_format.json_schema.", "`text.format.")
        .replace("`response_format.json_schema`", "`text.format`")
        .replace("`response_format", "`text.format")
}

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
        "store": false,
        "truncation": "disabled",
        "usage": null,
        "metadata": {},
    });
    for (k, v) in &echo.fields {
        if !["tools", "model"].contains(&k.as_str()) {
            r[k] = v.clone();
        }
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

fn reasoning_item(id: &str, text: &str, status: &str) -> Value {
    json!({"type": "reasoning", "id": id, "status": status, "summary": [],
           "content": [{"type": "reasoning_text", "text": text}]})
}

fn message_item(id: &str, text: &str, status: &str) -> Value {
    let content = if status == "in_progress" {
        json!([])
    } else {
        json!([{"type": "output_text", "text": text, "annotations": [], "logprobs": []}])
    };
    json!({"type": "message", "id": id, "status": status, "role": "assistant", "content": content})
}

fn call_item(ids: &Ids, i: usize, name: &str, arguments: &str, status: &str) -> Value {
    json!({"type": "function_call", "id": ids.item("fc", i), "call_id": format!("call_{}_{i}", ids.n),
           "name": name, "arguments": arguments, "status": status})
}

/// Every output item of a finished answer.
fn output(ids: &Ids, c: &Completion) -> Vec<Value> {
    let mut items = vec![];
    if let Some(r) = &c.reasoning {
        items.push(reasoning_item(&ids.item("rs", 0), r, "completed"));
    }
    // A message unless the answer is only calls or only reasoning (one that is neither has an
    // empty message).
    if !c.text.is_empty() || (c.tool_calls.is_empty() && c.reasoning.is_none()) {
        items.push(message_item(&ids.item("msg", 0), &c.text, status_of(c)));
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
    let ids = Ids { response: format!("resp_{n}"), n };
    let created = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let stopped = || {
        ApiError::with(
            axum::http::StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            "internal_error",
            "the engine stopped",
        )
    };
    if !stream {
        let mut msg = first;
        loop {
            if let Msg::Done(done) = msg {
                let all = done?;
                crate::router::log_answer("/v1/responses", &all, started);
                let c = &all[0];
                let r = response(&app, &ids, &echo, created, status_of(c), output(&ids, c), Some(c));
                return Ok(axum::Json(r).into_response());
            }
            msg = rx.recv().await.ok_or_else(stopped)?;
        }
    }
    if let Msg::Done(Err(e)) = first {
        return Err(e);
    }
    let (lines, out) = mpsc::channel::<(String, String)>(64);
    tokio::spawn(async move {
        let mut events = Events { lines, seq: 0 };
        let start = response(&app, &ids, &echo, created, "in_progress", vec![], None);
        if !events.send("response.created", json!({"response": start.clone()})).await
            || !events.send("response.in_progress", json!({"response": start})).await
        {
            return;
        }
        // The open item: (output index, id, is reasoning, text so far).
        let mut open: Option<(usize, String, bool, String)> = None;
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
                Msg::Text(_, t, reasoning, _) => {
                    if open.as_ref().is_some_and(|o| o.2 != reasoning) {
                        let o = open.take().expect("checked");
                        if !events.close(&mut items, o, "completed").await {
                            return;
                        }
                    }
                    if open.is_none() {
                        let index = items.len();
                        let id = ids.item(if reasoning { "rs" } else { "msg" }, 0);
                        let item = if reasoning {
                            reasoning_item(&id, "", "in_progress")
                        } else {
                            message_item(&id, "", "in_progress")
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
                        open = Some((index, id, reasoning, String::new()));
                    }
                    let o = open.as_mut().expect("opened");
                    o.3.push_str(&t);
                    let kind = if reasoning { "response.reasoning_text.delta" } else { "response.output_text.delta" };
                    let mut e = json!({"item_id": o.1, "output_index": o.0, "content_index": 0, "delta": t});
                    if !reasoning {
                        e["logprobs"] = json!([]);
                    }
                    if !events.send(kind, e).await {
                        return;
                    }
                }
                Msg::Done(Ok(all)) => {
                    crate::router::log_answer("/v1/responses", &all, started);
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
                        let item = message_item(&ids.item("msg", 0), "", status_of(c));
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
                    let r = response(&app, &ids, &echo, created, status, items, Some(c));
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
        let (kind, data) = out.recv().await?;
        Some((Ok::<_, std::convert::Infallible>(Event::default().event(kind).data(data)), out))
    });
    Ok(Sse::new(stream)
        .keep_alive(axum::response::sse::KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response())
}

/// The stream's typed events, numbered.
struct Events {
    lines: mpsc::Sender<(String, String)>,
    seq: u64,
}

impl Events {
    /// Sends one event; false when the client has gone.
    async fn send(&mut self, kind: &str, mut body: Value) -> bool {
        body["type"] = json!(kind);
        body["sequence_number"] = json!(self.seq);
        self.seq += 1;
        self.lines.send((kind.to_string(), body.to_string())).await.is_ok()
    }

    /// Closes the open item: its text's `done` event, then the item's.
    async fn close(
        &mut self,
        items: &mut [Value],
        (index, id, reasoning, text): (usize, String, bool, String),
        status: &str,
    ) -> bool {
        let (item, ok) = if reasoning {
            let e = json!({"item_id": id, "output_index": index, "content_index": 0, "text": text});
            (reasoning_item(&id, &text, "completed"), self.send("response.reasoning_text.done", e).await)
        } else {
            let e = json!({"item_id": id, "output_index": index, "content_index": 0, "text": text, "logprobs": []});
            let part = json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []});
            let p = json!({"item_id": id, "output_index": index, "content_index": 0, "part": part});
            let ok =
                self.send("response.output_text.done", e).await && self.send("response.content_part.done", p).await;
            (message_item(&id, &text, status), ok)
        };
        items[index] = item.clone();
        ok && self.send("response.output_item.done", json!({"output_index": index, "item": item})).await
    }
}
