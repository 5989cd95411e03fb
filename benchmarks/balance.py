"""Balance of one global batch over K data-parallel ranks, simulated at K = 8..1024 on real rollouts: the
predicted step time, idle share and duplicated work of treepack's sharing-aware balance against
AReaL-DTA's Algorithm 4 and a round-robin split. No model runs: every cost is the FLOP model (design §9,
``--model``) of what a rank computes.

Global batch: all sequences of a file. A rank's cost is the FLOPs of a fwd+bwd pass over its work:
- ``round-robin``: sequence i goes to rank i mod K (a ``DistributedSampler``); the rank computes the trie
  of its sequences (whatever sharing survives the deal);
- ``Algorithm 4``: AReaL-DTA's split: the sequences in lexicographic order, K contiguous groups minimising
  the largest group's trie *tokens* (binary search + greedy, exactly K groups); the rank computes its
  group's trie;
- ``treepack``: `balance_units` with FLOP costs over the batch's trie as one unit (the same setting as
  Algorithm 4: each rank gets runs of the DFS order and computes their tries);
- ``packs RR`` / ``treepack packs``: the batch first packed at ``--capacity`` (``pack_sequences``, strategy
  best, no tree_id scoping), then the packs dealt round-robin, or balanced by `balance_units` (whole packs
  first, a pack cut only where that lowers the step time by >= 1%): what ``treepack train`` does.

Per cell: ``time`` = costliest rank / (FLOPs of the whole batch's trie / K), the step time against a
perfect split that duplicates nothing (1.00 is ideal); ``idle`` = share of the ranks' time spent waiting
for the costliest (1 - mean / max); ``dup`` = FLOPs computed over the batch's trie FLOPs, minus 1 (shared
prefixes computed on several ranks, or in several packs); for treepack's two rows ``cut`` = what cutting
cost (`UnitSplit.cut_share`: the cut units' pieces over those units whole, as a share of the batch's
units whole; the packs row's ``dup`` also holds what packing repeats). Every predicted load is exact:
each piece costs what the pack it becomes costs (``tests/test_balance.py``). ``floor``: the costliest single sequence over
the same ideal; no split of whole sequences gets below it (past it, more ranks only idle).

Usage: python benchmarks/balance.py [--ranks 8,16,...,1024] [--model qwen3-1.7b] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
import itertools

from common import command_line, cpu_line, today, versions, write_report

DATA = ROOT.parent / "shared" / "data" / "rollouts"
FILES = ("tau_bench_grok3_retail", "toolbench_dfs", "gsm8k_model_solutions", "hh_rlhf_harmless_test")
METHODS = ("round-robin", "Algorithm 4", "treepack", "packs RR", "treepack packs")


def timed(fn, *args, repeat: int = 3):
    """(seconds, result): the fastest of ``repeat`` calls (a shared machine's other work only adds time)."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn(*args)
        best = min(best, time.perf_counter() - t0)
    return best, out


def simulate(r, ks: list[int], model: str, capacity: int) -> tuple[dict, list[dict]]:
    from treepack.pack.balance import balance_units, split_run
    from treepack.pack.cost import FlopModel, rollout_run_costs
    from treepack.pack.strategies import pack_sequences

    flops, tokens = FlopModel.named(model), FlopModel(1, 0, 0)
    _, batch = rollout_run_costs(r, flops=flops)  # the whole batch's trie: the ideal's numerator
    _, batch_tokens = rollout_run_costs(r, flops=tokens)
    t0 = time.perf_counter()
    packing = pack_sequences(r, capacity, strategy="best")
    packs = [rollout_run_costs(r, p, flops)[1] for p in packing.packs]
    facts = {"sequences": len(r), "flat_tokens": int(r.lengths.sum()), "tree_tokens": batch_tokens.whole,
             "packs": len(packs), "pack_seconds": time.perf_counter() - t0, "batch_flops": batch.whole,
             "longest": int(batch.full.max())}
    rows = []
    for k in ks:
        loads = {}
        loads["round-robin"] = [rollout_run_costs(r, np.arange(i, len(r), k), flops)[1].whole if i < len(r) else 0
                                for i in range(k)]
        starts = split_run(batch_tokens, k, exactly=True)
        bounds = [*starts, len(r)]
        loads["Algorithm 4"] = [batch.run(a, b) for a, b in itertools.pairwise(bounds)] + [0] * (k - len(starts))
        seconds = {}
        cut = {}  # what cutting cost: the cut units' pieces over those units whole (UnitSplit.cut_share)
        seconds["treepack"], split = timed(balance_units, [batch], k)
        loads["treepack"], cut["treepack"] = split.loads, split.cut_share
        rr = [0] * k
        for i, p in enumerate(packs):
            rr[i % k] += p.whole
        loads["packs RR"] = rr
        seconds["treepack packs"], split = timed(balance_units, packs, k)
        loads["treepack packs"], cut["treepack packs"] = split.loads, split.cut_share
        ideal = batch.whole / k
        row = {"k": k, "floor": facts["longest"] / ideal, "seconds": seconds}
        for m, load in loads.items():
            top, mean = max(load), sum(load) / k
            row[m] = {"time": top / ideal, "idle": 1 - mean / top, "dup": sum(load) / batch.whole - 1,
                      "imbalance": top / mean, "cut": cut.get(m)}
        rows.append(row)
    return facts, rows


def cell(m: dict) -> str:
    cut = "" if m["cut"] is None else f" / cut {100 * m['cut']:+.1f}%"
    return f"{m['time']:.2f} / {100 * m['idle']:.0f}% / {100 * m['dup']:+.0f}%{cut}"


def report(argv, model: str, capacity: int, results: dict) -> str:
    lines = [f"# Balance of a global batch over K ranks, simulated on real rollouts, {today()}", "",
             f"- hardware: {cpu_line()} (no model runs: FLOP-model costs); {versions('numpy')}",
             f"- command: `{command_line(__file__, argv)}`",
             (f"- costs: fwd+bwd FLOPs of {model} (design §9: tokens, predicted tokens, attention pairs); global "
             f"batch = every sequence of the file; packs for the pack rows: `pack_sequences(best)` at {capacity:,} "
             "tokens, no tree_id scoping"), "",
             ("Cells: **time** (costliest rank over the no-duplication ideal, 1.00 = perfect) / **idle** (share of "
             "rank time spent waiting) / **dup** (work duplicated across ranks or packs) / for treepack's balance, "
             "**cut** (what cutting costs: the FLOPs the cut units' pieces compute beyond those units whole, over the "
             "batch's units whole; `UnitSplit.cut_share`). *floor*: the costliest single sequence over the ideal, "
             "which no split of whole sequences beats."), ""]
    for name, (facts, rows) in results.items():
        lines += [(f"## {name}: {facts['sequences']:,} sequences, N_flat {facts['flat_tokens']:,}, "
                  f"N_tree {facts['tree_tokens']:,}, {facts['packs']} packs"), "",
                  "| K | floor | " + " | ".join(METHODS) + " |", "|---" * (len(METHODS) + 2) + "|"]
        for row in rows:
            lines.append(f"| {row['k']} | {row['floor']:.2f} | " + " | ".join(cell(row[m]) for m in METHODS) + " |")
        worst = max(s for row in rows for s in row["seconds"].values())
        lines += ["", f"treepack's balance took at most {1e3 * worst:.0f} ms per split here (fastest of 3 calls).", ""]
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    from treepack.io.ingest import read_rollouts
    from treepack.sizes import parse_size
    from treepack.stats import MODEL_SHAPES

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="8,16,32,64,128,256,512,1024")
    p.add_argument("--model", default="qwen3-1.7b", choices=sorted(MODEL_SHAPES))
    p.add_argument("--capacity", default="32k", help="pack capacity of the pack rows")
    p.add_argument("--data", type=Path, default=DATA, help="folder of the rollout files")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    ks = [int(k) for k in args.ranks.split(",")]
    capacity = parse_size(args.capacity, what="--capacity")
    results = {}
    for name in FILES:
        path = args.data / f"{name}.parquet"
        if not path.is_file():
            print(f"skipping {name}: {path.name} not found", file=sys.stderr)
            continue
        results[name] = simulate(read_rollouts([str(path)]), ks, args.model, capacity)
        print(f"{name}: done", file=sys.stderr, flush=True)
    text = report(argv, args.model, capacity, results)
    print(text)
    write_report(args.out, text)


if __name__ == "__main__":
    main(sys.argv[1:])
