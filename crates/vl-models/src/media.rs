//! Encoded media, family-agnostic: what a vision tower takes (patch rows and their grids) and
//! gives back (rows that replace a prompt's placeholders, plus per-level rows some families add
//! deeper in the decoder), and how the engine caches and joins them.

use candle_core::Tensor;

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
