"""FA4's Hopper backward configurations for head dim 128 under block sparsity, timed on treepack packs.

Why: FA4 takes its sm90 backward tile and pipeline settings from FA3's table (`_tile_size_bwd_sm90`, tuned on
an H100 for dense attention); treepack's tree kernel runs that backward with 128-row sparse blocks and 64-row
tiles on masked packs. This sweeps the settings one at a time (each a `dataclasses.replace` of FA4's own
config) and times `tree_attention(impl="fa4")` fwd+bwd on the first 32K pack of each source, laid out largest
subtree first as training does; gradients are compared with the default configuration's. A configuration FA4
refuses to build is reported as failed.

Usage (GPU, flash-attn-4 installed):
    python benchmarks/fa4_bwd_configs.py --rollouts toolbench=toolbench_dfs.parquet --rollouts tau-bench=tau_bench.parquet \\
        --synth tau2 --out benchmarks/results/DATE-fa4-bwd-configs-h200.md
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch
from attention import workload_subtree_end
from attention_backends import first_pack, largest_first
from common import bench_ms, command_line, gpu_line, today, write_report

VARIANTS = {
    "default": {},
    "num_stages_PdS=1": {"num_stages_PdS": 1},
    "dQ_single_wg": {"dQ_single_wg": True},
    "AtomLayoutNdKV=1": {"AtomLayoutNdKV": 1},
    "AtomLayoutMSdP=2": {"AtomLayoutMSdP": 2},
    "SdP_swapAB=False, AtomLayoutMSdP=2": {"SdP_swapAB": False, "AtomLayoutMSdP": 2},
    "dKV_swapAB": {"dKV_swapAB": True},
    "AtomLayoutMdQ=2": {"AtomLayoutMdQ": 2},
    "num_stages_Q=1": {"num_stages_Q": 1},
}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rollouts", action="append", default=[], metavar="NAME=PATH")
    ap.add_argument("--synth", default="tau2", help="treepack synth workloads (comma-separated, '' for none)")
    ap.add_argument("--capacity", type=int, default=32768)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)

    import flash_attn.cute.interface as fa4_interface

    from treepack.kernels import prepare, tree_attention
    from treepack.kernels.tree_attention import fa4

    packs = {name: largest_first(workload_subtree_end(name, args.capacity, 0)) for name in filter(None, args.synth.split(","))}
    for spec in args.rollouts:
        name, path = spec.split("=", 1)
        packs[name] = largest_first(first_pack(Path(path), args.capacity, False))
    dev = torch.device("cuda")
    state = {}
    for name, se in packs.items():
        info = prepare(torch.from_numpy(se).to(dev))
        info.cache["host_subtree_end"] = torch.from_numpy(se)  # as tree mode has it: fa4 picks its grid order
        g = torch.Generator(device=dev).manual_seed(0)
        q, k, v = (torch.randn(se.shape[0], h, 128, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
                   for h in (16, 8, 8))
        state[name] = [info, q, k, v, torch.randn_like(q), None]

    library = fa4_interface._tile_size_bwd_sm90
    rows: list[tuple[str, str, float | None, float | None, str]] = []
    for variant, changes in VARIANTS.items():
        def patched(head_dim, *a, changes=changes, **kw):
            cfg = library(head_dim, *a, **kw)
            return dataclasses.replace(cfg, **changes) if head_dim == 128 else cfg

        fa4_interface._tile_size_bwd_sm90 = patched
        fa4_interface._flash_attn_bwd.compile_cache.clear()  # its key leaves out num_stages_PdS
        fa4._REPLAY_BWD.plans.clear()
        fa4._REPLAY_FWD.plans.clear()
        for name, st in state.items():
            info, q, k, v, dout, ref = st

            def step(info=info, q=q, k=k, v=v, dout=dout):
                return torch.autograd.grad(tree_attention(q, k, v, info, impl="fa4"), (q, k, v), dout)

            try:
                grads = step()
            except Exception as e:  # noqa: BLE001 - a configuration FA4 cannot build: report it, go on
                rows.append((name, variant, None, None, f"{type(e).__name__} {str(e)[:80]}".strip()))
                print(f"{name} {variant}: failed ({type(e).__name__})", flush=True)
                break
            if ref is None:
                st[5] = ref = grads
            err = max(((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(grads, ref))
            ms = bench_ms(step)
            rows.append((name, variant, ms, err, ""))
            print(f"{name} {variant}: {ms:.3f} ms, grad rel. err {err:.1e}", flush=True)
    fa4_interface._tile_size_bwd_sm90 = library

    default = {n: ms for n, var, ms, _, _ in rows if var == "default"}
    lines = [f"# FA4's Hopper backward configurations on tree packs — {today()}", "",
             f"- GPU: {gpu_line()}",
             f"- command: `{command_line('benchmarks/fa4_bwd_configs.py', sys.argv[1:] if argv is None else argv)}`",
             ("- bf16, Hq 16 / Hkv 8 / D 128, `tree_attention(impl=\"fa4\")` fwd+bwd (128-row sparse blocks, 64-row "
              "backward tiles), first pack of each source at the capacity, largest subtree first; median of "
              "triton.testing.do_bench; grad rel. err = largest of dq, dk, dv against the default configuration's"), "",
             "| pack | backward configuration | fwd+bwd ms | speed vs default | grad rel. err |", "|---|---|---|---|---|"]
    for name, variant, ms, err, failed in rows:
        if ms is None:
            lines.append(f"| {name} | {variant} | failed: {failed} | - | - |")
        else:
            lines.append(f"| {name} | {variant} | {ms:.3f} | {default[name] / ms:.3f}x | {err:.1e} |")
    text = "\n".join(lines) + "\n"
    print(text)
    write_report(args.out, text)


if __name__ == "__main__":
    main()
