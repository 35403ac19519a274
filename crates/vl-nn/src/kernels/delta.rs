//! The gated delta rule of a Gated DeltaNet layer, on f32 rows (its convolution and output norm
//! are in `delta_conv`).
//!
//! Each value head keeps a state matrix S [k_dim, v_dim] and, per position t, with the decay
//! g_t (log space, <= 0), the rate beta_t, an L2-normalised key k_t and a (normalised, scaled)
//! query q_t:
//!   S <- exp(g_t) S;  delta = beta_t (v_t - S^T k_t);  S <- S + k_t delta^T;  o_t = S^T q_t.
//! Prompts and decoding steps run the same recurrence, a block of 32 value columns at a time
//! (the columns evolve independently; a block's 16 KiB stay in the L1 cache through all the
//! rows), in `delta_simd`'s AVX-512 / AVX2 blocks where the CPU has them. transformers' chunked
//! form (`delta_chunk`: chunks of rows solved together, applied as matrix products) is built and
//! held to the same reference, but the scan is the default: it needs 4 multiply-adds per state
//! element per row where the chunked form needs ~5 plus its products' packing, and measured
//! faster (docs/qwen35.md). `VL_DELTA_FORM=chunked` runs the chunked form for sequences of a
//! chunk's rows or more that keep no trail of states (speculative decoding's). Work items are
//! (sequence, value head) pairs on candle's pool; each owns its state and output rows.

use crate::cpu::SendPtr;

/// Heads and widths of one gated delta rule call. Each key head serves `v_heads / k_heads`
/// value heads: consecutive ones (transformers' order), or every `k_heads`-th when `tiled`
/// (llama.cpp's GGUF files reorder the value heads so: value head h reads key head h % k_heads).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeltaShape {
    pub k_heads: usize,
    pub v_heads: usize,
    pub k_dim: usize,
    pub v_dim: usize,
    pub tiled: bool,
}

impl DeltaShape {
    /// Floats of one sequence's state: [v_heads, k_dim, v_dim].
    pub fn state_len(&self) -> usize {
        self.v_heads * self.k_dim * self.v_dim
    }
}

/// Runs the rule over rows laid out sequence after sequence: `segments[s]` rows belong to
/// sequence `s`, which starts from and leaves its state in `states[s]`. Per row: `q`, `k`
/// [k_heads * k_dim], `v` [v_heads * v_dim], `g`, `beta` `[v_heads]`; `out` [rows, v_heads * v_dim].
#[allow(clippy::too_many_arguments)]
pub fn gated_delta_rule(
    shape: DeltaShape,
    segments: &[usize],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    states: &mut [Vec<f32>],
    out: &mut [f32],
) {
    let mut none: Vec<Vec<Vec<f32>>> = vec![Vec::new(); segments.len()];
    let from = vec![None; segments.len()];
    gated_delta_rule_trail(shape, segments, q, k, v, g, beta, (&from, states), out, &mut none);
}

/// `gated_delta_rule`, also keeping the states after rows before each sequence's last: for
/// sequence `s`, `trails[s]` (`t` < `segments[s]` buffers of `state_len()` floats) receives the
/// states after its rows `segments[s] - 1 - t .. segments[s] - 1`, in order (the state after its
/// last row is `states[s]`). Drafted tokens verified in one pass are so taken back to any of them.
/// Where `from[s]` is given (`state_len()` floats: a state kept elsewhere, read in place),
/// sequence `s` starts from it instead and `states[s]` is replaced by its new state: each work
/// item copies its head in (the copy made where the head is used, on every core, rather than
/// the whole state up front on one).
#[allow(clippy::too_many_arguments)]
pub fn gated_delta_rule_trail(
    shape: DeltaShape,
    segments: &[usize],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    (from, states): (&[Option<&[f32]>], &mut [Vec<f32>]),
    out: &mut [f32],
    trails: &mut [Vec<Vec<f32>>],
) {
    let form = Form::from_env();
    trail_with((Simd::detect(), form), shape, segments, [q, k, v, g, beta], (from, states), out, trails)
}

/// How a sequence's rows are run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Form {
    /// One row at a time (`scan_head`).
    Scan,
    /// Chunks of rows as matrix products (`delta_chunk`) for sequences of at least this many
    /// rows that keep no trail; the scan for the others.
    ChunkedFrom(usize),
}

impl Form {
    /// The default (the scan), or `VL_DELTA_FORM=chunked` (from one chunk's rows) for side by
    /// side measurements; read once.
    fn from_env() -> Self {
        static FORM: std::sync::OnceLock<Form> = std::sync::OnceLock::new();
        *FORM.get_or_init(|| match std::env::var("VL_DELTA_FORM").as_deref() {
            Ok("chunked") => Form::ChunkedFrom(super::delta_chunk::CHUNK),
            _ => Form::Scan,
        })
    }
}

/// `gated_delta_rule_trail` with its blocks run by `simd`, in `form`.
fn trail_with(
    (simd, form): (Simd, Form),
    shape: DeltaShape,
    segments: &[usize],
    [q, k, v, g, beta]: [&[f32]; 5],
    (from, states): (&[Option<&[f32]>], &mut [Vec<f32>]),
    out: &mut [f32],
    trails: &mut [Vec<Vec<f32>>],
) {
    let DeltaShape { k_heads, v_heads, k_dim, v_dim, tiled } = shape;
    assert!(from.len() == states.len() && from.iter().all(|f| f.is_none_or(|f| f.len() == shape.state_len())));
    let rows: usize = segments.iter().sum();
    let (kw, vw) = (k_heads * k_dim, v_heads * v_dim);
    assert!(k_heads > 0 && v_heads.is_multiple_of(k_heads) && states.len() == segments.len());
    assert!(q.len() == rows * kw && k.len() == rows * kw && v.len() == rows * vw && out.len() == rows * vw);
    assert!(g.len() == rows * v_heads && beta.len() == rows * v_heads);
    assert!(states.iter().zip(from).all(|(s, f)| f.is_some() || s.len() == shape.state_len()));
    assert!(trails.len() == segments.len());
    let kept: Vec<usize> = trails.iter().map(Vec::len).collect();
    assert!(trails
        .iter()
        .zip(segments)
        .all(|(t, &n)| (t.len() < n || t.is_empty()) && t.iter().all(|e| e.len() == shape.state_len())));
    let trail_ptrs: Vec<Vec<SendPtr<f32>>> =
        trails.iter_mut().map(|t| t.iter_mut().map(|e| SendPtr(e.as_mut_ptr())).collect()).collect();
    let starts: Vec<usize> = segments.iter().scan(0, |acc, &n| Some(std::mem::replace(acc, *acc + n))).collect();
    let rep = v_heads / k_heads;
    for (f, st) in from.iter().zip(states.iter_mut()) {
        if f.is_some() {
            // Written whole below, head by head, before it is read.
            *st = Vec::with_capacity(shape.state_len());
        }
    }
    let state_ptrs: Vec<SendPtr<f32>> = states.iter_mut().map(|s| SendPtr(s.as_mut_ptr())).collect();
    let out_ptr = SendPtr(out.as_mut_ptr());
    let head_len = k_dim * v_dim;
    super::tile::for_each_item(
        segments.len() * v_heads,
        || (Vec::<f32>::new(), Vec::<f32>::new(), super::delta_chunk::ChunkScratch::default()),
        |item, (kq, blk, chunk)| {
            let (s, h) = (item / v_heads, item % v_heads);
            let kh = if tiled { h % k_heads } else { h / rep };
            // SAFETY: item (s, h) alone reads and writes head h of sequence s's state (a
            // `head_len` slice of a vector of `v_heads * head_len` floats, or of that capacity
            // when `from[s]` is given, whose head h it first copies in: both asserted above) and
            // the `v_dim` outputs of head h in its sequence's rows (inside `out`, asserted above).
            let st = unsafe {
                let at = state_ptrs[s].get().add(h * head_len);
                if let Some(old) = from[s] {
                    // Into the new state's (allocated, not yet initialized) head, before any
                    // reference to it is made.
                    std::ptr::copy_nonoverlapping(old.as_ptr().add(h * head_len), at, head_len);
                }
                std::slice::from_raw_parts_mut(at, head_len)
            };
            // Rows first.. of the sequence keep their states (all but the last of its last
            // `kept[s] + 1`).
            let first = segments[s].saturating_sub(1 + kept[s]);
            let mut keep: Vec<&mut [f32]> = (0..kept[s])
                .map(|e| {
                    // SAFETY: head h's `head_len` floats of trail entry e of sequence s (a buffer
                    // of `state_len()` floats, as asserted), written by this item alone.
                    unsafe { std::slice::from_raw_parts_mut(trail_ptrs[s][e].get().add(h * head_len), head_len) }
                })
                .collect();
            let rows = HeadRows {
                q: &q[starts[s] * kw..],
                k: &k[starts[s] * kw..],
                v: &v[starts[s] * vw..],
                g: &g[starts[s] * v_heads..],
                beta: &beta[starts[s] * v_heads..],
                n: segments[s],
                widths: (kw, vw, v_heads),
                at: (kh * k_dim, h * v_dim, h),
            };
            // SAFETY: the rows' outputs of head h, as above.
            let out = unsafe { out_ptr.get().add(starts[s] * vw + h * v_dim) };
            match form {
                Form::ChunkedFrom(min) if kept[s] == 0 && segments[s] >= min => {
                    let (g, beta) = (&rows.g[h..], &rows.beta[h..]);
                    let (qk, kk) = (&rows.q[kh * k_dim..], &rows.k[kh * k_dim..]);
                    let io = ((qk, kk, kw), (&rows.v[h * v_dim..], vw), (g, beta, v_heads));
                    // SAFETY: `out` is this item's head in its sequence's rows, as above.
                    unsafe {
                        super::delta_chunk::chunk_head(st, (k_dim, v_dim), segments[s], io.0, io.1, io.2, chunk, out)
                    }
                }
                // SAFETY: as above; `simd` from `Simd::detect` or `Simd::all`.
                _ => unsafe { scan_head(simd, st, (k_dim, v_dim), &rows, (kq, blk), SendPtr(out), (first, &mut keep)) },
            }
        },
    );
    for (f, st) in from.iter().zip(states.iter_mut()) {
        if f.is_some() {
            // SAFETY: every head of the new state was written above (items cover every
            // (sequence, head) pair), within its capacity of state_len() floats.
            unsafe { st.set_len(shape.state_len()) };
        }
    }
}

/// One (sequence, head) work item's inputs: its sequence's rows from the first (`widths`: the
/// row strides of q and k, of v, and of g and beta; `at`: where this head's key, value and rate
/// sit in a row).
struct HeadRows<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    g: &'a [f32],
    beta: &'a [f32],
    n: usize,
    widths: (usize, usize, usize),
    at: (usize, usize, usize),
}

/// Value columns of the state a block holds (two 16-lane vectors): the state's columns evolve
/// independently, so each block runs every row while its `k_dim x COLS` floats (16 KiB at
/// k_dim 128), copied out together, stay in the L1 cache, where the whole head (64 KiB) would
/// not (nor the block in place: its rows 512 bytes apart fall in a few of the cache's sets).
const COLS: usize = 32;
#[cfg(target_arch = "x86_64")]
const _: () = assert!(super::delta_simd::COLS == COLS);

/// Which code runs a whole block's row.
#[derive(Debug, Clone, Copy)]
enum Simd {
    #[cfg(all(target_arch = "x86_64", not(vl_avx2_proxy)))]
    Avx512,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    Portable,
}

impl Simd {
    /// The widest this CPU runs.
    fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            #[cfg(not(vl_avx2_proxy))]
            if crate::cpu::has_avx512() {
                return Simd::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                return Simd::Avx2;
            }
        }
        Simd::Portable
    }

    /// Every kind this CPU runs (the tests hold each to the recurrence).
    #[cfg(test)]
    fn all() -> Vec<Self> {
        let mut all = vec![Simd::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                all.push(Simd::Avx2);
            }
            #[cfg(not(vl_avx2_proxy))]
            if crate::cpu::has_avx512() {
                all.push(Simd::Avx512);
            }
        }
        all
    }
}

/// All of a head's rows, a block of value columns at a time. Per row, with d = exp(g):
/// a = S^T k and b = S^T q read the old state in one pass; delta = beta (v - d a);
/// o = d b + (k . q) delta (the new state read by q); then S <- d S + k delta^T.
/// `out` points at the head's outputs in the first row (rows `widths.1` apart); `keep` = (the
/// first row whose state is kept, the buffers for it and the rows after it).
///
/// # Safety
/// `out` is writable, by this call alone, for `v_dim` floats at each of the `r.n` rows; `simd`
/// names instructions the CPU has (`Simd::detect`, `Simd::all`).
unsafe fn scan_head(
    simd: Simd,
    st: &mut [f32],
    (kd, vd): (usize, usize),
    r: &HeadRows<'_>,
    (kq, blk): (&mut Vec<f32>, &mut Vec<f32>),
    out: SendPtr<f32>,
    keep: (usize, &mut [&mut [f32]]),
) {
    let (kw, vw, gw) = r.widths;
    let (ka, va, ga) = r.at;
    kq.clear();
    kq.extend((0..r.n).map(|t| {
        let (qt, kt) = (&r.q[t * kw + ka..][..kd], &r.k[t * kw + ka..][..kd]);
        qt.iter().zip(kt).map(|(a, b)| a * b).sum::<f32>()
    }));
    let mut c0 = 0;
    while c0 < vd {
        let w = COLS.min(vd - c0);
        blk.clear();
        for row in st.chunks_exact(vd) {
            blk.extend_from_slice(&row[c0..c0 + w]);
        }
        for (t, &kqt) in kq.iter().enumerate() {
            let (qt, kt) = (&r.q[t * kw + ka..][..kd], &r.k[t * kw + ka..][..kd]);
            let vt = &r.v[t * vw + va + c0..][..w];
            let (decay, b) = (r.g[t * gw + ga].exp(), r.beta[t * gw + ga]);
            // SAFETY: this head's outputs in row t (the caller's `out`), columns c0..c0 + w.
            let o = unsafe { std::slice::from_raw_parts_mut(out.get().add(t * vw + c0), w) };
            let f = (decay, b, kqt);
            match (w, simd) {
                // SAFETY: the CPU has the instructions (`Simd::detect`); `blk` is [kd, COLS],
                // `qt`, `kt` kd floats, `vt`, `o` COLS.
                #[cfg(all(target_arch = "x86_64", not(vl_avx2_proxy)))]
                (COLS, Simd::Avx512) => unsafe { super::delta_simd::avx512::block(blk, qt, kt, vt, f, o) },
                #[cfg(target_arch = "x86_64")]
                (COLS, Simd::Avx2) => unsafe { super::delta_simd::avx2::block(blk, qt, kt, vt, f, o) },
                _ => block(blk, qt, kt, vt, f, o),
            }
            if t >= keep.0 && t + 1 < r.n {
                let dst = &mut keep.1[t - keep.0];
                for (d, s) in dst.chunks_exact_mut(vd).zip(blk.chunks_exact(w)) {
                    d[c0..c0 + w].copy_from_slice(s);
                }
            }
        }
        for (row, s) in st.chunks_exact_mut(vd).zip(blk.chunks_exact(w)) {
            row[c0..c0 + w].copy_from_slice(s);
        }
        c0 += w;
    }
}

/// One row of `scan_head` on a block of `w` <= `COLS` of the state's columns, `st` [k_dim, w]
/// (`f` = (decay, beta, k . q)), in plain loops: where no `delta_simd` block applies (other
/// CPUs, the last columns of a width that is not a multiple of `COLS`). Products and sums stay
/// separate (a fused multiply-add is a library call where the CPU has none).
#[multiversion::multiversion(targets = "simd")]
fn block(st: &mut [f32], q: &[f32], k: &[f32], v: &[f32], (decay, beta, kq): (f32, f32, f32), o: &mut [f32]) {
    let w = v.len();
    let (mut a, mut b) = ([0f32; COLS], [0f32; COLS]);
    let (a, b) = (&mut a[..w], &mut b[..w]);
    for ((row, &kk), &qq) in st.chunks_exact(w).zip(k).zip(q) {
        for ((x, y), &s) in a.iter_mut().zip(b.iter_mut()).zip(row) {
            *x += kk * s;
            *y += qq * s;
        }
    }
    let mut delta = [0f32; COLS];
    let delta = &mut delta[..w];
    for ((((d, y), &x), &bb), &vv) in delta.iter_mut().zip(o.iter_mut()).zip(a.iter()).zip(b.iter()).zip(v) {
        *d = (vv - decay * x) * beta;
        *y = decay * bb + kq * *d;
    }
    for (row, &kk) in st.chunks_exact_mut(w).zip(k) {
        for (s, &d) in row.iter_mut().zip(delta.iter()) {
            *s = decay * *s + kk * d;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rnd(n: usize, seed: u64) -> Vec<f32> {
        let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((x >> 33) as f32 / (1u64 << 31) as f32) - 0.5
            })
            .collect()
    }

    /// The recurrence written out per element (torch_recurrent_gated_delta_rule's loop).
    #[allow(clippy::too_many_arguments)]
    fn naive(
        sh: DeltaShape,
        n: usize,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        g: &[f32],
        b: &[f32],
        s: &mut [f32],
    ) -> Vec<f32> {
        let (kd, vd) = (sh.k_dim, sh.v_dim);
        let rep = sh.v_heads / sh.k_heads;
        let mut out = vec![0f32; n * sh.v_heads * vd];
        for t in 0..n {
            for h in 0..sh.v_heads {
                let kh = if sh.tiled { h % sh.k_heads } else { h / rep };
                let st = &mut s[h * kd * vd..][..kd * vd];
                let e = g[t * sh.v_heads + h].exp();
                st.iter_mut().for_each(|x| *x *= e);
                for j in 0..vd {
                    let mem: f32 = (0..kd).map(|i| st[i * vd + j] * k[(t * sh.k_heads + kh) * kd + i]).sum();
                    let d = (v[(t * sh.v_heads + h) * vd + j] - mem) * b[t * sh.v_heads + h];
                    for i in 0..kd {
                        st[i * vd + j] += k[(t * sh.k_heads + kh) * kd + i] * d;
                    }
                    out[(t * sh.v_heads + h) * vd + j] =
                        (0..kd).map(|i| st[i * vd + j] * q[(t * sh.k_heads + kh) * kd + i]).sum();
                }
            }
        }
        out
    }

    #[test]
    fn the_rule_matches_the_elementwise_recurrence_and_splits_anywhere() {
        let sh = DeltaShape { k_heads: 2, v_heads: 4, k_dim: 6, v_dim: 5, tiled: false };
        let n = 9;
        let (q, k, v) = (rnd(n * 12, 1), rnd(n * 12, 2), rnd(n * 20, 3));
        let g: Vec<f32> = rnd(n * 4, 4).iter().map(|x| -x.abs() * 2.0).collect();
        let b: Vec<f32> = rnd(n * 4, 5).iter().map(|x| x + 0.5).collect();
        let s0 = rnd(sh.state_len(), 6);
        let mut want_s = s0.clone();
        let want = naive(sh, n, &q, &k, &v, &g, &b, &mut want_s);
        let mut states = vec![s0.clone()];
        let mut out = vec![0f32; n * 20];
        gated_delta_rule(sh, &[n], &q, &k, &v, &g, &b, &mut states, &mut out);
        let close = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-5);
        assert!(close(&out, &want) && close(&states[0], &want_s));
        // The same rows as two sequences of 4 and 5 from the same start: the second differs
        // (it starts from s0, not from the state after row 4), the first equals rows 0..4.
        let mut two = vec![s0.clone(), s0.clone()];
        let mut out2 = vec![0f32; n * 20];
        gated_delta_rule(sh, &[4, 5], &q, &k, &v, &g, &b, &mut two, &mut out2);
        assert!(close(&out2[..80], &want[..80]) && !close(&out2[80..], &want[80..]));
    }

    #[test]
    fn every_block_kernel_matches_the_recurrence() {
        // Widths with a tail of columns past the 32-column blocks (40), an odd key width (7, the
        // AVX-512 block's two-row step), a full-size head (128); 2 key heads over 4 value heads,
        // in both orders; three sequences of 9, 0 and 4 rows, the first keeping the states after
        // its rows 5..8 (so it takes the scan in every form), the last starting from a state read
        // in place. Every block kernel, and the chunked form (the last sequence's 4 rows).
        let unit = |x: Vec<f32>, d: usize| -> Vec<f32> {
            x.chunks_exact(d)
                .flat_map(|h| {
                    let n = h.iter().map(|v| v * v).sum::<f32>().sqrt();
                    h.iter().map(move |v| v / n).collect::<Vec<_>>()
                })
                .collect()
        };
        for ((kd, vd), tiled) in [(7, 40), (128, 128), (6, 5)].into_iter().flat_map(|d| [(d, false), (d, true)]) {
            let sh = DeltaShape { k_heads: 2, v_heads: 4, k_dim: kd, v_dim: vd, tiled };
            let (n, kw, vw) = (13, 2 * kd, 4 * vd);
            let (q, k, v) = (unit(rnd(n * kw, 21), kd), unit(rnd(n * kw, 22), kd), rnd(n * vw, 23));
            let g: Vec<f32> = rnd(n * 4, 24).iter().map(|x| -x.abs()).collect();
            let b: Vec<f32> = rnd(n * 4, 25).iter().map(|x| x + 0.5).collect();
            let (s0, s1) = (rnd(sh.state_len(), 26), rnd(sh.state_len(), 27));
            // The recurrence per sequence, and the states after rows 5, 6, 7 of the first.
            let (mut w0, mut w1) = (s0.clone(), s1.clone());
            let mut want = naive(sh, 9, &q, &k, &v, &g, &b, &mut w0);
            let at = |x: &[f32], w: usize| x[9 * w..].to_vec();
            want.extend(naive(sh, 4, &at(&q, kw), &at(&k, kw), &at(&v, vw), &at(&g, 4), &at(&b, 4), &mut w1));
            let kept: Vec<Vec<f32>> = (5..8)
                .map(|row| {
                    let mut st = s0.clone();
                    naive(sh, row + 1, &q, &k, &v, &g, &b, &mut st);
                    st
                })
                .collect();
            let far = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
            let ways = Simd::all().into_iter().map(|s| (s, Form::Scan)).chain([(Simd::Portable, Form::ChunkedFrom(1))]);
            for way in ways {
                let s2 = rnd(sh.state_len(), 28);
                let mut states = vec![s0.clone(), s2.clone(), vec![]];
                let mut out = vec![0f32; n * vw];
                let mut trails = vec![vec![vec![0f32; sh.state_len()]; 3], vec![], vec![]];
                let io = [&q[..], &k, &v, &g, &b];
                let from = [None, None, Some(&s1[..])];
                trail_with(way, sh, &[9, 0, 4], io, (&from, &mut states), &mut out, &mut trails);
                let worst = [far(&out, &want), far(&states[0], &w0), far(&states[2], &w1)]
                    .into_iter()
                    .chain(trails[0].iter().zip(&kept).map(|(a, b)| far(a, b)))
                    .fold(0f32, f32::max);
                assert!(worst < 1e-5, "{kd}x{vd}, tiled {tiled}, {way:?}: {worst}");
                assert_eq!(states[1], s2, "a sequence of no rows keeps its state");
            }
        }
    }

    /// transformers' own delta rule at a real head size (goldens/delta-rule, made by
    /// tools/hf-reference/delta_rule.py): every block kernel this CPU runs, and the chunked
    /// form, on the whole sequence and split in two calls, against its recurrent form (the
    /// decoding path) and its chunked form (the prompt path).
    #[test]
    fn every_block_kernel_matches_transformers_at_a_real_head_size() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../goldens/delta-rule/rule.safetensors");
        let t = candle_core::safetensors::load(path, &candle_core::Device::Cpu).expect(path);
        let get = |n: &str| t[n].flatten_all().and_then(|x| x.to_vec1::<f32>()).expect(n);
        let (d, n) = (128, 100);
        let sh = DeltaShape { k_heads: 1, v_heads: 2, k_dim: d, v_dim: d, tiled: false };
        // The reference scales q by 1/sqrt(k_dim) itself; the kernel takes it scaled.
        let q: Vec<f32> = get("q").iter().map(|x| x * (d as f32).powf(-0.5)).collect();
        let (k, v, g, b, s0) = (get("k"), get("v"), get("g"), get("beta"), get("initial_state"));
        let far = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        let ways = Simd::all().into_iter().map(|s| (s, Form::Scan)).chain([(Simd::Portable, Form::ChunkedFrom(1))]);
        for way in ways {
            for split in [n, 37, 69] {
                let mut state = vec![s0.clone()];
                let mut out = vec![0f32; n * 2 * d];
                for (from, to) in [(0, split), (split, n)].into_iter().filter(|(a, b)| a < b) {
                    let (kw, vw) = (d, 2 * d);
                    let io = [
                        &q[from * kw..to * kw],
                        &k[from * kw..to * kw],
                        &v[from * vw..to * vw],
                        &g[from * 2..to * 2],
                        &b[from * 2..to * 2],
                    ];
                    let o = &mut out[from * vw..to * vw];
                    trail_with(way, sh, &[to - from], io, (&[None], &mut state), o, &mut [vec![]]);
                }
                // Measured: within 3e-8 (outputs, up to 0.054) and 1.5e-7 (states, up to 0.57) of both.
                for (o, s, tol) in [("out_recurrent", "state_recurrent", 1e-6), ("out_chunked", "state_chunked", 1e-6)]
                {
                    let (eo, es) = (far(&out, &get(o)), far(&state[0], &get(s)));
                    assert!(eo < tol && es < tol, "{way:?}, split at {split}: {o} {eo}, {s} {es}");
                }
            }
        }
    }

    #[test]
    fn the_trail_holds_the_state_after_each_kept_row() {
        // Two sequences of 5 and 3 rows; the first keeps the states after its rows 1..4, the
        // second none: each equals the naive recurrence run to that row.
        let sh = DeltaShape { k_heads: 2, v_heads: 4, k_dim: 6, v_dim: 5, tiled: false };
        let n = 8;
        let (q, k, v) = (rnd(n * 12, 11), rnd(n * 12, 12), rnd(n * 20, 13));
        let g: Vec<f32> = rnd(n * 4, 14).iter().map(|x| -x.abs()).collect();
        let b: Vec<f32> = rnd(n * 4, 15).iter().map(|x| x + 0.5).collect();
        let s0 = rnd(sh.state_len(), 16);
        let mut states = vec![s0.clone(), s0.clone()];
        let mut out = vec![0f32; n * 20];
        let mut trails = vec![vec![vec![0f32; sh.state_len()]; 3], vec![]];
        gated_delta_rule_trail(sh, &[5, 3], &q, &k, &v, &g, &b, (&[None, None], &mut states), &mut out, &mut trails);
        for (j, row) in (1..4).enumerate() {
            let mut want = s0.clone();
            naive(sh, row + 1, &q, &k, &v, &g, &b, &mut want);
            let got = &trails[0][j];
            let d = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(d < 1e-5, "row {row}: {d}");
        }
        let mut plain = vec![s0.clone(), s0];
        let mut out2 = vec![0f32; n * 20];
        gated_delta_rule(sh, &[5, 3], &q, &k, &v, &g, &b, &mut plain, &mut out2);
        assert_eq!((plain, out2), (states.clone(), out.clone()), "keeping a trail changes nothing else");
        // Started from states read in place (the second sequence only, and both): the same
        // bits, the sources untouched.
        let (src0, src1) = (rnd(sh.state_len(), 16), rnd(sh.state_len(), 16));
        for from in [[None, Some(&src1[..])], [Some(&src0[..]), Some(&src1[..])]] {
            let mut fresh = vec![if from[0].is_some() { vec![] } else { src0.clone() }, vec![7.0; 3]];
            let mut out3 = vec![0f32; n * 20];
            let mut trails3 = vec![vec![vec![0f32; sh.state_len()]; 3], vec![]];
            gated_delta_rule_trail(sh, &[5, 3], &q, &k, &v, &g, &b, (&from, &mut fresh), &mut out3, &mut trails3);
            assert_eq!((&fresh, &out3, &trails3), (&states, &out, &trails));
        }
        assert_eq!(src0, rnd(sh.state_len(), 16));
    }
}
