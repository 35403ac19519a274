#!/usr/bin/env python3
"""Speculative decoding and forced tokens on the CLI path (`vl run --json`, a cold process per
answer, alternating rounds, medians).

  tools/bench/speculative.py target/bench-2b [--rounds 3] [--tokens 96] [--vl target/release/vl]
      [--only ngram|forced|repeat|draft] [--draft target/bench-draft]

1. The verify step's cost: the same greedy answer with n-gram drafts off and at --draft-max k
   (1, 2, 4, 8). Per run: decode tok/s, forward passes, rows per pass, drafts kept. The cost of a
   pass of 1 + k rows against one row gives the speed-up any acceptance rate a would bring:
   E(a, k) = (1 - a^(k+1)) / (1 - a) tokens per pass, over the pass's relative cost. (Random
   weights fall into loops, which n-gram drafts predict: a repeating answer, not a real one.)
2. Forced tokens on a JSON schema (an invoice: keys, enums, bounded numbers and strings), with
   the default bounded whitespace and compact (`x-guidance`): the same request with and without
   --no-forced-tokens, decode tokens per second and answers per second. Its effect does not
   depend on the weights.
3. An answer the drafts predict (one token made certain by logit_bias, through a warm `vl
   serve`): n-gram drafts off, at draft_max 4 and 8.
4. With --draft (a smaller random checkpoint of the family: `tools/bench/make-checkpoint DIR
   --draft`): the draft alone, the model alone, and the model with `--draft-model` at k = 1, 2,
   4, 8. Random weights agree on nothing, so every draft is rejected: each pass's cost (k draft
   passes and a verify pass of 1 + k rows) against a plain step is measured whole, and gives the
   speed-up at any acceptance rate as in 1.
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
    ap.add_argument("--only", choices=["ngram", "forced", "repeat", "draft"])
    ap.add_argument("--draft", help="a draft checkpoint (section 4)")
    a = ap.parse_args()
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    print(f"CPU: {cpu}, {os.cpu_count()} threads; model {a.model}; {a.rounds} rounds, cold processes\n")

    if a.only in (None, "ngram"):
        ngram(a)
    if a.only in (None, "forced"):
        forced_tokens(a)
    if a.only in (None, "repeat"):
        repeating(a)
    if a.draft and a.only in (None, "draft"):
        draft_model(a)


def draft_model(a):
    # 4. A draft model: the cost of a pass that drafts k tokens with it and verifies them.
    prompt = ["--prompt", "Copy this document word for word: " + DOCUMENT]
    ks = [0, 1, 2, 4, 8]
    runs = {k: [] for k in ks}
    alone = []
    for r in range(a.rounds):
        j = run(a.vl, a.draft, a.tokens, prompt)
        alone.append(j)
        print(f"round {r} draft alone: {j['timings']['decode_tokens_per_s']:.2f} tok/s", file=sys.stderr)
        for k in ks:
            extra = prompt + (["--draft-model", a.draft, "--draft-max", str(k)] if k else [])
            j = run(a.vl, a.model, a.tokens, extra)
            runs[k].append(j)
            print(f"round {r} k={k}: {j['timings']['decode_tokens_per_s']:.2f} tok/s, {j['steps']}", file=sys.stderr)
    same = all(runs[k][0]["token_ids"] == runs[0][0]["token_ids"] for k in ks)
    d = statistics.median(j["timings"]["decode_tokens_per_s"] for j in alone)
    print(f"\ndraft alone ({a.draft}): {d:.2f} tok/s decode (median)\n")
    cost_tables(runs, ks, same, [0.5, 0.7, 0.8, 0.9])


def cost_tables(runs, ks, same, rates):
    """Per k: decode tok/s, passes, rows per pass, drafts kept, ms per pass and its cost
    against k = 0 (medians over the rounds); then the speed-up each acceptance rate would give."""
    print("| draft_max k | decode tok/s (median) | forward passes | rows per pass | drafts kept | ms per pass | pass cost vs k=0 |")
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
    for acc in rates:
        cells = []
        for k in ks[1:]:
            per_pass = (1 - acc ** (k + 1)) / (1 - acc)
            cells.append(f"{per_pass / (cost[k] / cost[0]):.2f}x")
        print(f"| {acc} | " + " | ".join(cells) + " |")


def repeating(a):
    # 3. An answer n-gram drafts predict: one token made certain by logit_bias (through `vl
    # serve`, warm), the acceptance an answer that repeats its prompt verbatim approaches.
    import socket
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([a.vl, "serve", "--model", a.model, "--port", str(port), "--host", "127.0.0.1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(base + "/health", timeout=1)
                break
            except OSError:
                time.sleep(0.5)

        def post(spec):
            body = {"messages": [{"role": "user", "content": "Copy this document word for word: " + DOCUMENT}],
                    "max_tokens": a.tokens, "temperature": 0, "logit_bias": {"3751": 100}, "speculative": spec}
            req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            t = time.perf_counter()
            v = json.load(urllib.request.urlopen(req, timeout=600))
            return time.perf_counter() - t, v["usage"]["completion_tokens"], v["choices"][0]["message"]["content"]

        post("off")  # warm
        specs = ["off", {"method": "ngram", "draft_max": 4}, {"method": "ngram", "draft_max": 8}]
        times = {i: [] for i in range(len(specs))}
        texts = {}
        for r in range(a.rounds):
            for i, spec in enumerate(specs):
                t, n, text = post(spec)
                times[i].append(t)
                texts[i] = (n, text)
                print(f"round {r} {spec}: {t:.2f}s for {n} tokens", file=sys.stderr)
        print("\n| repeating answer (logit_bias, warm server) | tokens | request s (median) | tok/s | vs off |")
        print("|---|---|---|---|---|")
        off = statistics.median(times[0])
        for i, spec in enumerate(specs):
            m = statistics.median(times[i])
            name = spec if isinstance(spec, str) else f"ngram, draft_max {spec['draft_max']}"
            print(f"| {name} | {texts[i][0]} | {m:.2f} | {texts[i][0] / m:.2f} | {off / m:.2f}x |")
        print(f"\nanswers identical: {all(texts[i] == texts[0] for i in texts)}")
    finally:
        server.terminate()
        server.wait(timeout=30)


def ngram(a):
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
    cost_tables(runs, ks, same, [0.3, 0.5, 0.7, 0.9])


def forced_tokens(a):
    # 2. Forced tokens on a schema: with the default bounded whitespace, and compact (the
    # schema's own `x-guidance` options: no whitespace but the separators).
    compact = dict(SCHEMA)
    compact["x-guidance"] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    print("\n| schema | forced tokens | tokens | forced | forward passes | decode s (median) | decode tok/s | answers/s (prefill + decode) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, schema_json in [("bounded whitespace", SCHEMA), ("compact (x-guidance)", compact)]:
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(schema_json, f)
            schema = f.name
        base = ["--prompt", "Extract the invoice as JSON: " + DOCUMENT, "--json-schema", schema]
        forced = {True: [], False: []}
        try:
            for r in range(a.rounds):
                for on in (False, True):
                    j = run(a.vl, a.model, 400, base + ([] if on else ["--no-forced-tokens"]))
                    json.loads(j["text"])  # the answer is JSON
                    forced[on].append(j)
                    print(f"round {r} {name} forced={on}: {j['timings']['decode_s']:.2f}s {j['steps']}", file=sys.stderr)
        finally:
            os.unlink(schema)
        med = {}
        for on in (False, True):
            js = forced[on]
            s = js[0]["steps"]
            d = statistics.median(j["timings"]["decode_s"] for j in js)
            whole = statistics.median(j["timings"]["decode_s"] + j["timings"]["prefill_s"] for j in js)
            n = js[0]["generated_tokens"]
            med[on] = (d, n, whole)
            print(f"| {name} | {'on' if on else 'off'} | {n} | {s['forced']} | {s['forward_passes']} | {d:.2f} | {(n - 1) / d:.2f} | {1 / whole:.3f} |")
        print(f"| {name} | on / off | | | | | {((med[True][1] - 1) / med[True][0]) / ((med[False][1] - 1) / med[False][0]):.2f}x | {med[False][2] / med[True][2]:.2f}x |")


if __name__ == "__main__":
    main()
