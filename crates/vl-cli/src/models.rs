//! `vl models`: the checkpoints in the local Hugging Face cache listed, pulled ahead of time and
//! removed, as `ollama list/pull/rm` do. A GGUF repository is pulled by quantization
//! (`repo:Q4_K_M`: the text model of that type and its vision projector, as `llama-server -hf`
//! picks them); `vl run --model repo:Q4_K_M` resolves the same way.

use std::path::Path;

use anyhow::{bail, Result};
use clap::Subcommand;
use serde_json::{json, Value};

use vl_models::hub::{self, is_gguf, is_mmproj, quant_of};

#[derive(Subcommand)]
pub enum ModelsCommand {
    /// The models in the local Hugging Face cache (HF_HUB_CACHE, else HF_HOME/hub, else
    /// ~/.cache/huggingface/hub): id, format, quantization, size on disk, complete or partial.
    List {
        /// One JSON array instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Download a model into the cache without running it: a hub id (safetensors checkpoint or
    /// MLX conversion), or `REPO:QUANT` for a GGUF repository (the text model of that type, e.g.
    /// Q4_K_M, and its vision projector, f16 preferred).
    Pull {
        /// `Qwen/Qwen3-VL-2B-Instruct` or `ggml-org/Qwen3-VL-2B-Instruct-GGUF:Q4_K_M`.
        model: String,
    },
    /// Remove a model (every revision and file of its repository) from the cache.
    Rm {
        /// The hub id as `vl models list` shows it.
        model: String,
    },
}

pub fn run(cmd: ModelsCommand) -> Result<()> {
    match cmd {
        ModelsCommand::List { json } => list(json),
        ModelsCommand::Pull { model } => {
            let path = hub::pull(&model)?;
            crate::note!("pulled {model}: {}", path.display());
            Ok(())
        }
        ModelsCommand::Rm { model } => rm(&model),
    }
}

/// One cached repository as listed.
struct Entry {
    id: String,
    format: String,
    quant: String,
    bytes: u64,
    complete: bool,
}

fn list(as_json: bool) -> Result<()> {
    let root = hub::cache_root();
    let mut entries = Vec::new();
    if root.is_dir() {
        let dirs =
            std::fs::read_dir(&root).map_err(|e| anyhow::anyhow!("cannot list the cache {}: {e}", root.display()))?;
        for d in dirs.flatten() {
            let name = d.file_name().to_string_lossy().to_string();
            let Some(id) = name.strip_prefix("models--").map(|s| s.replacen("--", "/", 1)) else { continue };
            entries.push(describe(&id, &d.path()));
        }
    }
    entries.sort_by(|a, b| a.id.cmp(&b.id));
    if as_json {
        let v: Vec<Value> = entries
            .iter()
            .map(|e| json!({"model": e.id, "format": e.format, "quant": e.quant, "bytes": e.bytes, "complete": e.complete}))
            .collect();
        println!("{}", Value::Array(v));
        return Ok(());
    }
    if entries.is_empty() {
        println!("no models in {} (vl models pull MODEL)", root.display());
        return Ok(());
    }
    let width = entries.iter().map(|e| e.id.len()).max().unwrap_or(5).max(5);
    println!("{:width$}  {:11}  {:14}  {:>9}  STATE", "MODEL", "FORMAT", "QUANT", "SIZE");
    for e in &entries {
        let state = if e.complete { "complete" } else { "partial" };
        println!("{:width$}  {:11}  {:14}  {:>9}  {state}", e.id, e.format, e.quant, size(e.bytes));
    }
    Ok(())
}

fn size(bytes: u64) -> String {
    match bytes {
        b if b >= 1 << 30 => format!("{:.1} GB", b as f64 / 1e9),
        b if b >= 1 << 20 => format!("{:.1} MB", b as f64 / 1e6),
        b => format!("{:.1} KB", b as f64 / 1e3),
    }
}

/// What a cached repository holds: its snapshot's files read by name, its config's dtype or MLX
/// quantization, and its blobs' bytes.
fn describe(id: &str, dir: &Path) -> Entry {
    let bytes = std::fs::read_dir(dir.join("blobs"))
        .map(|it| it.flatten().filter_map(|b| b.metadata().ok()).filter(|m| m.is_file()).map(|m| m.len()).sum())
        .unwrap_or(0);
    let snapshot = hub::snapshot_dir(dir);
    let files: Vec<String> = snapshot
        .as_ref()
        .and_then(|s| std::fs::read_dir(s).ok())
        .map(|it| it.flatten().map(|f| f.file_name().to_string_lossy().to_string()).collect())
        .unwrap_or_default();
    let ggufs: Vec<&String> = files.iter().filter(|f| is_gguf(f) && !is_mmproj(f)).collect();
    if !ggufs.is_empty() {
        let mut quants: Vec<String> = ggufs.iter().map(|f| quant_of(f)).collect();
        quants.sort();
        quants.dedup();
        let has_mmproj = files.iter().any(|f| is_gguf(f) && is_mmproj(f));
        return Entry { id: id.into(), format: "gguf".into(), quant: quants.join(","), bytes, complete: has_mmproj };
    }
    let config: Option<Value> = snapshot
        .as_ref()
        .and_then(|s| {
            vl_models::limits::read_text(&s.join("config.json"), vl_models::limits::MAX_METADATA_FILE_BYTES).ok()
        })
        .and_then(|t| serde_json::from_str(&t).ok());
    let complete = hub::is_cached(id);
    let Some(config) = config else {
        return Entry { id: id.into(), format: "unknown".into(), quant: "-".into(), bytes, complete };
    };
    if let Some(bits) = config.get("quantization").and_then(|q| q.get("bits")).and_then(Value::as_u64) {
        return Entry { id: id.into(), format: "mlx".into(), quant: format!("{bits}-bit"), bytes, complete };
    }
    let dtype = ["torch_dtype", "dtype"]
        .iter()
        .find_map(|k| config.get(*k).or_else(|| config.get("text_config").and_then(|t| t.get(*k))))
        .and_then(Value::as_str)
        .unwrap_or("-");
    Entry { id: id.into(), format: "safetensors".into(), quant: dtype.into(), bytes, complete }
}

fn rm(model: &str) -> Result<()> {
    if !hub::looks_like_hub_id(model) {
        bail!("vl models rm {model}: not a hub id (OWNER/NAME, as `vl models list` shows)");
    }
    let dir = hub::repo_dir(model);
    if !dir.is_dir() {
        bail!("vl models rm {model}: not in the cache {}", hub::cache_root().display());
    }
    let bytes = describe(model, &dir).bytes;
    std::fs::remove_dir_all(&dir)
        .map_err(|e| anyhow::anyhow!("vl models rm {model}: cannot remove {}: {e}", dir.display()))?;
    crate::note!("removed {model} ({}) from {}", size(bytes), hub::cache_root().display());
    Ok(())
}
