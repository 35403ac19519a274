"""Writes a Qwen3-VL-30B-A3B-width MoE checkpoint with seeded random weights, bf16 safetensors in
the hub's layout (fused experts `gate_up_proj` [E, hidden, 2*moe_inter], `down_proj`
[E, moe_inter, hidden], as Qwen's release stores them and llama.cpp's converter reads them), with
the real tokenizer, chat template, preprocessor and generation configs. Fewer decoder layers than
the release (default 8 of 48) so it fits this machine's disk and memory. For benchmarks only.

    tools/bench/make-moe-checkpoint OUT_DIR [--layers 8] [--seed N]

Text: the 30B-A3B's width (../shared/REFERENCE.md: hidden 2048, 32 heads / 4 KV heads, head_dim
128, 128 experts, top-8, moe_intermediate 768, untied lm_head). Vision: the pinned transformers'
Qwen3VLMoeVisionConfig defaults, whose docstring names Qwen/Qwen3-VL-30B-A3B-Instruct (depth 27,
hidden 1152, intermediate 4304, 16 heads, deepstack [8, 16, 24], 2304 positions), with
out_hidden_size 2048: the merger projects into the text model's hidden size.
"""
import argparse
import json
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

from make_checkpoint import write_side_files


def config(layers):
    return Qwen3VLMoeConfig(
        text_config=dict(
            vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=layers,
            num_attention_heads=32, num_key_value_heads=4, head_dim=128, max_position_embeddings=262144,
            rms_norm_eps=1e-6, tie_word_embeddings=False, num_experts=128, num_experts_per_tok=8,
            moe_intermediate_size=768, decoder_sparse_step=1, mlp_only_layers=[],
            rope_parameters=dict(rope_type="default", rope_theta=5000000.0, mrope_section=[24, 20, 20],
                                 mrope_interleaved=True),
        ),
        vision_config=dict(
            depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=2048,
            num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24], patch_size=16,
            temporal_patch_size=2, spatial_merge_size=2, in_channels=3,
        ),
        tie_word_embeddings=False,
    )


def value(name, shape, gen):
    """Trained-like scales: unit-ish norms, 1/sqrt(fan_in) linears (the experts' fan-in is their
    input width), so activations stay finite."""
    rnd = torch.randn(shape, generator=gen, dtype=torch.float32)
    if "norm" in name and name.endswith("weight"):
        return 1.0 + 0.1 * rnd
    if name.endswith("bias"):
        return 0.02 * rnd
    if "embed_tokens" in name or "pos_embed" in name:
        return 0.02 * rnd
    if name.endswith("experts.gate_up_proj"):  # hub layout [E, hidden, 2*inter]: fan-in hidden
        return rnd / shape[1] ** 0.5
    if name.endswith("experts.down_proj"):  # hub layout [E, inter, hidden]: fan-in inter
        return rnd / shape[1] ** 0.5
    fan_in = 1
    for d in shape[1:]:
        fan_in *= d
    return rnd / max(fan_in, 1) ** 0.5


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seed", type=int, default=3031)
    args = ap.parse_args()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(args.seed)
    cfg = config(args.layers)
    with torch.device("meta"):
        model = Qwen3VLMoeForConditionalGeneration(cfg)
    tensors, n = {}, 0
    for name, p in model.state_dict().items():
        shape = list(p.shape)
        if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            shape = [shape[0], shape[2], shape[1]]  # transformers 5's [E, out, in] -> the hub's
        tensors[name] = value(name, shape, gen).to(torch.bfloat16)
        n += tensors[name].numel()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    del tensors
    cfg.architectures = ["Qwen3VLMoeForConditionalGeneration"]  # as a model's save_pretrained writes
    cfg.save_pretrained(out)
    write_side_files(out)
    print(json.dumps({"out": str(out), "parameters": n, "layers": args.layers, "seed": args.seed,
                      "torch": torch.__version__, "transformers": transformers.__version__}))


if __name__ == "__main__":
    main()
