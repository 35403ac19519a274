//! `Dense`: a float layer `y = x W^T + b` with its CPU f32 products in tiles (gemm from the bias
//! rows, AVX2 panels, or AMX bf16 tiles) and an op taken on each tile as it is written (`Then`).

use candle_core::{DType, Tensor};
use candle_nn::Linear;

use crate::cpu::{cpu_f32, SendPtr};
use crate::dispatch::{own_kernel, own_kernel_for, DeviceKind, Op};
use crate::{Error, Result};

/// What `Dense::forward_then` applies to the product `x W^T + b`: on the CPU f32 path to each
/// output tile right after it is computed, while it is still in cache, instead of in a separate
/// pass over the whole output (and a second output buffer, for `Add`); elsewhere as the plain op.
/// The values are the same either way: each op runs on the finished product.
#[derive(Debug, Clone, Copy)]
pub enum Then<'a> {
    /// The product itself (`Dense::forward`).
    Nothing,
    /// The tanh-approximated GELU of every value (`kernels::gelu_tanh_tensor`).
    GeluTanh,
    /// `r + (x W^T + b)`, `r` shaped like the output (a residual connection).
    Add(&'a Tensor),
}

/// A dense layer `y = x W^T + b` whose CPU f32 forward needs no separate bias pass (candle's
/// broadcast add cost a third of a vision linear's time) and no per-call copy of the weights.
/// The weights are kept in one of two layouts, chosen at load:
/// - `W^T` ([in, out], contiguous; transposed once at load): one `gemm` call per output tile
///   starting from the bias rows (other devices and dtypes run candle's matmul and add);
/// - on CPUs whose widest vectors are AVX2 (`panels::preferred`), 16-column panels
///   (`vl_nn::panels`), read by an AVX2 micro-kernel against the activations packed per call
///   in chunks of rows (`panels::pack_rows`);
/// - asked for with `to_bf16` (reduced precision, CPUs with AMX-BF16): bf16 pairs in 32-column
///   panels (`amx`), the activations rounded to bf16 as they are packed per call, f32
///   sums.
#[derive(Debug, Clone)]
pub struct Dense {
    /// `W^T` [in, out], the panels [ceil(out / 16), in, 16], or the bf16 pairs (u32)
    /// [ceil(out / 32), ceil(in / 2), 32].
    w: Tensor,
    panels: bool,
    bf16: bool,
    bias: Option<Tensor>,
    /// (in, out) features.
    dims: (usize, usize),
}

impl Dense {
    /// The layout this CPU runs fastest (panels on AVX2-only x86_64 for weights in memory).
    pub fn from_linear(l: &Linear) -> Result<Self> {
        let w = l.weight();
        let panels = own_kernel(Op::PanelPacking, DeviceKind::of(w.device()), w.dtype()) && crate::panels::preferred();
        Self::from_linear_as(l, panels)
    }

    /// With the weights in 16-column panels (`panels`, CPU tensors of a float dtype only) or as
    /// `W^T`. The panels need `panels::available()` to run fast; elsewhere they are unpacked
    /// for every call.
    pub fn from_linear_as(l: &Linear, panels: bool) -> Result<Self> {
        let (n, k) = l.weight().dims2()?;
        let w = if panels { pack_panels(l.weight())? } else { None };
        let panels = w.is_some();
        let w = match w {
            Some(w) => w,
            None => crate::kernels::transpose(l.weight())?,
        };
        Ok(Self { w, panels, bf16: false, bias: l.bias().cloned(), dims: (k, n) })
    }

    /// The same layer computing with bf16 operands (`amx`): the weights rounded to bf16
    /// once, here, the activations at each call, sums in f32; the bias stays f32. For CPU f32
    /// compute on CPUs where `amx::products_available()` (AMX tiles, else AVX512-BF16); elsewhere
    /// an error naming what is missing.
    pub fn to_bf16(&self) -> Result<Self> {
        if self.bf16 {
            return Ok(self.clone());
        }
        let unsupported = |why: &str| Error::Unsupported(format!("bf16 products: {why}"));
        if !crate::amx::products_available() {
            return Err(unsupported(
                "they need AVX512-BF16 (AMD Zen 4 and later, Intel Cooper Lake) or AMX-BF16 tiles granted by Linux (Intel Xeon since Sapphire Rapids) on x86_64; this CPU or OS has neither",
            ));
        }
        if !self.w.device().is_cpu() {
            return Err(unsupported("they run on the CPU only"));
        }
        let (k, n) = self.dims;
        // W^T [in, out], read in its own float dtype (widened exactly as it is packed).
        let wt = self.w_t()?.contiguous()?;
        let (s, l) = wt.storage_and_layout();
        let candle_core::Storage::Cpu(cpu) = &*s else {
            return Err(unsupported("the weights are not on the CPU"));
        };
        let o = l.start_offset();
        let packed = match wt.dtype() {
            DType::F32 => crate::amx::pack_weights_t(&cpu.as_slice::<f32>()?[o..][..k * n], n, k),
            DType::F16 => crate::amx::pack_weights_t(&cpu.as_slice::<half::f16>()?[o..][..k * n], n, k),
            DType::BF16 => crate::amx::pack_weights_t(&cpu.as_slice::<half::bf16>()?[o..][..k * n], n, k),
            d => return Err(unsupported(&format!("weights in {d:?}"))),
        };
        let shape = crate::amx::packed_weight_shape(n, k);
        Ok(Self {
            w: Tensor::from_vec(packed, shape, self.w.device())?,
            panels: false,
            bf16: true,
            bias: self.bias.as_ref().map(|b| b.to_dtype(DType::F32)).transpose()?,
            dims: self.dims,
        })
    }

    /// Whether the layer computes with bf16 operands (`to_bf16`).
    pub fn is_bf16(&self) -> bool {
        self.bf16
    }

    /// Whether the weights are in panels.
    pub fn is_panels(&self) -> bool {
        self.panels
    }

    /// The same layer with its parameters in `dtype` (layout kept; bf16 products keep their
    /// packed weights and f32 bias: they take f32 activations whatever `dtype` says).
    pub fn to_dtype(&self, dtype: DType) -> Result<Self> {
        if self.bf16 {
            return Ok(self.clone());
        }
        Ok(Self {
            w: crate::widen::to_dtype(&self.w, dtype)?,
            bias: self.bias.as_ref().map(|b| crate::widen::to_dtype(b, dtype)).transpose()?,
            ..self.clone()
        })
    }

    /// (in, out) features.
    pub fn dims(&self) -> Result<(usize, usize)> {
        Ok(self.dims)
    }

    /// `W^T` [in, out] (a copy when the weights are in panels).
    fn w_t(&self) -> Result<Tensor> {
        let (k, n) = self.dims;
        if !self.panels {
            return Ok(self.w.clone());
        }
        let p = n.div_ceil(crate::panels::WIDTH);
        Ok(self
            .w
            .permute((1, 0, 2))?
            .contiguous()?
            .reshape((k, p * crate::panels::WIDTH))?
            .narrow(1, 0, n)?
            .contiguous()?)
    }

    /// The output's dims for an input `x`: its own, the last one `out`.
    fn out_dims(&self, x: &Tensor) -> Vec<usize> {
        let mut dims = x.dims().to_vec();
        if let Some(last) = dims.last_mut() {
            *last = self.dims.1;
        }
        dims
    }

    /// `x`: [..., in] -> [..., out].
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_then(x, Then::Nothing)
    }

    /// `then` applied to `forward(x)`.
    pub fn forward_then(&self, x: &Tensor, then: Then<'_>) -> Result<Tensor> {
        if let Then::Add(r) = then {
            let shape = self.out_dims(x);
            if r.dims() != shape {
                return Err(Error::Shape {
                    layer: "Dense",
                    message: format!("residual {:?} for an output of {shape:?}", r.dims()),
                });
            }
        }
        if let Some(y) = self.forward_cpu_f32(x, then)? {
            return Ok(y);
        }
        if self.bf16 {
            return Err(Error::Unsupported(format!(
                "bf16 products take f32 activations on the CPU (got {:?} on {:?})",
                x.dtype(),
                x.device()
            )));
        }
        let w_t = self.w_t()?;
        let y = if x.rank() == 2 { x.matmul(&w_t)? } else { x.broadcast_matmul(&w_t)? };
        let y = match &self.bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        };
        Ok(match then {
            Then::Nothing => y,
            Then::GeluTanh => crate::kernels::gelu_tanh_tensor(y)?,
            Then::Add(r) => (r + y)?,
        })
    }

    fn forward_cpu_f32(&self, x: &Tensor, then: Then<'_>) -> Result<Option<Tensor>> {
        let residual = match then {
            Then::Add(r) => Some(r),
            _ => None,
        };
        // (The bf16 layout's packed weights are u32; its activations and bias are f32.)
        let w = if self.bf16 { None } else { Some(&self.w) };
        let tensors: Vec<&Tensor> = [Some(x), w, self.bias.as_ref(), residual].into_iter().flatten().collect();
        let all_f32 = own_kernel_for(Op::DenseLinear, &tensors);
        if !all_f32
            || x.rank() == 0
            || (self.panels && !crate::panels::available())
            || (self.bf16 && !crate::amx::products_available())
        {
            return Ok(None);
        }
        let (k, n) = self.dims;
        let dims = x.dims().to_vec();
        if dims[dims.len() - 1] != k {
            return Err(Error::Shape { layer: "Dense", message: format!("input {dims:?} for {k} input features") });
        }
        let m = x.elem_count() / k;
        let shape = self.out_dims(x);
        if m == 0 || n == 0 {
            return Ok(Some(Tensor::zeros(shape, DType::F32, x.device())?));
        }
        let residual = residual.map(|r| r.contiguous()).transpose()?;
        let residual_storage = residual.as_ref().map(|r| r.storage_and_layout());
        // What each tile gets once written: the GELU, or its rows of the residual to add.
        enum Tail<'s> {
            Gelu,
            Add(&'s [f32]),
        }
        let tail = match (then, &residual_storage) {
            (Then::Nothing, _) => None,
            (Then::GeluTanh, _) => Some(Tail::Gelu),
            (Then::Add(_), Some((rs, rl))) => match cpu_f32(rs) {
                Some(rs) => Some(Tail::Add(&rs[rl.start_offset()..rl.start_offset() + m * n])),
                None => return Ok(None),
            },
            (Then::Add(_), None) => unreachable!("the residual is taken from `then` above"),
        };
        let x = x.contiguous()?;
        let w = self.w.contiguous()?;
        let bias = self.bias.as_ref().map(|b| b.contiguous()).transpose()?;
        let (xs, xl) = x.storage_and_layout();
        let (ws, wl) = w.storage_and_layout();
        let Some(xs) = cpu_f32(&xs) else {
            return Ok(None);
        };
        let xs = &xs[xl.start_offset()..xl.start_offset() + m * k];
        let bias_row = match &bias {
            Some(b) => {
                let (bs, bl) = b.storage_and_layout();
                let Some(bs) = cpu_f32(&bs) else {
                    return Ok(None);
                };
                Some(bs[bl.start_offset()..bl.start_offset() + n].to_vec())
            }
            None => None,
        };
        // The f32 weights (panels or W^T); the bf16 layout's u32 pairs are read in its branch.
        let wf: &[f32] = if self.bf16 {
            &[]
        } else {
            let Some(all) = cpu_f32(&ws) else {
                return Ok(None);
            };
            let w_len = if self.panels { n.div_ceil(crate::panels::WIDTH) * k * crate::panels::WIDTH } else { k * n };
            &all[wl.start_offset()..wl.start_offset() + w_len]
        };
        let mut out: Vec<f32> = Vec::with_capacity(m * n);
        let out_ptr = SendPtr(out.as_mut_ptr());
        // `then` on rows r0..r1, columns c0..c1 of the output once they are written.
        let finish = |(r0, r1): (usize, usize), (c0, c1): (usize, usize)| {
            let Some(tail) = &tail else { return };
            for r in r0..r1 {
                // SAFETY: the calling item's rows and columns, written by it just before.
                let row = unsafe { std::slice::from_raw_parts_mut(out_ptr.get().add(r * n + c0), c1 - c0) };
                match tail {
                    Tail::Gelu => crate::kernels::gelu_slice(row),
                    Tail::Add(res) => {
                        for (y, a) in row.iter_mut().zip(&res[r * n + c0..r * n + c1]) {
                            *y += *a;
                        }
                    }
                }
            }
        };
        let threads = candle_core::utils::get_num_threads().max(1);
        if self.bf16 {
            // The activations rounded into bf16 tiles once, then the output's tiles on the pool.
            #[cfg(target_arch = "x86_64")]
            {
                let candle_core::Storage::Cpu(cpu) = &*ws else {
                    return Ok(None);
                };
                let wp = &cpu.as_slice::<u32>()?[wl.start_offset()..];
                let mut packed = Vec::new();
                crate::amx::pack_rows(xs, m, k, &mut packed);
                for_each_tile(m, n, bf16_tiles(m, n, threads), |(r0, r1), (c0, c1)| {
                    // SAFETY: `amx::products_available()` checked above; this item owns rows r0..r1
                    // (r0 a multiple of the group), columns c0..c1 (c0 of the panel) of the
                    // m x n output; the packed rows and panels cover m rows and n columns.
                    unsafe {
                        crate::amx::product_tile(
                            &packed,
                            k,
                            wp,
                            n,
                            bias_row.as_deref(),
                            out_ptr.get(),
                            (r0, r1),
                            (c0, c1),
                        )
                    };
                    finish((r0, r1), (c0, c1));
                });
            }
            #[cfg(not(target_arch = "x86_64"))]
            return Ok(None);
        } else if self.panels {
            // Chunks of rows packed for the micro-kernel (at most 8 MiB at a time, shared by
            // every tile of the chunk), then the chunk's tiles on candle's pool.
            #[cfg(target_arch = "x86_64")]
            {
                use crate::panels;
                let chunk = panels::chunk_rows(m, k);
                let mut packed = Vec::new();
                let mut c_row = 0;
                while c_row < m {
                    let rows = chunk.min(m - c_row);
                    panels::pack_rows(&xs[c_row * k..(c_row + rows) * k], rows, k, &mut packed);
                    // SAFETY: c_row < m, inside the m x n output.
                    let y = SendPtr(unsafe { out_ptr.get().add(c_row * n) });
                    let packed = &packed[..];
                    for_each_tile(rows, n, panel_tiles(rows, n, k, threads), |(r0, r1), (c0, c1)| {
                        // SAFETY: this item owns rows r0..r1 (of the chunk), columns c0..c1 of the
                        // output, which has room for m rows of n; `forward_cpu_f32` checked
                        // `panels::available()`; r0 is a multiple of the group.
                        unsafe {
                            panels::tile(packed, rows, k, wf, n, bias_row.as_deref(), y.get(), (r0, r1), (c0, c1))
                        };
                        finish((c_row + r0, c_row + r1), (c0, c1));
                    });
                    c_row += rows;
                }
            }
        } else {
            // Tiles of the output (row blocks x column blocks) on candle's pool, each one
            // single-threaded `gemm` starting from the bias rows: a thread packs only its own
            // slice of W^T, and no second (rayon) pool spins beside candle's on the same cores.
            // About four tiles per thread; up to 1024 rows, column blocks only (a tile over fewer
            // rows would pack its W^T slice for too little work), beyond that row blocks of about
            // 1024 rows and wider column blocks (4096 rows, 2 threads: 4 x 2 tiles, 7% faster
            // than 1 x 8 on a Zen 3 with AVX2, `tools/bench/linear-side-by-side`).
            for_each_tile(m, n, dense_tiles(m, n, threads), |(r0, r1), (c0, c1)| {
                // SAFETY: this item owns rows r0..r1, columns c0..c1 of the output; `out` has
                // room for m rows of n (its elements are written here before `set_len` below).
                unsafe {
                    let dst = out_ptr.get().add(r0 * n + c0);
                    if let Some(row) = &bias_row {
                        for r in 0..r1 - r0 {
                            std::ptr::copy_nonoverlapping(row[c0..c1].as_ptr(), dst.add(r * n), c1 - c0);
                        }
                    }
                    gemm::gemm(
                        r1 - r0,
                        c1 - c0,
                        k,
                        dst,
                        1,
                        n as isize,
                        bias_row.is_some(),
                        xs.as_ptr().add(r0 * k),
                        1,
                        k as isize,
                        wf.as_ptr().add(c0),
                        1,
                        n as isize,
                        1.0,
                        1.0,
                        false,
                        false,
                        false,
                        gemm::Parallelism::None,
                    );
                }
                finish((r0, r1), (c0, c1));
            });
        }
        // SAFETY: every tile was written above (the bf16 tiles' or the panels' blocks, a bias copy
        // then gemm, or gemm with read_dst false, which writes its whole destination).
        unsafe { out.set_len(m * n) };
        Ok(Some(Tensor::from_vec(out, shape, x.device())?))
    }
}

/// Runs `f` on every tile of an `m` x `n` output cut in tiles of `rb` rows by `cb` columns (the
/// last ones ragged), on candle's pool: `f((r0, r1), (c0, c1))`.
fn for_each_tile(m: usize, n: usize, (rb, cb): (usize, usize), f: impl Fn((usize, usize), (usize, usize)) + Sync) {
    let col_tiles = n.div_ceil(cb);
    candle_core::utils::barrier_pool().execute_chunked(m.div_ceil(rb) * col_tiles, |items| {
        for item in items {
            let (r0, c0) = ((item / col_tiles) * rb, (item % col_tiles) * cb);
            f((r0, (r0 + rb).min(m)), (c0, (c0 + cb).min(n)));
        }
    });
}

/// The panels' output tile for `m` rows, `n` columns, `k` input features (all > 0) on `threads`
/// threads: (rows, columns). A tile's weight panels are swept over all its rows, 48 at a time,
/// so its columns are kept to about 4 MiB of panels (512 columns of 1024 features, 256 of 4096)
/// that stay in L3, and its rows to at most 2048; narrower until there are two tiles per thread.
/// On the Zen 3 at 4096 rows this took the 1024x3072, 1024x4096 and 4096x1024 shapes from
/// 164-172 GFLOP/s (`dense_tiles`' 1024-row tiles, 1536-2048 columns wide) to 186-189.
fn panel_tiles(m: usize, n: usize, k: usize, threads: usize) -> (usize, usize) {
    const W: usize = crate::panels::WIDTH;
    let rows = m.div_ceil(m.div_ceil(2046)).next_multiple_of(crate::panels::GROUP);
    let row_blocks = m.div_ceil(rows);
    let mut cols = ((4 << 20) / (4 * k)).clamp(4 * W, 512) / W * W;
    while row_blocks * n.div_ceil(cols) < 2 * threads && cols > 4 * W {
        cols = (cols / 2).next_multiple_of(W);
    }
    (rows, cols.min(n))
}

/// The bf16 products' output tile for `m` rows, `n` columns (both > 0) on `threads` threads:
/// (rows, columns). Rows in blocks of at most ~768 (a pass's slice of their pairs, 128 pairs x 4
/// B a row, stays in L2), columns in whole panels, narrowed until there are about four tiles a
/// thread.
fn bf16_tiles(m: usize, n: usize, threads: usize) -> (usize, usize) {
    use crate::amx::{MR, NR};
    let rows = m.div_ceil(m.div_ceil(768)).next_multiple_of(MR);
    let row_blocks = m.div_ceil(rows);
    let panels = n.div_ceil(NR);
    let col_blocks = (4 * threads).div_ceil(row_blocks).clamp(1, panels);
    (rows, panels.div_ceil(col_blocks) * NR)
}

/// A linear layer's weight [out, in] packed in `panels` layout (None: not a CPU float tensor).
fn pack_panels(w: &Tensor) -> Result<Option<Tensor>> {
    if !own_kernel(Op::PanelPacking, DeviceKind::of(w.device()), w.dtype()) {
        return Ok(None);
    }
    let w = w.contiguous()?;
    let (n, k) = w.dims2()?;
    let p = n.div_ceil(crate::panels::WIDTH);
    let (storage, layout) = w.storage_and_layout();
    let candle_core::Storage::Cpu(cpu) = &*storage else {
        return Ok(None);
    };
    let o = layout.start_offset();
    macro_rules! go {
        ($ty:ty) => {{
            let src = &cpu.as_slice::<$ty>()?[o..o + n * k];
            Tensor::from_vec(crate::panels::pack(src, n, k), (p, k, crate::panels::WIDTH), w.device())?
        }};
    }
    Ok(Some(match w.dtype() {
        DType::F32 => go!(f32),
        DType::BF16 => go!(half::bf16),
        DType::F16 => go!(half::f16),
        _ => return Ok(None),
    }))
}

/// `Dense`'s output tile for `m` rows, `n` columns (both > 0) on `threads` threads: (rows,
/// columns), the columns a multiple of 64 unless the tile spans all `n`.
fn dense_tiles(m: usize, n: usize, threads: usize) -> (usize, usize) {
    if threads <= 1 {
        return (m, n);
    }
    let tiles = threads * 4;
    let row_blocks = m.div_ceil(1024).min(tiles);
    let col_blocks = tiles.div_ceil(row_blocks);
    (m.div_ceil(row_blocks), n.div_ceil(col_blocks).next_multiple_of(64).min(n))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
    }

    #[test]
    fn panel_tiles_keep_a_tiles_panels_small_and_give_every_thread_work() {
        for (m, n, k, threads) in
            [(784, 3072, 1024, 2), (784, 1024, 1024, 2), (4096, 1024, 4096, 2), (196, 2048, 4096, 16), (5, 20, 3, 8)]
        {
            let (rows, cols) = panel_tiles(m, n, k, threads);
            assert!((1..=2048).contains(&rows) && cols >= 1 && cols <= n, "{m}x{n}x{k}: {rows}x{cols}");
            assert_eq!(rows % crate::panels::GROUP, 0, "{m}x{n}x{k}: tiles start on a packed group");
            assert!(cols == n || cols % crate::panels::WIDTH == 0, "{m}x{n}x{k}: {cols} columns");
            assert!(
                cols * k * 4 <= 4 << 20 || cols <= 4 * crate::panels::WIDTH,
                "{m}x{n}x{k}: {cols} columns of panels"
            );
            let tiles = m.div_ceil(rows) * n.div_ceil(cols);
            assert!(
                tiles >= (2 * threads).min(n.div_ceil(4 * crate::panels::WIDTH) * m.div_ceil(2048)),
                "{m}x{n}x{k}: {tiles} tiles"
            );
        }
    }

    #[test]
    fn panels_span_several_packed_chunks() {
        // 4096 features: chunks of at most 510 rows, so 1030 rows take three (348, 348 and 334,
        // which ends on a group of 4); 36 outputs: two full panels and a ragged one; the GELU
        // taken per tile.
        let (k, n, rows) = (4096, 36, 1030);
        assert_eq!(crate::panels::chunk_rows(rows, k), 348);
        let w = crate::testing::randn(121, 0.02, (n, k)).unwrap();
        let b = crate::testing::randn(122, 1.0, n).unwrap();
        let x = crate::testing::randn(123, 1.0, (rows, k)).unwrap();
        let (wv, bv, xv) = (w.to_vec2::<f32>().unwrap(), b.to_vec1::<f32>().unwrap(), x.to_vec2::<f32>().unwrap());
        let dense = Dense::from_linear_as(&Linear::new(w, Some(b)), true).unwrap();
        let got = dense.forward_then(&x, Then::GeluTanh).unwrap().to_vec2::<f32>().unwrap();
        for r in 0..rows {
            for c in 0..n {
                let u = (0..k).map(|i| xv[r][i] as f64 * wv[c][i] as f64).sum::<f64>() + bv[c] as f64;
                let want = 0.5 * u * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (u + 0.044715 * u * u * u)).tanh());
                assert!((got[r][c] as f64 - want).abs() < 1e-4, "[{r}, {c}]: {} vs {want}", got[r][c]);
            }
        }
    }

    #[test]
    fn dense_tiles_cover_the_output_in_enough_pieces() {
        assert_eq!(dense_tiles(4096, 3072, 1), (4096, 3072));
        assert_eq!(dense_tiles(784, 3072, 2), (784, 384));
        assert_eq!(dense_tiles(4096, 3072, 2), (1024, 1536));
        assert_eq!(dense_tiles(4096, 1024, 2), (1024, 512));
        for m in [1, 63, 784, 1024, 1025, 2100, 4096, 40_000] {
            for n in [1, 64, 100, 1024, 3072] {
                for threads in [1, 2, 3, 8, 64] {
                    let (r, c) = dense_tiles(m, n, threads);
                    assert!((1..=m).contains(&r) && (1..=n).contains(&c), "{m}x{n}/{threads}: {r}x{c}");
                    assert!(c == n || c % 64 == 0, "{m}x{n}/{threads}: {c} columns");
                    let tiles = m.div_ceil(r) * n.div_ceil(c);
                    assert!(tiles <= 4 * threads.max(1) * 2, "{m}x{n}/{threads}: {tiles} tiles");
                    if threads > 1 && n >= 64 * threads && m >= 1024 {
                        assert!(tiles >= threads, "{m}x{n}/{threads}: {tiles} tiles");
                    }
                }
            }
        }
    }

    #[test]
    fn dense_matches_the_definition_across_column_blocks() {
        // 300 outputs: several column blocks on the pool, the last one ragged; 2100 rows: row
        // blocks too (with more than one thread), the last one ragged.
        let (k, n) = (70, 300);
        let w = crate::testing::randn(111, 0.1, (n, k)).unwrap();
        let b = crate::testing::randn(112, 1.0, n).unwrap();
        let (wv, bv) = (w.to_vec2::<f32>().unwrap(), b.to_vec1::<f32>().unwrap());
        // Both weight layouts (the panels unpacked per call where the CPU lacks AVX2), the last
        // panel ragged (300 = 18 x 16 + 12), 37 rows = 6 blocks of 6 and one row.
        for (rows, bias, panels) in [
            (37, true, false),
            (37, false, false),
            (2100, true, false),
            (37, true, true),
            (37, false, true),
            (2100, true, true),
        ] {
            let x = crate::testing::randn(113, 1.0, (rows, k)).unwrap();
            let xv = x.to_vec2::<f32>().unwrap();
            let dense = Dense::from_linear_as(&Linear::new(w.clone(), bias.then(|| b.clone())), panels).unwrap();
            assert_eq!(dense.is_panels(), panels);
            assert_eq!(dense.dims().unwrap(), (k, n));
            // A 3-D input is rows of the last dimension.
            let got = dense.forward(&x.reshape((1, rows, k)).unwrap()).unwrap();
            assert_eq!(got.dims(), [1, rows, n]);
            let got = got.squeeze(0).unwrap().to_vec2::<f32>().unwrap();
            for r in 0..rows {
                for c in 0..n {
                    let dot: f64 = (0..k).map(|i| xv[r][i] as f64 * wv[c][i] as f64).sum();
                    let want = dot + if bias { bv[c] as f64 } else { 0.0 };
                    assert!(
                        (got[r][c] as f64 - want).abs() < 1e-4,
                        "bias {bias}, panels {panels}, [{r}, {c}]: {} vs {want}",
                        got[r][c]
                    );
                }
            }
        }
        // Weights stored in bf16 and upcast per forward (the engine's resident path) keep their
        // layout: the same rows as a layer built from the upcast weights.
        let x = crate::testing::randn(114, 1.0, (13, k)).unwrap();
        for panels in [false, true] {
            let stored = Linear::new(w.to_dtype(DType::BF16).unwrap(), Some(b.to_dtype(DType::BF16).unwrap()));
            let upcast = Dense::from_linear_as(&stored, panels).unwrap().to_dtype(DType::F32).unwrap();
            assert_eq!(upcast.is_panels(), panels);
            let direct = Linear::new(
                stored.weight().to_dtype(DType::F32).unwrap(),
                Some(stored.bias().unwrap().to_dtype(DType::F32).unwrap()),
            );
            let direct = Dense::from_linear_as(&direct, false).unwrap();
            assert!(max_diff(&upcast.forward(&x).unwrap(), &direct.forward(&x).unwrap()) < 1e-5, "panels {panels}");
        }
        let dense = Dense::from_linear(&Linear::new(w, Some(b))).unwrap();
        assert_eq!(dense.forward(&Tensor::zeros((0, k), DType::F32, &Device::Cpu).unwrap()).unwrap().dims(), [0, n]);
        assert_eq!(dense.forward(&Tensor::zeros((5, k), DType::F32, &Device::Cpu).unwrap()).unwrap().dims(), [5, n]);
        assert!(dense.forward(&Tensor::zeros((2, k + 1), DType::F32, &Device::Cpu).unwrap()).is_err());
    }

    #[test]
    fn forward_then_equals_the_separate_ops_exactly() {
        // The GELU and the residual sum taken per output tile give the same bits as the ops
        // after the product, for both weight layouts, over column and row blocks.
        let (k, n) = (70, 300);
        let w = crate::testing::randn(121, 0.1, (n, k)).unwrap();
        let b = crate::testing::randn(122, 1.0, n).unwrap();
        for (rows, panels) in [(37, false), (37, true), (2100, false), (2100, true)] {
            let dense = Dense::from_linear_as(&Linear::new(w.clone(), Some(b.clone())), panels).unwrap();
            let x = crate::testing::randn(123, 1.0, (rows, k)).unwrap();
            let r = crate::testing::randn(124, 1.0, (rows, n)).unwrap();
            let y = dense.forward(&x).unwrap();
            let gelu = crate::kernels::gelu_tanh_tensor(y.copy().unwrap()).unwrap();
            let sum = (&r + &y).unwrap();
            for (then, want) in [(Then::GeluTanh, &gelu), (Then::Add(&r), &sum), (Then::Nothing, &y)] {
                let got = dense.forward_then(&x, then).unwrap();
                assert_eq!(got.dims(), want.dims());
                let (got, want) = (
                    got.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                    want.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                );
                assert!(
                    got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{then:?}, {rows} rows, panels {panels}"
                );
            }
            // The residual's shape is checked.
            let wrong = Tensor::zeros((rows, n + 1), DType::F32, &Device::Cpu).unwrap();
            let err = dense.forward_then(&x, Then::Add(&wrong)).unwrap_err().to_string();
            assert!(err.contains("residual"), "{err}");
        }
        // Off the fused path (bf16 here) the ops run after the product.
        let dense = Dense::from_linear_as(&Linear::new(w.to_dtype(DType::BF16).unwrap(), None), false).unwrap();
        let x = crate::testing::randn(125, 1.0, (5, k)).unwrap().to_dtype(DType::BF16).unwrap();
        let r = crate::testing::randn(126, 1.0, (5, n)).unwrap().to_dtype(DType::BF16).unwrap();
        let want = (&r + dense.forward(&x).unwrap()).unwrap();
        let got = dense.forward_then(&x, Then::Add(&r)).unwrap();
        assert_eq!(got.dtype(), DType::BF16);
        let f32 = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
        assert_eq!(max_diff(&f32(&got), &f32(&want)), 0.0);
    }

    #[test]
    fn bf16_products_equal_candles_product_of_the_rounded_operands() {
        // Without AMX the layer is refused with a message naming it; with AMX, `x W^T + b` over
        // row blocks (2100 rows) and ragged panels (300 outputs, 70 features), the GELU and the
        // residual taken per tile, against candle's f32 matmul of the bf16-rounded operands.
        let (k, n) = (70, 300);
        let w = crate::testing::randn(131, 0.1, (n, k)).unwrap();
        let b = crate::testing::randn(132, 1.0, n).unwrap();
        let dense = Dense::from_linear(&Linear::new(w.clone(), Some(b.clone()))).unwrap().to_bf16();
        if !crate::amx::products_available() {
            let e = dense.unwrap_err().to_string();
            assert!(e.contains("AVX512-BF16") && e.contains("AMX-BF16"), "{e}");
            return;
        }
        let dense = dense.unwrap();
        assert!(dense.is_bf16() && dense.to_bf16().unwrap().is_bf16());
        let round = |t: &Tensor| t.to_dtype(DType::BF16).unwrap().to_dtype(DType::F32).unwrap();
        for rows in [1, 37, 2100] {
            let x = crate::testing::randn(133, 1.0, (rows, k)).unwrap();
            let r = crate::testing::randn(134, 1.0, (rows, n)).unwrap();
            let want = round(&x).matmul(&round(&w).t().unwrap()).unwrap().broadcast_add(&b).unwrap();
            let y = dense.forward(&x).unwrap();
            assert!(max_diff(&y, &want) <= 1e-5, "{rows} rows: {}", max_diff(&y, &want));
            let gelu = crate::kernels::gelu_tanh_tensor(y.copy().unwrap()).unwrap();
            assert_eq!(max_diff(&dense.forward_then(&x, Then::GeluTanh).unwrap(), &gelu), 0.0);
            assert_eq!(max_diff(&dense.forward_then(&x, Then::Add(&r)).unwrap(), &(&r + &y).unwrap()), 0.0);
            // Rank 3 input: the same rows.
            let y3 = dense.forward(&x.unsqueeze(0).unwrap()).unwrap();
            assert_eq!(y3.dims(), &[1, rows, n]);
            assert_eq!(max_diff(&y3.squeeze(0).unwrap(), &y), 0.0);
        }
        // Activations the tiles do not take are refused, named.
        let x = crate::testing::randn(135, 1.0, (3, k)).unwrap().to_dtype(DType::BF16).unwrap();
        let e = dense.forward(&x).unwrap_err().to_string();
        assert!(e.contains("f32 activations") && e.contains("BF16"), "{e}");
    }
}
