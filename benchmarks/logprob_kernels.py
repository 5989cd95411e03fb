"""The language-model head's two memory-bound passes over a chunk of logits: Inductor (the compiled
reference, as `treepack.train.losses` ran them) against the Triton kernels of `treepack.kernels.logprobs`.

Shapes: a forward chunk of `--rows` rows over the whole vocabulary (log-sum-exp and the target's log-prob)
and a backward vocabulary block of `--bwd-rows` x `--block` (the logits gradient, in place), bf16 logits.
Prints each variant's median time, its bandwidth (bytes it must move / time) and the largest difference
from the float64 reference; then `target_logprobs` forward + backward over `--bwd-rows` hidden rows of
`--hidden` (bf16 autocast, the head's GEMMs included) with `LOGPROB_KERNELS` = inductor and auto.

    python benchmarks/logprob_kernels.py [--rows 4096] [--vocab 151936] [--bwd-rows 11616] [--block 50688]
"""

from __future__ import annotations

import argparse

import torch
from common import events_ms

from treepack.kernels.logprobs import (
    grad_logits_reference_,
    grad_logits_triton_,
    lse_and_logprob_reference,
    lse_and_logprob_triton,
)
from treepack.train.compiled import pick


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--bwd-rows", type=int, default=11616)
    ap.add_argument("--block", type=int, default=50688)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=4096, help="target_logprobs' chunk_rows")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(args.rows, args.vocab, device=dev, generator=g).mul_(3).to(torch.bfloat16)
    t = torch.randint(0, args.vocab, (args.rows,), device=dev, generator=g)
    ref = lse_and_logprob_reference(x.double(), t, torch.float64)
    fwd = {"inductor": pick(lse_and_logprob_reference, True, dynamic=False), "triton": lse_and_logprob_triton}
    print(f"{torch.cuda.get_device_name(dev)}; torch {torch.__version__}")
    print("| pass | shape | variant | ms | GB/s | max abs diff vs float64 |")
    print("|---|---|---|---|---|---|")
    for name, fn in fwd.items():
        out = fn(x, t, torch.float32)
        err = max(float((a.double() - b).abs().max()) for a, b in zip(out, ref))
        ms = events_ms(lambda fn=fn, x=x: fn(x, t, torch.float32), args.repeats, warmup=3)
        print(f"| forward | {args.rows} x {args.vocab} | {name} | {ms:.3f} | {x.numel() * 2 / ms / 1e6:.0f} | {err:.2e} |")
    del x, ref
    R, B, v0 = args.bwd_rows, args.block, args.vocab - args.block
    y = torch.randn(R, B, device=dev, generator=g).mul_(3).to(torch.bfloat16)
    tb = torch.randint(0, args.vocab, (R,), device=dev, generator=g)
    lse = torch.logsumexp(y.float(), dim=-1) + 2.0
    gr = torch.randn(R, device=dev, generator=g)
    expect = y.double().sub(lse.double()[:, None]).exp().neg().mul(gr.double()[:, None])
    hit = (torch.arange(B, device=dev) + v0)[None, :] == tb[:, None]
    expect += hit * gr.double()[:, None]
    bwd = {"inductor": pick(grad_logits_reference_, True), "triton": grad_logits_triton_}
    for name, fn in bwd.items():
        work = y.clone()
        fn(work, lse, gr, tb, v0)
        err = float((work.double() - expect).abs().max())
        ms = events_ms(lambda fn=fn, work=work: fn(work, lse, gr, tb, v0), args.repeats, warmup=3)  # in place: time holds
        print(f"| backward | {R} x {B} | {name} | {ms:.3f} | {y.numel() * 4 / ms / 1e6:.0f} | {err:.2e} |")
    del y, work, expect, hit
    from treepack.train import losses

    h = torch.randn(R, args.hidden, device=dev, generator=g).mul_(0.5).requires_grad_()
    w = torch.randn(args.vocab, args.hidden, device=dev, generator=g).mul_(0.05).requires_grad_()
    coef = torch.randn(R, device=dev, generator=g)
    print(f"\n| target_logprobs fwd+bwd, {R} rows, hidden {args.hidden}, chunk {args.chunk} | ms |\n|---|---|")
    for kernels in ("inductor", "auto"):
        losses.LOGPROB_KERNELS = kernels

        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logp = losses.target_logprobs(h, w, tb, args.chunk, compiled=True)
            torch.autograd.grad((coef * logp).sum(), (h, w))

        print(f"| {kernels} | {events_ms(step, max(args.repeats // 2, 3), warmup=3):.2f} |")


if __name__ == "__main__":
    main()
