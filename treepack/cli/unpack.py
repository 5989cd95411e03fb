"""``treepack unpack``: packed shards -> the original rollout records, exactly, in input order."""

from __future__ import annotations

from pathlib import Path

import typer

from treepack.cli.common import check_stdout, err_console, handle_errors, whole_stdout_writes
from treepack.io.records import write_rollouts
from treepack.pack.shard_reader import pack_dir_of, read_inputs, read_manifest


@handle_errors
def unpack(
    directory: str = typer.Argument(..., help="A directory written by `treepack pack`."),
    output: str = typer.Option(..., "--output", "-o", help="Output file: .jsonl, .jsonl.gz, .parquet, or - for JSONL on stdout."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No summary line."),
) -> None:
    """Rebuild every packed record (tokens, loss_mask, id, tree_id, step, advantage, reward, logprobs) from the shards."""
    if not (output == "-" or output.endswith((".jsonl", ".jsonl.gz", ".parquet", ".pq"))):
        raise typer.BadParameter(f"{output!r}: expected a .jsonl, .jsonl.gz or .parquet file, or -", param_hint="--output")
    check_stdout(output)
    packs = pack_dir_of(directory)  # the directory, or its manifest.json
    if packs is None:
        read_manifest(directory)  # raises, naming what is missing
    if output != "-" and Path(output).resolve().parent == Path(packs).resolve():
        raise typer.BadParameter(f"{output!r}: write it outside the pack directory {packs} (a file there can "
                                 "replace one of its shards)", param_hint="--output")
    r = read_inputs(str(packs), keep_records=True)  # every packed record, and the count of those not packed
    with whole_stdout_writes():  # -o - into `| head`: a quiet end, not a summary of a cut-short output
        as_text = write_rollouts(r, output)
    if not quiet:
        where = "<stdout>" if output == "-" else output
        err_console.print(f"wrote {len(r):,} records ({r.n_tokens:,} tokens) to {where}", markup=False)
    if as_text:  # said even with --quiet: these values are not back exactly
        kinds = ", ".join(f"{kind}: {n:,}" for kind, n in as_text.most_common())
        err_console.print(f"written as text: {sum(as_text.values()):,} value(s) JSON has no type for ({kinds}); "
                          "unpack to .parquet keeps them exact", markup=False)
    if r.n_skipped:  # records of the input that `pack` left out: not in the packs, so not written
        reasons = ", ".join(f"{v:,} {k}" for k, v in r.skipped.most_common())
        err_console.print(f"not written: {r.n_skipped:,} input record(s) that pack left out: {reasons}", markup=False)
