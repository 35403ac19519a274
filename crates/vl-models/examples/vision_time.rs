//! Times the vision tower of a checkpoint (`ModelDir::open`, weights read from the checkpoint's
//! safetensors and upcast to f32 at load: the forward alone, no upcast inside it), on square
//! images of the given sizes, and prints one JSON line per size with the per-block breakdown.
//! Used by `tools/bench/vision-side-by-side` (ours vs transformers/torch):
//!   cargo run --release -p vl-models --example vision_time -- target/bench-2b 448 1024
//! Env: VL_VISION_RUNS (runs per size, default 2; the fastest is reported); VL_VISION_STORED=1
//! times the path `vl run`, `vl serve` and `vl chat` take instead (blocks kept in the
//! checkpoint's bf16 and upcast per block for each forward: half the memory, ~0.2 s more per
//! 448 image on the 2B). VL_VISION_PRECISION=bf16 times `--vision-precision bf16` (the linears
//! on AMX bf16 tiles; read in the checkpoint's float dtype and packed, as the engine does) and
//! reports its largest difference from the f32 path's features on the same input.

use std::path::Path;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use vl_models::qwen3_vl::plan::VISION_PREFIX;
use vl_models::qwen3_vl::{ModelDir, VisionTower};

fn main() -> vl_models::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        eprintln!("usage: vision_time CHECKPOINT_DIR SIZE [SIZE...]");
        std::process::exit(2);
    }
    // As the `vl` binary does.
    vl_models::alloc::keep_large_buffers();
    let dev = Device::Cpu;
    let load = Instant::now();
    let ModelDir { config, weights, .. } = ModelDir::open(Path::new(&args[1]))?;
    let bf16 = match std::env::var("VL_VISION_PRECISION").as_deref() {
        Ok("bf16") => true,
        Ok("f32") | Err(_) => false,
        Ok(other) => panic!("VL_VISION_PRECISION={other}: f32 or bf16"),
    };
    let stored =
        if bf16 || std::env::var_os("VL_VISION_STORED").is_some() { weights.vision_float_dtype() } else { DType::F32 };
    let tower = VisionTower::load_stored(
        &config.vision,
        weights.var_builder(stored, &dev, None).pp(VISION_PREFIX),
        DType::F32,
    )?;
    // The f32 tower kept beside the bf16 one, for the difference (not part of the load time).
    let (tower, f32_tower) = if bf16 { (tower.clone().into_bf16_products()?, Some(tower)) } else { (tower, None) };
    drop(weights);
    let load_s = load.elapsed().as_secs_f64();
    let runs: usize = std::env::var("VL_VISION_RUNS").ok().and_then(|s| s.parse().ok()).unwrap_or(2).max(1);
    let cfg = tower.config().clone();
    for size in &args[2..] {
        let size: usize = size.parse().expect("SIZE is a pixel count per side");
        let side = size / cfg.patch_size;
        let side = side - side % cfg.spatial_merge_size;
        let rows = side * side;
        // A fixed, smooth pattern in the normalized pixel range (content does not change the work).
        let cols = cfg.patch_row_len();
        let data: Vec<f32> = (0..rows * cols).map(|i| ((i % 9973) as f32 * 0.0007).sin()).collect();
        let pixels = Tensor::from_vec(data, (rows, cols), &dev)?;
        let grids = [[1, side, side]];
        let mut best: Option<(f64, f64, f64, Vec<f64>)> = None;
        for _ in 0..runs {
            let t0 = Instant::now();
            let mut last = t0;
            let mut blocks = Vec::new();
            let (mut stem, mut mergers) = (0.0, 0.0);
            tower.forward_traced(&pixels, &grids, &mut |name, _| {
                let now = Instant::now();
                let dt = (now - last).as_secs_f64();
                if name.starts_with("block.") {
                    blocks.push(dt);
                } else if name == "pos_embed" || name == "patch_embed" {
                    stem += dt;
                } else {
                    mergers += dt;
                }
                last = now;
            })?;
            let total = t0.elapsed().as_secs_f64();
            if best.as_ref().is_none_or(|(t, ..)| total < *t) {
                best = Some((total, stem, mergers, blocks));
            }
        }
        let (total, stem, mergers, blocks) = best.unwrap();
        // Largest |bf16 - f32| of the merged features, and relative to their largest value.
        let diff = match &f32_tower {
            Some(f) => {
                let a = Tensor::cat(&f.forward(&pixels, &grids)?.merged, 0)?;
                let b = Tensor::cat(&tower.forward(&pixels, &grids)?.merged, 0)?;
                let d = (a.clone() - b)?.abs()?.max_all()?.to_scalar::<f32>()?;
                let scale = a.abs()?.max_all()?.to_scalar::<f32>()?;
                Some((d, d / scale))
            }
            None => None,
        };
        let line = serde_json::json!({
            "impl": "vl", "precision": if bf16 { "bf16" } else { "f32" },
            "merged_max_abs_diff_vs_f32": diff.map(|d| d.0), "merged_rel_diff_vs_f32": diff.map(|d| d.1),
            "weights": format!("{stored:?}").to_lowercase(), "size": size, "patches": rows, "seconds": total, "load_s": load_s, "stem_s": stem, "mergers_s": mergers,
            "block_mean_s": blocks.iter().sum::<f64>() / blocks.len() as f64,
            "blocks_s": blocks,
        });
        println!("{line}");
    }
    Ok(())
}
