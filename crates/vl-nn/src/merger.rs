//! Patch merger: LayerNorm (before or after concatenating each merge block's patches), fc1,
//! exact (erf) GELU, fc2. Rows arrive in block-major order, so a block is `merge^2` consecutive rows.

use candle_core::{Module, Tensor};
use candle_nn::{LayerNorm, Linear};

use crate::linear::Dense;
use crate::Result;

#[derive(Debug, Clone)]
pub struct PatchMerger {
    norm: LayerNorm,
    fc1: Dense,
    fc2: Dense,
    /// Rows concatenated into one merged row (merge_size^2).
    unit: usize,
    /// Normalize the concatenated row (true) or each patch row before concatenation (false).
    postshuffle_norm: bool,
}

impl PatchMerger {
    pub fn new(norm: LayerNorm, fc1: &Linear, fc2: &Linear, unit: usize, postshuffle_norm: bool) -> Result<Self> {
        Ok(Self { norm, fc1: Dense::from_linear(fc1)?, fc2: Dense::from_linear(fc2)?, unit, postshuffle_norm })
    }

    /// The same merger with its weights in `dtype`.
    pub fn to_dtype(&self, dtype: candle_core::DType) -> crate::Result<Self> {
        Ok(Self {
            norm: crate::linear::cast_layer_norm(&self.norm, dtype)?,
            fc1: self.fc1.to_dtype(dtype)?,
            fc2: self.fc2.to_dtype(dtype)?,
            ..self.clone()
        })
    }

    /// The same merger with its norm in f32 and both linears on bf16 products (`Dense::to_bf16`).
    pub fn to_bf16(&self) -> crate::Result<Self> {
        Ok(Self {
            norm: crate::linear::cast_layer_norm(&self.norm, candle_core::DType::F32)?,
            fc1: self.fc1.to_bf16()?,
            fc2: self.fc2.to_bf16()?,
            ..self.clone()
        })
    }

    /// `x`: [rows, hidden] with rows a multiple of `unit`; returns [rows / unit, out].
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (rows, hidden) = x.dims2()?;
        if rows % self.unit != 0 {
            return Err(crate::Error::Shape {
                layer: "PatchMerger",
                message: format!("{rows} rows are not a multiple of the merge unit {}", self.unit),
            });
        }
        let merged = (rows / self.unit, hidden * self.unit);
        let x = if self.postshuffle_norm {
            self.norm.forward(&x.reshape(merged)?)?
        } else {
            self.norm.forward(x)?.reshape(merged)?
        };
        let x = crate::kernels::gelu_erf_tensor(self.fc1.forward(&x)?)?;
        self.fc2.forward(&x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    #[test]
    fn norm_order_matters_and_matches_hand_values() {
        let dev = Device::Cpu;
        // hidden 2, unit 2: rows [1,3],[2,6] -> one merged row.
        let x = Tensor::new(&[[1f32, 3.], [2., 6.]], &dev).unwrap();
        let ln = |n: usize| {
            LayerNorm::new(
                Tensor::ones(n, DType::F32, &dev).unwrap(),
                Tensor::zeros(n, DType::F32, &dev).unwrap(),
                1e-6,
            )
        };
        let eye4 = Linear::new(Tensor::eye(4, DType::F32, &dev).unwrap(), None);
        let pre = PatchMerger::new(ln(2), &eye4, &eye4, 2, false).unwrap();
        let post = PatchMerger::new(ln(4), &eye4, &eye4, 2, true).unwrap();
        let g = |v: f32| 0.5 * v * (1.0 + erf(v / 2f32.sqrt()));
        // Pre-shuffle: each row normalized to [-1, 1].
        let want_pre = [g(-1.0), g(1.0), g(-1.0), g(1.0)];
        // Post-shuffle: [1,3,2,6] has mean 3, var 3.5.
        let s = 3.5f32.sqrt();
        let want_post = [g(-2.0 / s), g(0.0), g(-1.0 / s), g(3.0 / s)];
        for (m, want) in [(pre, want_pre), (post, want_post)] {
            let y = m.forward(&x).unwrap().to_vec2::<f32>().unwrap();
            for (a, b) in y[0].iter().zip(want) {
                assert!((a - b).abs() < 1e-5, "{y:?} vs {want:?}");
            }
        }
    }

    fn erf(x: f32) -> f32 {
        // Abramowitz-Stegun 7.1.26 is too coarse; use a series good to 1e-7 for |x| < 3.
        let mut sum = 0f64;
        let x = x as f64;
        let mut term = x;
        for n in 0..60 {
            sum += term / (2 * n + 1) as f64;
            term *= -x * x / (n + 1) as f64;
        }
        (2.0 / std::f64::consts::PI.sqrt() * sum) as f32
    }
}
