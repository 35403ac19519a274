//! OpenAI's Responses API, `POST /v1/responses`, without stored state: a request is made into the
//! chat completions request it stands for (so it gets the same checks, sampling, constraints and
//! tools), and its answer is shaped as a `response` object or, streamed, as the API's typed
//! events. `previous_response_id`, `conversation`, `store: true` and `background: true` ask for
//! state this server does not keep and are refused; so are built-in tools (web search, file
//! search, ...) and the fields the table in docs/serving.md lists as refused.

mod answer;
mod parse;

pub(crate) use answer::answer;
pub(crate) use parse::{parse_responses, Echo};
