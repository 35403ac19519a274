//! Qwen3-VL (`Qwen3VLForConditionalGeneration`), mirroring transformers' `models/qwen3_vl/`.

pub mod config;
pub mod inspect;
pub mod plan;
pub mod vision;

pub use config::{Qwen3VlConfig, TextConfig, VisionConfig};
pub use inspect::{inspect, Summary};
pub use plan::{check_plan, tensor_plan, Group, PlanReport, PlannedTensor};
pub use vision::{Grid, VisionOutput, VisionTower};
