//! A Responses request made into the chat completions request it stands for: its fields passed
//! on, renamed or refused, `input` items made into messages, errors naming the Responses paths.

use serde_json::{json, Map, Value};

use crate::error::ApiError;
use crate::fields::{known_keys, opt_str, typed_field};
use crate::request::{parse, typed, Parsed};
use crate::state::App;

/// Top-level fields passed on to the chat request under the same name (sampling extensions
/// vLLM's Responses API also takes, ours); llama-server's samplers (`openai::LLAMA_SAMPLERS`) and
/// the format fields (`formats::FIELDS`) pass too.
const PASSED: [&str; 13] = [
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
    "reasoning_budget",
    "speculative",
    "forced_tokens",
];
/// What the response object echoes of its request, and what storing it needs.
pub(crate) struct Echo {
    pub(super) fields: Map<String, Value>,
    /// The request's function tools in the Responses shape, echoed as sent.
    pub(super) tools: Vec<Value>,
    /// The reasoning block's closing token (counts the answer's reasoning tokens).
    pub(super) close: Option<u32>,
    /// Keep the answer (`store`, default on when the server keeps responses).
    pub(super) store: bool,
    /// The conversation the answer continues, as chat messages without `instructions` (the
    /// stored previous one's, then this input): stored with the answer.
    pub(super) history: Vec<Value>,
    /// `include: ["reasoning.encrypted_content"]`: reasoning items carry it.
    pub(super) encrypted: bool,
    /// `top_logprobs` or `include: ["message.output_text.logprobs"]`: `output_text` carries the
    /// answer's log-probabilities.
    pub(super) logprobs: bool,
    /// `truncation: "auto"`, and the input messages it dropped.
    pub(super) auto_truncation: bool,
    pub(super) truncated: usize,
}

/// The prefix of the opaque `encrypted_content` this server writes: the reasoning text in
/// base64 (not encrypted: it is the model's own text, round-tripped unchanged).
const REASONING_PREFIX: &str = "vl1.";

/// A reasoning text as the opaque `encrypted_content` of a reasoning item.
pub(super) fn encrypt_reasoning(text: &str) -> String {
    use base64::Engine as _;
    format!("{REASONING_PREFIX}{}", base64::engine::general_purpose::STANDARD.encode(text))
}

/// The text of an `encrypted_content` this server wrote.
fn decrypt_reasoning(e: &str) -> Option<String> {
    use base64::Engine as _;
    let bytes = base64::engine::general_purpose::STANDARD.decode(e.strip_prefix(REASONING_PREFIX)?).ok()?;
    String::from_utf8(bytes).ok()
}

/// A Responses request: the chat request it stands for, parsed, and what its answer echoes.
pub(crate) struct ResponsesRequest {
    pub chat: Parsed,
    pub echo: Echo,
}

/// The body made into a chat completions request and parsed with its checks.
pub(crate) fn parse_responses(app: &App, body: &[u8]) -> Result<ResponsesRequest, ApiError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| ApiError::bad(format!("malformed JSON body: {e}")))?;
    let Some(o) = v.as_object() else { return Err(ApiError::bad("the body must be a JSON object")) };
    let mut chat = Map::new();
    let mut fields = Map::new();
    let mut store = app.responses.enabled();
    let mut previous = None;
    let (mut encrypted, mut auto_truncation, mut logprobs) = (false, false, false);
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
            k if PASSED.contains(&k)
                || crate::openai::LLAMA_SAMPLERS.contains(&k)
                || crate::formats::FIELDS.contains(&k) =>
            {
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
            "store" => {
                let asked = typed_field(o, k, "", "a boolean", Value::as_bool)?;
                if asked == Some(true) && !app.responses.enabled() {
                    return Err(ApiError::bad_at(
                        "store",
                        "`store`: this server keeps no responses (vl serve --responses-store-mib 0); send `store: false`",
                    ));
                }
                store = asked.unwrap_or(app.responses.enabled());
            }
            "background" if typed_field(o, k, "", "a boolean", Value::as_bool)? == Some(true) => {
                return Err(ApiError::bad_at("background", "`background` responses are not supported"))
            }
            "background" => {}
            "truncation" => match opt_str(o, k, "")? {
                None | Some("disabled") => {}
                Some("auto") => auto_truncation = true,
                Some(t) => {
                    return Err(ApiError::bad_at(
                        "truncation",
                        format!("`truncation` = {t:?} is not one of \"auto\", \"disabled\""),
                    ))
                }
            },
            "previous_response_id" => {
                if let Some(id) = opt_str(o, k, "")? {
                    let Some(p) = app.responses.get(id) else {
                        return Err(ApiError::bad(format!(
                            "`previous_response_id`: no stored response `{}` (not stored, evicted past the server's --responses-store-mib, or made before a restart)",
                            crate::guard::escape_log(id)
                        )));
                    };
                    previous = Some(p);
                }
            }
            "conversation" if set => {
                return Err(ApiError::bad(
                    "`conversation`: this server keeps no conversation objects; continue a stored response with `previous_response_id`",
                ))
            }
            "include" => {
                for (i, what) in typed_field(o, k, "", "a list", Value::as_array)?.into_iter().flatten().enumerate() {
                    match what.as_str() {
                        Some("reasoning.encrypted_content") => encrypted = true,
                        Some("message.output_text.logprobs") => logprobs = true,
                        _ => {
                            return Err(ApiError::bad_at(
                                format!("include[{i}]"),
                                format!("`include[{i}]` = {what} is not supported (only \"reasoning.encrypted_content\" and \"message.output_text.logprobs\")"),
                            ))
                        }
                    }
                }
            }
            // Bounds calls of built-in tools, which this server has none of: it cannot change
            // the answer.
            "max_tool_calls" => {
                typed_field(o, k, "", "an integer >= 1", |v| v.as_u64().filter(|&n| n >= 1))?;
            }
            // The answer's log-probabilities (with this many alternatives per token) on its
            // `output_text`, as `include: ["message.output_text.logprobs"]` asks too.
            "top_logprobs" => {
                if let Some(n) = typed_field(o, k, "", "an integer in 0..=20", |v| v.as_u64().filter(|&n| n <= 20))? {
                    chat.insert("top_logprobs".into(), n.into());
                    logprobs = true;
                }
            }
            "conversation" => {}
            // `reasoning.effort`: the reasoning budget chat completions' `reasoning_effort` maps.
            "reasoning" if set => {
                let r = typed_field(o, k, "", "an object", Value::as_object)?.expect("set");
                known_keys(r, &["effort", "summary"], k)?;
                if let Some(summary) = opt_str(r, "summary", k)? {
                    return Err(ApiError::bad_at(
                        "reasoning.summary",
                        format!("`reasoning.summary` = {summary:?}: this server writes no summaries (the reasoning itself is answered)"),
                    ));
                }
                if let Some(e) = opt_str(r, "effort", k)? {
                    if !crate::request::REASONING_EFFORT.iter().any(|(name, _)| *name == e) {
                        let known: Vec<String> =
                            crate::request::REASONING_EFFORT.iter().map(|(n, _)| format!("{n:?}")).collect();
                        return Err(ApiError::bad_at(
                            "reasoning.effort",
                            format!("`reasoning.effort` = {e:?} is not one of {}", known.join(", ")),
                        ));
                    }
                    chat.insert("reasoning_effort".into(), Value::String(e.into()));
                }
            }
            "prompt" | "context_management" if set => {
                return Err(ApiError::bad(format!("`{k}` is not supported by this server")))
            }
            "reasoning" | "prompt" | "context_management" => {}
            other => return Err(ApiError::bad_at(other, format!("unknown field `{other}`"))),
        }
        if set && !matches!(k.as_str(), "input" | "stream" | "stream_options" | "store" | "truncation" | "include") {
            fields.insert(k.clone(), x.clone());
        }
    }
    if logprobs {
        chat.insert("logprobs".into(), Value::Bool(true));
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
    let Messages { messages, paths } = messages(o.get("instructions"), o.get("input"))?;
    // The system message from `instructions` first, then the stored conversation (its own
    // instructions are not carried over, as OpenAI's are not), then this input.
    let system = usize::from(o.get("instructions").is_some_and(|i| !i.is_null()));
    let mut history: Vec<Value> = previous.map(|p| p.messages.clone()).unwrap_or_default();
    let earlier = history.len();
    history.extend(messages[system..].iter().cloned());
    let mut all_paths: Vec<String> = paths[..system].to_vec();
    all_paths.extend(std::iter::repeat_n("previous_response_id".to_string(), earlier));
    all_paths.extend(paths[system..].iter().cloned());
    let mut truncated = 0;
    let parsed = loop {
        let mut chat = chat.clone();
        let kept = &history[truncated..];
        let msgs: Vec<Value> = messages[..system].iter().chain(kept).cloned().collect();
        let mut paths: Vec<String> = all_paths[..system].to_vec();
        paths.extend(all_paths[system + truncated..].iter().cloned());
        chat.insert("messages".into(), Value::Array(msgs));
        let body = Value::Object(chat).to_string();
        let renamed = |e: ApiError| e.map_message(|m| rename_paths(m, &paths));
        let parsed = parse(app, typed(body.as_bytes()).map_err(renamed)?).map_err(renamed)?;
        if !auto_truncation {
            break parsed;
        }
        // `truncation: "auto"`: the oldest turns out until the prompt fits the context with
        // room for one answer token; a turn is a user message and what follows it.
        // (Parsing runs off the runtime's threads: `handlers::parse_for`.)
        let n = match app.engine.count_tokens(&parsed.req) {
            Ok(n) if n < app.context => break parsed,
            Ok(n) => n,
            // Past the context (the count refuses it): as over.
            Err(vl_models::Error::Limit { kind: vl_models::limits::LimitKind::Context, .. }) => app.context,
            Err(e) => return Err(ApiError::from_engine(&e)),
        };
        let next_user = (truncated + 1..history.len()).find(|&i| history[i]["role"] == "user");
        match next_user {
            Some(i) => truncated = i,
            None => {
                return Err(ApiError::bad(format!(
                    "`input`: the last turn alone is at least {n} tokens, over the context of {} (`truncation: \"auto\"` drops only earlier turns)",
                    app.context
                )))
            }
        }
    };
    let close = app.engine.family().reasoning().map(|m| m.close_id);
    let history = history[truncated..].to_vec();
    let echo = Echo { fields, tools, close, store, history, encrypted, logprobs, auto_truncation, truncated };
    Ok(ResponsesRequest { chat: parsed, echo })
}

/// `text.format` as a chat `response_format`: `{"type": "text" | "json_object"}` or `{"type":
/// "json_schema", "name", "schema", "strict", "description"}` (the schema's fields flat).
fn text_format(t: &Value) -> Result<Option<Value>, ApiError> {
    let Some(o) = t.as_object() else { return Err(ApiError::bad("`text` must be an object with a `format`")) };
    if let Some(k) = o.keys().find(|k| !["format", "verbosity"].contains(&k.as_str())) {
        return Err(ApiError::bad(format!("`text.{k}` is not a known field")));
    }
    // `medium` is the default and changes nothing; the others would change the answer.
    match o.get("verbosity").filter(|v| !v.is_null()) {
        None => {}
        Some(v) if v == "medium" => {}
        Some(v) => {
            return Err(ApiError::bad(format!(
                "`text.verbosity` = {v} is not supported: only \"medium\" (this server does not steer length)"
            )))
        }
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

/// `instructions` and `input` as chat messages.
struct Messages {
    messages: Vec<Value>,
    /// The request path each message came from (`input[K]`), for its errors.
    paths: Vec<String>,
}

/// `instructions` and `input` as chat messages, with the request path each came from.
fn messages(instructions: Option<&Value>, input: Option<&Value>) -> Result<Messages, ApiError> {
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
            return Ok(Messages { messages: out, paths });
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
                let sealed = match opt_str(o, "encrypted_content", &at)? {
                    None => None,
                    Some(e) => Some(decrypt_reasoning(e).ok_or_else(|| {
                        ApiError::bad_at(
                            format!("{at}.encrypted_content"),
                            format!("`{at}.encrypted_content` is not reasoning this server wrote; send its text"),
                        )
                    })?),
                };
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
                reasoning = Some(sealed.unwrap_or(text));
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
    Ok(Messages { messages: out, paths })
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
