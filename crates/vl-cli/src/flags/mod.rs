//! The flag groups `run`, `chat` and `serve` share, each a clap `Args` struct flattened into the
//! commands (its flags' headings are `help.rs`'s): `model` (which model, on what device, in what
//! precision), `media` (image budgets, video sampling), `limits` (image file and pixel limits),
//! `sampling` (`run` and `chat`'s generation flags), `speculative` (drafts and forced tokens, in
//! `sampling` and `serve`); `LoadArgs` the first three together.

pub mod limits;
pub mod media;
pub mod model;
pub mod sampling;
pub mod speculative;

use candle_core::{DType, Device};
use clap::Args;
use vl_models::engine::ModelOptions;
use vl_nn::QuantType;

pub use limits::LimitArgs;
pub use media::{check_media, Budget, MediaArgs};
pub use model::{ModelArgs, QuantSource};
pub use sampling::{ChatDefaults, RunDefaults, SamplingArgs};
pub use speculative::SpeculativeArgs;

/// How to find and load a model and size its inputs: the flags `run`, `serve` and `chat` share.
#[derive(Debug, Args)]
pub struct LoadArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub media: MediaArgs,
    #[command(flatten)]
    pub limits: LimitArgs,
}

impl LoadArgs {
    /// The engine's model options from these flags, on `device` in `dtype` with `quant`, and the
    /// checked video settings (`MediaArgs::video_options`); video limits and the clip cache at
    /// the library's defaults.
    pub fn model_options(
        &self,
        device: Device,
        dtype: DType,
        quant: Option<QuantType>,
        video: (vl_models::video::VideoOptions, Option<usize>),
    ) -> ModelOptions {
        ModelOptions {
            dtype,
            device,
            quant,
            vision_bf16: self.model.vision_bf16(),
            kv_dtype: self.model.kv_dtype(),
            min_pixels: self.media.min_pixels,
            max_pixels: self.media.max_pixels,
            max_image_tokens: self.media.max_image_tokens(),
            image_limits: self.limits.image_limits(),
            video: video.0,
            video_pixel_cap: video.1,
            ..Default::default()
        }
    }
}
