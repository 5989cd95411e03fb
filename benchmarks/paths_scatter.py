"""The backward of `kernels/varlen/paths.py`'s key gather: the gathered keys' gradients summed back onto the pack.

`paths_attention` gathers each leaf path's keys and values (``index_select``), so its backward sums the copies'
gradients with ``index_add_``: one atomic add per element of every copy. Every pack token has exactly one copy
where it is a query of its own segment (the last keys of that segment's range); only ancestors shared by later
leaves have more. This times, per real pack (first 32K pack, largest subtree first), ``index_add_`` in bf16 and
in float32, against gathering each token's own copy and ``index_add_`` of the extra copies alone.

Usage (GPU):
    python benchmarks/paths_scatter.py --rollouts tau-bench=tau_bench.parquet --rollouts gsm8k=gsm8k.parquet
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
from attention_backends import first_pack, largest_first
from common import bench_ms, gpu_line


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rollouts", action="append", default=[], metavar="NAME=PATH")
    ap.add_argument("--capacity", type=int, default=32768)
    args = ap.parse_args(argv)

    print(gpu_line())
    print("| pack | T | gathered keys | extra copies | index_add bf16 ms | index_add fp32 ms | own gather + extra index_add ms |")
    print("|---|---|---|---|---|---|---|")
    for spec in args.rollouts:
        name, path = spec.split("=", 1)
        print(time_pack(name, largest_first(first_pack(Path(path), args.capacity, False))), flush=True)


def time_pack(name: str, se: np.ndarray) -> str:
    """One table row: the three ways of summing a pack's gathered key gradients (float32 index_add_ the reference)."""
    from treepack.kernels.varlen.paths import plan_paths

    plan = plan_paths(se)
    T, N = se.shape[0], plan.key_index_N.shape[0]
    index = torch.from_numpy(plan.key_index_N).cuda()
    # each token's own copy and the extra ones, as `paths._GatherPaths` sums them
    own, extra = torch.from_numpy(plan.own_T).cuda(), torch.from_numpy(plan.extra_X).cuda()
    extra_to = index[extra]
    grad = torch.randn(N, 8, 128, device="cuda", dtype=torch.bfloat16)

    def bf16():
        return torch.zeros(T, 8, 128, device="cuda", dtype=torch.bfloat16).index_add_(0, index, grad)

    def fp32():
        return torch.zeros(T, 8, 128, device="cuda", dtype=torch.float32).index_add_(0, index, grad.float()).bfloat16()

    def own_then_extra():
        return grad.index_select(0, own).index_add_(0, extra_to, grad.index_select(0, extra))

    ref = fp32().float()
    for fn in (bf16, own_then_extra):
        assert ((fn().float() - ref).norm() / ref.norm()).item() < 1e-2
    ms = [bench_ms(fn) for fn in (bf16, fp32, own_then_extra)]
    return f"| {name} | {T:,} | {N:,} | {plan.extra_X.shape[0]:,} | {ms[0]:.3f} | {ms[1]:.3f} | {ms[2]:.3f} |"

if __name__ == "__main__":
    main()
