"""FA4's forward and backward on one real dfs call: its cached prefix exact, padded, or partly hidden (as a CUDA
graph's prefix bucket reads it), per backward grid order, with `fa4.tail_share`'s prediction.

Why: inside dfs CUDA graphs FA4's backward ran 19% longer than eagerly. Hidden prefix rows make the key block
after the visible prefix partial for every query block, the longest CTA of the grid, which FA4's head-major
order leaves to finish alone (results/2026-11-26-dfs-bwd-order-h100.md).

The call: grad call ``--call`` of the tau-bench dfs schedule (144 records, block ``--block``), its own subtree
ends, random bf16 q/k/v (Qwen3-0.6B's 16 q / 8 kv heads of 128); FA4's kernels summed over ``--reps`` calls
under the profiler.

Usage: python benchmarks/fa4_dfs_call.py [--calls 0,1,6,8] [--orders 0,1,2] [--out fa4-dfs-call.md]
Needs CUDA (sm90) and flash-attn-4.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import command_line, gpu_kernels, gpu_line, today, write_report

H, K, E = 16, 8, 128


def kernel_ms(step, tokens: int, prefix: int, visible: int | None, order: int, reps: int) -> tuple[float, float]:
    """(forward, backward) ms of FA4's main kernels per call: ``step`` padded to ``tokens`` over ``prefix`` cached
    rows of which the first ``visible`` are seen (None: all)."""
    import torch

    from treepack.kernels.tree_attention import fa4
    from treepack.train.modes.dfs_graphs import padded_inputs

    dev = torch.device("cuda")
    se = padded_inputs(step, tokens)[1]
    valid = None if visible is None else torch.tensor([visible], device=dev)
    tables = fa4.fa4_tables(torch.as_tensor(se, dtype=torch.int32, device=dev), prefix, bwd_block_q=128,
                            prefix_valid=valid)

    def rand(rows: int, heads: int):
        return torch.randn(rows, heads, E, device=dev, dtype=torch.bfloat16, requires_grad=True)

    q, k, v = rand(tokens, H), rand(tokens, K), rand(tokens, K)
    pk, pv = (rand(prefix, K), rand(prefix, K)) if prefix else (None, None)
    grad = torch.randn(tokens, H, E, device=dev, dtype=torch.bfloat16)

    def call():
        out, _ = torch.ops.treepack.tree_attention_fa4_fwd(q, k, v, pk, pv, *tables, E ** -0.5, 128, order)
        out.backward(grad)

    fwd = bwd = 0.0
    for name, ms in gpu_kernels(call, reps):
        if "FlashAttentionBackwardP" in name:  # pre/post-processing
            continue
        if "FlashAttentionBackward" in name:
            bwd += ms / reps
        elif "FlashAttentionForward" in name:
            fwd += ms / reps
    return fwd, bwd


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", default="0,1,6,8", type=lambda s: [int(c) for c in s.split(",")],
                    help="grad calls of the schedule (their index among the grad calls)")
    ap.add_argument("--orders", default="0,1,2", type=lambda s: [int(o) for o in s.split(",")],
                    help="FA4_BWD_ORDERS indices: 0 FA4's, 1 heads fastest, 2 groups of 4 heads")
    ap.add_argument("--block", type=int, default=8192)
    ap.add_argument("--token-bucket", type=int, default=256)
    ap.add_argument("--prefix-bucket", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    import dfs as bench

    from treepack.kernels.tree_attention import fa4
    from treepack.train.config import DfsConfig
    from treepack.train.modes.dfs import DfsMode
    from treepack.train.modes.dfs_graphs import padded_inputs, rounded

    data = argparse.Namespace(tau_bench=bench.SAMPLE, tau_records=144, seed=0, capacity=[32768], child_order="lex",
                              dense_tokens=16384)
    pack = bench.batches(bench.workload("tau-bench", data), data)["dfs"][0]
    grads = [s for s in DfsMode(dfs=DfsConfig(block_size=args.block)).schedule(pack).steps if s.kind == "grad"]
    lines = [f"# FA4 on one dfs call: exact, padded and hidden prefix rows, per backward order — {today()}", "",
             f"GPU {gpu_line()}.", f"Command: `{command_line(__file__, sys.argv[1:] if argv is None else argv)}`",
             "", "| call | tokens | cached rows | keys read | predicted | order | forward ms | backward ms |",
             "|---|---|---|---|---|---|---|---|"]
    for c in args.calls:
        step = grads[c]
        padded = rounded(step.n, args.token_bucket), rounded(step.lo, args.prefix_bucket)
        for tokens, prefix in ((step.n, step.lo), padded):
            visible = step.lo if prefix else None
            share = fa4.tail_share(padded_inputs(step, tokens)[1], prefix, prefix_visible=visible)
            keys = "exact" if (tokens, prefix) == (step.n, step.lo) else f"{tokens:,} over {prefix:,}"
            for order in args.orders:
                fwd, bwd = kernel_ms(step, tokens, prefix, visible, order, args.reps)
                lines.append(f"| {c} | {step.n:,} | {step.lo:,} | {keys} | {fa4.predicted_tail(share, H):.2f} | "
                             f"{order} | {fwd:.3f} | {bwd:.3f} |")
                print(lines[-1], flush=True)
    write_report(args.out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
