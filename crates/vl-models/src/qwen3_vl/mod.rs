//! Qwen3-VL (`Qwen3VLForConditionalGeneration`), mirroring transformers' `models/qwen3_vl/`.

pub mod config;
pub mod family;
pub mod gguf;
mod gguf_names;
pub mod gguf_write;
pub mod image_processor;
pub mod inspect;
pub mod model;
pub mod plan;
pub mod positions;
pub mod preflight;
pub mod prepare;
pub mod presets;
pub mod processor;
pub mod text;
pub mod video_processor;
pub mod vision;
pub mod weights;

pub use crate::formats::generation_config::GenerationConfig;
pub use config::{Qwen3VlConfig, TextConfig, VisionConfig};
pub use image_processor::{ImageFile, ImageProcessor, PreprocessorConfig, ProcessedImage};
pub use inspect::{inspect, Summary};
pub use model::{PrefillOutput, Prompt, Qwen3VlModel, VisionInput};
pub use plan::{check_plan, plan_for, split_experts, tensor_plan, Group, PlanReport, PlannedTensor};
pub use preflight::ModelDir;
pub use processor::{Content, Message, Processor, StreamDecoder, TemplateToolCall};
pub use text::{LoadPlan, Prequantized, QuantLoad, TextCache, TextModel};
pub use video_processor::{ProcessedVideo, VideoConfig, VideoOptions, VideoPlan, VideoProcessor};
pub use vision::{Grid, VisionOutput, VisionTower};
pub use weights::{Layout, Weights};
