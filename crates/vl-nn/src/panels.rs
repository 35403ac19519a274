//! Dense f32 products for AVX2 CPUs over weights packed once, at load, in 16-column panels.
//!
//! `y = x W^T + b` with W stored as `[ceil(out / 16), in, 16]`: panel p holds output columns
//! 16p..16p+16 for every input feature. The activations are packed per call in chunks of rows
//! (`pack_rows`: groups of 6 rows side by side, feature by feature), once for every column tile
//! of the chunk, so the micro-kernel reads both operands at constant offsets from two pointers:
//! each weight row of a panel as two AVX2 vectors against 6 broadcast activations, 6 rows x 16
//! columns of accumulators started from the bias. A ragged last panel is zero-padded and its
//! spare columns never stored. On this session's Xeon core (AVX2 code, 2 threads) the tower's
//! shapes run at 165-194 GFLOP/s, 80-90% of the FMA peak; on a Zen 3 the unpacked version ran at
//! 188-193 against `gemm`'s 155-179 (see docs/performance.md).

/// Output columns per panel: two AVX2 registers of f32.
pub(crate) const WIDTH: usize = 16;

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

/// Rows of activations per packed group: the micro-kernel's rows of accumulators.
pub(crate) const GROUP: usize = 6;

/// Bytes of packed activations at most per chunk of rows (`chunk_rows`).
const CHUNK_BYTES: usize = 8 << 20;

/// Rows of `m` (each of `k` features) packed at once: whole groups, chunks of at most
/// `CHUNK_BYTES` (at least `ROW_BLOCK`'s 48 rows), equal in size.
pub(crate) fn chunk_rows(m: usize, k: usize) -> usize {
    let cap = (CHUNK_BYTES / (4 * k.max(1))).max(48) / GROUP * GROUP;
    m.div_ceil(m.div_ceil(cap)).next_multiple_of(GROUP)
}

/// `x`: `rows` rows of `k` features, row-major, into `dst` (refilled with `rows * k` floats) as
/// the panels' micro-kernel reads them: group g (rows 6g..6g+r, r = 6 or what is left) at
/// `6g * k`, feature by feature, its r rows' values side by side. Parallel over groups on
/// candle's pool.
pub(crate) fn pack_rows(x: &[f32], rows: usize, k: usize, dst: &mut Vec<f32>) {
    assert!(x.len() >= rows * k, "pack_rows: {} floats for {rows} rows of {k}", x.len());
    dst.clear();
    dst.reserve(rows * k);
    let ptr = crate::cpu::SendPtr(dst.as_mut_ptr());
    candle_core::utils::barrier_pool().execute_chunked(rows.div_ceil(GROUP), |groups| {
        for g in groups {
            let r0 = g * GROUP;
            let r = GROUP.min(rows - r0);
            if r == GROUP {
                // A whole group: each feature's 6 values written side by side.
                let src: [&[f32]; GROUP] = std::array::from_fn(|j| &x[(r0 + j) * k..][..k]);
                // SAFETY: as below.
                let out = unsafe { std::slice::from_raw_parts_mut(ptr.get().add(r0 * k), GROUP * k) };
                for (i, o) in out.chunks_exact_mut(GROUP).enumerate() {
                    for j in 0..GROUP {
                        o[j] = src[j][i];
                    }
                }
                continue;
            }
            for j in 0..r {
                for (i, v) in x[(r0 + j) * k..][..k].iter().enumerate() {
                    // SAFETY: group g's floats, r0 * k .. (r0 + r) * k, inside the reserved
                    // capacity, belong to this work item.
                    unsafe { ptr.get().add(r0 * k + i * r + j).write(*v) };
                }
            }
        }
    });
    // SAFETY: the groups cover rows * k floats, each written once above.
    unsafe { dst.set_len(rows * k) };
}

/// Whether this CPU can run the panel kernel (x86_64 with AVX2 and FMA).
pub(crate) fn available() -> bool {
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
        available() && !crate::cpu::has_avx512()
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// `w`: [n, k] row-major (a linear layer's weight) into panels `[ceil(n / 16), k, 16]`.
pub(crate) fn pack<T: Copy + Default + Send + Sync>(w: &[T], n: usize, k: usize) -> Vec<T> {
    let panels = n.div_ceil(WIDTH);
    let mut dst = vec![T::default(); panels * k * WIDTH];
    let ptr = crate::cpu::SendPtr(dst.as_mut_ptr());
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

/// Rows `r0..r1`, columns `c0..c1` (`c0` a multiple of 16, `r0` of `GROUP`) of
/// `y = x W^T + b`, `y` row-major with `n` columns; `a`: the rows of x (all `rows` of them, from
/// row 0 of `y`) packed by `pack_rows`; `panels` from `pack`. Single-threaded.
///
/// # Safety
/// The CPU has AVX2 and FMA (`available()`); `y` has room for `r1` rows of `n`; no other thread
/// writes this block of `y`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn tile(
    a: &[f32],
    rows: usize,
    k: usize,
    panels: &[f32],
    n: usize,
    bias: Option<&[f32]>,
    y: *mut f32,
    (r0, r1): (usize, usize),
    (c0, c1): (usize, usize),
) {
    // SAFETY: the operations below need no more than this function's `# Safety` contract.
    unsafe {
        debug_assert!(c0 % WIDTH == 0 && c1 <= n && r0 % GROUP == 0 && r1 <= rows && a.len() >= rows * k);
        debug_assert!(panels.len() >= n.div_ceil(WIDTH) * k * WIDTH);
        // A ragged last panel goes through this [6][16] buffer.
        let mut spare = [0f32; GROUP * WIDTH];
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
                        // The group's packed rows (all of them, even past `re`) from feature k0.
                        let group = GROUP.min(rows - r);
                        let xr = a.as_ptr().add(r * k + k0 * group);
                        let (dst, ldc) =
                            if cols == WIDTH { (y.add(r * n + col), n) } else { (spare.as_mut_ptr(), WIDTH) };
                        let take = GROUP.min(re - r);
                        if cols < WIDTH && !first {
                            for i in 0..take {
                                std::ptr::copy_nonoverlapping(y.add((r + i) * n + col), dst.add(i * WIDTH), cols);
                            }
                        }
                        let start = Start { bias: b, cols, first };
                        debug_assert!(take == group, "a row block ends on a group's end");
                        match group {
                            6 => block::<6>(xr, w, kc, dst, ldc, start),
                            5 => block::<5>(xr, w, kc, dst, ldc, start),
                            4 => block::<4>(xr, w, kc, dst, ldc, start),
                            3 => block::<3>(xr, w, kc, dst, ldc, start),
                            2 => block::<2>(xr, w, kc, dst, ldc, start),
                            _ => block::<1>(xr, w, kc, dst, ldc, start),
                        }
                        if cols < WIDTH {
                            for i in 0..take {
                                std::ptr::copy_nonoverlapping(dst.add(i * WIDTH), y.add((r + i) * n + col), cols);
                            }
                        }
                        r += take;
                    }
                    col += WIDTH;
                }
                rb = re;
            }
            k0 += kc;
        }
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

/// `c[r][0..16] (+)= sum_i x[i][r] w[i][0..16]` for `R` rows over `kc` input features, `x`
/// packed `R` values to a feature.
///
/// # Safety
/// The CPU has AVX2 and FMA; `x` is readable for `kc` groups of R packed values, `w` for `kc` rows
/// of a 16-float panel, `c` for R rows of 16 floats `ldc` apart (read unless `s.first`, then
/// written; this caller's); `s.bias`, when given, is readable for `s.cols` (at most 16) floats.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn block<const R: usize>(x: *const f32, w: *const f32, kc: usize, c: *mut f32, ldc: usize, s: Start) {
    // SAFETY: the operations below need no more than this function's `# Safety` contract.
    unsafe {
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
        // Packed rows: every step and stride a constant once inlined, so every address is a fixed
        // offset from two pointers (strided rows had left LLVM a chain of address adds, one per
        // broadcast, as long as the FMAs' own 6 cycles per feature).
        avx2::accumulate(&mut acc, kc, w, WIDTH, x, R, 1);
        avx2::store(&acc, c, ldc);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_are_whole_groups_within_the_bound_and_cover_the_rows() {
        for (m, k) in
            [(1, 1), (5, 3), (784, 1024), (784, 4096), (4096, 1024), (4096, 4096), (16384, 1024), (100, 1 << 20)]
        {
            let c = chunk_rows(m, k);
            assert_eq!(c % GROUP, 0, "{m}x{k}: {c}");
            assert!(c * k * 4 <= CHUNK_BYTES || c <= 48, "{m}x{k}: {c} rows of {k}");
            assert!(c < m + GROUP, "{m}x{k}: {c}");
        }
        assert_eq!(chunk_rows(784, 1024), 786);
        // Two equal chunks, not 510 rows and 274.
        assert_eq!(chunk_rows(784, 4096), 396);
    }

    #[test]
    fn packed_rows_are_groups_of_six_feature_by_feature() {
        let (rows, k) = (8, 3);
        let x: Vec<f32> = (0..rows * k).map(|i| i as f32).collect();
        let mut dst = vec![-1.0; 2];
        pack_rows(&x, rows, k, &mut dst);
        assert_eq!(dst.len(), rows * k);
        // Group 0: rows 0..6, feature by feature; group 1: rows 6 and 7.
        for i in 0..k {
            for j in 0..6 {
                assert_eq!(dst[i * 6 + j], x[j * k + i], "group 0, feature {i}, row {j}");
            }
            for j in 0..2 {
                assert_eq!(dst[6 * k + i * 2 + j], x[(6 + j) * k + i], "group 1, feature {i}, row {j}");
            }
        }
    }

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
