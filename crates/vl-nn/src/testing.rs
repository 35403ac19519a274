//! Seeded random tensors for unit tests and the timing examples (candle's `Tensor::randn` on
//! CPU cannot be seeded).

use candle_core::{Device, Shape, Tensor};

/// Normal(0, std) samples from a splitmix64 stream and the Box-Muller transform: the same
/// `seed` gives the same tensor on every run and machine.
pub fn randn(seed: u64, std: f32, shape: impl Into<Shape>) -> candle_core::Result<Tensor> {
    let shape = shape.into();
    let mut state = seed ^ 0x9E37_79B9_7F4A_7C15;
    let mut next = move || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        // 53 random bits in (0, 1].
        (((z ^ (z >> 31)) >> 11) as f64 + 1.0) / (1u64 << 53) as f64
    };
    let data: Vec<f32> = (0..shape.elem_count())
        .map(|_| {
            let (u1, u2) = (next(), next());
            ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32 * std
        })
        .collect();
    Tensor::from_vec(data, shape, &Device::Cpu)
}
