//! Shared helpers for the golden parity tests.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use vl_models::checkpoint::Checkpoint;
use vl_models::qwen3_vl::Qwen3VlConfig;

pub const GEOMETRIES: [&str; 2] = ["tiny-a", "tiny-b"];
pub const PROBES: [&str; 6] = ["square", "odd", "small", "large", "wide", "alpha"];
pub const CASES: [&str; 4] = ["text_only", "one_image", "two_images", "image_mid"];

pub fn goldens() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../goldens")
}

pub fn load(path: &Path) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(path, &Device::Cpu).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

pub fn read_json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

pub fn checkpoint(g: &str) -> (Qwen3VlConfig, Arc<Checkpoint>) {
    let dir = goldens().join(g).join("checkpoint");
    (Qwen3VlConfig::from_dir(&dir).unwrap(), Arc::new(Checkpoint::open(&dir).unwrap()))
}

/// Max absolute difference, both sides in f32.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims(), "shape mismatch");
    let a = a.to_dtype(DType::F32).unwrap();
    let b = b.to_dtype(DType::F32).unwrap();
    (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
}

pub fn grids(t: &Tensor) -> Vec<[usize; 3]> {
    t.to_vec2::<i64>().unwrap().iter().map(|r| [r[0] as usize, r[1] as usize, r[2] as usize]).collect()
}
