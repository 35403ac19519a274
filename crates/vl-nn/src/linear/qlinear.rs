//! `QLinear`: a linear layer dense or quantized; its quantized products on the stored blocks
//! (`stored`, `stored_tiles`) where they run, candle's `QMatMul` otherwise (in pieces of 31 rows
//! where the CPU has AMX, unless `allow_amx`), and the one-time preparation of many layers.

use std::borrow::Cow;
use std::sync::Arc;

use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{DType, Module, Tensor};
use candle_nn::Linear;

use super::{dtype_name, quantize_rows, QuantType};
use crate::dispatch::{own_kernel, DeviceKind, Op};
use crate::{Error, Result};

/// A weight's stored blocks as `stored::matmul_each` takes them: the block type, the bytes, the
/// output size (`QLinear::stored_bytes`).
pub type StoredWeight<'a> = (crate::stored::Blocks, Cow<'a, [u8]>, usize);

/// `QLinear::prepare` for many layers, on every core (each repack is single-threaded).
pub fn prepare_all(layers: &[&QLinear]) -> Result<()> {
    prepare_all_then(layers, &|_| {})
}

/// `prepare_all`, calling `then(i)` as soon as `layers[i]` is prepared (e.g. to hand back the
/// pages of the blocks it was repacked from).
pub fn prepare_all_then(layers: &[&QLinear], then: &(dyn Fn(usize) + Sync)) -> Result<()> {
    let threads = candle_core::utils::get_num_threads().clamp(1, layers.len().max(1));
    let next = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    match layers.get(i) {
                        Some(l) => {
                            l.prepare()?;
                            then(i);
                        }
                        None => return Ok(()),
                    }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("prepare thread panicked")).collect::<Result<Vec<()>>>()
    })?;
    Ok(())
}

/// A linear layer, dense or quantized.
#[derive(Debug, Clone)]
pub enum QLinear {
    Dense(Linear),
    Quant { w: QMatMul, qtype: QuantType, bias: Option<Tensor> },
}

impl QLinear {
    /// Quantizes `l` to `qtype` when its input dimension is a multiple of the block size;
    /// otherwise keeps it dense (reported by `storage`).
    pub fn new(l: Linear, qtype: Option<QuantType>) -> Result<Self> {
        let Some(q) = qtype else { return Ok(QLinear::Dense(l)) };
        let (_, in_dim) = l.weight().dims2()?;
        if in_dim % q.block() != 0 {
            return Ok(QLinear::Dense(l));
        }
        let w = quantize_rows(l.weight(), q)?;
        Ok(QLinear::Quant { w: QMatMul::from_qtensor(w)?, qtype: q, bias: l.bias().cloned() })
    }

    /// A layer over weights already quantized (e.g. read from a GGUF file): used as stored.
    pub fn from_qtensor(w: Arc<QTensor>, bias: Option<Tensor>) -> Result<Self> {
        let qtype = QuantType::from_ggml(w.dtype()).ok_or_else(|| Error::Shape {
            layer: "QLinear",
            message: format!("no kernel for block type {:?}", w.dtype()),
        })?;
        Ok(QLinear::Quant { w: QMatMul::from_arc(w)?, qtype, bias })
    }

    /// `forward`, but a CPU k-quant / legacy-quant weight is multiplied on its compact blocks as
    /// stored (candle's `k_quants::matmul`), never through candle's repacked tiles: `QMatMul`
    /// repacks a Q4_K (or Q8_0) weight on its first product and keeps both copies, which for
    /// routed experts, each touched by some token sooner or later, doubles their memory. Other
    /// storage takes `forward`.
    pub fn forward_compact(&self, x: &Tensor) -> Result<Tensor> {
        if let Some([y]) = Self::stored_products(&[self], x)?.and_then(|y| <[Tensor; 1]>::try_from(y).ok()) {
            return Ok(y);
        }
        if let QLinear::Quant { w: QMatMul::QTensor(t), bias: None, .. } = self {
            if x.dtype() == DType::F32 && t.device().is_cpu() {
                if let Some(y) = compact_matmul(t, x)? {
                    return Ok(y);
                }
            }
        }
        self.forward(x)
    }

    /// `forward` of each layer on the same `x`. CPU Q4_K / Q6_K weights run together on their
    /// stored blocks (one parallel region, one quantization of `x`): `stored::matmul` for a few
    /// rows (a decode step), `stored_tiles::matmul_each` for more (a prefill); the others take
    /// `forward`.
    pub fn forward_many(layers: &[&QLinear], x: &Tensor) -> Result<Vec<Tensor>> {
        let fused: Vec<usize> = (0..layers.len()).filter(|&i| layers[i].stored_blocks().is_some()).collect();
        let mut out: Vec<Option<Tensor>> = vec![None; layers.len()];
        if fused.len() > 1 {
            let some: Vec<&QLinear> = fused.iter().map(|&i| layers[i]).collect();
            if let Some(ys) = Self::stored_products(&some, x)? {
                for (i, y) in fused.into_iter().zip(ys) {
                    out[i] = Some(y);
                }
            }
        }
        layers.iter().zip(out).map(|(l, y)| y.map_or_else(|| l.forward(x), Ok)).collect()
    }

    /// `forward_many` for a fixed number of layers.
    pub fn forward_each<const N: usize>(layers: [&QLinear; N], x: &Tensor) -> Result<[Tensor; N]> {
        let ys = Self::forward_many(&layers, x)?;
        let got = ys.len();
        ys.try_into().map_err(|_| Error::Shape { layer: "QLinear", message: format!("{got} products for {N} layers") })
    }

    /// The weight's stored blocks on the CPU where `stored::matmul` takes them, and its output size.
    fn stored_blocks(&self) -> Option<(crate::stored::Blocks, &QTensor, usize)> {
        let QLinear::Quant { w: QMatMul::QTensor(t), qtype, .. } = self else { return None };
        let kind = match qtype {
            QuantType::Q4K => crate::stored::Blocks::Q4K,
            QuantType::Q6K => crate::stored::Blocks::Q6K,
            _ => return None,
        };
        t.device().is_cpu().then_some(())?;
        Some((kind, t, t.shape().dims2().ok()?.0))
    }

    /// A bias-free CPU Q4_K / Q6_K weight's stored blocks, as `stored::matmul_each` takes them:
    /// the block type, the bytes and the output size. None for any other weight.
    pub fn stored_bytes(&self) -> Result<Option<StoredWeight<'_>>> {
        if let QLinear::Quant { bias: Some(_), .. } = self {
            return Ok(None);
        }
        match self.stored_blocks() {
            Some((kind, t, n)) => Ok(Some((kind, t.data()?, n))),
            None => Ok(None),
        }
    }

    /// Every layer's product with `x` on the stored blocks, when all are stored Q4_K / Q6_K on a
    /// CPU that runs the kernel for x's row count: `stored::matmul` for up to `stored::SMALL_ROWS`
    /// rows (a decode step, drafted tokens verified) and, on AVX2 without AVX-512, for any
    /// (`stored::takes_prompts`), `stored_tiles::matmul_each` for more (no repacked copy; Q4_K only
    /// while candle's AMX path was not asked for, `allow_amx`); None otherwise.
    fn stored_products(layers: &[&QLinear], x: &Tensor) -> Result<Option<Vec<Tensor>>> {
        let k = x.dim(candle_core::D::Minus1)?;
        let rows = x.elem_count() / k.max(1);
        let few = rows <= crate::stored::SMALL_ROWS;
        let tiles = !few && crate::stored_tiles::available();
        let runs = if few { crate::stored::available() } else { tiles || crate::stored::takes_prompts() };
        if rows == 0 || !x.device().is_cpu() || !runs {
            return Ok(None);
        }
        let Some(weights) = layers.iter().map(|l| l.stored_blocks()).collect::<Option<Vec<_>>>() else {
            return Ok(None);
        };
        let amx = ALLOW_AMX.load(std::sync::atomic::Ordering::Relaxed);
        if !few && amx && weights.iter().any(|(kind, _, _)| *kind == crate::stored::Blocks::Q4K) {
            return Ok(None);
        }
        let xs = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let bytes: Vec<Cow<'_, [u8]>> = weights.iter().map(|(_, t, _)| t.data()).collect::<candle_core::Result<_>>()?;
        let parts: Vec<(crate::stored::Blocks, &[u8], usize)> =
            bytes.iter().zip(&weights).map(|(b, (kind, _, n))| (*kind, b.as_ref(), *n)).collect();
        let ys = if tiles {
            crate::stored_tiles::matmul_each(&parts, &xs, rows, k)
        } else {
            crate::stored::matmul(&parts, &xs, rows, k)
        };
        let Some(ys) = ys else { return Ok(None) };
        Self::stored_outputs(layers, &weights, ys, x).map(Some)
    }

    /// The stored kernels' products as tensors shaped and typed like `x` (last dimension each
    /// layer's output size), each layer's bias added.
    fn stored_outputs(
        layers: &[&QLinear],
        weights: &[(crate::stored::Blocks, &QTensor, usize)],
        ys: Vec<Vec<f32>>,
        x: &Tensor,
    ) -> Result<Vec<Tensor>> {
        let dtype = x.dtype();
        ys.into_iter()
            .zip(layers.iter().zip(weights))
            .map(|(y, (l, (_, _, n)))| {
                let mut dims = x.dims().to_vec();
                if let Some(last) = dims.last_mut() {
                    *last = *n;
                }
                let y = Tensor::from_vec(y, dims, x.device())?.to_dtype(dtype)?;
                Ok(match l {
                    QLinear::Quant { bias: Some(b), .. } => y.broadcast_add(&b.to_dtype(dtype)?)?,
                    _ => y,
                })
            })
            .collect()
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if let Some([y]) = Self::stored_products(&[self], x)?.and_then(|y| <[Tensor; 1]>::try_from(y).ok()) {
            return Ok(y);
        }
        match self {
            QLinear::Dense(l) => Ok(l.forward(x)?),
            QLinear::Quant { w, bias, qtype } => {
                let dtype = x.dtype();
                let x = x.to_dtype(DType::F32)?;
                let k = x.dim(candle_core::D::Minus1)?;
                let rows = x.elem_count() / k.max(1);
                let y = if *qtype == QuantType::Q4K && rows > AMX_ROWS && x.device().is_cpu() && avoid_amx() {
                    let flat = x.reshape((rows, k))?;
                    let parts = (0..rows)
                        .step_by(AMX_ROWS)
                        .map(|s| w.forward(&flat.narrow(0, s, AMX_ROWS.min(rows - s))?))
                        .collect::<candle_core::Result<Vec<_>>>()?;
                    let y = Tensor::cat(&parts, 0)?;
                    let mut dims = x.dims().to_vec();
                    if let Some(last) = dims.last_mut() {
                        *last = y.dim(1)?;
                    }
                    y.reshape(dims)?
                } else {
                    w.forward(&x)?
                };
                let y = y.to_dtype(dtype)?;
                Ok(match bias {
                    Some(b) => y.broadcast_add(&b.to_dtype(dtype)?)?,
                    None => y,
                })
            }
        }
    }

    /// The layer of its first `n` output rows only (a copy of those rows' weights, stored as they
    /// are): a product over part of a vocabulary, e.g. drafts picked among its first `n` tokens.
    pub fn first_rows(&self, n: usize) -> Result<QLinear> {
        let out = |dims: &[usize]| dims.first().copied().unwrap_or(0);
        match self {
            QLinear::Dense(l) => {
                let n = n.min(out(l.weight().dims()));
                let w = l.weight().narrow(0, 0, n)?.copy()?;
                let b = l.bias().map(|b| b.narrow(0, 0, n)).transpose()?;
                Ok(QLinear::Dense(Linear::new(w, b)))
            }
            QLinear::Quant { w, qtype, bias } => {
                let w = match w {
                    QMatMul::QTensor(t) => {
                        let dims = t.shape().dims().to_vec();
                        let n = n.min(out(&dims));
                        let row_bytes = t.storage_size_in_bytes() / out(&dims).max(1);
                        let data = t.data()?;
                        let mut cut = dims.clone();
                        cut[0] = n;
                        let q = candle_core::quantized::ggml_file::qtensor_from_ggml(
                            t.dtype(),
                            &data[..n * row_bytes],
                            cut,
                            &t.device(),
                        )?;
                        QMatMul::from_qtensor(q)?
                    }
                    QMatMul::Tensor(t) => QMatMul::Tensor(t.narrow(0, 0, n.min(out(t.dims())))?.copy()?),
                    QMatMul::TensorF16(t) => QMatMul::TensorF16(t.narrow(0, 0, n.min(out(t.dims())))?.copy()?),
                };
                let bias = bias.as_ref().map(|b| b.narrow(0, 0, n.min(b.dim(0)?))).transpose()?;
                Ok(QLinear::Quant { w, qtype: *qtype, bias })
            }
        }
    }

    /// "f32", "bf16", "q4k", ...
    pub fn storage(&self) -> String {
        match self {
            QLinear::Dense(l) => dtype_name(l.weight().dtype()).into(),
            QLinear::Quant { qtype, .. } => qtype.name().into(),
        }
    }

    /// Pays the kernels' one-time weight preparation now rather than in the first forward:
    /// candle repacks CPU k-quant weights into its tile layout on first use (a product with a
    /// two-row input triggers what both prefill and decode use). A no-op for dense weights, and
    /// for Q4_K / Q6_K weights where `stored_tiles` runs (AVX-512 VNNI) or `stored` takes
    /// prompts (AVX2 without AVX-512): their products of any row count read the stored blocks.
    pub fn prepare(&self) -> Result<()> {
        if let QLinear::Quant { w: w @ QMatMul::QTensor(t), .. } = self {
            let dev = t.device();
            if self.stored_blocks().is_some_and(|(kind, _, _)| {
                kind == crate::stored::Blocks::Q6K || !ALLOW_AMX.load(std::sync::atomic::Ordering::Relaxed)
            }) && (crate::stored_tiles::available() || crate::stored::takes_prompts())
            {
                // Every product runs on the stored blocks (`stored_products`): no tiles.
                return Ok(());
            }
            if own_kernel(Op::KQuantRepack, DeviceKind::of(&dev), DType::F32) {
                let (_, k) = t.shape().dims2()?;
                w.forward(&Tensor::zeros((2, k), DType::F32, &dev)?)?;
            }
        }
        Ok(())
    }

    /// Bytes held by the weight.
    pub fn weight_bytes(&self) -> usize {
        match self {
            QLinear::Dense(l) => l.weight().elem_count() * l.weight().dtype().size_in_bytes(),
            QLinear::Quant { w: QMatMul::QTensor(t), .. } => t.storage_size_in_bytes(),
            QLinear::Quant { w: QMatMul::Tensor(t) | QMatMul::TensorF16(t), .. } => {
                t.elem_count() * t.dtype().size_in_bytes()
            }
        }
    }
}

/// The most rows one candle product of a CPU Q4_K weight gets where AMX is left alone.
const AMX_ROWS: usize = 31;
static ALLOW_AMX: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Lets Q4_K products of 32 rows or more take candle's AMX path (process-wide; off by default).
/// candle 0.11 multiplies such products on AMX tiles where the CPU has AMX: a third copy of the
/// weight (10 bits a value, besides the stored 4.5 and the VNNI tiles' 6), made single-threaded
/// at its first such product and kept. For the 2B decoder that is 1.25 GB more and ~1.7 s in the
/// first prefill, for products 0-30% faster (`examples/qmatmul_time`: 210 rows, 2048->6144
/// 21.0 vs 21.6 ms, 6144->2048 20.7 vs 26.8 ms, on this repo's 2-core Xeon). Without it,
/// `QLinear::forward` cuts those products into pieces of 31 rows, which candle runs on the VNNI
/// tiles that decoding uses anyway.
pub fn allow_amx(allow: bool) {
    ALLOW_AMX.store(allow, std::sync::atomic::Ordering::Relaxed);
}

/// Whether this CPU has AMX (CPUID leaf 7: AMX-TILE and AMX-INT8, what candle checks) and its
/// use is not allowed.
fn avoid_amx() -> bool {
    crate::cpu::has_amx_int8() && !ALLOW_AMX.load(std::sync::atomic::Ordering::Relaxed)
}

/// `x` [.., k] times the CPU quantized `t` [n, k] transposed, on `t`'s blocks in place (see
/// `QLinear::forward_compact`). None for a block type this does not cover.
fn compact_matmul(t: &candle_core::quantized::QTensor, x: &Tensor) -> Result<Option<Tensor>> {
    use candle_core::quantized::k_quants::{self as kq, GgmlType};
    use candle_core::quantized::GgmlDType as G;
    let (n, k) = t.shape().dims2()?;
    let mut out_dims = x.dims().to_vec();
    if out_dims.pop() != Some(k) {
        return Ok(None);
    }
    out_dims.push(n);
    let m = x.elem_count() / k;
    let lhs = x.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
    let bytes = t.data()?;
    let mut dst = vec![0f32; m * n];
    fn run<T: GgmlType>(bytes: &[u8], mkn: (usize, usize, usize), lhs: &[f32], dst: &mut [f32]) -> Result<bool> {
        let size = std::mem::size_of::<T>();
        if !(bytes.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>()) || !bytes.len().is_multiple_of(size) {
            return Ok(false);
        }
        // SAFETY: the bytes are a QTensor's CPU storage of this block type (a `Vec<T>` in candle,
        // or blocks cut from one), aligned and a whole number of blocks (checked above); the
        // slice borrows them for this call only.
        let blocks = unsafe { std::slice::from_raw_parts(bytes.as_ptr() as *const T, bytes.len() / size) };
        candle_core::quantized::k_quants::matmul(mkn, lhs, blocks, dst)?;
        Ok(true)
    }
    let mkn = (m, k, n);
    let done = match t.dtype() {
        G::Q4K => run::<kq::BlockQ4K>(&bytes, mkn, &lhs, &mut dst)?,
        G::Q5K => run::<kq::BlockQ5K>(&bytes, mkn, &lhs, &mut dst)?,
        G::Q6K => run::<kq::BlockQ6K>(&bytes, mkn, &lhs, &mut dst)?,
        G::Q8_0 => run::<kq::BlockQ8_0>(&bytes, mkn, &lhs, &mut dst)?,
        G::Q4_0 => run::<kq::BlockQ4_0>(&bytes, mkn, &lhs, &mut dst)?,
        G::Q5_0 => run::<kq::BlockQ5_0>(&bytes, mkn, &lhs, &mut dst)?,
        G::Q2K => run::<kq::BlockQ2K>(&bytes, mkn, &lhs, &mut dst)?,
        G::Q3K => run::<kq::BlockQ3K>(&bytes, mkn, &lhs, &mut dst)?,
        _ => false,
    };
    if !done {
        return Ok(None);
    }
    Ok(Some(Tensor::from_vec(dst, out_dims, x.device())?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
    }

    #[test]
    fn the_first_rows_of_a_layer_give_the_first_outputs() {
        let w = crate::testing::randn(3, 0.05, (40, 512)).unwrap();
        let x = crate::testing::randn(4, 1.0, (3, 512)).unwrap();
        for q in [None, Some(QuantType::Q4K), Some(QuantType::Q8_0)] {
            let l = QLinear::new(Linear::new(w.clone(), None), q).unwrap();
            let cut = l.first_rows(24).unwrap();
            assert_eq!(cut.storage(), l.storage());
            let want = l.forward(&x).unwrap().narrow(1, 0, 24).unwrap();
            let got = cut.forward(&x).unwrap();
            assert_eq!(got.dims(), [3, 24]);
            assert!(max_diff(&got, &want) < 1e-5, "{q:?}: {}", max_diff(&got, &want));
            assert_eq!(l.first_rows(99).unwrap().forward(&x).unwrap().dims(), [3, 40]);
        }
    }

    #[test]
    fn a_q4k_product_of_many_rows_equals_its_rows_one_by_one() {
        // 70 rows. Where the CPU has AVX-512 VNNI, or AVX2 without AVX-512, they run on the
        // stored blocks (`stored_tiles`, `stored`), each row quantized and summed on its own, so the product equals that
        // kernel's rows taken alone bit for bit; elsewhere candle's paths do the same (cut into
        // 31 + 31 + 8 where the CPU has AMX). Either way within float rounding of candle's own
        // product of each row.
        let w = crate::testing::randn(7, 0.05, (48, 512)).unwrap();
        let x = crate::testing::randn(8, 1.0, (2, 35, 512)).unwrap();
        let l = QLinear::new(Linear::new(w, None), Some(QuantType::Q4K)).unwrap();
        let y = l.forward(&x).unwrap();
        assert_eq!(y.dims(), [2, 35, 48]);
        let flat = x.reshape((70, 512)).unwrap();
        // candle's own product per row (`forward` would take `stored` for one row).
        let QLinear::Quant { w: QMatMul::QTensor(t), .. } = &l else { panic!("quantized") };
        let candle = QMatMul::from_arc(t.clone()).unwrap();
        let rows: Vec<Tensor> = (0..70).map(|r| candle.forward(&flat.narrow(0, r, 1).unwrap()).unwrap()).collect();
        let alone = Tensor::cat(&rows, 0).unwrap().reshape((2, 35, 48)).unwrap();
        if crate::stored_tiles::available() || crate::stored::takes_prompts() {
            // Without AVX-512, `stored` takes all 70 rows (`stored::takes_prompts`).
            let bytes = t.data().unwrap();
            let rows: Vec<f32> = (0..70)
                .flat_map(|r| {
                    let row = flat.narrow(0, r, 1).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
                    match crate::stored_tiles::available() {
                        true => crate::stored_tiles::matmul(crate::stored::Blocks::Q4K, &bytes, 48, &row, 1, 512),
                        false => crate::stored::matmul(&[(crate::stored::Blocks::Q4K, &bytes, 48)], &row, 1, 512)
                            .map(|mut y| y.remove(0)),
                    }
                    .unwrap()
                })
                .collect();
            let ours = Tensor::from_vec(rows, (2, 35, 48), &Device::Cpu).unwrap();
            assert_eq!(max_diff(&y, &ours), 0.0);
            let scale = alone.abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
            assert!(max_diff(&y, &alone) <= 1e-5 * scale, "{} of {scale}", max_diff(&y, &alone));
        } else {
            assert_eq!(max_diff(&y, &alone), 0.0);
        }
    }

    #[test]
    fn quantized_linear_is_close_and_small_dims_stay_dense() {
        let dev = Device::Cpu;
        let w = crate::testing::randn(101, 0.05, (64, 512)).unwrap();
        let x = crate::testing::randn(102, 1., (3, 512)).unwrap();
        let dense = QLinear::new(Linear::new(w.clone(), None), None).unwrap();
        let want = dense.forward(&x).unwrap();
        let scale = want.abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
        // Activations are quantized to 8 bits too, hence a percent-level error even for 8-bit weights.
        for (q, rel) in
            [(QuantType::Q8K, 0.025), (QuantType::Q8_0, 0.025), (QuantType::Q6K, 0.04), (QuantType::Q4K, 0.1)]
        {
            let l = QLinear::new(Linear::new(w.clone(), None), Some(q)).unwrap();
            assert_eq!(l.storage(), q.name());
            let d = max_diff(&l.forward(&x).unwrap(), &want);
            assert!(d < rel * scale, "{q:?}: {d} vs scale {scale}");
            assert!(l.weight_bytes() < 512 * 64 * 4 / 3);
        }
        let small =
            QLinear::new(Linear::new(Tensor::zeros((4, 48), DType::F32, &dev).unwrap(), None), Some(QuantType::Q4K))
                .unwrap();
        assert_eq!(small.storage(), "f32");
    }
}
