"""``treepack train``: run a TOML config (tree, dense or dfs mode) and print one fixed-format line per step.

Data-parallel: ``treepack train --nproc N config.toml`` launches torchrun on this host (N ranks), the same as
``torchrun --nproc-per-node N -m treepack train config.toml``; under torchrun the command runs
`treepack.train.parallel.train_distributed` and only rank 0 prints (errors too: the ranks fail alike).
``--simulate-ranks N`` rehearses N ranks in this one process (`treepack.train.sync.SimulatedRanks`).
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import typer

from treepack.cli.common import check_choice, console, fail, handle_errors
from treepack.errors import TreepackError

ERROR_GRACE_S = 5.0


@handle_errors
def train(
    config: Path | None = typer.Argument(None, help="Training config (TOML); see --example-config."),
    example_config: bool = typer.Option(False, "--example-config", help="Print a commented config template and exit."),
    size: str = typer.Option("full", "--size", help="With --example-config: full (every key, GPU defaults) or tiny "
                             "(a few steps on a CPU in seconds)."),
    steps: int | None = typer.Option(None, "--steps", help="Override train.steps."),
    output_dir: str | None = typer.Option(None, "--output-dir", "-o", help="Override output.dir."),
    nproc: int | None = typer.Option(None, "--nproc", help="Data-parallel on N processes of this host: launches "
                                     "torchrun (one GPU each on CUDA, gloo on CPU)."),
    simulate_ranks: int | None = typer.Option(None, "--simulate-ranks", help="Rehearse N data-parallel ranks in "
                                              "this one process: their split, each rank's share timed, the plain "
                                              "run's gradients."),
) -> None:
    """Train on packed shards or rollouts: tree attention, DFS, or the dense baseline."""
    from treepack.train.config import EXAMPLE_CONFIGS, load_config

    check_choice(size, EXAMPLE_CONFIGS, "--size")
    if example_config:
        sys.stdout.write(EXAMPLE_CONFIGS[size])
        return
    if size != "full":
        raise typer.BadParameter("only with --example-config", param_hint="--size")
    if config is None:
        raise typer.BadParameter("missing CONFIG (or use --example-config)", param_hint="CONFIG")
    if nproc is not None and nproc < 1:
        raise typer.BadParameter(f"must be >= 1, got {nproc}", param_hint="--nproc")
    if simulate_ranks is not None and simulate_ranks < 1:
        raise typer.BadParameter(f"must be >= 1, got {simulate_ranks}", param_hint="--simulate-ranks")
    distributed = "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ  # started by torchrun
    if simulate_ranks is not None and (nproc is not None or distributed):
        raise typer.BadParameter("runs in one process: not with --nproc or under torchrun",
                                 param_hint="--simulate-ranks")
    cfg = load_config(config)
    if steps is not None:
        if steps < 1:
            raise typer.BadParameter("must be >= 1", param_hint="--steps")
        cfg.train.steps = steps
    if output_dir is not None:
        if not output_dir.strip():  # Path("") is ".": the run would land in the working directory
            raise typer.BadParameter("must not be empty", param_hint="--output-dir")
        cfg.output.dir = output_dir

    if nproc is not None and not distributed:
        from treepack.train.parallel import launch  # imports torch

        raise typer.Exit(launch(nproc, _forwarded_args()))
    if distributed:
        from treepack.train.parallel import train_distributed as run_training
    elif simulate_ranks is not None:
        from functools import partial

        from treepack.train.loop import resolve_precision
        from treepack.train.loop import train as plain
        from treepack.train.sync import SimulatedRanks

        device = resolve_precision(cfg.train.device, cfg.train.dtype)[0]
        run_training = partial(plain, sync=SimulatedRanks(device, cfg.train.mode, simulate_ranks, cfg.train.balance))
    else:
        from treepack.train.loop import train as run_training  # imports torch
    rank = os.environ.get("RANK", "0")
    try:
        result = run_training(cfg, log=lambda line: console.print(line, markup=False))
    except TreepackError as exc:
        if rank == "0":
            raise
        # Config and data errors hit every rank alike and rank 0 prints them (torchrun stops this rank
        # meanwhile); an error of this rank alone is printed after that grace period.
        time.sleep(ERROR_GRACE_S)
        raise fail(f"rank {rank}: {exc}") from None
    except RuntimeError as exc:
        if not (distributed and _group_broke(exc)):
            raise
        # another rank failed alone (out of memory, its data) and printed why; this one only lost its peers
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        first = re.sub(r"^\[[^\]]*\]\s*", "", first).split(". ")[0]  # gloo's "[source.cc:553] Connection closed..."
        raise fail(f"rank {rank}: stopped, its process group broken by another rank's failure ({first})") from None
    if rank != "0":
        return
    if result.first_step > result.last_step:
        # the step the checkpoint holds, which may be past train.steps (a run resumed with fewer steps)
        console.print(f"nothing to do: {result.output_dir} already holds step {result.first_step - 1}", markup=False)
    elif cfg.output.save_final:
        console.print(f"saved {result.output_dir / 'checkpoint'} (step {result.last_step})", markup=False)


def _group_broke(exc: RuntimeError) -> bool:
    """Whether ``exc`` is a collective's failure when a peer rank went away (gloo / NCCL / the store)."""
    import torch.distributed as dist

    text = str(exc)
    return isinstance(exc, dist.DistError) or any(s in text for s in ("Connection closed by peer", "[gloo", "NCCL"))


def _forwarded_args() -> list[str]:
    """The command line as given (``train ...``) without ``--nproc``: what each launched rank runs."""
    argv = sys.argv[1:]
    argv = argv[argv.index("train"):] if "train" in argv else ["train", *argv]
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out
