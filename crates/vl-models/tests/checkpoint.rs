//! Loading checks: parameter counts against the reference, both config dialects, sharded
//! weights, and precise errors for broken checkpoints.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};
use vl_models::checkpoint::{write_safetensors, Checkpoint, RawTensor};
use vl_models::qwen3_vl::{inspect, Qwen3VlConfig};
use vl_models::Error;

const GEOMETRIES: [&str; 2] = ["tiny-a", "tiny-b"];

fn golden(g: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../goldens").join(g)
}

fn read_json(p: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

/// A scratch model dir with the golden config, links to the golden weights and to the
/// tokenizer, template and processor files.
fn scratch(g: &str) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    let src = golden(g).join("checkpoint");
    std::fs::copy(src.join("config.json"), tmp.path().join("config.json")).unwrap();
    std::os::unix::fs::symlink(src.join("model.safetensors"), tmp.path().join("model.safetensors")).unwrap();
    link_processor_files(&src, tmp.path());
    tmp
}

/// Links every file of `src` but the config and weights into `dst`.
fn link_processor_files(src: &Path, dst: &Path) {
    for entry in std::fs::read_dir(src).unwrap() {
        let p = entry.unwrap().path();
        let name = p.file_name().unwrap().to_str().unwrap().to_string();
        if name != "config.json" && !name.starts_with("model") {
            std::os::unix::fs::symlink(std::fs::canonicalize(&p).unwrap(), dst.join(&name)).unwrap();
        }
    }
}

/// Rewrites the weights of `dir` through `edit`, which sees every tensor.
fn rewrite_weights(dir: &Path, edit: impl Fn(&mut Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)>)) {
    let ck = Checkpoint::open(dir).unwrap();
    let mut all: Vec<_> = ck
        .tensors()
        .keys()
        .map(|k| {
            let (info, bytes) = ck.raw(k).unwrap();
            (k.clone(), info.dtype, info.shape.clone(), bytes.to_vec())
        })
        .collect();
    drop(ck);
    edit(&mut all);
    let raws: Vec<RawTensor> =
        all.iter().map(|(n, d, s, b)| RawTensor { name: n.clone(), dtype: *d, shape: s.clone(), data: b }).collect();
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    write_safetensors(&dir.join("model.safetensors"), &raws).unwrap();
}

/// The transformers-4.57 form of a config written by transformers 5: `rope_theta` +
/// `rope_scaling` in text_config, no vision rope_parameters, tie flag only in text_config.
fn to_v4_dialect(mut cfg: Value) -> Value {
    let text = cfg["text_config"].as_object_mut().unwrap();
    let rp = text.remove("rope_parameters").unwrap();
    text.insert("rope_theta".into(), rp["rope_theta"].clone());
    text.insert(
        "rope_scaling".into(),
        json!({"rope_type": "default", "mrope_section": rp["mrope_section"], "mrope_interleaved": true}),
    );
    let tie = cfg["tie_word_embeddings"].clone();
    cfg["text_config"]["tie_word_embeddings"] = tie;
    cfg.as_object_mut().unwrap().remove("tie_word_embeddings");
    cfg["vision_config"].as_object_mut().unwrap().remove("rope_parameters");
    cfg["transformers_version"] = json!("4.57.0");
    cfg
}

#[test]
fn parameter_counts_match_the_reference() {
    for g in GEOMETRIES {
        let reference = read_json(&golden(g).join("reference.json"))["parameter_counts"].clone();
        let s = inspect(&golden(g).join("checkpoint")).unwrap();
        println!("{g}: {}", s.layout());
        assert_eq!(s.parameters.vision as u64, reference["vision"].as_u64().unwrap(), "{g} vision");
        assert_eq!(s.parameters.text as u64, reference["text"].as_u64().unwrap(), "{g} text");
        assert_eq!(s.parameters.lm_head as u64, reference["lm_head"].as_u64().unwrap(), "{g} lm_head");
        assert_eq!(s.tensors as u64, reference["tensors_in_checkpoint"].as_u64().unwrap(), "{g} tensors");
        assert!(s.unknown_config_keys.is_empty(), "{g}: {:?}", s.unknown_config_keys);
    }
    let a = inspect(&golden("tiny-a").join("checkpoint")).unwrap();
    assert_eq!(a.layout(), "4 text layers, 4 vision blocks, 3 deepstack mergers, merger, tied lm_head");
    let b = inspect(&golden("tiny-b").join("checkpoint")).unwrap();
    assert_eq!(b.layout(), "3 text layers, 3 vision blocks, 1 deepstack merger, merger, untied lm_head");
    assert_eq!(b.dtypes.keys().collect::<Vec<_>>(), vec!["bfloat16"]);
}

#[test]
fn both_config_dialects_give_the_same_model() {
    for g in GEOMETRIES {
        let v5 = read_json(&golden(g).join("checkpoint/config.json"));
        assert!(v5["text_config"].get("rope_parameters").is_some(), "golden config is transformers-5 dialect");
        let dir = scratch(g);
        std::fs::write(dir.path().join("config.json"), to_v4_dialect(v5.clone()).to_string()).unwrap();
        let old = Qwen3VlConfig::from_dir(dir.path()).unwrap();
        let new = Qwen3VlConfig::from_dir(&golden(g).join("checkpoint")).unwrap();
        assert_eq!(old, new, "{g}: dialects differ");
        let (s_old, s_new) = (inspect(dir.path()).unwrap(), inspect(&golden(g).join("checkpoint")).unwrap());
        assert_eq!(s_old.to_string(), s_new.to_string());
    }
}

#[test]
fn tie_flag_is_read_at_either_level() {
    let v5 = read_json(&golden("tiny-a").join("checkpoint/config.json"));
    let path = Path::new("config.json");
    let mut top_only = v5.clone();
    top_only["text_config"].as_object_mut().unwrap().remove("tie_word_embeddings");
    assert!(Qwen3VlConfig::from_json_str(&top_only.to_string(), path).unwrap().tie_word_embeddings);
    let mut text_only = v5.clone();
    text_only.as_object_mut().unwrap().remove("tie_word_embeddings");
    assert!(Qwen3VlConfig::from_json_str(&text_only.to_string(), path).unwrap().tie_word_embeddings);
    let mut neither = text_only.clone();
    neither["text_config"].as_object_mut().unwrap().remove("tie_word_embeddings");
    assert!(!Qwen3VlConfig::from_json_str(&neither.to_string(), path).unwrap().tie_word_embeddings);
}

#[test]
fn a_removed_tensor_is_named() {
    let dir = scratch("tiny-b");
    let key = "model.language_model.layers.1.self_attn.k_norm.weight";
    rewrite_weights(dir.path(), |all| all.retain(|t| t.0 != key));
    match inspect(dir.path()) {
        Err(Error::TensorPlan { missing, unexpected, wrong_shape, .. }) => {
            assert_eq!(missing, vec![key.to_string()]);
            assert!(unexpected.is_empty() && wrong_shape.is_empty());
        }
        other => panic!("expected a tensor-plan error, got {other:?}"),
    }
    let msg = inspect(dir.path()).unwrap_err().to_string();
    assert!(msg.contains(key) && msg.contains("missing"), "{msg}");
}

#[test]
fn a_reshaped_tensor_is_named_with_both_shapes() {
    let dir = scratch("tiny-a");
    let key = "model.visual.blocks.2.mlp.linear_fc1.weight";
    rewrite_weights(dir.path(), |all| {
        let t = all.iter_mut().find(|t| t.0 == key).unwrap();
        t.2.reverse();
    });
    let err = inspect(dir.path()).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains(key) && msg.contains("[32, 80]") && msg.contains("[80, 32]"), "{msg}");
    assert!(matches!(err, Error::TensorPlan { ref wrong_shape, .. } if wrong_shape.len() == 1));
}

#[test]
fn an_extra_tensor_is_reported_as_unexpected() {
    let dir = scratch("tiny-a");
    rewrite_weights(dir.path(), |all| {
        all.push(("model.visual.extra.weight".into(), safetensors::Dtype::F32, vec![2], vec![0; 8]))
    });
    let msg = inspect(dir.path()).unwrap_err().to_string();
    assert!(msg.contains("unexpected") && msg.contains("model.visual.extra.weight"), "{msg}");
}

#[test]
fn sharded_weights_load_like_one_file() {
    for g in GEOMETRIES {
        let src = golden(g).join("checkpoint");
        let ck = Checkpoint::open(&src).unwrap();
        let dir = tempfile::tempdir().unwrap();
        std::fs::copy(src.join("config.json"), dir.path().join("config.json")).unwrap();
        link_processor_files(&src, dir.path());
        let keys: Vec<&String> = ck.tensors().keys().collect();
        let mut map = serde_json::Map::new();
        for (i, part) in keys.chunks(keys.len().div_ceil(3)).enumerate() {
            let name = format!("model-{:05}-of-00003.safetensors", i + 1);
            let raws: Vec<RawTensor> = part
                .iter()
                .map(|k| {
                    let (info, data) = ck.raw(k).unwrap();
                    map.insert((*k).clone(), json!(name));
                    RawTensor { name: (*k).clone(), dtype: info.dtype, shape: info.shape.clone(), data }
                })
                .collect();
            write_safetensors(&dir.path().join(&name), &raws).unwrap();
        }
        let index = json!({"metadata": {}, "weight_map": map});
        std::fs::write(dir.path().join("model.safetensors.index.json"), index.to_string()).unwrap();
        let sharded = inspect(dir.path()).unwrap();
        let single = inspect(&src).unwrap();
        assert_eq!((sharded.files, sharded.sharded), (3, true));
        assert_eq!(sharded.parameters, single.parameters);
        let dev = candle_core::Device::Cpu;
        let key = "model.language_model.norm.weight";
        let a =
            Checkpoint::open(dir.path()).unwrap().load(key, &dev).unwrap().to_dtype(candle_core::DType::F32).unwrap();
        let b = ck.load(key, &dev).unwrap().to_dtype(candle_core::DType::F32).unwrap();
        assert_eq!(a.to_vec1::<f32>().unwrap(), b.to_vec1::<f32>().unwrap());
    }
}

#[test]
fn broken_inputs_give_precise_errors() {
    // Unknown architecture.
    let dir = scratch("tiny-a");
    let mut cfg = read_json(&dir.path().join("config.json"));
    cfg["model_type"] = json!("llava");
    cfg["architectures"] = json!(["LlavaForConditionalGeneration"]);
    std::fs::write(dir.path().join("config.json"), cfg.to_string()).unwrap();
    let msg = inspect(dir.path()).unwrap_err().to_string();
    assert!(msg.contains("LlavaForConditionalGeneration") && msg.contains("unsupported architecture"), "{msg}");

    // Truncated weights file.
    let dir = scratch("tiny-a");
    let bytes = std::fs::read(dir.path().join("model.safetensors")).unwrap();
    std::fs::remove_file(dir.path().join("model.safetensors")).unwrap();
    std::fs::write(dir.path().join("model.safetensors"), &bytes[..bytes.len() / 2]).unwrap();
    let msg = inspect(dir.path()).unwrap_err().to_string();
    assert!(msg.contains("model.safetensors") && msg.contains("not a valid safetensors"), "{msg}");

    // No weights at all.
    let dir = scratch("tiny-a");
    std::fs::remove_file(dir.path().join("model.safetensors")).unwrap();
    assert!(matches!(inspect(dir.path()), Err(Error::NoWeights { .. })));

    // Unsupported feature names its field.
    let dir = scratch("tiny-a");
    let mut cfg = read_json(&dir.path().join("config.json"));
    cfg["text_config"]["rope_parameters"]["rope_type"] = json!("yarn");
    std::fs::write(dir.path().join("config.json"), cfg.to_string()).unwrap();
    let msg = inspect(dir.path()).unwrap_err().to_string();
    assert!(msg.contains("text_config.rope_parameters.rope_type") && msg.contains("yarn"), "{msg}");

    // Invalid JSON names the file.
    let dir = scratch("tiny-a");
    std::fs::write(dir.path().join("config.json"), "{ not json").unwrap();
    let msg = inspect(dir.path()).unwrap_err().to_string();
    assert!(msg.contains("config.json") && msg.contains("invalid JSON"), "{msg}");
}

/// Qwen3.5's config (goldens/tiny-q35): `layer_types` and the older `full_attention_interval`
/// dialect read to the same pattern where they agree; the rotary share read from
/// `rope_parameters` or `text_config`; each broken hybrid field refused with its name.
#[test]
fn qwen3_5_configs_read_both_dialects_and_name_what_is_wrong() {
    let path = Path::new("config.json");
    let base = read_json(&golden("tiny-q35").join("checkpoint/config.json"));
    let parse = |v: &Value| Qwen3VlConfig::from_json_str(&v.to_string(), path);
    let c = parse(&base).unwrap();
    let h = c.text.hybrid.as_ref().unwrap();
    assert_eq!(h.linear, [true, false, true, true, false]);
    assert_eq!((c.text.rotary_dim, c.text.head_dim, c.image_token_id), (8, 32, 248056));
    // The interval dialect: every 4th layer full (transformers' rule), the default 4 without it.
    let mut v = base.clone();
    v["text_config"].as_object_mut().unwrap().remove("layer_types");
    v["text_config"]["full_attention_interval"] = json!(2);
    assert_eq!(parse(&v).unwrap().text.hybrid.unwrap().linear, [true, false, true, false, true]);
    v["text_config"].as_object_mut().unwrap().remove("full_attention_interval");
    assert_eq!(parse(&v).unwrap().text.hybrid.unwrap().linear, [true, true, true, false, true]);
    // The rotary share at the text level (older configs), and its default of 0.25.
    let mut v = base.clone();
    v["text_config"]["rope_parameters"].as_object_mut().unwrap().remove("partial_rotary_factor");
    assert_eq!(parse(&v).unwrap().text.rotary_dim, 8);
    v["text_config"]["partial_rotary_factor"] = json!(0.5);
    assert_eq!(parse(&v).unwrap().text.rotary_dim, 16);
    let broken = [
        ("layer_types", json!(["linear_attention"]), "text_config.layer_types"),
        (
            "layer_types",
            json!(["linear_attention", "sliding", "full_attention", "full_attention", "full_attention"]),
            "\"sliding\"",
        ),
        ("linear_num_value_heads", json!(3), "text_config.linear_num_value_heads"),
        ("linear_conv_kernel_dim", json!(0), "text_config.linear_conv_kernel_dim"),
        ("attn_output_gate", json!(false), "text_config.attn_output_gate"),
        ("partial_rotary_factor", json!(0.0), "partial_rotary_factor"),
    ];
    for (key, value, needle) in broken {
        let mut v = base.clone();
        if key == "partial_rotary_factor" {
            v["text_config"]["rope_parameters"][key] = value;
        } else {
            v["text_config"][key] = value;
        }
        let e = parse(&v).unwrap_err().to_string();
        assert!(e.contains(needle), "{key}: {e}");
    }
    // A Qwen3-VL config that names a Qwen3.5 field reports it as unknown, and a partial rotary
    // share is refused there.
    let mut v = read_json(&golden("tiny-a").join("checkpoint/config.json"));
    v["text_config"]["layer_types"] = json!(["full_attention"]);
    assert!(parse(&v).unwrap().unknown_keys.contains(&"text_config.layer_types".to_string()));
    v["text_config"]["rope_parameters"]["partial_rotary_factor"] = json!(0.5);
    assert!(parse(&v).unwrap_err().to_string().contains("partial_rotary_factor"));
}
