//! Qwen3-VL (`Qwen3VLForConditionalGeneration`), mirroring transformers' `models/qwen3_vl/`.

pub mod config;
pub mod family;
mod ffn;
pub mod gguf;
mod gguf_hybrid;
mod gguf_names;
pub mod gguf_write;
pub mod image_processor;
pub mod inspect;
mod linears;
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

/// The `Family` methods that a family built on Qwen3-VL's code (the embedding and reranker
/// checkpoints) forwards unchanged to its `inner: Qwen3Vl`.
macro_rules! forward_family_to_inner {
    () => {
        fn context(&self) -> usize {
            self.inner.context()
        }
        fn vocab_size(&self) -> usize {
            self.inner.vocab_size()
        }
        fn tokenizer(&self) -> &tokenizers::Tokenizer {
            self.inner.tokenizer()
        }
        fn encode(&self, media: &crate::media::Media) -> crate::error::Result<crate::media::VisionOutput> {
            self.inner.encode(media)
        }
        fn load_vision(&self) -> crate::error::Result<()> {
            self.inner.load_vision()
        }
        fn finish_loading(&self) -> crate::error::Result<()> {
            self.inner.finish_loading()
        }
        fn storage(&self) -> Vec<(String, String, usize)> {
            self.inner.storage()
        }
        fn image_sizing(&self, width: usize, height: usize) -> crate::error::Result<crate::family::ImageSizing> {
            self.inner.image_sizing(width, height)
        }
        fn checkpoint_video_sizing(&self, video: &crate::request::VideoReport) -> Option<crate::family::Sizing> {
            self.inner.checkpoint_video_sizing(video)
        }
        fn tensors_to_load(&self) -> usize {
            self.inner.tensors_to_load()
        }
        fn load_warnings(&self) -> Vec<String> {
            self.inner.load_warnings()
        }
    };
}
pub(crate) use forward_family_to_inner;

/// The `Pooler` methods about states that a pooling family built on Qwen3-VL's code forwards to
/// its `inner: Qwen3Vl` (its `pooled` and `pool` are its own).
macro_rules! forward_pool_states_to_inner {
    () => {
        fn new_state(&self) -> crate::state::SeqState {
            crate::family::Generator::new_state(&self.inner)
        }
        fn kv_bytes_per_position(&self) -> usize {
            crate::family::Generator::kv_bytes_per_position(&self.inner)
        }
        fn prefill(
            &self,
            inputs: &[crate::family::PoolInput<'_>],
            states: &mut [&mut crate::state::SeqState],
            ends: &[usize],
        ) -> crate::error::Result<()> {
            self.inner.prefill_rows(inputs, states, ends).map(drop)
        }
    };
}
pub(crate) use forward_pool_states_to_inner;
