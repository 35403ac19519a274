"""Times transformers' Qwen3VLVisionModel (float32, torch's default attention for the pinned
transformers: sdpa) on the vision weights of a checkpoint, on square images of the given sizes,
with the same input rows as crates/vl-models/examples/vision_time.rs, and prints one JSON line per
size with the per-block breakdown (forward hooks). Run by tools/bench/vision-side-by-side.

    python vision_time.py CHECKPOINT_DIR THREADS SIZE [SIZE...]

VL_TORCH_DTYPE=bf16 runs the whole tower in torch's bfloat16 instead (weights and activations;
oneDNN's bf16 kernels, AMX where the CPU has it): the peer figure for `--vision-precision bf16`.
"""
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import Qwen3VLConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel


def main():
    ck, threads, sizes = Path(sys.argv[1]), int(sys.argv[2]), [int(s) for s in sys.argv[3:]]
    torch.set_num_threads(threads)
    runs = max(1, int(os.environ.get("VL_VISION_RUNS", "2")))
    cfg = Qwen3VLConfig.from_pretrained(ck).vision_config
    cfg._attn_implementation = "sdpa"
    model = Qwen3VLVisionModel(cfg).eval()
    state = {}
    for f in sorted(ck.glob("*.safetensors")):
        with safe_open(f, framework="pt") as st:
            for k in st.keys():
                if k.startswith("model.visual."):
                    state[k[len("model.visual."):]] = st.get_tensor(k).float()
    model.load_state_dict(state, strict=True)
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[os.environ.get("VL_TORCH_DTYPE", "f32")]
    model = model.to(dtype)

    marks = []
    for blk in model.blocks:
        blk.register_forward_hook(lambda *_: marks.append(time.perf_counter()))

    row = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2
    for size in sizes:
        side = size // cfg.patch_size
        side -= side % cfg.spatial_merge_size
        n = side * side
        i = torch.arange(n * row, dtype=torch.float64)
        pixels = torch.sin(torch.remainder(i, 9973) * 0.0007).float().reshape(n, row).to(dtype)
        grid = torch.tensor([[1, side, side]])
        best = None
        with torch.inference_mode():
            for _ in range(runs):
                marks.clear()
                t0 = time.perf_counter()
                model(pixels, grid)
                total = time.perf_counter() - t0
                if best is None or total < best[0]:
                    blocks = [b - a for a, b in zip([t0] + marks[:-1], marks)]
                    best = (total, blocks)
        total, blocks = best
        print(json.dumps({"impl": "torch", "dtype": str(dtype), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                          "size": size, "patches": n, "seconds": total,
                          "block_mean_s": sum(blocks[1:]) / max(1, len(blocks) - 1), "blocks_s": blocks}), flush=True)


if __name__ == "__main__":
    main()
