//! Reasoning blocks, model-agnostic: a thinking model writes `<think>...</think>` before its
//! answer (or its chat template opens the block in the generation prompt and the model writes
//! only the rest). The split follows the Qwen3 chat templates' own reading of an assistant
//! message: the reasoning is the text between the markers without its leading and trailing
//! newlines, the answer is the text after the closing marker without its leading newlines.
//!
//! `Split` does it as the text streams: text that may still turn out to be a marker (or the
//! newlines before a closing one) is held until it is decided.

/// A family's reasoning markers: their text and token ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Markers {
    pub open: String,
    pub close: String,
    pub open_id: u32,
    pub close_id: u32,
}

impl Markers {
    /// The markers `open` / `close` when `tokenizer` has each as one token; None otherwise.
    pub fn from_tokenizer(tokenizer: &tokenizers::Tokenizer, open: &str, close: &str) -> Option<Self> {
        Some(Self {
            open: open.into(),
            close: close.into(),
            open_id: tokenizer.token_to_id(open)?,
            close_id: tokenizer.token_to_id(close)?,
        })
    }

    /// Whether a prompt leaves a reasoning block open for the answer: its last token that is
    /// not whitespace is the opening marker (a template that opens `<think>` in the generation
    /// prompt).
    pub fn opened_by(&self, tokenizer: &tokenizers::Tokenizer, prompt: &[u32]) -> bool {
        for &id in prompt.iter().rev().take(8) {
            if id == self.open_id {
                return true;
            }
            let text = tokenizer.decode(&[id], false).unwrap_or_default();
            if !text.trim().is_empty() {
                return false;
            }
        }
        false
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// The answer's start: an opening marker (after whitespace) may still come.
    Start,
    /// Inside the block; `lead`: its leading newlines are still dropped.
    Reasoning { lead: bool },
    /// After the block (`lead`: its leading newlines are still dropped), or an answer that
    /// opened none.
    Content { lead: bool },
}

/// Splits a streamed answer into reasoning and content.
#[derive(Debug, Clone)]
pub struct Split {
    open: String,
    close: String,
    state: State,
    held: String,
    /// The reasoning so far, and whether the answer has a reasoning block at all.
    pub reasoning: String,
    pub thought: bool,
    /// The answer after the block.
    pub content: String,
}

/// What one piece of streamed text became.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Pieces {
    pub reasoning: String,
    pub content: String,
}

impl Split {
    /// `opened`: the prompt opened the block, so the answer starts inside it.
    pub fn new(markers: &Markers, opened: bool) -> Self {
        Self {
            open: markers.open.clone(),
            close: markers.close.clone(),
            state: if opened { State::Reasoning { lead: true } } else { State::Start },
            held: String::new(),
            reasoning: String::new(),
            thought: opened,
            content: String::new(),
        }
    }

    /// Adds a piece; returns what may be shown now.
    pub fn push(&mut self, piece: &str) -> Pieces {
        self.held.push_str(piece);
        let mut out = Pieces::default();
        loop {
            match self.state {
                State::Start => {
                    let t = self.held.trim_start();
                    if t.starts_with(self.open.as_str()) {
                        self.held = t[self.open.len()..].to_string();
                        self.state = State::Reasoning { lead: true };
                        self.thought = true;
                        continue;
                    }
                    if t.is_empty() || self.open.starts_with(t) {
                        return out;
                    }
                    self.state = State::Content { lead: false };
                }
                State::Reasoning { lead } => {
                    if lead {
                        let t = self.held.trim_start_matches('\n');
                        if t.is_empty() {
                            self.held.clear();
                            return out;
                        }
                        self.held = t.to_string();
                        self.state = State::Reasoning { lead: false };
                    }
                    if let Some(at) = self.held.find(self.close.as_str()) {
                        let r = self.held[..at].trim_end_matches('\n').to_string();
                        self.held.drain(..at + self.close.len());
                        out.reasoning.push_str(&r);
                        self.reasoning.push_str(&r);
                        self.state = State::Content { lead: true };
                        continue;
                    }
                    // Held: trailing newlines and a proper prefix of the closing marker.
                    let keep = self.undecided_tail();
                    let cut = self.held.len() - keep;
                    let r: String = self.held.drain(..cut).collect();
                    out.reasoning.push_str(&r);
                    self.reasoning.push_str(&r);
                    return out;
                }
                State::Content { lead } => {
                    if lead {
                        let t = self.held.trim_start_matches('\n');
                        if t.is_empty() {
                            self.held.clear();
                            return out;
                        }
                        self.held = t.to_string();
                        self.state = State::Content { lead: false };
                    }
                    let c = std::mem::take(&mut self.held);
                    out.content.push_str(&c);
                    self.content.push_str(&c);
                    return out;
                }
            }
        }
    }

    /// The length of the held text's tail that may still belong to a closing marker: newlines,
    /// then a proper prefix of it.
    fn undecided_tail(&self) -> usize {
        let h = self.held.as_str();
        let partial = (1..self.close.len())
            .rev()
            .filter(|&i| self.close.is_char_boundary(i))
            .find(|&i| h.ends_with(&self.close[..i]))
            .unwrap_or(0);
        let before = &h[..h.len() - partial];
        partial + (before.len() - before.trim_end_matches('\n').len())
    }

    /// The answer ended: what was held is shown as it stands (an unclosed block's text is
    /// reasoning; an answer that never opened one is content).
    pub fn finish(&mut self) -> Pieces {
        let rest = std::mem::take(&mut self.held);
        let mut out = Pieces::default();
        match self.state {
            State::Reasoning { .. } => {
                let r = rest.trim_end_matches('\n');
                out.reasoning.push_str(r);
                self.reasoning.push_str(r);
            }
            State::Start | State::Content { .. } => {
                out.content.push_str(&rest);
                self.content.push_str(&rest);
            }
        }
        out
    }

    /// Inside the block (the constraint of a request waits until it closes).
    pub fn in_reasoning(&self) -> bool {
        matches!(self.state, State::Reasoning { .. })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn markers() -> Markers {
        Markers { open: "<think>".into(), close: "</think>".into(), open_id: 1, close_id: 2 }
    }

    /// Every way of cutting `text` into pieces gives the same split, and the shown pieces add
    /// up to it.
    fn split_all_ways(text: &str, opened: bool) -> (String, String, bool) {
        let whole = {
            let mut s = Split::new(&markers(), opened);
            let a = s.push(text);
            let b = s.finish();
            assert_eq!(a.reasoning + &b.reasoning, s.reasoning);
            assert_eq!(a.content + &b.content, s.content);
            (s.reasoning, s.content, s.thought)
        };
        let chars: Vec<char> = text.chars().collect();
        for step in 1..=3 {
            let mut s = Split::new(&markers(), opened);
            let (mut r, mut c) = (String::new(), String::new());
            for chunk in chars.chunks(step) {
                let p = s.push(&chunk.iter().collect::<String>());
                r += &p.reasoning;
                c += &p.content;
            }
            let p = s.finish();
            r += &p.reasoning;
            c += &p.content;
            assert_eq!((&r, &c, s.thought), (&whole.0, &whole.1, whole.2), "pieces of {step} chars: {text:?}");
        }
        whole
    }

    #[test]
    fn blocks_split_as_the_qwen3_templates_read_them() {
        // The model opens the block.
        assert_eq!(
            split_all_ways("<think>\nLet me look.\n\n</think>\n\nA cat.", false),
            ("Let me look.".into(), "A cat.".into(), true)
        );
        // The template opened it: the answer starts inside.
        assert_eq!(
            split_all_ways("I see a cat.\n</think>\n\nA cat.", true),
            ("I see a cat.".into(), "A cat.".into(), true)
        );
        // No block: all content, untouched (leading newlines and spaces kept).
        assert_eq!(split_all_ways("\n A <b>cat</b>.", false), (String::new(), "\n A <b>cat</b>.".into(), false));
        assert_eq!(split_all_ways("<thin", false), (String::new(), "<thin".into(), false));
        // Cut off inside the block: all reasoning.
        assert_eq!(
            split_all_ways("\nstill thinking\n</thi", true),
            ("still thinking\n</thi".into(), String::new(), true)
        );
        // Newlines inside the reasoning stay; a second marker in the content stays content.
        assert_eq!(split_all_ways("a\n\nb\n</think>x</think>y", true), ("a\n\nb".into(), "x</think>y".into(), true));
        // An empty block (a template's `enable_thinking: false`).
        assert_eq!(split_all_ways("<think>\n\n</think>\n\nHi", false), (String::new(), "Hi".into(), true));
        // Multi-byte text around the markers.
        assert_eq!(split_all_ways("é\n</think>\nü", true), ("é".into(), "ü".into(), true));
    }

    #[test]
    fn newlines_before_the_close_are_held_not_dropped() {
        let mut s = Split::new(&markers(), true);
        assert_eq!(s.push("a\n\n").reasoning, "a");
        // Not a close after all: the newlines belong to the reasoning.
        assert_eq!(s.push("b").reasoning, "\n\nb");
        assert_eq!(s.push("\n</").reasoning, "");
        assert_eq!(s.push("think>").reasoning, "");
        assert!(!s.in_reasoning());
        assert_eq!(s.push("\nok").content, "ok");
    }
}
