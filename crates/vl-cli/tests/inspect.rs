//! `vl inspect` end to end: counts on the tiny checkpoints, exit codes and messages on broken ones.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use vl_models::checkpoint::{write_safetensors, Checkpoint, RawTensor};

fn golden(g: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../goldens").join(g).join("checkpoint")
}

fn vl(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_vl")).args(args).output().expect("run vl");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn inspect_prints_the_layout_and_counts() {
    let (code, out, err) = vl(&["inspect", "--model", golden("tiny-a").to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("4 text layers, 4 vision blocks, 3 deepstack mergers, merger, tied lm_head"), "{out}");
    assert!(out.contains("vision 173.0K (172960), text 4.91M (4910496), lm_head tied"), "{out}");
    let (code, out, err) = vl(&["inspect", "--model", golden("tiny-b").to_str().unwrap(), "--json"]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["text_layers"], 3);
    assert_eq!(v["deepstack_mergers"], 1);
    assert_eq!(v["tied_lm_head"], false);
    assert_eq!(v["parameters"]["lm_head"], 151936 * 48);
}

#[test]
fn inspect_fails_with_the_name_of_a_missing_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let src = golden("tiny-a");
    std::fs::copy(src.join("config.json"), tmp.path().join("config.json")).unwrap();
    let ck = Checkpoint::open(&src).unwrap();
    let gone = "model.visual.deepstack_merger_list.2.norm.bias";
    let raws: Vec<RawTensor> = ck
        .tensors()
        .keys()
        .filter(|k| k.as_str() != gone)
        .map(|k| {
            let (info, data) = ck.raw(k).unwrap();
            RawTensor { name: k.clone(), dtype: info.dtype, shape: info.shape.clone(), data }
        })
        .collect();
    write_safetensors(&tmp.path().join("model.safetensors"), &raws).unwrap();
    let (code, out, err) = vl(&["inspect", "--model", tmp.path().to_str().unwrap()]);
    assert_ne!(code, 0);
    assert!(out.is_empty(), "{out}");
    assert!(err.contains(gone) && err.contains("1 missing tensor"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "one clear line: {err}");
}

#[test]
fn inspect_fails_on_a_missing_directory() {
    let (code, _, err) = vl(&["inspect", "--model", "/nonexistent/model"]);
    assert_ne!(code, 0);
    assert!(err.contains("/nonexistent/model"), "{err}");
}

#[test]
fn inspect_reports_the_mlx_layout_and_storage() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../goldens/tiny-q-mlx4/checkpoint");
    let (code, out, err) = vl(&["inspect", "--model", dir.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("mlx-community layout"), "{out}");
    assert!(
        out.contains("text decoder: float32 (9 tensors), mlx 4-bit (group 64, float32 scales) (15 tensors)"),
        "{out}"
    );
    assert!(!out.contains("warning"), "{out}");
}

#[test]
fn inspect_reports_each_width_of_a_mixed_mlx_checkpoint_and_what_run_computes() {
    // tools/mlx-reference/convert.py: 3-bit default, the embedding 4-bit, v_proj 6-bit, one
    // down_proj 8-bit group 32, the other left in float by the predicate.
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../goldens/tiny-q-mlx-mixed/checkpoint");
    let (code, out, err) = vl(&["inspect", "--model", dir.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains(
            "text decoder: float32 (10 tensors), mlx 3-bit (group 64, float32 scales) (10 tensors), mlx 4-bit (group 64, float32 scales) (1 tensors), mlx 6-bit (group 64, float32 scales) (2 tensors), mlx 8-bit (group 32, float32 scales) (1 tensors)"
        ),
        "{out}"
    );
    // The widest width (8) picks Q8_0; every row here fills its 32-value blocks.
    assert!(
        out.contains("requantized to q8_0")
            && out.contains("(14 tensors), the others dequantized exactly to f32 (0 tensors)"),
        "{out}"
    );
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../goldens/tiny-q-mlx6/checkpoint");
    let (_, out, _) = vl(&["inspect", "--model", dir.to_str().unwrap()]);
    // 6 bits -> Q6_K, whose 256-value blocks no row of the tiny geometry (64, 128) fills.
    assert!(
        out.contains("requantized to q6k")
            && out.contains("(0 tensors), the others dequantized exactly to f32 (15 tensors)"),
        "{out}"
    );
}

#[test]
fn inspect_takes_a_cached_hub_id_and_never_downloads() {
    let home = tempfile::tempdir().unwrap();
    common::fake_hub_cache(home.path());
    let with_home = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_vl"))
            .args(args)
            .env("HF_HOME", home.path())
            .env_remove("HF_HUB_CACHE")
            .env_remove("HF_HUB_OFFLINE")
            .output()
            .unwrap();
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, out, err) = with_home(&["inspect", "--model", "tiny/qwen3-vl-a", "--json"]);
    assert_eq!(code, 0, "{err}");
    let direct = vl(&["inspect", "--model", golden("tiny-a").to_str().unwrap(), "--json"]).1;
    let (a, b): (serde_json::Value, serde_json::Value) =
        (serde_json::from_str(&out).unwrap(), serde_json::from_str(&direct).unwrap());
    assert_eq!(a["parameters"], b["parameters"], "{out}");
    // Not cached: one line saying so, whatever the network (inspect does not download).
    let (code, _, err) = with_home(&["inspect", "--model", "tiny/not-cached"]);
    assert_ne!(code, 0);
    assert!(err.contains("tiny/not-cached") && err.contains("not in the local Hugging Face cache"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    // A missing .gguf file is named as one.
    let (code, _, err) = vl(&["inspect", "--model", "/nonexistent/model-Q4_K_M.gguf"]);
    assert_ne!(code, 0);
    assert!(err.contains("GGUF file /nonexistent/model-Q4_K_M.gguf not found"), "{err}");
}

/// A MoE checkpoint (goldens/tiny-moe): its family, expert counts and sparse layers, and the
/// parameter counts the reference reported (reference.json).
#[test]
fn inspect_shows_a_moe_checkpoint_s_experts() {
    let dir = golden("tiny-moe");
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.parent().unwrap().join("reference.json")).unwrap()).unwrap();
    let (code, out, err) = vl(&["inspect", "--model", dir.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("architecture: Qwen3VLMoeForConditionalGeneration (qwen3_vl_moe)"), "{out}");
    assert!(
        out.contains(
            "experts:      8 per layer, 2 active per token, moe_intermediate 24; sparse layers [0, 2], dense [1]"
        ),
        "{out}"
    );
    let (code, out, err) = vl(&["inspect", "--model", dir.to_str().unwrap(), "--json"]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let counts = &reference["parameter_counts"];
    assert_eq!(v["parameters"]["vision"], counts["vision"]);
    assert_eq!(v["parameters"]["text"], counts["text"]);
    assert_eq!(v["parameters"]["lm_head"], counts["lm_head"]);
    assert_eq!(v["experts"]["experts_per_layer"], 8);
    assert_eq!(v["experts"]["sparse_layers"], serde_json::json!([0, 2]));
    // The experts' product override takes two values; another is one line naming it.
    let out = Command::new(env!("CARGO_BIN_EXE_vl"))
        .args(["run", "--model", dir.to_str().unwrap(), "--prompt", "hi", "--max-new-tokens", "1"])
        .env("VL_MOE_EXPERTS", "fast")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("VL_MOE_EXPERTS") && err.contains("\"fast\""), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    // Its dense layer has no place in llama.cpp's qwen3vlmoe file: one line saying so, nothing
    // written.
    let out_dir = tempfile::tempdir().unwrap();
    let target = out_dir.path().join("q");
    let (code, _, err) =
        vl(&["quantize", "--model", dir.to_str().unwrap(), "--quantize", "q8", "--out", target.to_str().unwrap()]);
    assert_ne!(code, 0);
    assert!(err.contains("layers 1 are dense") && err.trim().lines().count() == 1, "{err}");
    assert!(!target.exists());
    // The all-sparse checkpoint is written as llama.cpp's qwen3vlmoe pair, which inspects as the
    // checkpoint does.
    let sparse = golden("tiny-moe-gguf");
    let (code, _, err) = vl(&[
        "quantize",
        "--model",
        sparse.to_str().unwrap(),
        "--quantize",
        "q4k_m",
        "--out",
        target.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    let (code, out, err) = vl(&["inspect", "--model", target.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("experts:      8 per layer, 2 active per token, moe_intermediate 24"), "{out}");
}

/// A Qwen3.5 checkpoint: its layer pattern as config.json lists it (the Gated DeltaNet layers
/// by index), and its `mtp.*` tensors reported as the multi-token-prediction head, not as
/// ignored tensors.
#[test]
fn inspect_shows_a_qwen35_checkpoint_s_layer_pattern_and_mtp_head() {
    let dir = golden("tiny-q35");
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let types = cfg["text_config"]["layer_types"].as_array().unwrap();
    let linear: Vec<usize> = (0..types.len()).filter(|&i| types[i] == "linear_attention").collect();
    let (code, out, err) = vl(&["inspect", "--model", dir.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("architecture: Qwen3_5ForConditionalGeneration (qwen3_5)"), "{out}");
    assert!(out.contains(&format!("{} text layers, ", types.len())), "{out}");
    assert!(out.contains(&format!("Gated DeltaNet layers {linear:?}")), "{out}");
    assert!(out.contains("mtp head:     15 tensors"), "{out}");
    assert!(!out.contains("ignored:"), "{out}");
    let (code, out, err) = vl(&["inspect", "--model", dir.to_str().unwrap(), "--json"]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["mtp_head_tensors"], 15, "{v}");
    assert_eq!(v["ignored_tensors"], serde_json::json!([]), "{v}");
}
