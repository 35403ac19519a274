#!/usr/bin/env python3
"""MLX side of the quantized fixtures (run by tools/hf-reference/generate-mlx).

For each bit width: mlx_vlm convert the tiny-q source checkpoint, then dequantize every quantized
tensor with mx.dequantize (the exact model the quantized weights describe) and write it in
transformers' key layout for the reference run. Also pins two dequantized tensors per width as
goldens for a bit-exactness test of the Rust unpacking.
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


def main(src, out_root, cache, bits_list, group):
    for bits in bits_list:
        name = f"tiny-q-mlx{bits}"
        ck = Path(out_root) / name / "checkpoint"
        if ck.parent.exists():
            shutil.rmtree(ck.parent)
        subprocess.run([sys.executable, "-m", "mlx_vlm", "convert", "--hf-path", src, "--mlx-path", str(ck),
                        "-q", "--q-bits", str(bits), "--q-group-size", str(group)], check=True)
        for f in ("tokenizer.json", "vocab.json", "merges.txt"):
            (ck / f).unlink(missing_ok=True)
            os.symlink(os.path.join("..", "..", "tokenizer", f), ck / f)
        (ck / "README.md").unlink(missing_ok=True)
        cfg = json.loads((ck / "config.json").read_text())
        weights = {}
        for f in sorted(ck.glob("*.safetensors")):
            weights.update(mx.load(str(f)))
        dense = {}
        pinned = {}
        for k, v in weights.items():
            if k.endswith(".scales") or k.endswith(".biases"):
                continue
            m = k[: -len(".weight")] if k.endswith(".weight") else None
            if m is not None and f"{m}.scales" in weights:
                q = cfg["quantization"].get(m, cfg["quantization"])
                w = mx.dequantize(v, weights[f"{m}.scales"], weights[f"{m}.biases"],
                                  group_size=q["group_size"], bits=q["bits"])
                arr = np.array(w.astype(mx.float32))
                if hf_key(k).endswith("layers.0.self_attn.o_proj.weight") or hf_key(k).endswith("layers.1.mlp.down_proj.weight"):
                    pinned[hf_key(k)] = arr
                if hf_key(k).endswith("embed_tokens.weight"):
                    pinned[hf_key(k) + "[:64]"] = arr[:64].copy()
            else:
                arr = np.array(v.astype(mx.float32))
                if hf_key(k) == "model.visual.patch_embed.proj.weight" and arr.ndim == 5:
                    arr = np.ascontiguousarray(arr.transpose(0, 4, 1, 2, 3))
            dense[hf_key(k)] = arr
        Path(cache).mkdir(parents=True, exist_ok=True)
        save_file(dense, str(Path(cache) / f"{name}-dequantized.safetensors"))
        save_file(pinned, str(ck.parent / "dequantized.safetensors"))
        print(f"{name}: {sum(1 for k in weights if k.endswith('.scales'))} quantized tensors")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], [int(b) for b in sys.argv[4].split(",")], int(sys.argv[5]))
