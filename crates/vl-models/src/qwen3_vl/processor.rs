//! Prompts: the checkpoint's chat template rendered with minijinja (as transformers renders it:
//! trim_blocks, lstrip_blocks, Python string methods), `<|image_pad|>` expanded to each image's
//! token count and `<|video_pad|>` to each video's timestamped frame pairs, tokenization with the `tokenizers` crate, and incremental detokenization for
//! streaming that never emits a broken UTF-8 sequence.

use std::path::Path;

use candle_core::Device;
use tokenizers::Tokenizer;

use super::image_processor::{ImageProcessor, ProcessedImage};
use super::model::Prompt;
use super::video_processor::{ProcessedVideo, VideoPlan, VideoProcessor, VIDEO_PAD};
use crate::error::{Error, Result};
use crate::limits::{read_text, MAX_METADATA_FILE_BYTES};
pub use crate::stream::StreamDecoder;
pub use crate::template::{ChatTemplate, Content, FunctionCall, Message, TemplateSource, TemplateToolCall};

/// Used only when a checkpoint ships no template of its own.
pub const BUILTIN_TEMPLATE: &str = include_str!("chat_template.jinja");

const IMAGE_PAD: &str = "<|image_pad|>";

/// Tokenizer, chat template and image processor of one checkpoint.
pub struct Processor {
    pub tokenizer: Tokenizer,
    pub template: ChatTemplate,
    pub images: ImageProcessor,
    pub videos: VideoProcessor,
}

impl Processor {
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        if !path.is_file() {
            return Err(Error::io(
                &path,
                std::io::Error::new(std::io::ErrorKind::NotFound, "tokenizer.json not found"),
            ));
        }
        let json = read_text(&path, MAX_METADATA_FILE_BYTES)?;
        let tokenizer = Tokenizer::from_bytes(json.as_bytes()).map_err(|e| Error::Input {
            what: path.display().to_string(),
            message: format!("invalid tokenizer: {}", e.to_string().replace('\n', " ")),
        })?;
        Ok(Self {
            tokenizer,
            template: ChatTemplate::from_dir(dir, BUILTIN_TEMPLATE)?,
            images: ImageProcessor::from_dir(dir)?,
            videos: VideoProcessor::from_dir(dir)?,
        })
    }

    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .tokenizer
            .encode(text, true)
            .map_err(|e| Error::Input { what: "tokenizer".into(), message: e.to_string() })?;
        Ok(enc.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.tokenizer
            .decode(ids, skip_special_tokens)
            .map_err(|e| Error::Input { what: "tokenizer".into(), message: e.to_string() })
    }

    /// The prompt length `prepare` would produce for images of these token counts, computed
    /// without the pixels (to check a prompt against the context before decoding any image).
    pub fn prompt_len(&self, messages: &[Message], image_tokens: &[usize]) -> Result<usize> {
        self.prompt_len_with(messages, None, image_tokens)
    }

    /// `prompt_len` with function definitions in the prompt.
    pub fn prompt_len_with(
        &self,
        messages: &[Message],
        tools: Option<&[serde_json::Value]>,
        image_tokens: &[usize],
    ) -> Result<usize> {
        self.prompt_len_media(messages, tools, &serde_json::Map::new(), image_tokens, &[])
    }

    /// `prompt_len_with` for images and videos (their plans: timestamps and grids).
    pub fn prompt_len_media(
        &self,
        messages: &[Message],
        tools: Option<&[serde_json::Value]>,
        kwargs: &serde_json::Map<String, serde_json::Value>,
        image_tokens: &[usize],
        videos: &[&VideoPlan],
    ) -> Result<usize> {
        self.rendered_len(&self.render(messages, tools, kwargs)?, image_tokens, videos)
    }

    /// The chat template rendered (with the generation prompt): the text `rendered_len` and
    /// `rendered_ids` take, so that a request renders its template once.
    pub fn render(
        &self,
        messages: &[Message],
        tools: Option<&[serde_json::Value]>,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String> {
        self.template.render_kw(messages, tools, kwargs, true)
    }

    /// `prompt_len_media` of a rendered prompt.
    pub fn rendered_len(&self, text: &str, image_tokens: &[usize], videos: &[&VideoPlan]) -> Result<usize> {
        // Each run of pads is one special token in `short`, expanded to its count after encoding.
        let (short, extra) = self.expand(text, image_tokens, videos, false)?;
        Ok(self.encode(&short)?.len().saturating_add(extra))
    }

    /// `prompt_ids` of a rendered prompt.
    pub fn rendered_ids(&self, text: &str, images: &[ProcessedImage], videos: &[ProcessedVideo]) -> Result<Vec<u32>> {
        let merge = self.images.config.merge_size;
        let tokens: Vec<usize> = images.iter().map(|i| i.num_tokens(merge)).collect();
        let plans: Vec<&VideoPlan> = videos.iter().map(|v| &v.plan).collect();
        let (expanded, _) = self.expand(text, &tokens, &plans, true)?;
        self.encode(&expanded)
    }

    /// Renders `messages` (with the generation prompt), expands each `<|image_pad|>` to its
    /// image's token count (images in prompt order) and tokenizes.
    pub fn prepare(&self, messages: &[Message], images: &[ProcessedImage], device: &Device) -> Result<Prompt> {
        self.prepare_with(messages, None, images, device)
    }

    /// `prepare` with function definitions in the prompt.
    pub fn prepare_with(
        &self,
        messages: &[Message],
        tools: Option<&[serde_json::Value]>,
        images: &[ProcessedImage],
        device: &Device,
    ) -> Result<Prompt> {
        self.prepare_media(messages, tools, images, &[], device)
    }

    /// `prepare_with` for images and videos: each `<|video_pad|>` becomes its video's frame
    /// pairs, `<{t:.1f} seconds><|vision_start|>` + pads + `<|vision_end|>` each.
    pub fn prepare_media(
        &self,
        messages: &[Message],
        tools: Option<&[serde_json::Value]>,
        images: &[ProcessedImage],
        videos: &[ProcessedVideo],
        device: &Device,
    ) -> Result<Prompt> {
        let input_ids = self.prompt_ids(messages, tools, &serde_json::Map::new(), images, videos)?;
        let images = (!images.is_empty()).then(|| self.images.batch(images, device)).transpose()?;
        let videos = (!videos.is_empty()).then(|| self.videos.batch(videos, device)).transpose()?;
        Ok(Prompt { input_ids, images, videos, generated_from: None })
    }

    /// The prompt's token ids (`prepare_media` without the pixel tensors).
    pub fn prompt_ids(
        &self,
        messages: &[Message],
        tools: Option<&[serde_json::Value]>,
        kwargs: &serde_json::Map<String, serde_json::Value>,
        images: &[ProcessedImage],
        videos: &[ProcessedVideo],
    ) -> Result<Vec<u32>> {
        self.rendered_ids(&self.render(messages, tools, kwargs)?, images, videos)
    }

    /// Replaces the rendered prompt's image and video pads, in one left-to-right pass, by their
    /// expansions: every pad run full length (`full`), or one pad per run with the count of the
    /// missing pads returned.
    fn expand(&self, text: &str, images: &[usize], videos: &[&VideoPlan], full: bool) -> Result<(String, usize)> {
        for (pad, n, what) in [(IMAGE_PAD, images.len(), "image"), (VIDEO_PAD, videos.len(), "video")] {
            let pads = text.matches(pad).count();
            if pads != n {
                return Err(Error::Input {
                    what: "prompt".into(),
                    message: format!("the rendered prompt has {pads} {what} placeholders for {n} {what}s"),
                });
            }
        }
        let merge = self.videos.config.base.merge_size;
        let (mut out, mut extra) = (String::with_capacity(text.len()), 0usize);
        let (mut images, mut videos) = (images.iter(), videos.iter());
        let mut rest = text;
        loop {
            let next = [IMAGE_PAD, VIDEO_PAD].into_iter().filter_map(|p| rest.find(p).map(|at| (at, p))).min();
            let Some((at, pad)) = next else { break };
            out.push_str(&rest[..at]);
            rest = &rest[at + pad.len()..];
            if pad == IMAGE_PAD {
                let n = *images.next().expect("counted above");
                out.push_str(&IMAGE_PAD.repeat(if full { n } else { 1 }));
                extra = extra.saturating_add(n.saturating_sub(1));
            } else {
                let plan = videos.next().expect("counted above");
                let n = plan.frame_tokens(merge);
                out.push_str(&plan.placeholder(if full { n } else { 1 }));
                extra = extra.saturating_add(plan.grid[0] * n.saturating_sub(1));
            }
        }
        out.push_str(rest);
        Ok((out, if full { 0 } else { extra }))
    }

    pub fn stream_decoder(&self) -> StreamDecoder<'_> {
        StreamDecoder::new(&self.tokenizer)
    }
}
