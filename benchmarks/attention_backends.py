"""Tree attention per visible pair against the best dense attention, every exact backend side by side.

What it measures, in one run on one GPU (bf16, Hq 16 x D 128, Hkv 8 by default), fwd+bwd:
- ``tree/fa4``: `tree_attention(impl="fa4")`, FlashAttention-4's CuTe DSL kernels with 128 x 128 block
  sparsity and a mask_mod over ``subtree_end`` (optional extra ``treepack[fa4]``);
  (``tree/fa4-headmajor`` / ``tree/fa4-headsfast``: its Hopper backward in FA4's own grid order / heads
  fastest, instead of the per-pack choice; ``tree/fa4-bwd80`` / ``tree/fa4-bwd64``: 80- or 64-row backward query blocks);
- ``tree/triton``: our Triton kernel (library tiles, pinned);
- ``tree/flex``: FlexAttention (Triton template) with the same mask;
- ``dense/sdpa-cudnn``, ``dense/sdpa-flash``: torch's SDPA, one causal call per root-to-leaf sequence of the
  pack (what dense-leaf training runs), each backend forced; ``dense/varlen``: torch's varlen flash
  attention over the same sequences in one call.
FLOPs count visible pairs only (fwd 4·pairs·D·Hq, fwd+bwd 3.5x that): the tree's pairs for tree runners,
sum of L(L+1)/2 over the leaf sequences for dense ones, so TFLOP/s is the speed *per pair* the issue
compares, and "vs best dense" is the tree runner's TFLOP/s over the fastest dense runner's.

Packs: the first pack treepack packs (at ``--capacity`` tree tokens) from each source:
``tau-bench-heldout`` = the tau-bench retail records whose tasks are NOT in the repository's
``treepack/datasets/samples/tau_bench_slice.parquet`` (``--tau-bench``, Parquet or JSONL), ``toolbench``
(``--toolbench``), and treepack's synthetic ``tau2``, ``tau2-think``, ``agentic-think``.

``--grid`` adds the call-shape grid behind ``attention = "auto"`` (`kernels/tree_attention/backends.py`):
chains and random trees of T tokens over a cached prefix of P keys, fa4 vs triton (and cuDNN on chains).

Usage (GPU):
    python benchmarks/attention_backends.py --tau-bench ../shared/data/rollouts/tau_bench_grok3_retail.parquet \\
        --toolbench ../shared/data/rollouts/toolbench_dfs.parquet --grid --out benchmarks/results/DATE-attention-fa4-h100.md
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from attention import fwd_bwd, paths_from_subtree_end, varlen_dense, workload_subtree_end
from common import bench_ms, command_line, fa4_version, gpu_line, today, write_report

ROOT = Path(__file__).resolve().parents[1]
SLICE = ROOT / "treepack" / "datasets" / "samples" / "tau_bench_slice.parquet"


def first_pack(path: Path, capacity: int, exclude_slice: bool) -> np.ndarray:
    """subtree_end of the first pack treepack packs from a rollout Parquet file (optionally without the trees
    of the repository's tau-bench slice: held-out tasks)."""
    import tempfile

    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from treepack.io.ingest import read_rollouts
    from treepack.train.data import pack_rollouts

    table = pq.read_table(path)
    if exclude_slice:
        seen = pa.array(sorted(set(pq.read_table(SLICE, columns=["tree_id"]).column("tree_id").to_pylist())))
        table = table.filter(pc.invert(pc.is_in(table.column("tree_id"), value_set=seen)))
    with tempfile.TemporaryDirectory() as tmp:
        pq.write_table(table, Path(tmp) / "held.parquet")
        r = read_rollouts([str(Path(tmp) / "held.parquet")])
    fits = np.flatnonzero(r.lengths <= capacity)
    pack = next(pack_rollouts(r.select(fits), capacity))
    return np.asarray(pack.subtree_end[: pack.n_real], dtype=np.int32)


def sdpa_per_sequence(bounds, backend, heads: int, kv_heads: int):
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v):
        outs = []
        with sdpa_kernel([backend]):
            for a, b in itertools.pairwise(bounds):
                o = F.scaled_dot_product_attention(
                    q[a:b].transpose(0, 1)[None], k[a:b].transpose(0, 1)[None], v[a:b].transpose(0, 1)[None],
                    is_causal=True, enable_gqa=kv_heads != heads)
                outs.append(o[0].transpose(0, 1))
        return torch.cat(outs)
    return run


def largest_first(se_T: np.ndarray) -> np.ndarray:
    """subtree_end of the same tree laid out with each node's children largest subtree first (ties: as laid
    out), as `treepack.pack.layout.relayout` lays out packs; FA4 visits fewer partial blocks (fa4_blocks.py)."""
    from treepack.pack.layout import preorder_by_key

    T = se_T.shape[0]
    parent_T = np.full(T, -1, dtype=np.int64)
    stack: list[int] = []
    for q in range(T):  # the parent is the innermost open subtree
        while stack and se_T[stack[-1]] <= q:
            stack.pop()
        parent_T[q] = stack[-1] if stack else -1
        stack.append(q)
    size_T = se_T.astype(np.int64) - np.arange(T)
    new_T = preorder_by_key(parent_T, se_T.astype(np.int64), -size_T)
    out = np.empty_like(se_T)
    out[new_T] = new_T + size_T
    return out


def run_pack(name: str, se_np: np.ndarray, heads: int, kv_heads: int, dim: int, runners: list[str], rep: dict):
    from torch.nn.attention import SDPBackend

    from treepack.kernels import prepare, tree_attention, visible_pairs

    dev = torch.device("cuda")
    T = se_np.shape[0]
    se = torch.from_numpy(se_np).to(dev)
    paths = paths_from_subtree_end(se_np)
    lengths = np.array([len(p) for p in paths])
    flat = torch.from_numpy(np.concatenate(paths)).to(dev)
    bounds = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    pairs_tree, pairs_dense = visible_pairs(se), int((lengths * (lengths + 1) // 2).sum())
    info = prepare(se)
    info.cache["host_subtree_end"] = torch.from_numpy(se_np)  # as tree mode has it: fa4 picks its grid order
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(T, h, dim, device=dev, dtype=torch.bfloat16, generator=g) for h in (heads, kv_heads, kv_heads))
    dout = torch.randn(T, heads, dim, device=dev, dtype=torch.bfloat16, generator=g)
    inputs = [t.requires_grad_() for t in (q, k, v)]
    dense_in = [t.detach()[flat].contiguous().requires_grad_() for t in (q, k, v)]
    dense_dout = dout[flat].contiguous()
    row = {"pack": name, "T": T, "paths": len(paths), "N_flat": int(lengths.sum()), "pairs_tree": pairs_tree,
           "pairs_dense": pairs_dense, "ms": {}, "fwd_ms": {}, "err": {}, "failed": {}}
    with torch.no_grad():
        ref = tree_attention(*(t.detach() for t in inputs), info, impl="triton")
    tree = {"tree/fa4": "fa4", "tree/fa4-bwd80": "fa4", "tree/fa4-bwd64": "fa4", "tree/fa4-headmajor": "fa4",
            "tree/fa4-headsfast": "fa4", "tree/fa4-heads4": "fa4", "tree/triton": "triton", "tree/flex": "flex"}
    orders = {"tree/fa4-headmajor": "fa4", "tree/fa4-headsfast": "heads-fast", "tree/fa4-heads4": "heads-4"}
    blocks_q = {"tree/fa4-bwd80": 80, "tree/fa4-bwd64": 64}
    for runner in runners:
        try:
            if runner in tree:
                block_q = blocks_q.get(runner, 128)
                order = orders.get(runner, "auto")

                def fn(q_, k_, v_, impl=tree[runner], block_q=block_q, order=order):
                    from treepack.kernels.tree_attention import fa4

                    fa4.FA4_BWD_BLOCK_Q = block_q  # the backward's query blocks (fa4 only)
                    fa4.FA4_BWD_ORDER = order  # the backward grid's order (fa4 on Hopper only)
                    return tree_attention(q_, k_, v_, info, impl=impl)

                ins, d = inputs, dout
            elif runner in ("tree/routed", "tree/paths"):
                # tree/paths: the pack's leaf segments over their gathered ancestor keys (FA4 varlen); tree/routed:
                # what tree mode runs, paths where their padded tiles pay (`paths_pay`), else the tree kernel
                from treepack.kernels.varlen.paths import DevicePaths, paths_attention, paths_pay, plan_paths

                plan = plan_paths(se_np)
                row["paths_padding"] = plan.padded_pairs() / max(plan.pairs, 1)
                use_paths = runner == "tree/paths" or paths_pay(plan)
                if runner == "tree/routed":
                    row["routed"] = "paths" if use_paths else "tree"
                if use_paths:
                    dp = DevicePaths.of(plan, dev)
                    fn = lambda q_, k_, v_, dp=dp: paths_attention(q_, k_, v_, dp, impl="fa4")
                else:
                    fn = lambda q_, k_, v_: tree_attention(q_, k_, v_, info, impl="auto")
                ins, d = inputs, dout
            elif runner == "tree/paths-kernel":
                # FA4's varlen kernel alone on tree/paths' problem: the gathered keys and values are the inputs,
                # so the gather and the scatter-add of their gradients are left out (what tree/paths pays beyond)
                from treepack.kernels.varlen.fast import fa4_varlen
                from treepack.kernels.varlen.paths import DevicePaths, plan_paths

                plan = plan_paths(se_np)
                dp = DevicePaths.of(plan, dev)
                gathered = [inputs[0].detach().clone().requires_grad_()] + [
                    t.detach().index_select(0, dp.key_index_N).requires_grad_() for t in inputs[1:]]
                fn = lambda q_, k_, v_, dp=dp: fa4_varlen(q_, k_, v_, dp.cu_q_S1, dp.cu_k_S1, dp.plan.max_q,
                                                          dp.plan.max_k, dim ** -0.5)
                ins, d = gathered, dout
            elif runner == "dense/fa4-varlen":  # FA4's varlen kernel over the pack's leaf sequences, one call
                from treepack.kernels.varlen import CausalBatch, causal_varlen_attention

                cb = CausalBatch.of(lengths.tolist(), dev)
                fn = lambda q_, k_, v_, cb=cb: causal_varlen_attention(q_, k_, v_, cb, impl="fa4")
                ins, d = dense_in, dense_dout
            elif runner == "dense/varlen":
                run = varlen_dense(heads, kv_heads)
                if run is None:
                    continue
                cu, m = torch.tensor(bounds, device=dev, dtype=torch.int32), int(lengths.max())
                fn = lambda q_, k_, v_, run=run, cu=cu, m=m: run(q_, k_, v_, cu, m)
                ins, d = dense_in, dense_dout
            else:
                backend = {"dense/sdpa-cudnn": SDPBackend.CUDNN_ATTENTION, "dense/sdpa-flash": SDPBackend.FLASH_ATTENTION}[runner]
                fn, ins, d = sdpa_per_sequence(bounds, backend, heads, kv_heads), dense_in, dense_dout
            out = fn(*ins).detach().float()
            on_tree = runner in tree or runner in ("tree/routed", "tree/paths", "tree/paths-kernel")
            expect = ref.float() if on_tree else ref.float()[flat]
            row["err"][runner] = ((out - expect).norm() / expect.norm()).item()
            row["ms"][runner] = bench_ms(fwd_bwd(fn, ins, d), **rep)
            with torch.no_grad():
                row["fwd_ms"][runner] = bench_ms(lambda fn=fn, ins=ins: fn(*ins), **rep)
        except Exception as e:  # noqa: BLE001 - report the runner's failure and go on
            row["failed"][runner] = f"{type(e).__name__}: {str(e)[:300]}"
            traceback.print_exc()
    flops = lambda pairs: 14 * pairs * dim * heads
    row["tflops"] = {r: flops(pairs_dense if r.startswith("dense") else pairs_tree) / ms / 1e9 for r, ms in row["ms"].items()}
    return row


def run_grid(heads: int, kv_heads: int, dim: int, rep: dict) -> list[dict]:
    """fwd+bwd of one call, fa4 vs triton (and cuDNN SDPA on chains without a prefix), over call shapes."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from treepack.kernels import prepare, tree_attention, visible_pairs

    dev = torch.device("cuda")
    rng = np.random.default_rng(0)
    rows = []
    for kind, T, P in itertools.product(("chain", "tree"), (512, 2048, 8192, 32768), (0, 8192)):
        if kind == "chain":
            se_np = np.full(T, T, dtype=np.int32)
        else:  # a random tree: segments of 1..300 tokens, branching at random
            se_np = random_tree(T, rng)
        se = torch.from_numpy(se_np).to(dev)
        info = prepare(se)
        g = torch.Generator(device=dev).manual_seed(1)
        mk = lambda *s, g=g: torch.randn(*s, device=dev, dtype=torch.bfloat16, generator=g)
        ins = [mk(T, heads, dim), mk(T, kv_heads, dim), mk(T, kv_heads, dim)] + ([mk(P, kv_heads, dim), mk(P, kv_heads, dim)] if P else [])
        ins = [t.requires_grad_() for t in ins]
        dout = mk(T, heads, dim)
        row = {"kind": kind, "T": T, "P": P, "pairs": visible_pairs(se, P), "ms": {}}
        for impl in ("fa4", "triton"):
            fn = lambda q, k, v, pk=None, pv=None, impl=impl, info=info: tree_attention(
                q, k, v, info, prefix_k=pk, prefix_v=pv, impl=impl)
            try:
                row["ms"][impl] = bench_ms(fwd_bwd(fn, ins, dout), **rep)
            except Exception as e:  # noqa: BLE001
                row["ms"][impl] = None
                print(f"grid {kind} T={T} P={P} {impl} failed: {e}"[:300])
        if kind == "chain" and P == 0:
            def cud(q, k, v):
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    return F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                                          v.transpose(0, 1)[None], is_causal=True,
                                                          enable_gqa=kv_heads != heads)[0].transpose(0, 1)
            row["ms"]["sdpa-cudnn"] = bench_ms(fwd_bwd(cud, ins, dout), **rep)
        rows.append(row)
        print("grid", json.dumps(row), flush=True)
    return rows


def random_tree(T: int, rng: np.random.Generator) -> np.ndarray:
    """subtree_end of a random DFS-preorder tree: segments of 1..300 tokens, each closing a random number of
    open segments before it (so the tree branches at random depths)."""
    ends = np.zeros(T, dtype=np.int64)
    stack, closed, i = [], {}, 0
    starts = []
    while i < T:
        if stack and rng.random() < 0.5:
            for _ in range(int(rng.integers(1, len(stack) + 1))):
                closed[stack.pop()] = i
        stack.append(i)
        starts.append(i)
        i += min(int(rng.integers(1, 300)), T - i)
    for s in stack:
        closed[s] = T
    for a, b in zip(starts, starts[1:] + [T]):
        ends[a:b] = closed[a]
    return ends.astype(np.int32)


def report(args, rows: list[dict], grid: list[dict], started: float) -> str:
    lines = [
        f"# Tree attention per visible pair vs the best dense attention, every backend — {today()}",
        "",
        f"- GPU: {gpu_line()}{'' if fa4_version() else '; flash-attn-4 not installed'}",
        f"- command: `{command_line(__file__, sys.argv[1:])}`",
        (f"- bf16, Hq={args.heads}, Hkv={args.kv_heads}, D={args.head_dim}; fwd+bwd; FLOPs = 14 x visible pairs x D x Hq "
         "(tree runners: the tree's pairs; dense runners: sum of L(L+1)/2 over the pack's leaf sequences); "
         "median of triton.testing.do_bench"),
        f"- packs: first pack at capacity {args.capacity} tokens of each source; run took {time.time() - started:.0f} s",
        "",
        "| pack | T | leaf seqs | C_attn | runner | fwd+bwd ms | fwd ms | TFLOP/s per pair | vs best dense (per pair) | rel. err vs triton |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    summary = []
    for r in rows:
        dense = {n: t for n, t in r["tflops"].items() if n.startswith("dense")}
        best = max(dense, key=dense.get) if dense else None
        for n in sorted(r["ms"], key=lambda n: (not n.startswith("tree"), n)):
            vs = f"{r['tflops'][n] / dense[best]:.2f}x" if best else "-"
            fwd = f"{r['fwd_ms'][n]:.3f}" if n in r["fwd_ms"] else "-"
            lines.append(f"| {r['pack']} | {r['T']} | {r['paths']} | {r['pairs_dense'] / r['pairs_tree']:.2f} | {n} | "
                         f"{r['ms'][n]:.3f} | {fwd} | {r['tflops'][n]:.0f} | {vs} | {r['err'].get(n, float('nan')):.1e} |")
        for n, why in r["failed"].items():
            lines.append(f"| {r['pack']} | {r['T']} | {r['paths']} | - | {n} | failed: {why[:120]} | | | | |")
        if best and "tree/fa4" in r["tflops"]:
            fast = max((n for n in r["tflops"] if n.startswith("tree")), key=r["tflops"].get)
            summary.append(f"{r['pack']}: tree/fa4 {r['tflops']['tree/fa4']:.0f} TFLOP/s per pair = "
                           f"{r['tflops']['tree/fa4'] / dense[best]:.2f}x {best} ({dense[best]:.0f}); "
                           f"{r['ms'][best] / r['ms']['tree/fa4']:.2f}x faster in time; fastest tree runner {fast}")
        if "tree/routed" in r["ms"] and "dense/fa4-varlen" in r["ms"]:
            ratio = r["ms"]["tree/routed"] / r["ms"]["dense/fa4-varlen"]
            per_pair = r["tflops"]["tree/routed"] / r["tflops"]["dense/fa4-varlen"]
            summary.append(f"{r['pack']}: tree/routed ({r.get('routed')}; paths' padded pairs "
                           f"{r.get('paths_padding', float('nan')):.2f}x the tree's) takes {ratio:.2f}x the time of FA4 "
                           f"varlen over the leaves; {per_pair:.2f}x its TFLOP/s per pair")
    lines += ["", *[f"- {s}" for s in summary], ""]
    if grid:
        lines += ["## Call-shape grid (the table behind attention = \"auto\")", "",
                  "| kind | T | P | pairs | fa4 ms | triton ms | cuDNN SDPA ms | fa4 TFLOP/s | triton TFLOP/s | faster |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for g in grid:
            ms = g["ms"]
            tf = {n: 14 * g["pairs"] * args.head_dim * args.heads / t / 1e9 for n, t in ms.items() if t}
            fast = min((n for n in ("fa4", "triton") if ms.get(n)), key=lambda n: ms[n], default="-")
            cell = lambda n, ms=ms: f"{ms[n]:.3f}" if ms.get(n) else "-"
            lines.append(f"| {g['kind']} | {g['T']} | {g['P']} | {g['pairs']:.3e} | {cell('fa4')} | {cell('triton')} | "
                         f"{cell('sdpa-cudnn')} | {tf.get('fa4', 0):.0f} | {tf.get('triton', 0):.0f} | {fast} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tau-bench", type=Path, help="tau-bench retail rollouts: held-out tasks become a pack")
    ap.add_argument("--toolbench", type=Path, help="ToolBench rollouts")
    ap.add_argument("--synth", default="tau2,tau2-think,agentic-think", help="treepack synth workloads")
    ap.add_argument("--rollouts", action="append", default=[], metavar="NAME=PATH",
                    help="more packs: the first pack of a rollout file (repeatable), e.g. gsm8k=gsm8k.parquet")
    ap.add_argument("--capacity", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--runners", default="tree/fa4,tree/triton,tree/flex,dense/sdpa-cudnn,dense/sdpa-flash,dense/varlen")
    ap.add_argument("--child-order", default="lex", choices=("lex", "largest-first"),
                    help="lay each pack out with every node's children largest subtree first")
    ap.add_argument("--grid", action="store_true", help="also time the call-shape grid of attention='auto'")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()
    started = time.time()
    rep = {"warmup_ms": 25, "rep_ms": 100} if args.quick else {"warmup_ms": 50, "rep_ms": 250}
    packs = {}
    if args.tau_bench:
        packs["tau-bench-heldout"] = first_pack(args.tau_bench, args.capacity, exclude_slice=True)
    if args.toolbench:
        packs["toolbench"] = first_pack(args.toolbench, args.capacity, exclude_slice=False)
    for w in filter(None, args.synth.split(",")):
        packs[w] = workload_subtree_end(w, args.capacity, 0)
    for spec in args.rollouts:
        name, _, path = spec.partition("=")
        packs[name] = first_pack(Path(path), args.capacity, exclude_slice=False)
    if args.child_order == "largest-first":
        packs = {f"{name} (largest-first)": largest_first(se) for name, se in packs.items()}
    runners = args.runners.split(",")
    rows = []
    for name, se in packs.items():
        rows.append(run_pack(name, se, args.heads, args.kv_heads, args.head_dim, runners, rep))
        print("pack", json.dumps(rows[-1]), flush=True)
    grid = run_grid(args.heads, args.kv_heads, args.head_dim, {"warmup_ms": 15, "rep_ms": 60}) if args.grid else []
    text = report(args, rows, grid, started)
    print(text)
    write_report(args.out, text)
    if args.json_out:
        write_report(args.json_out, json.dumps({"packs": rows, "grid": grid}, indent=1))


if __name__ == "__main__":
    main()
