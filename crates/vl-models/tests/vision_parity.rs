//! Vision tower parity with the reference: every captured intermediate of every probe image and
//! of the multi-image case, float32, within 1e-4 max absolute difference.

mod common;

use std::collections::BTreeMap;

use candle_core::{DType, Tensor};
use common::*;
use vl_models::qwen3_vl::VisionTower;

const TOL: f32 = 1e-4;

fn tower(g: &str, dtype: DType) -> VisionTower {
    let (cfg, ck) = checkpoint(g);
    VisionTower::load(&cfg.vision, ck.var_builder(dtype, &device(), None).pp("model.visual")).unwrap()
}

/// Runs the tower on `pixels`, returns the worst (name, diff) against `want` after checking all.
fn compare(
    tower: &VisionTower,
    pixels: &Tensor,
    grids: &[[usize; 3]],
    want: &std::collections::HashMap<String, Tensor>,
    label: &str,
    tol: f32,
) -> f32 {
    let mut got = BTreeMap::new();
    let out = tower
        .forward_traced(pixels, grids, &mut |name, t| {
            got.insert(name.to_string(), t.clone());
        })
        .unwrap();
    let mut names: Vec<&String> = want
        .keys()
        .filter(|k| !k.starts_with("logits") && !k.starts_with("greedy") && !k.starts_with("hidden"))
        .collect();
    names.sort();
    let mut worst: f32 = 0.0;
    let mut line = Vec::new();
    for name in names {
        let key = name.trim_start_matches("vision.");
        let g = got.get(key).unwrap_or_else(|| panic!("{label}: no intermediate {key}"));
        let d = max_abs_diff(g, &want[name.as_str()]);
        line.push(format!("{key} {d:.2e}"));
        assert!(d <= tol, "{label}: {key} differs by {d:e} (> {tol:e})");
        worst = worst.max(d);
    }
    println!("{label}: {}", line.join(", "));
    // The split outputs are the merged rows, per input.
    let merged = Tensor::cat(&out.merged, 0).unwrap();
    assert_eq!(max_abs_diff(&merged, &got["merged"]), 0.0);
    assert_eq!(out.merged.len(), grids.len());
    worst
}

#[test]
fn every_probe_image_matches_the_reference() {
    for g in GEOMETRIES {
        let tower = tower(g, DType::F32);
        let mut worst: f32 = 0.0;
        for probe in PROBES {
            let p = load(&goldens().join("processor").join(format!("{probe}.safetensors")));
            let want = load(&goldens().join(g).join("vision").join(format!("{probe}.safetensors")));
            assert!(want.len() >= 5, "golden has {} tensors", want.len());
            let grids = grids(&p["image_grid_thw"]);
            worst = worst.max(compare(
                &tower,
                &p["pixel_values"],
                &grids,
                &want,
                &format!("{g}/{probe} {grids:?}"),
                tol(TOL),
            ));
        }
        println!("{g}: worst max|diff| over all probes and intermediates {worst:.2e}");
    }
}

/// 1200 patches (640x480): several query tiles (at most 256 rows) and key tiles (at most 512) of
/// the fused CPU attention, against the reference; also with tiny tiles (ragged last tiles).
#[test]
fn a_large_image_spans_several_attention_tiles_and_matches() {
    let p = load(&goldens().join("processor").join("large@max307200.safetensors"));
    let grids = grids(&p["image_grid_thw"]);
    let patches: usize = grids.iter().map(|g| g.iter().product::<usize>()).sum();
    assert_eq!(patches, 1200);
    // Default tiles: 5 query tiles of 240 rows, 3 key tiles of 400; 7x13: ragged last tiles.
    assert!(patches > (2 * vl_nn::kernels::KEY_TILE).max(4 * vl_nn::kernels::QUERY_TILE));
    for g in GEOMETRIES {
        let want = load(&goldens().join(g).join("vision").join("large@max307200.safetensors"));
        let mut t = tower(g, DType::F32);
        compare(&t, &p["pixel_values"], &grids, &want, &format!("{g}/large@max307200 {grids:?}"), tol(TOL));
        t.set_attention_tiles(7, 13);
        compare(&t, &p["pixel_values"], &grids, &want, &format!("{g}/large@max307200 tiles 7x13"), tol(TOL));
    }
}

#[test]
fn multi_image_batches_match_the_reference() {
    for g in GEOMETRIES {
        let tower = tower(g, DType::F32);
        for case in ["two_images", "image_mid", "one_image"] {
            let prompt = load(&goldens().join("prompts").join(format!("{case}.safetensors")));
            let meta = read_json(&goldens().join("prompts").join(format!("{case}.json")));
            let pixels: Vec<Tensor> = meta["images"]
                .as_array()
                .unwrap()
                .iter()
                .map(|n| {
                    load(&goldens().join("processor").join(format!("{}.safetensors", n.as_str().unwrap())))
                        ["pixel_values"]
                        .clone()
                })
                .collect();
            let pixels = Tensor::cat(&pixels, 0).unwrap();
            let want = load(&goldens().join(g).join("cases").join(format!("{case}.safetensors")));
            let want: std::collections::HashMap<String, Tensor> =
                want.into_iter().filter(|(k, _)| k.starts_with("vision.")).collect();
            compare(&tower, &pixels, &grids(&prompt["image_grid_thw"]), &want, &format!("{g}/{case}"), tol(TOL));
        }
    }
}

#[test]
fn query_block_size_does_not_change_features() {
    let mut t = tower("tiny-a", DType::F32);
    let p = load(&goldens().join("processor/large.safetensors"));
    let grids = grids(&p["image_grid_thw"]);
    let full = t.forward(&p["pixel_values"], &grids).unwrap();
    t.set_query_block(7);
    let blocked = t.forward(&p["pixel_values"], &grids).unwrap();
    let d = max_abs_diff(&full.merged[0], &blocked.merged[0]);
    assert!(d < 1e-5, "{d}");
}

/// bf16 compute (weights and activations): a separate, measured bound; see docs/vision.md.
#[test]
fn bf16_tower_stays_within_its_documented_bound() {
    const BF16_MERGED_BOUND: f32 = 0.35;
    for g in GEOMETRIES {
        let tower = tower(g, DType::BF16);
        let mut worst: f32 = 0.0;
        let mut worst_rel: f32 = 0.0;
        for probe in PROBES {
            let p = load(&goldens().join("processor").join(format!("{probe}.safetensors")));
            let want = load(&goldens().join(g).join("vision").join(format!("{probe}.safetensors")));
            let out = tower.forward(&p["pixel_values"], &grids(&p["image_grid_thw"])).unwrap();
            let d = max_abs_diff(&out.merged[0], &want["merged"]);
            let scale =
                want["merged"].abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
            worst = worst.max(d);
            worst_rel = worst_rel.max(d / scale);
        }
        println!("{g}: bf16 merged rows max|diff| {worst:.3e} (relative to max|ref| {worst_rel:.3e})");
        assert!(worst < BF16_MERGED_BOUND, "{g}: bf16 deviation {worst}");
    }
}

#[test]
fn wrong_inputs_are_errors_not_panics() {
    let tower = tower("tiny-a", DType::F32);
    let p = load(&goldens().join("processor/square.safetensors"));
    let err = tower.forward(&p["pixel_values"], &[[1, 8, 6]]).unwrap_err().to_string();
    assert!(err.contains("64 patch rows") && err.contains("48"), "{err}");
    let err = tower.forward(&p["pixel_values"], &[[1, 7, 9]]).unwrap_err().to_string();
    assert!(err.contains("multiples of 2"), "{err}");
    let short = p["pixel_values"].narrow(1, 0, 100).unwrap();
    let err = tower.forward(&short, &[[1, 8, 8]]).unwrap_err().to_string();
    assert!(err.contains("100 values"), "{err}");
}

/// The reference appends DeepStack features in the order the blocks run
/// (`for layer_num, blk in enumerate(blocks): if layer_num in deepstack_visual_indexes:
/// deepstack_merger_list[deepstack_visual_indexes.index(layer_num)](x)`), so with the taps
/// listed out of order, level k belongs to the k-th tapped block, whatever its merger's index.
#[test]
fn deepstack_levels_follow_block_order_not_merger_order() {
    let (mut cfg, ck) = checkpoint("tiny-a");
    assert_eq!(cfg.vision.deepstack_visual_indexes, vec![0, 2, 3]);
    // Merger 0 taps block 3, merger 1 block 0, merger 2 block 2: levels are mergers 1, 2, 0.
    cfg.vision.deepstack_visual_indexes = vec![3, 0, 2];
    let tower = VisionTower::load(&cfg.vision, ck.var_builder(DType::F32, &device(), None).pp("model.visual")).unwrap();
    let p = load(&goldens().join("processor").join("square.safetensors"));
    let mut traced = BTreeMap::new();
    let out = tower
        .forward_traced(&p["pixel_values"], &grids(&p["image_grid_thw"]), &mut |name, t| {
            traced.insert(name.to_string(), t.clone());
        })
        .unwrap();
    for (level, merger) in [(0, 1), (1, 2), (2, 0)] {
        let d = max_abs_diff(&out.levels[level][0], &traced[&format!("deepstack.{merger}")]);
        assert_eq!(d, 0.0, "level {level} should be merger {merger}'s output");
    }
}

#[test]
fn bf16_stored_weights_upcast_per_block_equal_the_f32_load_exactly() {
    // tiny-b is stored in bf16: keeping its vision weights in bf16 and upcasting each block for
    // its forward is the same arithmetic as loading them as f32 (the upcast is exact).
    let (cfg, ck) = checkpoint("tiny-b");
    assert_eq!(ck.vision_float_dtype(), DType::BF16);
    let full = tower("tiny-b", DType::F32);
    let stored = VisionTower::load_stored(
        &cfg.vision,
        ck.var_builder(DType::BF16, &device(), None).pp("model.visual"),
        DType::F32,
    )
    .unwrap();
    for probe in ["square", "odd"] {
        let p = load(&goldens().join("processor").join(format!("{probe}.safetensors")));
        let grids = grids(&p["image_grid_thw"]);
        let a = full.forward(&p["pixel_values"], &grids).unwrap();
        let b = stored.forward(&p["pixel_values"], &grids).unwrap();
        assert_eq!(max_abs_diff(&a.merged[0], &b.merged[0]), 0.0, "{probe}: merged");
        for (x, y) in a.levels.iter().zip(&b.levels) {
            assert_eq!(max_abs_diff(&x[0], &y[0]), 0.0, "{probe}: deepstack");
        }
    }
    // tiny-a is stored in f32: nothing to keep smaller.
    assert_eq!(checkpoint("tiny-a").1.vision_float_dtype(), DType::F32);
}

/// `--vision-precision bf16`: every linear on bf16 products (AMX tiles, or AVX512-BF16). Its bound against the
/// reference's f32 intermediates, measured on these goldens (docs/parity.md): the largest
/// difference over all probes and intermediates, relative to the intermediate's largest value.
/// Without AMX the conversion is refused with a message that says so.
#[test]
fn bf16_products_stay_within_their_bound_of_the_f32_reference() {
    const BOUND: f32 = 2e-2;
    for g in GEOMETRIES {
        let bf16 = tower(g, DType::F32).into_bf16_products();
        if !vl_nn::bf16::available() {
            let e = bf16.expect_err("no AMX or AVX512-BF16 here: refused").to_string();
            assert!(e.contains("AMX-BF16"), "{e}");
            continue;
        }
        let bf16 = bf16.unwrap();
        assert!(bf16.is_bf16_products());
        let mut worst: f32 = 0.0;
        for probe in PROBES {
            let p = load(&goldens().join("processor").join(format!("{probe}.safetensors")));
            let want = load(&goldens().join(g).join("vision").join(format!("{probe}.safetensors")));
            let mut got = BTreeMap::new();
            bf16.forward_traced(&p["pixel_values"], &grids(&p["image_grid_thw"]), &mut |name, t| {
                got.insert(name.to_string(), t.clone());
            })
            .unwrap();
            let mut line = Vec::new();
            for (name, w) in &want {
                if ["logits", "greedy", "hidden"].iter().any(|x| name.starts_with(x)) {
                    continue;
                }
                let key = name.trim_start_matches("vision.");
                let t = got.get(key).unwrap_or_else(|| panic!("{g}/{probe}: no intermediate {key}"));
                let scale = w.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap().max(1e-6);
                let rel = max_abs_diff(t, w) / scale;
                line.push(format!("{key} {rel:.2e}"));
                assert!(rel <= BOUND, "{g}/{probe}: {key} differs by {rel:e} of its largest value (> {BOUND:e})");
                worst = worst.max(rel);
            }
            assert!(line.len() >= 5, "{g}/{probe}: {} intermediates compared", line.len());
            println!("{g}/{probe}: {}", line.join(", "));
        }
        println!("{g}: worst relative max|diff| {worst:.2e}");
    }
}
