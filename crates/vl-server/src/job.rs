//! What a route hands the workers (`Job`: a parsed request and where its answer goes) and what
//! they relay back (`Msg`: the answer's pieces, then its end).

use std::time::Instant;

use axum::http::StatusCode;
use serde_json::Value;
use tokio::sync::mpsc;
use vl_models::engine::{Completion, Request};

use crate::error::ApiError;

/// A parsed request and where its answer goes.
pub(crate) struct Job {
    pub req: Request,
    /// Answers asked for (`n`).
    pub n: usize,
    /// `parallel_tool_calls: false`: each answer keeps its first call.
    pub one_call: bool,
    /// The request field that set the answer's format, named in the engine's errors about it.
    pub format_field: Option<String>,
    pub tx: mpsc::Sender<Msg>,
    pub queued: Instant,
}

/// Messages a request's relay may hold unread: past them the worker waits for the client (and
/// the engine pauses the request's sequences once their own pieces pile up).
pub(crate) const RELAY_MESSAGES: usize = 32;

/// What a worker relays of a request's answer. One `Done` per request, after its texts: its
/// size is no concern.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Msg {
    /// A piece of one choice's answer.
    Text {
        /// The choice's index (`n` choices).
        choice: usize,
        text: String,
        /// The piece is of the reasoning block, not of the answer.
        reasoning: bool,
        /// Its tokens' log-probabilities (JSON, null when not asked).
        logprobs: Value,
    },
    /// Every choice's completion, in order.
    Done(Result<Vec<Completion>, ApiError>),
}

/// The error of a request whose relay closed before its end: the engine stopped.
pub(crate) fn engine_stopped() -> ApiError {
    ApiError::with(StatusCode::INTERNAL_SERVER_ERROR, "server_error", "internal_error", "the engine stopped")
}
