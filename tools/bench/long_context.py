"""Decode at a long context (default 32,000 positions; docs/qwen35.md): vl on the near-2B Qwen3.5
Q4_K_M GGUF (tools/bench/q35-side-by-side makes it), llama.cpp's llama-bench on the same file, and
vl on the Qwen3-VL 2B (target/bench-2b, q4k at load), one cold process each (a 32k prefill takes
minutes), 2 threads, peak RSS from /usr/bin/time:

    python3 tools/bench/long_context.py 32000 vlq35,llama,vl2b [ROUNDS]

An engine name followed by `:f16` or `:bf16` runs vl with `--kv-cache-dtype` so (its KV cache in
half precision); `vl2bg` / `llama2b` are vl and llama.cpp on the Qwen3-VL 2B geometry's Q4_K_M
GGUF (target/draft-sbs, tools/bench/draft-side-by-side makes it). With ROUNDS > 1 the engines
run in alternating rounds (the first of a round rotating) and the medians are printed last.

The prompt is 32,000 - 8 short words of one token each (the chat template adds 8), so it fits in
one argument (the kernel takes at most 128 KiB an argument)."""
import json, re, subprocess, sys, time
ROOT = str(__import__("pathlib").Path(__file__).resolve().parents[2])
VL = f"{ROOT}/target/release/vl"
Q35 = f"{ROOT}/target/bench-q35-gguf/model-Q4_K_M.gguf"
VL2B = f"{ROOT}/target/bench-2b"
VL2BG = f"{ROOT}/target/draft-sbs/model-Q4_K_M.gguf"
BIN = f"{ROOT}/target/llama.cpp/build/bin"
DEPTH = int(sys.argv[1]) if len(sys.argv) > 1 else 32000
WORDS = "a an the of to in on at by it is as or be we he me my up so no go do".split()
def prompt(tokens):
    return " ".join(WORDS[i % len(WORDS)] for i in range(tokens - 8))
def timed(cmd):
    t = time.time()
    p = subprocess.run(["/usr/bin/time", "-f", "TIME %e %M"] + cmd, capture_output=True, text=True)
    if p.returncode != 0:
        print("FAILED", cmd[:3], p.stderr[-1500:], flush=True); return None, None, None
    wall, rss = re.findall(r"TIME ([\d.]+) (\d+)", p.stderr)[-1]
    return p.stdout, float(wall), int(rss) / 1024 / 1024
def vl(model, kv=None):
    extra = ["--kv-cache-dtype", kv] if kv else []
    out, wall, rss = timed([VL, "run", "--model", model, "--prompt", prompt(DEPTH), "--max-new-tokens", "32", "--temperature", "0", "--json", "--kv-cache-mib", "8192"] + extra)
    if out is None: return None
    j = json.loads(out)
    print(json.dumps({"engine": "vl", "model": model, "kv_cache_dtype": j.get("kv_cache_dtype"), "prompt_tokens": j["prompt_tokens"], "timings": j["timings"], "wall_s": wall, "peak_rss_gib": round(rss, 3)}), flush=True)
    return j["timings"]["decode_tokens_per_s"], rss
def llama(model=Q35):
    out, wall, rss = timed([f"{BIN}/llama-bench", "-m", model, "-t", "2", "-p", "0", "-n", "32", "-d", str(DEPTH), "-r", "1", "-o", "json"])
    if out is None: return None
    r = json.loads(out)[0]
    print(json.dumps({"engine": "llama.cpp", "model": model, "depth": r["n_depth"], "tg_tok_s": r["avg_ts"], "wall_s": wall, "peak_rss_gib": round(rss, 3)}), flush=True)
    return r["avg_ts"], rss
print("CPU:", open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0], flush=True)
ENGINES = {"vlq35": lambda kv: vl(Q35, kv), "llama": lambda _: llama(), "vl2b": lambda kv: vl(VL2B, kv),
           "vl2bg": lambda kv: vl(VL2BG, kv), "llama2b": lambda _: llama(VL2BG)}
names = sys.argv[2].split(",")
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 1
got = {n: [] for n in names}
for r in range(rounds):
    for n in names[r % len(names):] + names[:r % len(names)]:
        base, _, kv = n.partition(":")
        res = ENGINES[base](kv or None)
        if res: got[n].append(res)
if rounds > 1:
    import statistics
    print(f"\nmedians of {rounds} rounds at {DEPTH} positions: engine | decode tok/s | peak RSS GiB")
    for n in names:
        if got[n]:
            print(f"| {n} | {statistics.median(g[0] for g in got[n]):.2f} | {statistics.median(g[1] for g in got[n]):.2f} |")
