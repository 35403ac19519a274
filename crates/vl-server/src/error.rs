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

/// The request field a message names first, when it begins with one quoted
/// (`` `messages[0].content[1]`: ... ``): every error that is about a field says so first.
fn named_field(message: &str) -> Option<String> {
    let (name, _) = message.strip_prefix('`')?.split_once('`')?;
    let path = name.chars().all(|c| c.is_ascii_alphanumeric() || "_.[]-$".contains(c));
    let starts = name.chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
    (path && starts).then(|| name.to_string())
}

impl ApiError {
    /// A 400; its `param` is the field the message begins with, quoted, if it does.
    pub(crate) fn bad(message: impl Into<String>) -> Self {
        let message = message.into();
        Self {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            code: None,
            param: named_field(&message),
            message,
        }
    }
    /// An error of any status; its `param` as `bad`'s.
    pub(crate) fn with(status: StatusCode, kind: &'static str, code: &'static str, message: impl Into<String>) -> Self {
        let message = message.into();
        Self { status, kind, code: Some(code), param: named_field(&message), message }
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
    pub(crate) fn status(&self) -> StatusCode {
        self.status
    }
    pub(crate) fn message(&self) -> &str {
        &self.message
    }
    #[cfg(test)]
    pub(crate) fn param(&self) -> Option<&str> {
        self.param.as_deref()
    }
    /// The error in Anthropic's shape (`{"type": "error", "error": {"type", "message"}}`), with
    /// its status.
    pub(crate) fn anthropic_response(&self) -> axum::response::Response {
        let kind = match self.status.as_u16() {
            400 | 405 | 408 | 411 => "invalid_request_error",
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            413 => "request_too_large",
            429 => "rate_limit_error",
            503 => "overloaded_error",
            _ => "api_error",
        };
        let body = json!({"type": "error", "error": {"type": kind, "message": self.message}});
        (self.status, axum::Json(body)).into_response()
    }
    pub(crate) fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind, "code": self.code, "param": self.param}})
    }
    /// `from_engine` for a request whose answer format `format_field` set (`grammar`,
    /// `structured_outputs.regex`, ...): the engine names the format `response_format` whichever
    /// field set it, so its errors about the format name that field instead.
    pub(crate) fn from_engine_for(e: &vl_models::Error, format_field: Option<&str>) -> Self {
        match (e, format_field) {
            (vl_models::Error::Input { what, .. }, Some(field)) if what == "response_format" => {
                Self::from_engine(e).map_message(|m| m.replacen("response_format", field, 1))
            }
            _ => Self::from_engine(e),
        }
    }
    pub(crate) fn from_engine(e: &vl_models::Error) -> Self {
        let message = e.to_string().split_whitespace().collect::<Vec<_>>().join(" ");
        match e {
            vl_models::Error::Limit { kind, .. } => match kind {
                LimitKind::Context => {
                    Self::with(StatusCode::BAD_REQUEST, "invalid_request_error", "context_length_exceeded", message)
                }
                LimitKind::KvCache => {
                    Self::with(StatusCode::SERVICE_UNAVAILABLE, "server_error", "kv_cache_exhausted", message)
                }
                // The client can send less (a shorter clip, fewer frames); the server's bound is
                // `--video-decode-timeout`.
                LimitKind::DecodeTime => Self::with(
                    StatusCode::BAD_REQUEST,
                    "invalid_request_error",
                    "decode_timeout",
                    format!("{message} (the server's --video-decode-timeout)"),
                ),
                LimitKind::ImageBytes | LimitKind::ImagePixels => {
                    Self::with(StatusCode::PAYLOAD_TOO_LARGE, "invalid_request_error", "image_too_large", message)
                }
                LimitKind::Fixed => {
                    Self::with(StatusCode::PAYLOAD_TOO_LARGE, "invalid_request_error", "input_too_large", message)
                }
            },
            // One line: the fault, not the request, is named.
            vl_models::Error::Internal { .. } => {
                Self::with(StatusCode::INTERNAL_SERVER_ERROR, "server_error", "internal_error", message)
            }
            vl_models::Error::Input { what, .. } => {
                let mut e = Self::bad(message);
                e.param = engine_param(what);
                e
            }
            _ => Self::with(StatusCode::INTERNAL_SERVER_ERROR, "server_error", "internal_error", message),
        }
    }
}

/// The request field an engine's input error names (`Error::Input::what`), when it is one: the
/// engine names a constraint's field (`response_format`, `tool_choice`), a sampling option, a
/// message (`messages[2]`) or `n` / `stop`; `max_new_tokens` is the request's `max_tokens`. Other
/// subjects (a template, an image file, the engine) are no request field.
fn engine_param(what: &str) -> Option<String> {
    const FIELDS: [&str; 19] = [
        "messages",
        "speculative",
        "tools",
        "tool_choice",
        "response_format",
        "logit_bias",
        "max_tokens",
        "n",
        "stop",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "seed",
        "top_logprobs",
        "chat_template_kwargs",
    ];
    match what {
        "max_new_tokens" => Some("max_tokens".into()),
        w if FIELDS.contains(&w) || crate::openai::LLAMA_SAMPLERS.contains(&w) => Some(w.into()),
        w if w.starts_with("messages[") || w.starts_with("tools[") => Some(w.into()),
        _ => None,
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn param_is_the_field_a_message_begins_with() {
        for (m, p) in [
            ("`messages[0].content[1]`: malformed data URL", Some("messages[0].content[1]")),
            ("`logit_bias.7` = 200 must be a number", Some("logit_bias.7")),
            ("`n` = 9 must be in 1..=8", Some("n")),
            ("unknown field `foo`", None),
            ("`` is empty", None),
            ("`a b`: not a path", None),
            ("malformed JSON body: EOF", None),
        ] {
            assert_eq!(ApiError::bad(m).param.as_deref(), p, "{m}");
        }
        let e = vl_models::Error::Input { what: "response_format".into(), message: "cannot be compiled".into() };
        assert_eq!(ApiError::from_engine(&e).param.as_deref(), Some("response_format"));
        let e = vl_models::Error::Input { what: "max_new_tokens".into(), message: "0".into() };
        assert_eq!(ApiError::from_engine(&e).param.as_deref(), Some("max_tokens"));
        let e = vl_models::Error::Input { what: "chat template".into(), message: "raised".into() };
        assert_eq!(ApiError::from_engine(&e).param, None);
    }
}
