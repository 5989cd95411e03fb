"""Compiled log-prob forward (`treepack.train.losses.target_logprobs`) by how its chunks are compiled: one
dynamic-shape graph whose reduction is tuned at its first launch, against a few static row counts.

Why: in one dfs process the fused log-sum-exp + gather kernel took 80 ms a step (3.2 ms a launch) and in
another under 11 ms (results/2026-11-26-dfs-host-h100.md). Inductor tunes a dynamic graph's reduction once,
at the first launch, on that launch's row count. Each variant runs in a fresh process with its own Inductor
cache, since tuned configurations are kept on disk and would carry over.

    python benchmarks/logprobs.py [--rows 4096] [--chunk 1024] [--first 37,1024]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
from common import events_ms


def child(variant: str, args: argparse.Namespace) -> dict:
    from treepack.train import losses

    kind, _, first = variant.partition(":")
    losses.STATIC_CHUNKS = kind == "static"
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    h = torch.randn(args.rows, args.hidden, device=dev, dtype=torch.bfloat16, generator=g)
    w = (torch.randn(args.vocab, args.hidden, device=dev, dtype=torch.bfloat16, generator=g) * 0.02)
    t = torch.randint(0, args.vocab, (args.rows,), device=dev, generator=g)
    h.requires_grad_(), w.requires_grad_()

    def fwd(rows: int):
        with torch.no_grad():
            return losses.target_logprobs(h[:rows], w, t[:rows], args.chunk, compiled=True)

    def fwd_bwd():
        losses.target_logprobs(h, w, t, args.chunk, compiled=True).sum().backward()

    if first:  # the launch the dynamic graph is tuned on
        fwd(int(first))
        losses.target_logprobs(h[: int(first)], w, t[: int(first)], args.chunk, compiled=True).sum().backward()
    fwd(args.rows), fwd_bwd(), torch.cuda.synchronize()
    return {"variant": variant, "forward_ms": events_ms(lambda: fwd(args.rows), args.repeats),
            "fwd_bwd_ms": events_ms(fwd_bwd, args.repeats),
            "mm_ms": events_ms(lambda: torch.mm(h.detach(), w.detach().T), args.repeats)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=4096, help="loss rows timed")
    ap.add_argument("--chunk", type=int, default=1024, help="forward chunk rows (train.logits_chunk)")
    ap.add_argument("--first", default="37,1024", help="row counts the dynamic graph is first launched on")
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.variant:
        print(json.dumps(child(args.variant, args)))
        return
    import triton

    variants = [f"dynamic:{f}" for f in args.first.split(",") if f] + ["static:"]
    print(f"GPU {torch.cuda.get_device_name()}; torch {torch.__version__}, triton {triton.__version__}; "
          f"rows {args.rows}, chunk {args.chunk}, vocab {args.vocab}, hidden {args.hidden}, bf16; median of "
          f"{args.repeats}; each variant a fresh process and Inductor cache\n")
    print("| chunks compiled | tuned on | forward ms | forward + backward ms | logits matmul alone ms |\n|---|---|---|---|---|")
    for variant in variants:
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
            argv = [sys.executable, __file__, "--variant", variant] + [
                f"--{k}={getattr(args, k)}" for k in ("rows", "chunk", "vocab", "hidden", "repeats")]
            run = subprocess.run(argv, check=False, env=env, capture_output=True, text=True)
        if run.returncode:
            print(f"| {variant} | failed: {(run.stderr.strip().splitlines() or ['?'])[-1]} | | | |")
            continue
        r = json.loads(run.stdout.strip().splitlines()[-1])
        kind, _, first = variant.partition(":")
        tuned = f"first launch, {first} rows" if first else "each static shape at its own size"
        print(f"| {kind} | {tuned} | {r['forward_ms']:.2f} | {r['fwd_bwd_ms']:.2f} | {r['mm_ms']:.2f} |")


if __name__ == "__main__":
    main()
