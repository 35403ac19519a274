"""One offline batch of image questions through the Python API (threads) and through `vl serve`
with the openai client, on the same checkpoint and images, in alternating rounds, warm, medians.

    target/py-test/bin/python tools/bench/py_vs_http.py target/bench-2b [QUESTIONS] [ROUNDS]
    THREADS=1 ONLY=python target/py-test/bin/python tools/bench/py_vs_http.py target/bench-2b 16 1

(`THREADS`: client threads, default 8; `ONLY=python` or `ONLY=http`: one path, the other
neither loaded nor started.)

Needs the package (`pip install ./crates/vl-py`), `openai` and Pillow in that venv, and
`target/release/vl`. Each question is a distinct 224x224 image (seeded noise) and "Describe this
image.", 8 greedy tokens; both paths quantize the text decoder to q4k and decode 4 sequences
together; 8 client threads each. Prints questions/s and output tok/s per path and round, then
the medians and what the HTTP path costs.
"""

import base64
import concurrent.futures as cf
import io
import os
import random
import statistics
import subprocess
import sys
import time

import openai
from PIL import Image

import vl

model = sys.argv[1]
questions = int(sys.argv[2]) if len(sys.argv) > 2 else 200
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 2
THREADS = int(os.environ.get("THREADS", "8"))
ONLY = os.environ.get("ONLY")
TOKENS, PARALLEL = 8, 4

rng = random.Random(20261205)
images = []
for _ in range(questions + 8):
    im = Image.frombytes("RGB", (224, 224), bytes(rng.getrandbits(8) for _ in range(224 * 224 * 3)))
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    images.append(buf.getvalue())
urls = ["data:image/png;base64," + base64.b64encode(b).decode() for b in images]


def messages(url):
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "Describe this image."}]}]


def run(ask, batch):
    started = time.perf_counter()
    with cf.ThreadPoolExecutor(THREADS) as pool:
        tokens = sum(pool.map(ask, batch))
    return time.perf_counter() - started, tokens


# No image cache on either path: every round encodes every image.
engine = None if ONLY == "http" else vl.Engine(model, quantize="q4k", parallel=PARALLEL, image_cache_mib=0)


def py_ask(url):
    return engine.chat(messages(url), max_tokens=TOKENS, temperature=0).usage["completion_tokens"]


server = None if ONLY == "python" else subprocess.Popen(["target/release/vl", "serve", "--model", model, "--quantize", "q4k", "--parallel",
                           str(PARALLEL), "--image-cache-mib", "0", "--port", "0", "--no-ui"], stderr=subprocess.PIPE, text=True)
base = "http://unused"
for line in server.stderr if server else []:
    if line.startswith("listening on "):
        base = line.split()[-1]
        break
client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600)


def http_ask(url):
    r = client.chat.completions.create(model="m", messages=messages(url), max_tokens=TOKENS, temperature=0)
    return r.usage.completion_tokens


try:
    order = tuple((n, a) for n, a in (("python", py_ask), ("http", http_ask)) if ONLY in (None, n))
    # Warm (weights paged in, threads started).
    for _, ask in order:
        run(ask, urls[:8])
    result = {name: [] for name, _ in order}
    for r in range(rounds):
        for name, ask in order if r % 2 == 0 else order[::-1]:
            secs, tokens = run(ask, urls[8:])
            result[name].append((secs, tokens))
            print(f"round {r} {name}: {questions / secs:.2f} questions/s, {tokens / secs:.1f} tok/s ({secs:.1f} s)", flush=True)
    med = {name: statistics.median(questions / secs for secs, _ in r) for name, r in result.items()}
    print(f"| path | questions/s (median of {rounds}) |\n|---|---|")
    for name, label in (("python", "Python API"), ("http", "vl serve + openai client")):
        if name in med:
            print(f"| {label}, {THREADS} threads | {med[name]:.3f} |")
    if len(med) == 2:
        print(f"| HTTP / Python | {med['http'] / med['python']:.3f} |")
finally:
    if server:
        server.terminate()
        server.wait(timeout=30)
