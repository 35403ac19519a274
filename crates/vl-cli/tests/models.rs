//! `vl models list/pull/rm` and `--model REPO:QUANT` against a temporary Hugging Face cache laid
//! out as hf-hub writes it (blobs, snapshots linking to them, refs/main); nothing touches the
//! network (`HF_HUB_OFFLINE=1`).

mod common;

use std::path::Path;
use std::process::Command;

use common::goldens;
use serde_json::Value;

/// Writes `files` (name, source) as repository `id` at revision `rev` of the cache `root`.
fn cached_repo(root: &Path, id: &str, rev: &str, files: &[(&str, &Path)]) {
    let repo = root.join(format!("models--{}", id.replace('/', "--")));
    let snapshot = repo.join("snapshots").join(rev);
    std::fs::create_dir_all(&snapshot).unwrap();
    std::fs::create_dir_all(repo.join("blobs")).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), rev).unwrap();
    for (i, (name, src)) in files.iter().enumerate() {
        let blob = format!("{:040x}", i + 1);
        std::fs::copy(src, repo.join("blobs").join(&blob)).unwrap();
        std::os::unix::fs::symlink(format!("../../blobs/{blob}"), snapshot.join(name)).unwrap();
    }
}

fn vl(cache: &Path, args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_vl"))
        .args(args)
        .env("HF_HUB_CACHE", cache)
        .env("HF_HUB_OFFLINE", "1")
        .env_remove("HF_ENDPOINT")
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

#[test]
fn models_are_listed_resolved_by_quant_refused_offline_and_removed() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path();
    let ck = goldens().join("tiny-a/checkpoint");
    let ck_files: Vec<(String, std::path::PathBuf)> = std::fs::read_dir(&ck)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (e.file_name().to_string_lossy().to_string(), e.path())
        })
        .collect();
    let refs: Vec<(&str, &Path)> = ck_files.iter().map(|(n, p)| (n.as_str(), p.as_path())).collect();
    cached_repo(cache, "test-org/tiny-vl", "a1b2c3", &refs);
    let gguf = goldens().join("gguf");
    cached_repo(
        cache,
        "test-org/tiny-vl-GGUF",
        "d4e5f6",
        &[
            ("tiny-vl-F32.gguf", &gguf.join("tiny-a-f32.gguf")),
            ("mmproj-tiny-vl-F32.gguf", &gguf.join("mmproj-tiny-a-f32.gguf")),
        ],
    );
    cached_repo(cache, "test-org/partial", "0f0f0f", &[("config.json", &ck.join("config.json"))]);

    // list: a table and JSON with format, quantization, bytes and state.
    let (code, table, err) = vl(cache, &["models", "list"]);
    assert_eq!(code, 0, "{err}");
    println!("{table}");
    assert!(table.lines().next().unwrap().starts_with("MODEL"), "{table}");
    let (code, out, err) = vl(cache, &["models", "list", "--json"]);
    assert_eq!(code, 0, "{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    let rows = v.as_array().unwrap();
    let row = |id: &str| rows.iter().find(|r| r["model"] == id).unwrap_or_else(|| panic!("{id} not listed: {out}"));
    let dir_bytes: u64 = ck_files.iter().map(|(_, p)| std::fs::metadata(p).unwrap().len()).sum();
    let st = row("test-org/tiny-vl");
    assert_eq!(
        (st["format"].as_str(), st["complete"].as_bool(), st["bytes"].as_u64()),
        (Some("safetensors"), Some(true), Some(dir_bytes))
    );
    let g = row("test-org/tiny-vl-GGUF");
    assert_eq!(
        (g["format"].as_str(), g["quant"].as_str(), g["complete"].as_bool()),
        (Some("gguf"), Some("F32"), Some(true))
    );
    assert_eq!(row("test-org/partial")["complete"], false);
    assert_eq!(rows.len(), 3);

    // A hub id and a REPO:QUANT resolve from the cache, offline.
    for model in ["test-org/tiny-vl", "test-org/tiny-vl-GGUF:F32", "test-org/tiny-vl-GGUF:f32"] {
        let (code, _, err) =
            vl(cache, &["run", "--model", model, "--prompt", "Hi", "--max-new-tokens", "2", "--quantize", "none"]);
        assert_eq!(code, 0, "{model}: {err}");
    }
    // What is not cached, offline: one line each, naming what to do.
    for (args, needle) in [
        (
            vec!["run", "--model", "test-org/tiny-vl-GGUF:Q4_K_M", "--prompt", "Hi"],
            "vl models pull test-org/tiny-vl-GGUF:Q4_K_M",
        ),
        (vec!["models", "pull", "test-org/other"], "HF_HUB_OFFLINE is set"),
        (vec!["models", "pull", "test-org/tiny-vl-GGUF:Q8_0"], "HF_HUB_OFFLINE is set"),
        (vec!["models", "pull", "not-a-hub-id"], "not a hub id"),
        (vec!["models", "rm", "test-org/absent"], "not in the cache"),
        (vec!["models", "rm", "../escape"], "not a hub id"),
    ] {
        let (code, _, err) = vl(cache, &args);
        assert_eq!(code, 1, "{args:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err:?} should say {needle:?}");
    }

    // rm removes the repository and nothing else.
    let (code, _, err) = vl(cache, &["models", "rm", "test-org/tiny-vl"]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("removed test-org/tiny-vl"), "{err}");
    assert!(!cache.join("models--test-org--tiny-vl").exists());
    let (_, out, _) = vl(cache, &["models", "list", "--json"]);
    let v: Value = serde_json::from_str(&out).unwrap();
    let ids: Vec<&str> = v.as_array().unwrap().iter().map(|r| r["model"].as_str().unwrap()).collect();
    assert_eq!(ids, ["test-org/partial", "test-org/tiny-vl-GGUF"]);
    assert!(ck.join("model.safetensors").is_file(), "the goldens are untouched");
}
