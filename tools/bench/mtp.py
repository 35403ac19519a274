#!/usr/bin/env python3
"""Qwen3.5's MTP head (`--speculative mtp`) against llama.cpp's (`--spec-type draft-mtp`) on the
same GGUF file: cold processes, alternating rounds, medians.

  tools/bench/mtp.py target/bench-q35-gguf/model-Q4_K_M.gguf [--rounds 3] [--tokens 96]
      [--vl target/release/vl] [--llama target/llama.cpp/build/bin] [--ks 1,2,3]
      [--draft-vocab 32768]

Random weights: the head's drafts are never the model's picks, so every pass verifies k drafts
and keeps none. Each engine's cost of a pass (k head passes, then one verify pass of 1 + k rows)
against its plain step is measured whole (vl: decode seconds over forward passes; llama.cpp:
`--spec-synth-rates 0,..` so that it keeps none either, 1 / its generation tokens per second),
and gives the speed-up at any acceptance rate a of each draft:
E(a, k) = (1 - a^(k+1)) / (1 - a) tokens per pass, over the pass's relative cost.
Then llama.cpp's own synthetic acceptance (`--spec-synth-rates a,a^2,..`) checks that model
against a measured figure."""

import argparse
import os
import statistics

from spec_common import cost_table, llama, vl


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--vl", default="target/release/vl")
    ap.add_argument("--llama", default="target/llama.cpp/build/bin")
    ap.add_argument("--ks", default="1,2,3")
    ap.add_argument("--draft-vocab", type=int, default=32768)
    a = ap.parse_args()
    ks = [int(k) for k in a.ks.split(",")]
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    print(f"CPU: {cpu}, {os.cpu_count()} threads; {a.model}; {a.tokens} tokens; {a.rounds} rounds, cold processes")
    runs = {"vl plain": lambda: vl(a, ["--speculative", "off"]),
            "llama.cpp plain": lambda: llama(a, [])}
    for k in ks:
        runs[f"vl mtp k={k}"] = lambda k=k: vl(a, ["--speculative", "mtp", "--draft-max", str(k)])
        runs[f"vl mtp k={k} vocab {a.draft_vocab}"] = lambda k=k: vl(
            a, ["--speculative", "mtp", "--draft-max", str(k), "--draft-vocab", str(a.draft_vocab)])
        runs[f"llama.cpp mtp k={k}"] = lambda k=k: llama(
            a, ["--spec-type", "draft-mtp", "--spec-draft-n-max", str(k), "--spec-synth-rates", ",".join(["0"] * k)])
    synth = {}
    for k, rate in [(1, 0.8), (3, 0.8)]:
        rates = [rate ** (j + 1) for j in range(k)]
        synth[f"llama.cpp mtp k={k} synthetic a={rate}"] = (k, rate, lambda k=k, rates=rates: llama(
            a, ["--spec-type", "draft-mtp", "--spec-draft-n-max", str(k),
                "--spec-synth-rates", ",".join(f"{r:.4f}" for r in rates)]))
    got = {name: [] for name in list(runs) + list(synth)}
    for r in range(a.rounds):
        for name, f in runs.items():
            got[name].append(f())
        for name, (_, _, f) in synth.items():
            got[name].append(f())
        print(f"round {r + 1} done", flush=True)
    med = {n: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v)) for n, v in got.items()}
    rates = [0.5, 0.7, 0.8, 0.9]
    cost_table(runs, med, rates)
    print("\n| llama.cpp, synthetic acceptance | tok/s | vs its plain | its pass cost model says |")
    print("|---|---|---|---|")
    for name, (k, rate, _) in synth.items():
        cost = med[f"llama.cpp mtp k={k}"][0] / med["llama.cpp plain"][0]
        model = ((1 - rate ** (k + 1)) / (1 - rate)) / cost
        print(f"| {name} | {med[name][1]:.2f} | {med[name][1] / med['llama.cpp plain'][1]:.2f}x | {model:.2f}x |")


if __name__ == "__main__":
    main()
