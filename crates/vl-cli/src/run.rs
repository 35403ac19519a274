//! `vl run`: load a checkpoint, preprocess images, render the chat prompt, generate with
//! streaming output, and report timings.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};
use clap::{Args, ValueEnum};
use vl_models::checkpoint::LoadProgress;
use vl_models::checkpoint::{encode_safetensors, RawTensor};
use vl_models::engine::{ChatMessage, Engine, EngineOptions, Finish, ModelOptions, Part, Request, VideoData};
use vl_models::family::Family;
use vl_models::limits::ImageLimits;
use vl_models::limits::LimitKind;
use vl_models::sampling::GenerationOptions;
use vl_nn::QuantType;

use crate::note;

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum DeviceArg {
    /// The CPU (every build; its own kernels for x86-64 AVX2 / AVX-512 and Arm).
    Cpu,
    /// Apple's GPU (a build with `--features metal`).
    Metal,
    /// An NVIDIA GPU, the first one (a build with `--features cuda`).
    Cuda,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum DtypeArg {
    /// 32-bit floats (the CPU default; the reference's numbers).
    F32,
    /// bfloat16 (the GPU default; slow on most CPUs).
    Bf16,
    /// IEEE half precision.
    F16,
}

/// Precision of the vision tower's linear layers on the CPU.
#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum VisionPrecisionArg {
    /// f32 products: the reference's numbers (vision features within 1e-4 of the goldens).
    F32,
    /// bf16 products with f32 sums on AMX tiles (Intel Xeon since Sapphire Rapids, Linux): the
    /// linears and (head dimension 64) the attention's products; ~2.5x faster products,
    /// features within the bound in docs/parity.md. Refused elsewhere.
    Bf16,
}

#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum QuantArg {
    /// Keep the stored weights: a float checkpoint stays in floats (MLX-quantized checkpoints are
    /// requantized to the nearest k-quant; GGUF blocks stay as stored).
    None,
    /// 4.5 bits a weight (Q4_K blocks of 256): the fastest, the CPU default.
    Q4k,
    /// 5.5 bits a weight (Q5_K blocks of 256).
    Q5k,
    /// 6.6 bits a weight (Q6_K blocks of 256): closest to full precision of the k-quants.
    Q6k,
    /// 8.5 bits a weight (Q8_0 blocks of 32).
    Q8,
    /// Full precision: everything in the compute dtype, MLX weights dequantized exactly (no
    /// quantized matmuls; what the parity tests run).
    Off,
}

/// How to find and load a model: the flags `run`, `serve` and `chat` share.
#[derive(Debug, Args)]
pub struct LoadArgs {
    /// A local model directory, a Hugging Face hub id (from the local cache, downloaded when
    /// absent), or GGUF weights (a .gguf text model, or a directory holding one).
    #[arg(long, default_value = "Qwen/Qwen3-VL-2B-Instruct")]
    pub model: String,
    /// The GGUF vision projector (mmproj) for a GGUF text model; default: the `mmproj*.gguf`
    /// beside it. Without one, a GGUF model answers text only.
    #[arg(long)]
    pub mmproj: Option<PathBuf>,
    /// Compute dtype (default: f32 on CPU, bf16 on GPUs).
    #[arg(long, value_enum)]
    pub dtype: Option<DtypeArg>,
    /// Where to compute: cpu, or a GPU (metal, cuda: a build with that cargo feature).
    #[arg(long, value_enum, default_value = "cpu")]
    pub device: DeviceArg,
    /// Precision of the vision tower's products (CPU, f32 compute): f32, or bf16 on AMX tiles
    /// (faster images, reduced precision; docs/parity.md has its bound).
    #[arg(long, value_enum, default_value = "f32")]
    pub vision_precision: VisionPrecisionArg,
    /// Quantize the text decoder's linears, embeddings and lm_head at load (CPU decoding speed).
    /// Default on CPU: q4k for a float checkpoint, the stored quantization for GGUF and MLX ones;
    /// on GPUs: none. `off` for full precision.
    #[arg(long, value_enum)]
    pub quantize: Option<QuantArg>,
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
    /// Largest image file read, in bytes (checked before reading).
    #[arg(long, default_value_t = ImageLimits::default().max_file_bytes)]
    pub max_image_bytes: u64,
    /// Largest decoded image, in pixels (width x height, checked from the header before decoding).
    #[arg(long, default_value_t = ImageLimits::default().max_pixels)]
    pub max_image_pixels: u64,
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

impl LoadArgs {
    /// Whether `--vision-precision bf16` was asked for.
    pub fn vision_bf16(&self) -> bool {
        self.vision_precision == VisionPrecisionArg::Bf16
    }

    pub fn image_limits(&self) -> ImageLimits {
        ImageLimits { max_file_bytes: self.max_image_bytes, max_pixels: self.max_image_pixels }
    }

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

#[derive(Debug, Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub(crate) load: LoadArgs,
    /// An image file (PNG, JPEG, WebP, GIF, BMP); repeat for several, in prompt order.
    #[arg(long = "image")]
    images: Vec<PathBuf>,
    /// A video: a file (mp4, mkv, webm, mov, avi, ...: decoded by ffmpeg on PATH), an animated
    /// GIF/PNG/WebP, or a directory of frame images (name order, at --video-fps); repeat for
    /// several. Images and videos enter the prompt in the order given.
    #[arg(long = "video")]
    videos: Vec<PathBuf>,
    /// The user's message (default: "Describe this image." / "Describe this video.").
    #[arg(long)]
    prompt: Option<String>,
    /// An optional system message.
    #[arg(long)]
    system: Option<String>,
    /// Tokens generated at most (the answer stops earlier at an end-of-turn token).
    #[arg(long, default_value_t = 256)]
    max_new_tokens: usize,
    /// Sampling temperature; 0 (the default) is greedy decoding.
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    /// Keep the k most likely tokens (0 = off).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Nucleus sampling mass (1 = off).
    #[arg(long, default_value_t = 1.0)]
    top_p: f64,
    /// Drop tokens below min_p times the top probability (0 = off).
    #[arg(long, default_value_t = 0.0)]
    min_p: f64,
    /// Penalize tokens already seen (1 = off).
    #[arg(long, default_value_t = 1.0)]
    repetition_penalty: f64,
    /// Seed of the sampler's random numbers (with --temperature above 0): the same seed, the
    /// same answer.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Print one JSON object (text, token ids, counts, timings) instead of streaming.
    #[arg(long)]
    json: bool,
    /// Constrain the answer to JSON valid against the JSON schema in FILE (structured output:
    /// the answer always parses and validates).
    #[arg(long, value_name = "FILE", conflicts_with = "json_object")]
    json_schema: Option<PathBuf>,
    /// Constrain the answer to a JSON object (any keys).
    #[arg(long)]
    json_object: bool,
    /// Write the f32 logits of the first generated position to this safetensors file (key "logits").
    #[arg(long)]
    logits_out: Option<PathBuf>,
    /// Whether this is a grounding prompt (boxes or points): its images are then sized to at
    /// least the model's grounding minimum (Qwen3-VL: 1024 visual tokens, within
    /// --max-image-tokens) and the answer's shapes are reported. `auto`: when the prompt says
    /// bbox, bounding box, point_2d, grounding or coordinates, or --draw-boxes is given.
    #[arg(long, value_enum, default_value = "auto")]
    grounding: Grounding,
    /// Draw the answer's boxes and points (with labels, in distinct colours) on the first image,
    /// at the image's own size, into this PNG file; stderr says how many were drawn. Checked
    /// before any work: never an input file, a directory or in a missing directory; an existing
    /// file only with --force.
    #[arg(long, value_name = "OUT.png")]
    draw_boxes: Option<PathBuf>,
    /// Replace an existing --draw-boxes file (without it, an existing file is refused before the
    /// model is loaded). An input file is never replaced.
    #[arg(long)]
    force: bool,
    #[command(flatten)]
    reasoning: crate::reasoning::ReasoningArgs,
}

#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum Grounding {
    /// When the prompt or schema asks for boxes or points, or --draw-boxes is given.
    Auto,
    /// Always a grounding request.
    On,
    /// Never (images at the plain budget, no shapes reported).
    Off,
}

/// The PNG `--draw-boxes` names, checked before any work (`check_output`); written at the end
/// to a temporary file beside it, then renamed over it (never a half-written image; the
/// temporary file is removed on any error, and no message names it).
struct BoxesOut {
    path: PathBuf,
    force: bool,
}

/// The directory a file `path` goes in.
fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    }
}

/// An io error without the path tempfile adds to it (the temporary file's name).
fn plain(e: std::io::Error) -> std::io::Error {
    std::io::Error::from(e.kind())
}

/// Whether `a` and `b` are one file: the same canonical path, or the same device and inode (a
/// hard link, or a symbolic link to it).
fn same_file(a: &Path, b: &Path) -> bool {
    if let (Ok(x), Ok(y)) = (std::fs::canonicalize(a), std::fs::canonicalize(b)) {
        if x == y {
            return true;
        }
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        if let (Ok(x), Ok(y)) = (std::fs::metadata(a), std::fs::metadata(b)) {
            return x.dev() == y.dev() && x.ino() == y.ino();
        }
    }
    false
}

/// Refuses (one line naming `flag` and `path`) an output file that is one of `inputs` (what,
/// path): an existing `path` that is the same file as an input.
fn check_not_input(flag: &str, path: &Path, inputs: &[(&str, &Path)]) -> Result<()> {
    // A link (even a dangling one) counts as there.
    if std::fs::symlink_metadata(path).is_ok() {
        if let Some((what, p)) = inputs.iter().find(|(_, p)| same_file(path, p)) {
            bail!(
                "{flag} {}: is the input {what} {}; name another file (an input is never replaced)",
                path.display(),
                p.display()
            );
        }
    }
    Ok(())
}

/// Checks the file an output flag names before any work, each refusal one line naming `flag`
/// and `path`: not a directory, in an existing directory, not one of `inputs` (what, path),
/// unless `force` not an existing file, and a file can be created beside it (a probe, removed).
fn check_output(flag: &str, path: &Path, inputs: &[(&str, &Path)], force: bool) -> Result<()> {
    let shown = path.display();
    if path.is_dir() {
        bail!("{flag} {shown}: is a directory; name a file");
    }
    let dir = parent_dir(path);
    if !dir.is_dir() {
        let why = if dir.exists() { "is not a directory" } else { "does not exist" };
        bail!("{flag} {shown}: cannot create it: the directory {} {why}", dir.display());
    }
    check_not_input(flag, path, inputs)?;
    if !force && std::fs::symlink_metadata(path).is_ok() {
        bail!("{flag} {shown}: exists; pass --force to replace it");
    }
    tempfile::Builder::new()
        .prefix(".vl-out-")
        .tempfile_in(dir)
        .map_err(|e| anyhow::anyhow!("{flag} {shown}: cannot create a file in {}: {}", dir.display(), plain(e)))?;
    Ok(())
}

impl BoxesOut {
    fn create(path: &Path, inputs: &[(&str, &Path)], force: bool) -> Result<Self> {
        check_output("--draw-boxes", path, inputs, force)?;
        let ext = path.extension().and_then(|e| e.to_str()).map(str::to_ascii_lowercase);
        if ext.as_deref() != Some("png") {
            bail!("--draw-boxes {}: the drawing is written as PNG; name a .png file", path.display());
        }
        Ok(Self { path: path.to_path_buf(), force })
    }

    /// Draws `text`'s shapes on the image `data` (decoded as the engine decodes it) and writes
    /// the PNG; returns the number drawn and the parser's notes.
    fn write(
        self,
        g: vl_models::grounding::Grounding,
        data: &[u8],
        name: &Path,
        limits: &ImageLimits,
        text: &str,
        resized: (usize, usize),
    ) -> Result<usize> {
        use vl_models::grounding::{draw, parse, to_pixels};
        let file = vl_models::image_file::ImageFile::from_bytes(data.to_vec(), name, limits)?;
        let mut img = file.decode()?;
        let parsed = parse(text, g.coords);
        for n in &parsed.notes {
            note!("note: --draw-boxes: {n}");
        }
        let shapes = to_pixels(&parsed.shapes, g.coords, img.width() as usize, img.height() as usize, resized);
        draw(&mut img, &shapes);
        let shown = self.path.display();
        let dir = parent_dir(&self.path);
        // Dropped (and so removed) on every error below.
        let tmp = tempfile::Builder::new().prefix(".vl-boxes-").suffix(".png").tempfile_in(dir).map_err(|e| {
            anyhow::anyhow!("--draw-boxes {shown}: cannot create a file in {}: {}", dir.display(), plain(e))
        })?;
        let mut w = std::io::BufWriter::new(tmp.as_file());
        img.write_to(&mut w, image::ImageFormat::Png)
            .map_err(|e| anyhow::anyhow!("--draw-boxes {shown}: cannot write: {e}"))?;
        w.flush()
            .and_then(|_| tmp.as_file().sync_all())
            .map_err(|e| anyhow::anyhow!("--draw-boxes {shown}: cannot write: {}", plain(e)))?;
        drop(w);
        // Without --force, a file that appeared meanwhile is not replaced either.
        let persisted = if self.force { tmp.persist(&self.path) } else { tmp.persist_noclobber(&self.path) };
        persisted.map_err(|e| match e.error.kind() {
            std::io::ErrorKind::AlreadyExists if !self.force => {
                anyhow::anyhow!("--draw-boxes {shown}: exists; pass --force to replace it")
            }
            _ => anyhow::anyhow!("--draw-boxes {shown}: cannot write: {}", plain(e.error)),
        })?;
        Ok(shapes.len())
    }
}

pub(crate) fn device(arg: DeviceArg) -> Result<Device> {
    match arg {
        DeviceArg::Cpu => Ok(Device::Cpu),
        DeviceArg::Cuda if !candle_core::utils::cuda_is_available() => {
            bail!("--device cuda: this build has no CUDA support; rebuild with `--features cuda`")
        }
        DeviceArg::Metal if !candle_core::utils::metal_is_available() => {
            bail!("--device metal: this build has no Metal support; rebuild with `--features metal` on macOS")
        }
        DeviceArg::Cuda => Ok(Device::new_cuda(0).context("--device cuda")?),
        DeviceArg::Metal => Ok(Device::new_metal(0).context("--device metal")?),
    }
}

pub(crate) fn dtype(arg: Option<DtypeArg>, dev: &Device) -> DType {
    match arg {
        Some(DtypeArg::F32) => DType::F32,
        Some(DtypeArg::Bf16) => DType::BF16,
        Some(DtypeArg::F16) => DType::F16,
        // f32 on CPU, bf16 on GPUs.
        None => vl_nn::dispatch::default_dtype(vl_nn::dispatch::DeviceKind::of(dev)),
    }
}

/// How the text decoder's quantization was chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum QuantSource {
    /// `--quantize` was given.
    Flag,
    /// Not given: the checkpoint's own (an MLX-quantized one's nearest k-quant; GGUF blocks as
    /// stored), or none on a GPU.
    Checkpoint,
    /// Not given, on the CPU, for a float checkpoint: the fast default, q4k.
    CpuDefault,
}

/// The text decoder's quantization for the model at `path`, and how it was chosen.
/// `--quantize` given: that one (`none`: the checkpoint's own, for an MLX-quantized checkpoint
/// its nearest k-quant; `off`: none). Not given: on the CPU in f32, q4k unless the checkpoint is
/// already quantized (GGUF, MLX); elsewhere the checkpoint's own.
pub(crate) fn quant_choice(load: &LoadArgs, path: &Path, dtype: DType) -> Result<(Option<QuantType>, QuantSource)> {
    let explicit = match load.quantize {
        Some(QuantArg::Q4k) => Some(QuantType::Q4K),
        Some(QuantArg::Q5k) => Some(QuantType::Q5K),
        Some(QuantArg::Q6k) => Some(QuantType::Q6K),
        Some(QuantArg::Q8) => Some(QuantType::Q8_0),
        Some(QuantArg::Off) => None,
        Some(QuantArg::None) => vl_models::registry::default_quant(path)?,
        None => {
            let stored = vl_models::registry::default_quant(path)?;
            let cpu = matches!(load.device, DeviceArg::Cpu) && dtype == DType::F32;
            if stored.is_none() && cpu && !vl_models::gguf::is_gguf(path) {
                return Ok((Some(QuantType::Q4K), QuantSource::CpuDefault));
            }
            return Ok((stored, QuantSource::Checkpoint));
        }
    };
    Ok((explicit, QuantSource::Flag))
}

/// What the text decoder ran in, as the stats line and `--json`'s `quantized` say it: `applied`
/// the quantization some tensor got, `quant` the one chosen (`source`), `off` for `--quantize off`.
pub(crate) fn quantized_report(
    applied: Option<QuantType>,
    quant: Option<QuantType>,
    source: QuantSource,
    off: bool,
) -> String {
    match (applied, quant, source) {
        (Some(q), _, QuantSource::CpuDefault) => format!("{} (default; --quantize off for full precision)", q.name()),
        (None, Some(q), QuantSource::CpuDefault) => {
            format!(
                "none (the default {} fits no tensor: input dimensions are not multiples of {})",
                q.name(),
                q.block()
            )
        }
        (Some(q), _, _) => q.name().to_string(),
        (None, _, _) if off => "off".to_string(),
        (None, _, _) => "none".to_string(),
    }
}

/// `quant_choice` for `vl serve` and `vl chat`, the CPU default said on stderr.
pub(crate) fn quant_of(load: &LoadArgs, path: &Path, dtype: DType) -> Result<Option<QuantType>> {
    let (quant, source) = quant_choice(load, path, dtype)?;
    if source == QuantSource::CpuDefault {
        note!("quantized: q4k (the CPU default; --quantize off for full precision)");
    }
    Ok(quant)
}

/// The JSON schema in `path` (within `MAX_SCHEMA_BYTES`).
fn read_schema(path: &Path) -> Result<serde_json::Value> {
    let max = vl_models::constraint::MAX_SCHEMA_BYTES as u64;
    let text = vl_models::limits::read_text(path, max).map_err(|e| anyhow::anyhow!("--json-schema {e}"))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| anyhow::anyhow!("--json-schema {}: not JSON: {e}", path.display()))?;
    if !v.is_object() && !v.is_boolean() {
        bail!("--json-schema {}: a JSON schema is an object", path.display());
    }
    Ok(v)
}

/// Peak resident set size of this process, where the OS reports it.
fn peak_rss() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb: u64 = s.lines().find(|l| l.starts_with("VmHWM:"))?.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// The file `--logits-out` names, created before any work so that an unwritable path fails
/// first; removed again if the run fails.
struct LogitsOut {
    path: PathBuf,
    file: Option<std::fs::File>,
}

impl LogitsOut {
    fn create(path: &std::path::Path) -> Result<Self> {
        let file = std::fs::File::create(path)
            .with_context(|| format!("--logits-out {}: cannot create the file", path.display()))?;
        Ok(Self { path: path.to_path_buf(), file: Some(file) })
    }

    fn write(mut self, logits: &[f32]) -> Result<()> {
        let bytes: Vec<u8> = logits.iter().flat_map(|x| x.to_le_bytes()).collect();
        let t = [RawTensor {
            name: "logits".into(),
            dtype: safetensors::Dtype::F32,
            shape: vec![logits.len()],
            data: &bytes,
        }];
        let encoded = encode_safetensors(&self.path, &t)?;
        let mut file = self.file.take().expect("written once");
        file.write_all(&encoded)
            .and_then(|_| file.sync_all())
            .with_context(|| format!("--logits-out {}: cannot write", self.path.display()))
    }
}

impl Drop for LogitsOut {
    fn drop(&mut self) {
        if self.file.take().is_some() {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// The progress bar of `vl run` on a terminal: one line, the stage, its units done and to do.
struct Bar {
    bar: indicatif::ProgressBar,
    stage: Mutex<&'static str>,
    loaded: AtomicU64,
    to_load: AtomicU64,
}

impl Bar {
    fn new() -> Self {
        let bar = indicatif::ProgressBar::new(0);
        bar.set_style(
            indicatif::ProgressStyle::with_template("{msg:>14} {bar:40} {pos}/{len} {prefix}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        Bar { bar, stage: Mutex::new(""), loaded: AtomicU64::new(0), to_load: AtomicU64::new(0) }
    }

    fn tensor_loaded(&self) {
        let done = self.loaded.fetch_add(1, Ordering::Relaxed) + 1;
        let total = self.to_load.load(Ordering::Relaxed).max(done);
        vl_models::progress::Observer::report(self, "loading", "tensors", done, total);
    }
}

impl vl_models::progress::Observer for Bar {
    fn report(&self, stage: &'static str, unit: &'static str, done: u64, total: u64) {
        let Ok(mut current) = self.stage.lock() else { return };
        if *current != stage {
            *current = stage;
            self.bar.set_message(stage);
            self.bar.set_prefix(unit);
        }
        self.bar.set_length(total);
        self.bar.set_position(done);
    }
}

/// A media path named by the user exists: one line naming it (and a broken link as one).
pub(crate) fn check_media(kind: &str, path: &Path) -> Result<()> {
    if let Some(target) = vl_models::error::broken_link(path) {
        bail!("{kind} {}: broken symbolic link to {}", path.display(), target.display());
    }
    if !path.exists() {
        bail!("{kind} {}: no such file or directory", path.display());
    }
    Ok(())
}

/// Whether each media flag was an image or a video, in command-line order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Media {
    Image,
    Video,
}

/// The order of `--image` and `--video` on the command line (images first when unknown).
pub fn media_order(m: Option<&clap::ArgMatches>) -> Vec<Media> {
    let Some(m) = m else { return vec![] };
    let at = |id: &str| m.indices_of(id).map(|i| i.collect::<Vec<_>>()).unwrap_or_default();
    let mut all: Vec<(usize, Media)> = at("images").into_iter().map(|i| (i, Media::Image)).collect();
    all.extend(at("videos").into_iter().map(|i| (i, Media::Video)));
    all.sort_unstable_by_key(|&(i, _)| i);
    all.into_iter().map(|(_, k)| k).collect()
}

pub fn run(args: RunArgs, order: Vec<Media>) -> Result<()> {
    let t_start = Instant::now();
    // Flags first: a typo costs nothing.
    let options = GenerationOptions {
        max_new_tokens: args.max_new_tokens,
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: args.min_p,
        repetition_penalty: args.repetition_penalty,
        seed: args.seed,
        ..Default::default()
    };
    options.validate().map_err(|e| anyhow::anyhow!("--{}", e.to_string().replace('_', "-")))?;
    let constraint = match (&args.json_schema, args.json_object) {
        (Some(path), _) => Some(vl_models::engine::Constraint::JsonSchema(read_schema(path)?)),
        (None, true) => Some(vl_models::engine::Constraint::JsonObject),
        (None, false) => None,
    };
    let video = args.load.video_options()?;
    // Media files exist before the model is resolved (or downloaded).
    for p in &args.images {
        check_media("image", p)?;
    }
    for p in &args.videos {
        check_media("video", p)?;
    }
    // Output files before the model is resolved (or downloaded) and loaded: never an input.
    let mut inputs: Vec<(&str, &Path)> = args.images.iter().map(|p| ("--image", p.as_path())).collect();
    inputs.extend(args.videos.iter().map(|p| ("--video", p.as_path())));
    inputs.extend(args.json_schema.iter().map(|p| ("--json-schema", p.as_path())));
    inputs.extend(args.load.mmproj.iter().map(|p| ("--mmproj", p.as_path())));
    inputs.push(("--model", Path::new(&args.load.model)));
    if let Some(p) = &args.logits_out {
        // Created (truncated) before the run: never over an input. An existing file is replaced.
        check_not_input("--logits-out", p, &inputs)?;
    }
    if args.draw_boxes.is_some() && args.images.is_empty() {
        bail!("--draw-boxes draws on the first --image; give one");
    }
    if let (Some(b), Some(l)) = (&args.draw_boxes, &args.logits_out) {
        if same_file(b, l) || b == l {
            bail!("--draw-boxes {}: is the --logits-out file too; name another file", b.display());
        }
    }
    let boxes_out = args.draw_boxes.as_deref().map(|p| BoxesOut::create(p, &inputs, args.force)).transpose()?;
    let dev = device(args.load.device)?;
    let dtype = dtype(args.load.dtype, &dev);
    let dir = crate::hub::resolve(&args.load.model)?;
    let logits_out = args.logits_out.as_deref().map(LogitsOut::create).transpose()?;
    let limits = args.load.image_limits();
    let gguf = vl_models::gguf::is_gguf(&dir);
    if !gguf && args.load.mmproj.is_some() {
        anyhow::bail!("--mmproj goes with a GGUF text model; {} is a checkpoint directory", dir.display());
    }
    let (quant, quant_source) = quant_choice(&args.load, &dir, dtype)?;
    let opts = EngineOptions {
        model: ModelOptions {
            dtype,
            device: dev,
            quant,
            vision_bf16: args.load.vision_bf16(),
            min_pixels: args.load.min_pixels,
            max_pixels: args.load.max_pixels,
            max_image_tokens: args.load.max_image_tokens(),
            image_limits: limits,
            video: video.0,
            video_pixel_cap: video.1,
            video_limits: Default::default(),
        },
        image_cache_bytes: usize::MAX,
        clip_cache_bytes: 0,
        prefix_cache: false,
        parallel: 1,
        kv_cache_bytes: vl_models::engine::default_kv_cache_bytes(),
        prefill_chunk: vl_models::engine::DEFAULT_PREFILL_CHUNK,
    };

    // A progress bar on a terminal (never in a pipe, nor with --json): the tensors loaded, then
    // each stage the engine reports (media, the vision tower's blocks, prefill).
    let bar = (std::io::stderr().is_terminal() && !args.json).then(|| Arc::new(Bar::new()));
    let _observer = bar.clone().map(|b| vl_models::progress::install(b as Arc<dyn vl_models::progress::Observer>));
    let progress_bar = bar.clone();
    let progress: LoadProgress = Arc::new(move |_key: &str| {
        if let Some(b) = &progress_bar {
            b.tensor_loaded();
        }
    });
    // The family opens in stages: every file of the model is checked and the pixel-budget flags
    // against its preprocessor, before a weight is read.
    let source =
        vl_models::family::Source { model: &dir, mmproj: args.load.mmproj.as_deref(), progress: Some(&progress) };
    let family = vl_models::registry::open_staged(&source, &opts.model).map_err(|e| match e {
        vl_models::Error::Input { ref what, .. }
            if ["min_pixels", "max_pixels", "max_image_tokens"].contains(&what.as_str()) =>
        {
            anyhow::anyhow!(
                "{}",
                e.to_string()
                    .replace("min_pixels", "--min-pixels")
                    .replace("max_pixels", "--max-pixels")
                    .replace("max_image_tokens", "--max-image-tokens")
            )
        }
        e => anyhow::Error::new(e),
    })?;
    if let Some(b) = &bar {
        b.to_load.store(family.tensors_to_load() as u64, Ordering::Relaxed);
    }

    // Image files within the byte limit; their headers, video probes and the prompt's length are
    // checked by the engine before a weight is read.
    let mut parts = Vec::with_capacity(args.images.len() + args.videos.len() + 1);
    let mut sizes = Vec::new();
    let order = if order.len() == args.images.len() + args.videos.len() {
        order
    } else {
        [vec![Media::Image; args.images.len()], vec![Media::Video; args.videos.len()]].concat()
    };
    let (mut images, mut videos) = (args.images.iter(), args.videos.iter());
    for kind in order {
        if kind == Media::Video {
            let p = videos.next().expect("counted");
            parts.push(Part::Video {
                source: VideoData::Path(p.clone()),
                name: p.display().to_string(),
                options: Default::default(),
            });
            continue;
        }
        let p = images.next().expect("counted");
        let data =
            vl_models::limits::read_bytes(p, limits.max_file_bytes, LimitKind::ImageBytes).map_err(|e| match e {
                vl_models::Error::Limit { message, kind, .. } => {
                    vl_models::Error::Limit { what: format!("image {}", p.display()), message, kind }
                }
                other => other,
            })?;
        sizes.push(image_size_report(p, &data, &*family, &args.load, &limits)?);
        parts.push(Part::Image { data, name: p.display().to_string(), min_pixels: None, max_pixels: None });
    }
    let default_prompt =
        if args.images.is_empty() && !args.videos.is_empty() { "Describe this video." } else { "Describe this image." };
    let prompt = args.prompt.clone().unwrap_or_else(|| default_prompt.into());
    let grounding = match args.grounding {
        Grounding::On => true,
        Grounding::Off => false,
        Grounding::Auto => {
            let schema = match &constraint {
                Some(vl_models::engine::Constraint::JsonSchema(s)) => s.to_string(),
                _ => String::new(),
            };
            boxes_out.is_some()
                || vl_models::grounding::looks_like_grounding(&prompt)
                || vl_models::grounding::looks_like_grounding(&schema)
        }
    };
    let grounding_spec = family.grounding().filter(|_| grounding);
    if boxes_out.is_some() && grounding_spec.is_none() {
        bail!("--draw-boxes: the {} family has no grounding convention (or --grounding off was given)", family.name());
    }
    if let Some(g) = grounding_spec {
        // The grounding minimum, unless --min-pixels says otherwise.
        for p in parts.iter_mut() {
            if let Part::Image { min_pixels: min @ None, .. } = p {
                if args.load.min_pixels.is_none() {
                    *min = Some(g.min_pixels);
                }
            }
        }
    }
    let first_image = args.images.first().cloned();
    let first_image_data = boxes_out.as_ref().and_then(|_| {
        parts.iter().find_map(|p| match p {
            Part::Image { data, .. } => Some(data.clone()),
            _ => None,
        })
    });
    parts.push(Part::Text(prompt));
    let mut messages = Vec::new();
    if let Some(s) = &args.system {
        messages.push(ChatMessage::text("system", s));
    }
    messages.push(ChatMessage::new("user", parts));
    let template_kwargs = args.reasoning.chat_template_kwargs.clone().unwrap_or_default();
    let req = Request { messages, options, constraint, template_kwargs, ..Default::default() };

    let mut printer = crate::reasoning::Printer::new(&args.reasoning, std::io::stdout().is_terminal());
    let mut stdout = std::io::stdout().lock();
    let mut write_err: Option<std::io::Error> = None;
    let mut started = false;
    let before_load = t_start.elapsed();
    let mut on_text = |d: &vl_models::engine::Delta<'_>| {
        if !started {
            started = true;
            if let Some(b) = &bar {
                b.bar.finish_and_clear();
            }
        }
        if args.json {
            return true;
        }
        if let Err(e) = printer.piece(&mut stdout, d.text, d.reasoning) {
            write_err = Some(e);
            return false;
        }
        true
    };
    let result = Engine::answer_once(family, opts, &req, &mut on_text);
    if let Some(b) = &bar {
        b.bar.finish_and_clear();
    }
    let shot = result.map_err(|e| match e {
        vl_models::Error::Limit {
            kind: vl_models::limits::LimitKind::Context | vl_models::limits::LimitKind::KvCache,
            message,
            ..
        } => {
            let mut hints = vec![];
            if !args.images.is_empty() {
                hints.push("lower --max-image-tokens (or --max-pixels)");
            }
            if !args.videos.is_empty() {
                hints.push("lower --video-max-pixels or --video-max-frames");
            }
            if hints.is_empty() {
                anyhow::anyhow!("{message}")
            } else {
                anyhow::anyhow!("{message}; {}", hints.join(", "))
            }
        }
        vl_models::Error::Input { what, message } if what == "response_format" => match &args.json_schema {
            Some(p) => anyhow::anyhow!("--json-schema {}: {message}", p.display()),
            None => anyhow::anyhow!("--json-object: {message}"),
        },
        e @ (vl_models::Error::Input { .. } | vl_models::Error::Limit { .. }) => anyhow::Error::new(e),
        other => anyhow::Error::new(other).context(format!("model {}", dir.display())),
    })?;
    if let Some(e) = write_err {
        return Err(e).context("writing to stdout");
    }
    let c = &shot.completion;
    let applied = quant.filter(|q| shot.storage.iter().any(|(_, s, _)| s == q.name()));
    // What the stats line and --json say the text decoder ran in.
    let off = args.load.quantize == Some(QuantArg::Off);
    let quantized = quantized_report(applied, quant, quant_source, off);
    if let Some(q) = quant.filter(|_| quant_source != QuantSource::CpuDefault) {
        if applied.is_none() {
            note!(
                "note: --quantize {} applied to no tensor: every input dimension must be a multiple of {}; the weights stay {}",
                q.name(),
                q.block(),
                vl_nn::linear::dtype_name(dtype)
            );
        }
    }
    if !args.json {
        printer.end_reasoning(&mut stdout).context("writing to stdout")?;
        writeln!(stdout).and_then(|_| stdout.flush()).context("writing to stdout")?;
    }
    if let Some(out) = logits_out {
        out.write(&c.first_logits)?;
    }
    // The answer's shapes in pixels of each image, for --json and --grounding.
    let shapes_json = grounding_spec.map(|g| grounding_report(&c.text, g, &c.images));
    // Sizes as the engine applied them (a grounding minimum may have raised them).
    for (s, r) in sizes.iter_mut().zip(&c.images) {
        s["resized_width"] = r.resized.1.into();
        s["resized_height"] = r.resized.0.into();
        s["tokens"] = r.tokens.into();
    }
    if let (Some(out), Some(data), Some(name), Some(g)) = (boxes_out, &first_image_data, &first_image, grounding_spec) {
        let resized = c.images.first().map_or((0, 0), |i| i.resized);
        let target = out.path.clone();
        match out.write(g, data, name, &limits, &c.text, resized)? {
            0 => note!(
                "--draw-boxes: the answer has no boxes or points; {} is {} unchanged",
                target.display(),
                name.display()
            ),
            n => note!("--draw-boxes: drew {n} shape(s) on {} into {}", name.display(), target.display()),
        }
    }

    let videos: Vec<serde_json::Value> =
        c.videos.iter().zip(&shot.checkpoint_videos).map(|(v, full)| video_report(v, *full, &args.load)).collect();
    let prefill_s = c.prefill_time.as_secs_f64();
    let decode_s = c.decode_time.as_secs_f64();
    // The first token comes from the prefill; the others from decode steps.
    let decode_steps = c.token_ids.len().saturating_sub(1);
    let decode_tps = if decode_s > 0.0 { decode_steps as f64 / decode_s } else { 0.0 };
    let prefill_tps = c.prompt_tokens as f64 / prefill_s.max(1e-9);
    let stop = match c.finish {
        Finish::Stop => "eos",
        Finish::Length => "max_tokens",
        Finish::ContextFull => "context_full",
        Finish::Cancelled => "stopped",
        Finish::ToolCalls => "tool_calls",
    };
    // From process start (flags parsed) to the first generated token.
    let ttft = (shot.generate_started - t_start + c.time_to_first_token).as_secs_f64();
    if args.json {
        let out = serde_json::json!({
            "model": dir.display().to_string(),
            "text": c.text,
            "reasoning": c.reasoning,
            "token_ids": c.token_ids,
            "prompt_tokens": c.prompt_tokens,
            "image_tokens": c.image_tokens,
            "images": sizes,
            "grounding": shapes_json,
            "video_tokens": c.video_tokens,
            "videos": videos,
            "generated_tokens": c.token_ids.len(),
            "stop_reason": stop,
            "dtype": format!("{dtype:?}").to_lowercase(),
            "vision_precision": if args.load.vision_bf16() { "bf16" } else { "f32" },
            "device": format!("{:?}", args.load.device).to_lowercase(),
            // What was asked for, and what each tensor group got (a layer whose input dimension
            // is not a multiple of the quant block stays dense).
            "quantization": quant.map(|q| q.name()),
            // How it was chosen ("flag", "checkpoint", "default": q4k on the CPU) and what ran.
            "quantization_source": match quant_source {
                QuantSource::Flag => "flag",
                QuantSource::Checkpoint => "checkpoint",
                QuantSource::CpuDefault => "default",
            },
            "quantized": quantized,
            "weights": shot
                .storage
                .iter()
                .map(|(group, storage, bytes)| serde_json::json!({"group": group, "storage": storage, "bytes": bytes}))
                .collect::<Vec<_>>(),
            "timings": {
                "load_s": (before_load + shot.load_time).as_secs_f64(),
                "media_s": shot.media_time.as_secs_f64(),
                "vision_s": shot.vision_time.as_secs_f64(),
                "prefill_s": prefill_s,
                "prefill_tokens_per_s": prefill_tps,
                "decode_s": decode_s,
                "decode_tokens_per_s": decode_tps,
                "time_to_first_token_s": ttft,
            },
            "kv_cache_bytes": shot.completion.kv_cache_bytes,
            "peak_rss_bytes": peak_rss(),
        });
        writeln!(stdout, "{out}").and_then(|_| stdout.flush()).context("writing to stdout")?;
    } else {
        note!(
            "[load {:.2}s | media {:.2}s | vision {:.2}s{} ({} images, {} videos, {} tokens) | prefill {} tokens {:.2}s, {:.1} tok/s | decode {} tokens, {:.1} tok/s | stop: {stop} | quantized: {quantized} | peak RSS {}]",
            (before_load + shot.load_time).as_secs_f64(),
            shot.media_time.as_secs_f64(),
            shot.vision_time.as_secs_f64(),
            if args.load.vision_bf16() { " bf16" } else { "" },
            args.images.len(),
            args.videos.len(),
            c.image_tokens + c.video_tokens,
            c.prompt_tokens,
            prefill_s,
            prefill_tps,
            c.token_ids.len(),
            decode_tps,
            peak_rss().map_or("n/a".into(), |b| format!("{:.0} MiB", b as f64 / 1048576.0)),
        );
    }
    Ok(())
}

/// The answer's boxes and points: as the model gave them, and in pixels of each image (`vl serve`
/// puts the same object on its choices; docs/serving.md). Each shape is said on stderr too.
fn grounding_report(
    text: &str,
    g: vl_models::grounding::Grounding,
    images: &[vl_models::request::ImageReport],
) -> serde_json::Value {
    let v = vl_models::grounding::report(text, g.coords, images);
    let first = v["images"][0]["shapes"].as_array().cloned().unwrap_or_default();
    for s in &first {
        note!("grounding: {s}");
    }
    v
}

/// What sampling and resizing made of one video, and whether the budget in force scaled it below
/// what the checkpoint's own (`full`) would give (said on stderr too, with the flag that lifts it).
fn video_report(
    v: &vl_models::engine::VideoReport,
    full: Option<vl_models::family::Sizing>,
    load: &LoadArgs,
) -> serde_json::Value {
    let (h, w) = v.plan.resized;
    let scaled = full.is_some_and(|f| f.resized.0 * f.resized.1 > h * w);
    if let (true, Some(f)) = (scaled, full) {
        let why = match load.video_max_pixels {
            Budget::At(n) => format!("--video-max-pixels {n}"),
            Budget::Model => "the budget".into(),
        };
        note!(
            "note: video {}: {} frames of {}x{} scaled to {w}x{h} ({} visual tokens) by {why}; the checkpoint's budget would give {}x{} ({} tokens): --video-max-pixels model",
            v.name,
            v.plan.indices.len(),
            v.info.width,
            v.info.height,
            v.tokens,
            f.resized.1,
            f.resized.0,
            f.tokens
        );
    }
    serde_json::json!({
        "file": v.name,
        "decoder": v.info.decoder,
        "width": v.info.width,
        "height": v.info.height,
        "frames": v.info.frames,
        "fps": v.info.fps,
        "sampled_frames": v.plan.indices.len(),
        "frame_indices": v.plan.indices,
        "timestamps": v.plan.timestamps,
        "resized_width": w,
        "resized_height": h,
        "grid_thw": v.plan.grid,
        "tokens": v.tokens,
        "scaled_below_checkpoint_budget": scaled,
    })
}

/// How one image is sized: its stored size, the size and token count it is resized to, and
/// whether the budget in force scaled it below what the checkpoint's own budget would give (said
/// on stderr too, with the flag that lifts it).
fn image_size_report(
    path: &std::path::Path,
    data: &[u8],
    family: &dyn Family,
    load: &LoadArgs,
    limits: &ImageLimits,
) -> anyhow::Result<serde_json::Value> {
    let file = vl_models::image_file::ImageFile::from_bytes(data.to_vec(), path, limits)?;
    let (w0, h0) = (file.width as usize, file.height as usize);
    let sizing = family.image_sizing(w0, h0)?;
    let ((h, w), tokens) = (sizing.ours.resized, sizing.ours.tokens);
    let (mh, mw) = sizing.checkpoint.resized;
    let scaled = h * w < mh * mw;
    if scaled {
        let why = match load.max_image_tokens {
            Budget::At(n) if load.max_pixels.is_none() => format!("--max-image-tokens {n}"),
            _ => "--max-pixels".to_string(),
        };
        note!(
            "note: image {}: {w0}x{h0} scaled to {w}x{h} ({tokens} visual tokens) by {why}; the checkpoint's budget would give {mw}x{mh} ({} tokens): --max-image-tokens model",
            path.display(),
            sizing.checkpoint.tokens
        );
    }
    Ok(serde_json::json!({
        "file": path.display().to_string(),
        "width": w0,
        "height": h0,
        "resized_width": w,
        "resized_height": h,
        "tokens": tokens,
        "scaled_below_checkpoint_budget": scaled,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The CPU default is said as such, with the way back to full precision.
    #[test]
    fn the_default_quantization_is_said_with_its_way_out() {
        let q4 = Some(QuantType::Q4K);
        assert_eq!(
            quantized_report(q4, q4, QuantSource::CpuDefault, false),
            "q4k (default; --quantize off for full precision)"
        );
        assert_eq!(
            quantized_report(None, q4, QuantSource::CpuDefault, false),
            "none (the default q4k fits no tensor: input dimensions are not multiples of 256)"
        );
        assert_eq!(quantized_report(q4, q4, QuantSource::Flag, false), "q4k");
        assert_eq!(quantized_report(None, None, QuantSource::Flag, true), "off");
        assert_eq!(quantized_report(None, None, QuantSource::Checkpoint, false), "none");
    }
}
