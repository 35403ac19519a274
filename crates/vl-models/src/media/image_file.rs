//! Image files, family-agnostic: read within `ImageLimits` (bytes from the file size, pixels
//! and sides from the header, before any pixel is decoded; truncated JPEGs refused as Pillow
//! refuses them), decoded to RGB with transparency composited onto white, as transformers'
//! PIL-based processors do.

use std::path::Path;

use image::{DynamicImage, RgbImage};

use crate::error::{Error, Result};
use crate::limits::{self, ImageLimits, LimitKind, MAX_IMAGE_SIDE};

/// A decoder's message on one line.
fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// An image file read within `ImageLimits`, its header checked, not yet decoded.
pub struct ImageFile {
    path: std::path::PathBuf,
    bytes: Vec<u8>,
    format: image::ImageFormat,
    /// Stored (not EXIF-rotated) width and height.
    pub width: u32,
    pub height: u32,
    limits: ImageLimits,
}

impl ImageFile {
    /// Reads `path` (at most `limits.max_file_bytes`) and checks the header's dimensions against
    /// `limits` before any pixel is decoded. Truncated JPEGs are refused here, as Pillow does.
    pub fn open(path: &Path, limits: &ImageLimits) -> Result<Self> {
        let what = || format!("image {}", path.display());
        let bytes = limits::read_bytes(path, limits.max_file_bytes, LimitKind::ImageBytes).map_err(|e| match e {
            Error::Limit { message, kind, .. } => Error::Limit { what: what(), message, kind },
            other => other,
        })?;
        Self::from_bytes(bytes, path, limits)
    }

    /// An image already in memory (e.g. a request's base64 data), checked as `open` checks a
    /// file; `name` stands for it in errors.
    pub fn from_bytes(bytes: Vec<u8>, name: &Path, limits: &ImageLimits) -> Result<Self> {
        let path = name;
        let what = || format!("image {}", path.display());
        let bad = |message: String| Error::Input { what: what(), message };
        if bytes.len() as u64 > limits.max_file_bytes {
            return Err(Error::Limit {
                what: what(),
                message: format!("{} bytes, over the limit of {} bytes", bytes.len(), limits.max_file_bytes),
                kind: LimitKind::ImageBytes,
            });
        }
        let reader = image::ImageReader::new(std::io::Cursor::new(&bytes[..]))
            .with_guessed_format()
            .map_err(|e| bad(format!("cannot read: {}", one_line(&e.to_string()))))?;
        let format =
            reader.format().ok_or_else(|| bad("not a recognized image format (PNG, JPEG, WebP, GIF, BMP)".into()))?;
        let (width, height) = {
            let decoder = Self::decoder(reader, limits).map_err(|e| Self::decode_error(e, path, limits))?;
            image::ImageDecoder::dimensions(&decoder)
        };
        if width == 0 || height == 0 {
            return Err(bad(format!("empty image {width}x{height}")));
        }
        let pixels = width as u64 * height as u64;
        if pixels > limits.max_pixels {
            return Err(Error::Limit {
                what: what(),
                message: format!(
                    "{width}x{height} is {pixels} pixels, over the limit of {} pixels per image",
                    limits.max_pixels
                ),
                kind: LimitKind::ImagePixels,
            });
        }
        if format == image::ImageFormat::Jpeg {
            jpeg_complete(&bytes).map_err(bad)?;
        }
        Ok(Self { path: path.to_path_buf(), bytes, format, width, height, limits: *limits })
    }

    fn decoder<'a>(
        mut reader: image::ImageReader<std::io::Cursor<&'a [u8]>>,
        limits: &ImageLimits,
    ) -> image::ImageResult<impl image::ImageDecoder + 'a> {
        let mut l = image::Limits::default();
        l.max_image_width = Some(MAX_IMAGE_SIDE);
        l.max_image_height = Some(MAX_IMAGE_SIDE);
        l.max_alloc = Some(limits.max_decoder_alloc());
        reader.limits(l);
        reader.into_decoder()
    }

    fn decode_error(e: image::ImageError, path: &Path, limits: &ImageLimits) -> Error {
        let what = format!("image {}", path.display());
        match e {
            image::ImageError::Limits(l) => Error::Limit {
                what,
                message: format!(
                    "{} (sides up to {MAX_IMAGE_SIDE}, decoder memory up to {} bytes for {} pixels)",
                    one_line(&l.to_string()),
                    limits.max_decoder_alloc(),
                    limits.max_pixels
                ),
                kind: LimitKind::ImagePixels,
            },
            e => Error::Input { what, message: format!("cannot decode: {}", one_line(&e.to_string())) },
        }
    }

    /// The path (or the name standing for it) the image was read as.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// An input error about this image, named by its path.
    pub(crate) fn name_error(&self, e: Error) -> Error {
        e.rename_input(|_| format!("image {}", self.path.display()))
    }

    /// Decodes the pixels, applies the EXIF orientation, and converts to RGB as the reference does.
    pub fn decode(&self) -> Result<RgbImage> {
        let reader = image::ImageReader::with_format(std::io::Cursor::new(&self.bytes[..]), self.format);
        let mut decoder =
            Self::decoder(reader, &self.limits).map_err(|e| Self::decode_error(e, &self.path, &self.limits))?;
        let orientation = image::ImageDecoder::orientation(&mut decoder).ok();
        let jpeg = (self.format == image::ImageFormat::Jpeg).then(|| decode_jpeg(&self.bytes, &self.limits)).flatten();
        let mut img = match jpeg {
            Some(img) => img,
            None => DynamicImage::from_decoder(decoder).map_err(|e| Self::decode_error(e, &self.path, &self.limits))?,
        };
        if let Some(o) = orientation {
            img.apply_orientation(o);
        }
        Ok(to_rgb(img))
    }
}

/// Decodes an image file (PNG, JPEG, WebP, GIF's first frame, BMP) within the default
/// `ImageLimits`, applies its EXIF orientation, and converts it to RGB the way the reference does.
pub fn load_image(path: &Path) -> Result<RgbImage> {
    ImageFile::open(path, &ImageLimits::default())?.decode()
}

/// Walks a JPEG's marker segments to its end-of-image marker; a file that ends first is
/// truncated (Pillow raises "image file is truncated"; jpeg-decoder would fill in gray).
fn jpeg_complete(b: &[u8]) -> std::result::Result<(), String> {
    let truncated =
        |at: usize| Err(format!("truncated JPEG: the data ends at byte {at} before the end-of-image marker"));
    if !b.starts_with(&[0xFF, 0xD8]) {
        return Err("not a JPEG (no start-of-image marker)".into());
    }
    let mut i = 2;
    loop {
        // Extraneous bytes before a marker are skipped, as libjpeg does.
        while i < b.len() && b[i] != 0xFF {
            i += 1;
        }
        while i < b.len() && b[i] == 0xFF {
            i += 1;
        }
        let Some(&marker) = b.get(i) else { return truncated(b.len()) };
        i += 1;
        match marker {
            0xD9 => return Ok(()),
            0x01 | 0xD0..=0xD7 => continue,
            _ => {}
        }
        if i + 2 > b.len() {
            return truncated(b.len());
        }
        let len = u16::from_be_bytes([b[i], b[i + 1]]) as usize;
        if len < 2 || i + len > b.len() {
            return truncated(b.len());
        }
        i += len;
        if marker == 0xDA {
            // Entropy-coded data runs to the next marker that is not a stuffed 0xFF00 or a restart.
            loop {
                if i + 1 >= b.len() {
                    return truncated(b.len());
                }
                if b[i] == 0xFF && b[i + 1] != 0 && !(0xD0..=0xD7).contains(&b[i + 1]) {
                    break;
                }
                i += 1;
            }
        }
    }
}

/// JPEG through `jpeg-decoder`, whose IDCT and fancy chroma upsampling follow libjpeg (what
/// Pillow uses) more closely than the `image` crate's decoder. `None` (use the `image` crate) for
/// CMYK and for anything it cannot decode.
fn decode_jpeg(bytes: &[u8], limits: &ImageLimits) -> Option<DynamicImage> {
    let mut d = jpeg_decoder::Decoder::new(bytes);
    d.set_max_decoding_buffer_size(usize::try_from(limits.max_decoder_alloc()).unwrap_or(usize::MAX));
    let pixels = d.decode().ok()?;
    let info = d.info()?;
    let (w, h) = (info.width as u32, info.height as u32);
    match info.pixel_format {
        jpeg_decoder::PixelFormat::RGB24 => RgbImage::from_raw(w, h, pixels).map(DynamicImage::ImageRgb8),
        jpeg_decoder::PixelFormat::L8 => image::GrayImage::from_raw(w, h, pixels).map(DynamicImage::ImageLuma8),
        _ => None,
    }
}

/// RGB conversion as transformers' `convert_to_rgb`: images with an alpha channel are
/// composited onto opaque white with Pillow's integer `alpha_composite` arithmetic.
pub fn to_rgb(img: DynamicImage) -> RgbImage {
    if !img.color().has_alpha() {
        return img.to_rgb8();
    }
    let rgba = img.to_rgba8();
    let (w, h) = rgba.dimensions();
    let mut out = RgbImage::new(w, h);
    for (o, p) in out.pixels_mut().zip(rgba.pixels()) {
        let a = p[3] as u32;
        for c in 0..3 {
            o[c] = composite_on_white(p[c] as u32, a);
        }
    }
    out
}

/// Pillow's `alpha_composite` of (v, a) over opaque white, 7 bits of fixed-point precision.
fn composite_on_white(v: u32, a: u32) -> u8 {
    const PRECISION_BITS: u32 = 7;
    if a == 0 {
        return 255;
    }
    let coef1 = a * 255 * 255 * (1 << PRECISION_BITS) / (255 * 255);
    let coef2 = 255 * (1 << PRECISION_BITS) - coef1;
    let tmp = v * coef1 + 255 * coef2 + (0x80 << PRECISION_BITS);
    ((((tmp >> 8) + tmp) >> 8) >> PRECISION_BITS) as u8
}

#[cfg(test)]
mod tests {
    use super::composite_on_white;

    #[test]
    fn compositing_matches_pillow_on_white() {
        assert_eq!(composite_on_white(0, 0), 255);
        assert_eq!(composite_on_white(10, 255), 10);
        assert_eq!(composite_on_white(0, 128), 127);
        assert_eq!(composite_on_white(200, 64), 241);
    }
}
