"""Replicas behind a router: prefix-cache hit rate and throughput of three `vl serve` replicas
behind vllm-router (consistent hash on `X-Session-ID`; round robin for contrast) and
sglang-router (cache-aware), against one replica alone, on the same conversations' shape, in
alternating rounds, warm replicas, medians.

    python3 tools/bench/router.py target/bench-2b [ROUNDS] [CONVERSATIONS] [TURNS]

Needs `target/release/vl` and the routers (`tools/py-clients/setup`). Each configuration gets
conversations of its own (new text each round, so no cache carries over from another run):
each opens with a 60-word note and asks a question, then short follow-ups; 16 greedy tokens
an answer; all conversations asked together, a turn at a time. Replicas: q4k, `--parallel 4`.
Prints per configuration and round: turns/s, answer tok/s, and the hit rate (cached prompt
tokens / prompt tokens, over the turns after the first); then the medians.
"""

import json
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

model = sys.argv[1]
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
CONVS = int(sys.argv[3]) if len(sys.argv) > 3 else 12
TURNS = int(sys.argv[4]) if len(sys.argv) > 4 else 4
TOKENS = 16
root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
vl = os.path.join(root, "target/release/vl")
py = os.path.join(root, "target/py-clients/bin/python")
WORDS = "river stone maple quartz harbor glacier ember violet tundra saffron cloud anchor".split()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url, timeout=5):
    return urllib.request.urlopen(url, timeout=timeout).read()


def wait(url, ok, what, limit=300):
    t0 = time.time()
    while time.time() - t0 < limit:
        try:
            if ok(get(url)):
                return
        except Exception:
            pass
        time.sleep(0.2)
    sys.exit(f"{what} did not come up")


def replica():
    port = free_port()
    p = subprocess.Popen(
        [vl, "serve", "--model", model, "--port", str(port), "--parallel", "4", "--quantize", "q4k"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait(url + "/health", lambda b: True, "vl serve")
    return p, url


def router(module, policy, workers):
    port = free_port()
    p = subprocess.Popen(
        [py, "-m", module, "--worker-urls", *workers, "--policy", policy, "--host", "127.0.0.1",
         "--port", str(port), "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
         "--log-level", "warn" if module.startswith("sglang") else "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait(url + "/workers", lambda b: sum(w["is_healthy"] for w in json.loads(b)["workers"]) == len(workers), module)
    return p, url


def first_turn(rng, c):
    return f"Conversation {c}. A note: {' '.join(rng.choice(WORDS) for _ in range(60))}. What is it about?"


def ask(base, c, history):
    body = json.dumps({"model": "m", "messages": history, "max_tokens": TOKENS}).encode()
    req = urllib.request.Request(base + "/v1/chat/completions", body,
                                 {"content-type": "application/json", "x-session-id": f"c{c}-{id(history)}"})
    v = json.load(urllib.request.urlopen(req, timeout=600))
    u = v["usage"]
    return v["choices"][0]["message"]["content"], u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"], u["completion_tokens"]


def run(base, seed):
    rng = random.Random(seed)
    hist = [[{"role": "user", "content": first_turn(rng, c)}] for c in range(CONVS)]
    prompt = cached = answered = 0
    t0 = time.time()
    for t in range(TURNS):
        out = [None] * CONVS

        def one(c):
            out[c] = ask(base, c, hist[c])

        th = [threading.Thread(target=one, args=(c,)) for c in range(CONVS)]
        for x in th:
            x.start()
        for x in th:
            x.join()
        for c, (text, p, k, n) in enumerate(out):
            hist[c] += [{"role": "assistant", "content": text},
                        {"role": "user", "content": f"Turn {t + 1}: tell me more about {rng.choice(WORDS)}."}]
            answered += n
            if t > 0:
                prompt += p
                cached += k
    wall = time.time() - t0
    return CONVS * TURNS / wall, answered / wall, cached / max(prompt, 1)


procs = []
try:
    reps = [replica() for _ in range(3)]
    procs += [p for p, _ in reps]
    urls = [u for _, u in reps]
    routers = {
        "vllm-router consistent_hash": router("vllm_router.launch_router", "consistent_hash", urls),
        "vllm-router round_robin": router("vllm_router.launch_router", "round_robin", urls),
        "sglang-router cache_aware": router("sglang_router.launch_router", "cache_aware", urls),
    }
    procs += [p for p, _ in routers.values()]
    configs = [("one replica", urls[0])] + [(k, u) for k, (_, u) in routers.items()]
    results = {k: [] for k, _ in configs}
    seed = 20261205
    for r in range(rounds):
        order = configs if r % 2 == 0 else configs[::-1]
        for name, base in order:
            seed += 1
            turns, toks, hit = run(base, seed)
            results[name].append((turns, toks, hit))
            print(f"round {r} {name:30s} {turns:6.3f} turns/s {toks:7.2f} tok/s hit rate {hit:.3f}", flush=True)
    print("medians:")
    for name, rs in results.items():
        med = [statistics.median(x[i] for x in rs) for i in range(3)]
        print(f"  {name:30s} {med[0]:6.3f} turns/s {med[1]:7.2f} tok/s hit rate {med[2]:.3f}")
finally:
    for p in procs:
        p.kill()
