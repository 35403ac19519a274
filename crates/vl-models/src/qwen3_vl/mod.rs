//! Qwen3-VL (`Qwen3VLForConditionalGeneration`), mirroring transformers' `models/qwen3_vl/`.

pub mod chat;
pub mod config;
pub mod family;
pub mod generation_config;
pub mod gguf;
mod gguf_names;
pub mod gguf_write;
pub mod inspect;
pub mod model;
pub mod plan;
pub mod positions;
pub mod preflight;
pub mod presets;
pub mod processor;
pub mod text;
pub mod video;
pub mod vision;
pub mod weights;

pub use chat::{Content, Message, Processor, StreamDecoder, TemplateToolCall};
pub use config::{Qwen3VlConfig, TextConfig, VisionConfig};
pub use generation_config::GenerationConfig;
pub use inspect::{inspect, Summary};
pub use model::{PrefillOutput, Prompt, Qwen3VlModel, VisionInput};
pub use plan::{check_plan, plan_for, split_experts, tensor_plan, Group, PlanReport, PlannedTensor};
pub use preflight::ModelDir;
pub use processor::{ImageFile, ImageProcessor, PreprocessorConfig, ProcessedImage};
pub use text::{LoadPlan, Prequantized, QuantLoad, TextCache, TextModel};
pub use video::{ProcessedVideo, VideoConfig, VideoOptions, VideoPlan, VideoProcessor};
pub use vision::{Grid, VisionOutput, VisionTower};
pub use weights::{Layout, Weights};
