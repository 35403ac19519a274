//! Quality of load-time k-quantization against f32, over the golden prompts, on a seeded random
//! model whose text dims fit the 256-value k-quant blocks (the tiny goldens' dims do not, so
//! their layers would stay dense). Reports max |dlogit| (last position, full vocabulary) and
//! top-1 agreement over every position; bounds are the measured figures with headroom
//! (docs/performance.md).

mod common;

use std::hash::{Hash, Hasher};
use std::path::Path;

use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use common::*;
use rand::{Rng, SeedableRng};
use vl_models::qwen3_vl::{Qwen3VlConfig, Qwen3VlModel};
use vl_nn::QuantType;

/// Seeded per tensor name, so every load sees the same weights.
struct Seeded;

impl SimpleBackend for Seeded {
    fn get(&self, s: Shape, name: &str, _: candle_nn::Init, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        name.hash(&mut h);
        let mut rng = rand::rngs::StdRng::seed_from_u64(h.finish());
        let n = s.elem_count();
        let fan_in: usize = s.dims().iter().skip(1).product::<usize>().max(1);
        let (mean, std) = if name.contains("norm") && name.ends_with("weight") {
            (1.0f32, 0.3f32)
        } else if s.rank() == 1 {
            (0.0, 0.2)
        } else if name.contains("embed_tokens") {
            (0.0, 1.0)
        } else {
            (0.0, 1.5 / (fan_in as f32).sqrt())
        };
        // Sum of uniforms: cheap, deterministic, roughly normal.
        let v: Vec<f32> =
            (0..n).map(|_| mean + std * ((0..4).map(|_| rng.random::<f32>()).sum::<f32>() - 2.0) * 1.732).collect();
        Tensor::from_vec(v, s, dev)?.to_dtype(dtype)
    }
    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> candle_core::Result<Tensor> {
        candle_core::bail!("no shape for {name}")
    }
    fn contains_tensor(&self, _: &str) -> bool {
        true
    }
}

fn config() -> Qwen3VlConfig {
    // tiny-a's vision tower and token ids, a text decoder at k-quant-sized dims.
    let mut v = read_json(&goldens().join("tiny-a/checkpoint/config.json"));
    let t = &mut v["text_config"];
    t["hidden_size"] = 256.into();
    t["intermediate_size"] = 512.into();
    t["num_hidden_layers"] = 3.into();
    t["num_attention_heads"] = 4.into();
    t["num_key_value_heads"] = 2.into();
    t["head_dim"] = 64.into();
    t["rope_parameters"]["mrope_section"] = serde_json::json!([12, 10, 10]);
    v["vision_config"]["out_hidden_size"] = 256.into();
    Qwen3VlConfig::from_json_str(&v.to_string(), Path::new("quality.json")).unwrap()
}

fn model(q: Option<QuantType>) -> Qwen3VlModel {
    let vb = candle_nn::VarBuilder::from_backend(Box::new(Seeded), DType::F32, Device::Cpu);
    Qwen3VlModel::from_var_builder_quantized(config(), vb, q).unwrap()
}

#[test]
fn kquant_modes_stay_close_to_f32() {
    let reference = model(None);
    // (mode, bound on max |dlogit| relative to the logit range, minimum top-1 agreement)
    // Measured (docs/performance.md): q8k 2.1% / 90.9%, q6k 5.0% / 83.4%, q4k 15.2% / 54.5%. A random
    // model has no trained structure and near-tied logits, so these are pessimistic; the bounds
    // catch a broken layout or kernel (which gives ~0% agreement), not a subtle regression.
    let modes = [
        (QuantType::Q8_0, 0.04, 0.85),
        (QuantType::Q8K, 0.04, 0.85),
        (QuantType::Q6K, 0.08, 0.75),
        (QuantType::Q4K, 0.20, 0.45),
    ];
    let mut refs = Vec::new();
    for case in CASES {
        let p = prompt(case);
        let mut cache = reference.new_cache();
        let s = reference.prefill(&p, &mut cache, &mut |_, _| {}).unwrap();
        refs.push((p, reference.text().logits(&s.hidden).unwrap()));
    }
    for (q, rel_bound, agree_bound) in modes {
        let m = model(Some(q));
        assert!(m.text().storage().iter().any(|(_, s, _)| s == q.name()), "{q:?} not applied");
        let (mut worst, mut range, mut agree, mut total) = (0f32, 0f32, 0usize, 0usize);
        for (p, want) in &refs {
            let mut cache = m.new_cache();
            let s = m.prefill(p, &mut cache, &mut |_, _| {}).unwrap();
            let got = m.text().logits(&s.hidden).unwrap();
            let n = want.dim(0).unwrap();
            let last = |t: &Tensor| t.get(n - 1).unwrap();
            worst = worst.max(max_abs_diff(&last(&got), &last(want)));
            let hi = last(want).max(0).unwrap().to_scalar::<f32>().unwrap();
            let lo = last(want).min(0).unwrap().to_scalar::<f32>().unwrap();
            range = range.max(hi - lo);
            let a = got.argmax(1).unwrap().to_vec1::<u32>().unwrap();
            let b = want.argmax(1).unwrap().to_vec1::<u32>().unwrap();
            agree += a.iter().zip(&b).filter(|(x, y)| x == y).count();
            total += n;
        }
        let frac = agree as f64 / total as f64;
        println!(
            "{}: max |dlogit| {worst:.4} (logit range {range:.1}, {:.2}%), top-1 agreement {agree}/{total} = {:.1}%",
            q.name(),
            100.0 * worst / range,
            100.0 * frac
        );
        assert!(worst <= rel_bound * range && frac >= agree_bound, "{q:?}: {worst} of {range}, {frac}");
    }
}
