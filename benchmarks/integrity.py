"""Benchmark pack verification: what checking shards against their manifest costs, next to reading them.

Every reader verifies a pack directory (`treepack.pack.integrity`): the manifest's fields and counts, each
shard's size and sha256 (its bytes read once, hashed, then parsed from memory), the Parquet page checksums
as pages decode, rows, records, tokens and pack order. This script times, on the same directory, in one run:
1. ``unpack`` (what stats / plot / report / unpack of a pack directory run) and ``read_packs`` (what train,
   verify and treepack.hf run), each verified as shipped and with every check turned off (the shard read
   from its file by Parquet directly, nothing hashed, no page checksums, no counts), the two alternating;
2. ``check_packs`` (``treepack check``) alone.
The target: verification <= 5% of a read.

Usage: python benchmarks/integrity.py [--trees 8] [--capacity 32K] [--repeats 31] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from common import command_line, cpu_model, today, versions, write_report  # benchmarks/ is on sys.path


@contextmanager
def unverified():
    """The readers with every integrity check off: the baseline a read costs without verification."""

    import treepack.pack.shard_reader as reader
    from treepack.pack import integrity

    saved = (reader.open_shard, reader.check_manifest, reader.unlisted_shards, integrity.ShardCheck.rows)
    reader.open_shard = lambda path, e: integrity.OpenShard(path / e.file, None, None)
    reader.check_manifest = lambda m, f: integrity._shard_entries(integrity._Fields(f), m, 1)
    reader.unlisted_shards = lambda path, shards: None
    integrity.ShardCheck.rows = lambda self, *a: None
    try:
        yield
    finally:
        reader.open_shard, reader.check_manifest, reader.unlisted_shards, integrity.ShardCheck.rows = saved


def timed(fn) -> float:
    """CPU seconds of this process (every thread) in ``fn``: what the work costs, whatever else the machine runs
    (wall times on the shared 2-core machine varied 2x between identical runs)."""
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def paired(fn, repeats: int) -> dict[str, float]:
    """Minimum CPU and wall seconds of ``fn`` unverified and verified, the two alternating so that a busy
    machine slows both alike."""
    runs: dict[str, list[float]] = {"cpu_plain": [], "wall_plain": [], "cpu_verified": [], "wall_verified": []}
    for _ in range(repeats):
        for kind in ("plain", "verified"):
            w0, c0 = time.perf_counter(), time.process_time()
            if kind == "plain":
                with unverified():
                    fn()
            else:
                fn()
            runs[f"cpu_{kind}"].append(time.process_time() - c0)
            runs[f"wall_{kind}"].append(time.perf_counter() - w0)
    return {k: min(v) for k, v in runs.items()}


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trees", type=int, default=8, help="synthetic tau2 --think trees")
    ap.add_argument("--capacity", default="32K")
    ap.add_argument("--shard-size", default="64M")
    ap.add_argument("--repeats", type=int, default=31)
    ap.add_argument("--out", type=Path, default=None, help="folder for the dated markdown report")
    args = ap.parse_args(argv)

    import pyarrow as pa
    import pyarrow.parquet as pq

    from treepack.datasets import synth
    from treepack.io.ingest import read_rollouts
    from treepack.pack.shard_reader import check_packs, read_manifest, read_packs, unpack
    from treepack.pack.shards import write_shards
    from treepack.pack.strategies import pack_sequences

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "tau2.jsonl.gz"
        synth.write("tau2", args.trees, src, seed=0, think=True)
        r = read_rollouts(src, keep_records=True)
        pk = Path(tmp) / "pk"
        m = write_shards(r, pack_sequences(r, args.capacity), pk, shard_size=args.shard_size)
        size = sum(s["bytes"] for s in m["shards"])
        what = (f"{len(r):,} records, {r.n_tokens:,} tokens (synth tau2 --think, {args.trees} trees), "
                f"{m['counts']['packs']:,} packs at {args.capacity} in {len(m['shards'])} shard(s), "
                f"{size / 2**20:.1f} MiB")
        print(what)
        rows = []
        for name, fn in (("unpack (stats, plot, report, unpack)", lambda: unpack(pk)),
                         ("read_packs (train, verify, treepack.hf)", lambda: sum(1 for _ in read_packs(pk)))):
            fn()  # warm the page cache and imports
            t = paired(fn, args.repeats)
            rows.append((name, t))
            print(f"{name}: CPU {t['cpu_plain']:.3f} s unverified, {t['cpu_verified']:.3f} s verified "
                  f"({t['cpu_verified'] / t['cpu_plain'] - 1:+.1%}); wall {t['wall_plain']:.3f} / "
                  f"{t['wall_verified']:.3f} s ({t['wall_verified'] / t['wall_plain'] - 1:+.1%})")
        data = b"".join((pk / s["file"]).read_bytes() for s in m["shards"])
        sha = min(timed(lambda: hashlib.sha256(data).hexdigest()) for _ in range(args.repeats))
        crc_off, crc_on = [], []
        blobs = [(pk / s["file"]).read_bytes() for s in m["shards"]]
        cols = [n for n in pq.read_schema(pk / m["shards"][0]["file"]).names if n not in ("seq_carry", "seq_record")
                and not n.startswith("extra:")]  # what read_packs decodes
        for _ in range(3 * args.repeats):  # decoded with and without page checksums, alternating
            for check_pages, out in ((False, crc_off), (True, crc_on)):
                out.append(sum(timed(lambda b=b, c=check_pages: pq.ParquetFile(
                    pa.BufferReader(b), page_checksum_verification=c).read(columns=cols)) for b in blobs))
        crc = max(0.0, min(crc_on) - min(crc_off))
        manifest = min(timed(lambda: read_manifest(pk)) for _ in range(args.repeats))
        check = min(timed(lambda: check_packs(pk)) for _ in range(args.repeats))
        print(f"sha256 of the shards: {sha * 1e3:.1f} ms; page checksums: {crc * 1e3:.1f} ms; manifest checks: "
              f"{manifest * 1e3:.2f} ms; check_packs: {check * 1e3:.1f} ms")
        parts = sha + crc + manifest

    lines = [f"# Pack integrity: verification cost ({today()})", "",
             f"Machine: {os.cpu_count()}-core CPU ({cpu_model()}). Versions: {versions('treepack', 'pyarrow', 'numpy')}.",
             f"Command: `{command_line('benchmarks/integrity.py', argv)}`", "", f"Data: {what}.", "",
             (f"Minimum of {args.repeats} runs each, verified and unverified alternating in one process, page "
              "cache warm (the machine is shared: wall times of identical runs varied 2x, so the least disturbed "
              "run is the figure). CPU = seconds of the process, all threads: what the work costs; wall = what "
              "a user waits (the sha256 runs on a second thread while Parquet decodes). Unverified = every check "
              "off (Parquet reads the file itself; no sha256, no page checksums, no manifest or count checks)."),
             "",
             "| reader | CPU unverified | CPU verified | CPU cost | wall unverified | wall verified | wall cost |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, t in rows:
        lines.append(f"| {name} | {t['cpu_plain']:.3f} s | {t['cpu_verified']:.3f} s | "
                     f"{t['cpu_verified'] / t['cpu_plain'] - 1:+.1%} | {t['wall_plain']:.3f} s | "
                     f"{t['wall_verified']:.3f} s | {t['wall_verified'] / t['wall_plain'] - 1:+.1%} |")
    lines += ["", (f"The checks alone, CPU: sha256 of "
                   f"every shard byte {sha * 1e3:.1f} ms ({size / sha / 1e6:,.0f} MB/s), page checksums "
                   f"{crc * 1e3:.1f} ms (min CPU of decoding read_packs' columns with them less without), the manifest's "
                   f"fields, counts and digest {manifest * 1e3:.2f} ms: {parts * 1e3:.1f} ms in all, "
                   + ", ".join(f"{parts / t['cpu_plain']:.1%} of {name.split(' (')[0]}" for name, t in rows)
                   + f" (CPU, unverified). `check_packs` (`treepack check`: the manifest, sizes, sha256 and three "
                   f"small columns per shard) {check * 1e3:.1f} ms."),
              ""]
    write_report(None if args.out is None else args.out / f"{today()}-pack-integrity.md", "\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1:])
