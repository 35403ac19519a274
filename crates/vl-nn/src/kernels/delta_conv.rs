//! The Gated DeltaNet layer's element-wise parts around the rule (`delta`): the short causal
//! convolution of q, k and v with SiLU, and the output's gated RMSNorm. Both cut their rows into
//! chunks on candle's pool, in vectorized passes, SiLU with the polynomial `exp`.

use crate::cpu::SendPtr;

/// A depthwise convolution's weight laid out [kernel, channels] (made once, at load), so each
/// tap is a contiguous row across the channels.
#[derive(Debug, Clone)]
pub struct ConvTaps {
    taps: Vec<f32>,
    channels: usize,
    kernel: usize,
}

impl ConvTaps {
    /// From `weight` [channels, kernel] (the last tap on the current row).
    pub fn new(weight: &[f32], channels: usize, kernel: usize) -> Self {
        assert!(kernel >= 1 && weight.len() == channels * kernel);
        let mut taps = vec![0f32; kernel * channels];
        for (c, wc) in weight.chunks_exact(kernel).enumerate() {
            for (j, &v) in wc.iter().enumerate() {
                taps[j * channels + c] = v;
            }
        }
        Self { taps, channels, kernel }
    }
}

/// The depthwise causal convolution over time with SiLU: `x` [rows, channels] after the
/// `window` [kernel - 1, channels] of earlier inputs (oldest first; zeros before a sequence's
/// start), with the weight `taps`. Returns the outputs [rows, channels] and writes the new window
/// (the last kernel - 1 inputs) back. Every output is its own sum, so the rows are cut into chunks
/// on candle's pool, each a vectorized pass per tap, and SiLU with the polynomial `exp`.
pub fn causal_conv1d_silu(x: &[f32], taps: &ConvTaps, window: &mut [f32]) -> Vec<f32> {
    let ConvTaps { ref taps, channels, kernel } = *taps;
    let rows = x.len() / channels.max(1);
    let w = kernel - 1;
    assert!(x.len() == rows * channels && window.len() == w * channels);
    let mut out = vec![0f32; rows * channels];
    super::activation::map_chunks(&mut out, |start, part| {
        conv_part((window, x), taps, (channels, kernel), start, part)
    });
    // The new window: the last w inputs, of the old window and `x`.
    let mut all = Vec::with_capacity(2 * w * channels);
    all.extend_from_slice(window);
    all.extend_from_slice(&x[rows.saturating_sub(w) * channels..]);
    window.copy_from_slice(&all[all.len() - w * channels..]);
    out
}

/// Outputs `start..start + part.len()` of `causal_conv1d_silu` (flat [rows, channels] indices),
/// a row's run of channels at a time; output row t reads input rows t..t + kernel of the
/// window (its kernel - 1 rows) followed by `x`.
#[multiversion::multiversion(targets = "simd")]
fn conv_part(
    (window, x): (&[f32], &[f32]),
    taps: &[f32],
    (channels, kernel): (usize, usize),
    start: usize,
    part: &mut [f32],
) {
    let w = kernel - 1;
    let mut i = start;
    while i < start + part.len() {
        let (t, c0) = (i / channels, i % channels);
        let n = (channels - c0).min(start + part.len() - i);
        let o = &mut part[i - start..][..n];
        for j in 0..kernel {
            let r = t + j;
            let src = if r < w { &window[r * channels + c0..][..n] } else { &x[(r - w) * channels + c0..][..n] };
            for ((y, &xv), &wv) in o.iter_mut().zip(src).zip(&taps[j * channels + c0..][..n]) {
                *y += wv * xv;
            }
        }
        for y in o.iter_mut() {
            *y /= 1.0 + super::activation::exp(-*y);
        }
        i += n;
    }
}

/// The layer output's gated RMSNorm, in place: each head of `weight.len()` values of `o` times
/// rsqrt(mean(o^2) + eps), `weight` and silu(`z`), on candle's pool (groups of heads of ~16 Ki
/// values), SiLU with the polynomial `exp`.
pub fn gated_rms_norm(o: &mut [f32], z: &[f32], weight: &[f32], eps: f32) {
    let d = weight.len();
    assert!(d > 0 && o.len() == z.len() && o.len().is_multiple_of(d));
    let heads = o.len() / d;
    let per = (16_384 / d).max(1);
    let ptr = SendPtr(o.as_mut_ptr());
    super::tile::for_each_item(
        heads.div_ceil(per),
        || (),
        |item, _| {
            let (h0, h1) = (item * per, ((item + 1) * per).min(heads));
            // SAFETY: items are disjoint groups of heads of `o`, alive for the whole call.
            let part = unsafe { std::slice::from_raw_parts_mut(ptr.get().add(h0 * d), (h1 - h0) * d) };
            norm_part(part, &z[h0 * d..h1 * d], weight, eps);
        },
    );
}

#[multiversion::multiversion(targets = "simd")]
fn norm_part(o: &mut [f32], z: &[f32], weight: &[f32], eps: f32) {
    let d = weight.len();
    for (oh, zh) in o.chunks_exact_mut(d).zip(z.chunks_exact(d)) {
        let inv = 1.0 / (oh.iter().map(|x| x * x).sum::<f32>() / d as f32 + eps).sqrt();
        for ((y, &w), &zz) in oh.iter_mut().zip(weight).zip(zh) {
            *y = (*y * inv) * w * (zz / (1.0 + super::activation::exp(-zz)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic values in [-0.5, 0.5) (a Weyl sequence).
    fn rnd(n: usize, seed: u64) -> Vec<f32> {
        (0..n as u64)
            .map(|i| ((i + 1) * 0x9E37_79B9 + seed * 0x7F4A_7C15) as u32 as f32 / 4_294_967_296.0 - 0.5)
            .collect()
    }

    #[test]
    fn the_convolution_continues_across_calls() {
        let (c, kern) = (3, 4);
        let x = rnd(7 * c, 9);
        let w = rnd(c * kern, 10);
        let mut win = vec![0f32; (kern - 1) * c];
        let whole = causal_conv1d_silu(&x, &ConvTaps::new(&w, c, kern), &mut win);
        let mut win2 = vec![0f32; (kern - 1) * c];
        let mut parts = causal_conv1d_silu(&x[..2 * c], &ConvTaps::new(&w, c, kern), &mut win2);
        parts.extend(causal_conv1d_silu(&x[2 * c..], &ConvTaps::new(&w, c, kern), &mut win2));
        assert_eq!(whole, parts);
        assert_eq!(win, win2);
        // Row 0 sees only itself: silu(w[c, last] * x[0, c]).
        let y = w[kern - 1] * x[0];
        assert!((whole[0] - y / (1.0 + (-y).exp())).abs() < 1e-6);
    }

    #[test]
    fn the_convolution_matches_its_definition_across_chunk_seams() {
        // 40,000 outputs: three chunks on the pool, their seams inside rows; in f64 from the
        // definition (the window's rows first, then the input's).
        let (c, kern, rows) = (1000, 4, 40);
        let (x, w, win0) = (rnd(rows * c, 31), rnd(c * kern, 32), rnd((kern - 1) * c, 33));
        let mut win = win0.clone();
        let got = causal_conv1d_silu(&x, &ConvTaps::new(&w, c, kern), &mut win);
        let input = |r: usize, ch: usize| if r < kern - 1 { win0[r * c + ch] } else { x[(r + 1 - kern) * c + ch] };
        let mut worst = 0f64;
        for t in 0..rows {
            for ch in 0..c {
                let y: f64 = (0..kern).map(|j| w[ch * kern + j] as f64 * input(t + j, ch) as f64).sum();
                let want = y / (1.0 + (-y).exp());
                worst = worst.max((got[t * c + ch] as f64 - want).abs() / (1.0 + want.abs()));
            }
        }
        assert!(worst < 1e-6, "{worst}");
        assert_eq!(win, x[(rows + 1 - kern) * c..]);
    }

    #[test]
    fn the_gated_norm_matches_its_definition_on_every_head() {
        // 300 heads of 100 (30,000 values: two groups on the pool), in f64 from the definition.
        let (d, heads, eps) = (100, 300, 1e-6f32);
        let (o0, z, w) = (rnd(heads * d, 41), rnd(heads * d, 42), rnd(d, 43));
        let mut o = o0.clone();
        gated_rms_norm(&mut o, &z, &w, eps);
        let mut worst = 0f64;
        for h in 0..heads {
            let oh = &o0[h * d..][..d];
            let ms = oh.iter().map(|&x| x as f64 * x as f64).sum::<f64>() / d as f64;
            for i in 0..d {
                let zz = z[h * d + i] as f64;
                let want = oh[i] as f64 / (ms + eps as f64).sqrt() * w[i] as f64 * zz / (1.0 + (-zz).exp());
                worst = worst.max((o[h * d + i] as f64 - want).abs() / (1.0 + want.abs()));
            }
        }
        assert!(worst < 1e-6, "{worst}");
    }
}
