//! Errors in OpenAI's shape: `{"error": {"message", "type", "code", "param"}}` with an HTTP
//! status, and the engine's errors mapped to theirs.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use vl_models::limits::LimitKind;

#[derive(Debug)]
pub(crate) struct ApiError {
    status: StatusCode,
    kind: &'static str,
    code: Option<&'static str>,
    message: String,
    /// The request field the error is about (OpenAI's `param`), when one is.
    param: Option<String>,
}

impl ApiError {
    pub(crate) fn bad(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            code: None,
            message: message.into(),
            param: None,
        }
    }
    pub(crate) fn with(status: StatusCode, kind: &'static str, code: &'static str, message: impl Into<String>) -> Self {
        Self { status, kind, code: Some(code), message: message.into(), param: None }
    }
    /// A 400 about the field `param` (a path such as `messages[0].content[1].detail`).
    pub(crate) fn bad_at(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self::bad(message).at(param)
    }
    /// The same error about the field `param`.
    pub(crate) fn at(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
        self
    }
    /// The same error with its message (and its `param`) rewritten.
    pub(crate) fn map_message(mut self, f: impl Fn(&str) -> String) -> Self {
        self.message = f(&self.message);
        // Quoted as messages quote a field, so a rewrite of `name` applies to it too.
        self.param = self.param.map(|p| f(&format!("`{p}`")).trim_matches('`').to_string());
        self
    }
    pub(crate) fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind, "code": self.code, "param": self.param}})
    }
    pub(crate) fn from_engine(e: &vl_models::Error) -> Self {
        let message = e.to_string().split_whitespace().collect::<Vec<_>>().join(" ");
        match e {
            vl_models::Error::Limit { what, kind, .. } if what == "prompt" && *kind == LimitKind::Fixed => {
                Self::with(StatusCode::BAD_REQUEST, "invalid_request_error", "context_length_exceeded", message)
            }
            vl_models::Error::Limit { kind: LimitKind::KvCache, .. } => {
                Self::with(StatusCode::SERVICE_UNAVAILABLE, "server_error", "kv_cache_exhausted", message)
            }
            vl_models::Error::Limit { .. } => {
                Self::with(StatusCode::PAYLOAD_TOO_LARGE, "invalid_request_error", "image_too_large", message)
            }
            vl_models::Error::Input { .. } => Self::bad(message),
            _ => Self::with(StatusCode::INTERNAL_SERVER_ERROR, "server_error", "internal_error", message),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}
