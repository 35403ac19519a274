//! Text decoder at the real Qwen3-VL-2B text geometry (28 layers, hidden 2048, 16/8 heads,
//! head_dim 128, mlp 6144, vocab 151936, tied), random weights: prefill tokens/s for a 128-token
//! prompt, decode tokens/s, KV-cache bytes and peak memory, per weight format. Prints a table:
//!   cargo bench -p vl-models --bench text
//! Env: VL_BENCH_MODES=f32,bf16,q8k,q8_0,q6k,q4k (default f32,q8k,q6k,q4k), VL_BENCH_DECODE=16.
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
    let modes = std::env::var("VL_BENCH_MODES").unwrap_or_else(|_| "f32,q8k,q6k,q4k".into());
    println!("| mode | weights | prefill {PROMPT} tok | prefill tok/s | decode tok/s | KV cache | peak live (allocator) | peak RSS |");
    println!("|---|---|---|---|---|---|---|---|");
    let exe = std::env::current_exe().unwrap();
    for m in modes.split(',') {
        let st = Command::new(&exe).env("VL_BENCH_ONE", m.trim()).status().unwrap();
        assert!(st.success(), "mode {m} failed");
    }
}

fn run_one(name: &str) {
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
    let t0 = Instant::now();
    let x = model.embed(&ids).unwrap();
    let h = model.forward(&x, &positions, &mut cache, None, &mut |_, _| {}).unwrap();
    let logits = model.logits(&h.narrow(0, PROMPT - 1, 1).unwrap()).unwrap();
    let mut next = logits.argmax(1).unwrap().to_vec1::<u32>().unwrap()[0];
    let prefill = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    for step in 0..decode {
        let x = model.embed(&[next]).unwrap();
        let p = (PROMPT + step) as i64;
        let h = model.forward(&x, &[[p; 3]], &mut cache, None, &mut |_, _| {}).unwrap();
        next = model.logits(&h).unwrap().argmax(1).unwrap().to_vec1::<u32>().unwrap()[0];
    }
    let dec = t1.elapsed().as_secs_f64();
    println!(
        "| {name} | {:.0} MiB | {:.2} s | {:.1} | {:.2} | {:.1} MiB | {:.0} MiB | {:.0} MiB |",
        alloc::mib(weights_bytes),
        prefill,
        PROMPT as f64 / prefill,
        decode as f64 / dec,
        alloc::mib(cache.bytes()),
        alloc::mib(alloc::peak()),
        alloc::mib(alloc::peak_rss()),
    );
}
