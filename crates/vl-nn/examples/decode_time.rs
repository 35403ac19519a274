//! Times decode attention over KV caches past the L3, one per layer as a decode step reads them
//! (diagnosis, not a user-path figure), for each cache dtype:
//! `cargo run --release -p vl-nn --features testing --example decode_time [POSITIONS] [LAYERS] [HEADS] [KV_HEADS] [HEAD_DIM] [RUNS]`
//! (default 8000 positions, 28 layers, 16 heads over 8 of 128: the Qwen3-VL 2B). Prints the
//! best run's time a step and the rate the caches are read at.
use candle_core::{DType, Tensor};

fn main() {
    let arg = |i: usize, default: usize| std::env::args().nth(i).map_or(default, |a| a.parse().expect("a number"));
    let (total, layers, heads, kv, d, runs) = (arg(1, 8000), arg(2, 28), arg(3, 16), arg(4, 8), arg(5, 128), arg(6, 5));
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let views: Vec<(Tensor, Tensor)> = (0..layers)
            .map(|l| {
                let mut c = vl_nn::KvCache::in_dtype(dtype);
                let k = vl_nn::testing::randn(10 + l as u64, 1.0, (kv, total, d)).unwrap();
                let v = vl_nn::testing::randn(90 + l as u64, 1.0, (kv, total, d)).unwrap();
                c.append(&k, &v).unwrap()
            })
            .collect();
        let q = vl_nn::testing::randn(7, 1.0, (heads, 1, d)).unwrap();
        let bytes = (layers * 2 * kv * total * d * dtype.size_in_bytes()) as f64;
        let mut best = f64::MAX;
        for _ in 0..runs {
            let t = std::time::Instant::now();
            for (k, v) in &views {
                vl_nn::causal_gqa_attention(&q, k, v, 1).unwrap();
            }
            best = best.min(t.elapsed().as_secs_f64());
        }
        println!("{dtype:?}: {:.2} ms a step ({layers} layers), {:.1} GB/s", best * 1e3, bytes / best / 1e9);
    }
}
