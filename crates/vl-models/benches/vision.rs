//! Vision tower at the real Qwen3-VL-2B vision geometry (hidden 1024, 16 heads, mlp 4096) with
//! reduced depth (3 blocks, one DeepStack tap), random weights, on one 1024x1024 image
//! (64x64 = 4096 patches), f32 and bf16. Prints per-image memory before timing:
//!   cargo bench -p vl-models --bench vision
//! Env: VL_BENCH_DTYPES=f32,bf16, VL_BENCH_QUICK=1 (first run only, no criterion sampling), VL_BENCH_QUERY_BLOCK=rows,
//! VL_BENCH_DEPTH=blocks.

#[path = "common/alloc.rs"]
mod alloc;
#[path = "common/random.rs"]
mod random;

use std::path::Path;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use criterion::{criterion_group, criterion_main, Criterion};
use vl_models::qwen3_vl::{presets, Qwen3VlConfig, VisionTower};

#[global_allocator]
static GLOBAL: alloc::Counting = alloc::Counting;

const DEPTH: usize = 3;
const GRID: usize = 64; // 1024 px / 16

fn config() -> Qwen3VlConfig {
    let mut cfg = Qwen3VlConfig::from_json_str(presets::QWEN3_VL_2B, Path::new("qwen3-vl-2b")).unwrap();
    cfg.vision.depth = std::env::var("VL_BENCH_DEPTH").ok().and_then(|s| s.parse().ok()).unwrap_or(DEPTH);
    cfg.vision.deepstack_visual_indexes = vec![1];
    cfg
}

fn bench(c: &mut Criterion) {
    let dev = Device::Cpu;
    let cfg = config();
    let mut group = c.benchmark_group("vision_2b_3blocks_1024px/cpu");
    group.sample_size(10);
    let wanted = std::env::var("VL_BENCH_DTYPES").unwrap_or_else(|_| "f32,bf16".into());
    for dtype in [DType::F32, DType::BF16] {
        if !wanted.split(',').any(|w| w.trim() == format!("{dtype:?}").to_lowercase()) {
            continue;
        }
        let before_weights = alloc::live();
        let vb = random::var_builder(dtype, &dev);
        let mut tower = VisionTower::load(&cfg.vision, vb.pp("model.visual")).unwrap();
        if let Some(rows) = std::env::var("VL_BENCH_QUERY_BLOCK").ok().and_then(|s| s.parse().ok()) {
            tower.set_query_block(rows);
        }
        let pixels = Tensor::randn(0f32, 1., (GRID * GRID, cfg.vision.patch_row_len()), &dev).unwrap();
        let grids = [[1, GRID, GRID]];
        let baseline = alloc::live();
        alloc::reset_peak();
        let t0 = Instant::now();
        let out = tower.forward(&pixels, &grids).unwrap();
        let first = t0.elapsed();
        let transient = alloc::peak() - baseline;
        let sustained = alloc::live() - baseline;
        let kept: usize = out
            .merged
            .iter()
            .chain(out.deepstack.iter().flatten())
            .map(|t| t.elem_count() * t.dtype().size_in_bytes())
            .sum();
        println!(
            "{dtype:?}: weights {:.1} MiB; per image: transient peak {:.1} MiB over baseline, sustained {:.2} MiB (merged + deepstack rows {:.2} MiB); first run {:.2} s; process peak RSS {:.0} MiB",
            alloc::mib(baseline - before_weights - pixels.elem_count() * 4),
            alloc::mib(transient),
            alloc::mib(sustained),
            alloc::mib(kept),
            first.as_secs_f64(),
            alloc::mib(alloc::peak_rss()),
        );
        drop(out);
        group.bench_function(format!("{dtype:?}").to_lowercase(), |b| {
            b.iter(|| tower.forward(&pixels, &grids).unwrap())
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
