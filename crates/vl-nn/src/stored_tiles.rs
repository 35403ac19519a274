//! Q4_K and Q6_K products of many rows (a prompt's prefill) on the weight's stored blocks, with
//! AVX-512 VNNI: no repacked copy of the weight is ever made or kept.
//!
//! candle multiplies such products on tiles it repacks each weight into on first use (16 output
//! rows interleaved per 4 values, nibbles split, scales widened to f32: 6 bits a value for Q4_K,
//! 10 for Q6_K, against the stored 4.5 and 6.6) and keeps them beside the stored blocks. For the
//! 2B decoder that is ~1.3 GB of new pages and most of a GGUF file's load. Here the same tile is
//! built per call, one 256-value super-block of 16 output rows at a time, into a few KiB that
//! stay in L1 while every input row meets it: the unpacking costs a few hundred instructions
//! per tile, the products (`vpdpbusd`, 64 of them per input row) tens of thousands.
//!
//! Each input row is quantized to Q8_K as candle and ggml do (`crate::q8k`); a lane of
//! the products is one output row, so the sums need no horizontal reduction. Per 32-value (Q4_K)
//! or 16-value (Q6_K) sub-block, the integer dot is widened and scaled by the weight's sub-block
//! scale; the Q4_K mins and the Q6_K offset of 32 come off through the Q8_K block sums.
//! Block layouts: see `stored`.

use candle_core::quantized::k_quants::{BlockQ8K, GgmlType};

use crate::cpu::SendPtr;
use crate::stored::Blocks;

const QK: usize = 256;
const Q8K_BYTES: usize = 292;
/// Output rows per tile: one per lane of a 512-bit vector of i32 / f32.
const LANES: usize = 16;
/// The most bytes of quantized input rows one work item meets (see `matmul`).
const CHUNK_BYTES: usize = 384 * 1024;

/// Whether this CPU runs the kernel (AVX-512 F, BW, VNNI; FMA and F16C), and this build may use
/// it (not the AVX2 stand-in build, `crate::cpu::has_avx512`).
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *HAS.get_or_init(|| {
            crate::cpu::has_avx512()
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vnni")
                && is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
/// The input rows quantized once, for every weight they meet: Q8_K blocks and each block's 16
/// sums of 16 values as f32, row-major by (row, block).
struct Input {
    q8: Vec<BlockQ8K>,
    sums: Vec<f32>,
}

impl Input {
    fn new(x: &[f32], m: usize, k: usize) -> Self {
        let kb = k / QK;
        let mut q8 = vec![BlockQ8K::zeros(); m * kb];
        let mut sums = vec![0f32; m * kb * 16];
        let (q8_at, sums_at) = (SendPtr(q8.as_mut_ptr()), SendPtr(sums.as_mut_ptr()));
        // Rows quantized on every core: at 210 rows of 2048 one thread took ~10% of a product.
        candle_core::utils::barrier_pool().execute_chunked(m, |rows| {
            for r in rows {
                // SAFETY: row r's blocks and sums are written by this item alone, inside q8 and
                // sums (m * kb blocks, 16 sums each).
                let (blocks, out) = unsafe {
                    (
                        std::slice::from_raw_parts_mut(q8_at.get().add(r * kb), kb),
                        std::slice::from_raw_parts_mut(sums_at.get().add(r * kb * 16), kb * 16),
                    )
                };
                crate::q8k::quantize(&x[r * k..(r + 1) * k], blocks);
                for (b, o) in out.chunks_exact_mut(16).enumerate() {
                    // SAFETY: block b of the row's kb blocks (see `block`).
                    let s: [i16; 16] =
                        unsafe { std::ptr::read_unaligned(block(blocks, b).add(4 + QK) as *const [i16; 16]) };
                    for (o, v) in o.iter_mut().zip(s) {
                        *o = v as f32;
                    }
                }
            }
        });
        Input { q8, sums }
    }
}

/// The bytes of Q8_K block i (f32 d, 256 i8 values, 16 i16 sums: `stored`'s layout; candle's
/// `#[repr(C)]` struct of exactly `Q8K_BYTES`, whose fields are private).
///
/// # Safety
/// i < q8.len().
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
unsafe fn block(q8: &[BlockQ8K], i: usize) -> *const u8 {
    // SAFETY: the operations below need no more than this function's `# Safety` contract.
    unsafe {
        const _: () = assert!(std::mem::size_of::<BlockQ8K>() == Q8K_BYTES);
        (q8.as_ptr() as *const u8).add(i * Q8K_BYTES)
    }
}

/// `x` ([m, k] row-major) times the stored `[n, k]` weight transposed (`kind` blocks, `w` its
/// bytes): the product `[m, n]` row-major, or None where the kernel does not apply (CPU features,
/// k not whole super-blocks, byte counts, no rows).
pub fn matmul(kind: Blocks, w: &[u8], n: usize, x: &[f32], m: usize, k: usize) -> Option<Vec<f32>> {
    matmul_each(&[(kind, w, n)], x, m, k).and_then(|ys| ys.into_iter().next())
}

/// `matmul` of several weights with the same `x`, in one parallel region, `x` quantized once
/// (e.g. q/k/v, gate/up): `weights[i]` is `(kind, bytes, n)`. Returns each product `[m, n]`.
pub(crate) fn matmul_each(weights: &[(Blocks, &[u8], usize)], x: &[f32], m: usize, k: usize) -> Option<Vec<Vec<f32>>> {
    if !available() || m == 0 || k == 0 || !k.is_multiple_of(QK) || x.len() != m * k {
        return None;
    }
    let kb = k / QK;
    let bytes = |kind: Blocks| match kind {
        Blocks::Q4K => 144,
        Blocks::Q6K => 210,
    };
    if weights.iter().any(|&(kind, w, n)| n == 0 || w.len() != n * kb * bytes(kind)) {
        return None;
    }
    let input = Input::new(x, m, k);
    let mut outs: Vec<Vec<f32>> = weights.iter().map(|&(_, _, n)| vec![0f32; m * n]).collect();
    let ptrs: Vec<SendPtr<f32>> = outs.iter_mut().map(|o| SendPtr(o.as_mut_ptr())).collect();
    // Work items: a tile of 16 output rows of one weight times a chunk of input rows, the chunk's
    // quantized rows small enough to stay in L2 while every tile meets them (at 210 rows of 6144
    // they were 1.5 MB, and a product 1.3x slower than at 2048); consecutive items share a chunk.
    // `starts[i]`: weight i's first tile.
    let mut starts = Vec::with_capacity(weights.len() + 1);
    let mut tiles = 0;
    for (_, _, n) in weights {
        starts.push(tiles);
        tiles += n.div_ceil(LANES);
    }
    starts.push(tiles);
    let chunk = (CHUNK_BYTES / (kb * Q8K_BYTES)).clamp(4, m.next_multiple_of(4));
    let chunks = m.div_ceil(chunk);
    candle_core::utils::barrier_pool().execute_chunked(tiles * chunks, |items| {
        let mut acc = vec![0f32; chunk * LANES];
        for item in items {
            let (c, tile) = (item / tiles, item % tiles);
            let i = starts.partition_point(|&s| s <= tile) - 1;
            let (kind, w, n) = weights[i];
            let t = tile - starts[i];
            let (first, count) = (c * chunk, chunk.min(m - c * chunk));
            let outputs = LANES.min(n - t * LANES);
            acc[..count * LANES].fill(0.0);
            // SAFETY: `available` checked the CPU features; tile t's rows lie in `w` (length
            // checked above), the input holds m rows of kb blocks, and this item alone writes
            // output columns t * 16.. of rows first..first + count, inside weight i's m x n output.
            unsafe {
                let at = w.as_ptr().add(t * LANES * kb * bytes(kind));
                #[cfg(target_arch = "x86_64")]
                x86::tile(kind, at, outputs, kb, (&input, first, count), &mut acc);
                #[cfg(not(target_arch = "x86_64"))]
                let _ = (at, &input, first); // `available` is false: never reached
                for r in 0..count {
                    let to = ptrs[i].get().add((first + r) * n + t * LANES);
                    std::ptr::copy_nonoverlapping(acc.as_ptr().add(r * LANES), to, outputs);
                }
            }
        }
    });
    Some(outs)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use std::arch::x86_64::*;

    /// One super-block of a 16-row Q4_K tile, unpacked: lane r of `lo[w]` / `hi[w]` holds the low
    /// / high nibbles of the stored quant bytes 4w..4w+4 of row r (values 64c + 4j.. and
    /// 64c + 32 + 4j.., c = w / 8, j = w % 8: sub-blocks 2c and 2c + 1); `scales[s]` / `mins[s]`
    /// are d x scale and dmin x min of sub-block s per row.
    #[repr(C, align(64))]
    struct Q4Tile {
        lo: [__m512i; 32],
        hi: [__m512i; 32],
        scales: [__m512; 8],
        mins: [__m512; 8],
    }

    /// One super-block of a 16-row Q6_K tile: lane r of `q[w]` holds row r's values 4w..4w+4 as
    /// unsigned 6-bit numbers (the stored value plus 32); `scales[s]` is d x scale of the
    /// 16-value sub-block s per row.
    #[repr(C, align(64))]
    struct Q6Tile {
        q: [__m512i; 64],
        scales: [__m512; 16],
        /// Rows decoded in value order, before the gathers that interleave them.
        rows: [[u8; QK]; LANES],
    }

    /// `acc` ([m, 16]) = the products of tile `w` (`rows` output rows of kb blocks each, from
    /// `w`) with the input's rows first..first + m.
    ///
    /// # Safety
    /// The CPU has AVX-512 F/BW/VNNI, AVX2, FMA and F16C; `w` is readable for `rows` (at most 16)
    /// output rows of `kb` blocks of `kind`, each row `kb` blocks after the previous; `input` holds
    /// rows first..first + m of `kb` Q8_K blocks; `acc` holds at least m x 16 floats.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn tile(
        kind: Blocks,
        w: *const u8,
        rows: usize,
        kb: usize,
        (input, first, m): (&Input, usize, usize),
        acc: &mut [f32],
    ) {
        // SAFETY: the operations below need no more than this function's `# Safety` contract.
        unsafe {
            let mask: __mmask16 = if rows >= LANES { 0xffff } else { (1u16 << rows) - 1 };
            match kind {
                Blocks::Q4K => {
                    let mut t: Q4Tile = std::mem::zeroed();
                    for b in 0..kb {
                        unpack_q4k(w.add(b * 144), kb * 144, mask, &mut t);
                        let mut r = 0;
                        while r < m {
                            match m - r {
                                1 => q4k_rows::<1>(&t, input, (first, r), b, kb, acc),
                                2 => q4k_rows::<2>(&t, input, (first, r), b, kb, acc),
                                3 => q4k_rows::<3>(&t, input, (first, r), b, kb, acc),
                                _ => q4k_rows::<4>(&t, input, (first, r), b, kb, acc),
                            }
                            r += 4;
                        }
                    }
                }
                Blocks::Q6K => {
                    let mut t: Q6Tile = std::mem::zeroed();
                    for b in 0..kb {
                        unpack_q6k(w.add(b * 210), kb * 210, rows, mask, &mut t);
                        let mut r = 0;
                        while r < m {
                            match m - r {
                                1 => q6k_rows::<1>(&t, input, (first, r), b, kb, acc),
                                2 => q6k_rows::<2>(&t, input, (first, r), b, kb, acc),
                                3 => q6k_rows::<3>(&t, input, (first, r), b, kb, acc),
                                _ => q6k_rows::<4>(&t, input, (first, r), b, kb, acc),
                            }
                            r += 4;
                        }
                    }
                }
            }
        }
    }

    /// Lane r: the byte offset of row r's block from row 0's (`stride` bytes a row) plus `at`.
    ///
    /// # Safety
    /// The CPU has AVX-512F (only inlined into this module's AVX-512 functions); no memory is
    /// accessed.
    #[inline(always)]
    unsafe fn offsets(stride: usize, at: usize) -> __m512i {
        // SAFETY: the operations below need no more than this function's `# Safety` contract.
        unsafe {
            let lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
            _mm512_add_epi32(_mm512_mullo_epi32(lanes, _mm512_set1_epi32(stride as i32)), _mm512_set1_epi32(at as i32))
        }
    }

    /// Four bytes at `p` in every lane (an input row's 4 values).
    ///
    /// # Safety
    /// The CPU has AVX-512F; `p` is readable for 4 bytes.
    #[inline(always)]
    unsafe fn four(p: *const i8) -> __m512i {
        unsafe { _mm512_set1_epi32(std::ptr::read_unaligned(p as *const i32)) }
    }

    /// Unpacks the Q4_K super-block of 16 rows whose row 0 block is at `blk` (rows `stride`
    /// bytes apart; lanes outside `mask` read nothing and get zeros).
    ///
    /// # Safety
    /// The CPU has AVX-512 F/BW, AVX2, FMA and F16C; for each lane r in `mask`, the 144-byte super-
    /// block at `blk + r * stride` is readable (other lanes read nothing).
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn unpack_q4k(blk: *const u8, stride: usize, mask: __mmask16, t: &mut Q4Tile) {
        // SAFETY: the operations below need no more than this function's `# Safety` contract.
        unsafe {
            let zero = _mm512_setzero_si512();
            let gather =
                |at: usize| _mm512_mask_i32gather_epi32::<1>(zero, mask, offsets(stride, at), blk as *const i32);
            let dd = gather(0);
            let d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dd));
            let dmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(dd)));
            let (a0, a1, a2) = (gather(4), gather(8), gather(12));
            // ggml's 6-bit packing (see `stored::avx2::scales_mins`), four sub-blocks a vector, one a byte.
            let six = _mm512_set1_epi32(0x3f3f_3f3f);
            let four_bits = _mm512_set1_epi32(0x0f0f_0f0f);
            let two = _mm512_set1_epi32(0x0303_0303);
            let sc_lo = _mm512_and_si512(a0, six);
            let mn_lo = _mm512_and_si512(a1, six);
            let sc_hi = _mm512_or_si512(
                _mm512_and_si512(a2, four_bits),
                _mm512_slli_epi32::<4>(_mm512_and_si512(_mm512_srli_epi32::<6>(a0), two)),
            );
            let mn_hi = _mm512_or_si512(
                _mm512_and_si512(_mm512_srli_epi32::<4>(a2), four_bits),
                _mm512_slli_epi32::<4>(_mm512_and_si512(_mm512_srli_epi32::<6>(a1), two)),
            );
            let byte = _mm512_set1_epi32(0xff);
            for s in 0..4 {
                let shift = _mm_cvtsi32_si128(8 * s as i32);
                let pick = |v: __m512i| _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srl_epi32(v, shift), byte));
                t.scales[s] = _mm512_mul_ps(d, pick(sc_lo));
                t.scales[s + 4] = _mm512_mul_ps(d, pick(sc_hi));
                t.mins[s] = _mm512_mul_ps(dmin, pick(mn_lo));
                t.mins[s + 4] = _mm512_mul_ps(dmin, pick(mn_hi));
            }
            let low = _mm512_set1_epi8(0x0f);
            for w in 0..32 {
                let v = gather(16 + 4 * w);
                t.lo[w] = _mm512_and_si512(v, low);
                t.hi[w] = _mm512_and_si512(_mm512_srli_epi32::<4>(v), low);
            }
        }
    }

    /// Unpacks the Q6_K super-block of 16 rows whose row 0 block is at `blk` (rows `stride`
    /// bytes apart, the first `rows` of them real; lanes outside `mask` get zeros).
    ///
    /// # Safety
    /// The CPU has AVX-512 F/BW, AVX2, FMA and F16C; for each row r < `rows` (the lanes of `mask`),
    /// the 210-byte super-block at `blk + r * stride` is readable.
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn unpack_q6k(blk: *const u8, stride: usize, rows: usize, mask: __mmask16, t: &mut Q6Tile) {
        // SAFETY: the operations below need no more than this function's `# Safety` contract.
        unsafe {
            let low = _mm256_set1_epi8(0x0f);
            let pair = _mm256_set1_epi8(0x03);
            for r in 0..LANES {
                let out = t.rows[r].as_mut_ptr();
                if r >= rows {
                    std::ptr::write_bytes(out, 0, QK);
                    continue;
                }
                let b = blk.add(r * stride);
                for h in 0..2 {
                    // See `stored`'s Q6_K layout: values 128h + l, +32, +64, +96 (l < 32).
                    let a = _mm256_loadu_si256(b.add(64 * h) as *const __m256i);
                    let c = _mm256_loadu_si256(b.add(64 * h + 32) as *const __m256i);
                    let p = _mm256_loadu_si256(b.add(128 + 32 * h) as *const __m256i);
                    let hi = |shift: i32| {
                        _mm256_slli_epi16::<4>(_mm256_and_si256(_mm256_srl_epi16(p, _mm_cvtsi32_si128(shift)), pair))
                    };
                    let parts = [
                        _mm256_or_si256(_mm256_and_si256(a, low), hi(0)),
                        _mm256_or_si256(_mm256_and_si256(c, low), hi(2)),
                        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(a), low), hi(4)),
                        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(c), low), hi(6)),
                    ];
                    for (i, v) in parts.into_iter().enumerate() {
                        _mm256_storeu_si256(out.add(128 * h + 32 * i) as *mut __m256i, v);
                    }
                }
            }
            let zero = _mm512_setzero_si512();
            let rows_at = t.rows.as_ptr() as *const i32;
            for w in 0..64 {
                t.q[w] = _mm512_mask_i32gather_epi32::<1>(zero, mask, offsets(QK, 4 * w), rows_at);
            }
            // The 16 i8 scales at 192 and the f16 d at 208, read as the dwords at 192.. and 206.
            let gather =
                |at: usize| _mm512_mask_i32gather_epi32::<1>(zero, mask, offsets(stride, at), blk as *const i32);
            let d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(gather(206))));
            for q in 0..4 {
                let v = gather(192 + 4 * q);
                for i in 0..4 {
                    // Byte i of each lane, sign-extended: up to the top byte, then back down.
                    let s = _mm512_srai_epi32::<24>(_mm512_sll_epi32(v, _mm_cvtsi32_si128(24 - 8 * i as i32)));
                    t.scales[4 * q + i] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(s));
                }
            }
        }
    }

    /// Input rows first + r0.. (R of them) times a Q4_K tile's super-block b, added to their rows of `acc`.
    ///
    /// # Safety
    /// The CPU has AVX-512 F/BW/VNNI, AVX2, FMA and F16C; `input` holds rows first + r0..first + r0
    /// + R of `kb` Q8_K blocks (b < kb); `acc` holds rows r0..r0 + R of 16 floats.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    unsafe fn q4k_rows<const R: usize>(
        t: &Q4Tile,
        input: &Input,
        (first, r0): (usize, usize),
        b: usize,
        kb: usize,
        acc: &mut [f32],
    ) {
        // SAFETY: the operations below need no more than this function's `# Safety` contract.
        unsafe {
            let blocks: [*const u8; R] = std::array::from_fn(|r| block(&input.q8, (first + r0 + r) * kb + b));
            let qs: [*const i8; R] = std::array::from_fn(|r| blocks[r].add(4) as *const i8);
            let mut f = [_mm512_setzero_ps(); R];
            for c in 0..4 {
                let mut il = [_mm512_setzero_si512(); R];
                let mut ih = [_mm512_setzero_si512(); R];
                for j in 0..8 {
                    let (lo, hi) = (t.lo[8 * c + j], t.hi[8 * c + j]);
                    for r in 0..R {
                        il[r] = _mm512_dpbusd_epi32(il[r], lo, four(qs[r].add(64 * c + 4 * j)));
                        ih[r] = _mm512_dpbusd_epi32(ih[r], hi, four(qs[r].add(64 * c + 32 + 4 * j)));
                    }
                }
                for r in 0..R {
                    f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(il[r]), t.scales[2 * c], f[r]);
                    f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ih[r]), t.scales[2 * c + 1], f[r]);
                }
            }
            for r in 0..R {
                let sums = input.sums.as_ptr().add(((first + r0 + r) * kb + b) * 16);
                for s in 0..8 {
                    f[r] = _mm512_fnmadd_ps(t.mins[s], _mm512_set1_ps(*sums.add(2 * s) + *sums.add(2 * s + 1)), f[r]);
                }
                let out = acc.as_mut_ptr().add((r0 + r) * LANES);
                let y = _mm512_fmadd_ps(
                    f[r],
                    _mm512_set1_ps(std::ptr::read_unaligned(blocks[r] as *const f32)),
                    _mm512_loadu_ps(out),
                );
                _mm512_storeu_ps(out, y);
            }
        }
    }

    /// Input rows first + r0.. (R of them) times a Q6_K tile's super-block b, added to their rows of `acc`.
    ///
    /// # Safety
    /// The CPU has AVX-512 F/BW/VNNI, AVX2, FMA and F16C; `input` holds rows first + r0..first + r0
    /// + R of `kb` Q8_K blocks (b < kb); `acc` holds rows r0..r0 + R of 16 floats.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    unsafe fn q6k_rows<const R: usize>(
        t: &Q6Tile,
        input: &Input,
        (first, r0): (usize, usize),
        b: usize,
        kb: usize,
        acc: &mut [f32],
    ) {
        // SAFETY: the operations below need no more than this function's `# Safety` contract.
        unsafe {
            let blocks: [*const u8; R] = std::array::from_fn(|r| block(&input.q8, (first + r0 + r) * kb + b));
            let qs: [*const i8; R] = std::array::from_fn(|r| blocks[r].add(4) as *const i8);
            let mut f = [_mm512_setzero_ps(); R];
            for p in 0..8 {
                // Sub-blocks 2p and 2p + 1: words 8p.. and 8p + 4...
                let mut i0 = [_mm512_setzero_si512(); R];
                let mut i1 = [_mm512_setzero_si512(); R];
                for j in 0..4 {
                    let (w0, w1) = (t.q[8 * p + j], t.q[8 * p + 4 + j]);
                    for r in 0..R {
                        i0[r] = _mm512_dpbusd_epi32(i0[r], w0, four(qs[r].add(32 * p + 4 * j)));
                        i1[r] = _mm512_dpbusd_epi32(i1[r], w1, four(qs[r].add(32 * p + 16 + 4 * j)));
                    }
                }
                for r in 0..R {
                    f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0[r]), t.scales[2 * p], f[r]);
                    f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1[r]), t.scales[2 * p + 1], f[r]);
                }
            }
            for r in 0..R {
                // The offset of 32: minus 32 x scale x each 16-value sum.
                let sums = input.sums.as_ptr().add(((first + r0 + r) * kb + b) * 16);
                for s in 0..16 {
                    f[r] = _mm512_fnmadd_ps(t.scales[s], _mm512_set1_ps(32.0 * *sums.add(s)), f[r]);
                }
                let out = acc.as_mut_ptr().add((r0 + r) * LANES);
                let y = _mm512_fmadd_ps(
                    f[r],
                    _mm512_set1_ps(std::ptr::read_unaligned(blocks[r] as *const f32)),
                    _mm512_loadu_ps(out),
                );
                _mm512_storeu_ps(out, y);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
    use candle_core::{Device, Module};

    #[test]
    fn products_match_candles_repacked_tiles() {
        if !available() {
            eprintln!("no AVX-512 VNNI here: the kernel is not used, nothing to compare");
            return;
        }
        for (kind, dtype) in [(Blocks::Q4K, GgmlDType::Q4K), (Blocks::Q6K, GgmlDType::Q6K)] {
            // Whole and partial tiles (n % 16), one to several super-blocks, row counts that
            // leave each remainder of the 4-row groups.
            for (m, n, k) in [(5, 48, 512), (6, 33, 256), (7, 16, 768), (13, 1, 1024), (40, 100, 512), (210, 64, 2048)]
            {
                let w = crate::testing::randn(21 + n as u64, 0.05, (n, k)).unwrap();
                let x = crate::testing::randn(22 + m as u64, 1.0, (m, k)).unwrap();
                let q = QTensor::quantize(&w, dtype).unwrap();
                let bytes = q.data().unwrap();
                let xs = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                let got = matmul(kind, &bytes, n, &xs, m, k).unwrap();
                let both = matmul_each(&[(kind, &bytes, n), (kind, &bytes, n)], &xs, m, k).unwrap();
                assert!(both[0] == got && both[1] == got, "{kind:?} ({m},{n},{k}): two weights in one call");
                // candle's own product on the same blocks (its tiles where n is whole tiles, its
                // vec_dot elsewhere).
                let want = QMatMul::from_qtensor(q).unwrap().forward(&x).unwrap();
                let want = want.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                let scale = want.iter().fold(0f32, |a, v| a.max(v.abs()));
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!((g - w).abs() <= 1e-5 * scale.max(1.0), "{kind:?} ({m},{n},{k}) [{i}]: {g} vs {w}");
                }
                // And close to the f32 product of the dequantized weight.
                let deq = QTensor::quantize(&w, dtype).unwrap().dequantize(&Device::Cpu).unwrap();
                let exact = x.matmul(&deq.t().unwrap()).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
                let err = got.iter().zip(&exact).fold(0f32, |a, (g, e)| a.max((g - e).abs()));
                assert!(err <= 0.02 * scale.max(1.0), "{kind:?} ({m},{n},{k}) off the f32 product by {err}");
            }
        }
        // Q4_K and Q6_K weights of different widths in one call: each as it is alone.
        let (m, k) = (9, 512);
        let x = crate::testing::randn(31, 1.0, (m, k)).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let q4 = QTensor::quantize(&crate::testing::randn(32, 0.05, (40, k)).unwrap(), GgmlDType::Q4K).unwrap();
        let q6 = QTensor::quantize(&crate::testing::randn(33, 0.05, (24, k)).unwrap(), GgmlDType::Q6K).unwrap();
        let (b4, b6) = (q4.data().unwrap(), q6.data().unwrap());
        let both = matmul_each(&[(Blocks::Q4K, &b4, 40), (Blocks::Q6K, &b6, 24)], &x, m, k).unwrap();
        assert_eq!(both[0], matmul(Blocks::Q4K, &b4, 40, &x, m, k).unwrap());
        assert_eq!(both[1], matmul(Blocks::Q6K, &b6, 24, &x, m, k).unwrap());
        let xs = vec![0f32; 5 * 256];
        assert!(matmul(Blocks::Q4K, &[0u8; 144], 2, &xs, 5, 256).is_none(), "bytes are not the weight's");
        assert!(matmul(Blocks::Q6K, &[0u8; 210], 1, &xs[..1000], 5, 200).is_none(), "k is not whole super-blocks");
        assert!(matmul(Blocks::Q4K, &[0u8; 144], 1, &xs, 0, 256).is_none(), "no rows");
    }
}
