#!/usr/bin/env python3
"""Speculative decoding and forced tokens on the CLI path (`vl run --json`, a cold process per
answer, alternating rounds, medians).

  tools/bench/speculative.py target/bench-2b [--rounds 3] [--tokens 96] [--vl target/release/vl]

1. The verify step's cost: the same greedy answer with n-gram drafts off and at --draft-max k
   (1, 2, 4, 8). Per run: decode tok/s, forward passes, rows per pass, drafts kept. The cost of a
   pass of 1 + k rows against one row gives the speed-up any acceptance rate a would bring:
   E(a, k) = (1 - a^(k+1)) / (1 - a) tokens per pass, over the pass's relative cost. (Random
   weights fall into loops, which n-gram drafts predict: a repeating answer, not a real one.)
2. Forced tokens on a JSON schema (an invoice: keys, enums, bounded numbers and strings): the
   same request with and without --no-forced-tokens, answers per second and tokens per second
   of the decode phase. Its effect does not depend on the weights.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

DOCUMENT = (
    "Invoice 2024-117 from Harbour Supplies Ltd, 14 Quay Street, Bristol. Billed to North Pier Cafe. "
    "Two crates of coffee beans at 48.50 each, one espresso grinder at 310.00, six boxes of paper cups "
    "at 12.25 each. Subtotal 480.50, VAT 96.10, total 576.60 GBP, due on 2024-03-31. Paid by card."
)

SCHEMA = {
    "type": "object",
    "properties": {
        "invoice_number": {"type": "string", "maxLength": 10},
        "supplier": {"type": "string", "maxLength": 24},
        "currency": {"enum": ["GBP", "EUR", "USD"]},
        "status": {"enum": ["paid_by_card", "paid_by_transfer", "unpaid"]},
        "line_items": {
            "type": "array",
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "description": {"type": "string", "maxLength": 16},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                },
                "required": ["description", "quantity"],
                "additionalProperties": False,
            },
        },
        "total_in_pence": {"type": "integer", "minimum": 0, "maximum": 999999},
    },
    "required": ["invoice_number", "supplier", "currency", "status", "line_items", "total_in_pence"],
    "additionalProperties": False,
}


def run(vl, model, tokens, extra):
    cmd = [vl, "run", "--model", model, "--max-new-tokens", str(tokens), "--json"] + extra
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--vl", default="target/release/vl")
    a = ap.parse_args()
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    print(f"CPU: {cpu}, {os.cpu_count()} threads; model {a.model}; {a.rounds} rounds, cold processes\n")

    # 1. n-gram drafts: the cost of verifying k drafted tokens.
    prompt = ["--prompt", "Copy this document word for word: " + DOCUMENT]
    ks = [0, 1, 2, 4, 8]
    runs = {k: [] for k in ks}
    for r in range(a.rounds):
        for k in ks:
            extra = prompt + (["--speculative", "ngram", "--draft-max", str(k), "--ngram-min", "1"] if k else [])
            j = run(a.vl, a.model, a.tokens, extra)
            runs[k].append(j)
            s, t = j["steps"], j["timings"]
            print(f"round {r} k={k}: {t['decode_tokens_per_s']:.2f} tok/s, {s}", file=sys.stderr)
    ids = {k: runs[k][0]["token_ids"] for k in ks}
    same = all(ids[k] == ids[0] for k in ks)
    print(f"| draft_max k | decode tok/s (median) | forward passes | rows per pass | drafts kept | ms per pass | pass cost vs k=0 |")
    print("|---|---|---|---|---|---|---|")
    cost = {}
    for k in ks:
        med = statistics.median(j["timings"]["decode_tokens_per_s"] for j in runs[k])
        s = runs[k][0]["steps"]
        passes = max(s["forward_passes"], 1)
        ms = statistics.median(1000 * j["timings"]["decode_s"] / max(j["steps"]["forward_passes"], 1) for j in runs[k])
        cost[k] = ms
        kept = f"{s['accepted']}/{s['drafted']}" if k else "-"
        rows = (passes + s["drafted"]) / passes
        print(f"| {k or 'off'} | {med:.2f} | {passes} | {rows:.2f} | {kept} | {ms:.1f} | {ms / cost[0]:.2f} |")
    print(f"\nanswers identical across k: {same}\n")
    print("| acceptance a | " + " | ".join(f"k={k}" for k in ks[1:]) + " |")
    print("|---|" + "---|" * (len(ks) - 1))
    for acc in [0.3, 0.5, 0.7, 0.9]:
        cells = []
        for k in ks[1:]:
            per_pass = (1 - acc ** (k + 1)) / (1 - acc)
            cells.append(f"{per_pass / (cost[k] / cost[0]):.2f}x")
        print(f"| {acc} | " + " | ".join(cells) + " |")

    # 2. Forced tokens on a schema.
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(SCHEMA, f)
        schema = f.name
    base = ["--prompt", "Extract the invoice as JSON: " + DOCUMENT, "--json-schema", schema]
    forced = {True: [], False: []}
    try:
        for r in range(a.rounds):
            for on in (False, True):
                j = run(a.vl, a.model, 400, base + ([] if on else ["--no-forced-tokens"]))
                json.loads(j["text"])  # the answer is JSON
                forced[on].append(j)
                print(f"round {r} forced={on}: {j['timings']['decode_s']:.2f}s {j['steps']}", file=sys.stderr)
    finally:
        os.unlink(schema)
    print("\n| forced tokens | tokens | forced | forward passes | answer decode s (median) | answers/s | tok/s |")
    print("|---|---|---|---|---|---|---|")
    med = {}
    for on in (False, True):
        js = forced[on]
        s = js[0]["steps"]
        d = statistics.median(j["timings"]["decode_s"] + j["timings"]["prefill_s"] for j in js)
        n = js[0]["generated_tokens"]
        med[on] = (d, n)
        print(f"| {'on' if on else 'off'} | {n} | {s['forced']} | {s['forward_passes']} | {d:.2f} | {1 / d:.3f} | {n / d:.2f} |")
    print(f"\nanswers per second, on / off: {med[False][0] / med[True][0]:.2f}x; "
          f"tokens per second: {(med[True][1] / med[True][0]) / (med[False][1] / med[False][0]):.2f}x")


if __name__ == "__main__":
    main()
