//! The registry: the one place that names the families this build runs. It picks the family of
//! a checkpoint directory (`config.json`'s `architectures` / `model_type`) or a GGUF file
//! (`general.architecture`) and forwards `open`, `inspect`, `quantize` and `default_quant` to it.
//! Adding a family is a folder and a line in `FAMILIES`.

use std::path::Path;

use crate::error::{Error, Result};
use crate::family::{Family, FamilyEntry, ModelOptions, Source};
use crate::gguf::Recipe;

/// Every family this build runs.
pub static FAMILIES: &[&FamilyEntry] = &[
    &crate::qwen3_vl::family::ENTRY,
    &crate::qwen3_vl_moe::ENTRY,
    &crate::qwen3_vl_embedding::ENTRY,
    &crate::qwen3_vl_reranker::ENTRY,
    &crate::qwen3_5::ENTRY,
    &crate::qwen3_5::MOE_ENTRY,
];

/// Sentence Transformers modules that every kind of checkpoint may list: the model itself and a
/// final L2 normalisation.
const PLAIN_MODULES: [&str; 2] = ["Transformer", "Normalize"];

/// What identifies a model's family.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Architecture {
    /// `config.json`'s `architectures` and `model_type`, and the Sentence Transformers modules
    /// `modules.json` lists beyond `Transformer` and `Normalize` (an embedding model's pooling).
    Config { architectures: Vec<String>, model_type: Option<String>, heads: Vec<String> },
    /// GGUF `general.architecture`.
    Gguf(String),
}

/// The family that loads `arch`, or an error naming what was found and what is supported.
pub fn lookup(arch: &Architecture, origin: &Path) -> Result<&'static FamilyEntry> {
    // Nothing readable names the architecture (a missing or broken config.json): the first
    // family loads it, and its own checks name what is wrong.
    if *arch == (Architecture::Config { architectures: vec![], model_type: None, heads: vec![] }) {
        return Ok(FAMILIES[0]);
    }
    let found = FAMILIES.iter().copied().find(|f| match arch {
        Architecture::Config { architectures, model_type, heads } => {
            let named = architectures.iter().any(|a| f.architectures.contains(&a.as_str()))
                || (architectures.is_empty() && model_type.as_deref().is_some_and(|m| f.model_types.contains(&m)));
            named && heads.len() == f.heads.len() && heads.iter().all(|h| f.heads.contains(&h.as_str()))
        }
        Architecture::Gguf(a) => f.gguf_architectures.contains(&a.as_str()),
    });
    found.ok_or_else(|| {
        if *arch == Architecture::Gguf("clip".into()) {
            return Error::Input {
                what: origin.display().to_string(),
                message: "general.architecture \"clip\" is a vision projector, not a text model: pass it with --mmproj beside --model TEXT.gguf".into(),
            };
        }
        let (what, supported): (String, Vec<&str>) = match arch {
            Architecture::Config { architectures, model_type, heads } => (
                format!(
                    "architectures {architectures:?}{}{}",
                    model_type.as_ref().map(|m| format!(", model_type {m:?}")).unwrap_or_default(),
                    if heads.is_empty() {
                        String::new()
                    } else {
                        format!(" with the Sentence Transformers modules {heads:?} (modules.json)")
                    }
                ),
                {
                    let mut all: Vec<&str> = vec![];
                    for a in FAMILIES.iter().flat_map(|f| f.architectures.iter().copied()) {
                        if !all.contains(&a) {
                            all.push(a);
                        }
                    }
                    all
                },
            ),
            Architecture::Gguf(a) => (
                format!("GGUF general.architecture {a:?}"),
                FAMILIES.iter().flat_map(|f| f.gguf_architectures.iter().copied()).collect(),
            ),
        };
        Error::Input {
            what: origin.display().to_string(),
            message: format!("unsupported architecture: {what}; this build supports {}", supported.join(", ")),
        }
    })
}

/// Reads what identifies the model at `path` (a directory's config.json, or a GGUF header).
pub fn architecture(path: &Path) -> Result<Architecture> {
    if crate::gguf::is_gguf(path) {
        let file = crate::gguf::find_text_file(path)?;
        return Ok(Architecture::Gguf(crate::gguf::architecture(&file)?));
    }
    let config = path.join("config.json");
    // A directory without one (a broken link counts as one: its read names it) is no model; the
    // weights are not looked for (`run` and `inspect` say the same).
    if path.is_dir() && config.symlink_metadata().is_err() {
        return Err(Error::not_a_model_dir(path));
    }
    let v: serde_json::Value = crate::limits::read_text(&config, crate::limits::MAX_METADATA_FILE_BYTES)
        .ok()
        .and_then(|text| serde_json::from_str(&text).ok())
        .unwrap_or_default();
    let architectures = v
        .get("architectures")
        .and_then(|a| a.as_array())
        .map(|a| a.iter().filter_map(|s| s.as_str().map(String::from)).collect())
        .unwrap_or_default();
    let model_type = v.get("model_type").and_then(|m| m.as_str()).map(String::from);
    Ok(Architecture::Config { architectures, model_type, heads: sentence_transformer_heads(path)? })
}

/// The Sentence Transformers modules `modules.json` lists beyond `Transformer` and `Normalize`,
/// by class (`sentence_transformers.models.Pooling` whatever namespace the file names it in);
/// none without the file.
fn sentence_transformer_heads(dir: &Path) -> Result<Vec<String>> {
    Ok(crate::formats::sentence_transformers::modules(dir)?
        .into_iter()
        .flatten()
        .filter(|m| !PLAIN_MODULES.contains(&m.class.as_str()))
        .map(|m| {
            if m.kind.starts_with("sentence_transformers.") {
                format!("sentence_transformers.models.{}", m.class)
            } else {
                m.kind
            }
        })
        .collect())
}

/// Loads the model at `source` with the family its files name.
pub fn open(source: &Source<'_>, opts: &ModelOptions) -> Result<Box<dyn Family>> {
    let entry = lookup(&architecture(source.model)?, source.model)?;
    (entry.open)(source, opts, false)
}

/// `vl inspect` for the model at `source`, with the family its files name.
pub fn inspect(source: &Source<'_>, json: bool) -> Result<String> {
    let entry = lookup(&architecture(source.model)?, source.model)?;
    (entry.inspect)(source, json)
}

/// `vl quantize` for the checkpoint directory `model`, with the family its files name.
pub fn quantize(
    model: &Path,
    recipe: Recipe,
    out: &Path,
    overwrite: bool,
    progress: &mut dyn FnMut(&str),
) -> Result<crate::gguf::Written> {
    let entry = lookup(&architecture(model)?, model)?;
    (entry.quantize)(model, recipe, out, overwrite, progress)
}

/// The quantization a model loads with when none is asked for (see `FamilyEntry::default_quant`).
pub fn default_quant(model: &Path) -> Result<Option<vl_nn::QuantType>> {
    let entry = lookup(&architecture(model)?, model)?;
    (entry.default_quant)(model)
}

/// `open`, in stages: the vision tower at the first `encode`, the text decoder at
/// `finish_loading` (after the tower is released). For one answer from a cold start.
pub fn open_staged(source: &Source<'_>, opts: &ModelOptions) -> Result<Box<dyn Family>> {
    let entry = lookup(&architecture(source.model)?, source.model)?;
    (entry.open)(source, opts, true)
}
