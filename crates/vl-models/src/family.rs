//! The seam between the engine and a model family: what a family gives the engine (turn a request
//! into prompt tokens and media, encode media, prefill from a position into a cache, one batched
//! decode step, a new cache, its context and tokenizer), and the registry that picks the family
//! of a checkpoint directory (`config.json`'s `architectures` / `model_type`) or a GGUF file
//! (`general.architecture`). The engine and the server name no family; adding one is a folder
//! and a line in `FAMILIES`.

use std::path::Path;

use candle_core::Tensor;
use tokenizers::Tokenizer;

use crate::engine::{EngineOptions, Request, VideoReport};
use crate::error::{Error, Result};
use crate::gguf::Recipe;
use crate::kv::SeqCache;
use crate::media::{Media, VisionOutput};
use crate::sampling::GenerationOptions;

/// What the KV cache holds per position: the token id and, at media placeholders, the media's
/// content key (0 elsewhere). Two prompts share a cached prefix where their identities agree.
pub type Identity = (u32, u64);

/// A request checked and turned into a prompt by its family.
#[derive(Debug, Clone)]
pub struct Prepared {
    /// The request's sampling options with the model's eos ids.
    pub options: GenerationOptions,
    pub ids: Vec<u32>,
    pub ident: Vec<Identity>,
    /// Every image and video of the prompt, in prompt order.
    pub media: Vec<Media>,
    pub image_tokens: usize,
    pub video_tokens: usize,
    pub videos: Vec<VideoReport>,
    /// Each image of the prompt, in order.
    pub images: Vec<ImageReport>,
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

/// What an image or video becomes under a pixel budget: its resized (height, width) and its
/// visual tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sizing {
    pub resized: (usize, usize),
    pub tokens: usize,
}

/// An image's sizing under the engine's budget, and under the checkpoint's own (to say when the
/// first scaled it below the second).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageSizing {
    pub ours: Sizing,
    pub checkpoint: Sizing,
}

/// A loaded model of one family, as the engine drives it. Every method takes `&self`: the
/// engine's scheduler thread owns the caches and calls in turn.
pub trait Family: Send + Sync {
    /// The family's name (`qwen3_vl`).
    fn name(&self) -> &'static str;
    /// The model's context in tokens.
    fn context(&self) -> usize;
    fn eos_token_ids(&self) -> &[u32];
    /// Rows of the logits a step returns (at least the tokenizer's vocabulary).
    fn vocab_size(&self) -> usize;
    fn tokenizer(&self) -> &Tokenizer;
    /// KV cache bytes one position of one sequence takes.
    fn kv_bytes_per_position(&self) -> usize;
    fn new_cache(&self) -> SeqCache;
    /// Checks a request (options, media headers and budgets, the prompt's length against the
    /// context: cheap checks before any pixel is decoded), then reads its media and tokenizes it.
    fn prepare(&self, req: &Request) -> Result<Prepared>;
    /// Runs the vision tower on one image or video.
    fn encode(&self, media: &Media) -> Result<VisionOutput>;
    /// A model loaded in stages (`open_staged`) loads its vision tower here (so that the load
    /// is not timed as encoding); a resident model does nothing.
    fn load_vision(&self) -> Result<()> {
        Ok(())
    }
    /// A model loaded in stages (`open_staged`) releases its vision tower and loads its text
    /// decoder here, so the two never peak together; a resident model does nothing.
    fn finish_loading(&self) -> Result<()> {
        Ok(())
    }
    /// Prefills `ids[cache.len()..end]` into `cache`; `features[i]` are `media[i]`'s (the
    /// prompt's media in order). `ids[prompt_len..]` are generated tokens (a preempted sequence
    /// prefilled again): text whatever their value, never media placeholders. Returns the f32
    /// logits [vocab] of position `end - 1` when `end == ids.len()`.
    fn prefill(
        &self,
        ids: &[u32],
        prompt_len: usize,
        media: &[Media],
        features: &[VisionOutput],
        cache: &mut SeqCache,
        end: usize,
    ) -> Result<Option<Tensor>>;
    /// One decoding step for several sequences: `tokens[i]` goes into `caches[i]`. Returns f32
    /// logits [rows, vocab]; row `i` equals that sequence's alone.
    fn decode(&self, tokens: &[u32], caches: &mut [&mut SeqCache]) -> Result<Tensor>;
    /// (group, storage, bytes) of the text decoder's weights, for reports.
    fn storage(&self) -> Vec<(String, String, usize)>;
    /// How a `width` x `height` image is sized (the header's size; nothing is decoded).
    fn image_sizing(&self, width: usize, height: usize) -> Result<ImageSizing>;
    /// How a video that `video` reports would be sized under the checkpoint's own budget (None
    /// when the family cannot say).
    fn checkpoint_video_sizing(&self, video: &VideoReport) -> Option<Sizing>;
    /// Tensors a load reads through `Source::progress` (progress bars; 0 when unknown).
    fn tensors_to_load(&self) -> usize {
        0
    }
    /// How the family's answers give boxes and points, and the fewest pixels a grounding
    /// request's images are sized to (within the engine's budget); None when it has no
    /// grounding convention.
    fn grounding(&self) -> Option<crate::grounding::Grounding> {
        None
    }
    /// The markers of the reasoning block a thinking checkpoint writes before its answer (split
    /// into `Completion::reasoning`); None when the family has none.
    fn reasoning(&self) -> Option<&crate::reasoning::Markers> {
        None
    }
}

/// `FamilyEntry::quantize`: (checkpoint directory, recipe, output directory, overwrite, progress)
/// -> what was written. It refuses, before writing, a recipe that would quantize no tensor, and
/// (unless `overwrite`) files that exist.
pub type QuantizeFn = fn(&Path, Recipe, &Path, bool, &mut dyn FnMut(&str)) -> Result<crate::gguf::Written>;

/// How a family is found and loaded.
pub struct FamilyEntry {
    pub name: &'static str,
    /// `config.json` `architectures` entries it loads.
    pub architectures: &'static [&'static str],
    /// `config.json` `model_type` values it loads.
    pub model_types: &'static [&'static str],
    /// GGUF `general.architecture` values it loads.
    pub gguf_architectures: &'static [&'static str],
    /// Loads a checkpoint directory or GGUF file; `staged` defers the text decoder to
    /// `Family::finish_loading` and loads the vision tower at the first `encode`.
    pub open: fn(&Source<'_>, &EngineOptions, bool) -> Result<Box<dyn Family>>,
    /// `vl inspect`: every check a load makes, then what the files hold (text or JSON).
    pub inspect: fn(&Source<'_>, bool) -> Result<String>,
    /// `vl quantize`: a checkpoint directory written as GGUF (text model and vision projector,
    /// in the peers' names); returns both paths. `progress` sees each tensor written.
    pub quantize: QuantizeFn,
    /// The k-quant a model's own quantization maps to when `--quantize` is not given (an MLX
    /// 4-bit checkpoint: Q4K); None to keep the stored weights.
    pub default_quant: fn(&Path) -> Result<Option<vl_nn::QuantType>>,
}

/// Where a model is: a checkpoint directory or a GGUF file (with its vision projector).
#[derive(Clone, Copy)]
pub struct Source<'a> {
    pub model: &'a Path,
    pub mmproj: Option<&'a Path>,
    /// Called with each tensor's key as it is loaded (progress bars).
    pub progress: Option<&'a crate::checkpoint::LoadProgress>,
}

/// Every family this build runs.
pub static FAMILIES: &[&FamilyEntry] = &[&crate::qwen3_vl::family::ENTRY, &crate::qwen3_vl_moe::ENTRY];

/// What identifies a model's family.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Architecture {
    /// `config.json`'s `architectures` and `model_type`.
    Config { architectures: Vec<String>, model_type: Option<String> },
    /// GGUF `general.architecture`.
    Gguf(String),
}

/// The family that loads `arch`, or an error naming what was found and what is supported.
pub fn lookup(arch: &Architecture, origin: &Path) -> Result<&'static FamilyEntry> {
    // Nothing readable names the architecture (a missing or broken config.json): the first
    // family loads it, and its own checks name what is wrong.
    if *arch == (Architecture::Config { architectures: vec![], model_type: None }) {
        return Ok(FAMILIES[0]);
    }
    let found = FAMILIES.iter().copied().find(|f| match arch {
        Architecture::Config { architectures, model_type } => {
            architectures.iter().any(|a| f.architectures.contains(&a.as_str()))
                || (architectures.is_empty() && model_type.as_deref().is_some_and(|m| f.model_types.contains(&m)))
        }
        Architecture::Gguf(a) => f.gguf_architectures.contains(&a.as_str()),
    });
    found.ok_or_else(|| {
        if *arch == Architecture::Gguf("clip".into()) {
            return Error::Input {
                what: origin.display().to_string(),
                message: "general.architecture \"clip\" is a vision projector, not a text model: pass it with --mmproj beside --model TEXT.gguf".into(),
            };
        }
        let (what, supported): (String, Vec<&str>) = match arch {
            Architecture::Config { architectures, model_type } => (
                format!(
                    "architectures {architectures:?}{}",
                    model_type.as_ref().map(|m| format!(", model_type {m:?}")).unwrap_or_default()
                ),
                FAMILIES.iter().flat_map(|f| f.architectures.iter().copied()).collect(),
            ),
            Architecture::Gguf(a) => (
                format!("GGUF general.architecture {a:?}"),
                FAMILIES.iter().flat_map(|f| f.gguf_architectures.iter().copied()).collect(),
            ),
        };
        Error::Input {
            what: origin.display().to_string(),
            message: format!("unsupported architecture: {what}; this build supports {}", supported.join(", ")),
        }
    })
}

/// Reads what identifies the model at `path` (a directory's config.json, or a GGUF header).
pub fn architecture(path: &Path) -> Result<Architecture> {
    if crate::gguf::is_gguf(path) {
        let file = crate::gguf::find_text_file(path)?;
        return Ok(Architecture::Gguf(crate::gguf::architecture(&file)?));
    }
    let config = path.join("config.json");
    // A directory without one (a broken link counts as one: its read names it) is no model; the
    // weights are not looked for (`run` and `inspect` say the same).
    if path.is_dir() && config.symlink_metadata().is_err() {
        return Err(Error::not_a_model_dir(path));
    }
    let v: serde_json::Value = crate::limits::read_text(&config, crate::limits::MAX_METADATA_FILE_BYTES)
        .ok()
        .and_then(|text| serde_json::from_str(&text).ok())
        .unwrap_or_default();
    let architectures = v
        .get("architectures")
        .and_then(|a| a.as_array())
        .map(|a| a.iter().filter_map(|s| s.as_str().map(String::from)).collect())
        .unwrap_or_default();
    let model_type = v.get("model_type").and_then(|m| m.as_str()).map(String::from);
    Ok(Architecture::Config { architectures, model_type })
}

/// Loads the model at `source` with the family its files name.
pub fn open(source: &Source<'_>, opts: &EngineOptions) -> Result<Box<dyn Family>> {
    let entry = lookup(&architecture(source.model)?, source.model)?;
    (entry.open)(source, opts, false)
}

/// `vl inspect` for the model at `source`, with the family its files name.
pub fn inspect(source: &Source<'_>, json: bool) -> Result<String> {
    let entry = lookup(&architecture(source.model)?, source.model)?;
    (entry.inspect)(source, json)
}

/// `vl quantize` for the checkpoint directory `model`, with the family its files name.
pub fn quantize(
    model: &Path,
    recipe: Recipe,
    out: &Path,
    overwrite: bool,
    progress: &mut dyn FnMut(&str),
) -> Result<crate::gguf::Written> {
    let entry = lookup(&architecture(model)?, model)?;
    (entry.quantize)(model, recipe, out, overwrite, progress)
}

/// The quantization a model loads with when none is asked for (see `FamilyEntry::default_quant`).
pub fn default_quant(model: &Path) -> Result<Option<vl_nn::QuantType>> {
    let entry = lookup(&architecture(model)?, model)?;
    (entry.default_quant)(model)
}

/// `open`, in stages: the vision tower at the first `encode`, the text decoder at
/// `finish_loading` (after the tower is released). For one answer from a cold start.
pub fn open_staged(source: &Source<'_>, opts: &EngineOptions) -> Result<Box<dyn Family>> {
    let entry = lookup(&architecture(source.model)?, source.model)?;
    (entry.open)(source, opts, true)
}
