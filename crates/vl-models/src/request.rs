//! What goes into the engine and comes out of it, below both the engine and the families: a
//! request (messages of text, image and video parts, options, tools, a constraint), the
//! completion (text, reasoning, tool calls, counts, timings), the pieces of a stream, and the
//! reports on each image and video. The engine, the families and the server all speak these.

use std::time::Duration;

pub use crate::constraint::Constraint;
use crate::sampling::GenerationOptions;
pub use crate::sampling::TokenLogprob;
pub use crate::tool_calls::ToolCall;

/// One part of a request message.
#[derive(Debug, Clone)]
pub enum Part {
    Text(String),
    /// Encoded image bytes (PNG, JPEG, WebP, GIF, BMP); `name` stands for it in errors. A
    /// per-image pixel budget may narrow the engine's.
    Image {
        data: Vec<u8>,
        name: String,
        min_pixels: Option<usize>,
        max_pixels: Option<usize>,
    },
    /// A video: a file (decoded by ffmpeg; animated GIF/PNG/WebP in-process), a directory of
    /// frames, or encoded bytes; `name` stands for it in errors. `options` may narrow the
    /// engine's video settings (fewer frames or pixels, another sampling rate).
    Video {
        source: VideoData,
        name: String,
        options: crate::video::VideoOptions,
    },
}

impl Part {
    /// Text.
    pub fn text(text: impl Into<String>) -> Self {
        Part::Text(text.into())
    }
    /// An encoded image (PNG, JPEG, WebP, GIF, BMP) under the engine's pixel budget.
    pub fn image(data: impl Into<Vec<u8>>) -> Self {
        Part::Image { data: data.into(), name: "image".into(), min_pixels: None, max_pixels: None }
    }
    /// An image file, read now (errors name the file); its name stands for it in errors.
    pub fn image_file(path: impl AsRef<std::path::Path>) -> crate::Result<Self> {
        let path = path.as_ref();
        let data = std::fs::read(path).map_err(|e| crate::Error::Io { path: path.to_path_buf(), source: e })?;
        Ok(Part::Image { data, name: path.display().to_string(), min_pixels: None, max_pixels: None })
    }
    /// A video file or a directory of frames on this machine, under the engine's video settings.
    pub fn video_file(path: impl Into<std::path::PathBuf>) -> Self {
        let path = path.into();
        Part::Video {
            name: path.display().to_string(),
            source: VideoData::Path(path),
            options: crate::video::VideoOptions::default(),
        }
    }
}

/// A video as the engine read it.
#[derive(Debug, Clone)]
pub struct VideoReport {
    pub name: String,
    pub info: crate::video::VideoInfo,
    pub plan: crate::video::VideoPlan,
    /// Video pad tokens (without the timestamp text and frame markers).
    pub tokens: usize,
    /// The frames came from the engine's clip cache: the same file (path, size, modification
    /// time) or bytes with the same settings were read before, so nothing was decoded.
    pub from_cache: bool,
}

/// Where a video part's data is.
#[derive(Debug, Clone)]
pub enum VideoData {
    /// A file or a directory of frames on this machine.
    Path(std::path::PathBuf),
    /// Encoded bytes (e.g. a data URL's).
    Bytes(Vec<u8>),
}

#[derive(Debug, Clone)]
pub struct ChatMessage {
    pub role: String,
    pub parts: Vec<Part>,
    /// An assistant turn's function calls (given back with the tools' answers in `tool`
    /// messages).
    pub tool_calls: Vec<ToolCall>,
    /// An assistant turn's reasoning (`Completion::reasoning`), given back to the template as
    /// `reasoning_content`.
    pub reasoning: Option<String>,
}

impl ChatMessage {
    /// A user turn.
    pub fn user(parts: Vec<Part>) -> Self {
        Self::new("user", parts)
    }
    pub fn new(role: &str, parts: Vec<Part>) -> Self {
        Self { role: role.into(), parts, tool_calls: vec![], reasoning: None }
    }
    pub fn text(role: &str, text: &str) -> Self {
        Self::new(role, vec![Part::Text(text.into())])
    }
}

#[derive(Debug, Clone, Default)]
pub struct Request {
    pub messages: Vec<ChatMessage>,
    pub options: GenerationOptions,
    /// Generation stops before any of these strings would be emitted (the string is not part
    /// of the answer, unless `include_stop`).
    pub stop: Vec<String>,
    /// The stop string that ended the answer is kept at its end (vLLM's
    /// `include_stop_str_in_output`, SGLang's `no_stop_trim`).
    pub include_stop: bool,
    /// Function definitions the model may call (OpenAI's `tools`: `{"type": "function",
    /// "function": {"name", "description", "parameters"}}`), rendered by the chat template.
    /// With tools, an answer's `<tool_call>` blocks become `Completion::tool_calls` and are not
    /// streamed as text.
    pub tools: Vec<serde_json::Value>,
    /// What the answer must be (a JSON schema, any JSON object, tool calls): the sampler picks
    /// only tokens that keep it valid (`crate::constraint`).
    pub constraint: Option<Constraint>,
    /// A raw prompt, tokenized as it is without the chat template (OpenAI's `/v1/completions`);
    /// `messages` and `tools` must then be empty.
    pub prompt: Option<String>,
    /// Extra variables for the chat template (`chat_template_kwargs`, e.g. `enable_thinking`).
    pub template_kwargs: serde_json::Map<String, serde_json::Value>,
}

impl Request {
    /// One user turn of these parts, with default options (greedy, 256 new tokens at most).
    pub fn user(parts: Vec<Part>) -> Self {
        Request { messages: vec![ChatMessage::user(parts)], ..Default::default() }
    }
    /// The same request with at most `n` new tokens.
    pub fn max_new_tokens(mut self, n: usize) -> Self {
        self.options.max_new_tokens = n;
        self
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// An end-of-sequence token or a stop string.
    Stop,
    /// `max_new_tokens` reached.
    Length,
    /// The model's context is full.
    ContextFull,
    /// The callback asked to stop (e.g. the client went away).
    Cancelled,
    /// The answer is function calls (`Completion::tool_calls`).
    ToolCalls,
}

impl Finish {
    /// The OpenAI `finish_reason`.
    pub fn openai(self) -> &'static str {
        match self {
            Finish::Stop | Finish::Cancelled => "stop",
            Finish::Length | Finish::ContextFull => "length",
            Finish::ToolCalls => "tool_calls",
        }
    }
}

#[derive(Debug, Clone)]
pub struct Completion {
    /// The answer's text (with tool calls, the text before the first call; with a reasoning
    /// block, the text after it).
    pub text: String,
    /// The reasoning block's text (`<think>...</think>`, without the markers), when the answer
    /// has one (a thinking checkpoint; `Family::reasoning`).
    pub reasoning: Option<String>,
    /// Function calls the answer made (only when the request offered tools).
    pub tool_calls: Vec<ToolCall>,
    /// Generated ids (an eos id included when it ended the answer).
    pub token_ids: Vec<u32>,
    pub prompt_tokens: usize,
    /// Prompt positions whose KV came from an earlier request (not prefilled again).
    pub cached_tokens: usize,
    pub image_tokens: usize,
    pub video_tokens: usize,
    /// Each video of the request: its source and what sampling and resizing made of it.
    pub videos: Vec<VideoReport>,
    /// Each image of the request: its size as displayed and as the model saw it.
    pub images: Vec<ImageReport>,
    /// Images whose features came from the feature cache.
    pub image_cache_hits: usize,
    /// Videos whose features came from the feature cache (keyed by the preprocessed pixels).
    pub video_cache_hits: usize,
    pub finish: Finish,
    pub vision_time: Duration,
    pub prefill_time: Duration,
    pub decode_time: Duration,
    pub time_to_first_token: Duration,
    /// f32 logits that chose the first generated token.
    pub first_logits: Vec<f32>,
    /// Each answer token's log-probabilities, when `GenerationOptions::logprobs` asked (an
    /// end-of-sequence token that ended the answer is not among them).
    pub logprobs: Vec<TokenLogprob>,
    /// KV cache bytes the sequence held at its end.
    pub kv_cache_bytes: usize,
    /// How its tokens were decoded: forward passes, drafted and forced tokens.
    pub steps: StepReport,
}

/// How an answer's tokens were decoded (`GenerationOptions::speculative`, `forced_tokens`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepReport {
    /// Decode forward passes it took part in (the prefill not counted).
    pub forward_passes: usize,
    /// Tokens drafted (`speculative`) and fed for verification.
    pub drafted: usize,
    /// Drafted tokens the verification kept.
    pub accepted: usize,
    /// Tokens a constraint forced, written without sampling.
    pub forced: usize,
}

/// An image as the engine read it: its size as displayed (after EXIF orientation) and as the
/// model saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageReport {
    pub name: String,
    pub width: usize,
    pub height: usize,
    /// (height, width) after resizing.
    pub resized: (usize, usize),
    pub tokens: usize,
}

/// A piece of a streamed answer.
#[derive(Debug, Clone, Copy)]
pub struct Delta<'a> {
    /// Which answer of the request (`n`).
    pub choice: usize,
    pub text: &'a str,
    /// A piece of the reasoning block (`Completion::reasoning`), not of the answer's text.
    pub reasoning: bool,
    /// The log-probabilities of the tokens picked since the last piece (when asked for).
    pub logprobs: &'a [TokenLogprob],
}
