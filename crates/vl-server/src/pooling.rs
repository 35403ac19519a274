//! The endpoints of a model that pools: `POST /v1/embeddings` (OpenAI's shape, with vLLM's
//! multimodal `messages` and a list-of-parts `input`), `POST /v1/rerank` (Jina / Cohere's shape,
//! as vLLM and llama-server serve it) and `POST /v1/score` (vLLM's). A body is read and checked
//! here, its media fetched under the chat endpoints' rules, and the prompts pooled by the engine
//! on a blocking thread holding one of the requests-in-flight places. A chat model asked for
//! these, or a pooling model asked for chat, is answered 400 naming the model's kind.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use serde_json::{json, Map, Value};
use vl_models::engine::{ChatMessage, Part, PoolOutput, Request};
use vl_models::family::Pooled;

use crate::error::ApiError;
use crate::fields::{known_keys, opt_str, typed_field};
use crate::guard::read_body;
use crate::media::part;
use crate::state::{now, App};

/// Most inputs in one embeddings request (OpenAI's limit), documents in one rerank request, and
/// pairs in one score request.
pub(crate) const MAX_POOL_INPUTS: usize = 2048;
/// Most parts in one input.
const MAX_PARTS: usize = 64;
/// Most images and videos in one request (all its inputs together).
pub(crate) const MAX_POOL_MEDIA: usize = 256;

/// A request's media so far: at most `MAX_POOL_MEDIA` images and videos, and their bytes (data
/// URLs, local files, remote fetches) at most `--max-body-bytes` together, checked as each is
/// read.
#[derive(Default)]
struct Media {
    count: usize,
    bytes: usize,
}

impl Media {
    fn add(&mut self, app: &App, p: &Part, at: &str) -> Result<(), ApiError> {
        let bytes = match p {
            Part::Image { data, .. } => data.len(),
            Part::Video { source: vl_models::engine::VideoData::Bytes(b), .. } => b.len(),
            Part::Video { .. } => 0,
            Part::Text(_) => return Ok(()),
        };
        self.count += 1;
        self.bytes += bytes;
        if self.count > MAX_POOL_MEDIA {
            return Err(ApiError::bad_at(
                at,
                format!("`{at}`: more than {MAX_POOL_MEDIA} images and videos in one request"),
            ));
        }
        let budget = app.config.max_body_bytes;
        if self.bytes > budget {
            return Err(ApiError::with(
                StatusCode::PAYLOAD_TOO_LARGE,
                "invalid_request_error",
                "media_too_large",
                format!("`{at}`: the request's images and videos are over {budget} bytes together (--max-body-bytes)"),
            ));
        }
        Ok(())
    }
}

/// `router` with the pooling routes (and vLLM's unversioned aliases).
pub(crate) fn routes(router: axum::Router<Arc<App>>) -> axum::Router<Arc<App>> {
    use axum::routing::post;
    router
        .route("/v1/embeddings", post(embeddings))
        .route("/v1/rerank", post(rerank))
        .route("/rerank", post(rerank))
        .route("/v1/score", post(score))
        .route("/score", post(score))
}

/// The endpoints a model serves, for `/v1/models`.
pub(crate) fn endpoints(app: &App) -> Vec<&'static str> {
    match app.engine.pooled() {
        None => vec!["/v1/chat/completions", "/v1/completions", "/v1/responses"],
        Some(Pooled::Embedding { .. }) => vec!["/v1/embeddings", "/v1/rerank", "/v1/score"],
        Some(Pooled::Score) => vec!["/v1/rerank", "/v1/score"],
    }
}

/// What the served model is, in words, for refusals.
fn kind_of(app: &App) -> &'static str {
    match app.engine.pooled() {
        None => "a chat model",
        Some(Pooled::Embedding { .. }) => "an embedding model",
        Some(Pooled::Score) => "a reranker",
    }
}

/// 400 naming the served model's kind and the endpoints it serves.
pub(crate) fn wrong_kind(app: &App, asked: &str) -> ApiError {
    ApiError::with(
        StatusCode::BAD_REQUEST,
        "invalid_request_error",
        "wrong_model_kind",
        format!(
            "`model`: {} ({}) is {}, not {asked}; it serves {}",
            app.config.id,
            app.engine.family().name(),
            kind_of(app),
            endpoints(app).join(", ")
        ),
    )
}

async fn embeddings(State(app): State<Arc<App>>, req: axum::extract::Request) -> Response {
    pooling(app, req, Endpoint::Embeddings).await
}
async fn rerank(State(app): State<Arc<App>>, req: axum::extract::Request) -> Response {
    pooling(app, req, Endpoint::Rerank).await
}
async fn score(State(app): State<Arc<App>>, req: axum::extract::Request) -> Response {
    pooling(app, req, Endpoint::Score).await
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Endpoint {
    Embeddings,
    Rerank,
    Score,
}

async fn pooling(app: Arc<App>, req: axum::extract::Request, endpoint: Endpoint) -> Response {
    let resp = match read_body(&app, req).await {
        Ok(body) => handle(&app, &body, endpoint).await.unwrap_or_else(IntoResponse::into_response),
        Err(e) => e.into_response(),
    };
    app.metrics.count(resp.status());
    resp
}

/// A request's place among those in flight, given back when dropped.
struct Place(Arc<App>);

impl Drop for Place {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A place among the requests in flight, or 503 when none is left.
fn take_place(app: &Arc<App>) -> Result<Place, ApiError> {
    if app.in_flight.fetch_add(1, Ordering::SeqCst) >= app.workers {
        app.in_flight.fetch_sub(1, Ordering::SeqCst);
        return Err(ApiError::with(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "overloaded",
            "the server is busy (request queue full); retry later",
        ));
    }
    Ok(Place(app.clone()))
}

/// Pools `reqs` on a blocking thread; an error names the input (`what[i]`) it is about.
async fn pool(app: &Arc<App>, reqs: Vec<Request>, what: &'static str) -> Result<Vec<PoolOutput>, ApiError> {
    let place = take_place(app)?;
    let engine = app.engine.clone();
    let out = tokio::task::spawn_blocking(move || {
        let _place = place;
        engine.pool(&reqs)
    })
    .await
    .map_err(|_| {
        ApiError::with(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            "internal_error",
            "internal error while pooling (a bug; see the server log)",
        )
    })?;
    out.map_err(|e| ApiError::from_engine(&e).map_message(|m| m.replace("inputs[", &format!("{what}["))))
}

/// A pooling body answered as `endpoint` answers it, as JSON (the server's handlers, and
/// embedders through `crate::Chat::pool`).
pub(crate) async fn answer_json(app: &Arc<App>, body: &[u8], endpoint: Endpoint) -> Result<Value, ApiError> {
    let o: Map<String, Value> = match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(o)) => o,
        Ok(_) => return Err(ApiError::bad("the body must be a JSON object")),
        Err(e) => return Err(ApiError::bad(format!("malformed JSON body: {e}"))),
    };
    check_model(app, &o)?;
    match endpoint {
        Endpoint::Embeddings => embed_answer(app, &o).await,
        Endpoint::Rerank => rerank_answer(app, &o).await,
        Endpoint::Score => score_answer(app, &o).await,
    }
}

async fn handle(app: &Arc<App>, body: &[u8], endpoint: Endpoint) -> Result<Response, ApiError> {
    Ok(axum::Json(answer_json(app, body, endpoint).await?).into_response())
}

/// `model`, when given, is a string; with `--strict-model-name` one of the served names.
fn check_model(app: &App, o: &Map<String, Value>) -> Result<(), ApiError> {
    crate::request::check_model_name(app, opt_str(o, "model", "")?)
}

/// The optional `instruction`: the system message of each prompt.
fn instruction(o: &Map<String, Value>) -> Result<Option<String>, ApiError> {
    Ok(opt_str(o, "instruction", "")?.map(String::from))
}

/// One input's parts from a JSON value at `at`: a string (a text), an array of token ids (decoded
/// to text: the prompt is always templated), a part object (`{"type": "text" | "image_url" |
/// "video_url", ...}`, as in chat), or `{"content": [parts]}`.
fn input_parts(app: &App, v: &Value, at: &str, media: &mut Media) -> Result<Vec<Part>, ApiError> {
    let mut read = |p: &Value, at: &str| -> Result<Part, ApiError> {
        let p = part(app, p, at)?;
        media.add(app, &p, at)?;
        Ok(p)
    };
    match v {
        Value::String(s) => Ok(vec![Part::Text(s.clone())]),
        Value::Array(ids) if ids.iter().all(Value::is_u64) && !ids.is_empty() => {
            Ok(vec![Part::Text(decode(app, ids, at)?)])
        }
        Value::Object(o) if o.contains_key("content") => {
            known_keys(o, &["content"], at)?;
            let at = format!("{at}.content");
            match &o["content"] {
                Value::String(s) => Ok(vec![Part::Text(s.clone())]),
                Value::Array(parts) => {
                    if parts.len() > MAX_PARTS {
                        return Err(ApiError::bad_at(
                            at.clone(),
                            format!("`{at}` has {} parts; at most {MAX_PARTS}", parts.len()),
                        ));
                    }
                    parts.iter().enumerate().map(|(i, p)| read(p, &format!("{at}[{i}]"))).collect()
                }
                _ => Err(ApiError::bad_at(at.clone(), format!("`{at}` must be a string or an array of parts"))),
            }
        }
        Value::Object(_) => Ok(vec![read(v, at)?]),
        _ => Err(ApiError::bad_at(
            at,
            format!("`{at}` must be a string, an array of token ids, a part or {{\"content\": [parts]}}"),
        )),
    }
}

/// Token ids as text; an id outside the vocabulary is refused by position.
fn decode(app: &App, ids: &[Value], at: &str) -> Result<String, ApiError> {
    let vocab = app.engine.family().vocab_size() as u64;
    let mut out = Vec::with_capacity(ids.len());
    for (i, id) in ids.iter().enumerate() {
        match id.as_u64() {
            Some(n) if n < vocab => out.push(n as u32),
            _ => {
                return Err(ApiError::bad_at(
                    format!("{at}[{i}]"),
                    format!("`{at}[{i}]` = {id} is not a token id below {vocab}"),
                ))
            }
        }
    }
    app.engine
        .family()
        .tokenizer()
        .decode(&out, false)
        .map_err(|e| ApiError::bad_at(at, format!("`{at}`: the token ids do not decode: {e}")))
}

/// The inputs of an embeddings body: `input` (one or a list) or `messages` (one conversation).
fn embed_inputs(app: &App, o: &Map<String, Value>) -> Result<Vec<Request>, ApiError> {
    let system = instruction(o)?;
    let mut media = Media::default();
    let with_system = |mut messages: Vec<ChatMessage>| {
        if let Some(s) = &system {
            messages.insert(0, ChatMessage::text("system", s));
        }
        Request { messages, ..Default::default() }
    };
    match (o.get("input").filter(|v| !v.is_null()), o.get("messages").filter(|v| !v.is_null())) {
        (Some(_), Some(_)) => Err(ApiError::bad("`messages`: send `input` or `messages`, not both")),
        (None, None) => Err(ApiError::bad_at("input", "`input` is required (or `messages`)")),
        (None, Some(m)) => {
            let Some(list) = m.as_array().filter(|l| !l.is_empty()) else {
                return Err(ApiError::bad_at("messages", "`messages` must be a non-empty array"));
            };
            let mut messages = Vec::with_capacity(list.len());
            for (i, msg) in list.iter().enumerate() {
                let at = format!("messages[{i}]");
                let mo =
                    msg.as_object().ok_or_else(|| ApiError::bad_at(at.clone(), format!("`{at}` must be an object")))?;
                known_keys(mo, &["role", "content"], &at)?;
                let role = opt_str(mo, "role", &at)?.unwrap_or("user");
                if !matches!(role, "system" | "user" | "assistant") {
                    return Err(ApiError::bad_at(
                        format!("{at}.role"),
                        format!("`{at}.role` = {role:?}: expected system, user or assistant"),
                    ));
                }
                let content = mo.get("content").cloned().unwrap_or(Value::Null);
                let parts = input_parts(app, &json!({"content": content}), &at, &mut media)?;
                messages.push(ChatMessage::new(role, parts));
            }
            if system.is_some() && messages.iter().any(|m| m.role == "system") {
                return Err(ApiError::bad_at(
                    "instruction",
                    "`instruction`: the messages have a system message already",
                ));
            }
            Ok(vec![with_system(messages)])
        }
        (Some(input), None) => {
            let items: Vec<&Value> = match input {
                Value::Array(a) if a.is_empty() => return Err(ApiError::bad_at("input", "`input` is empty")),
                // One input of token ids.
                Value::Array(a) if a.iter().all(Value::is_u64) => vec![input],
                Value::Array(a) => a.iter().collect(),
                other => vec![other],
            };
            if items.len() > MAX_POOL_INPUTS {
                return Err(ApiError::bad_at(
                    "input",
                    format!("`input` has {} items; at most {MAX_POOL_INPUTS}", items.len()),
                ));
            }
            let one = !input.is_array() || items.len() == 1 && std::ptr::eq(items[0], input);
            items
                .iter()
                .enumerate()
                .map(|(i, v)| {
                    let at = if one { "input".to_string() } else { format!("input[{i}]") };
                    Ok(with_system(vec![ChatMessage::user(input_parts(app, v, &at, &mut media)?)]))
                })
                .collect()
        }
    }
}

/// A JSON array of floats, or their little-endian f32 bytes in base64 (OpenAI's
/// `encoding_format`).
fn encoded(v: &[f32], base64: bool) -> Value {
    if base64 {
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        Value::String(base64::engine::general_purpose::STANDARD.encode(bytes))
    } else {
        json!(v)
    }
}

fn usage(out: &[PoolOutput]) -> Value {
    let tokens: usize = out.iter().map(|p| p.prompt_tokens).sum();
    let cached: usize = out.iter().map(|p| p.cached_tokens).sum();
    json!({"prompt_tokens": tokens, "total_tokens": tokens, "prompt_tokens_details": {"cached_tokens": cached}})
}

async fn embed_answer(app: &Arc<App>, o: &Map<String, Value>) -> Result<Value, ApiError> {
    let Some(Pooled::Embedding { dims: full }) = app.engine.pooled() else {
        return Err(wrong_kind(app, "an embedding model (`/v1/embeddings`)"));
    };
    known_keys(o, &["model", "input", "messages", "encoding_format", "dimensions", "user", "instruction"], "")?;
    let base64 = match opt_str(o, "encoding_format", "")? {
        None | Some("float") => false,
        Some("base64") => true,
        Some(f) => {
            return Err(ApiError::bad_at(
                "encoding_format",
                format!("`encoding_format` = {f:?}: expected \"float\" or \"base64\""),
            ))
        }
    };
    let dims = typed_field(o, "dimensions", "", "a positive integer", |x| x.as_u64())?;
    if let Some(d) = dims {
        if d == 0 || d as usize > full {
            return Err(ApiError::bad_at(
                "dimensions",
                format!("`dimensions` = {d} is outside 1..={full} (the model's embedding size)"),
            ));
        }
    }
    opt_str(o, "user", "")?;
    let reqs = tokio::task::block_in_place(|| embed_inputs(app, o))?;
    let out = pool(app, reqs, "input").await?;
    app.metrics.prompt_tokens.inc_by(out.iter().map(|p| p.prompt_tokens as u64).sum());
    let mut data = Vec::with_capacity(out.len());
    for (i, p) in out.iter().enumerate() {
        let v = match dims {
            Some(d) => vl_models::engine::truncated(&p.values, d as usize).map_err(|e| ApiError::from_engine(&e))?,
            None => p.values.clone(),
        };
        data.push(json!({"object": "embedding", "index": i, "embedding": encoded(&v, base64)}));
    }
    Ok(json!({"object": "list", "data": data, "model": app.config.id, "usage": usage(&out)}))
}

/// A query or a document of a rerank or score body, as parts, and how it is echoed.
struct Side {
    parts: Vec<Part>,
    echo: Value,
}

fn side(app: &App, v: &Value, at: &str, media: &mut Media) -> Result<Side, ApiError> {
    let echo = match v {
        Value::String(s) => json!({"text": s}),
        other => other.clone(),
    };
    // Cohere's `{"text": ...}` documents.
    if let Value::Object(o) = v {
        if o.contains_key("text") && !o.contains_key("type") {
            known_keys(o, &["text"], at)?;
            let t = opt_str(o, "text", at)?.unwrap_or_default();
            return Ok(Side { parts: vec![Part::Text(t.into())], echo });
        }
    }
    Ok(Side { parts: input_parts(app, v, at, media)?, echo })
}

/// A list field of sides (`documents`, `text_2`), a single value counting as a list of one.
fn sides(app: &App, o: &Map<String, Value>, name: &str, media: &mut Media) -> Result<Vec<Side>, ApiError> {
    let v =
        o.get(name).filter(|v| !v.is_null()).ok_or_else(|| ApiError::bad_at(name, format!("`{name}` is required")))?;
    match v {
        Value::Array(a) if a.is_empty() => Err(ApiError::bad_at(name, format!("`{name}` is empty"))),
        Value::Array(a) if !a.iter().all(Value::is_u64) => {
            if a.len() > MAX_POOL_INPUTS {
                return Err(ApiError::bad_at(
                    name,
                    format!("`{name}` has {} items; at most {MAX_POOL_INPUTS}", a.len()),
                ));
            }
            a.iter().enumerate().map(|(i, d)| side(app, d, &format!("{name}[{i}]"), media)).collect()
        }
        one => Ok(vec![side(app, one, name, media)?]),
    }
}

/// The relevance of each (query, document) pair: the reranker's score, or for an embedding model
/// the cosine of the two embeddings (the query with the instruction, the documents with the
/// default one). An error names the document (`what[i]`).
async fn relevance(
    app: &Arc<App>,
    instruction: Option<String>,
    pairs: Vec<(&Side, &Side)>,
    what: &'static str,
) -> Result<(Vec<f32>, usize), ApiError> {
    match app.engine.pooled() {
        Some(Pooled::Score) => {
            let reqs = pairs
                .iter()
                .map(|(q, d)| {
                    let mut messages = vec![];
                    if let Some(i) = &instruction {
                        messages.push(ChatMessage::text("system", i));
                    }
                    messages.push(ChatMessage::new("query", q.parts.clone()));
                    messages.push(ChatMessage::new("document", d.parts.clone()));
                    Request { messages, ..Default::default() }
                })
                .collect();
            let out = pool(app, reqs, what).await?;
            let tokens = out.iter().map(|p| p.prompt_tokens).sum();
            Ok((out.iter().map(|p| p.values[0]).collect(), tokens))
        }
        Some(Pooled::Embedding { .. }) => {
            // Each distinct query once, then the documents.
            let mut queries: Vec<&Side> = vec![];
            let mut query_of = Vec::with_capacity(pairs.len());
            for (q, _) in &pairs {
                let k = queries.iter().position(|p| std::ptr::eq(*p, *q)).unwrap_or_else(|| {
                    queries.push(q);
                    queries.len() - 1
                });
                query_of.push(k);
            }
            let mut reqs: Vec<Request> = queries
                .iter()
                .map(|q| {
                    let mut messages = vec![];
                    if let Some(i) = &instruction {
                        messages.push(ChatMessage::text("system", i));
                    }
                    messages.push(ChatMessage::user(q.parts.clone()));
                    Request { messages, ..Default::default() }
                })
                .collect();
            let nq = reqs.len();
            reqs.extend(pairs.iter().map(|(_, d)| Request::user(d.parts.clone())));
            let out = pool(app, reqs, what).await?;
            let tokens = out.iter().map(|p| p.prompt_tokens).sum();
            let scores = query_of
                .iter()
                .enumerate()
                .map(|(i, &k)| out[k].values.iter().zip(&out[nq + i].values).map(|(x, y)| x * y).sum::<f32>())
                .collect();
            Ok((scores, tokens))
        }
        None => Err(wrong_kind(app, "a reranker or an embedding model (`/v1/rerank`, `/v1/score`)")),
    }
}

async fn rerank_answer(app: &Arc<App>, o: &Map<String, Value>) -> Result<Value, ApiError> {
    if app.engine.pooled().is_none() {
        return Err(wrong_kind(app, "a reranker or an embedding model (`/v1/rerank`)"));
    }
    known_keys(o, &["model", "query", "documents", "top_n", "return_documents", "instruction", "user"], "")?;
    let top_n = typed_field(o, "top_n", "", "a positive integer", |x| x.as_u64().filter(|&n| n > 0))?;
    let return_documents = typed_field(o, "return_documents", "", "a boolean", Value::as_bool)?.unwrap_or(true);
    opt_str(o, "user", "")?;
    let instruction = instruction(o)?;
    let (query, docs) = tokio::task::block_in_place(|| {
        let q =
            o.get("query").filter(|v| !v.is_null()).ok_or_else(|| ApiError::bad_at("query", "`query` is required"))?;
        let mut media = Media::default();
        Ok::<_, ApiError>((side(app, q, "query", &mut media)?, sides(app, o, "documents", &mut media)?))
    })?;
    let pairs = docs.iter().map(|d| (&query, d)).collect();
    let (scores, tokens) = relevance(app, instruction, pairs, "documents").await?;
    let mut order: Vec<usize> = (0..docs.len()).collect();
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    order.truncate(top_n.map_or(order.len(), |n| n as usize));
    let results: Vec<Value> = order
        .iter()
        .map(|&i| {
            let mut r = json!({"index": i, "relevance_score": scores[i]});
            if return_documents {
                r["document"] = docs[i].echo.clone();
            }
            r
        })
        .collect();
    let number = app.next_id.fetch_add(1, Ordering::Relaxed);
    Ok(json!({"id": format!("rerank-{number}"), "model": app.config.id, "results": results,
              "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}))
}

async fn score_answer(app: &Arc<App>, o: &Map<String, Value>) -> Result<Value, ApiError> {
    if app.engine.pooled().is_none() {
        return Err(wrong_kind(app, "a reranker or an embedding model (`/v1/score`)"));
    }
    known_keys(o, &["model", "text_1", "text_2", "queries", "documents", "instruction", "user"], "")?;
    opt_str(o, "user", "")?;
    let (a, b) = match (
        o.contains_key("text_1") || o.contains_key("text_2"),
        o.contains_key("queries") || o.contains_key("documents"),
    ) {
        (true, true) => {
            return Err(ApiError::bad("`queries`: send `text_1` / `text_2` or `queries` / `documents`, not both"))
        }
        (false, false) => {
            return Err(ApiError::bad_at(
                "queries",
                "`queries` and `documents` (or `text_1` and `text_2`) are required",
            ))
        }
        (true, false) => ("text_1", "text_2"),
        (false, true) => ("queries", "documents"),
    };
    let instruction = instruction(o)?;
    let (left, right) = tokio::task::block_in_place(|| {
        let mut media = Media::default();
        Ok::<_, ApiError>((sides(app, o, a, &mut media)?, sides(app, o, b, &mut media)?))
    })?;
    // One against many, or pairwise.
    let pairs: Vec<(&Side, &Side)> = match (left.len(), right.len()) {
        (1, _) => right.iter().map(|r| (&left[0], r)).collect(),
        (n, m) if n == m => left.iter().zip(&right).collect(),
        (n, m) => {
            return Err(ApiError::bad_at(
                a,
                format!("`{a}` has {n} items and `{b}` {m}: send one against many, or as many of each"),
            ))
        }
    };
    let (scores, tokens) = relevance(app, instruction, pairs, b).await?;
    let number = app.next_id.fetch_add(1, Ordering::Relaxed);
    let data: Vec<Value> =
        scores.iter().enumerate().map(|(i, s)| json!({"index": i, "object": "score", "score": s})).collect();
    Ok(json!({"id": format!("score-{number}"), "object": "list", "created": now(), "model": app.config.id,
              "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}))
}
