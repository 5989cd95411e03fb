"""``treepack pack``: rollouts -> capacity-bounded prefix-tree packs as Parquet shards + manifest.json."""

from __future__ import annotations

import contextlib
import shlex
import time
from pathlib import Path

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from treepack.cli.common import (
    check_choice,
    check_output_path,
    console,
    err_console,
    handle_errors,
)
from treepack.cli.inputs import (
    ON_ERROR,
    Inputs,
    reads_inputs,
    report_oversize,
    report_skipped_records,
    size_option,
)
from treepack.errors import InputError, TreepackError
from treepack.pack.balance import BALANCE_COSTS
from treepack.pack.shards import DEFAULT_SHARD_SIZE, check_output_dir, parse_shard_size, write_shards
from treepack.pack.strategies import OVERSIZE, STRATEGIES, pack_sequences
from treepack.stats import DEFAULT_MODEL, MODEL_SHAPES, compute_stats
from treepack.tree import PrefixTree

PROGRESS_MIN_PACKS = 200  # show the shard-writing progress bar from this many packs
PROGRESS_MIN_TOKENS = 20_000_000  # show a spinner while packing inputs this big


def _status(message: str, hidden: bool):
    """A transient spinner on stderr (nothing when ``hidden`` or when stderr is not a terminal)."""
    return contextlib.nullcontext() if hidden else err_console.status(message)


@handle_errors
@reads_inputs(quiet="No progress bars.")
def pack(
    capacity: str = typer.Option(..., "--capacity", "-c", help="Max tokens per pack: 60k (=60,000), 64K (=65,536), 1M or an integer."),
    output: str = typer.Option(..., "--output", "-o", help="Output directory for the shards and manifest.json."),
    strategy: str = typer.Option("best", "--strategy", help=f"Packing strategy: {', '.join(STRATEGIES)}."),
    pad_to: int | None = typer.Option(None, "--pad-to", help="Pad each pack to a multiple of this (e.g. 128 for block masks); packs then hold at most capacity rounded down to it."),
    shard_size: str = typer.Option(DEFAULT_SHARD_SIZE, "--shard-size", help="Cut shards by size (256M: uncompressed bytes, files come out smaller) or count (1000packs)."),
    balance: int | None = typer.Option(None, "--balance", help="Assign packs to K data-parallel ranks: contiguous runs per step minimising the max cost."),
    balance_cost: str = typer.Option("tokens", "--balance-cost", help=f"Cost balanced by --balance: {', '.join(BALANCE_COSTS)}."),
    model: str = typer.Option(DEFAULT_MODEL, "--model", help=f"Model shape for --balance-cost flops: {', '.join(MODEL_SHAPES)}."),
    oversize: str = typer.Option("error", "--oversize", help="A sequence longer than the capacity: error (default) or skip (drop and count)."),
    group_by: str = typer.Option("none", "--group-by", help="Sharing scope: none (whole input) or tree_id."),
    inputs: Inputs = None,
) -> None:
    """Pack rollouts into prefix-tree packs of at most --capacity tokens: Parquet shards + manifest.json."""
    cap = size_option(capacity, "--capacity", "capacity")
    check_choice(strategy, STRATEGIES, "--strategy")
    check_choice(oversize, OVERSIZE, "--oversize")
    check_choice(group_by, ("none", "tree_id"), "--group-by")
    check_choice(balance_cost, BALANCE_COSTS, "--balance-cost")
    check_choice(inputs.on_error, ON_ERROR, "--on-error")
    check_choice(model, MODEL_SHAPES, "--model")
    if pad_to is not None and pad_to <= 0:
        raise typer.BadParameter(f"must be positive, got {pad_to}", param_hint="--pad-to")
    if balance is not None and balance <= 0:
        raise typer.BadParameter(f"must be positive, got {balance}", param_hint="--balance")
    if balance is None and balance_cost != "tokens":
        raise typer.BadParameter("needs --balance (the cost it balances packs by)", param_hint="--balance-cost")
    try:
        parse_shard_size(shard_size)
    except TreepackError as exc:
        raise typer.BadParameter(str(exc), param_hint="--shard-size") from None
    pack_cap = cap if pad_to is None else cap // pad_to * pad_to
    if pack_cap <= 0:
        raise typer.BadParameter(f"--pad-to {pad_to} is larger than the capacity {cap:,}", param_hint="--pad-to")
    chat = inputs.chat()
    files, quiet = inputs.files, inputs.quiet
    if output == "-":
        raise typer.BadParameter("pack writes a directory of shards, not a stream: name one", param_hint="--output")
    check_output_path(output, files, inside_inputs=True)  # the readers skip a pack directory
    out = Path(output)
    check_output_dir(out)  # before the work, not after it

    t0 = time.perf_counter()
    rollouts = inputs.read("sequences to pack", chat, keep_records=True)
    t_read = time.perf_counter() - t0
    with _status(f"packing {rollouts.n_tokens:,} tokens ({strategy})", quiet or rollouts.n_tokens < PROGRESS_MIN_TOKENS):
        tree = PrefixTree.build(rollouts, group_by=group_by)
        st = compute_stats(tree, rollouts=rollouts, model=model, top_groups=0)
        p = pack_sequences(rollouts, pack_cap, strategy=strategy, group_by=group_by, oversize=oversize, tree=tree)
    t_pack = time.perf_counter() - t0 - t_read
    if p.n_packs == 0:
        raise InputError(f"no sequence fits the capacity {pack_cap:,}: all {p.n_oversize_skipped:,} are longer")
    options = {"--capacity": capacity, "-o": output, "--strategy": strategy, "--pad-to": pad_to,
               "--shard-size": shard_size, "--balance": balance, "--balance-cost": balance_cost, "--model": model,
               "--oversize": oversize, "--group-by": group_by,
               **inputs.command_line()}  # --template-arg: a list, the option once per value
    defaults = {"--strategy": "best", "--shard-size": DEFAULT_SHARD_SIZE, "--balance-cost": "tokens",
                "--model": DEFAULT_MODEL, "--oversize": "error", "--group-by": "none", **Inputs.DEFAULTS}
    command = " ".join(["treepack pack", *map(_quote, files)] + [
        k if x is True else f"{k} {_quote(str(x))}" for k, v in options.items() if v is not None and defaults.get(k) != v
        for x in (v if isinstance(v, list) else [v])])
    kwargs = {"pad_to": pad_to, "shard_size": shard_size, "balance": balance, "balance_cost": balance_cost,
              "model": model, "group_by": group_by, "stats": st, "command": command, "rendering": None}
    if chat is not None:  # the tokenizer (and a hash of its files) and options that made the records
        from treepack.cli.chat_inputs import rendering

        kwargs["rendering"] = rendering(inputs.tokenizer, chat)
    if quiet or p.n_packs < PROGRESS_MIN_PACKS:
        manifest = write_shards(rollouts, p, out, **kwargs)
    else:
        with Progress(TextColumn("writing packs"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                      console=err_console, transient=True) as bar:
            task = bar.add_task("write", total=p.n_packs)
            manifest = write_shards(rollouts, p, out, progress=lambda n: bar.advance(task, n), **kwargs)
    t_write = time.perf_counter() - t0 - t_read - t_pack
    report_oversize(rollouts, p)
    report_skipped_records(rollouts)  # the count by reason, then the first few bad records (as stats)
    _summary(manifest, cap, out, (t_read, t_pack, t_write))


def _quote(arg: str) -> str:
    """``arg`` as a POSIX shell reads it back: the manifest's command re-runs as written."""
    return shlex.quote(arg)


def _summary(m: dict, requested: int, out: Path, times: tuple[float, float, float]) -> None:
    s = m["stats"]
    c = m["counts"]
    t = Table(title=f"treepack pack -> {out}", title_justify="left", header_style="bold")
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_column("meaning", style="dim")
    rows = [
        ("sequences", f"{c['packed_sequences']:,}", f"of {c['records']:,} records read"
         + (f"; {c['oversize_skipped']:,} over capacity skipped" if c["oversize_skipped"] else "")
         + (f"; {c['skipped']:,} bad records skipped" if c.get("skipped") else "")),
        ("N_flat", f"{s['packed_flat_tokens']:,}", "tokens a dense trainer computes"),
        ("N_tree", f"{s['packed_tree_tokens']:,}", "tokens in the prefix trie (the lower bound)"),
        ("POR", f"{s['packed_por']:.4f}", "1 - N_tree / N_flat"),
        ("capacity", f"{m['capacity']:,}", f"tokens per pack incl. padding; strategy {m['strategy']}"
         + (f"; --capacity {requested:,} rounded down to a multiple of --pad-to {m['pad_to']}"
            if m["capacity"] != requested else "")),
        ("packs", f"{c['packs']:,}", f"mean fill {s['fill']:.1%}"),
        ("N_pack", f"{s['n_pack_tokens']:,}", "tokens over all packs (padding excluded)"),
        ("ERR", f"{s['err']:.4f}", "1 - N_pack / N_flat"),
        ("ERR speedup", f"{s['err_speedup']:.2f}x", "1 / (1 - ERR)"),
    ]
    if m["pad_to"]:
        rows.append(("padding", f"{s['padding_tokens']:,}", "tokens added for block alignment"))
    if m["balance"]:
        b = m["balance"]
        worst = max(x["imbalance"] for x in b["steps"])
        rows.append(("balance", f"{worst:.3f}", f"max / mean {b['cost']} over {b['k']} ranks, worst step"))
    n_bytes = sum(f["bytes"] for f in m["shards"])
    rows += [
        ("shards", f"{c['shards']:,}", f"{n_bytes / 2**20:,.1f} MiB + manifest.json"),
        ("time", f"{sum(times):.1f}s", f"read {times[0]:.1f}s, tree + pack {times[1]:.1f}s, write {times[2]:.1f}s"),
    ]
    for row in rows:
        t.add_row(*row)
    console.print(t)
