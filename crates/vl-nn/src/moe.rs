//! A sparse mixture-of-experts MLP: a router picks `top_k` SwiGLU experts per token.
//!
//! Routing is the one of Qwen3-MoE style models in transformers: softmax over the router's
//! logits (in f32), the `top_k` largest probabilities, renormalized to sum to one, cast to the
//! activations' dtype. Then the rows are grouped by expert: each active expert multiplies only the
//! rows routed to it (one product per expert, its weights read once, quantized as stored), and
//! its outputs, scaled by their routing weights, are added into those rows. An expert no row
//! chose costs nothing, so a decode step reads only the active experts' weights.

use candle_core::{DType, Tensor};

use crate::error::{Error, Result};
use crate::linear::QLinear;

/// One expert: `down(silu(gate(x)) * up(x))`.
#[derive(Debug, Clone)]
pub struct SwiGluExpert {
    pub gate: QLinear,
    pub up: QLinear,
    pub down: QLinear,
}

impl SwiGluExpert {
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = crate::kernels::silu_mul(&self.gate.forward(x)?, &self.up.forward(x)?)?;
        self.down.forward(&h)
    }

    /// `forward` on the quantized weights' compact blocks as stored
    /// (`QLinear::forward_compact`): no repacked second copy of the expert.
    pub fn forward_compact(&self, x: &Tensor) -> Result<Tensor> {
        let h = crate::kernels::silu_mul(&self.gate.forward_compact(x)?, &self.up.forward_compact(x)?)?;
        self.down.forward_compact(&h)
    }

    /// Bytes held by the expert's weights.
    pub fn weight_bytes(&self) -> usize {
        self.gate.weight_bytes() + self.up.weight_bytes() + self.down.weight_bytes()
    }
}

#[derive(Debug, Clone)]
pub struct SparseMoe {
    /// [experts, hidden], kept dense (it is small and the routing is sensitive to it).
    router: Tensor,
    experts: Vec<SwiGluExpert>,
    top_k: usize,
    /// Experts multiply their compact blocks (`SwiGluExpert::forward_compact`).
    compact: bool,
    /// Experts with at most this many rows in a call take the stored blocks (`forward_stored`).
    stored_rows: usize,
}

/// Rows an expert may have in one call for its products to run on the stored blocks in pieces
/// of 4 (`SparseMoe::set_stored_rows`), where the CPU lacks AVX-512 VNNI. A prompt's chunk of 256
/// rows routes ~16 to an expert on average (top 8 of 128): such experts read their weights once
/// per 4 rows from cache, where candle would first repack each one it meets (a second copy, made
/// in the cold process that answers once). The hot experts above this still take candle's
/// tiles. Measured on llama.cpp's 8-layer 30B-A3B-width Q4_K_M (docs/moe.md): 200-token prompt,
/// cold, 2.9-7.4 s of prefill at 4 (decode-sized only) against 1.1 s at 64, peak RSS 2.72 ->
/// 1.90 GiB; 2000 tokens 11.6 s at 4, 9.3-9.6 at 32 to 128, 11.4 with every expert stored.
pub(crate) const DEFAULT_STORED_ROWS: usize = 64;

/// `DEFAULT_STORED_ROWS` where the CPU has AVX-512 VNNI: experts above it multiply their stored
/// blocks too (`stored_tiles`, weights read once for all their rows), so the pieces of 4 pay
/// only for the coolest. Same file, old/new alternating, 2 rounds, prefill (s): 200 tokens
/// 1.00 / 1.02 at 64, 0.91 / 0.91 at 16, 0.92 / 0.97 at 4; 2000 tokens 9.57 / 9.34, 9.11 / 9.06,
/// 9.06 / 9.11.
pub(crate) const DEFAULT_STORED_ROWS_VNNI: usize = 16;

/// The stored-rows limit for this CPU: `DEFAULT_STORED_ROWS_VNNI` or `DEFAULT_STORED_ROWS`.
pub fn default_stored_rows() -> usize {
    if crate::stored_tiles::available() {
        DEFAULT_STORED_ROWS_VNNI
    } else {
        DEFAULT_STORED_ROWS
    }
}

/// Each row's experts and their weights, in the order of decreasing probability.
pub(crate) type Routes = Vec<Vec<(usize, f32)>>;

impl SparseMoe {
    pub fn new(router: Tensor, experts: Vec<SwiGluExpert>, top_k: usize) -> Result<Self> {
        let (e, _) = router.dims2()?;
        if e != experts.len() || top_k == 0 || top_k > e {
            return Err(Error::Shape {
                layer: "SparseMoe",
                message: format!("router of {e} experts, {} experts, top_k {top_k}", experts.len()),
            });
        }
        Ok(Self { router, experts, top_k, compact: false, stored_rows: default_stored_rows() })
    }

    /// Whether the experts multiply their compact blocks as stored instead of candle's repacked
    /// tiles (which candle makes on a quantized weight's first product and keeps beside it).
    pub fn set_compact(&mut self, compact: bool) {
        self.compact = compact;
    }

    /// Experts with at most `rows` rows in a call multiply their stored blocks without
    /// repacking (where `stored::available()` and the blocks are Q4_K / Q6_K); 0 sends every
    /// expert of a prompt through `SwiGluExpert::forward` / `forward_compact` (candle's
    /// products; on AVX-512 VNNI CPUs `stored_tiles`, so there the compact and repacked settings
    /// multiply alike and the test comparing them compares one kernel with itself). A decode step's few rows (up to
    /// `stored::SMALL_ROWS` in all) take the stored blocks whatever this says.
    /// `default_stored_rows()` by default.
    pub fn set_stored_rows(&mut self, rows: usize) {
        self.stored_rows = rows;
    }

    pub fn experts(&self) -> &[SwiGluExpert] {
        &self.experts
    }

    pub fn top_k(&self) -> usize {
        self.top_k
    }

    /// The routes of `x` [rows, hidden]: softmax in f32, top-k, renormalized.
    pub fn route(&self, x: &Tensor) -> Result<Routes> {
        let logits = x.to_dtype(DType::F32)?.matmul(&self.router.to_dtype(DType::F32)?.t()?)?;
        let probs = candle_nn::ops::softmax_last_dim(&logits)?.to_vec2::<f32>()?;
        Ok(probs.iter().map(|p| top_k(p, self.top_k)).collect())
    }

    /// `x` [..., hidden] through the routed experts.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let shape = x.shape().clone();
        let hidden = *shape
            .dims()
            .last()
            .ok_or_else(|| Error::Shape { layer: "SparseMoe", message: "a scalar input".into() })?;
        let rows = x.reshape(((), hidden))?;
        let routes = self.route(&rows)?;
        // The rows of each expert, and their weights.
        let mut by_expert: Vec<(Vec<u32>, Vec<f32>)> = vec![(vec![], vec![]); self.experts.len()];
        for (r, route) in routes.iter().enumerate() {
            for &(e, w) in route {
                by_expert[e].0.push(r as u32);
                by_expert[e].1.push(w);
            }
        }
        // Experts with few rows (every expert of a decode step, most of a prompt's) take the
        // stored blocks, all in two parallel regions, never repacked; the rest candle's tiles.
        let n_rows = rows.dim(0)?;
        let stored_path = rows.dtype() == DType::F32 && rows.device().is_cpu() && crate::stored::available();
        let mut most = match (stored_path, n_rows <= crate::stored::SMALL_ROWS) {
            (false, _) => 0,
            // A decode step's few rows always, drafted tokens being verified with them
            // (`QLinear::forward` takes them there too).
            (true, true) => usize::MAX,
            (true, false) => self.stored_rows,
        };
        let pick: Vec<usize> = (0..by_expert.len()).filter(|&e| (1..=most).contains(&by_expert[e].0.len())).collect();
        let stored = match pick.is_empty() {
            true => None,
            false => self.forward_stored(&rows, &by_expert, &pick)?,
        };
        if stored.is_none() {
            most = 0;
        }
        let rest: Vec<usize> = (0..by_expert.len()).filter(|&e| by_expert[e].0.len() > most).collect();
        let mut out = match stored {
            Some(out) if rest.is_empty() => return Ok(Tensor::from_vec(out, shape, x.device())?),
            Some(out) => Tensor::from_vec(out, (n_rows, hidden), x.device())?,
            None => rows.zeros_like()?,
        };
        for e in rest {
            let (idx, w) = &by_expert[e];
            let n = idx.len();
            let ids = Tensor::from_vec(idx.clone(), n, x.device())?;
            let xs = rows.index_select(&ids, 0)?;
            let ex = &self.experts[e];
            let y = if self.compact { ex.forward_compact(&xs)? } else { ex.forward(&xs)? };
            // The weights in the activations' dtype, as transformers casts them.
            let w = Tensor::from_vec(w.clone(), (n, 1), x.device())?.to_dtype(y.dtype())?;
            out = out.index_add(&ids, &y.broadcast_mul(&w)?, 0)?;
        }
        Ok(out.reshape(shape)?)
    }

    /// The experts `pick` (each with at least one row) of `forward` on their stored Q4_K / Q6_K
    /// blocks in two parallel regions for the whole layer (`stored::matmul_each`): every picked
    /// expert's gate and up products, then every down product, each expert on its own rows in
    /// pieces of up to `stored::MAX_ROWS` (each piece re-reads the expert's rows of weights,
    /// from cache after the first). The same arithmetic as the compact per-expert path (each row
    /// quantized alike, the same kernels, the experts' outputs added in the same order), without
    /// a region and a dozen tensor ops per expert, and without candle's repacked copy. Returns
    /// their weighted sum for every row; None where it does not apply (other block types, no
    /// kernel).
    fn forward_stored(
        &self,
        rows: &Tensor,
        by_expert: &[(Vec<u32>, Vec<f32>)],
        pick: &[usize],
    ) -> Result<Option<Vec<f32>>> {
        let (n_rows, hidden) = rows.dims2()?;
        if !crate::stored::available() {
            return Ok(None);
        }
        let mut gate_up = Vec::with_capacity(2 * pick.len());
        let mut downs = Vec::with_capacity(pick.len());
        for &e in pick {
            let ex = &self.experts[e];
            let (Some(g), Some(u), Some(d)) = (ex.gate.stored_bytes()?, ex.up.stored_bytes()?, ex.down.stored_bytes()?)
            else {
                return Ok(None);
            };
            gate_up.push((g, u));
            downs.push(d);
        }
        let inter = match gate_up.first() {
            Some(((_, _, n), _)) => *n,
            None => return Ok(Some(vec![0f32; n_rows * hidden])),
        };
        if gate_up.iter().any(|((_, _, g), (_, _, u))| *g != inter || *u != inter)
            || downs.iter().any(|(_, _, n)| *n != hidden)
        {
            return Ok(None);
        }
        // Pieces: (index into `pick`, first of the expert's rows, rows).
        let pieces: Vec<(usize, usize, usize)> = pick
            .iter()
            .enumerate()
            .flat_map(|(i, &e)| {
                let n = by_expert[e].0.len();
                (0..n).step_by(crate::stored::MAX_ROWS).map(move |s| (i, s, (n - s).min(crate::stored::MAX_ROWS)))
            })
            .collect();
        let xs = rows.flatten_all()?.to_vec1::<f32>()?;
        // Each piece's rows, gathered.
        let gathered: Vec<Vec<f32>> = pieces
            .iter()
            .map(|&(i, s, m)| {
                by_expert[pick[i]].0[s..s + m]
                    .iter()
                    .flat_map(|&r| &xs[r as usize * hidden..(r as usize + 1) * hidden])
                    .copied()
                    .collect()
            })
            .collect();
        let inputs: Vec<(&[f32], usize)> = pieces.iter().zip(&gathered).map(|(p, x)| (x.as_slice(), p.2)).collect();
        let weights: Vec<_> = pieces
            .iter()
            .enumerate()
            .flat_map(|(j, &(i, _, _))| {
                let ((gk, gb, gn), (uk, ub, un)) = &gate_up[i];
                [(*gk, gb.as_ref(), *gn, j), (*uk, ub.as_ref(), *un, j)]
            })
            .collect();
        let Some(products) = crate::stored::matmul_each(&weights, &inputs, hidden) else { return Ok(None) };
        // silu(gate) * up, as candle's silu computes it.
        let hs: Vec<Vec<f32>> = products
            .chunks_exact(2)
            .map(|p| p[0].iter().zip(&p[1]).map(|(&g, &u)| g / ((-g).exp() + 1.0) * u).collect())
            .collect();
        let inputs: Vec<(&[f32], usize)> = hs.iter().zip(&pieces).map(|(h, p)| (h.as_slice(), p.2)).collect();
        let weights: Vec<_> = pieces
            .iter()
            .enumerate()
            .map(|(j, &(i, _, _))| {
                let (k, b, n) = &downs[i];
                (*k, b.as_ref(), *n, j)
            })
            .collect();
        let Some(ys) = crate::stored::matmul_each(&weights, &inputs, inter) else { return Ok(None) };
        let mut out = vec![0f32; n_rows * hidden];
        for (&(i, s, m), y) in pieces.iter().zip(&ys) {
            let (idx, w) = &by_expert[pick[i]];
            for (j, (&r, &w)) in idx[s..s + m].iter().zip(&w[s..s + m]).enumerate() {
                let dst = &mut out[r as usize * hidden..(r as usize + 1) * hidden];
                for (o, v) in dst.iter_mut().zip(&y[j * hidden..(j + 1) * hidden]) {
                    *o += v * w;
                }
            }
        }
        Ok(Some(out))
    }
}

/// The `k` largest of `p` (ties to the lower index, as `torch.topk` on distinct values), their
/// weights divided by their sum.
fn top_k(p: &[f32], k: usize) -> Vec<(usize, f32)> {
    let mut idx: Vec<usize> = (0..p.len()).collect();
    idx.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
    idx.truncate(k);
    let sum: f32 = idx.iter().map(|&i| p[i]).sum();
    idx.into_iter().map(|i| (i, p[i] / sum)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn top_k_renormalizes_the_largest() {
        let r = top_k(&[0.1, 0.4, 0.2, 0.3], 2);
        assert_eq!(r.iter().map(|x| x.0).collect::<Vec<_>>(), [1, 3]);
        assert!((r[0].1 - 0.4 / 0.7).abs() < 1e-6 && (r[1].1 - 0.3 / 0.7).abs() < 1e-6);
    }

    /// Quantized experts on their compact blocks: for the k-quants the same rows as through
    /// candle's repacked tiles (both quantize the activations per 256 values; only the summation
    /// order differs); for Q8_0 (compact: activations per 32 values, repacked: per 256) both stay
    /// close to the product of the dequantized weights in f32. Decode (1 row) and prefill (33 rows:
    /// candle's AMX path where the CPU has it) sizes.
    #[test]
    fn compact_experts_match_the_repacked_path() {
        use crate::QuantType;
        let dev = Device::Cpu;
        let (h, i, e) = (256, 256, 4);
        for q in [QuantType::Q4K, QuantType::Q6K, QuantType::Q8_0] {
            let lin = |o: usize, n: usize, s: u64| {
                let w = crate::testing::randn(s, 0.1, (o, n)).unwrap();
                QLinear::new(candle_nn::Linear::new(w, None), Some(q)).unwrap()
            };
            let experts: Vec<SwiGluExpert> = (0..e as u64)
                .map(|s| SwiGluExpert { gate: lin(i, h, 10 + s), up: lin(i, h, 20 + s), down: lin(h, i, 30 + s) })
                .collect();
            // The same experts with their weights dequantized: the definition, in f32.
            let exact = |l: &QLinear| match l {
                QLinear::Quant { w: candle_core::quantized::QMatMul::QTensor(t), .. } => {
                    QLinear::Dense(candle_nn::Linear::new(t.dequantize(&dev).unwrap(), None))
                }
                _ => unreachable!("quantized above"),
            };
            let dense: Vec<SwiGluExpert> = experts
                .iter()
                .map(|x| SwiGluExpert { gate: exact(&x.gate), up: exact(&x.up), down: exact(&x.down) })
                .collect();
            let router = crate::testing::randn(7, 1.0, (e, h)).unwrap();
            let mut moe = SparseMoe::new(router.clone(), experts, 2).unwrap();
            let reference = SparseMoe::new(router, dense, 2).unwrap();
            for rows in [1, 33] {
                let x = crate::testing::randn(8 + rows as u64, 1.0, (rows, h)).unwrap();
                let run = |m: &SparseMoe| m.forward(&x).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
                let want = run(&reference);
                moe.set_compact(false);
                let repacked = run(&moe);
                moe.set_compact(true);
                let compact = run(&moe);
                let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
                let diff = |a: &[f32], b: &[f32]| a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
                let (dc, dr) = (diff(&compact, &want), diff(&repacked, &want));
                println!("{q:?} {rows} rows: compact {dc:.2e}, repacked {dr:.2e} of {scale:.2}");
                assert!(
                    scale > 0.1 && dc <= 0.03 * scale && dr <= 0.03 * scale,
                    "{q:?}, {rows} rows: {dc} / {dr} of {scale}"
                );
                if q != QuantType::Q8_0 {
                    let d = diff(&compact, &repacked);
                    assert!(d <= 1e-4 * scale.max(1.0), "{q:?}, {rows} rows: compact vs repacked {d} (scale {scale})");
                }
            }
        }
    }

    /// A decode step's few rows through the fused stored-block path (two parallel regions a
    /// layer) give what each row gets through its own experts one by one on the same blocks
    /// (`SwiGluExpert::forward_compact`), weighted and summed: Q4_K gate/up with Q6_K or Q4_K
    /// down, as llama.cpp's Q4_K_M stores experts, for 1 to 4 rows (rows sharing experts); and a
    /// prompt's 13 and 40 rows, the experts with few rows on the stored blocks in pieces of 4,
    /// the others through candle's products.
    #[test]
    fn fused_decode_experts_equal_each_expert_alone() {
        use crate::QuantType;
        if !crate::stored::available() {
            eprintln!("no AVX2 here: the fused path is not taken, nothing to compare");
            return;
        }
        let (h, i, e) = (512, 256, 8);
        for down_q in [QuantType::Q6K, QuantType::Q4K] {
            let lin = |o: usize, n: usize, s: u64, q| {
                let w = crate::testing::randn(s, 0.1, (o, n)).unwrap();
                QLinear::new(candle_nn::Linear::new(w, None), Some(q)).unwrap()
            };
            let experts: Vec<SwiGluExpert> = (0..e as u64)
                .map(|s| SwiGluExpert {
                    gate: lin(i, h, 40 + s, QuantType::Q4K),
                    up: lin(i, h, 50 + s, QuantType::Q4K),
                    down: lin(h, i, 60 + s, down_q),
                })
                .collect();
            let router = crate::testing::randn(9, 1.0, (e, h)).unwrap();
            let mut moe = SparseMoe::new(router, experts.clone(), 3).unwrap();
            moe.set_compact(true);
            for rows in (1..=crate::stored::MAX_ROWS).chain([13, crate::stored::SMALL_ROWS, 40]) {
                let x = crate::testing::randn(70 + rows as u64, 1.0, (rows, h)).unwrap();
                let routes = moe.route(&x).unwrap();
                let mut by_expert: Vec<(Vec<u32>, Vec<f32>)> = vec![(vec![], vec![]); e];
                for (r, route) in routes.iter().enumerate() {
                    for &(ex, w) in route {
                        by_expert[ex].0.push(r as u32);
                        by_expert[ex].1.push(w);
                    }
                }
                let pick: Vec<usize> = (0..e).filter(|&ex| !by_expert[ex].0.is_empty()).collect();
                let fused = if rows <= crate::stored::SMALL_ROWS {
                    let fused = moe.forward_stored(&x, &by_expert, &pick).unwrap().expect("the fused path applies");
                    assert_eq!(moe.forward(&x).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap(), fused);
                    fused
                } else {
                    // A prompt's rows: experts up to the median count of rows on the stored blocks
                    // (in pieces of MAX_ROWS), the others through candle's products.
                    let mut counts: Vec<usize> = pick.iter().map(|&ex| by_expert[ex].0.len()).collect();
                    counts.sort();
                    let limit = counts[counts.len() / 2];
                    assert!(limit > crate::stored::MAX_ROWS && counts[counts.len() - 1] > limit, "{counts:?}");
                    moe.set_stored_rows(limit);
                    moe.forward(&x).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()
                };
                let mut max = 0f32;
                for (r, route) in routes.iter().enumerate() {
                    let row = x.narrow(0, r, 1).unwrap();
                    let mut want = vec![0f32; h];
                    let mut sorted = route.clone();
                    sorted.sort_by_key(|&(ex, _)| ex);
                    for (ex, w) in sorted {
                        let y =
                            experts[ex].forward_compact(&row).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
                        for (a, b) in want.iter_mut().zip(&y) {
                            *a += b * w;
                        }
                    }
                    // A prompt's rows add the stored experts' outputs first, then the others':
                    // the order of a row's few f32 sums differs, so a few ulp.
                    let tol = if rows <= crate::stored::SMALL_ROWS { 1e-6 } else { 1e-5 };
                    for (a, b) in fused[r * h..(r + 1) * h].iter().zip(&want) {
                        max = max.max(b.abs());
                        assert!(
                            (a - b).abs() <= tol * b.abs().max(1.0),
                            "{down_q:?}, {rows} rows, row {r}: {a} vs {b}"
                        );
                    }
                }
                assert!(max > 0.1, "outputs too small to compare: {max}");
            }
        }
    }

    /// Grouped by expert equals each row through its own experts, weighted (computed directly).
    #[test]
    fn grouped_rows_equal_each_row_through_its_experts() {
        let dev = Device::Cpu;
        let (h, i, e) = (8, 6, 4);
        let lin = |o: usize, n: usize, s: u64| {
            let v: Vec<f32> = (0..o * n).map(|j| (((j as u64 * 2654435761 + s) % 1000) as f32 / 500.0) - 1.0).collect();
            QLinear::Dense(candle_nn::Linear::new(Tensor::from_vec(v, (o, n), &dev).unwrap(), None))
        };
        let experts: Vec<SwiGluExpert> = (0..e as u64)
            .map(|s| SwiGluExpert { gate: lin(i, h, s), up: lin(i, h, s + 10), down: lin(h, i, s + 20) })
            .collect();
        let router: Vec<f32> = (0..e * h).map(|j| ((j * 37 % 11) as f32 - 5.0) / 4.0).collect();
        let moe = SparseMoe::new(Tensor::from_vec(router, (e, h), &dev).unwrap(), experts.clone(), 2).unwrap();
        let xs: Vec<f32> = (0..5 * h).map(|j| ((j * 13 % 17) as f32 - 8.0) / 8.0).collect();
        let x = Tensor::from_vec(xs, (5, h), &dev).unwrap();
        let got = moe.forward(&x).unwrap().to_vec2::<f32>().unwrap();
        let routes = moe.route(&x).unwrap();
        for (r, route) in routes.iter().enumerate() {
            assert_eq!(route.len(), 2);
            let row = x.narrow(0, r, 1).unwrap();
            let mut want = vec![0f32; h];
            for &(ex, w) in route {
                let y = experts[ex].forward(&row).unwrap().to_vec2::<f32>().unwrap();
                for (a, b) in want.iter_mut().zip(&y[0]) {
                    *a += w * b;
                }
            }
            for (a, b) in got[r].iter().zip(&want) {
                assert!((a - b).abs() < 1e-5, "row {r}: {a} vs {b}");
            }
        }
    }
}
