//! Half-precision tensors widened to f32 on the CPU at memory speed: each worker of candle's pool
//! converts its share with the `half` crate's vectorized slice conversion (F16C for f16), where
//! candle's `to_dtype` converts one element at a time on one thread (the vision tower's per-block
//! upcast of a GGUF f16 mmproj or a bf16 checkpoint: 300 M values an image on the 2B).

use candle_core::{DType, Storage, Tensor};
use half::slice::HalfFloatSliceExt;

use crate::cpu::SendPtr;
use crate::Result;

/// Values a work item converts.
const CHUNK: usize = 1 << 16;

/// `t` in `dtype`: a contiguous CPU f16 / bf16 tensor widened to f32 in parallel (exact: every
/// f16 and bf16 value is an f32); anything else through candle's `to_dtype`.
pub fn to_dtype(t: &Tensor, dtype: DType) -> Result<Tensor> {
    let half = matches!(t.dtype(), DType::F16 | DType::BF16);
    if dtype != DType::F32 || !half || !t.device().is_cpu() || !t.is_contiguous() {
        return Ok(t.to_dtype(dtype)?);
    }
    let n = t.elem_count();
    let mut out = vec![0f32; n];
    {
        let (s, l) = t.storage_and_layout();
        let Storage::Cpu(c) = &*s else { return Ok(t.to_dtype(dtype)?) };
        let o = l.start_offset();
        let dst = SendPtr(out.as_mut_ptr());
        let run = |convert: &(dyn Fn(usize, &mut [f32]) + Sync)| {
            candle_core::utils::barrier_pool().execute_chunked(n.div_ceil(CHUNK), |range| {
                for i in range {
                    let (a, b) = (i * CHUNK, ((i + 1) * CHUNK).min(n));
                    // SAFETY: work items are disjoint ranges a..b of `out` (n values).
                    let d = unsafe { std::slice::from_raw_parts_mut(dst.get().add(a), b - a) };
                    convert(a, d);
                }
            })
        };
        match t.dtype() {
            DType::F16 => {
                let src = &c.as_slice::<half::f16>()?[o..o + n];
                run(&|a, d| src[a..a + d.len()].convert_to_f32_slice(d));
            }
            _ => {
                let src = &c.as_slice::<half::bf16>()?[o..o + n];
                run(&|a, d| src[a..a + d.len()].convert_to_f32_slice(d));
            }
        }
    }
    Ok(Tensor::from_vec(out, t.shape(), t.device())?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn widens_as_candle_does_bit_for_bit() {
        // More values than one work item, a view that starts inside its storage, and values of
        // every kind: normals, subnormals, infinities, a NaN's payload aside.
        let x = crate::testing::randn(501, 3.0, (3, CHUNK + 77)).unwrap();
        let special =
            Tensor::new(&[0.0f32, -0.0, 1e-7, -6e-8, 65504.0, f32::INFINITY, f32::NEG_INFINITY], x.device()).unwrap();
        for dtype in [DType::F16, DType::BF16] {
            let h = x.to_dtype(dtype).unwrap();
            let view = h.narrow(0, 1, 2).unwrap();
            for t in [&h, &view, &special.to_dtype(dtype).unwrap()] {
                let want = t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
                let got = to_dtype(t, DType::F32).unwrap();
                assert_eq!(got.dims(), t.dims());
                let got = got.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                assert!(want.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits()), "{dtype:?}");
            }
        }
    }
}
