//! Times the gated delta rule over one prompt (diagnosis of the kernel, not a user-path figure):
//! `cargo run --release -p vl-nn --example delta_time [ROWS] [HEADS] [DIM] [LAYERS] [RUNS]`
//! (default 1024 rows, 16 key and value heads of 128, 18 layers: the near-2B Qwen3.5 bench
//! geometry's DeltaNet layers). Prints the best run's time and the FMA rate (4 multiply-adds per
//! state element per row: the decay, the read along the key, the update, the read by the query),
//! then the best time of the layers' convolutions over the same rows (q, k and v: 3 x heads x dim
//! channels, kernel 4, with SiLU). `VL_DELTA_FORM=chunked` times the chunked form.
use vl_nn::kernels::delta::{gated_delta_rule, DeltaShape};
use vl_nn::kernels::delta_conv::{causal_conv1d_silu, ConvTaps};

fn rnd(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect()
}

fn main() {
    let arg = |i: usize, default: usize| std::env::args().nth(i).map_or(default, |a| a.parse().expect("a number"));
    let (rows, heads, d, layers, runs) = (arg(1, 1024), arg(2, 16), arg(3, 128), arg(4, 18), arg(5, 5));
    let sh = DeltaShape { k_heads: heads, v_heads: heads, k_dim: d, v_dim: d, tiled: false };
    let unit = |x: Vec<f32>| -> Vec<f32> {
        x.chunks_exact(d)
            .flat_map(|h| {
                let n = h.iter().map(|v| v * v).sum::<f32>().sqrt().max(1e-6);
                h.iter().map(move |v| v / n).collect::<Vec<_>>()
            })
            .collect()
    };
    let w = rows * heads * d;
    let (q, k, v) = (unit(rnd(w, 1)), unit(rnd(w, 2)), rnd(w, 3));
    let g: Vec<f32> = rnd(rows * heads, 4).iter().map(|x| -0.05 - x.abs()).collect();
    let beta: Vec<f32> = rnd(rows * heads, 5).iter().map(|x| 0.5 + x).collect();
    let mut out = vec![0f32; w];
    let mut best = f64::MAX;
    for _ in 0..runs {
        let t = std::time::Instant::now();
        for _ in 0..layers {
            let mut states = vec![vec![0f32; sh.state_len()]];
            gated_delta_rule(sh, &[rows], &q, &k, &v, &g, &beta, &mut states, &mut out);
        }
        best = best.min(t.elapsed().as_secs_f64());
    }
    let channels = 3 * heads * d;
    let (x, taps) = (rnd(rows * channels, 6), ConvTaps::new(&rnd(channels * 4, 7), channels, 4));
    let mut conv_best = f64::MAX;
    for _ in 0..runs {
        let t = std::time::Instant::now();
        for _ in 0..layers {
            let mut window = vec![0f32; 3 * channels];
            std::hint::black_box(causal_conv1d_silu(&x, &taps, &mut window));
        }
        conv_best = conv_best.min(t.elapsed().as_secs_f64());
    }
    let fmas = (4 * rows * sh.state_len() * layers) as f64;
    println!(
        "{rows} rows, {heads} heads of {d}, {layers} layers: {:.1} ms, {:.1} us a row, {:.1} GFMA/s",
        best * 1e3,
        best * 1e6 / rows as f64,
        fmas / best / 1e9
    );
    println!("convolution, {channels} channels, kernel 4, {layers} layers: {:.1} ms", conv_best * 1e3);
}
