"""Benchmark ``treepack stats`` on a generated 100M-token Parquet file against a Python dict trie.

What it measures, in one run:
- ``treepack stats FILE --json --quiet`` end to end in a subprocess (interpreter start, Parquet read,
  validation, tree build, stats): wall seconds, tokens/s and peak RSS (that child's ru_maxrss);
- where that time goes: the same stages timed inside fresh interpreters (start, imports, read, build, stats);
- a dict-of-dicts trie (the obvious Python implementation) building the same trie over a 5M-token slice of
  the same file, timed in-process from already-decoded Python lists (its most favourable setting);
- like for like, the tree build alone from already-decoded int32 arrays, in-process: on that same slice
  (checked to give the same trie) and on the whole file;
- the speedups in tokens/s, and peak RSS over the raw token bytes (4 bytes a token);
- the same rollouts as JSONL.gz: ``treepack stats`` end to end, and ``treepack pack --capacity 32K`` on both
  formats (wall, peak RSS); and each JSON parser at hand decoding ``input_ids`` + ``loss_mask`` of the first
  ``--parser-tokens`` tokens into numpy arrays, each in a fresh interpreter (simdjson, orjson, msgspec,
  ``json``, pyarrow.json, polars; one that is not installed is reported so).
Targets (design §9): >= 50x the dict trie's tokens/s; 100M tokens of JSONL.gz (and of Parquet) in <= 15 s on
2 cores at peak RSS <= 3x the int32 token bytes + 300 MB.

Usage: python benchmarks/stats.py [--tokens 100M] [--kind tau2] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
from common import cpu_line, today, versions  # benchmarks/ is on sys.path when a script runs

ROOT = Path(__file__).resolve().parents[1]


def generate(path: Path, tokens: int, kind: str, seed: int) -> dict:
    """Write a Parquet file of about ``tokens`` tokens of ``treepack synth KIND --think`` rollouts."""
    from treepack.datasets import synth

    probe = synth.generate(kind, 64, seed=seed, think=True)
    per_tree = sum(len(x) for x in probe.column("input_ids").to_pylist()) / 64
    n_trees = max(1, round(tokens / per_tree))
    res = synth.write(kind, n_trees, path, seed=seed, think=True)
    return {"tokens": res.tokens, "records": res.records, "trees": res.trees, "seconds": res.seconds}


# Each parser decodes the tokens and loss masks of a decompressed JSONL slice into numpy arrays (the work
# `treepack.io.jsonl` does per line), in its own interpreter: prints "seconds tokens".
PARSERS = {
    "simdjson (treepack's fast path)": """
import simdjson
p = simdjson.Parser()
def decode(lines):
    n = 0
    for line in lines:
        r = p.parse(line)
        t = np.frombuffer(r["input_ids"].as_buffer(of_type="i"), np.int64).astype(np.int32)
        m = np.frombuffer(r["loss_mask"].as_buffer(of_type="i"), np.int64).astype(np.uint8)
        n += len(t); del r
    return n
""",
    "orjson + numpy": """
import orjson
def decode(lines):
    n = 0
    for line in lines:
        r = orjson.loads(line); t = np.array(r["input_ids"], np.int32); m = np.array(r["loss_mask"], np.uint8)
        n += len(t)
    return n
""",
    "msgspec + numpy": """
import msgspec
dec = msgspec.json.Decoder()
def decode(lines):
    n = 0
    for line in lines:
        r = dec.decode(line); t = np.array(r["input_ids"], np.int32); m = np.array(r["loss_mask"], np.uint8)
        n += len(t)
    return n
""",
    "json (stdlib) + numpy": """
import json
def decode(lines):
    n = 0
    for line in lines:
        r = json.loads(line); t = np.array(r["input_ids"], np.int32); m = np.array(r["loss_mask"], np.uint8)
        n += len(t)
    return n
""",
    "pyarrow.json (threads)": """
import io, pyarrow.json as pj
def decode(lines):
    t = pj.read_json(io.BytesIO(b"\\n".join(lines)), read_options=pj.ReadOptions(block_size=1 << 24))
    return len(t.column("input_ids").combine_chunks().values)
""",
    "polars.read_ndjson": """
import io, polars as pl
def decode(lines):
    df = pl.read_ndjson(io.BytesIO(b"\\n".join(lines)))
    return int(df["input_ids"].list.len().sum())
""",
}
PARSER_MAIN = """
import sys, time
import numpy as np
lines = open(sys.argv[1], "rb").read().split(b"\\n")[:-1]
{code}
t0 = time.perf_counter()
n = decode(lines)
print(time.perf_counter() - t0, n)
"""


def write_jsonl_slice(src: Path, dst: Path, tokens: int) -> int:
    """The first lines of a JSONL.gz holding about ``tokens`` tokens, decompressed; returns the tokens."""
    import gzip

    n = 0
    with gzip.open(src, "rb") as fin, open(dst, "wb") as out:
        for line in fin:
            out.write(line)
            n += line.count(b",", 0, line.find(b"]")) + 1 if b'"input_ids"' in line else 0
            if n >= tokens:
                break
    return n


def parser_seconds(slice_path: Path, repeat: int) -> dict:
    """{parser: (best seconds, tokens, peak RSS bytes) or the reason it did not run}."""
    out: dict = {}
    for name, code in PARSERS.items():
        try:
            runs = [run_child(PEAK_RSS + PARSER_MAIN.format(code=code), str(slice_path)) for _ in range(repeat)]
        except subprocess.CalledProcessError as exc:
            err = [line for line in (exc.stderr or "").splitlines() if line.strip() and "peak_rss_kib" not in line]
            out[name] = "not installed" if any("ModuleNotFoundError" in e for e in err) else f"failed: {err[-1:]}"
            continue
        best = min(runs, key=lambda r: float(r[2].split()[0]))
        out[name] = (float(best[2].split()[0]), int(best[2].split()[1]), max(r[1] for r in runs))
    return out


def run_pack(path: Path, out_dir: Path) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of ``treepack pack PATH --capacity 32K -o OUT --quiet``."""
    wall, rss, _ = run_child(TREEPACK, "pack", str(path), "--capacity", "32K", "-o", str(out_dir), "--quiet")
    return wall, rss


# Peak RSS of the interpreter it runs in, printed to stderr at exit. A child's ru_maxrss (wait4,
# RUSAGE_CHILDREN) starts at the RSS of the parent it was spawned from, which here holds the generator's
# data; VmHWM counts only the pages of the new program.
PEAK_RSS = """
import atexit, resource, sys
def _report_peak_rss():
    try:
        with open("/proc/self/status") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    sys.stderr.write(f"\\npeak_rss_kib {kib}\\n")
atexit.register(_report_peak_rss)
"""

# ``treepack stats ARGS`` as ``python -m treepack stats ARGS`` runs it, reporting its peak RSS.
TREEPACK = PEAK_RSS + """
import runpy
sys.argv = ["treepack", *sys.argv[1:]]
runpy.run_module("treepack", run_name="__main__", alter_sys=True)
"""

# The stages of ``treepack stats`` inside one fresh interpreter (run as ``python -c STAGES FILE``).
STAGES = PEAK_RSS + """
import json, time
t0 = time.perf_counter()
import treepack.cli.app  # everything ``treepack stats`` imports before it reads
t1 = time.perf_counter()
from treepack.io.ingest import read_rollouts
from treepack.stats import compute_stats
from treepack.tree import PrefixTree
r = read_rollouts(sys.argv[1], keep_token_fields=False)
t2 = time.perf_counter()
tree = PrefixTree.build(r)
t3 = time.perf_counter()
compute_stats(tree, rollouts=r)
t4 = time.perf_counter()
print(json.dumps({"imports": t1 - t0, "read": t2 - t1, "build": t3 - t2, "stats": t4 - t3}))
"""


def dict_trie_tokens_per_s(path: Path, slice_tokens: int, repeat: int) -> tuple[float, int, int, int]:
    """Build a dict trie over the first ``slice_tokens`` tokens' sequences, best of ``repeat``.

    Returns (tok/s, tokens, trie tokens, sequences).
    """
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
    best = float("inf")
    for _ in range(repeat):
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
        best = min(best, time.perf_counter() - t0)
        del root
    return total / best, total, n_tree, len(seqs)


def build_tokens_per_s(r, repeat: int) -> tuple[float, int]:
    """(tok/s, trie tokens) of ``PrefixTree.build`` from decoded arrays, best of ``repeat``."""
    from treepack.tree import PrefixTree

    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        tree = PrefixTree.build(r)
        best = min(best, time.perf_counter() - t0)
    return r.n_tokens / best, tree.n_tree_tokens


def run_child(code: str, *args: str) -> tuple[float, int, str]:
    """(wall seconds, peak RSS bytes, stdout) of ``python -c CODE ARGS``, CODE starting with PEAK_RSS."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t0
    peak = next(line for line in proc.stderr.splitlines()[::-1] if line.startswith("peak_rss_kib "))
    return wall, int(peak.split()[1]) * 1024, proc.stdout


def run_treepack(path: Path) -> tuple[float, int, dict]:
    """(wall seconds, peak RSS bytes, stats JSON) of ``treepack stats PATH --json --quiet`` in a child."""
    wall, rss, out = run_child(TREEPACK, "stats", str(path), "--json", "--quiet")
    return wall, rss, json.loads(out)


def stage_seconds(path: Path, repeat: int) -> dict[str, float]:
    """Best seconds of each stage of ``treepack stats`` over ``repeat`` fresh interpreters, start included."""
    best: dict[str, float] = {"start": min(run_child(PEAK_RSS)[0] for _ in range(repeat))}
    for _ in range(repeat):
        for stage, seconds in json.loads(run_child(STAGES, str(path))[2]).items():
            best[stage] = min(best.get(stage, float("inf")), seconds)
    return best


def main() -> None:
    from treepack.sizes import parse_size

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="100m", help="tokens in the generated file (default 100m = 100,000,000)")
    ap.add_argument("--kind", default="tau2", help="synth kind (default tau2 with --think)")
    ap.add_argument("--baseline-tokens", default="5m", help="dict-trie slice (default 5m)")
    ap.add_argument("--repeat", type=int, default=5, help="runs of each timing (best is reported)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--parser-tokens", default="20m", help="tokens of the JSONL slice each parser decodes")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    tokens = parse_size(args.tokens, what="--tokens")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{args.kind}-{tokens}.parquet"
        info = generate(path, tokens, args.kind, args.seed)
        n_tokens = info["tokens"]
        print(f"generated {n_tokens:,} tokens, {info['records']:,} records in {info['seconds']:.1f} s "
              f"({path.stat().st_size / 1e6:.0f} MB Parquet)", flush=True)
        load_before = os.getloadavg()
        runs = [run_treepack(path) for _ in range(args.repeat)]
        wall, _, st = min(runs, key=lambda x: x[0])
        rss = max(r[1] for r in runs)
        stages = stage_seconds(path, args.repeat)
        base_tps, base_tokens, base_trie, base_seqs = dict_trie_tokens_per_s(path, parse_size(args.baseline_tokens), 3)
        from treepack.io.ingest import read_rollouts

        decoded = read_rollouts(path, keep_token_fields=False)
        build_tps, _ = build_tokens_per_s(decoded, args.repeat)
        piece = decoded.select(np.arange(base_seqs))
        slice_tps, slice_trie = build_tokens_per_s(piece, 5)
        if slice_trie != base_trie:
            raise SystemExit(f"the tree and the dict trie disagree on the slice: {slice_trie} != {base_trie} tokens")
        del decoded, piece
        from treepack.datasets import synth

        gz = path.with_suffix(".jsonl.gz")
        synth.write(args.kind, info["trees"], gz, seed=args.seed, think=True)
        gz_bytes = gz.stat().st_size
        print(f"wrote the same rollouts as {gz.stat().st_size / 1e6:.0f} MB of JSONL.gz", flush=True)
        jruns = [run_treepack(gz) for _ in range(args.repeat)]
        if jruns[0][2]["n_tree_tokens"] != st["n_tree_tokens"]:
            raise SystemExit("stats of the JSONL.gz and the Parquet copy of the same rollouts differ")
        packs = {fmt: run_pack(src, Path(tmp) / f"packs-{fmt}") for fmt, src in (("parquet", path), ("jsonl.gz", gz))}
        slice_path = Path(tmp) / "slice.jsonl"
        write_jsonl_slice(gz, slice_path, parse_size(args.parser_tokens, what="--parser-tokens"))
        parsers = parser_seconds(slice_path, min(args.repeat, 3))
        load_after = os.getloadavg()
    tps = n_tokens / wall
    budget = n_tokens / (50 * base_tps)  # seconds end to end that 50x the dict trie allows
    fixed = stages["start"] + stages["imports"] + stages["read"]
    rows = {
        "tokens": n_tokens,
        "records": info["records"],
        "compression": st["compression"],
        "wall_s": wall,
        "all_walls_s": [round(r[0], 2) for r in runs],
        "tokens_per_s": tps,
        "peak_rss_bytes": rss,
        "all_peak_rss_bytes": [r[1] for r in runs],
        "rss_over_tokens": rss / (4 * n_tokens),
        "dict_trie_tokens_per_s": base_tps,
        "dict_trie_tokens": base_tokens,
        "speedup": tps / base_tps,
        "build_tokens_per_s": build_tps,
        "build_speedup": build_tps / base_tps,
        "slice_build_tokens_per_s": slice_tps,
        "slice_build_speedup": slice_tps / base_tps,
        "stage_seconds": stages,
        "budget_50x_s": budget,
        "load_average": [round(x, 2) for x in (*load_before, *load_after)],
        "jsonl_gz_bytes": gz_bytes,
        "jsonl_wall_s": min(r[0] for r in jruns),
        "jsonl_all_walls_s": [round(r[0], 2) for r in jruns],
        "jsonl_peak_rss_bytes": max(r[1] for r in jruns),
        "pack_32k": {fmt: {"wall_s": w, "peak_rss_bytes": m} for fmt, (w, m) in packs.items()},
        "parsers": {k: (v if isinstance(v, str) else {"seconds": v[0], "tokens": v[1], "peak_rss_bytes": v[2]})
                    for k, v in parsers.items()},
    }
    token_mib = 4 * n_tokens / 2**20
    budget_mib = 3 * token_mib + 300e6 / 2**20
    from importlib import metadata

    versions_line = versions("numpy", "pyarrow", "polars", "orjson", "msgspec") + f", pysimdjson {metadata.version('pysimdjson')}"
    date = today()
    cmd = "python benchmarks/stats.py " + " ".join(sys.argv[1:])
    walls = ", ".join(f"{w:.2f}" for w in rows["all_walls_s"])
    lines = [
        f"# treepack stats benchmark ({date})",
        "",
        (f"- hardware: {cpu_line()}; load average (1, 5, 15 min) {load_before[0]:.2f},"
         f" {load_before[1]:.2f}, {load_before[2]:.2f} before and {load_after[0]:.2f}, {load_after[1]:.2f},"
         f" {load_after[2]:.2f} after"),
        f"- versions: {versions_line}",
        f"- command: `{cmd.strip()}` (`make bench-stats`)",
        (f"- input: `treepack synth {args.kind} --think` rollouts, seed {args.seed}, written to Parquet:"
         f" {n_tokens:,} tokens, {info['records']:,} records, C = {st['compression']:.2f}"),
        "",
        "| measure | value | target |",
        "|---|---|---|",
        f"| `treepack stats --json` wall time (best of {len(runs)}: {walls}) | {wall:.2f} s | <= 15 s |",
        f"| throughput | {tps / 1e6:.1f}M tokens/s | |",
        f"| dict trie (Python, {base_tokens / 1e6:.1f}M-token slice, pre-decoded lists, best of 3) | {base_tps / 1e6:.2f}M tokens/s | |",
        f"| speedup over the dict trie, end to end | {rows['speedup']:.0f}x | >= 50x |",
        (f"| tree build from decoded arrays, whole file (in-process) | {build_tps / 1e6:.0f}M tokens/s ="
         f" {rows['build_speedup']:.0f}x the dict trie | >= 50x |"),
        (f"| tree build from decoded arrays, the dict trie's slice | {slice_tps / 1e6:.0f}M tokens/s ="
         f" {rows['slice_build_speedup']:.0f}x the dict trie | |"),
        f"| peak RSS (worst of {len(runs)}) | {rss / 2**20:,.0f} MiB = {rows['rss_over_tokens']:.2f}x the raw int32 tokens | <= 3x |",
        "",
        f"## The same rollouts as JSONL.gz ({gz_bytes / 1e6:,.0f} MB)",
        "",
        "| measure | value | target |",
        "|---|---|---|",
        (f"| `treepack stats --json` wall time (best of {len(jruns)}: "
         f"{', '.join(f'{w:.2f}' for w in rows['jsonl_all_walls_s'])}) | {rows['jsonl_wall_s']:.2f} s | <= 15 s |"),
        (f"| peak RSS (worst of {len(jruns)}) | {rows['jsonl_peak_rss_bytes'] / 2**20:,.0f} MiB = "
         f"{rows['jsonl_peak_rss_bytes'] / 2**20 / token_mib:.2f}x the int32 tokens | <= {budget_mib:,.0f} MiB "
         f"(3x + 300 MB) |"),
        *(f"| `treepack pack --capacity 32K`, {fmt} (one run) | {v['wall_s']:.1f} s at "
          f"{v['peak_rss_bytes'] / 2**20:,.0f} MiB ({v['peak_rss_bytes'] / 2**20 / token_mib:.2f}x) | |"
          for fmt, v in rows["pack_32k"].items()),
        "",
        "JSON parsers decoding `input_ids` and `loss_mask` of the first lines of that file (decompressed) into",
        f"numpy arrays, each in a fresh interpreter (best of {min(args.repeat, 3)}):",
        "",
        "| parser | seconds | M tokens/s | peak RSS |",
        "|---|---|---|---|",
        *(f"| {k} | {v} | | |" if isinstance(v, str) else
          f"| {k} | {v[0]:.2f} | {v[1] / v[0] / 1e6:.1f} | {v[2] / 2**20:,.0f} MiB |" for k, v in parsers.items()),
        "",
        "The end-to-end time includes the interpreter start, reading and validating the Parquet file, the tree",
        "build and every statistic; the dict trie is timed on Python lists that are already decoded, and so is",
        "the like-for-like tree build (int32 arrays, from the same file).",
        "",
        textwrap.fill(
            f"Where the end-to-end time goes (each stage's best over {args.repeat} fresh interpreters):"
            f" interpreter start {stages['start']:.2f} s, imports {stages['imports']:.2f} s, Parquet read and"
            f" validation {stages['read']:.2f} s, tree build {stages['build']:.2f} s, stats {stages['stats']:.2f} s."
            f" 50x the dict trie end to end means {budget:.2f} s for the whole run; start, imports and reading"
            f" alone take {fixed:.2f} s.",
            width=105,
        ),
    ]
    report = "\n".join(lines) + "\n"
    print(report)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{date}-stats.md").write_text(report)
    (out / f"{date}-stats.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
