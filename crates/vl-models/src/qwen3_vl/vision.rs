//! The Qwen3-VL vision tower, mirroring `Qwen3VLVisionModel` in transformers'
//! `models/qwen3_vl/modeling_qwen3_vl.py` (helpers from `vision_utils.py`).
//!
//! Patch embed (Conv3d with kernel = stride, as one matmul over patch rows), learned position
//! embedding bilinearly resampled (align_corners) to each grid in block-major order, 2-axis
//! rotary, pre-norm blocks with per-image (per-frame) attention segments, DeepStack taps through
//! post-shuffle-norm mergers, and the final merger.

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{LayerNorm, Linear, VarBuilder};
use vl_nn::grid::{bilinear_taps_block_major, block_major_positions, cumulative};
use vl_nn::linear::{Dense, Then};
use vl_nn::{PatchMerger, SegmentRotaryAttention, TwoAxisRope};

use super::config::VisionConfig;
use crate::error::{Error, Result};

/// LayerNorm epsilon of every vision norm (hard-coded in the reference).
const LN_EPS: f64 = 1e-6;

pub use crate::media::{Grid, VisionOutput};

fn layer_norm(dim: usize, vb: VarBuilder) -> Result<LayerNorm> {
    Ok(LayerNorm::new(vb.get(dim, "weight")?, vb.get(dim, "bias")?, LN_EPS))
}

fn linear(i: usize, o: usize, vb: VarBuilder) -> Result<Linear> {
    Ok(candle_nn::linear(i, o, vb)?)
}

fn merger(cfg: &VisionConfig, postshuffle: bool, vb: VarBuilder) -> Result<PatchMerger> {
    let unit = cfg.spatial_merge_size * cfg.spatial_merge_size;
    let merged = cfg.hidden_size * unit;
    let norm = layer_norm(if postshuffle { merged } else { cfg.hidden_size }, vb.pp("norm"))?;
    let fc1 = linear(merged, merged, vb.pp("linear_fc1"))?;
    let fc2 = linear(merged, cfg.out_hidden_size, vb.pp("linear_fc2"))?;
    Ok(PatchMerger::new(norm, &fc1, &fc2, unit, postshuffle)?)
}

/// `x = x + attn(norm1(x)); x = x + mlp(norm2(x))`, MLP with tanh-approximated GELU.
#[derive(Debug, Clone)]
struct VisionBlock {
    norm1: LayerNorm,
    norm2: LayerNorm,
    attn: SegmentRotaryAttention,
    fc1: Dense,
    fc2: Dense,
}

impl VisionBlock {
    fn load(cfg: &VisionConfig, vb: VarBuilder) -> Result<Self> {
        let h = cfg.hidden_size;
        let attn = SegmentRotaryAttention::new(
            &linear(h, 3 * h, vb.pp("attn.qkv"))?,
            &linear(h, h, vb.pp("attn.proj"))?,
            cfg.num_heads,
            cfg.head_dim(),
        )?;
        Ok(Self {
            norm1: layer_norm(h, vb.pp("norm1"))?,
            norm2: layer_norm(h, vb.pp("norm2"))?,
            attn,
            fc1: Dense::from_linear(&linear(h, cfg.intermediate_size, vb.pp("mlp.linear_fc1"))?)?,
            fc2: Dense::from_linear(&linear(cfg.intermediate_size, h, vb.pp("mlp.linear_fc2"))?)?,
        })
    }

    fn to_dtype(&self, d: DType) -> Result<Self> {
        use vl_nn::linear::cast_layer_norm;
        Ok(Self {
            norm1: cast_layer_norm(&self.norm1, d)?,
            norm2: cast_layer_norm(&self.norm2, d)?,
            attn: self.attn.to_dtype(d)?,
            fc1: self.fc1.to_dtype(d)?,
            fc2: self.fc2.to_dtype(d)?,
        })
    }

    /// Norms in f32, every linear on bf16 products.
    fn to_bf16(&self) -> Result<Self> {
        use vl_nn::linear::cast_layer_norm;
        Ok(Self {
            norm1: cast_layer_norm(&self.norm1, DType::F32)?,
            norm2: cast_layer_norm(&self.norm2, DType::F32)?,
            attn: self.attn.to_bf16()?,
            fc1: self.fc1.to_bf16()?,
            fc2: self.fc2.to_bf16()?,
        })
    }

    fn forward(&self, x: &Tensor, cos: &Tensor, sin: &Tensor, cu: &[usize]) -> Result<Tensor> {
        // The GELU and both residual sums are taken by the linears as they write their output
        // tiles (`Then`), not in passes of their own.
        let x = self.attn.forward_add(&self.norm1.forward(x)?, cos, sin, cu, x)?;
        let h = self.fc1.forward_then(&self.norm2.forward(&x)?, Then::GeluTanh)?;
        Ok(self.fc2.forward_then(&h, Then::Add(&x))?)
    }
}

#[derive(Debug, Clone)]
pub struct VisionTower {
    cfg: VisionConfig,
    patch_embed: Dense,
    pos_embed: Tensor,
    rope: TwoAxisRope,
    blocks: Vec<VisionBlock>,
    merger: PatchMerger,
    deepstack: Vec<PatchMerger>,
    /// Compute dtype.
    dtype: DType,
    /// Dtype the blocks and mergers are kept in; when it differs from `dtype` each is upcast
    /// for its forward only (e.g. bf16 weights of a bf16 checkpoint, computed in f32: exact,
    /// half the resident memory).
    stored: DType,
    device: Device,
}

impl VisionTower {
    /// `vb` points at the tower's prefix (`model.visual`).
    pub fn load(cfg: &VisionConfig, vb: VarBuilder) -> Result<Self> {
        let d = vb.dtype();
        Self::load_stored(cfg, vb, d)
    }

    /// Loads the blocks and mergers in `vb`'s dtype (their storage) and computes in `compute`:
    /// each is upcast for its own forward only. The patch embedding and position table (small)
    /// are kept in `compute`.
    pub fn load_stored(cfg: &VisionConfig, vb: VarBuilder, compute: DType) -> Result<Self> {
        let h = cfg.hidden_size;
        let (c, t, p) = (cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size);
        let w = vb.get((h, c, t, p, p), "patch_embed.proj.weight")?.reshape((h, cfg.patch_row_len()))?;
        let b = vb.get(h, "patch_embed.proj.bias")?;
        let blocks =
            (0..cfg.depth).map(|i| VisionBlock::load(cfg, vb.pp(format!("blocks.{i}")))).collect::<Result<_>>()?;
        let deepstack = (0..cfg.deepstack_visual_indexes.len())
            .map(|j| merger(cfg, true, vb.pp(format!("deepstack_merger_list.{j}"))))
            .collect::<Result<_>>()?;
        Ok(Self {
            cfg: cfg.clone(),
            patch_embed: Dense::from_linear(&Linear::new(w.to_dtype(compute)?, Some(b.to_dtype(compute)?)))?,
            pos_embed: vb.get((cfg.num_position_embeddings, h), "pos_embed.weight")?.to_dtype(compute)?,
            rope: TwoAxisRope::new(cfg.head_dim(), cfg.rope_theta),
            blocks,
            merger: merger(cfg, false, vb.pp("merger"))?,
            deepstack,
            dtype: compute,
            stored: vb.dtype(),
            device: vb.device().clone(),
        })
    }

    /// The tower with every linear (patch embedding, blocks, mergers) on bf16 products:
    /// `vl_nn::bf16` (AMX tiles, or AVX512-BF16), weights rounded to bf16 here, activations at
    /// each product, f32 sums; on AMX at head dimension 64 the attention's two products too (its
    /// softmax in f32); norms,
    /// GELU and residuals stay f32. For f32 compute on a CPU whose
    /// `vl_nn::bf16::available()`; an error saying what is missing otherwise. Converted block by
    /// block, each original dropped as its copy is made (the transient is one block).
    pub fn into_bf16_products(self) -> Result<Self> {
        if self.dtype != DType::F32 || !self.device.is_cpu() {
            return Err(Error::Input {
                what: "vision precision bf16".into(),
                message: format!("needs f32 compute on the CPU (here {:?} on {:?})", self.dtype, self.device),
            });
        }
        let Self { cfg, patch_embed, pos_embed, rope, blocks, merger, deepstack, dtype, device, .. } = self;
        let blocks = blocks.into_iter().map(|b| b.to_bf16()).collect::<Result<Vec<_>>>()?;
        Ok(Self {
            cfg,
            patch_embed: patch_embed.to_bf16()?,
            pos_embed,
            rope,
            blocks,
            merger: merger.to_bf16()?,
            deepstack: deepstack.iter().map(|m| m.to_bf16()).collect::<std::result::Result<_, _>>()?,
            dtype,
            stored: dtype,
            device,
        })
    }

    /// Whether the linears run on bf16 products (`into_bf16_products`).
    pub fn is_bf16_products(&self) -> bool {
        self.patch_embed.is_bf16()
    }

    fn merger_in_compute<'a>(&self, m: &'a PatchMerger) -> Result<std::borrow::Cow<'a, PatchMerger>> {
        Ok(if self.stored == self.dtype {
            std::borrow::Cow::Borrowed(m)
        } else {
            std::borrow::Cow::Owned(m.to_dtype(self.dtype)?)
        })
    }

    pub fn config(&self) -> &VisionConfig {
        &self.cfg
    }

    /// Use `rows` query rows per attention block (memory/speed trade-off).
    pub fn set_query_block(&mut self, rows: usize) {
        for b in &mut self.blocks {
            b.attn = b.attn.clone().with_query_block(rows);
        }
    }

    /// Query and key rows per tile of the fused CPU attention (tests and tuning).
    pub fn set_attention_tiles(&mut self, query_rows: usize, key_rows: usize) {
        for b in &mut self.blocks {
            b.attn = b.attn.clone().with_query_block(query_rows).with_key_block(key_rows);
        }
    }

    /// Number of merged rows (LLM tokens) an input of this grid produces.
    pub fn merged_len(&self, g: &Grid) -> usize {
        g[0] * g[1] * g[2] / (self.cfg.spatial_merge_size * self.cfg.spatial_merge_size)
    }

    /// `pixels`: patch rows [sum t*h*w, C*T*P*P] for all inputs, in order; `grids`: one per input.
    pub fn forward(&self, pixels: &Tensor, grids: &[Grid]) -> Result<VisionOutput> {
        self.forward_traced(pixels, grids, &mut |_, _| {})
    }

    /// Like `forward`, calling `trace(name, tensor)` with every intermediate: `patch_embed`,
    /// `pos_embed` (after adding it), `block.<i>`, `deepstack.<j>`, `merged`.
    pub fn forward_traced(
        &self,
        pixels: &Tensor,
        grids: &[Grid],
        trace: &mut dyn FnMut(&str, &Tensor),
    ) -> Result<VisionOutput> {
        self.check_input(pixels, grids)?;
        let x = self.patch_embed.forward(&pixels.to_dtype(self.dtype)?)?;
        trace("patch_embed", &x);
        let x = (x + self.position_embedding(grids)?)?;
        trace("pos_embed", &x);

        let merge = self.cfg.spatial_merge_size;
        let mut positions = Vec::with_capacity(x.dim(0)?);
        for &[t, h, w] in grids {
            let frame = block_major_positions(h, w, merge);
            for _ in 0..t {
                positions.extend_from_slice(&frame);
            }
        }
        let (cos, sin) = self.rope.cos_sin(&positions, &self.device)?;
        let cu = cumulative(grids.iter().flat_map(|&[t, h, w]| std::iter::repeat_n(h * w, t)));

        let mut x = x;
        let mut deepstack = Vec::with_capacity(self.deepstack.len());
        let depth = self.blocks.len();
        crate::progress::report("vision tower", "blocks", 0, depth);
        for (i, block) in self.blocks.iter().enumerate() {
            x = if self.stored == self.dtype {
                block.forward(&x, &cos, &sin, &cu)?
            } else {
                block.to_dtype(self.dtype)?.forward(&x, &cos, &sin, &cu)?
            };
            trace(&format!("block.{i}"), &x);
            crate::progress::report("vision tower", "blocks", i + 1, depth);
            if let Some(j) = self.cfg.deepstack_visual_indexes.iter().position(|&d| d == i) {
                let f = self.merger_in_compute(&self.deepstack[j])?.forward(&x)?;
                trace(&format!("deepstack.{j}"), &f);
                // Levels in block order, as the reference appends them (not in merger-index order).
                deepstack.push(f);
            }
        }
        let merged = self.merger_in_compute(&self.merger)?.forward(&x)?;
        trace("merged", &merged);
        let sizes: Vec<usize> = grids.iter().map(|g| self.merged_len(g)).collect();
        Ok(VisionOutput {
            merged: split_rows(&merged, &sizes)?,
            levels: deepstack.iter().map(|f| split_rows(f, &sizes)).collect::<Result<_>>()?,
            grids: grids.to_vec(),
        })
    }

    fn check_input(&self, pixels: &Tensor, grids: &[Grid]) -> Result<()> {
        let bad = |message: String| Error::Input { what: "vision input".into(), message };
        let (rows, cols) =
            pixels.dims2().map_err(|_| bad(format!("pixel rows must be 2-D, got {:?}", pixels.dims())))?;
        if cols != self.cfg.patch_row_len() {
            return Err(bad(format!("patch rows have {cols} values, expected {}", self.cfg.patch_row_len())));
        }
        let merge = self.cfg.spatial_merge_size;
        for g in grids {
            if g.contains(&0) || g[1] % merge != 0 || g[2] % merge != 0 {
                return Err(bad(format!("grid {g:?} must be non-empty with h, w multiples of {merge}")));
            }
        }
        let want: usize = grids.iter().map(|g| g[0] * g[1] * g[2]).sum();
        if rows != want {
            return Err(bad(format!("{rows} patch rows but the grids {grids:?} need {want}")));
        }
        Ok(())
    }

    /// The learned table resampled to every input's grid (repeated over frames): [rows, hidden].
    fn position_embedding(&self, grids: &[Grid]) -> Result<Tensor> {
        let side = self.cfg.num_grid_per_side();
        let mut idx = Vec::new();
        let mut wts = Vec::new();
        for &[t, h, w] in grids {
            let taps = bilinear_taps_block_major(h, w, side, self.cfg.spatial_merge_size);
            for _ in 0..t {
                for tap in &taps {
                    for &(i, wt) in tap {
                        idx.push(i as u32);
                        wts.push(wt);
                    }
                }
            }
        }
        Ok(vl_nn::kernels::weighted_row_sum(&self.pos_embed, &idx, &wts, 4)?)
    }
}

fn split_rows(t: &Tensor, sizes: &[usize]) -> Result<Vec<Tensor>> {
    let mut out = Vec::with_capacity(sizes.len());
    let mut start = 0;
    for &n in sizes {
        out.push(t.narrow(0, start, n)?);
        start += n;
    }
    Ok(out)
}
