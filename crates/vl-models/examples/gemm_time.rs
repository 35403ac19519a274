//! Diagnosis: candle's f32 matmul (gemm crate) against the panel kernel, x [m, k] by W^T [k, n].
fn main() {
    vl_models::alloc::keep_large_buffers();
    let arg = |i: usize, default: usize| std::env::args().nth(i).map_or(default, |a| a.parse().expect("a number"));
    let (m, k, n, runs) = (arg(1, 4096), arg(2, 1024), arg(3, 4096), arg(4, 3));
    let dev = candle_core::Device::Cpu;
    let x = candle_core::Tensor::randn(0f32, 1.0, (m, k), &dev).unwrap();
    let w_t = candle_core::Tensor::randn(0f32, 1.0, (k, n), &dev).unwrap();
    let b = candle_core::Tensor::randn(0f32, 1.0, n, &dev).unwrap();
    let flops = 2.0 * (m * k * n) as f64;
    let mut best = f64::INFINITY;
    let mut want = None;
    for _ in 0..runs {
        let t = std::time::Instant::now();
        want = Some(x.matmul(&w_t).unwrap().broadcast_add(&b).unwrap());
        best = best.min(t.elapsed().as_secs_f64());
    }
    println!("candle {:.1} ms {:.0} GFLOP/s", best * 1e3, flops / best / 1e9);
    let xs = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let ws = w_t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let bs = b.to_vec1::<f32>().unwrap();
    let t = std::time::Instant::now();
    let panels = vl_nn::kernels::pack_weight_panels(&ws, k, n);
    let pack = t.elapsed().as_secs_f64();
    let mut y = vec![std::mem::MaybeUninit::<f32>::uninit(); m * n];
    let mut best = f64::INFINITY;
    for _ in 0..runs {
        let t = std::time::Instant::now();
        vl_nn::kernels::dense_panels(&xs, m, k, &panels, n, Some(&bs), &mut y);
        best = best.min(t.elapsed().as_secs_f64());
    }
    let want = want.unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let y: Vec<f32> = y.iter().map(|v| unsafe { v.assume_init() }).collect();
    let diff = want.iter().zip(&y).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    println!("panels {:.1} ms {:.0} GFLOP/s (pack {:.1} ms), max diff {diff:e}", best * 1e3, flops / best / 1e9, pack * 1e3);
}
