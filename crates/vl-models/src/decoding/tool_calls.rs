//! Tool calling around a chat template: transformers' `tojson` filter (Python's `json.dumps`,
//! which templates use to print function definitions), the two `<tool_call>` text formats that
//! Qwen models write (Qwen3-VL's `{json}`, the "hermes" format of vLLM and llama.cpp; Qwen3.5's
//! XML `<function=NAME>` with `<parameter=P>` blocks, the Qwen3-Coder format), and a streaming
//! filter that holds generated text back from the first call on.

use std::io::Write;

use minijinja::value::{Kwargs, Value};
use serde::Serialize;

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// Python's `json.dumps(value, ensure_ascii=False)`: `", "` and `": "` separators, or with an
/// `indent`, one item per line; key order and non-ASCII text kept.
pub fn to_python_json<T: Serialize + ?Sized>(value: &T, indent: Option<usize>) -> serde_json::Result<String> {
    let mut out = Vec::new();
    let fmt = PyFormatter { indent, level: 0, has_value: false };
    let mut ser = serde_json::Serializer::with_formatter(&mut out, fmt);
    value.serialize(&mut ser)?;
    Ok(String::from_utf8(out).expect("serde_json writes UTF-8"))
}

/// The `tojson` filter of transformers' chat-template environment.
pub fn py_tojson(value: &Value, kwargs: Kwargs) -> Result<Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    to_python_json(value, indent)
        .map(Value::from_safe_string)
        .map_err(|e| minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, format!("tojson: {e}")))
}

struct PyFormatter {
    indent: Option<usize>,
    level: usize,
    has_value: bool,
}

impl PyFormatter {
    fn newline<W: ?Sized + Write>(&self, w: &mut W) -> std::io::Result<()> {
        if let Some(n) = self.indent {
            w.write_all(b"\n")?;
            for _ in 0..n * self.level {
                w.write_all(b" ")?;
            }
        }
        Ok(())
    }
    fn separator<W: ?Sized + Write>(&self, w: &mut W, first: bool) -> std::io::Result<()> {
        if !first {
            w.write_all(if self.indent.is_some() { b"," } else { b", " })?;
        }
        self.newline(w)
    }
    fn open<W: ?Sized + Write>(&mut self, w: &mut W, bracket: &[u8]) -> std::io::Result<()> {
        self.level += 1;
        self.has_value = false;
        w.write_all(bracket)
    }
    /// An empty container closes on its own line's bracket: `[]`, `{}`.
    fn close<W: ?Sized + Write>(&mut self, w: &mut W, bracket: &[u8]) -> std::io::Result<()> {
        self.level -= 1;
        if self.has_value {
            self.newline(w)?;
        }
        w.write_all(bracket)
    }
}

impl serde_json::ser::Formatter for PyFormatter {
    fn begin_array<W: ?Sized + Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.open(w, b"[")
    }
    fn end_array<W: ?Sized + Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.close(w, b"]")
    }
    fn begin_array_value<W: ?Sized + Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
        self.separator(w, first)
    }
    fn end_array_value<W: ?Sized + Write>(&mut self, _w: &mut W) -> std::io::Result<()> {
        self.has_value = true;
        Ok(())
    }
    fn begin_object<W: ?Sized + Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.open(w, b"{")
    }
    fn end_object<W: ?Sized + Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.close(w, b"}")
    }
    fn begin_object_key<W: ?Sized + Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
        self.separator(w, first)
    }
    fn begin_object_value<W: ?Sized + Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(b": ")
    }
    fn end_object_value<W: ?Sized + Write>(&mut self, _w: &mut W) -> std::io::Result<()> {
        self.has_value = true;
        Ok(())
    }
}

/// A function call (one the model wrote, or one of an earlier assistant turn). `arguments` is
/// JSON text, as the OpenAI API carries it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: String,
}

/// Splits an answer into its content (the text before the first `<tool_call>`) and its calls.
/// A call is `{"name": string, "arguments": ...}` JSON, or XML (`xml_call`, its parameter
/// values typed by the function's schema in `tools`, the request's OpenAI tool definitions).
/// `None` when the answer has no call or a call is neither: the whole answer is then content,
/// as vLLM's parsers treat it. A last call left open (the answer ended before `</tool_call>`)
/// still counts when it is complete (its JSON, or its `</function>`).
pub fn split_tool_calls(text: &str, tools: &[serde_json::Value]) -> Option<(String, Vec<ToolCall>)> {
    let first = text.find(OPEN)?;
    let mut calls = Vec::new();
    let mut rest = &text[first..];
    while let Some(at) = rest.find(OPEN) {
        let body_start = &rest[at + OPEN.len()..];
        let (body, next) = match body_start.find(CLOSE) {
            Some(end) => (&body_start[..end], &body_start[end + CLOSE.len()..]),
            None => (body_start, ""),
        };
        if body.trim_start().starts_with(FUNCTION) {
            calls.push(xml_call(body.trim(), tools)?);
            rest = next;
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(body.trim()).ok()?;
        let name = v.get("name")?.as_str()?.to_string();
        let arguments = match v.get("arguments") {
            None | Some(serde_json::Value::Null) => "{}".to_string(),
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(a) => to_python_json(a, None).ok()?,
        };
        calls.push(ToolCall { name, arguments });
        rest = next;
    }
    // Only whitespace may follow the last call.
    if !rest.trim().is_empty() {
        return None;
    }
    Some((text[..first].to_string(), calls))
}

const FUNCTION: &str = "<function=";
const PARAMETER: &str = "<parameter=";
const END_PARAMETER: &str = "</parameter>";
const END_FUNCTION: &str = "</function>";

/// One call in Qwen3.5's XML form, as its template writes one:
/// `<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n...</function>`. A value is text:
/// it stays a string where the function's schema says the parameter is a string (or says
/// nothing of it), and is read as JSON otherwise when it parses as JSON (numbers, booleans,
/// objects, arrays), as vLLM's qwen3_coder parser reads it.
fn xml_call(body: &str, tools: &[serde_json::Value]) -> Option<ToolCall> {
    let rest = body.strip_prefix(FUNCTION)?;
    let end = rest.find('>')?;
    let name = rest[..end].trim().to_string();
    if name.is_empty() || name.contains('\n') {
        return None;
    }
    let props = tools
        .iter()
        .map(|t| t.get("function").unwrap_or(t))
        .find(|f| f.get("name").and_then(|n| n.as_str()) == Some(name.as_str()))
        .and_then(|f| f.pointer("/parameters/properties"));
    let mut args = serde_json::Map::new();
    let mut rest = &rest[end + 1..];
    loop {
        rest = rest.trim_start();
        if let Some(after) = rest.strip_prefix(END_FUNCTION) {
            if !after.trim().is_empty() {
                return None;
            }
            break;
        }
        let p = rest.strip_prefix(PARAMETER)?;
        let close = p.find('>')?;
        let pname = p[..close].trim().to_string();
        let value_start = &p[close + 1..];
        let stop = value_start.find(END_PARAMETER)?;
        let raw = &value_start[..stop];
        let raw = raw.strip_prefix('\n').unwrap_or(raw);
        let raw = raw.strip_suffix('\n').unwrap_or(raw);
        let ty = props.and_then(|p| p.get(&pname)).and_then(|s| s.get("type"));
        let is_string = match ty {
            None => true,
            Some(serde_json::Value::String(t)) => t == "string",
            Some(serde_json::Value::Array(ts)) => ts.iter().any(|t| t == "string"),
            Some(_) => true,
        };
        let value = match serde_json::from_str::<serde_json::Value>(raw) {
            Ok(v) if !is_string => v,
            _ => serde_json::Value::String(raw.to_string()),
        };
        args.insert(pname, value);
        rest = &value_start[stop + END_PARAMETER.len()..];
    }
    Some(ToolCall { name, arguments: to_python_json(&serde_json::Value::Object(args), None).ok()? })
}

/// Streaming: passes text through until `<tool_call>` begins, then holds everything back (a
/// partial marker at the end of a piece is held until it is decided).
#[derive(Debug, Default)]
pub struct CallHold {
    held: String,
    capturing: bool,
}

impl CallHold {
    /// Adds a piece of text; returns what may be emitted now.
    pub fn push(&mut self, piece: &str) -> String {
        self.held.push_str(piece);
        if self.capturing {
            return String::new();
        }
        if let Some(at) = self.held.find(OPEN) {
            self.capturing = true;
            let emit = self.held[..at].to_string();
            self.held.drain(..at);
            return emit;
        }
        let keep = (1..OPEN.len()).rev().find(|&i| self.held.ends_with(&OPEN[..i])).unwrap_or(0);
        let cut = self.held.len() - keep;
        let emit = self.held[..cut].to_string();
        self.held.drain(..cut);
        emit
    }

    /// What is held back (at the end of generation).
    pub fn take(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_json_separators_order_and_unicode() {
        let v: serde_json::Value =
            serde_json::from_str(r#"{"z": 1, "a": [1, 2.5, "Zürich \"q\"\n"], "e": {}, "l": []}"#).unwrap();
        // What Python's json.dumps(v, ensure_ascii=False) prints for the same object.
        assert_eq!(to_python_json(&v, None).unwrap(), r#"{"z": 1, "a": [1, 2.5, "Zürich \"q\"\n"], "e": {}, "l": []}"#);
        assert_eq!(to_python_json(&v["a"], Some(2)).unwrap(), "[\n  1,\n  2.5,\n  \"Zürich \\\"q\\\"\\n\"\n]");
    }

    #[test]
    fn calls_are_split_from_the_content() {
        let t = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Zürich\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>";
        let (content, calls) = split_tool_calls(t, &[]).unwrap();
        assert_eq!(content, "Let me check.\n");
        assert_eq!(calls[0], ToolCall { name: "get_weather".into(), arguments: r#"{"city": "Zürich"}"#.into() });
        assert_eq!(calls[1].arguments, "{}");
        // Left open at the end of the answer: still a call.
        assert_eq!(
            split_tool_calls("<tool_call>{\"name\": \"f\", \"arguments\": {\"x\": 1}}", &[]).unwrap().1.len(),
            1
        );
        // Not JSON, no name, or text after the calls: all content.
        assert_eq!(split_tool_calls("<tool_call>{oops</tool_call>", &[]), None);
        assert_eq!(split_tool_calls("<tool_call>{\"arguments\": {}}</tool_call>", &[]), None);
        assert_eq!(split_tool_calls("<tool_call>{\"name\": \"f\"}</tool_call> and more", &[]), None);
        assert_eq!(split_tool_calls("no calls", &[]), None);
    }

    #[test]
    fn xml_calls_are_typed_by_the_function_schema() {
        let tools = vec![serde_json::json!({"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
            "opts": {"type": "object"}}}}})];
        let t = "I will check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=opts>\n{\"unit\": \"C\"}\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=now>\n</function>\n</tool_call>";
        let (content, calls) = split_tool_calls(t, &tools).unwrap();
        assert_eq!(content, "I will check.\n\n");
        assert_eq!(calls[0].name, "get_weather");
        // A string parameter stays a string even when it looks like a number.
        assert_eq!(calls[0].arguments, r#"{"city": "42", "days": 3, "opts": {"unit": "C"}}"#);
        assert_eq!(calls[1], ToolCall { name: "now".into(), arguments: "{}".into() });
        // A multi-line value keeps its inner newlines; an unknown function's values are strings.
        let (_, c) =
            split_tool_calls("<tool_call>\n<function=f>\n<parameter=x>\na\nb\n</parameter>\n</function>", &[]).unwrap();
        assert_eq!(c[0].arguments, r#"{"x": "a\nb"}"#);
        // Unclosed parameter or function, or text after the function: all content.
        assert_eq!(split_tool_calls("<tool_call>\n<function=f>\n<parameter=x>\na", &[]), None);
        assert_eq!(split_tool_calls("<tool_call>\n<function=f>\n<parameter=x>\na\n</parameter>\n", &[]), None);
        assert_eq!(split_tool_calls("<tool_call>\n<function=f>\n</function> tail</tool_call>", &[]), None);
        assert_eq!(split_tool_calls("<tool_call>\n<function=>\n</function>\n</tool_call>", &[]), None);
    }

    #[test]
    fn the_hold_passes_text_until_a_call_begins() {
        let mut h = CallHold::default();
        assert_eq!(h.push("Hello <"), "Hello ");
        assert_eq!(h.push("b>"), "<b>");
        assert_eq!(h.push("x <tool_"), "x ");
        assert_eq!(h.push("call>{\"name\""), "");
        assert_eq!(h.push(" more"), "");
        assert_eq!(h.take(), "<tool_call>{\"name\" more");
        let mut h = CallHold::default();
        assert_eq!(h.push("a <tool"), "a ");
        assert_eq!(h.take(), "<tool");
    }
}
