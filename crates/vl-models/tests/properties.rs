//! Property tests over every number a file or a flag can hand us: config values, preprocessor
//! values, pixel-budget flags and sampling options. Whatever the values, the result is either a
//! valid object that respects the documented bounds or an error naming the file or option,
//! never a panic. Seeded: the same cases run every time.

use std::path::Path;

use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, RngSeed};
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use vl_models::qwen3_vl::image_processor::{smart_resize, MAX_PIXEL_BUDGET};
use vl_models::qwen3_vl::{tensor_plan, ImageProcessor, PreprocessorConfig, Qwen3VlConfig};
use vl_models::sampling::{check_logits, sample};
use vl_models::GenerationOptions;

fn seeded(cases: u32) -> Config {
    Config {
        cases,
        rng_algorithm: RngAlgorithm::ChaCha,
        rng_seed: RngSeed::Fixed(0x005e_ed0f_7e57),
        failure_persistence: None,
        ..Config::default()
    }
}

fn golden_config() -> Value {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../goldens/tiny-a/checkpoint/config.json");
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

/// JSON values a hostile or careless file holds where a number belongs.
fn hostile_number() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(json!(0)),
        Just(json!(1)),
        Just(json!(-1)),
        Just(json!(2)),
        Just(json!(3)),
        Just(json!(u64::MAX)),
        Just(json!(i64::MIN)),
        Just(json!(1_000_000_000u64)),
        Just(json!(0.5)),
        Just(json!(-1e-6)),
        Just(json!(1e300)),
        Just(json!(-1e300)),
        Just(json!(null)),
        Just(json!("16")),
        Just(json!([])),
        (0u64..5000).prop_map(|n| json!(n)),
        (-1e12f64..1e12).prop_map(|x| json!(x)),
    ]
}

/// Numeric leaves of config.json that a file may set.
const CONFIG_FIELDS: &[&str] = &[
    "/text_config/vocab_size",
    "/text_config/hidden_size",
    "/text_config/intermediate_size",
    "/text_config/num_hidden_layers",
    "/text_config/num_attention_heads",
    "/text_config/num_key_value_heads",
    "/text_config/head_dim",
    "/text_config/max_position_embeddings",
    "/text_config/rms_norm_eps",
    "/text_config/rope_parameters/rope_theta",
    "/text_config/rope_parameters/mrope_section/0",
    "/vision_config/depth",
    "/vision_config/hidden_size",
    "/vision_config/intermediate_size",
    "/vision_config/num_heads",
    "/vision_config/in_channels",
    "/vision_config/patch_size",
    "/vision_config/spatial_merge_size",
    "/vision_config/temporal_patch_size",
    "/vision_config/out_hidden_size",
    "/vision_config/num_position_embeddings",
    "/vision_config/deepstack_visual_indexes/1",
    "/vision_config/rope_parameters/rope_theta",
    "/image_token_id",
    "/vision_start_token_id",
];

proptest! {
    #![proptest_config(seeded(400))]

    #[test]
    fn config_values_give_a_bounded_model_or_a_named_error(
        edits in proptest::collection::vec((0..CONFIG_FIELDS.len(), hostile_number()), 1..4)
    ) {
        let mut cfg = golden_config();
        for (field, value) in &edits {
            *cfg.pointer_mut(CONFIG_FIELDS[*field]).unwrap() = value.clone();
        }
        match Qwen3VlConfig::from_json_str(&cfg.to_string(), Path::new("x/config.json")) {
            Ok(c) => {
                let (t, v) = (&c.text, &c.vision);
                prop_assert!((1..=1024).contains(&t.num_hidden_layers) && (1..=256).contains(&v.depth));
                prop_assert!(t.rms_norm_eps.is_finite() && t.rms_norm_eps > 0.0);
                prop_assert!(t.rope_theta.is_finite() && t.rope_theta > 0.0);
                prop_assert!(t.num_attention_heads % t.num_key_value_heads == 0 && t.head_dim % 2 == 0);
                prop_assert!(v.hidden_size % v.num_heads == 0);
                // Everything the plan sizes stays far from overflow.
                let plan = tensor_plan(&c);
                prop_assert!(plan.len() < 20_000);
                let total = plan.iter().try_fold(0u64, |acc, p| {
                    p.shape.iter().try_fold(1u64, |n, &d| n.checked_mul(d as u64)).and_then(|n| acc.checked_add(n))
                });
                prop_assert!(total.is_some());
            }
            Err(e) => {
                let msg = e.to_string();
                prop_assert!(msg.starts_with("x/config.json"), "{}", msg);
                prop_assert!(!msg.contains('\n'), "{}", msg);
            }
        }
    }

    #[test]
    fn preprocessor_values_give_a_bounded_resize_or_a_named_error(
        patch in hostile_number(), merge in hostile_number(), temporal in hostile_number(),
        min in hostile_number(), max in hostile_number(), std in hostile_number(), rescale in hostile_number(),
        h in 1usize..20_000, w in 1usize..20_000,
    ) {
        let raw = json!({
            "patch_size": patch, "merge_size": merge, "temporal_patch_size": temporal,
            "size": {"shortest_edge": min, "longest_edge": max},
            "image_std": [0.5, std, 0.5], "rescale_factor": rescale,
        });
        match PreprocessorConfig::from_json_str(&raw.to_string(), Path::new("x/preprocessor_config.json")) {
            Ok(c) => {
                prop_assert!(c.patch_size >= 1 && c.merge_size >= 1 && c.temporal_patch_size >= 1);
                prop_assert!(1 <= c.min_pixels && c.min_pixels <= c.max_pixels && c.max_pixels <= MAX_PIXEL_BUDGET);
                prop_assert!(c.image_std.iter().all(|s| s.is_finite() && *s > 0.0));
                let factor = c.factor();
                if let Ok((rh, rw)) = ImageProcessor::new(c).target_size(h, w) {
                    prop_assert!(rh % factor == 0 && rw % factor == 0 && rh > 0 && rw > 0);
                    prop_assert!(rh * rw <= 2 * MAX_PIXEL_BUDGET);
                }
            }
            Err(e) => prop_assert!(e.to_string().starts_with("x/preprocessor_config.json"), "{}", e),
        }
    }

    #[test]
    fn pixel_budget_flags_are_bounded(
        min in prop_oneof![Just(None), Just(Some(0usize)), Just(Some(usize::MAX)), (1usize..1 << 27).prop_map(Some)],
        max in prop_oneof![Just(None), Just(Some(0usize)), Just(Some(usize::MAX)), (1usize..1 << 27).prop_map(Some)],
        h in 1usize..40_000, w in 1usize..40_000,
    ) {
        match ImageProcessor::new(PreprocessorConfig::default()).with_pixel_budget(min, max) {
            Ok(p) => {
                let c = &p.config;
                prop_assert!(1 <= c.min_pixels && c.min_pixels <= c.max_pixels && c.max_pixels <= MAX_PIXEL_BUDGET);
                if let Some(m) = min { prop_assert_eq!(c.min_pixels, m); }
                if let Some(m) = max { prop_assert_eq!(c.max_pixels, m); }
                match p.target_size(h, w) {
                    Ok((rh, rw)) => prop_assert!(rh * rw <= 2 * MAX_PIXEL_BUDGET && rh % 32 == 0 && rw % 32 == 0),
                    // Only the aspect-ratio rule may refuse an in-budget image.
                    Err(e) => prop_assert!(e.to_string().contains("aspect ratio"), "{}", e),
                }
            }
            Err(e) => {
                let msg = e.to_string();
                prop_assert!(msg.starts_with("min_pixels") || msg.starts_with("max_pixels"), "{}", msg);
            }
        }
    }

    #[test]
    fn smart_resize_never_panics(
        h in 0usize..usize::MAX, w in 0usize..usize::MAX, factor in 0usize..128,
        min in 0usize..usize::MAX, max in 0usize..usize::MAX,
    ) {
        if let Ok((rh, rw)) = smart_resize(h, w, factor, min, max) {
            prop_assert!(rh.checked_mul(rw).is_some());
        }
    }

    #[test]
    fn sampling_options_are_valid_or_named(
        temperature in prop_oneof![Just(f64::NAN), Just(f64::INFINITY), Just(-1.0), Just(0.0), 0.0f64..5.0],
        top_p in prop_oneof![Just(f64::NAN), Just(0.0), Just(2.0), Just(1.0), 0.0f64..1.0],
        min_p in prop_oneof![Just(f64::NAN), Just(-0.5), Just(2.0), 0.0f64..1.0],
        repetition_penalty in prop_oneof![Just(f64::NAN), Just(0.0), Just(-1.0), Just(f64::INFINITY), 0.01f64..3.0],
        top_k in prop_oneof![Just(0usize), Just(1usize), Just(usize::MAX), 0usize..100],
        seed in any::<u64>(),
    ) {
        let opts = GenerationOptions { temperature, top_p, min_p, repetition_penalty, top_k, seed, ..Default::default() };
        match opts.validate() {
            Ok(()) => {
                let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
                let logits: Vec<f32> = (0..50).map(|_| rng.random_range(-30.0f32..30.0)).collect();
                prop_assert!(check_logits(&logits, 0).is_ok());
                let seen = [3u32, 7, 3, 49];
                for _ in 0..4 {
                    prop_assert!((sample(&logits, &seen, &opts, &mut rng) as usize) < logits.len());
                }
            }
            Err(e) => {
                let msg = e.to_string();
                let named = ["temperature", "top_p", "min_p", "repetition_penalty"].iter().any(|o| msg.starts_with(o));
                prop_assert!(named, "{}", msg);
            }
        }
    }
}

#[test]
fn non_finite_logits_are_named() {
    let mut l = vec![0.5f32; 10];
    l[7] = f32::NAN;
    let msg = check_logits(&l, 3).unwrap_err().to_string();
    assert!(msg.contains("1 non-finite logits at generated position 3 (token 7: NaN)"), "{msg}");
    l[7] = f32::INFINITY;
    assert!(check_logits(&l, 0).is_err());
}
