"""What the speculative-decoding side-by-sides share (`mtp.py`, `draft_side_by_side.py`): one cold
`vl run` or `llama-cli` answer's seconds per forward pass and tokens per second, and the table of
pass costs with the speed-up each acceptance rate would give."""

import json
import os
import re
import subprocess

PROMPT = "Tell me a story about a lighthouse keeper and a storm."


def vl(a, extra):
    """`vl run` on a.model: (decode seconds per forward pass, generated tokens per second)."""
    cmd = [a.vl, "run", "--model", a.model, "--prompt", PROMPT, "--max-new-tokens", str(a.tokens), "--json"] + extra
    r = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    passes = r["steps"]["forward_passes"]
    return r["timings"]["decode_s"] / passes, r["generated_tokens"] / r["timings"]["decode_s"]


def llama(a, extra, ctx=None):
    """`llama-cli` on a.model, greedy, 2 threads: (1 / its generation tokens per second, that rate);
    one pass a token where no draft is kept. `ctx` bounds its context (else the file's own)."""
    cmd = [os.path.join(a.llama, "llama-cli"), "-m", a.model, "-n", str(a.tokens), "-p", PROMPT, "-st", "-t", "2",
           "--temp", "0"] + (["-c", str(ctx)] if ctx else []) + extra
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600).stdout
    m = re.search(r"Generation: ([0-9.]+) t/s", out)
    if not m:
        raise SystemExit(f"llama-cli said no generation speed: {out[-2000:]}")
    tps = float(m.group(1))
    return 1.0 / tps, tps


def cost_table(names, med, rates, ms=False):
    """Per run: its time per pass, tok/s, cost against its engine's plain step, and at each
    acceptance rate a: E(a, k) = (1 - a^(k+1)) / (1 - a) tokens per pass over that cost."""
    unit = "ms per pass" if ms else "s per pass"
    print(f"\n| run | {unit} | tok/s | pass cost vs plain | " + " | ".join(f"a={x}" for x in rates) + " |")
    print("|---|---|---|---|" + "---|" * len(rates))
    for name in names:
        engine = "vl" if name.startswith("vl") else "llama.cpp"
        cost = med[name][0] / med[f"{engine} plain"][0]
        k = int(re.search(r"k=(\d+)", name).group(1)) if "k=" in name else 0
        ups = [((1 - x ** (k + 1)) / (1 - x)) / cost for x in rates]
        print(f"| {name} | {med[name][0] * 1e3:.1f}{'' if ms else ' ms'} | {med[name][1]:.2f} | {cost:.2f} | "
              + " | ".join(f"{u:.2f}x" for u in ups) + " |")
