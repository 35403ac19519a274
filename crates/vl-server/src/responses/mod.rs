//! OpenAI's Responses API, `POST /v1/responses`: a request is made into the chat completions
//! request it stands for (so it gets the same checks, sampling, constraints and tools), and its
//! answer is shaped as a `response` object or, streamed, as the API's typed events. Answers are
//! stored (`store`, bounded: `store`) and `previous_response_id` continues one; `GET` and
//! `DELETE /v1/responses/{id}` read and remove them. `conversation` and `background: true` are
//! refused; so are built-in tools (web search, file search, ...) and the fields the table in
//! docs/serving.md lists as refused.

mod answer;
mod parse;
mod store;

pub(crate) use answer::answer;
pub(crate) use parse::{parse_responses, Echo};
pub(crate) use store::ResponseStore;
