//! Linear layers and embeddings whose storage is chosen at load time: dense (any float dtype)
//! or a k-quant (candle's GGML block formats with fast AVX2/NEON kernels). Quantization is a
//! property of the layer, not a second copy of the model.

use std::borrow::Cow;
use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QMatMul, QStorage, QTensor};
use candle_core::{DType, Module, Tensor};
use candle_nn::Linear;

use crate::dispatch::{own_kernel, own_kernel_for, DeviceKind, Op};
use crate::kernels::{cpu_f32, SendPtr};
use crate::{Error, Result};

/// Weight storage of a quantized layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantType {
    Q4K,
    Q5K,
    Q6K,
    Q8K,
    Q8_0,
    // Block types read from GGUF files as they are stored (not produced by our quantizer).
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q2K,
    Q3K,
}

impl QuantType {
    pub fn ggml(self) -> GgmlDType {
        match self {
            QuantType::Q4K => GgmlDType::Q4K,
            QuantType::Q5K => GgmlDType::Q5K,
            QuantType::Q6K => GgmlDType::Q6K,
            QuantType::Q8K => GgmlDType::Q8K,
            QuantType::Q8_0 => GgmlDType::Q8_0,
            QuantType::Q4_0 => GgmlDType::Q4_0,
            QuantType::Q4_1 => GgmlDType::Q4_1,
            QuantType::Q5_0 => GgmlDType::Q5_0,
            QuantType::Q5_1 => GgmlDType::Q5_1,
            QuantType::Q2K => GgmlDType::Q2K,
            QuantType::Q3K => GgmlDType::Q3K,
        }
    }

    /// The block types candle has kernels for; `None` for float types and the rest.
    pub fn from_ggml(d: GgmlDType) -> Option<Self> {
        Some(match d {
            GgmlDType::Q4K => QuantType::Q4K,
            GgmlDType::Q5K => QuantType::Q5K,
            GgmlDType::Q6K => QuantType::Q6K,
            GgmlDType::Q8K => QuantType::Q8K,
            GgmlDType::Q8_0 => QuantType::Q8_0,
            GgmlDType::Q4_0 => QuantType::Q4_0,
            GgmlDType::Q4_1 => QuantType::Q4_1,
            GgmlDType::Q5_0 => QuantType::Q5_0,
            GgmlDType::Q5_1 => QuantType::Q5_1,
            GgmlDType::Q2K => QuantType::Q2K,
            GgmlDType::Q3K => QuantType::Q3K,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            QuantType::Q4K => "q4k",
            QuantType::Q5K => "q5k",
            QuantType::Q6K => "q6k",
            QuantType::Q8K => "q8k",
            QuantType::Q8_0 => "q8_0",
            QuantType::Q4_0 => "q4_0",
            QuantType::Q4_1 => "q4_1",
            QuantType::Q5_0 => "q5_0",
            QuantType::Q5_1 => "q5_1",
            QuantType::Q2K => "q2k",
            QuantType::Q3K => "q3k",
        }
    }

    /// Rows of this many values quantize; others stay dense.
    pub fn block(self) -> usize {
        self.ggml().block_size()
    }
}

/// Rows quantized per task: bounds the f32 scratch of a bf16 weight to a few MiB per thread.
const QUANT_CHUNK_ROWS: usize = 64;

/// Quantizes a 2-D weight [rows, cols] (any float dtype; cols a multiple of the block size).
/// On CPU, chunks of rows are widened to f32 and quantized on every core (candle's quantizer is
/// single-threaded and wants a full f32 copy): the blocks of a row never span two rows, so the
/// chunks' bytes concatenate to the whole tensor's.
pub fn quantize_rows(w: &Tensor, q: QuantType) -> Result<QTensor> {
    let (rows, cols) = w.dims2()?;
    let threads = candle_core::utils::get_num_threads().clamp(1, rows.div_ceil(QUANT_CHUNK_ROWS).max(1));
    let kind = DeviceKind::of(w.device());
    if q == QuantType::Q4K && own_kernel(Op::Q4kQuantizer, kind, w.dtype()) {
        return quantize_q4k_cpu(&w.contiguous()?, rows, cols, threads);
    }
    if !own_kernel(Op::ParallelQuantizer, kind, w.dtype()) || threads == 1 {
        return Ok(QTensor::quantize(&w.to_dtype(DType::F32)?, q.ggml())?);
    }
    let w = w.contiguous()?;
    let chunks = rows.div_ceil(QUANT_CHUNK_ROWS);
    let next = std::sync::atomic::AtomicUsize::new(0);
    // Per thread: the (chunk index, quantized bytes) pairs it did.
    type Chunks = Vec<(usize, Vec<u8>)>;
    let results: Vec<Result<Chunks>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    let mut done = Vec::new();
                    loop {
                        let c = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        if c >= chunks {
                            return Ok(done);
                        }
                        let start = c * QUANT_CHUNK_ROWS;
                        let n = QUANT_CHUNK_ROWS.min(rows - start);
                        // A fresh buffer: candle's quantizer reads the storage from its start,
                        // ignoring a view's offset (an f32 `narrow` is such a view).
                        let part = w.narrow(0, start, n)?;
                        let part = if part.dtype() == DType::F32 {
                            Tensor::from_vec(
                                part.flatten_all()?.to_vec1::<f32>()?,
                                (n, cols),
                                &candle_core::Device::Cpu,
                            )?
                        } else {
                            part.to_dtype(DType::F32)?
                        };
                        let qt = QTensor::quantize(&part, q.ggml())?;
                        done.push((c, qt.data()?.into_owned()));
                    }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("quantization thread panicked")).collect()
    });
    let mut parts: Vec<(usize, Vec<u8>)> = Vec::with_capacity(chunks);
    for r in results {
        parts.extend(r?);
    }
    parts.sort_unstable_by_key(|(c, _)| *c);
    let mut bytes = Vec::with_capacity(parts.iter().map(|(_, b)| b.len()).sum());
    for (_, b) in parts {
        bytes.extend_from_slice(&b);
    }
    let storage = QStorage::from_data(Cow::Owned(bytes), &candle_core::Device::Cpu, q.ggml())?;
    Ok(QTensor::new(storage, (rows, cols))?)
}

/// Q4K straight from the checkpoint's rows (`crate::quant`, byte-identical to candle's
/// quantizer): chunks of rows on `threads` cores, written in place, no f32 copy of the weight.
fn quantize_q4k_cpu(w: &Tensor, rows: usize, cols: usize, threads: usize) -> Result<QTensor> {
    use crate::quant::{q4k_row, Row, Q4K_BLOCK_BYTES, QK_K};
    if !cols.is_multiple_of(QK_K) {
        return Err(Error::Shape { layer: "q4k", message: format!("row length {cols} is not a multiple of {QK_K}") });
    }
    let row_bytes = cols / QK_K * Q4K_BLOCK_BYTES;
    let mut bytes = vec![0u8; rows * row_bytes];
    {
        let (storage, layout) = w.storage_and_layout();
        let candle_core::Storage::Cpu(cpu) = &*storage else {
            return Err(Error::Shape { layer: "q4k", message: "weight is not on the CPU".into() });
        };
        let start = layout.start_offset();
        let n = rows * cols;
        let row = |r: usize| -> Result<Row<'_>> {
            let range = start + r * cols..start + (r + 1) * cols;
            Ok(match w.dtype() {
                DType::F32 => Row::F32(&cpu.as_slice::<f32>()?[..start + n][range]),
                DType::BF16 => Row::BF16(&cpu.as_slice::<half::bf16>()?[..start + n][range]),
                DType::F16 => Row::F16(&cpu.as_slice::<half::f16>()?[..start + n][range]),
                other => return Err(Error::Shape { layer: "q4k", message: format!("cannot quantize {other:?}") }),
            })
        };
        let chunks: Vec<(usize, &mut [u8])> = bytes.chunks_mut(QUANT_CHUNK_ROWS * row_bytes).enumerate().collect();
        let work = std::sync::Mutex::new(chunks.into_iter());
        let results: Vec<Result<()>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..threads.max(1))
                .map(|_| {
                    s.spawn(|| loop {
                        let next = work.lock().expect("q4k work queue").next();
                        let Some((c, out)) = next else { return Ok(()) };
                        for (i, dst) in out.chunks_exact_mut(row_bytes).enumerate() {
                            q4k_row(row(c * QUANT_CHUNK_ROWS + i)?, dst);
                        }
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("quantization thread panicked")).collect()
        });
        results.into_iter().collect::<Result<Vec<()>>>()?;
    }
    let storage = QStorage::from_data(Cow::Owned(bytes), &candle_core::Device::Cpu, GgmlDType::Q4K)?;
    Ok(QTensor::new(storage, (rows, cols))?)
}

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

/// `l` with its weight and bias in `dtype` (e.g. bf16-stored weights upcast for an f32 forward).
pub fn cast_linear(l: &Linear, dtype: DType) -> Result<Linear> {
    Ok(Linear::new(l.weight().to_dtype(dtype)?, l.bias().map(|b| b.to_dtype(dtype)).transpose()?))
}

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
///   panels (`vl_nn::bf16`), the activations rounded to bf16 as they are packed per call, f32
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

    /// The same layer computing with bf16 operands (`vl_nn::bf16`): the weights rounded to bf16
    /// once, here, the activations at each call, sums in f32; the bias stays f32. For CPU f32
    /// compute on CPUs where `bf16::available()` (AMX); elsewhere an error naming what is missing.
    pub fn to_bf16(&self) -> Result<Self> {
        if self.bf16 {
            return Ok(self.clone());
        }
        let unsupported = |why: &str| Error::Unsupported(format!("bf16 products: {why}"));
        if !crate::bf16::available() {
            return Err(unsupported(
                "they need AMX-BF16 tiles granted by Linux on x86_64 (Intel Xeon since Sapphire Rapids); this CPU or OS has none",
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
            DType::F32 => crate::bf16::pack_weights_t(&cpu.as_slice::<f32>()?[o..][..k * n], n, k),
            DType::F16 => crate::bf16::pack_weights_t(&cpu.as_slice::<half::f16>()?[o..][..k * n], n, k),
            DType::BF16 => crate::bf16::pack_weights_t(&cpu.as_slice::<half::bf16>()?[o..][..k * n], n, k),
            d => return Err(unsupported(&format!("weights in {d:?}"))),
        };
        let shape = crate::bf16::packed_weight_shape(n, k);
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
            w: self.w.to_dtype(dtype)?,
            bias: self.bias.as_ref().map(|b| b.to_dtype(dtype)).transpose()?,
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
            || (self.bf16 && !crate::bf16::available())
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
                crate::bf16::pack_rows(xs, m, k, &mut packed);
                for_each_tile(m, n, bf16_tiles(m, n, threads), |(r0, r1), (c0, c1)| {
                    // SAFETY: `bf16::available()` checked above; this item owns rows r0..r1
                    // (r0 a multiple of the group), columns c0..c1 (c0 of the panel) of the
                    // m x n output; the packed rows and panels cover m rows and n columns.
                    unsafe {
                        crate::bf16::tile(&packed, k, wp, n, bias_row.as_deref(), out_ptr.get(), (r0, r1), (c0, c1))
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
    use crate::bf16::{MR, NR};
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

/// `n` with its parameters in `dtype`.
pub fn cast_layer_norm(n: &candle_nn::LayerNorm, dtype: DType) -> Result<candle_nn::LayerNorm> {
    let w = n.weight().to_dtype(dtype)?;
    Ok(match (n.bias(), n.remove_mean()) {
        (_, false) => candle_nn::LayerNorm::rms_norm(w, n.eps()),
        (Some(b), true) => candle_nn::LayerNorm::new(w, b.to_dtype(dtype)?, n.eps()),
        (None, true) => candle_nn::LayerNorm::new_no_bias(w, n.eps()),
    })
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
    /// CPU that runs the kernel for x's row count: `stored::matmul` for up to `stored::MAX_ROWS`
    /// rows (a decode step), `stored_tiles::matmul_each` for more (no repacked copy; Q4_K only
    /// while candle's AMX path was not asked for, `allow_amx`); None otherwise.
    fn stored_products(layers: &[&QLinear], x: &Tensor) -> Result<Option<Vec<Tensor>>> {
        let k = x.dim(candle_core::D::Minus1)?;
        let rows = x.elem_count() / k.max(1);
        let few = rows <= crate::stored::MAX_ROWS;
        let runs = if few { crate::stored::available() } else { crate::stored_tiles::available() };
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
        let ys = if few {
            crate::stored::matmul(&parts, &xs, rows, k)
        } else {
            crate::stored_tiles::matmul_each(&parts, &xs, rows, k)
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
    /// for Q4_K / Q6_K weights where `stored_tiles` runs (AVX-512 VNNI): their products of any
    /// row count read the stored blocks.
    pub fn prepare(&self) -> Result<()> {
        if let QLinear::Quant { w: w @ QMatMul::QTensor(t), .. } = self {
            let dev = t.device();
            if self.stored_blocks().is_some_and(|(kind, _, _)| {
                kind == crate::stored::Blocks::Q6K || !ALLOW_AMX.load(std::sync::atomic::Ordering::Relaxed)
            }) && crate::stored_tiles::available()
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
    #[cfg(target_arch = "x86_64")]
    {
        static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        let has = *HAS.get_or_init(|| {
            let info = std::arch::x86_64::__cpuid_count(7, 0);
            info.edx & (1 << 24) != 0 && info.edx & (1 << 25) != 0
        });
        has && !ALLOW_AMX.load(std::sync::atomic::Ordering::Relaxed)
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
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

pub fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        DType::F64 => "f64",
        _ => "other",
    }
}

/// A token embedding table, dense or quantized. A quantized table dequantizes only the rows it
/// looks up, so a tied lm_head and the embedding can share one quantized copy.
#[derive(Debug, Clone)]
pub enum QEmbedding {
    Dense(Tensor),
    Quant { table: Arc<QTensor>, qtype: QuantType, rows: usize, dim: usize },
}

impl QEmbedding {
    pub fn new(table: Tensor, qtype: Option<QuantType>) -> Result<Self> {
        let (rows, dim) = table.dims2()?;
        match qtype {
            // Row lookups read the quantized bytes in place on CPU; a GPU table stays dense.
            Some(q)
                if dim % q.block() == 0
                    && own_kernel(Op::QuantEmbedding, DeviceKind::of(table.device()), table.dtype()) =>
            {
                let t = quantize_rows(&table, q)?;
                Ok(QEmbedding::Quant { table: Arc::new(t), qtype: q, rows, dim })
            }
            _ => Ok(QEmbedding::Dense(table)),
        }
    }

    /// A table already quantized (e.g. read from a GGUF file), used as stored.
    /// Off the CPU the table is dequantized once, to `dtype` (the model's compute dtype, so a
    /// tied lm_head multiplies in it; candle 0.11 reads a GPU table's bytes back to the host for
    /// each lookup): a dense table, its lm_head a dense product.
    pub fn from_qtensor(t: Arc<QTensor>, dtype: DType) -> Result<Self> {
        let dev = t.device();
        if !own_kernel(Op::QuantEmbedding, DeviceKind::of(&dev), DType::F32) {
            return Ok(QEmbedding::Dense(t.dequantize(&dev)?.to_dtype(dtype)?));
        }
        let (rows, dim) = t.shape().dims2()?;
        let qtype = QuantType::from_ggml(t.dtype()).ok_or_else(|| Error::Shape {
            layer: "QEmbedding",
            message: format!("no kernel for block type {:?}", t.dtype()),
        })?;
        Ok(QEmbedding::Quant { table: t, qtype, rows, dim })
    }

    /// Rows for `ids` as [n, dim] in `dtype`.
    pub fn lookup(&self, ids: &[u32], dtype: DType) -> Result<Tensor> {
        match self {
            QEmbedding::Dense(t) => {
                let idx = Tensor::from_slice(ids, ids.len(), t.device())?;
                Ok(t.index_select(&idx, 0)?.to_dtype(dtype)?)
            }
            QEmbedding::Quant { table, qtype, rows, dim } => {
                let data = table.data()?;
                let row_bytes = data.len() / rows;
                let mut buf = Vec::with_capacity(ids.len() * row_bytes);
                for &i in ids {
                    let i = i as usize;
                    if i >= *rows {
                        return Err(Error::Shape { layer: "QEmbedding", message: format!("id {i} >= {rows} rows") });
                    }
                    buf.extend_from_slice(&data[i * row_bytes..(i + 1) * row_bytes]);
                }
                let dev = table.device();
                let storage = QStorage::from_data(Cow::Owned(buf), &dev, qtype.ggml())?;
                let q = QTensor::new(storage, (ids.len(), *dim))?;
                Ok(q.dequantize(&dev)?.to_dtype(dtype)?)
            }
        }
    }

    /// The table as an lm_head (logits = x @ table^T).
    pub fn as_linear(&self) -> Result<QLinear> {
        match self {
            QEmbedding::Dense(t) => Ok(QLinear::Dense(Linear::new(t.clone(), None))),
            QEmbedding::Quant { table, qtype, .. } => {
                Ok(QLinear::Quant { w: QMatMul::from_arc(table.clone())?, qtype: *qtype, bias: None })
            }
        }
    }

    pub fn storage(&self) -> String {
        match self {
            QEmbedding::Dense(t) => dtype_name(t.dtype()).into(),
            QEmbedding::Quant { qtype, .. } => qtype.name().into(),
        }
    }

    pub fn weight_bytes(&self) -> usize {
        match self {
            QEmbedding::Dense(t) => t.elem_count() * t.dtype().size_in_bytes(),
            QEmbedding::Quant { table, .. } => table.storage_size_in_bytes(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
    }

    #[test]
    fn a_q4k_product_of_many_rows_equals_its_rows_one_by_one() {
        // 70 rows. Where the CPU has AVX-512 VNNI they run on the stored blocks
        // (`stored_tiles`), each row quantized and summed on its own, so the product equals that
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
        if crate::stored_tiles::available() {
            let bytes = t.data().unwrap();
            let rows: Vec<f32> = (0..70)
                .flat_map(|r| {
                    let row = flat.narrow(0, r, 1).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
                    crate::stored_tiles::matmul(crate::stored::Blocks::Q4K, &bytes, 48, &row, 1, 512).unwrap()
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
        if !crate::bf16::available() {
            let e = dense.unwrap_err().to_string();
            assert!(e.contains("AMX-BF16"), "{e}");
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

    #[test]
    fn chunked_quantization_equals_whole_tensor_quantization() {
        // 200 rows: three full chunks and a partial one, from bf16 and from f32.
        let w = crate::testing::randn(105, 1., (200, 512)).unwrap();
        for q in [QuantType::Q4K, QuantType::Q6K, QuantType::Q8K, QuantType::Q8_0] {
            for dtype in [DType::F32, DType::BF16] {
                let w = w.to_dtype(dtype).unwrap();
                let whole = QTensor::quantize(&w.to_dtype(DType::F32).unwrap(), q.ggml()).unwrap();
                let chunked = quantize_rows(&w, q).unwrap();
                assert_eq!(chunked.shape().dims(), &[200, 512]);
                assert!(whole.data().unwrap() == chunked.data().unwrap(), "{q:?} {dtype:?}");
            }
        }
    }

    #[test]
    fn quantized_embedding_rows_match_the_dequantized_table() {
        let dev = Device::Cpu;
        let t = crate::testing::randn(103, 1., (10, 256)).unwrap();
        let e = QEmbedding::new(t.clone(), Some(QuantType::Q6K)).unwrap();
        let QEmbedding::Quant { table, .. } = &e else { panic!("not quantized") };
        let full = table.dequantize(&dev).unwrap();
        let rows = e.lookup(&[7, 2, 7], DType::F32).unwrap();
        let idx = Tensor::new(&[7u32, 2, 7], &dev).unwrap();
        assert_eq!(max_diff(&rows, &full.index_select(&idx, 0).unwrap()), 0.0);
        assert!(max_diff(&rows, &t.index_select(&idx, 0).unwrap()) < 0.1);
        assert!(e.lookup(&[10], DType::F32).is_err());
        // The same table as an lm_head.
        let x = crate::testing::randn(104, 1., (2, 256)).unwrap();
        let want = x.matmul(&full.t().unwrap()).unwrap();
        let scale = want.abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
        assert!(max_diff(&e.as_linear().unwrap().forward(&x).unwrap(), &want) < 0.025 * scale);
    }
}
