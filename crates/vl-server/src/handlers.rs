//! The endpoints: `/v1/chat/completions`, `/v1/completions` and `/v1/responses` share one
//! handler (body read, parsed for its endpoint, handed to a worker, answered in its endpoint's
//! shape); `/v1/models`, `/v1/models/{id}` (with the model's kind and endpoints), `/health`,
//! `/metrics`; the 404 and 405 answers. The pooling endpoints are `pooling`'s.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::answers::{Answer, Kind};
use crate::error::ApiError;
use crate::guard::{escape_log, read_body};
use crate::job::{engine_stopped, Job, Msg, RELAY_MESSAGES};
use crate::request::{parse, typed, Parsed};
use crate::responses::Echo;
use crate::state::{now, App};
use crate::workers::submit;

/// `router` with the API's routes and its 404 / 405 answers.
pub(crate) fn routes(router: axum::Router<Arc<App>>) -> axum::Router<Arc<App>> {
    use axum::routing::{get, post};
    crate::anthropic::routes(crate::pooling::routes(router))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/responses", post(responses))
        .route("/v1/responses/{id}", get(stored_response).delete(delete_response))
        .route("/v1/models", get(models))
        .route("/v1/models/{*name}", get(model))
        .route("/health", get(|| async { axum::Json(json!({"status": "ok"})) }))
        .route("/metrics", get(|State(app): State<Arc<App>>| async move { app.metrics.render(&app.engine) }))
        .fallback(|| async {
            ApiError::with(StatusCode::NOT_FOUND, "invalid_request_error", "not_found", "no such endpoint")
        })
        .method_not_allowed_fallback(|method: axum::http::Method, uri: axum::http::Uri| async move {
            ApiError::with(
                StatusCode::METHOD_NOT_ALLOWED,
                "invalid_request_error",
                "method_not_allowed",
                format!("{method} is not allowed on {}", uri.path()),
            )
        })
}

/// The served model under `name` (its id or an alias), as OpenAI's model object.
fn model_object(app: &App, name: &str) -> Value {
    let kind = match app.engine.pooled() {
        None => "chat",
        Some(vl_models::family::Pooled::Embedding { .. }) => "embedding",
        Some(vl_models::family::Pooled::Score) => "reranker",
    };
    // The `speculative` methods its requests may ask for.
    let mut speculative = vec![];
    if kind == "chat" {
        speculative.extend(["off", "ngram"]);
        if app.engine.draft_family().is_some() {
            speculative.push("draft");
        }
        if app.engine.has_draft_head() {
            speculative.push("mtp");
        }
    }
    json!({"id": name, "object": "model", "created": app.created, "owned_by": "vl", "context_length": app.context,
           "kind": kind, "endpoints": crate::pooling::endpoints(app), "speculative": speculative})
}

/// `GET /v1/models`: the served model's id, then its aliases.
async fn models(State(app): State<Arc<App>>) -> Response {
    let names = std::iter::once(&app.config.id).chain(&app.config.aliases);
    axum::Json(json!({"object": "list", "data": names.map(|n| model_object(&app, n)).collect::<Vec<_>>()}))
        .into_response()
}

/// `GET /v1/models/{id}` (openai's `models.retrieve`): the model under that name, 404 for a name
/// the server does not list.
async fn model(State(app): State<Arc<App>>, axum::extract::Path(name): axum::extract::Path<String>) -> Response {
    if app.config.names(&name) {
        return axum::Json(model_object(&app, &name)).into_response();
    }
    ApiError::with(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        "model_not_found",
        format!("the model `{}` does not exist; this server serves `{}`", escape_log(&name), app.config.id),
    )
    .into_response()
}

async fn chat_completions(State(app): State<Arc<App>>, req: axum::extract::Request) -> Response {
    endpoint(app, req, Kind::Chat).await
}

/// `POST /v1/completions`: a raw prompt, no chat template.
async fn completions(State(app): State<Arc<App>>, req: axum::extract::Request) -> Response {
    endpoint(app, req, Kind::Text).await
}

fn no_stored_response(id: &str) -> Response {
    ApiError::with(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        "not_found",
        format!("no stored response `{}` (not stored, evicted, or made before a restart)", escape_log(id)),
    )
    .into_response()
}

/// `GET /v1/responses/{id}`: a stored response object.
async fn stored_response(
    State(app): State<Arc<App>>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Response {
    match app.responses.get(&id) {
        Some(s) => axum::Json(s.response.clone()).into_response(),
        None => no_stored_response(&id),
    }
}

/// `DELETE /v1/responses/{id}`: forgets a stored response.
async fn delete_response(
    State(app): State<Arc<App>>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Response {
    if app.responses.remove(&id) {
        axum::Json(json!({"id": id, "object": "response", "deleted": true})).into_response()
    } else {
        no_stored_response(&id)
    }
}

/// `POST /v1/responses`: OpenAI's Responses API (`crate::responses`).
async fn responses(State(app): State<Arc<App>>, req: axum::extract::Request) -> Response {
    endpoint(app, req, Kind::Responses).await
}

async fn endpoint(app: Arc<App>, req: axum::extract::Request, kind: Kind) -> Response {
    let resp = match read_body(&app, req).await {
        Ok(body) => handle(&app, body, kind).await.unwrap_or_else(IntoResponse::into_response),
        Err(e) => e.into_response(),
    };
    app.metrics.count(resp.status());
    resp
}

/// A request as its endpoint parsed it.
struct Incoming {
    parsed: Parsed,
    /// What a Responses request's answer echoes; None on the other endpoints.
    echo: Option<Echo>,
}

/// A body parsed for its endpoint, handed to a worker, answered in its endpoint's shape.
async fn handle(app: &Arc<App>, body: Bytes, kind: Kind) -> Result<Response, ApiError> {
    let started = Instant::now();
    if app.engine.pooled().is_some() {
        let asked = match kind {
            Kind::Chat => "a chat model (`/v1/chat/completions`)",
            Kind::Text => "a chat model (`/v1/completions`)",
            Kind::Responses => "a chat model (`/v1/responses`)",
        };
        return Err(crate::pooling::wrong_kind(app, asked));
    }
    let Incoming { parsed, echo } = parse_for(app, &body, kind)?;
    let Parsed { req, n, stream, include_usage, one_call, format_field } = parsed;
    let want_logprobs = req.options.logprobs.is_some();
    let (tx, mut rx) = mpsc::channel::<Msg>(RELAY_MESSAGES);
    submit(app, Job { req, n, one_call, format_field, tx, queued: Instant::now() })?;
    let number = app.next_id.fetch_add(1, Ordering::Relaxed);
    let created = now();
    // The first message decides the status: a request the engine refuses gets its error status
    // even when streaming.
    let first = rx.recv().await.ok_or_else(engine_stopped)?;
    if let Some(echo) = echo {
        return crate::responses::answer(app.clone(), echo, stream, first, rx, started, number).await;
    }
    let prefix = if kind == Kind::Chat { "chatcmpl" } else { "cmpl" };
    let id = format!("{prefix}-{number}");
    let answer = Answer { app: app.clone(), kind, id, created, started, want_logprobs, n, include_usage };
    if stream {
        answer.stream(first, rx)
    } else {
        answer.whole(first, rx).await
    }
}

/// The body parsed as `kind`'s request. Parsing reads local media files and fetches remote ones:
/// off the runtime's threads (the runtime moves its other tasks to a fresh thread meanwhile).
fn parse_for(app: &App, body: &[u8], kind: Kind) -> Result<Incoming, ApiError> {
    tokio::task::block_in_place(|| match kind {
        Kind::Chat => Ok(Incoming { parsed: parse(app, typed(body)?)?, echo: None }),
        Kind::Text => Ok(Incoming { parsed: crate::request::parse_completion(app, body)?, echo: None }),
        Kind::Responses => {
            crate::responses::parse_responses(app, body).map(|r| Incoming { parsed: r.chat, echo: Some(r.echo) })
        }
    })
}
