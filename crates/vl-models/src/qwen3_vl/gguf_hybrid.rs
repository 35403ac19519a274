//! `vl quantize` for Qwen3.5 (`qwen35`, `qwen35moe`): what llama.cpp's converter
//! (`conversion/qwen.py` of the pinned sdist: `Qwen3NextModel.modify_tensors`,
//! `_LinearAttentionVReorderBase`, `_QwenMtpMixin`) does to a checkpoint's tensors and metadata,
//! so that the files `vl quantize` writes hold what the converter's hold:
//! - value heads reordered from grouped by key head to tiled across key heads (where there are
//!   more value heads than key heads): `in_proj_qkv`'s value rows, `in_proj_z`, `in_proj_b`,
//!   `in_proj_a`, `A_log`, `dt_bias`, the convolution's value channels, `out_proj`'s columns;
//! - `A_log` stored as -exp(A_log), the convolution squeezed to [channels, kernel];
//! - every decoder RMSNorm but the DeltaNet's gated one stored with its +1 (the MTP head's too);
//! - the MTP head (`mtp.*`) as the block after the decoder's (`block_count` counts it,
//!   `nextn_predict_layers` says how many), its own tensors named `nextn.*`.

use candle_core::quantized::gguf_file::Value;
use candle_core::{DType, Tensor};

use super::config::{HybridConfig, Qwen3VlConfig};
use super::weights::TEXT_PREFIX;
use crate::error::Result;

const MTP_LAYERS: &str = "mtp.layers.";

/// The MTP head's whole-block tensors: checkpoint key -> llama.cpp's name within its block.
const MTP_TOP: &[(&str, &str)] = &[
    ("mtp.fc.weight", "nextn.eh_proj.weight"),
    ("mtp.pre_fc_norm_embedding.weight", "nextn.enorm.weight"),
    ("mtp.pre_fc_norm_hidden.weight", "nextn.hnorm.weight"),
    ("mtp.norm.weight", "nextn.shared_head_norm.weight"),
];

/// llama.cpp's name of an MTP whole-block tensor, in block `layers` (the first after the
/// decoder's).
pub(super) fn mtp_top_name(key: &str, layers: usize) -> Option<String> {
    MTP_TOP.iter().find(|(k, _)| *k == key).map(|(_, n)| format!("blk.{layers}.{n}"))
}

/// An MTP layer's key (`mtp.layers.<j>.<rest>`) as the decoder layer `layers + j` would hold it,
/// so it takes that layer's llama.cpp name.
pub(super) fn as_decoder_key(key: &str, layers: usize) -> Option<String> {
    let (j, rest) = key.strip_prefix(MTP_LAYERS)?.split_once('.')?;
    Some(format!("{TEXT_PREFIX}.layers.{}.{rest}", layers + j.parse::<usize>().ok()?))
}

/// The checkpoint key behind a decoder key: layers from `layers` on are the MTP head's.
pub(super) fn checkpoint_key(key: &str, layers: usize) -> String {
    let prefix = format!("{TEXT_PREFIX}.layers.");
    let Some((i, rest)) = key.strip_prefix(&prefix).and_then(|r| r.split_once('.')) else {
        return key.to_string();
    };
    match i.parse::<usize>() {
        Ok(i) if i >= layers => format!("{MTP_LAYERS}{}.{rest}", i - layers),
        _ => key.to_string(),
    }
}

/// The checkpoint key of a tensor of llama.cpp's MTP block (`blk.<layers>.*`): its `nextn.*`
/// tensors are the head's own, the rest its decoder layer's; None for one the head does not
/// read.
pub(super) fn mtp_key(name: &str, layers: usize) -> Option<String> {
    let rest = name.strip_prefix(&format!("blk.{layers}."))?;
    if rest.starts_with("nextn.") {
        return MTP_TOP.iter().find(|(_, n)| *n == rest).map(|(k, _)| k.to_string());
    }
    Some(checkpoint_key(&super::gguf_names::text_key(name)?, layers)).filter(|k| k.starts_with(MTP_LAYERS))
}

/// `t` with its value heads along `dim` (0 or 1; `head` values each) moved from grouped by key
/// head ([k0 v0..v(r-1), k1 v0..]) to tiled ([k0 v0, k1 v0, .., k0 v1, ..]).
fn tile_heads(t: &Tensor, dim: usize, key_heads: usize, head: usize) -> Result<Tensor> {
    let t = if t.rank() == 1 { t.unsqueeze(1)? } else { t.clone() };
    let t = if dim == 1 { t.t()? } else { t };
    let (n, c) = t.dims2()?;
    let r = n / (key_heads * head);
    let tiled = t.reshape((key_heads, r, head, c))?.transpose(0, 1)?.contiguous()?.reshape((n, c))?;
    Ok(if dim == 1 { tiled.t()?.contiguous()? } else { tiled })
}

/// A text tensor (checkpoint key, read as stored) as llama.cpp's converter writes it; 1-D
/// tensors and the convolution come back in f32, as the converter keeps them.
pub(super) fn rewrite(key: &str, w: Tensor, h: &HybridConfig) -> Result<Tensor> {
    let mut w = if w.rank() == 1 || key.ends_with(".conv1d.weight") { w.to_dtype(DType::F32)? } else { w };
    if key.ends_with(".conv1d.weight") && w.rank() == 3 {
        let (c, _, k) = w.dims3()?;
        w = w.reshape((c, k))?;
    }
    if h.value_heads != h.key_heads && key.contains(".linear_attn.") {
        let (kh, kd, vd) = (h.key_heads, h.key_head_dim, h.value_head_dim);
        let part = key.rsplit('.').nth(1).unwrap_or("");
        w = match (part, key.rsplit('.').next().unwrap_or("")) {
            // The value rows (or channels) after the query and key ones.
            ("in_proj_qkv" | "conv1d", "weight") => {
                let qk = 2 * kh * kd;
                let v = w.narrow(0, qk, w.dim(0)? - qk)?;
                Tensor::cat(&[&w.narrow(0, 0, qk)?, &tile_heads(&v, 0, kh, vd)?], 0)?
            }
            ("in_proj_z", "weight") => tile_heads(&w, 0, kh, vd)?,
            ("in_proj_b" | "in_proj_a", "weight") => tile_heads(&w, 0, kh, 1)?,
            ("out_proj", "weight") => tile_heads(&w, 1, kh, vd)?,
            (_, "A_log" | "dt_bias") => tile_heads(&w, 0, kh, 1)?.squeeze(1)?,
            _ => w,
        };
    }
    if key.ends_with(".A_log") {
        w = w.exp()?.neg()?;
    } else if (key.ends_with("norm.weight") && !key.ends_with("linear_attn.norm.weight"))
        || key.starts_with("mtp.pre_fc_norm_")
    {
        w = (w + 1.0)?;
    }
    Ok(w)
}

/// The hybrid decoder's metadata (`<arch>.` keys), after the ones every Qwen3-VL file has.
pub(super) fn metadata(cfg: &Qwen3VlConfig, h: &HybridConfig, mtp: usize, arch: &str) -> Vec<(String, Value)> {
    let t = &cfg.text;
    let a = |k: &str| format!("{arch}.{k}");
    let u = |v: usize| Value::U32(v as u32);
    // The converter writes the config's interval (4 when absent); llama.cpp reads
    // `recurrent_layers` first, which is always written here.
    let every = (2..=h.linear.len())
        .find(|&k| h.linear.iter().enumerate().all(|(i, &lin)| lin != (i + 1).is_multiple_of(k)))
        .unwrap_or(4);
    let mut meta = vec![
        (a("ssm.conv_kernel"), u(h.conv_kernel)),
        (a("ssm.state_size"), u(h.key_head_dim)),
        (a("ssm.group_count"), u(h.key_heads)),
        (a("ssm.time_step_rank"), u(h.value_heads)),
        (a("ssm.inner_size"), u(h.value_heads * h.value_head_dim)),
        (
            a("attention.recurrent_layers"),
            Value::Array(h.linear.iter().chain(std::iter::repeat_n(&false, mtp)).map(|&b| Value::Bool(b)).collect()),
        ),
        (a("full_attention_interval"), u(every)),
        (a("rope.dimension_count"), u(t.rotary_dim)),
    ];
    if mtp > 0 {
        meta.push((a("nextn_predict_layers"), u(mtp)));
    }
    if let Some(s) = t.moe.as_ref().and_then(|m| m.shared_intermediate_size) {
        meta.push((a("expert_shared_feed_forward_length"), u(s)));
    }
    meta
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn value_heads_are_tiled_across_key_heads() {
        // 2 key heads, 4 value heads of 1: grouped [g0v0, g0v1, g1v0, g1v1] -> tiled [g0v0, g1v0, g0v1, g1v1].
        let t = Tensor::new(&[0f32, 1., 2., 3.], &Device::Cpu).unwrap();
        assert_eq!(tile_heads(&t, 0, 2, 1).unwrap().squeeze(1).unwrap().to_vec1::<f32>().unwrap(), [0., 2., 1., 3.]);
        // Columns, heads of 2 values: [a0 a1 | b0 b1 | c0 c1 | d0 d1] -> [a | c | b | d].
        let t = Tensor::new(&[[0f32, 1., 2., 3., 4., 5., 6., 7.]], &Device::Cpu).unwrap();
        assert_eq!(tile_heads(&t, 1, 2, 2).unwrap().to_vec2::<f32>().unwrap(), [[0., 1., 4., 5., 2., 3., 6., 7.]]);
    }

    #[test]
    fn mtp_keys_take_the_block_after_the_decoder() {
        assert_eq!(mtp_top_name("mtp.fc.weight", 5).unwrap(), "blk.5.nextn.eh_proj.weight");
        let k = as_decoder_key("mtp.layers.0.self_attn.q_proj.weight", 5).unwrap();
        assert_eq!(k, "model.language_model.layers.5.self_attn.q_proj.weight");
        assert_eq!(checkpoint_key(&k, 5), "mtp.layers.0.self_attn.q_proj.weight");
        assert_eq!(
            checkpoint_key("model.language_model.layers.4.mlp.up_proj.weight", 5),
            "model.language_model.layers.4.mlp.up_proj.weight"
        );
    }
}
