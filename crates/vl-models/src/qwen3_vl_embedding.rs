//! Qwen3-VL-Embedding (2B, 8B): a Qwen3-VL checkpoint whose Sentence Transformers files
//! (`modules.json`: Transformer, Pooling with `pooling_mode_lasttoken`, Normalize) make it an
//! embedding model. It pools, never decodes: a request becomes the official prompt (the
//! instruction as the system message, default "Represent the user's input.", a period added when
//! it ends without punctuation; the user turn's videos, then images, then texts, "NULL" when it
//! has none; the generation prompt), and its vector is the last position's final-normed hidden
//! state, L2-normalised (QwenLM/Qwen3-VL-Embedding `src/models/qwen3_vl_embedding.py`).
//! Images are sized within the checkpoint's bounds capped at 1,843,200 pixels (1,800 visual
//! tokens) unless the engine is told otherwise, as qwen-vl-utils and the processor size them for
//! the official code.

use std::path::Path;

use crate::error::{Error, Result};
use crate::family::{Family, FamilyEntry, ModelOptions, PoolInput, Pooled, Pooler, Prepared, Source, Task};
use crate::media::MediaContext;
use crate::qwen3_vl::family::Qwen3Vl;
use crate::qwen3_vl::video_processor::ClipSizing;
use crate::request::{ChatMessage, Part, Request};
use crate::state::SeqState;

/// The registry's entry for Qwen3-VL-Embedding.
pub static ENTRY: FamilyEntry = FamilyEntry {
    name: "qwen3_vl_embedding",
    architectures: &["Qwen3VLForConditionalGeneration"],
    model_types: &["qwen3_vl"],
    gguf_architectures: &[],
    heads: &["sentence_transformers.models.Pooling"],
    open: open_entry,
    inspect: inspect_entry,
    quantize: crate::qwen3_vl::family::quantize_entry,
    default_quant: crate::qwen3_vl::family::default_quant_entry,
};

/// The instruction when a request gives none (the official default).
pub const DEFAULT_INSTRUCTION: &str = "Represent the user's input.";
/// The official image budget's top (qwen-vl-utils' bound for the embedding models).
pub const MAX_PIXELS: usize = 1800 * 32 * 32;
/// The official video sampling: frames a second, and at most this many.
pub const VIDEO_FPS: f64 = 1.0;
pub const VIDEO_MAX_FRAMES: usize = 64;

fn open_entry(source: &Source<'_>, opts: &ModelOptions, staged: bool) -> Result<Box<dyn Family>> {
    check_pooling(source.model)?;
    let inner = open_official(source, opts, staged)?;
    Ok(Box::new(Qwen3VlEmbedding { inner }))
}

/// The Qwen3-VL checkpoint under an embedding or reranker head, with the official code's media
/// defaults unless the engine is told otherwise.
pub(crate) fn open_official(source: &Source<'_>, opts: &ModelOptions, staged: bool) -> Result<Qwen3Vl> {
    // The official code sizes images within [MIN_PIXELS, MAX_PIXELS] (qwen-vl-utils), then the
    // checkpoint's processor within its own bounds: the two together are the checkpoint's budget
    // capped at 1,800 tokens (its minimum is above 4 tokens in every released checkpoint).
    let mut opts = opts.clone();
    if opts.max_pixels.is_none() {
        opts.max_image_tokens = Some(MAX_PIXELS / (32 * 32));
    }
    // Videos as the official code reads a video file: 1 frame a second, at most 64, sized by
    // qwen-vl-utils (an even count of frames, each within 128 to 768 tokens).
    opts.video.fps = opts.video.fps.or(Some(VIDEO_FPS));
    opts.video.max_frames = opts.video.max_frames.or(Some(VIDEO_MAX_FRAMES));
    let mut inner = crate::qwen3_vl::family::open(source, &opts, staged)?;
    inner.size_videos(ClipSizing::QwenVlUtils);
    Ok(inner)
}

/// `1_Pooling/config.json` (the Pooling module's path in `modules.json`) must ask for the last
/// token, the one pooling these checkpoints use; anything else is refused by name.
fn check_pooling(dir: &Path) -> Result<()> {
    let (path, v) = crate::formats::sentence_transformers::module_config(dir, "Pooling", "1_Pooling")?;
    let on: Vec<&str> = v
        .as_object()
        .into_iter()
        .flatten()
        .filter(|(k, x)| k.starts_with("pooling_mode_") && x.as_bool() == Some(true))
        .map(|(k, _)| k.as_str())
        .collect();
    if on != ["pooling_mode_lasttoken"] {
        return Err(Error::Config {
            path,
            field: "pooling_mode_*".into(),
            message: format!("{on:?}: only pooling_mode_lasttoken (the Qwen3-VL-Embedding checkpoints') is supported"),
        });
    }
    Ok(())
}

fn inspect_entry(source: &Source<'_>, json: bool) -> Result<String> {
    check_pooling(source.model)?;
    (crate::qwen3_vl::family::ENTRY.inspect)(source, json)
}

/// A loaded Qwen3-VL-Embedding model: Qwen3-VL, pooled.
pub struct Qwen3VlEmbedding {
    inner: Qwen3Vl,
}

/// The instruction as the official code writes it: trimmed, a period added when it does not end
/// with punctuation (Unicode category P: ASCII's and the common CJK and general punctuation).
pub fn instruction(text: &str) -> String {
    let t = text.trim();
    let Some(last) = t.chars().last() else { return DEFAULT_INSTRUCTION.into() };
    let punctuation = matches!(last, '!' | '"' | '#' | '%' | '&' | '\'' | '(' | ')' | '*' | ',' | '-' | '.' | '/')
        || matches!(last, ':' | ';' | '?' | '@' | '[' | '\\' | ']' | '_' | '{' | '}' | '¡' | '§' | '«' | '»' | '¿')
        || matches!(last as u32, 0x2010..=0x2027 | 0x2030..=0x205E | 0x3001..=0x3003 | 0x3008..=0x3011)
        || matches!(last as u32, 0x3014..=0x301F | 0xFF01..=0xFF03 | 0xFF05..=0xFF0A | 0xFF0C..=0xFF0F)
        || matches!(last as u32, 0xFF1A | 0xFF1B | 0xFF1F | 0xFF20 | 0xFF3B..=0xFF3D | 0xFF3F | 0xFF5B | 0xFF5D);
    if punctuation {
        t.to_string()
    } else {
        format!("{t}.")
    }
}

/// The official prompt of a request: its system message is the instruction (else the default);
/// the other messages' parts make one user turn, videos first, then images, then texts ("NULL"
/// when there are none). A raw `prompt` is a text.
pub fn templated(req: &Request) -> Result<Request> {
    let mut system = None;
    let (mut videos, mut images, mut texts) = (vec![], vec![], vec![]);
    if let Some(p) = &req.prompt {
        texts.push(Part::Text(p.clone()));
    }
    for (i, m) in req.messages.iter().enumerate() {
        if m.role == "system" {
            if system.is_some() {
                return Err(Error::Input { what: format!("messages[{i}]"), message: "a second system message".into() });
            }
            let mut t = String::new();
            for p in &m.parts {
                match p {
                    Part::Text(s) => t.push_str(s),
                    _ => {
                        return Err(Error::Input {
                            what: format!("messages[{i}]"),
                            message: "the system message is the instruction: text only".into(),
                        })
                    }
                }
            }
            system = Some(t);
            continue;
        }
        for p in &m.parts {
            match p {
                Part::Video { .. } => videos.push(p.clone()),
                Part::Image { .. } => images.push(p.clone()),
                Part::Text(_) => texts.push(p.clone()),
            }
        }
    }
    let mut user: Vec<Part> = videos.into_iter().chain(images).chain(texts).collect();
    if user.is_empty() {
        user.push(Part::Text("NULL".into()));
    }
    let system = instruction(system.as_deref().unwrap_or(DEFAULT_INSTRUCTION));
    Ok(Request {
        messages: vec![ChatMessage::text("system", &system), ChatMessage::user(user)],
        prompt: None,
        tools: vec![],
        constraint: None,
        stop: vec![],
        ..req.clone()
    })
}

impl Family for Qwen3VlEmbedding {
    fn name(&self) -> &'static str {
        ENTRY.name
    }
    crate::qwen3_vl::forward_family_to_inner!();
    fn task(&self) -> Task<'_> {
        Task::Pool(self)
    }
    fn prepare(&self, req: &Request, ctx: &MediaContext<'_>) -> Result<Prepared> {
        if !req.tools.is_empty() {
            return Err(Error::Input { what: "tools".into(), message: "an embedding model calls no function".into() });
        }
        self.inner.prepare(&templated(req)?, ctx)
    }
}

impl Pooler for Qwen3VlEmbedding {
    fn pooled(&self) -> Pooled {
        Pooled::Embedding { dims: self.inner.hidden_size() }
    }
    crate::qwen3_vl::forward_pool_states_to_inner!();
    fn pool(&self, inputs: &[PoolInput<'_>], states: &mut [&mut SeqState]) -> Result<Vec<Vec<f32>>> {
        let ends: Vec<usize> = inputs.iter().map(|i| i.ids.len()).collect();
        let rows = self.inner.prefill_rows(inputs, states, &ends)?.to_vec2::<f32>()?;
        Ok(rows.into_iter().map(crate::vectors::normalized).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn instructions_get_a_period_unless_they_end_with_punctuation() {
        assert_eq!(instruction("Find cats"), "Find cats.");
        assert_eq!(instruction("  Find cats?  "), "Find cats?");
        assert_eq!(instruction("找猫。"), "找猫。");
        assert_eq!(instruction("Sum $"), "Sum $.");
        assert_eq!(instruction(""), DEFAULT_INSTRUCTION);
    }

    #[test]
    fn a_request_becomes_the_official_turns() {
        let img = Part::image(vec![1, 2, 3]);
        let req = Request::user(vec![Part::text("a cat"), img.clone()]);
        let t = templated(&req).unwrap();
        assert_eq!(t.messages[0].role, "system");
        assert!(matches!(&t.messages[0].parts[0], Part::Text(s) if s == DEFAULT_INSTRUCTION));
        assert!(matches!(t.messages[1].parts[0], Part::Image { .. }));
        assert!(matches!(&t.messages[1].parts[1], Part::Text(s) if s == "a cat"));
        let empty =
            templated(&Request { messages: vec![ChatMessage::text("system", "Find dogs")], ..Default::default() })
                .unwrap();
        assert!(matches!(&empty.messages[0].parts[0], Part::Text(s) if s == "Find dogs."));
        assert!(matches!(&empty.messages[1].parts[0], Part::Text(s) if s == "NULL"));
    }
}
