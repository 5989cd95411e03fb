"""Qwen3's per-head RMSNorm + RoPE on a pack's queries and keys: Inductor (the compiled reference, as the
decoder layer ran it) against the Triton kernels of `treepack.kernels.norm_rope`.

Shapes: `--tokens` tokens of `--heads` query heads and `--kv-heads` key heads of 128 values (bf16), a float32
weight, float32 angles. For each variant, the GPU kernel time of a forward and of a forward + backward
(torch.profiler: a training step's host runs ahead, so launch time is not the GPU's); the backward is their
difference, its weight-gradient sum included. GB/s counts the bytes a pass must move (forward: x in, result out; backward: the
gradient and x in, dx out), so 100% of the GPU's bandwidth is the floor. The largest difference from the
float64 truth is printed beside eager's. Then the Triton kernels' block sizes.

    python benchmarks/norm_rope.py [--tokens 22336] [--heads 16] [--kv-heads 8] [--out norm-rope.md]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from common import command_line, gpu_line, kernel_ms, today, write_report

from treepack.kernels.norm_rope import op
from treepack.kernels.norm_rope import triton as kernels
from treepack.kernels.norm_rope.reference import norm_rope_reference
from treepack.train.compiled import pick


def _inputs(T: int, N: int, E: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    dev = torch.device("cuda")
    x = (torch.randn(T, N, E, device=dev, generator=gen) * 3).to(torch.bfloat16)
    w = 1 + 0.3 * torch.randn(E, device=dev, generator=gen)
    ang = torch.cat([torch.arange(T, device=dev, dtype=torch.float32)[:, None]
                     * (10000.0 ** (-torch.arange(0, E, 2, device=dev) / E))[None, :]] * 2, -1)
    g = torch.randn(T, N, E, device=dev, generator=gen).to(torch.bfloat16)
    return x, w, ang.cos(), ang.sin(), g


def _truth_error(fn, x, w, cos, sin, g) -> tuple[float, float, float]:
    """Largest |fn - float64 truth| of out, dx, dw."""
    xx, ww = x.detach().requires_grad_(), w.detach().requires_grad_()
    out = fn(xx, ww, cos, sin, 1e-6)
    dx, dw = torch.autograd.grad(out, (xx, ww), g)
    xt, wt = x.double().requires_grad_(), w.double().requires_grad_()
    ref = norm_rope_reference(xt, wt, cos.double(), sin.double(), 1e-6)
    rdx, rdw = torch.autograd.grad(ref, (xt, wt), g.double())
    with torch.no_grad():
        return tuple(float((a.double() - b).abs().max()) for a, b in ((out, ref), (dx, rdx), (dw, rdw)))


def _times(fn, x, w, cos, sin, g, repeats: int) -> tuple[float, float]:
    xx, ww = x.detach().requires_grad_(), w.detach().requires_grad_()

    def fwd():
        with torch.no_grad():
            fn(xx, ww, cos, sin, 1e-6)

    def fwd_bwd():  # the gradients returned, not accumulated into .grad (no add of its own)
        torch.autograd.grad(fn(xx, ww, cos, sin, 1e-6), (xx, ww), g)

    return kernel_ms(fwd, repeats), kernel_ms(fwd_bwd, repeats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=22336, help="a ToolBench pack's tokens (67.0k a step of 3)")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--out", type=Path, help="also write the tables as a dated markdown report")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    lines = [f"# Qwen3's q / k norm + RoPE: Inductor vs Triton — {today()}", "",
             f"- hardware: 1x {gpu_line()}", f"- command: `{command_line(__file__, sys.argv[1:])}`", ""]

    def emit(line: str) -> None:  # a table line: to stdout and to the report
        lines.append(line)
        print(line)

    print("\n".join(lines))

    variants = {"inductor": pick(norm_rope_reference, True), "eager": norm_rope_reference, "triton": op.norm_rope}
    emit("| tensor | variant | fwd ms | fwd GB/s | bwd ms | bwd GB/s | max err out / dx / dw vs float64 |")
    emit("|---|---|---|---|---|---|---|")
    total = dict.fromkeys(variants, 0.0)
    for label, N in (("q", args.heads), ("k", args.kv_heads)):
        x, w, cos, sin, g = _inputs(args.tokens, N, args.head_dim, gen)
        size = x.numel() * x.element_size()
        for name, fn in variants.items():
            err = _truth_error(fn, x, w, cos, sin, g)
            f, fb = _times(fn, x, w, cos, sin, g, args.repeats)
            total[name] += fb
            emit(f"| {label} [{args.tokens}, {N}, {args.head_dim}] | {name} | {f:.3f} | {2 * size / f / 1e6:.0f} | "
                  f"{fb - f:.3f} | {3 * size / (fb - f) / 1e6:.0f} | {err[0]:.1e} / {err[1]:.1e} / {err[2]:.1e} |")
    emit("\nq + k, forward + backward: " + ", ".join(f"{n} {ms:.3f} ms" for n, ms in total.items()))

    x, w, cos, sin, g = _inputs(args.tokens, args.heads, args.head_dim, gen)
    floor = kernel_ms(lambda: torch.add(g, x), args.repeats)  # reads two [T, N, E] tensors, writes one: the backward's bytes
    emit(f"\nq: torch.add of two such tensors (the backward's bytes) {floor:.3f} ms, {3 * x.numel() * 2 / floor / 1e6:.0f} GB/s")
    emit("\n| tensor | rows a program (FWD_BLOCK_R = BWD_BLOCK_R) | num_warps | fwd kernel ms | bwd kernels ms |")
    emit("|---|---|---|---|---|")
    defaults = kernels.FWD_BLOCK_R, kernels.BWD_BLOCK_R, kernels.NUM_WARPS
    for block in (16, 32, 64, 128, 256):
        for warps in (1, 2, 4, 8):
            kernels.FWD_BLOCK_R = kernels.BWD_BLOCK_R = block
            kernels.NUM_WARPS = warps
            f = kernel_ms(lambda: kernels.norm_rope_fwd_triton(x, w, cos, sin, 1e-6), args.repeats)
            b = kernel_ms(lambda: kernels.norm_rope_bwd_triton(g, x, w, cos, sin, 1e-6), args.repeats)
            emit(f"| q | {block} | {warps} | {f:.3f} | {b:.3f} |")
    kernels.FWD_BLOCK_R, kernels.BWD_BLOCK_R, kernels.NUM_WARPS = defaults
    write_report(args.out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
