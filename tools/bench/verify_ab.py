#!/usr/bin/env python3
"""The verify pass's cost, two `vl` binaries on the same files, alternating rounds, medians
(what a kernel change to the small-batch products must show; a tool, not CI).

  tools/bench/verify_ab.py OLD_VL NEW_VL MODEL [--rounds 3] [--tokens 96] [--ks 0,1,2,4,8]
      [--source ngram|mtp] [--draft-vocab N]

Each run is `vl run --model MODEL --json --max-new-tokens TOKENS` on a prompt that asks to copy a
document, with `--speculative SOURCE --draft-max k` (`--ngram-min 1` for n-gram; k = 0 runs with
`--speculative off`), a cold process each. Random weights keep few drafts, so a pass is mostly the
cost of verifying its rows: per binary and k, the median ms per forward pass (decode seconds over
passes), the rows per pass, and the pass cost against one row with the same binary. The answers
must be the same for every k and both binaries (else it says so)."""
import argparse
import json
import os
import statistics
import subprocess
import sys

DOCUMENT = (
    "Invoice 2024-117 from Harbour Supplies Ltd, 14 Quay Street, Bristol. Billed to North Pier Cafe. "
    "Two crates of coffee beans at 48.50 each, one espresso grinder at 310.00, six boxes of paper cups "
    "at 12.25 each. Subtotal 480.50, VAT 96.10, total 576.60 GBP, due on 2024-03-31. Paid by card."
)


def run(vl, a, k):
    cmd = [vl, "run", "--model", a.model, "--prompt", "Copy this document word for word: " + DOCUMENT,
           "--max-new-tokens", str(a.tokens), "--json"]
    if k == 0:
        cmd += ["--speculative", "off"]
    else:
        cmd += ["--speculative", a.source, "--draft-max", str(k)]
        cmd += ["--ngram-min", "1"] if a.source == "ngram" else []
        cmd += ["--draft-vocab", str(a.draft_vocab)] if a.source == "mtp" and a.draft_vocab else []
    return json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("model")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--ks", default="0,1,2,4,8")
    ap.add_argument("--source", choices=["ngram", "mtp"], default="ngram")
    ap.add_argument("--draft-vocab", type=int, default=0)
    a = ap.parse_args()
    ks = [int(k) for k in a.ks.split(",")]
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    print(f"CPU: {cpu}, {os.cpu_count()} threads; {a.model}; {a.source}; {a.rounds} rounds, cold processes\n")
    bins = {"old": a.old, "new": a.new}
    runs = {(b, k): [] for b in bins for k in ks}
    for r in range(a.rounds):
        for k in ks:
            for b in (["old", "new"] if r % 2 == 0 else ["new", "old"]):
                j = run(bins[b], a, k)
                runs[(b, k)].append(j)
                print(f"round {r} {b} k={k}: {j['timings']['decode_tokens_per_s']:.2f} tok/s, {j['steps']}",
                      file=sys.stderr)
    first = runs[("old", ks[0])][0]["token_ids"]
    same = all(js[0]["token_ids"] == first for js in runs.values())

    def ms(b, k):
        return statistics.median(1000 * j["timings"]["decode_s"] / max(j["steps"]["forward_passes"], 1)
                                 for j in runs[(b, k)])

    print("| k | rows per pass | old ms/pass | new ms/pass | new / old | old cost vs 1 row | new cost vs 1 row |")
    print("|---|---|---|---|---|---|---|")
    for k in ks:
        s = runs[("new", k)][0]["steps"]
        passes = max(s["forward_passes"], 1)
        rows = (passes + s.get("drafted", 0)) / passes
        o, n = ms("old", k), ms("new", k)
        print(f"| {k or 'off'} | {rows:.2f} | {o:.1f} | {n:.1f} | {n / o:.2f} | {o / ms('old', ks[0]):.2f} | "
              f"{n / ms('new', ks[0]):.2f} |")
    print(f"\nanswers identical across k and binaries: {same}")


if __name__ == "__main__":
    main()
