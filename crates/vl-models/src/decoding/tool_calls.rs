//! Tool calling around a chat template: transformers' `tojson` filter (Python's `json.dumps`,
//! which templates use to print function definitions), the `<tool_call>{json}</tool_call>` text
//! format that Qwen models write (the "hermes" format of vLLM and llama.cpp), and a streaming
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
/// `None` when the answer has no call or a call is not `{"name": string, "arguments": ...}`
/// JSON: the whole answer is then content, as vLLM's parser treats it. A last call left open
/// (the answer ended before `</tool_call>`) still counts when its JSON is complete.
pub fn split_tool_calls(text: &str) -> Option<(String, Vec<ToolCall>)> {
    let first = text.find(OPEN)?;
    let mut calls = Vec::new();
    let mut rest = &text[first..];
    while let Some(at) = rest.find(OPEN) {
        let body_start = &rest[at + OPEN.len()..];
        let (body, next) = match body_start.find(CLOSE) {
            Some(end) => (&body_start[..end], &body_start[end + CLOSE.len()..]),
            None => (body_start, ""),
        };
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
        let (content, calls) = split_tool_calls(t).unwrap();
        assert_eq!(content, "Let me check.\n");
        assert_eq!(calls[0], ToolCall { name: "get_weather".into(), arguments: r#"{"city": "Zürich"}"#.into() });
        assert_eq!(calls[1].arguments, "{}");
        // Left open at the end of the answer: still a call.
        assert_eq!(split_tool_calls("<tool_call>{\"name\": \"f\", \"arguments\": {\"x\": 1}}").unwrap().1.len(), 1);
        // Not JSON, no name, or text after the calls: all content.
        assert_eq!(split_tool_calls("<tool_call>{oops</tool_call>"), None);
        assert_eq!(split_tool_calls("<tool_call>{\"arguments\": {}}</tool_call>"), None);
        assert_eq!(split_tool_calls("<tool_call>{\"name\": \"f\"}</tool_call> and more"), None);
        assert_eq!(split_tool_calls("no calls"), None);
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
