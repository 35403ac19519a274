//! Constrained decoding, model-agnostic, with llguidance (the library mistral.rs and llama.cpp
//! use): an answer held to a JSON schema, to any JSON object, or to tool calls in a template's
//! `<tool_call>` form. At each step the grammar's token mask leaves only the tokens that keep the
//! answer valid; the sampler picks among them.
//!
//! - Whitespace is bounded: between two JSON tokens one space, or a newline and at most 20
//!   spaces or tabs (llama.cpp's rule), unless the schema's own `x-guidance` options say
//!   otherwise; a tool call is written as the template writes one (`", "` and `": "`).
//! - The answer ends when the grammar can go no further (the closing brace of the document) or
//!   the model picks an end-of-sequence token where the grammar may end.
//! - A schema the library cannot compile is an `Error::Input` naming the failing part.

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};
use tokenizers::Tokenizer;

use crate::error::{Error, Result};

/// Between two JSON tokens: nothing, one space, or a newline and up to 20 spaces or tabs.
const WHITESPACE: &str = r"(?:\x20|\x0A[\x20\x09]{0,20})";

/// Largest schema accepted, in bytes of its JSON text (compiling is bounded by llguidance's
/// own fuel; this bounds what is parsed and kept).
pub const MAX_SCHEMA_BYTES: usize = 256 << 10;

/// What an answer must be.
#[derive(Debug, Clone, PartialEq)]
pub enum Constraint {
    /// Any JSON object (OpenAI's `response_format: {"type": "json_object"}`).
    JsonObject,
    /// A JSON document valid against this schema.
    JsonSchema(Value),
    /// Function calls in the chat template's form, `<tool_call>\n{"name": ..., "arguments":
    /// {...}}\n</tool_call>`, the arguments valid against that function's `parameters`: one call
    /// of the only function listed when `one`, else one or more calls of any listed.
    ToolCalls { functions: Vec<(String, Value)>, one: bool },
}

impl Constraint {
    /// The llguidance grammar.
    fn grammar(&self) -> Result<TopLevelGrammar> {
        Ok(match self {
            Constraint::JsonObject => TopLevelGrammar::from_json_schema(with_whitespace(json!({"type": "object"}))),
            Constraint::JsonSchema(schema) => TopLevelGrammar::from_json_schema(with_whitespace(schema.clone())),
            Constraint::ToolCalls { functions, one } => {
                if functions.is_empty() {
                    return Err(Error::Input { what: "tool_choice".into(), message: "no function to call".into() });
                }
                let calls: Vec<Value> = functions
                    .iter()
                    .map(|(name, params)| {
                        json!({
                            "type": "object",
                            "properties": {"name": {"const": name}, "arguments": params},
                            "required": ["name", "arguments"],
                            "additionalProperties": false,
                        })
                    })
                    .collect();
                let mut call = if calls.len() == 1 { calls[0].clone() } else { json!({"anyOf": calls}) };
                // The separators the template writes a call with (Python's json.dumps), no other
                // whitespace.
                call["x-guidance"] =
                    json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "});
                let repeat = if *one { "" } else { r#" ("\n" call)*"# };
                TopLevelGrammar::from_lark(format!(
                    "start: call{repeat}\ncall: \"<tool_call>\\n\" %json {call} \"\\n</tool_call>\"\n"
                ))
            }
        })
    }
}

/// The schema with bounded whitespace unless it sets its own `x-guidance` options.
fn with_whitespace(mut schema: Value) -> Value {
    if let Some(o) = schema.as_object_mut() {
        o.entry("x-guidance").or_insert_with(|| json!({"whitespace_pattern": WHITESPACE}));
    }
    schema
}

/// A model's token vocabulary as llguidance sees it: each id's bytes, the end-of-sequence ids,
/// and the tokenizer for the grammar's literal text.
struct Vocab {
    trie: TokTrie,
    tokenizer: Tokenizer,
}

impl TokenizerEnv for Vocab {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.tokenize_with_greedy_fallback(s, |text| {
            self.tokenizer.encode(text, false).map(|e| e.get_ids().to_vec()).unwrap_or_default()
        })
    }
}

/// Compiles constraints for one model; built once (about a second on the 151k-token Qwen
/// vocabulary) and shared.
pub struct Compiler {
    factory: ParserFactory,
}

impl Compiler {
    /// `vocab_size`: the model's logits width (at least the tokenizer's size; ids past the
    /// tokenizer's are never allowed).
    pub fn new(tokenizer: &Tokenizer, vocab_size: usize, eos: &[u32]) -> Result<Self> {
        let fail = |message: String| Error::Input { what: "tokenizer".into(), message };
        let text = tokenizer.to_string(false).map_err(|e| fail(format!("cannot serialize for constraints: {e}")))?;
        let value: Value = serde_json::from_str(&text).map_err(|e| fail(e.to_string()))?;
        let mut words = llguidance::token_bytes_from_tokenizer_json(&value)
            .map_err(|e| fail(format!("cannot read the vocabulary for constraints: {e}")))?;
        if words.len() > vocab_size {
            return Err(fail(format!("{} tokens, more than the model's {vocab_size} logits", words.len())));
        }
        words.resize(vocab_size, Vec::new());
        let first = *eos.first().ok_or_else(|| fail("no end-of-sequence token".into()))?;
        let trie = TokTrie::from(&TokRxInfo::new(vocab_size as u32, first), &words).with_eos_tokens(eos);
        let env: TokEnv = Arc::new(Vocab { trie, tokenizer: tokenizer.clone() });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| fail(e.to_string()))?;
        factory.quiet();
        Ok(Self { factory })
    }

    /// A fresh matcher for one answer; `what` names the request field in errors.
    pub fn matcher(&self, c: &Constraint, what: &str) -> Result<Guide> {
        let grammar = c.grammar()?;
        let parser = self.factory.create_parser(grammar).map_err(|e| Error::Input {
            what: what.into(),
            message: format!("cannot be compiled: {}", first_line(&e.to_string())),
        })?;
        let m = Matcher::new(Ok(parser));
        if let Some(e) = m.get_error() {
            return Err(Error::Input { what: what.into(), message: format!("cannot be compiled: {}", first_line(&e)) });
        }
        Ok(Guide { m })
    }
}

fn first_line(s: &str) -> String {
    s.lines().next().unwrap_or(s).to_string()
}

/// One answer's constraint state.
pub struct Guide {
    m: Matcher,
}

impl Guide {
    /// The tokens allowed next (a bit set over the vocabulary: token t is bit t % 32 of word
    /// t / 32).
    pub fn mask(&mut self) -> Result<SimpleVob> {
        self.m.compute_mask().map_err(|e| internal(&e.to_string()))
    }

    /// Takes the picked token.
    pub fn consume(&mut self, token: u32) -> Result<()> {
        self.m.consume_token(token).map(|_| ()).map_err(|e| internal(&e.to_string()))
    }

    /// The grammar can go no further: the answer is complete.
    pub fn is_done(&self) -> bool {
        self.m.is_stopped()
    }
}

fn internal(message: &str) -> Error {
    Error::Input { what: "constrained decoding".into(), message: first_line(message) }
}
