"""``treepack verify``: run the training modes on the same packs; exit 1 unless they agree with the baseline.

Progress goes to stderr once the packs are loaded: a bar naming the (mode, pack) run in progress on a
terminal, otherwise one line as each run starts (logs of remote jobs), so a long check is never silent.
Bad input still fails with the one ``Error:`` line before any progress is printed.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import typer
from rich import box
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from treepack.cli.common import check_choice, console, err_console, handle_errors
from treepack.cli.inputs import report_skipped_files, size_option
from treepack.errors import TreepackError
from treepack.kernels.tree_attention import registry
from treepack.train.config import DfsConfig

DFS = DfsConfig()  # the dfs options' defaults: training's [train.dfs]


def plural(n: int, word: str) -> str:
    return f"{n:,} {word}{'s' if n != 1 else ''}"


def counted(n: int, total: int | None, word: str) -> str:
    """``1 pack``, ``8 sequences``, or what was left out: ``1 of 29 packs``, ``8 of 256 sequences``."""
    return plural(n, word) if total is None or total == n else f"{n:,} of {plural(total, word)}"


def render(report, packs_total: int | None = None, sequences_total: int | None = None) -> None:
    packs = counted(report.packs, packs_total, "pack")
    if packs_total is not None and packs_total != report.packs:
        packs += f" (--packs {report.packs})"
    t = Table(title=f"treepack verify: {packs}, {counted(report.sequences, sequences_total, 'sequence')}, "
                    f"{report.dtype}, {report.loss_kind} loss", title_justify="left", header_style="bold",
              box=box.SIMPLE_HEAD)
    for name, justify in (("mode", "left"), ("loss", "right"), ("Δgrad max", "right"), ("Δgrad mean", "right"),
                          ("Δlogp max", "right")):
        t.add_column(name, justify=justify)
    if report.dtype != "float64":
        t.add_column("err vs ref", justify="right")
    for name, m in report.modes.items():
        baseline = name == report.baseline
        row = [
            name,
            "error" if m.error else f"{m.loss:.9g}",
            *("baseline" if baseline else ("-" if v is None else f"{v:.2e}")
              for v in (m.max_rel_grad_diff, m.mean_rel_grad_diff, m.max_logprob_diff)),
        ]
        if report.dtype != "float64":
            row.append("-" if m.ref_rel_grad_diff is None else f"{m.ref_rel_grad_diff:.2e}")
        t.add_row(*row)
    console.print(t)
    b = report.baseline
    console.print(f"Δgrad: max |g_mode - g_{b}| / max |g_{b}| per parameter (max and mean over parameters and "
                  f"packs); Δlogp: |logp_mode - logp_{b}| over (sequence, token) rows", markup=False, style="dim")
    console.print("forwarded: " + ", ".join(f"{k} {m.forward_tokens:,} tokens in {m.seconds:.1f} s"
                                            for k, m in report.modes.items()), markup=False)
    for name, m in report.modes.items():
        w = m.work
        if "anchor_share" in w:
            console.print(f"{name}: {w['grad_tokens']:,} tokens forwarded with grad, {w['anchor_tokens']:,} without "
                          f"(anchors, {w['anchor_share']:.1%}), {w['backward_tokens']:,} back-propagated, "
                          f"{w['pruned_tokens']:,} pruned; peak live graph {w['peak_graph_tokens']:,} tokens, "
                          f"K/V cache {w['kv_rows']:,} rows; {w['model_calls']:,} model calls", markup=False)
    console.print(f"tree tokens {report.tree_tokens:,} | flat tokens {report.flat_tokens:,} | "
                  f"loss tokens {report.loss_tokens:,} | vocab {report.vocab}"
                  + (f" | advantages {report.advantages}" if report.loss_kind == "grpo" else ""), markup=False)
    n = report.layout_problem_count
    paths = "yes" if n == 0 else f"NO ({n:,} problem{'s' if n != 1 else ''})"
    console.print(f"layout (paths = parent chains, subtree_end, positions, scale, loss_weight): {paths}",
                  markup=False)
    for p in report.layout_problems:
        console.print(f"  {p}", markup=False)
    worst = max((m for k, m in report.modes.items() if k != b and m.max_rel_grad_diff is not None),
                key=lambda m: m.max_rel_grad_diff, default=None)
    if report.ok:
        tol = (f"{report.tolerance:g} relative" if report.dtype == "float64"
               else f"2x the {b} run's error vs the reference")
        console.print(f"OK: every mode matches {b} within {tol}"
                      + (f" (worst: {worst.worst_param})" if worst and worst.worst_param else ""), markup=False)
    else:
        for f in report.failures:
            console.print(f"FAIL: {f}", markup=False)


class Reporter:
    """Progress on stderr: a bar on a terminal, else one line per stage (what runs now, time so far)."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.live = not quiet and err_console.is_terminal
        self.t0 = time.perf_counter()
        self.bar: Progress | None = None
        self.task = None

    def stage(self, text: str) -> None:
        if not self.quiet:
            err_console.print(f"verify: {text} ({time.perf_counter() - self.t0:.1f} s)", markup=False,
                              style="dim" if self.live else None)

    def start(self) -> None:
        if self.live:
            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), console=err_console, transient=True)
            self.bar.start()
            self.task = self.bar.add_task("verifying", total=None)

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()

    def __call__(self, done: int, total: int, label: str) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=done, total=total, description=f"verifying {label}")
        elif label != "done":
            self.stage(f"[{done + 1}/{total}] {label}")
        else:
            self.stage(f"{total} runs done")


def load(source: list[str], capacity: int, packs: int) -> tuple[list, int | None, int | None, list]:
    """(the first ``packs`` packs (0: all), packs in all, sequences in all, files a directory held that were not
    read). Rollout files are packed as ``treepack pack`` packs them by default (`PACK_STRATEGY`, one forest over
    the whole input, packs never crossing a ``step``), so the packs, their order and the counts are those of its
    shards at the same capacity; only the packs verified are laid out. A pack directory's manifest counts its
    own (None when it does not). The files not read are named on stderr here, as stats and plot name them."""
    import numpy as np

    from treepack.errors import CapacityError
    from treepack.pack.layout import build_pack
    from treepack.pack.shard_reader import read_manifest
    from treepack.pack.strategies import describe_sequence, pack_sequences
    from treepack.train.data import load_packs, read_rollout_files
    from treepack.tree import scope_codes

    paths = [Path(s) for s in source]
    if len(paths) == 1 and paths[0].is_dir() and (paths[0] / "manifest.json").is_file():  # as load_packs sees it
        pack_list = load_packs(source, capacity=capacity, max_packs=packs or None)
        counts = read_manifest(paths[0]).get("counts", {})
        return pack_list, counts.get("packs"), counts.get("packed_sequences"), []
    r = read_rollout_files(paths)
    report_skipped_files(r)
    lengths = r.lengths
    too_long = np.flatnonzero(lengths > capacity)
    if too_long.size:  # pack's message without its hint: verify has no --oversize
        i = int(too_long[0])
        raise CapacityError(f"{describe_sequence(r, i)} has {int(lengths[i])} tokens, more than the capacity {capacity}")
    packing = pack_sequences(r, capacity, strategy=PACK_STRATEGY)
    scope, _ = scope_codes(r)  # as write_shards lays out pack's packs: steps apart, tree_ids shared
    kept = packing.packs[:packs] if packs else packing.packs  # the packs after the first N are counted, not built
    return ([build_pack(r, index, scope=scope) for index in kept], packing.n_packs,
            sum(len(index) for index in packing.packs), r.skipped_files)


PACK_STRATEGY = "best"  # `treepack pack`'s default --strategy: verify checks the packs pack would write


def check_kernel(attention: str, config: Path | None, cfg, device: str, dtype: str) -> None:
    """Usage error (exit 2) before any work when the tree kernel named cannot run on this device in this dtype
    for the model's head shape, with its backward (the registry's reason): flex, triton or fa4 on a CPU, fa4 in
    float64, ..."""
    if attention == "auto":
        return
    import torch

    from treepack.train.architecture import ModelArgs
    from treepack.train.verify import DTYPES, tiny_model_args

    if config is None:
        args = tiny_model_args(2)
    elif cfg.model.checkpoint:
        try:
            hf = json.loads((Path(cfg.model.checkpoint) / "config.json").read_text())
            args = ModelArgs.from_hf_config(hf)
        except (OSError, ValueError, TreepackError):  # loading the checkpoint names what is wrong with it
            return
    else:
        args = SimpleNamespace(num_heads=cfg.model.num_heads, head_dim=cfg.model.head_dim)
    call = registry.AttentionCall(torch.device(device), DTYPES[dtype], args.num_heads, args.head_dim, grad=True)
    reason = registry.unsupported_reason("tree", attention, call)
    if reason is not None:
        raise typer.BadParameter(f"{attention!r} cannot run here: {reason}", param_hint="--attention")


@handle_errors
def verify(
    source: list[str] = typer.Argument(..., metavar="SHARDS_DIR", help="Packed shards directory, or rollout files (.jsonl, .jsonl.gz, .parquet) packed at --capacity as treepack pack packs them."),
    config: Path | None = typer.Option(None, "--config", help="Training config whose [model] to use (default: a tiny random model on the CPU)."),
    modes: str = typer.Option("dense,tree", "--modes", help="Comma-separated modes (tree, dense, dense-leaf, dfs, auto); the baseline always runs."),
    baseline: str = typer.Option("dense", "--baseline", help="Mode the others are compared with: dense | dense-leaf (same check, fewer tokens)."),
    dtype: str = typer.Option("float64", "--dtype", help="float64 | float32 | bfloat16 | float16."),
    loss: str = typer.Option("sft", "--loss", help="sft | grpo (advantages from the data, else synthetic)."),
    normalization: str = typer.Option("token", "--normalization", help="token | sequence."),
    packs: int = typer.Option(1, "--packs", help="Verify the first N packs (0 = all)."),
    capacity: str = typer.Option("16k", "--capacity", help="Pack capacity when packing rollout files (as treepack pack --capacity)."),
    attention: str = typer.Option("auto", "--attention", help=f"Tree kernel: {' | '.join(registry.names('tree'))}."),
    device: str = typer.Option("cpu", "--device", help="cpu | cuda."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random model (and of synthetic advantages)."),
    micro_batch_tokens: str = typer.Option("0", "--micro-batch-tokens", help="dense modes: most tokens forwarded at once (0 = each pack's size)."),
    dfs_block_size: str = typer.Option(DFS.block_size, "--dfs-block-size", help="dfs: most tokens forwarded with grad at once: tokens (8192, 8K), 0 = unlimited, or auto (as [train.dfs] block_size)."),
    dfs_keep_tokens: str = typer.Option(str(DFS.keep_tokens), "--dfs-keep-tokens", help="dfs: shared segments kept with their graph instead of re-forwarded: tokens (4096, 4K), 0 = off (as [train.dfs] keep_tokens)."),
    dfs_walk: bool = typer.Option(not DFS.subtree_calls, "--dfs-walk", help="dfs: walk leaf by leaf (AReaL-DTA) instead of one call per subtree that fits a block (as [train.dfs] subtree_calls = false)."),
    compile_: bool = typer.Option(False, "--compile", help="Run the compiled (torch.compile) regions as training on CUDA does (needs --device cuda and a dtype below float64); slower to start."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of tables."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress on stderr."),
) -> None:
    """Loss, gradients and log-probs of every mode against the baseline on the same packs; exit 1 if they differ."""
    from treepack.train.losses import NORMALIZATIONS
    from treepack.train.modes import MODES

    if packs < 0:
        raise typer.BadParameter("must be >= 0", param_hint="--packs")
    mode_list = tuple(m.strip() for m in modes.split(",") if m.strip())
    for m in mode_list:
        check_choice(m, MODES, "--modes")
    if not [m for m in mode_list if m != baseline]:  # the baseline alone compares nothing, yet would print OK
        raise typer.BadParameter(f"name at least one mode to compare with the baseline ({baseline}), got {modes!r}",
                                 param_hint="--modes")
    cap = size_option(capacity, "--capacity", "capacity")
    micro = (size_option(micro_batch_tokens, "--micro-batch-tokens", "micro-batch tokens")
             if micro_batch_tokens.strip() != "0" else 0)
    reporter = Reporter(quiet or as_json)

    import torch

    from treepack.errors import ConfigError
    from treepack.train.config import load_config, parse_dfs_block, parse_dfs_keep
    from treepack.train.data import compact_vocab
    from treepack.train.model import Decoder
    from treepack.train.modes import make_mode
    from treepack.train.verify import BASELINES, DTYPES, verify_packs

    try:
        block = parse_dfs_block(dfs_block_size, "--dfs-block-size")
    except ConfigError as exc:
        raise typer.BadParameter(str(exc).removeprefix("--dfs-block-size "), param_hint="--dfs-block-size") from None
    try:
        keep = parse_dfs_keep(dfs_keep_tokens, "--dfs-keep-tokens")
    except ConfigError as exc:
        raise typer.BadParameter(str(exc).removeprefix("--dfs-keep-tokens "), param_hint="--dfs-keep-tokens") from None
    dfs = DfsConfig(block_size=block, keep_tokens=keep, subtree_calls=not dfs_walk)
    mode_options = {"dfs": dfs, "micro_batch_tokens": str(micro) if micro else ""}
    for m in mode_list:
        make_mode(m, **mode_options)  # unknown modes and bad options fail here, before any work
    check_choice(baseline, BASELINES, "--baseline")
    check_choice(dtype, DTYPES, "--dtype")
    check_choice(attention, registry.names("tree"), "--attention")
    check_choice(device, ("cpu", "cuda"), "--device")
    if device == "cuda" and not torch.cuda.is_available():
        raise typer.BadParameter("CUDA is not available", param_hint="--device")
    # --compile compiles what training compiles (train.compile = "auto": on CUDA, below float64); anywhere else
    # it would change nothing, so it is refused here, as a tree kernel that cannot run is
    if compile_ and device != "cuda":
        where = "needs --device cuda" if torch.cuda.is_available() else "CUDA is not available"
        raise typer.BadParameter(f"{where} (training compiles on CUDA only)", param_hint="--compile")
    if compile_ and dtype == "float64":
        raise typer.BadParameter("needs --dtype float32, bfloat16 or float16 (training compiles nothing in float64)",
                                 param_hint="--compile")
    if loss not in ("sft", "grpo"):
        raise typer.BadParameter("must be sft or grpo", param_hint="--loss")
    check_choice(normalization, NORMALIZATIONS, "--normalization")

    cfg = load_config(config) if config is not None else None
    check_kernel(attention, config, cfg, device, dtype)
    try:
        pack_list, packs_total, sequences_total, skipped_files = load(source, cap, packs)
    except TreepackError as exc:  # e.g. a shard whose parent chains are broken: still a verdict for --json
        if as_json:
            print(json.dumps({"ok": False, "error": str(exc)}))
        raise
    reporter.stage(f"{counted(len(pack_list), packs_total, 'pack')} "
                   f"({sum(int(p.n_real) for p in pack_list):,} tree tokens) from {', '.join(source)}")
    model = None
    if config is not None:
        if cfg.model.compact_vocab and not cfg.model.checkpoint:
            pack_list, _ = compact_vocab(pack_list)
        if cfg.model.checkpoint:
            model = Decoder.from_pretrained(cfg.model.checkpoint, dtype=torch.float64)
        else:
            from treepack.train.loop import build_model

            model = build_model(cfg, pack_list, torch.device("cpu"), torch.float64)

    reporter.start()
    try:
        report = verify_packs(pack_list, modes=mode_list, dtype=dtype, loss=loss, normalization=normalization,
                              model=model, attention=attention, device=device, seed=seed, progress=reporter,
                              mode_options=mode_options, baseline=baseline, compile=compile_)
    finally:
        reporter.stop()
    if as_json:
        print(json.dumps({**report.to_json(), "packs_total": packs_total, "sequences_total": sequences_total,
                          "skipped_files": [{"path": p, "reason": why} for p, why in skipped_files]}))
    else:
        render(report, packs_total, sequences_total)
    if not report.ok:
        raise typer.Exit(1)
