"""Training step of ``dfs`` vs ``tree`` vs ``dense`` vs ``dense-leaf``: time, tokens/s, peak memory, and the
dfs work accounting (anchor overhead, model calls, live graph), side by side on the same rollouts.

A step is the forward and backward of one global batch (every pack of the workload, gradients
accumulated; the optimizer update is excluded, as in AReaL-DTA's backward ablations), bf16 weights and
compute, GRPO loss (advantages: rewards standardised over the batch, or the data's), token-mean. Each
(workload, mode) runs one warm-up step (Triton compiles and autotunes there; two with dfs CUDA graphs, which
capture a call shape the second time they meet it), then ``--repeats`` timed
steps; the median time and the largest ``torch.cuda.max_memory_allocated`` are reported.

Modes, all over the same sequences, sharing one forest per workload (no ``tree_id`` scoping, so the
system prompt is shared across tasks):
- ``dfs``: `DfsMode` on one pack holding the whole workload (its memory does not grow with the tree);
- ``tree``: `TreeMode` on the packs of ``pack_rollouts`` at each ``--capacity`` (tree tokens; a tree larger
  than the capacity is split into runs of sequences, repeating their shared prefixes in each pack). A
  pack's capacity is its memory bound, as a block is dfs's: ``--capacity 16384,32768`` with ``--dfs
  16384,8192`` compares the two at matched and at unequal memory. The "vs tree, same memory" column
  divides by the fastest tree run whose peak memory is at least the row's (none: "-");
- ``dense``: every sequence, micro-batches of whole sequences up to ``--dense-tokens`` flat tokens;
- ``dense-leaf``: the same over the leaf sequences only (duplicates and prefix-of-another dropped: the
  strongest simple baseline).

Workloads: ``tau-bench`` is real (the first ``--tau-records`` records of the bundled slice of tau-bench
retail, multi-turn tool use, one trajectory per task: chains whose records are prefixes of each other);
``tau2-fits`` / ``tau2-split`` / ``tau2-think`` are synthetic (`treepack.datasets.synth`), a tree that fits
one tree pack, one that must be split, and a comb of dropped reasoning.

Targets (issue 6): dfs peak memory <= dense's peak + the K/V of the longest path; dfs throughput >= 80%
of tree where the tree fits one pack and above tree where it must split; on tau-bench (144 records,
Qwen3-0.6B shape, bf16) >= 2x AReaL-DTA's code at no more memory (1.97 s/step at 13.4 GiB, or 1.71 s at
20.4 GiB, on an H200) and faster than dense-leaf.

Usage (with treepack installed, ``pip install -e .``):
    python benchmarks/dfs.py --plan-only                      # CPU: dfs accounting only, no model
    python benchmarks/dfs.py --out benchmarks/results/DATE-dfs.md [--workloads tau-bench,tau2-split]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import command_line, gpu_line, one_forest, ratio, today

SAMPLE = ROOT / "treepack" / "datasets" / "samples" / "tau_bench_slice.parquet"
WORKLOADS = ("tau-bench", "tau2-fits", "tau2-split", "tau2-think")
MODES = ("dfs", "tree", "dense", "dense-leaf")
# AReaL-DTA's code on tau-bench 144 records, measured on an H200 (issue 6): block 2048 and block 4096
AREAL_DTA = ({"seconds": 1.97, "gib": 13.4, "block": 2048}, {"seconds": 1.71, "gib": 20.4, "block": 4096})



from treepack.io.ingest import read_rollouts
from treepack.io.rollouts import Rollouts
from treepack.pack.layout import CHILD_ORDERS, Pack, build_pack, relayout
from treepack.train.collector import Pauses, freeze_warmup, thaw
from treepack.train.config import DfsConfig
from treepack.train.data import dense_batches, leaf_sequences, pack_rollouts
from treepack.train.losses import BatchTotals, LossRows, Objective
from treepack.train.model import ModelArgs
from treepack.train.modes.dfs import DfsMode, merge_work
from treepack.train.modes.dfs_schedule import MERGE_ANCHOR_TOKENS

QWEN3_0_6B = ModelArgs.for_family("qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                                  num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
                                  tie_embeddings=True)
TINY = ModelArgs.for_family("qwen3", vocab_size=151936, hidden_size=64, intermediate_size=176, num_layers=2,
                            num_heads=4, num_kv_heads=2, head_dim=16, tie_embeddings=True)  # CPU smoke runs


# --------------------------------------------------------------------------------------------------
# Workloads


def workload(name: str, args) -> Rollouts:
    if name == "tau-bench":
        r = read_rollouts([str(args.tau_bench)])
        return one_forest(r.select(np.arange(min(args.tau_records, len(r)))), args.seed)
    from treepack.datasets import synth

    kind, n, overrides = {
        "tau2-fits": ("tau2", 1, {"group_size": 4, "turns": "8,0.3,2,20"}),
        "tau2-split": ("tau2", 2, {}),
        "tau2-think": ("tau2", 1, {"think": True, "group_size": 4}),
    }[name]
    overrides = {k: (synth.LogNormal.parse(v) if isinstance(v, str) else v) for k, v in overrides.items()}
    table = synth.generate(kind, n, seed=args.seed, **overrides)
    import pyarrow.parquet as pq

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, f"{name}.parquet")
        pq.write_table(table, path)
        return one_forest(read_rollouts([path]), args.seed)


def batches(r: Rollouts, args) -> dict[str, list[Pack]]:
    """The packs of each mode; tree mode once per capacity, under "tree" (the first) and "tree C=<capacity>";
    dfs and tree packs in ``--child-order``."""
    order = getattr(args, "child_order", "lex")
    whole = relayout(build_pack(r), order)
    capacities = args.capacity if isinstance(args.capacity, list) else [args.capacity]
    trees = {f"tree C={c}": [relayout(p, order) for p in pack_rollouts(r, c)] for c in capacities}
    return {
        "dfs": [whole],
        "tree": trees[f"tree C={capacities[0]}"],
        **trees,
        "dense": dense_batches(r, np.arange(len(r)), args.dense_tokens),
        "dense-leaf": dense_batches(r, leaf_sequences(r), args.dense_tokens),
    }


def kv_bytes_per_token(m: ModelArgs, bytes_per_value: int = 2) -> int:
    return m.num_layers * 2 * m.num_kv_heads * m.head_dim * bytes_per_value


# --------------------------------------------------------------------------------------------------
# Plan only (CPU): the dfs accounting of each workload


def plan_only(args) -> str:
    lines = [("| workload | N_tree | N_flat | leaves | longest path | block | keep | pruned | anchor tokens "
              "| anchor share | calls (anchor/keep/grad/release, merges) | peak graph tokens | path K/V + grads (0.6B) |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    per_token = kv_bytes_per_token(QWEN3_0_6B)
    for name in args.workloads:
        r = workload(name, args)
        whole = build_pack(r)
        rows = LossRows.from_pack(whole)
        for (block, keep), merge, pops in itertools.product(args.dfs, args.merge_anchors, args.merge_pops):
            dfs = DfsConfig(block_size=block, keep_tokens=keep, subtree_calls=not args.walk, merge_anchor_tokens=merge)
            s = DfsMode(dfs=dfs, merge_pops=pops == "on").schedule(whole, rows)
            share = s.anchor_tokens / (s.anchor_tokens + s.grad_tokens)
            calls = "/".join(str(s.count(k)) for k in ("anchor", "keep", "grad", "release"))
            calls += f", {sum(1 for st in s.steps if st.n_anchor)} anchors merged, pops merged {pops}"
            lines.append(
                f"| {name} | {whole.n_real:,} | {int(whole.seq_offsets[-1]):,} | {s.n_leaves} | {s.max_depth:,} "
                f"| {block or 'unlimited'} | {keep} | {s.n_pruned:,} | {s.anchor_tokens:,} | {share:.1%} | {calls} "
                f"| {s.peak_graph_tokens:,} | {s.max_depth * per_token * 3 / 2**30:.2f} GiB |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------
# GPU measurement


def gpu_busy(step, top: int = 16) -> tuple[float, float, str]:
    """(wall seconds, seconds the GPU ran kernels or copies: the union of their intervals, a markdown table of
    the longest kernels) of one ``step()`` under torch.profiler. Busy well below wall means the host (Python,
    launches) sets the pace."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        wall = step()[0]
    events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    spans = sorted((e.time_range.start, e.time_range.end) for e in events)
    busy_us, end = 0.0, float("-inf")
    for lo, hi in spans:
        if hi > end:
            busy_us += hi - max(lo, end)
            end = hi
    by_name: dict[str, list[float]] = {}
    for e in events:
        by_name.setdefault(e.name, []).append(e.time_range.end - e.time_range.start)
    header = "| kernel | calls | GPU ms | share of busy |\n|---|---|---|---|\n"

    def rows(key) -> str:
        return "".join(f"| `{name[:90]}` | {len(d)} | {sum(d) / 1e3:.1f} | {sum(d) / busy_us:.1%} |\n"
                       for name, d in sorted(by_name.items(), key=key)[:top])

    kinds: dict[str, list[float]] = {}
    for name, d in by_name.items():
        kinds.setdefault(_kernel_kind(name), []).extend(d)
    table = (f"{len(events)} kernels and copies in the step. By GPU time:\n\n{header}{rows(lambda kv: -sum(kv[1]))}"
             f"\nBy launches (each costs host time):\n\n{header}{rows(lambda kv: -len(kv[1]))}"
             "\nBy kind:\n\n| kind | calls | GPU ms | share of busy |\n|---|---|---|---|\n"
             + "".join(f"| {kind} | {len(d)} | {sum(d) / 1e3:.1f} | {sum(d) / busy_us:.1%} |\n"
                       for kind, d in sorted(kinds.items(), key=lambda kv: -sum(kv[1]))))
    return wall, busy_us / 1e6, table


KERNEL_KINDS = (("attention backward", ("flash_bwd", "FlashAttentionBackward")),
                ("attention forward", ("flash_fwd", "FlashAttentionForward")),
                ("matmul", ("nvjet", "gemm", "cutlass", "splitKreduce", "sm90_xmma")),
                ("fused (Inductor)", ("triton_",)),
                ("copy / cat / fill / index", ("copy", "Cat", "Fill", "Memset", "memcpy", "Memcpy", "index")),
                ("elementwise / reduce (eager)", ("elementwise", "reduce_kernel", "multi_tensor_apply")))


def _kernel_kind(name: str) -> str:
    return next((kind for kind, marks in KERNEL_KINDS if any(m in name for m in marks)), "other")


def host_profile(step, top: int = 40) -> str:
    """cProfile of one ``step()``: the Python functions the host spends its time in (own time), as a
    markdown table, for steps the GPU waits on."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    wall = step()[0]
    prof.disable()
    stats = pstats.Stats(prof)
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    lines = [f"cProfile of one step ({wall:.3f} s under the profiler), by own time:", "",
             "| function | calls | own s | cumulative s |", "|---|---|---|---|"]
    for (file, line, name), (_, calls, own, cum, _) in rows:
        where = f"{Path(file).name}:{line}" if line else file
        lines.append(f"| `{name}` ({where}) | {calls} | {own:.3f} | {cum:.3f} |")
    return "\n".join(lines) + "\n"


def measure(model, packs: list[Pack], mode, objective: Objective, repeats: int, profile: bool = False,
            gc_mode: str = "default", cprofile: bool = False) -> dict:
    import gc

    import torch

    rows = [LossRows.from_pack(p) for p in packs]
    totals = BatchTotals.of(rows)
    cuda = model.device.type == "cuda"
    pauses = Pauses()  # Python's collections during a step

    def step() -> tuple[float, int, dict]:
        model.zero_grad(set_to_none=True)
        pauses.take()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            retries = torch.cuda.memory_stats().get("num_alloc_retries", 0)
        t0 = time.perf_counter()
        work: dict = {}
        for pack, row in zip(packs, rows):
            out = mode(model, pack, row, objective, totals)
            out.backward()
            work = merge_work(work, out.metrics)
        # host time to queue the step: close to the wall time when the GPU waits for the host
        work["issue_seconds"] = time.perf_counter() - t0
        work["gc_seconds"], work["gc_full"] = pauses.take()
        if cuda:
            torch.cuda.synchronize()
            # allocations that had to free cached blocks first (cudaFree waits for the whole device)
            work["alloc_retries"] = torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries
            work["reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)  # CUDA graph pools included
        # dfs's CUDA graphs hold their memory in a pool that max_memory_allocated stops counting once captured
        peak = torch.cuda.max_memory_allocated() + work.get("graph_pool_bytes", 0) if cuda else 0
        return time.perf_counter() - t0, peak, work

    pauses.start()
    try:
        step()  # warm-up: Triton compiles and autotunes per block shape
        if getattr(mode, "cuda_graphs", False):
            step()  # dfs CUDA graphs capture a call shape the second time they meet it
        if gc_mode != "default":  # what the warm-up built (compiled code, caches) is never garbage
            freeze_warmup()
            if gc_mode == "off":
                gc.disable()
        runs = [step() for _ in range(repeats)]
    except torch.cuda.OutOfMemoryError:
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        return {"oom": True}
    finally:
        pauses.stop()
        gc.enable()
        thaw()
    out = {"seconds": statistics.median(t for t, _, _ in runs), "peak": max(m for _, m, _ in runs),
           "work": runs[-1][2], "times": [t for t, _, _ in runs],
           "issue": statistics.median(w["issue_seconds"] for _, _, w in runs),
           "alloc_retries": sum(w.get("alloc_retries", 0) for _, _, w in runs),
           "gc_seconds": [w["gc_seconds"] for _, _, w in runs], "gc_full": sum(w["gc_full"] for _, _, w in runs),
           "reserved_gib": max(w.get("reserved_gib", 0.0) for _, _, w in runs),
           "graph_calls": runs[-1][2].get("graph_calls", 0)}
    if profile and cuda:
        out["profiled_wall"], out["gpu_busy"], out["kernels"] = gpu_busy(step)
    if cprofile:
        out["host_profile"] = host_profile(step)
    return out


def run_gpu(args) -> None:
    import torch

    from treepack.train import compiled
    from treepack.train.model import Decoder
    from treepack.train.modes import dfs as dfs_mode
    from treepack.train.modes import make_mode

    os.environ["TREEPACK_FA4_REPLAY"] = args.fa4_replay
    from treepack.kernels.tree_attention import fa4

    # costed (the default): the budget partitioner weighs the tree-attention ops by their FLOP formula
    # (kernels/tree_attention/ops.py); free: as custom ops, they count as free to recompute
    compiled.WEIGH_KERNEL_OPS = args.attention_recompute == "costed"

    fa4.FA4_BWD_BLOCK_Q = args.fa4_bwd_block_q
    if args.graph_buckets:
        from treepack.train.modes import dfs_graphs

        dfs_graphs.TOKEN_BUCKET, dfs_graphs.PREFIX_BUCKET = args.graph_buckets
    dev = torch.device(args.device)
    margs = QWEN3_0_6B if args.model == "qwen3-0.6b" else TINY
    t0 = time.perf_counter()
    model = Decoder.random_init(margs, seed=args.seed, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32,
                                device=dev, draw_on_device=True)
    init_s = time.perf_counter() - t0
    model.compile = args.compile
    model.activation_memory_budget = args.activation_memory_budget
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    objective = Objective(kind="grpo")
    per_token = kv_bytes_per_token(margs)

    head = [
        f"# dfs vs tree vs dense training step — {today()}",
        "",
        f"GPU {gpu_line(dev)}.",
        (f"Model: {args.model} shape ({margs.num_layers} layers, hidden {margs.hidden_size}, {margs.num_heads} q / "
         f"{margs.num_kv_heads} kv heads of {margs.head_dim}, vocab {margs.vocab_size:,}, tied), random init, "
         f"{str(model.dtype).removeprefix('torch.')} weights ({weights / 2**30:.2f} GiB) and compute; GRPO, "
         f"token-mean; attention {args.attention} (FA4 launch replay {args.fa4_replay}, backward query blocks of "
         f"{args.fa4_bwd_block_q} rows); attention recompute {args.attention_recompute}; BLAS {' or '.join(args.blas)}; gradient sums per call {' or '.join(args.grad_sum)}; dfs anchors merged up to {' or '.join(map(str, args.merge_anchors))} tokens, pops merged {' or '.join(args.merge_pops)}; pack child order {args.child_order}; Python gc {' or '.join(args.gc)}; activation memory budget {args.activation_memory_budget}; tree capacity {', '.join(f'{c:,}' for c in args.capacity)}; "
         f"dense micro-batches <= "
         f"{args.dense_tokens:,} flat tokens; {args.repeats} timed steps after one warm-up, two with dfs CUDA graphs (median)."),
        f"Command: `{command_line(__file__, sys.argv[1:])}` (model init {init_s:.0f} s).",
        "",
        ("Columns: s/step = forward + backward of the whole workload; tree tok/s = N_tree / s; peak = "
         "max_memory_allocated over the step (weights and gradients included; with dfs CUDA graphs plus the "
         "memory their pool reserved); anchor = dfs tokens forwarded "
         "without grad / all its forwarded tokens; calls = model calls of dfs per step."),
        "",
    ]
    out_text = "\n".join(head)

    def flush() -> None:
        print(out_text, flush=True)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(out_text)

    for name in args.workloads:
        r = workload(name, args)
        groups = batches(r, args)
        whole = groups["dfs"][0]
        n_tree, n_flat = whole.n_real, int(whole.seq_offsets[-1])
        longest = int(whole.position_ids[: whole.n_real].max()) + 1
        leaf_tokens = sum(int(p.seq_offsets[-1]) for p in groups["dense-leaf"])
        out_text += (f"\n## {name}: {len(r)} sequences, N_tree {n_tree:,}, N_flat {n_flat:,}, dense-leaf tokens "
                     f"{leaf_tokens:,}, longest path {longest:,} (its K/V: {longest * per_token / 2**30:.2f} GiB)\n\n"
                     "| mode | packs | s/step | tree tok/s | vs tree, same memory | vs dense-leaf | peak GiB | anchor "
                     "| calls | peak graph tokens |\n|---|---|---|---|---|---|---|---|---|---|\n")
        results = {}
        for mode_name in args.modes:
            if mode_name == "dense" and n_flat > args.dense_max_flat:
                results[mode_name] = {"skipped": f"N_flat {n_flat:,} > --dense-max-flat"}
                continue
            variants = [(b, k, m, p, g, bl, gm, cg) for (b, k), m, p, g, bl, gm, cg in itertools.product(
                args.dfs, args.merge_anchors, args.merge_pops, args.grad_sum, args.blas, args.gc, args.cuda_graphs)] \
                if mode_name == "dfs" else [(None, 0, 0, "on", "on", args.blas[0], args.gc[0], "off")]
            if mode_name == "tree":
                variants = [(c, 0, 0, "on", "on", args.blas[0], args.gc[0], "off") for c in args.capacity]
            for block, keep, merge, pops, grad_sum, blas, gc_mode, graphs in variants:
                dfs_mode.SUM_GRADS_AT_ONCE = grad_sum == "on"
                if blas != "default" and dev.type == "cuda":
                    torch.backends.cuda.preferred_blas_library(blas)
                if mode_name == "dfs":
                    label = (f"dfs B={block or 'inf'}" + (f" keep={keep}" if keep else "")
                             + (f" merge={merge}" if len(args.merge_anchors) > 1 else "")
                             + (f" pops={pops}" if len(args.merge_pops) > 1 else "")
                             + (f" grad-sum={grad_sum}" if len(args.grad_sum) > 1 else "")
                             + (f" {blas}" if len(args.blas) > 1 else "")
                             + (f" gc={gc_mode}" if len(args.gc) > 1 else "")
                             + (f" graphs={graphs}" if len(args.cuda_graphs) > 1 else ""))
                    label += f" #{sum(1 for k in results if k.startswith(label)) + 1}" if label in results else ""
                else:
                    label = f"tree C={block}" if mode_name == "tree" else mode_name
                dense = mode_name.startswith("dense")
                dfs = DfsConfig(block_size=block if mode_name == "dfs" else "auto", keep_tokens=keep,
                                subtree_calls=not args.walk, merge_anchor_tokens=merge, cuda_graphs=graphs == "on")
                mode = make_mode(mode_name.removesuffix("-leaf"), **({} if dense else {"attention": args.attention}),
                                 logits_chunk=args.logits_chunk, dfs=dfs, merge_pops=pops == "on",
                                 micro_batch_tokens=args.dense_tokens if dense else "")
                packs = groups[label if mode_name == "tree" else mode_name]
                results[label] = measure(model, packs, mode, objective, args.repeats, args.profile, gc_mode,
                                         args.cprofile and mode_name == "dfs")
                results[label]["packs"] = len(packs)
                g = getattr(mode, "_graphs", None)
                if g is not None:
                    results[label]["cuda_graphs"] = {"captures": g.captures, "replays": g.replays, "eager": g.eager,
                                                     "failed": g.failed}
                print(label, {k: v for k, v in results[label].items() if k != "work"}, flush=True)
        leaf_s = results.get("dense-leaf", {}).get("seconds")
        trees = [res for label, res in results.items() if label.startswith("tree") and "seconds" in res]


        for label, res in results.items():
            if "seconds" not in res:
                why = "out of memory" if res.get("oom") else res.get("skipped", "")
                out_text += f"| {label} | {res.get('packs', '-')} | {why} | | | | | | | |\n"
                continue
            w = res["work"]
            out_text += (f"| {label} | {res['packs']} | {res['seconds']:.3f} | {n_tree / res['seconds'] / 1e3:,.1f}k "
                         f"| {_vs_tree_same_memory(res, trees)} "
                         f"| {ratio(leaf_s, res['seconds'])} | {res['peak'] / 2**30:.2f} "
                         f"| {w['anchor_share']:.1%} | {w['model_calls']} | {w['peak_graph_tokens']:,} |\n"
                         if "anchor_share" in w else
                         f"| {label} | {res['packs']} | {res['seconds']:.3f} | {n_tree / res['seconds'] / 1e3:,.1f}k "
                         f"| {_vs_tree_same_memory(res, trees)} "
                         f"| {ratio(leaf_s, res['seconds'])} | {res['peak'] / 2**30:.2f} "
                         f"| | | |\n")
        timed = [(label, res) for label, res in results.items() if "issue" in res]
        if timed:
            out_text += ("\nHost time to queue a step (median; near s/step means the GPU waited for the host) and "
                         "allocations that first had to free cached memory (each waits for the device):\n")
            for label, res in timed:
                out_text += (f"- {label}: queued in {res['issue']:.3f} s of {res['seconds']:.3f} s; steps "
                             f"{', '.join(f'{t:.3f}' for t in res['times'])}; alloc retries {res['alloc_retries']}; "
                             f"Python's gc {', '.join(f'{1e3 * t:.0f}' for t in res['gc_seconds'])} ms "
                             f"({res['gc_full']} full collections)\n")
        for label, res in results.items():
            if "host_profile" in res:
                out_text += f"\n{label}: {res['host_profile']}"
        fwd_stats, bwd_stats = fa4.fa4_replay_stats()
        if fwd_stats.replayed + fwd_stats.recorded + fwd_stats.plain:
            out_text += f"\nFA4 calls so far: forward {fwd_stats.line()}; backward {bwd_stats.line()}.\n"
        profiled = [(label, res) for label, res in results.items() if "gpu_busy" in res]
        if profiled:
            out_text += "\nGPU busy (union of kernel and copy intervals, torch.profiler) over one profiled step:\n"
            for label, res in profiled:
                out_text += (f"- {label}: {res['gpu_busy']:.3f} s busy of {res['profiled_wall']:.3f} s wall "
                             f"({res['gpu_busy'] / res['profiled_wall']:.0%}); host-bound share "
                             f"{1 - res['gpu_busy'] / res['profiled_wall']:.0%}\n")
            for label, res in profiled:
                out_text += f"\n{label}, longest kernels of the profiled step:\n\n{res['kernels']}"
        if name == "tau-bench" and len(r) == 144:
            out_text += "\n"
            for ref in AREAL_DTA:
                runs = [(res["seconds"], label, res["peak"]) for label, res in results.items()
                        if label.startswith("dfs") and "seconds" in res and res["peak"] <= ref["gib"] * 2**30]
                best = (f"fastest dfs here within that memory: {min(runs)[1]}, {min(runs)[0]:.3f} s at "
                        f"{min(runs)[2] / 2**30:.2f} GiB: {ref['seconds'] / min(runs)[0]:.2f}x" if runs
                        else "no dfs run here within that memory")
                out_text += (f"AReaL-DTA's code on these 144 records (block {ref['block']}): {ref['seconds']} s/step "
                             f"at {ref['gib']} GiB (H200); {best}.\n")
        flush()
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def _vs_tree_same_memory(res: dict, trees: list[dict]) -> str:
    """A run's speed-up over the fastest tree run that used at least its memory ("-": none did)."""
    fits = [t["seconds"] for t in trees if t["peak"] >= res["peak"]]
    return ratio(min(fits) if fits else None, res["seconds"])


def _choices(*allowed: str):
    """A comma-separated list of values from ``allowed`` (each runs as its own variant)."""

    def parse(text: str) -> list[str]:
        values = text.split(",")
        bad = [v for v in values if v not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"{', '.join(bad)}: not one of {', '.join(allowed)}")
        return values

    return parse


def _dfs_variants(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        block, _, keep = item.partition(":")
        out.append((int(block), int(keep or 0)))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default=",".join(WORKLOADS), type=lambda s: s.split(","))
    ap.add_argument("--modes", default=",".join(MODES), type=lambda s: s.split(","))
    ap.add_argument("--dfs", default="2048,8192,2048:8192", type=_dfs_variants,
                    help="dfs variants BLOCK[:KEEP] ([train.dfs] block_size, 0 = unlimited; keep_tokens, default 0)")
    ap.add_argument("--walk", action="store_true", help="dfs leaf by leaf (AReaL-DTA), no subtree calls")
    ap.add_argument("--merge-anchors", type=lambda s: [int(m) for m in s.split(",")], default=[MERGE_ANCHOR_TOKENS],
                    help="dfs: anchors of at most this many tokens ride along in the grad call before them (0: off); "
                         "several (0,512): one dfs run each, in one process")
    ap.add_argument("--capacity", default=[32768], type=lambda s: [int(c) for c in s.split(",")],
                    help="tree mode: pack capacities in tree tokens (comma-separated: one tree run each)")
    ap.add_argument("--dense-tokens", type=int, default=16384, help="dense modes: flat tokens per micro-batch")
    ap.add_argument("--dense-max-flat", type=int, default=300_000, help="skip dense above this many flat tokens")
    ap.add_argument("--tau-bench", type=Path, default=SAMPLE, help="tau-bench rollouts (Parquet)")
    ap.add_argument("--tau-records", type=int, default=144)
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--model", default="qwen3-0.6b", choices=("qwen3-0.6b", "tiny"))
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run (with --model tiny)")
    ap.add_argument("--compile", default="auto", choices=("auto", "on", "off"),
                    help="torch.compile the elementwise regions (train.compile; auto = on CUDA)")
    ap.add_argument("--activation-memory-budget", type=float, default=1.0,
                    help="share of saved activations compiled layers keep (train.activation_memory_budget)")
    ap.add_argument("--logits-chunk", type=int, default=4096, help="rows of full-vocabulary logits at a time")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--attention-recompute", default="costed", choices=("free", "costed"),
                    help="under --activation-memory-budget < 1: free (torch's default for custom ops: the "
                         "attention forward may be recomputed in backward) or costed (weighed by its FLOPs)")
    ap.add_argument("--merge-pops", type=_choices("on", "off"), default=["on"],
                    help="dfs: consecutive pops of one path in one call (on | off; several: one dfs run each)")
    ap.add_argument("--child-order", default="lex", choices=CHILD_ORDERS,
                    help="DFS order of the dfs and tree packs (treepack.pack.layout.relayout)")
    ap.add_argument("--blas", default=["default"], type=_choices("default", "cublas", "cublaslt"),
                    help="torch.backends.cuda.preferred_blas_library for the matmuls: cublas, cublaslt (a list runs "
                         "each, switched in one process), or default (torch's, left as the run before set it)")
    ap.add_argument("--grad-sum", default=["on"], type=_choices("on", "off"),
                    help="dfs: sum each call's parameter gradients with one multi-tensor add (on) or let autograd "
                         "add per parameter (off); a list runs each")
    ap.add_argument("--fa4-replay", default="on", choices=("on", "off", "check"),
                    help="FA4 launch replay (TREEPACK_FA4_REPLAY): on, off, or checked against FA4 on every call")
    ap.add_argument("--fa4-bwd-block-q", type=int, default=128, choices=(128, 80, 64),
                    help="query rows per block of FA4's backward block lists")
    ap.add_argument("--gc", default=["default"], type=_choices("default", "freeze", "off"),
                    help="Python's garbage collector during the timed steps: as is, everything from the warm-up "
                         "frozen (gc.freeze), or frozen and disabled; a list runs each as a dfs variant")
    ap.add_argument("--cuda-graphs", default=["off"], type=_choices("on", "off"),
                    help="dfs calls as CUDA graphs (a list: one dfs run per value)")
    ap.add_argument("--graph-buckets", default=None, type=lambda s: tuple(int(x) for x in s.split(":")),
                    help="TOKENS:PREFIX: dfs CUDA graphs' call and prefix length buckets (default 128:256)")
    ap.add_argument("--cprofile", action="store_true", help="one more dfs step under cProfile: host time by function")
    ap.add_argument("--plan-only", action="store_true", help="print the dfs accounting (CPU, no model)")
    ap.add_argument("--profile", action="store_true", help="one more step per run under torch.profiler: GPU busy "
                                                           "time against wall time")
    ap.add_argument("--out", type=Path, default=None, help="write the markdown results here")
    args = ap.parse_args(argv)
    for w in args.workloads:
        if w not in WORKLOADS:
            ap.error(f"unknown workload {w!r} (workloads: {', '.join(WORKLOADS)})")
    if set(args.merge_pops) - {"on", "off"}:
        ap.error(f"--merge-pops takes on and off, got {','.join(args.merge_pops)!r}")
    for m in args.modes:
        if m not in MODES:
            ap.error(f"unknown mode {m!r} (modes: {', '.join(MODES)})")
    if args.plan_only:
        text = plan_only(args)
        print(text, end="")
        if args.out:
            args.out.write_text(text)
        return
    run_gpu(args)


if __name__ == "__main__":
    main()
