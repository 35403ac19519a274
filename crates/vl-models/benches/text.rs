//! Text decoder at the real Qwen3-VL-2B text geometry (28 layers, hidden 2048, 16/8 heads,
//! head_dim 128, mlp 6144, vocab 151936, tied), random weights: prefill tokens/s for a 128-token
//! prompt, decode tokens/s, KV-cache bytes and peak memory, per weight format. Prints a table:
//!   cargo bench -p vl-models --bench text
//! Env: VL_BENCH_MODES=f32,bf16,q8k,q8_0,q6k,q5k,q4k,e2e-q4k,e2e-q8k (default f32,q8k,q6k,q4k,e2e-q4k),
//! VL_BENCH_DECODE=16. `e2e-*` runs the CLI's flow with a 448x448 image and an f32 vision tower.
//! Each mode runs in its own process so that peak RSS is that mode's alone.

#[path = "common/alloc.rs"]
mod alloc;
#[path = "common/random.rs"]
mod random;

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use candle_core::{DType, Device};
use vl_models::qwen3_vl::{presets, Qwen3VlConfig, TextModel};
use vl_nn::QuantType;

#[global_allocator]
static GLOBAL: alloc::Counting = alloc::Counting;

const PROMPT: usize = 128;

fn mode(name: &str) -> (DType, Option<QuantType>) {
    match name {
        "f32" => (DType::F32, None),
        "bf16" => (DType::BF16, None),
        "q8k" => (DType::F32, Some(QuantType::Q8K)),
        "q8_0" => (DType::F32, Some(QuantType::Q8_0)),
        "q6k" => (DType::F32, Some(QuantType::Q6K)),
        "q5k" => (DType::F32, Some(QuantType::Q5K)),
        "q4k" => (DType::F32, Some(QuantType::Q4K)),
        other => panic!("unknown mode {other}"),
    }
}

fn main() {
    if let Ok(m) = std::env::var("VL_BENCH_ONE") {
        run_one(&m);
        return;
    }
    let modes = std::env::var("VL_BENCH_MODES").unwrap_or_else(|_| "f32,q8k,q6k,q4k,e2e-q4k".into());
    println!("| mode | weights | prefill {PROMPT} tok | prefill tok/s | decode tok/s | KV cache | peak live (allocator) | peak RSS |");
    println!("|---|---|---|---|---|---|---|---|");
    let exe = std::env::current_exe().unwrap();
    for m in modes.split(',') {
        let st = Command::new(&exe).env("VL_BENCH_ONE", m.trim()).status().unwrap();
        assert!(st.success(), "mode {m} failed");
    }
}

/// The CLI's flow at the 2B geometry: f32 vision tower (24 blocks) loaded, one 448x448 image
/// encoded, tower released, then the quantized text decoder loaded; prefill and decode.
fn run_e2e(name: &str, quant: Option<QuantType>) {
    use vl_models::qwen3_vl::{Prompt, Qwen3VlModel, VisionTower};
    let dev = Device::Cpu;
    let cfg = Qwen3VlConfig::from_json_str(presets::QWEN3_VL_2B, Path::new("qwen3-vl-2b")).unwrap();
    let grid = [1, 28, 28];
    let t0 = Instant::now();
    let vout = {
        let tower = VisionTower::load(&cfg.vision, random::var_builder(DType::F32, &dev).pp("model.visual")).unwrap();
        let pixels = candle_core::Tensor::randn(0f32, 1., (28 * 28, cfg.vision.patch_row_len()), &dev).unwrap();
        tower.forward(&pixels, &[grid]).unwrap()
    };
    let vision_s = t0.elapsed().as_secs_f64();
    let text =
        TextModel::load(&cfg.text, cfg.tie_word_embeddings, random::var_builder(DType::F32, &dev), quant).unwrap();
    let model = Qwen3VlModel::from_parts(cfg.clone(), None, text);
    let mut ids: Vec<u32> = vec![151644, 872, 198, cfg.vision_start_token_id];
    ids.extend(std::iter::repeat_n(cfg.image_token_id, 196));
    ids.extend([cfg.vision_end_token_id, 74785, 419, 2168, 13, 151645, 198, 151644, 77091, 198]);
    let prompt = Prompt { input_ids: ids, images: None, videos: None, generated_from: None };
    // Prefill, then 15 greedy decode steps.
    let n = prompt.input_ids.len();
    let t0 = Instant::now();
    let mut cache = model.new_cache();
    let state = model.prefill_encoded(&prompt, Some(&vout), None, &mut cache, &mut |_, _| {}).unwrap();
    let mut logits = model.last_logits(&state).unwrap();
    let prefill_s = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    const STEPS: usize = 15;
    for step in 0..STEPS {
        let next = logits.argmax(0).unwrap().to_scalar::<u32>().unwrap();
        logits = model.decode_step(next, &state, step, &mut cache).unwrap();
    }
    let decode_s = t1.elapsed().as_secs_f64();
    println!(
        "| {name} | 448x448 image (196 tokens), {n} prompt tokens | vision (load+encode) {vision_s:.1} s | prefill {:.1} tok/s | decode {:.2} tok/s | peak RSS {:.0} MiB |",
        n as f64 / prefill_s,
        STEPS as f64 / decode_s,
        alloc::mib(alloc::peak_rss()),
    );
}

fn run_one(name: &str) {
    if let Some(q) = name.strip_prefix("e2e-") {
        return run_e2e(name, mode(q).1);
    }
    let dev = Device::Cpu;
    let cfg = Qwen3VlConfig::from_json_str(presets::QWEN3_VL_2B, Path::new("qwen3-vl-2b")).unwrap();
    let decode: usize = std::env::var("VL_BENCH_DECODE").ok().and_then(|s| s.parse().ok()).unwrap_or(16);
    let (dtype, quant) = mode(name);
    let model = TextModel::load(&cfg.text, cfg.tie_word_embeddings, random::var_builder(dtype, &dev), quant).unwrap();
    let weights_bytes = alloc::live();
    alloc::reset_peak();
    let ids: Vec<u32> = (0..PROMPT as u32).map(|i| (i * 7919) % 150_000).collect();
    let positions: Vec<[i64; 3]> = (0..PROMPT as i64).map(|i| [i; 3]).collect();
    let mut cache = model.new_cache();
    // Twice: the first prefill includes one-time work (candle repacks some k-quant weights into
    // tile layouts on first use); the second is the steady state.
    let mut prefill = [0f64; 2];
    let mut next = 0;
    for p in prefill.iter_mut() {
        cache.release();
        let t0 = Instant::now();
        let x = model.embed(&ids).unwrap();
        let h = model.forward(&x, &positions, &mut cache, None, &mut |_, _| {}).unwrap();
        let logits = model.logits(&h.narrow(0, PROMPT - 1, 1).unwrap()).unwrap();
        next = logits.argmax(1).unwrap().to_vec1::<u32>().unwrap()[0];
        *p = t0.elapsed().as_secs_f64();
    }
    let t1 = Instant::now();
    for step in 0..decode {
        let x = model.embed(&[next]).unwrap();
        let p = (PROMPT + step) as i64;
        let h = model.forward(&x, &[[p; 3]], &mut cache, None, &mut |_, _| {}).unwrap();
        next = model.logits(&h).unwrap().argmax(1).unwrap().to_vec1::<u32>().unwrap()[0];
    }
    let dec = t1.elapsed().as_secs_f64();
    println!(
        "| {name} | {:.0} MiB | {:.2} s (first: {:.2} s) | {:.1} | {:.2} | {:.1} MiB | {:.0} MiB | {:.0} MiB |",
        alloc::mib(weights_bytes),
        prefill[1],
        prefill[0],
        PROMPT as f64 / prefill[1],
        decode as f64 / dec,
        alloc::mib(cache.bytes()),
        alloc::mib(alloc::peak()),
        alloc::mib(alloc::peak_rss()),
    );
}
