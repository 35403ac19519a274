//! The seam between the engine and a model family: what a family gives the engine (turn a request
//! into prompt tokens and media, encode media, prefill from a position into a sequence's state,
//! one batched decode step, a new state, its context and tokenizer), the options it loads with,
//! and the entry the registry (the one file that names the families) lists.
//! Nothing here names the engine or a family.

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use tokenizers::Tokenizer;
use vl_nn::QuantType;

use crate::error::Result;
use crate::gguf::Recipe;
use crate::limits::ImageLimits;
use crate::media::{Media, MediaContext, VisionOutput};
use crate::request::{ImageReport, Request, VideoReport};
use crate::sampling::GenerationOptions;
use crate::state::SeqState;
use crate::video::{VideoLimits, VideoOptions};

/// What a sequence's state holds at one position: the token id and, at media placeholders, the
/// media's content key (0 elsewhere). Two prompts share a cached prefix where their identities
/// agree.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Identity {
    pub token: u32,
    /// The media's content key at a placeholder; 0 for text.
    pub media: u64,
}

impl Identity {
    /// A text position.
    pub fn text(token: u32) -> Self {
        Self { token, media: 0 }
    }
}

/// Visual tokens per image an engine allows unless told otherwise: the Qwen team's suggested
/// balance (1280 x 32 x 32 pixels for Qwen3-VL). The checkpoints' own budget (16384 tokens, 16.7 M
/// pixels) turns a 12 MP photo into ~47k patches: hours of vision tower on a CPU.
pub const DEFAULT_MAX_IMAGE_TOKENS: usize = 1280;

/// A video's pixel budget (frames x height x width over the sampled clip) an engine allows
/// unless told otherwise: 2560 visual tokens (frame pairs of 32x32-pixel tokens), about a 10 s
/// clip at 2 frames a second at 512x512. The checkpoints' own (25 M pixels, ~12k tokens) takes
/// many minutes of vision tower and prefill on a CPU.
pub const DEFAULT_MAX_VIDEO_PIXELS: usize = 2560 * 2 * 32 * 32;

/// What a family sees of the engine's options: how the model loads (device, dtype, quantization,
/// the vision tower's precision) and the media budget (pixels, tokens, video settings, input
/// limits).
#[derive(Debug, Clone)]
pub struct ModelOptions {
    pub dtype: DType,
    pub device: Device,
    pub quant: Option<QuantType>,
    /// Run the vision tower's linears (and, on AMX at head dimension 64, its attention products)
    /// on bf16 operands with f32 sums (AMX tiles, or AVX512-BF16; reduced precision, bound in
    /// docs/parity.md) instead of f32. CPU, f32 compute, AMX-BF16 or AVX512-BF16 only: refused
    /// elsewhere.
    pub vision_bf16: bool,
    /// The dtype the KV cache keeps its rows in; None: the compute dtype. f16 or bf16 under f32
    /// compute on the CPU halves the cache (read in place by the decode kernel, widened to f32;
    /// the bound in docs/parity.md); refused elsewhere.
    pub kv_dtype: Option<DType>,
    /// Server-wide image budget (defaults from preprocessor_config.json); a request may ask for
    /// less, never more.
    pub min_pixels: Option<usize>,
    pub max_pixels: Option<usize>,
    /// Cap on visual tokens per image when `max_pixels` is not given (`None`: the checkpoint's
    /// own budget). Default `DEFAULT_MAX_IMAGE_TOKENS`.
    pub max_image_tokens: Option<usize>,
    pub image_limits: ImageLimits,
    /// Server-wide video settings over the checkpoint's video processor (a request may ask for
    /// fewer frames or pixels, never more). `max_pixels` given here wins over `video_pixel_cap`.
    pub video: VideoOptions,
    /// Cap on a video's pixel budget when `video.max_pixels` is not given (`None`: the
    /// checkpoint's own). Default `DEFAULT_MAX_VIDEO_PIXELS`.
    pub video_pixel_cap: Option<usize>,
    pub video_limits: VideoLimits,
    /// A draft head's picks (`speculative: mtp`) among the first this many token ids only
    /// (BPE vocabularies rank their frequent merges first): its lm_head product shrinks by the
    /// vocabulary over this; drafts of rarer tokens are lost, answers never change. None: the
    /// whole vocabulary.
    pub draft_vocab: Option<usize>,
}

impl Default for ModelOptions {
    fn default() -> Self {
        Self {
            dtype: DType::F32,
            device: Device::Cpu,
            quant: None,
            vision_bf16: false,
            kv_dtype: None,
            min_pixels: None,
            max_pixels: None,
            max_image_tokens: Some(DEFAULT_MAX_IMAGE_TOKENS),
            image_limits: ImageLimits::default(),
            video: VideoOptions::default(),
            video_pixel_cap: Some(DEFAULT_MAX_VIDEO_PIXELS),
            video_limits: VideoLimits::default(),
            draft_vocab: None,
        }
    }
}

/// A request checked and turned into a prompt by its family.
#[derive(Debug, Clone, Default)]
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
/// engine's scheduler thread owns the sequences' states and calls in turn. What is common to
/// every kind of model is here: the request made into a prompt, the media encoded, the
/// tokenizer; what the model then does with a prompt is its `task`.
pub trait Family: Send + Sync {
    /// The family's name, as the registry lists it.
    fn name(&self) -> &'static str;
    /// The model's context in tokens.
    fn context(&self) -> usize;
    /// Rows of the logits a step returns (at least the tokenizer's vocabulary).
    fn vocab_size(&self) -> usize;
    fn tokenizer(&self) -> &Tokenizer;
    /// What the model does with a prepared prompt: generate text, or pool it into a vector or
    /// a score.
    fn task(&self) -> Task<'_>;
    /// Checks a request (media headers and budgets, the prompt's length against the context:
    /// cheap checks before any pixel is decoded), then reads its media and tokenizes it. The
    /// engine checked what is not the family's (options, messages, stop strings) first; `ctx`
    /// holds the request's decode-time budget and the clip cache.
    fn prepare(&self, req: &Request, ctx: &MediaContext<'_>) -> Result<Prepared>;
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
    /// (group, storage, bytes) of the text decoder's weights, for reports.
    fn storage(&self) -> Vec<(String, String, usize)>;
    /// How a `width` x `height` image is sized (the header's size; nothing is decoded).
    fn image_sizing(&self, width: usize, height: usize) -> Result<ImageSizing>;
    /// How a video that `video` reports would be sized under the checkpoint's own budget (None
    /// when the family cannot say).
    fn checkpoint_video_sizing(&self, video: &VideoReport) -> Option<Sizing>;
    /// What the load found and left unused, a line each for the user to see (config keys not
    /// understood); empty when nothing.
    fn load_warnings(&self) -> Vec<String> {
        Vec::new()
    }
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
    /// How the family's chat template writes a function call (the form tool-call constraints
    /// hold answers to).
    fn tool_call_format(&self) -> crate::decoding::constraint::CallFormat {
        crate::decoding::constraint::CallFormat::Json
    }
}

/// What a model does with a prepared prompt.
#[derive(Clone, Copy)]
pub enum Task<'a> {
    /// Generates text token by token (a chat model).
    Generate(&'a dyn Generator),
    /// Turns the whole prompt into one vector or score (an embedding or reranker model).
    Pool(&'a dyn Pooler),
}

/// A model that generates: sequences prefilled in chunks and decoded in batched steps, each
/// holding a `SeqState`.
pub trait Generator: Send + Sync {
    fn eos_token_ids(&self) -> &[u32];
    /// KV cache bytes one position of one sequence takes (0 for a family without attention
    /// layers).
    fn kv_bytes_per_position(&self) -> usize;
    /// Bytes one sequence's state takes whatever its length: its recurrent layers' states (0 for
    /// a family of attention layers only). Counted with the KV blocks at admission.
    fn fixed_state_bytes(&self) -> usize {
        0
    }
    /// An empty state for one sequence: a `LayerState` per decoder layer.
    fn new_state(&self) -> SeqState;
    /// Prefills `ids[state.len()..end]` into `state`; `features[i]` are `media[i]`'s (the
    /// prompt's media in order). `ids[prompt_len..]` are generated tokens (a preempted sequence
    /// prefilled again): text whatever their value, never media placeholders. Returns the f32
    /// logits `[vocab]` of position `end - 1` when `end == ids.len()`.
    fn prefill(
        &self,
        ids: &[u32],
        prompt_len: usize,
        media: &[Media],
        features: &[VisionOutput],
        state: &mut SeqState,
        end: usize,
    ) -> Result<Option<Tensor>>;
    /// One decoding step for several sequences: `tokens[i]` goes into `states[i]`. Returns f32
    /// logits [rows, vocab]; row `i` equals that sequence's alone.
    fn decode(&self, tokens: &[u32], states: &mut [&mut SeqState]) -> Result<Tensor>;
    /// Several new positions for each of several sequences (tokens being verified, or fed
    /// again): `tokens[i]` (at least one) go into `states[i]` in order. Returns f32 logits
    /// [total rows, vocab], sequence after sequence, each row the logits after its token, equal
    /// to what `decode` gives feeding them one at a time. This default does exactly that; a
    /// family overrides it with one forward pass over every row.
    fn extend(&self, tokens: &[Vec<u32>], states: &mut [&mut SeqState]) -> Result<Tensor> {
        let longest = tokens.iter().map(Vec::len).max().unwrap_or(0);
        let mut rows: Vec<Vec<Tensor>> = vec![Vec::new(); tokens.len()];
        for j in 0..longest {
            let live: Vec<usize> = (0..tokens.len()).filter(|&i| tokens[i].len() > j).collect();
            let step: Vec<u32> = live.iter().map(|&i| tokens[i][j]).collect();
            let mut refs: Vec<&mut SeqState> =
                states.iter_mut().enumerate().filter(|(i, _)| live.contains(i)).map(|(_, s)| &mut **s).collect();
            let logits = self.decode(&step, &mut refs)?;
            for (r, &i) in live.iter().enumerate() {
                rows[i].push(logits.narrow(0, r, 1)?);
            }
        }
        let all: Vec<Tensor> = rows.into_iter().flatten().collect();
        Ok(Tensor::cat(&all, 0)?)
    }
    /// A draft head the model carries (Qwen3.5's multi-token prediction, `speculative: mtp`);
    /// None when it has none. A sequence drafting with it keeps its final hidden rows
    /// (`SeqState::keep_hidden`): `prefill`, `decode` and `extend` record them.
    fn draft_head(&self) -> Option<&dyn DraftHead> {
        None
    }
}

/// A model's own draft head: one decoder layer over the model's final hidden row at a position
/// and the embedding of the token after it, whose output predicts the token after that
/// (DeepSeek-V3's and Qwen3.5's multi-token prediction). It keeps a KV cache of its own (a
/// `SeqState` of one attention layer).
pub trait DraftHead: Send + Sync {
    /// KV bytes one position of its state takes.
    fn kv_bytes_per_position(&self) -> usize;
    /// An empty state for one sequence.
    fn new_state(&self) -> SeqState;
    /// New entries for several sequences in one pass: `lens[i]` consecutive rows belong to
    /// `states[i]`; row r combines `hidden` row r (the model's final hidden row at a position,
    /// or the head's own output row for a further draft) with `tokens[r]` (the token after that
    /// position), at rotary `positions[r]`. Returns the head's output rows [rows, hidden] (what
    /// a further draft reads as its hidden row) and the f32 logits [picks, vocab] of the rows
    /// `picks`.
    fn forward(
        &self,
        tokens: &[u32],
        hidden: &Tensor,
        positions: &[[i64; 3]],
        states: &mut [&mut SeqState],
        lens: &[usize],
        picks: &[u32],
    ) -> Result<(Tensor, Tensor)>;
}

/// What each pooled row is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pooled {
    /// A vector of this many dimensions (an embedding).
    Embedding { dims: usize },
    /// One number: how well the prompt's document answers its query (a reranker).
    Score,
}

/// One prompt to pool: its tokens and its media with their features.
#[derive(Clone, Copy)]
pub struct PoolInput<'a> {
    pub ids: &'a [u32],
    pub media: &'a [Media],
    pub features: &'a [VisionOutput],
}

/// A model that pools: each prompt becomes one row (a vector or a score) from its prefill, no
/// decoding. The engine batches the prompts that wait into one forward pass, and serves the
/// prefixes they share (an instruction, a query) from states it prefilled once.
pub trait Pooler: Send + Sync {
    fn pooled(&self) -> Pooled;
    /// An empty state for one prompt.
    fn new_state(&self) -> SeqState;
    /// KV cache bytes one position of one prompt takes.
    fn kv_bytes_per_position(&self) -> usize;
    /// Prefills `inputs[i]`'s positions `states[i].len()..ends[i]` into `states[i]`, all in one
    /// forward pass (prefixes that other prompts share).
    fn prefill(&self, inputs: &[PoolInput<'_>], states: &mut [&mut SeqState], ends: &[usize]) -> Result<()>;
    /// Prefills the rest of each prompt into its state (empty, or holding a prefix of that
    /// prompt) in one forward pass, and pools it: one row per input, in order
    /// (`Pooled::Score`: rows of one value).
    fn pool(&self, inputs: &[PoolInput<'_>], states: &mut [&mut SeqState]) -> Result<Vec<Vec<f32>>>;
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
    /// The Sentence Transformers modules (`modules.json` beside the weights) that make a
    /// checkpoint this family, besides `Transformer` and `Normalize`: an embedding model's
    /// `sentence_transformers.models.Pooling`. Empty for a family of checkpoints without them.
    pub heads: &'static [&'static str],
    /// Loads a checkpoint directory or GGUF file; `staged` defers the text decoder to
    /// `Family::finish_loading` and loads the vision tower at the first `encode`.
    pub open: fn(&Source<'_>, &ModelOptions, bool) -> Result<Box<dyn Family>>,
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
