//! llama.cpp's mirostat (`GenerationOptions::mirostat`): Mirostat 1 and Mirostat 2.0, the
//! sampler that replaces the truncation samplers when it is on (`TokenPicker` keeps its `mu` and
//! gives it the tempered candidates).

use rand::rngs::StdRng;
use rand::Rng;

/// Which mirostat and its constants.
pub(crate) struct Params {
    /// 1 or 2.
    pub version: u8,
    /// The target surprise, in bits.
    pub tau: f64,
    /// The learning rate.
    pub eta: f64,
}

/// Candidates that were left after mirostat's cut at most (llama.cpp's `m` for Mirostat 1's
/// estimate of the distribution's exponent).
const MIROSTAT_M: usize = 100;

/// llama.cpp's mirostat over the tempered logits `l` and their candidates `idx` (sorted by
/// logit, descending): normalized, cut (Mirostat 1: to the top k that its Zipf estimate gives for the target surprise
/// `mu`; Mirostat 2: to those whose surprise, -log2 p, is at most `mu`; at least one), the draw
/// from the renormalized rest, then `mu` moved by eta times the picked token's surprise minus tau.
pub(crate) fn pick(l: &[f32], mut idx: Vec<usize>, params: &Params, mu: &mut f64, rng: &mut StdRng) -> u32 {
    let normalized = |idx: &[usize]| {
        let max = l[idx[0]];
        let p: Vec<f64> = idx.iter().map(|&i| ((l[i] - max) as f64).exp()).collect();
        let total: f64 = p.iter().sum();
        p.into_iter().map(|x| x / total).collect::<Vec<f64>>()
    };
    let p = normalized(&idx);
    let keep = if params.version == 1 {
        let (mut tb, mut tt) = (0.0, 0.0);
        for i in 0..(MIROSTAT_M - 1).min(p.len() - 1) {
            let ti = ((i + 2) as f64 / (i + 1) as f64).ln();
            let bi = (p[i] / p[i + 1]).ln();
            tb += ti * bi;
            tt += ti * ti;
        }
        let s = tb / tt;
        let eps = s - 1.0;
        let k = ((eps * 2f64.powf(*mu)) / (1.0 - (l.len() as f64).powf(-eps))).powf(1.0 / s);
        if k.is_finite() {
            k as usize
        } else {
            1
        }
    } else {
        p.iter().take_while(|&&x| -x.log2() <= *mu).count()
    };
    idx.truncate(keep.clamp(1, idx.len()));
    let p = normalized(&idx);
    let mut r = rng.random::<f64>();
    let mut k = p.len() - 1;
    for (j, x) in p.iter().enumerate() {
        r -= x;
        if r <= 0.0 {
            k = j;
            break;
        }
    }
    *mu -= params.eta * (-p[k].log2() - params.tau);
    idx[k] as u32
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;

    use super::*;

    /// `pick` at temperature 1 over all of `logits`.
    fn draw(logits: &[f32], params: &Params, mu: &mut f64, rng: &mut StdRng) -> u32 {
        let mut idx: Vec<usize> = (0..logits.len()).collect();
        idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        pick(logits, idx, params, mu, rng)
    }

    #[test]
    fn mirostat_2_cuts_at_its_target_surprise_and_moves_it() {
        // p = 1/2, 1/4, 1/8, 1/8: surprises 1, 2, 3, 3 bits. tau 0.75: mu starts at 1.5, so
        // only the first token is a candidate; each pick's surprise (0 after the cut) moves mu
        // up by eta x 0.75 = 0.075, and at the 8th pick (mu 2.025 >= 2) the second one joins.
        let logits: Vec<f32> = [0.5f32, 0.25, 0.125, 0.125].iter().map(|p| p.ln()).collect();
        let params = Params { version: 2, tau: 0.75, eta: 0.1 };
        let (mut mu, mut rng) = (1.5, StdRng::seed_from_u64(0));
        for step in 0..7 {
            assert_eq!(draw(&logits, &params, &mut mu, &mut rng), 0, "step {step}");
        }
        assert!((mu - 2.025).abs() < 1e-9, "{mu}");
        let next = draw(&logits, &params, &mut mu, &mut rng);
        // Renormalized over the two: 2/3 and 1/3.
        let surprise = if next == 0 { -(2f64 / 3.0).log2() } else { -(1f64 / 3.0).log2() };
        assert!(next < 2);
        assert!((mu - (2.025 - 0.1 * (surprise - 0.75))).abs() < 1e-9, "{mu}");
    }

    #[test]
    fn mirostat_1_keeps_the_top_k_of_its_zipf_estimate() {
        // p_i proportional to 1/(i+1)^2 over 1000 tokens: the estimated exponent is exactly 2,
        // so k = (2^mu / (1 - 1000^-1))^(1/2). tau 0.1 (mu 0.2): k = 1.07, the first token, and
        // mu moves to 0.2 + 0.1 x 0.1. tau 3 (mu 6): k = 8.004, the first pick among the top 8.
        let logits: Vec<f32> = (0..1000).map(|i| -2.0 * ((i + 1) as f32).ln()).collect();
        let low = Params { version: 1, tau: 0.1, eta: 0.1 };
        let mut mu = 0.2;
        assert_eq!(draw(&logits, &low, &mut mu, &mut StdRng::seed_from_u64(0)), 0);
        assert!((mu - 0.21).abs() < 1e-9, "{mu}");
        let high = Params { version: 1, tau: 3.0, eta: 0.1 };
        let mut firsts = std::collections::BTreeSet::new();
        for seed in 0..50 {
            firsts.insert(draw(&logits, &high, &mut 6.0, &mut StdRng::seed_from_u64(seed)));
        }
        assert!(firsts.iter().all(|&t| t < 8) && firsts.len() > 1, "{firsts:?}");
    }
}
