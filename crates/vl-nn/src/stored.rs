//! Q4_K and Q6_K products of a few rows (decoding) on the weight's stored blocks: AVX-512 BW
//! (with or without VNNI, `stored_vnni.rs`) or AVX2 (`stored_avx2.rs`).
//!
//! candle multiplies a Q4_K weight on tiles it repacks the blocks into (6 bits a value against
//! the stored 4.5), and a Q6_K weight's single rows with its AVX2 dot product. A decode step
//! reads every weight once and is bound by memory bandwidth, so reading the stored blocks moves
//! a quarter less for Q4_K. Here each block's quants are unpacked once into registers and
//! multiplied with up to `MAX_ROWS` activation rows (quantized to Q8_K as candle and ggml do), so
//! a batch of sequences also reads the weights once. Several weights that share an input (q/k/v,
//! gate/up) run in one parallel region on candle's worker pool.
//!
//! Block layouts (ggml's, `#[repr(C)]` in candle):
//! - Q4_K (144 bytes): f16 d, f16 dmin, 12 bytes of 6-bit scales and mins for 8 sub-blocks of
//!   32, 128 bytes of nibbles (chunk c of 64 values: the low nibbles of bytes 32c..32c+32 are
//!   values 64c.., the high nibbles 64c+32..); value = d * scale * q - dmin * min.
//! - Q6_K (210 bytes): 128 bytes of low nibbles, 64 bytes of high bit pairs, 16 i8 scales (one
//!   per 16 values), f16 d. Half h (128 values) takes low bytes 64h.. and pair bytes 32h..:
//!   values 128h + l, +32, +64, +96 (l < 32) are low byte l's low nibble, low byte l + 32's low
//!   nibble, low byte l's high nibble, low byte l + 32's high nibble, each with pair byte l's
//!   bits 0-1, 2-3, 4-5, 6-7 above; value = d * scale * (q - 32).
//! - Q8_K (292 bytes): f32 d, 256 i8, 16 i16 sums of 16 values each.

use candle_core::quantized::k_quants::{BlockQ8K, GgmlType as _};

use crate::cpu::SendPtr;

/// Input rows one pass over a weight row's blocks takes (the kernels' accumulators per row).
pub const MAX_ROWS: usize = 8;
/// Input rows one product takes here, in passes of `MAX_ROWS` over each weight row (read again
/// from L1): a decode step's batch, or drafted tokens being verified. Each row's result is bit
/// for bit the same whatever the row count. More rows go to the tiles (`stored_tiles`: their
/// weight reuse wins).
pub const SMALL_ROWS: usize = 16;
const QK: usize = 256;
const Q4K_BYTES: usize = 144;
const Q6K_BYTES: usize = 210;

/// The block types this module multiplies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Blocks {
    Q4K,
    Q6K,
}

impl Blocks {
    fn bytes(self) -> usize {
        match self {
            Blocks::Q4K => Q4K_BYTES,
            Blocks::Q6K => Q6K_BYTES,
        }
    }
}
const Q8K_BYTES: usize = 292;
/// How far ahead of the block being multiplied its row's bytes are prefetched: a decode product
/// streams its weight once, and the hardware prefetchers alone left each core waiting on memory.
/// `examples/stream_time 1 2048 6144 40` (40 distinct Q4_K weights in turn, 283 MB, as a decode
/// step streams its layers): 15.5 GB/s without, 21.2 at 4 KiB, 22.2 at 16 KiB; a whole MoE decode
/// step was faster at 4 KiB than at 8. Prefetching past the weight's end is harmless: a hint,
/// never a fault.
const PREFETCH: usize = 4096;
/// A second prefetch, this far ahead and into L2 only (`_MM_HINT_T1`): with the near one alone
/// the two cores streamed ~17 GB/s of the ~30 a plain 2-thread read reaches on this VM. The same
/// `examples/stream_time 1 2048 6144 120` (850 MB of distinct Q4_K weights), old/new alternating:
/// 16.6-17.0 GB/s without, 21.6-23.5 with (8 to 32 KiB alike); `vl run` decode at 200 positions
/// on llama.cpp's Q4_K_M, 3 rounds: 2B 15.1-15.3 -> 19.4-19.7 tok/s, the MoE's 8 layers
/// 31.9-33.4 -> 41.3-42.0; 8 and 16 KiB alike there too (2B 19.9 / 20.4 against 19.6 / 20.0).
const FAR: usize = 8192;

/// The prefetches of a Q4_K block's row ahead of the block at `blk` (a `*const u8`): three
/// lines `PREFETCH` ahead into L1 and three `FAR` ahead into L2. A macro for the callers'
/// `#[target_feature]` code.
macro_rules! q4k_prefetch {
    ($blk:expr) => {{
        let blk: *const u8 = $blk;
        for line in 0..3 {
            _mm_prefetch::<_MM_HINT_T0>(blk.wrapping_add(PREFETCH + 64 * line) as *const i8);
            _mm_prefetch::<_MM_HINT_T1>(blk.wrapping_add(FAR + 64 * line) as *const i8);
        }
    }};
}

/// The head of the Q4_K block at `blk` (a `*const u8`), as every Q4_K row kernel reads it: its
/// lines prefetched (`PREFETCH` ahead into L1, `FAR` into L2), d and dmin (two f16 widened
/// together), the packed scales and mins (`scales_mins`). A macro for the callers'
/// `#[target_feature]` code (SSE and F16C).
macro_rules! q4k_head {
    ($blk:expr) => {{
        let blk: *const u8 = $blk;
        q4k_prefetch!(blk);
        let dd = _mm_cvtph_ps(_mm_cvtsi32_si128(std::ptr::read_unaligned(blk as *const i32)));
        let (d, dmin) = (_mm_cvtss_f32(dd), _mm_cvtss_f32(_mm_shuffle_ps(dd, dd, 1)));
        let a = std::ptr::read_unaligned(blk.add(4) as *const [u32; 3]);
        let (sc, mn) = scales_mins([u32::from_le(a[0]), u32::from_le(a[1]), u32::from_le(a[2])]);
        (d, dmin, sc, mn)
    }};
}

/// One Q4_K block at `blk` (a `*const u8`), as both AVX-512 row kernels read it: its lines
/// prefetched (`PREFETCH` ahead into L1, `FAR` into L2), d and dmin (two f16 widened together),
/// the packed minimums, the 8 sub-block scales widened to i16 in a zmm's low half, and the four
/// 64-byte nibble planes (`low` masks a byte's nibble). A macro, not a function: the callers'
/// `#[target_feature]` code inlines it.
macro_rules! q4k_block {
    ($blk:expr, $low:expr) => {{
        let blk: *const u8 = $blk;
        let (d, dmin, sc, mn) = q4k_head!(blk);
        let sc16 = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(_mm_cvtsi64_si128(sc as i64)));
        let mut q4 = [_mm512_setzero_si512(); 4];
        for p in 0..2 {
            let bytes = _mm512_loadu_si512(blk.add(16 + 64 * p) as *const __m512i);
            q4[2 * p] = _mm512_and_si512(bytes, $low);
            q4[2 * p + 1] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), $low);
        }
        (d, dmin, mn, sc16, q4)
    }};
}

/// `$f::<M>(args)` for M = `$m` (1 to `MAX_ROWS`; more takes `MAX_ROWS`): the kernels' row
/// counts are const generics, so their accumulators live in registers.
macro_rules! by_rows {
    ($m:expr, $f:ident($($a:expr),*)) => {
        match $m {
            1 => $f::<1>($($a),*),
            2 => $f::<2>($($a),*),
            3 => $f::<3>($($a),*),
            4 => $f::<4>($($a),*),
            5 => $f::<5>($($a),*),
            6 => $f::<6>($($a),*),
            7 => $f::<7>($($a),*),
            _ => $f::<8>($($a),*),
        }
    };
}

/// Output rows per work item.
const ITEM_ROWS: usize = 16;
/// The most bytes of Q8_K input rows a work item meets when there are more than `SMALL_ROWS`.
const CHUNK_BYTES: usize = 192 * 1024;

/// The kernels that multiply the blocks, by CPU feature.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kernel {
    /// `row_dots` / `q6k_dots`: AVX-512 F and BW.
    Avx512,
    /// `row_dots_vnni` / `q6k_dots_vnni`: AVX512-VNNI besides, two weight rows a pass.
    Vnni,
    /// `row_dots_avx2` / `q6k_dots_avx2`: AVX2, FMA and F16C, where the CPU has no AVX-512.
    Avx2,
}

/// Whether this CPU has AVX-512 F/BW and this build may use it (not the AVX2 stand-in build,
/// `crate::cpu::has_avx512`).
fn avx512_runs() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        crate::cpu::has_avx512() && is_x86_feature_detected!("avx512bw") && avx2_runs()
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Whether this CPU has AVX2, FMA and F16C.
fn avx2_runs() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// The kernel this CPU runs (asked once): VNNI where it has AVX512-VNNI (`VL_NO_VNNI=1` says
/// no), else AVX-512, else AVX2; None without AVX2 or when `VL_STORED=0` (candle's products
/// instead, to compare the two on one machine).
pub(crate) fn kernel() -> Option<Kernel> {
    static KERNEL: std::sync::OnceLock<Option<Kernel>> = std::sync::OnceLock::new();
    *KERNEL.get_or_init(|| {
        if std::env::var_os("VL_STORED").is_some_and(|v| v == "0") {
            None
        } else if crate::cpu::has_avx512_vnni() && avx512_runs() {
            Some(Kernel::Vnni)
        } else if avx512_runs() {
            Some(Kernel::Avx512)
        } else if avx2_runs() {
            Some(Kernel::Avx2)
        } else {
            None
        }
    })
}

/// Whether this CPU runs one of the kernels (AVX-512 F and BW, or AVX2 with FMA and F16C).
pub fn available() -> bool {
    kernel().is_some()
}

/// Whether `matmul` takes any number of rows here, a prompt's too: on the AVX2 kernels, where
/// `stored_tiles` (AVX-512 VNNI) does not run and candle's AVX2 tiles would be a second copy of
/// every weight, 6 bits a Q4_K value and 10 a Q6_K one.
pub fn takes_prompts() -> bool {
    kernel() == Some(Kernel::Avx2)
}

/// `x` ([m, k] row-major, m <= SMALL_ROWS unless `takes_prompts`) times each weight transposed: `weights[i]` is
/// `(kind, bytes, n)`, the stored blocks of an `[n, k]` matrix. Returns each product `[m, n]`
/// row-major, or None where the kernel does not apply (CPU features, m, k, byte counts).
pub fn matmul(weights: &[(Blocks, &[u8], usize)], x: &[f32], m: usize, k: usize) -> Option<Vec<Vec<f32>>> {
    let each: Vec<(Blocks, &[u8], usize, usize)> = weights.iter().map(|&(kind, b, n)| (kind, b, n, 0)).collect();
    matmul_each(&each, &[(x, m)], k)
}

/// One activation matrix quantized once for every weight it multiplies: its Q8_K blocks and,
/// for Q4_K weights (and for Q6_K ones with VNNI), its values reordered to meet the weight's
/// vectors and the per-block terms the kernels add.
struct Input {
    m: usize,
    q8: Vec<BlockQ8K>,
    /// For Q4_K weights: each block's values in the order `row_dots` meets the stored nibbles,
    /// or with VNNI in `Q4K_VNNI_ORDER` (none for `row_dots_avx2`, which reads `q8` in order).
    reordered: Vec<i8>,
    /// For Q4_K weights without VNNI: each block's 8 sub-block sums (`row_dots`,
    /// `row_dots_avx2`).
    pairs: Vec<i16>,
    /// With VNNI, for Q4_K weights: the block's scale x the sum of each sub-block's 32 values, in
    /// `Q4K_FOLDED` order (8 a block: the mins' term, `row_dots_vnni`).
    folded_sums: Vec<f32>,
    /// With VNNI: each block's scale, the rows' blocks in order (the VNNI kernels read it here,
    /// a few lines, rather than one line of each Q8_K block).
    scales: Vec<f32>,
    /// With VNNI, for Q6_K weights: each block's values in `Q6K_VNNI_ORDER`, and for each i32
    /// lane of that layout -32 x the block's scale x its sub-block's sum (the quants' offset;
    /// `q6k_dots_vnni`).
    reordered6: Vec<i8>,
    offsets6: Vec<f32>,
}

impl Input {
    fn new(x: &[f32], m: usize, k: usize, (q4k, q6k): (bool, bool), kernel: Kernel) -> Self {
        let vnni = kernel == Kernel::Vnni;
        let kb = k / QK;
        let mut q8 = vec![BlockQ8K::zeros(); m * kb];
        if m <= SMALL_ROWS {
            for (row, blocks) in x.chunks_exact(k).zip(q8.chunks_exact_mut(kb)) {
                crate::q8k::quantize(row, blocks);
            }
        } else {
            // A prompt's rows (AVX2), on every core.
            let at = SendPtr(q8.as_mut_ptr());
            candle_core::utils::barrier_pool().execute_chunked(m, |rows| {
                for r in rows {
                    // SAFETY: row r's kb blocks are written by this item alone, inside q8.
                    let blocks = unsafe { std::slice::from_raw_parts_mut(at.get().add(r * kb), kb) };
                    crate::q8k::quantize(&x[r * k..(r + 1) * k], blocks);
                }
            });
        }
        let bytes = q8_bytes(&q8);
        let d = |blk: &[u8]| f32::from_le_bytes([blk[0], blk[1], blk[2], blk[3]]);
        let sum16 = |blk: &[u8], i: usize| i16::from_le_bytes([blk[4 + QK + 2 * i], blk[4 + QK + 2 * i + 1]]);
        let reorder = |order: &[u8; QK], out: &mut Vec<i8>| {
            out.resize(m * kb * QK, 0);
            reorder_blocks(order, bytes, out);
        };
        let (mut reordered, mut pairs, mut folded_sums) = (vec![], vec![], vec![]);
        if q4k {
            if kernel != Kernel::Avx2 {
                reordered.reserve(m * kb * QK);
            }
            if vnni {
                reorder(&Q4K_VNNI_ORDER, &mut reordered);
                folded_sums.reserve(m * kb * 8);
                for blk in bytes.chunks_exact(Q8K_BYTES) {
                    let yd = d(blk);
                    let sub = |s: usize| yd * f32::from(sum16(blk, 2 * s) + sum16(blk, 2 * s + 1));
                    folded_sums.extend(Q4K_FOLDED.iter().map(|&s| sub(s)));
                }
            } else {
                // Each Q8_K block's sums of its 8 sub-blocks of 32 (the mins' term; at most 32 x
                // 128, an i16).
                pairs.reserve(m * kb * 8);
                for blk in bytes.chunks_exact(Q8K_BYTES) {
                    pairs.extend((0..8).map(|s| sum16(blk, 2 * s) + sum16(blk, 2 * s + 1)));
                }
            }
            if kernel == Kernel::Avx512 {
                // The order Q4_K stores its nibbles in (see `row_dots`): of each 128, values
                // 0-31, 64-95, 32-63, 96-127.
                for blk in bytes.chunks_exact(Q8K_BYTES) {
                    for half in 0..2 {
                        for from in [0, 64, 32, 96] {
                            let at = 4 + half * 128 + from;
                            reordered.extend(blk[at..at + 32].iter().map(|&v| v as i8));
                        }
                    }
                }
            }
        }
        let (mut reordered6, mut offsets6) = (vec![], vec![]);
        if q6k && vnni {
            reordered6.reserve(m * kb * QK);
            reorder(&Q6K_VNNI_ORDER, &mut reordered6);
            offsets6.reserve(m * kb * 16);
            for blk in bytes.chunks_exact(Q8K_BYTES) {
                let minus = -32.0 * d(blk);
                offsets6.extend(Q6K_LANE_SUBBLOCK.iter().map(|&s| minus * f32::from(sum16(blk, s as usize))));
            }
        }
        let scales = if vnni { bytes.chunks_exact(Q8K_BYTES).map(d).collect() } else { vec![] };
        Input { m, q8, reordered, pairs, folded_sums, scales, reordered6, offsets6 }
    }
}

/// The bytes of Q8_K blocks.
fn q8_bytes(q8: &[BlockQ8K]) -> &[u8] {
    // SAFETY: BlockQ8K is `#[repr(C)]` of exactly Q8K_BYTES (candle asserts its size); its bytes
    // are read as the layout at the top of this file.
    unsafe { std::slice::from_raw_parts(q8.as_ptr() as *const u8, q8.len() * Q8K_BYTES) }
}

/// `matmul` with several inputs of the same width k, in one parallel region: `weights[i]` is
/// `(kind, bytes, n, input)`, an `[n, k]` matrix multiplying `inputs[input]`, `(x, m)`: m rows of
/// k (m <= SMALL_ROWS unless `takes_prompts`). Each input is quantized once, however many weights it meets (e.g. the
/// gate and up products of every expert a decode step routes to, each on its own rows).
/// Returns each product `[m, n]` row-major, or None where the kernel does not apply.
pub(crate) fn matmul_each(
    weights: &[(Blocks, &[u8], usize, usize)],
    inputs: &[(&[f32], usize)],
    k: usize,
) -> Option<Vec<Vec<f32>>> {
    matmul_each_on(weights, inputs, k, kernel()?)
}

/// `matmul_each` on the kernels `kernel` names (the caller checked the CPU runs them).
fn matmul_each_on(
    weights: &[(Blocks, &[u8], usize, usize)],
    inputs: &[(&[f32], usize)],
    k: usize,
    kernel: Kernel,
) -> Option<Vec<Vec<f32>>> {
    if k == 0 || !k.is_multiple_of(QK) {
        return None;
    }
    let most = if kernel == Kernel::Avx2 { usize::MAX } else { SMALL_ROWS };
    if inputs.iter().any(|&(x, m)| m == 0 || m > most || x.len() != m * k) {
        return None;
    }
    let kb = k / QK;
    // Input rows per work item: all of a few; of more (a prompt, AVX2 only), chunks of whole
    // passes whose Q8_K blocks stay in L2 while the item's weight rows meet them.
    let chunk = |m: usize| match m <= SMALL_ROWS {
        true => m,
        false => (CHUNK_BYTES / (kb * Q8K_BYTES)).max(MAX_ROWS) / MAX_ROWS * MAX_ROWS,
    };
    if weights.iter().any(|&(kind, b, n, i)| b.len() != n * kb * kind.bytes() || i >= inputs.len()) {
        return None;
    }
    let quantized: Vec<Input> = inputs
        .iter()
        .enumerate()
        .map(|(i, &(x, m))| {
            let meets = |kind| weights.iter().any(|w| w.3 == i && w.0 == kind);
            Input::new(x, m, k, (meets(Blocks::Q4K), meets(Blocks::Q6K)), kernel)
        })
        .collect();
    let mut outs: Vec<Vec<f32>> = weights.iter().map(|&(_, _, n, i)| vec![0f32; quantized[i].m * n]).collect();
    let ptrs: Vec<SendPtr<f32>> = outs.iter_mut().map(|o| SendPtr(o.as_mut_ptr())).collect();
    // Work items: ITEM_ROWS output rows of one weight and a chunk of its input's rows, the
    // chunks outer; `starts[i]` is weight i's first item.
    let mut starts = Vec::with_capacity(weights.len() + 1);
    let mut total = 0;
    for &(_, _, n, i) in weights {
        starts.push(total);
        let m = quantized[i].m;
        total += n.div_ceil(ITEM_ROWS) * m.div_ceil(chunk(m));
    }
    starts.push(total);
    candle_core::utils::barrier_pool().execute_chunked(total, |items| {
        for item in items {
            let w = starts.partition_point(|&s| s <= item) - 1;
            let (kind, blocks, n, input) = weights[w];
            let x = &quantized[input];
            let (m, q8) = (x.m, q8_bytes(&x.q8));
            let (groups, rows) = (n.div_ceil(ITEM_ROWS), chunk(m));
            let (c, g) = ((item - starts[w]) / groups, (item - starts[w]) % groups);
            let (first, end) = (g * ITEM_ROWS, (g * ITEM_ROWS + ITEM_ROWS).min(n));
            let out = ptrs[w];
            // With VNNI, weight rows go two at a time (`row_dots_vnni`, `q6k_dots_vnni`: each load
            // of the input meets both); a lone last row goes as its own pair and is written once.
            let step = if kernel == Kernel::Vnni { 2 } else { 1 };
            // Passes of up to MAX_ROWS input rows over the item's weight rows: a pass's inputs
            // stay in L1 while it meets each weight row (the rows, fewer bytes, come again from
            // L2 for the next pass). With one weight row after another instead, two passes of 8
            // rows of 2048 thrashed L1: 16 rows took 3x 8 rows' time on a Zen 4.
            for r0 in (c * rows..(c * rows + rows).min(m)).step_by(MAX_ROWS) {
                let mr = MAX_ROWS.min(m - r0);
                for row in (first..end).step_by(step) {
                    let rows = [row, (row + step - 1).min(end - 1)];
                    let mut dots = [[0f32; MAX_ROWS]; 2];
                    // SAFETY: the CPU runs `kernel` (the caller's check, `kernel()`); the weight rows' blocks lie in `blocks` (length
                    // checked above), the input's q8 and, for its weights' kinds and kernels,
                    // reordered values and sums (`Input::new`) hold m rows of kb blocks, of which
                    // rows r0..r0 + mr are read.
                    unsafe {
                        let at = |row: usize| blocks.as_ptr().add(row * kb * kind.bytes());
                        let q8 = q8.as_ptr().add(r0 * kb * Q8K_BYTES);
                        let scales = x.scales.as_ptr().wrapping_add(r0 * kb);
                        match kind {
                            Blocks::Q4K => {
                                let re = x.reordered.as_ptr().wrapping_add(r0 * kb * QK);
                                let pairs = x.pairs.as_ptr().wrapping_add(r0 * kb * 8);
                                let sums = x.folded_sums.as_ptr().wrapping_add(r0 * kb * 8);
                                row_dots_m(
                                    [at(rows[0]), at(rows[1])],
                                    kb,
                                    (q8, scales, re, pairs, sums),
                                    mr,
                                    kernel,
                                    &mut dots,
                                )
                            }
                            Blocks::Q6K => {
                                let re = x.reordered6.as_ptr().wrapping_add(r0 * kb * QK);
                                let offsets = x.offsets6.as_ptr().wrapping_add(r0 * kb * 16);
                                q6k_dots_m(
                                    [at(rows[0]), at(rows[1])],
                                    kb,
                                    (q8, scales, re, offsets),
                                    mr,
                                    kernel,
                                    &mut dots,
                                )
                            }
                        }
                    };
                    for (j, &row) in rows.iter().enumerate().take(if rows[1] == rows[0] { 1 } else { 2 }) {
                        for (r, d) in dots[j].iter().take(mr).enumerate() {
                            // SAFETY: each (r, row) is written by this item alone, inside the m x n
                            // output.
                            unsafe { *out.get().add((r0 + r) * n + row) = *d };
                        }
                    }
                }
            }
        }
    });
    Some(outs)
}

/// One weight row (kb Q4_K blocks at `w`) dotted with M Q8_K rows (M * kb blocks at `q8`, their
/// values again at `re` in the order of the stored nibbles; `pairs` holds each block's 8
/// sub-block sums, the pairs of its 16-value sums).
///
/// # Safety
/// The CPU has AVX-512 F/BW, AVX2, FMA and F16C; `w` is readable for `kb` Q4_K blocks, `q8` for M x
/// kb Q8_K blocks, and `re` and `pairs` for those blocks' reordered values and sub-block sums (an
/// `Input` made with them).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
unsafe fn row_dots<const M: usize>(
    w: *const u8,
    kb: usize,
    q8: *const u8,
    re: *const i8,
    pairs: *const i16,
    dots: &mut [f32; MAX_ROWS],
) {
    // SAFETY: the operations below need no more than this function's `# Safety` contract.
    unsafe {
        use std::arch::x86_64::*;
        let low = _mm512_set1_epi8(0x0f);
        // 64 stored bytes hold the low nibbles of sub-blocks 4p and 4p + 2 and the high nibbles of
        // 4p + 1 and 4p + 3 (p = 0, 1): `re` has each Q8_K block's values in that order, so a load
        // of stored bytes meets its activations without shuffling the weight. Scales: lanes 0-15 of
        // a product take the first sub-block's, lanes 16-31 the second's.
        let pick = |a: i16, b: i16| _mm512_mask_blend_epi16(0xffff_0000, _mm512_set1_epi16(a), _mm512_set1_epi16(b));
        let picks = [pick(0, 2), pick(1, 3), pick(4, 6), pick(5, 7)];
        let mut acc = [_mm512_setzero_ps(); M];
        let mut mins = [_mm_setzero_ps(); M];
        for b in 0..kb {
            let (d, dmin, mn, sc16, q4) = q4k_block!(w.add(b * Q4K_BYTES), low);
            let mn16 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(mn as i64));
            let scale = [
                _mm512_permutexvar_epi16(picks[0], sc16),
                _mm512_permutexvar_epi16(picks[1], sc16),
                _mm512_permutexvar_epi16(picks[2], sc16),
                _mm512_permutexvar_epi16(picks[3], sc16),
            ];
            for r in 0..M {
                let i = r * kb + b;
                let yd = std::ptr::read_unaligned(q8.add(i * Q8K_BYTES) as *const f32);
                let yq = re.add(i * QK);
                let mut sum = _mm512_setzero_si512();
                for c in 0..4 {
                    let prod = _mm512_maddubs_epi16(q4[c], _mm512_loadu_si512(yq.add(64 * c) as *const __m512i));
                    sum = _mm512_add_epi32(sum, _mm512_madd_epi16(prod, scale[c]));
                }
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(d * yd), acc[r]);
                let p = _mm_loadu_si128(pairs.add(i * 8) as *const __m128i);
                let m = _mm_cvtepi32_ps(_mm_madd_epi16(mn16, p));
                mins[r] = _mm_fmadd_ps(m, _mm_set1_ps(dmin * yd), mins[r]);
            }
        }
        for r in 0..M {
            let m = _mm_add_ps(mins[r], _mm_movehl_ps(mins[r], mins[r]));
            let m = _mm_add_ss(m, _mm_shuffle_ps(m, m, 1));
            dots[r] = _mm512_reduce_add_ps(acc[r]) - _mm_cvtss_f32(m);
        }
    }
}

/// `row_dots` (or `row_dots_vnni` when `vnni`) for m input rows: `dots[j]` is weight row
/// `w[j]`'s, for both with VNNI and for `w[0]` alone without.
///
/// # Safety
/// As for `row_dots` with M = `m` (1 to `MAX_ROWS`), and for `row_dots_vnni` when `vnni`.
#[cfg(target_arch = "x86_64")]
unsafe fn row_dots_m(
    w: [*const u8; 2],
    kb: usize,
    (q8, scales, re, pairs, sums): (*const u8, *const f32, *const i8, *const i16, *const f32),
    m: usize,
    kernel: Kernel,
    dots: &mut [[f32; MAX_ROWS]; 2],
) {
    // SAFETY: the operations below need no more than this function's `# Safety` contract.
    unsafe {
        if kernel == Kernel::Vnni {
            return by_rows!(m, row_dots_vnni(w, kb, scales, re, sums, dots));
        }
        let (w, dots) = (w[0], &mut dots[0]);
        if kernel == Kernel::Avx2 {
            return by_rows!(m, row_dots_avx2(w, kb, q8, pairs, dots));
        }
        by_rows!(m, row_dots(w, kb, q8, re, pairs, dots))
    }
}

/// One Q6_K block at `blk` (a `*const u8`), as both Q6_K row kernels read it: its lines
/// prefetched, d, the 16 i8 scales widened to i16, and its four 64-value vectors of 6-bit quants,
/// values 64v..64v + 64 in order (bits 4-5 from the pair bytes). A macro for the callers'
/// `#[target_feature]` code.
macro_rules! q6k_block {
    ($blk:expr) => {{
        let blk: *const u8 = $blk;
        let low = _mm512_set1_epi8(0x0f);
        let pair = _mm512_set1_epi8(0x30);
        // The high bit pairs each 64 values take, moved to bits 4-5 with one 16-bit shift per half
        // of the vector (the bits a shift carries into the neighbouring byte are masked off): for
        // vector 2h, bits 0-1 (values 0-31) and 2-3 (32-63); for vector 2h + 1, bits 4-5 and 6-7.
        let up = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
        let down = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1);
        for line in 0..4 {
            _mm_prefetch::<_MM_HINT_T0>(blk.wrapping_add(PREFETCH + 64 * line) as *const i8);
            _mm_prefetch::<_MM_HINT_T1>(blk.wrapping_add(FAR + 64 * line) as *const i8);
        }
        let (ql, qh, scales) = (blk, blk.add(128), blk.add(192));
        let d =
            _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(std::ptr::read_unaligned(blk.add(208) as *const u16) as i32)));
        let sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(scales as *const __m128i));
        let mut q6 = [_mm512_setzero_si512(); 4];
        for h in 0..2 {
            // Low bytes 64h..64h+64: their low nibbles are values 128h + 0..64 in order, their
            // high nibbles 128h + 64..128; the pair bytes 32h..32h+32 serve both halves.
            let l = _mm512_loadu_si512(ql.add(64 * h) as *const __m512i);
            let hb = _mm512_broadcast_i64x4(_mm256_loadu_si256(qh.add(32 * h) as *const __m256i));
            let b0 = _mm512_and_si512(_mm512_sllv_epi16(hb, up), pair);
            let b1 = _mm512_and_si512(_mm512_srlv_epi16(hb, down), pair);
            q6[2 * h] = _mm512_or_si512(_mm512_and_si512(l, low), b0);
            q6[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), low), b1);
        }
        (d, sc16, q6)
    }};
}

/// One Q6_K weight row (kb blocks at `w`) dotted with M Q8_K rows (M * kb blocks at `q8`).
///
/// # Safety
/// The CPU has AVX-512 F/BW, AVX2, FMA and F16C; `w` is readable for `kb` Q6_K blocks and `q8` for
/// M x kb Q8_K blocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
unsafe fn q6k_dots<const M: usize>(w: *const u8, kb: usize, q8: *const u8, dots: &mut [f32; MAX_ROWS]) {
    // SAFETY: the operations below need no more than this function's `# Safety` contract.
    unsafe {
        use std::arch::x86_64::*;
        // Vector v (values 64v..64v+64) takes scales 4v..4v+4, one per 8 i16 lanes of its products.
        let pick = |v: i16| {
            let mut idx = [0i16; 32];
            for (i, x) in idx.iter_mut().enumerate() {
                *x = 4 * v + (i / 8) as i16;
            }
            _mm512_loadu_si512(idx.as_ptr() as *const __m512i)
        };
        let picks = [pick(0), pick(1), pick(2), pick(3)];
        let mut acc = [_mm512_setzero_ps(); M];
        let mut offs = [_mm256_setzero_ps(); M];
        for b in 0..kb {
            let (d, sc16, q6) = q6k_block!(w.add(b * Q6K_BYTES));
            let sc512 = _mm512_castsi256_si512(sc16);
            let mut scale = [_mm512_setzero_si512(); 4];
            for v in 0..4 {
                scale[v] = _mm512_permutexvar_epi16(picks[v], sc512);
            }
            for r in 0..M {
                let y = q8.add((r * kb + b) * Q8K_BYTES);
                let yd = std::ptr::read_unaligned(y as *const f32);
                let yq = y.add(4);
                let mut sum = _mm512_setzero_si512();
                for v in 0..4 {
                    let prod = _mm512_maddubs_epi16(q6[v], _mm512_loadu_si512(yq.add(64 * v) as *const __m512i));
                    sum = _mm512_add_epi32(sum, _mm512_madd_epi16(prod, scale[v]));
                }
                let dyd = d * yd;
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(dyd), acc[r]);
                // The quants' offset of 32: minus 32 x scale x the 16-value sums.
                let bsums = _mm256_loadu_si256(y.add(4 + QK) as *const __m256i);
                let off = _mm256_cvtepi32_ps(_mm256_madd_epi16(sc16, bsums));
                offs[r] = _mm256_fmadd_ps(off, _mm256_set1_ps(-32.0 * dyd), offs[r]);
            }
        }
        for r in 0..M {
            let o = _mm_add_ps(_mm256_castps256_ps128(offs[r]), _mm256_extractf128_ps(offs[r], 1));
            let o = _mm_add_ps(o, _mm_movehl_ps(o, o));
            let o = _mm_add_ss(o, _mm_shuffle_ps(o, o, 1));
            dots[r] = _mm512_reduce_add_ps(acc[r]) + _mm_cvtss_f32(o);
        }
    }
}

/// `q6k_dots` (or `q6k_dots_vnni` when `vnni`) for m input rows: `dots[j]` is weight row
/// `w[j]`'s, for both with VNNI and for `w[0]` alone without.
///
/// # Safety
/// As for `q6k_dots` with M = `m` (1 to `MAX_ROWS`), and for `q6k_dots_vnni` when `vnni`.
#[cfg(target_arch = "x86_64")]
unsafe fn q6k_dots_m(
    w: [*const u8; 2],
    kb: usize,
    (q8, scales, re, offsets): (*const u8, *const f32, *const i8, *const f32),
    m: usize,
    kernel: Kernel,
    dots: &mut [[f32; MAX_ROWS]; 2],
) {
    // SAFETY: the operations below need no more than this function's `# Safety` contract.
    unsafe {
        let x = (scales, re, offsets);
        if kernel == Kernel::Vnni {
            return by_rows!(m, q6k_dots_vnni(w, kb, x, dots));
        }
        let (w, dots) = (w[0], &mut dots[0]);
        if kernel == Kernel::Avx2 {
            return by_rows!(m, q6k_dots_avx2(w, kb, q8, dots));
        }
        by_rows!(m, q6k_dots(w, kb, q8, dots))
    }
}

/// # Safety
/// Never to be called: `available` is false off x86-64 (the body is unreachable).
#[cfg(not(target_arch = "x86_64"))]
unsafe fn q6k_dots_m(
    _w: [*const u8; 2],
    _kb: usize,
    _q8: (*const u8, *const f32, *const i8, *const f32),
    _m: usize,
    _kernel: Kernel,
    _dots: &mut [[f32; MAX_ROWS]; 2],
) {
    unreachable!("`available` is false off x86-64")
}

/// # Safety
/// Never to be called: `available` is false off x86-64 (the body is unreachable).
#[cfg(not(target_arch = "x86_64"))]
unsafe fn row_dots_m(
    _w: [*const u8; 2],
    _kb: usize,
    _q8: (*const u8, *const f32, *const i8, *const i16, *const f32),
    _m: usize,
    _kernel: Kernel,
    _dots: &mut [[f32; MAX_ROWS]; 2],
) {
    unreachable!("`available` is false off x86-64")
}

#[path = "stored_vnni.rs"]
mod vnni;
use vnni::*;
#[path = "stored_avx2.rs"]
mod avx2;
#[cfg(target_arch = "x86_64")]
use avx2::*;

#[cfg(test)]
#[path = "stored_tests.rs"]
mod tests;
