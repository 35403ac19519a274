//! Bidirectional attention within segments from the fused qkv projection's output (the vision
//! tower's): rotary applied once per call, query tiles x heads on candle's pool, each tile's two
//! products on the chosen `TileKernel`.

use multiversion::multiversion;

use crate::cpu::SendPtr;
#[cfg(target_arch = "x86_64")]
use crate::kernels::strips;
use crate::kernels::tile::{attend_gemm, for_each_item, tile_rows, Operands, Scratch, Tile};
use crate::kernels::{SegmentAttentionShape, TileKernel};

/// Bidirectional attention within segments, from the fused projection's output, on the given
/// tile kernel (`Gemm` where the CPU cannot run it; `TileKernel::best()` is the default choice).
///
/// `qkv`: [seq, 3, heads, head_dim] row-major (q | k | v); `cos`, `sin`: [seq, head_dim / 2]
/// (rotate-half rotary on q and k); `cu`: segment boundaries `[0, ..., seq]`. Writes
/// softmax(q k^T / sqrt(d)) v into `out`: [seq, heads * head_dim], heads side by side (what the
/// output projection reads). The caller checks the lengths.
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
    let usable = kernel.available() && (kernel != TileKernel::AmxBf16 || crate::amx::attention::available(d));
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
        use crate::amx::attention::{pack_keys, pack_values};
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
                    let t = crate::amx::attention::Tile {
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
                    unsafe { crate::amx::attention::attend(&t, amx, out_ptr.get().add(q0 * hidden + h * d), hidden) }
                }
                #[cfg(not(target_arch = "x86_64"))]
                TileKernel::AmxBf16 => unreachable!("not available off x86_64"),
                // SAFETY: as above, and `available()` checked AVX2 and FMA.
                #[cfg(target_arch = "x86_64")]
                TileKernel::Avx2Strips => unsafe { strips::avx2::attend_tile(&tile, shape, scratch, out_ptr) },
                // SAFETY: as above, and `available()` checked AVX-512F.
                #[cfg(all(target_arch = "x86_64", not(vl_avx2_proxy)))]
                TileKernel::Avx512Strips => unsafe { strips::avx512::attend_tile(&tile, shape, scratch, out_ptr) },
                #[cfg(all(target_arch = "x86_64", vl_avx2_proxy))]
                TileKernel::Avx512Strips => unreachable!("not available in the AVX2 stand-in build"),
                #[cfg(not(target_arch = "x86_64"))]
                TileKernel::Avx2Strips | TileKernel::Avx512Strips => unreachable!("not available off x86_64"),
            }
        },
    );
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
///
/// # Safety
/// `qp`, `kp` (and `vp`) point to the q ([heads, d, ldq]), k and v ([heads, seq, d]) buffers laid
/// out for `shape`, and the positions `range` of each (q's columns, k's and v's rows) are this
/// call's alone to write while it runs; `qkv`, `cos` and `sin` hold `shape.seq` rows (the caller
/// asserts their lengths).
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

/// One head's attention for query rows `q0..q0+rows` over keys `s0..s1` (`attend_gemm` on the
/// vision layout: q transposed and pre-scaled, k head-major, v in the projection output), then
/// normalized into `out`.
///
/// # Safety
/// `t`'s operands are laid out as `segment_attention_with` makes them (q [heads, d, ldq] with rows
/// q0..q0 + rows inside `ldq`, k head-major, v in the projection output) for keys s0..s1 of
/// `shape`; `sc` was made for `shape` with `TileKernel::Gemm`; rows q0..q0 + rows, columns h d..h d
/// + d of the [seq, heads d] output at `out` are this caller's alone to write.
unsafe fn attend_tile(t: &Tile<'_>, shape: SegmentAttentionShape, sc: &mut Scratch, out: SendPtr<f32>) {
    // SAFETY: the operations below need no more than this function's `# Safety` contract.
    unsafe {
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
            half: None,
        };
        attend_gemm(&op, t.rows, d, t.s1 - t.s0, shape.key_tile, None, sc);
        // SAFETY (caller): this item owns rows q0..q0+rows, columns h*d..h*d+d of `out`.
        sc.write_normalized(t.rows, d, out.get().add(t.q0 * hidden + t.h * d), hidden);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::{KEY_TILE, QUERY_TILE};
    use candle_core::Tensor;

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
}
