//! The tiled transpose: a row-major buffer or a 2-D tensor transposed in 64 x 64 tiles on
//! candle's worker pool.

use candle_core::{DType, Tensor};

use crate::cpu::SendPtr;
use crate::dispatch::{own_kernel, DeviceKind, Op};

/// `t` ([rows, cols], any float dtype) transposed into a new contiguous [cols, rows] tensor of
/// the same dtype: 64 x 64 tiles on candle's worker pool (candle's strided copy walks the source
/// element by element). CPU tensors only; others take candle's `t().contiguous()`.
pub(crate) fn transpose(t: &Tensor) -> candle_core::Result<Tensor> {
    if t.rank() == 2 && !t.is_contiguous() && t.t()?.is_contiguous() {
        // Already a transposed view of a contiguous [cols, rows] buffer (a loader that wrote
        // it so): that buffer is the result, shared, nothing copied.
        return t.t();
    }
    if !own_kernel(Op::Transpose, DeviceKind::of(t.device()), t.dtype()) || t.rank() != 2 {
        return t.t()?.contiguous();
    }
    let t = t.contiguous()?;
    let (rows, cols) = t.dims2()?;
    let (storage, layout) = t.storage_and_layout();
    let candle_core::Storage::Cpu(cpu) = &*storage else {
        return t.t()?.contiguous();
    };
    let o = layout.start_offset();
    macro_rules! go {
        ($ty:ty) => {{
            let src = &cpu.as_slice::<$ty>()?[o..o + rows * cols];
            Tensor::from_vec(transpose_slice(src, rows, cols), (cols, rows), t.device())
        }};
    }
    match t.dtype() {
        DType::F32 => go!(f32),
        DType::BF16 => go!(half::bf16),
        DType::F16 => go!(half::f16),
        _ => t.t()?.contiguous(),
    }
}

/// `src` ([rows, cols] row-major) transposed into a new [cols, rows] row-major buffer, 64 x 64
/// tiles on candle's pool, each new page written (and faulted in) once, by the thread that fills
/// it. Panics if `src` is shorter than `rows * cols`.
pub fn transpose_slice<T: Copy + Send + Sync>(src: &[T], rows: usize, cols: usize) -> Vec<T> {
    let src = &src[..rows * cols];
    const TILE: usize = 64;
    // Not zeroed first: every element is written once below, so the new pages are touched (and
    // faulted in) only by the threads that fill them, in parallel.
    let mut dst: Vec<T> = Vec::with_capacity(rows * cols);
    let ptr = SendPtr(dst.as_mut_ptr());
    candle_core::utils::barrier_pool().execute_chunked(cols.div_ceil(TILE), |range| {
        for tc in range {
            let (c0, c1) = (tc * TILE, ((tc + 1) * TILE).min(cols));
            for r0 in (0..rows).step_by(TILE) {
                let r1 = (r0 + TILE).min(rows);
                for c in c0..c1 {
                    for r in r0..r1 {
                        // SAFETY: destination rows c0..c1 belong to this work item, inside the
                        // reserved capacity (written, never read, before `set_len`).
                        unsafe { ptr.get().add(c * rows + r).write(src[r * cols + c]) };
                    }
                }
            }
        }
    });
    // SAFETY: the work items cover columns 0..cols, each writing its rows 0..rows: every element.
    unsafe { dst.set_len(rows * cols) };
    dst
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transpose_is_exact() {
        let t = crate::testing::randn(11, 1.0, (67, 130)).unwrap();
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let x = t.to_dtype(dtype).unwrap();
            let want = x.t().unwrap().contiguous().unwrap().to_dtype(DType::F32).unwrap();
            let got = transpose(&x).unwrap();
            assert_eq!(got.dtype(), dtype);
            let diff = (got.to_dtype(DType::F32).unwrap() - &want).unwrap().abs().unwrap().max_all().unwrap();
            assert_eq!(diff.to_scalar::<f32>().unwrap(), 0.0, "{dtype:?}");
        }
        {
            // A transposed view of a contiguous buffer (as the GGUF loader writes a linear's
            // weight): the buffer itself, contiguous, the same values; its own rows transposed
            // by `transpose_slice` give that buffer.
            let rows: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
            let buffer = Tensor::from_vec(transpose_slice(&rows, 67, 130), (130, 67), t.device()).unwrap();
            let view = buffer.t().unwrap();
            assert!(!view.is_contiguous());
            assert_eq!(view.to_vec2::<f32>().unwrap(), t.to_vec2::<f32>().unwrap());
            let got = transpose(&view).unwrap();
            assert!(got.is_contiguous());
            assert_eq!(got.to_vec2::<f32>().unwrap(), buffer.to_vec2::<f32>().unwrap());
        }
    }
}
