//! Times the Q4_K quantizer on a bf16 weight (diagnosis, not a user-path figure):
//! `cargo run --release -p vl-nn --example quant_time [ROWS] [COLS] [RUNS]`.
//! Seeded random weights (`vl_nn::testing::randn`), rounded to bf16 as checkpoints store them;
//! prints the best run of `linear::quantize_rows` (every core) and its rate.
fn main() -> candle_core::Result<()> {
    let arg = |i: usize, default: usize| std::env::args().nth(i).map_or(default, |a| a.parse().expect("a number"));
    let (rows, cols, runs) = (arg(1, 6144), arg(2, 2048), arg(3, 3));
    let w = vl_nn::testing::randn(3, 0.03, (rows, cols))?.to_dtype(candle_core::DType::BF16)?;
    let mut best = f64::MAX;
    for _ in 0..runs {
        let t = std::time::Instant::now();
        let q = vl_nn::linear::quantize_rows(&w, vl_nn::QuantType::Q4K).expect("quantize");
        best = best.min(t.elapsed().as_secs_f64());
        std::hint::black_box(q);
    }
    println!(
        "{rows}x{cols} bf16 -> Q4_K: best {:.1} ms, {:.0} M values/s",
        best * 1e3,
        (rows * cols) as f64 / best / 1e6
    );
    Ok(())
}
