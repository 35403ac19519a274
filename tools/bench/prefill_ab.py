"""Two or more `vl` binaries' text prefill on the same file, side by side: cold processes in
alternating rounds (the order reversed every other round), medians of `vl run --json`'s timings.

    python3 tools/bench/prefill_ab.py TOKENS ROUNDS BIN [BIN...]

The model is the near-2B Qwen3.5 Q4_K_M GGUF (tools/bench/q35-side-by-side makes it; MODEL= in
the environment for another); the prompt is TOKENS - 8 one-token words (the template adds 8),
answered with 2 greedy tokens."""
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODEL = os.environ.get("MODEL", str(ROOT / "target/bench-q35-gguf/model-Q4_K_M.gguf"))
WORDS = "a an the of to in on at by it is as or be we he me my up so no go do".split()


def main():
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    n, rounds, bins = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    prompt = " ".join(WORDS[i % len(WORDS)] for i in range(n - 8))
    res = {b: [] for b in bins}
    for r in range(rounds):
        for b in bins if r % 2 == 0 else bins[::-1]:
            cmd = [b, "run", "--model", MODEL, "--prompt", prompt, "--max-new-tokens", "2", "--temperature", "0", "--json"]
            t = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)["timings"]
            res[b].append(t)
            print(json.dumps({"round": r, "bin": b, "prefill_s": t["prefill_s"], "prefill_tokens_per_s": t["prefill_tokens_per_s"]}), flush=True)
    for b in bins:
        pre = [t["prefill_s"] for t in res[b]]
        print(json.dumps({"bin": b, "median_prefill_s": round(statistics.median(pre), 3), "rounds": [round(x, 3) for x in pre]}))


if __name__ == "__main__":
    main()
