//! Video sources: files decoded by the `ffmpeg` / `ffprobe` programs found on PATH (driven as
//! subprocesses, no C library linked), animated GIF / PNG (APNG) / WebP decoded in-process, and
//! directories of frame images. A source is probed first (frame size, frame count, frame rate:
//! all that frame sampling and the token count need, before any pixel is decoded); then only the
//! sampled frames are decoded and handed out one at a time, so memory holds one source frame.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use image::{ImageFormat, RgbImage};

use crate::error::{Error, Result};

use super::video_tools::*;
pub use super::video_tools::{check_fps, VideoLimits, FFMPEG_HINT, MAX_FPS};

/// Frames sampled from one video at most (any config or flag); Qwen3-VL's shipped limit is 768.
pub const MAX_VIDEO_FRAMES: usize = 4096;
use crate::image_file::{to_rgb, ImageFile};
use crate::limits::{self, LimitKind, MAX_IMAGE_SIDE};

/// File extensions taken as frames in a directory of frames.
const FRAME_EXTENSIONS: [&str; 7] = ["png", "jpg", "jpeg", "webp", "gif", "bmp", "tif"];

/// What a probe learned about a source.
#[derive(Debug, Clone, PartialEq)]
pub struct VideoInfo {
    pub width: u32,
    pub height: u32,
    /// Frames in the source.
    pub frames: usize,
    /// Source frames per second (the rate timestamps are computed from).
    pub fps: f64,
    /// Which decoder reads it: "ffmpeg", "gif", "apng", "webp" or "frames" (a directory).
    pub decoder: &'static str,
}

enum Kind {
    /// Decoded by ffmpeg from this file (a temporary copy for in-memory data, kept alive here).
    /// `turns`: quarter turns clockwise that make the frames upright (the stream's display
    /// rotation), applied by our own filter, not ffmpeg's autorotation.
    Ffmpeg { file: PathBuf, _temp: Option<tempfile::NamedTempFile>, turns: u8 },
    /// An animated image held in memory.
    Animated { bytes: Vec<u8>, format: ImageFormat },
    /// Image files, one per frame, in name order.
    Frames(Vec<PathBuf>),
}

/// A probed video source.
pub struct VideoSource {
    name: PathBuf,
    kind: Kind,
    info: VideoInfo,
    limits: VideoLimits,
}

impl std::fmt::Debug for VideoSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VideoSource").field("name", &self.name).field("info", &self.info).finish()
    }
}

/// Container formats ffmpeg may open (its demuxer names): playlists (`hls`), `concat` lists and
/// image sequences (`image2`) are left out, since they open other files (a request's "video"
/// could otherwise read any file the server can).
const FFMPEG_FORMATS: &str = "mov,mp4,m4a,3gp,3g2,mj2,matroska,webm,avi,asf,flv,mpegts,mpeg,ogg,mxf,nut,ivf,dv,m4v,h264,hevc,av1,obu,mjpeg,vc1,yuv4mpegpipe";

/// Input options for ffprobe and ffmpeg: only local files, only the formats above.
fn input_guard(cmd: &mut Command) -> &mut Command {
    cmd.args(["-protocol_whitelist", "file", "-format_whitelist", FFMPEG_FORMATS])
}

impl VideoSource {
    /// Opens a video file or a directory of frames. A directory's frames (every image file in
    /// it, in file-name order) are taken as `frames_fps` frames per second.
    pub fn open(path: &Path, frames_fps: f64, limits: &VideoLimits) -> Result<Self> {
        let name = path.to_path_buf();
        let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
        if meta.is_dir() {
            return Self::frames_dir(name, frames_fps, limits);
        }
        let mut head = Vec::with_capacity(64);
        limits::open_checked(path, limits.confined)?.take(64).read_to_end(&mut head).map_err(|e| Error::io(path, e))?;
        if let Some(format) = animated_format(&head) {
            let bytes = limits::read_within(path, limits.max_file_bytes, LimitKind::Fixed, limits.confined)
                .map_err(|e| rename(e, &name))?;
            return Self::animated(name, bytes, format, limits);
        }
        Self::ffmpeg(name, path.to_path_buf(), None, limits)
    }

    /// A video held in memory (e.g. a request's base64 data); `name` stands for it in errors.
    /// Data that is not an animated image is written to a temporary file for ffmpeg.
    pub fn from_bytes(bytes: Vec<u8>, name: &Path, limits: &VideoLimits) -> Result<Self> {
        let name = name.to_path_buf();
        if bytes.len() as u64 > limits.max_file_bytes {
            return Err(Error::Limit {
                what: what(&name),
                message: format!("{} bytes, over the limit of {} bytes", bytes.len(), limits.max_file_bytes),
                kind: LimitKind::Fixed,
            });
        }
        if let Some(format) = animated_format(&bytes) {
            return Self::animated(name, bytes, format, limits);
        }
        let mut temp = tempfile::Builder::new().prefix("vl-video-").tempfile().map_err(|e| Error::io(&name, e))?;
        std::io::Write::write_all(&mut temp, &bytes).map_err(|e| Error::io(temp.path(), e))?;
        let file = temp.path().to_path_buf();
        Self::ffmpeg(name, file, Some(temp), limits)
    }

    /// Sets the decode-time bound for the reads that follow (a request's budget, what is left
    /// of it).
    pub fn set_max_decode_time(&mut self, limit: Option<std::time::Duration>) {
        self.limits.max_decode_time = limit;
    }

    pub fn info(&self) -> &VideoInfo {
        &self.info
    }

    pub fn name(&self) -> &Path {
        &self.name
    }

    /// Decodes the frames at `indices` (ascending, each below `info().frames`) and calls
    /// `each(k, frame)` for the k-th of them, in order. A stream that ends before an index (its
    /// header counted more frames than it decodes) repeats its last decoded frame.
    pub fn read_frames(&self, indices: &[usize], each: &mut dyn FnMut(usize, &RgbImage) -> Result<()>) -> Result<()> {
        if indices.windows(2).any(|w| w[0] >= w[1]) || indices.last().is_some_and(|&i| i >= self.info.frames) {
            return Err(self.input(format!("frame indices {indices:?} are not ascending below {}", self.info.frames)));
        }
        let delivered = std::cell::Cell::new(0usize);
        let mut last: Option<RgbImage> = None;
        let mut give = |frame: RgbImage, last: &mut Option<RgbImage>| -> Result<()> {
            let k = delivered.get();
            if frame.dimensions() != (self.info.width, self.info.height) {
                return Err(self.input(format!(
                    "frame {} is {}x{}, the first frame {}x{}: frames of changing size are not supported",
                    indices[k],
                    frame.width(),
                    frame.height(),
                    self.info.width,
                    self.info.height
                )));
            }
            each(k, &frame)?;
            delivered.set(k + 1);
            *last = Some(frame);
            Ok(())
        };
        match &self.kind {
            Kind::Frames(files) => {
                let started = std::time::Instant::now();
                for &i in indices {
                    decode_time_check(&self.name, &self.limits, started)?;
                    let frame = self.open_frame(&files[i]).and_then(|f| f.decode()).map_err(|e| match e {
                        Error::Input { what, message } => self.input(format!("{what}: {message}")),
                        other => other,
                    })?;
                    if frame.dimensions() != (self.info.width, self.info.height) {
                        return Err(self.input(format!(
                            "{} is {}x{}, the first frame {}x{}: frames of changing size are not supported",
                            files[i].display(),
                            frame.width(),
                            frame.height(),
                            self.info.width,
                            self.info.height
                        )));
                    }
                    give(frame, &mut last)?;
                }
            }
            Kind::Animated { bytes, format } => {
                let mut wanted = indices.iter().peekable();
                let started = std::time::Instant::now();
                for (i, frame) in animation_frames(bytes, *format).map_err(|e| self.decode_error(e))?.enumerate() {
                    if wanted.peek().is_none() {
                        break;
                    }
                    decode_time_check(&self.name, &self.limits, started)?;
                    let frame = frame.map_err(|e| self.decode_error(e))?;
                    if wanted.peek() == Some(&&i) {
                        wanted.next();
                        give(to_rgb(image::DynamicImage::ImageRgba8(frame.into_buffer())), &mut last)?;
                    }
                }
            }
            Kind::Ffmpeg { file, turns, .. } => {
                self.ffmpeg_frames(file, *turns, indices, &mut |f| give(f, &mut last))?
            }
        }
        if delivered.get() == 0 && !indices.is_empty() {
            return Err(self.input("no frame could be decoded".into()));
        }
        while delivered.get() < indices.len() {
            let frame = last.take().expect("one frame delivered");
            give(frame, &mut last)?;
        }
        Ok(())
    }

    /// A frame file of a directory (confined: only a regular file, checked on the open file).
    fn open_frame(&self, path: &Path) -> Result<ImageFile> {
        if !self.limits.confined {
            return ImageFile::open(path, &self.image_limits());
        }
        let bytes = limits::read_regular(path, self.limits.max_file_bytes, LimitKind::ImageBytes)?;
        ImageFile::from_bytes(bytes, path, &self.image_limits())
    }

    fn image_limits(&self) -> limits::ImageLimits {
        limits::ImageLimits { max_file_bytes: self.limits.max_file_bytes, max_pixels: self.limits.max_frame_pixels }
    }

    fn input(&self, message: String) -> Error {
        Error::Input { what: what(&self.name), message }
    }

    fn decode_error(&self, e: image::ImageError) -> Error {
        self.input(format!("cannot decode: {}", one_line(&e.to_string())))
    }

    fn checked(name: PathBuf, kind: Kind, info: VideoInfo, limits: &VideoLimits) -> Result<Self> {
        let bad = |message: String| Error::Input { what: what(&name), message };
        if info.width == 0 || info.height == 0 {
            return Err(bad(format!("empty frames {}x{}", info.width, info.height)));
        }
        let pixels = info.width as u64 * info.height as u64;
        if pixels > limits.max_frame_pixels || info.width > MAX_IMAGE_SIDE || info.height > MAX_IMAGE_SIDE {
            return Err(Error::Limit {
                what: what(&name),
                message: format!(
                    "frames of {}x{} are {pixels} pixels, over the limit of {} pixels per frame",
                    info.width, info.height, limits.max_frame_pixels
                ),
                kind: LimitKind::Fixed,
            });
        }
        if info.frames == 0 {
            return Err(bad("no frames".into()));
        }
        if info.frames > limits.max_source_frames {
            return Err(Error::Limit {
                what: what(&name),
                message: format!(
                    "{} frames, over the limit of {} frames per video",
                    info.frames, limits.max_source_frames
                ),
                kind: LimitKind::Fixed,
            });
        }
        check_fps(info.fps).map_err(|m| bad(format!("frame rate {m}")))?;
        Ok(Self { name, kind, info, limits: *limits })
    }

    /// A directory of frames, listed at the cost of the listing alone: each entry's type comes
    /// with it (no `stat`), and only a link is resolved (a plain file in the directory is inside
    /// it). Thousands of frames, listed again for each of many videos of a request, cost
    /// milliseconds, not seconds.
    fn frames_dir(name: PathBuf, fps: f64, limits: &VideoLimits) -> Result<Self> {
        let mut files = Vec::new();
        let dir = if limits.confined { Some(name.canonicalize().map_err(|e| Error::io(&name, e))?) } else { None };
        for entry in std::fs::read_dir(&name).map_err(|e| Error::io(&name, e))? {
            let entry = entry.map_err(|e| Error::io(&name, e))?;
            let file_name = entry.file_name();
            let path = entry.path();
            let is_frame = path.extension().is_some_and(|e| FRAME_EXTENSIONS.iter().any(|x| e.eq_ignore_ascii_case(x)));
            if file_name.to_string_lossy().starts_with('.') || !is_frame {
                continue;
            }
            let kind = entry.file_type().map_err(|e| Error::io(&path, e))?;
            let link = kind.is_symlink();
            if !(kind.is_file() || (link && path.is_file())) {
                continue;
            }
            if let (Some(dir), true) = (&dir, link) {
                // The directory was allowed; a frame that links elsewhere is not.
                let real = path.canonicalize();
                if !matches!(&real, Ok(r) if r.starts_with(dir)) {
                    return Err(Error::Input {
                        what: what(&name),
                        message: format!(
                            "frame {} is a link to a file outside the directory",
                            file_name.to_string_lossy()
                        ),
                    });
                }
            }
            files.push(entry.path());
            if files.len() > limits.max_source_frames {
                return Err(Error::Limit {
                    what: what(&name),
                    message: format!("more than {} frame files", limits.max_source_frames),
                    kind: LimitKind::Fixed,
                });
            }
        }
        files.sort_by(|a, b| natural_cmp(&a.to_string_lossy(), &b.to_string_lossy()));
        let Some(first) = files.first() else {
            return Err(Error::Input {
                what: what(&name),
                message: format!("no frame images ({}) in the directory", FRAME_EXTENSIONS.join(", ")),
            });
        };
        let limits_img =
            limits::ImageLimits { max_file_bytes: limits.max_file_bytes, max_pixels: limits.max_frame_pixels };
        let head = ImageFile::open(first, &limits_img)?;
        let info = VideoInfo { width: head.width, height: head.height, frames: files.len(), fps, decoder: "frames" };
        Self::checked(name, Kind::Frames(files), info, limits)
    }

    fn animated(name: PathBuf, bytes: Vec<u8>, format: ImageFormat, limits: &VideoLimits) -> Result<Self> {
        let bad = |e: image::ImageError| Error::Input {
            what: what(&name),
            message: format!("cannot decode: {}", one_line(&e.to_string())),
        };
        let (width, height) = animation_size(&bytes, format).map_err(bad)?;
        if width as u64 * height as u64 > limits.max_frame_pixels || width > MAX_IMAGE_SIDE || height > MAX_IMAGE_SIDE {
            // `checked` refuses the canvas size before anything is decoded.
            let info = VideoInfo { width, height, frames: 1, fps: 1.0, decoder: "" };
            return Self::checked(name, Kind::Frames(vec![]), info, limits);
        }
        // Count the frames and their display time (one frame decoded at a time), within a bound on
        // the pixels decoded (a tiny file can describe a huge canvas many times over).
        let (mut frames, mut seconds) = (0usize, 0f64);
        let canvas = width as u64 * height as u64;
        let started = std::time::Instant::now();
        for frame in animation_frames(&bytes, format).map_err(bad)? {
            decode_time_check(&name, limits, started)?;
            if (frames as u64 + 1).saturating_mul(canvas) > limits.max_animation_pixels {
                return Err(Error::Limit {
                    what: what(&name),
                    message: format!(
                        "more than {frames} frames of {width}x{height}: over the limit of {} decoded pixels per animation",
                        limits.max_animation_pixels
                    ),
                    kind: LimitKind::Fixed,
                });
            }
            let frame = frame.map_err(bad)?;
            let (num, den) = frame.delay().numer_denom_ms();
            seconds += if den == 0 { 0.0 } else { num as f64 / den as f64 / 1000.0 };
            frames += 1;
            if frames > limits.max_source_frames {
                break;
            }
        }
        // No timing (all delays 0): 10 frames a second, as browsers show such GIFs.
        let fps = if seconds > 0.0 { frames as f64 / seconds } else { 10.0 };
        let decoder = match format {
            ImageFormat::Gif => "gif",
            ImageFormat::Png => "apng",
            _ => "webp",
        };
        let info = VideoInfo { width, height, frames, fps, decoder };
        Self::checked(name, Kind::Animated { bytes, format }, info, limits)
    }

    fn ffmpeg(
        name: PathBuf,
        file: PathBuf,
        temp: Option<tempfile::NamedTempFile>,
        limits: &VideoLimits,
    ) -> Result<Self> {
        let out = run_tool(
            &name,
            input_guard(&mut Command::new("ffprobe"))
                .args(["-v", "error", "-select_streams", "v:0", "-count_packets", "-show_entries"])
                .arg("stream=width,height,avg_frame_rate,r_frame_rate,nb_read_packets:stream_side_data=rotation:stream_tags=rotate")
                .args(["-of", "json"])
                .arg(&file),
            limits.max_decode_time,
        )?;
        let json: serde_json::Value = serde_json::from_slice(&out).map_err(|e| Error::Input {
            what: what(&name),
            message: format!("ffprobe printed no readable JSON: {e}"),
        })?;
        let Some(stream) = json.get("streams").and_then(|s| s.get(0)) else {
            return Err(Error::Input { what: what(&name), message: "no video stream".into() });
        };
        let dim = |k: &str| stream.get(k).and_then(|v| v.as_u64()).unwrap_or(0).min(u32::MAX as u64) as u32;
        let text = |k: &str| stream.get(k).and_then(|v| v.as_str()).unwrap_or("").to_string();
        let frames = text("nb_read_packets").parse::<usize>().unwrap_or(0);
        let fps =
            parse_rate(&text("avg_frame_rate")).or_else(|| parse_rate(&text("r_frame_rate"))).ok_or_else(|| {
                Error::Input {
                    what: what(&name),
                    message: format!(
                        "no usable frame rate (avg_frame_rate {:?}, r_frame_rate {:?})",
                        text("avg_frame_rate"),
                        text("r_frame_rate")
                    ),
                }
            })?;
        // Frames are turned upright by the stream's display rotation (phone videos), to the
        // nearest quarter turn, by our own filter: ffmpeg's autorotation rotates an angle just
        // off a quarter (90.9) by that angle without swapping the sides, so the two would disagree.
        let side_rotation = stream
            .get("side_data_list")
            .and_then(|l| l.as_array())
            .and_then(|l| l.iter().find_map(|d| d.get("rotation").and_then(|r| r.as_f64())));
        let tag_rotation =
            stream.get("tags").and_then(|t| t.get("rotate")).and_then(|r| r.as_str()?.parse::<f64>().ok());
        let turns = quarter_turns(side_rotation, tag_rotation);
        let (width, height) =
            if turns % 2 == 1 { (dim("height"), dim("width")) } else { (dim("width"), dim("height")) };
        let info = VideoInfo { width, height, frames, fps, decoder: "ffmpeg" };
        Self::checked(name, Kind::Ffmpeg { file, _temp: temp, turns }, info, limits)
    }

    /// Streams the selected frames out of ffmpeg as raw RGB, one frame in memory at a time.
    /// `-fps_mode passthrough` (ffmpeg 5.1 and later) keeps ffmpeg from duplicating frames into
    /// the gaps the selection leaves; an ffmpeg without it (4.x) is asked with `-vsync 0`, the
    /// spelling ffmpeg 9 removed.
    fn ffmpeg_frames(
        &self,
        file: &Path,
        turns: u8,
        indices: &[usize],
        give: &mut dyn FnMut(RgbImage) -> Result<()>,
    ) -> Result<()> {
        if indices.is_empty() {
            return Ok(());
        }
        let (mut got, mut ok, mut stderr) =
            self.run_ffmpeg(file, turns, indices, &["-fps_mode", "passthrough"], give)?;
        if got == 0 && !ok && String::from_utf8_lossy(&stderr).contains("fps_mode") {
            (got, ok, stderr) = self.run_ffmpeg(file, turns, indices, &["-vsync", "0"], give)?;
        }
        if got == 0 && !ok {
            return Err(self.input(format!("ffmpeg cannot decode it: {}", last_line(&stderr))));
        }
        Ok(())
    }

    /// One ffmpeg run: (frames handed out, whether ffmpeg succeeded, the start of its stderr).
    fn run_ffmpeg(
        &self,
        file: &Path,
        turns: u8,
        indices: &[usize],
        sync: &[&str],
        give: &mut dyn FnMut(RgbImage) -> Result<()>,
    ) -> Result<(usize, bool, Vec<u8>)> {
        // Only the sampled frames leave the filter graph (all are decoded; none are converted
        // or piped besides those), then turned upright.
        let upright = match turns {
            1 => ",transpose=clock",
            2 => ",hflip,vflip",
            3 => ",transpose=cclock",
            _ => "",
        };
        let mut child = input_guard(Command::new("ffmpeg").args(["-nostdin", "-v", "error", "-noautorotate"]))
            .arg("-i")
            .arg(file)
            .args(["-map", "0:v:0", "-vf"])
            .arg(format!("select={}{upright}", select_expr(indices)))
            .args(sync)
            .args(["-f", "rawvideo", "-pix_fmt", "rgb24", "pipe:1"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| spawn_error(&self.name, "ffmpeg", e))?;
        // stderr drained on its own thread (a chatty decoder must not block the pipe); its start kept.
        let mut stderr = child.stderr.take().expect("piped");
        let errors = std::thread::spawn(move || {
            let mut buf = Vec::new();
            let _ = (&mut stderr).take(1 << 20).read_to_end(&mut buf);
            let _ = std::io::copy(&mut stderr, &mut std::io::sink());
            buf
        });
        // A watchdog kills ffmpeg past the time limit (its stdout then ends).
        let watchdog = limits::Watchdog::start(&child, self.limits.max_decode_time);
        let mut stdout = child.stdout.take().expect("piped");
        let (w, h) = (self.info.width, self.info.height);
        let size = w as usize * h as usize * 3;
        let mut result = Ok(());
        let mut got = 0;
        while got < indices.len() {
            let mut buf = vec![0u8; size];
            match read_full(&mut stdout, &mut buf) {
                Ok(n) if n == size => {}
                Ok(0) => break,
                Ok(n) => {
                    result = Err(self.input(format!(
                        "ffmpeg ended inside frame {} ({n} of {size} bytes): truncated, or frames of changing size",
                        indices[got]
                    )));
                    break;
                }
                Err(e) => {
                    result = Err(Error::io(&self.name, e));
                    break;
                }
            }
            if let Err(e) = give(RgbImage::from_raw(w, h, buf).expect("sized")) {
                result = Err(e);
                break;
            }
            got += 1;
        }
        drop(stdout);
        let timed_out = watchdog.stop();
        let _ = child.kill();
        let status = child.wait().map_err(|e| Error::io(&self.name, e))?;
        let stderr = errors.join().unwrap_or_default();
        if timed_out {
            return Err(Error::Limit {
                what: what(&self.name),
                message: format!(
                    "decoding took longer than the limit of {} s",
                    self.limits.max_decode_time.unwrap_or_default().as_secs_f64()
                ),
                kind: LimitKind::DecodeTime,
            });
        }
        result?;
        Ok((got, status.success(), stderr))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frames(dir: &Path, sizes: &[(u32, u32)]) {
        for (i, &(w, h)) in sizes.iter().enumerate() {
            RgbImage::from_fn(w, h, |x, y| image::Rgb([x as u8, y as u8, i as u8]))
                .save(dir.join(format!("{i:02}.png")))
                .unwrap();
        }
    }

    #[test]
    fn frame_directories_are_bounded_and_checked() {
        let dir = tempfile::tempdir().unwrap();
        frames(dir.path(), &[(8, 6); 5]);
        std::fs::write(dir.path().join(".hidden"), b"x").unwrap();
        let src = VideoSource::open(dir.path(), 4.0, &VideoLimits::default()).unwrap();
        assert_eq!(src.info(), &VideoInfo { width: 8, height: 6, frames: 5, fps: 4.0, decoder: "frames" });
        let mut seen = vec![];
        src.read_frames(&[0, 2, 4], &mut |k, f| {
            seen.push((k, f.get_pixel(0, 0)[2]));
            Ok(())
        })
        .unwrap();
        assert_eq!(seen, vec![(0, 0), (1, 2), (2, 4)]);
        assert!(src.read_frames(&[3, 1], &mut |_, _| Ok(())).is_err(), "indices must ascend");
        // More frames than the limit: refused at the probe.
        let few = VideoLimits { max_source_frames: 3, ..Default::default() };
        let e = VideoSource::open(dir.path(), 4.0, &few).unwrap_err().to_string();
        assert!(e.contains("more than 3 frame files"), "{e}");
        // Frames over the per-frame pixel limit: refused from the first frame's header.
        let small = VideoLimits { max_frame_pixels: 40, ..Default::default() };
        let e = VideoSource::open(dir.path(), 4.0, &small).unwrap_err().to_string();
        assert!(e.contains("48 pixels") || e.contains("40 pixels"), "{e}");
        // A frame of another size, when it is sampled.
        frames(dir.path(), &[(8, 6), (8, 6), (6, 8)]);
        let src = VideoSource::open(dir.path(), 4.0, &VideoLimits::default()).unwrap();
        let e = src.read_frames(&[0, 2], &mut |_, _| Ok(())).unwrap_err().to_string();
        assert!(e.contains("02.png is 6x8, the first frame 8x6"), "{e}");
    }

    #[test]
    fn animated_gifs_are_clips_at_their_frame_delays() {
        let mut bytes = Vec::new();
        {
            let mut enc = image::codecs::gif::GifEncoder::new(&mut bytes);
            for i in 0..6u8 {
                let img = image::RgbaImage::from_fn(10, 8, |x, _| image::Rgba([x as u8 * 20, i * 40, 0, 255]));
                let delay = image::Delay::from_numer_denom_ms(250, 1);
                enc.encode_frame(image::Frame::from_parts(img, 0, 0, delay)).unwrap();
            }
        }
        let src = VideoSource::from_bytes(bytes, Path::new("anim.gif"), &VideoLimits::default()).unwrap();
        // 6 frames of 250 ms: 4 frames a second.
        assert_eq!(src.info(), &VideoInfo { width: 10, height: 8, frames: 6, fps: 4.0, decoder: "gif" });
        let mut green = vec![];
        src.read_frames(&[1, 5], &mut |_, f| {
            green.push(f.get_pixel(0, 0)[1]);
            Ok(())
        })
        .unwrap();
        assert_eq!(green, vec![40, 200]);
    }

    #[test]
    fn frame_files_sort_by_their_numbers() {
        let mut names = vec!["f10.png", "f2.png", "f1.png", "f002.png", "g.png", "f11.png"];
        names.sort_by(|a, b| natural_cmp(a, b));
        assert_eq!(names, vec!["f1.png", "f2.png", "f002.png", "f10.png", "f11.png", "g.png"]);
    }

    #[test]
    fn huge_animations_are_refused_while_counting() {
        let mut bytes = Vec::new();
        {
            let mut enc = image::codecs::gif::GifEncoder::new(&mut bytes);
            for _ in 0..3 {
                let img = image::RgbaImage::from_pixel(1, 1, image::Rgba([9, 9, 9, 255]));
                enc.encode_frame(image::Frame::new(img)).unwrap();
            }
        }
        // A 1000 x 1000 logical screen holding 1-pixel frames, 2.5 canvases allowed.
        bytes[6..10].copy_from_slice(&[0xe8, 0x03, 0xe8, 0x03]);
        let limits = VideoLimits { max_animation_pixels: 2_500_000, ..Default::default() };
        let e = VideoSource::from_bytes(bytes, Path::new("wide.gif"), &limits).unwrap_err().to_string();
        assert!(e.contains("more than 2 frames of 1000x1000") && e.contains("wide.gif"), "{e}");
    }

    #[test]
    fn rates_parse_as_ffprobe_prints_them() {
        assert_eq!(parse_rate("30000/1001"), Some(30000.0 / 1001.0));
        assert_eq!(parse_rate("15/1"), Some(15.0));
        assert_eq!(parse_rate("0/0"), None);
        assert_eq!(parse_rate("-5/1"), None);
        assert_eq!(parse_rate("abc"), None);
        assert!(check_fps(0.0).is_err() && check_fps(f64::NAN).is_err() && check_fps(1001.0).is_err());
        assert!(check_fps(29.97).is_ok());
    }
}

/// Per-call overrides of a video processor's config (the reference's call kwargs).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct VideoOptions {
    pub fps: Option<f64>,
    pub max_frames: Option<usize>,
    pub min_pixels: Option<usize>,
    pub max_pixels: Option<usize>,
    pub cap_pixels_per_frame: Option<bool>,
}

/// What sampling and resizing make of a clip, known before any frame is decoded.
#[derive(Debug, Clone, PartialEq)]
pub struct VideoPlan {
    /// Source frames sampled, ascending.
    pub indices: Vec<usize>,
    /// (height, width) of every frame after resizing.
    pub resized: (usize, usize),
    /// [frame pairs, patch rows, patch cols].
    pub grid: crate::media::Grid,
    /// Seconds of each frame pair (the mean of its frames' times).
    pub timestamps: Vec<f64>,
}
