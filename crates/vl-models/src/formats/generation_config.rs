//! `generation_config.json`, the file transformers writes beside any checkpoint: the stop ids,
//! and the sampling values the checkpoint's authors suggest (`do_sample`, `temperature`, `top_k`,
//! `top_p`, `repetition_penalty`). Families read the stop ids; the suggested values are applied
//! only when asked (`vl serve --sampling model`): decoding is greedy otherwise. Other keys are
//! not read; a key read here of the wrong type is an error naming the file.

use std::path::Path;

use serde::Deserialize;

use crate::error::{Error, Result};
use crate::sampling::GenerationOptions;

#[derive(Debug, Clone, Default, PartialEq)]
pub struct GenerationConfig {
    pub eos_token_ids: Vec<u32>,
    /// False: the authors ask for greedy decoding, whatever the values below say.
    pub do_sample: Option<bool>,
    pub temperature: Option<f64>,
    pub top_k: Option<u64>,
    pub top_p: Option<f64>,
    pub repetition_penalty: Option<f64>,
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
    do_sample: Option<bool>,
    temperature: Option<f64>,
    top_k: Option<u64>,
    top_p: Option<f64>,
    repetition_penalty: Option<f64>,
}

impl GenerationConfig {
    /// Reads `dir/generation_config.json`; `default_eos` when the file or its eos is absent.
    pub fn from_dir(dir: &Path, default_eos: &[u32]) -> Result<Self> {
        let path = dir.join("generation_config.json");
        if !path.is_file() {
            return Ok(Self { eos_token_ids: default_eos.to_vec(), ..Default::default() });
        }
        let text = crate::limits::read_text(&path, crate::limits::MAX_METADATA_FILE_BYTES)?;
        let raw: Raw = serde_json::from_str(&text).map_err(|source| Error::Json { path, source })?;
        Ok(Self {
            eos_token_ids: match raw.eos_token_id {
                Some(OneOrMany::One(i)) => vec![i],
                Some(OneOrMany::Many(v)) => v,
                None => default_eos.to_vec(),
            },
            do_sample: raw.do_sample,
            temperature: raw.temperature,
            top_k: raw.top_k,
            top_p: raw.top_p,
            repetition_penalty: raw.repetition_penalty,
        })
    }

    /// Greedy options with the suggested sampling values applied (none when `do_sample` is
    /// false), checked as a request's are (`GenerationOptions::validate`).
    pub fn sampling(&self) -> Result<GenerationOptions> {
        let mut o = GenerationOptions::default();
        if self.do_sample != Some(false) {
            if let Some(t) = self.temperature {
                o.temperature = t;
            }
            if let Some(k) = self.top_k {
                o.top_k = usize::try_from(k).unwrap_or(usize::MAX);
            }
            if let Some(p) = self.top_p {
                o.top_p = p;
            }
        }
        if let Some(p) = self.repetition_penalty {
            o.repetition_penalty = p;
        }
        o.validate()?;
        Ok(o)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(json: &str) -> Result<GenerationConfig> {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("generation_config.json"), json).unwrap();
        GenerationConfig::from_dir(dir.path(), &[7])
    }

    #[test]
    fn sampling_values_apply_unless_do_sample_is_false() {
        let c = read(
            r#"{"eos_token_id": [1, 2], "temperature": 0.7, "top_k": 20, "top_p": 0.8, "repetition_penalty": 1.05}"#,
        )
        .unwrap();
        assert_eq!(c.eos_token_ids, [1, 2]);
        let o = c.sampling().unwrap();
        assert_eq!((o.temperature, o.top_k, o.top_p, o.repetition_penalty), (0.7, 20, 0.8, 1.05));
        let greedy = read(r#"{"do_sample": false, "temperature": 0.7, "top_k": 20}"#).unwrap();
        assert_eq!(greedy.eos_token_ids, [7]);
        let o = greedy.sampling().unwrap();
        assert_eq!((o.temperature, o.top_k), (0.0, 0));
    }

    #[test]
    fn a_value_of_the_wrong_type_or_range_is_an_error() {
        let e = read(r#"{"temperature": "hot"}"#).unwrap_err().to_string();
        assert!(e.contains("generation_config.json"), "{e}");
        assert!(read(r#"{"top_p": 7.0}"#).unwrap().sampling().is_err());
    }
}
