//! Quantized tensors whose blocks stay in a memory-mapped file (a GGUF's k-quant and legacy
//! blocks are the layout candle multiplies). Nothing is read at load: pages come in as the
//! kernels touch them, and being file pages, the kernel may drop them under memory pressure and
//! read them again, so a model larger than the memory left over can still run (slowly, when its
//! active set does not fit). `release` hands a range's pages back once nothing reads them: after
//! candle has repacked a weight into its tiles, the compact blocks are a second copy.

use std::marker::PhantomData;
use std::sync::Arc;

use candle_core::quantized::k_quants::{self as kq, GgmlType};
use candle_core::quantized::{GgmlDType, QStorage, QTensor, QuantizedType};
use candle_core::{CpuStorage, Shape};
use half::f16;
use memmap2::Mmap;

/// Blocks of `T` inside a shared map, or owned (once `from_float` rewrites them: a mapped file
/// is never written).
enum Blocks<T> {
    Mapped { map: Arc<Mmap>, offset: usize, len: usize, _t: PhantomData<T> },
    Owned(Vec<T>),
}

impl<T: GgmlType> Blocks<T> {
    fn slice(&self) -> &[T] {
        match self {
            // SAFETY: `mapped` checked that `offset..offset + len * size_of::<T>()` lies in the
            // map and that `offset` is aligned for `T`; the blocks are plain bytes (f16 scales and
            // integer quants, every bit pattern valid), and the map lives as long as `self`.
            Blocks::Mapped { map, offset, len, .. } => unsafe {
                std::slice::from_raw_parts(map.as_ptr().add(*offset) as *const T, *len)
            },
            Blocks::Owned(v) => v,
        }
    }
}

struct MappedBlocks<T>(Blocks<T>);

impl<T: GgmlType + 'static> QuantizedType for MappedBlocks<T> {
    fn dtype(&self) -> GgmlDType {
        T::DTYPE
    }
    fn matmul_t(&self, mkn: (usize, usize, usize), lhs: &[f32], dst: &mut [f32]) -> candle_core::Result<()> {
        kq::matmul(mkn, lhs, self.0.slice(), dst)
    }
    fn matmul_t_f16(&self, mkn: (usize, usize, usize), lhs: &[f16], dst: &mut [f16]) -> candle_core::Result<()> {
        kq::matmul_f16(mkn, lhs, self.0.slice(), dst)
    }
    fn embedding(&self, ids: &[u32], rows: usize, hidden: usize) -> candle_core::Result<CpuStorage> {
        let blocks = self.0.slice();
        if !hidden.is_multiple_of(T::BLCK_SIZE) || blocks.len() != rows * (hidden / T::BLCK_SIZE) {
            candle_core::bail!("quantized embedding of {} blocks is not {rows} rows of {hidden}", blocks.len())
        }
        let per_row = hidden / T::BLCK_SIZE;
        let mut out = vec![0f32; ids.len() * hidden];
        for (dst, &id) in out.chunks_exact_mut(hidden.max(1)).zip(ids) {
            let row = id as usize;
            if row >= rows {
                candle_core::bail!("embedding id {row} is out of range for {rows} rows")
            }
            T::to_float(&blocks[row * per_row..(row + 1) * per_row], dst);
        }
        Ok(CpuStorage::F32(out))
    }
    fn dequantize(&self, elem_count: usize) -> candle_core::Result<CpuStorage> {
        let blocks = self.0.slice();
        if elem_count != blocks.len() * T::BLCK_SIZE {
            candle_core::bail!("{elem_count} values asked of {} blocks", blocks.len())
        }
        let mut ys = vec![0f32; elem_count];
        T::to_float(blocks, &mut ys);
        Ok(CpuStorage::F32(ys))
    }
    fn storage_size_in_bytes(&self) -> usize {
        std::mem::size_of_val(self.0.slice())
    }
    fn as_ptr(&self) -> *const u8 {
        self.0.slice().as_ptr() as *const u8
    }
    fn block_size(&self) -> usize {
        T::BLCK_SIZE
    }
    fn from_float(&mut self, xs: &[f32]) {
        let mut v = vec![T::zeros(); xs.len() / T::BLCK_SIZE];
        T::from_float(xs, &mut v);
        self.0 = Blocks::Owned(v);
    }
    fn from_float_imatrix(&mut self, xs: &[f32], imatrix_weights: &[f32], n_per_row: usize) {
        let mut v = vec![T::zeros(); xs.len() / T::BLCK_SIZE];
        T::from_float_imatrix(xs, &mut v, imatrix_weights, n_per_row);
        self.0 = Blocks::Owned(v);
    }
    fn size(&self) -> usize {
        self.storage_size_in_bytes()
    }
}

fn storage<T: GgmlType + 'static>(map: &Arc<Mmap>, offset: usize, blocks: usize) -> Option<Box<dyn QuantizedType>> {
    let end = blocks.checked_mul(std::mem::size_of::<T>())?.checked_add(offset)?;
    if end > map.len() || !(map.as_ptr() as usize + offset).is_multiple_of(std::mem::align_of::<T>()) {
        return None;
    }
    Some(Box::new(MappedBlocks::<T>(Blocks::Mapped { map: map.clone(), offset, len: blocks, _t: PhantomData })))
}

/// A CPU tensor of `dtype` and `shape` over the map's bytes at `offset`, or None when the block
/// type is not one candle multiplies (floats: read and convert them instead), the bytes do not
/// lie in the map, or `offset` is not aligned for the block.
pub fn qtensor(map: &Arc<Mmap>, offset: usize, dtype: GgmlDType, shape: &[usize]) -> Option<QTensor> {
    use GgmlDType as G;
    let elems: usize = shape.iter().product();
    let bs = dtype.block_size();
    if shape.is_empty() || !shape[shape.len() - 1].is_multiple_of(bs) {
        return None;
    }
    let n = elems / bs;
    let s = match dtype {
        G::Q4_0 => storage::<kq::BlockQ4_0>(map, offset, n),
        G::Q4_1 => storage::<kq::BlockQ4_1>(map, offset, n),
        G::Q5_0 => storage::<kq::BlockQ5_0>(map, offset, n),
        G::Q5_1 => storage::<kq::BlockQ5_1>(map, offset, n),
        G::Q8_0 => storage::<kq::BlockQ8_0>(map, offset, n),
        G::Q2K => storage::<kq::BlockQ2K>(map, offset, n),
        G::Q3K => storage::<kq::BlockQ3K>(map, offset, n),
        G::Q4K => storage::<kq::BlockQ4K>(map, offset, n),
        G::Q5K => storage::<kq::BlockQ5K>(map, offset, n),
        G::Q6K => storage::<kq::BlockQ6K>(map, offset, n),
        _ => None,
    }?;
    QTensor::new(QStorage::Cpu(s), Shape::from(shape.to_vec())).ok()
}

/// Hands the whole pages inside `offset..offset + len` of a read-only map back to the kernel:
/// they leave this process's resident memory, and a later read faults them in from the file
/// again (same bytes). Errors are ignored: the pages simply stay.
#[cfg(unix)]
pub fn release(map: &Mmap, offset: usize, len: usize) {
    let page = page_size();
    let Some(start) = offset.checked_next_multiple_of(page) else { return };
    let end = offset.saturating_add(len).min(map.len()) / page * page;
    if end > start {
        // SAFETY: the map is read-only and file-backed: MADV_DONTNEED drops the pages, and a later
        // access reads the file's unchanged bytes again, so no reader sees different data.
        let _ = unsafe { map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, end - start) };
    }
}

/// `release` where pages cannot be advised: they stay.
#[cfg(not(unix))]
pub fn release(_map: &Mmap, _offset: usize, _len: usize) {}

#[cfg(unix)]
fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as usize
    } else {
        4096
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::QMatMul;
    use candle_core::{Device, Module, Tensor};

    fn values(seed: u64, n: usize) -> Vec<f32> {
        let mut state = seed;
        (0..n)
            .map(|_| {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.2
            })
            .collect()
    }

    /// A file holding `pad` bytes, then `t`'s blocks; mapped.
    fn mapped_file(t: &QTensor, pad: usize) -> (tempfile::TempDir, Arc<Mmap>) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("blocks.bin");
        let mut bytes = vec![0u8; pad];
        bytes.extend_from_slice(&t.data().unwrap());
        std::fs::write(&path, &bytes).unwrap();
        let map = unsafe { Mmap::map(&std::fs::File::open(&path).unwrap()) }.unwrap();
        (dir, Arc::new(map))
    }

    #[test]
    fn mapped_blocks_multiply_look_up_and_dequantize_as_the_read_ones_even_after_release() {
        let (n, k) = (32, 512);
        let w = Tensor::from_vec(values(1, n * k), (n, k), &Device::Cpu).unwrap();
        let x = Tensor::from_vec(values(2, 3 * k), (3, k), &Device::Cpu).unwrap();
        for dtype in [GgmlDType::Q4K, GgmlDType::Q6K, GgmlDType::Q8_0] {
            let owned = Arc::new(QTensor::quantize(&w, dtype).unwrap());
            // 4096 bytes before the blocks: the tensor starts on a page, so `release` drops them.
            let (_dir, map) = mapped_file(&owned, 4096);
            let mapped = qtensor(&map, 4096, dtype, &[n, k]).unwrap();
            assert_eq!(mapped.dtype(), dtype);
            assert_eq!(mapped.data().unwrap(), owned.data().unwrap());
            let want = QMatMul::from_arc(owned.clone()).unwrap().forward(&x).unwrap();
            let deq = owned.dequantize(&Device::Cpu).unwrap();
            let mm = QMatMul::from_arc(Arc::new(mapped)).unwrap();
            let QMatMul::QTensor(t) = &mm else { unreachable!() };
            for round in 0..2 {
                let got = mm.forward(&x).unwrap();
                let diff = (&got - &want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
                assert_eq!(diff, 0.0, "{dtype:?} round {round}");
                let d = (t.dequantize(&Device::Cpu).unwrap() - &deq).unwrap().abs().unwrap().max_all().unwrap();
                assert_eq!(d.to_scalar::<f32>().unwrap(), 0.0, "{dtype:?}");
                let ids = Tensor::new(&[5u32, 0, 31], &Device::Cpu).unwrap();
                let rows = t.embedding(&ids).unwrap();
                let d = (rows - deq.index_select(&ids, 0).unwrap()).unwrap().abs().unwrap().max_all().unwrap();
                assert_eq!(d.to_scalar::<f32>().unwrap(), 0.0, "{dtype:?}");
                let out_of_range = Tensor::new(&[32u32], &Device::Cpu).unwrap();
                assert!(t.embedding(&out_of_range).is_err());
                release(&map, 4096, map.len() - 4096);
            }
        }
    }

    #[test]
    fn a_tensor_that_is_unaligned_outside_the_map_or_not_blocks_is_not_mapped() {
        let w = Tensor::from_vec(values(3, 16 * 256), (16, 256), &Device::Cpu).unwrap();
        let owned = QTensor::quantize(&w, GgmlDType::Q4K).unwrap();
        let (_dir, map) = mapped_file(&owned, 64);
        assert!(qtensor(&map, 64, GgmlDType::Q4K, &[16, 256]).is_some());
        // BlockQ4K holds f16 scales: an odd offset is misaligned.
        assert!(qtensor(&map, 63, GgmlDType::Q4K, &[16, 256]).is_none());
        assert!(qtensor(&map, 64 + 144, GgmlDType::Q4K, &[16, 256]).is_none(), "one block past the end");
        assert!(qtensor(&map, 64, GgmlDType::Q4K, &[16, 100]).is_none(), "rows not whole blocks");
        assert!(qtensor(&map, 64, GgmlDType::F16, &[16, 256]).is_none(), "floats are read, not mapped");
    }
}
