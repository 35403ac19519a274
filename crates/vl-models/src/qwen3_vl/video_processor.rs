//! The video processor, mirroring transformers' `Qwen3VLVideoProcessor`
//! (`models/qwen3_vl/video_processing_qwen3_vl.py`) and the video half of `Qwen3VLProcessor`
//! (`processing_qwen3_vl.py`): frames sampled from the source frame rate (indices from a linspace
//! over the clip, rounded half to even), one `smart_resize` over the whole clip's pixel budget
//! (optionally capped per frame), each frame resized, rescaled and normalized like an image,
//! frames paired (the temporal patch; an odd count repeats the last frame), and the prompt text:
//! per frame pair `<{t:.1f} seconds>` + `<|vision_start|>` + video pads + `<|vision_end|>`,
//! `t` the mean timestamp of the pair's frames. docs/video.md lists what was verified.

use std::path::Path;

use candle_core::{Device, Tensor};
use image::RgbImage;
use serde::Deserialize;

use super::image_processor::{
    normalized_planes_by, patchify, resize_bicubic, resize_bicubic_rounded_once, PreprocessorConfig, ResizeFn,
    MAX_ASPECT_RATIO, MAX_PIXEL_BUDGET,
};
use super::model::VisionInput;
use crate::error::{Error, Result};
use crate::limits::{self, MAX_METADATA_FILE_BYTES};
use crate::video::{check_fps, VideoLimits, VideoSource};

pub use crate::video::MAX_VIDEO_FRAMES;

/// The video pad token's text.
pub const VIDEO_PAD: &str = "<|video_pad|>";

#[derive(Debug, Clone, Default, Deserialize)]
struct RawVideo {
    fps: Option<f64>,
    min_frames: Option<usize>,
    max_frames: Option<usize>,
    do_sample_frames: Option<bool>,
    cap_pixels_per_frame: Option<bool>,
    max_video_tokens: Option<usize>,
}

/// `video_preprocessor_config.json`, resolved. `base.min_pixels` / `base.max_pixels` are
/// `size.shortest_edge` / `size.longest_edge`: bounds on frames x height x width of the clip.
#[derive(Debug, Clone, PartialEq)]
pub struct VideoConfig {
    pub base: PreprocessorConfig,
    /// Frames sampled per second of the source.
    pub fps: f64,
    pub min_frames: usize,
    pub max_frames: usize,
    pub do_sample_frames: bool,
    /// qwen-vl-utils' per-frame cap (transformers' `cap_pixels_per_frame`); off by default, as in
    /// transformers 5.23 (which warns that its default will change).
    pub cap_pixels_per_frame: bool,
    /// The per-frame token ceiling the cap applies.
    pub max_video_tokens: usize,
    /// How frames are counted and sized.
    pub sizing: ClipSizing,
}

/// How a clip's frames are counted and sized.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ClipSizing {
    /// `Qwen3VLVideoProcessor` (transformers): `int(total / source_fps * fps)` frames within
    /// [min_frames, max_frames], the pixel bounds over the clip's frames x height x width.
    #[default]
    Processor,
    /// qwen-vl-utils' `fetch_video` (QwenLM/Qwen3-VL `qwen-vl-utils/src/qwen_vl_utils/
    /// vision_process.py`), what the Qwen3-VL-Embedding code sizes a video file with before its
    /// processor (whose resize is off): an even number of frames,
    /// `floor_even(min(max(total / source_fps * fps, min_frames), max_frames, total))`, and
    /// each frame sized alone by the image `smart_resize` within [128, max_video_tokens]
    /// tokens, the top lowered to the frame's share of the clip budget (`max_pixels / frames`,
    /// never under 1.05 x the bottom).
    QwenVlUtils,
}

/// qwen-vl-utils' fewest tokens of a frame (`VIDEO_MIN_TOKEN_NUM`).
const QWEN_VL_UTILS_MIN_FRAME_TOKENS: usize = 128;

impl Default for VideoConfig {
    /// `Qwen3VLVideoProcessor`'s class defaults.
    fn default() -> Self {
        let (min, max) = Self::CLASS_BUDGET;
        Self {
            base: PreprocessorConfig { min_pixels: min, max_pixels: max, ..Default::default() },
            fps: 2.0,
            min_frames: 4,
            max_frames: 768,
            do_sample_frames: true,
            cap_pixels_per_frame: false,
            max_video_tokens: 768,
            sizing: ClipSizing::Processor,
        }
    }
}

impl VideoConfig {
    /// The class's `size` (shortest_edge 128x32x32, longest_edge 32x32x768).
    pub const CLASS_BUDGET: (usize, usize) = (128 * 32 * 32, 32 * 32 * 768);
    /// The `size` the Qwen3-VL and Qwen3.5 hub checkpoints' `video_preprocessor_config.json`
    /// sets (shortest_edge 4096, longest_edge 25165824), over the class's: what a file without
    /// that config (a GGUF pair) stands for.
    pub const HUB_BUDGET: (usize, usize) = (4096, 25_165_824);

    /// `dir/video_preprocessor_config.json`; as transformers does, `preprocessor_config.json` when
    /// that is absent; the class defaults when both are.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        for name in ["video_preprocessor_config.json", "preprocessor_config.json"] {
            let path = dir.join(name);
            if path.is_file() {
                return Self::from_json_str(&limits::read_text(&path, MAX_METADATA_FILE_BYTES)?, &path);
            }
        }
        Ok(Self::default())
    }

    /// Parses a video (or image) preprocessor config; `path` is used in error messages only.
    pub fn from_json_str(text: &str, path: &Path) -> Result<Self> {
        let base = PreprocessorConfig::parse(text, path, Self::CLASS_BUDGET)?;
        let raw: RawVideo =
            serde_json::from_str(text).map_err(|source| Error::Json { path: path.to_path_buf(), source })?;
        let d = Self::default();
        let cfg = Self {
            base,
            fps: raw.fps.unwrap_or(d.fps),
            min_frames: raw.min_frames.unwrap_or(d.min_frames),
            max_frames: raw.max_frames.unwrap_or(d.max_frames),
            do_sample_frames: raw.do_sample_frames.unwrap_or(d.do_sample_frames),
            cap_pixels_per_frame: raw.cap_pixels_per_frame.unwrap_or(d.cap_pixels_per_frame),
            max_video_tokens: raw.max_video_tokens.unwrap_or(d.max_video_tokens),
            sizing: d.sizing,
        };
        cfg.check().map_err(|(f, m)| Error::Config { path: path.to_path_buf(), field: f.into(), message: m })?;
        Ok(cfg)
    }

    /// Value bounds: `Err((field, message))`.
    fn check(&self) -> std::result::Result<(), (&'static str, String)> {
        check_fps(self.fps).map_err(|m| ("fps", m))?;
        for (f, v) in [("min_frames", self.min_frames), ("max_frames", self.max_frames)] {
            if v == 0 || v > MAX_VIDEO_FRAMES {
                return Err((f, format!("{v} is outside 1..={MAX_VIDEO_FRAMES}")));
            }
        }
        let most = MAX_PIXEL_BUDGET / (self.base.factor() * self.base.factor());
        if self.max_video_tokens == 0 || self.max_video_tokens > most {
            return Err(("max_video_tokens", format!("{} is outside 1..={most}", self.max_video_tokens)));
        }
        Ok(())
    }
}

pub use crate::video::{VideoOptions, VideoPlan};

impl VideoPlan {
    /// LLM tokens of one frame pair.
    pub fn frame_tokens(&self, merge: usize) -> usize {
        self.grid[1] * self.grid[2] / (merge * merge)
    }

    /// LLM tokens of the clip's pads (without the timestamp text and frame markers).
    pub fn num_tokens(&self, merge: usize) -> usize {
        self.grid[0] * self.frame_tokens(merge)
    }

    /// The text the prompt's video pad becomes, with `pads` pad tokens per frame pair.
    pub fn placeholder(&self, pads: usize) -> String {
        let mut s = String::new();
        for t in &self.timestamps {
            s.push_str(&format!("<{t:.1} seconds><|vision_start|>"));
            s.push_str(&VIDEO_PAD.repeat(pads));
            s.push_str("<|vision_end|>");
        }
        s
    }
}

/// One preprocessed video.
#[derive(Debug, Clone)]
pub struct ProcessedVideo {
    pub plan: VideoPlan,
    /// Patch rows, row-major [t * h * w, C * T * P * P].
    pub pixels: Vec<f32>,
}

#[derive(Debug, Clone)]
pub struct VideoProcessor {
    pub config: VideoConfig,
    pub limits: VideoLimits,
}

impl VideoProcessor {
    pub fn new(config: VideoConfig) -> Self {
        Self { config, limits: VideoLimits::default() }
    }

    pub fn from_dir(dir: &Path) -> Result<Self> {
        Ok(Self::new(VideoConfig::from_dir(dir)?))
    }

    /// Applies per-call overrides; errors name the option (`fps`, `max_frames`, `min_pixels`,
    /// `max_pixels`). A pixel bound given alone moves the other with it when they would cross.
    pub fn with_options(mut self, o: &VideoOptions) -> Result<Self> {
        let bad = |what: &str, message: String| Error::Input { what: what.into(), message };
        let c = &mut self.config;
        if let Some(fps) = o.fps {
            check_fps(fps).map_err(|m| bad("fps", m))?;
            c.fps = fps;
        }
        if let Some(n) = o.max_frames {
            if n == 0 || n > MAX_VIDEO_FRAMES {
                return Err(bad("max_frames", format!("{n} is outside 1..={MAX_VIDEO_FRAMES}")));
            }
            c.max_frames = n;
        }
        c.base.set_pixel_budget(o.min_pixels, o.max_pixels)?;
        if let Some(cap) = o.cap_pixels_per_frame {
            c.cap_pixels_per_frame = cap;
        }
        Ok(self)
    }

    /// Source frame indices sampled from a clip of `total` frames at `source_fps`:
    /// `int(total / source_fps * fps)` clamped to [min_frames, max_frames] and to `total`, spread
    /// by `linspace(0, total - 1, n).round()`.
    pub fn sample_indices(&self, total: usize, source_fps: f64) -> Result<Vec<usize>> {
        let c = &self.config;
        if total == 0 {
            return Err(Error::Input { what: "video".into(), message: "no frames".into() });
        }
        if !c.do_sample_frames {
            if total > c.max_frames {
                return Err(Error::Input {
                    what: "video".into(),
                    message: format!("{total} frames with do_sample_frames off exceed max_frames {}", c.max_frames),
                });
            }
            return Ok((0..total).collect());
        }
        if c.sizing == ClipSizing::QwenVlUtils {
            let (least, most) = (c.min_frames.div_ceil(2) * 2, c.max_frames / 2 * 2);
            let n = (total as f64 / source_fps * c.fps).max(least as f64).min(most as f64).min(total as f64);
            let n = (n / 2.0).floor() as usize * 2;
            if n < 2 {
                return Err(Error::Input {
                    what: "video".into(),
                    message: format!("{total} frame(s) at max_frames {}: a video needs at least 2", c.max_frames),
                });
            }
            return Ok(linspace_round(total - 1, n));
        }
        let n = (total as f64 / source_fps * c.fps) as usize;
        let n = n.max(c.min_frames).min(c.max_frames).min(total);
        Ok(linspace_round(total - 1, n))
    }

    /// Sampling and resizing of a clip of `total` frames of `height` x `width` at `source_fps`.
    pub fn plan(&self, total: usize, source_fps: f64, height: usize, width: usize) -> Result<VideoPlan> {
        check_fps(source_fps)
            .map_err(|m| Error::Input { what: "video".into(), message: format!("source frame rate {m}") })?;
        let indices = self.sample_indices(total, source_fps)?;
        let c = &self.config;
        let b = &c.base;
        let n = indices.len();
        let (factor, tp) = (b.factor(), b.temporal_patch_size);
        let (h, w) = if b.do_resize && c.sizing == ClipSizing::QwenVlUtils {
            let least = QWEN_VL_UTILS_MIN_FRAME_TOKENS * factor * factor;
            let share = (c.max_video_tokens * factor * factor).min(b.max_pixels / n);
            super::image_processor::smart_resize(height, width, factor, least, share.max(least * 105 / 100))
                .map_err(|e| e.rename_input(|_| "video".into()))?
        } else if b.do_resize {
            let mut max_pixels = b.max_pixels;
            if c.cap_pixels_per_frame {
                let frame_cap = c.max_video_tokens * factor * factor;
                let per_frame = frame_cap.min(b.max_pixels / n).max((b.min_pixels as f64 * 1.05) as usize);
                max_pixels = per_frame * n;
            }
            smart_resize_video(n, height, width, tp, factor, b.min_pixels, max_pixels)?
        } else {
            // Unresized frames are bounded like resized ones: the clip within the hard budget.
            if n.saturating_mul(height).saturating_mul(width) > MAX_PIXEL_BUDGET {
                return Err(Error::Input {
                    what: "video".into(),
                    message: format!(
                        "do_resize is off: {n} frames of {width}x{height} exceed the {MAX_PIXEL_BUDGET}-pixel budget"
                    ),
                });
            }
            (height, width)
        };
        if h % factor != 0 || w % factor != 0 {
            return Err(Error::Input {
                what: "video".into(),
                message: format!("{w}x{h} frames are not a multiple of {factor} (enable do_resize)"),
            });
        }
        let pairs = n.div_ceil(tp);
        Ok(VideoPlan {
            timestamps: timestamps(&indices, source_fps, tp),
            indices,
            resized: (h, w),
            grid: [pairs, h / b.patch_size, w / b.patch_size],
        })
    }

    /// `plan` for a probed source; errors name it.
    pub fn plan_source(&self, src: &VideoSource) -> Result<VideoPlan> {
        let info = src.info();
        self.plan(info.frames, info.fps, info.height as usize, info.width as usize)
            .map_err(|e| e.rename_input(|w| if w == "video" { format!("video {}", src.name().display()) } else { w }))
    }

    /// Plans, decodes the sampled frames and preprocesses them (one source frame in memory at a
    /// time besides the output); errors name the source.
    pub fn process_source(&self, src: &VideoSource) -> Result<ProcessedVideo> {
        self.process_planned(src, self.plan_source(src)?)
    }

    /// `process_source` with the source's plan already made (`plan_source`).
    pub fn process_planned(&self, src: &VideoSource, plan: VideoPlan) -> Result<ProcessedVideo> {
        let mut builder = Patches::new(&self.config.base, &plan);
        if self.config.sizing == ClipSizing::QwenVlUtils {
            builder.resize = resize_bicubic_rounded_once;
        }
        src.read_frames(&plan.indices, &mut |_, frame| builder.push(frame))?;
        Ok(ProcessedVideo { pixels: builder.finish(), plan })
    }

    /// Stacks processed videos into one vision input.
    pub fn batch(&self, videos: &[ProcessedVideo], device: &Device) -> Result<VisionInput> {
        let b = &self.config.base;
        let row = 3 * b.temporal_patch_size * b.patch_size * b.patch_size;
        let data: Vec<f32> = videos.iter().flat_map(|v| v.pixels.iter().copied()).collect();
        let rows = data.len() / row;
        Ok(VisionInput {
            pixels: Tensor::from_vec(data, (rows, row), device)?,
            grids: videos.iter().map(|v| v.plan.grid).collect(),
        })
    }
}

/// Patch rows built frame by frame: frames are normalized as they arrive and patchified a
/// temporal patch at a time; the last patch is completed by repeating the last frame.
struct Patches<'a> {
    cfg: &'a PreprocessorConfig,
    size: (usize, usize),
    resize: ResizeFn,
    pending: Vec<Vec<f32>>,
    out: Vec<f32>,
}

impl<'a> Patches<'a> {
    fn new(cfg: &'a PreprocessorConfig, plan: &VideoPlan) -> Self {
        let (h, w) = plan.resized;
        let capacity = plan.grid[0] * cfg.temporal_patch_size * 3 * h * w;
        Self { cfg, size: plan.resized, resize: resize_bicubic, pending: Vec::new(), out: Vec::with_capacity(capacity) }
    }

    fn push(&mut self, frame: &RgbImage) -> Result<()> {
        let (h, w) = self.size;
        self.pending.push(normalized_planes_by(frame, h, w, self.cfg, self.resize)?);
        if self.pending.len() == self.cfg.temporal_patch_size {
            self.flush();
        }
        Ok(())
    }

    fn flush(&mut self) {
        let (h, w) = self.size;
        let refs: Vec<&[f32]> = self.pending.iter().map(|p| &p[..]).collect();
        self.out.extend(patchify(&refs, h, w, self.cfg));
        self.pending.clear();
    }

    fn finish(mut self) -> Vec<f32> {
        if let Some(last) = self.pending.last().cloned() {
            while self.pending.len() < self.cfg.temporal_patch_size {
                self.pending.push(last.clone());
            }
            self.flush();
        }
        self.out
    }
}

/// `numpy.linspace(0, stop, n).round()` as integers: `i * (stop / (n - 1))`, the last exactly
/// `stop`, halves to even.
pub fn linspace_round(stop: usize, n: usize) -> Vec<usize> {
    if n == 1 {
        return vec![0];
    }
    let step = stop as f64 / (n - 1) as f64;
    (0..n).map(|i| if i == n - 1 { stop } else { (i as f64 * step).round_ties_even() as usize }).collect()
}

/// Seconds of each temporal patch: the sampled indices (the last repeated up to a multiple of
/// `temporal`) over the source rate, the mean of each patch's first and last frame.
pub fn timestamps(indices: &[usize], source_fps: f64, temporal: usize) -> Vec<f64> {
    let mut idx = indices.to_vec();
    if let Some(&last) = idx.last() {
        while !idx.len().is_multiple_of(temporal) {
            idx.push(last);
        }
    }
    let ts: Vec<f64> = idx.iter().map(|&i| i as f64 / source_fps).collect();
    ts.chunks(temporal).map(|c| (c[0] + c[c.len() - 1]) / 2.0).collect()
}

/// The video `smart_resize` of `video_processing_qwen3_vl.py`: frames smaller than `factor` are
/// first scaled up; sides round to multiples of `factor`; when frames x height x width (frames
/// rounded to the temporal patch) leaves [min_pixels, max_pixels], both sides scale by
/// sqrt(budget ratio) computed on the sampled frame count, floor (down) or ceil (up).
pub fn smart_resize_video(
    num_frames: usize,
    height: usize,
    width: usize,
    temporal: usize,
    factor: usize,
    min_pixels: usize,
    max_pixels: usize,
) -> Result<(usize, usize)> {
    let bad = |message: String| Error::Input { what: "video".into(), message };
    if num_frames < temporal {
        return Err(bad(format!(
            "{num_frames} frame(s) sampled; a video needs at least {temporal} (one temporal patch)"
        )));
    }
    if height == 0 || width == 0 || factor == 0 || max_pixels == 0 {
        return Err(bad(format!("empty frames {width}x{height}")));
    }
    let (mut h, mut w) = (height as f64, width as f64);
    let f = factor as f64;
    if h < f || w < f {
        let scale = (f / h).max(f / w);
        h = (h * scale).trunc();
        w = (w * scale).trunc();
    }
    let ratio = h.max(w) / h.min(w);
    if ratio > MAX_ASPECT_RATIO {
        return Err(bad(format!("aspect ratio {ratio:.1} ({width}x{height}) exceeds {MAX_ASPECT_RATIO}")));
    }
    let side = |units: f64| -> usize { (units * f).min(1e15) as usize };
    let mut h_bar = side((h / f).round_ties_even());
    let mut w_bar = side((w / f).round_ties_even());
    let t_bar = ((num_frames as f64 / temporal as f64).round_ties_even() as usize * temporal) as f64;
    let n = num_frames as f64;
    if t_bar * h_bar as f64 * w_bar as f64 > max_pixels as f64 {
        let beta = (n * h * w / max_pixels as f64).sqrt();
        h_bar = factor.max(side((h / beta / f).floor()));
        w_bar = factor.max(side((w / beta / f).floor()));
    } else if t_bar * (h_bar as f64) * (w_bar as f64) < min_pixels as f64 {
        let beta = (min_pixels as f64 / (n * h * w)).sqrt();
        h_bar = side((h * beta / f).ceil());
        w_bar = side((w * beta / f).ceil());
    }
    // One frame's pixels stay within the hard budget (the output is sized by it).
    match h_bar.checked_mul(w_bar) {
        Some(p) if p <= MAX_PIXEL_BUDGET => Ok((h_bar, w_bar)),
        _ => {
            Err(bad(format!("resizing {width}x{height} frames gives {w_bar}x{h_bar}, over {MAX_PIXEL_BUDGET} pixels")))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn processor(max_frames: usize) -> VideoProcessor {
        VideoProcessor::new(VideoConfig { max_frames, ..Default::default() })
    }

    #[test]
    fn sampling_follows_the_reference_formula() {
        let p = processor(768);
        // 45 frames at 15 fps, 2 fps: int(45 / 15 * 2) = 6 frames over linspace(0, 44, 6)
        // = [0, 8.8, 17.6, 26.4, 35.2, 44] -> rounded.
        assert_eq!(p.sample_indices(45, 15.0).unwrap(), vec![0, 9, 18, 26, 35, 44]);
        // Fewer than min_frames (4): raised to 4; never above the clip's frame count.
        assert_eq!(p.sample_indices(10, 30.0).unwrap(), vec![0, 3, 6, 9]);
        assert_eq!(p.sample_indices(3, 30.0).unwrap(), vec![0, 1, 2]);
        // Half to even: linspace(0, 3, 3) = [0, 1.5, 3] -> [0, 2, 3].
        assert_eq!(linspace_round(3, 3), vec![0, 2, 3]);
        assert_eq!(linspace_round(5, 1), vec![0]);
        // Ten minutes at 30 fps at 2 fps is 1200 frames: max_frames (768) bounds it.
        let long = p.sample_indices(18_000, 30.0).unwrap();
        assert_eq!(long.len(), 768);
        assert_eq!((long[0], long[767]), (0, 17_999));
        assert_eq!(processor(8).sample_indices(60, 10.0).unwrap(), vec![0, 8, 17, 25, 34, 42, 51, 59]);
    }

    #[test]
    fn timestamps_pair_frames_and_repeat_the_last() {
        // Pairs (0, 9), (18, 26), (35, 44) at 15 fps.
        let t = timestamps(&[0, 9, 18, 26, 35, 44], 15.0, 2);
        assert_eq!(t, vec![0.3, (18.0 / 15.0 + 26.0 / 15.0) / 2.0, (35.0 / 15.0 + 44.0 / 15.0) / 2.0]);
        // An odd count: the last frame pairs with itself.
        assert_eq!(timestamps(&[0, 1, 2, 3, 4], 1.0, 2), vec![0.5, 2.5, 4.0]);
        let plan = VideoPlan { indices: vec![], resized: (32, 32), grid: [2, 2, 2], timestamps: vec![0.25, 1.75] };
        // Python's "{:.1f}": 0.25 -> "0.2", 1.75 -> "1.8" (nearest, ties to even on the binary value).
        assert_eq!(
            plan.placeholder(1),
            "<0.2 seconds><|vision_start|><|video_pad|><|vision_end|><1.8 seconds><|vision_start|><|video_pad|><|vision_end|>"
        );
    }

    #[test]
    fn smart_resize_spends_the_budget_over_the_clip() {
        // Within budget: round each side to 32 (48 -> 64 by half-to-even of 1.5).
        assert_eq!(smart_resize_video(5, 48, 64, 2, 32, 4096, 25_165_824).unwrap(), (64, 64));
        // Over budget: 20 frames of 1080p into 5 242 880 pixels: beta = sqrt(20*1080*1920/5242880).
        let (h, w) = smart_resize_video(20, 1080, 1920, 2, 32, 4096, 5_242_880).unwrap();
        assert_eq!((h, w), (384, 672));
        assert!(20 * h * w <= 5_242_880);
        // Tiny frames are scaled up to the factor first: 20x100 -> 32x160.
        assert_eq!(smart_resize_video(4, 20, 100, 2, 32, 4096, 1 << 24).unwrap(), (32, 160));
        let one = smart_resize_video(1, 64, 64, 2, 32, 4096, 1 << 24).unwrap_err().to_string();
        assert!(one.contains("1 frame(s) sampled; a video needs at least 2"), "{one}");
    }

    #[test]
    fn qwen_vl_utils_sizing_counts_even_frames_and_sizes_each_alone() {
        let mut cfg = VideoConfig { fps: 1.0, max_frames: 64, sizing: ClipSizing::QwenVlUtils, ..Default::default() };
        cfg.base.max_pixels = 25_165_824; // the released checkpoints' clip budget
        let p = VideoProcessor::new(cfg);
        // smart_nframes by hand: 5 s at 1 fps -> 5 -> floor_even 4; 3 frames -> min(max(3, 4), 3)
        // -> 2; 200 s -> 64; one frame cannot make a pair.
        assert_eq!(p.sample_indices(5, 1.0).unwrap(), [0, 1, 3, 4]);
        assert_eq!(p.sample_indices(3, 1.0).unwrap(), [0, 2]);
        assert_eq!(p.sample_indices(200, 1.0).unwrap().len(), 64);
        assert_eq!(p.sample_indices(45, 15.0).unwrap(), [0, 15, 29, 44]);
        assert!(p.sample_indices(1, 1.0).is_err());
        // Each frame alone: 48x48 grows to at least 128 tokens of 32x32 (ceil(48 x 7.54 / 32) =
        // 12 a side); 1920x1080 shrinks to at most 768 tokens (beta = sqrt(2073600 / 786432)).
        assert_eq!(p.plan(60, 10.0, 48, 48).unwrap().resized, (384, 384));
        assert_eq!(p.plan(8, 2.0, 1080, 1920).unwrap().resized, (640, 1152));
        // The clip budget's share lowers the top: 6 frames of a 1.5M-pixel budget, 250k each.
        let mut small = p.clone();
        small.config.base.max_pixels = 1_500_000;
        assert_eq!(small.plan(6, 1.0, 1080, 1920).unwrap().resized, (352, 640));
    }

    #[test]
    fn the_per_frame_cap_bounds_short_clips() {
        let mut cfg = VideoConfig::default();
        cfg.base.max_pixels = 25_165_824;
        cfg.base.min_pixels = 4096;
        let uncapped = VideoProcessor::new(cfg.clone()).plan(8, 2.0, 1080, 1920).unwrap();
        cfg.cap_pixels_per_frame = true;
        let capped = VideoProcessor::new(cfg).plan(8, 2.0, 1080, 1920).unwrap();
        // 8 frames: uncapped keeps 1088x1920 (the budget allows it); the cap is 768 tokens of
        // 32x32 per frame = 786432 pixels: sqrt(1080*1920*8 / (786432*8)) = 1.63 -> 640x1152.
        assert_eq!(uncapped.resized, (1088, 1920));
        assert_eq!(capped.resized, (640, 1152));
        assert_eq!(capped.grid, [4, 40, 72]);
    }

    #[test]
    fn config_reads_the_shipped_file_and_checks_values() {
        let text = r#"{"size": {"longest_edge": 25165824, "shortest_edge": 4096}, "patch_size": 16,
            "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5], "processor_class": "Qwen3VLProcessor",
            "video_processor_type": "Qwen3VLVideoProcessor"}"#;
        let c = VideoConfig::from_json_str(text, Path::new("v.json")).unwrap();
        assert_eq!((c.base.min_pixels, c.base.max_pixels), (4096, 25_165_824));
        assert_eq!((c.fps, c.min_frames, c.max_frames), (2.0, 4, 768));
        let c = VideoConfig::from_json_str("{}", Path::new("v.json")).unwrap();
        assert_eq!((c.base.min_pixels, c.base.max_pixels), VideoConfig::CLASS_BUDGET);
        for (body, field) in [
            (r#"{"fps": 0}"#, "fps"),
            (r#"{"fps": -2}"#, "fps"),
            (r#"{"max_frames": 0}"#, "max_frames"),
            (r#"{"max_frames": 100000}"#, "max_frames"),
        ] {
            let e = VideoConfig::from_json_str(body, Path::new("v.json")).unwrap_err().to_string();
            assert!(e.contains(field) && e.contains("v.json"), "{body}: {e}");
        }
        let p = VideoProcessor::new(VideoConfig::default());
        let e = p.clone().with_options(&VideoOptions { fps: Some(f64::INFINITY), ..Default::default() });
        assert!(e.unwrap_err().to_string().contains("fps"));
        let e = p.with_options(&VideoOptions { min_pixels: Some(10), max_pixels: Some(5), ..Default::default() });
        assert!(e.unwrap_err().to_string().contains("above max_pixels"));
    }
}
