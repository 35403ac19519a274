//! Constrained decoding, model-agnostic, with llguidance (the library mistral.rs and llama.cpp
//! use): an answer held to a JSON schema, to any JSON object, to tool calls in a template's
//! `<tool_call>` form (`schema`), to a regular expression, to one of a list of strings, or to a
//! context-free grammar in Lark or llama.cpp's GBNF (`gbnf`). At each step the grammar's token mask leaves only the tokens that keep the
//! answer valid; the sampler picks among them.
//!
//! - Whitespace is bounded: between two JSON tokens one space, or a newline and at most 20
//!   spaces or tabs (llama.cpp's rule), unless the schema's own `x-guidance` options say
//!   otherwise; a tool call is written as the template writes one (`", "` and `": "`).
//! - The answer ends when the grammar can go no further (the closing brace of the document) or
//!   the model picks an end-of-sequence token where the grammar may end.
//! - A schema or grammar the library cannot compile is an `Error::Input` naming the failing
//!   part; schema patterns and regexes are bounded first (`patterns`).

use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{CancellationHandle, Matcher, ParserFactory};
use serde_json::{json, Value};
use tokenizers::Tokenizer;

use crate::error::{Error, Result};
use patterns::{check_patterns, patterns_of};

pub mod gbnf;
mod patterns;
mod schema;

/// Between two JSON tokens: nothing, one space, or a newline and up to 20 spaces or tabs.
const WHITESPACE: &str = r"(?:\x20|\x0A[\x20\x09]{0,20})";

/// Largest schema accepted, in bytes of its JSON text (compiling is bounded by llguidance's
/// own fuel; this bounds what is parsed and kept).
pub const MAX_SCHEMA_BYTES: usize = 256 << 10;

/// Most characters a schema's `pattern` may spell out through its counted repetitions
/// (`(a{300}){300}` spells 90,000): llguidance builds a pattern's lexer states as the answer
/// reaches it, at a cost that grows with this, so a pattern past it is refused at admission.
pub const MAX_PATTERN_EXPANSION: u64 = 10_000;

/// The longest one token mask may take before it is cancelled and the answer refused (the first
/// mask, at admission) or ended with an error (a later one).
pub const MASK_TIME_LIMIT: Duration = Duration::from_secs(2);

/// How a chat template writes a function call inside `<tool_call>` (the family says which).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CallFormat {
    /// `{"name": ..., "arguments": {...}}` (Qwen3-VL).
    #[default]
    Json,
    /// `<function=NAME>` with a `<parameter=P>` block per argument, string values as text and
    /// others as JSON (Qwen3.5, the Qwen3-Coder form).
    Xml,
}

/// Largest grammar, regular expression or list of choices accepted, in bytes of its text.
pub const MAX_GRAMMAR_BYTES: usize = 256 << 10;

/// Most strings a `Choice` constraint may list.
pub const MAX_CHOICES: usize = 4096;

/// The notation of a `Grammar` constraint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GrammarSyntax {
    /// llguidance's Lark variant (vLLM's and mistral.rs's `grammar`; llama.cpp's grammars that
    /// begin with `%llguidance`).
    Lark,
    /// llama.cpp's GBNF (`root ::= ...`), rewritten as Lark before compiling (`gbnf`).
    Gbnf,
}

impl GrammarSyntax {
    /// GBNF when a line defines a rule with `::=`, else Lark.
    pub fn detect(text: &str) -> Self {
        let defines = |l: &str| {
            let l = l.trim_start();
            let name = l.find(|c: char| !(c.is_ascii_alphanumeric() || c == '-' || c == '_')).unwrap_or(l.len());
            name > 0 && l[name..].trim_start().starts_with("::=")
        };
        if text.trim_start().starts_with("%llguidance") || !text.lines().any(defines) {
            GrammarSyntax::Lark
        } else {
            GrammarSyntax::Gbnf
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            GrammarSyntax::Lark => "Lark",
            GrammarSyntax::Gbnf => "GBNF",
        }
    }
}

/// What an answer must be.
#[derive(Debug, Clone, PartialEq)]
pub enum Constraint {
    /// Any JSON object (OpenAI's `response_format: {"type": "json_object"}`).
    JsonObject,
    /// A JSON document valid against this schema.
    JsonSchema(Value),
    /// Function calls in the chat template's form, `<tool_call>\n{"name": ..., "arguments":
    /// {...}}\n</tool_call>`, the arguments valid against that function's `parameters`: exactly
    /// one call of any function listed when `one` (a named function, or `parallel_tool_calls:
    /// false`), else one or more.
    ToolCalls { functions: Vec<(String, Value)>, one: bool },
    /// Text the whole of which matches this regular expression (Rust `regex` syntax, anchored
    /// at both ends).
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// Text in the language of a context-free grammar.
    Grammar { text: String, syntax: GrammarSyntax },
}

impl Constraint {
    /// The llguidance grammar; tool calls in `format`. `what` names the request field in errors.
    fn grammar(&self, format: CallFormat, what: &str) -> Result<TopLevelGrammar> {
        let too_big = |n: usize, of: &str| Error::Input {
            what: what.into(),
            message: format!("the {of} is {n} bytes, over the limit of {MAX_GRAMMAR_BYTES}"),
        };
        Ok(match self {
            Constraint::ToolCalls { functions, one } => match format {
                CallFormat::Xml => schema::xml_calls(functions, *one)?,
                CallFormat::Json => schema::json_calls(functions, *one)?,
            },
            Constraint::JsonObject => {
                TopLevelGrammar::from_json_schema(schema::with_whitespace(json!({"type": "object"})))
            }
            Constraint::JsonSchema(s) => {
                TopLevelGrammar::from_json_schema(schema::with_whitespace(schema::closed_objects(s.clone())))
            }
            Constraint::Regex(rx) if rx.len() > MAX_GRAMMAR_BYTES => return Err(too_big(rx.len(), "regex")),
            Constraint::Regex(rx) => TopLevelGrammar::from_regex(unanchored(rx)),
            Constraint::Choice(all) => {
                if all.is_empty() {
                    return Err(Error::Input { what: what.into(), message: "no choice given".into() });
                }
                if all.len() > MAX_CHOICES {
                    return Err(Error::Input {
                        what: what.into(),
                        message: format!("{} choices, at most {MAX_CHOICES}", all.len()),
                    });
                }
                let bytes: usize = all.iter().map(String::len).sum();
                if bytes > MAX_GRAMMAR_BYTES {
                    return Err(too_big(bytes, "list of choices"));
                }
                if let Some(i) = all.iter().position(String::is_empty) {
                    return Err(Error::Input { what: what.into(), message: format!("choice {i} is empty") });
                }
                let alts: Vec<String> = all.iter().map(|c| serde_json::to_string(c).unwrap_or_default()).collect();
                TopLevelGrammar::from_lark(format!("start: {}\n", alts.join(" | ")))
            }
            Constraint::Grammar { text, .. } if text.len() > MAX_GRAMMAR_BYTES => {
                return Err(too_big(text.len(), "grammar"))
            }
            Constraint::Grammar { text, syntax: GrammarSyntax::Lark } => TopLevelGrammar::from_lark(text.clone()),
            Constraint::Grammar { text, syntax: GrammarSyntax::Gbnf } => {
                let lark = gbnf::to_lark(text).map_err(|e| Error::Input {
                    what: what.into(),
                    message: format!("the GBNF grammar cannot be read: {e}"),
                })?;
                TopLevelGrammar::from_lark(lark)
            }
        })
    }
}

/// `rx` without a leading `^` and a trailing unescaped `$`: the answer is matched whole anyway
/// (vLLM's and xgrammar's rule), and llguidance's lexer takes no anchors.
fn unanchored(rx: &str) -> &str {
    let rx = rx.strip_prefix('^').unwrap_or(rx);
    match rx.strip_suffix('$') {
        // `\$` is a dollar sign, `\\$` a backslash then the anchor.
        Some(body) if (body.len() - body.trim_end_matches('\\').len()) % 2 == 0 => body,
        _ => rx,
    }
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

    /// `n` matchers for the answers of one request, each holding its first token mask: the
    /// grammar compiled once, its first mask computed once in this thread (within
    /// `MASK_TIME_LIMIT`), then copied. `what` names the request field in errors; a grammar that
    /// cannot be compiled, that admits no answer, or whose mask is too costly is refused here,
    /// naming `what` and the failing part.
    pub fn guides(&self, c: &Constraint, what: &str, n: usize, format: CallFormat) -> Result<Vec<Guide>> {
        check_patterns(c, what)?;
        let grammar = c.grammar(format, what)?;
        let parser = self.factory.create_parser(grammar).map_err(|e| Error::Input {
            what: what.into(),
            message: format!("cannot be compiled: {}", describe(c, &e.to_string())),
        })?;
        let m = Matcher::new(Ok(parser)).into_cancellable();
        if let Some(e) = m.get_error() {
            return Err(Error::Input {
                what: what.into(),
                message: format!("cannot be compiled: {}", describe(c, &e)),
            });
        }
        let mut first = Guide { m, what: what.to_string(), ready: None, hint: costly(c) };
        first.prime(c)?;
        let mut all = Vec::with_capacity(n);
        for _ in 1..n {
            all.push(Guide {
                m: first.m.deep_clone(),
                what: first.what.clone(),
                ready: first.ready.clone(),
                hint: first.hint.clone(),
            });
        }
        all.insert(0, first);
        Ok(all)
    }
}

/// Runs `f` on `m`, cancelling it past `limit` (a watchdog thread sets the matcher's cancellation
/// flag, which llguidance checks as it works). Returns `f`'s result and whether it ran over.
fn within<T>(m: &mut Matcher, limit: Duration, f: impl FnOnce(&mut Matcher) -> T) -> (T, bool) {
    let Some(handle) = m.cancellation_handle() else { return (f(m), false) };
    let (done, wait) = mpsc::channel::<()>();
    let watchdog = std::thread::spawn(move || {
        if wait.recv_timeout(limit) == Err(mpsc::RecvTimeoutError::Timeout) {
            handle.cancel();
            return true;
        }
        false
    });
    let out = f(m);
    drop(done);
    let over = watchdog.join().unwrap_or(false);
    (out, over)
}

/// llguidance's error as one line a client can act on, naming the failing part of `c` where the
/// library's reason allows.
fn describe(c: &Constraint, e: &str) -> String {
    let line = first_line(e);
    if line.contains("NoExtensionBias") || line.contains("no extension") {
        if !matches!(c, Constraint::JsonSchema(_) | Constraint::ToolCalls { .. }) {
            return "no token can begin a valid answer: the grammar admits no finite text".into();
        }
        return "no token can begin a valid answer: the schema has no finite instance (a `$ref` cycle with no way out, or alternatives that all require themselves)".into();
    }
    if line.to_ascii_lowercase().contains("lexer") || line.contains("fuel") || line.contains("too many") {
        return format!("too costly to match{}: {line}", costly(c));
    }
    line
}

/// " (patterns at ...)" naming the schema's patterns, the usual cause of a costly grammar.
fn costly(c: &Constraint) -> String {
    let patterns = patterns_of(c);
    if patterns.is_empty() {
        String::new()
    } else {
        format!(" (patterns at {})", patterns.join(", "))
    }
}

fn first_line(s: &str) -> String {
    s.lines().next().unwrap_or(s).to_string()
}

/// One answer's constraint state: the matcher and, when computed ahead, the mask of the next
/// token.
pub struct Guide {
    m: Matcher,
    /// The request field named in errors (`response_format`, `tool_choice`).
    what: String,
    ready: Option<SimpleVob>,
    /// " (patterns at ...)" for errors of a costly grammar.
    hint: String,
}

impl Guide {
    /// Computes the first mask within `MASK_TIME_LIMIT`, keeping it for the first pick.
    fn prime(&mut self, c: &Constraint) -> Result<()> {
        let (r, over) = within(&mut self.m, MASK_TIME_LIMIT, Matcher::compute_mask);
        if over {
            return Err(Error::Input {
                what: self.what.clone(),
                message: format!(
                    "too costly to match{}: the first token mask took longer than {} s",
                    costly(c),
                    MASK_TIME_LIMIT.as_secs_f64()
                ),
            });
        }
        match r {
            Ok(mask) => {
                self.ready = Some(mask);
                Ok(())
            }
            Err(e) => Err(Error::Input { what: self.what.clone(), message: describe(c, &e.to_string()) }),
        }
    }

    /// The tokens allowed next (a bit set over the vocabulary: token t is bit t % 32 of word
    /// t / 32): the one computed ahead, else computed now.
    pub fn mask(&mut self) -> Result<SimpleVob> {
        if let Some(m) = self.ready.take() {
            return Ok(m);
        }
        let (what, hint) = (self.what.clone(), self.hint.clone());
        self.m.compute_mask().map_err(|e| failed(&what, &format!("{}{hint}", first_line(&e.to_string()))))
    }

    /// Takes the picked token.
    pub fn consume(&mut self, token: u32) -> Result<()> {
        self.ready = None;
        let what = self.what.clone();
        self.m.consume_token(token).map(|_| ()).map_err(|e| failed(&what, &e.to_string()))
    }

    /// The tokens the grammar forces next (llguidance's fast-forward tokens, in the tokenizer's
    /// canonical tokenization), consumed: the answer writes them without sampling. Empty when
    /// the next token is a choice.
    pub fn take_forced(&mut self) -> Result<Vec<u32>> {
        self.ready = None;
        let forced = self.m.consume_ff_tokens();
        if let Some(e) = self.m.get_error() {
            return Err(failed(&self.what, &e));
        }
        Ok(forced)
    }

    /// The grammar can go no further: the answer is complete.
    pub fn is_done(&self) -> bool {
        self.m.is_stopped()
    }

    /// Computes the next mask on a thread of its own (beside the forward pass); the guide comes
    /// back with it.
    pub fn next_mask(mut self) -> MaskTask {
        let cancel = self.m.cancellation_handle();
        let (tx, rx) = mpsc::channel();
        let spawned = std::thread::Builder::new().name("vl-mask".into()).spawn(move || {
            let r = self.mask();
            if let Ok(m) = &r {
                self.ready = Some(m.clone());
            }
            let _ = tx.send((self, r.map(|_| ())));
        });
        let error = spawned.err().map(|e| e.to_string());
        MaskTask { rx, result: None, cancel, started: Instant::now(), error }
    }
}

/// A mask being computed beside the forward pass.
pub struct MaskTask {
    rx: mpsc::Receiver<(Guide, Result<()>)>,
    result: Option<(Guide, Result<()>)>,
    cancel: Option<CancellationHandle>,
    started: Instant,
    /// The thread could not be started.
    error: Option<String>,
}

impl MaskTask {
    /// Whether the mask is computed (or the computation failed, or ran past `MASK_TIME_LIMIT`).
    pub fn ready(&mut self) -> bool {
        if self.result.is_none() {
            if let Ok(r) = self.rx.try_recv() {
                self.result = Some(r);
            }
        }
        self.result.is_some() || self.error.is_some() || self.started.elapsed() > MASK_TIME_LIMIT
    }

    /// The guide, its next mask computed; an error naming the field when the computation failed
    /// or ran past `MASK_TIME_LIMIT` (then it is cancelled).
    pub fn finish(mut self, what: &str) -> Result<Guide> {
        if let Some(e) = self.error.take() {
            return Err(failed(what, &format!("cannot start a mask thread: {e}")));
        }
        self.ready();
        let result = self.result.take();
        if result.is_some() {
            // Done: dropping the task must not cancel the guide it hands back.
            self.cancel = None;
        }
        match result {
            Some((guide, Ok(()))) => Ok(guide),
            Some((_, Err(e))) => Err(e),
            None => Err(Error::Input {
                what: what.into(),
                message: format!(
                    "a token mask took longer than {} s: too costly to match",
                    MASK_TIME_LIMIT.as_secs_f64()
                ),
            }),
        }
    }
}

impl Drop for MaskTask {
    fn drop(&mut self) {
        // Abandoned before its result came: the computation stops at llguidance's next check.
        if self.result.is_none() {
            if let Some(c) = &self.cancel {
                c.cancel();
            }
        }
    }
}

fn failed(what: &str, message: &str) -> Error {
    Error::Input { what: what.into(), message: format!("constrained decoding failed: {}", first_line(message)) }
}
