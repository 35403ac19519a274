//! The regular expressions of a constraint, bounded before llguidance compiles them.

use serde_json::Value;

use super::{Constraint, MAX_PATTERN_EXPANSION};
use crate::error::{Error, Result};

/// Every regular expression of a constraint: a schema's `pattern` values and
/// `patternProperties` keys with their JSON pointers (a tool's prefixed by its name), or a
/// `Regex` constraint's own (its pointer empty).
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
        Constraint::Regex(rx) => out.push((String::new(), rx.clone())),
        Constraint::JsonObject | Constraint::Choice(_) | Constraint::Grammar { .. } => {}
    }
    out
}

/// JSON pointers of the first few patterns of a schema constraint.
pub(super) fn patterns_of(c: &Constraint) -> Vec<String> {
    all_patterns(c).into_iter().filter(|(at, _)| !at.is_empty()).take(3).map(|(at, _)| at).collect()
}

/// "the pattern at POINTER", or "the regex" for a `Regex` constraint's own.
fn label(at: &str) -> String {
    if at.is_empty() {
        "the regex".into()
    } else {
        format!("the pattern at {at}")
    }
}

/// Refuses a pattern that spells out more than `MAX_PATTERN_EXPANSION` characters, naming it.
/// The pattern is read as llguidance reads it (its rewrite first: `\w`, `\d` as ASCII classes);
/// one that cannot be read cannot be bounded, so it is refused too.
pub(super) fn check_patterns(c: &Constraint, what: &str) -> Result<()> {
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
                    message: format!("{} cannot be read: {reason}", label(&at)),
                });
            }
        };
        let n = expansion(&hir);
        if n > MAX_PATTERN_EXPANSION {
            return Err(Error::Input {
                what: what.into(),
                message: format!(
                    "{} spells out up to {n} characters through its counted repetitions, more than {MAX_PATTERN_EXPANSION}: too costly to match",
                    label(&at)
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn with_pattern(p: &str) -> Constraint {
        Constraint::JsonSchema(json!({"type": "object", "properties": {"s": {"type": "string", "pattern": p}}}))
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
