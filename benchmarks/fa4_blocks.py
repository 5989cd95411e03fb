"""How many 128 x 128 blocks the FA4 tree kernel visits on real packs, and how many of them are partial
(its ``mask_mod`` evaluated per score), for the pack's token order and for other DFS orders of the same tree.

Why: per visible pair FA4 runs ToolBench's packs at ~0.74x the rate of tau-bench's (313 vs 425 TFLOP/s,
2026-11-25-attention-fa4-h100.md), and ToolBench is the one real file where tree mode's MFU stays below 50%.
The kernel's work is its visited blocks, and a partial block costs more than a full one. Both counts come
from `fa4_tables` exactly as the kernel receives them (CPU, no GPU needed). Any DFS order of a pack's tokens
satisfies the mask contract ``k <= q < subtree_end[k]`` and gives the same attention, so the order is free
to choose; this script measures what choosing it could save:

- ``lex``: the pack as built (children in lexicographic order of their first token, `treepack.pack.layout`);
- ``size-desc`` / ``size-asc``: each node's children by subtree size, largest / smallest first (ties in
  lexicographic order); ``size-desc`` is `treepack.pack.layout.relayout(pack, "largest-first")`, what
  ``treepack train`` runs with ``data.child_order = "largest-first"``.

Usage:
    python benchmarks/fa4_blocks.py FILE [FILE ...] [--records N] [--capacity 32K] [--out report.md]
Files are packed as `benchmarks/train_step.py` packs them (one forest, `treepack.train.data.pack_rollouts`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import command_line, cpu_line, one_forest, today, versions, write_report

from treepack.io.ingest import read_rollouts
from treepack.pack.layout import relayout, reorder
from treepack.sizes import parse_size
from treepack.train.data import pack_rollouts

ORDERS = ("lex", "size-desc", "size-asc")
CHILD_ORDER = {"lex": "lex", "size-desc": "largest-first"}  # the trainer's data.child_order of each


def layout_subtree_end(pack, order: str) -> np.ndarray:
    """subtree_end (int64, real tokens) of the pack laid out in ``order``: ``lex`` as built, ``size-desc``
    the trainer's ``largest-first`` (`treepack.pack.layout.relayout`), ``size-asc`` `reorder` by subtree
    size ascending (no trainer option: the order not to use)."""
    T = int(pack.n_real)
    if order == "size-asc":
        pack = reorder(pack, np.asarray(pack.subtree_end[:T], dtype=np.int64) - np.arange(T))
    else:
        pack = relayout(pack, CHILD_ORDER[order])
    return np.asarray(pack.subtree_end[:T], dtype=np.int64)


def block_counts(subtree_end_T: np.ndarray) -> tuple[int, int]:
    """(partial, full) blocks of FA4's forward block lists for this pack."""
    import torch

    from treepack.kernels.tree_attention.fa4 import fa4_tables

    tables = fa4_tables(torch.as_tensor(subtree_end_T.astype(np.int32)))
    return int(tables[1].sum()), int(tables[3].sum())


def measure(path: str, records: int | None, capacity: int) -> dict:
    r = read_rollouts([path])
    if records is not None:
        r = r.select(np.arange(min(records, len(r))))
    r = one_forest(r, 0)
    out = {"packs": 0, "tokens": 0, "pairs": 0, **{o: [0, 0] for o in ORDERS}}
    for pack in pack_rollouts(r, capacity):
        T = int(pack.n_real)
        size_T = np.asarray(pack.subtree_end[:T], dtype=np.int64) - np.arange(T)
        out["packs"] += 1
        out["tokens"] += T
        out["pairs"] += int(size_T.sum())
        for name in ORDERS:
            se = layout_subtree_end(pack, name)
            assert int((se - np.arange(T)).sum()) == int(size_T.sum())  # same tree, same visible pairs
            partial, full = block_counts(se)
            out[name][0] += partial
            out[name][1] += full
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--records", type=int, default=None, help="the first N records of each file")
    ap.add_argument("--capacity", default="32K")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    capacity = parse_size(args.capacity, what="--capacity")
    lines = [f"# FA4 blocks visited per DFS order of the same packs — {today()}", "",
             f"- machine: {cpu_line()}; {versions('numpy', 'torch')}",
             f"- command: `{command_line(__file__, sys.argv[1:] if argv is None else argv)}`",
             f"- packs: one forest per file, `pack_rollouts` at {capacity:,}; blocks of 128 x 128 (FA4 on Hopper)",
             "- visited = partial + full blocks; useful = visible pairs / (visited x 128^2)", "",
             "| file | packs | tokens | order | partial | full | partial share | useful | visited vs lex |",
             "|---|---|---|---|---|---|---|---|---|"]
    for path in args.files:
        res = measure(path, args.records, capacity)
        base = sum(res["lex"])
        for name in ORDERS:
            partial, full = res[name]
            lines.append(f"| {Path(path).name} | {res['packs']} | {res['tokens']:,} | {name} | {partial:,} | {full:,} "
                         f"| {partial / (partial + full):.1%} | {res['pairs'] / ((partial + full) * 128 * 128):.1%} "
                         f"| {(partial + full) / base:.3f}x |")
        print(lines[-3], lines[-2], lines[-1], sep="\n", flush=True)
    write_report(args.out, "\n".join(lines) + "\n")
    if args.out is None:
        print("\n".join(lines))


if __name__ == "__main__":
    main()
