"""Benchmark ``treepack stats`` on a generated 100M-token Parquet file against a Python dict trie.

What it measures, in one run:
- ``treepack stats FILE --json --quiet`` end to end in a subprocess (interpreter start, Parquet read,
  validation, tree build, stats): wall seconds, tokens/s and peak RSS (the child's ru_maxrss);
- a dict-of-dicts trie (the obvious Python implementation) building the same trie over a 5M-token slice of
  the same file, timed in-process from already-decoded Python lists (its most favourable setting);
- the speedup in tokens/s, and peak RSS over the raw token bytes (4 bytes a token).
Targets (DESIGN §9): >= 50x the dict trie's tokens/s; 100M tokens in <= 15 s on 2 cores; RSS <= 3x tokens.

Usage: python benchmarks/stats.py [--tokens 100M] [--kind tau2] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]


def generate(path: Path, tokens: int, kind: str, seed: int) -> dict:
    """Write a Parquet file of about ``tokens`` tokens of ``treepack synth KIND --think`` rollouts."""
    from treepack.datasets import synth

    probe = synth.generate(kind, 64, seed=seed, think=True)
    per_tree = sum(len(x) for x in probe.column("input_ids").to_pylist()) / 64
    n_trees = max(1, round(tokens / per_tree))
    res = synth.write(kind, n_trees, path, seed=seed, think=True)
    return {"tokens": res.tokens, "records": res.records, "trees": res.trees, "seconds": res.seconds}


def dict_trie_tokens_per_s(path: Path, slice_tokens: int) -> tuple[float, int, int]:
    """Build a dict trie over the first ``slice_tokens`` tokens' sequences; return (tok/s, tokens, trie tokens)."""
    pf = pq.ParquetFile(path)
    seqs: list[list[int]] = []
    total = 0
    for batch in pf.iter_batches(batch_size=1024, columns=["input_ids"]):
        for s in batch.column(0).to_pylist():
            seqs.append(s)
            total += len(s)
            if total >= slice_tokens:
                break
        if total >= slice_tokens:
            break
    t0 = time.perf_counter()
    root: dict = {}
    n_tree = 0
    for s in seqs:
        node = root
        for t in s:
            child = node.get(t)
            if child is None:
                child = node[t] = {}
                n_tree += 1
            node = child
    seconds = time.perf_counter() - t0
    return total / seconds, total, n_tree


def run_treepack(path: Path) -> tuple[float, int, dict]:
    """(wall seconds, peak RSS bytes, stats JSON) of ``treepack stats PATH --json --quiet`` in a child."""
    exe = [sys.executable, "-m", "treepack", "stats", str(path), "--json", "--quiet"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    out = subprocess.run(exe, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t0
    rss_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    if rss_kb <= before:
        rss_kb = before  # an earlier child was bigger; ru_maxrss is the max over children
    return wall, rss_kb * 1024, json.loads(out.stdout)


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> None:
    from treepack.sizes import parse_size

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="100m", help="tokens in the generated file (default 100m = 100,000,000)")
    ap.add_argument("--kind", default="tau2", help="synth kind (default tau2 with --think)")
    ap.add_argument("--baseline-tokens", default="5m", help="dict-trie slice (default 5m)")
    ap.add_argument("--repeat", type=int, default=3, help="treepack runs (best is reported)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    tokens = parse_size(args.tokens, what="--tokens")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{args.kind}-{tokens}.parquet"
        info = generate(path, tokens, args.kind, args.seed)
        n_tokens = info["tokens"]
        print(f"generated {n_tokens:,} tokens, {info['records']:,} records in {info['seconds']:.1f} s "
              f"({path.stat().st_size / 1e6:.0f} MB Parquet)", flush=True)
        runs = [run_treepack(path) for _ in range(args.repeat)]
        wall, rss, st = min(runs, key=lambda x: x[0])
        base_tps, base_tokens, _ = dict_trie_tokens_per_s(path, parse_size(args.baseline_tokens))
    tps = n_tokens / wall
    rows = {
        "tokens": n_tokens,
        "records": info["records"],
        "compression": st["compression"],
        "wall_s": wall,
        "all_walls_s": [round(r[0], 2) for r in runs],
        "tokens_per_s": tps,
        "peak_rss_bytes": rss,
        "rss_over_tokens": rss / (4 * n_tokens),
        "dict_trie_tokens_per_s": base_tps,
        "dict_trie_tokens": base_tokens,
        "speedup": tps / base_tps,
    }
    import numpy
    import polars
    import pyarrow

    versions = f"Python {platform.python_version()}, numpy {numpy.__version__}, pyarrow {pyarrow.__version__}, polars {polars.__version__}"
    today = dt.date.today().isoformat()
    cmd = "python benchmarks/stats.py " + " ".join(sys.argv[1:])
    lines = [
        f"# treepack stats benchmark ({today})",
        "",
        f"- hardware: {cpu_model()}, {os.cpu_count()} cores",
        f"- versions: {versions}",
        f"- command: `{cmd.strip()}` (`make bench-stats`)",
        f"- input: `treepack synth {args.kind} --think` rollouts, seed {args.seed}, written to Parquet:"
        f" {n_tokens:,} tokens, {info['records']:,} records, C = {st['compression']:.2f}",
        "",
        "| measure | value | target |",
        "|---|---|---|",
        f"| `treepack stats --json` wall time (best of {len(runs)}: {rows['all_walls_s']}) | {wall:.2f} s | <= 15 s |",
        f"| throughput | {tps / 1e6:.1f}M tokens/s | |",
        f"| dict trie (Python, {base_tokens / 1e6:.1f}M-token slice, pre-decoded lists) | {base_tps / 1e6:.2f}M tokens/s | |",
        f"| speedup over the dict trie | {rows['speedup']:.0f}x | >= 50x |",
        f"| peak RSS | {rss / 2**20:,.0f} MiB = {rows['rss_over_tokens']:.2f}x the raw int32 tokens | <= 3x |",
        "",
        "The treepack time includes the interpreter start, reading and validating the Parquet file, the tree",
        "build and every statistic; the dict trie is timed on Python lists that are already decoded.",
    ]
    report = "\n".join(lines) + "\n"
    print(report)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{today}-stats.md").write_text(report)
    (out / f"{today}-stats.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
