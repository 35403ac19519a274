//! What `vl run` says at the end: the answer's timings, sizes and quantization as one JSON
//! object (`--json`) or a stats line on stderr; each image's and video's sizing and the answer's
//! boxes and points, with a note on stderr where a budget scaled media down.

use std::path::Path;
use std::time::{Duration, Instant};

use candle_core::DType;
use serde_json::Value;
use vl_models::engine::{Finish, OneShot};
use vl_models::family::Family;
use vl_models::limits::ImageLimits;
use vl_nn::QuantType;

use crate::flags::{Budget, LoadArgs, MediaArgs, QuantSource};
use crate::note;

/// What the run was asked and given besides the engine's answer (`OneShot`).
pub(super) struct Report<'a> {
    /// The model directory (or GGUF file) resolved.
    pub model: &'a Path,
    pub load: &'a LoadArgs,
    pub dtype: DType,
    /// The quantization chosen and how (`ModelArgs::quant_choice`).
    pub quant: Option<QuantType>,
    pub quant_source: QuantSource,
    /// What the text decoder ran in (`quantized_report`).
    pub quantized: String,
    /// `--image` and `--video` counts.
    pub image_files: usize,
    pub video_files: usize,
    /// Each image's sizing (`image_size_report`, as applied), each video's (`video_report`).
    pub images: Vec<Value>,
    pub videos: Vec<Value>,
    /// The answer's shapes (`grounding_report`) for a grounding request.
    pub grounding: Option<Value>,
    /// When the flags were parsed; the time from then to the engine's start.
    pub started: Instant,
    pub before_load: Duration,
}

impl Report<'_> {
    /// `--json`'s object.
    pub fn json(self, shot: &OneShot) -> Value {
        let c = &shot.completion;
        let r = Rates::of(shot, self.started);
        let (dtype, quant, quant_source) = (self.dtype, self.quant, self.quant_source);
        serde_json::json!({
            "model": self.model.display().to_string(),
            "text": c.text,
            "reasoning": c.reasoning,
            "token_ids": c.token_ids,
            "prompt_tokens": c.prompt_tokens,
            "image_tokens": c.image_tokens,
            "images": self.images,
            "grounding": self.grounding,
            "video_tokens": c.video_tokens,
            "videos": self.videos,
            "generated_tokens": c.token_ids.len(),
            "stop_reason": stop_reason(c.finish),
            "dtype": format!("{dtype:?}").to_lowercase(),
            "vision_precision": if self.load.model.vision_bf16() { "bf16" } else { "f32" },
            "kv_cache_dtype": format!("{:?}", self.load.model.kv_dtype().unwrap_or(dtype)).to_lowercase(),
            "device": format!("{:?}", self.load.model.device).to_lowercase(),
            // What was asked for, and what each tensor group got (a layer whose input dimension
            // is not a multiple of the quant block stays dense).
            "quantization": quant.map(|q| q.name()),
            // How it was chosen ("flag", "checkpoint", "default": q4k on the CPU) and what ran.
            "quantization_source": match quant_source {
                QuantSource::Flag => "flag",
                QuantSource::Checkpoint => "checkpoint",
                QuantSource::CpuDefault => "default",
            },
            "quantized": self.quantized,
            "weights": shot
                .storage
                .iter()
                .map(|(group, storage, bytes)| serde_json::json!({"group": group, "storage": storage, "bytes": bytes}))
                .collect::<Vec<_>>(),
            "timings": {
                "load_s": (self.before_load + shot.load_time).as_secs_f64(),
                "media_s": shot.media_time.as_secs_f64(),
                "vision_s": shot.vision_time.as_secs_f64(),
                "prefill_s": r.prefill_s,
                "prefill_tokens_per_s": r.prefill_tps,
                "decode_s": r.decode_s,
                "decode_tokens_per_s": r.decode_tps,
                "time_to_first_token_s": r.ttft,
            },
            "kv_cache_bytes": shot.completion.kv_cache_bytes,
            "steps": {
                "forward_passes": shot.completion.steps.forward_passes,
                "drafted": shot.completion.steps.drafted,
                "accepted": shot.completion.steps.accepted,
                "forced": shot.completion.steps.forced,
            },
            "peak_rss_bytes": peak_rss(),
        })
    }

    /// The stats line on stderr (without `--json`).
    pub fn stats_line(self, shot: &OneShot) -> String {
        let c = &shot.completion;
        let r = Rates::of(shot, self.started);
        let (stop, quantized) = (stop_reason(c.finish), &self.quantized);
        format!(
            "[load {:.2}s | media {:.2}s | vision {:.2}s{} ({} images, {} videos, {} tokens) | prefill {} tokens {:.2}s, {:.1} tok/s | decode {} tokens, {:.1} tok/s{} | stop: {stop} | quantized: {quantized} | peak RSS {}]",
            (self.before_load + shot.load_time).as_secs_f64(),
            shot.media_time.as_secs_f64(),
            shot.vision_time.as_secs_f64(),
            if self.load.model.vision_bf16() { " bf16" } else { "" },
            self.image_files,
            self.video_files,
            c.image_tokens + c.video_tokens,
            c.prompt_tokens,
            r.prefill_s,
            r.prefill_tps,
            c.token_ids.len(),
            r.decode_tps,
            steps(&c.steps),
            peak_rss().map_or("n/a".into(), |b| format!("{:.0} MiB", b as f64 / 1048576.0)),
        )
    }
}

/// The answer's speeds.
struct Rates {
    prefill_s: f64,
    prefill_tps: f64,
    decode_s: f64,
    decode_tps: f64,
    /// From process start (flags parsed) to the first generated token.
    ttft: f64,
}

impl Rates {
    fn of(shot: &OneShot, started: Instant) -> Self {
        let c = &shot.completion;
        let prefill_s = c.prefill_time.as_secs_f64();
        let decode_s = c.decode_time.as_secs_f64();
        // The first token comes from the prefill; the others from decode steps.
        let decode_steps = c.token_ids.len().saturating_sub(1);
        let decode_tps = if decode_s > 0.0 { decode_steps as f64 / decode_s } else { 0.0 };
        let prefill_tps = c.prompt_tokens as f64 / prefill_s.max(1e-9);
        let ttft = (shot.generate_started - started + c.time_to_first_token).as_secs_f64();
        Rates { prefill_s, prefill_tps, decode_s, decode_tps, ttft }
    }
}

/// ", N passes (drafts kept/drafted, F forced)" when drafts or forced tokens took part.
fn steps(s: &vl_models::engine::StepReport) -> String {
    let mut out = String::new();
    if s.drafted > 0 || s.forced > 0 {
        out = format!(" in {} passes", s.forward_passes);
    }
    if s.drafted > 0 {
        out.push_str(&format!(", drafts {}/{} kept", s.accepted, s.drafted));
    }
    if s.forced > 0 {
        out.push_str(&format!(", {} forced", s.forced));
    }
    out
}

/// Why the answer ended, as `--json` and the stats line say it.
fn stop_reason(finish: Finish) -> &'static str {
    match finish {
        Finish::Stop => "eos",
        Finish::Length => "max_tokens",
        Finish::ContextFull => "context_full",
        Finish::Cancelled => "stopped",
        Finish::ToolCalls => "tool_calls",
    }
}

/// Peak resident set size of this process, where the OS reports it.
fn peak_rss() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb: u64 = s.lines().find(|l| l.starts_with("VmHWM:"))?.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// What the text decoder ran in, as the stats line and `--json`'s `quantized` say it: `applied`
/// the quantization some tensor got, `quant` the one chosen (`source`), `off` for `--quantize off`.
pub(super) fn quantized_report(
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

/// The answer's boxes and points: as the model gave them, and in pixels of each image (`vl serve`
/// puts the same object on its choices; docs/serving.md). Each shape is said on stderr too.
pub(super) fn grounding_report(
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
pub(super) fn video_report(
    v: &vl_models::engine::VideoReport,
    full: Option<vl_models::family::Sizing>,
    media: &MediaArgs,
) -> serde_json::Value {
    let (h, w) = v.plan.resized;
    let scaled = full.is_some_and(|f| f.resized.0 * f.resized.1 > h * w);
    if let (true, Some(f)) = (scaled, full) {
        let why = match media.video_max_pixels {
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
pub(super) fn image_size_report(
    path: &std::path::Path,
    data: &[u8],
    family: &dyn Family,
    media: &MediaArgs,
    limits: &ImageLimits,
) -> anyhow::Result<serde_json::Value> {
    let file = vl_models::image_file::ImageFile::from_bytes(data.to_vec(), path, limits)?;
    let (w0, h0) = (file.width as usize, file.height as usize);
    let sizing = family.image_sizing(w0, h0)?;
    let ((h, w), tokens) = (sizing.ours.resized, sizing.ours.tokens);
    let (mh, mw) = sizing.checkpoint.resized;
    let scaled = h * w < mh * mw;
    if scaled {
        let why = match media.max_image_tokens {
            Budget::At(n) if media.max_pixels.is_none() => format!("--max-image-tokens {n}"),
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
