"""Host time per launch of the ops a dfs model call is made of, with the GPU kept busy so that nothing waits
for it: what each matmul, elementwise op and compiled-graph call costs the host, by BLAS backend.

Why: a dfs step on 144 tau-bench records launches ~23,000 kernels and the host, not the GPU, sets its pace
(results/2026-11-26-dfs-host-h100.md); the cProfile of that step puts `torch.mm` at ~40 us of host time per
call. This separates the launch cost from everything around it.

    python benchmarks/launch_cost.py [--tokens 6144] [--calls 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def host_us(fn, calls: int, repeats: int = 7) -> float:
    """Median host microseconds per ``fn()`` while the GPU sleeps, so launches never wait on a full queue."""
    out = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        torch.cuda._sleep(300_000_000)  # ~0.15 s of GPU time queued ahead of the launches
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=6144)
    ap.add_argument("--calls", type=int, default=200, help="launches per timing (below the launch queue's depth)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    n, d, f = args.tokens, 1024, 3072
    x = torch.randn(n, d, device=dev, dtype=torch.bfloat16)
    w = torch.randn(f, d, device=dev, dtype=torch.bfloat16)
    g = torch.randn(n, f, device=dev, dtype=torch.bfloat16)
    out = torch.empty(n, f, device=dev, dtype=torch.bfloat16)
    wt = w.t()
    small = torch.randn(d, device=dev, dtype=torch.bfloat16)

    add = torch.compile(lambda a, b: (a * 2 + b).sum(), dynamic=True)
    add(x, x)
    cases = {
        "torch.add (elementwise, baseline)": lambda: torch.add(small, small),
        "torch.mm x @ w.T (forward projection)": lambda: torch.mm(x, wt),
        "torch.mm out= (Inductor's extern call)": lambda: torch.mm(x, wt, out=out),
        "torch.mm g.T @ x (weight gradient, K = tokens)": lambda: torch.mm(g.t(), x),
        "F.linear": lambda: F.linear(x, w),
        "torch.compile'd pointwise + sum (one graph call)": lambda: add(x, x),
    }
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}; host us per call, median of 7 x "
          f"{args.calls} calls, GPU kept busy; tokens {n}\n")
    backends = ["default", "cublas", "cublaslt"]
    print("| op | " + " | ".join(backends) + " |\n|---|" + "---|" * len(backends))
    results = {}
    for backend in backends:
        if backend != "default":
            torch.backends.cuda.preferred_blas_library(backend)
        for name, fn in cases.items():
            fn()
            results[name, backend] = host_us(fn, args.calls)
    for name in cases:
        print(f"| {name} | " + " | ".join(f"{results[name, b]:.1f}" for b in backends) + " |")


if __name__ == "__main__":
    main()
