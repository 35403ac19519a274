//! Incremental detokenization for streaming, model-agnostic (any `tokenizers` tokenizer).

use tokenizers::Tokenizer;

use crate::error::{Error, Result};

/// Turns a token stream into text pieces; a piece is emitted only once it decodes to complete
/// characters, so multi-token UTF-8 sequences are never split. Special tokens are skipped.
pub struct StreamDecoder<'a> {
    tokenizer: &'a Tokenizer,
    ids: Vec<u32>,
    prefix: usize,
    read: usize,
}

impl<'a> StreamDecoder<'a> {
    pub fn new(tokenizer: &'a Tokenizer) -> Self {
        Self { tokenizer, ids: Vec::new(), prefix: 0, read: 0 }
    }

    /// The text already emitted from the current prefix, and the text with every pending token.
    fn texts(&self) -> Result<(String, String)> {
        let dec = |ids: &[u32]| {
            self.tokenizer
                .decode(ids, true)
                .map_err(|e| Error::Input { what: "tokenizer".into(), message: e.to_string() })
        };
        Ok((dec(&self.ids[self.prefix..self.read])?, dec(&self.ids[self.prefix..])?))
    }

    /// Adds a token; returns the text it completes, if any.
    pub fn push(&mut self, id: u32) -> Result<Option<String>> {
        self.ids.push(id);
        let (before, now) = self.texts()?;
        if now.len() > before.len() && !now.ends_with('\u{FFFD}') {
            self.prefix = self.read;
            self.read = self.ids.len();
            Ok(Some(now[before.len()..].to_string()))
        } else {
            Ok(None)
        }
    }

    /// Whatever is left (possibly an incomplete sequence, decoded with replacement characters).
    pub fn finish(&mut self) -> Result<Option<String>> {
        let (before, now) = self.texts()?;
        self.prefix = self.ids.len();
        self.read = self.ids.len();
        Ok((now.len() > before.len()).then(|| now[before.len()..].to_string()))
    }
}
