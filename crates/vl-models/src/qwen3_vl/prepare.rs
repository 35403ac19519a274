//! A request made into Qwen3-VL's prompt: its images and videos checked against their budgets
//! and the context before any pixel is decoded, then read, preprocessed and keyed, and the
//! chat template rendered once into the prompt's ids and identities.

use std::path::Path;
use std::sync::Arc;

use candle_core::Device;
use sha2::{Digest, Sha256};

use super::video_processor::{ProcessedVideo, VideoOptions, VideoPlan, VideoProcessor};
use super::{Content, ImageFile, Message, Processor, TemplateToolCall};
use crate::error::{Error, Result};
use crate::family::{Identity, Prepared};
use crate::media::{image_key, pixels_key, CachedClip, Media, MediaContext, MediaKind};
use crate::request::{ImageReport, Part, Request, VideoData, VideoReport};
use crate::sampling::GenerationOptions;
use crate::video::VideoSource;

/// The registry's entry for Qwen3-VL.
/// A video of a request: sampled and preprocessed before (from the clip cache), or to be decoded.
/// One per video of a request, consumed at once: the fresh variant's size is no concern.
#[allow(clippy::large_enum_variant)]
enum Clip {
    Cached(ProcessedVideo),
    Fresh { src: VideoSource, proc: VideoProcessor, plan: VideoPlan, key: Option<[u8; 32]> },
}

impl Clip {
    fn plan(&self) -> &VideoPlan {
        match self {
            Clip::Cached(v) => &v.plan,
            Clip::Fresh { plan, .. } => plan,
        }
    }
}

/// The video processor for one video: the engine's, narrowed by the request's options (fewer
/// frames and pixels only; any sampling rate within bounds).
fn video_processor(base: &VideoProcessor, o: &VideoOptions) -> Result<VideoProcessor> {
    let c = &base.config;
    let over = |name: &str, v: usize, most: usize| {
        (v > most).then(|| Error::Input {
            what: format!("video {name}"),
            message: format!("{v} is above the server's {most}"),
        })
    };
    if let Some(e) = o.max_frames.and_then(|v| over("max_frames", v, c.max_frames)) {
        return Err(e);
    }
    if let Some(e) = o.max_pixels.and_then(|v| over("max_pixels", v, c.base.max_pixels)) {
        return Err(e);
    }
    let narrowed = VideoOptions { min_pixels: None, cap_pixels_per_frame: None, ..*o };
    let mut p = base.clone().with_options(&narrowed).map_err(|e| e.rename_input(|w| format!("video {w}")))?;
    p.limits = base.limits;
    Ok(p)
}

/// The image processor for one image: the engine's, narrowed by the request's budget.
fn image_processor(
    base: &super::ImageProcessor,
    min_pixels: Option<usize>,
    max_pixels: Option<usize>,
) -> Result<super::ImageProcessor> {
    let (lo, hi) = (base.config.min_pixels, base.config.max_pixels);
    for (name, v) in [("min_pixels", min_pixels), ("max_pixels", max_pixels)] {
        if let Some(v) = v {
            if v < lo || v > hi {
                return Err(Error::Input {
                    what: name.into(),
                    message: format!("{v} is outside the server's image budget [{lo}, {hi}] pixels"),
                });
            }
        }
    }
    if min_pixels.is_none() && max_pixels.is_none() {
        return Ok(base.clone());
    }
    let mut p = base.clone().with_pixel_budget(min_pixels, max_pixels)?;
    p.limits = base.limits;
    Ok(p)
}

/// A raw prompt (no chat template): its tokens as the tokenizer gives them, no media.
fn raw_prompt(
    processor: &Processor,
    config: &super::Qwen3VlConfig,
    options: GenerationOptions,
    req: &Request,
    text: &str,
) -> Result<Prepared> {
    if !req.messages.is_empty() || !req.tools.is_empty() {
        return Err(Error::Input {
            what: "prompt".into(),
            message: "a raw prompt goes without messages and tools".into(),
        });
    }
    let ids = processor
        .tokenizer
        .encode(text, false)
        .map_err(|e| Error::Input { what: "prompt".into(), message: e.to_string() })?
        .get_ids()
        .to_vec();
    let context = config.text.max_position_embeddings;
    if ids.is_empty() {
        return Err(Error::Input { what: "prompt".into(), message: "no tokens".into() });
    }
    if ids.len() >= context {
        return Err(Error::Limit {
            what: "prompt".into(),
            message: format!("the prompt is {} tokens, longer than the model's context of {context} tokens", ids.len()),
            kind: crate::limits::LimitKind::Context,
        });
    }
    let ident = ids.iter().map(|&t| Identity::text(t)).collect();
    Ok(Prepared {
        options,
        ids,
        ident,
        media: vec![],
        image_tokens: 0,
        video_tokens: 0,
        videos: vec![],
        images: vec![],
    })
}

/// Checks a request and prepares its prompt: options, image headers and budgets, the prompt's
/// length against the context (before any pixel is decoded), then pixels and tokens.
pub(super) fn prepare(
    processor: &Processor,
    config: &super::Qwen3VlConfig,
    eos: &[u32],
    device: &Device,
    req: &Request,
    ctx: &MediaContext<'_>,
) -> Result<Prepared> {
    // The engine checked the options, the messages and the stop strings (`check_request`).
    let opts = GenerationOptions { eos_token_ids: eos.to_vec(), ..req.options.clone() };
    if let Some(text) = &req.prompt {
        return raw_prompt(processor, config, opts, req, text);
    }
    let mut messages = Vec::with_capacity(req.messages.len());
    let mut files = Vec::new();
    let mut clips: Vec<Clip> = Vec::new();
    let mut reports = Vec::new();
    let mut video_tokens = 0usize;
    let decode_left = || ctx.decode_left();
    for m in &req.messages {
        let mut content = Vec::with_capacity(m.parts.len());
        for p in &m.parts {
            match p {
                Part::Text(t) => content.push(Content::Text { text: t.clone() }),
                Part::Image { data, name, min_pixels, max_pixels } => {
                    let proc = image_processor(&processor.images, *min_pixels, *max_pixels)?;
                    let file = ImageFile::from_bytes(data.clone(), Path::new(name), &proc.limits)?;
                    content.push(Content::Image { image: name.clone() });
                    files.push((file, proc, Sha256::digest(data)));
                }
                Part::Video { source, name, options } => {
                    let mut proc = video_processor(&processor.videos, options)?;
                    proc.limits.max_decode_time = decode_left()?;
                    let key = ctx.clip_key(source, &format!("{:?}", proc.config));
                    let cached = key.and_then(|k| ctx.cached_clip(&k)).and_then(|c| {
                        let video = c.data.downcast_ref::<ProcessedVideo>()?.clone();
                        Some((c.info, video))
                    });
                    let (info, clip) = match cached {
                        Some((info, video)) => (info, Clip::Cached(video)),
                        None => {
                            let src = match source {
                                VideoData::Path(p) => VideoSource::open(p, proc.config.fps, &proc.limits)?,
                                VideoData::Bytes(b) => {
                                    VideoSource::from_bytes(b.clone(), Path::new(name), &proc.limits)?
                                }
                            };
                            let plan = proc.plan_source(&src)?;
                            (src.info().clone(), Clip::Fresh { src, proc, plan, key })
                        }
                    };
                    content.push(Content::Video { video: name.clone() });
                    let plan = clip.plan().clone();
                    let tokens = plan.num_tokens(processor.videos.config.base.merge_size);
                    // Cheap check first: the videos planned so far already overflow the context,
                    // so the others are not probed (a probe lists a frame directory or runs
                    // ffprobe over the whole file).
                    video_tokens += tokens;
                    let context = config.text.max_position_embeddings;
                    if video_tokens >= context {
                        return Err(Error::Limit {
                            what: "prompt".into(),
                            message: format!(
                                "the prompt is at least {video_tokens} tokens from its first {} video(s), longer than the model's context of {context} tokens",
                                reports.len() + 1
                            ),
                            kind: crate::limits::LimitKind::Context,
                        });
                    }
                    let from_cache = matches!(clip, Clip::Cached(_));
                    reports.push(VideoReport { name: name.clone(), info, plan, tokens, from_cache });
                    clips.push(clip);
                }
            }
        }
        let mut msg = Message::new(&m.role, content);
        msg.tool_calls = m
            .tool_calls
            .iter()
            .map(|c| {
                // As transformers' templates expect (and vLLM passes them): the arguments as an
                // object when they are one (Qwen3.5's template iterates `arguments|items`), else
                // the text as sent.
                let args = match serde_json::from_str::<serde_json::Value>(&c.arguments) {
                    Ok(v @ serde_json::Value::Object(_)) => v,
                    _ => serde_json::Value::String(c.arguments.clone()),
                };
                TemplateToolCall::function(&c.name, args)
            })
            .collect();
        msg.reasoning_content = m.reasoning.clone();
        messages.push(msg);
    }
    let tokens: Vec<usize> = files.iter().map(|(f, p, _)| p.tokens_for(f)).collect::<Result<_>>()?;
    let context = config.text.max_position_embeddings;
    let tools = (!req.tools.is_empty()).then_some(req.tools.as_slice());
    let plans: Vec<&VideoPlan> = clips.iter().map(Clip::plan).collect();
    // The template renders once (a template runs in a child process, bounded in time).
    let rendered = processor.render(&messages, tools, &req.template_kwargs)?;
    let prompt_len = processor.rendered_len(&rendered, &tokens, &plans)?;
    if prompt_len >= context {
        let merge = processor.videos.config.base.merge_size;
        let video_tokens: usize = plans.iter().map(|p| p.num_tokens(merge)).sum();
        let videos =
            if plans.is_empty() { String::new() } else { format!(", {video_tokens} from {} video(s)", plans.len()) };
        return Err(Error::Limit {
            what: "prompt".into(),
            message: format!(
                "the prompt is {prompt_len} tokens ({} from {} image(s){videos}), longer than the model's context of {context} tokens",
                tokens.iter().sum::<usize>(),
                tokens.len()
            ),
            kind: crate::limits::LimitKind::Context,
        });
    }
    let processed: Vec<_> = files.iter().map(|(f, p, _)| p.process_opened(f)).collect::<Result<_>>()?;
    let keys: Vec<u64> = files.iter().zip(&processed).map(|((_, _, h), img)| image_key(h, img.resized)).collect();
    let mut videos: Vec<ProcessedVideo> = Vec::with_capacity(clips.len());
    for (clip, report) in clips.into_iter().zip(&reports) {
        videos.push(match clip {
            Clip::Cached(video) => video,
            Clip::Fresh { mut src, proc, plan, key } => {
                src.set_max_decode_time(decode_left()?);
                let video = proc.process_planned(&src, plan)?;
                if let Some(k) = key {
                    let bytes = video.pixels.len() * std::mem::size_of::<f32>();
                    let data = Arc::new(video.clone());
                    ctx.keep_clip(k, CachedClip { info: report.info.clone(), data }, bytes);
                }
                video
            }
        });
    }
    let video_keys: Vec<u64> = videos.iter().map(|v| pixels_key(&v.pixels, v.plan.grid)).collect();
    let ids = processor.rendered_ids(&rendered, &processed, &videos)?;
    let count = |id: u32| ids.iter().filter(|&&t| t == id).count();
    let (image_tokens, video_tokens) = (count(config.image_token_id), count(config.video_token_id));
    // Identities: which image or video each placeholder belongs to, in prompt order (a video's
    // frame pairs are runs of one video, separated by their timestamps).
    let mut ident: Vec<Identity> = Vec::with_capacity(ids.len());
    let mut runs = [(config.image_token_id, &keys, 0usize, false), (config.video_token_id, &video_keys, 0, false)];
    let mut pairs_left = videos.first().map_or(0, |v| v.plan.grid[0]);
    for &t in &ids {
        let mut key = 0;
        for (kind, (id, keys, at, in_run)) in runs.iter_mut().enumerate() {
            if t == *id {
                *in_run = true;
                key = keys.get(*at).copied().unwrap_or(0);
            } else if *in_run {
                *in_run = false;
                if kind == 0 {
                    *at += 1;
                } else {
                    pairs_left -= 1;
                    if pairs_left == 0 {
                        *at += 1;
                        pairs_left = videos.get(*at).map_or(0, |v| v.plan.grid[0]);
                    }
                }
            }
        }
        ident.push(Identity { token: t, media: key });
    }
    let mut media = Vec::with_capacity(processed.len() + videos.len());
    for (img, &key) in processed.iter().zip(&keys) {
        let input = processor.images.batch(std::slice::from_ref(img), device)?;
        media.push(Media { kind: MediaKind::Image, key, input });
    }
    for (video, &key) in videos.iter().zip(&video_keys) {
        let input = processor.videos.batch(std::slice::from_ref(video), device)?;
        media.push(Media { kind: MediaKind::Video, key, input });
    }
    let images = files
        .iter()
        .zip(&processed)
        .map(|((f, p, _), img)| ImageReport {
            name: f.path().display().to_string(),
            width: img.original.1,
            height: img.original.0,
            resized: img.resized,
            tokens: img.num_tokens(p.config.merge_size),
        })
        .collect();
    Ok(Prepared { options: opts, ids, ident, media, image_tokens, video_tokens, videos: reports, images })
}
