//! Generation: prefill, then token-by-token decoding with the KV cache. Greedy by default;
//! temperature, top-k, top-p, min-p and repetition penalty applied in transformers' order
//! (penalty, temperature, top-k, top-p, min-p), seeded sampling, stop on eos ids or max tokens,
//! a callback per token.

use std::time::{Duration, Instant};

use candle_core::Tensor;

use super::model::{Prompt, Qwen3VlModel};
use crate::error::Result;
pub use crate::sampling::{apply_presence_frequency, check_logits, sample, GenerationOptions, TokenPicker};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    Eos,
    MaxTokens,
    /// The model's context (max_position_embeddings) is full.
    ContextFull,
    /// The callback asked to stop.
    Callback,
}

#[derive(Debug, Clone)]
pub struct Generation {
    /// Generated ids, the eos token included when it stopped generation.
    pub tokens: Vec<u32>,
    pub stop: StopReason,
    pub prompt_tokens: usize,
    /// Vision tower time (images and videos of the prompt).
    pub vision_time: Duration,
    /// Text prefill time (after the vision tower).
    pub prefill_time: Duration,
    pub decode_time: Duration,
    /// f32 logits that chose the first generated token.
    pub first_logits: Tensor,
    /// KV cache bytes at the end.
    pub cache_bytes: usize,
}

impl Qwen3VlModel {
    /// Generates a continuation of `prompt`. `on_token(id)` is called for every generated token
    /// in order; returning `false` stops generation.
    pub fn generate(
        &self,
        prompt: &Prompt,
        opts: &GenerationOptions,
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<Generation> {
        let t0 = Instant::now();
        let images = prompt.images.as_ref().map(|i| self.encode_vision(i)).transpose()?;
        let videos = prompt.videos.as_ref().map(|v| self.encode_vision(v)).transpose()?;
        let vision_time = t0.elapsed();
        let mut gen = self.generate_encoded(prompt, images.as_ref(), videos.as_ref(), opts, on_token)?;
        gen.vision_time = vision_time;
        Ok(gen)
    }

    /// Like `generate`, with the prompt's vision features already computed
    /// (`VisionTower::forward`); `vision_time` is then zero.
    pub fn generate_encoded(
        &self,
        prompt: &Prompt,
        images: Option<&super::vision::VisionOutput>,
        videos: Option<&super::vision::VisionOutput>,
        opts: &GenerationOptions,
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<Generation> {
        opts.validate()?;
        let vision_time = Duration::ZERO;
        let t0 = Instant::now();
        let mut cache = self.new_cache();
        let room = self.config().text.max_position_embeddings.saturating_sub(prompt.input_ids.len());
        cache.reserve(prompt.input_ids.len() + opts.max_new_tokens.min(room));
        let state = self.prefill_encoded(prompt, images, videos, &mut cache, &mut |_, _| {})?;
        let first_logits = self.last_logits(&state)?;
        let prefill_time = t0.elapsed();
        let t1 = Instant::now();
        let mut picker = TokenPicker::new(opts.clone(), &prompt.input_ids);
        let mut logits = first_logits.clone();
        let budget = opts.max_new_tokens.min(room);
        let mut stop = if room < opts.max_new_tokens { StopReason::ContextFull } else { StopReason::MaxTokens };
        for step in 0..budget {
            let next = picker.pick(logits.to_vec1::<f32>()?)?;
            if !on_token(next) {
                stop = StopReason::Callback;
                break;
            }
            if picker.is_eos(next) {
                stop = StopReason::Eos;
                break;
            }
            if step + 1 == budget {
                break;
            }
            logits = self.decode_rows(&[next], &mut [&mut cache])?.squeeze(0)?;
        }
        let tokens = picker.generated().to_vec();
        Ok(Generation {
            tokens,
            stop,
            prompt_tokens: prompt.input_ids.len(),
            vision_time,
            prefill_time,
            decode_time: t1.elapsed(),
            first_logits,
            cache_bytes: cache.bytes(),
        })
    }
}
