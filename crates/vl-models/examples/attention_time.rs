//! Times the fused CPU segment attention alone (diagnosis, not a user-path figure):
//! `cargo run --release -p vl-models --example attention_time [SEQ] [HEADS] [HEAD_DIM] [RUNS]`.
//! Random rows (seeded), one segment, candle's pool (RAYON_NUM_THREADS); prints the best run and
//! its rate counting the two products (4 x seq^2 x head_dim x heads flops). `VL_QUERY_TILE` and
//! `VL_KEY_TILE` override the tile sizes; `VL_TILE_KERNEL=gemm|strips|strips512` the tile kernel (default:
//! `TileKernel::best()`).
use vl_nn::kernels::{segment_attention_with, SegmentAttentionShape, TileKernel, KEY_TILE, QUERY_TILE};

fn main() {
    vl_models::alloc::keep_large_buffers();
    let arg = |i: usize, default: usize| std::env::args().nth(i).map_or(default, |a| a.parse().expect("a number"));
    let (seq, heads, d, runs) = (arg(1, 4096), arg(2, 16), arg(3, 64), arg(4, 5));
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    };
    let qkv: Vec<f32> = (0..seq * 3 * heads * d).map(|_| next() * 2.0).collect();
    let ang: Vec<f32> = (0..seq * d / 2).map(|_| next() * 3.0).collect();
    let (cos, sin): (Vec<f32>, Vec<f32>) = ang.iter().map(|a| (a.cos(), a.sin())).unzip();
    let env = |k: &str, default: usize| std::env::var(k).map_or(default, |v| v.parse().expect("a number"));
    let (query_tile, key_tile) = (env("VL_QUERY_TILE", QUERY_TILE), env("VL_KEY_TILE", KEY_TILE));
    let shape = SegmentAttentionShape { seq, heads, head_dim: d, query_tile, key_tile };
    let kernel = match std::env::var("VL_TILE_KERNEL").as_deref() {
        Ok("gemm") => TileKernel::Gemm,
        Ok("strips") => TileKernel::Avx2Strips,
        Ok("strips512") => TileKernel::Avx512Strips,
        Ok(other) => panic!("VL_TILE_KERNEL={other}: gemm, strips or strips512"),
        Err(_) => TileKernel::best(),
    };
    let mut out = vec![0f32; seq * heads * d];
    let mut best = f64::INFINITY;
    for _ in 0..runs {
        let t = std::time::Instant::now();
        segment_attention_with(kernel, &qkv, &cos, &sin, &[0, seq], shape, &mut out);
        best = best.min(t.elapsed().as_secs_f64());
    }
    let flops = 4.0 * (seq * seq * d * heads) as f64;
    let check: f64 = out.iter().map(|&v| v as f64).sum();
    println!(
        "{kernel:?} seq {seq} heads {heads} d {d}: best {:.1} ms, {:.0} GFLOP/s (checksum {check:.6})",
        best * 1e3,
        flops / best / 1e9
    );
}
