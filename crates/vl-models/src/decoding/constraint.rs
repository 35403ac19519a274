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

use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{CancellationHandle, Matcher, ParserFactory};
use serde_json::{json, Value};
use tokenizers::Tokenizer;

use crate::error::{Error, Result};

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
}

impl Constraint {
    /// The llguidance grammar; tool calls in `format`.
    fn grammar(&self, format: CallFormat) -> Result<TopLevelGrammar> {
        if let (Constraint::ToolCalls { functions, one }, CallFormat::Xml) = (self, format) {
            return xml_calls(functions, *one);
        }
        Ok(match self {
            Constraint::JsonObject => TopLevelGrammar::from_json_schema(with_whitespace(json!({"type": "object"}))),
            Constraint::JsonSchema(schema) => {
                TopLevelGrammar::from_json_schema(with_whitespace(closed_objects(schema.clone())))
            }
            Constraint::ToolCalls { functions, one } => {
                if functions.is_empty() {
                    return Err(Error::Input { what: "tool_choice".into(), message: "no function to call".into() });
                }
                let calls: Vec<Value> = functions
                    .iter()
                    .map(|(name, params)| {
                        json!({
                            "type": "object",
                            "properties": {"name": {"const": name}, "arguments": closed_objects(params.clone())},
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

/// Calls in Qwen3.5's XML form, as its template writes one: `<tool_call>\n<function=NAME>\n`,
/// then for each parameter of the function's schema in its order (the required ones always,
/// the others optionally) `<parameter=P>\n` VALUE `\n</parameter>\n`, then
/// `</function>\n</tool_call>`. A string parameter's value is text without `<` (of the schema's
/// `minLength` to `maxLength` characters); any other is JSON valid against its schema (objects
/// closed as in `closed_objects`).
fn xml_calls(functions: &[(String, Value)], one: bool) -> Result<TopLevelGrammar> {
    if functions.is_empty() {
        return Err(Error::Input { what: "tool_choice".into(), message: "no function to call".into() });
    }
    let lit = |s: &str| serde_json::to_string(s).unwrap_or_default();
    let mut rules = String::new();
    let mut alts = vec![];
    for (f, (name, params)) in functions.iter().enumerate() {
        let props: Vec<(String, Value)> = params
            .get("properties")
            .and_then(Value::as_object)
            .map(|m| m.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
            .unwrap_or_default();
        let required: Vec<&str> =
            params.get("required").and_then(Value::as_array).into_iter().flatten().filter_map(Value::as_str).collect();
        let mut body = vec![lit(&format!("{name}>\n"))];
        for (p, (pname, schema)) in props.iter().enumerate() {
            let rule = format!("f{f}_p{p}");
            let open = lit(&format!("<parameter={pname}>\n"));
            let is_string = schema.get("type").and_then(Value::as_str) == Some("string")
                && !schema.as_object().is_some_and(|o| o.contains_key("enum") || o.contains_key("const"));
            let value = if is_string {
                // The schema's length bounds, in characters.
                let n = |k: &str| schema.get(k).and_then(Value::as_u64);
                let count = match (n("minLength"), n("maxLength")) {
                    (None, None) => "*".to_string(),
                    (min, max) => {
                        format!("{{{},{}}}", min.unwrap_or(0), max.map(|m| m.to_string()).unwrap_or_default())
                    }
                };
                format!(r#"/[^<]{count}\n<\/parameter>\n/"#)
            } else {
                let mut s = closed_objects(schema.clone());
                if let Some(o) = s.as_object_mut() {
                    o.insert(
                        "x-guidance".into(),
                        json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
                    );
                }
                format!("%json {s} \"\\n</parameter>\\n\"")
            };
            rules.push_str(&format!("{rule}: {open} {value}\n"));
            body.push(if required.contains(&pname.as_str()) { rule } else { format!("{rule}?") });
        }
        rules.push_str(&format!("f{f}: {}\n", body.join(" ")));
        alts.push(format!("f{f}"));
    }
    let repeat = if one { "" } else { r#" ("\n" call)*"# };
    Ok(TopLevelGrammar::from_lark(format!(
        "start: call{repeat}\ncall: \"<tool_call>\\n<function=\" ({}) \"</function>\\n</tool_call>\"\n{rules}",
        alts.join(" | ")
    )))
}

/// Most nesting levels `closed_objects` walks (deeper schemas stay as they are there; serde_json
/// parses at most 128 levels anyway).
const CLOSE_DEPTH: usize = 128;

/// The schema with its objects closed unless it opens them, as llama.cpp's converter and
/// xgrammar's strict mode do: an object schema that lists `properties` and has none of
/// `additionalProperties`, `patternProperties`, `unevaluatedProperties` takes
/// `additionalProperties: false`, so the answer has exactly the keys the schema declares rather
/// than more until `max_tokens` (plain Pydantic models send such schemas). An object schema
/// without `properties` (`{"type": "object"}`, a free-form dictionary) stays open; so do object
/// schemas whose keys other keywords beside `properties` may add (`allOf`, `anyOf`, `oneOf`,
/// `$ref`, `if` / `then` / `else`, `dependentSchemas`, `dependencies`) and the schemas that
/// declare part of one object's keys (an `allOf` member, `then`, `else`, a `dependentSchemas`
/// value): their nested schemas are closed, not they. Nested schemas are walked under
/// `properties`, `patternProperties`, `additionalProperties`, `items`, `prefixItems`, `anyOf`,
/// `oneOf`, `allOf`, `$defs`, `definitions`, `then` / `else` and the like, each node once, at
/// most `CLOSE_DEPTH` deep (the schema is at most `MAX_SCHEMA_BYTES`). A condition (`if`) or a
/// negation (`not`) is left as written: closing an object there would not narrow what the schema
/// admits.
fn closed_objects(mut schema: Value) -> Value {
    /// `part`: `v` declares part of an object's keys, other schemas the rest.
    fn close(v: &mut Value, depth: usize, part: bool) {
        let Some(o) = v.as_object_mut() else { return };
        if depth > CLOSE_DEPTH {
            return;
        }
        let has = |keys: &[&str]| keys.iter().any(|k| o.contains_key(*k));
        let opened = has(&["additionalProperties", "patternProperties", "unevaluatedProperties"]);
        let composed =
            has(&["allOf", "anyOf", "oneOf", "$ref", "if", "then", "else", "dependentSchemas", "dependencies"]);
        if o.contains_key("properties") && !opened && !composed && !part {
            o.insert("additionalProperties".into(), Value::Bool(false));
        }
        for (k, sub) in o.iter_mut() {
            match k.as_str() {
                // Maps of names to schemas.
                "properties" | "patternProperties" | "$defs" | "definitions" | "dependentSchemas" => {
                    let part = k == "dependentSchemas";
                    if let Some(m) = sub.as_object_mut() {
                        m.values_mut().for_each(|s| close(s, depth + 1, part));
                    }
                }
                // A schema, or (`items` of draft 4) a list of them.
                "items" | "prefixItems" | "anyOf" | "oneOf" | "allOf" => {
                    let part = k == "allOf";
                    match sub {
                        Value::Array(a) => a.iter_mut().for_each(|s| close(s, depth + 1, part)),
                        s => close(s, depth + 1, false),
                    }
                }
                "then" | "else" => close(sub, depth + 1, true),
                "additionalProperties"
                | "unevaluatedProperties"
                | "additionalItems"
                | "unevaluatedItems"
                | "contains" => close(sub, depth + 1, false),
                _ => {}
            }
        }
    }
    close(&mut schema, 0, false);
    schema
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

    /// `n` matchers for the answers of one request, each holding its first token mask: the
    /// grammar compiled once, its first mask computed once in this thread (within
    /// `MASK_TIME_LIMIT`), then copied. `what` names the request field in errors; a grammar that
    /// cannot be compiled, that admits no answer, or whose mask is too costly is refused here,
    /// naming `what` and the failing part.
    pub fn guides(&self, c: &Constraint, what: &str, n: usize, format: CallFormat) -> Result<Vec<Guide>> {
        check_patterns(c, what)?;
        let grammar = c.grammar(format)?;
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

/// Every regular expression of a schema constraint (`pattern` values and `patternProperties`
/// keys), with its JSON pointer (a tool's prefixed by its name).
fn all_patterns(c: &Constraint) -> Vec<(String, String)> {
    fn pointer(at: &str, k: &str) -> String {
        format!("{at}/{}", k.replace('~', "~0").replace('/', "~1"))
    }
    fn walk(v: &Value, at: &str, out: &mut Vec<(String, String)>) {
        match v {
            Value::Object(o) => {
                for (k, v) in o {
                    let here = pointer(at, k);
                    match (k.as_str(), v) {
                        ("pattern", Value::String(p)) => out.push((here, p.clone())),
                        ("patternProperties", Value::Object(props)) => {
                            for (p, sub) in props {
                                out.push((pointer(&here, p), p.clone()));
                                walk(sub, &pointer(&here, p), out);
                            }
                        }
                        _ => walk(v, &here, out),
                    }
                }
            }
            Value::Array(a) => a.iter().enumerate().for_each(|(i, v)| walk(v, &format!("{at}/{i}"), out)),
            _ => {}
        }
    }
    let mut out = Vec::new();
    match c {
        Constraint::JsonSchema(s) => walk(s, "#", &mut out),
        Constraint::ToolCalls { functions, .. } => {
            for (name, params) in functions {
                walk(params, &format!("{name}#"), &mut out);
            }
        }
        Constraint::JsonObject => {}
    }
    out
}

/// JSON pointers of the first few patterns of a schema constraint.
fn patterns_of(c: &Constraint) -> Vec<String> {
    all_patterns(c).into_iter().take(3).map(|(at, _)| at).collect()
}

/// Refuses a pattern that spells out more than `MAX_PATTERN_EXPANSION` characters, naming it.
/// The pattern is read as llguidance reads it (its rewrite first: `\w`, `\d` as ASCII classes);
/// one that cannot be read cannot be bounded, so it is refused too.
fn check_patterns(c: &Constraint, what: &str) -> Result<()> {
    for (at, p) in all_patterns(c) {
        let rewritten = llguidance::regex_to_lark(&p, "dw");
        let parsed = regex_syntax::ParserBuilder::new().nest_limit(256).build().parse(&rewritten);
        let hir = match parsed {
            Ok(h) => h,
            Err(e) => {
                let e = e.to_string();
                let reason = e.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("unreadable").trim();
                return Err(Error::Input {
                    what: what.into(),
                    message: format!("the pattern at {at} cannot be read: {reason}"),
                });
            }
        };
        let n = expansion(&hir);
        if n > MAX_PATTERN_EXPANSION {
            return Err(Error::Input {
                what: what.into(),
                message: format!(
                    "the pattern at {at} spells out up to {n} characters through its counted repetitions, more than {MAX_PATTERN_EXPANSION}: too costly to match"
                ),
            });
        }
    }
    Ok(())
}

/// Characters a regular expression spells out at most, counting a counted repetition's
/// maximum (its minimum when unbounded: a loop costs one pass), an alternation's longest branch,
/// saturating. A counted repetition of a body of variable length counts its maximum twice
/// (`(.{0,50}){0,100}` is 500,000, not 5,000): the lexer tells apart every way the body's runs
/// can split the text, which grows with both counts.
fn expansion(h: &regex_syntax::hir::Hir) -> u64 {
    use regex_syntax::hir::HirKind;
    match h.kind() {
        HirKind::Empty | HirKind::Look(_) => 0,
        HirKind::Literal(l) => std::str::from_utf8(&l.0).map_or(l.0.len(), |s| s.chars().count()) as u64,
        HirKind::Class(_) => 1,
        HirKind::Repetition(r) => {
            let times = r.max.unwrap_or(r.min).max(1) as u64;
            let variable = fixed_chars(&r.sub).is_none();
            let body = expansion(&r.sub).max(1).saturating_mul(times);
            if variable && times > 1 {
                body.saturating_mul(times)
            } else {
                body
            }
        }
        HirKind::Capture(c) => expansion(&c.sub),
        HirKind::Concat(v) => v.iter().fold(0u64, |a, h| a.saturating_add(expansion(h))),
        HirKind::Alternation(v) => v.iter().map(expansion).max().unwrap_or(0),
    }
}

/// The characters every match of `h` spells, when all its matches have the same count.
fn fixed_chars(h: &regex_syntax::hir::Hir) -> Option<u64> {
    use regex_syntax::hir::HirKind;
    match h.kind() {
        HirKind::Empty | HirKind::Look(_) => Some(0),
        HirKind::Literal(l) => Some(std::str::from_utf8(&l.0).map_or(l.0.len(), |s| s.chars().count()) as u64),
        HirKind::Class(_) => Some(1),
        HirKind::Repetition(r) if r.max == Some(r.min) => fixed_chars(&r.sub).map(|n| n.saturating_mul(r.min as u64)),
        HirKind::Repetition(_) => None,
        HirKind::Capture(c) => fixed_chars(&c.sub),
        HirKind::Concat(v) => v.iter().try_fold(0u64, |a, h| fixed_chars(h).map(|n| a.saturating_add(n))),
        HirKind::Alternation(v) => {
            let first = fixed_chars(v.first()?)?;
            v.iter().all(|h| fixed_chars(h) == Some(first)).then_some(first)
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn with_pattern(p: &str) -> Constraint {
        Constraint::JsonSchema(json!({"type": "object", "properties": {"s": {"type": "string", "pattern": p}}}))
    }

    #[test]
    fn objects_are_closed_unless_the_schema_opens_them() {
        let schema = json!({
            "type": "object",
            "properties": {
                "a": {"type": "object", "properties": {"x": {"type": "integer"}}},
                "free": {"type": "object"},
                "map": {"type": "object", "additionalProperties": {"type": "object", "properties": {"y": {}}}},
                "pat": {"type": "object", "properties": {"p": {}}, "patternProperties": {"^q": {}}},
                "list": {"type": "array", "items": {"properties": {"i": {}}}},
                "tuple": {"type": "array", "prefixItems": [{"properties": {"t": {}}}]},
                "either": {"anyOf": [{"$ref": "#/$defs/D"}, {"type": "null"}]},
                "both": {"allOf": [{"properties": {"b1": {}}}, {"properties": {"b2": {"properties": {"c": {}}}}}]},
                "properties": {"type": "object", "properties": {"items": {"properties": {"k": {}}}}},
                "neg": {"not": {"properties": {"n": {}}}},
                "cond": {"if": {"properties": {"f": {}}}, "then": {"properties": {"g": {"properties": {}}}}},
            },
            "$defs": {"D": {"type": "object", "properties": {"d": {}}}},
            "definitions": {"E": {"properties": {"e": {}}, "unevaluatedProperties": false}},
        });
        let c = closed_objects(schema);
        let closed = |ptr: &str| c.pointer(ptr).unwrap_or_else(|| panic!("{ptr}")).get("additionalProperties").cloned();
        for ptr in [
            "",
            "/properties/a",
            "/properties/map/additionalProperties",
            "/properties/list/items",
            "/properties/tuple/prefixItems/0",
            "/properties/both/allOf/1/properties/b2",
            "/properties/properties",
            "/properties/properties/properties/items",
            "/properties/cond/then/properties/g",
            "/$defs/D",
        ] {
            assert_eq!(closed(ptr), Some(json!(false)), "{ptr}: {c}");
        }
        // Open: free-form, opened by the schema, composed, a part of an object, a condition or a
        // negation.
        for ptr in [
            "/properties/free",
            "/properties/pat",
            "/properties/both/allOf/0",
            "/properties/cond/if",
            "/properties/cond/then",
            "/properties/neg/not",
            "/definitions/E",
        ] {
            assert!(closed(ptr).is_none(), "{ptr}: {c}");
        }
        assert_eq!(c.pointer("/properties/map/additionalProperties/type"), Some(&json!("object")));
        // Past the depth bound the schema stays as it is.
        let mut deep = json!({"properties": {"x": {}}});
        for _ in 0..200 {
            deep = json!({"properties": {"x": deep}});
        }
        let c = closed_objects(deep);
        assert_eq!(c["additionalProperties"], json!(false));
        let mut at = &c;
        let mut depth = 0;
        while let Some(next) = at.get("properties").and_then(|p| p.get("x")) {
            at = next;
            depth += 1;
        }
        assert!(depth >= 200 && at.get("additionalProperties").is_none());
    }

    #[test]
    fn ordinary_patterns_pass_and_costly_ones_are_refused_by_pointer() {
        for p in [
            r"^\d{4}-\d{2}-\d{2}$",
            r"^[\w.+-]+@[\w-]+\.[\w.-]+$",
            r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$",
            r"^[a-zA-Z0-9_-]{1,64}$",
            r".{0,5000}",
            r"^(\d{1,3}\.){3}\d{1,3}$",
            r"^(a{99}){100}$",
            r"^(a|b){9000}$",
            r"^é{6000}$",
        ] {
            check_patterns(&with_pattern(p), "response_format").unwrap_or_else(|e| panic!("{p}: {e}"));
        }
        for (p, n) in [
            (r"^(a{1000}){1000}$", "1000000"),
            (r"^(a{300}){300}[\w-.]?$", "90001"),
            (r"^(.{0,50}){0,100}$", "500000"),
            (r"^(ab|cd){5001}$", "10002"),
        ] {
            let e = check_patterns(&with_pattern(p), "response_format").unwrap_err().to_string();
            assert!(e.contains("#/properties/s/pattern") && e.contains(n), "{p}: {e}");
        }
        let e = check_patterns(&with_pattern(r"^(a"), "tool_choice").unwrap_err().to_string();
        assert!(e.starts_with("tool_choice: the pattern at #/properties/s/pattern cannot be read"), "{e}");
    }
}
