//! llama.cpp's GBNF grammars (`root ::= ...`), read as llama.cpp reads them and written out in
//! llguidance's Lark variant, which the constraint compiles.
//!
//! What is read: rules `name ::= alternatives` (names of letters, digits, `-` and `_`), one per
//! line unless a parenthesis is open or the line ends in `::=` or `|`; string literals with
//! llama.cpp's escapes (`\n \r \t \\ \" \[ \]`, `\xHH`, `\uHHHH`, `\UHHHHHHHH`); character
//! classes `[a-z]`, `[^...]`; `.` (any character); groups; `*`, `+`, `?` and `{m}`, `{m,}`,
//! `{m,n}`, `{,n}`; `#` comments. The answer is the `root` rule.
//!
//! Refused, naming the line and column: a rule used and never defined, a rule defined twice, no
//! `root`, token references (`<...>`, llama.cpp's newer form that names vocabulary entries),
//! groups nested past `MAX_NESTING`, and counted repetitions that, multiplied through their
//! nesting, repeat more than `MAX_REPEAT` times (llama.cpp expands them into copies).

use std::collections::BTreeMap;
use std::fmt::Write;

/// Most groups one inside another.
pub const MAX_NESTING: usize = 64;

/// Most copies counted repetitions may make of what they repeat, multiplied through nested
/// repetitions (`("a"{100}){100}` makes 10,000).
pub const MAX_REPEAT: u64 = 10_000;

/// The grammar as Lark: `start` is `root`; each GBNF rule a Lark rule of a lower-case name.
pub fn to_lark(src: &str) -> Result<String, String> {
    let mut p = Reader { s: src.as_bytes(), src, at: 0, depth: 0 };
    let mut rules: Vec<(String, usize, Alts)> = vec![];
    let mut defined: BTreeMap<String, usize> = BTreeMap::new();
    p.space(true);
    while !p.done() {
        // Where the rule begins (its line is counted only for an error).
        let start = p.at;
        let name = p.name().ok_or_else(|| p.error("expected a rule name"))?;
        p.space(false);
        if !p.eat("::=") {
            return Err(p.error(&format!("expected `::=` after `{name}`")));
        }
        p.space(true);
        let alts = p.alternatives(1)?;
        if !p.done() && !p.eat("\r\n") && !p.eat("\n") && !p.eat("\r") {
            return Err(p.error("expected the end of the line"));
        }
        p.space(true);
        if let Some(first) = defined.insert(name.clone(), start) {
            let (line, first) = (line_at(src, start), line_at(src, first));
            return Err(format!("line {line}: rule `{name}` is defined twice (first at line {first})"));
        }
        rules.push((name, start, alts));
    }
    if !defined.contains_key("root") {
        return Err("no `root` rule: the answer is what `root` matches".into());
    }
    // Lark names: lower case, unique.
    let mut names: BTreeMap<String, String> = BTreeMap::new();
    let mut taken: std::collections::BTreeSet<String> = ["start".to_string()].into();
    for (name, _, _) in &rules {
        let base: String = format!(
            "r_{}",
            name.chars()
                .map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '_' })
                .collect::<String>()
        );
        let mut unique = base.clone();
        let mut i = 2;
        while taken.contains(&unique) {
            unique = format!("{base}_{i}");
            i += 1;
        }
        taken.insert(unique.clone());
        names.insert(name.clone(), unique);
    }
    let mut out = format!("start: {}\n", names["root"]);
    for (name, start, alts) in &rules {
        let mut body = String::new();
        write_alts(alts, &names, &mut body).map_err(|used| {
            format!("line {}: rule `{name}` uses `{used}`, which is never defined", line_at(src, *start))
        })?;
        let _ = writeln!(out, "{}: {body}", names[name]);
    }
    Ok(out)
}

type Alts = Vec<Vec<Item>>;

/// A repetition's least and most counts (None: unbounded).
type Bounds = (u64, Option<u64>);

/// A repetition as Lark text, the most copies it makes, and its bounds.
type Repeat = (Option<String>, u64, Bounds);

#[derive(Debug)]
enum Atom {
    Text(String),
    /// Ranges of characters, negated or not.
    Class(Vec<(char, char)>, bool),
    Any,
    Rule(String),
    Group(Alts),
}

#[derive(Debug)]
struct Item {
    atom: Atom,
    /// `*`, `+`, `?` or `{m,n}` as written for Lark.
    repeat: Option<String>,
    /// The most copies a counted repetition makes (1 for none or a loop).
    times: u64,
    /// (1, Some(1)) for none.
    bounds: Bounds,
}

struct Reader<'a> {
    s: &'a [u8],
    src: &'a str,
    at: usize,
    depth: usize,
}

impl Reader<'_> {
    fn done(&self) -> bool {
        self.at >= self.s.len()
    }

    fn peek(&self) -> Option<u8> {
        self.s.get(self.at).copied()
    }

    fn eat(&mut self, t: &str) -> bool {
        if self.s[self.at..].starts_with(t.as_bytes()) {
            self.at += t.len();
            true
        } else {
            false
        }
    }

    fn line(&self) -> usize {
        line_at(self.src, self.at)
    }

    fn error(&self, what: &str) -> String {
        let before = &self.src[..self.at];
        let column = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
        let found = match self.src[self.at..].chars().next() {
            None => "the end".to_string(),
            Some(c) => format!("{c:?}"),
        };
        format!("line {}, column {column}: {what}, found {found}", self.line())
    }

    /// Spaces, tabs and comments; line ends too when `lines`.
    fn space(&mut self, lines: bool) {
        while let Some(c) = self.peek() {
            match c {
                b' ' | b'\t' => self.at += 1,
                b'\r' | b'\n' if lines => self.at += 1,
                b'#' => {
                    while !matches!(self.peek(), None | Some(b'\n') | Some(b'\r')) {
                        self.at += 1;
                    }
                }
                _ => break,
            }
        }
    }

    fn name(&mut self) -> Option<String> {
        let start = self.at;
        while self.peek().is_some_and(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_') {
            self.at += 1;
        }
        (self.at > start).then(|| self.src[start..self.at].to_string())
    }

    /// `alternatives` of a rule or group; `repeat` is the product of the counted repetitions
    /// around it.
    fn alternatives(&mut self, repeat: u64) -> Result<Alts, String> {
        let nested = self.depth > 0;
        let mut alts = vec![self.sequence(nested, repeat)?];
        while self.eat("|") {
            self.space(true);
            alts.push(self.sequence(nested, repeat)?);
        }
        Ok(alts)
    }

    fn sequence(&mut self, nested: bool, repeat: u64) -> Result<Vec<Item>, String> {
        let mut items = vec![];
        loop {
            let start = self.at;
            let atom = match self.peek() {
                Some(b'"') => {
                    self.at += 1;
                    let mut text = String::new();
                    loop {
                        match self.peek() {
                            None | Some(b'\n') | Some(b'\r') => return Err(self.error("unterminated string")),
                            Some(b'"') => {
                                self.at += 1;
                                break;
                            }
                            _ => text.push(self.char()?),
                        }
                    }
                    Atom::Text(text)
                }
                Some(b'[') => {
                    self.at += 1;
                    let negated = self.eat("^");
                    let mut ranges = vec![];
                    loop {
                        match self.peek() {
                            None | Some(b'\n') | Some(b'\r') => return Err(self.error("unterminated character class")),
                            Some(b']') => {
                                self.at += 1;
                                break;
                            }
                            _ => {
                                let lo = self.char()?;
                                let ranged =
                                    self.s.get(self.at + 1).is_some_and(|c| !matches!(c, b']' | b'\n' | b'\r'));
                                let hi = if self.peek() == Some(b'-') && ranged {
                                    self.at += 1;
                                    self.char()?
                                } else {
                                    lo
                                };
                                if hi < lo {
                                    return Err(self.error(&format!("the range {lo:?}-{hi:?} is reversed")));
                                }
                                ranges.push((lo, hi));
                            }
                        }
                    }
                    if ranges.is_empty() && !negated {
                        self.at = start;
                        return Err(self.error("an empty character class matches nothing"));
                    }
                    if ranges.is_empty() {
                        // `[^]`: any character.
                        Atom::Any
                    } else {
                        Atom::Class(ranges, negated)
                    }
                }
                Some(b'.') => {
                    self.at += 1;
                    Atom::Any
                }
                Some(b'(') => {
                    self.at += 1;
                    if self.depth >= MAX_NESTING {
                        return Err(self.error(&format!("groups nested more than {MAX_NESTING} deep")));
                    }
                    self.depth += 1;
                    self.space(true);
                    // The repetition that follows the group is not known yet: checked at its end.
                    let alts = self.alternatives(repeat)?;
                    if !self.eat(")") {
                        return Err(self.error("expected `)`"));
                    }
                    self.depth -= 1;
                    Atom::Group(alts)
                }
                Some(b'<') | Some(b'!') => {
                    return Err(self.error("token references (`<...>`) are not supported; write the text as a string"))
                }
                Some(c) if c.is_ascii_alphanumeric() || c == b'-' || c == b'_' => {
                    let name = self.name().unwrap_or_default();
                    // The next rule's definition (a line ending without `|` at the top level
                    // is caught before this).
                    let mut look = Reader { s: self.s, src: self.src, at: self.at, depth: 0 };
                    look.space(false);
                    if look.eat("::=") {
                        self.at = start;
                        return Err(self.error("a new rule begins on the same line as another rule's body"));
                    }
                    Atom::Rule(name)
                }
                _ => break,
            };
            self.space(nested);
            let (repeat_text, times, bounds) = self.repetition()?;
            let total = repeat.saturating_mul(times);
            if total > MAX_REPEAT {
                self.at = start;
                return Err(
                    self.error(&format!("counted repetitions make up to {total} copies here, more than {MAX_REPEAT}"))
                );
            }
            if let Atom::Group(alts) = &atom {
                check_counts(alts, total).map_err(|n| {
                    format!(
                        "line {}: counted repetitions make up to {n} copies in a group, more than {MAX_REPEAT}",
                        self.line()
                    )
                })?;
            }
            items.push(Item { atom, repeat: repeat_text, times, bounds });
            self.space(nested);
        }
        Ok(items)
    }

    /// A repetition after an atom: its Lark text and the most copies it makes (1 for none, `*`,
    /// `+`, `?`: a loop is not copies).
    fn repetition(&mut self) -> Result<Repeat, String> {
        let out = match self.peek() {
            Some(c @ (b'*' | b'+' | b'?')) => {
                self.at += 1;
                let bounds = match c {
                    b'*' => (0, None),
                    b'+' => (1, None),
                    _ => (0, Some(1)),
                };
                (Some((c as char).to_string()), 1, bounds)
            }
            Some(b'{') => {
                self.at += 1;
                self.space(false);
                let lo = self.number()?;
                self.space(false);
                let (lo, hi) = if self.eat(",") {
                    self.space(false);
                    (lo.unwrap_or(0), self.number()?)
                } else {
                    let Some(n) = lo else { return Err(self.error("expected a count")) };
                    (n, Some(n))
                };
                self.space(false);
                if !self.eat("}") {
                    return Err(self.error("expected `}`"));
                }
                if hi.is_some_and(|h| h < lo) {
                    return Err(self.error(&format!("the repetition {{{lo},{}}} is reversed", hi.unwrap_or(0))));
                }
                let text = match hi {
                    Some(h) => format!("{{{lo},{h}}}"),
                    None => format!("{{{lo},}}"),
                };
                (Some(text), hi.unwrap_or(lo).max(1), (lo, hi))
            }
            _ => (None, 1, (1, Some(1))),
        };
        Ok(out)
    }

    fn number(&mut self) -> Result<Option<u64>, String> {
        let start = self.at;
        while self.peek().is_some_and(|c| c.is_ascii_digit()) {
            self.at += 1;
        }
        if self.at == start {
            return Ok(None);
        }
        match self.src[start..self.at].parse::<u64>() {
            Ok(n) if n <= MAX_REPEAT => Ok(Some(n)),
            _ => {
                self.at = start;
                Err(self.error(&format!("a count over {MAX_REPEAT}")))
            }
        }
    }

    /// One character of a string or class, escapes read.
    fn char(&mut self) -> Result<char, String> {
        let rest = &self.src[self.at..];
        let Some(c) = rest.chars().next() else { return Err(self.error("unexpected end")) };
        if c != '\\' {
            self.at += c.len_utf8();
            return Ok(c);
        }
        let Some(e) = rest[1..].chars().next() else { return Err(self.error("unfinished escape")) };
        let hex = |n: usize| -> Result<char, String> {
            let digits = rest.get(2..2 + n).filter(|d| d.chars().all(|c| c.is_ascii_hexdigit()));
            let code = digits.and_then(|d| u32::from_str_radix(d, 16).ok()).and_then(char::from_u32);
            code.ok_or_else(|| self.error(&format!("`\\{e}` takes {n} hexadecimal digits of a character")))
        };
        let (c, len) = match e {
            'x' => (hex(2)?, 4),
            'u' => (hex(4)?, 6),
            'U' => (hex(8)?, 10),
            'n' => ('\n', 2),
            'r' => ('\r', 2),
            't' => ('\t', 2),
            '\\' | '"' | '[' | ']' | '-' | '^' | '/' => (e, 2),
            _ => return Err(self.error(&format!("unknown escape `\\{e}`"))),
        };
        self.at += len;
        Ok(c)
    }
}

/// The line (from 1) of byte `at` of `src`.
fn line_at(src: &str, at: usize) -> usize {
    src[..at].matches('\n').count() + 1
}

/// Refuses counted repetitions inside a group that multiply past `MAX_REPEAT` with `outer`.
fn check_counts(alts: &Alts, outer: u64) -> Result<(), u64> {
    for item in alts.iter().flatten() {
        let total = outer.saturating_mul(item.times);
        if total > MAX_REPEAT {
            return Err(total);
        }
        if let Atom::Group(inner) = &item.atom {
            check_counts(inner, total)?;
        }
    }
    Ok(())
}

/// Writes `alts` as Lark; `Err` names an undefined rule.
fn write_alts(alts: &Alts, names: &BTreeMap<String, String>, out: &mut String) -> Result<(), String> {
    for (i, seq) in alts.iter().enumerate() {
        if i > 0 {
            out.push_str(" | ");
        }
        if seq.is_empty() {
            out.push_str("\"\"");
        }
        for (j, item) in seq.iter().enumerate() {
            if j > 0 {
                out.push(' ');
            }
            match &item.atom {
                Atom::Text(t) => out.push_str(&serde_json::to_string(t).unwrap_or_default()),
                Atom::Class(ranges, negated)
                    if item.repeat.is_some() && ends_before(ranges, *negated, seq.get(j + 1)) =>
                {
                    // A run of the class that must end where the next text begins: one lexeme.
                    out.push_str(&run(ranges, *negated, item.bounds));
                    continue;
                }
                Atom::Class(ranges, negated) => {
                    out.push('/');
                    out.push_str(&class(ranges, *negated));
                    out.push('/');
                }
                Atom::Any => out.push_str("/(?s:.)/"),
                Atom::Rule(name) => out.push_str(names.get(name).ok_or_else(|| name.clone())?),
                Atom::Group(inner) => {
                    out.push('(');
                    write_alts(inner, names, out)?;
                    out.push(')');
                }
            }
            if let Some(r) = &item.repeat {
                out.push_str(r);
            }
        }
    }
    Ok(())
}

/// `[...]` for a regex.
fn class(ranges: &[(char, char)], negated: bool) -> String {
    let mut out = String::from(if negated { "[^" } else { "[" });
    for (lo, hi) in ranges {
        out.push_str(&class_char(*lo));
        if hi != lo {
            out.push('-');
            out.push_str(&class_char(*hi));
        }
    }
    out.push(']');
    out
}

/// Whether a run of the class must end where `next` begins: `next` is text that is always
/// there (not optional) and whose first character the class does not hold. Then the run can be
/// one lexeme (llguidance's lexemes are greedy, so a run that could swallow what follows must
/// stay a sequence of one-character lexemes, which costs more per token).
fn ends_before(ranges: &[(char, char)], negated: bool, next: Option<&Item>) -> bool {
    let Some(Item { atom: Atom::Text(t), bounds: (min, _), .. }) = next else { return false };
    let Some(c) = t.chars().next() else { return false };
    let held = ranges.iter().any(|&(lo, hi)| lo <= c && c <= hi) != negated;
    *min >= 1 && !held
}

/// A run of the class as one lexeme; never one that matches nothing (an optional one instead).
fn run(ranges: &[(char, char)], negated: bool, (min, max): Bounds) -> String {
    let c = class(ranges, negated);
    match (min, max) {
        (_, Some(0)) => "\"\"".into(),
        (0, Some(1)) => format!("/{c}/?"),
        (0, None) => format!("/{c}+/?"),
        (0, Some(n)) => format!("/{c}{{1,{n}}}/?"),
        (m, None) => format!("/{c}{{{m},}}/"),
        (m, Some(n)) => format!("/{c}{{{m},{n}}}/"),
    }
}

/// A character inside a regex class: letters and digits as they are, anything else escaped by
/// its code (so no `/`, `]`, `\` or `-` ends the class or the regex early).
fn class_char(c: char) -> String {
    if c.is_ascii_alphanumeric() {
        c.to_string()
    } else {
        format!("\\x{{{:X}}}", c as u32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_strings_classes_and_repetitions_become_lark() {
        let g = r#"
# a list of numbers
root   ::= "(" num ("," ws num)* ")"
num    ::= [1-9] [0-9]{0,2} | "0"
ws     ::= [ \t]?
"#;
        let lark = to_lark(g).unwrap();
        assert_eq!(
            lark,
            "start: r_root\n\
             r_root: \"(\" r_num (\",\" r_ws r_num)* \")\"\n\
             r_num: /[1-9]/ /[0-9]/{0,2} | \"0\"\n\
             r_ws: /[\\x{20}\\x{9}]/?\n"
        );
    }

    #[test]
    fn escapes_multiline_bodies_and_names_are_read_as_llama_cpp_reads_them() {
        let g =
            "root ::=\n  \"a\\n\\x41\\u00e9\" (\n  x-y |\n  X_y\n  ) [^\\]\\\\]\nx-y ::= .\nX_y ::= \"\" | \"q\"{,3}\n";
        let lark = to_lark(g).unwrap();
        assert!(lark.contains(r#"r_root: "a\nAé" (r_x_y | r_x_y_2) /[^\x{5D}\x{5C}]/"#), "{lark}");
        assert!(lark.contains("r_x_y: /(?s:.)/\n"), "{lark}");
        assert!(lark.contains(r#"r_x_y_2: "" | "q"{0,3}"#), "{lark}");
    }

    #[test]
    fn a_run_that_ends_before_fixed_text_is_one_lexeme_and_others_stay_per_character() {
        let lark =
            to_lark("root ::= \"'\" [^'\\\\]* \"'\" [0-9]{0,3} \".\" [a-z]* \"x\" [a-z]+ \"!\"? \"?\"\n").unwrap();
        assert_eq!(
            lark,
            "start: r_root\nr_root: \"'\" /[^\\x{27}\\x{5C}]+/? \"'\" /[0-9]{1,3}/? \".\" /[a-z]/* \"x\" /[a-z]/+ \"!\"? \"?\"\n"
        );
    }

    #[test]
    fn bad_grammars_are_refused_with_the_line() {
        for (g, want) in [
            ("root ::= foo\n", "line 1: rule `root` uses `foo`, which is never defined"),
            ("a ::= \"x\"\n", "no `root` rule"),
            ("root ::= \"x\"\nroot ::= \"y\"\n", "line 2: rule `root` is defined twice (first at line 1)"),
            ("root ::= \"x\n", "line 1, column 12: unterminated string"),
            ("root ::= [a-\n", "unterminated character class"),
            ("root ::= [z-a]\n", "the range 'z'-'a' is reversed"),
            ("root ::= <think>\n", "token references"),
            ("root ::= \"a\"{3,1}\n", "reversed"),
            ("root ::= (\"a\"{200}){200}\n", "more than 10000"),
            ("root ::= \"a\"{99999}\n", "a count over 10000"),
            ("root ::= \"\\q\"\n", "unknown escape `\\q`"),
            ("root \"x\"\n", "line 1, column 6: expected `::=` after `root`"),
            ("root ::= \"x\" )\n", "line 1, column 14: expected the end of the line"),
        ] {
            let e = to_lark(g).unwrap_err();
            assert!(e.contains(want), "{g:?}: {e}");
        }
        let deep = format!("root ::= {}\"a\"{}\n", "(".repeat(100), ")".repeat(100));
        assert!(to_lark(&deep).unwrap_err().contains("nested more than 64"));
    }
}
