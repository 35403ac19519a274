//! Times products of a few rows through many distinct Q4_K (or Q6_K) weights in turn, past the
//! L3 (the way a decode step streams a model's layers), on `vl_nn::stored`; prints each run's
//! rate.
//! `cargo run --release -p vl-nn --example stream_time [ROWS] [IN] [OUT] [COUNT] [RUNS]`
//! (`VL_QTYPE=q6k` for Q6_K weights; `VL_NO_VNNI=1` for the kernels without `vpdpbusd`).
fn main() {
    let arg = |i: usize, default: usize| std::env::args().nth(i).map_or(default, |a| a.parse().expect("a number"));
    let (m, k, n, count, runs) = (arg(1, 1), arg(2, 2048), arg(3, 6144), arg(4, 40), arg(5, 5));
    let x = vl_nn::testing::randn(1, 1.0, (m, k)).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let (dtype, blocks) = match std::env::var("VL_QTYPE").as_deref() {
        Ok("q6k") => (candle_core::quantized::GgmlDType::Q6K, vl_nn::stored::Blocks::Q6K),
        _ => (candle_core::quantized::GgmlDType::Q4K, vl_nn::stored::Blocks::Q4K),
    };
    let weights: Vec<Vec<u8>> = (0..count)
        .map(|i| {
            let w = vl_nn::testing::randn(2 + i as u64, 0.03, (n, k)).unwrap();
            let q = candle_core::quantized::QTensor::quantize(&w, dtype).unwrap();
            q.data().unwrap().to_vec()
        })
        .collect();
    let bytes: usize = weights.iter().map(|w| w.len()).sum();
    for _ in 0..runs {
        let t = std::time::Instant::now();
        for w in &weights {
            vl_nn::stored::matmul(&[(blocks, w, n)], &x, m, k).unwrap();
        }
        let s = t.elapsed().as_secs_f64();
        println!(
            "{count} x {m}x{k}x{n}: {:.2} ms, {:.3} ms a product, {:.1} GB/s",
            s * 1e3,
            s * 1e3 / count as f64,
            bytes as f64 / s / 1e9
        );
    }
}
