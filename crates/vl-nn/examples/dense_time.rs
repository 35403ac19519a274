//! Times `Dense` (the CPU f32 linear layer) on one shape (diagnosis, not a user-path figure):
//! `cargo run --release -p vl-nn --example dense_time [ROWS] [IN] [OUT] [RUNS]`.
//! Random rows and weights (seeded), candle's pool (RAYON_NUM_THREADS); prints the best run and
//! its rate (2 x rows x in x out flops). `VL_DENSE_LAYOUT=panels|wt|bf16` forces the weight layout
//! (bf16: the reduced-precision products, `Dense::to_bf16`).
use candle_core::{Device, Tensor};
use vl_nn::linear::Dense;

fn main() -> candle_core::Result<()> {
    let arg = |i: usize, default: usize| std::env::args().nth(i).map_or(default, |a| a.parse().expect("a number"));
    let (m, k, n, runs) = (arg(1, 4096), arg(2, 1024), arg(3, 4096), arg(4, 5));
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    };
    let x = Tensor::from_vec((0..m * k).map(|_| next()).collect::<Vec<f32>>(), (m, k), &Device::Cpu)?;
    let w = Tensor::from_vec((0..n * k).map(|_| next() * 0.03).collect::<Vec<f32>>(), (n, k), &Device::Cpu)?;
    let b = Tensor::from_vec((0..n).map(|_| next()).collect::<Vec<f32>>(), n, &Device::Cpu)?;
    // VL_DENSE_LAYOUT=panels|wt|bf16 forces a weight layout (default: the one this CPU prefers).
    let l = candle_nn::Linear::new(w, Some(b));
    let dense = match std::env::var("VL_DENSE_LAYOUT").as_deref() {
        Ok("panels") => Dense::from_linear_as(&l, true),
        Ok("wt") => Dense::from_linear_as(&l, false),
        Ok("bf16") => Dense::from_linear_as(&l, false).and_then(|d| d.to_bf16()),
        Ok(other) => panic!("VL_DENSE_LAYOUT={other}: panels, wt or bf16"),
        Err(_) => Dense::from_linear(&l),
    }
    .expect("dense");
    let layout = if dense.is_bf16() {
        "bf16 pairs"
    } else if dense.is_panels() {
        "panels"
    } else {
        "W^T (gemm)"
    };
    println!("layout: {layout}");
    let mut best = f64::INFINITY;
    let mut sum = 0f64;
    for _ in 0..runs {
        let t = std::time::Instant::now();
        let y = dense.forward(&x).expect("forward");
        best = best.min(t.elapsed().as_secs_f64());
        sum += y.sum_all()?.to_scalar::<f32>()? as f64;
    }
    let flops = 2.0 * (m * k * n) as f64;
    println!("{m}x{k} by {k}x{n}: best {:.1} ms, {:.0} GFLOP/s (checksum {sum:.3})", best * 1e3, flops / best / 1e9);
    Ok(())
}
