"""``treepack report``: one self-contained HTML file (stats, packing comparison, figures) for CI artifacts."""

from __future__ import annotations

from pathlib import Path

import typer

from treepack.cli.common import Render, check_choice, console, handle_errors, nothing_read
from treepack.cli.inputs import (
    KEEP_PREFIX_HELP,
    MAX_DPI,
    TOKENIZER_HELP,
    chat_input,
    check_dpi,
    load_with_progress,
    report_skipped_records,
    size_option,
)
from treepack.pack.strategies import OVERSIZE
from treepack.stats import DEFAULT_MODEL, MODEL_SHAPES
from treepack.viz.options import DEFAULT_DPI, REPORT_DPI
from treepack.viz.options import REPORT_CAPACITY as DEFAULT_CAPACITY


@handle_errors
def report(
    ctx: typer.Context,
    files: list[str] = typer.Argument(..., help="Rollout files: .jsonl, .jsonl.gz, .parquet, a directory, or - for stdin."),
    output: Path = typer.Option(..., "--output", "-o", help="HTML file to write."),
    capacity: str = typer.Option(str(DEFAULT_CAPACITY), "--capacity", help="Pack capacity for the strategy comparison (32K)."),
    no_packing: bool = typer.Option(False, "--no-packing", help="Leave the packing comparison out."),
    oversize: str = typer.Option("skip", "--oversize", help="Sequences longer than the capacity: skip (count them) or error."),
    group_by: str = typer.Option("none", "--group-by", help="Sharing scope: none (whole input) or tree_id."),
    model: str = typer.Option(DEFAULT_MODEL, "--model", help=f"Model shape for the FLOP model: {', '.join(MODEL_SHAPES)}."),
    dpi: int = typer.Option(REPORT_DPI, "--dpi", help=f"Resolution of the embedded figures, 10 to {MAX_DPI} (plot's default: {DEFAULT_DPI})."),
    tokens_field: str | None = typer.Option(None, "--tokens-field", help="Column holding the token ids."),
    tokenizer: Path | None = typer.Option(None, "--tokenizer", help=TOKENIZER_HELP),
    keep_prefix_tokens: bool = typer.Option(False, "--keep-prefix-tokens", help=KEEP_PREFIX_HELP),
    turns: str = Render.turns,
    reasoning: str = Render.reasoning,
    no_system: bool = Render.no_system,
    no_tools: bool = Render.no_tools,
    template_arg: list[str] = Render.template_arg,
    on_error: str = typer.Option("raise", "--on-error", help="raise: stop at the first bad record; skip: count and skip."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar, no 'wrote' line."),
) -> None:
    """Write an HTML report: stats tables, every packing strategy at one capacity, and the figures."""
    if output.suffix.lower() not in (".html", ".htm"):
        raise typer.BadParameter(f"{output.name!r}: the file name must end in .html", param_hint="--output")
    check_choice(group_by, ("none", "tree_id"), "--group-by")
    check_choice(on_error, ("raise", "skip"), "--on-error")
    check_choice(oversize, OVERSIZE, "--oversize")
    if model not in MODEL_SHAPES:
        raise typer.BadParameter(f"unknown model {model!r}; known: {', '.join(MODEL_SHAPES)}", param_hint="--model")
    check_dpi(dpi)
    cap = None if no_packing else size_option(capacity, "--capacity", "capacity")
    chat = chat_input(tokenizer, keep_prefix_tokens, tokens_field, ctx, turns=turns, reasoning=reasoning,
                      no_system=no_system, no_tools=no_tools, template_arg=template_arg)
    rollouts = load_with_progress(files, tokens_field=tokens_field, on_error=on_error, quiet=quiet,
                                  tokenizer=tokenizer, chat=chat)
    if len(rollouts) == 0:
        raise nothing_read(files, "sequences to report on", rollouts)
    report_skipped_records(rollouts)
    output.parent.mkdir(parents=True, exist_ok=True)
    from treepack.viz.report import write_report

    rendered = None
    if chat is not None:
        from treepack.cli.chat_inputs import rendering

        rendered = rendering(tokenizer, chat)
    n_bytes = write_report(output, rollouts, files=files, group_by=group_by, capacity=cap, oversize=oversize,
                           model=model, dpi=dpi, rendering=rendered)
    if not quiet:
        console.print(f"wrote {output} ({n_bytes / 1024:,.0f} kB)", markup=False)
