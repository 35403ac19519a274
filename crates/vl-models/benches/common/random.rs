//! Random weights for a tensor plan, so benches run at real geometry without a checkpoint.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use vl_models::qwen3_vl::{Group, PlannedTensor};

pub fn random_weights(plan: &[PlannedTensor], groups: &[Group], dtype: DType, dev: &Device) -> HashMap<String, Tensor> {
    plan.iter()
        .filter(|p| p.required && groups.contains(&p.group))
        .map(|p| {
            let fan_in: usize = p.shape.iter().skip(1).product::<usize>().max(1);
            let std = if p.shape.len() == 1 { 0.1 } else { 1.0 / (fan_in as f64).sqrt() };
            let mean = if p.key.contains("norm") && p.key.ends_with("weight") { 1.0 } else { 0.0 };
            let t = Tensor::randn(mean as f32, std as f32, p.shape.as_slice(), dev).unwrap().to_dtype(dtype).unwrap();
            (p.key.clone(), t)
        })
        .collect()
}
