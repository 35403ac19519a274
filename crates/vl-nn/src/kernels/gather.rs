//! Weighted sums of gathered table rows (interpolated lookups such as bilinear position
//! embeddings).

use candle_core::Tensor;
use multiversion::multiversion;

use crate::cpu::{cpu_f32, SendPtr};
use crate::dispatch::{own_kernel, DeviceKind, Op};

/// `out[r] = sum_t weights[r * taps + t] * table[idx[r * taps + t]]`: each output row a weighted
/// sum of `taps` rows of `table` ([rows, cols]), added in tap order (an interpolated lookup
/// table, e.g. bilinear position embeddings). On a CPU f32 table the rows are written straight
/// into the result on candle's pool; elsewhere it is `index_select`, a broadcast multiply and
/// a sum, which materialize `taps` times the result.
pub fn weighted_row_sum(table: &Tensor, idx: &[u32], weights: &[f32], taps: usize) -> candle_core::Result<Tensor> {
    let (rows, cols) = table.dims2()?;
    if taps == 0 || idx.len() != weights.len() || !idx.len().is_multiple_of(taps) {
        candle_core::bail!("weighted_row_sum: {} indices and {} weights for {taps} taps", idx.len(), weights.len());
    }
    if let Some(&bad) = idx.iter().find(|&&i| i as usize >= rows) {
        candle_core::bail!("weighted_row_sum: index {bad} outside the table's {rows} rows");
    }
    let n = idx.len() / taps;
    if own_kernel(Op::RowGather, DeviceKind::of(table.device()), table.dtype()) {
        let table = table.contiguous()?;
        let (storage, layout) = table.storage_and_layout();
        if let Some(all) = cpu_f32(&storage) {
            let src = &all[layout.start_offset()..][..rows * cols];
            let mut out = vec![0f32; n * cols];
            let ptr = SendPtr(out.as_mut_ptr());
            candle_core::utils::barrier_pool().execute_chunked(n, |range| {
                for r in range {
                    // SAFETY: output row r belongs to this work item.
                    let y = unsafe { std::slice::from_raw_parts_mut(ptr.get().add(r * cols), cols) };
                    for t in 0..taps {
                        let (i, w) = (idx[r * taps + t] as usize, weights[r * taps + t]);
                        add_scaled_row(y, &src[i * cols..(i + 1) * cols], w, t == 0);
                    }
                }
            });
            drop(storage);
            return Tensor::from_vec(out, (n, cols), table.device());
        }
    }
    let dev = table.device();
    let rows = table.index_select(&Tensor::from_slice(idx, idx.len(), dev)?, 0)?.reshape((n, taps, cols))?;
    let w = Tensor::from_slice(weights, (n, taps, 1), dev)?.to_dtype(table.dtype())?;
    rows.broadcast_mul(&w)?.sum(1)
}

/// `y = w * x` (first tap) or `y += w * x`, the product rounded before the sum (no fused
/// multiply-add, as the unfused reference computes it).
#[multiversion(targets = "simd")]
fn add_scaled_row(y: &mut [f32], x: &[f32], w: f32, first: bool) {
    if first {
        for (a, b) in y.iter_mut().zip(x) {
            *a = b * w;
        }
    } else {
        for (a, b) in y.iter_mut().zip(x) {
            *a += b * w;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::DType;

    #[test]
    fn weighted_row_sum_matches_the_gather_and_sum() {
        let table = crate::testing::randn(12, 1.0, (9, 37)).unwrap();
        let idx = [0u32, 8, 3, 3, 5, 1, 2, 7];
        let weights = [0.25f32, 0.75, 1.0, -0.5, 0.125, 0.375, 0.3, 0.2];
        let got = weighted_row_sum(&table, &idx, &weights, 2).unwrap();
        let t = table.to_vec2::<f32>().unwrap();
        let got = got.to_vec2::<f32>().unwrap();
        assert_eq!(got.len(), 4);
        for (r, row) in got.iter().enumerate() {
            for (c, v) in row.iter().enumerate() {
                let (i, j) = (idx[2 * r] as usize, idx[2 * r + 1] as usize);
                let want = t[i][c] * weights[2 * r] + t[j][c] * weights[2 * r + 1];
                assert_eq!(*v, want, "row {r} col {c}");
            }
        }
        // The generic path (another dtype) agrees, and bad input is an error, not a panic.
        let f64_sum = weighted_row_sum(&table.to_dtype(DType::F64).unwrap(), &idx, &weights, 2).unwrap();
        let diff = (f64_sum.to_dtype(DType::F32).unwrap() - Tensor::new(got, &candle_core::Device::Cpu).unwrap())
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(diff < 1e-6, "{diff}");
        assert!(weighted_row_sum(&table, &[9, 0], &[1.0, 1.0], 2).unwrap_err().to_string().contains("index 9"));
        assert!(weighted_row_sum(&table, &[0, 1, 2], &[1.0; 3], 2).is_err());
    }
}
