"""Embedding and reranking side by side with transformers on torch (a tool, not CI): the same
inputs, the same machine, warm, alternating rounds, medians. Run through
tools/bench/pool-side-by-side.

    pool_side_by_side.py CHECKPOINT WORKDIR ROUNDS THREADS TASK [TASK...]

CHECKPOINT is a Qwen3-VL checkpoint (target/bench-2b: the 2B geometry, random weights); it is laid
out twice under WORKDIR as the released Qwen3-VL-Embedding and Qwen3-VL-Reranker are (links to its
files plus the Sentence Transformers files). Tasks: texts (256 short texts embedded), images (64
distinct 448x448 images embedded, 196 visual tokens each), rerank (one query against 100
documents). Ours: `vl embed` / `vl rerank` with the CPU defaults (q4k text decoder, f32 vision),
timed by their own report of the pooling call (the model loaded, as the torch side's is; the
first call, so ours is no warmer than torch's warmed-up one). Torch: pool_torch.py (float32).
"""
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from PIL import Image, ImageEnhance

ROOT = Path(__file__).resolve().parents[2]
VL = ROOT / "target" / "release" / "vl"
WORDS = ["red", "blue", "green", "yellow", "black", "white", "small", "large", "old", "new", "wooden", "metal",
         "bright", "dark", "round", "square"]
THINGS = ["cat", "dog", "car", "house", "chair", "tree", "boat", "lamp", "phone", "book", "cup", "bicycle",
          "window", "door", "clock", "bridge"]


def layout(ck, work):
    """WORKDIR/embed and WORKDIR/rerank: the checkpoint's files linked, with the heads' files."""
    for kind in ("embed", "rerank"):
        d = work / kind
        d.mkdir(parents=True, exist_ok=True)
        for f in ck.iterdir():
            link = d / f.name
            if not link.exists():
                link.symlink_to(f.resolve())
        hidden = json.loads((ck / "config.json").read_text())["text_config"]["hidden_size"]
        if kind == "embed":
            modules = [("sentence_transformers.models.Transformer", ""), ("sentence_transformers.models.Pooling", "1_Pooling"),
                       ("sentence_transformers.models.Normalize", "2_Normalize")]
            (d / "1_Pooling").mkdir(exist_ok=True)
            (d / "1_Pooling" / "config.json").write_text(json.dumps(
                {"word_embedding_dimension": hidden, "pooling_mode_lasttoken": True}))
        else:
            modules = [("sentence_transformers.models.Transformer", ""),
                       ("sentence_transformers.cross_encoder.models.LogitScore", "1_LogitScore")]
            (d / "1_LogitScore").mkdir(exist_ok=True)
            (d / "1_LogitScore" / "config.json").write_text(json.dumps({"true_token_id": 9693, "false_token_id": 2152}))
        (d / "modules.json").write_text(json.dumps(
            [{"idx": i, "name": str(i), "path": p, "type": t} for i, (t, p) in enumerate(modules)]))


def make_inputs(work):
    """256 texts, 64 distinct 448x448 images (crops of the photo golden, each shifted and
    recoloured), a query and 100 documents."""
    texts = [f"A photo of a {WORDS[i % 16]} {THINGS[(i * 7) % 16]} next to a {WORDS[(i * 3) % 16]} {THINGS[i // 16]}."
             for i in range(256)]
    photo = Image.open(ROOT / "goldens" / "images" / "photo.jpg").convert("RGB")
    (work / "images").mkdir(exist_ok=True)
    images = []
    for i in range(64):
        w, h = photo.size
        side = min(w, h) * (60 + (i % 8) * 5) // 100
        x, y = (w - side) * (i % 8) // 7, (h - side) * (i // 8) // 7
        img = photo.crop((x, y, x + side, y + side)).resize((448, 448), Image.BICUBIC)
        img = ImageEnhance.Color(img).enhance(0.5 + (i % 5) * 0.25)
        name = f"images/img{i:02}.png"
        img.save(work / name)
        images.append(name)
    docs = [f"Document {i}: the {WORDS[i % 16]} {THINGS[(i * 5) % 16]} is described here in a sentence or two, "
            f"with a note about the {THINGS[(i * 11) % 16]}." for i in range(100)]
    (work / "inputs.json").write_text(json.dumps(
        {"texts": texts, "images": images, "query": "Which document talks about a red cat?", "docs": docs}))


def ours(work, task, inputs, threads):
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads))
    if task == "texts":
        args = ["embed", "--model", str(work / "embed")] + [a for t in inputs["texts"] for a in ("--text", t)]
    elif task == "images":
        args = ["embed", "--model", str(work / "embed")] + [a for p in inputs["images"] for a in ("--image", str(work / p))]
    else:
        args = ["rerank", "--model", str(work / "rerank"), "--query", inputs["query"]] + \
               [a for d in inputs["docs"] for a in ("--doc", d)]
    t0 = time.perf_counter()
    r = subprocess.run([str(VL)] + args, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        sys.exit(f"vl {task}: {r.stderr}")
    m = re.search(r"(\d+) inputs, (\d+) prompt tokens, ([\d.]+) s", r.stderr) or \
        re.search(r"(\d+) documents scored in ([\d.]+) s", r.stderr)
    n, secs = int(m.group(1)), float(m.group(m.lastindex))
    return {"side": "ours", "task": task, "inputs": n, "seconds": secs, "per_second": round(n / secs, 3),
            "wall_with_load": round(wall, 2)}


def main():
    ck, work, rounds, threads = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    tasks = sys.argv[5:] or ["texts", "images", "rerank"]
    work.mkdir(parents=True, exist_ok=True)
    layout(ck, work)
    make_inputs(work)
    inputs = json.loads((work / "inputs.json").read_text())
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    print(f"== CPU: {cpu}, {os.cpu_count()} cores, {threads} threads; {rounds} alternating rounds, medians", flush=True)
    results = {}
    for task in tasks:
        for r in range(rounds):
            order = ["torch", "ours"] if r % 2 == 0 else ["ours", "torch"]
            for side in order:
                if side == "ours":
                    out = ours(work, task, inputs, threads)
                else:
                    p = subprocess.run([sys.executable, str(Path(__file__).parent / "pool_torch.py"), str(work / "embed"),
                                        str(work / "rerank"), str(work), str(threads), task],
                                       capture_output=True, text=True)
                    if p.returncode != 0:
                        sys.exit(f"torch {task}: {p.stderr[-2000:]}")
                    out = json.loads(p.stdout.strip().splitlines()[-1])
                print(json.dumps(out), flush=True)
                results.setdefault((task, side), []).append(out["per_second"])
    print("\n| task | inputs | torch f32 (per s) | ours (per s) | ours / torch |")
    print("|---|---|---|---|---|")
    for task in tasks:
        t, o = statistics.median(results[(task, "torch")]), statistics.median(results[(task, "ours")])
        n = {"texts": 256, "images": 64, "rerank": 100}[task]
        print(f"| {task} | {n} | {t:.2f} | {o:.2f} | {o / t:.2f}x |")


if __name__ == "__main__":
    main()
