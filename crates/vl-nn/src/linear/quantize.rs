//! Quantizing a weight's rows: candle's quantizer on chunks of rows on every core, or for Q4K
//! our own (`crate::quant`), straight from the checkpoint's rows.

use std::borrow::Cow;

use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::{DType, Tensor};

use super::QuantType;
use crate::dispatch::{own_kernel, DeviceKind, Op};
use crate::{Error, Result};

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

#[cfg(test)]
mod tests {
    use super::*;

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
}
