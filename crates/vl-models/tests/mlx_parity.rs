//! MLX-community fixtures converted by mlx_vlm (tools/mlx-reference/convert.py): 4 and 8 bits;
//! 6, 3, 5 bits and 6 bits at group 32 (the embedding kept at 4 bits, its shard shared); a mixed
//! one (per-layer widths and group sizes, one layer left in float); a Qwen3-VL MoE one (experts
//! stacked as `switch_mlp`, dequantized per expert). The layout maps to the HF
//! names with each tensor's width and group from the config's per-layer entries, unpacking is
//! bit-exact against mx.dequantize, and our run on the quantized checkpoint matches the reference
//! run on the dequantized weights (the exact model), logits within 1e-3.

mod common;

use std::sync::Arc;

use candle_core::{DType, Device};
use common::*;
use vl_models::qwen3_vl::weights::Storage;
use vl_models::qwen3_vl::{check_plan, plan_for, Layout, Qwen3VlConfig, Qwen3VlModel, Weights};

/// (fixture, default bits, default group, golden cases).
const FIXTURES: [(&str, usize, usize, &[&str]); 8] = [
    ("tiny-q-mlx4", 4, 64, &MLX_CASES),
    ("tiny-q-mlx8", 8, 64, &MLX_CASES),
    ("tiny-q-mlx6", 6, 64, &["one_image"]),
    ("tiny-q-mlx3", 3, 64, &["one_image"]),
    ("tiny-q-mlx5", 5, 64, &["one_image"]),
    ("tiny-q-mlx6g32", 6, 32, &["one_image"]),
    ("tiny-q-mlx-mixed", 3, 64, &["one_image"]),
    // Qwen3-VL MoE (8 experts, top-2, layer 1 dense): the experts stacked as `switch_mlp`.
    ("tiny-q-mlx-moe", 4, 64, &MLX_CASES),
];

/// The storage mlx_vlm's config gives a tensor: its module's entry in `quantization`, else the
/// default (MLX module paths: `language_model.model.layers.0.mlp.down_proj`).
fn configured(quant: &serde_json::Value, hf_key: &str) -> Storage {
    let module = hf_key.strip_suffix(".weight").unwrap().replace("model.language_model.", "language_model.model.");
    let q = quant.get(&module).unwrap_or(quant);
    Storage::Affine { bits: q["bits"].as_u64().unwrap() as usize, group: q["group_size"].as_u64().unwrap() as usize }
}

#[test]
fn mlx_layout_maps_to_the_plan_with_quantized_tensors() {
    for (name, bits, group, _) in FIXTURES {
        let dir = goldens().join(name).join("checkpoint");
        let cfg = Qwen3VlConfig::from_dir(&dir).unwrap();
        let quant = read_json(&dir.join("config.json"))["quantization"].clone();
        let w = Weights::open(&dir).unwrap();
        assert_eq!(w.layout, Layout::MlxCommunity);
        check_plan(&plan_for(&cfg, &w), &w).unwrap();
        let quantized: Vec<&String> =
            w.entries().iter().filter(|(_, e)| matches!(e.storage, Storage::Affine { .. })).map(|(k, _)| k).collect();
        assert!(quantized.iter().any(|k| k.ends_with("embed_tokens.weight")), "{quantized:?}");
        assert!(quantized.iter().any(|k| k.ends_with("mlp.down_proj.weight")), "{quantized:?}");
        let mut widths = std::collections::BTreeSet::new();
        for k in &quantized {
            let want = configured(&quant, k);
            assert_eq!(w.get(k).unwrap().storage, want, "{name} {k}");
            widths.insert(format!("{want:?}"));
        }
        // The default width is the one most tensors have; the per-layer entries are real output.
        let default = Storage::Affine { bits, group };
        assert!(quantized.iter().filter(|k| w.get(k).unwrap().storage == default).count() >= 10, "{name}");
        if name == "tiny-q-mlx-mixed" {
            assert_eq!(widths.len(), 4, "{widths:?}");
            let down1 = w.get("model.language_model.layers.1.mlp.down_proj.weight").unwrap();
            assert_eq!(down1.storage, Storage::Plain, "left in float by the predicate");
        }
        if name == "tiny-q-mlx-moe" {
            // mlx_vlm's `switch_mlp.{gate,up,down}_proj`: one 3-D affine tensor per matrix, named
            // as the plan's stacked experts; the router quantized like the rest.
            for (part, shape) in [("gate_proj", [8, 64, 64]), ("up_proj", [8, 64, 64]), ("down_proj", [8, 64, 64])] {
                let e = w.get(&format!("model.language_model.layers.0.mlp.experts.{part}.weight")).unwrap();
                assert_eq!((e.shape.as_slice(), &e.storage), (&shape[..], &default), "{part}");
            }
            assert_eq!(w.get("model.language_model.layers.0.mlp.gate.weight").unwrap().storage, default);
            assert!(w.get("model.language_model.layers.1.mlp.down_proj.weight").is_some(), "layer 1 is dense");
        }
        assert_eq!(w.get("model.visual.patch_embed.proj.weight").unwrap().storage, Storage::ChannelsLast);
        // Affine weights dequantize in f32: that is what a requantization reads.
        assert_eq!(w.text_float_dtype(), DType::F32);
        println!("{name}: {} quantized tensors, widths {widths:?}", quantized.len());
    }
}

#[test]
fn text_weights_are_read_for_quantization_in_their_stored_dtype() {
    // tiny-a is stored in f32, tiny-b in bf16 (goldens/provenance.json).
    for (name, want) in [("tiny-a", DType::F32), ("tiny-b", DType::BF16)] {
        let w = Weights::open(&goldens().join(name).join("checkpoint")).unwrap();
        assert_eq!(w.text_float_dtype(), want, "{name}");
    }
}

#[test]
fn unpacking_is_bit_exact_against_mlx() {
    for (name, ..) in FIXTURES {
        let dir = goldens().join(name).join("checkpoint");
        let w = Weights::open(&dir).unwrap();
        let pinned = load(&goldens().join(name).join("dequantized.safetensors"));
        assert!(pinned.len() >= 2, "{name}");
        for (key, want) in &pinned {
            let (key, rows) = match key.strip_suffix("[:64]") {
                Some(k) => (k, Some(64)),
                None => (key.as_str(), None),
            };
            let got = w.load(key, DType::F32, &Device::Cpu).unwrap();
            let got = match rows {
                Some(n) => got.narrow(0, 0, n).unwrap(),
                None => got,
            };
            let d = max_abs_diff(&got, want);
            assert_eq!(d, 0.0, "{name} {key}: {d:e}");
        }
    }
}

#[test]
fn quantized_checkpoints_match_the_dequantized_reference() {
    let sampled = load(&goldens().join("sampled_vocab_ids.safetensors"))["vocab_ids"].to_dtype(DType::U32).unwrap();
    for (name, _, _, cases) in FIXTURES {
        let dir = goldens().join(name).join("checkpoint");
        let m = Qwen3VlModel::load(&dir, DType::F32, &Device::Cpu).unwrap();
        for &case in cases {
            let want = load(&goldens().join(name).join("cases").join(format!("{case}.safetensors")));
            let p = prompt(case);
            let mut cache = m.new_cache();
            let state = m.prefill(&p, &mut cache, &mut |_, _| {}).unwrap();
            // The full-vocabulary last row is stored for the 4/8-bit fixtures only (size).
            let d_last = match want.get("logits.last") {
                Some(l) => max_abs_diff(&m.last_logits(&state).unwrap(), l),
                None => 0.0,
            };
            let all = m.text().logits(&state.hidden).unwrap().index_select(&sampled, 1).unwrap();
            let d_all = max_abs_diff(&all, &want["logits.sampled"]);
            let last = if want.contains_key("logits.last") { format!("{d_last:.2e}") } else { "n/a".into() };
            println!("{name}/{case}: logits max|diff| last {last}, all positions (sampled ids) {d_all:.2e}");
            assert!(d_last <= 1e-3 && d_all <= 1e-3, "{name}/{case}");
            let meta = read_json(&goldens().join(name).join("cases").join(format!("{case}.json")));
            let ids: Vec<u32> = want["greedy.ids"].to_vec1::<i64>().unwrap().iter().map(|&i| i as u32).collect();
            if meta["greedy_min_margin"].as_f64().unwrap() > 0.01 {
                let (gen, _) = greedy(&m, &p, ids.len(), &[]).unwrap();
                assert_eq!(gen, ids, "{name}/{case} greedy");
            }
        }
    }
}

#[test]
fn an_mlx_checkpoint_shards_and_loads() {
    // Two shards (the embedding and vision tower in the first, which tiny-q-mlx6 links).
    let dir = goldens().join("tiny-q-mlx4/checkpoint");
    assert!(dir.join("model.safetensors.index.json").is_file());
    let linked = goldens().join("tiny-q-mlx6/checkpoint/model-00001-of-00002.safetensors");
    assert!(std::fs::symlink_metadata(&linked).unwrap().file_type().is_symlink());
    assert_eq!(Weights::open(&goldens().join("tiny-q-mlx6/checkpoint")).unwrap().checkpoint().files().len(), 2);
    let w = Arc::new(Weights::open(&dir).unwrap());
    let vb = w.var_builder(DType::F32, &Device::Cpu, None);
    let t = vb.get((151936, 64), "model.language_model.embed_tokens.weight").unwrap();
    assert_eq!(t.dims(), &[151936, 64]);
}
