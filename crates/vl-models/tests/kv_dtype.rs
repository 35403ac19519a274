//! A KV cache kept in f16 or bf16 under f32 compute (`--kv-cache-dtype`, `KvCache::in_dtype`):
//! every golden prompt of the Qwen3-VL geometries (tiny-a, tiny-b) and of Qwen3.5 (tiny-q35: a
//! prompt of several DeltaNet chunks, images, video) ends at logits within the measured bound of
//! the reference's, with the reference's greedy answer; through the engine, batched answers
//! equal the answers alone (the cache's rounding is the same whatever the batch).

mod common;

use candle_core::DType;
use common::*;
use vl_models::engine::{Engine, EngineOptions, ModelOptions};
use vl_models::qwen3_vl::Qwen3VlModel;

/// Last-position logits against the reference (which keeps f32 keys and values), measured
/// 2026-12-06 on the goldens below (`golden_prompts_stay_within_the_bound`, printed): f16 up to
/// 1.6e-2 (tiny-b image_mid; 1.3e-3 to 8.9e-3 on tiny-q35), bf16 up to 3.6e-1 (tiny-b
/// image_mid; 8.9e-3 to 8.5e-2 on tiny-q35). Every greedy answer equal to the reference's.
const F16_BOUND: f32 = 3e-2;
const BF16_BOUND: f32 = 6e-1;

fn bound(d: DType) -> f32 {
    if d == DType::F16 {
        F16_BOUND
    } else {
        BF16_BOUND
    }
}

#[test]
fn golden_prompts_stay_within_the_bound() {
    for dtype in [DType::F16, DType::BF16] {
        for g in ["tiny-a", "tiny-b"] {
            let m = Qwen3VlModel::load(&goldens().join(g).join("checkpoint"), DType::F32, &device())
                .unwrap()
                .with_kv_dtype(dtype);
            for case in cases_of(g) {
                let (d, same) = against_reference(&m, g, case);
                println!("{dtype:?} {g} {case}: last logits {d:.2e}, greedy ids equal: {same}");
                assert!(d <= tol(bound(dtype)), "{dtype:?} {g} {case}: {d:e}");
                assert!(same, "{dtype:?} {g} {case}: greedy ids differ");
            }
        }
        let dir = goldens().join("tiny-q35/checkpoint");
        let m = Qwen3VlModel::load(&dir, DType::F32, &device()).unwrap().with_kv_dtype(dtype);
        for case in ["long_text", "one_image", "two_images", "no_think", "video"] {
            let c = goldens().join("tiny-q35/cases");
            let want = load(&c.join(format!("{case}.safetensors")));
            let meta = read_json(&c.join(format!("{case}.json")));
            let p = case_prompt(&want);
            let mut cache = m.new_cache();
            let state = m.prefill(&p, &mut cache, &mut |_, _| {}).unwrap();
            let d = max_abs_diff(&m.last_logits(&state).unwrap(), &want["logits.last"]);
            let ids: Vec<u32> =
                meta["greedy"]["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
            let same = greedy(&m, &p, ids.len(), &[]).unwrap().0 == ids;
            println!("{dtype:?} tiny-q35 {case}: last logits {d:.2e}, greedy ids equal: {same}");
            assert!(d <= tol(bound(dtype)), "{dtype:?} tiny-q35 {case}: {d:e}");
            assert!(same, "{dtype:?} tiny-q35 {case}: greedy ids differ");
        }
    }
}

/// Through the engine (template, scheduler, prefix store): four golden requests from four
/// threads into four slots with an f16 cache give the reference's answers, and the prefixes the
/// store keeps hold half the bytes an f32 cache's do. Elsewhere than the CPU (f32 compute) the
/// dtype is refused at load.
#[test]
fn the_engine_keeps_half_the_bytes_and_the_answers() {
    let g = &goldens().join("tiny-b");
    let cases = ["text_only", "one_image", "two_images", "multi_turn"];
    let run = |kv: Option<DType>| -> vl_models::Result<(Vec<Vec<u32>>, usize)> {
        let model = ModelOptions { device: device(), kv_dtype: kv, ..Default::default() };
        let engine = Engine::load(&g.join("checkpoint"), EngineOptions { model, parallel: 4, ..Default::default() })?;
        let answers = std::thread::scope(|s| {
            let hs: Vec<_> = cases
                .iter()
                .map(|&c| {
                    let engine = &engine;
                    s.spawn(move || {
                        let want = load(&g.join("cases").join(format!("{c}.safetensors")));
                        let n = want["greedy.ids"].dims1().unwrap();
                        engine.generate(&golden_request(c, n), &mut |_| true).unwrap().token_ids
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        Ok((answers, engine.stats().kv_cache_bytes))
    };
    if !device().is_cpu() {
        let err = run(Some(DType::F16)).expect_err("refused off the CPU").to_string();
        assert!(err.contains("KV cache dtype"), "{err}");
        return;
    }
    let (half, half_bytes) = run(Some(DType::F16)).unwrap();
    let (full, full_bytes) = run(None).unwrap();
    for (c, got) in cases.iter().zip(&half) {
        let want = load(&g.join("cases").join(format!("{c}.safetensors")))["greedy.ids"].to_vec1::<i64>().unwrap();
        assert_eq!(got.iter().map(|&i| i as i64).collect::<Vec<_>>(), want, "{c}");
    }
    assert_eq!(half, full);
    println!("kept prefixes: f16 {half_bytes} bytes, f32 {full_bytes}");
    assert!(full_bytes > 0 && 2 * half_bytes == full_bytes, "f16 {half_bytes}, f32 {full_bytes}");
    let refused = ModelOptions { kv_dtype: Some(DType::F16), dtype: DType::BF16, ..Default::default() };
    let err = Engine::load(&g.join("checkpoint"), EngineOptions { model: refused, ..Default::default() }).err();
    let err = err.expect("f16 keys under bf16 compute are refused").to_string();
    assert!(err.contains("KV cache dtype") && err.contains("f32 compute"), "{err}");
}
