"""The torch side of tools/bench/pool-side-by-side: transformers' Qwen3-VL (float32) pooling the
inputs in WORKDIR/inputs.json as the official Qwen3-VL-Embedding and Qwen3-VL-Reranker code pools
them (the prompts of tools/hf-reference/generate.py's embed_conversation and
rerank_conversation, left padding, the last position's hidden state), in batches, warm (one small
batch first). Prints one JSON line per task: {"task", "inputs", "seconds", "per_second", "tokens"}.

    python pool_torch.py EMBED_CHECKPOINT RERANK_CHECKPOINT WORKDIR THREADS TASK [TASK...]

TASK: texts, images, rerank. Batch sizes: VL_TORCH_BATCH (default 16).
"""
import json
import os
import sys
import time
from pathlib import Path

import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hf-reference"))
from generate import embed_conversation, rerank_conversation  # noqa: E402
from transformers import Qwen3VLForConditionalGeneration, Qwen3VLProcessor  # noqa: E402


def batches(items, n):
    for i in range(0, len(items), n):
        yield items[i:i + n]


def main():
    embed_ck, rerank_ck, work, threads = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
    tasks = sys.argv[5:]
    torch.set_num_threads(threads)
    bs = int(os.environ.get("VL_TORCH_BATCH", "16"))
    inputs = json.loads((work / "inputs.json").read_text())
    proc = Qwen3VLProcessor.from_pretrained(embed_ck)
    proc.tokenizer.padding_side = "left"
    model = Qwen3VLForConditionalGeneration.from_pretrained(embed_ck, torch_dtype=torch.float32).eval()
    yes, no = proc.tokenizer.get_vocab()["yes"], proc.tokenizer.get_vocab()["no"]
    w = (model.lm_head.weight[yes] - model.lm_head.weight[no]).detach()

    def last_hidden(convs, images):
        texts = [proc.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in convs]
        batch = proc(text=texts, images=images or None, padding=True, return_tensors="pt")
        with torch.no_grad():
            h = model.model(**batch).last_hidden_state[:, -1]
        return h, int(batch["attention_mask"].sum())

    def run(task, items):
        tokens = 0
        for chunk in batches(items, bs):
            if task == "texts":
                h, t = last_hidden([embed_conversation(None, [x]) for x in chunk], [])
                torch.nn.functional.normalize(h, p=2, dim=-1)
            elif task == "images":
                imgs = [Image.open(work / p).convert("RGB") for p in chunk]
                h, t = last_hidden([embed_conversation(None, [], [p]) for p in chunk], imgs)
                torch.nn.functional.normalize(h, p=2, dim=-1)
            else:
                q = inputs["query"]
                h, t = last_hidden([rerank_conversation(None, ([q], []), ([d], [])) for d in chunk], [])
                torch.sigmoid(h @ w)
            tokens += t
        return tokens

    for task in tasks:
        items = {"texts": inputs["texts"], "images": inputs["images"], "rerank": inputs["docs"]}[task]
        run(task, items[:2])  # warm-up
        t0 = time.perf_counter()
        tokens = run(task, items)
        dt = time.perf_counter() - t0
        print(json.dumps({"side": "torch", "task": task, "inputs": len(items), "seconds": round(dt, 3),
                          "per_second": round(len(items) / dt, 3), "tokens": tokens, "batch": bs}), flush=True)


if __name__ == "__main__":
    main()
