//! Dense f32 products for AVX2 CPUs over weights packed once, at load, in 16-column panels.
//!
//! `y = x W^T + b` with W stored as `[ceil(out / 16), in, 16]`: panel p holds output columns
//! 16p..16p+16 for every input feature, so the micro-kernel loads each weight row of a panel as
//! two AVX2 vectors, broadcasts the activations straight from their rows (no per-call packing of
//! either operand, which `gemm` does), and keeps 6 rows x 16 columns of accumulators, started
//! from the bias. A ragged last panel is zero-padded and its spare columns never stored.
//! On a Zen 3 (2 threads, 784 rows) the tower's shapes ran at 188-193 GFLOP/s against
//! `gemm`'s 155-179 through `Dense` (see docs/performance.md).

/// Output columns per panel: two AVX2 registers of f32.
pub const WIDTH: usize = 16;

#[cfg(target_arch = "x86_64")]
/// Rows of activations that each panel of a tile is swept over before the next panel (48 rows
/// of 1024 features: 192 KiB, in a 512 KiB L2). On the Zen 3, 784 x 1024 by 1024 x 4096: 48 or
/// 96 rows 192 GFLOP/s, all 784 rows at once 187.
const ROW_BLOCK: usize = 48;

#[cfg(target_arch = "x86_64")]
/// Input features per pass (the accumulators restart from the partial sums in `y` after each):
/// a panel's slice of `K_BLOCK` x 64 B stays in L2. 4096 covers every vision layer in one pass;
/// on the Zen 3, 256- and 512-feature passes ran at 180-187 GFLOP/s against 192.
const K_BLOCK: usize = 4096;

/// Whether this CPU can run the panel kernel (x86_64 with AVX2 and FMA).
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Whether `Dense` packs its weights in panels on this CPU: AVX2 and FMA are its widest vectors
/// (with AVX-512, `gemm`'s 16-lane kernels are used; the panels were not measured there).
pub fn preferred() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        available() && !crate::has_avx512()
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// `w`: [n, k] row-major (a linear layer's weight) into panels `[ceil(n / 16), k, 16]`.
pub fn pack<T: Copy + Default + Send + Sync>(w: &[T], n: usize, k: usize) -> Vec<T> {
    let panels = n.div_ceil(WIDTH);
    let mut dst = vec![T::default(); panels * k * WIDTH];
    let ptr = crate::kernels::SendPtr(dst.as_mut_ptr());
    candle_core::utils::barrier_pool().execute_chunked(panels, |range| {
        for p in range {
            // SAFETY: panel p of the destination belongs to this work item.
            let out = unsafe { std::slice::from_raw_parts_mut(ptr.get().add(p * k * WIDTH), k * WIDTH) };
            for j in 0..WIDTH.min(n - p * WIDTH) {
                let row = &w[(p * WIDTH + j) * k..][..k];
                for (i, v) in row.iter().enumerate() {
                    out[i * WIDTH + j] = *v;
                }
            }
        }
    });
    dst
}

/// Rows `r0..r1`, columns `c0..c1` (`c0` a multiple of 16) of `y = x W^T + b`, `y` row-major
/// with `n` columns; `x`: [rows, k]; `panels` from `pack`. Single-threaded.
///
/// # Safety
/// The CPU has AVX2 and FMA (`available()`); `y` has room for `r1` rows of `n`; no other thread
/// writes this block of `y`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn tile(
    x: &[f32],
    k: usize,
    panels: &[f32],
    n: usize,
    bias: Option<&[f32]>,
    y: *mut f32,
    (r0, r1): (usize, usize),
    (c0, c1): (usize, usize),
) {
    debug_assert!(c0 % WIDTH == 0 && c1 <= n && x.len() >= r1 * k);
    debug_assert!(panels.len() >= n.div_ceil(WIDTH) * k * WIDTH);
    // A ragged last panel goes through this [6][16] buffer.
    let mut spare = [0f32; 6 * WIDTH];
    let mut k0 = 0;
    while k0 < k {
        let kc = K_BLOCK.min(k - k0);
        let first = k0 == 0;
        let mut rb = r0;
        while rb < r1 {
            let re = (rb + ROW_BLOCK).min(r1);
            let mut col = c0;
            while col < c1 {
                let w = panels.as_ptr().add((col / WIDTH * k + k0) * WIDTH);
                let cols = WIDTH.min(c1 - col);
                let b = bias.map(|b| b[col..col + cols].as_ptr());
                let mut r = rb;
                while r < re {
                    let rows = 6.min(re - r);
                    let xr = x.as_ptr().add(r * k + k0);
                    let (dst, ldc) = if cols == WIDTH { (y.add(r * n + col), n) } else { (spare.as_mut_ptr(), WIDTH) };
                    if cols < WIDTH && !first {
                        for i in 0..rows {
                            std::ptr::copy_nonoverlapping(y.add((r + i) * n + col), dst.add(i * WIDTH), cols);
                        }
                    }
                    let start = Start { bias: b, cols, first };
                    match rows {
                        6 => block::<6>(xr, k, w, kc, dst, ldc, start),
                        5 => block::<5>(xr, k, w, kc, dst, ldc, start),
                        4 => block::<4>(xr, k, w, kc, dst, ldc, start),
                        3 => block::<3>(xr, k, w, kc, dst, ldc, start),
                        2 => block::<2>(xr, k, w, kc, dst, ldc, start),
                        _ => block::<1>(xr, k, w, kc, dst, ldc, start),
                    }
                    if cols < WIDTH {
                        for i in 0..rows {
                            std::ptr::copy_nonoverlapping(dst.add(i * WIDTH), y.add((r + i) * n + col), cols);
                        }
                    }
                    r += rows;
                }
                col += WIDTH;
            }
            rb = re;
        }
        k0 += kc;
    }
}

#[cfg(target_arch = "x86_64")]
/// What a block's accumulators start from: the bias (or zero) on the first pass over the
/// input features, the block's partial sums in `c` after that.
#[derive(Clone, Copy)]
struct Start {
    bias: Option<*const f32>,
    /// Valid columns of the panel (the bias has only these).
    cols: usize,
    first: bool,
}

/// `c[r][0..16] (+)= sum_i x[r][i] w[i][0..16]` for `R` rows over `kc` input features.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn block<const R: usize>(
    x: *const f32,
    ldx: usize,
    w: *const f32,
    kc: usize,
    c: *mut f32,
    ldc: usize,
    s: Start,
) {
    use crate::avx2;
    let mut acc = if !s.first {
        avx2::load::<R>(c, ldc)
    } else {
        let mut row = [0f32; WIDTH];
        if let Some(b) = s.bias {
            std::ptr::copy_nonoverlapping(b, row.as_mut_ptr(), s.cols);
        }
        [avx2::load::<1>(row.as_ptr(), 0)[0]; R]
    };
    // Over the input features: a weight row of the panel against the R rows' i-th activations.
    avx2::accumulate(&mut acc, kc, w, WIDTH, x, 1, ldx);
    avx2::store(&acc, c, ldc);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pack_puts_each_output_column_in_its_panel_lane() {
        let (n, k) = (21, 3);
        let w: Vec<f32> = (0..n * k).map(|i| i as f32 + 1.0).collect();
        let p = pack(&w, n, k);
        assert_eq!(p.len(), 2 * k * WIDTH);
        for o in 0..n {
            for i in 0..k {
                assert_eq!(p[(o / WIDTH * k + i) * WIDTH + o % WIDTH], w[o * k + i], "column {o}, input {i}");
            }
        }
        // The padding of the ragged last panel is zero.
        assert!((n..2 * WIDTH).all(|o| (0..k).all(|i| p[(k + i) * WIDTH + o % WIDTH] == 0.0)));
    }
}
