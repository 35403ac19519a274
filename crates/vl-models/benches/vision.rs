//! Vision tower at the real Qwen3-VL-2B vision geometry (hidden 1024, 16 heads, mlp 4096), random
//! weights, two cases: reduced depth (3 blocks, one DeepStack tap) on one 1024x1024 image (64x64 =
//! 4096 patches), f32 and bf16; and the full tower (24 blocks, taps 5/11/17) on a 448x448 image
//! (28x28 = 784 patches), f32. Prints per-image memory before timing:
//!   cargo bench -p vl-models --bench vision
//! Env: VL_BENCH_CASES=1024px,448px, VL_BENCH_DTYPES=f32,bf16, VL_BENCH_QUICK=1 (first run only, no criterion
//! sampling), VL_BENCH_QUERY_BLOCK=rows, VL_BENCH_DEPTH=blocks (1024px case).

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

/// (name, config, patch grid side, dtypes).
fn cases() -> Vec<(&'static str, Qwen3VlConfig, usize, Vec<DType>)> {
    let full = Qwen3VlConfig::from_json_str(presets::QWEN3_VL_2B, Path::new("qwen3-vl-2b")).unwrap();
    let mut short = full.clone();
    short.vision.depth = std::env::var("VL_BENCH_DEPTH").ok().and_then(|s| s.parse().ok()).unwrap_or(DEPTH);
    short.vision.deepstack_visual_indexes = vec![1];
    vec![
        ("1024px", short, 64, vec![DType::F32, DType::BF16]), // 1024 px / 16
        ("448px", full, 28, vec![DType::F32]),
    ]
}

fn bench(c: &mut Criterion) {
    let dev = Device::Cpu;
    let wanted_cases = std::env::var("VL_BENCH_CASES").unwrap_or_else(|_| "1024px,448px".into());
    for (name, cfg, grid, dtypes) in cases() {
        if !wanted_cases.split(',').any(|w| w.trim() == name) {
            continue;
        }
        bench_case(c, &dev, &cfg, grid, &dtypes, name);
    }
}

fn bench_case(c: &mut Criterion, dev: &Device, cfg: &Qwen3VlConfig, grid: usize, dtypes: &[DType], name: &str) {
    let mut group = c.benchmark_group(format!("vision_2b_{}blocks_{name}/cpu", cfg.vision.depth));
    group.sample_size(10);
    let wanted = std::env::var("VL_BENCH_DTYPES").unwrap_or_else(|_| "f32,bf16".into());
    for &dtype in dtypes {
        if !wanted.split(',').any(|w| w.trim() == format!("{dtype:?}").to_lowercase()) {
            continue;
        }
        let before_weights = alloc::live();
        let vb = random::var_builder(dtype, dev);
        let mut tower = VisionTower::load(&cfg.vision, vb.pp("model.visual")).unwrap();
        if let Some(rows) = std::env::var("VL_BENCH_QUERY_BLOCK").ok().and_then(|s| s.parse().ok()) {
            tower.set_query_block(rows);
        }
        let pixels = Tensor::randn(0f32, 1., (grid * grid, cfg.vision.patch_row_len()), dev).unwrap();
        let grids = [[1, grid, grid]];
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
            .chain(out.levels.iter().flatten())
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
        if std::env::var_os("VL_BENCH_QUICK").is_some() {
            continue;
        }
        group.bench_function(format!("{dtype:?}").to_lowercase(), |b| {
            b.iter(|| tower.forward(&pixels, &grids).unwrap())
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
