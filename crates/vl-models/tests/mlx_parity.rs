//! MLX-community fixtures (mlx_vlm convert, 4 and 8 bits, group 64): the layout maps to the HF
//! names, unpacking is bit-exact against mx.dequantize, and our run on the quantized checkpoint
//! matches the reference run on the dequantized weights (the exact model), logits within 1e-3.

mod common;

use std::sync::Arc;

use candle_core::{DType, Device};
use common::*;
use vl_models::qwen3_vl::weights::Storage;
use vl_models::qwen3_vl::{check_plan, tensor_plan, GenerationOptions, Layout, Qwen3VlConfig, Qwen3VlModel, Weights};

const FIXTURES: [(&str, usize); 2] = [("tiny-q-mlx4", 4), ("tiny-q-mlx8", 8)];

#[test]
fn mlx_layout_maps_to_the_plan_with_quantized_tensors() {
    for (name, bits) in FIXTURES {
        let dir = goldens().join(name).join("checkpoint");
        let cfg = Qwen3VlConfig::from_dir(&dir).unwrap();
        let w = Weights::open(&dir).unwrap();
        assert_eq!(w.layout, Layout::MlxCommunity);
        check_plan(&tensor_plan(&cfg), &w).unwrap();
        let quantized: Vec<&String> =
            w.entries().iter().filter(|(_, e)| matches!(e.storage, Storage::Affine { .. })).map(|(k, _)| k).collect();
        assert!(quantized.iter().any(|k| k.ends_with("embed_tokens.weight")), "{quantized:?}");
        assert!(quantized.iter().any(|k| k.ends_with("mlp.down_proj.weight")), "{quantized:?}");
        for k in &quantized {
            assert_eq!(w.get(k).unwrap().storage, Storage::Affine { bits, group: 64 });
        }
        assert_eq!(w.get("model.visual.patch_embed.proj.weight").unwrap().storage, Storage::ChannelsLast);
        // Affine weights dequantize in f32: that is what a requantization reads.
        assert_eq!(w.text_float_dtype(), DType::F32);
        println!("{name}: {} quantized tensors", quantized.len());
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
    for (name, _) in FIXTURES {
        let dir = goldens().join(name).join("checkpoint");
        let w = Weights::open(&dir).unwrap();
        let pinned = load(&goldens().join(name).join("dequantized.safetensors"));
        assert_eq!(pinned.len(), 3);
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
    for (name, _) in FIXTURES {
        let dir = goldens().join(name).join("checkpoint");
        let m = Qwen3VlModel::load(&dir, DType::F32, &Device::Cpu).unwrap();
        for case in MLX_CASES {
            let want = load(&goldens().join(name).join("cases").join(format!("{case}.safetensors")));
            let p = prompt(case);
            let mut cache = m.new_cache();
            let state = m.prefill(&p, &mut cache, &mut |_, _| {}).unwrap();
            let d_last = max_abs_diff(&m.last_logits(&state).unwrap(), &want["logits.last"]);
            let all = m.text().logits(&state.hidden).unwrap().index_select(&sampled, 1).unwrap();
            let d_all = max_abs_diff(&all, &want["logits.sampled"]);
            println!("{name}/{case}: logits max|diff| last {d_last:.2e}, all positions {d_all:.2e}");
            assert!(d_last <= 1e-3 && d_all <= 1e-3, "{name}/{case}");
            let meta = read_json(&goldens().join(name).join("cases").join(format!("{case}.json")));
            let ids: Vec<u32> = want["greedy.ids"].to_vec1::<i64>().unwrap().iter().map(|&i| i as u32).collect();
            if meta["greedy_min_margin"].as_f64().unwrap() > 0.01 {
                let opts = GenerationOptions { max_new_tokens: ids.len(), ..Default::default() };
                let gen = m.generate(&p, &opts, &mut |_| true).unwrap();
                assert_eq!(gen.tokens, ids, "{name}/{case} greedy");
            }
        }
    }
}

#[test]
fn an_mlx_checkpoint_shards_and_loads() {
    // Already sharded by mlx_vlm (index + one file); and a dequantized load equals a direct one.
    let dir = goldens().join("tiny-q-mlx4/checkpoint");
    assert!(dir.join("model.safetensors.index.json").is_file());
    let w = Arc::new(Weights::open(&dir).unwrap());
    let vb = w.var_builder(DType::F32, &Device::Cpu, None);
    let t = vb.get((151936, 64), "model.language_model.embed_tokens.weight").unwrap();
    assert_eq!(t.dims(), &[151936, 64]);
}
