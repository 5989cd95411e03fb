"""``treepack plot``: one figure of rollout files (tree, active, packs, hist) as PNG, SVG or PDF."""

from __future__ import annotations

from pathlib import Path

import typer

from treepack.cli.common import check_choice, console, err_console, handle_errors
from treepack.cli.inputs import (
    MAX_DPI,
    ON_ERROR,
    Inputs,
    check_dpi,
    reads_inputs,
    report_oversize,
    report_skipped_records,
    size_option,
)
from treepack.pack.strategies import OVERSIZE, STRATEGIES, pack_sequences
from treepack.tree import PrefixTree
from treepack.viz.options import DEFAULT_DPI, FORMATS, KINDS, MAX_TREE_NODES


def check_output(path: Path, param: str = "--output") -> None:
    """Usage error (exit 2) before any work when the output format is not one matplotlib writes here."""
    if path.suffix.lower().lstrip(".") not in FORMATS:
        raise typer.BadParameter(f"{path.name!r}: the file name must end in .png, .svg or .pdf", param_hint=param)


@handle_errors
@reads_inputs(quiet="No progress bar, no 'wrote' line.")
def plot(
    output: Path = typer.Option(..., "--output", "-o", help="Figure file: .png, .svg or .pdf."),
    kind: str = typer.Option("tree", "--kind", "-k", help=f"Figure: {', '.join(KINDS)}."),
    group: str | None = typer.Option(None, "--group", help="tree: the tree_id to draw (default: the one saving most tokens)."),
    group_by: str = typer.Option("none", "--group-by", help="Sharing scope: none (whole input) or tree_id."),
    capacity: str | None = typer.Option(None, "--capacity", help="packs: tokens per pack (60k, 32K, 65536)."),
    strategy: str = typer.Option("best", "--strategy", help=f"packs: packing strategy ({', '.join(STRATEGIES)})."),
    oversize: str = typer.Option("error", "--oversize", help="packs: sequences longer than the capacity: error or skip."),
    max_nodes: int = typer.Option(MAX_TREE_NODES, "--max-nodes", help="tree: summarise trees with more nodes than this."),
    dpi: int = typer.Option(DEFAULT_DPI, "--dpi", help=f"Resolution of PNG output (dots per inch, 10 to {MAX_DPI})."),
    inputs: Inputs = None,
) -> None:
    """Draw a figure: the prefix tree of a group, active sequences by position, pack fill, or histograms."""
    check_choice(kind, KINDS, "--kind")
    check_output(output)
    check_choice(group_by, ("none", "tree_id"), "--group-by")
    check_choice(inputs.on_error, ON_ERROR, "--on-error")
    check_choice(strategy, STRATEGIES, "--strategy")
    check_choice(oversize, OVERSIZE, "--oversize")
    if kind == "packs" and capacity is None:
        raise typer.BadParameter("--kind packs needs --capacity", param_hint="--capacity")
    for flag, value, default, only in (("--capacity", capacity, None, "packs"), ("--strategy", strategy, "best", "packs"),
                                       ("--oversize", oversize, "error", "packs"), ("--group", group, None, "tree"),
                                       ("--max-nodes", max_nodes, MAX_TREE_NODES, "tree")):
        if value != default and kind != only:  # an option of another figure would be ignored without a word
            raise typer.BadParameter(f"applies to --kind {only} only, not {kind}", param_hint=flag)
    if max_nodes < 2:
        raise typer.BadParameter("must be at least 2", param_hint="--max-nodes")
    check_dpi(dpi)
    cap = size_option(capacity, "--capacity", "capacity") if capacity is not None else None

    rollouts = inputs.read("sequences to plot", inputs.chat())
    report_skipped_records(rollouts)
    tree = PrefixTree.build(rollouts, group_by=group_by)
    packing = None
    if kind == "packs":
        packing = pack_sequences(rollouts, cap, strategy=strategy, group_by=group_by, oversize=oversize, tree=tree)
        report_oversize(rollouts, packing)
    from treepack.viz.plots import figure, save, source_label

    fig = figure(kind, rollouts, tree=tree, group_by=group_by, group=group, packing=packing,
                 source=source_label(inputs.files), max_nodes=max_nodes)
    path = save(fig, output, dpi=dpi)
    if not inputs.quiet:
        w, h = fig.get_size_inches()
        size = f" ({round(w * dpi)} x {round(h * dpi)} px)" if path.suffix.lower() == ".png" else ""
        console.print(f"wrote {path}{size}", markup=False)


def write_stats_figures(plot_dir: Path, rollouts, tree: PrefixTree, *, group_by: str, files: list[str],
                        packing=None, quiet: bool = False) -> None:
    """``treepack stats --plot DIR``: the standard set (tree, active, hist; packs with the stats' packing)."""
    from treepack.viz.plots import source_label, write_figures

    paths = write_figures(plot_dir, rollouts, tree=tree, group_by=group_by, packing=packing,
                          source=source_label(files))
    if not quiet:
        err_console.print(f"wrote {len(paths)} figures to {plot_dir}: " + ", ".join(p.name for p in paths), markup=False)
