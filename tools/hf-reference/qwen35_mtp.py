"""goldens/tiny-q35/mtp: the reference for Qwen3.5's multi-token-prediction head (`mtp.*`) on the
committed tiny-q35 checkpoint (its weights are read, nothing of it is regenerated).

transformers skips the head, so the reference is built from transformers' own modules the way
vLLM's `qwen3_5_mtp.py` (`Qwen3_5MultiTokenPredictor`) runs it:
- h = the model's final normed hidden rows of the prompt (the output of the text model's `norm`);
- for each position p: x_p = fc(concat(pre_fc_norm_embedding(embed(t_{p+1})), pre_fc_norm_hidden(h_p)))
  where t_{p+1} is the token after p (the prompt's, then the model's greedy first token);
- one `Qwen3_5DecoderLayer` of the full-attention kind loaded from `mtp.layers.0.*`, causal over
  the rows, rotated at the text model's own (M-RoPE) positions; then `mtp.norm`; logits by the
  model's lm_head;
- the second draft: the head's normed output at the last position as h, with the first draft's
  token, one position on (every axis + 1).

Writes goldens/tiny-q35/mtp/<case>.safetensors: `logits.sampled` (every position, the sampled
vocabulary ids), `logits.last` (the last position, whole vocabulary), `chain.logits` (the second
draft's row), `tokens` (the model's first greedy token, the head's two drafts).

`--moe`: the same for the MoE family on goldens/tiny-q35-moe-mtp, which this writes: tiny-q35-moe's
checkpoint (linked, unchanged: it has no head) as the first of two shards, and a second shard with
a random head whose layer is a `Qwen3_5MoeDecoderLayer` (6 routed experts one tensor each, as the
hub stores them, a gated shared expert); the config says `mtp_num_hidden_layers` 1. The reference
runs the experts eagerly, fused as transformers 5 holds them."""

import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
import json
import os
import shutil

from transformers import Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeDecoderLayer

CASES = ("long_text", "one_image")


MOE_SEED = 20271207


def moe_checkpoint(out):
    """goldens/tiny-q35-moe-mtp/checkpoint: tiny-q35-moe's files linked, its weights the first
    shard, a random MoE head the second."""
    src = out / "tiny-q35-moe" / "checkpoint"
    ck = out / "tiny-q35-moe-mtp" / "checkpoint"
    if ck.exists():
        shutil.rmtree(ck)
    ck.mkdir(parents=True)
    for f in sorted(os.listdir(src)):
        if f not in ("config.json", "model.safetensors", "model.safetensors.index.json"):
            os.symlink(os.path.join("..", "..", "tiny-q35-moe", "checkpoint", f), ck / f)
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    os.symlink(os.path.join("..", "..", "tiny-q35-moe", "checkpoint", "model.safetensors"), ck / first)
    cfg = json.loads((src / "config.json").read_text())
    t = cfg["text_config"]
    d, hd, e = t["hidden_size"], t["head_dim"], t["num_experts"]
    q, kv = t["num_attention_heads"] * hd, t["num_key_value_heads"] * hd
    inter, shared = t["moe_intermediate_size"], t["shared_expert_intermediate_size"]
    L = "mtp.layers.0."
    shapes = {"mtp.fc.weight": (d, 2 * d), "mtp.pre_fc_norm_embedding.weight": (d,), "mtp.pre_fc_norm_hidden.weight": (d,),
              "mtp.norm.weight": (d,), L + "input_layernorm.weight": (d,), L + "post_attention_layernorm.weight": (d,),
              L + "self_attn.q_proj.weight": (2 * q, d), L + "self_attn.k_proj.weight": (kv, d),
              L + "self_attn.v_proj.weight": (kv, d), L + "self_attn.o_proj.weight": (d, q),
              L + "self_attn.q_norm.weight": (hd,), L + "self_attn.k_norm.weight": (hd,),
              L + "mlp.gate.weight": (e, d), L + "mlp.shared_expert.gate_proj.weight": (shared, d),
              L + "mlp.shared_expert.up_proj.weight": (shared, d), L + "mlp.shared_expert.down_proj.weight": (d, shared),
              L + "mlp.shared_expert_gate.weight": (1, d)}
    for x in range(e):
        shapes.update({f"{L}mlp.experts.{x}.gate_proj.weight": (inter, d), f"{L}mlp.experts.{x}.up_proj.weight": (inter, d),
                       f"{L}mlp.experts.{x}.down_proj.weight": (d, inter)})
    gen = torch.Generator().manual_seed(MOE_SEED)
    head_tensors = {k: (torch.randn(shape, generator=gen) * 0.1).to(torch.bfloat16) for k, shape in shapes.items()}
    save_file(head_tensors, ck / second, metadata={"format": "pt"})
    from safetensors import safe_open
    with safe_open(src / "model.safetensors", "pt") as f:
        base = sorted(f.keys())
    index = {"metadata": {}, "weight_map": {**{k: first for k in base}, **{k: second for k in sorted(head_tensors)}}}
    (ck / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    t["mtp_num_hidden_layers"] = 1
    t["mtp_use_dedicated_embeddings"] = False
    (ck / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return ck, head_tensors


def head(model, ck, tensors=None):
    tc = model.config.text_config
    full = tc.layer_types.index("full_attention")
    tensors = tensors if tensors is not None else load_file(ck / "model.safetensors")
    state = {k[len("mtp."):]: v.float() for k, v in tensors.items() if k.startswith("mtp.")}
    layer_state = {k[len("layers.0."):]: v for k, v in state.items() if k.startswith("layers.0.")}
    if hasattr(tc, "num_experts"):
        tc._experts_implementation = "eager"
        layer = Qwen3_5MoeDecoderLayer(tc, full).eval()
        # The hub's one tensor an expert, fused as transformers 5 holds them: gate rows, then up.
        n = tc.num_experts
        take = lambda name: torch.stack([layer_state.pop(f"mlp.experts.{x}.{name}.weight") for x in range(n)])
        gate, up = take("gate_proj"), take("up_proj")
        layer_state["mlp.experts.gate_up_proj"] = torch.cat([gate, up], dim=1)
        layer_state["mlp.experts.down_proj"] = take("down_proj")
    else:
        layer = Qwen3_5DecoderLayer(tc, full).eval()
    layer.load_state_dict(layer_state)
    d, eps = tc.hidden_size, tc.rms_norm_eps
    norms = {}
    for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        norms[n] = Qwen3_5RMSNorm(d, eps=eps).eval()
        norms[n].load_state_dict({"weight": state[f"{n}.weight"]})
    fc = torch.nn.Linear(2 * d, d, bias=False)
    fc.load_state_dict({"weight": state["fc.weight"]})
    return layer, norms, fc


def main(out, moe=False):
    out = Path(out)
    name_of = "tiny-q35-moe" if moe else "tiny-q35"
    if moe:
        ck, tensors = moe_checkpoint(out)
        model = Qwen3_5MoeForConditionalGeneration.from_pretrained(ck, dtype=torch.float32,
                                                                   experts_implementation="eager").eval()
    else:
        ck, tensors = out / "tiny-q35" / "checkpoint", None
        model = Qwen3_5ForConditionalGeneration.from_pretrained(ck, dtype=torch.float32).eval()
    model.config._attn_implementation = "eager"
    for sub in (model.model.visual.config, model.model.language_model.config):
        sub._attn_implementation = "eager"
    layer, norms, fc = head(model, ck, tensors)
    lm = model.model.language_model
    sampled = load_file(out / "sampled_vocab_ids.safetensors")["vocab_ids"]
    seen = {}
    lm.norm.register_forward_hook(lambda m, a, o: seen.__setitem__("hidden", o))
    lm.rotary_emb.register_forward_pre_hook(lambda m, a: seen.__setitem__("positions", a[1]))
    dest = ck.parent / "mtp"
    dest.mkdir(exist_ok=True)

    def run_head(tokens, hidden, positions):
        x = fc(torch.cat([norms["pre_fc_norm_embedding"](lm.embed_tokens(tokens)),
                          norms["pre_fc_norm_hidden"](hidden)], dim=-1))
        n = x.shape[1]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        y = layer(x, position_embeddings=lm.rotary_emb(x, positions), attention_mask=mask)
        return norms["norm"](y)

    with torch.no_grad():
        for name in CASES:
            case = load_file(out / name_of / "cases" / f"{name}.safetensors")
            ids = case["input_ids"][None]
            kw = {}
            if "pixel_values" in case:
                types = (ids == model.config.image_token_id).to(torch.int32)
                kw = {"pixel_values": case["pixel_values"], "image_grid_thw": case["image_grid_thw"],
                      "mm_token_type_ids": types}
            logits = model(input_ids=ids, use_cache=False, **kw).logits[0]
            assert torch.allclose(logits[-1], case["logits.last"], atol=1e-4), f"{name}: not the case's logits"
            hidden, positions = seen["hidden"], seen["positions"]
            first = logits[-1].argmax()
            tokens = torch.cat([ids[0, 1:], first[None]])[None]
            o = run_head(tokens, hidden, positions)
            mtp_logits = model.lm_head(o)[0]
            d1 = mtp_logits[-1].argmax()
            # The second draft: the head's own last output row as h, one position on.
            tokens2 = torch.cat([tokens, d1[None, None]], dim=1)
            hidden2 = torch.cat([hidden, o[:, -1:]], dim=1)
            positions2 = torch.cat([positions, positions[..., -1:] + 1], dim=-1)
            o2 = run_head(tokens2, hidden2, positions2)
            assert torch.allclose(o2[:, :-1], o, atol=1e-5), "causal rows changed"
            chain = model.lm_head(o2[:, -1])[0]
            d2 = chain.argmax()
            save_file({"logits.sampled": mtp_logits[:, sampled].contiguous(), "logits.last": mtp_logits[-1].contiguous(),
                       "chain.logits": chain.contiguous(), "tokens": torch.stack([first, d1, d2]).to(torch.int64)},
                      dest / f"{name}.safetensors")
            print(f"{name}: {ids.shape[1]} positions; first {first.item()}, drafts {d1.item()} {d2.item()}")
    sys.path.insert(0, str(Path(__file__).parent))
    from generate import write_provenance
    if moe:
        write_provenance(out, {"qwen35_moe_mtp": {
            "generator": "tools/hf-reference/generate-mtp-q35", "seed": MOE_SEED,
            "checkpoint": "tiny-q35-moe's files linked, its model.safetensors the first shard; the second a "
                          "random head (randn x 0.1, bf16): fc, the three norms, one full-attention layer with "
                          "6 routed experts one tensor each and a gated shared expert",
            "reference": "the head in transformers modules (Qwen3_5MoeDecoderLayer with eager experts, fused "
                         "gate_up_proj; Qwen3_5RMSNorm; nn.Linear fc) wired as vLLM's Qwen3_5MultiTokenPredictor, "
                         "float32, eager attention with a causal mask, the text model's M-RoPE positions",
            "cases": "mtp/<case>.safetensors as tiny-q35/mtp's, on tiny-q35-moe's cases/<case> prompts"}})
        return
    write_provenance(out, {"qwen35_mtp": {
        "generator": "tools/hf-reference/generate-mtp-q35",
        "reference": "tiny-q35's mtp.* weights in transformers modules (Qwen3_5DecoderLayer, full attention; "
                     "Qwen3_5RMSNorm; nn.Linear fc) wired as vLLM's Qwen3_5MultiTokenPredictor, float32, eager "
                     "attention with a causal mask, the text model's M-RoPE positions",
        "cases": "mtp/<case>.safetensors: logits.sampled (every position), logits.last, chain.logits "
                 "(second draft), tokens (first greedy token, drafts 1 and 2); the prompts of cases/<case>"}})


if __name__ == "__main__":
    if sys.argv[1] == "--moe":
        main(sys.argv[2], moe=True)
    else:
        main(sys.argv[1])
