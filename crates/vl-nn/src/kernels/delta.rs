//! The gated delta rule and the short causal convolution of a Gated DeltaNet layer, on f32 rows.
//!
//! Each value head keeps a state matrix S [k_dim, v_dim] and, per position t, with the decay
//! g_t (log space, <= 0), the rate beta_t, an L2-normalised key k_t and a (normalised, scaled)
//! query q_t:
//!   S <- exp(g_t) S;  delta = beta_t (v_t - S^T k_t);  S <- S + k_t delta^T;  o_t = S^T q_t.
//! Prompts and decoding steps run the same recurrence (the chunked form regroups the same sums
//! into products for wide accelerators; on the CPU the scan is a few FMAs per state element per
//! position, well under 1% of a step's weight products, so it is not used). Work items are
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
        || vec![0f32; v_dim],
        |item, delta| {
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
            for t in starts[s]..starts[s] + segments[s] {
                let qt = &q[t * kw + kh * k_dim..][..k_dim];
                let kt = &k[t * kw + kh * k_dim..][..k_dim];
                let vt = &v[t * vw + h * v_dim..][..v_dim];
                let decay = g[t * v_heads + h].exp();
                let b = beta[t * v_heads + h];
                let o = unsafe { std::slice::from_raw_parts_mut(out_ptr.get().add(t * vw + h * v_dim), v_dim) };
                step(st, qt, kt, vt, decay, b, delta, o);
                // Row j of the sequence's last `kept[s] + 1` but the last: its state kept.
                let j = t - starts[s];
                let first = segments[s] - 1 - kept[s];
                if kept[s] > 0 && j >= first && j + 1 < segments[s] {
                    // SAFETY: head h's `head_len` floats of trail entry j - first of sequence s (a
                    // buffer of `state_len()` floats, as asserted), written by this item alone.
                    let dst = unsafe {
                        std::slice::from_raw_parts_mut(trail_ptrs[s][j - first].get().add(h * head_len), head_len)
                    };
                    dst.copy_from_slice(st);
                }
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

/// One position of one head: `s` [k_dim, v_dim] decayed, corrected toward `v` along `k`, read
/// by `q` into `o`.
#[allow(clippy::too_many_arguments)]
#[multiversion::multiversion(targets("x86_64+avx512f+avx512bw+avx512vl+fma", "x86_64+avx2+fma", "aarch64+neon"))]
fn step(s: &mut [f32], q: &[f32], k: &[f32], v: &[f32], decay: f32, beta: f32, delta: &mut [f32], o: &mut [f32]) {
    let vd = v.len();
    delta.iter_mut().for_each(|d| *d = 0.0);
    for (row, &kk) in s.chunks_exact_mut(vd).zip(k) {
        for (x, d) in row.iter_mut().zip(delta.iter_mut()) {
            *x *= decay;
            *d += kk * *x;
        }
    }
    for (d, &vv) in delta.iter_mut().zip(v) {
        *d = (vv - *d) * beta;
    }
    o.iter_mut().for_each(|x| *x = 0.0);
    for ((row, &kk), &qq) in s.chunks_exact_mut(vd).zip(k).zip(q) {
        for ((x, &d), y) in row.iter_mut().zip(delta.iter()).zip(o.iter_mut()) {
            *x += kk * d;
            *y += qq * *x;
        }
    }
}

/// The depthwise causal convolution over time with SiLU: `x` [rows, channels] after the
/// `window` [kernel - 1, channels] of earlier inputs (oldest first; zeros before a sequence's
/// start), `weight` [channels, kernel] (the last tap on the current row). Returns the outputs
/// [rows, channels] and writes the new window (the last kernel - 1 inputs) back.
pub fn causal_conv1d_silu(x: &[f32], channels: usize, weight: &[f32], kernel: usize, window: &mut [f32]) -> Vec<f32> {
    let rows = x.len() / channels.max(1);
    let w = kernel - 1;
    assert!(kernel >= 1 && x.len() == rows * channels && weight.len() == channels * kernel);
    assert!(window.len() == w * channels);
    // The input with the window before it: [w + rows, channels].
    let mut all = Vec::with_capacity((w + rows) * channels);
    all.extend_from_slice(window);
    all.extend_from_slice(x);
    let mut out = vec![0f32; rows * channels];
    for t in 0..rows {
        let o = &mut out[t * channels..][..channels];
        for j in 0..kernel {
            let src = &all[(t + j) * channels..][..channels];
            for ((y, &xv), c) in o.iter_mut().zip(src).zip(0..channels) {
                *y += weight[c * kernel + j] * xv;
            }
        }
        for y in o.iter_mut() {
            *y /= 1.0 + (-*y).exp();
        }
    }
    window.copy_from_slice(&all[rows * channels..]);
    out
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
                let kh = h / rep;
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
    fn the_convolution_continues_across_calls() {
        let (c, kern) = (3, 4);
        let x = rnd(7 * c, 9);
        let w = rnd(c * kern, 10);
        let mut win = vec![0f32; (kern - 1) * c];
        let whole = causal_conv1d_silu(&x, c, &w, kern, &mut win);
        let mut win2 = vec![0f32; (kern - 1) * c];
        let mut parts = causal_conv1d_silu(&x[..2 * c], c, &w, kern, &mut win2);
        parts.extend(causal_conv1d_silu(&x[2 * c..], c, &w, kern, &mut win2));
        assert_eq!(whole, parts);
        assert_eq!(win, win2);
        // Row 0 sees only itself: silu(w[c, last] * x[0, c]).
        let y = w[kern - 1] * x[0];
        assert!((whole[0] - y / (1.0 + (-y).exp())).abs() < 1e-6);
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
