//! JSON schemas as the constraint compiles them (objects closed unless opened, whitespace
//! bounded) and tool calls in Qwen3.5's XML form.

use serde_json::{json, Value};

use super::WHITESPACE;
use crate::error::{Error, Result};
use llguidance::api::TopLevelGrammar;

/// Calls in the JSON form (Qwen3-VL's template): `<tool_call>\n{"name": ..., "arguments":
/// {...}}\n</tool_call>`, written with the template's separators (Python's `json.dumps`) and no
/// other whitespace; one call when `one`, else calls separated by a newline.
pub(super) fn json_calls(functions: &[(String, Value)], one: bool) -> Result<TopLevelGrammar> {
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
    call["x-guidance"] = json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "});
    let repeat = if one { "" } else { r#" ("\n" call)*"# };
    Ok(TopLevelGrammar::from_lark(format!(
        "start: call{repeat}\ncall: \"<tool_call>\\n\" %json {call} \"\\n</tool_call>\"\n"
    )))
}

/// Calls in Qwen3.5's XML form, as its template writes one: `<tool_call>\n<function=NAME>\n`,
/// then for each parameter of the function's schema in its order (the required ones always,
/// the others optionally) `<parameter=P>\n` VALUE `\n</parameter>\n`, then
/// `</function>\n</tool_call>`. A string parameter's value is text without `<` (of the schema's
/// `minLength` to `maxLength` characters); any other is JSON valid against its schema (objects
/// closed as in `closed_objects`).
pub(super) fn xml_calls(functions: &[(String, Value)], one: bool) -> Result<TopLevelGrammar> {
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
pub(super) fn closed_objects(mut schema: Value) -> Value {
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
pub(super) fn with_whitespace(mut schema: Value) -> Value {
    if let Some(o) = schema.as_object_mut() {
        o.entry("x-guidance").or_insert_with(|| json!({"whitespace_pattern": WHITESPACE}));
    }
    schema
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
