#!/usr/bin/env python3
"""Two `vl` binaries on the same files, in alternating rounds, medians: what a refactor must not
change (a tool, not CI). Cold runs: each round starts each binary afresh (load included).

    tools/bench/ab.py OLD_VL NEW_VL MODEL IMAGE [ROUNDS] [TOKENS]

Each run is `vl run --model MODEL --image IMAGE --prompt "Describe this image." --json
--max-new-tokens TOKENS` with the defaults users get (q4k on a CPU). Prints one table: load,
vision encode, time to first token, prefill and decode tokens per second, peak RSS; the median of ROUNDS
(default 3) per binary, and NEW / OLD. The answers' token ids must agree (else it says so)."""
import json
import statistics
import subprocess
import sys


def run(vl, model, image, tokens):
    out = subprocess.run(
        [vl, "run", "--model", model, "--image", image, "--prompt", "Describe this image.", "--json",
         "--max-new-tokens", str(tokens)],
        check=True, capture_output=True, text=True,
    ).stdout
    return json.loads(out)


def main():
    old, new, model, image = sys.argv[1:5]
    rounds = int(sys.argv[5]) if len(sys.argv) > 5 else 3
    tokens = int(sys.argv[6]) if len(sys.argv) > 6 else 32
    keys = [("load_s", "load (s)"), ("vision_s", "vision encode (s)"), ("time_to_first_token_s", "first token (s)"),
            ("prefill_tokens_per_s", "prefill (tok/s)"), ("decode_tokens_per_s", "decode (tok/s)")]
    got = {old: [], new: []}
    for r in range(rounds):
        for vl in (old, new) if r % 2 == 0 else (new, old):
            got[vl].append(run(vl, model, image, tokens))
    ids = {tuple(j["token_ids"]) for j in got[old] + got[new]}
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    print(f"CPU: {cpu}; {model}, {image}, {tokens} tokens, {rounds} alternating cold rounds, medians")
    print("| | old | new | new / old |\n|---|---|---|---|")
    for key, name in keys:
        a = statistics.median(j["timings"][key] for j in got[old])
        b = statistics.median(j["timings"][key] for j in got[new])
        print(f"| {name} | {a:.3f} | {b:.3f} | {b / a:.3f} |")
    a = statistics.median(j["peak_rss_bytes"] for j in got[old]) / 2**30
    b = statistics.median(j["peak_rss_bytes"] for j in got[new]) / 2**30
    print(f"| peak RSS (GiB) | {a:.3f} | {b:.3f} | {b / a:.3f} |")
    print("answers: the same token ids" if len(ids) == 1 else f"answers DIFFER: {len(ids)} distinct token-id lists")


if __name__ == "__main__":
    main()
