//! `--model`: a local directory, or a Hugging Face hub id resolved through the local cache
//! (`HF_HUB_CACHE`, else `HF_HOME/hub`, else ~/.cache/huggingface/hub) and downloaded when absent.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

/// Files a checkpoint directory may hold; the first group is required.
const REQUIRED: &[&str] = &["config.json", "tokenizer.json"];
const OPTIONAL: &[&str] = &[
    "tokenizer_config.json",
    "preprocessor_config.json",
    "generation_config.json",
    "chat_template.json",
    "chat_template.jinja",
];
const WEIGHTS: &str = "model.safetensors";
const INDEX: &str = "model.safetensors.index.json";

fn cache() -> hf_hub::Cache {
    match std::env::var("HF_HUB_CACHE") {
        Ok(p) => hf_hub::Cache::new(PathBuf::from(p)),
        Err(_) => hf_hub::Cache::from_env(),
    }
}

/// The cache's root directory.
pub fn cache_root() -> PathBuf {
    cache().path().clone()
}

/// A hub repository's directory in the cache (`models--OWNER--NAME`).
pub fn repo_dir(model: &str) -> PathBuf {
    cache_root().join(format!("models--{}", model.replace('/', "--")))
}

/// The snapshot `refs/main` points at in a repository's cache directory.
pub fn snapshot_dir(repo: &Path) -> Option<PathBuf> {
    let rev = std::fs::read_to_string(repo.join("refs").join("main")).ok()?;
    let rev = rev.trim();
    if rev.is_empty() || rev.contains(['/', '\\']) || rev.starts_with('.') {
        return None;
    }
    let dir = repo.join("snapshots").join(rev);
    dir.is_dir().then_some(dir)
}

/// Whether every file a checkpoint needs is cached.
pub fn is_cached(model: &str) -> bool {
    cached(model).is_some()
}

/// `OWNER/NAME:QUANT` split, when `spec` has that form (QUANT letters, digits and `_`).
pub fn split_quant(spec: &str) -> Option<(&str, &str)> {
    let (repo, quant) = spec.rsplit_once(':')?;
    let ok = !quant.is_empty() && quant.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    (ok && looks_like_hub_id(repo)).then_some((repo, quant))
}

/// The GGUF text model of `quant` in a cached repository (its projector beside it), when both
/// are there.
fn cached_gguf(repo: &str, quant: &str) -> Result<Option<PathBuf>> {
    let Some(snapshot) = snapshot_dir(&repo_dir(repo)) else { return Ok(None) };
    let files: Vec<String> = std::fs::read_dir(&snapshot)
        .map(|it| it.flatten().map(|f| f.file_name().to_string_lossy().to_string()).collect())
        .unwrap_or_default();
    match pick(repo, &files, quant) {
        Ok((text, _)) => Ok(Some(snapshot.join(text))),
        // Files of another quantization, or none yet: a pull may bring them.
        Err(_) => Ok(None),
    }
}

/// Downloads `spec` into the cache (a hub id's checkpoint files, or `REPO:QUANT`'s GGUF pair)
/// and returns where it is; one line when offline or unreachable.
pub fn pull(spec: &str) -> Result<PathBuf> {
    let quant = split_quant(spec);
    if quant.is_none() && !looks_like_hub_id(spec) {
        bail!("{spec}: not a hub id (OWNER/NAME) or OWNER/NAME:QUANT");
    }
    if offline() {
        bail!("{spec}: HF_HUB_OFFLINE is set, nothing can be downloaded (cache: {})", cache().path().display());
    }
    let fetched = match quant {
        Some((repo, q)) => download_gguf(repo, q),
        None => download(spec),
    };
    fetched.map_err(|e| {
        anyhow::anyhow!(
            "cannot download {spec}: {}",
            e.root_cause().to_string().lines().next().unwrap_or("unknown error")
        )
    })
}

fn api() -> Result<hf_hub::api::sync::Api> {
    let mut b = hf_hub::api::sync::ApiBuilder::from_cache(cache())
        .with_progress(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    // A mirror (hf-mirror.com and the like), as the Python hub client reads it.
    if let Ok(endpoint) = std::env::var("HF_ENDPOINT") {
        if !endpoint.is_empty() {
            b = b.with_endpoint(endpoint);
        }
    }
    Ok(b.build()?)
}

/// The GGUF text model of `quant` and its projector from `repo`, chosen from its file list.
fn download_gguf(repo: &str, quant: &str) -> Result<PathBuf> {
    let r = api()?.model(repo.to_string());
    let files: Vec<String> = r.info()?.siblings.into_iter().map(|s| s.rfilename).collect();
    let (text, mmproj) = pick(repo, &files, quant)?;
    r.get(&mmproj).with_context(|| mmproj.clone())?;
    r.get(&text).with_context(|| text.clone())
}

fn offline() -> bool {
    std::env::var("HF_HUB_OFFLINE").is_ok_and(|v| !v.is_empty() && v != "0")
}

pub fn looks_like_hub_id(s: &str) -> bool {
    let parts: Vec<&str> = s.split('/').collect();
    parts.len() == 2 && parts.iter().all(|p| !p.is_empty() && !p.starts_with('.')) && !s.contains('\\')
}

/// Returns a local directory holding the checkpoint.
/// `model` without downloading (`vl inspect`): a directory, a .gguf file, or a hub id already in
/// the local cache.
pub fn resolve_cached(model: &str) -> Result<PathBuf> {
    if let Some((repo, quant)) = split_quant(model).filter(|_| !Path::new(model).exists()) {
        if let Some(file) = cached_gguf(repo, quant)? {
            return Ok(file);
        }
    }
    if let Some(local) = local(model)? {
        return Ok(local);
    }
    bail!(
        "{model} is not in the local Hugging Face cache ({}); `vl run --model {model}` downloads it, or pass --model DIR",
        cache().path().display()
    )
}

/// A local directory or .gguf file, or a cached hub snapshot; None for a hub id not cached.
fn local(model: &str) -> Result<Option<PathBuf>> {
    let path = Path::new(model);
    if path.is_dir() || (path.is_file() && path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf"))) {
        return Ok(Some(path.to_path_buf()));
    }
    if path.exists() {
        bail!("--model {model}: not a directory or a .gguf file");
    }
    if path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf")) {
        bail!("GGUF file {model} not found");
    }
    if !looks_like_hub_id(model) {
        bail!("model directory {model} not found");
    }
    Ok(cached(model))
}

pub fn resolve(model: &str) -> Result<PathBuf> {
    let path = Path::new(model);
    if path.is_dir() {
        return Ok(path.to_path_buf());
    }
    if path.is_file() && path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf")) {
        return Ok(path.to_path_buf());
    }
    if let Some((repo, quant)) = split_quant(model).filter(|_| !path.exists()) {
        if let Some(file) = cached_gguf(repo, quant)? {
            return Ok(file);
        }
        if offline() {
            bail!("{model} is not in the local Hugging Face cache ({}) and HF_HUB_OFFLINE is set; `vl models pull {model}` when online, or pass --model FILE.gguf", cache().path().display());
        }
        return pull(model);
    }
    if let Some(local) = local(model)? {
        return Ok(local);
    }
    if offline() {
        bail!("{model} is not in the local Hugging Face cache ({}) and HF_HUB_OFFLINE is set; pass --model DIR with a local checkpoint", cache().path().display());
    }
    download(model).map_err(|e| {
        anyhow::anyhow!(
            "cannot download {model} ({}) and there is no cached copy in {}; when offline, pass --model DIR with a local checkpoint",
            e.root_cause().to_string().lines().next().unwrap_or("unknown error"),
            cache().path().display()
        )
    })
}

/// The snapshot directory when every needed file is cached.
fn cached(model: &str) -> Option<PathBuf> {
    let repo = cache().model(model.to_string());
    let config = repo.get("config.json")?;
    let dir = config.parent()?.to_path_buf();
    let have = |f: &str| repo.get(f).is_some();
    if !REQUIRED.iter().all(|f| have(f)) {
        return None;
    }
    if have(INDEX) {
        let text = crate::limits::read_text(&dir.join(INDEX), crate::limits::MAX_METADATA_FILE_BYTES).ok()?;
        let index: serde_json::Value = serde_json::from_str(&text).ok()?;
        let shards = index["weight_map"].as_object()?;
        if !shards.values().filter_map(|v| v.as_str()).all(have) {
            return None;
        }
    } else if !have(WEIGHTS) {
        return None;
    }
    Some(dir)
}

fn download(model: &str) -> Result<PathBuf> {
    let repo = api()?.model(model.to_string());
    let config = repo.get("config.json").context("config.json")?;
    for f in REQUIRED {
        repo.get(f).with_context(|| f.to_string())?;
    }
    for f in OPTIONAL {
        let _ = repo.get(f);
    }
    match repo.get(INDEX) {
        Ok(index) => {
            let text = crate::limits::read_text(&index, crate::limits::MAX_METADATA_FILE_BYTES)?;
            let v: serde_json::Value = serde_json::from_str(&text)?;
            let mut shards: Vec<&str> =
                v["weight_map"].as_object().context("weight_map")?.values().filter_map(|s| s.as_str()).collect();
            shards.sort();
            shards.dedup();
            for s in shards {
                repo.get(s).with_context(|| s.to_string())?;
            }
        }
        Err(_) => {
            repo.get(WEIGHTS).context(WEIGHTS)?;
        }
    }
    Ok(config.parent().context("snapshot directory")?.to_path_buf())
}

pub fn is_gguf(name: &str) -> bool {
    name.to_ascii_lowercase().ends_with(".gguf")
}

pub fn is_mmproj(name: &str) -> bool {
    name.to_ascii_lowercase().starts_with("mmproj")
}

/// The quantization a GGUF file's name says (`Qwen3-VL-2B-Instruct-Q4_K_M.gguf` -> `Q4_K_M`):
/// its last `-`-separated part.
pub fn quant_of(name: &str) -> String {
    let stem = &name[..name.len().saturating_sub(5)];
    stem.rsplit('-').next().unwrap_or(stem).to_string()
}

/// Among a repository's files, the text model of quantization `quant` (case-insensitive, the
/// whole last part of the name) and its vision projector (f16, then bf16, then q8_0, then the
/// first by name). An error lists the quantizations the repository has.
pub fn pick(repo: &str, files: &[String], quant: &str) -> Result<(String, String)> {
    let texts: Vec<&String> = files.iter().filter(|f| is_gguf(f) && !is_mmproj(f)).collect();
    let matching: Vec<&&String> = texts.iter().filter(|f| quant_of(f).eq_ignore_ascii_case(quant)).collect();
    let text = match matching.as_slice() {
        [one] => (**one).clone(),
        [] => {
            let mut have: Vec<String> = texts.iter().map(|f| quant_of(f)).collect();
            have.sort();
            have.dedup();
            if have.is_empty() {
                bail!("{repo}: no GGUF text model in the repository");
            }
            bail!("{repo}: no {quant} GGUF; it has {}", have.join(", "));
        }
        many => bail!(
            "{repo}: {} files are {quant} ({}); split GGUF files are not read",
            many.len(),
            many.iter().map(|f| f.as_str()).collect::<Vec<_>>().join(", ")
        ),
    };
    let mut projectors: Vec<&String> = files.iter().filter(|f| is_gguf(f) && is_mmproj(f)).collect();
    projectors.sort();
    let rank = |f: &str| {
        let q = quant_of(f).to_ascii_lowercase();
        ["f16", "bf16", "q8_0"].iter().position(|p| *p == q).unwrap_or(3)
    };
    let Some(mmproj) = projectors.iter().min_by_key(|f| rank(f)) else {
        bail!("{repo}: no mmproj*.gguf vision projector in the repository");
    };
    Ok((text, (*mmproj).clone()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quants_are_read_from_names_and_picked_with_their_projector() {
        let files: Vec<String> = [
            "Qwen3-VL-2B-Instruct-Q4_K_M.gguf",
            "Qwen3-VL-2B-Instruct-Q4_K_S.gguf",
            "Qwen3-VL-2B-Instruct-Q8_0.gguf",
            "mmproj-Qwen3-VL-2B-Instruct-Q8_0.gguf",
            "mmproj-Qwen3-VL-2B-Instruct-f16.gguf",
            "README.md",
        ]
        .map(String::from)
        .to_vec();
        let (t, m) = pick("r", &files, "q4_k_m").unwrap();
        assert_eq!(
            (t.as_str(), m.as_str()),
            ("Qwen3-VL-2B-Instruct-Q4_K_M.gguf", "mmproj-Qwen3-VL-2B-Instruct-f16.gguf")
        );
        // Q4_K is not Q4_K_M or Q4_K_S: the whole part must match.
        let e = pick("r", &files, "Q4_K").unwrap_err().to_string();
        assert_eq!(e, "r: no Q4_K GGUF; it has Q4_K_M, Q4_K_S, Q8_0");
        let no_proj: Vec<String> = files.iter().filter(|f| !is_mmproj(f)).cloned().collect();
        assert!(pick("r", &no_proj, "Q8_0").unwrap_err().to_string().contains("no mmproj"));
    }
}
