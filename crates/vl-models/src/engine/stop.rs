//! Stop strings: text that may begin one is held back; the answer is cut where one appears
//! (after it, when the request keeps it).

/// Holds back text that may be the start of a stop string; cuts the answer at a stop string.
pub(crate) struct StopFilter {
    stops: Vec<String>,
    /// The stop string that ends the answer is part of it.
    keep: bool,
    /// Everything emitted so far.
    pub(crate) text: String,
    pending: String,
    pub(crate) stopped: bool,
}

impl StopFilter {
    pub(crate) fn new(stops: Vec<String>, keep: bool) -> Self {
        Self { stops, keep, text: String::new(), pending: String::new(), stopped: false }
    }

    /// Adds a decoded piece; returns the text safe to emit and whether a stop string was hit.
    pub(crate) fn push(&mut self, piece: &str) -> (String, bool) {
        if self.stopped {
            return (String::new(), true);
        }
        self.pending.push_str(piece);
        // The earliest stop string; of two starting there, the longer.
        let hit = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()).map(|at| (at, s.len())))
            .min_by_key(|&(at, len)| (at, std::cmp::Reverse(len)));
        if let Some((at, len)) = hit {
            let end = if self.keep { at + len } else { at };
            let emit = self.pending[..end].to_string();
            self.text.push_str(&emit);
            self.pending.clear();
            self.stopped = true;
            return (emit, true);
        }
        // Keep the longest tail that is a proper prefix of some stop string.
        let mut keep = 0;
        for s in &self.stops {
            for (i, _) in s.char_indices().skip(1) {
                if self.pending.ends_with(&s[..i]) {
                    keep = keep.max(i);
                }
            }
        }
        let cut = self.pending.len() - keep;
        let emit = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        self.text.push_str(&emit);
        (emit, false)
    }

    pub(crate) fn flush(&mut self) -> String {
        let rest = std::mem::take(&mut self.pending);
        self.text.push_str(&rest);
        rest
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_strings_cut_the_answer_and_hold_back_partial_matches() {
        let stops = vec!["END".to_string(), "\n\n".to_string()];
        let mut f = StopFilter::new(stops.clone(), false);
        assert_eq!(f.push("Hello E"), ("Hello ".to_string(), false));
        assert_eq!(f.push("N"), (String::new(), false));
        assert_eq!(f.push("Dless"), (String::new(), true));
        assert_eq!(f.text, "Hello ");
        let mut f = StopFilter::new(stops.clone(), false);
        assert_eq!(f.push("a\n"), ("a".to_string(), false));
        assert_eq!(f.push("b"), ("\nb".to_string(), false));
        assert_eq!(f.flush(), "");
        assert_eq!(f.text, "a\nb");
        // No stops: everything passes at once.
        let none: Vec<String> = vec![];
        let mut f = StopFilter::new(none.clone(), false);
        assert_eq!(f.push("xyz"), ("xyz".to_string(), false));
        // A multi-byte stop string never splits a character.
        let uni = vec!["é!".to_string()];
        let mut f = StopFilter::new(uni.clone(), false);
        assert_eq!(f.push("caf é"), ("caf ".to_string(), false));
        assert_eq!(f.push("!"), (String::new(), true));
    }

    #[test]
    fn a_kept_stop_string_ends_the_answer_and_nothing_after_it() {
        let stops = vec!["END".to_string(), "ENDING".to_string(), "\n\n".to_string()];
        let mut f = StopFilter::new(stops.clone(), true);
        assert_eq!(f.push("Hello E"), ("Hello ".to_string(), false));
        assert_eq!(f.push("NDING and more"), ("ENDING".to_string(), true));
        assert_eq!(f.text, "Hello ENDING");
        assert_eq!(f.push("x"), (String::new(), true));
        let mut f = StopFilter::new(stops, true);
        assert_eq!(f.push("a\n\nb"), ("a\n\n".to_string(), true));
    }
}
