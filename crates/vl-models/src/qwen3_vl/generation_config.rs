//! `generation_config.json`: the stop ids. The checkpoint's suggested sampling values are not
//! read: decoding is greedy unless the caller asks otherwise.

use std::path::Path;

use serde::Deserialize;

use crate::error::{Error, Result};

#[derive(Debug, Clone, Default, PartialEq)]
pub struct GenerationConfig {
    pub eos_token_ids: Vec<u32>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(u32),
    Many(Vec<u32>),
}

#[derive(Deserialize)]
struct Raw {
    eos_token_id: Option<OneOrMany>,
}

impl GenerationConfig {
    /// Reads `dir/generation_config.json`; `default_eos` when the file or its eos is absent.
    pub fn from_dir(dir: &Path, default_eos: &[u32]) -> Result<Self> {
        let path = dir.join("generation_config.json");
        if !path.is_file() {
            return Ok(Self { eos_token_ids: default_eos.to_vec() });
        }
        let text = crate::limits::read_text(&path, crate::limits::MAX_METADATA_FILE_BYTES)?;
        let raw: Raw = serde_json::from_str(&text).map_err(|source| Error::Json { path, source })?;
        Ok(Self {
            eos_token_ids: match raw.eos_token_id {
                Some(OneOrMany::One(i)) => vec![i],
                Some(OneOrMany::Many(v)) => v,
                None => default_eos.to_vec(),
            },
        })
    }
}
