//! Every golden file is pinned by SHA-256 in goldens/provenance.json; no Python at test time.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

fn goldens() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../goldens")
}

fn sha256(path: &Path) -> String {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    Sha256::digest(&bytes).iter().map(|b| format!("{b:02x}")).collect()
}

fn pinned(root: &Path) -> BTreeMap<String, String> {
    let text = std::fs::read_to_string(root.join("provenance.json")).expect("goldens/provenance.json");
    let v: serde_json::Value = serde_json::from_str(&text).expect("provenance.json is JSON");
    v["files"]
        .as_object()
        .expect("provenance.json has a files map")
        .iter()
        .map(|(k, v)| (k.clone(), v.as_str().expect("hash is a string").to_string()))
        .collect()
}

/// Files whose bytes differ from their pinned hash (or are missing).
fn mismatches(root: &Path, files: &BTreeMap<String, String>) -> Vec<String> {
    files
        .iter()
        .filter(|(rel, want)| {
            let p = root.join(rel);
            !p.is_file() || &sha256(&p) != *want
        })
        .map(|(rel, _)| rel.clone())
        .collect()
}

fn walk(dir: &Path, root: &Path, out: &mut Vec<String>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let entry = entry.unwrap();
        let p = entry.path();
        let ft = entry.file_type().unwrap();
        if ft.is_dir() {
            walk(&p, root, out);
        } else if ft.is_file() {
            out.push(p.strip_prefix(root).unwrap().to_string_lossy().into_owned());
        }
    }
}

#[test]
fn every_golden_matches_its_pinned_hash() {
    let root = goldens();
    let files = pinned(&root);
    assert!(files.len() > 40, "provenance lists only {} files", files.len());
    let bad = mismatches(&root, &files);
    assert!(bad.is_empty(), "golden files changed or missing: {bad:?}");
    println!("{} golden files verified", files.len());
}

#[test]
fn every_golden_file_is_pinned() {
    let root = goldens();
    let files = pinned(&root);
    let mut found = Vec::new();
    walk(&root, &root, &mut found);
    let unpinned: Vec<_> = found.iter().filter(|f| *f != "provenance.json" && !files.contains_key(*f)).collect();
    assert!(unpinned.is_empty(), "files under goldens/ without a pinned hash: {unpinned:?}");
}

#[test]
fn a_changed_byte_is_detected() {
    let root = goldens();
    let files = pinned(&root);
    let rel = "tiny-a/cases/one_image.safetensors";
    let tmp = tempfile::tempdir().unwrap();
    let copy = tmp.path().join(rel);
    std::fs::create_dir_all(copy.parent().unwrap()).unwrap();
    let mut bytes = std::fs::read(root.join(rel)).unwrap();
    let one: BTreeMap<_, _> = [(rel.to_string(), files[rel].clone())].into();
    std::fs::write(&copy, &bytes).unwrap();
    assert!(mismatches(tmp.path(), &one).is_empty(), "an intact copy must verify");
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x01;
    std::fs::write(&copy, &bytes).unwrap();
    assert_eq!(mismatches(tmp.path(), &one), vec![rel.to_string()]);
}
