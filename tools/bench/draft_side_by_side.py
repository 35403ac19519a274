#!/usr/bin/env python3
"""A draft model against llama.cpp's (`-md`, `--spec-type draft-simple`) on the same GGUF pair:
cold processes, alternating rounds, medians.

  tools/bench/draft_side_by_side.py MODEL.gguf DRAFT.gguf [--rounds 3] [--tokens 96]
      [--vl target/release/vl] [--llama target/llama.cpp/build/bin] [--ks 1,2,4]

The pair: llama.cpp's converter and `llama-quantize Q4_K_M` on the 2B-geometry checkpoint and
on the 0.3B draft of the same family (`tools/bench/make-checkpoint DIR --draft`), both text only.
Random weights: the draft's picks are never the model's, so every pass drafts k tokens and keeps
none, and each engine's cost of a pass (k draft passes, then one verify pass of 1 + k rows)
against its plain step is measured whole (vl: decode seconds over forward passes; llama.cpp: 1 /
its generation tokens per second, one pass a token when nothing is kept), and gives the speed-up
at any acceptance rate a of each draft: E(a, k) = (1 - a^(k+1)) / (1 - a) tokens per pass, over
the pass's relative cost."""

import argparse
import os
import statistics

from spec_common import cost_table, llama, vl

# The file's own context (256k positions) made llama-cli hold ~17 GB with a draft.
CTX = 4096


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("draft")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--vl", default="target/release/vl")
    ap.add_argument("--llama", default="target/llama.cpp/build/bin")
    ap.add_argument("--ks", default="1,2,4")
    a = ap.parse_args()
    ks = [int(k) for k in a.ks.split(",")]
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    print(f"CPU: {cpu}, {os.cpu_count()} threads; {a.model} drafted for by {a.draft}; {a.tokens} tokens; "
          f"{a.rounds} rounds, cold processes")
    runs = {"vl plain": lambda: vl(a, ["--speculative", "off"]),
            "llama.cpp plain": lambda: llama(a, [], CTX)}
    for k in ks:
        runs[f"vl draft k={k}"] = lambda k=k: vl(a, ["--draft-model", a.draft, "--draft-max", str(k)])
        runs[f"llama.cpp draft k={k}"] = lambda k=k: llama(
            a, ["-md", a.draft, "--spec-type", "draft-simple", "--spec-draft-n-max", str(k),
                "--spec-draft-n-min", "0", "-td", "2"], CTX)
    got = {name: [] for name in runs}
    for r in range(a.rounds):
        for name, f in runs.items():
            got[name].append(f())
        print(f"round {r + 1} done", flush=True)
    med = {n: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v)) for n, v in got.items()}
    cost_table(runs, med, [0.5, 0.7, 0.8, 0.9], ms=True)


if __name__ == "__main__":
    main()
