//! CPU f32 kernels that candle runs scalar or unfused: a vectorized `exp`, the tanh-approximated
//! GELU in place, and flash-style segment attention (rotary applied once, query/key tiles, online
//! softmax, no score matrix beyond one tile).
//!
//! One portable binary: the loops are written plainly so that LLVM vectorizes them, and each is
//! compiled once per instruction set by `multiversion` and picked at run time (AVX-512 where
//! present, AVX2+FMA, NEON on aarch64, the baseline otherwise), so the default build needs no
//! `-C target-cpu`. The attention tiles' products go to the `gemm` crate (what candle's own
//! matmul calls), single-threaded per tile, except on CPUs whose widest vectors are AVX2, where
//! register-blocked strips of 16 query rows (`std::arch` intrinsics, checked at run time) read
//! the operands in place and skip `gemm`'s per-tile packing (the same template builds 48-row
//! AVX-512 strips, `TileKernel::Avx512Strips`, measured even with `gemm` there and so not its
//! default); tiles run on candle's worker pool.

use candle_core::{DType, Tensor};
use multiversion::multiversion;

use crate::dispatch::{own_kernel, DeviceKind, Op};

/// `e^x` to about 2 ulp for |x| <= 87 (clamped outside: `exp(-inf)` is ~1e-38, not 0, and large
/// inputs saturate at ~2^127). Cephes' `expf`: x = n ln2 + r, |r| <= ln2 / 2, degree-7
/// polynomial for e^r, 2^n from the exponent bits. Branch-free, so loops of it vectorize.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 * 2^23: adding it rounds to the nearest integer and leaves that integer in the low bits.
    const MAGIC: f32 = 12_582_912.0;
    let x = x.clamp(-87.0, 88.0);
    let t = x.mul_add(LOG2E, MAGIC);
    let n = t - MAGIC;
    let r = n.mul_add(-LN2_HI, x);
    let r = n.mul_add(-LN2_LO, r);
    let mut p = 1.987_569_1e-4_f32;
    p = p.mul_add(r, 1.398_199_9e-3);
    p = p.mul_add(r, 8.333_452e-3);
    p = p.mul_add(r, 4.166_579_6e-2);
    p = p.mul_add(r, 1.666_666_5e-1);
    p = p.mul_add(r, 0.5);
    let y = (p * r).mul_add(r, r) + 1.0;
    // n in [-126, 127]: its biased exponent, shifted into place.
    let bits = (t.to_bits().wrapping_sub(MAGIC.to_bits()) as i32 + 127) as u32;
    y * f32::from_bits(bits << 23)
}

/// `exp2_nonpositive`'s polynomial for `2^r` on [-1/2, 1/2], highest degree first (Horner; the
/// vector versions in `avx2` and `avx512` use the same coefficients in the same order).
#[allow(clippy::approx_constant)] // the fitted linear coefficient is near ln 2, but not ln 2
pub(crate) const EXP2_POLY: [f32; 6] = [1.327_735_7e-3, 9.671_589e-3, 5.550_689_6e-2, 2.402_224_1e-1, 6.931_47e-1, 1.0];

/// `2^x` for `x <= 0` to about 2 ulp (relative error <= 1.8e-7 in the fit), flushing below
/// `2^-126` to `2^-126`; NaN stays NaN. The softmax's exponential when the scores are in base 2
/// (q scaled by `log2 e`): x = n + r with |r| <= 1/2, a degree-5 polynomial for `2^r` with
/// constant term 1 (so `2^0` is exactly 1), its other coefficients fitted for relative error on
/// [-1/2, 1/2], `2^n` from the exponent bits. Four operations fewer than `exp`: no range
/// reduction by ln 2 and no upper clamp.
#[inline(always)]
pub fn exp2_nonpositive(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0;
    // Written as a comparison so that NaN passes through (`f32::max` would drop it).
    let x = if x < -126.0 { -126.0 } else { x };
    let t = x + MAGIC;
    let n = t - MAGIC;
    let r = x - n;
    let mut p = EXP2_POLY[0];
    for c in &EXP2_POLY[1..] {
        p = p.mul_add(r, *c);
    }
    // n in [-126, 0]: its biased exponent, shifted into place.
    let bits = (t.to_bits().wrapping_sub(MAGIC.to_bits()) as i32 + 127) as u32;
    p * f32::from_bits(bits << 23)
}

/// `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`, written as `x / (1 + e^(-2u))` (the same
/// function; no cancellation for negative x).
#[inline(always)]
pub fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    let u = SQRT_2_OVER_PI * (0.044_715 * x * x).mul_add(x, x);
    x / (1.0 + exp(-2.0 * u))
}

/// The exact GELU, `0.5 x (1 + erf(x / sqrt 2))`, with erfc from Abramowitz & Stegun 7.1.26
/// (absolute error <= 1.5e-7) computed for |z| and used on the side that does not cancel:
/// `0.5 x erfc(|z|)` for negative x, `x - 0.5 x erfc(z)` for positive.
#[inline(always)]
pub fn gelu_erf(x: f32) -> f32 {
    let z = x.abs() * std::f32::consts::FRAC_1_SQRT_2;
    let t = 1.0 / 0.327_591_1f32.mul_add(z, 1.0);
    let mut p = 1.061_405_4f32;
    p = p.mul_add(t, -1.453_152);
    p = p.mul_add(t, 1.421_413_8);
    p = p.mul_add(t, -0.284_496_74);
    p = p.mul_add(t, 0.254_829_6);
    let erfc = p * t * exp(-z * z);
    let half = 0.5 * x * erfc;
    if x < 0.0 {
        half
    } else {
        x - half
    }
}

/// Applies `gelu_tanh` to every value, in place, on candle's worker pool.
pub fn gelu_tanh_inplace(values: &mut [f32]) {
    map_chunks(values, gelu_slice);
}

/// Applies `gelu_erf` to every value, in place, on candle's worker pool.
pub fn gelu_erf_inplace(values: &mut [f32]) {
    map_chunks(values, gelu_erf_slice);
}

/// Runs `f` over 16 Ki-value chunks of `values` on candle's worker pool.
fn map_chunks(values: &mut [f32], f: fn(&mut [f32])) {
    const CHUNK: usize = 1 << 14;
    let n = values.len();
    let ptr = SendPtr(values.as_mut_ptr());
    candle_core::utils::barrier_pool().execute_chunked(n.div_ceil(CHUNK), |range| {
        let (start, end) = (range.start * CHUNK, (range.end * CHUNK).min(n));
        // SAFETY: work items are disjoint ranges of `values`, alive for the whole call.
        f(unsafe { std::slice::from_raw_parts_mut(ptr.get().add(start), end - start) });
    });
}

/// `gelu_tanh` on every value, in place, on this thread.
#[multiversion(targets = "simd")]
pub(crate) fn gelu_slice(part: &mut [f32]) {
    for v in part.iter_mut() {
        *v = gelu_tanh(*v);
    }
}

#[multiversion(targets = "simd")]
fn gelu_erf_slice(part: &mut [f32]) {
    for v in part.iter_mut() {
        *v = gelu_erf(*v);
    }
}

/// The tanh-approximated GELU of a tensor (`gelu_pytorch_tanh`). A CPU f32 tensor that is the
/// only view of its storage (a layer's fresh output) is updated in place by the vectorized
/// kernel; anything else takes candle's `gelu`.
pub fn gelu_tanh_tensor(x: Tensor) -> candle_core::Result<Tensor> {
    if own_kernel(Op::Gelu, DeviceKind::of(x.device()), x.dtype()) && x.is_contiguous() {
        x.inplace_op1(&GeluInPlace { erf: false })?;
        Ok(x)
    } else {
        x.gelu()
    }
}

/// The exact (erf) GELU of a tensor, in place on a fresh CPU f32 tensor like `gelu_tanh_tensor`;
/// candle's `gelu_erf` elsewhere.
pub fn gelu_erf_tensor(x: Tensor) -> candle_core::Result<Tensor> {
    if own_kernel(Op::Gelu, DeviceKind::of(x.device()), x.dtype()) && x.is_contiguous() {
        x.inplace_op1(&GeluInPlace { erf: true })?;
        Ok(x)
    } else {
        x.gelu_erf()
    }
}

struct GeluInPlace {
    erf: bool,
}

impl candle_core::InplaceOp1 for GeluInPlace {
    fn name(&self) -> &'static str {
        "gelu-inplace"
    }

    fn cpu_fwd(&self, storage: &mut candle_core::CpuStorage, layout: &candle_core::Layout) -> candle_core::Result<()> {
        let candle_core::CpuStorage::F32(values) = storage else {
            candle_core::bail!("gelu-inplace: f32 only");
        };
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("gelu-inplace: contiguous tensors only");
        };
        if self.erf {
            gelu_erf_inplace(&mut values[start..end]);
        } else {
            gelu_tanh_inplace(&mut values[start..end]);
        }
        Ok(())
    }
}

/// `t` ([rows, cols], any float dtype) transposed into a new contiguous [cols, rows] tensor of
/// the same dtype: 64 x 64 tiles on candle's worker pool (candle's strided copy walks the source
/// element by element). CPU tensors only; others take candle's `t().contiguous()`.
pub fn transpose(t: &Tensor) -> candle_core::Result<Tensor> {
    if t.rank() == 2 && !t.is_contiguous() && t.t()?.is_contiguous() {
        // Already a transposed view of a contiguous [cols, rows] buffer (a loader that wrote
        // it so): that buffer is the result, shared, nothing copied.
        return t.t();
    }
    if !own_kernel(Op::Transpose, DeviceKind::of(t.device()), t.dtype()) || t.rank() != 2 {
        return t.t()?.contiguous();
    }
    let t = t.contiguous()?;
    let (rows, cols) = t.dims2()?;
    let (storage, layout) = t.storage_and_layout();
    let candle_core::Storage::Cpu(cpu) = &*storage else {
        return t.t()?.contiguous();
    };
    let o = layout.start_offset();
    macro_rules! go {
        ($ty:ty) => {{
            let src = &cpu.as_slice::<$ty>()?[o..o + rows * cols];
            Tensor::from_vec(transpose_slice(src, rows, cols), (cols, rows), t.device())
        }};
    }
    match t.dtype() {
        DType::F32 => go!(f32),
        DType::BF16 => go!(half::bf16),
        DType::F16 => go!(half::f16),
        _ => t.t()?.contiguous(),
    }
}

/// `src` ([rows, cols] row-major) transposed into a new [cols, rows] row-major buffer, 64 x 64
/// tiles on candle's pool, each new page written (and faulted in) once, by the thread that fills
/// it. Panics if `src` is shorter than `rows * cols`.
pub fn transpose_slice<T: Copy + Send + Sync>(src: &[T], rows: usize, cols: usize) -> Vec<T> {
    let src = &src[..rows * cols];
    const TILE: usize = 64;
    // Not zeroed first: every element is written once below, so the new pages are touched (and
    // faulted in) only by the threads that fill them, in parallel.
    let mut dst: Vec<T> = Vec::with_capacity(rows * cols);
    let ptr = SendPtr(dst.as_mut_ptr());
    candle_core::utils::barrier_pool().execute_chunked(cols.div_ceil(TILE), |range| {
        for tc in range {
            let (c0, c1) = (tc * TILE, ((tc + 1) * TILE).min(cols));
            for r0 in (0..rows).step_by(TILE) {
                let r1 = (r0 + TILE).min(rows);
                for c in c0..c1 {
                    for r in r0..r1 {
                        // SAFETY: destination rows c0..c1 belong to this work item, inside the
                        // reserved capacity (written, never read, before `set_len`).
                        unsafe { ptr.get().add(c * rows + r).write(src[r * cols + c]) };
                    }
                }
            }
        }
    });
    // SAFETY: the work items cover columns 0..cols, each writing its rows 0..rows: every element.
    unsafe { dst.set_len(rows * cols) };
    dst
}

/// `out[r] = sum_t weights[r * taps + t] * table[idx[r * taps + t]]`: each output row a weighted
/// sum of `taps` rows of `table` ([rows, cols]), added in tap order (an interpolated lookup
/// table, e.g. bilinear position embeddings). On a CPU f32 table the rows are written straight
/// into the result on candle's pool; elsewhere it is `index_select`, a broadcast multiply and
/// a sum, which materialize `taps` times the result.
pub fn weighted_row_sum(table: &Tensor, idx: &[u32], weights: &[f32], taps: usize) -> candle_core::Result<Tensor> {
    let (rows, cols) = table.dims2()?;
    if taps == 0 || idx.len() != weights.len() || !idx.len().is_multiple_of(taps) {
        candle_core::bail!("weighted_row_sum: {} indices and {} weights for {taps} taps", idx.len(), weights.len());
    }
    if let Some(&bad) = idx.iter().find(|&&i| i as usize >= rows) {
        candle_core::bail!("weighted_row_sum: index {bad} outside the table's {rows} rows");
    }
    let n = idx.len() / taps;
    if own_kernel(Op::RowGather, DeviceKind::of(table.device()), table.dtype()) {
        let table = table.contiguous()?;
        let (storage, layout) = table.storage_and_layout();
        if let Some(all) = cpu_f32(&storage) {
            let src = &all[layout.start_offset()..][..rows * cols];
            let mut out = vec![0f32; n * cols];
            let ptr = SendPtr(out.as_mut_ptr());
            candle_core::utils::barrier_pool().execute_chunked(n, |range| {
                for r in range {
                    // SAFETY: output row r belongs to this work item.
                    let y = unsafe { std::slice::from_raw_parts_mut(ptr.get().add(r * cols), cols) };
                    for t in 0..taps {
                        let (i, w) = (idx[r * taps + t] as usize, weights[r * taps + t]);
                        add_scaled_row(y, &src[i * cols..(i + 1) * cols], w, t == 0);
                    }
                }
            });
            drop(storage);
            return Tensor::from_vec(out, (n, cols), table.device());
        }
    }
    let dev = table.device();
    let rows = table.index_select(&Tensor::from_slice(idx, idx.len(), dev)?, 0)?.reshape((n, taps, cols))?;
    let w = Tensor::from_slice(weights, (n, taps, 1), dev)?.to_dtype(table.dtype())?;
    rows.broadcast_mul(&w)?.sum(1)
}

/// `y = w * x` (first tap) or `y += w * x`, the product rounded before the sum (no fused
/// multiply-add, as the unfused reference computes it).
#[multiversion(targets = "simd")]
fn add_scaled_row(y: &mut [f32], x: &[f32], w: f32, first: bool) {
    if first {
        for (a, b) in y.iter_mut().zip(x) {
            *a = b * w;
        }
    } else {
        for (a, b) in y.iter_mut().zip(x) {
            *a += b * w;
        }
    }
}

/// A buffer's base pointer shared with pool workers that write disjoint parts of it.
pub(crate) struct SendPtr<T>(pub(crate) *mut T);
impl<T> Clone for SendPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SendPtr<T> {}
unsafe impl<T> Send for SendPtr<T> {}
unsafe impl<T> Sync for SendPtr<T> {}
impl<T> SendPtr<T> {
    pub(crate) fn get(self) -> *mut T {
        self.0
    }
}

/// The f32 values of a CPU storage (None for other devices and dtypes).
pub(crate) fn cpu_f32(s: &candle_core::Storage) -> Option<&[f32]> {
    match s {
        candle_core::Storage::Cpu(c) => c.as_slice::<f32>().ok(),
        _ => None,
    }
}

/// The shape of one fused segment-attention call.
#[derive(Debug, Clone, Copy)]
pub struct SegmentAttentionShape {
    pub seq: usize,
    pub heads: usize,
    pub head_dim: usize,
    /// Query rows per tile (the tile's scores are `query_tile x key_tile` floats).
    pub query_tile: usize,
    /// Key rows per tile.
    pub key_tile: usize,
}

/// Default tile sizes: a 256 x 512 f32 score tile is 512 KiB per thread, the query, key and value
/// tiles 64 + 128 + 128 KiB. Larger tiles amortize `gemm`'s packing of each tile: on a 2-core
/// Xeon (AVX-512), 4096 keys x 16 heads ran at ~140 GFLOP/s with 128 x 256 tiles and ~170-200
/// with 256 x 512 (the machine's noise is +-10%). The AVX2 strips keep 256 x 512 too (Zen 3,
/// 4096 keys: 468 ms against 471-515 for 128-512 x 256-1024).
pub const QUERY_TILE: usize = 256;
pub const KEY_TILE: usize = 512;

/// The kernel that runs an attention tile's two products.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TileKernel {
    /// `gemm` per tile (what candle's matmul calls; it packs both operands of each product).
    Gemm,
    /// Strips of 16 query rows in AVX2 registers over operands laid out once per call, nothing
    /// packed per tile (x86_64 with AVX2 and FMA).
    Avx2Strips,
    /// The same strips 48 query rows wide in three AVX-512 registers (x86_64 with AVX-512F).
    Avx512Strips,
    /// Reduced precision (`--vision-precision bf16`): both products on AMX tiles with bf16
    /// operands and f32 sums, the softmax in f32 (`bf16::attention`; head dimension 64 only,
    /// `Gemm` otherwise). Never chosen by `best`.
    AmxBf16,
}

impl TileKernel {
    /// The faster kernel this CPU can run: the AVX2 strips where AVX2 and FMA are the widest
    /// vectors (a 2B block's attention on a Zen 3, 2 threads: 4096 rows 476 ms against gemm's
    /// 507, 784 rows 17.4 against 19.0; docs/performance.md), `gemm` elsewhere: with AVX-512
    /// the 48-row strips ran even with it at 4096 rows and 2-6% behind at 784 (a 2-core Xeon,
    /// 2026-12-01), so they are there to be chosen (`segment_attention_with`), not the default;
    /// NEON and the baseline have no strips.
    pub fn best() -> Self {
        #[cfg(target_arch = "x86_64")]
        if TileKernel::Avx2Strips.available() && !TileKernel::Avx512Strips.available() {
            return TileKernel::Avx2Strips;
        }
        TileKernel::Gemm
    }

    /// Query rows per strip (the strips' tiles are whole strips where the tile allows; `gemm`
    /// tiles whole 16-row vectors).
    fn strip(self) -> usize {
        match self {
            TileKernel::Avx512Strips => 48,
            _ => 16,
        }
    }

    fn is_strips(self) -> bool {
        matches!(self, TileKernel::Avx2Strips | TileKernel::Avx512Strips)
    }

    /// Whether this CPU can run the kernel.
    pub fn available(self) -> bool {
        match self {
            TileKernel::Gemm => true,
            TileKernel::AmxBf16 => crate::bf16::attention::available(crate::bf16::ATTENTION_HEAD_DIM),
            #[cfg(target_arch = "x86_64")]
            TileKernel::Avx2Strips => {
                std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
            }
            #[cfg(target_arch = "x86_64")]
            TileKernel::Avx512Strips => crate::has_avx512(),
            #[cfg(not(target_arch = "x86_64"))]
            TileKernel::Avx2Strips | TileKernel::Avx512Strips => false,
        }
    }
}

/// Bidirectional attention within segments, from the fused projection's output.
///
/// `qkv`: [seq, 3, heads, head_dim] row-major (q | k | v); `cos`, `sin`: [seq, head_dim / 2]
/// (rotate-half rotary on q and k); `cu`: segment boundaries `[0, ..., seq]`. Writes
/// softmax(q k^T / sqrt(d)) v into `out`: [seq, heads * head_dim], heads side by side (what the
/// output projection reads). The caller checks the lengths. Runs `TileKernel::best()`.
pub fn segment_attention(
    qkv: &[f32],
    cos: &[f32],
    sin: &[f32],
    cu: &[usize],
    shape: SegmentAttentionShape,
    out: &mut [f32],
) {
    segment_attention_with(TileKernel::best(), qkv, cos, sin, cu, shape, out)
}

/// `segment_attention` on the given tile kernel (`Gemm` where the CPU cannot run it).
pub fn segment_attention_with(
    kernel: TileKernel,
    qkv: &[f32],
    cos: &[f32],
    sin: &[f32],
    cu: &[usize],
    shape: SegmentAttentionShape,
    out: &mut [f32],
) {
    let SegmentAttentionShape { seq, heads, head_dim: d, .. } = shape;
    let usable = kernel.available() && (kernel != TileKernel::AmxBf16 || crate::bf16::attention::available(d));
    let kernel = if usable { kernel } else { TileKernel::Gemm };
    let hidden = heads * d;
    assert!(qkv.len() >= seq * 3 * hidden && out.len() >= seq * hidden && d % 2 == 0);
    assert!(cos.len() >= seq * d / 2 && sin.len() >= seq * d / 2);
    assert!(
        cu.first() == Some(&0) && cu.last() == Some(&seq) && cu.windows(2).all(|w| w[0] <= w[1]),
        "segment boundaries {cu:?} for {seq} rows"
    );
    // Rotary q (scaled by log2(e) / sqrt(d): scores in base 2 for the softmax's `exp2`) and k,
    // rotated once (each key tile is read by every query tile of its segment). k head-major
    // [heads, seq, d]; q transposed per head, [heads, d, ldq]: a query tile is then
    // column-major, which `gemm` packs by plain copies instead of a transposing gather and the
    // strips load as vectors, and the padding keeps its columns off one cache set (the strips
    // read up to 47 columns past a tile's last row: the padding covers the last tile).
    let scale = std::f32::consts::LOG2_E / (d as f32).sqrt();
    let ldq = seq.next_multiple_of(16) + 48;
    let mut q = vec![0f32; heads * d * ldq];
    let mut k = vec![0f32; heads * seq * d];
    // The strips read v head-major too ([heads, seq, d]: a key tile's rows contiguous); `gemm`
    // packs them from the projection's output in place.
    let mut v = vec![0f32; if kernel.is_strips() { heads * seq * d } else { 0 }];
    rotate(qkv, cos, sin, shape, scale, ldq, &mut q, &mut k, (!v.is_empty()).then_some(&mut v[..]));

    // Work items: (tile, head), longest segments first so the pool's tail stays short.
    let mut tiles: Vec<(usize, usize, usize, usize)> = Vec::new();
    for w in cu.windows(2) {
        let (s0, s1) = (w[0], w[1]);
        // Near-equal tiles of at most `query_tile` rows, in whole 16-row vectors or strips
        // (784 rows in 16-row vectors: 3 x 208 + 160, not 3 x 256 + 16, nor 4 x 196 whose 4
        // spare rows per tile would take the softmax's scalar path and gemm's repacking; in
        // 48-row strips: 2 x 288 + 208, 17 strips, the fewest 784 rows take).
        let rows = tile_rows(s1 - s0, shape.query_tile, kernel.strip());
        let mut q0 = s0;
        while q0 < s1 {
            let r = rows.min(s1 - q0);
            tiles.push((s0, s1, q0, r));
            q0 += r;
        }
    }
    tiles.sort_by_key(|&(s0, s1, _, _)| std::cmp::Reverse(s1 - s0));
    let out_ptr = SendPtr(out.as_mut_ptr());
    // The tile attention's keys and values, bf16 pairs, once for every head.
    let (kb, vb) = if kernel == TileKernel::AmxBf16 {
        use crate::bf16::attention::{pack_keys, pack_values};
        (pack_keys(&k, heads, seq), pack_values(&qkv[2 * hidden..], 3 * hidden, heads, seq))
    } else {
        (Vec::new(), Vec::new())
    };
    let (q, k, vh) = (&q[..], &k[..], &v[..]);
    for_each_item(
        tiles.len() * heads,
        || Scratch::new(shape, kernel),
        |item, scratch| {
            let (s0, s1, q0, rows) = tiles[item / heads];
            let h = item % heads;
            let tile = Tile { q, ldq, k, v: qkv, vh, h, s0, s1, q0, rows };
            // SAFETY: each (tile, head) item writes its own rows x d block of `out`.
            match kernel {
                TileKernel::Gemm => unsafe { attend_tile(&tile, shape, scratch, out_ptr) },
                #[cfg(target_arch = "x86_64")]
                TileKernel::AmxBf16 => {
                    let t = crate::bf16::attention::Tile {
                        q,
                        ldq,
                        keys: &kb,
                        values: &vb,
                        seq,
                        h,
                        s0,
                        s1,
                        q0,
                        rows,
                        key_tile: shape.key_tile,
                    };
                    let amx = scratch.amx.as_mut().expect("made for AmxBf16");
                    // SAFETY: `available` checked AMX and d; this item owns rows q0..q0+rows,
                    // columns h*d..h*d+d of `out`; the scratch is made for the shape's tiles.
                    unsafe { crate::bf16::attention::attend(&t, amx, out_ptr.get().add(q0 * hidden + h * d), hidden) }
                }
                #[cfg(not(target_arch = "x86_64"))]
                TileKernel::AmxBf16 => unreachable!("not available off x86_64"),
                // SAFETY: as above, and `available()` checked AVX2 and FMA.
                #[cfg(target_arch = "x86_64")]
                TileKernel::Avx2Strips => unsafe { strips::attend_tile(&tile, shape, scratch, out_ptr) },
                // SAFETY: as above, and `available()` checked AVX-512F.
                #[cfg(all(target_arch = "x86_64", not(vl_avx2_proxy)))]
                TileKernel::Avx512Strips => unsafe { strips512::attend_tile(&tile, shape, scratch, out_ptr) },
                #[cfg(all(target_arch = "x86_64", vl_avx2_proxy))]
                TileKernel::Avx512Strips => unreachable!("not available in the AVX2 stand-in build"),
                #[cfg(not(target_arch = "x86_64"))]
                TileKernel::Avx2Strips | TileKernel::Avx512Strips => unreachable!("not available off x86_64"),
            }
        },
    );
}

/// Runs `f(item, state)` for every item in `0..n` on candle's worker pool, each thread taking
/// one item at a time from a shared cursor, with `state` made once per thread by `init`. For
/// items of a millisecond or more (an attention tile): the pool's own chunking hands out
/// `n / (8 x threads)` items per grab, and its last grab left up to ~3% of a 4096-row
/// attention call to one thread.
fn for_each_item<S>(n: usize, init: impl Fn() -> S + Sync, f: impl Fn(usize, &mut S) + Sync) {
    let cursor = std::sync::atomic::AtomicUsize::new(0);
    let pool = candle_core::utils::barrier_pool();
    // One range per thread (inline, whole, when called from inside the pool); each drains the
    // shared cursor.
    pool.execute_chunked(pool.n_workers() + 1, |_| {
        let mut state = None;
        loop {
            let item = cursor.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if item >= n {
                break;
            }
            f(item, state.get_or_insert_with(&init));
        }
    });
}

/// Query rows per tile for a segment of `len` rows: whole strips of `strip` rows, at most `max`
/// rows (or one strip) per tile, the fewest tiles, near-equal; a segment no longer than a strip
/// or a tile smaller than one is taken as it is.
fn tile_rows(len: usize, max: usize, strip: usize) -> usize {
    let max = max.max(1);
    if len <= strip || max < strip {
        return balanced(len, max);
    }
    let strips = len.div_ceil(strip);
    let per_tile = max / strip;
    strips.div_ceil(strips.div_ceil(per_tile)) * strip
}

/// The tile size that splits `len` rows into the fewest tiles of at most `max` rows, evenly.
fn balanced(len: usize, max: usize) -> usize {
    let max = max.max(1);
    len.div_ceil(len.div_ceil(max).max(1)).max(1)
}

#[allow(clippy::too_many_arguments)]
fn rotate(
    qkv: &[f32],
    cos: &[f32],
    sin: &[f32],
    shape: SegmentAttentionShape,
    scale: f32,
    ldq: usize,
    q: &mut [f32],
    k: &mut [f32],
    v: Option<&mut [f32]>,
) {
    let (qp, kp) = (SendPtr(q.as_mut_ptr()), SendPtr(k.as_mut_ptr()));
    let vp = v.map(|v| SendPtr(v.as_mut_ptr()));
    candle_core::utils::barrier_pool().execute_chunked(shape.seq, |range| {
        // SAFETY: positions s in `range` of all three buffers belong to this item.
        unsafe { rotate_rows(qkv, cos, sin, shape, scale, ldq, range, qp, kp, vp) };
    });
}

/// `y = (x * cos + rotate_half(x) * sin) * factor` for every head of the rows `range`: q (factor
/// `scale`) into column s of head h's [d, ldq] block, k (factor 1) into row (h, s) of the
/// head-major buffer. One dispatched call per work item, the per-row loops inlined into it.
/// q goes through a block of 16 rotated rows per head, written out column by column, so each
/// column gets one 64-byte store instead of 16 scattered 4-byte ones (one store per element at stride `ldq` had
/// made this pass 2.3 ms of a 784-row block's 14 ms attention).
#[multiversion(targets = "simd")]
#[allow(clippy::too_many_arguments)]
unsafe fn rotate_rows(
    qkv: &[f32],
    cos: &[f32],
    sin: &[f32],
    shape: SegmentAttentionShape,
    scale: f32,
    ldq: usize,
    range: std::ops::Range<usize>,
    qp: SendPtr<f32>,
    kp: SendPtr<f32>,
    vp: Option<SendPtr<f32>>,
) {
    const ROWS: usize = 16;
    let SegmentAttentionShape { seq, heads, head_dim: d, .. } = shape;
    let (hidden, half) = (heads * d, d / 2);
    // Rotates one head's row `x` into `y` (zipped slices: the loop vectorizes).
    let rotate = |x: &[f32], c: &[f32], sn: &[f32], factor: f32, y: &mut [f32]| {
        let (x1, x2) = x.split_at(half);
        let (y1, y2) = y.split_at_mut(half);
        for ((((y1, y2), (x1, x2)), c), sn) in y1.iter_mut().zip(y2).zip(x1.iter().zip(x2)).zip(c).zip(sn) {
            *y1 = (x1 * c - x2 * sn) * factor;
            *y2 = (x2 * c + x1 * sn) * factor;
        }
    };
    // q's rotated rows of one head, row r at r * d; then written column by column.
    let mut block = vec![0f32; ROWS * d];
    let mut column = [0f32; ROWS];
    let mut s0 = range.start;
    while s0 < range.end {
        let rows = ROWS.min(range.end - s0);
        for h in 0..heads {
            for r in 0..rows {
                let s = s0 + r;
                let (c, sn) = (&cos[s * half..(s + 1) * half], &sin[s * half..(s + 1) * half]);
                let row = &qkv[s * 3 * hidden..][..3 * hidden];
                rotate(&row[h * d..][..d], c, sn, scale, &mut block[r * d..][..d]);
                // SAFETY (caller): row (h, s) of k (and of v) is this call's to write.
                let k_out = unsafe { std::slice::from_raw_parts_mut(kp.get().add((h * seq + s) * d), d) };
                rotate(&row[hidden + h * d..][..d], c, sn, 1.0, k_out);
                if let Some(vp) = vp {
                    let x = &row[2 * hidden + h * d..][..d];
                    unsafe { std::ptr::copy_nonoverlapping(x.as_ptr(), vp.get().add((h * seq + s) * d), d) };
                }
            }
            for i in 0..d {
                for (r, v) in column[..rows].iter_mut().enumerate() {
                    *v = block[r * d + i];
                }
                // SAFETY (caller): columns s0..s0 + rows of head h's block are this call's to write.
                unsafe {
                    let dst = qp.get().add((h * d + i) * ldq + s0);
                    if rows == ROWS {
                        // One 64-byte store, not a call to memcpy.
                        dst.cast::<[f32; ROWS]>().write_unaligned(column);
                    } else {
                        std::ptr::copy_nonoverlapping(column.as_ptr(), dst, rows);
                    }
                }
            }
        }
        s0 += rows;
    }
}

/// Per-thread buffers: one score tile (column-major), the output accumulator, the running max
/// and sum.
struct Scratch {
    s: Vec<f32>,
    o: Vec<f32>,
    max: Vec<f32>,
    sum: Vec<f32>,
    /// The strips' queries, each strip's `d` x 16 block contiguous (strips only).
    q: Vec<f32>,
    /// The tile attention's own buffers (`TileKernel::AmxBf16` only).
    amx: Option<crate::bf16::attention::Scratch>,
}

impl Scratch {
    fn new(shape: SegmentAttentionShape, kernel: TileKernel) -> Self {
        let (qt, kt) = (shape.query_tile.max(1), shape.key_tile.max(1));
        if kernel == TileKernel::AmxBf16 {
            let amx = Some(crate::bf16::attention::Scratch::new(qt, kt));
            return Self { s: Vec::new(), o: Vec::new(), max: Vec::new(), sum: Vec::new(), q: Vec::new(), amx };
        }
        // The strips keep one strip's scores, and a tile's rows rounded up to whole strips.
        let (sq, qt) =
            if kernel.is_strips() { (kernel.strip(), qt.next_multiple_of(kernel.strip())) } else { (qt, qt) };
        let q = vec![0.0; if kernel.is_strips() { qt * shape.head_dim } else { 0 }];
        Self {
            s: vec![0.0; sq * kt],
            o: vec![0.0; qt * shape.head_dim],
            max: vec![0.0; qt],
            sum: vec![0.0; qt],
            q,
            amx: None,
        }
    }
}

struct Tile<'a> {
    q: &'a [f32],
    ldq: usize,
    k: &'a [f32],
    /// The projection output (v read in place).
    v: &'a [f32],
    /// v head-major (the strips only).
    vh: &'a [f32],
    h: usize,
    s0: usize,
    s1: usize,
    q0: usize,
    rows: usize,
}

/// One head's attention for query rows `q0..q0+rows` over keys `s0..s1` (`attend_gemm` on the
/// vision layout: q transposed and pre-scaled, k head-major, v in the projection output), then
/// normalized into `out`.
unsafe fn attend_tile(t: &Tile<'_>, shape: SegmentAttentionShape, sc: &mut Scratch, out: SendPtr<f32>) {
    let SegmentAttentionShape { seq, heads, head_dim: d, .. } = shape;
    let hidden = heads * d;
    let op = Operands {
        q: t.q.as_ptr().add(t.h * d * t.ldq + t.q0),
        q_rs: 1,
        q_cs: t.ldq,
        k: t.k.as_ptr().add((t.h * seq + t.s0) * d),
        k_rs: d,
        v: t.v.as_ptr().add(t.s0 * 3 * hidden + 2 * hidden + t.h * d),
        v_rs: 3 * hidden,
        scale: 1.0,
    };
    attend_gemm(&op, t.rows, d, t.s1 - t.s0, shape.key_tile, None, sc);
    // SAFETY (caller): this item owns rows q0..q0+rows, columns h*d..h*d+d of `out`.
    sc.write_normalized(t.rows, d, out.get().add(t.q0 * hidden + t.h * d), hidden);
}

impl Scratch {
    /// Writes the `m` rows of the output accumulator, each divided by its softmax sum, to `dst`
    /// (`d` floats per row, rows `row_stride` apart).
    ///
    /// # Safety
    /// Those rows of `dst` are the caller's to write.
    unsafe fn write_normalized(&self, m: usize, d: usize, dst: *mut f32, row_stride: usize) {
        for i in 0..m {
            let inv = 1.0 / self.sum[i];
            let row = std::slice::from_raw_parts_mut(dst.add(i * row_stride), d);
            for (y, x) in row.iter_mut().zip(&self.o[i * d..(i + 1) * d]) {
                *y = x * inv;
            }
        }
    }
}

/// Where one head's operands for a tile of `m` query rows lie: q as an `[m, d]` matrix with row
/// and column strides, key `j` (of the tile's key range) at `k + j k_rs` and value `j` at
/// `v + j v_rs` (each `d` contiguous floats). `scale` multiplies the scores (base 2: log2(e) /
/// sqrt(d) unless q carries it already).
struct Operands {
    q: *const f32,
    q_rs: usize,
    q_cs: usize,
    k: *const f32,
    k_rs: usize,
    v: *const f32,
    v_rs: usize,
    scale: f32,
}

/// `m` query rows against `keys` keys, key tile by key tile through `gemm` with the running max
/// and sum (online softmax): leaves the unnormalized output in `sc.o` ([m][d]) and the sums in
/// `sc.sum`. `causal`: query row i sees keys up to `causal + i` only (the later ones are neither
/// read past the tile's last visible key nor weighted: masked to `-inf` in the diagonal tiles).
unsafe fn attend_gemm(
    op: &Operands,
    m: usize,
    d: usize,
    keys: usize,
    key_tile: usize,
    causal: Option<usize>,
    sc: &mut Scratch,
) {
    sc.o[..m * d].fill(0.0);
    sc.max[..m].fill(f32::NEG_INFINITY);
    sc.sum[..m].fill(0.0);
    let keys = causal.map_or(keys, |p0| keys.min(p0 + m));
    let key_rows = balanced(keys, key_tile);
    let mut kt = 0;
    while kt < keys {
        let n = key_rows.min(keys - kt);
        // S = Q K^T: [m, d] x [d, n] into a column-major tile (key j's scores at s[j * m..]).
        gemm::gemm(
            m,
            n,
            d,
            sc.s.as_mut_ptr(),
            m as isize,
            1,
            false,
            op.q,
            op.q_cs as isize,
            op.q_rs as isize,
            op.k.add(kt * op.k_rs),
            op.k_rs as isize,
            1,
            0.0,
            op.scale,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
        if let Some(p0) = causal {
            // Key kt + j is hidden from query rows i < kt + j - p0 (none before the diagonal).
            for j in (p0 + 1).saturating_sub(kt)..n {
                let hidden_rows = (kt + j - p0).min(m);
                sc.s[j * m..j * m + hidden_rows].fill(f32::NEG_INFINITY);
            }
        }
        online_softmax(&mut sc.s[..m * n], m, &mut sc.max[..m], &mut sc.sum[..m], &mut sc.o[..m * d], d);
        // O += P V: [m, n] x [n, d], value rows read in place.
        gemm::gemm(
            m,
            d,
            n,
            sc.o.as_mut_ptr(),
            1,
            d as isize,
            true,
            sc.s.as_ptr(),
            m as isize,
            1,
            op.v.add(kt * op.v_rs),
            1,
            op.v_rs as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
        kt += n;
    }
}

/// Causal (grouped-query) attention on CPU f32 slices, fused like `segment_attention`: query
/// tiles x heads on candle's pool, key tiles through `gemm` with the online softmax, no score
/// matrix beyond one tile per thread, keys after a tile's last query never read.
///
/// `q`: [heads, new, d] contiguous; key and value rows: `kv_heads` heads, head `g`'s position `j`
/// at `g * head_stride + j * d` in `k` / `v` (a cache's views: `head_stride` is its capacity
/// times `d`),
/// `total` positions of which the last `new` are the queries' own; query head h reads kv head
/// `h / (heads / kv_heads)`. Writes softmax(q k^T / sqrt(d)) v, [heads, new, d], into `out`.
/// The caller checks the shapes.
#[allow(clippy::too_many_arguments)]
pub fn causal_attention(
    q: &[f32],
    (heads, new, d): (usize, usize, usize),
    k: &[f32],
    v: &[f32],
    (kv_heads, head_stride, total): (usize, usize, usize),
    out: &mut [f32],
) {
    assert!(kv_heads > 0 && heads % kv_heads == 0 && new <= total && (kv_heads == 1 || head_stride >= total * d));
    assert!(q.len() >= heads * new * d && out.len() >= heads * new * d);
    let span = (kv_heads - 1) * head_stride + total * d;
    assert!(k.len() >= span && v.len() >= span);
    let rep = heads / kv_heads;
    let offset = total - new;
    let shape = SegmentAttentionShape { seq: new, heads, head_dim: d, query_tile: QUERY_TILE, key_tile: KEY_TILE };
    let rows = tile_rows(new, QUERY_TILE, 16);
    // (query tile start, rows), the longest (most keys) first so the pool's tail stays short.
    let mut tiles: Vec<(usize, usize)> = (0..new).step_by(rows).map(|q0| (q0, rows.min(new - q0))).collect();
    tiles.reverse();
    let scale = std::f32::consts::LOG2_E / (d as f32).sqrt();
    let out_ptr = SendPtr(out.as_mut_ptr());
    for_each_item(
        tiles.len() * heads,
        || Scratch::new(shape, TileKernel::Gemm),
        |item, sc| {
            let (q0, m) = tiles[item / heads];
            let h = item % heads;
            let g = h / rep;
            let op = Operands {
                q: q[(h * new + q0) * d..].as_ptr(),
                q_rs: d,
                q_cs: 1,
                k: k[g * head_stride..].as_ptr(),
                k_rs: d,
                v: v[g * head_stride..].as_ptr(),
                v_rs: d,
                scale,
            };
            // SAFETY: the operands lie inside `q`, `k` and `v` (asserted above; keys past
            // `offset + q0 + m` are not read), and each (tile, head) item writes its own rows.
            unsafe {
                attend_gemm(&op, m, d, total, KEY_TILE, Some(offset + q0), sc);
                sc.write_normalized(m, d, out_ptr.get().add((h * new + q0) * d), d);
            }
        },
    );
}

/// For each query row of the column-major score tile `s` ([n][m], scores in base 2): raise the
/// running max, turn the scores into `2^(s - max)` in place, rescale the row's sum and output
/// accumulator by `2^(old - new)`. Rows go in blocks across the vector lanes (64 at a time: four AVX-512 or
/// eight AVX2 registers of independent maxima and sums), so no reduction crosses lanes.
#[multiversion(targets = "simd")]
fn online_softmax(s: &mut [f32], m: usize, max: &mut [f32], sum: &mut [f32], o: &mut [f32], d: usize) {
    let mut i0 = 0;
    while i0 + 64 <= m {
        softmax_rows::<64>(s, m, i0, max, sum, o, d);
        i0 += 64;
    }
    while i0 + 8 <= m {
        softmax_rows::<8>(s, m, i0, max, sum, o, d);
        i0 += 8;
    }
    while i0 < m {
        softmax_rows::<1>(s, m, i0, max, sum, o, d);
        i0 += 1;
    }
}

/// `online_softmax` for query rows `i0..i0 + W`.
#[inline(always)]
fn softmax_rows<const W: usize>(
    s: &mut [f32],
    m: usize,
    i0: usize,
    max: &mut [f32],
    sum: &mut [f32],
    o: &mut [f32],
    d: usize,
) {
    let n = s.len() / m;
    let mut mx = [0f32; W];
    mx.copy_from_slice(&max[i0..i0 + W]);
    for j in 0..n {
        let c: &[f32; W] = s[j * m + i0..][..W].try_into().unwrap();
        for l in 0..W {
            mx[l] = if c[l] > mx[l] { c[l] } else { mx[l] };
        }
    }
    let mut acc = [0f32; W];
    for j in 0..n {
        let c: &mut [f32; W] = (&mut s[j * m + i0..][..W]).try_into().unwrap();
        for l in 0..W {
            c[l] = exp2_nonpositive(c[l] - mx[l]);
            acc[l] += c[l];
        }
    }
    for l in 0..W {
        let i = i0 + l;
        if max[i] == f32::NEG_INFINITY {
            sum[i] = acc[l];
        } else {
            let r = exp2_nonpositive(max[i] - mx[l]);
            sum[i] = sum[i] * r + acc[l];
            for y in &mut o[i * d..(i + 1) * d] {
                *y *= r;
            }
        }
        max[i] = mx[l];
    }
}

/// The strip tile kernels: the query rows of a tile in strips of `$w` vector registers (16 rows
/// in 2 on AVX2, 48 in 3 on AVX-512), every operand read where the layout pass put it (q transposed per
/// head, k and v head-major), so nothing is packed per tile. Per key tile and strip: the scores
/// `S^T = K Q^T` (`$nk` keys x one strip of accumulators), the online softmax on them, then
/// `O^T += V^T P^T` (`$nc` dimensions x one strip) into the strip's transposed output, kept until
/// the end of the tile. One template, compiled per instruction set from `$simd`'s operations
/// (`avx2` or `avx512`, which share their names) under `$feature`.
#[cfg(target_arch = "x86_64")]
macro_rules! strip_kernel {
    ($name:ident, $simd:ident, $feature:literal, $w:literal, $nk:literal, $nc:literal) => {
        mod $name {
            use super::{balanced, Scratch, SegmentAttentionShape, SendPtr, Tile};
            use crate::$simd as s;

            /// Query rows per strip: `$w` vector registers.
            pub(super) const STRIP: usize = $w * s::LANES;
            /// One strip's lanes: a row of `$w` vectors.
            type Row = [s::V; $w];

            /// `attend_tile` on strips: for each key tile, each strip of query rows gets its
            /// scores, its online-softmax step and its `P V` in turn. The last strip of a tile
            /// reads past the tile's rows (other queries or the padding of `q`); those lanes are
            /// computed and dropped.
            ///
            /// # Safety
            /// The CPU has `$feature`; as `attend_tile` otherwise.
            #[target_feature(enable = $feature)]
            pub(super) unsafe fn attend_tile(
                t: &Tile<'_>,
                shape: SegmentAttentionShape,
                sc: &mut Scratch,
                out: SendPtr<f32>,
            ) {
                let SegmentAttentionShape { seq, heads, head_dim: d, .. } = shape;
                let hidden = heads * d;
                let n_strips = t.rows.div_ceil(STRIP);
                debug_assert!(t.q0 + n_strips * STRIP <= t.ldq);
                sc.o[..n_strips * STRIP * d].fill(0.0);
                sc.max[..n_strips * STRIP].fill(f32::NEG_INFINITY);
                sc.sum[..n_strips * STRIP].fill(0.0);
                // Each strip's queries gathered into one contiguous d x STRIP block (4 or 8 KiB
                // at d = 64, where the transposed layout puts each of its d rows on a page of
                // its own).
                for st in 0..n_strips {
                    for c in 0..d {
                        let src = &t.q[(t.h * d + c) * t.ldq + t.q0 + st * STRIP..][..STRIP];
                        sc.q[(st * d + c) * STRIP..][..STRIP].copy_from_slice(src);
                    }
                }
                let key_rows = balanced(t.s1 - t.s0, shape.key_tile);
                let mut kt = t.s0;
                while kt < t.s1 {
                    let n = key_rows.min(t.s1 - kt);
                    let k = t.k.as_ptr().add((t.h * seq + kt) * d);
                    let v = t.vh.as_ptr().add((t.h * seq + kt) * d);
                    for st in 0..n_strips {
                        let q = sc.q.as_ptr().add(st * d * STRIP);
                        let o = sc.o.as_mut_ptr().add(st * STRIP * d);
                        let mut mx: Row = [s::splat(f32::NEG_INFINITY); $w];
                        scores(q, k, d, n, sc.s.as_mut_ptr(), &mut mx);
                        softmax(
                            sc.s.as_mut_ptr(),
                            n,
                            mx,
                            sc.max.as_mut_ptr().add(st * STRIP),
                            sc.sum.as_mut_ptr().add(st * STRIP),
                            o,
                            d,
                        );
                        values(sc.s.as_ptr(), n, v, d, o);
                    }
                    kt += n;
                }
                for i in 0..t.rows {
                    let (st, l) = (i / STRIP, i % STRIP);
                    let inv = 1.0 / sc.sum[i];
                    let o = &sc.o[st * STRIP * d..];
                    // SAFETY (caller): this item owns rows q0..q0+rows, columns h*d..h*d+d of `out`.
                    let dst =
                        unsafe { std::slice::from_raw_parts_mut(out.get().add((t.q0 + i) * hidden + t.h * d), d) };
                    for (c, y) in dst.iter_mut().enumerate() {
                        *y = o[c * STRIP + l] * inv;
                    }
                }
            }

            /// Scores of one strip against keys `k` (`n` rows of `d`, contiguous):
            /// `s[j * STRIP + l]` = q(l) . k(j), q read from its strip block (`q[c * STRIP + l]`);
            /// `mx` takes the lanes' running maxima.
            #[target_feature(enable = $feature)]
            unsafe fn scores(q: *const f32, k: *const f32, d: usize, n: usize, sc: *mut f32, mx: &mut Row) {
                let mut j = 0;
                while j + $nk <= n {
                    scores_block::<$nk>(q, k.add(j * d), d, sc.add(j * STRIP), mx);
                    j += $nk;
                }
                while j + 4 <= n {
                    scores_block::<4>(q, k.add(j * d), d, sc.add(j * STRIP), mx);
                    j += 4;
                }
                while j + 2 <= n {
                    scores_block::<2>(q, k.add(j * d), d, sc.add(j * STRIP), mx);
                    j += 2;
                }
                if j < n {
                    scores_block::<1>(q, k.add(j * d), d, sc.add(j * STRIP), mx);
                }
            }

            #[inline]
            #[target_feature(enable = $feature)]
            unsafe fn scores_block<const NK: usize>(
                q: *const f32,
                k: *const f32,
                d: usize,
                sc: *mut f32,
                mx: &mut Row,
            ) {
                // Over the d dimensions: the strip's queries of dimension c against NK keys' c-th.
                let mut acc: [Row; NK] = [[s::splat(0.0); $w]; NK];
                s::accumulate(&mut acc, d, q, STRIP, k, 1, d);
                s::store(&acc, sc, STRIP);
                for row in acc {
                    for (m, v) in mx.iter_mut().zip(row) {
                        *m = s::max(*m, v);
                    }
                }
            }

            /// The online softmax step of one strip: scores `sc` (`n` keys x STRIP, base 2)
            /// become `2^(s - max)` with `max` the new running max (`mx`: this tile's, `max`:
            /// the strip's so far); the strip's sums and transposed output (`o`: `d` x STRIP)
            /// are rescaled by `2^(old - new)` and the tile's probabilities added to the sums.
            #[target_feature(enable = $feature)]
            unsafe fn softmax(sc: *mut f32, n: usize, mx: Row, max: *mut f32, sum: *mut f32, o: *mut f32, d: usize) {
                // One pass over the tile's scores, every vector of a row in turn.
                let old: Row = std::array::from_fn(|w| s::ld(max.add(s::LANES * w)));
                let new: Row = std::array::from_fn(|w| s::max(old[w], mx[w]));
                let mut acc = [[s::splat(0.0); $w]; 2];
                for j in 0..n {
                    for w in 0..$w {
                        let p = sc.add(j * STRIP + s::LANES * w);
                        let e = s::exp2(s::sub(s::ld(p), new[w]));
                        s::st(p, e);
                        acc[j % 2][w] = s::add(acc[j % 2][w], e);
                    }
                }
                // The first tile: old is -inf and its factor 2^-126 multiplies zeros.
                let r: Row = std::array::from_fn(|w| s::exp2(s::sub(old[w], new[w])));
                for w in 0..$w {
                    let lane = s::LANES * w;
                    s::st(sum.add(lane), s::fmadd(s::ld(sum.add(lane)), r[w], s::add(acc[0][w], acc[1][w])));
                    s::st(max.add(lane), new[w]);
                }
                for c in 0..d {
                    for w in 0..$w {
                        let y = o.add(c * STRIP + s::LANES * w);
                        s::st(y, s::mul(s::ld(y), r[w]));
                    }
                }
            }

            /// `o[c * STRIP + l] += sum_j p[j * STRIP + l] v[j * d + c]` for the strip's `d` x
            /// STRIP transposed output, over `n` value rows of `d`; `d` even.
            #[target_feature(enable = $feature)]
            unsafe fn values(p: *const f32, n: usize, v: *const f32, d: usize, o: *mut f32) {
                let mut c = 0;
                while c + $nc <= d {
                    values_block::<$nc>(p, n, v.add(c), d, o.add(c * STRIP));
                    c += $nc;
                }
                // d even: what is left in blocks of 4 (8 accumulators cover the FMA latency,
                // two blocks of 2 would not), then 2.
                while c + 4 <= d {
                    values_block::<4>(p, n, v.add(c), d, o.add(c * STRIP));
                    c += 4;
                }
                if c < d {
                    values_block::<2>(p, n, v.add(c), d, o.add(c * STRIP));
                }
            }

            #[inline]
            #[target_feature(enable = $feature)]
            unsafe fn values_block<const NC: usize>(
                p: *const f32,
                n: usize,
                v: *const f32,
                vstride: usize,
                o: *mut f32,
            ) {
                // Over the n keys: the strip's probabilities of key j against its NC values.
                let mut acc: [Row; NC] = s::load(o, STRIP);
                s::accumulate(&mut acc, n, p, STRIP, v, vstride, 1);
                s::store(&acc, o, STRIP);
            }
        }
    };
}

// AVX2: 6 keys or 6 dimensions x 16 queries in 2 vectors (12 of the 16 registers); AVX-512: 8
// keys or 8 dimensions x 48 queries in 3 vectors (24 of the 32 registers; d = 64 in whole
// blocks), gemm's own micro-kernel shape there.
#[cfg(target_arch = "x86_64")]
strip_kernel!(strips, avx2, "avx2,fma", 2, 6, 6);
#[cfg(all(target_arch = "x86_64", not(vl_avx2_proxy)))]
strip_kernel!(strips512, avx512, "avx512f", 3, 8, 8);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_matches_std_to_a_few_ulp() {
        let mut worst = 0f32;
        let mut x = -87.0f32;
        while x < 88.0 {
            let (a, b) = (exp(x), x.exp());
            worst = worst.max(((a - b) / b).abs());
            x += 0.001_37;
        }
        assert!(worst < 3e-7, "worst relative error {worst}");
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(f32::NEG_INFINITY) < 1e-37 && exp(f32::INFINITY).is_finite());
    }

    #[test]
    fn exp2_matches_std_to_a_few_ulp() {
        let mut worst = 0f32;
        let mut x = -126.0f32;
        while x <= 0.0 {
            let (a, b) = (exp2_nonpositive(x), x.exp2());
            worst = worst.max(((a - b) / b).abs());
            x += 0.000_71;
        }
        assert!(worst < 3e-7, "worst relative error {worst}");
        assert_eq!(exp2_nonpositive(0.0), 1.0);
        assert_eq!(exp2_nonpositive(-1.0), 0.5);
        assert!(exp2_nonpositive(-1000.0) <= 1.2e-38 && exp2_nonpositive(f32::NEG_INFINITY) >= 0.0);
        assert!(exp2_nonpositive(f32::NAN).is_nan());
    }

    #[test]
    fn gelu_matches_the_tanh_formula() {
        let mut v: Vec<f32> = (0..100_000).map(|i| (i as f32 - 50_000.0) * 2e-4).collect();
        let want: Vec<f32> = v
            .iter()
            .map(|&x| {
                let x = x as f64;
                (0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh())) as f32
            })
            .collect();
        gelu_tanh_inplace(&mut v);
        for (a, b) in v.iter().zip(&want) {
            assert!((a - b).abs() <= 2e-7 * b.abs().max(1.0), "{a} vs {b}");
        }
    }

    /// Plain f64 attention, straight from the definition, for one head of one segment.
    fn naive(qkv: &[f32], cos: &[f32], sin: &[f32], cu: &[usize], heads: usize, d: usize) -> Vec<f64> {
        let (hidden, half) = (heads * d, d / 2);
        let seq = *cu.last().unwrap();
        let rot = |s: usize, col: usize| -> Vec<f64> {
            let x = &qkv[s * 3 * hidden + col..][..d];
            (0..d)
                .map(|i| {
                    let (c, sn) = (cos[s * half + i % half] as f64, sin[s * half + i % half] as f64);
                    let rh = if i < half { -(x[i + half] as f64) } else { x[i - half] as f64 };
                    x[i] as f64 * c + rh * sn
                })
                .collect()
        };
        let mut out = vec![0f64; seq * hidden];
        for w in cu.windows(2) {
            for h in 0..heads {
                for i in w[0]..w[1] {
                    let q = rot(i, h * d);
                    let scores: Vec<f64> = (w[0]..w[1])
                        .map(|j| {
                            q.iter().zip(rot(j, hidden + h * d)).map(|(a, b)| a * b).sum::<f64>() / (d as f64).sqrt()
                        })
                        .collect();
                    let mx = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = scores.iter().map(|s| (s - mx).exp()).collect();
                    let z: f64 = e.iter().sum();
                    for (j, p) in (w[0]..w[1]).zip(&e) {
                        for c in 0..d {
                            out[i * hidden + h * d + c] += p / z * qkv[j * 3 * hidden + 2 * hidden + h * d + c] as f64;
                        }
                    }
                }
            }
        }
        out
    }

    #[test]
    fn segment_attention_matches_the_definition_across_tiles_and_segments() {
        // d = 22: every strip kernel's remainder blocks of dimensions (AVX2 6+6+6+4, AVX-512
        // 8+8+4+2).
        for d in [16, 22] {
            attention_case(3, d);
        }
    }

    /// Seeded projection rows [seq, 3 x heads x d] (`seed`) and rotary cos / sin [seq, d / 2]
    /// (`seed + 1`).
    fn attention_inputs(seed: u64, seq: usize, heads: usize, d: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let flat = |t: Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let qkv = flat(crate::testing::randn(seed, 1.5, (seq, 3 * heads * d)).unwrap());
        let ang = flat(crate::testing::randn(seed + 1, 3.0, (seq, d / 2)).unwrap());
        let (cos, sin) = ang.iter().map(|a| (a.cos(), a.sin())).unzip();
        (qkv, cos, sin)
    }

    fn attention_case(heads: usize, d: usize) {
        // Segments shorter than, equal to and longer than the tiles, with ragged last tiles.
        let cu = [0usize, 1, 6, 70, 203, 203, 260];
        let seq = *cu.last().unwrap();
        let (qkv, cos, sin) = attention_inputs(7, seq, heads, d);
        let want = naive(&qkv, &cos, &sin, &cu, heads, d);
        // Every kernel this CPU runs (CI also runs these tests under qemu as an AVX2-only and a
        // baseline x86_64 CPU), with tiles that leave ragged strips and odd key counts.
        let kernels: Vec<TileKernel> = [TileKernel::Gemm, TileKernel::Avx2Strips, TileKernel::Avx512Strips]
            .into_iter()
            .filter(|k| k.available())
            .collect();
        for kernel in kernels {
            for (query_tile, key_tile) in [(QUERY_TILE, KEY_TILE), (7, 13), (1, 1), (64, 5), (48, 37)] {
                let shape = SegmentAttentionShape { seq, heads, head_dim: d, query_tile, key_tile };
                let mut out = vec![f32::NAN; seq * heads * d];
                segment_attention_with(kernel, &qkv, &cos, &sin, &cu, shape, &mut out);
                let what = format!("{kernel:?}, d {d}, tiles {query_tile}x{key_tile}");
                assert!(out.iter().all(|v| v.is_finite()), "{what}: a row was not written");
                let worst = out.iter().zip(&want).map(|(a, b)| (*a as f64 - b).abs()).fold(0.0, f64::max);
                assert!(worst < 2e-5, "{what}: worst {worst:e}");
            }
        }
    }

    #[test]
    fn amx_bf16_attention_stays_within_its_bound_of_the_definition() {
        // The reduced-precision tile kernel: d = 64 only (other head sizes take `Gemm`, exactly
        // as the f32 path). Segments that start and end off the 32-key steps, empty ones, ragged
        // query tiles; its error against the f64 definition relative to the output's largest
        // value, bound 2e-2 (bf16 operands, f32 sums). Without AMX the kernel reports itself
        // unavailable and the call runs `Gemm` (same bits as asking for it).
        let (heads, d) = (2, 64);
        let cu = [0usize, 1, 6, 70, 203, 203, 300];
        let seq = *cu.last().unwrap();
        let (qkv, cos, sin) = attention_inputs(17, seq, heads, d);
        let want = naive(&qkv, &cos, &sin, &cu, heads, d);
        let scale = want.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        for (query_tile, key_tile) in [(QUERY_TILE, KEY_TILE), (48, 64), (16, 32), (100, 40)] {
            let shape = SegmentAttentionShape { seq, heads, head_dim: d, query_tile, key_tile };
            let mut out = vec![f32::NAN; seq * heads * d];
            segment_attention_with(TileKernel::AmxBf16, &qkv, &cos, &sin, &cu, shape, &mut out);
            assert!(out.iter().all(|v| v.is_finite()), "tiles {query_tile}x{key_tile}: a row was not written");
            let worst = out.iter().zip(&want).map(|(a, b)| (*a as f64 - b).abs()).fold(0.0, f64::max) / scale;
            if TileKernel::AmxBf16.available() {
                println!("AMX bf16 attention, tiles {query_tile}x{key_tile}: worst {worst:.2e} of the largest");
                assert!(worst > 0.0 && worst < 2e-2, "tiles {query_tile}x{key_tile}: worst {worst:e}");
            } else {
                let mut gemm = vec![f32::NAN; seq * heads * d];
                segment_attention_with(TileKernel::Gemm, &qkv, &cos, &sin, &cu, shape, &mut gemm);
                assert_eq!(out, gemm);
            }
        }
    }

    #[test]
    fn query_tiles_are_whole_strips_and_the_fewest() {
        // 784 rows in 16-row vectors: 3 x 208 + 160; in 48-row strips: 17 strips in 4 tiles
        // of at most 5 (240 rows); 4096 rows: 16 x 256, and 86 strips in 18 tiles of 5.
        assert_eq!(tile_rows(784, 256, 16), 208);
        assert_eq!(tile_rows(784, 256, 48), 240);
        assert_eq!(tile_rows(4096, 256, 16), 256);
        assert_eq!(tile_rows(4096, 256, 48), 240);
        // At most one strip or the whole segment when either is smaller than a strip.
        assert_eq!(tile_rows(40, 256, 48), 40);
        assert_eq!(tile_rows(784, 7, 16), 7);
        for (len, max, strip) in [(1, 1, 16), (133, 64, 48), (2000, 300, 48), (999, 512, 16)] {
            let rows = tile_rows(len, max, strip);
            assert!(rows >= 1 && (rows <= max || (max < strip && rows <= len)), "{len} {max} {strip}: {rows}");
            if len > strip && max >= strip {
                assert_eq!(rows % strip, 0, "{len} {max} {strip}: {rows}");
                // No fewer tiles would do.
                assert_eq!(len.div_ceil(rows), len.div_ceil(strip).div_ceil(max / strip), "{len} {max} {strip}");
            }
        }
    }

    #[test]
    fn gelu_erf_matches_the_definition() {
        // erf by its Maclaurin series in f64 (converges for |x| < 4 with enough terms), erfc's
        // tail by the asymptotic series beyond.
        fn erf(x: f64) -> f64 {
            if x.abs() > 3.5 {
                let z = x.abs();
                let tail = (-z * z).exp() / (z * std::f64::consts::PI.sqrt())
                    * (1.0 - 1.0 / (2.0 * z * z) + 3.0 / (4.0 * z.powi(4)) - 15.0 / (8.0 * z.powi(6)));
                return x.signum() * (1.0 - tail);
            }
            let (mut sum, mut term) = (0f64, x);
            for n in 0..120 {
                sum += term / (2 * n + 1) as f64;
                term *= -x * x / (n + 1) as f64;
            }
            2.0 / std::f64::consts::PI.sqrt() * sum
        }
        let mut v: Vec<f32> = (0..40_000).map(|i| (i as f32 - 20_000.0) * 5e-4).collect();
        let want: Vec<f64> =
            v.iter().map(|&x| 0.5 * x as f64 * (1.0 + erf(x as f64 / std::f64::consts::SQRT_2))).collect();
        gelu_erf_inplace(&mut v);
        for ((a, b), i) in v.iter().zip(&want).zip(0..) {
            assert!(
                (*a as f64 - b).abs() <= 4e-7 * b.abs().max(1.0),
                "x = {}: {a} vs {b}",
                (i as f32 - 20_000.0) * 5e-4
            );
        }
    }

    #[test]
    fn weighted_row_sum_matches_the_gather_and_sum() {
        let table = crate::testing::randn(12, 1.0, (9, 37)).unwrap();
        let idx = [0u32, 8, 3, 3, 5, 1, 2, 7];
        let weights = [0.25f32, 0.75, 1.0, -0.5, 0.125, 0.375, 0.3, 0.2];
        let got = weighted_row_sum(&table, &idx, &weights, 2).unwrap();
        let t = table.to_vec2::<f32>().unwrap();
        let got = got.to_vec2::<f32>().unwrap();
        assert_eq!(got.len(), 4);
        for (r, row) in got.iter().enumerate() {
            for (c, v) in row.iter().enumerate() {
                let (i, j) = (idx[2 * r] as usize, idx[2 * r + 1] as usize);
                let want = t[i][c] * weights[2 * r] + t[j][c] * weights[2 * r + 1];
                assert_eq!(*v, want, "row {r} col {c}");
            }
        }
        // The generic path (another dtype) agrees, and bad input is an error, not a panic.
        let f64_sum = weighted_row_sum(&table.to_dtype(DType::F64).unwrap(), &idx, &weights, 2).unwrap();
        let diff = (f64_sum.to_dtype(DType::F32).unwrap() - Tensor::new(got, &candle_core::Device::Cpu).unwrap())
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(diff < 1e-6, "{diff}");
        assert!(weighted_row_sum(&table, &[9, 0], &[1.0, 1.0], 2).unwrap_err().to_string().contains("index 9"));
        assert!(weighted_row_sum(&table, &[0, 1, 2], &[1.0; 3], 2).is_err());
    }

    #[test]
    fn transpose_is_exact() {
        let t = crate::testing::randn(11, 1.0, (67, 130)).unwrap();
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let x = t.to_dtype(dtype).unwrap();
            let want = x.t().unwrap().contiguous().unwrap().to_dtype(DType::F32).unwrap();
            let got = transpose(&x).unwrap();
            assert_eq!(got.dtype(), dtype);
            let diff = (got.to_dtype(DType::F32).unwrap() - &want).unwrap().abs().unwrap().max_all().unwrap();
            assert_eq!(diff.to_scalar::<f32>().unwrap(), 0.0, "{dtype:?}");
        }
        {
            // A transposed view of a contiguous buffer (as the GGUF loader writes a linear's
            // weight): the buffer itself, contiguous, the same values; its own rows transposed
            // by `transpose_slice` give that buffer.
            let rows: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
            let buffer = Tensor::from_vec(transpose_slice(&rows, 67, 130), (130, 67), t.device()).unwrap();
            let view = buffer.t().unwrap();
            assert!(!view.is_contiguous());
            assert_eq!(view.to_vec2::<f32>().unwrap(), t.to_vec2::<f32>().unwrap());
            let got = transpose(&view).unwrap();
            assert!(got.is_contiguous());
            assert_eq!(got.to_vec2::<f32>().unwrap(), buffer.to_vec2::<f32>().unwrap());
        }
    }
}
