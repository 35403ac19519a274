//! The media flags: each image's pixel budget (`--min-pixels`, `--max-pixels`,
//! `--max-image-tokens`) and how videos are sampled (`--video-fps`, `--video-max-frames`,
//! `--video-max-pixels`, `--video-cap-pixels-per-frame`), checked into the engine's settings;
//! `check_media`, the first check of a media path the user named.

use std::path::Path;

use anyhow::{bail, Result};
use clap::Args;

/// How images and videos are sized and sampled: flags of the Input heading of `run`, `serve` and
/// `chat`.
#[derive(Debug, Args)]
pub struct MediaArgs {
    /// Lower bound of the per-image pixel budget (default from preprocessor_config.json).
    #[arg(long)]
    pub min_pixels: Option<usize>,
    /// Upper bound of the per-image pixel budget; fewer pixels, fewer tokens, faster.
    #[arg(long, conflicts_with = "max_image_tokens")]
    pub max_pixels: Option<usize>,
    /// Visual tokens per image at most (each is 32x32 pixels for Qwen3-VL): larger images are
    /// scaled down, and stderr says so. `model`: the checkpoint's own budget (16384 tokens).
    #[arg(long, value_parser = |s: &str| parse_budget(s, "token"), default_value = "1280")]
    pub max_image_tokens: Budget,
    /// Video frames sampled per second of the clip (default: the checkpoint's, 2). A directory
    /// of frames is taken as frames at this rate.
    #[arg(long)]
    pub video_fps: Option<f64>,
    /// Frames sampled from one video at most (default: the checkpoint's, 768).
    #[arg(long)]
    pub video_max_frames: Option<usize>,
    /// A video's pixel budget: sampled frames x height x width (frames are scaled to fit).
    /// `model`: the checkpoint's own (25 M pixels for Qwen3-VL, ~12k visual tokens).
    #[arg(long, value_parser = |s: &str| parse_budget(s, "pixel"), default_value = "5242880")]
    pub video_max_pixels: Budget,
    /// Cap each video frame at 768 visual tokens and an even share of the budget, as
    /// qwen-vl-utils does (transformers' `cap_pixels_per_frame`; off in transformers 5.23).
    #[arg(long)]
    pub video_cap_pixels_per_frame: bool,
}

impl MediaArgs {
    /// The engine's video settings (explicit flags) and the cap on the budget (`None`: the
    /// checkpoint's), the values checked.
    pub fn video_options(&self) -> Result<(vl_models::video::VideoOptions, Option<usize>)> {
        use vl_models::{limits::MAX_PIXEL_BUDGET, video::MAX_VIDEO_FRAMES};
        if let Some(fps) = self.video_fps {
            vl_models::video::check_fps(fps).map_err(|m| anyhow::anyhow!("--video-fps {m}"))?;
        }
        if let Some(n) = self.video_max_frames.filter(|&n| n == 0 || n > MAX_VIDEO_FRAMES) {
            bail!("--video-max-frames {n} is outside 1..={MAX_VIDEO_FRAMES}");
        }
        let cap = match self.video_max_pixels {
            Budget::Model => None,
            Budget::At(n) if n > MAX_PIXEL_BUDGET => {
                bail!("--video-max-pixels {n} is outside 1..={MAX_PIXEL_BUDGET}")
            }
            Budget::At(n) => Some(n),
        };
        let opts = vl_models::video::VideoOptions {
            fps: self.video_fps,
            max_frames: self.video_max_frames,
            min_pixels: None,
            max_pixels: None,
            cap_pixels_per_frame: self.video_cap_pixels_per_frame.then_some(true),
        };
        Ok((opts, cap))
    }

    /// The engine's token cap (`None`: the checkpoint's budget).
    pub fn max_image_tokens(&self) -> Option<usize> {
        match self.max_image_tokens {
            Budget::Model => None,
            Budget::At(n) => Some(n),
        }
    }
}

/// `--max-image-tokens`, `--video-max-pixels`: a count, or `model` for the checkpoint's budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Budget {
    Model,
    At(usize),
}

/// Parses a `Budget` counting `unit`s ("token", "pixel").
fn parse_budget(s: &str, unit: &str) -> Result<Budget, String> {
    if s == "model" {
        return Ok(Budget::Model);
    }
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1 (or `model`)".into()),
        Ok(n) => Ok(Budget::At(n)),
        Err(_) => Err(format!("{s:?} is not a {unit} count or `model`")),
    }
}

/// A media path named by the user exists: one line naming it (and a broken link as one).
pub fn check_media(kind: &str, path: &Path) -> Result<()> {
    if let Some(target) = vl_models::error::broken_link(path) {
        bail!("{kind} {}: broken symbolic link to {}", path.display(), target.display());
    }
    if !path.exists() {
        bail!("{kind} {}: no such file or directory", path.display());
    }
    Ok(())
}
