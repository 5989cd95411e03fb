"""``treepack stats``: prefix-sharing numbers of rollout files, and a CI data-quality gate."""

from __future__ import annotations

import json
import math
from pathlib import Path

import typer
from rich.table import Table

from treepack.cli.common import check_choice, console, err_console, handle_errors, nothing_read
from treepack.cli.inputs import ON_ERROR, TOKENIZER_HELP, Inputs, reads_inputs, report_oversize, size_option
from treepack.errors import TreepackError
from treepack.io.rollouts import Rollouts
from treepack.pack.shard_reader import pack_dir_of
from treepack.pack.strategies import OVERSIZE, STRATEGIES, pack_sequences
from treepack.pack.strategies import compare_strategies as compare_strategies_of
from treepack.stats import DEFAULT_MODEL, MODEL_SHAPES, Gate, TreeStats, compute_stats
from treepack.tree import PrefixTree


def render_stats(st: TreeStats, *, title: str) -> None:
    t = Table(title=title, title_justify="left", show_header=True, header_style="bold")
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_column("meaning", style="dim")
    for row in st.rows():
        t.add_row(*row)
    console.print(t)

    if st.branching:
        b = Table(title="branching (children per internal node)", title_justify="left", header_style="bold")
        b.add_column("children", justify="right")
        b.add_column("nodes", justify="right")
        b.add_column("share", justify="right")
        total = sum(st.branching.values())
        items = sorted(st.branching.items())
        shown = [(str(k), v) for k, v in items if k <= 8]
        rest = sum(v for k, v in items if k > 8)
        if rest:
            shown.append((f"9-{st.max_branching}" if st.max_branching > 9 else "9", rest))
        for k, v in shown:
            b.add_row(k, f"{v:,}", f"{v / total:.1%}")
        console.print(b)

    if st.groups:
        g = Table(title=f"top {len(st.groups)} scopes by saved tokens", title_justify="left", header_style="bold")
        for name, justify in (("scope", "left"), ("sequences", "right"), ("N_flat", "right"), ("N_tree", "right"),
                              ("C", "right"), ("saved", "right")):
            g.add_column(name, justify=justify)
        for gs in st.groups:
            g.add_row(str(gs.group), f"{gs.n_sequences:,}", f"{gs.n_flat_tokens:,}", f"{gs.n_tree_tokens:,}",
                      f"{gs.compression:.2f}", f"{gs.saved_tokens:,}")
        console.print(g)


def render_strategies(strategies: dict, st: TreeStats) -> None:
    """Every packing strategy side by side at the stats' capacity."""
    t = Table(title=f"packing strategies at capacity {st.capacity:,} (POR {st.por:.4f} is the bound)",
              title_justify="left", header_style="bold")
    for name, justify in (("strategy", "left"), ("packs", "right"), ("N_pack", "right"), ("ERR", "right"),
                          ("ERR speedup", "right"), ("time", "right")):
        t.add_column(name, justify=justify)
    for name, p in strategies.items():
        if isinstance(p, str):
            t.add_row(name, "-", "-", "-", "-", "-")
            continue
        t.add_row(name, f"{p.n_packs:,}", f"{p.n_pack_tokens:,}", f"{p.err:.4f}",
                  f"{1 / (1 - p.err):.2f}x" if p.err < 1 else "inf", f"{p.seconds:.2f}s")
    console.print(t)
    for name, p in strategies.items():
        if isinstance(p, str):
            console.print(f"{name}: {p}", markup=False, style="dim")


@handle_errors
@reads_inputs(quiet="No progress bar.", tokenizer=TOKENIZER_HELP + " Adds the drift report.")
def stats(
    inputs: Inputs = None,
    group_by: str = typer.Option("none", "--group-by", help="Sharing scope: none (whole input) or tree_id."),
    model: str = typer.Option(DEFAULT_MODEL, "--model", help=f"Model shape for the FLOP model: {', '.join(MODEL_SHAPES)}."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of tables."),
    top: int = typer.Option(10, "--top", min=0, help="Scopes shown in the per-scope summary."),
    min_compression: float | None = typer.Option(None, "--min-compression", help="Gate: fail below this C."),
    min_por: float | None = typer.Option(None, "--min-por", help="Gate: fail below this POR."),
    max_seq_len: str | None = typer.Option(None, "--max-seq-len", help="Gate: fail if a sequence is longer (32K, 32768)."),
    capacity: str | None = typer.Option(None, "--capacity", help="Also pack at this capacity (60k, 64K, 1M or tokens): packs, N_pack, ERR."),
    strategy: str = typer.Option("best", "--strategy", help=f"Packing strategy for --capacity: {', '.join(STRATEGIES)}."),
    min_err: float | None = typer.Option(None, "--min-err", help="Gate: fail below this ERR (needs --capacity)."),
    compare_strategies: bool = typer.Option(False, "--compare-strategies", help="With --capacity: ERR, packs and time of every strategy side by side."),
    oversize: str = typer.Option("error", "--oversize", help="With --capacity, a sequence longer than it: error or skip."),
    plot_dir: Path | None = typer.Option(None, "--plot", help="Also write the figures (tree, active, hist, packs) as PNGs into this directory."),
) -> None:
    """Compression rate C, POR, C_leaf, C_attn and the shape of the prefix trees; exit 1 if a gate fails."""
    check_choice(inputs.on_error, ON_ERROR, "--on-error")
    check_choice(group_by, ("none", "tree_id"), "--group-by")
    if model not in MODEL_SHAPES:
        raise typer.BadParameter(f"unknown model {model!r}; known: {', '.join(MODEL_SHAPES)}", param_hint="--model")
    cap = None
    if capacity is not None:

        cap = size_option(capacity, "--capacity", "capacity")
    seq_len_limit = None if max_seq_len is None else size_option(max_seq_len, "--max-seq-len", "--max-seq-len")
    check_choice(strategy, STRATEGIES, "--strategy")
    check_choice(oversize, OVERSIZE, "--oversize")
    for flag, value, low, high in (("--min-compression", min_compression, 1.0, math.inf), ("--min-por", min_por, 0.0, 1.0),
                                   ("--min-err", min_err, 0.0, 1.0)):
        if value is not None and not low <= value <= high:  # nan too: a gate that can never pass
            raise typer.BadParameter(f"must be in [{low:g}, {high:g}], got {value:g}", param_hint=flag)
    for flag, value in (("--min-err", min_err), ("--compare-strategies", compare_strategies or None)):
        if value is not None and cap is None:
            raise typer.BadParameter("needs --capacity", param_hint=flag)
    # stats (and its packing and figures) read tokens and loss masks: log-probs are validated, not kept
    chat = inputs.chat()
    files, quiet = inputs.files, inputs.quiet
    drift = None
    if chat is None:
        rollouts = inputs.load(keep_token_fields=False)
    else:  # chat transcripts: the records as tokenize makes them, and the drift report
        from treepack.cli.chat_inputs import drift_summary, load_chats, rendering

        recs = load_chats(files, inputs.tokenizer, chat, on_error=inputs.on_error, quiet=quiet, consistent=True)
        rollouts, drift = recs.rollouts, drift_summary(recs)
        drift["rendering"] = rendering(inputs.tokenizer, chat)  # what made these records: --json says how to redo them
    if len(rollouts) == 0:
        raise nothing_read(files, "sequences to analyse", rollouts)
    tree = PrefixTree.build(rollouts, group_by=group_by)
    st = compute_stats(tree, rollouts=rollouts, model=model, top_groups=top)
    strategies = None
    if cap is not None:
        if compare_strategies:
            strategies = compare_strategies_of(rollouts, cap, group_by=group_by, oversize=oversize, tree=tree)
            p = strategies[strategy]
            if isinstance(p, str):
                raise TreepackError(p)
        else:
            p = pack_sequences(rollouts, cap, strategy=strategy, group_by=group_by, oversize=oversize, tree=tree)
        st.capacity, st.strategy, st.n_packs, st.n_pack_tokens, st.err = cap, strategy, p.n_packs, p.n_pack_tokens, p.err
        st.err_speedup = 1.0 / (1.0 - p.err) if p.err < 1 else float("inf")
        st.n_oversize_skipped = p.n_oversize_skipped
        st.n_packed_flat_tokens = p.n_flat_tokens
        if p.n_oversize_skipped:
            report_oversize(rollouts, p)
    gate = Gate(min_compression=min_compression, min_por=min_por, min_err=min_err, max_seq_len=seq_len_limit)
    if plot_dir is not None:  # before the gate, so a failing CI run still leaves its figures
        from treepack.cli.plot import write_stats_figures  # matplotlib is imported only when asked for

        write_stats_figures(plot_dir, rollouts, tree, group_by=group_by, files=files,
                            packing=p if cap is not None else None, quiet=quiet)
    emit(st, gate, files=files, as_json=as_json, skipped_examples=rollouts.skipped_examples, strategies=strategies,
         drift=drift, notes=input_notes(rollouts, files))


def input_notes(r: Rollouts, files: list[str]) -> dict:
    """What ``--json`` says about the input besides the stats: files not read, repeated ids, pack directory."""
    packs = pack_dir_of(files[0]) if len(files) == 1 else None
    return {"skipped_files": [{"path": p, "reason": why} for p, why in r.skipped_files],
            "n_duplicate_ids": r.n_duplicate_ids, "pack_directory": None if packs is None else str(packs)}


def emit(st: TreeStats, gate: Gate, *, files: list[str], as_json: bool, skipped_examples: list[str],
         strategies: dict | None = None, drift: dict | None = None, notes: dict | None = None) -> None:
    """Print the stats (tables or JSON), the skipped-record report, and apply the gate."""
    failures = gate.check(st)
    if as_json:
        d = st.to_dict()
        d.update(notes or {})
        if strategies is not None:
            d["strategies"] = {name: ({"error": p} if isinstance(p, str) else
                                      {"n_packs": p.n_packs, "n_pack_tokens": p.n_pack_tokens, "err": p.err,
                                       "seconds": p.seconds}) for name, p in strategies.items()}
        if drift is not None:
            d["drift"] = drift
        d["gate"] = {"passed": not failures, "failures": failures}
        console.file.write(json.dumps(d) + "\n")
    else:
        names = ", ".join(Path(f).name if f != "-" else "<stdin>" for f in files[:3]) + (" ..." if len(files) > 3 else "")
        packed = " (the records this pack directory was packed from)" if (notes or {}).get("pack_directory") else ""
        render_stats(st, title=f"treepack stats: {names}{packed}")
        if strategies is not None:
            render_strategies(strategies, st)
        if drift is not None:
            from treepack.cli.chat_inputs import render_drift

            render_drift(drift, examples=False)
    if st.n_skipped:
        reasons = ", ".join(f"{v} {k}" for k, v in sorted(st.skipped.items(), key=lambda kv: -kv[1]))
        err_console.print(f"skipped {st.n_skipped} bad record(s): {reasons}", markup=False)
        for ex in skipped_examples:
            err_console.print(f"  {ex}", markup=False)
    if failures:
        for f in failures:
            err_console.print(f"gate failed: {f}", markup=False)
        raise typer.Exit(1)
    if not as_json and any(v is not None for v in vars(gate).values()):
        console.print("gate passed", markup=False)
