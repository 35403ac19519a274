//! Rotary position embeddings: a 2-axis (row, col) rotary for vision patches and a multi-axis
//! (t, h, w) rotary with interleaved frequency sections (M-RoPE) for the text decoder. Both
//! produce the half-width `cos`/`sin` tables ([positions, head_dim / 2]) that candle's
//! `rotary_emb::rope` consumes (rotate-half layout: the table is duplicated across the halves).

use candle_core::{CpuStorage, CustomOp3, DType, Device, Layout, Shape, Tensor};

use crate::cpu::contiguous_f32;
use crate::Result;

/// candle's `rotary_emb::rope` (rotate-half) of `x` [b, heads, t, d] by `cos`/`sin` [t', d / 2]
/// (t <= t'), with a few rows (a decode step's, up to `crate::norm::SERIAL_MAX` values) on the
/// calling thread: candle spreads t > 1 over rayon's pool, whose hand-off costs more than the
/// work there (see `crate::norm`). The same arithmetic, so bit for bit candle's.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> candle_core::Result<Tensor> {
    let serial = matches!(x.device(), Device::Cpu)
        && [x, cos, sin].iter().all(|t| t.dtype() == DType::F32 && t.is_contiguous())
        && x.elem_count() <= crate::norm::SERIAL_MAX
        && x.rank() == 4
        && cos.rank() == 2
        && cos.dims() == sin.dims()
        && cos.dim(1)? * 2 == x.dim(3)?
        && x.dim(2)? <= cos.dim(0)?;
    if serial {
        return x.apply_op3_no_bwd(cos, sin, &SerialRope);
    }
    candle_nn::rotary_emb::rope(x, cos, sin)
}

/// `rope` on the calling thread: candle's `RotaryEmb` loop for t >= 1.
struct SerialRope;

impl CustomOp3 for SerialRope {
    fn name(&self) -> &'static str {
        "rope-serial"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let name = self.name();
        let x = contiguous_f32(s1, l1, name)?;
        let (cos, sin) = (contiguous_f32(s2, l2, name)?, contiguous_f32(s3, l3, name)?);
        let (_, _, t, d) = l1.shape().dims4()?;
        let half = d / 2;
        if d == 0 || d % 2 != 0 || cos.len() < t * half || sin.len() < t * half {
            candle_core::bail!("rope-serial: head dim {d}, {t} rows, tables of {} values", cos.len());
        }
        let mut out = vec![0f32; x.len()];
        for (src, dst) in x.chunks_exact(t * d).zip(out.chunks_exact_mut(t * d)) {
            for i_t in 0..t {
                for i_d in 0..half {
                    let (i1, i_cs) = (i_t * d + i_d, i_t * half + i_d);
                    let i2 = i1 + half;
                    dst[i1] = src[i1] * cos[i_cs] - src[i2] * sin[i_cs];
                    dst[i2] = src[i1] * sin[i_cs] + src[i2] * cos[i_cs];
                }
            }
        }
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }
}

/// Inverse frequencies `1 / theta^(2i / dim)` for `i < dim / 2`, in f32 as the reference computes them.
pub fn inv_freq(dim: usize, theta: f64) -> Vec<f32> {
    (0..dim / 2).map(|i| 1.0 / (theta as f32).powf((2 * i) as f32 / dim as f32)).collect()
}

/// 2-axis rotary: frequencies over head_dim / 2, row angles then column angles.
#[derive(Debug, Clone)]
pub struct TwoAxisRope {
    inv_freq: Vec<f32>,
}

impl TwoAxisRope {
    /// `head_dim` of the attention heads; each axis gets head_dim / 4 frequencies.
    pub fn new(head_dim: usize, theta: f64) -> Self {
        Self { inv_freq: inv_freq(head_dim / 2, theta) }
    }

    /// cos and sin tables, each [positions, head_dim / 2]: `[row * f, col * f]` per position.
    pub fn cos_sin(&self, positions: &[(u32, u32)], device: &Device) -> Result<(Tensor, Tensor)> {
        let q = self.inv_freq.len();
        let mut cos = Vec::with_capacity(positions.len() * 2 * q);
        let mut sin = Vec::with_capacity(positions.len() * 2 * q);
        for &(r, c) in positions {
            for p in [r, c] {
                for &f in &self.inv_freq {
                    let a = p as f32 * f;
                    cos.push(a.cos());
                    sin.push(a.sin());
                }
            }
        }
        let n = positions.len();
        Ok((Tensor::from_vec(cos, (n, 2 * q), device)?, Tensor::from_vec(sin, (n, 2 * q), device)?))
    }
}

/// Multi-axis rotary with interleaved sections: frequency slot `i` takes its angle from axis
/// H when `i % 3 == 1 && i < 3 * sections[1]`, from W when `i % 3 == 2 && i < 3 * sections[2]`,
/// else from T (the reference's interleaved M-RoPE).
#[derive(Debug, Clone)]
pub struct MultiAxisRope {
    inv_freq: Vec<f32>,
    /// Axis (0 = t, 1 = h, 2 = w) of each frequency slot.
    axis_of_slot: Vec<usize>,
}

impl MultiAxisRope {
    pub fn new(head_dim: usize, theta: f64, sections: [usize; 3]) -> Self {
        let inv_freq = inv_freq(head_dim, theta);
        let axis_of_slot = (0..inv_freq.len())
            .map(|i| match i % 3 {
                1 if i < 3 * sections[1] => 1,
                2 if i < 3 * sections[2] => 2,
                _ => 0,
            })
            .collect();
        Self { inv_freq, axis_of_slot }
    }

    pub fn axis_of_slot(&self) -> &[usize] {
        &self.axis_of_slot
    }

    /// cos and sin tables [positions, head_dim / 2] for (t, h, w) positions.
    pub fn cos_sin(&self, positions: &[[i64; 3]], device: &Device) -> Result<(Tensor, Tensor)> {
        let q = self.inv_freq.len();
        let mut cos = Vec::with_capacity(positions.len() * q);
        let mut sin = Vec::with_capacity(positions.len() * q);
        for p in positions {
            for (f, &axis) in self.inv_freq.iter().zip(&self.axis_of_slot) {
                let a = p[axis] as f32 * f;
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
        let n = positions.len();
        Ok((Tensor::from_vec(cos, (n, q), device)?, Tensor::from_vec(sin, (n, q), device)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_of_a_few_rows_is_bit_for_bit_candles() {
        // t = 4 runs here (candle takes t > 1 to rayon's pool), t = 1 too, and t = 600 x 16
        // heads of 128 (more than SERIAL_MAX values) takes candle's own; cos/sin tables longer
        // than t use their first t rows, as candle's do.
        for (seed, (b, h, t, d), rows) in
            [(1, (1, 16, 4, 128), 4), (2, (1, 8, 1, 64), 3), (3, (1, 16, 40, 128), 40), (4, (1, 2, 600, 128), 600)]
        {
            let x = crate::testing::randn(seed, 1.0, (b, h, t, d)).unwrap();
            let cos = crate::testing::randn(seed + 10, 1.0, (rows, d / 2)).unwrap();
            let sin = crate::testing::randn(seed + 20, 1.0, (rows, d / 2)).unwrap();
            let a = rope(&x, &cos, &sin).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let want =
                candle_nn::rotary_emb::rope(&x, &cos, &sin).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert!(a.iter().zip(&want).all(|(p, q)| p.to_bits() == q.to_bits()), "{:?}", (b, h, t, d));
            assert_eq!(a.len(), want.len());
        }
    }

    #[test]
    fn inv_freq_of_dim_8() {
        let f = inv_freq(8, 10000.0);
        let want = [1.0, 0.1, 0.01, 0.001];
        for (a, b) in f.iter().zip(want) {
            assert!((a - b).abs() < 1e-7, "{f:?}");
        }
    }

    #[test]
    fn two_axis_tables_put_rows_then_columns() {
        // head_dim 8: 2 frequencies per axis, [1, 0.01].
        let rope = TwoAxisRope::new(8, 10000.0);
        let (cos, sin) = rope.cos_sin(&[(0, 0), (2, 3)], &Device::Cpu).unwrap();
        let sin = sin.to_vec2::<f32>().unwrap();
        let cos = cos.to_vec2::<f32>().unwrap();
        assert_eq!(cos[0], vec![1.0; 4]);
        let want = [2.0f32.sin(), 0.02f32.sin(), 3.0f32.sin(), 0.03f32.sin()];
        for (a, b) in sin[1].iter().zip(want) {
            assert!((a - b).abs() < 1e-6, "{sin:?}");
        }
    }

    #[test]
    fn mrope_slots_are_interleaved_like_the_reference() {
        // Qwen3-VL: 64 slots, sections [24, 20, 20]: T H W T H W ... up to slot 59, then T.
        let r = MultiAxisRope::new(128, 5e6, [24, 20, 20]);
        let a = r.axis_of_slot();
        assert_eq!(&a[..7], &[0, 1, 2, 0, 1, 2, 0]);
        assert_eq!(&a[57..], &[0, 1, 2, 0, 0, 0, 0]);
        assert_eq!(a.iter().filter(|&&x| x == 0).count(), 24);
        assert_eq!(a.iter().filter(|&&x| x == 1).count(), 20);
        // Small: 8 slots, [4, 2, 2] -> T H W T H W T T.
        assert_eq!(MultiAxisRope::new(16, 1e4, [4, 2, 2]).axis_of_slot(), &[0, 1, 2, 0, 1, 2, 0, 0]);
    }

    #[test]
    fn mrope_angles_follow_the_axis_of_each_slot() {
        let r = MultiAxisRope::new(6, 1.0, [1, 1, 1]); // 3 slots, all frequencies 1.0
        let (cos, _) = r.cos_sin(&[[1, 2, 3]], &Device::Cpu).unwrap();
        let cos = cos.to_vec2::<f32>().unwrap();
        let want = [1.0f32.cos(), 2.0f32.cos(), 3.0f32.cos()];
        for (a, b) in cos[0].iter().zip(want) {
            assert!((a - b).abs() < 1e-7);
        }
    }
}
