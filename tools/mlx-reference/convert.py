#!/usr/bin/env python3
"""MLX side of the quantized fixtures (run by tools/hf-reference/generate-mlx).

For each fixture: mlx_vlm converts the tiny-q source checkpoint (its CLI for the uniform 4- and
8-bit fixtures; its `convert()` with a per-layer `quant_predicate` for the others, which is how
mlx_vlm writes mixed checkpoints: per-layer entries in `quantization`), then every quantized tensor
is dequantized with mx.dequantize (the exact model the quantized weights describe) and written in
transformers' key layout for the reference run. Also pins dequantized tensors per fixture as
goldens for a bit-exactness test of the Rust unpacking.

Size: the real vocabulary's embedding (151936 x 64) and the float vision tower (mlx_vlm leaves it
unquantized) are most of a fixture. tiny-q-mlx4 is split into two shards, those tensors alone in
the first; every predicate fixture keeps the embedding at exactly that quantization, so the
tensors are equal (asserted), and links that shard instead of storing its own copy.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from safetensors.numpy import save_file

PREFIXES = [("vision_tower.", "model.visual."), ("language_model.model.", "model.language_model."),
            ("language_model.lm_head.", "lm_head.")]


def hf_key(k):
    for a, b in PREFIXES:
        if k.startswith(a):
            return b + k[len(a):]
    return k


EMBED = "language_model.model.embed_tokens"
EMBED_SHARD = "model-00001-of-00002.safetensors"
REST_SHARD = "model-00002-of-00002.safetensors"
SHARED_FROM = "tiny-q-mlx4"

# name -> (default bits, default group size, per-layer rules or None for the plain CLI conversion).
# Rules: (substring of the module path, params dict or False = keep it unquantized), first match wins.
SHARED_EMBED = (EMBED, {"bits": 4, "group_size": 64})
FIXTURES = {
    "tiny-q-mlx4": (4, 64, None),
    "tiny-q-mlx8": (8, 64, None),
    "tiny-q-mlx6": (6, 64, [SHARED_EMBED]),
    "tiny-q-mlx3": (3, 64, [SHARED_EMBED]),
    "tiny-q-mlx5": (5, 64, [SHARED_EMBED]),
    "tiny-q-mlx6g32": (6, 32, [SHARED_EMBED]),
    # As mlx_vlm's mixed recipes shape it (more bits for v_proj / down_proj of some layers), plus a
    # layer left in float and one at another group size.
    "tiny-q-mlx-mixed": (3, 64, [SHARED_EMBED,
                                 ("layers.1.mlp.down_proj", False),
                                 ("layers.0.mlp.down_proj", {"bits": 8, "group_size": 32}),
                                 ("self_attn.v_proj", {"bits": 6, "group_size": 64})]),
    # Qwen3-VL MoE through mlx_vlm's CLI: the experts stacked as `switch_mlp.{gate,up,down}_proj`
    # [E, out, in], 4-bit like everything else, the router `mlp.gate` included (the CLI applies
    # no per-layer predicate: one `quantization` entry).
    "tiny-q-mlx-moe": (4, 64, None),
}
# A fixture's source checkpoint, next to tiny-q-src in the cache (generate.py MLX_SOURCES).
SOURCES = {"tiny-q-mlx-moe": "tiny-qmoe-src"}


def predicate_for(rules, bits, group):
    from mlx_vlm.utils import skip_multimodal_module

    def predicate(path, module):
        # mlx_vlm's own default keeps the vision tower in float; a custom predicate must say so too.
        if skip_multimodal_module(path):
            return False
        for needle, params in rules:
            if needle in path:
                return False if params is False else {**params, "mode": "affine"}
        return {"bits": bits, "group_size": group, "mode": "affine"}
    return predicate


def float_tensors(weights, cfg):
    """(stored key, float32 array, quantized?) of every tensor but the scales and biases, the
    quantized ones dequantized with mx.dequantize (its scales and biases in float32: with bf16 ones
    it rounds each weight to bf16, which is not the model the stored values describe)."""
    for k, v in weights.items():
        if k.endswith(".scales") or k.endswith(".biases"):
            continue
        m = k[: -len(".weight")] if k.endswith(".weight") else None
        if m is not None and f"{m}.scales" in weights:
            q = cfg["quantization"].get(m, cfg["quantization"])
            scales, biases = weights[f"{m}.scales"].astype(mx.float32), weights[f"{m}.biases"].astype(mx.float32)
            w = mx.dequantize(v, scales, biases, group_size=q["group_size"], bits=q["bits"])
            yield k, np.array(w.astype(mx.float32)), True
        else:
            yield k, np.array(v.astype(mx.float32)), False


def load_all(ck):
    weights = {}
    for f in sorted(ck.glob("*.safetensors")):
        weights.update(mx.load(str(f)))
    return weights


def shared_key(k):
    return k.startswith(EMBED + ".") or k.startswith("vision_tower.")


def write_shards(ck, weights, embed_file):
    """Rewrites ck as two shards: the embedding (`embed_file`: written, or linked when it is a
    path to an existing shard) and the rest, with the index mlx_vlm writes."""
    for f in ck.glob("*.safetensors"):
        f.unlink()
    embed = {k: v for k, v in weights.items() if shared_key(k)}
    rest = {k: v for k, v in weights.items() if not shared_key(k)}
    if isinstance(embed_file, Path):
        shared = mx.load(str(embed_file))
        assert sorted(shared) == sorted(embed), (sorted(shared), sorted(embed))
        for k in embed:
            assert mx.array_equal(shared[k], embed[k]).item() and shared[k].dtype == embed[k].dtype, k
        os.symlink(os.path.relpath(embed_file, ck), ck / EMBED_SHARD)
    else:
        mx.save_safetensors(str(ck / EMBED_SHARD), embed, metadata={"format": "mlx"})
    mx.save_safetensors(str(ck / REST_SHARD), rest, metadata={"format": "mlx"})
    total = sum(v.nbytes for v in weights.values())
    wmap = {k: (EMBED_SHARD if k in embed else REST_SHARD) for k in sorted(weights)}
    (ck / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": wmap}, indent=4) + "\n")


def main(src, out_root, cache, names):
    from mlx_vlm.convert import convert

    base = src
    for name in names:
        src = str(Path(base).parent / SOURCES[name]) if name in SOURCES else base
        bits, group, rules = FIXTURES[name]
        ck = Path(out_root) / name / "checkpoint"
        if ck.parent.exists():
            shutil.rmtree(ck.parent)
        if rules is None:
            subprocess.run([sys.executable, "-m", "mlx_vlm", "convert", "--hf-path", src, "--mlx-path", str(ck),
                            "-q", "--q-bits", str(bits), "--q-group-size", str(group)], check=True)
        else:
            convert(hf_path=src, mlx_path=str(ck), quantize=True, q_group_size=group, q_bits=bits,
                    quant_predicate=predicate_for(rules, bits, group))
        if name == SHARED_FROM:
            write_shards(ck, load_all(ck), None)
        elif rules is not None:
            shared = Path(out_root) / SHARED_FROM / "checkpoint" / EMBED_SHARD
            write_shards(ck, load_all(ck), shared)
        for f in ("tokenizer.json", "vocab.json", "merges.txt"):
            (ck / f).unlink(missing_ok=True)
            os.symlink(os.path.join("..", "..", "tokenizer", f), ck / f)
        (ck / "README.md").unlink(missing_ok=True)
        cfg = json.loads((ck / "config.json").read_text())
        weights = load_all(ck)
        dense = {}
        pinned = {}
        for k, arr, quantized in float_tensors(weights, cfg):
            if quantized:
                if hf_key(k).endswith("layers.0.self_attn.o_proj.weight") or hf_key(k).endswith("layers.1.mlp.down_proj.weight"):
                    pinned[hf_key(k)] = arr
                if hf_key(k).endswith("embed_tokens.weight"):
                    pinned[hf_key(k) + "[:64]"] = arr[:64].copy()
            else:
                if hf_key(k) == "model.visual.patch_embed.proj.weight" and arr.ndim == 5:
                    arr = np.ascontiguousarray(arr.transpose(0, 4, 1, 2, 3))
            dense[hf_key(k)] = arr
        # The stacked experts back in transformers 5's fused layout for the reference:
        # gate_up_proj [E, 2*inter, hidden] (gate rows, then up rows), down_proj [E, hidden, inter].
        for k in [k for k in dense if k.endswith(".mlp.switch_mlp.gate_proj.weight")]:
            base_key = k[: -len(".switch_mlp.gate_proj.weight")]
            gate, up = dense.pop(k), dense.pop(f"{base_key}.switch_mlp.up_proj.weight")
            dense[f"{base_key}.experts.gate_up_proj"] = np.ascontiguousarray(np.concatenate([gate, up], axis=1))
            dense[f"{base_key}.experts.down_proj"] = dense.pop(f"{base_key}.switch_mlp.down_proj.weight")
        Path(cache).mkdir(parents=True, exist_ok=True)
        save_file(dense, str(Path(cache) / f"{name}-dequantized.safetensors"))
        save_file(pinned, str(ck.parent / "dequantized.safetensors"))
        print(f"{name}: {sum(1 for k in weights if k.endswith('.scales'))} quantized tensors")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split(",") if len(sys.argv) > 4 else list(FIXTURES))
