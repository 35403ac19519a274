//! llama.cpp's tensor names for Qwen3-VL and the checkpoint keys they stand for: one set of
//! tables, read one way by the GGUF reader and the other way by `vl quantize`.

const TEXT: &str = "model.language_model";

/// Whole-model text tensors: (llama.cpp name, checkpoint key).
const TEXT_TOP: &[(&str, &str)] = &[
    ("token_embd.weight", "model.language_model.embed_tokens.weight"),
    ("output_norm.weight", "model.language_model.norm.weight"),
    ("output.weight", "lm_head.weight"),
];

/// Per decoder layer: `blk.N.<a>` <-> `model.language_model.layers.N.<b>`.
const TEXT_LAYER: &[(&str, &str)] = &[
    ("attn_q", "self_attn.q_proj"),
    ("attn_k", "self_attn.k_proj"),
    ("attn_v", "self_attn.v_proj"),
    ("attn_output", "self_attn.o_proj"),
    ("attn_q_norm", "self_attn.q_norm"),
    ("attn_k_norm", "self_attn.k_norm"),
    ("attn_norm", "input_layernorm"),
    ("ffn_norm", "post_attention_layernorm"),
    ("ffn_gate", "mlp.gate_proj"),
    ("ffn_up", "mlp.up_proj"),
    ("ffn_down", "mlp.down_proj"),
    // MoE (qwen3vlmoe): the router, and each layer's experts as one 3-D tensor per matrix.
    ("ffn_gate_inp", "mlp.gate"),
    ("ffn_gate_exps", "mlp.experts.gate_proj"),
    ("ffn_up_exps", "mlp.experts.up_proj"),
    ("ffn_down_exps", "mlp.experts.down_proj"),
    // Qwen3.5 MoE (qwen35moe): the shared expert and its gate.
    ("ffn_gate_shexp", "mlp.shared_expert.gate_proj"),
    ("ffn_up_shexp", "mlp.shared_expert.up_proj"),
    ("ffn_down_shexp", "mlp.shared_expert.down_proj"),
    ("ffn_gate_inp_shexp", "mlp.shared_expert_gate"),
    // Qwen3.5 (qwen35): the norm after attention, and the Gated DeltaNet layers.
    ("post_attention_norm", "post_attention_layernorm"),
    ("attn_qkv", "linear_attn.in_proj_qkv"),
    ("attn_gate", "linear_attn.in_proj_z"),
    ("ssm_beta", "linear_attn.in_proj_b"),
    ("ssm_alpha", "linear_attn.in_proj_a"),
    ("ssm_conv1d", "linear_attn.conv1d"),
    ("ssm_norm", "linear_attn.norm"),
    ("ssm_out", "linear_attn.out_proj"),
];

/// Qwen3.5's per-layer tensors whose names do not follow `<part>.<kind>`: `blk.N.<a>` <->
/// `model.language_model.layers.N.<b>` (`ssm_a` holds -exp(A_log); `ssm_dt.bias` is dt_bias).
const TEXT_LAYER_WHOLE: &[(&str, &str)] = &[("ssm_a", "linear_attn.A_log"), ("ssm_dt.bias", "linear_attn.dt_bias")];

/// Whole-tower vision parts (relative to `model.visual`).
const VISION_TOP: &[(&str, &str)] = &[
    ("v.position_embd", "pos_embed"),
    ("v.patch_embd", "patch_embed.proj"),
    ("v.post_ln", "merger.norm"),
    ("mm.0", "merger.linear_fc1"),
    ("mm.2", "merger.linear_fc2"),
];

/// Per vision block: `v.blk.N.<a>` <-> `blocks.N.<b>`.
const VISION_BLOCK: &[(&str, &str)] = &[
    ("attn_qkv", "attn.qkv"),
    ("attn_out", "attn.proj"),
    ("ffn_up", "mlp.linear_fc1"),
    ("ffn_down", "mlp.linear_fc2"),
    ("ln1", "norm1"),
    ("ln2", "norm2"),
];

/// Per DeepStack merger: `v.deepstack.<vision layer>.<a>` <-> `deepstack_merger_list.<k>.<b>`.
const DEEPSTACK: &[(&str, &str)] = &[("norm", "norm"), ("fc1", "linear_fc1"), ("fc2", "linear_fc2")];

fn to_key<'a>(table: &[(&'a str, &'a str)], name: &str) -> Option<&'a str> {
    table.iter().find(|(n, _)| *n == name).map(|(_, k)| *k)
}

fn to_name<'a>(table: &[(&'a str, &'a str)], key: &str) -> Option<&'a str> {
    table.iter().find(|(_, k)| *k == key).map(|(n, _)| *n)
}

/// `prefix.<index>.<rest>` -> (index, rest).
fn indexed<'a>(s: &'a str, prefix: &str) -> Option<(usize, &'a str)> {
    let (i, rest) = s.strip_prefix(prefix)?.split_once('.')?;
    Some((i.parse().ok()?, rest))
}

/// A text tensor's llama.cpp name -> its checkpoint key.
pub(crate) fn text_key(name: &str) -> Option<String> {
    if let Some(k) = to_key(TEXT_TOP, name) {
        return Some(k.into());
    }
    let (i, rest) = indexed(name, "blk.")?;
    if let Some(k) = to_key(TEXT_LAYER_WHOLE, rest) {
        return Some(format!("{TEXT}.layers.{i}.{k}"));
    }
    let (part, kind) = rest.rsplit_once('.')?;
    Some(format!("{TEXT}.layers.{i}.{}.{kind}", to_key(TEXT_LAYER, part)?))
}

/// A text checkpoint key -> its llama.cpp name and decoder layer.
pub(crate) fn text_name(key: &str) -> Option<(String, Option<usize>)> {
    if let Some(n) = to_name(TEXT_TOP, key) {
        return Some((n.into(), None));
    }
    let (i, rest) = indexed(key, &format!("{TEXT}.layers."))?;
    if let Some(n) = to_name(TEXT_LAYER_WHOLE, rest) {
        return Some((format!("blk.{i}.{n}"), Some(i)));
    }
    let (part, kind) = rest.rsplit_once('.')?;
    Some((format!("blk.{i}.{}.{kind}", to_name(TEXT_LAYER, part)?), Some(i)))
}

/// An mmproj tensor's llama.cpp name -> the vision tower's key (relative to `model.visual`).
/// `deepstack` lists the vision layers the mergers tap, in merger order.
pub(crate) fn vision_key(name: &str, deepstack: &[usize]) -> Option<String> {
    let (part, kind) = name.rsplit_once('.')?;
    let key = if let Some(k) = to_key(VISION_TOP, part) {
        k.to_string()
    } else if let Some((i, p)) = indexed(part, "v.blk.") {
        format!("blocks.{i}.{}", to_key(VISION_BLOCK, p)?)
    } else {
        let (layer, p) = indexed(part, "v.deepstack.")?;
        let k = deepstack.iter().position(|&l| l == layer)?;
        format!("deepstack_merger_list.{k}.{}", to_key(DEEPSTACK, p)?)
    };
    Some(format!("{key}.{kind}"))
}

/// A vision key (relative to `model.visual`) -> its llama.cpp name.
pub(crate) fn vision_name(key: &str, deepstack: &[usize]) -> Option<String> {
    let (part, kind) = key.rsplit_once('.')?;
    let name = if let Some(n) = to_name(VISION_TOP, part) {
        n.to_string()
    } else if let Some((i, p)) = indexed(part, "blocks.") {
        format!("v.blk.{i}.{}", to_name(VISION_BLOCK, p)?)
    } else {
        let (k, p) = indexed(part, "deepstack_merger_list.")?;
        format!("v.deepstack.{}.{}", deepstack.get(k)?, to_name(DEEPSTACK, p)?)
    };
    Some(format!("{name}.{kind}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_to_checkpoint_keys_and_back() {
        assert_eq!(text_key("blk.3.attn_q.weight").unwrap(), "model.language_model.layers.3.self_attn.q_proj.weight");
        assert_eq!(text_key("token_embd.weight").unwrap(), "model.language_model.embed_tokens.weight");
        assert_eq!(text_key("blk.x.attn_q.weight"), None);
        assert_eq!(text_key("blk.2.ssm_a").unwrap(), "model.language_model.layers.2.linear_attn.A_log");
        assert_eq!(text_key("blk.2.ssm_dt.bias").unwrap(), "model.language_model.layers.2.linear_attn.dt_bias");
        assert_eq!(
            text_key("blk.0.ssm_alpha.weight").unwrap(),
            "model.language_model.layers.0.linear_attn.in_proj_a.weight"
        );
        assert_eq!(vision_key("v.deepstack.5.fc1.bias", &[2, 5]).unwrap(), "deepstack_merger_list.1.linear_fc1.bias");
        assert_eq!(vision_key("v.deepstack.4.fc1.bias", &[2, 5]), None);
        assert_eq!(vision_key("mm.2.weight", &[]).unwrap(), "merger.linear_fc2.weight");
        for key in ["model.language_model.layers.2.mlp.down_proj.weight", "model.language_model.norm.weight"] {
            let (name, _) = text_name(key).unwrap();
            assert_eq!(text_key(&name).unwrap(), key);
        }
        assert_eq!(text_name("model.language_model.layers.7.self_attn.v_proj.weight").unwrap().1, Some(7));
        let deep = [0, 2, 3];
        for key in ["blocks.1.attn.qkv.bias", "deepstack_merger_list.2.linear_fc1.weight", "merger.norm.weight"] {
            let name = vision_name(key, &deep).unwrap();
            assert_eq!(vision_key(&name, &deep).unwrap(), key);
        }
    }
}
