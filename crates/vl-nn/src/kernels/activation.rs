//! The element-wise functions: a vectorized `exp`, the tanh-approximated and the exact (erf)
//! GELU, in place on candle's worker pool, SwiGLU's `silu(gate) * up` fused, and their tensor
//! forms.

use candle_core::Tensor;
use multiversion::multiversion;

use crate::cpu::{contiguous_f32, SendPtr};
use crate::dispatch::{own_kernel, DeviceKind, Op};

/// `e^x` to about 2 ulp for |x| <= 87 (clamped outside: `exp(-inf)` is ~1e-38, not 0, and large
/// inputs saturate at ~2^127). Cephes' `expf`: x = n ln2 + r, |r| <= ln2 / 2, degree-7
/// polynomial for e^r, 2^n from the exponent bits. Branch-free, so loops of it vectorize.
#[inline(always)]
pub(super) fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 * 2^23: adding it rounds to the nearest integer and leaves that integer in the low bits.
    const MAGIC: f32 = 12_582_912.0;
    let x = x.clamp(-87.0, 88.0);
    let t = x.mul_add(LOG2E, MAGIC);
    let n = t - MAGIC;
    let r = n.mul_add(-LN2_HI, x);
    let r = n.mul_add(-LN2_LO, r);
    let mut p = 1.987_569_1e-4_f32;
    p = p.mul_add(r, 1.398_199_9e-3);
    p = p.mul_add(r, 8.333_452e-3);
    p = p.mul_add(r, 4.166_579_6e-2);
    p = p.mul_add(r, 1.666_666_5e-1);
    p = p.mul_add(r, 0.5);
    let y = (p * r).mul_add(r, r) + 1.0;
    // n in [-126, 127]: its biased exponent, shifted into place.
    let bits = (t.to_bits().wrapping_sub(MAGIC.to_bits()) as i32 + 127) as u32;
    y * f32::from_bits(bits << 23)
}

/// `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`, written as `x / (1 + e^(-2u))` (the same
/// function; no cancellation for negative x).
#[inline(always)]
fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    let u = SQRT_2_OVER_PI * (0.044_715 * x * x).mul_add(x, x);
    x / (1.0 + exp(-2.0 * u))
}

/// The exact GELU, `0.5 x (1 + erf(x / sqrt 2))`, with erfc from Abramowitz & Stegun 7.1.26
/// (absolute error <= 1.5e-7) computed for |z| and used on the side that does not cancel:
/// `0.5 x erfc(|z|)` for negative x, `x - 0.5 x erfc(z)` for positive.
#[inline(always)]
fn gelu_erf(x: f32) -> f32 {
    let z = x.abs() * std::f32::consts::FRAC_1_SQRT_2;
    let t = 1.0 / 0.327_591_1f32.mul_add(z, 1.0);
    let mut p = 1.061_405_4f32;
    p = p.mul_add(t, -1.453_152);
    p = p.mul_add(t, 1.421_413_8);
    p = p.mul_add(t, -0.284_496_74);
    p = p.mul_add(t, 0.254_829_6);
    let erfc = p * t * exp(-z * z);
    let half = 0.5 * x * erfc;
    if x < 0.0 {
        half
    } else {
        x - half
    }
}

/// Applies `gelu_tanh` to every value, in place, on candle's worker pool.
fn gelu_tanh_inplace(values: &mut [f32]) {
    map_chunks(values, |_, v| gelu_slice(v));
}

/// Applies `gelu_erf` to every value, in place, on candle's worker pool.
fn gelu_erf_inplace(values: &mut [f32]) {
    map_chunks(values, |_, v| gelu_erf_slice(v));
}

/// Runs `f(start, chunk)` over 16 Ki-value chunks of `values` (`start`: the chunk's offset in
/// `values`) on candle's worker pool.
pub(super) fn map_chunks(values: &mut [f32], f: impl Fn(usize, &mut [f32]) + Sync) {
    const CHUNK: usize = 1 << 14;
    let n = values.len();
    let ptr = SendPtr(values.as_mut_ptr());
    candle_core::utils::barrier_pool().execute_chunked(n.div_ceil(CHUNK), |range| {
        let (start, end) = (range.start * CHUNK, (range.end * CHUNK).min(n));
        // SAFETY: work items are disjoint ranges of `values`, alive for the whole call.
        f(start, unsafe { std::slice::from_raw_parts_mut(ptr.get().add(start), end - start) });
    });
}

/// `gelu_tanh` on every value, in place, on this thread.
#[multiversion(targets = "simd")]
pub(crate) fn gelu_slice(part: &mut [f32]) {
    for v in part.iter_mut() {
        *v = gelu_tanh(*v);
    }
}

#[multiversion(targets = "simd")]
fn gelu_erf_slice(part: &mut [f32]) {
    for v in part.iter_mut() {
        *v = gelu_erf(*v);
    }
}

/// The tanh-approximated GELU of a tensor (`gelu_pytorch_tanh`). A CPU f32 tensor that is the
/// only view of its storage (a layer's fresh output) is updated in place by the vectorized
/// kernel; anything else takes candle's `gelu`.
pub(crate) fn gelu_tanh_tensor(x: Tensor) -> candle_core::Result<Tensor> {
    if own_kernel(Op::Gelu, DeviceKind::of(x.device()), x.dtype()) && x.is_contiguous() {
        x.inplace_op1(&GeluInPlace { erf: false })?;
        Ok(x)
    } else {
        x.gelu()
    }
}

/// The exact (erf) GELU of a tensor, in place on a fresh CPU f32 tensor like `gelu_tanh_tensor`;
/// candle's `gelu_erf` elsewhere.
pub(crate) fn gelu_erf_tensor(x: Tensor) -> candle_core::Result<Tensor> {
    if own_kernel(Op::Gelu, DeviceKind::of(x.device()), x.dtype()) && x.is_contiguous() {
        x.inplace_op1(&GeluInPlace { erf: true })?;
        Ok(x)
    } else {
        x.gelu_erf()
    }
}

/// The values a `silu_mul` call computes on the calling thread: a decode step's rows (candle's
/// `silu` and product would each be a pass over the pool). More are split over the pool.
const SILU_MUL_SERIAL: usize = 1 << 15;

/// SwiGLU's `silu(gate) * up` (`silu(x) = x / (1 + e^-x)`) in one pass with the vectorized `exp`,
/// for CPU f32 tensors of one shape; candle's `silu` and product elsewhere.
pub fn silu_mul(gate: &Tensor, up: &Tensor) -> candle_core::Result<Tensor> {
    let ours = own_kernel(Op::SiluMul, DeviceKind::of(gate.device()), gate.dtype())
        && up.dtype() == gate.dtype()
        && up.device().same_device(gate.device())
        && gate.dims() == up.dims()
        && gate.is_contiguous()
        && up.is_contiguous();
    if ours {
        gate.apply_op2_no_bwd(up, &SiluMul)
    } else {
        candle_nn::ops::silu(gate)? * up
    }
}

struct SiluMul;

impl candle_core::CustomOp2 for SiluMul {
    fn name(&self) -> &'static str {
        "silu-mul"
    }

    fn cpu_fwd(
        &self,
        s1: &candle_core::CpuStorage,
        l1: &candle_core::Layout,
        s2: &candle_core::CpuStorage,
        l2: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        let (gate, up) = (contiguous_f32(s1, l1, self.name())?, contiguous_f32(s2, l2, self.name())?);
        if gate.len() != up.len() {
            candle_core::bail!("silu-mul: {} gate values against {} up", gate.len(), up.len());
        }
        let mut out = vec![0f32; gate.len()];
        let part =
            |start: usize, dst: &mut [f32]| silu_mul_slice(&gate[start..][..dst.len()], &up[start..][..dst.len()], dst);
        if out.len() <= SILU_MUL_SERIAL {
            part(0, &mut out);
        } else {
            map_chunks(&mut out, part);
        }
        Ok((candle_core::CpuStorage::F32(out), l1.shape().clone()))
    }
}

#[multiversion(targets = "simd")]
fn silu_mul_slice(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = g / (1.0 + exp(-g)) * u;
    }
}

struct GeluInPlace {
    erf: bool,
}

impl candle_core::InplaceOp1 for GeluInPlace {
    fn name(&self) -> &'static str {
        "gelu-inplace"
    }

    fn cpu_fwd(&self, storage: &mut candle_core::CpuStorage, layout: &candle_core::Layout) -> candle_core::Result<()> {
        let candle_core::CpuStorage::F32(values) = storage else {
            candle_core::bail!("gelu-inplace: f32 only");
        };
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("gelu-inplace: contiguous tensors only");
        };
        if self.erf {
            gelu_erf_inplace(&mut values[start..end]);
        } else {
            gelu_tanh_inplace(&mut values[start..end]);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_matches_std_to_a_few_ulp() {
        let mut worst = 0f32;
        let mut x = -87.0f32;
        while x < 88.0 {
            let (a, b) = (exp(x), x.exp());
            worst = worst.max(((a - b) / b).abs());
            x += 0.001_37;
        }
        assert!(worst < 3e-7, "worst relative error {worst}");
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(f32::NEG_INFINITY) < 1e-37 && exp(f32::INFINITY).is_finite());
    }

    #[test]
    fn silu_mul_matches_candles_to_a_few_ulp() {
        // 3 x 5000 values run on this thread, 2 x 40000 on the pool; both within a few ulp of
        // candle's `silu(gate) * up` (its `exp` is libm's, ours the polynomial above); past
        // the clamp of `exp` a large negative gate gives a value below 1e-30 for candle's -0.
        for (seed, shape) in [(1u64, (3usize, 5000usize)), (2, (2, 40_000))] {
            let gate = crate::testing::randn(seed, 6.0, shape).unwrap();
            let up = crate::testing::randn(seed + 1, 1.0, shape).unwrap();
            let got = silu_mul(&gate, &up).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let want = (candle_nn::ops::silu(&gate).unwrap() * &up).unwrap();
            let want = want.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(got.len(), want.len());
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                assert!((a - b).abs() <= 4e-7 * b.abs() + 1e-30, "{shape:?} [{i}]: {a} vs {b}");
            }
        }
        let gate = Tensor::new(&[-200f32, 0.0, 200.0], &candle_core::Device::Cpu).unwrap();
        let up = Tensor::new(&[1f32, 1.0, 2.0], &candle_core::Device::Cpu).unwrap();
        let got = silu_mul(&gate, &up).unwrap().to_vec1::<f32>().unwrap();
        assert!(got[0].abs() < 1e-30 && got[1] == 0.0 && got[2] == 400.0, "{got:?}");
    }

    #[test]
    fn gelu_matches_the_tanh_formula() {
        let mut v: Vec<f32> = (0..100_000).map(|i| (i as f32 - 50_000.0) * 2e-4).collect();
        let want: Vec<f32> = v
            .iter()
            .map(|&x| {
                let x = x as f64;
                (0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh())) as f32
            })
            .collect();
        gelu_tanh_inplace(&mut v);
        for (a, b) in v.iter().zip(&want) {
            assert!((a - b).abs() <= 2e-7 * b.abs().max(1.0), "{a} vs {b}");
        }
    }

    #[test]
    fn gelu_erf_matches_the_definition() {
        // erf by its Maclaurin series in f64 (converges for |x| < 4 with enough terms), erfc's
        // tail by the asymptotic series beyond.
        fn erf(x: f64) -> f64 {
            if x.abs() > 3.5 {
                let z = x.abs();
                let tail = (-z * z).exp() / (z * std::f64::consts::PI.sqrt())
                    * (1.0 - 1.0 / (2.0 * z * z) + 3.0 / (4.0 * z.powi(4)) - 15.0 / (8.0 * z.powi(6)));
                return x.signum() * (1.0 - tail);
            }
            let (mut sum, mut term) = (0f64, x);
            for n in 0..120 {
                sum += term / (2 * n + 1) as f64;
                term *= -x * x / (n + 1) as f64;
            }
            2.0 / std::f64::consts::PI.sqrt() * sum
        }
        let mut v: Vec<f32> = (0..40_000).map(|i| (i as f32 - 20_000.0) * 5e-4).collect();
        let want: Vec<f64> =
            v.iter().map(|&x| 0.5 * x as f64 * (1.0 + erf(x as f64 / std::f64::consts::SQRT_2))).collect();
        gelu_erf_inplace(&mut v);
        for ((a, b), i) in v.iter().zip(&want).zip(0..) {
            assert!(
                (*a as f64 - b).abs() <= 4e-7 * b.abs().max(1.0),
                "x = {}: {a} vs {b}",
                (i as f32 - 20_000.0) * 5e-4
            );
        }
    }
}
