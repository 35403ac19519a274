//! The input limits every command that reads images shares (`--max-image-bytes`,
//! `--max-image-pixels`; docs/limits.md). The server's own limits are `vl serve`'s flags.

use clap::Args;
use vl_models::limits::ImageLimits;

/// How large an image file may be, read and decoded: the Limits heading of `run`, `serve` and
/// `chat`. The defaults are the library's (`ImageLimits::default()`).
#[derive(Debug, Args)]
pub struct LimitArgs {
    /// Largest image file read, in bytes (checked before reading).
    #[arg(long, default_value_t = ImageLimits::default().max_file_bytes)]
    pub max_image_bytes: u64,
    /// Largest decoded image, in pixels (width x height, checked from the header before decoding).
    #[arg(long, default_value_t = ImageLimits::default().max_pixels)]
    pub max_image_pixels: u64,
}

impl LimitArgs {
    pub fn image_limits(&self) -> ImageLimits {
        ImageLimits { max_file_bytes: self.max_image_bytes, max_pixels: self.max_image_pixels }
    }
}
