//! RMSNorm whose calls on a few rows (a decode step's, one per sequence, and its per-head
//! norms) run on the calling thread, with candle's arithmetic. candle's own op spreads more
//! than 32 rows over rayon's pool, a second set of threads beside candle's barrier pool that
//! the products run on: for a few thousand values the hand-off (waking a rayon thread, waiting
//! on its latch) costs more than the work, and on a machine with as many threads as cores it
//! preempts the pool. Larger inputs (prompts) take candle's op.

use candle_core::{CpuStorage, CustomOp2, DType, Device, Layout, Module, Shape, Tensor};

use crate::cpu::contiguous_f32;

/// The most values a call of `RmsNorm` (and of the rotary embedding) computes on the calling thread
/// (64 Ki: 32 rows of 2048, or 512 heads' rows of 128).
pub(crate) const SERIAL_MAX: usize = 1 << 16;

/// An RMSNorm (weight, eps): `x / sqrt(mean(x^2) + eps) * weight` over the last dimension.
#[derive(Debug, Clone)]
pub struct RmsNorm {
    inner: candle_nn::RmsNorm,
}

impl RmsNorm {
    pub fn new(weight: Tensor, eps: f64) -> Self {
        Self { inner: candle_nn::RmsNorm::new(weight, eps) }
    }

    /// The weight `[dim]` at `vb`'s "weight".
    pub fn load(dim: usize, eps: f64, vb: candle_nn::VarBuilder) -> candle_core::Result<Self> {
        Ok(Self { inner: candle_nn::rms_norm(dim, eps, vb)? })
    }

    pub fn weight(&self) -> &Tensor {
        self.inner.weight()
    }

    pub fn eps(&self) -> f64 {
        self.inner.eps()
    }
}

impl Module for RmsNorm {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let w = self.inner.weight();
        let serial = matches!(x.device(), Device::Cpu)
            && x.dtype() == DType::F32
            && w.dtype() == DType::F32
            && x.is_contiguous()
            && w.is_contiguous()
            && x.elem_count() <= SERIAL_MAX
            && x.rank() >= 1
            && w.dims1().ok() == x.dims().last().copied();
        if serial {
            return x.apply_op2_no_bwd(w, &Serial { eps: self.inner.eps() as f32 });
        }
        self.inner.forward(x)
    }
}

/// `RmsNorm` on the calling thread: each row as candle's `rms_row` computes it (the squares
/// summed in order, the root of their mean plus eps, each value divided by it then times the
/// weight), so results are bit for bit candle's.
struct Serial {
    eps: f32,
}

impl CustomOp2 for Serial {
    fn name(&self) -> &'static str {
        "rms-norm-serial"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let name = self.name();
        let (x, w) = (contiguous_f32(s1, l1, name)?, contiguous_f32(s2, l2, name)?);
        let n = w.len();
        if n == 0 || !x.len().is_multiple_of(n) {
            candle_core::bail!("rms-norm-serial: {} values in rows of {n}", x.len());
        }
        let mut out = vec![0f32; x.len()];
        for (src, dst) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
            let sum2 = src.iter().map(|&v| v * v).sum::<f32>();
            let m = (sum2 / n as f32 + self.eps).sqrt();
            for ((d, &s), &a) in dst.iter_mut().zip(src).zip(w) {
                *d = s / m * a;
            }
        }
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn few_rows_are_bit_for_bit_candles_norm() {
        // 64 rows of 128 run here (candle's op takes them to rayon's pool), 3 of 2048 too (candle
        // on the calling thread): both must equal candle's op exactly, and more than SERIAL_MAX
        // values take candle's op itself.
        let w = crate::testing::randn(1, 1.0, 128).unwrap();
        let norm = RmsNorm::new(w.clone(), 1e-6);
        let theirs = candle_nn::RmsNorm::new(w, 1e-6);
        for (seed, shape) in [(2, vec![64, 128]), (3, vec![4, 16, 128]), (4, vec![1, 128]), (5, vec![600, 128])] {
            let x = crate::testing::randn(seed, 2.0, shape.as_slice()).unwrap();
            let (a, b) = (norm.forward(&x).unwrap(), theirs.forward(&x).unwrap());
            assert_eq!(a.dims(), b.dims());
            let (a, b) = (
                a.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                b.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            );
            assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "{shape:?}");
        }
        let w = crate::testing::randn(6, 1.0, 2048).unwrap();
        let x = crate::testing::randn(7, 1.0, (3, 2048)).unwrap();
        let a = RmsNorm::new(w.clone(), 1e-5).forward(&x).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let b = candle_nn::RmsNorm::new(w, 1e-5).forward(&x).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(a, b);
    }
}
