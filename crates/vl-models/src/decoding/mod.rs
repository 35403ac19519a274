//! From logits to an answer: sampling (`sampling`), constrained decoding with llguidance
//! (`constraint`), streaming detokenization (`stream`), reasoning blocks (`reasoning`), tool
//! calls (`tool_calls`), chat templates (`template`), boxes and points in answers
//! (`grounding`), and speculative decoding's drafts (`speculative`).

pub mod constraint;
pub mod dry;
pub mod grounding;
pub mod mirostat;
pub mod reasoning;
pub mod sampling;
pub mod speculative;
pub mod stream;
pub mod template;
pub mod tool_calls;
