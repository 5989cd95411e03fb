"""A/B of the two layer paths under ``torch.compile`` with the Triton tree kernel, in one process on one GPU:
``fused`` (the whole layer one compiled graph with the kernel's custom op inside, the default) against
``split`` (two compiled regions around the eager custom op). Host-bound steps (dfs with many small model
calls) vary from run to run and machine to machine by tens of percent, so only an alternating comparison
in one process says which path is faster.

Usage (GPU): python benchmarks/dfs_layer_ab.py --workloads tau-bench,tau2-think [--modes dfs8192,dfs4096,tree]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import dfs as bench  # the sibling benchmark: workloads, packing, timing


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default="tau-bench,tau2-think")
    ap.add_argument("--modes", default="dfs8192,dfs4096,tree", help="dfsB (block B) and/or tree")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()

    import torch

    import treepack.train.attention as attention_mod
    from treepack.train.config import DfsConfig
    from treepack.train.losses import Objective
    from treepack.train.model import Decoder
    from treepack.train.modes import make_mode

    args = argparse.Namespace(tau_bench=bench.SAMPLE, tau_records=144, seed=0, capacity=32768, dense_tokens=16384)
    model = Decoder.random_init(bench.QWEN3_0_6B, seed=0, dtype=torch.bfloat16, device=torch.device("cuda"),
                                draw_on_device=True)
    objective = Objective(kind="grpo")
    fused_schedule = attention_mod.AttentionContext.kernel_schedule
    print(f"GPU {torch.cuda.get_device_name()}; torch {torch.__version__}; seconds per step (2 timed after a warm-up)")
    for workload in a.workloads.split(","):
        groups = bench.batches(bench.workload(workload, args), args)
        for label in a.modes.split(","):
            if label == "tree":
                packs, mode = groups["tree"], make_mode("tree", attention="auto", logits_chunk=1024)
            else:
                block = int(label.removeprefix("dfs"))
                packs = groups["dfs"]
                mode = make_mode("dfs", attention="auto", logits_chunk=1024, dfs=DfsConfig(block_size=block))
            for _ in range(a.rounds):
                for variant in ("split", "fused"):
                    attention_mod.AttentionContext.kernel_schedule = (
                        fused_schedule if variant == "fused" else (lambda *_, **__: None))
                    res = bench.measure(model, packs, mode, objective, 2)
                    times = ", ".join(f"{t:.3f}" for t in res.get("times", []))
                    print(f"{workload} {label} {variant}: {times} (peak {res.get('peak', 0) / 2**30:.2f} GiB)",
                          flush=True)
    attention_mod.AttentionContext.kernel_schedule = fused_schedule


if __name__ == "__main__":
    main()
