"""``treepack report``: one self-contained HTML file (stats, packing comparison, figures) for CI artifacts."""

from __future__ import annotations

from pathlib import Path

import typer

from treepack.cli.common import check_choice, console, handle_errors
from treepack.cli.inputs import (
    MAX_DPI,
    ON_ERROR,
    Inputs,
    check_dpi,
    reads_inputs,
    report_skipped_records,
    size_option,
)
from treepack.pack.strategies import OVERSIZE
from treepack.stats import DEFAULT_MODEL, MODEL_SHAPES
from treepack.viz.options import DEFAULT_DPI, REPORT_DPI
from treepack.viz.options import REPORT_CAPACITY as DEFAULT_CAPACITY


@handle_errors
@reads_inputs(quiet="No progress bar, no 'wrote' line.")
def report(
    output: Path = typer.Option(..., "--output", "-o", help="HTML file to write."),
    capacity: str = typer.Option(str(DEFAULT_CAPACITY), "--capacity", help="Pack capacity for the strategy comparison (32K)."),
    no_packing: bool = typer.Option(False, "--no-packing", help="Leave the packing comparison out."),
    oversize: str = typer.Option("skip", "--oversize", help="Sequences longer than the capacity: skip (count them) or error."),
    group_by: str = typer.Option("none", "--group-by", help="Sharing scope: none (whole input) or tree_id."),
    model: str = typer.Option(DEFAULT_MODEL, "--model", help=f"Model shape for the FLOP model: {', '.join(MODEL_SHAPES)}."),
    dpi: int = typer.Option(REPORT_DPI, "--dpi", help=f"Resolution of the embedded figures, 10 to {MAX_DPI} (plot's default: {DEFAULT_DPI})."),
    inputs: Inputs = None,
) -> None:
    """Write an HTML report: stats tables, every packing strategy at one capacity, and the figures."""
    if output.suffix.lower() not in (".html", ".htm"):
        raise typer.BadParameter(f"{output.name!r}: the file name must end in .html", param_hint="--output")
    check_choice(group_by, ("none", "tree_id"), "--group-by")
    check_choice(inputs.on_error, ON_ERROR, "--on-error")
    check_choice(oversize, OVERSIZE, "--oversize")
    if model not in MODEL_SHAPES:
        raise typer.BadParameter(f"unknown model {model!r}; known: {', '.join(MODEL_SHAPES)}", param_hint="--model")
    check_dpi(dpi)
    cap = None if no_packing else size_option(capacity, "--capacity", "capacity")
    chat = inputs.chat()
    rollouts = inputs.read("sequences to report on", chat)
    report_skipped_records(rollouts)
    output.parent.mkdir(parents=True, exist_ok=True)
    from treepack.viz.report import write_report

    rendered = None
    if chat is not None:
        from treepack.cli.chat_inputs import rendering

        rendered = rendering(inputs.tokenizer, chat)
    n_bytes = write_report(output, rollouts, files=inputs.files, group_by=group_by, capacity=cap, oversize=oversize,
                           model=model, dpi=dpi, rendering=rendered)
    if not inputs.quiet:
        console.print(f"wrote {output} ({n_bytes / 1024:,.0f} kB)", markup=False)
