//! Pooled vectors: L2 normalisation and Matryoshka truncation (embedding models' `dimensions`).

use crate::error::{Error, Result};

/// `v / |v|` (as torch's `F.normalize`: the norm floored at 1e-12).
pub fn normalized(mut v: Vec<f32>) -> Vec<f32> {
    let norm = v.iter().map(|x| (*x as f64) * (*x as f64)).sum::<f64>().sqrt().max(1e-12);
    v.iter_mut().for_each(|x| *x = (*x as f64 / norm) as f32);
    v
}

/// An embedding cut to its first `dims` values and normalised again (Matryoshka truncation, as
/// vLLM serves `dimensions`); an error names the value when it is 0 or above the model's.
pub fn truncated(v: &[f32], dims: usize) -> Result<Vec<f32>> {
    if dims == 0 || dims > v.len() {
        return Err(Error::Input {
            what: "dimensions".into(),
            message: format!("{dims} is outside 1..={} (the model's embedding size)", v.len()),
        });
    }
    Ok(normalized(v[..dims].to_vec()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truncation_renormalises_and_refuses_out_of_range() {
        let v = normalized(vec![3.0, 4.0, 12.0]);
        assert!((v.iter().map(|x| x * x).sum::<f32>() - 1.0).abs() < 1e-6);
        let cut = truncated(&v, 2).unwrap();
        assert!((cut[0] - 0.6).abs() < 1e-6 && (cut[1] - 0.8).abs() < 1e-6, "{cut:?}");
        assert!(truncated(&v, 0).is_err() && truncated(&v, 4).unwrap_err().to_string().contains("1..=3"));
    }
}
