"""``treepack check PACKS...``: verify pack directories as every reader does, without reading their packs.

Each directory gets one line: ``ok`` with what was verified on stdout, or ``Error: <shard>: <what differs>``
on stderr; the exit code is 1 when any failed (every directory is still checked). It reads the shards'
bytes once (sha256) and three small columns of each (counts, pack order): 5 ms of CPU for 4.4M tokens of
tau2 in 32 packs, where ``unpack`` takes 155 ms.
"""

from __future__ import annotations

import sys

import typer

from treepack.cli.common import console, handle_errors
from treepack.errors import TreepackError
from treepack.pack.shard_reader import check_packs


@handle_errors
def check(
    packs: list[str] = typer.Argument(..., help="Directories written by `treepack pack` (or their manifest.json)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Only errors; the exit code says the rest."),
) -> None:
    """Verify packed shards against their manifest: sizes, sha256, page checksums, rows, records, tokens, pack order."""
    failed = 0
    for path in packs:
        try:
            s = check_packs(path)
        except TreepackError as exc:
            sys.stderr.write(f"Error: {exc}\n")
            sys.stderr.flush()
            failed += 1
            continue
        if quiet:
            continue
        what = ("sizes, sha256, rows, records, tokens and pack order match the manifest" if s["sha256"] else
                f"sizes, rows, page checksums and pack order match the manifest (schema version "
                f"{s['schema_version']}: written before sha256s)")
        counts = ", ".join(_count(s[key], noun) for key, noun in
                           (("shards", "shard"), ("packs", "pack"), ("records", "record"), ("tokens", "token"),
                            ("bytes", "byte")))
        console.print(f"{s['path']}: ok: {counts}: {what}", markup=False)
    if failed:
        raise typer.Exit(1)


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"
