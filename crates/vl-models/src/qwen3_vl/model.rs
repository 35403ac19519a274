//! The composed model, mirroring `Qwen3VLModel` / `Qwen3VLForConditionalGeneration` in
//! transformers' `models/qwen3_vl/modeling_qwen3_vl.py`: token embeddings with vision rows
//! substituted at `<|image_pad|>` / `<|video_pad|>`, DeepStack rows added after the first
//! decoder layers at the visual positions, M-RoPE positions from the prompt layout, and the rope
//! delta kept for decoding.

use std::path::Path;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};

use super::config::Qwen3VlConfig;
use super::plan::{check_plan, plan_for, VISION_PREFIX};
use super::positions::{mrope_positions, token_types, TokenType};
use super::text::{Attend, DeepStack, QuantLoad, TextCache, TextModel};
use super::vision::{VisionOutput, VisionTower};
use super::weights::Weights;
use crate::error::{Error, Result};

pub use crate::media::VisionInput;

/// A tokenized prompt with its vision inputs, in prompt order.
#[derive(Debug, Clone, Default)]
pub struct Prompt {
    pub input_ids: Vec<u32>,
    pub images: Option<VisionInput>,
    pub videos: Option<VisionInput>,
    /// Where the ids the model generated begin (a preempted sequence prefilled again with its
    /// answer so far): those are text whatever their value, never media placeholders. `None`:
    /// every id is the prompt's.
    pub generated_from: Option<usize>,
}

/// The state a prompt leaves for decoding.
#[derive(Debug, Clone)]
pub struct PrefillOutput {
    /// Final-normed hidden states of every prompt position [n, hidden].
    pub hidden: Tensor,
    /// `max position + 1 - prompt length`: decoding step `k` (0-based, after the prompt) sits at
    /// position `prompt_len + k + rope_delta` on all three axes.
    pub rope_delta: i64,
    pub prompt_len: usize,
}

#[derive(Debug, Clone)]
pub struct Qwen3VlModel {
    cfg: Qwen3VlConfig,
    /// None once released (see `without_vision`): prompts must then come with encoded vision.
    vision: Option<VisionTower>,
    text: TextModel,
}

impl Qwen3VlModel {
    /// Loads a model directory: config, weights (checked against the tensor plan first).
    pub fn load(dir: &Path, dtype: DType, device: &Device) -> Result<Self> {
        Self::load_quantized(dir, dtype, device, None)
    }

    /// Loads a model directory (HF or MLX-community layout; MLX-quantized weights are
    /// dequantized exactly), quantizing the text decoder to `quant` when given.
    pub fn load_quantized(dir: &Path, dtype: DType, device: &Device, quant: Option<vl_nn::QuantType>) -> Result<Self> {
        let mut cfg = Qwen3VlConfig::from_dir(dir)?;
        let w = Arc::new(Weights::open(dir)?);
        cfg.follow_layout(&w);
        check_plan(&plan_for(&cfg, &w), &w)?;
        let read_as = w.text_float_dtype();
        let vision = VisionTower::load(&cfg.vision, w.var_builder(dtype, device, None).pp(VISION_PREFIX))?;
        let quant = quant.map(|qtype| QuantLoad { qtype, read_as });
        let text = TextModel::load_with(&cfg.text, cfg.tie_word_embeddings, w.var_builder(dtype, device, None), quant)?;
        Ok(Self { cfg, vision: Some(vision), text })
    }

    /// Loads with the text decoder quantized to `quant` (see `TextModel::load`).
    pub fn from_var_builder_quantized(
        cfg: Qwen3VlConfig,
        vb: candle_nn::VarBuilder,
        quant: Option<vl_nn::QuantType>,
    ) -> Result<Self> {
        let vision = VisionTower::load(&cfg.vision, vb.pp(VISION_PREFIX))?;
        let text = TextModel::load(&cfg.text, cfg.tie_word_embeddings, vb, quant)?;
        Ok(Self { cfg, vision: Some(vision), text })
    }

    pub fn config(&self) -> &Qwen3VlConfig {
        &self.cfg
    }
    /// A model from separately loaded parts; `vision` may be None when the caller encodes images
    /// beforehand (e.g. to free the tower before loading the text weights).
    pub fn from_parts(cfg: Qwen3VlConfig, vision: Option<VisionTower>, text: TextModel) -> Self {
        Self { cfg, vision, text }
    }

    pub fn vision(&self) -> Option<&VisionTower> {
        self.vision.as_ref()
    }
    pub fn text(&self) -> &TextModel {
        &self.text
    }
    pub fn new_cache(&self) -> TextCache {
        self.text.new_cache()
    }

    /// The model with its caches' KV rows kept in `dtype` (`TextModel::with_kv_dtype`).
    pub fn with_kv_dtype(self, dtype: DType) -> Self {
        Self { text: self.text.with_kv_dtype(dtype), ..self }
    }

    /// Runs the vision tower on every image (or video) of a prompt.
    pub fn encode_vision(&self, input: &VisionInput) -> Result<VisionOutput> {
        let tower = self.vision.as_ref().ok_or_else(|| Error::Input {
            what: "model".into(),
            message: "the vision tower was not loaded; pass encoded vision features".into(),
        })?;
        tower.forward(&input.pixels, &input.grids)
    }

    /// Prefills `cache` (which must be empty) with the prompt. `trace(k, h)` sees the embeddings
    /// after vision substitution (k = 0) and each decoder layer's output (k = layer + 1).
    pub fn prefill(
        &self,
        prompt: &Prompt,
        cache: &mut TextCache,
        trace: &mut dyn FnMut(usize, &Tensor),
    ) -> Result<PrefillOutput> {
        let images = prompt.images.as_ref().map(|i| self.encode_vision(i)).transpose()?;
        let videos = prompt.videos.as_ref().map(|v| self.encode_vision(v)).transpose()?;
        self.prefill_encoded(prompt, images.as_ref(), videos.as_ref(), cache, trace)
    }

    /// Like `prefill`, with the vision tower's outputs computed by the caller.
    pub fn prefill_encoded(
        &self,
        prompt: &Prompt,
        images: Option<&VisionOutput>,
        videos: Option<&VisionOutput>,
        cache: &mut TextCache,
        trace: &mut dyn FnMut(usize, &Tensor),
    ) -> Result<PrefillOutput> {
        if !cache.is_empty() {
            return Err(Error::Input {
                what: "cache".into(),
                message: format!("prefill needs an empty cache, it holds {} positions", cache.len()),
            });
        }
        self.prefill_from(prompt, images, videos, cache, trace)
    }

    /// Prefills the prompt positions after the `cache.len()` already cached (prefix reuse: the
    /// cache must hold exactly this prompt's first positions, and must not end inside an image's
    /// placeholder run). Positions, vision substitution and DeepStack rows are those of the whole
    /// prompt, so the result equals a full prefill's; only the new rows run through the decoder.
    /// `hidden` of the output holds the new rows.
    pub fn prefill_from(
        &self,
        prompt: &Prompt,
        images: Option<&VisionOutput>,
        videos: Option<&VisionOutput>,
        cache: &mut TextCache,
        trace: &mut dyn FnMut(usize, &Tensor),
    ) -> Result<PrefillOutput> {
        self.side().prefill_until(prompt, images, videos, cache, prompt.input_ids.len(), trace)
    }

    /// One decoding step for several sequences at once (see `TextSide::decode_rows`).
    pub fn decode_rows(&self, tokens: &[u32], caches: &mut [&mut TextCache]) -> Result<Tensor> {
        self.side().decode_rows(tokens, caches)
    }

    /// The text side, borrowed.
    pub fn side(&self) -> TextSide<'_> {
        TextSide { cfg: &self.cfg, text: &self.text }
    }

    /// Feeds one generated token at decoding step `step` (0 for the first token after the prompt)
    /// of the sequence `state` prefilled into `cache`; returns the f32 logits `[vocab]` of the next
    /// position.
    pub fn decode_step(&self, token: u32, state: &PrefillOutput, step: usize, cache: &mut TextCache) -> Result<Tensor> {
        if cache.len() != state.prompt_len + step || cache.position_offset != state.rope_delta {
            return Err(Error::Input {
                what: "cache".into(),
                message: format!(
                    "decoding step {step} of a {}-token prompt needs a cache of {} positions, it holds {}",
                    state.prompt_len,
                    state.prompt_len + step,
                    cache.len()
                ),
            });
        }
        Ok(self.decode_rows(&[token], &mut [cache])?.squeeze(0)?)
    }

    /// f32 logits `[vocab]` of the last prompt position.
    pub fn last_logits(&self, state: &PrefillOutput) -> Result<Tensor> {
        self.side().last_logits(state)
    }
}

/// What prefill and decode need of a loaded model, borrowed: the config and the text decoder.
#[derive(Clone, Copy)]
pub struct TextSide<'a> {
    pub cfg: &'a Qwen3VlConfig,
    pub text: &'a TextModel,
}

/// One prompt chunk's decoder input (`TextSide::chunk_rows`).
struct ChunkRows {
    /// Input rows [end - start, hidden].
    x: Tensor,
    positions: Vec<[i64; 3]>,
    /// Rows of `x` that hold media, ascending, and the DeepStack levels' rows for them.
    visual_rows: Vec<u32>,
    levels: Vec<Tensor>,
    rope_delta: i64,
}

impl TextSide<'_> {
    /// `prefill_from` for the positions `cache.len()..end` only (a chunk of a long prompt; the
    /// next chunk continues from the cache). Chunks give the same cache and rows as one prefill.
    pub fn prefill_until(
        &self,
        prompt: &Prompt,
        images: Option<&VisionOutput>,
        videos: Option<&VisionOutput>,
        cache: &mut TextCache,
        end: usize,
        trace: &mut dyn FnMut(usize, &Tensor),
    ) -> Result<PrefillOutput> {
        let start = cache.len();
        let rows = self.chunk_rows(prompt, images, videos, start, end)?;
        let deepstack =
            (!rows.visual_rows.is_empty()).then_some(DeepStack { positions: &rows.visual_rows, levels: &rows.levels });
        let hidden = self.text.forward(&rows.x, &rows.positions, cache, deepstack, trace)?;
        cache.position_offset = rows.rope_delta;
        cache.record_hidden(start, &hidden, &rows.positions)?;
        Ok(PrefillOutput { hidden, rope_delta: rows.rope_delta, prompt_len: prompt.input_ids.len() })
    }

    /// Several prompts' chunks in one forward pass: `items[i]` (a prompt and its image and
    /// video features) is prefilled from `caches[i].len()` to `ends[i]`, its rows attending as
    /// its own prefill would. Returns the final-normed hidden rows `[items, hidden]` of each
    /// chunk's last position (what pooling models read), in the model's dtype.
    pub fn prefill_rows(
        &self,
        items: &[(Prompt, Option<VisionOutput>, Option<VisionOutput>)],
        caches: &mut [&mut TextCache],
        ends: &[usize],
    ) -> Result<Tensor> {
        if items.len() != caches.len() || items.len() != ends.len() || items.is_empty() {
            return Err(Error::Input {
                what: "batch".into(),
                message: format!("{} prompts, {} states, {} ends", items.len(), caches.len(), ends.len()),
            });
        }
        let mut parts = Vec::with_capacity(items.len());
        for ((prompt, images, videos), (cache, &end)) in items.iter().zip(caches.iter().zip(ends)) {
            parts.push(self.chunk_rows(prompt, images.as_ref(), videos.as_ref(), cache.len(), end)?);
        }
        let lens: Vec<usize> = parts.iter().map(|p| p.positions.len()).collect();
        let x = Tensor::cat(&parts.iter().map(|p| &p.x).collect::<Vec<_>>(), 0)?;
        let positions: Vec<[i64; 3]> = parts.iter().flat_map(|p| p.positions.iter().copied()).collect();
        // DeepStack rows of every chunk, relative to the batch; each level joined over chunks.
        let mut visual_rows = Vec::new();
        let mut base = 0u32;
        for p in &parts {
            visual_rows.extend(p.visual_rows.iter().map(|r| r + base));
            base += p.positions.len() as u32;
        }
        let with: Vec<&ChunkRows> = parts.iter().filter(|p| !p.visual_rows.is_empty()).collect();
        let n_levels = with.iter().map(|p| p.levels.len()).min().unwrap_or(0);
        let levels: Vec<Tensor> = (0..n_levels)
            .map(|k| Tensor::cat(&with.iter().map(|p| &p.levels[k]).collect::<Vec<_>>(), 0))
            .collect::<candle_core::Result<_>>()?;
        let deepstack = (!visual_rows.is_empty()).then_some(DeepStack { positions: &visual_rows, levels: &levels });
        let hidden = self.text.forward_rows(&x, &positions, caches, &lens, deepstack, Attend::AsPrefill)?;
        for (cache, p) in caches.iter_mut().zip(&parts) {
            cache.position_offset = p.rope_delta;
        }
        let last: Vec<u32> = lens
            .iter()
            .scan(0u32, |at, &n| {
                *at += n as u32;
                Some(*at - 1)
            })
            .collect();
        Ok(hidden.index_select(&Tensor::from_vec(last, items.len(), hidden.device())?, 0)?)
    }

    /// The decoder's input for positions `start..end` of `prompt`: embeddings with the media
    /// rows substituted, their M-RoPE positions, and the DeepStack rows among them.
    fn chunk_rows(
        &self,
        prompt: &Prompt,
        images: Option<&VisionOutput>,
        videos: Option<&VisionOutput>,
        start: usize,
        end: usize,
    ) -> Result<ChunkRows> {
        let ids = &prompt.input_ids;
        if end <= start || end > ids.len() {
            return Err(Error::Input {
                what: "prefill".into(),
                message: format!("chunk {start}..{end} of a {}-token prompt", ids.len()),
            });
        }
        if ids.is_empty() {
            return Err(Error::Input { what: "prompt".into(), message: "no tokens".into() });
        }
        if start >= ids.len() {
            return Err(Error::Input {
                what: "cache".into(),
                message: format!("the cache holds {start} positions, the prompt only {}", ids.len()),
            });
        }
        let max = self.cfg.text.max_position_embeddings;
        if ids.len() > max {
            return Err(Error::Input {
                what: "prompt".into(),
                message: format!("{} tokens exceed the model's context of {max}", ids.len()),
            });
        }
        let media_end = prompt.generated_from.map_or(ids.len(), |g| g.min(ids.len()));
        let mut types = token_types(&ids[..media_end], self.cfg.image_token_id, self.cfg.video_token_id);
        types.resize(ids.len(), TokenType::Text);
        // Grids from the encoded features when given, else from the prompt's inputs.
        let grids = |enc: Option<&VisionOutput>, inp: &Option<VisionInput>| {
            enc.map(|o| o.grids.clone()).or_else(|| inp.as_ref().map(|v| v.grids.clone())).unwrap_or_default()
        };
        let (positions, rope_delta) = mrope_positions(
            &types,
            &grids(images, &prompt.images),
            &grids(videos, &prompt.videos),
            self.cfg.vision.spatial_merge_size,
        )?;

        let mut x = self.text.embed(ids)?;
        let mut visual_rows: Vec<u32> = Vec::new();
        let mut levels: Vec<Tensor> = Vec::new();
        // Per modality: substitute merged rows in order; collect DeepStack rows in sequence order.
        let mut ds_parts: Vec<(Vec<u32>, &VisionOutput)> = Vec::new();
        for (kind, out, name) in [(TokenType::Image, images, "image"), (TokenType::Video, videos, "video")] {
            let rows: Vec<u32> = types.iter().enumerate().filter(|(_, &t)| t == kind).map(|(i, _)| i as u32).collect();
            match out {
                None if rows.is_empty() => continue,
                None => {
                    return Err(Error::Input {
                        what: "prompt".into(),
                        message: format!("{} {name} placeholder tokens but no {name} input", rows.len()),
                    })
                }
                Some(out) => {
                    let merged = Tensor::cat(&out.merged, 0)?;
                    if merged.dim(0)? != rows.len() {
                        return Err(Error::Input {
                            what: "prompt".into(),
                            message: format!(
                                "{name} features and {name} tokens do not match: {} placeholder tokens, {} feature rows",
                                rows.len(),
                                merged.dim(0)?
                            ),
                        });
                    }
                    // Exact replacement: gather every row from [embeddings; merged rows].
                    let n = x.dim(0)? as u32;
                    let mut order: Vec<u32> = (0..n).collect();
                    for (j, &r) in rows.iter().enumerate() {
                        order[r as usize] = n + j as u32;
                    }
                    let all = Tensor::cat(&[&x, &merged.to_dtype(x.dtype())?], 0)?;
                    x = all.index_select(&Tensor::from_vec(order, n as usize, x.device())?, 0)?;
                    ds_parts.push((rows, out));
                }
            }
        }
        if !ds_parts.is_empty() {
            let n_levels = ds_parts.iter().map(|(_, o)| o.levels.len()).min().unwrap_or(0);
            // Order the visual rows by sequence position across modalities.
            let mut order: Vec<(u32, usize, usize)> = Vec::new(); // (row, part, index within part)
            for (p, (rows, _)) in ds_parts.iter().enumerate() {
                order.extend(rows.iter().enumerate().map(|(k, &r)| (r, p, k)));
            }
            order.sort_unstable();
            visual_rows = order.iter().map(|o| o.0).collect();
            for level in 0..n_levels {
                let per_part: Vec<Tensor> = ds_parts
                    .iter()
                    .map(|(_, o)| Tensor::cat(&o.levels[level], 0))
                    .collect::<candle_core::Result<_>>()?;
                let level_rows = if per_part.len() == 1 {
                    per_part[0].clone()
                } else {
                    let offsets: Vec<usize> = ds_parts
                        .iter()
                        .scan(0, |s, (r, _)| {
                            let o = *s;
                            *s += r.len();
                            Some(o)
                        })
                        .collect();
                    let gather: Vec<u32> = order.iter().map(|&(_, p, k)| (offsets[p] + k) as u32).collect();
                    let all = Tensor::cat(&per_part, 0)?;
                    all.index_select(&Tensor::from_slice(&gather, gather.len(), all.device())?, 0)?
                };
                levels.push(level_rows);
            }
        }
        if start > 0 || end < ids.len() {
            // Only the rows of this chunk run; DeepStack rows follow them.
            x = x.narrow(0, start, end - start)?;
            let keep: Vec<usize> =
                (0..visual_rows.len()).filter(|&i| (start..end).contains(&(visual_rows[i] as usize))).collect();
            if keep.len() != visual_rows.len() {
                let idx = Tensor::from_vec(keep.iter().map(|&i| i as u32).collect::<Vec<_>>(), keep.len(), x.device())?;
                levels = levels.iter().map(|l| l.index_select(&idx, 0)).collect::<candle_core::Result<_>>()?;
                visual_rows = keep.iter().map(|&i| visual_rows[i] - start as u32).collect();
            } else {
                visual_rows.iter_mut().for_each(|r| *r -= start as u32);
            }
        }
        Ok(ChunkRows { x, positions: positions[start..end].to_vec(), visual_rows, levels, rope_delta })
    }

    /// One decoding step for several sequences at once: `tokens[i]` is fed to `caches[i]` at
    /// its next position (`len + position_offset`). Returns f32 logits [rows, vocab]; row `i`
    /// equals what that sequence would get decoding alone.
    pub fn decode_rows(&self, tokens: &[u32], caches: &mut [&mut TextCache]) -> Result<Tensor> {
        let max = self.cfg.text.max_position_embeddings;
        if let Some(c) = caches.iter().find(|c| c.len() + 1 > max) {
            return Err(Error::Input {
                what: "generation".into(),
                message: format!("context of {max} tokens is full ({} cached)", c.len()),
            });
        }
        let positions: Vec<[i64; 3]> = caches.iter().map(|c| [c.len() as i64 + c.position_offset; 3]).collect();
        let starts: Vec<usize> = caches.iter().map(|c| c.len()).collect();
        let x = self.text.embed(tokens)?;
        let lens = vec![1; tokens.len()];
        let h = self.text.forward_rows(&x, &positions, caches, &lens, None, Attend::AsDecoding)?;
        record_rows(caches, &starts, &lens, &h, &positions)?;
        self.text.logits(&h)
    }

    /// Several new positions for each of several sequences in one forward pass: `tokens[i]`
    /// continue `caches[i]` at its next positions. Returns f32 logits [total rows, vocab],
    /// sequence after sequence (`Generator::extend`).
    pub fn extend_rows(&self, tokens: &[Vec<u32>], caches: &mut [&mut TextCache]) -> Result<Tensor> {
        let max = self.cfg.text.max_position_embeddings;
        let mut positions = Vec::new();
        for (c, t) in caches.iter().zip(tokens) {
            if c.len() + t.len() > max {
                return Err(Error::Input {
                    what: "generation".into(),
                    message: format!("context of {max} tokens is full ({} cached, {} more)", c.len(), t.len()),
                });
            }
            let next = c.len() as i64 + c.position_offset;
            positions.extend((0..t.len() as i64).map(|j| [next + j; 3]));
        }
        let lens: Vec<usize> = tokens.iter().map(Vec::len).collect();
        let starts: Vec<usize> = caches.iter().map(|c| c.len()).collect();
        let flat: Vec<u32> = tokens.concat();
        let x = self.text.embed(&flat)?;
        let h = self.text.forward_rows(&x, &positions, caches, &lens, None, Attend::AsDecoding)?;
        record_rows(caches, &starts, &lens, &h, &positions)?;
        self.text.logits(&h)
    }

    /// f32 logits `[vocab]` of the last prompt position.
    pub fn last_logits(&self, state: &PrefillOutput) -> Result<Tensor> {
        let h = state.hidden.narrow(0, state.hidden.dim(0)? - 1, 1)?;
        Ok(self.text.logits(&h)?.squeeze(0)?)
    }
}

/// Each state's final hidden rows of a batched pass (`lens[i]` consecutive rows of `h` from its
/// position `starts[i]`), kept where a draft head reads them (`SeqState::record_hidden`).
fn record_rows(
    caches: &mut [&mut TextCache],
    starts: &[usize],
    lens: &[usize],
    h: &Tensor,
    positions: &[[i64; 3]],
) -> Result<()> {
    let mut at = 0;
    for ((c, &start), &n) in caches.iter_mut().zip(starts).zip(lens) {
        if c.keeps_hidden() {
            c.record_hidden(start, &h.narrow(0, at, n)?, &positions[at..at + n])?;
        }
        at += n;
    }
    Ok(())
}
