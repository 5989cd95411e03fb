"""FA4 tree attention (forward + backward) launched eagerly against replayed from a CUDA graph, on a dfs call's
shape: does a captured FA4 run slower?

Why: with dfs calls replayed as CUDA graphs, FA4's backward took 19% longer a step than launched eagerly in the
same process, whatever the shape buckets and not from clocks (results/2026-11-26-dfs-cuda-graphs-h100.md).
This takes the model and the rest of the step away: one `tree_attention(impl="fa4")` call over a cached
prefix, its backward through autograd, timed with CUDA events over ``--reps`` calls each way, and FA4's own
kernels summed from a profiled run of each.

Usage: python benchmarks/graph_replay.py [--tokens 8192] [--prefix 8192] [--reps 30] [--out graph-replay.md]
Needs CUDA (sm90/sm100) and flash-attn-4.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _kernel_ms(fn, reps: int) -> dict[str, float]:
    """GPU ms per call of FA4's kernels (forward, backward, the backward's pre/post-processing) under the profiler."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out = {"FA4 forward": 0.0, "FA4 backward": 0.0, "FA4 backward pre/post": 0.0, "other": 0.0}
    for e in prof.events():
        if e.device_type != DeviceType.CUDA:
            continue
        us = e.time_range.end - e.time_range.start
        name = e.name
        kind = ("FA4 backward pre/post" if "FlashAttentionBackwardP" in name else "FA4 backward"
                if "FlashAttentionBackward" in name else "FA4 forward" if "FlashAttentionForward" in name else "other")
        out[kind] += us / 1e3 / reps
    return out


def _event_ms(fn, reps: int) -> float:
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192, help="queries of the call (a chain)")
    ap.add_argument("--prefix", type=int, default=8192, help="cached prefix keys every query sees")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    import torch

    from treepack.kernels import tree_attention
    from treepack.kernels.tree_attention import fa4

    dev = torch.device("cuda") if torch.cuda.is_available() else None
    if dev is None or not fa4.fa4_supported_device(dev) or not fa4.fa4_importable():
        print("graph_replay.py needs a CUDA GPU that FA4 supports (sm90/sm100) and flash-attn-4", file=sys.stderr)
        return 1
    T, P, H, K, D = args.tokens, args.prefix, args.heads, args.kv_heads, args.head_dim
    gen = torch.Generator(device=dev).manual_seed(0)

    def leaf(*shape):
        return torch.randn(*shape, device=dev, dtype=torch.bfloat16, generator=gen).requires_grad_()

    q, k, v, pk, pv = leaf(T, H, D), leaf(T, K, D), leaf(T, K, D), leaf(P, K, D), leaf(P, K, D)
    dout = torch.randn(T, H, D, device=dev, dtype=torch.bfloat16, generator=gen)
    subtree_end = torch.full((T,), T, device=dev, dtype=torch.int32)
    leaves = (q, k, v, pk, pv)

    def call() -> None:  # gradients add into .grad, which exists: in place, as a captured backward needs
        out = tree_attention(q, k, v, subtree_end, prefix_k=pk, prefix_v=pv, impl="fa4")
        torch.autograd.backward([out], [dout])

    for t in leaves:
        t.grad = torch.zeros_like(t)
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):  # warm-up (FA4 compiles, records its launches) where the capture runs
        for _ in range(3):
            call()
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        call()

    pairs = T * P + T * (T + 1) // 2
    flops = 3.5 * 4 * pairs * D * H  # forward 4, backward 10 FLOPs per visible pair and head dim
    rows = []
    for name, fn in (("eager", call), ("graph", graph.replay), ("eager", call), ("graph", graph.replay)):
        ms = _event_ms(fn, args.reps)
        kernels = _kernel_ms(fn, max(args.reps // 3, 3))
        rows.append((name, ms, flops / ms / 1e9, kernels))
    title = (f"FA4 tree attention, T={T:,} queries (a chain) over P={P:,} prefix keys, bf16, {H} q / {K} kv heads "
             f"of {D}; torch {torch.__version__}, {torch.cuda.get_device_name(dev)}.")
    header = ("| launched | fwd+bwd ms (events) | TFLOP/s | FA4 forward ms | FA4 backward ms | backward pre/post ms "
              "| other ms |")
    command = f"Command: `python benchmarks/graph_replay.py {' '.join(sys.argv[1:] if argv is None else argv)}`"
    lines = [title, "", command, "", header, "|---|---|---|---|---|---|---|"]
    for name, ms, tflops, kern in rows:
        lines.append(f"| {name} | {ms:.3f} | {tflops:.0f} | {kern['FA4 forward']:.3f} | {kern['FA4 backward']:.3f} "
                     f"| {kern['FA4 backward pre/post']:.3f} | {kern['other']:.3f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
