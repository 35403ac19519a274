//! `delta`'s block step in `std::arch` intrinsics, one template for AVX-512 and AVX2 (LLVM,
//! left to vectorize the plain loop, turned its update pass into gathers across the block's
//! rows): a block of `COLS` value columns of a head's state, [k_dim, COLS], contiguous.

/// The state's value columns a block holds (`delta::COLS`, checked equal there).
pub(super) const COLS: usize = 32;

macro_rules! delta_block {
    ($name:ident, $simd:ident, $feature:literal, $rows:literal) => {
        pub(super) mod $name {
            use super::COLS;
            use crate::$simd as s;

            /// Vectors in a block's row.
            const NV: usize = COLS / s::LANES;

            /// One row (position) of the rule on a block `st` [k_dim, COLS]: with d = decay,
            /// a = S^T k and b = S^T q over the old state (`$rows` state rows a step, each into
            /// its own sums), delta = beta (v - d a), o = d b + (k . q) delta, S <- d S + k delta^T.
            ///
            /// # Safety
            /// The CPU has `$feature`; `st` holds `k.len() * COLS` floats, `q` as many as `k`,
            /// `v` and `o` `COLS`.
            #[target_feature(enable = $feature)]
            pub(in crate::kernels) unsafe fn block(
                st: &mut [f32],
                q: &[f32],
                k: &[f32],
                v: &[f32],
                (decay, beta, kq): (f32, f32, f32),
                o: &mut [f32],
            ) {
                let kd = k.len();
                debug_assert!(st.len() == kd * COLS && q.len() == kd && v.len() >= COLS && o.len() >= COLS);
                // SAFETY: every access below is inside `st` (row i < kd of COLS floats), `q`,
                // `k` (index i < kd), `v` and `o` (COLS floats), as the contract says.
                unsafe {
                    let p = st.as_mut_ptr();
                    let zero = s::splat(0.0);
                    let mut a = [[zero; NV]; $rows];
                    let mut b = [[zero; NV]; $rows];
                    let whole = kd / $rows * $rows;
                    let mut i = 0;
                    while i < whole {
                        for r in 0..$rows {
                            let (kk, qq) = (s::splat(*k.get_unchecked(i + r)), s::splat(*q.get_unchecked(i + r)));
                            for j in 0..NV {
                                let x = s::ld(p.add((i + r) * COLS + j * s::LANES));
                                a[r][j] = s::fmadd(kk, x, a[r][j]);
                                b[r][j] = s::fmadd(qq, x, b[r][j]);
                            }
                        }
                        i += $rows;
                    }
                    for i in whole..kd {
                        let (kk, qq) = (s::splat(k[i]), s::splat(q[i]));
                        for j in 0..NV {
                            let x = s::ld(p.add(i * COLS + j * s::LANES));
                            a[0][j] = s::fmadd(kk, x, a[0][j]);
                            b[0][j] = s::fmadd(qq, x, b[0][j]);
                        }
                    }
                    let (d, nd, bt, kqv) = (s::splat(decay), s::splat(-decay), s::splat(beta), s::splat(kq));
                    let mut delta = [zero; NV];
                    for j in 0..NV {
                        let (mut sa, mut sb) = (a[0][j], b[0][j]);
                        for (ar, br) in a.iter().zip(&b).skip(1) {
                            sa = s::add(sa, ar[j]);
                            sb = s::add(sb, br[j]);
                        }
                        delta[j] = s::mul(s::fmadd(nd, sa, s::ld(v.as_ptr().add(j * s::LANES))), bt);
                        s::st(o.as_mut_ptr().add(j * s::LANES), s::fmadd(d, sb, s::mul(kqv, delta[j])));
                    }
                    for i in 0..kd {
                        let kk = s::splat(*k.get_unchecked(i));
                        for j in 0..NV {
                            let at = p.add(i * COLS + j * s::LANES);
                            s::st(at, s::fmadd(d, s::ld(at), s::mul(kk, delta[j])));
                        }
                    }
                }
            }
        }
    };
}

delta_block!(avx2, avx2, "avx2,fma", 1);
#[cfg(not(vl_avx2_proxy))]
delta_block!(avx512, avx512, "avx512f", 2);
