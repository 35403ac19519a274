//! Encoded media, family-agnostic: what a vision tower takes (patch rows and their grids) and
//! gives back (rows that replace a prompt's placeholders, plus per-level rows some families add
//! deeper in the decoder), and how the engine caches and joins them.

use candle_core::Tensor;

pub mod image_file;
pub mod video;
mod video_tools;

/// A (temporal, height, width) patch grid, as a processor's `image_grid_thw`.
pub type Grid = [usize; 3];

/// Preprocessed vision input: patch rows [sum t*h*w, C*T*P*P] and one grid per image / video.
#[derive(Debug, Clone)]
pub struct VisionInput {
    pub pixels: Tensor,
    pub grids: Vec<Grid>,
}

/// A vision tower's output for a batch of images / videos, split per input.
#[derive(Debug, Clone)]
pub struct VisionOutput {
    /// Merged rows per input: [t * h * w / merge^2, out_hidden].
    pub merged: Vec<Tensor>,
    /// Rows a family adds deeper in its decoder, `levels[level][input]`, shaped like `merged`
    /// (Qwen3-VL's DeepStack taps; empty for a tower without them). The engine caches and joins
    /// them without reading them.
    pub levels: Vec<Vec<Tensor>>,
    /// The patch grid of each input.
    pub grids: Vec<Grid>,
}

impl VisionOutput {
    /// Bytes the features hold (for caches bounded by bytes).
    pub fn bytes(&self) -> usize {
        self.merged.iter().chain(self.levels.iter().flatten()).map(|t| t.elem_count() * t.dtype().size_in_bytes()).sum()
    }

    /// Several outputs as one (rows in input order); `None` for none.
    pub fn concat(parts: &[&VisionOutput]) -> Option<VisionOutput> {
        (!parts.is_empty()).then(|| {
            let levels = parts.iter().map(|p| p.levels.len()).min().unwrap_or(0);
            VisionOutput {
                merged: parts.iter().flat_map(|p| p.merged.iter().cloned()).collect(),
                levels: (0..levels).map(|l| parts.iter().flat_map(|p| p.levels[l].iter().cloned()).collect()).collect(),
                grids: parts.iter().flat_map(|p| p.grids.iter().copied()).collect(),
            }
        })
    }
}

/// What a placeholder run stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MediaKind {
    Image,
    Video,
}

/// One image or video of a request, preprocessed, with the key its features are cached under
/// (its content and resized size, or its preprocessed pixels).
#[derive(Debug, Clone)]
pub struct Media {
    pub kind: MediaKind,
    pub key: u64,
    pub input: VisionInput,
}

/// A sampled, preprocessed video a family kept for a repeated request: the source's description
/// and the family's own preprocessed form (opaque here).
#[derive(Clone)]
pub struct CachedClip {
    pub info: crate::video::VideoInfo,
    pub data: std::sync::Arc<dyn std::any::Any + Send + Sync>,
}

/// The engine's cache of preprocessed videos, by `MediaContext::clip_key`, bounded by bytes.
pub type ClipCache = crate::cache::ByteLru<[u8; 32], CachedClip>;

/// What the engine lends a family's `prepare` for one request: the time the request's videos
/// may take to probe and decode (all of them together: each gets what is left), and the clip
/// cache (a video sent again, as `vl chat` resends its history each turn, is not decoded again).
pub struct MediaContext<'a> {
    started: std::time::Instant,
    decode_budget: Option<std::time::Duration>,
    clips: Option<&'a std::sync::Mutex<ClipCache>>,
}

impl<'a> MediaContext<'a> {
    /// A request starting now, with this decode-time budget and clip cache.
    pub fn new(decode_budget: Option<std::time::Duration>, clips: Option<&'a std::sync::Mutex<ClipCache>>) -> Self {
        Self { started: std::time::Instant::now(), decode_budget, clips }
    }

    /// No budget, no cache (a one-off answer).
    pub fn unbounded() -> Self {
        Self::new(None, None)
    }

    /// What is left of the request's decode-time budget (None: no bound); an error naming the
    /// bound once it is spent.
    pub fn decode_left(&self) -> crate::Result<Option<std::time::Duration>> {
        let Some(budget) = self.decode_budget else { return Ok(None) };
        let left = budget.saturating_sub(self.started.elapsed());
        if left.is_zero() {
            return Err(crate::Error::Limit {
                what: "videos".into(),
                message: format!(
                    "the request's videos took longer than the decode limit of {} s in all",
                    budget.as_secs_f64()
                ),
                kind: crate::limits::LimitKind::DecodeTime,
            });
        }
        Ok(Some(left))
    }

    /// What identifies a video's sampled frames (None without a cache): a regular file's
    /// canonical path, device, inode, size, modification time and status-change time, or the
    /// bytes' SHA-256; and the family's `settings` (its processor's, as text). The status-change
    /// time (`ctime`) is what a copy cannot keep: `cp -p`, `rsync -a` and `tar x` set the old
    /// modification time on a new file, but every write, rename into place or metadata change
    /// sets `ctime` to now, and no call sets it back. None for frame directories (a frame can
    /// change without the directory's times changing), unreadable files and systems without
    /// `ctime` (no cache there rather than a stale one).
    pub fn clip_key(&self, source: &crate::request::VideoData, settings: &str) -> Option<[u8; 32]> {
        use sha2::{Digest, Sha256};
        self.clips?;
        let mut h = Sha256::new();
        match source {
            crate::request::VideoData::Path(p) => {
                let meta = std::fs::metadata(p).ok().filter(|m| m.is_file())?;
                let since = meta.modified().ok()?.duration_since(std::time::UNIX_EPOCH).ok()?;
                h.update(b"file\0");
                h.update(std::fs::canonicalize(p).ok()?.as_os_str().as_encoded_bytes());
                h.update(meta.len().to_le_bytes());
                h.update(since.as_nanos().to_le_bytes());
                h.update(file_identity(&meta)?);
            }
            crate::request::VideoData::Bytes(b) => {
                h.update(b"bytes\0");
                h.update(b);
            }
        }
        h.update(settings.as_bytes());
        Some(h.finalize().into())
    }

    /// The clip kept under `key`.
    pub fn cached_clip(&self, key: &[u8; 32]) -> Option<CachedClip> {
        lock_clips(self.clips?).get(key)
    }

    /// Keeps a clip under `key` (`bytes`: what it holds).
    pub fn keep_clip(&self, key: [u8; 32], clip: CachedClip, bytes: usize) {
        if let Some(c) = self.clips {
            lock_clips(c).put(key, clip, bytes);
        }
    }
}

fn lock_clips(c: &std::sync::Mutex<ClipCache>) -> std::sync::MutexGuard<'_, ClipCache> {
    // Entries are inserted whole, so a poisoned lock's map is still consistent.
    c.lock().unwrap_or_else(|p| p.into_inner())
}

/// A file's device, inode and status-change time (seconds and nanoseconds), as bytes.
#[cfg(unix)]
fn file_identity(meta: &std::fs::Metadata) -> Option<Vec<u8>> {
    use std::os::unix::fs::MetadataExt;
    Some(
        [meta.dev(), meta.ino(), meta.ctime() as u64, meta.ctime_nsec() as u64]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
    )
}

#[cfg(not(unix))]
fn file_identity(_: &std::fs::Metadata) -> Option<Vec<u8>> {
    None
}

/// An image's cache key: its content hash (at least 8 bytes) and its resized size. Never 0 (0
/// marks text positions in `Identity`).
pub fn image_key(hash: &[u8], resized: (usize, usize)) -> u64 {
    let mut k = [0u8; 8];
    k.copy_from_slice(&hash[..8]);
    u64::from_le_bytes(k) ^ ((resized.0 as u64) << 32 | resized.1 as u64).rotate_left(17) | 1
}

/// Preprocessed pixels' cache key: the hash of the values and their grid. Never 0.
pub fn pixels_key(pixels: &[f32], grid: Grid) -> u64 {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for chunk in pixels.chunks(1 << 14) {
        h.update(chunk.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>());
    }
    for g in grid {
        h.update((g as u64).to_le_bytes());
    }
    let digest = h.finalize();
    let mut k = [0u8; 8];
    k.copy_from_slice(&digest[..8]);
    u64::from_le_bytes(k) | 1
}
