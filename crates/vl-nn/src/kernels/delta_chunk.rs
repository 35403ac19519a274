//! `delta`'s rule for a prompt in transformers' chunked form (`torch_chunk_gated_delta_rule`):
//! per chunk of `CHUNK` positions the rows' updates are solved together and applied as matrix
//! products (`gemm`). With Gamma_i the chunk's cumulative log decay up to row i, A[i][j] =
//! beta_i (k_i . k_j) exp(Gamma_i - Gamma_j) for j < i, and S the state entering the chunk:
//!   (I + A) [U | W] = [beta V | beta exp(Gamma) K]   (forward substitution)
//!   V' = U - W S
//!   O  = (exp(Gamma) Q) S + P V',  P[i][j] = (q_i . k_j) exp(Gamma_i - Gamma_j), j <= i
//!   S  <- exp(Gamma_last) S + (exp(Gamma_last - Gamma) K)^T V'
//! The cumulative decays and their differences are taken in f64, so no digits are lost where
//! strong decays make the sums large (the reference's float32 cumsum loses them there).

/// Positions a chunk solves together (the reference's `chunk_size`).
pub(super) const CHUNK: usize = 64;

/// Rows the forward substitution solves one by one; the rows before them are applied as a
/// product.
const SOLVE: usize = 16;

/// Per-thread buffers of `chunk_head`.
#[derive(Default)]
pub(super) struct ChunkScratch {
    q: Vec<f32>,
    k: Vec<f32>,
    /// [U | W] rows, `v_dim + k_dim` wide.
    uw: Vec<f32>,
    kk: Vec<f32>,
    p: Vec<f32>,
    o: Vec<f32>,
    gam: Vec<f64>,
}

/// `dst` [m, n] (row-major, `dst_rs` apart) = `keep` dst + `scale` lhs [m, k] rhs [k, n], each
/// operand given by its row and column strides.
///
/// # Safety
/// Each pointer holds every element its strides reach for these sizes; `dst`'s elements are
/// this call's to write and overlap no element of `lhs` or `rhs` it reads.
#[allow(clippy::too_many_arguments)]
unsafe fn product(
    (m, n, k): (usize, usize, usize),
    dst: *mut f32,
    dst_rs: usize,
    keep: bool,
    (lhs, lhs_rs, lhs_cs): (*const f32, usize, usize),
    (rhs, rhs_rs, rhs_cs): (*const f32, usize, usize),
    scale: f32,
) {
    // SAFETY: this function's contract.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            dst_rs as isize,
            keep,
            lhs,
            lhs_cs as isize,
            lhs_rs as isize,
            rhs,
            rhs_cs as isize,
            rhs_rs as isize,
            1.0,
            scale,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}

/// The rule over `n` rows of one head in chunks: `q`, `k` rows `kw` apart (the head's key at
/// the start of each), `v` rows `vw` apart, `g` and `beta` rows `gw` apart, the head's state
/// `st` [kd, vd] updated in place, the outputs written `vw` apart from `out`.
///
/// # Safety
/// `out` is writable, by this call alone, for `vd` floats at each of the `n` rows `vw` apart;
/// `q`, `k` hold `n` rows of `kw` (at least `kd`), `v` of `vw` (at least `vd`), `g` and `beta`
/// of `gw`, and `st` `kd * vd` floats.
#[allow(clippy::too_many_arguments)]
#[multiversion::multiversion(targets = "simd")]
pub(super) unsafe fn chunk_head(
    st: &mut [f32],
    (kd, vd): (usize, usize),
    n: usize,
    (q, k, kw): (&[f32], &[f32], usize),
    (v, vw): (&[f32], usize),
    (g, beta, gw): (&[f32], &[f32], usize),
    sc: &mut ChunkScratch,
    out: *mut f32,
) {
    let uw_w = vd + kd;
    let mut t0 = 0;
    while t0 < n {
        let c = CHUNK.min(n - t0);
        // The chunk's keys and queries, contiguous [c, kd]; the right-hand sides [beta v |
        // beta exp(Gamma) k] [c, vd + kd]; the cumulative decays.
        sc.q.clear();
        sc.k.clear();
        sc.uw.clear();
        sc.gam.clear();
        let mut acc = 0f64;
        for i in 0..c {
            let t = t0 + i;
            sc.q.extend_from_slice(&q[t * kw..][..kd]);
            sc.k.extend_from_slice(&k[t * kw..][..kd]);
            acc += g[t * gw] as f64;
            sc.gam.push(acc);
        }
        for i in 0..c {
            let t = t0 + i;
            let b = beta[t * gw];
            let e = (b as f64 * sc.gam[i].exp()) as f32;
            sc.uw.extend(v[t * vw..][..vd].iter().map(|x| x * b));
            sc.uw.extend(sc.k[i * kd..][..kd].iter().map(|x| x * e));
        }
        // K K^T and Q K^T [c, c].
        sc.kk.resize(c * c, 0.0);
        sc.p.resize(c * c, 0.0);
        let kt = (sc.k.as_ptr(), 1, kd);
        // SAFETY: the chunk's buffers hold these sizes; `dst` is disjoint from what it reads.
        unsafe { product((c, c, kd), sc.kk.as_mut_ptr(), c, false, (sc.k.as_ptr(), kd, 1), kt, 1.0) };
        // SAFETY: the chunk's buffers hold these sizes; `dst` is disjoint from what it reads.
        unsafe { product((c, c, kd), sc.p.as_mut_ptr(), c, false, (sc.q.as_ptr(), kd, 1), kt, 1.0) };
        for i in 0..c {
            let b = beta[(t0 + i) * gw];
            for j in 0..=i {
                let d = (sc.gam[i] - sc.gam[j]).exp() as f32;
                sc.p[i * c + j] *= d;
                sc.kk[i * c + j] *= if j < i { b * d } else { 0.0 };
            }
            sc.p[i * c + i + 1..(i + 1) * c].iter_mut().for_each(|x| *x = 0.0);
            sc.kk[i * c + i..(i + 1) * c].iter_mut().for_each(|x| *x = 0.0);
        }
        // Forward substitution, `SOLVE` rows at a time: the rows before a block are subtracted
        // from it as one product, then its own rows one by one (row i -= A[i][j] row j).
        let mut r0 = 0;
        while r0 < c {
            let r1 = (r0 + SOLVE).min(c);
            if r0 > 0 {
                let uw = sc.uw.as_mut_ptr();
                // SAFETY (offset): row r0 of [U | W], inside the c rows.
                let dst = unsafe { uw.add(r0 * uw_w) };
                // SAFETY (offset): row r0 of A, inside the c x c floats.
                let lhs = unsafe { sc.kk.as_ptr().add(r0 * c) };
                // SAFETY: the chunk's buffers hold these sizes; `dst` is disjoint from what it reads.
                unsafe {
                    product((r1 - r0, uw_w, r0), dst, uw_w, true, (lhs, c, 1), (uw as *const f32, uw_w, 1), -1.0)
                };
            }
            for i in r0 + 1..r1 {
                let (done, rest) = sc.uw.split_at_mut(i * uw_w);
                let row = &mut rest[..uw_w];
                for (j, prev) in done.chunks_exact(uw_w).enumerate().skip(r0) {
                    let a = sc.kk[i * c + j];
                    for (x, &y) in row.iter_mut().zip(prev) {
                        *x -= a * y;
                    }
                }
            }
            r0 = r1;
        }
        // V' = U - W S, in U's place.
        let uw = sc.uw.as_mut_ptr();
        // SAFETY (pointer offsets): W starts vd floats into each [U | W] row.
        let w_ptr = unsafe { uw.add(vd) } as *const f32;
        // SAFETY: the chunk's buffers hold these sizes; `dst` is disjoint from what it reads.
        unsafe { product((c, vd, kd), uw, uw_w, true, (w_ptr, uw_w, 1), (st.as_ptr(), vd, 1), -1.0) };
        // O = (exp(Gamma) Q) S + P V'.
        for (i, row) in sc.q.chunks_exact_mut(kd).enumerate() {
            let e = sc.gam[i].exp() as f32;
            row.iter_mut().for_each(|x| *x *= e);
        }
        sc.o.resize(c * vd, 0.0);
        // SAFETY: the chunk's buffers hold these sizes; `dst` is disjoint from what it reads.
        unsafe {
            product((c, vd, kd), sc.o.as_mut_ptr(), vd, false, (sc.q.as_ptr(), kd, 1), (st.as_ptr(), vd, 1), 1.0)
        };
        // SAFETY: the chunk's buffers hold these sizes; `dst` is disjoint from what it reads.
        unsafe {
            product((c, vd, c), sc.o.as_mut_ptr(), vd, true, (sc.p.as_ptr(), c, 1), (uw as *const f32, uw_w, 1), 1.0)
        };
        // S <- exp(Gamma_last) S + (exp(Gamma_last - Gamma) K)^T V'.
        let last = sc.gam[c - 1];
        for (i, row) in sc.k.chunks_exact_mut(kd).enumerate() {
            let e = (last - sc.gam[i]).exp() as f32;
            row.iter_mut().for_each(|x| *x *= e);
        }
        let e = last.exp() as f32;
        st.iter_mut().for_each(|x| *x *= e);
        // SAFETY: the chunk's buffers hold these sizes; `dst` is disjoint from what it reads.
        unsafe {
            product((kd, vd, c), st.as_mut_ptr(), vd, true, (sc.k.as_ptr(), 1, kd), (uw as *const f32, uw_w, 1), 1.0)
        };
        for (i, o) in sc.o.chunks_exact(vd).enumerate() {
            // SAFETY: the caller's output row t0 + i of this head, vd floats.
            unsafe { std::ptr::copy_nonoverlapping(o.as_ptr(), out.add((t0 + i) * vw), vd) };
        }
        t0 += c;
    }
}
