"""Times torch's float32 linear layer (F.linear: MKL sgemm plus the bias) on one shape, with the
same protocol as crates/vl-nn/examples/dense_time.rs (best of RUNS calls), and prints one line in
its format. Run by tools/bench/linear-side-by-side.

    python linear_time.py THREADS ROWS IN OUT RUNS
"""
import sys
import time

import torch


def main():
    threads, m, k, n, runs = (int(a) for a in sys.argv[1:6])
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(7)
    x = torch.rand(m, k, generator=g) * 2 - 1
    w = (torch.rand(n, k, generator=g) * 2 - 1) * 0.03
    b = torch.rand(n, generator=g) * 2 - 1
    best, total = float("inf"), 0.0
    with torch.inference_mode():
        for _ in range(runs):
            t = time.perf_counter()
            y = torch.nn.functional.linear(x, w, b)
            best = min(best, time.perf_counter() - t)
            total += float(y.sum())
    print(f"{m}x{k} by {k}x{n}: best {best * 1e3:.1f} ms, {2 * m * k * n / best / 1e9:.0f} GFLOP/s (checksum {total:.3f})")


if __name__ == "__main__":
    main()
