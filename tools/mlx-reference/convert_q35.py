#!/usr/bin/env python3
"""MLX side of goldens/tiny-q35-mlx4 (run by tools/hf-reference/generate-mlx-q35): mlx_vlm's CLI
converts the float Qwen3.5 source (4-bit affine, group 64), then every tensor is written back in
transformers' layout for the reference run: quantized ones dequantized exactly (mx.dequantize in
float32),
and mlx-vlm's `sanitize` (mlx_vlm/models/qwen3_5/qwen3_5.py) undone: the decoder norms it stores
with +1 (input/post-attention layernorms, the final norm, q/k norms; not the DeltaNet's gated norm)
get it taken off, the DeltaNet convolution goes back from [C, K, 1] to [C, 1, K] and the patch
embedding from channels-last to channels-first.

    tools/mlx-reference/.venv/bin/python tools/mlx-reference/convert_q35.py SRC GOLDENS CACHE [NAME]

NAME (default tiny-q35-mlx4) tiny-q35-moe-mlx4 converts the qwen3_5_moe source: mlx-vlm stacks its
experts as `switch_mlp.{gate,up,down}_proj` [E, out, in]; they go back into transformers 5's fused
`experts.gate_up_proj` [E, 2 inter, hidden] (gate rows, then up rows) and `experts.down_proj`.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from convert import float_tensors, hf_key, load_all

NAME = "tiny-q35-mlx4"
SHIFTED = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight", ".q_norm.weight",
           ".k_norm.weight")


def main(src, out_root, cache, name=NAME):
    ck = Path(out_root) / name / "checkpoint"
    if ck.parent.exists():
        shutil.rmtree(ck.parent)
    subprocess.run([sys.executable, "-m", "mlx_vlm", "convert", "--hf-path", src, "--mlx-path", str(ck),
                    "-q", "--q-bits", "4", "--q-group-size", "64"], check=True)
    # The tokenizer is goldens/tokenizer-q35's (linked, not stored twice).
    (ck / "tokenizer.json").unlink()
    os.symlink(os.path.join("..", "..", "tokenizer-q35", "tokenizer.json"), ck / "tokenizer.json")
    (ck / "README.md").unlink(missing_ok=True)
    cfg = json.loads((ck / "config.json").read_text())
    dense = {}
    weights = load_all(ck)
    for k, arr, _ in float_tensors(weights, cfg):
        key = hf_key(k)
        if key.startswith("model.language_model.") and key.endswith(SHIFTED):
            arr = arr - np.float32(1.0)
        if key.endswith(".linear_attn.conv1d.weight") and arr.shape[-1] == 1:
            arr = np.ascontiguousarray(np.moveaxis(arr, 2, 1))
        if key == "model.visual.patch_embed.proj.weight" and arr.ndim == 5:
            arr = np.ascontiguousarray(arr.transpose(0, 4, 1, 2, 3))
        dense[key] = arr
    for k in [k for k in dense if k.endswith(".mlp.switch_mlp.gate_proj.weight")]:
        base_key = k[: -len(".switch_mlp.gate_proj.weight")]
        gate, up = dense.pop(k), dense.pop(f"{base_key}.switch_mlp.up_proj.weight")
        dense[f"{base_key}.experts.gate_up_proj"] = np.ascontiguousarray(np.concatenate([gate, up], axis=1))
        dense[f"{base_key}.experts.down_proj"] = dense.pop(f"{base_key}.switch_mlp.down_proj.weight")
    Path(cache).mkdir(parents=True, exist_ok=True)
    save_file(dense, str(Path(cache) / f"{name}-dequantized.safetensors"))
    print(f"{name}: {sum(1 for k in weights if k.endswith('.scales'))} quantized tensors of {len(dense)}")


if __name__ == "__main__":
    main(*sys.argv[1:5])
