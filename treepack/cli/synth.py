"""``treepack synth``: write seeded synthetic rollouts with the tree shapes of real RL workloads.

Thin: options become a ``SynthConfig`` (``treepack.datasets.synth``), which streams record batches to
the file; a progress bar on a terminal, then one summary line on stderr.
"""

from __future__ import annotations

import math
import sys
from enum import Enum

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from treepack.cli.common import (
    check_output_path,
    check_stdout,
    err_console,
    handle_errors,
    whole_stdout_writes,
)
from treepack.datasets import synth as lib
from treepack.datasets.writer import output_format
from treepack.errors import TreepackError
from treepack.sizes import parse_size


class Kind(str, Enum):
    tau2 = "tau2"
    grpo_math = "grpo-math"
    agentic_think = "agentic-think"
    low_overlap = "low-overlap"
    swe = "swe"


def _settings(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key.strip():
            raise typer.BadParameter(f"expected key=value, got {pair!r}", param_hint="--set")
        out[key.strip()] = value.strip()
    return out


@handle_errors
def synth(
    kind: Kind = typer.Argument(..., help="Shape preset (see treepack.datasets.synth).", show_default=False),
    output: str = typer.Option(..., "-o", "--output", help="File .jsonl, .jsonl.gz, .parquet; - = stdout."),
    n: int = typer.Option(8, "-n", "--trees", min=1, help="Trees: tasks (prompts), each a group of samples."),
    seed: int = typer.Option(0, "--seed", min=0, help="Random seed: the same seed gives the same bytes."),
    think: bool | None = typer.Option(
        None, "--think/--no-think", show_default=False,
        help="Open each turn with <think>...</think>, dropped from later turns' context [default: per kind].",
    ),
    logprobs: bool = typer.Option(False, "--logprobs", help="Add per-token behaviour log-probs."),
    steps: int | None = typer.Option(None, "--steps", min=1, help="Add a step column: K consecutive steps."),
    group_size: int | None = typer.Option(None, "--group-size", "-g", min=1, help="Samples per task."),
    turns: float | None = typer.Option(None, "--turns", min=1, help="Median assistant turns per sample."),
    system_tokens: int | None = typer.Option(None, "--system-tokens", min=0, help="Shared prompt; 0 = none."),
    max_len: str | None = typer.Option(None, "--max-len", help="Context limit, e.g. 16K."),
    vocab: int | None = typer.Option(None, "--vocab", min=64, max=2**31, help="Vocabulary [default: 151669]."),
    settings: list[str] | None = typer.Option(
        None, "--set", help="Any config field, key=value: --set response.median=120 --set fork_prob=0.2."
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar, no summary line."),
) -> None:
    """Write synthetic rollouts (one record per assistant turn) with realistic prefix-tree shapes."""
    try:
        output_format(output)
    except TreepackError as exc:
        raise typer.BadParameter(str(exc), param_hint="--output") from None
    check_output_path(output)
    check_stdout(output)
    if turns is not None and not math.isfinite(turns):
        raise typer.BadParameter(f"must be a finite number, got {turns}", param_hint="--turns")
    if steps is not None and steps > n:
        raise typer.BadParameter(f"{steps} steps need at least as many trees, got -n {n} (a tree is in one step)",
                                 param_hint="--steps")
    cfg = lib.preset(kind.value)
    overrides: dict[str, object] = {"logprobs": logprobs, "steps": steps}
    given = {"think": think, "group_size": group_size, "system_tokens": system_tokens, "vocab": vocab}
    overrides.update({name: value for name, value in given.items() if value is not None})
    if turns is not None:
        overrides["turns"] = cfg.turns.with_median(turns)
    if max_len is not None:
        try:
            overrides["max_len"] = parse_size(max_len, what="--max-len")
        except TreepackError as exc:
            raise typer.BadParameter(str(exc), param_hint="--max-len") from None
    cfg = lib.configure(lib.configure(cfg, overrides), _settings(settings or []))

    show_bar = not quiet and output != "-" and err_console.is_terminal
    with Progress(TextColumn(f"synth {kind.value}"), BarColumn(), MofNCompleteColumn(), TextColumn("trees"),
                  TimeRemainingColumn(), console=err_console, transient=True, disable=not show_bar) as bar:
        task = bar.add_task("trees", total=n)
        with whole_stdout_writes():  # -o - into `| head -c 100`: a quiet end, not a summary of a cut-short output
            res = lib.write(cfg, n, output, seed=seed, progress=lambda done: bar.update(task, completed=done))
    if not quiet:
        where = "stdout" if output == "-" else output
        rate = res.tokens / max(res.seconds, 1e-9)
        sys.stderr.write(
            f"synth {kind.value}: {_count(res.trees, 'tree')}, {_count(res.records, 'record')}, "
            f"{_count(res.tokens, 'token')} "
            f"-> {where} ({res.seconds:.1f} s, {_si(rate)} tokens/s)\n"
        )
    if res.samples < res.samples_asked:  # said even with --quiet: these samples are not in the file
        sys.stderr.write(
            f"left out: {res.samples_asked - res.samples:,} of {res.samples_asked:,} samples, whose first turn does "
            f"not fit max_len = {cfg.max_len:,} tokens ({res.trees - res.trees_written:,} trees without any); "
            "their groups' advantages are over the samples written\n"
        )


def _count(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def _si(x: float) -> str:
    """1234567 -> '1.2M', 45600 -> '45.6k'."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.0f}"
