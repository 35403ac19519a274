//! A chat completions body made into an engine request: the typed body (`openai`), its values
//! checked against their ranges, the server's defaults applied, and the messages' parts read
//! (`media`).

use axum::http::StatusCode;
use serde_json::Value;
use vl_models::engine::{ChatMessage, Constraint, Part, Request, ToolCall};

use crate::error::ApiError;
use crate::fields::{known_keys, opt_str, typed_field};
use crate::media::part;
use crate::openai::{ChatCompletionRequest, Content, ToolCallIn};
use crate::state::App;

/// Most functions a request may offer (each is rendered into the prompt).
const MAX_TOOLS: usize = 128;
/// Most stop strings (OpenAI allows 4; vLLM and llama-server more) and their length in bytes.
const MAX_STOPS: usize = 16;
const MAX_STOP_BYTES: usize = 256;
/// Most images and videos in one request.
const MAX_MEDIA: usize = 64;
/// Most `logit_bias` entries (OpenAI's limit is 300).
const MAX_LOGIT_BIAS: usize = 300;
/// Largest `chat_template_kwargs`, in bytes of its JSON text.
const MAX_TEMPLATE_KWARGS_BYTES: usize = 64 << 10;

/// A parsed request and how its answer is sent.
pub(crate) struct Parsed {
    pub req: Request,
    /// Answers asked for (`n`, 1..=`MAX_CHOICES`).
    pub n: usize,
    pub stream: bool,
    pub include_usage: bool,
    /// `parallel_tool_calls: false`: an answer keeps its first call only (`keep_one_call`).
    pub one_call: bool,
    /// The field that set the answer's format (`structured_outputs.regex`, `grammar`, ...): the
    /// engine's errors about the format name it.
    pub format_field: Option<String>,
}

/// With `parallel_tool_calls: false`, each answer's calls cut to the first (a constrained answer
/// makes exactly one already; an unconstrained one may have written more).
pub(crate) fn keep_one_call(all: &mut [vl_models::engine::Completion]) {
    for c in all {
        c.tool_calls.truncate(1);
    }
}

/// Whether a request asks for boxes or points: `grounding` when the client says, else a guess
/// from the users' text and the response format's schema.
fn is_grounding(asked: Option<bool>, messages: &[vl_models::engine::ChatMessage], format: Option<&Value>) -> bool {
    if let Some(g) = asked {
        return g;
    }
    let users = messages.iter().filter(|m| m.role == "user").flat_map(|m| &m.parts).any(|p| match p {
        Part::Text(t) => vl_models::grounding::looks_like_grounding(t),
        _ => false,
    });
    users || format.is_some_and(|f| vl_models::grounding::looks_like_grounding(&f.to_string()))
}

/// A grounding request's images sized to at least the family's grounding minimum, where the
/// client set no `min_pixels` and no `max_pixels` below it.
fn grounding_minimum(app: &App, messages: &mut [vl_models::engine::ChatMessage]) {
    let Some(g) = app.engine.family().grounding() else { return };
    for p in messages.iter_mut().flat_map(|m| m.parts.iter_mut()) {
        if let Part::Image { min_pixels: min @ None, max_pixels, .. } = p {
            if max_pixels.is_none_or(|m| m >= g.min_pixels) {
                *min = Some(g.min_pixels);
            }
        }
    }
}

/// The body as JSON, typed: a malformed body, a field of the wrong type (named with its path) or
/// an unknown field is a 400.
pub(crate) fn typed(body: &[u8]) -> Result<ChatCompletionRequest, ApiError> {
    if serde_json::from_slice::<serde::de::IgnoredAny>(body).is_err() {
        let e = serde_json::from_slice::<Value>(body).err().map_or_else(String::new, |e| e.to_string());
        return Err(ApiError::bad(format!("malformed JSON body: {e}")));
    }
    let de = &mut serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner().to_string();
        let inner = inner.split(" at line ").next().unwrap_or(&inner).to_string();
        if path == "." {
            ApiError::bad(format!("the body: {inner}"))
        } else {
            ApiError::bad_at(path.clone(), format!("`{path}`: {inner}"))
        }
    })
}

/// With `--strict-model-name`, a `model` the server does not serve is a 404.
pub(crate) fn check_model_name(app: &App, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(m) if app.config.strict_model_name && !app.config.names(m) => Err(ApiError::with(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "model_not_found",
            format!(
                "the model `{}` does not exist; this server serves `{}` (--strict-model-name)",
                crate::guard::escape_log(m),
                app.config.id
            ),
        )),
        _ => Ok(()),
    }
}

pub(crate) fn parse(app: &App, v: ChatCompletionRequest) -> Result<Parsed, ApiError> {
    check_model_name(app, v.model.as_deref())?;
    if let Some(message) = v.check_supported() {
        return Err(ApiError::bad(message));
    }
    let (mut constraint, format_field) = match crate::formats::format_constraint(&v)? {
        Some((c, field)) => (Some(c), Some(field)),
        None => (None, None),
    };
    let mut tools = v.tools.unwrap_or_default();
    if tools.len() > MAX_TOOLS {
        return Err(ApiError::bad(format!("`tools`: {} functions, at most {MAX_TOOLS}", tools.len())));
    }
    for (i, t) in tools.iter().enumerate() {
        if t.get("type").and_then(Value::as_str) != Some("function")
            || t.get("function").and_then(|f| f.get("name")).and_then(Value::as_str).is_none()
        {
            return Err(ApiError::bad_at(
                format!("tools[{i}]"),
                format!("`tools[{i}]` must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"),
            ));
        }
        tool_fields(t, &format!("tools[{i}]"))?;
    }
    let format = v.response_format.clone();
    let grounding = v.grounding;
    let one_call = v.parallel_tool_calls == Some(false);
    match &v.tool_choice {
        None | Some(Value::Null) => {}
        Some(Value::String(c)) if c == "auto" => {}
        // The model is not told about the functions.
        Some(Value::String(c)) if c == "none" => tools.clear(),
        // A required call wins over a JSON `response_format` (as OpenAI's does; instructor's
        // tools modes send both): the answer is the call.
        Some(c) => constraint = Some(tool_choice(c, &tools, one_call)?),
    }
    let logit_bias = logit_bias(v.logit_bias.as_ref(), app.engine.family().vocab_size())?;
    let template_kwargs = template_kwargs(v.chat_template_kwargs.as_ref())?;
    let most = vl_models::engine::MAX_CHOICES as u64;
    let n = match v.n {
        None => 1,
        Some(n) if (1..=most).contains(&n) => n as usize,
        Some(n) => return Err(ApiError::bad(format!("`n` = {n} must be in 1..={most}"))),
    };
    let stream = v.stream.unwrap_or(false);
    let include_usage = v.stream_options.as_ref().and_then(|o| o.include_usage).unwrap_or(false);

    let context = app.context;
    let mut o = app.config.defaults.clone();
    match v.max_completion_tokens.or(v.max_tokens) {
        Some(0) => {
            let name = if v.max_completion_tokens.is_some() { "max_completion_tokens" } else { "max_tokens" };
            return Err(ApiError::bad(format!("`{name}` must be at least 1")));
        }
        Some(m) => o.max_new_tokens = m.min(context as u64) as usize,
        // The rest of the context: the engine's KV cache grows with the answer, not with this.
        None => o.max_new_tokens = context,
    }
    if let Some(t) = v.temperature {
        if !(0.0..=2.0).contains(&t) {
            return Err(ApiError::bad(format!("`temperature` = {t} must be in [0, 2]")));
        }
        o.temperature = t;
    }
    if let Some(p) = v.top_p {
        o.top_p = p;
    }
    if let Some(k) = v.top_k {
        o.top_k = match k {
            -1 => 0,
            k if k >= 0 => k as usize,
            _ => return Err(ApiError::bad(format!("`top_k` must be an integer >= 0 (or -1), got {k}"))),
        };
    }
    if let Some(p) = v.min_p {
        o.min_p = p;
    }
    if let Some(p) = v.presence_penalty {
        o.presence_penalty = p;
    }
    if let Some(p) = v.frequency_penalty {
        o.frequency_penalty = p;
    }
    if let Some(p) = v.repetition_penalty {
        o.repetition_penalty = p;
    }
    if let Some(n) = v.top_n_sigma {
        o.top_n_sigma = n;
    }
    if let Some(p) = v.xtc_probability {
        o.xtc_probability = p;
    }
    if let Some(t) = v.xtc_threshold {
        o.xtc_threshold = t;
    }
    if let Some(m) = v.dry_multiplier {
        o.dry_multiplier = m;
    }
    if let Some(b) = v.dry_base {
        o.dry_base = b;
    }
    if let Some(n) = v.dry_allowed_length {
        o.dry_allowed_length = usize::try_from(n).unwrap_or(usize::MAX);
    }
    if let Some(n) = v.dry_penalty_last_n {
        o.dry_penalty_last_n = n;
    }
    if let Some(b) = v.dry_sequence_breakers {
        o.dry_sequence_breakers = b;
    }
    if let Some(m) = v.mirostat {
        o.mirostat = u8::try_from(m)
            .ok()
            .filter(|&m| m <= 2)
            .ok_or_else(|| ApiError::bad_at("mirostat", format!("`mirostat` = {m} must be 0 (off), 1 or 2")))?;
    }
    if let Some(t) = v.mirostat_tau {
        o.mirostat_tau = t;
    }
    if let Some(e) = v.mirostat_eta {
        o.mirostat_eta = e;
    }
    if o.mirostat != 0 {
        // Mirostat cuts the candidates itself: a truncation sampler the client set is refused
        // (by `validate`, naming it), the server's defaults for them are dropped.
        if v.top_k.is_none_or(|k| k == -1) {
            o.top_k = 0;
        }
        if v.top_p.is_none() {
            o.top_p = 1.0;
        }
        if v.min_p.is_none() {
            o.min_p = 0.0;
        }
        if v.top_n_sigma.is_none() {
            o.top_n_sigma = 0.0;
        }
        if v.xtc_probability.is_none() {
            o.xtc_probability = 0.0;
        }
    }
    if let Some(s) = &v.seed {
        o.seed = s.value();
    }
    o.logit_bias = logit_bias;
    o.ignore_eos = v.ignore_eos.unwrap_or(false);
    if let Some(s) = &v.speculative {
        o.speculative = crate::fields::speculative(s, &o.speculative)?;
    }
    if let Some(f) = v.forced_tokens {
        o.forced_tokens = f;
    }
    if let Some(b) = reasoning_budget(v.reasoning_effort.as_deref(), v.reasoning_budget)? {
        o.reasoning_budget = Some(b);
    }
    let most = vl_models::sampling::MAX_TOP_LOGPROBS as u64;
    match (v.logprobs, v.top_logprobs) {
        (_, Some(n)) if n > most => {
            return Err(ApiError::bad(format!("`top_logprobs` = {n} must be in 0..={most}")));
        }
        (Some(true), n) => o.logprobs = Some(n.unwrap_or(0) as usize),
        (_, Some(n)) if n > 0 => return Err(ApiError::bad("`top_logprobs` needs `logprobs: true`")),
        _ => {}
    }
    o.validate().map_err(|e| ApiError::from_engine(&e))?;
    let stop = v.stop.map(|s| s.into_vec()).unwrap_or_default();
    let include_stop = v.include_stop_str_in_output.unwrap_or(false) || v.no_stop_trim.unwrap_or(false);
    if stop.len() > MAX_STOPS || stop.iter().any(|s| s.is_empty() || s.len() > MAX_STOP_BYTES) {
        return Err(ApiError::bad(format!(
            "`stop`: at most {MAX_STOPS} non-empty strings of at most {MAX_STOP_BYTES} bytes"
        )));
    }

    if v.messages.is_empty() {
        return Err(ApiError::bad("`messages` must not be empty"));
    }
    let mut messages = Vec::with_capacity(v.messages.len());
    // Media of one request: at most MAX_MEDIA parts, and their bytes (data URLs, local files,
    // remote fetches) at most --max-body-bytes together, checked as each is read.
    let (mut media, mut media_bytes) = (0usize, 0usize);
    let budget = app.config.max_body_bytes;
    for (i, m) in v.messages.into_iter().enumerate() {
        let role = match m.role.as_str() {
            "system" | "user" | "assistant" | "tool" => m.role.as_str(),
            "developer" => "system",
            other => return Err(ApiError::bad(format!("`messages[{i}].role` = {other:?} is not a known role"))),
        };
        // What a client echoes back from a response: accepted when empty.
        for (name, x) in [
            ("refusal", &m.refusal),
            ("annotations", &m.annotations),
            ("audio", &m.audio),
            ("function_call", &m.function_call),
        ] {
            let empty = |x: &Value| match x {
                Value::Null => true,
                Value::String(s) => s.is_empty(),
                Value::Array(a) => a.is_empty(),
                _ => false,
            };
            if x.as_ref().is_some_and(|x| !empty(x)) {
                return Err(ApiError::bad_at(
                    format!("messages[{i}].{name}"),
                    format!("`messages[{i}].{name}` is not supported (only an empty one, as a client echoes back)"),
                ));
            }
        }
        let tool_calls = match m.tool_calls {
            None => vec![],
            Some(calls) if role == "assistant" => calls
                .iter()
                .enumerate()
                .map(|(j, c)| tool_call(c, &format!("messages[{i}].tool_calls[{j}]")))
                .collect::<Result<_, _>>()?,
            Some(_) => {
                return Err(ApiError::bad(format!("`messages[{i}].tool_calls` must be a list on an assistant message")))
            }
        };
        let parts: Vec<Part> = match m.content {
            None if role == "assistant" => vec![],
            None => return Err(ApiError::bad(format!("`messages[{i}].content` is required"))),
            Some(Content::Text(s)) => vec![Part::Text(s)],
            Some(Content::Parts(items)) => {
                let mut parts = Vec::with_capacity(items.len());
                for (j, p) in items.iter().enumerate() {
                    let at = format!("messages[{i}].content[{j}]");
                    let part = part(app, p, &at)?;
                    match &part {
                        Part::Text(_) => {}
                        Part::Image { data, .. } => {
                            media += 1;
                            media_bytes += data.len();
                        }
                        Part::Video { source, .. } => {
                            media += 1;
                            if let vl_models::engine::VideoData::Bytes(b) = source {
                                media_bytes += b.len();
                            }
                        }
                    }
                    if media > MAX_MEDIA {
                        return Err(ApiError::bad(format!(
                            "`{at}`: more than {MAX_MEDIA} images and videos in one request"
                        )));
                    }
                    if media_bytes > budget {
                        return Err(ApiError::with(
                            StatusCode::PAYLOAD_TOO_LARGE,
                            "invalid_request_error",
                            "media_too_large",
                            format!(
                                "`{at}`: the request's images and videos are over {budget} bytes together (--max-body-bytes)"
                            ),
                        ));
                    }
                    parts.push(part);
                }
                parts
            }
        };
        if m.reasoning_content.is_some() && role != "assistant" {
            return Err(ApiError::bad(format!("`messages[{i}].reasoning_content` goes on an assistant message")));
        }
        let mut msg = ChatMessage::new(role, parts);
        msg.tool_calls = tool_calls;
        msg.reasoning = m.reasoning_content;
        messages.push(msg);
    }
    if is_grounding(grounding, &messages, format.as_ref()) {
        grounding_minimum(app, &mut messages);
    }
    Ok(Parsed {
        req: Request { messages, options: o, stop, include_stop, tools, constraint, prompt: None, template_kwargs },
        n,
        stream,
        include_usage,
        one_call,
        format_field,
    })
}

/// A function tool's fields: `type`, `function` (`name`, `description`, `parameters`, `strict`)
/// and nothing else; `description` a string, `strict` a boolean.
fn tool_fields(t: &Value, at: &str) -> Result<(), ApiError> {
    let o = t.as_object().expect("checked: has a type");
    known_keys(o, &["type", "function"], at)?;
    let Some(f) = o.get("function").and_then(Value::as_object) else {
        return Err(ApiError::bad_at(format!("{at}.function"), format!("`{at}.function` must be an object")));
    };
    let at = format!("{at}.function");
    known_keys(f, &["name", "description", "parameters", "strict"], &at)?;
    opt_str(f, "description", &at)?;
    typed_field(f, "strict", &at, "a boolean", Value::as_bool)?;
    Ok(())
}

/// A `tool_choice` that requires a call: `"required"` (one or more calls of the listed
/// functions; exactly one with `one`, `parallel_tool_calls: false`) or `{"type": "function",
/// "function": {"name"}}` (one call of that function).
fn tool_choice(c: &Value, tools: &[Value], one: bool) -> Result<Constraint, ApiError> {
    let function = |i: usize| -> Result<(String, Value), ApiError> {
        let f = &tools[i]["function"];
        let at = format!("tools[{i}].function.parameters");
        let name = f["name"].as_str().unwrap_or_default().to_string();
        let params = match f.get("parameters") {
            // No parameters: a function of none (OpenAI: "omitting parameters defines a
            // function with an empty parameter list").
            None | Some(Value::Null) => {
                serde_json::json!({"type": "object", "properties": {}, "additionalProperties": false})
            }
            Some(p @ Value::Object(_)) => p.clone(),
            Some(_) => return Err(ApiError::bad(format!("`{at}` (function {name:?}) must be a JSON schema"))),
        };
        crate::formats::schema_within_limit(&params, &format!("`{at}` (function {name:?})"))?;
        Ok((name, params))
    };
    if tools.is_empty() {
        return Err(ApiError::bad(format!("`tool_choice` = {c} needs `tools`")));
    }
    match c {
        Value::String(s) if s == "required" => {
            Ok(Constraint::ToolCalls { functions: (0..tools.len()).map(function).collect::<Result<_, _>>()?, one })
        }
        Value::Object(o) if o.get("type").and_then(Value::as_str) == Some("function") => {
            known_keys(o, &["type", "function"], "tool_choice")?;
            if let Some(f) = o.get("function").and_then(Value::as_object) {
                known_keys(f, &["name"], "tool_choice.function")?;
            }
            let Some(name) = o.get("function").and_then(|f| f.get("name")).and_then(Value::as_str) else {
                return Err(ApiError::bad_at("tool_choice.function.name", "`tool_choice.function.name` must be a string"));
            };
            let Some(i) = tools.iter().position(|t| t["function"]["name"].as_str() == Some(name)) else {
                return Err(ApiError::bad(format!(
                    "`tool_choice.function.name` names the function {name:?}, which `tools` does not list"
                )));
            };
            Ok(Constraint::ToolCalls { functions: vec![function(i)?], one: true })
        }
        _ => Err(ApiError::bad(format!(
            "`tool_choice` = {c}: must be \"auto\", \"none\", \"required\" or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"
        ))),
    }
}

/// `chat_template_kwargs`: an object of variables for the chat template, at most
/// `MAX_TEMPLATE_KWARGS_BYTES`, none of the names the request sets itself.
fn template_kwargs(k: Option<&Value>) -> Result<serde_json::Map<String, Value>, ApiError> {
    let Some(k) = k.filter(|k| !k.is_null()) else { return Ok(Default::default()) };
    let Some(o) = k.as_object() else {
        return Err(ApiError::bad("`chat_template_kwargs` must be an object of template variables"));
    };
    let size = k.to_string().len();
    if size > MAX_TEMPLATE_KWARGS_BYTES {
        return Err(ApiError::bad(format!(
            "`chat_template_kwargs` is {size} bytes, over the limit of {MAX_TEMPLATE_KWARGS_BYTES}"
        )));
    }
    if let Some(r) = o.keys().find(|r| vl_models::template::RESERVED_TEMPLATE_VARIABLES.contains(&r.as_str())) {
        return Err(ApiError::bad(format!(
            "`chat_template_kwargs.{r}`: set by the request itself, not by template arguments"
        )));
    }
    Ok(o.clone())
}

/// `logit_bias`: token ids to a bias in [-100, 100]. A key is a token id written canonically
/// (`0` or `[1-9][0-9]*`, below the vocabulary's size): `"+7"`, `"07"` or `" 7"` are refused
/// rather than read as 7, so no two keys can name one token and stack past the bound.
fn logit_bias(b: Option<&Value>, vocab: usize) -> Result<Vec<(u32, f32)>, ApiError> {
    let Some(b) = b.filter(|b| !b.is_null()) else { return Ok(vec![]) };
    let Some(o) = b.as_object() else {
        return Err(ApiError::bad_at("logit_bias", "`logit_bias` must be an object of token ids to numbers"));
    };
    if o.len() > MAX_LOGIT_BIAS {
        return Err(ApiError::bad_at(
            "logit_bias",
            format!("`logit_bias`: {} entries, at most {MAX_LOGIT_BIAS}", o.len()),
        ));
    }
    o.iter()
        .map(|(k, v)| {
            let t = token_id(k).filter(|&t| (t as usize) < vocab).ok_or_else(|| {
                ApiError::bad_at(
                    "logit_bias",
                    format!(
                        "`logit_bias`: the key {k:?} is not a token id: a decimal integer without sign, spaces or \
                         leading zeros, below the vocabulary's {vocab}"
                    ),
                )
            })?;
            let x = v.as_f64().filter(|x| (-100.0..=100.0).contains(x)).ok_or_else(|| {
                ApiError::bad_at(
                    format!("logit_bias.{k}"),
                    format!("`logit_bias.{k}` = {v} must be a number in [-100, 100]"),
                )
            })?;
            Ok((t, x as f32))
        })
        .collect()
}

/// A token id written canonically: `0`, or a nonzero digit then digits, within u32.
fn token_id(k: &str) -> Option<u32> {
    let b = k.as_bytes();
    let canonical = !b.is_empty() && b.iter().all(u8::is_ascii_digit) && (b[0] != b'0' || b.len() == 1);
    if canonical {
        k.parse().ok()
    } else {
        None
    }
}

/// An assistant message's call (arguments as JSON text, or an object).
fn tool_call(c: &ToolCallIn, at: &str) -> Result<ToolCall, ApiError> {
    if let Some(k) = c.kind.as_deref().filter(|k| *k != "function") {
        return Err(ApiError::bad_at(format!("{at}.type"), format!("`{at}.type` = {k:?}: only \"function\"")));
    }
    let f = c.function.as_ref().ok_or_else(|| ApiError::bad(format!("`{at}.function` is required")))?;
    let name = f.name.as_ref().ok_or_else(|| ApiError::bad(format!("`{at}.function.name` must be a string")))?;
    let arguments = match &f.arguments {
        None | Some(Value::Null) => "{}".to_string(),
        Some(Value::String(s)) => s.clone(),
        Some(a @ Value::Object(_)) => a.to_string(),
        Some(_) => return Err(ApiError::bad(format!("`{at}.function.arguments` must be a JSON string"))),
    };
    Ok(ToolCall { name: name.clone(), arguments })
}

/// A `/v1/completions` body: `prompt` (a string, or a list of one) answered without the chat
/// template, with the chat endpoint's sampling fields and checks, and the legacy integer
/// `logprobs` (alternatives per token). `echo`, `suffix` and `best_of` > 1 are refused by name; a
/// request with `messages` is refused.
pub(crate) fn parse_completion(app: &App, body: &[u8]) -> Result<Parsed, ApiError> {
    let mut v: Value = serde_json::from_slice(body).map_err(|e| ApiError::bad(format!("malformed JSON body: {e}")))?;
    let Some(o) = v.as_object_mut() else { return Err(ApiError::bad("the body must be a JSON object")) };
    let prompt = match o.remove("prompt") {
        Some(Value::String(p)) => p,
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => a[0].as_str().unwrap_or_default().to_string(),
        Some(Value::Array(_)) => {
            return Err(ApiError::bad("`prompt`: one prompt per request (a string, or a list of one string)"))
        }
        Some(_) => return Err(ApiError::bad("`prompt` must be a string")),
        None => return Err(ApiError::bad("`prompt` is required")),
    };
    if prompt.is_empty() {
        return Err(ApiError::bad("`prompt` must not be empty"));
    }
    for (name, refused) in [
        ("echo", o.get("echo").is_some_and(|e| e.as_bool() == Some(true))),
        ("suffix", o.get("suffix").is_some_and(|s| !s.is_null())),
        ("best_of", o.get("best_of").is_some_and(|b| b.as_u64() != Some(1) && !b.is_null())),
        ("messages", o.contains_key("messages")),
        ("tools", o.contains_key("tools")),
        ("tool_choice", o.contains_key("tool_choice")),
        ("chat_template_kwargs", o.contains_key("chat_template_kwargs")),
    ] {
        if refused {
            return Err(ApiError::bad(format!("`{name}` is not supported on /v1/completions")));
        }
    }
    for k in ["echo", "suffix", "best_of"] {
        o.remove(k);
    }
    // The legacy `logprobs`: how many alternatives per token (0 = only the chosen one's).
    match o.remove("logprobs") {
        None | Some(Value::Null) => {}
        Some(l) => {
            let most = vl_models::sampling::MAX_TOP_LOGPROBS as u64;
            let n = l.as_u64().filter(|&n| n <= most).ok_or_else(|| {
                ApiError::bad(format!("`logprobs` = {l} must be an integer in 0..={most} on /v1/completions"))
            })?;
            if o.contains_key("top_logprobs") {
                return Err(ApiError::bad("`top_logprobs` is not a /v1/completions field: `logprobs` takes the count"));
            }
            o.insert("logprobs".into(), Value::Bool(true));
            o.insert("top_logprobs".into(), n.into());
        }
    }
    // The chat endpoint's checks, on a placeholder message.
    o.insert("messages".into(), serde_json::json!([{"role": "user", "content": ""}]));
    let chat = typed(v.to_string().as_bytes())?;
    let mut parsed = parse(app, chat)?;
    parsed.req.messages.clear();
    parsed.req.prompt = Some(prompt);
    Ok(parsed)
}

/// Tokens of reasoning OpenAI's `reasoning_effort` allows (a thinking model's block is closed
/// for it once they are spent): "none" and "minimal" close it at once, "low" 1024, "medium"
/// 4096, "high" 16384 (docs/serving.md). `reasoning_budget` gives the tokens directly (what
/// Anthropic's `thinking.budget_tokens` becomes); both at once are refused.
pub(crate) const REASONING_EFFORT: [(&str, usize); 5] =
    [("none", 0), ("minimal", 0), ("low", 1024), ("medium", 4096), ("high", 16384)];

fn reasoning_budget(effort: Option<&str>, budget: Option<u64>) -> Result<Option<usize>, ApiError> {
    match (effort, budget) {
        (Some(_), Some(_)) => {
            Err(ApiError::bad_at("reasoning_budget", "`reasoning_effort` and `reasoning_budget` both set: give one"))
        }
        (Some(e), None) => match REASONING_EFFORT.iter().find(|(name, _)| *name == e) {
            Some(&(_, tokens)) => Ok(Some(tokens)),
            None => Err(ApiError::bad_at(
                "reasoning_effort",
                format!(
                    "`reasoning_effort` = {e:?} is not one of {}",
                    REASONING_EFFORT.iter().map(|(n, _)| format!("{n:?}")).collect::<Vec<_>>().join(", ")
                ),
            )),
        },
        (None, Some(b)) => Ok(Some(usize::try_from(b).unwrap_or(usize::MAX))),
        (None, None) => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use vl_models::engine::{Completion, Finish};

    #[test]
    fn one_call_keeps_the_first_call_of_each_answer() {
        let call = |name: &str| ToolCall { name: name.into(), arguments: "{}".into() };
        let answer = |calls: Vec<ToolCall>| Completion {
            text: String::new(),
            reasoning: None,
            finish: Finish::ToolCalls,
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
        };
        let mut all = vec![answer(vec![call("a"), call("b"), call("c")]), answer(vec![]), answer(vec![call("d")])];
        keep_one_call(&mut all);
        let names: Vec<Vec<&str>> =
            all.iter().map(|c| c.tool_calls.iter().map(|t| t.name.as_str()).collect()).collect();
        assert_eq!(names, [vec!["a"], vec![], vec!["d"]]);
        assert!(all.iter().all(|c| c.finish == Finish::ToolCalls));
    }
}
