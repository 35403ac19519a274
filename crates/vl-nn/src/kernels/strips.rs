//! The AVX2 (and selectable AVX-512) strip tile kernels of the segment attention
//! (`TileKernel::Avx2Strips`, `TileKernel::Avx512Strips`): one template, `strip_kernel!`, built
//! per instruction set from `avx2`'s or `avx512`'s operations.

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
        pub(super) mod $name {
            use crate::cpu::SendPtr;
            use crate::kernels::tile::{balanced, Scratch, Tile};
            use crate::kernels::SegmentAttentionShape;
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
            pub(in crate::kernels) unsafe fn attend_tile(
                t: &Tile<'_>,
                shape: SegmentAttentionShape,
                sc: &mut Scratch,
                out: SendPtr<f32>,
            ) {
                // SAFETY: the operations below need no more than this function's `# Safety` contract.
                unsafe {
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
                        let dst = std::slice::from_raw_parts_mut(out.get().add((t.q0 + i) * hidden + t.h * d), d);
                        for (c, y) in dst.iter_mut().enumerate() {
                            *y = o[c * STRIP + l] * inv;
                        }
                    }
                }
            }

            /// Scores of one strip against keys `k` (`n` rows of `d`, contiguous):
            /// `s[j * STRIP + l]` = q(l) . k(j), q read from its strip block (`q[c * STRIP + l]`);
            /// `mx` takes the lanes' running maxima.
            ///
            /// # Safety
            /// The CPU has `$feature`; `q` is one strip's d x STRIP block, `k` is readable for `n`
            /// rows of `d`, and `sc` writable for `n` x STRIP floats.
            #[target_feature(enable = $feature)]
            unsafe fn scores(q: *const f32, k: *const f32, d: usize, n: usize, sc: *mut f32, mx: &mut Row) {
                // SAFETY: the operations below need no more than this function's `# Safety` contract.
                unsafe {
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
            }

            /// # Safety
            /// The CPU has `$feature`; `q` is one strip's d x STRIP block, `k` is readable for NK
            /// rows of `d`, and `sc` writable for NK x STRIP floats.
            #[inline]
            #[target_feature(enable = $feature)]
            unsafe fn scores_block<const NK: usize>(
                q: *const f32,
                k: *const f32,
                d: usize,
                sc: *mut f32,
                mx: &mut Row,
            ) {
                // SAFETY: the operations below need no more than this function's `# Safety` contract.
                unsafe {
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
            }

            /// The online softmax step of one strip: scores `sc` (`n` keys x STRIP, base 2)
            /// become `2^(s - max)` with `max` the new running max (`mx`: this tile's, `max`:
            /// the strip's so far); the strip's sums and transposed output (`o`: `d` x STRIP)
            /// are rescaled by `2^(old - new)` and the tile's probabilities added to the sums.
            ///
            /// # Safety
            /// The CPU has `$feature`; `sc` holds `n` x STRIP scores, `max` and `sum` STRIP floats
            /// each, `o` d x STRIP floats, all this caller's to read and write.
            #[target_feature(enable = $feature)]
            unsafe fn softmax(sc: *mut f32, n: usize, mx: Row, max: *mut f32, sum: *mut f32, o: *mut f32, d: usize) {
                // SAFETY: the operations below need no more than this function's `# Safety` contract.
                unsafe {
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
            }

            /// `o[c * STRIP + l] += sum_j p[j * STRIP + l] v[j * d + c]` for the strip's `d` x
            /// STRIP transposed output, over `n` value rows of `d`; `d` even.
            ///
            /// # Safety
            /// The CPU has `$feature`; `p` holds `n` x STRIP probabilities, `v` is readable for `n`
            /// rows of `d` floats, and `o` holds the strip's d x STRIP output, this caller's to
            /// update.
            #[target_feature(enable = $feature)]
            unsafe fn values(p: *const f32, n: usize, v: *const f32, d: usize, o: *mut f32) {
                // SAFETY: the operations below need no more than this function's `# Safety` contract.
                unsafe {
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
            }

            /// # Safety
            /// The CPU has `$feature`; `p` holds `n` x STRIP probabilities, `v` is readable for `n`
            /// rows of NC floats (`vstride` apart), and `o` holds NC x STRIP floats, this caller's
            /// to update.
            #[inline]
            #[target_feature(enable = $feature)]
            unsafe fn values_block<const NC: usize>(
                p: *const f32,
                n: usize,
                v: *const f32,
                vstride: usize,
                o: *mut f32,
            ) {
                // SAFETY: the operations below need no more than this function's `# Safety` contract.
                unsafe {
                    // Over the n keys: the strip's probabilities of key j against its NC values.
                    let mut acc: [Row; NC] = s::load(o, STRIP);
                    s::accumulate(&mut acc, n, p, STRIP, v, vstride, 1);
                    s::store(&acc, o, STRIP);
                }
            }
        }
    };
}

// AVX2: 6 keys or 6 dimensions x 16 queries in 2 vectors (12 of the 16 registers); AVX-512: 8
// keys or 8 dimensions x 48 queries in 3 vectors (24 of the 32 registers; d = 64 in whole
// blocks), gemm's own micro-kernel shape there.
#[cfg(target_arch = "x86_64")]
strip_kernel!(avx2, avx2, "avx2,fma", 2, 6, 6);
#[cfg(all(target_arch = "x86_64", not(vl_avx2_proxy)))]
strip_kernel!(avx512, avx512, "avx512f", 3, 8, 8);
