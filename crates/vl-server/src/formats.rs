//! The answer's format as a client sets it: `response_format` (JSON schema, JSON object, and
//! ours: regex, choice, grammar), vLLM's `structured_outputs`, llama-server's `grammar` and
//! `json_schema`, SGLang's `regex` and `ebnf`, each read into the engine's `Constraint` with
//! errors naming the field.

use serde_json::Value;
use vl_models::constraint::{GrammarSyntax, MAX_SCHEMA_BYTES};
use vl_models::engine::Constraint;

use crate::error::ApiError;
use crate::openai::ChatCompletionRequest;

/// The top-level fields besides `response_format` that set the answer's format.
pub(crate) const FIELDS: [&str; 5] = ["structured_outputs", "grammar", "json_schema", "regex", "ebnf"];

/// The answer's format and the field that set it: `response_format`, vLLM's
/// `structured_outputs`, llama-server's `grammar` / `json_schema`, or SGLang's `regex` / `ebnf`.
/// Two of them at once are refused, naming both.
pub(crate) fn format_constraint(v: &ChatCompletionRequest) -> Result<Option<(Constraint, String)>, ApiError> {
    let mut found: Vec<(Constraint, String)> = vec![];
    let given = |x: &Option<Value>| x.as_ref().filter(|x| !x.is_null()).cloned();
    if let Some(c) = response_format(v.response_format.as_ref())? {
        found.push((c, "response_format".into()));
    }
    if let Some(so) = given(&v.structured_outputs) {
        found.push(structured_outputs(&so)?);
    }
    if let Some(g) = given(&v.grammar) {
        let Some(text) = g.as_str() else {
            return Err(ApiError::bad("`grammar` must be a string: a GBNF grammar (llama-server's field)"));
        };
        found.push((grammar_text(text, "grammar")?, "grammar".into()));
    }
    if let Some(s) = given(&v.json_schema) {
        found.push((schema_value(&s, "json_schema")?, "json_schema".into()));
    }
    if let Some(r) = given(&v.regex) {
        let Some(rx) = r.as_str() else { return Err(ApiError::bad("`regex` must be a string")) };
        found.push((Constraint::Regex(rx.to_string()), "regex".into()));
    }
    if let Some(g) = given(&v.ebnf) {
        let Some(text) = g.as_str() else { return Err(ApiError::bad("`ebnf` must be a string: a GBNF grammar")) };
        found.push((grammar_text(text, "ebnf")?, "ebnf".into()));
    }
    if found.len() > 1 {
        return Err(ApiError::bad(format!(
            "`{}` and `{}` both constrain the answer: send one",
            found[1].1, found[0].1
        )));
    }
    Ok(found.pop())
}

/// A grammar's text: GBNF (`root ::= ...`) or, when no line defines a rule with `::=` or the
/// text begins with `%llguidance`, llguidance's Lark; `at` names the field.
fn grammar_text(text: &str, at: &str) -> Result<Constraint, ApiError> {
    if text.trim().is_empty() {
        return Err(ApiError::bad(format!("`{at}` is empty")));
    }
    Ok(Constraint::Grammar { text: text.to_string(), syntax: GrammarSyntax::detect(text) })
}

/// A JSON schema given as an object, a boolean, or JSON text (vLLM takes either); `at` names
/// the field.
fn schema_value(s: &Value, at: &str) -> Result<Constraint, ApiError> {
    let schema = match s {
        Value::String(text) => {
            serde_json::from_str::<Value>(text).map_err(|e| ApiError::bad(format!("`{at}` is not valid JSON: {e}")))?
        }
        other => other.clone(),
    };
    if !schema.is_object() && !schema.is_boolean() {
        return Err(ApiError::bad(format!("`{at}` must be a JSON schema (an object)")));
    }
    schema_within_limit(&schema, &format!("`{at}`"))?;
    Ok(Constraint::JsonSchema(schema))
}

/// A list of choices: non-empty strings.
fn choices(v: &Value, at: &str) -> Result<Constraint, ApiError> {
    let list = v
        .as_array()
        .filter(|a| !a.is_empty())
        .ok_or_else(|| ApiError::bad(format!("`{at}` must be a non-empty list of strings")))?;
    let mut out = Vec::with_capacity(list.len());
    for (i, c) in list.iter().enumerate() {
        match c.as_str() {
            Some(s) if !s.is_empty() => out.push(s.to_string()),
            _ => return Err(ApiError::bad(format!("`{at}[{i}]` must be a non-empty string"))),
        }
    }
    Ok(Constraint::Choice(out))
}

/// vLLM's `structured_outputs`: exactly one of `json` (a schema, or its text), `regex`,
/// `choice`, `grammar` (GBNF or Lark, as `grammar_text` tells) and `json_object: true`;
/// `disable_fallback` is accepted (there is no other backend to fall back to). vLLM's other
/// options would change the answer and are refused by name.
fn structured_outputs(so: &Value) -> Result<(Constraint, String), ApiError> {
    let Some(o) = so.as_object() else {
        return Err(ApiError::bad("`structured_outputs` must be an object such as {\"regex\": ...}"));
    };
    const KINDS: [&str; 5] = ["json", "regex", "choice", "grammar", "json_object"];
    for (k, x) in o {
        if KINDS.contains(&k.as_str()) || x.is_null() {
            continue;
        }
        match k.as_str() {
            "disable_fallback" if x.is_boolean() => {}
            "disable_fallback" => return Err(ApiError::bad("`structured_outputs.disable_fallback` must be a boolean")),
            "disable_any_whitespace" | "disable_additional_properties" | "whitespace_pattern" | "structural_tag" => {
                return Err(ApiError::bad(format!(
                    "`structured_outputs.{k}` is not supported: whitespace is bounded and objects closed as docs/serving.md says"
                )))
            }
            _ => return Err(ApiError::bad(format!("`structured_outputs.{k}` is not a known field"))),
        }
    }
    let set: Vec<&str> =
        KINDS.iter().copied().filter(|k| o.get(*k).is_some_and(|x| !x.is_null() && *x != Value::Bool(false))).collect();
    let kind = match set.as_slice() {
        [one] => *one,
        [] => {
            return Err(ApiError::bad(
                "`structured_outputs` must set one of `json`, `regex`, `choice`, `grammar`, `json_object`",
            ))
        }
        [a, b, ..] => {
            return Err(ApiError::bad(format!(
                "`structured_outputs.{b}` and `structured_outputs.{a}` both constrain the answer: set one"
            )))
        }
    };
    let at = format!("structured_outputs.{kind}");
    let x = &o[kind];
    let c = match kind {
        "json" => schema_value(x, &at)?,
        "regex" => match x.as_str() {
            Some(rx) => Constraint::Regex(rx.to_string()),
            None => return Err(ApiError::bad(format!("`{at}` must be a string"))),
        },
        "choice" => choices(x, &at)?,
        "grammar" => match x.as_str() {
            Some(text) => grammar_text(text, &at)?,
            None => return Err(ApiError::bad(format!("`{at}` must be a string"))),
        },
        _ if *x == Value::Bool(true) => Constraint::JsonObject,
        _ => return Err(ApiError::bad(format!("`{at}` must be a boolean"))),
    };
    Ok((c, at))
}

/// `response_format`: `{"type": "text"}`, `{"type": "json_object"}` (with llama-server's
/// `schema` beside it or not), `{"type": "json_schema", "json_schema": {"name", "schema",
/// "strict", "description"}}`, and ours for the other grammars: `{"type": "regex", "regex"}`,
/// `{"type": "choice", "choice": [...]}`, `{"type": "grammar", "grammar", "syntax": "lark" |
/// "gbnf"}` (`syntax` told from the text when absent).
fn response_format(f: Option<&Value>) -> Result<Option<Constraint>, ApiError> {
    let Some(f) = f.filter(|f| !f.is_null()) else { return Ok(None) };
    // `at` is the path under `response_format` the message begins with.
    let bad = |at: &str, m: &str| Err(ApiError::bad(format!("`response_format{at}`{m}")));
    let Some(o) = f.as_object() else { return bad("", " must be an object with a `type`") };
    let kind = o.get("type").and_then(Value::as_str);
    if o.contains_key("schema") && kind != Some("json_object") {
        return bad(
            ".schema",
            " goes with type \"json_object\" (llama-server's shape); json_schema takes `json_schema.schema`",
        );
    }
    let keys: &[&str] = match kind {
        Some("json_object") => &["type", "schema"],
        Some("json_schema") => &["type", "json_schema"],
        Some("regex") => &["type", "regex"],
        Some("choice") => &["type", "choice"],
        Some("grammar") => &["type", "grammar", "syntax"],
        _ => &["type"],
    };
    if let Some(k) = o.keys().find(|k| !keys.contains(&k.as_str())) {
        return bad(&format!(".{k}"), " is not a known field");
    }
    match kind {
        Some("text") => Ok(None),
        // llama-server's shape (and older instructor's): a JSON object held to `schema`.
        Some("json_object") => match o.get("schema").filter(|s| !s.is_null()) {
            None => Ok(Some(Constraint::JsonObject)),
            Some(schema) if schema.is_object() || schema.is_boolean() => {
                schema_within_limit(schema, "`response_format.schema`")?;
                Ok(Some(Constraint::JsonSchema(schema.clone())))
            }
            Some(_) => bad(".schema", " must be a JSON schema (an object)"),
        },
        Some("json_schema") => {
            let Some(js) = o.get("json_schema").and_then(Value::as_object) else {
                return bad(".json_schema", " must be an object with `name` and `schema`");
            };
            if let Some(k) = js.keys().find(|k| !["name", "schema", "strict", "description"].contains(&k.as_str())) {
                return bad(&format!(".json_schema.{k}"), " is not a known field");
            }
            if js.get("name").and_then(Value::as_str).is_none() {
                return bad(".json_schema.name", " must be a string");
            }
            if js.get("strict").is_some_and(|s| !s.is_boolean() && !s.is_null()) {
                return bad(".json_schema.strict", " must be a boolean");
            }
            // No schema: any JSON value.
            let schema = js.get("schema").cloned().unwrap_or(Value::Object(Default::default()));
            if !schema.is_object() && !schema.is_boolean() {
                return bad(".json_schema.schema", " must be a JSON schema (an object)");
            }
            schema_within_limit(&schema, "`response_format.json_schema.schema`")?;
            Ok(Some(Constraint::JsonSchema(schema)))
        }
        Some("regex") => match o.get("regex").and_then(Value::as_str) {
            Some(rx) => Ok(Some(Constraint::Regex(rx.to_string()))),
            None => bad(".regex", " must be a string (the regular expression the answer matches)"),
        },
        Some("choice") => Ok(Some(choices(o.get("choice").unwrap_or(&Value::Null), "response_format.choice")?)),
        Some("grammar") => {
            let Some(text) = o.get("grammar").and_then(Value::as_str) else {
                return bad(".grammar", " must be a string (a Lark or GBNF grammar)");
            };
            let syntax = match o.get("syntax").filter(|s| !s.is_null()) {
                None => GrammarSyntax::detect(text),
                Some(s) if s == "lark" => GrammarSyntax::Lark,
                Some(s) if s == "gbnf" => GrammarSyntax::Gbnf,
                Some(s) => return bad(".syntax", &format!(" = {s} is not one of \"lark\", \"gbnf\"")),
            };
            if text.trim().is_empty() {
                return bad(".grammar", " is empty");
            }
            Ok(Some(Constraint::Grammar { text: text.to_string(), syntax }))
        }
        Some(t) => bad(
            ".type",
            &format!(
                " = {t:?} is not one of \"text\", \"json_object\", \"json_schema\", \"regex\", \"choice\", \"grammar\""
            ),
        ),
        None => bad(".type", " must be a string"),
    }
}

/// Refuses a schema over `MAX_SCHEMA_BYTES` of JSON text; `what` names it.
pub(crate) fn schema_within_limit(schema: &Value, what: &str) -> Result<(), ApiError> {
    let size = schema.to_string().len();
    if size > MAX_SCHEMA_BYTES {
        return Err(ApiError::bad(format!("{what} is {size} bytes, over the limit of {MAX_SCHEMA_BYTES}")));
    }
    Ok(())
}
