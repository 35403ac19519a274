//! The image processor, mirroring transformers' `Qwen2VLImageProcessorPil`
//! (`models/qwen2_vl/image_processing_pil_qwen2_vl.py`), which Qwen3-VL uses: decode, convert to
//! RGB (transparency composited onto white), `smart_resize` to multiples of patch * merge within
//! the pixel budget, bicubic resize (a Pillow-compatible convolution resizer), rescale,
//! normalize, repeat to the temporal patch, and patchify in merge-block order.

use std::path::Path;

use candle_core::{Device, Tensor};
use fast_image_resize::images::Image as FirImage;
use fast_image_resize::{FilterType, PixelType, ResizeAlg, ResizeOptions, Resizer};
use image::RgbImage;
use serde::Deserialize;

use super::model::VisionInput;
use super::vision::Grid;
use crate::error::{Error, Result};
pub use crate::image_file::{load_image, to_rgb, ImageFile};
use crate::limits::{self, ImageLimits};

/// Largest accepted aspect ratio (the reference raises above it).
pub const MAX_ASPECT_RATIO: f64 = 200.0;
pub use crate::limits::MAX_PIXEL_BUDGET;
const MAX_PATCH: usize = 64;
const MAX_MERGE: usize = 8;
const MAX_TEMPORAL_PATCH: usize = 16;

#[derive(Debug, Clone, Deserialize)]
struct RawSize {
    shortest_edge: Option<usize>,
    longest_edge: Option<usize>,
}

#[derive(Debug, Clone, Deserialize)]
struct RawPreprocessor {
    size: Option<RawSize>,
    min_pixels: Option<usize>,
    max_pixels: Option<usize>,
    #[serde(default = "d_patch")]
    patch_size: usize,
    #[serde(default = "d_two")]
    temporal_patch_size: usize,
    #[serde(default = "d_two")]
    merge_size: usize,
    #[serde(default = "d_half")]
    image_mean: Vec<f32>,
    #[serde(default = "d_half")]
    image_std: Vec<f32>,
    #[serde(default = "d_rescale")]
    rescale_factor: f64,
    #[serde(default = "d_true")]
    do_resize: bool,
    #[serde(default = "d_true")]
    do_rescale: bool,
    #[serde(default = "d_true")]
    do_normalize: bool,
    #[serde(default = "d_bicubic")]
    resample: u32,
}

fn d_patch() -> usize {
    16
}
fn d_two() -> usize {
    2
}
fn d_half() -> Vec<f32> {
    vec![0.5; 3]
}
fn d_rescale() -> f64 {
    1.0 / 255.0
}
fn d_true() -> bool {
    true
}
fn d_bicubic() -> u32 {
    3
}

/// `preprocessor_config.json`, resolved.
#[derive(Debug, Clone, PartialEq)]
pub struct PreprocessorConfig {
    pub min_pixels: usize,
    pub max_pixels: usize,
    pub patch_size: usize,
    pub temporal_patch_size: usize,
    pub merge_size: usize,
    pub image_mean: [f32; 3],
    pub image_std: [f32; 3],
    pub rescale_factor: f64,
    pub do_resize: bool,
    pub do_rescale: bool,
    pub do_normalize: bool,
}

impl Default for PreprocessorConfig {
    /// Qwen3-VL's shipped values.
    fn default() -> Self {
        Self {
            min_pixels: 65_536,
            max_pixels: 16_777_216,
            patch_size: 16,
            temporal_patch_size: 2,
            merge_size: 2,
            image_mean: [0.5; 3],
            image_std: [0.5; 3],
            rescale_factor: 1.0 / 255.0,
            do_resize: true,
            do_rescale: true,
            do_normalize: true,
        }
    }
}

impl PreprocessorConfig {
    /// Reads `dir/preprocessor_config.json`; Qwen3-VL defaults when the file is absent.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("preprocessor_config.json");
        if !path.is_file() {
            return Ok(Self::default());
        }
        let text = limits::read_text(&path, limits::MAX_METADATA_FILE_BYTES)?;
        Self::from_json_str(&text, &path)
    }

    /// Parses a preprocessor_config.json body; `path` is used in error messages only.
    pub fn from_json_str(text: &str, path: &Path) -> Result<Self> {
        let d = Self::default();
        Self::parse(text, path, (d.min_pixels, d.max_pixels))
    }

    /// `from_json_str` with the pixel budget used when the file gives none (the video
    /// processor's class defaults differ from the image processor's).
    pub(crate) fn parse(text: &str, path: &Path, default_budget: (usize, usize)) -> Result<Self> {
        let path = path.to_path_buf();
        let raw: RawPreprocessor =
            serde_json::from_str(text).map_err(|source| Error::Json { path: path.clone(), source })?;
        let field = |f: &str, m: String| Error::Config { path: path.clone(), field: f.into(), message: m };
        if raw.resample != 3 {
            return Err(field("resample", format!("{} is not supported (3 = bicubic only)", raw.resample)));
        }
        let three = |v: &[f32], f: &str| -> Result<[f32; 3]> {
            v.try_into().map_err(|_| field(f, format!("{v:?} must have 3 values")))
        };
        let size = raw.size.clone();
        for (f, v, max) in [
            ("patch_size", raw.patch_size, MAX_PATCH),
            ("merge_size", raw.merge_size, MAX_MERGE),
            ("temporal_patch_size", raw.temporal_patch_size, MAX_TEMPORAL_PATCH),
        ] {
            if v == 0 || v > max {
                return Err(field(f, format!("{v} is outside 1..={max}")));
            }
        }
        if !(raw.rescale_factor.is_finite() && raw.rescale_factor > 0.0) {
            return Err(field("rescale_factor", format!("{} must be a finite number > 0", raw.rescale_factor)));
        }
        let mean = three(&raw.image_mean, "image_mean")?;
        let std = three(&raw.image_std, "image_std")?;
        if mean.iter().any(|m| !m.is_finite()) {
            return Err(field("image_mean", format!("{mean:?} must be finite")));
        }
        if std.iter().any(|s| !(s.is_finite() && *s > 0.0)) {
            return Err(field("image_std", format!("{std:?} must be finite and > 0 (pixels are divided by it)")));
        }
        let (min_key, max_key) = if raw.min_pixels.is_some() || raw.max_pixels.is_some() {
            ("min_pixels", "max_pixels")
        } else {
            ("size.shortest_edge", "size.longest_edge")
        };
        let cfg = Self {
            min_pixels: raw.min_pixels.or(size.as_ref().and_then(|s| s.shortest_edge)).unwrap_or(default_budget.0),
            max_pixels: raw.max_pixels.or(size.as_ref().and_then(|s| s.longest_edge)).unwrap_or(default_budget.1),
            patch_size: raw.patch_size,
            temporal_patch_size: raw.temporal_patch_size,
            merge_size: raw.merge_size,
            image_mean: mean,
            image_std: std,
            rescale_factor: raw.rescale_factor,
            do_resize: raw.do_resize,
            do_rescale: raw.do_rescale,
            do_normalize: raw.do_normalize,
        };
        check_budget(cfg.min_pixels, cfg.max_pixels)
            .map_err(|(which, m)| field(if which == 0 { min_key } else { max_key }, m))?;
        Ok(cfg)
    }

    /// Side multiple of resized images: patch * merge.
    pub fn factor(&self) -> usize {
        self.patch_size * self.merge_size
    }
}

/// Target (height, width): each a multiple of `factor`, the pixel count within
/// [min_pixels, max_pixels], the aspect ratio kept as closely as possible. Rounds half to even,
/// as Python's `round` does.
pub fn smart_resize(
    height: usize,
    width: usize,
    factor: usize,
    min_pixels: usize,
    max_pixels: usize,
) -> Result<(usize, usize)> {
    if height == 0 || width == 0 {
        return Err(Error::Input { what: "image".into(), message: format!("empty image {width}x{height}") });
    }
    let ratio = height.max(width) as f64 / height.min(width) as f64;
    if ratio > MAX_ASPECT_RATIO {
        return Err(Error::Input {
            what: "image".into(),
            message: format!("aspect ratio {ratio:.1} ({width}x{height}) exceeds {MAX_ASPECT_RATIO}"),
        });
    }
    if factor == 0 || max_pixels == 0 {
        return Err(Error::Input {
            what: "image".into(),
            message: format!("resize factor {factor} and max_pixels {max_pixels} must be > 0"),
        });
    }
    let (h, w, f) = (height as f64, width as f64, factor as f64);
    // Sides as multiples of the factor, saturating instead of overflowing (refused below).
    let sides = |units: f64| -> usize {
        let v = units * f;
        if v < (1u64 << 52) as f64 {
            v as usize
        } else {
            usize::MAX
        }
    };
    let area = |a: usize, b: usize| a as f64 * b as f64;
    let mut h_bar = sides((h / f).round_ties_even());
    let mut w_bar = sides((w / f).round_ties_even());
    if area(h_bar, w_bar) > max_pixels as f64 {
        let beta = ((h * w) / max_pixels as f64).sqrt();
        h_bar = factor.max(sides((h / beta / f).floor()));
        w_bar = factor.max(sides((w / beta / f).floor()));
    } else if area(h_bar, w_bar) < min_pixels as f64 {
        let beta = (min_pixels as f64 / (h * w)).sqrt();
        h_bar = sides((h * beta / f).ceil());
        w_bar = sides((w * beta / f).ceil());
    }
    // Rounding up to min_pixels can pass max_pixels slightly (as in the reference), but never the
    // hard budget: the caller's allocation is sized by this product.
    match h_bar.checked_mul(w_bar) {
        Some(n) if n <= MAX_PIXEL_BUDGET.max(max_pixels).saturating_mul(2) => Ok((h_bar, w_bar)),
        _ => Err(Error::Input {
            what: "image".into(),
            message: format!("resizing {width}x{height} gives {w_bar}x{h_bar}, over the pixel budget {max_pixels}"),
        }),
    }
}

/// Checks the pixel budget pair: `Err((0 | 1, message))` names min (0) or max (1).
fn check_budget(min_pixels: usize, max_pixels: usize) -> std::result::Result<(), (u8, String)> {
    if max_pixels == 0 || max_pixels > MAX_PIXEL_BUDGET {
        return Err((1, format!("{max_pixels} is outside 1..={MAX_PIXEL_BUDGET}")));
    }
    if min_pixels == 0 || min_pixels > MAX_PIXEL_BUDGET {
        return Err((0, format!("{min_pixels} is outside 1..={MAX_PIXEL_BUDGET}")));
    }
    if min_pixels > max_pixels {
        return Err((0, format!("{min_pixels} is above max_pixels {max_pixels}")));
    }
    Ok(())
}

/// One preprocessed image.
#[derive(Debug, Clone)]
pub struct ProcessedImage {
    /// Patch rows, row-major [t * h * w, C * T * P * P].
    pub pixels: Vec<f32>,
    pub grid: Grid,
    /// (height, width) after resizing.
    pub resized: (usize, usize),
    /// (height, width) as decoded (after EXIF orientation), before resizing.
    pub original: (usize, usize),
}

impl ProcessedImage {
    /// LLM tokens this image becomes.
    pub fn num_tokens(&self, merge: usize) -> usize {
        self.grid.iter().product::<usize>() / (merge * merge)
    }
}

#[derive(Debug, Clone)]
pub struct ImageProcessor {
    pub config: PreprocessorConfig,
    pub limits: ImageLimits,
}

impl ImageProcessor {
    pub fn new(config: PreprocessorConfig) -> Self {
        Self { config, limits: ImageLimits::default() }
    }

    pub fn from_dir(dir: &Path) -> Result<Self> {
        Ok(Self::new(PreprocessorConfig::from_dir(dir)?))
    }

    /// Overrides the pixel budget (per call, like the reference's `size=` argument); the
    /// resulting pair must satisfy 1 <= min_pixels <= max_pixels <= `MAX_PIXEL_BUDGET`. A bound
    /// given alone moves the other one with it when they would cross; both given and crossed is
    /// an error.
    pub fn with_pixel_budget(mut self, min_pixels: Option<usize>, max_pixels: Option<usize>) -> Result<Self> {
        self.config.set_pixel_budget(min_pixels, max_pixels)?;
        Ok(self)
    }
}

impl PreprocessorConfig {
    /// Sets the pixel budget as `ImageProcessor::with_pixel_budget` describes; errors name
    /// `min_pixels` or `max_pixels`.
    pub fn set_pixel_budget(&mut self, min_pixels: Option<usize>, max_pixels: Option<usize>) -> Result<()> {
        for (name, v) in [("min_pixels", min_pixels), ("max_pixels", max_pixels)] {
            if let Some(v) = v.filter(|&v| v == 0 || v > MAX_PIXEL_BUDGET) {
                return Err(Error::Input {
                    what: name.into(),
                    message: format!("{v} is outside 1..={MAX_PIXEL_BUDGET}"),
                });
            }
        }
        match (min_pixels, max_pixels) {
            (Some(lo), Some(hi)) => (self.min_pixels, self.max_pixels) = (lo, hi),
            (Some(lo), None) => (self.min_pixels, self.max_pixels) = (lo, self.max_pixels.max(lo)),
            (None, Some(hi)) => (self.min_pixels, self.max_pixels) = (self.min_pixels.min(hi), hi),
            (None, None) => {}
        }
        check_budget(self.min_pixels, self.max_pixels).map_err(|(which, message)| Error::Input {
            what: if which == 0 { "min_pixels".into() } else { "max_pixels".into() },
            message,
        })
    }
}

impl ImageProcessor {
    /// Loads and preprocesses an image file within `self.limits`; errors name the file.
    pub fn process_file(&self, path: &Path) -> Result<ProcessedImage> {
        self.process_opened(&ImageFile::open(path, &self.limits)?)
    }

    /// Decodes and preprocesses an image file already opened (and checked) by `ImageFile::open`.
    pub fn process_opened(&self, file: &ImageFile) -> Result<ProcessedImage> {
        self.process(&file.decode()?).map_err(|e| file.name_error(e))
    }

    /// (height, width) an image of `height0` x `width0` is resized to.
    pub fn target_size(&self, height0: usize, width0: usize) -> Result<(usize, usize)> {
        let c = &self.config;
        let (h, w) = if c.do_resize {
            smart_resize(height0, width0, c.factor(), c.min_pixels, c.max_pixels)?
        } else {
            (height0, width0)
        };
        if h % c.factor() != 0 || w % c.factor() != 0 {
            return Err(Error::Input {
                what: "image".into(),
                message: format!("{w}x{h} is not a multiple of {} (enable do_resize)", c.factor()),
            });
        }
        Ok((h, w))
    }

    /// LLM tokens an image of this stored size becomes (from its header, before decoding).
    pub fn tokens_for(&self, file: &ImageFile) -> Result<usize> {
        let (h, w) = self.target_size(file.height as usize, file.width as usize).map_err(|e| file.name_error(e))?;
        Ok(h * w / (self.config.factor() * self.config.factor()))
    }

    pub fn process(&self, img: &RgbImage) -> Result<ProcessedImage> {
        let c = &self.config;
        let (w0, h0) = (img.width() as usize, img.height() as usize);
        let (h, w) = self.target_size(h0, w0)?;
        let planes = normalized_planes(img, h, w, c)?;
        Ok(ProcessedImage {
            pixels: patchify(&vec![&planes[..]; c.temporal_patch_size], h, w, c),
            grid: [1, h / c.patch_size, w / c.patch_size],
            resized: (h, w),
            original: (h0, w0),
        })
    }

    /// Stacks processed images into one vision input.
    pub fn batch(&self, images: &[ProcessedImage], device: &Device) -> Result<VisionInput> {
        let row = 3 * self.config.temporal_patch_size * self.config.patch_size * self.config.patch_size;
        let data: Vec<f32> = images.iter().flat_map(|i| i.pixels.iter().copied()).collect();
        let rows = data.len() / row;
        Ok(VisionInput {
            pixels: Tensor::from_vec(data, (rows, row), device)?,
            grids: images.iter().map(|i| i.grid).collect(),
        })
    }
}

/// Bicubic (Catmull-Rom, a = -0.5) convolution resize in Pillow's order: the horizontal pass
/// first, rounded to u8, then the vertical pass. (fast_image_resize alone runs the vertical pass
/// first for u8 images, which moves values near sharp edges by several levels.)
pub(crate) fn resize_bicubic(img: &RgbImage, w: usize, h: usize) -> Result<Vec<u8>> {
    let err = |e: String| Error::Input { what: "image".into(), message: format!("resize: {e}") };
    let opts = ResizeOptions::new().resize_alg(ResizeAlg::Convolution(FilterType::CatmullRom));
    let mut resizer = Resizer::new();
    let (w0, h0) = img.dimensions();
    let src = FirImage::from_vec_u8(w0, h0, img.as_raw().clone(), PixelType::U8x3).map_err(|e| err(e.to_string()))?;
    let mut wide = FirImage::new(w as u32, h0, PixelType::U8x3);
    resizer.resize(&src, &mut wide, &opts).map_err(|e| err(e.to_string()))?;
    let mut dst = FirImage::new(w as u32, h as u32, PixelType::U8x3);
    resizer.resize(&wide, &mut dst, &opts).map_err(|e| err(e.to_string()))?;
    Ok(dst.into_vec())
}

/// The same bicubic filter (antialiased when shrinking) in f32, rounded to u8 once at the end:
/// what torchvision's `resize(uint8 frames, BICUBIC, antialias=True)` gives on the CPU, which
/// qwen-vl-utils sizes video frames with (Pillow rounds between its two passes).
pub(crate) fn resize_bicubic_rounded_once(img: &RgbImage, w: usize, h: usize) -> Result<Vec<u8>> {
    let err = |e: String| Error::Input { what: "video".into(), message: format!("resize: {e}") };
    let opts = ResizeOptions::new().resize_alg(ResizeAlg::Convolution(FilterType::CatmullRom));
    let (w0, h0) = img.dimensions();
    let bytes: Vec<u8> = img.as_raw().iter().flat_map(|&v| (v as f32).to_ne_bytes()).collect();
    let src = FirImage::from_vec_u8(w0, h0, bytes, PixelType::F32x3).map_err(|e| err(e.to_string()))?;
    let mut dst = FirImage::new(w as u32, h as u32, PixelType::F32x3);
    Resizer::new().resize(&src, &mut dst, &opts).map_err(|e| err(e.to_string()))?;
    Ok(dst
        .buffer()
        .chunks_exact(4)
        .map(|b| f32::from_ne_bytes([b[0], b[1], b[2], b[3]]).round_ties_even().clamp(0.0, 255.0) as u8)
        .collect())
}

/// How a frame or image is brought to its size (`normalized_planes_by`).
pub(crate) type ResizeFn = fn(&RgbImage, usize, usize) -> Result<Vec<u8>>;

/// Resized to (h, w) (bicubic, unless already that size), rescaled and normalized: channel-first
/// float planes [3, h, w].
pub(crate) fn normalized_planes(img: &RgbImage, h: usize, w: usize, c: &PreprocessorConfig) -> Result<Vec<f32>> {
    normalized_planes_by(img, h, w, c, resize_bicubic)
}

/// `normalized_planes` with another resize.
pub(crate) fn normalized_planes_by(
    img: &RgbImage,
    h: usize,
    w: usize,
    c: &PreprocessorConfig,
    resize: ResizeFn,
) -> Result<Vec<f32>> {
    let (w0, h0) = (img.width() as usize, img.height() as usize);
    let resized;
    let rgb: &[u8] = if (h, w) == (h0, w0) {
        img.as_raw()
    } else {
        resized = resize(img, w, h)?;
        &resized
    };
    let plane = h * w;
    let mut planes = vec![0f32; 3 * plane];
    for (i, px) in rgb.chunks_exact(3).enumerate() {
        for ch in 0..3 {
            let mut v = px[ch] as f32;
            if c.do_rescale {
                v = (px[ch] as f64 * c.rescale_factor) as f32;
            }
            if c.do_normalize {
                v = (v - c.image_mean[ch]) / c.image_std[ch];
            }
            planes[ch * plane + i] = v;
        }
    }
    Ok(planes)
}

/// One temporal patch of channel-first frames (`frames.len()` = the temporal patch size; an
/// image repeats its one frame) -> rows [(h/P)*(w/P), 3*T*P*P] in merge-block order: row order
/// (block row, block col, in-row, in-col), values ordered (channel, frame, patch row, patch col).
pub(crate) fn patchify(frames: &[&[f32]], h: usize, w: usize, c: &PreprocessorConfig) -> Vec<f32> {
    let (p, m) = (c.patch_size, c.merge_size);
    let (gh, gw) = (h / p, w / p);
    let mut out = Vec::with_capacity(3 * h * w * frames.len());
    for bh in 0..gh / m {
        for bw in 0..gw / m {
            for mh in 0..m {
                for mw in 0..m {
                    let (r0, c0) = ((bh * m + mh) * p, (bw * m + mw) * p);
                    for ch in 0..3 {
                        for planes in frames {
                            for pr in 0..p {
                                let start = ch * h * w + (r0 + pr) * w + c0;
                                out.extend_from_slice(&planes[start..start + p]);
                            }
                        }
                    }
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smart_resize_rounds_scales_and_rejects() {
        // Within budget: nearest multiple of 32, half to even (48/32 = 1.5 -> 2, 80/32 = 2.5 -> 2).
        assert_eq!(smart_resize(48, 80, 32, 1, 1 << 30).unwrap(), (64, 64));
        assert_eq!(smart_resize(211, 97, 32, 4096, 65536).unwrap(), (224, 96));
        // Above max: floor after scaling. 480x640 with max 65536: beta = sqrt(307200/65536).
        assert_eq!(smart_resize(480, 640, 32, 4096, 65536).unwrap(), (192, 288));
        // Below min: ceil after scaling. 24x40, min 4096: beta = sqrt(4096/960).
        assert_eq!(smart_resize(24, 40, 32, 4096, 65536).unwrap(), (64, 96));
        let err = smart_resize(10, 2010, 32, 1, 1 << 30).unwrap_err().to_string();
        assert!(err.contains("aspect ratio 201.0"), "{err}");
    }

    #[test]
    fn patchify_orders_merge_blocks_then_channels_then_time() {
        // 4x4 image, patch 1, merge 2, temporal 2: value = ch*100 + row*10 + col.
        let c = PreprocessorConfig { patch_size: 1, merge_size: 2, temporal_patch_size: 2, ..Default::default() };
        let planes: Vec<f32> = (0..3)
            .flat_map(|ch| (0..4).flat_map(move |r| (0..4).map(move |col| (ch * 100 + r * 10 + col) as f32)))
            .collect();
        let rows = patchify(&[&planes[..], &planes[..]], 4, 4, &c);
        assert_eq!(rows.len(), 16 * 6);
        let row = |i: usize| &rows[i * 6..i * 6 + 6];
        assert_eq!(row(0), &[0., 0., 100., 100., 200., 200.]); // (0,0)
        assert_eq!(row(1), &[1., 1., 101., 101., 201., 201.]); // (0,1)
        assert_eq!(row(2), &[10., 10., 110., 110., 210., 210.]); // (1,0)
        assert_eq!(row(4), &[2., 2., 102., 102., 202., 202.]); // block (0,1) starts at (0,2)
        assert_eq!(row(8), &[20., 20., 120., 120., 220., 220.]); // block (1,0) at (2,0)
    }
}
