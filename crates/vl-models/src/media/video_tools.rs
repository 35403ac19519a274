//! Helpers of video decoding: the time bound, rotation, ffmpeg's frame selection, the child
//! processes of ffmpeg and ffprobe and their errors, frame-file order, animated images' frames.

use crate::limits::{self, LimitKind};
use std::io::{Cursor, Read};
use std::path::Path;
use std::process::{Command, Stdio};

use image::{AnimationDecoder, ImageFormat};

use crate::error::{Error, Result};

/// Frame rates accepted from a source or a flag: above 0, at most this.
pub const MAX_FPS: f64 = 1000.0;

/// The install hint for a missing ffmpeg.
pub const FFMPEG_HINT: &str = "decoding video files needs `ffmpeg` and `ffprobe` on PATH (Debian/Ubuntu: apt-get install ffmpeg; macOS: brew install ffmpeg); animated GIF/PNG/WebP files and directories of frames work without them";

/// Bounds on a video source, checked when it is probed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VideoLimits {
    /// Bytes of a video held in memory (a request's data, an animated image file read whole).
    pub max_file_bytes: u64,
    /// Pixels (width x height) of one source frame.
    pub max_frame_pixels: u64,
    /// Frames in the source (all of them are decoded to reach the sampled ones).
    pub max_source_frames: usize,
    /// Pixels decoded to read an animated image (frames x canvas, counting its frames included):
    /// a tiny file can describe a huge canvas many times over.
    pub max_animation_pixels: u64,
    /// Wall time one decode may take (`None`: unbounded), by every decoder: ffmpeg (killed past
    /// it) and the in-process ones (animated images, frame directories; checked after each
    /// frame). Past it the video is refused. `vl serve` sets it, so one video cannot hold the
    /// worker for long.
    pub max_decode_time: Option<std::time::Duration>,
    /// Media a client named (a server): only regular files are opened (a FIFO, device or socket
    /// is refused without blocking), and a directory's frames must resolve inside it (a frame
    /// that is a link to a file elsewhere is refused).
    pub confined: bool,
}

impl Default for VideoLimits {
    fn default() -> Self {
        // 1 GiB of encoded video in memory; 2^26-pixel frames as for images (8K is 2^25); an
        // hour at 60 fps.
        // 2^30 animation pixels: 16 frames of an 8000x8000 canvas, 517 of 1080p, 4294 of 500x500.
        Self {
            max_file_bytes: 1 << 30,
            max_frame_pixels: 1 << 26,
            max_source_frames: 216_000,
            max_animation_pixels: 1 << 30,
            max_decode_time: None,
            confined: false,
        }
    }
}

/// The in-process decoders' time bound (`VideoLimits::max_decode_time`), checked between frames.
pub(super) fn decode_time_check(name: &Path, limits: &VideoLimits, started: std::time::Instant) -> Result<()> {
    match limits.max_decode_time {
        Some(limit) if started.elapsed() > limit => Err(Error::Limit {
            what: what(name),
            message: format!("decoding took longer than the limit of {} s", limit.as_secs_f64()),
            kind: LimitKind::DecodeTime,
        }),
        _ => Ok(()),
    }
}

/// Quarter turns clockwise (0-3) that make a stream upright: the display matrix's rotation as
/// ffprobe prints it (counter-clockwise degrees), else the legacy `rotate` tag (clockwise), to
/// the nearest quarter.
pub(super) fn quarter_turns(side_rotation: Option<f64>, tag_rotation: Option<f64>) -> u8 {
    let clockwise = match (side_rotation, tag_rotation) {
        (Some(r), _) => -r,
        (None, Some(t)) => t,
        (None, None) => return 0,
    };
    if !clockwise.is_finite() {
        return 0;
    }
    ((clockwise / 90.0).round() as i64).rem_euclid(4) as u8
}

/// ffmpeg's `select` expression for these frame numbers: a balanced sum of `eq(n,i)`, so its
/// nesting grows with the log of the count (ffmpeg 5.1's parser refuses a flat sum of more
/// than about 100 terms, a clip of about 50 s at 2 frames a second).
pub(super) fn select_expr(indices: &[usize]) -> String {
    match indices {
        [] => "0".into(),
        [i] => format!("eq(n\\,{i})"),
        _ => {
            let (a, b) = indices.split_at(indices.len() / 2);
            format!("({}+{})", select_expr(a), select_expr(b))
        }
    }
}

/// File-name order with digit runs compared as numbers (`frame2` before `frame10`).
pub(super) fn natural_cmp(a: &str, b: &str) -> std::cmp::Ordering {
    let (mut x, mut y) = (a.chars().peekable(), b.chars().peekable());
    loop {
        match (x.peek().copied(), y.peek().copied()) {
            (None, None) => return std::cmp::Ordering::Equal,
            (None, _) => return std::cmp::Ordering::Less,
            (_, None) => return std::cmp::Ordering::Greater,
            (Some(c), Some(d)) if c.is_ascii_digit() && d.is_ascii_digit() => {
                let run = |it: &mut std::iter::Peekable<std::str::Chars>| {
                    let mut s = String::new();
                    while let Some(c) = it.peek().copied().filter(char::is_ascii_digit) {
                        s.push(c);
                        it.next();
                    }
                    s
                };
                let (m, n) = (run(&mut x), run(&mut y));
                let (mt, nt) = (m.trim_start_matches('0'), n.trim_start_matches('0'));
                let ord = mt.len().cmp(&nt.len()).then_with(|| mt.cmp(nt)).then_with(|| m.len().cmp(&n.len()));
                if ord != std::cmp::Ordering::Equal {
                    return ord;
                }
            }
            (Some(c), Some(d)) => {
                if c != d {
                    return c.cmp(&d);
                }
                x.next();
                y.next();
            }
        }
    }
}

/// Reads until `buf` is full or the stream ends; the byte count.
pub(super) fn read_full(r: &mut impl Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

pub(super) fn what(name: &Path) -> String {
    format!("video {}", name.display())
}

pub(super) fn rename(e: Error, name: &Path) -> Error {
    match e {
        Error::Limit { message, kind, .. } => Error::Limit { what: what(name), message, kind },
        other => other,
    }
}

pub(super) fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

pub(super) fn last_line(stderr: &[u8]) -> String {
    let text = String::from_utf8_lossy(stderr);
    text.lines().rev().find(|l| !l.trim().is_empty()).map(one_line).unwrap_or_else(|| "no message".into())
}

pub(super) fn spawn_error(name: &Path, tool: &str, e: std::io::Error) -> Error {
    if e.kind() == std::io::ErrorKind::NotFound {
        Error::Input { what: what(name), message: FFMPEG_HINT.into() }
    } else {
        Error::Input { what: what(name), message: format!("cannot run {tool}: {e}") }
    }
}

/// Runs a probe tool to completion; its stdout, or an error with the last line it printed.
/// Runs a probe (ffprobe) and returns its stdout (at most 16 MiB), within `limit` when given:
/// a probe that counts packets reads the whole file, so a huge or crafted one is killed at the
/// decode-time bound like ffmpeg itself.
pub(super) fn run_tool(name: &Path, cmd: &mut Command, limit: Option<std::time::Duration>) -> Result<Vec<u8>> {
    let tool = cmd.get_program().to_string_lossy().into_owned();
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| spawn_error(name, &tool, e))?;
    let mut stderr = child.stderr.take().expect("piped");
    let errors = std::thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = (&mut stderr).take(1 << 20).read_to_end(&mut buf);
        let _ = std::io::copy(&mut stderr, &mut std::io::sink());
        buf
    });
    let watchdog = limits::Watchdog::start(&child, limit);
    let mut out = Vec::new();
    let read = child.stdout.take().expect("piped").take(16 << 20).read_to_end(&mut out);
    let timed_out = watchdog.stop();
    let _ = child.kill();
    let status = child.wait().map_err(|e| Error::io(name, e))?;
    let stderr = errors.join().unwrap_or_default();
    if timed_out {
        return Err(Error::Limit {
            what: what(name),
            message: format!(
                "probing it with {tool} took longer than the decode limit of {} s",
                limit.unwrap_or_default().as_secs_f64()
            ),
            kind: LimitKind::DecodeTime,
        });
    }
    read.map_err(|e| Error::io(name, e))?;
    if !status.success() {
        return Err(Error::Input {
            what: what(name),
            message: format!("{tool} cannot read it: {}", last_line(&stderr)),
        });
    }
    Ok(out)
}

/// `num/den` (or a plain number) as a rate; `None` for 0/0, zero, negative or non-finite.
pub(super) fn parse_rate(s: &str) -> Option<f64> {
    let v = match s.split_once('/') {
        Some((n, d)) => n.trim().parse::<f64>().ok()? / d.trim().parse::<f64>().ok()?,
        None => s.trim().parse::<f64>().ok()?,
    };
    (v.is_finite() && v > 0.0).then_some(v)
}

/// A frame rate within (0, `MAX_FPS`]; the message says why not.
pub fn check_fps(fps: f64) -> std::result::Result<(), String> {
    if fps.is_finite() && fps > 0.0 && fps <= MAX_FPS {
        Ok(())
    } else {
        Err(format!("{fps} is outside (0, {MAX_FPS}] frames per second"))
    }
}

/// Image formats decoded in-process (GIF, PNG, WebP: animated or not; a still image is a
/// one-frame clip), from the first bytes.
pub(super) fn animated_format(head: &[u8]) -> Option<ImageFormat> {
    match image::guess_format(head).ok()? {
        f @ (ImageFormat::Gif | ImageFormat::Png | ImageFormat::WebP) => Some(f),
        _ => None,
    }
}

pub(super) fn animation_size(bytes: &[u8], format: ImageFormat) -> image::ImageResult<(u32, u32)> {
    use image::ImageDecoder;
    Ok(match format {
        ImageFormat::Gif => image::codecs::gif::GifDecoder::new(Cursor::new(bytes))?.dimensions(),
        ImageFormat::Png => image::codecs::png::PngDecoder::new(Cursor::new(bytes))?.dimensions(),
        _ => image::codecs::webp::WebPDecoder::new(Cursor::new(bytes))?.dimensions(),
    })
}

/// The frames of an animated (or still) GIF / PNG / WebP, each composed onto the full canvas.
pub(super) fn animation_frames(bytes: &[u8], format: ImageFormat) -> image::ImageResult<image::Frames<'_>> {
    Ok(match format {
        ImageFormat::Gif => image::codecs::gif::GifDecoder::new(Cursor::new(bytes))?.into_frames(),
        ImageFormat::Png => {
            let d = image::codecs::png::PngDecoder::new(Cursor::new(bytes))?;
            if d.is_apng()? {
                d.apng()?.into_frames()
            } else {
                still(image::DynamicImage::from_decoder(d)?)
            }
        }
        _ => {
            let d = image::codecs::webp::WebPDecoder::new(Cursor::new(bytes))?;
            if d.has_animation() {
                d.into_frames()
            } else {
                still(image::DynamicImage::from_decoder(d)?)
            }
        }
    })
}

pub(super) fn still(img: image::DynamicImage) -> image::Frames<'static> {
    image::Frames::new(Box::new(std::iter::once(Ok(image::Frame::new(img.to_rgba8())))))
}
