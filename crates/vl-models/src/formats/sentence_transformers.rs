//! Sentence Transformers' files beside a checkpoint's weights: `modules.json` lists the modules
//! that turn the transformer's hidden states into what the model returns (`Pooling` and
//! `Normalize` for an embedding model, `LogitScore` for a generative reranker), and each module
//! keeps its settings in `<path>/config.json`. The same class is published under more than one
//! namespace (`sentence_transformers.models.Pooling`,
//! `sentence_transformers.cross_encoder.models.LogitScore`,
//! `sentence_transformers.base.modules.transformer.Transformer`); a module is known here by its
//! class name.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// One entry of `modules.json`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Module {
    /// The `type` as written.
    pub kind: String,
    /// The class name: the last part of a `sentence_transformers.` type; the whole type else.
    pub class: String,
    /// The module's folder, relative to the checkpoint (`""` for the transformer itself).
    pub path: String,
}

/// The class a module type names: `sentence_transformers.models.Pooling` -> `Pooling`. A type
/// outside the `sentence_transformers` package keeps its full name (it is no class we know).
pub fn class_of(kind: &str) -> &str {
    match kind.strip_prefix("sentence_transformers.") {
        Some(rest) => rest.rsplit('.').next().unwrap_or(rest),
        None => kind,
    }
}

/// The modules `dir/modules.json` lists, in order; None without the file. An error names the file
/// when it is not a list of modules with a `type` each.
pub fn modules(dir: &Path) -> Result<Option<Vec<Module>>> {
    let path = dir.join("modules.json");
    if !path.is_file() {
        return Ok(None);
    }
    let text = crate::limits::read_text(&path, crate::limits::MAX_METADATA_FILE_BYTES)?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| Error::Json { path: path.clone(), source: e })?;
    let Some(list) = v.as_array() else {
        return Err(Error::Input { what: path.display().to_string(), message: "not a list of modules".into() });
    };
    let mut out = Vec::with_capacity(list.len());
    for m in list {
        let Some(kind) = m.get("type").and_then(|t| t.as_str()) else {
            return Err(Error::Input {
                what: path.display().to_string(),
                message: format!("a module without a `type`: {m}"),
            });
        };
        let sub = m.get("path").and_then(|p| p.as_str()).unwrap_or("");
        if Path::new(sub).is_absolute() || Path::new(sub).components().any(|c| c.as_os_str() == "..") {
            return Err(Error::Input {
                what: path.display().to_string(),
                message: format!("module path {sub:?} leaves the checkpoint directory"),
            });
        }
        out.push(Module { kind: kind.to_string(), class: class_of(kind).to_string(), path: sub.to_string() });
    }
    Ok(Some(out))
}

/// The settings of the module of class `class` (its `config.json`, as a JSON object), with the
/// file's path; `default_path` is the folder when `modules.json` does not give one. An error names
/// the file when it is missing or not a JSON object.
pub fn module_config(dir: &Path, class: &str, default_path: &str) -> Result<(PathBuf, serde_json::Value)> {
    let sub = modules(dir)?
        .into_iter()
        .flatten()
        .find(|m| m.class == class)
        .map(|m| m.path)
        .filter(|p| !p.is_empty())
        .unwrap_or_else(|| default_path.to_string());
    let path = dir.join(sub).join("config.json");
    let text = crate::limits::read_text(&path, crate::limits::MAX_METADATA_FILE_BYTES)?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| Error::Json { path: path.clone(), source: e })?;
    if !v.is_object() {
        return Err(Error::Input { what: path.display().to_string(), message: "not a JSON object".into() });
    }
    Ok((path, v))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_are_known_by_their_last_name_in_any_namespace() {
        assert_eq!(class_of("sentence_transformers.models.Pooling"), "Pooling");
        assert_eq!(class_of("sentence_transformers.cross_encoder.models.LogitScore"), "LogitScore");
        assert_eq!(class_of("sentence_transformers.base.modules.transformer.Transformer"), "Transformer");
        assert_eq!(class_of("my_package.Pooling"), "my_package.Pooling");
    }

    #[test]
    fn module_paths_stay_inside_the_checkpoint() {
        let dir = std::env::temp_dir().join(format!("vl-st-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("modules.json"),
            r#"[{"type": "sentence_transformers.models.Pooling", "path": "../x"}]"#,
        )
        .unwrap();
        let e = modules(&dir).unwrap_err().to_string();
        assert!(e.contains("modules.json") && e.contains("../x"), "{e}");
        std::fs::write(dir.join("modules.json"), r#"{"type": 1}"#).unwrap();
        assert!(modules(&dir).unwrap_err().to_string().contains("not a list"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
