//! Qwen3-VL-Reranker (2B, 8B): a Qwen3-VL checkpoint whose Sentence Transformers files
//! (`modules.json`: Transformer, LogitScore) make it a reranker. It scores, never decodes: a
//! query and a document become the official prompt, and the score is
//! sigmoid(logit("yes") - logit("no")) at the prompt's last position, which is
//! sigmoid(h · (W["yes"] - W["no"])) as the official code computes it
//! (QwenLM/Qwen3-VL-Embedding `src/models/qwen3_vl_reranker.py`).
//!
//! The prompt: the fixed system message; one user turn of `<Instruct>: ` + the instruction
//! (default "Given a search query, retrieve relevant candidates that answer the query."), then
//! `<Query>:` and the query's videos, images and texts ("NULL" when it has none), then
//! `\n<Document>:` and the document's the same way; the generation prompt. A request carries the
//! query as a message with the role `query`, the document as one with the role `document`, and
//! the instruction, when it has one, as the system message. Images are sized as for the
//! embedding models (at most 1,800 visual tokens).

use std::path::Path;

use crate::error::{Error, Result};
use crate::family::{Family, FamilyEntry, ModelOptions, PoolInput, Pooled, Pooler, Prepared, Source, Task};
use crate::media::MediaContext;
use crate::qwen3_vl::family::Qwen3Vl;
use crate::request::{ChatMessage, Part, Request};
use crate::state::SeqState;

/// The registry's entry for Qwen3-VL-Reranker.
pub static ENTRY: FamilyEntry = FamilyEntry {
    name: "qwen3_vl_reranker",
    architectures: &["Qwen3VLForConditionalGeneration"],
    model_types: &["qwen3_vl"],
    gguf_architectures: &[],
    heads: &["sentence_transformers.models.LogitScore"],
    open: open_entry,
    inspect: inspect_entry,
    quantize: crate::qwen3_vl::family::quantize_entry,
    default_quant: crate::qwen3_vl::family::default_quant_entry,
};

/// The system message of every reranker prompt (the official one).
pub const SYSTEM: &str = "Judge whether the Document meets the requirements based on the Query and the Instruct provided. Note that the answer can only be \"yes\" or \"no\".";
/// The instruction when a request gives none (the official default).
pub const DEFAULT_INSTRUCTION: &str = "Given a search query, retrieve relevant candidates that answer the query.";

/// The two vocabulary ids the score compares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ScoreTokens {
    yes: u32,
    /// None: the score is sigmoid(logit("yes")) alone.
    no: Option<u32>,
}

fn open_entry(source: &Source<'_>, opts: &ModelOptions, staged: bool) -> Result<Box<dyn Family>> {
    let inner = crate::qwen3_vl_embedding::open_official(source, opts, staged)?;
    let tokens = score_tokens(source.model, inner.tokenizer(), inner.vocab_size())?;
    Ok(Box::new(Qwen3VlReranker { inner, tokens }))
}

/// The ids `LogitScore`'s `config.json` names (`true_token_id`, `false_token_id`; null for no
/// second token), else the tokenizer's "yes" and "no" as the official code takes them. An error
/// names the file and key of an id that is not a vocabulary index.
fn score_tokens(dir: &Path, tokenizer: &tokenizers::Tokenizer, vocab: usize) -> Result<ScoreTokens> {
    let (path, v) = crate::formats::sentence_transformers::module_config(dir, "LogitScore", "1_LogitScore")?;
    let id = |key: &str, word: &str| -> Result<Option<u32>> {
        let bad = |message: String| Error::Config { path: path.clone(), field: key.into(), message };
        match v.get(key) {
            None => tokenizer
                .token_to_id(word)
                .map(Some)
                .ok_or_else(|| bad(format!("absent, and the tokenizer has no {word:?} token to take instead"))),
            Some(serde_json::Value::Null) if key == "false_token_id" => Ok(None),
            Some(x) => match x.as_u64() {
                Some(n) if (n as usize) < vocab => Ok(Some(n as u32)),
                _ => Err(bad(format!("{x} is not a token id below the vocabulary size {vocab}"))),
            },
        }
    };
    let yes = id("true_token_id", "yes")?.expect("true_token_id is never null here");
    let no = id("false_token_id", "no")?;
    if no == Some(yes) {
        return Err(Error::Config {
            path,
            field: "false_token_id".into(),
            message: format!("{yes} equals true_token_id: the score would be a constant"),
        });
    }
    Ok(ScoreTokens { yes, no })
}

fn inspect_entry(source: &Source<'_>, json: bool) -> Result<String> {
    crate::formats::sentence_transformers::module_config(source.model, "LogitScore", "1_LogitScore")?;
    (crate::qwen3_vl::family::ENTRY.inspect)(source, json)
}

/// A loaded Qwen3-VL-Reranker: Qwen3-VL, scored.
pub struct Qwen3VlReranker {
    inner: Qwen3Vl,
    tokens: ScoreTokens,
}

/// The official user turn for one side: the prefix text, then videos, images and texts ("NULL"
/// when there are none).
fn side(prefix: &str, parts: &[Part], out: &mut Vec<Part>) {
    out.push(Part::Text(prefix.into()));
    let of = |want: fn(&Part) -> bool| parts.iter().filter(move |p| want(p)).cloned();
    let before = out.len();
    out.extend(of(|p| matches!(p, Part::Video { .. })));
    out.extend(of(|p| matches!(p, Part::Image { .. })));
    out.extend(of(|p| matches!(p, Part::Text(_))));
    if out.len() == before {
        out.push(Part::Text("NULL".into()));
    }
}

/// The official prompt of a request: the system message is the instruction (else the default);
/// one message with the role `query` and one with the role `document`. A raw `prompt` is refused:
/// a reranker scores a pair.
pub fn templated(req: &Request) -> Result<Request> {
    if req.prompt.is_some() {
        return Err(Error::Input {
            what: "prompt".into(),
            message: "a reranker scores a query and a document: send messages with the roles query and document".into(),
        });
    }
    let (mut instruction, mut query, mut document) = (None, None, None);
    for (i, m) in req.messages.iter().enumerate() {
        let slot = match m.role.as_str() {
            "system" => {
                let mut t = String::new();
                for p in &m.parts {
                    match p {
                        Part::Text(s) => t.push_str(s),
                        _ => {
                            return Err(Error::Input {
                                what: format!("messages[{i}]"),
                                message: "the system message is the instruction: text only".into(),
                            })
                        }
                    }
                }
                if instruction.replace(t).is_some() {
                    return Err(Error::Input {
                        what: format!("messages[{i}]"),
                        message: "a second system message".into(),
                    });
                }
                continue;
            }
            "query" => &mut query,
            "document" => &mut document,
            other => {
                return Err(Error::Input {
                    what: format!("messages[{i}].role"),
                    message: format!(
                        "{other:?}: a reranker takes the roles system (the instruction), query and document"
                    ),
                })
            }
        };
        if slot.replace(m.parts.clone()).is_some() {
            return Err(Error::Input {
                what: format!("messages[{i}]"),
                message: format!("a second {} message", m.role),
            });
        }
    }
    let missing = |what: &str| Error::Input { what: "messages".into(), message: format!("no {what} message to score") };
    let query = query.ok_or_else(|| missing("query"))?;
    let document = document.ok_or_else(|| missing("document"))?;
    let instruction = instruction.filter(|t| !t.trim().is_empty()).unwrap_or_else(|| DEFAULT_INSTRUCTION.into());
    let mut user = vec![Part::Text(format!("<Instruct>: {instruction}"))];
    side("<Query>:", &query, &mut user);
    side("\n<Document>:", &document, &mut user);
    Ok(Request {
        messages: vec![ChatMessage::text("system", SYSTEM), ChatMessage::user(user)],
        prompt: None,
        tools: vec![],
        constraint: None,
        stop: vec![],
        ..req.clone()
    })
}

impl Family for Qwen3VlReranker {
    fn name(&self) -> &'static str {
        ENTRY.name
    }
    crate::qwen3_vl::forward_family_to_inner!();
    fn task(&self) -> Task<'_> {
        Task::Pool(self)
    }
    fn prepare(&self, req: &Request, ctx: &MediaContext<'_>) -> Result<Prepared> {
        if !req.tools.is_empty() {
            return Err(Error::Input { what: "tools".into(), message: "a reranker calls no function".into() });
        }
        self.inner.prepare(&templated(req)?, ctx)
    }
}

impl Pooler for Qwen3VlReranker {
    fn pooled(&self) -> Pooled {
        Pooled::Score
    }
    crate::qwen3_vl::forward_pool_states_to_inner!();
    fn pool(&self, inputs: &[PoolInput<'_>], states: &mut [&mut SeqState]) -> Result<Vec<Vec<f32>>> {
        let ends: Vec<usize> = inputs.iter().map(|i| i.ids.len()).collect();
        let hidden = self.inner.prefill_rows(inputs, states, &ends)?;
        let logits = self.inner.logits(&hidden)?;
        // Only the two scored columns leave the device (ids checked against the vocabulary at
        // load).
        let ids = [self.tokens.yes, self.tokens.no.unwrap_or(self.tokens.yes)];
        let picked = logits.index_select(&candle_core::Tensor::new(&ids, logits.device())?, 1)?.to_vec2::<f32>()?;
        Ok(picked
            .iter()
            .map(|r| {
                let x = r[0] as f64 - if self.tokens.no.is_some() { r[1] as f64 } else { 0.0 };
                vec![(1.0 / (1.0 + (-x).exp())) as f32]
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(s: &str) -> Part {
        Part::Text(s.into())
    }

    #[test]
    fn a_pair_becomes_the_official_turn() {
        let img = Part::image(vec![1, 2, 3]);
        let req = Request {
            messages: vec![
                ChatMessage::new("query", vec![text("cats")]),
                ChatMessage::new("document", vec![text("a cat"), img]),
            ],
            ..Default::default()
        };
        let t = templated(&req).unwrap();
        assert!(matches!(&t.messages[0].parts[0], Part::Text(s) if s == SYSTEM));
        let p = &t.messages[1].parts;
        assert!(matches!(&p[0], Part::Text(s) if s == &format!("<Instruct>: {DEFAULT_INSTRUCTION}")));
        assert!(matches!(&p[1], Part::Text(s) if s == "<Query>:"));
        assert!(matches!(&p[2], Part::Text(s) if s == "cats"));
        assert!(matches!(&p[3], Part::Text(s) if s == "\n<Document>:"));
        assert!(matches!(p[4], Part::Image { .. }), "images before texts");
        assert!(matches!(&p[5], Part::Text(s) if s == "a cat"));
    }

    #[test]
    fn missing_sides_and_other_roles_are_refused_by_name() {
        let only_query = Request { messages: vec![ChatMessage::text("query", "q")], ..Default::default() };
        assert!(templated(&only_query).unwrap_err().to_string().contains("no document message"));
        let user = Request { messages: vec![ChatMessage::text("user", "q")], ..Default::default() };
        assert!(templated(&user).unwrap_err().to_string().contains("messages[0].role"));
        let empty_doc = Request {
            messages: vec![
                ChatMessage::text("system", "Find"),
                ChatMessage::text("query", "q"),
                ChatMessage::new("document", vec![]),
            ],
            ..Default::default()
        };
        let t = templated(&empty_doc).unwrap();
        assert!(matches!(&t.messages[1].parts[0], Part::Text(s) if s == "<Instruct>: Find"));
        assert!(matches!(t.messages[1].parts.last(), Some(Part::Text(s)) if s == "NULL"));
    }
}
