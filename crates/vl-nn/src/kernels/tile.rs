//! What the attention kernels share: the call's shape and tile sizes, the tile kernel choice
//! (`TileKernel`), the per-thread scratch, the work loop over (tile, head) items, and one head's
//! query tile against a key range through `gemm` with the online softmax (`attend_gemm`, used by
//! the segment attention's `Gemm` kernel and by the causal attention).

use crate::kernels::softmax::online_softmax;

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
    /// operands and f32 sums, the softmax in f32 (`amx::attention`; head dimension 64 only,
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
    pub(super) fn strip(self) -> usize {
        match self {
            TileKernel::Avx512Strips => 48,
            _ => 16,
        }
    }

    pub(super) fn is_strips(self) -> bool {
        matches!(self, TileKernel::Avx2Strips | TileKernel::Avx512Strips)
    }

    /// Whether this CPU can run the kernel.
    pub fn available(self) -> bool {
        match self {
            TileKernel::Gemm => true,
            TileKernel::AmxBf16 => crate::amx::attention::available(crate::amx::ATTENTION_HEAD_DIM),
            #[cfg(target_arch = "x86_64")]
            TileKernel::Avx2Strips => {
                std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
            }
            #[cfg(target_arch = "x86_64")]
            TileKernel::Avx512Strips => crate::cpu::has_avx512(),
            #[cfg(not(target_arch = "x86_64"))]
            TileKernel::Avx2Strips | TileKernel::Avx512Strips => false,
        }
    }
}

/// Runs `f(item, state)` for every item in `0..n` on candle's worker pool, each thread taking
/// one item at a time from a shared cursor, with `state` made once per thread by `init`. For
/// items of a millisecond or more (an attention tile): the pool's own chunking hands out
/// `n / (8 x threads)` items per grab, and its last grab left up to ~3% of a 4096-row
/// attention call to one thread.
pub(super) fn for_each_item<S>(n: usize, init: impl Fn() -> S + Sync, f: impl Fn(usize, &mut S) + Sync) {
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
pub(super) fn tile_rows(len: usize, max: usize, strip: usize) -> usize {
    let max = max.max(1);
    if len <= strip || max < strip {
        return balanced(len, max);
    }
    let strips = len.div_ceil(strip);
    let per_tile = max / strip;
    strips.div_ceil(strips.div_ceil(per_tile)) * strip
}

/// The tile size that splits `len` rows into the fewest tiles of at most `max` rows, evenly.
pub(super) fn balanced(len: usize, max: usize) -> usize {
    let max = max.max(1);
    len.div_ceil(len.div_ceil(max).max(1)).max(1)
}

/// Per-thread buffers: one score tile (column-major), the output accumulator, the running max
/// and sum.
pub(super) struct Scratch {
    pub(super) s: Vec<f32>,
    pub(super) o: Vec<f32>,
    pub(super) max: Vec<f32>,
    pub(super) sum: Vec<f32>,
    /// The strips' queries, each strip's `d` x 16 block contiguous (strips only).
    pub(super) q: Vec<f32>,
    /// The tile attention's own buffers (`TileKernel::AmxBf16` only).
    pub(super) amx: Option<crate::amx::attention::Scratch>,
    /// A key tile's keys and values widened from half-precision rows (`Operands::half`),
    /// allocated on first use.
    pub(super) kw: Vec<f32>,
    pub(super) vw: Vec<f32>,
}

impl Scratch {
    pub(super) fn new(shape: SegmentAttentionShape, kernel: TileKernel) -> Self {
        let (qt, kt) = (shape.query_tile.max(1), shape.key_tile.max(1));
        if kernel == TileKernel::AmxBf16 {
            let amx = Some(crate::amx::attention::Scratch::new(qt, kt));
            let (s, o, max, sum, q, kw, vw) = Default::default();
            return Self { s, o, max, sum, q, amx, kw, vw };
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
            kw: Vec::new(),
            vw: Vec::new(),
        }
    }

    /// Keys and values `from..from + n` of `rows` (`d` each, contiguous: a cache's rows of one
    /// head) widened to f32 into `kw` / `vw`; exact.
    ///
    /// # Safety
    /// `rows`' pointers are readable for those rows.
    unsafe fn widen(&mut self, rows: HalfRows, from: usize, n: usize, d: usize) {
        use half::slice::HalfFloatSliceExt;
        self.kw.resize(self.kw.len().max(n * d), 0.0);
        self.vw.resize(self.vw.len().max(n * d), 0.0);
        let (kd, vd) = (&mut self.kw[..n * d], &mut self.vw[..n * d]);
        // SAFETY: the caller's contract covers the rows read.
        unsafe {
            match rows {
                HalfRows::F16(k, v) => {
                    std::slice::from_raw_parts(k.add(from * d), n * d).convert_to_f32_slice(kd);
                    std::slice::from_raw_parts(v.add(from * d), n * d).convert_to_f32_slice(vd);
                }
                HalfRows::Bf16(k, v) => {
                    std::slice::from_raw_parts(k.add(from * d), n * d).convert_to_f32_slice(kd);
                    std::slice::from_raw_parts(v.add(from * d), n * d).convert_to_f32_slice(vd);
                }
            }
        }
    }
}

/// Keys and values kept as f16 or bf16 rows (a half-precision KV cache): `attend_gemm` widens
/// each key tile's rows into the scratch before its products.
#[derive(Clone, Copy)]
pub(super) enum HalfRows {
    F16(*const half::f16, *const half::f16),
    Bf16(*const half::bf16, *const half::bf16),
}

pub(super) struct Tile<'a> {
    pub(super) q: &'a [f32],
    pub(super) ldq: usize,
    pub(super) k: &'a [f32],
    /// The projection output (v read in place).
    pub(super) v: &'a [f32],
    /// v head-major (the strips only).
    pub(super) vh: &'a [f32],
    pub(super) h: usize,
    pub(super) s0: usize,
    pub(super) s1: usize,
    pub(super) q0: usize,
    pub(super) rows: usize,
}

impl Scratch {
    /// Writes the `m` rows of the output accumulator, each divided by its softmax sum, to `dst`
    /// (`d` floats per row, rows `row_stride` apart).
    ///
    /// # Safety
    /// Those rows of `dst` are the caller's to write.
    pub(super) unsafe fn write_normalized(&self, m: usize, d: usize, dst: *mut f32, row_stride: usize) {
        // SAFETY: the operations below need no more than this function's `# Safety` contract.
        unsafe {
            for i in 0..m {
                let inv = 1.0 / self.sum[i];
                let row = std::slice::from_raw_parts_mut(dst.add(i * row_stride), d);
                for (y, x) in row.iter_mut().zip(&self.o[i * d..(i + 1) * d]) {
                    *y = x * inv;
                }
            }
        }
    }
}

/// Where one head's operands for a tile of `m` query rows lie: q as an `[m, d]` matrix with row
/// and column strides, key `j` (of the tile's key range) at `k + j k_rs` and value `j` at
/// `v + j v_rs` (each `d` contiguous floats). `scale` multiplies the scores (base 2: log2(e) /
/// sqrt(d) unless q carries it already).
pub(super) struct Operands {
    pub(super) q: *const f32,
    pub(super) q_rs: usize,
    pub(super) q_cs: usize,
    pub(super) k: *const f32,
    pub(super) k_rs: usize,
    pub(super) v: *const f32,
    pub(super) v_rs: usize,
    pub(super) scale: f32,
    /// Half-precision keys and values instead of `k` / `v` (rows of `d` contiguous elements,
    /// `k_rs` = `v_rs` = d), widened tile by tile.
    pub(super) half: Option<HalfRows>,
}

/// `m` query rows against `keys` keys, key tile by key tile through `gemm` with the running max
/// and sum (online softmax): leaves the unnormalized output in `sc.o` ([m][d]) and the sums in
/// `sc.sum`. `causal`: query row i sees keys up to `causal + i` only (the later ones are neither
/// read past the tile's last visible key nor weighted: masked to `-inf` in the diagonal tiles).
///
/// # Safety
/// `op`'s pointers hold the operands it describes for `m` query rows of `d` and `keys` keys (with
/// `causal`, keys past `causal + m` are never read); `sc` was made for at least `m` query rows,
/// `key_tile` keys and head dimension `d` (`Scratch::new` with `TileKernel::Gemm`).
pub(super) unsafe fn attend_gemm(
    op: &Operands,
    m: usize,
    d: usize,
    keys: usize,
    key_tile: usize,
    causal: Option<usize>,
    sc: &mut Scratch,
) {
    // SAFETY: the operations below need no more than this function's `# Safety` contract.
    unsafe {
        sc.o[..m * d].fill(0.0);
        sc.max[..m].fill(f32::NEG_INFINITY);
        sc.sum[..m].fill(0.0);
        let keys = causal.map_or(keys, |p0| keys.min(p0 + m));
        let key_rows = balanced(keys, key_tile);
        let mut kt = 0;
        while kt < keys {
            let n = key_rows.min(keys - kt);
            let (kp, k_rs, vp, v_rs) = match op.half {
                None => (op.k.add(kt * op.k_rs), op.k_rs, op.v.add(kt * op.v_rs), op.v_rs),
                Some(rows) => {
                    sc.widen(rows, kt, n, d);
                    (sc.kw.as_ptr(), d, sc.vw.as_ptr(), d)
                }
            };
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
                kp,
                k_rs as isize,
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
                vp,
                1,
                v_rs as isize,
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
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
