"""Writes a Qwen3.5 checkpoint near the 2B geometry with seeded random weights, stored as bf16
safetensors like a hub release, with Qwen3.5's tokenizer (goldens/tokenizer-q35), the official
template, preprocessor and generation configs, and an `mtp.*` head as the releases carry one.
For benchmarks only (the text it generates is noise); nothing is downloaded.

The published Qwen3.5-2B config is not in this repository's reach (no download): the layer count
and width are what llama.cpp's `qwen35` loader calls 2B (24 layers, hidden not 1024:
src/models/qwen35.cpp of the pinned sdist); the rest is chosen, stated in `config()`.

    tools/bench/make-checkpoint-q35 OUT_DIR [--seed N] [--small]

`--small`: a geometry small enough to convert and quantize in seconds whose rows still fill
256-value blocks, with fewer key heads than value heads (the converter reorders value heads):
hidden 512, 4 layers (3 DeltaNet, 1 full attention), DeltaNet 2 key / 4 value heads of 128,
attention 4 heads / 2 kv of 256, mlp 1536, a 2-block vision tower of 256. For `vl quantize`
against llama.cpp's converter and llama-quantize (docs/qwen35.md).
"""
import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import GenerationConfig, Qwen3_5Config, Qwen3_5ForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

ROOT = Path(__file__).resolve().parent.parent.parent
TEMPLATE = ROOT / "tools/hf-reference/templates/Qwen3.5-4B.jinja"
TOKENIZER = ROOT / "goldens/tokenizer-q35/tokenizer.json"
TOKENIZER_CONFIG = ROOT / "goldens/tiny-q35/checkpoint/tokenizer_config.json"
TEXT = dict(vocab_size=248320, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
            num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_conv_kernel_dim=4,
            linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
            linear_num_value_heads=16, full_attention_interval=4, max_position_embeddings=262144,
            rms_norm_eps=1e-6, tie_word_embeddings=True,
            rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25,
                                 mrope_section=[11, 11, 10], mrope_interleaved=True))
# Qwen3-VL-2B's vision tower without DeepStack, projecting to the text width.
VISION = dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2048,
              num_position_embeddings=2304, patch_size=16, temporal_patch_size=2, spatial_merge_size=2,
              in_channels=3)


SMALL_TEXT = dict(TEXT, hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, linear_num_key_heads=2, linear_num_value_heads=4)
SMALL_VISION = dict(VISION, depth=2, hidden_size=256, intermediate_size=512, num_heads=4, out_hidden_size=512)


def config():
    return Qwen3_5Config(text_config=dict(TEXT), vision_config=dict(VISION), tie_word_embeddings=True)


@torch.no_grad()
def randomize(model, gen):
    """Trained-like scales; decays in the range the released A_log / dt_bias give."""
    for name, p in model.named_parameters():
        rnd = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        if name.endswith("A_log"):
            val = torch.log(torch.rand(p.shape, generator=gen) * 15.9 + 0.1)
        elif name.endswith("dt_bias"):
            val = 0.1 * rnd
        elif "linear_attn.norm" in name:
            val = 1.0 + 0.1 * rnd
        elif "norm" in name and name.endswith("weight"):
            val = 0.1 * rnd if "language_model" in name else 1.0 + 0.1 * rnd
        elif name.endswith("bias"):
            val = 0.02 * rnd
        elif "embed_tokens" in name or "pos_embed" in name:
            val = 0.02 * rnd
        else:
            fan_in = p[0].numel() if p.dim() > 1 else p.numel()
            val = rnd / fan_in ** 0.5
        p.copy_(val.to(p.dtype))


def add_mtp(out, gen):
    t = TEXT
    d, hd = t["hidden_size"], t["head_dim"]
    q, kv, inter = t["num_attention_heads"] * hd, t["num_key_value_heads"] * hd, t["intermediate_size"]
    shapes = {"fc.weight": (d, 2 * d), "pre_fc_norm_embedding.weight": (d,), "pre_fc_norm_hidden.weight": (d,),
              "norm.weight": (d,), "layers.0.input_layernorm.weight": (d,), "layers.0.post_attention_layernorm.weight": (d,),
              "layers.0.self_attn.q_proj.weight": (2 * q, d), "layers.0.self_attn.k_proj.weight": (kv, d),
              "layers.0.self_attn.v_proj.weight": (kv, d), "layers.0.self_attn.o_proj.weight": (d, q),
              "layers.0.self_attn.q_norm.weight": (hd,), "layers.0.self_attn.k_norm.weight": (hd,),
              "layers.0.mlp.gate_proj.weight": (inter, d), "layers.0.mlp.up_proj.weight": (inter, d),
              "layers.0.mlp.down_proj.weight": (d, inter)}
    save_file({f"mtp.{k}": (torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16) for k, s in shapes.items()},
              out / "model-mtp.safetensors", metadata={"format": "pt"})
    index = out / "model.safetensors.index.json"
    files = sorted(p.name for p in out.glob("model*.safetensors"))
    weight_map = {}
    for f in files:
        for k in load_file(out / f).keys():
            weight_map[k] = f
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2) + "\n")
    cfg = json.loads((out / "config.json").read_text())
    cfg["text_config"]["mtp_num_hidden_layers"] = 1
    cfg["text_config"]["mtp_use_dedicated_embeddings"] = False
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=20261205)
    ap.add_argument("--small", action="store_true")
    args = ap.parse_args()
    if args.small:
        TEXT.update(SMALL_TEXT)
        VISION.update(SMALL_VISION)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    with torch.device("meta"):
        model = Qwen3_5ForConditionalGeneration(config())
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    gen = torch.Generator().manual_seed(args.seed)
    randomize(model, gen)
    model.save_pretrained(out, max_shard_size="5GB")
    add_mtp(out, gen)
    GenerationConfig(bos_token_id=248044, eos_token_id=[248046, 248044], pad_token_id=248044,
                     do_sample=True, temperature=1.0, top_k=20, top_p=0.95).save_pretrained(out)
    Qwen2VLImageProcessorPil(
        size={"shortest_edge": 65536, "longest_edge": 16777216}, patch_size=16, temporal_patch_size=2, merge_size=2,
        image_mean=[0.5] * 3, image_std=[0.5] * 3,
    ).save_pretrained(out)
    shutil.copyfile(TOKENIZER, out / "tokenizer.json")
    shutil.copyfile(TOKENIZER_CONFIG, out / "tokenizer_config.json")
    shutil.copyfile(TEMPLATE, out / "chat_template.jinja")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
