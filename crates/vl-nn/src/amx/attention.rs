//! The attention core on AMX tiles (`--vision-precision bf16`): the scores `Q K^T` and the
//! product `P V` with bf16 operands and f32 sums; the online softmax in f32 on the scores, its
//! probabilities rounded to bf16 for `P V`. Keys and values are packed once per call for every
//! head (`pack_keys`, `pack_values`), the queries per tile.

#[cfg(target_arch = "x86_64")]
use super::config;
use super::pack::round_row;
use super::{ATTENTION_HEAD_DIM as D, KSTEP};

/// Keys per tile step (two 16-key score tiles).
const KEYS: usize = 32;

/// Whether the tile attention runs for head dimension `d` on this CPU.
pub(crate) fn available(d: usize) -> bool {
    d == D && super::available()
}

/// Positions rounded up to whole 32-key steps.
fn padded(seq: usize) -> usize {
    seq.next_multiple_of(KEYS)
}

/// `k` ([heads, seq, D] f32, head-major) as score-product operands: per head, per 16-key
/// group, per 32-feature step, a 16 x 16 tile of pairs (row p: features 2p, 2p+1 of each of
/// the 16 keys). Keys past `seq` are zero.
pub(crate) fn pack_keys(k: &[f32], heads: usize, seq: usize) -> Vec<u32> {
    let sp = padded(seq);
    let steps = D / KSTEP;
    let mut dst = vec![0u32; heads * sp * D / 2];
    let ptr = crate::cpu::SendPtr(dst.as_mut_ptr());
    candle_core::utils::barrier_pool().execute_chunked(heads * sp / 16, |range| {
        let mut bits = [0u16; D];
        for item in range {
            let (h, g) = (item / (sp / 16), item % (sp / 16));
            for j in 0..16 {
                let key = g * 16 + j;
                if key >= seq {
                    break;
                }
                round_row(&k[(h * seq + key) * D..][..D], &mut bits);
                for st in 0..steps {
                    for p in 0..16 {
                        let i = st * KSTEP + 2 * p;
                        let v = bits[i] as u32 | (bits[i + 1] as u32) << 16;
                        // SAFETY: head h's group g (16 x D / 2 pairs) belongs to this item.
                        unsafe { ptr.get().add((((h * sp / 16 + g) * steps + st) * 16 + p) * 16 + j).write(v) };
                    }
                }
            }
        }
    });
    dst
}

/// The values (key `j` of head `h` at `v[j * v_rs + h * D..]`, f32) as `P V` operands: per
/// head, per 32-key step, per 16-column group, a 16 x 16 tile of pairs (row p: keys 2p, 2p+1
/// of each column). Keys past `seq` are zero.
pub(crate) fn pack_values(v: &[f32], v_rs: usize, heads: usize, seq: usize) -> Vec<u32> {
    let sp = padded(seq);
    let groups = D / 16;
    let mut dst = vec![0u32; heads * sp * D / 2];
    let ptr = crate::cpu::SendPtr(dst.as_mut_ptr());
    candle_core::utils::barrier_pool().execute_chunked(heads * sp / KEYS, |range| {
        let mut bits = [[0u16; D]; 2];
        for item in range {
            let (h, st) = (item / (sp / KEYS), item % (sp / KEYS));
            for p in 0..16 {
                for (e, b) in bits.iter_mut().enumerate() {
                    let key = st * KEYS + 2 * p + e;
                    if key < seq {
                        round_row(&v[key * v_rs + h * D..][..D], b);
                    } else {
                        b.fill(0);
                    }
                }
                for g in 0..groups {
                    for c in 0..16 {
                        let col = g * 16 + c;
                        let val = bits[0][col] as u32 | (bits[1][col] as u32) << 16;
                        // SAFETY: head h's step st (D / 2 x 32 pairs) belongs to this item.
                        unsafe { ptr.get().add((((h * sp / KEYS + st) * groups + g) * 16 + p) * 16 + c).write(val) };
                    }
                }
            }
        }
    });
    dst
}

/// Per-thread buffers of `attend`.
pub(crate) struct Scratch {
    s: Vec<f32>,
    p: Vec<u16>,
    q: Vec<u16>,
    o: Vec<f32>,
    max: Vec<f32>,
    sum: Vec<f32>,
}

impl Scratch {
    /// For tiles of at most `rows` queries and `keys` keys.
    pub(crate) fn new(rows: usize, keys: usize) -> Self {
        let (m, n) = (rows.next_multiple_of(32), keys.next_multiple_of(KEYS) + KEYS);
        Self {
            s: vec![0.0; m * n],
            p: vec![0; m * n],
            q: vec![0; m * D],
            o: vec![0.0; m * D],
            max: vec![0.0; m],
            sum: vec![0.0; m],
        }
    }
}

/// Where one work item's operands lie.
pub(crate) struct Tile<'a> {
    /// Rotated, pre-scaled queries transposed per head: feature i of query s of head h at
    /// `q[(h * D + i) * ldq + s]` (scores in base 2).
    pub(crate) q: &'a [f32],
    pub(crate) ldq: usize,
    /// `pack_keys`, `pack_values` of this call.
    pub(crate) keys: &'a [u32],
    pub(crate) values: &'a [u32],
    pub(crate) seq: usize,
    pub(crate) h: usize,
    /// The segment's keys.
    pub(crate) s0: usize,
    pub(crate) s1: usize,
    /// The tile's queries.
    pub(crate) q0: usize,
    pub(crate) rows: usize,
    /// Keys per score tile (rounded to 32).
    pub(crate) key_tile: usize,
}

/// Softmax(q k^T) v for the tile's queries over its segment's keys, normalized, into
/// `out` (query r's D values at `out + r * out_stride`).
///
/// # Safety
/// `available(D)`; `sc` made for at least these rows and key tile; those rows of `out` are
/// the caller's to write; the operands as documented on `Tile`.
#[cfg(target_arch = "x86_64")]
pub(crate) unsafe fn attend(t: &Tile<'_>, sc: &mut Scratch, out: *mut f32, out_stride: usize) {
    // SAFETY: the operations below need no more than this function's `# Safety` contract.
    unsafe {
        let m = t.rows.next_multiple_of(32);
        let steps = D / KSTEP;
        // The queries as bf16 activation tiles ([m / 16][steps][16][32]), padded rows zero.
        sc.q[..m * D].fill(0);
        let mut col = [0f32; D];
        let mut bits = [0u16; D];
        for r in 0..t.rows {
            for (i, c) in col.iter_mut().enumerate() {
                *c = t.q[(t.h * D + i) * t.ldq + t.q0 + r];
            }
            round_row(&col, &mut bits);
            for st in 0..steps {
                let at = ((r / 16) * steps + st) * 512 + (r % 16) * KSTEP;
                sc.q[at..at + KSTEP].copy_from_slice(&bits[st * KSTEP..][..KSTEP]);
            }
        }
        sc.o[..m * D].fill(0.0);
        sc.max[..m].fill(f32::NEG_INFINITY);
        sc.sum[..m].fill(0.0);
        let sp = padded(t.seq);
        let (first, end) = (t.s0 / KEYS * KEYS, t.s1.next_multiple_of(KEYS));
        let width = t.key_tile.next_multiple_of(KEYS).max(KEYS);
        config::configure();
        let mut k0 = first;
        while k0 < end {
            let n = width.min(end - k0);
            // S = Q K^T, row-major [m][n].
            let kbase = t.keys.as_ptr().add((t.h * sp / 16 + k0 / 16) * steps * 256);
            for r in (0..m).step_by(32) {
                for j in (0..n).step_by(KEYS) {
                    let a = sc.q.as_ptr().add((r / 16) * steps * 512);
                    let b = kbase.add((j / 16) * steps * 256);
                    x86::scores(a, steps, b, sc.s.as_mut_ptr().add(r * n + j), n);
                }
            }
            // The online softmax on each query's row; the probabilities into `P` tiles.
            let (lo, hi) = (t.s0.saturating_sub(k0), (t.s1 - k0).min(n));
            for r in 0..m {
                let row = &mut sc.s[r * n..(r + 1) * n];
                let p_at = |j: usize| ((r / 16) * (n / KEYS) + j / KEYS) * 512 + (r % 16) * KEYS + j % KEYS;
                if r >= t.rows {
                    for j in (0..n).step_by(KEYS) {
                        let at = p_at(j);
                        sc.p[at..at + KEYS].fill(0);
                    }
                    continue;
                }
                let (new_max, acc) = x86::softmax_row(row, lo, hi, sc.max[r], &mut sc.p, &p_at);
                if sc.max[r] == f32::NEG_INFINITY {
                    sc.sum[r] = acc;
                } else {
                    let f = crate::cpu::exp2_nonpositive(sc.max[r] - new_max);
                    sc.sum[r] = sc.sum[r] * f + acc;
                    for y in &mut sc.o[r * D..(r + 1) * D] {
                        *y *= f;
                    }
                }
                sc.max[r] = new_max;
            }
            // O += P V.
            let vbase = t.values.as_ptr().add((t.h * sp / KEYS + k0 / KEYS) * (D / 16) * 256);
            for r in (0..m).step_by(16) {
                x86::values(
                    sc.p.as_ptr().add((r / 16) * (n / KEYS) * 512),
                    n / KEYS,
                    vbase,
                    sc.o.as_mut_ptr().add(r * D),
                );
            }
            k0 += n;
        }
        config::release();
        for r in 0..t.rows {
            let inv = 1.0 / sc.sum[r];
            let dst = std::slice::from_raw_parts_mut(out.add(r * out_stride), D);
            for (y, x) in dst.iter_mut().zip(&sc.o[r * D..(r + 1) * D]) {
                *y = x * inv;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::asm;
    use std::arch::x86_64::*;

    /// Four 16 x 16 score tiles: 32 query rows (activation tiles at `a`, `steps` 32-feature
    /// steps per 16-row group) against 32 keys (key tiles at `b`, `steps` per 16-key group), into
    /// `s` (row stride `n` floats).
    ///
    /// # Safety
    /// Tiles configured on this thread; the operands readable, `s` writable for 32 rows.
    pub(super) unsafe fn scores(a: *const u16, steps: usize, b: *const u32, s: *mut f32, n: usize) {
        // SAFETY: the operations below need no more than this function's `# Safety` contract.
        unsafe {
            asm!("tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3", options(nostack, nomem));
            for st in 0..steps {
                asm!(
                    "tileloadd tmm4, [{a0} + {sa}*1]",
                    "tileloadd tmm6, [{b0} + {sb}*1]",
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    "tileloadd tmm7, [{b1} + {sb}*1]",
                    "tdpbf16ps tmm1, tmm4, tmm7",
                    "tileloadd tmm5, [{a1} + {sa}*1]",
                    "tdpbf16ps tmm2, tmm5, tmm6",
                    "tdpbf16ps tmm3, tmm5, tmm7",
                    a0 = in(reg) a.add(st * 512),
                    a1 = in(reg) a.add((steps + st) * 512),
                    b0 = in(reg) b.add(st * 256),
                    b1 = in(reg) b.add((steps + st) * 256),
                    sa = in(reg) 64usize,
                    sb = in(reg) 64usize,
                    options(nostack, readonly),
                );
            }
            asm!(
                "tilestored [{s0} + {st}*1], tmm0",
                "tilestored [{s0} + {st}*1 + 64], tmm1",
                "tilestored [{s1} + {st}*1], tmm2",
                "tilestored [{s1} + {st}*1 + 64], tmm3",
                s0 = in(reg) s,
                s1 = in(reg) s.add(16 * n),
                st = in(reg) n * 4,
                options(nostack),
            );
        }
    }

    /// `o` (16 rows of 64 f32) += 16 rows of probabilities (`key_steps` activation tiles at `p`)
    /// times the values (`key_steps` x 4 tiles at `v`).
    ///
    /// # Safety
    /// As `scores`.
    pub(super) unsafe fn values(p: *const u16, key_steps: usize, v: *const u32, o: *mut f32) {
        // SAFETY: the operations below need no more than this function's `# Safety` contract.
        unsafe {
            asm!(
                "tileloadd tmm0, [{o} + {so}*1]",
                "tileloadd tmm1, [{o} + {so}*1 + 64]",
                "tileloadd tmm2, [{o} + {so}*1 + 128]",
                "tileloadd tmm3, [{o} + {so}*1 + 192]",
                o = in(reg) o,
                so = in(reg) 256usize,
                options(nostack, readonly),
            );
            for st in 0..key_steps {
                asm!(
                    "tileloadd tmm4, [{p} + {s}*1]",
                    "tileloadd tmm5, [{v} + {s}*1]",
                    "tdpbf16ps tmm0, tmm4, tmm5",
                    "tileloadd tmm6, [{v} + {s}*1 + 1024]",
                    "tdpbf16ps tmm1, tmm4, tmm6",
                    "tileloadd tmm7, [{v} + {s}*1 + 2048]",
                    "tdpbf16ps tmm2, tmm4, tmm7",
                    "tileloadd tmm5, [{v} + {s}*1 + 3072]",
                    "tdpbf16ps tmm3, tmm4, tmm5",
                    p = in(reg) p.add(st * 512),
                    v = in(reg) v.add(st * 4 * 256),
                    s = in(reg) 64usize,
                    options(nostack, readonly),
                );
            }
            asm!(
                "tilestored [{o} + {so}*1], tmm0",
                "tilestored [{o} + {so}*1 + 64], tmm1",
                "tilestored [{o} + {so}*1 + 128], tmm2",
                "tilestored [{o} + {so}*1 + 192], tmm3",
                o = in(reg) o,
                so = in(reg) 256usize,
                options(nostack),
            );
        }
    }

    /// One query's online-softmax step over a score row (`row`, base 2): keys `lo..hi` are its
    /// segment's, the others get probability 0. Returns the new running max (at least `max`)
    /// and the sum of the new probabilities; writes them, rounded to bf16, where `p_at(j)` says
    /// (32 consecutive keys contiguous).
    ///
    /// # Safety
    /// The CPU has AVX-512 F/BW and AVX512-BF16 (`amx::available()` implies them); `row.len()` is a
    /// multiple of 16 (whole 16-score loads), and for every `j` in steps of 16, `p_at(j)` is an
    /// index with 16 `u16` of room after it in `p`.
    #[cfg(not(vl_avx2_proxy))]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn softmax_row(
        row: &[f32],
        lo: usize,
        hi: usize,
        max: f32,
        p: &mut [u16],
        p_at: &dyn Fn(usize) -> usize,
    ) -> (f32, f32) {
        // SAFETY: the operations below need no more than this function's `# Safety` contract.
        unsafe {
            let n = row.len();
            let mask = |j: usize| -> __mmask16 {
                let (a, b) = (lo.saturating_sub(j).min(16), hi.saturating_sub(j).min(16));
                if b <= a {
                    0
                } else {
                    (((1u32 << b) - 1) & !((1u32 << a) - 1)) as u16
                }
            };
            let mut mx = _mm512_set1_ps(max);
            for j in (0..n).step_by(16) {
                let k = mask(j);
                mx = _mm512_mask_max_ps(mx, k, mx, _mm512_loadu_ps(row.as_ptr().add(j)));
            }
            let new_max = _mm512_reduce_max_ps(mx);
            let m = _mm512_set1_ps(new_max);
            let mut acc = _mm512_setzero_ps();
            for j in (0..n).step_by(16) {
                let k = mask(j);
                let e = crate::avx512::exp2(_mm512_sub_ps(_mm512_loadu_ps(row.as_ptr().add(j)), m));
                let e = _mm512_maskz_mov_ps(k, e);
                acc = _mm512_add_ps(acc, e);
                let h: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(e));
                _mm256_storeu_si256(p.as_mut_ptr().add(p_at(j)) as *mut __m256i, h);
            }
            (new_max, _mm512_reduce_add_ps(acc))
        }
    }

    /// The AVX2 stand-in build has no AVX-512 code (`available()` is false there).
    ///
    /// # Safety
    /// Never to be called: `available()` is false in the AVX2 stand-in build, so no tile attention
    /// runs (the body is unreachable).
    #[cfg(vl_avx2_proxy)]
    pub(super) unsafe fn softmax_row(
        _row: &[f32],
        _lo: usize,
        _hi: usize,
        _max: f32,
        _p: &mut [u16],
        _p_at: &dyn Fn(usize) -> usize,
    ) -> (f32, f32) {
        unreachable!("no tile attention in the AVX2 stand-in build")
    }
}
