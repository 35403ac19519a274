//! The limits every command that loads a model shares (`--max-image-bytes`,
//! `--max-image-pixels`, `--kv-cache-mib`; docs/limits.md). The server's own limits are
//! `vl serve`'s flags.

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
    /// KV cache budget in MiB, running sequences and kept prefixes together (default: a quarter
    /// of the machine's memory). A prompt whose cache cannot fit in it is refused (`vl serve`:
    /// 503); under `vl serve`, one that cannot fit now waits.
    #[arg(long)]
    pub kv_cache_mib: Option<usize>,
}

impl LimitArgs {
    pub fn image_limits(&self) -> ImageLimits {
        ImageLimits { max_file_bytes: self.max_image_bytes, max_pixels: self.max_image_pixels }
    }

    /// The engine's KV budget in bytes: `--kv-cache-mib`, else the library's default; 0 refused.
    pub fn kv_cache_bytes(&self) -> anyhow::Result<usize> {
        match self.kv_cache_mib {
            Some(0) => anyhow::bail!("--kv-cache-mib 0: the KV cache needs at least one block"),
            Some(m) => Ok(m.saturating_mul(1 << 20)),
            None => Ok(vl_models::engine::default_kv_cache_bytes()),
        }
    }
}
