"""llama.cpp and vl side by side on the same files: a Q4_K_M GGUF and an f16 mmproj made by
llama.cpp's converter and llama-quantize from a random checkpoint (the 2B geometry:
tools/bench/side-by-side; the 30B-A3B width: tools/bench/moe-side-by-side, which build llama.cpp
and convert the checkpoint first), 2 threads, alternating rounds (the first engine of a round
alternates), medians.

    python gguf_side_by_side.py MODELS_DIR LLAMA_BIN_DIR VL_BIN IMAGE_448 [ROUNDS]

Per round and engine:
- decode at 200 and 2000 positions (BENCH_DEPTHS=A,B for others): llama-bench -p 0 -n 32 -d 200,2000 (tg32 after a prompt of
  that depth) and `vl run --json` on a text prompt of 200 / 2000 tokens, 32 new tokens
  (decode_tokens_per_s);
- the image answer (the 448x448 image, "Describe this image.", 32 new tokens): llama-mtmd-cli vs
  `vl run --json`: the image prompt's prefill (vision encode + prompt), wall and peak RSS
  (/usr/bin/time), both cold processes; the load: vl's load_s (text model and mmproj), llama.cpp's
  `load time` of the text model plus its mmproj load (`clip_model_loader` to the first
  `load_hparams`... reported as `mmproj load`, when its log has it).

VL_BENCH_ALSO=NAME=VALUE adds a third engine: the same vl binary with that environment variable
set (e.g. VL_STORED=0, candle's products instead of vl_nn::stored), in the rotation and the table.
"""
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

models, llama_bin, vl, image = (Path(a) for a in sys.argv[1:5])
rounds = int(sys.argv[5]) if len(sys.argv) > 5 else 3
# MOE_BENCH_TEXT names another text model in MODELS_DIR (the layer-count point of the
# extrapolation: gguf_first_layers.py); MOE_BENCH_DECODE_ONLY=1 skips the image answer.
text_model = models / os.environ.get("MOE_BENCH_TEXT", "model-Q4_K_M.gguf")
mmproj = models / "mmproj-f16.gguf"
decode_only = os.environ.get("MOE_BENCH_DECODE_ONLY") == "1"
# BENCH_DEPTHS=200,8000: the two decode depths (default 200,2000) (positions before the 32 decoded tokens).
DEPTHS = [int(d) for d in os.environ.get("BENCH_DEPTHS", "200,2000").split(",")]
assert len(DEPTHS) == 2, "BENCH_DEPTHS takes two depths"
THREADS = "2"
WORDS = "the quick brown fox jumps over a lazy dog while seven small birds sing about rivers mountains and distant cities".split()


def prompt(tokens):
    # One token per word with this tokenizer, plus 8 of the chat template.
    return " ".join(WORDS[i % len(WORDS)] for i in range(tokens - 8))


def timed(cmd, env=None):
    """Runs cmd under /usr/bin/time; returns (stdout, stderr, wall s, peak RSS bytes)."""
    p = subprocess.run(["/usr/bin/time", "-f", "TIME %e %M"] + cmd, capture_output=True, text=True,
                       env=None if env is None else {**os.environ, **env})
    if p.returncode != 0:
        sys.exit(f"{cmd[0]} failed ({p.returncode}): {p.stderr[-2000:]}")
    wall, rss = re.findall(r"TIME ([\d.]+) (\d+)", p.stderr)[-1]
    return p.stdout, p.stderr, float(wall), int(rss) * 1024


def llama_decode():
    out = subprocess.run([str(llama_bin / "llama-bench"), "-m", str(text_model), "-t", THREADS, "-p", "0", "-n", "32",
                          "-d", ",".join(map(str, DEPTHS)), "-r", "1", "-o", "json"], capture_output=True, text=True, check=True).stdout
    return {r["n_depth"]: r["avg_ts"] for r in json.loads(out)}


def vl_decode(env=None):
    got = {}
    for depth in DEPTHS:
        out, _, _, _ = timed([str(vl), "run", "--model", str(text_model), "--prompt", prompt(depth),
                              "--max-new-tokens", "32", "--temperature", "0", "--json"], env)
        j = json.loads(out)
        assert abs(j["prompt_tokens"] - depth) <= 2, j["prompt_tokens"]
        got[depth] = j["timings"]["decode_tokens_per_s"]
    return got


def llama_image():
    _, err, wall, rss = timed([str(llama_bin / "llama-mtmd-cli"), "-m", str(text_model), "--mmproj", str(mmproj),
                               "--image", str(image), "-p", "Describe this image.", "-n", "32", "-t", THREADS,
                               "-c", "4096", "--temp", "0", "--perf", "-lv", "4"])
    enc = sum(float(x) for x in re.findall(r"mtmd batch encoding done in (\d+) ms", err))
    dec = sum(float(x) for x in re.findall(r"image decoded \(batch \d+/\d+\) in (\d+) ms", err))
    pe = float(re.search(r"prompt eval time =\s+([\d.]+) ms", err).group(1))
    load = re.search(r"load time =\s+([\d.]+) ms", err)
    # llama_perf's prompt eval spans the whole image prompt: the vision encode, the image
    # embeddings' decode and the text tokens around them (it is their sum plus the text).
    return {"prefill_s": pe / 1000, "encode_s": enc / 1000, "wall_s": wall, "rss": rss,
            "load_s": float(load.group(1)) / 1000 if load else float("nan"),
            "detail": f"encode {enc:.0f} ms, image decode {dec:.0f} ms, prompt eval {pe:.0f} ms"}


def vl_image(env=None):
    out, _, wall, rss = timed([str(vl), "run", "--model", str(text_model), "--mmproj", str(mmproj), "--image",
                               str(image), "--prompt", "Describe this image.", "--max-new-tokens", "32",
                               "--temperature", "0", "--json"], env)
    t = json.loads(out)["timings"]
    return {"prefill_s": t["vision_s"] + t["prefill_s"], "encode_s": t["vision_s"], "wall_s": wall, "rss": rss,
            "load_s": t["load_s"],
            "detail": f"vision {t['vision_s'] * 1000:.0f} ms, prefill {t['prefill_s'] * 1000:.0f} ms, load {t['load_s']:.1f} s"}


engines = [("llama.cpp", llama_decode, llama_image), ("vl", vl_decode, vl_image)]
also = os.environ.get("VL_BENCH_ALSO")
if also:
    key, _, value = also.partition("=")
    engines.append((f"vl {also}", lambda: vl_decode({key: value}), lambda: vl_image({key: value})))
runs = {name: {"decode": [], "image": []} for name, _, _ in engines}
for r in range(rounds):
    # The first engine of a round rotates.
    order = engines[r % len(engines):] + engines[:r % len(engines)]
    for name, dec, img in order:
        d = dec()
        runs[name]["decode"].append(d)
        line = (f"round {r + 1} {name} ({text_model.name}): decode@{DEPTHS[0]} {d[DEPTHS[0]]:.2f} tok/s, "
                f"decode@{DEPTHS[1]} {d[DEPTHS[1]]:.2f} tok/s")
        if not decode_only:
            i = img()
            runs[name]["image"].append(i)
            line += (f"; image prefill {i['prefill_s']:.2f} s ({i['detail']}), wall {i['wall_s']:.1f} s, "
                     f"peak RSS {i['rss'] / 2**30:.2f} GiB")
        print(line, flush=True)


ROWS = [  # (label, "decode" or "image", value of a run, better when "higher" or "lower")
    (f"decode at {DEPTHS[0]} positions (tok/s)", "decode", lambda x: x[DEPTHS[0]], "higher"),
    (f"decode at {DEPTHS[1]} positions (tok/s)", "decode", lambda x: x[DEPTHS[1]], "higher"),
    ("image prompt prefill, encode + prompt (s)", "image", lambda x: x["prefill_s"], "lower"),
    ("of which vision encode (s)", "image", lambda x: x["encode_s"], "lower"),
    ("image answer wall, cold process (s)", "image", lambda x: x["wall_s"], "lower"),
    ("load (vl: text + mmproj; llama.cpp: llama_perf's load time, text only) (s)", "image", lambda x: x["load_s"], "lower"),
    ("image answer peak RSS (GiB)", "image", lambda x: x["rss"] / 2**30, "lower"),
]
extra = [name for name, _, _ in engines[2:]]
print(f"\nmedians of {rounds} rounds | vl | llama.cpp | ratio" + "".join(f" | {n} | ratio" for n in extra))
print("|---|---|---|---|" + "---|---|" * len(extra))
for label, kind, value, better in ROWS:
    if decode_only and kind == "image":
        continue
    med = {name: statistics.median(value(x) for x in runs[name][kind]) for name, _, _ in engines}
    ratio = lambda a, b: a / b if better == "higher" else b / a
    a, b = med["vl"], med["llama.cpp"]
    print(f"| {label} | {a:.2f} | {b:.2f} | {ratio(a, b):.2f}x |" + "".join(f" {med[n]:.2f} | {ratio(med[n], b):.2f}x |" for n in extra))
print("(ratio: vl's speed over llama.cpp's; for times and memory, llama.cpp's over vl's: above 1.0 vl is ahead)")
