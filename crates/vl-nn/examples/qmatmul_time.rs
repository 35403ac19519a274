//! Times a Q4_K (or Q6_K) `QLinear` product (diagnosis, not a user-path figure):
//! `cargo run --release -p vl-nn --example qmatmul_time [ROWS] [IN] [OUT] [RUNS]`.
//! Seeded random rows and weights (`vl_nn::testing::randn`); prints the best run of the
//! whole-batch product (candle picks
//! its kernel by row count: AMX tiles from 32 rows where the CPU has AMX) and of the same rows in
//! pieces of at most 31 (candle's VNNI tiles), of `stored_tiles` (the stored blocks, tiles built
//! per call), and the rate (2 x rows x in x out ops).
use candle_core::{Device, Module, Tensor};
use vl_nn::{QLinear, QuantType};

fn main() -> candle_core::Result<()> {
    let arg = |i: usize, default: usize| std::env::args().nth(i).map_or(default, |a| a.parse().expect("a number"));
    let (m, k, n, runs) = (arg(1, 210), arg(2, 2048), arg(3, 6144), arg(4, 5));
    let x = vl_nn::testing::randn(1, 1.0, (m, k))?;
    let w = vl_nn::testing::randn(2, 0.03, (n, k))?;
    // VL_QTYPE=q6k times a Q6_K weight instead.
    let (qtype, blocks) = match std::env::var("VL_QTYPE").as_deref() {
        Ok("q6k") => (QuantType::Q6K, vl_nn::stored::Blocks::Q6K),
        Ok("q4k") | Err(_) => (QuantType::Q4K, vl_nn::stored::Blocks::Q4K),
        Ok(other) => candle_core::bail!("VL_QTYPE={other}: q4k or q6k"),
    };
    let l = QLinear::new(candle_nn::Linear::new(w, None), Some(qtype)).expect("quantize");
    let time = |f: &dyn Fn() -> candle_core::Result<Tensor>| -> candle_core::Result<f64> {
        let mut best = f64::MAX;
        for _ in 0..runs {
            let t = std::time::Instant::now();
            f()?;
            best = best.min(t.elapsed().as_secs_f64());
        }
        Ok(best)
    };
    let QLinear::Quant { w: candle_w, .. } = &l else { unreachable!() };
    // candle's own product (`QLinear::forward` takes `stored` for a few rows).
    let whole = || candle_w.forward(&x);
    let pieces = || {
        let parts: Vec<Tensor> = (0..m)
            .step_by(31)
            .map(|s| candle_w.forward(&x.narrow(0, s, 31.min(m - s))?))
            .collect::<candle_core::Result<_>>()?;
        Tensor::cat(&parts, 0)
    };
    let first = std::time::Instant::now();
    whole()?;
    let first_whole = first.elapsed().as_secs_f64();
    let first = std::time::Instant::now();
    pieces()?;
    let first_pieces = first.elapsed().as_secs_f64();
    let compact = || Ok(l.forward_compact(&x).expect("forward"));
    let QLinear::Quant { w: candle_core::quantized::QMatMul::QTensor(t), .. } = &l else { unreachable!() };
    let bytes = t.data()?;
    let xs = x.flatten_all()?.to_vec1::<f32>()?;
    let own = || {
        let out = vl_nn::stored::matmul(&[(blocks, &bytes, n)], &xs, m, k).expect("rows the kernel takes");
        Tensor::from_vec(out.into_iter().next().unwrap_or_default(), (m, n), &Device::Cpu)
    };
    let tiles = || {
        let out = vl_nn::stored_tiles::matmul(blocks, &bytes, n, &xs, m, k).unwrap_or_default();
        Tensor::from_vec(out, (m, n), &Device::Cpu)
    };
    let ops = 2.0 * (m * k * n) as f64;
    for (name, first, best) in [
        ("whole", first_whole, time(&whole)?),
        ("pieces of 31", first_pieces, time(&pieces)?),
        // (`forward_compact`: candle's `k_quants::matmul`, or `stored_tiles` above 4 rows on VNNI CPUs)
        ("compact blocks (forward_compact)", 0.0, time(&compact)?),
        (
            "compact blocks (vl_nn::stored)",
            0.0,
            if m <= vl_nn::stored::SMALL_ROWS || vl_nn::stored::takes_prompts() { time(&own)? } else { f64::NAN },
        ),
        (
            "stored blocks, tiles per call (vl_nn::stored_tiles)",
            0.0,
            if vl_nn::stored_tiles::available() { time(&tiles)? } else { f64::NAN },
        ),
    ] {
        println!(
            "{m}x{k}x{n} {name}: first {:.1} ms, best {:.2} ms, {:.1} Gop/s",
            first * 1e3,
            best * 1e3,
            ops / best / 1e9
        );
    }
    Ok(())
}
