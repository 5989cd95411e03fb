"""Where a run's step numbers go besides the step line: ``metrics.jsonl``, TensorBoard, Weights & Biases.

- ``metrics.jsonl`` (``output.metrics``, on by default): one JSON record per step, every number of the step
  (`treepack.train.metrics.StepStats.to_json`, the data-parallel figures per rank included). A resumed run
  drops the lines of steps after its checkpoint first (a run killed after its last save had logged steps it now
  runs again), so each step is in the file once.
- TensorBoard (``output.tensorboard = true``; needs the ``tensorboard`` package): the same numbers as scalars
  under ``<output.dir>/tensorboard`` (`tags`: ``train/loss``, ``train/lr``, ``speed/tok_per_s``, ``speed/mfu``,
  ``memory/peak_gb``, ``balance/imbalance_measured``, ``rank/load_measured/<r>``, ...), written through
  ``torch.utils.tensorboard`` and flushed every step. A resumed run purges the events of steps after its
  checkpoint (``purge_step``); a run that starts over removes the old event files. Open it with
  ``tensorboard --logdir runs/train/tensorboard`` (or ``--logdir runs`` to compare runs).
- Weights & Biases (``output.wandb = true``; needs ``wandb``): offline, in ``<output.dir>/wandb``, the same
  tags, the config as the run's config; ``wandb sync`` uploads it later. A resumed run continues the same W&B run
  (its id is kept in ``<output.dir>/wandb/run-id``).

Only rank 0 of a data-parallel run writes (the numbers are over all ranks already). A requested logger whose
package is missing stops the run before its model is built (`check_run_log`), never silently.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import secrets
from pathlib import Path

from treepack.errors import ConfigError

# metrics.jsonl key -> TensorBoard / W&B tag (keys not listed: "extra/<key>"; "step" is the x axis)
TAGS = {
    "loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
    "tok_per_s": "speed/tok_per_s", "flat_tok_per_s": "speed/flat_tok_per_s", "mfu": "speed/mfu",
    "seconds": "speed/step_seconds", "mem_gb": "memory/peak_gb",
    "tokens": "data/tokens", "flat_tokens": "data/flat_tokens", "loss_tokens": "data/loss_tokens",
    "imbalance_predicted": "balance/imbalance_predicted", "imbalance_measured": "balance/imbalance_measured",
    "idle_fraction": "balance/idle_fraction", "split_packs": "balance/split_packs", "world_size": "balance/world_size",
    "cut_tokens": "balance/cut_tokens", "cut_cost": "balance/cut_cost",
}
TENSORBOARD_DIR = "tensorboard"
WANDB_DIR = "wandb"


def tags(record: dict) -> dict[str, float]:
    """A step's ``metrics.jsonl`` record as the flat scalars TensorBoard and W&B get: `TAGS`' names, per-rank lists
    as ``rank/<name>/<r>`` plus each rank's load over the mean (``rank/load_measured/<r>`` from its compute seconds,
    ``rank/load_predicted/<r>`` from its predicted cost: 1.0 is a perfectly balanced rank), other numbers as
    ``extra/<key>``."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key == "step":
            continue
        if isinstance(value, list):
            name = key.removeprefix("rank_")
            for r, v in enumerate(value):
                out[f"rank/{name}/{r}"] = float(v)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[TAGS.get(key, f"extra/{key}")] = float(value)
    for key, name in (("rank_seconds", "load_measured"), ("rank_cost", "load_predicted")):
        values = record.get(key)
        if values:
            mean = sum(values) / len(values)
            for r, v in enumerate(values):
                out[f"rank/{name}/{r}"] = float(v) / mean if mean > 0 else 1.0
    return {k: v for k, v in out.items() if math.isfinite(v)}


def check_run_log(output) -> None:
    """Refuse, before any work, a logger the config asks for whose package is not installed."""
    for on, package, key in ((output.tensorboard, "tensorboard", "output.tensorboard"),
                             (output.wandb, "wandb", "output.wandb")):
        if on and importlib.util.find_spec(package) is None:
            raise ConfigError(f"{key} = true needs the {package} package (pip install {package}), "
                              "which is not installed")


def open_metrics(path: Path, start: int):
    """``metrics.jsonl`` opened for appending the steps after ``start`` (0: a new file). Lines of later steps
    are dropped first: a run that stopped after its last checkpoint had logged steps it now runs again."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not start:
        return open(path, "w")
    if path.is_file():
        lines = path.read_text().splitlines(keepends=True)
        kept = [line for line in lines if _logged_step(line) <= start]
        if len(kept) < len(lines):
            path.write_text("".join(kept))
    return open(path, "a")


def _logged_step(line: str) -> float:
    """The step of one metrics line; a line cut short by a killed run counts as past every checkpoint."""
    try:
        return json.loads(line).get("step", 0)
    except ValueError:
        return math.inf


class RunLog:
    """The run's loggers, opened for the steps after ``start``; `write` each step's `StepStats`, `close` at the
    end. ``enabled`` False (ranks other than 0): writes nothing."""

    def __init__(self, out_dir: Path, output, start: int, *, config=None, enabled: bool = True) -> None:
        self.metrics = self.tensorboard = self.wandb = None
        if not enabled:
            return
        check_run_log(output)
        try:
            if output.metrics:
                self.metrics = open_metrics(out_dir / output.metrics, start)
            if output.tensorboard:
                self.tensorboard = _tensorboard(out_dir / TENSORBOARD_DIR, start)
            if output.wandb:
                self.wandb = _wandb(out_dir / WANDB_DIR, output.wandb_project, start, config)
        except BaseException:
            self.close()
            raise

    def lines(self, out_dir: Path) -> list[str]:
        """What the run says at its start about where the numbers go (TensorBoard and W&B only)."""
        out = []
        if self.tensorboard is not None:
            out.append(f"tensorboard: tensorboard --logdir {out_dir / TENSORBOARD_DIR}")
        if self.wandb is not None:
            out.append(f"wandb: offline run in {out_dir / WANDB_DIR} (wandb sync {out_dir / WANDB_DIR} uploads it)")
        return out

    def write(self, stats) -> None:
        record = stats.to_json()
        if self.metrics is not None:
            self.metrics.write(json.dumps(record) + "\n")
            self.metrics.flush()
        if self.tensorboard is None and self.wandb is None:
            return
        scalars = tags(record)
        if self.tensorboard is not None:
            for tag, value in scalars.items():
                self.tensorboard.add_scalar(tag, value, stats.step)
            self.tensorboard.flush()
        if self.wandb is not None:
            self.wandb.log(scalars, step=stats.step)

    def close(self) -> None:
        for name, finish in (("metrics", "close"), ("tensorboard", "close"), ("wandb", "finish")):
            logger = getattr(self, name)
            if logger is not None:
                setattr(self, name, None)
                getattr(logger, finish)()


def _tensorboard(directory: Path, start: int):
    from torch.utils.tensorboard import SummaryWriter

    directory.mkdir(parents=True, exist_ok=True)
    if not start:  # starting over: the old run's curves would be drawn over the new one's
        for old in directory.glob("events.out.tfevents.*"):
            old.unlink()
    return SummaryWriter(log_dir=str(directory), purge_step=start + 1 if start else None)


def _wandb(directory: Path, project: str, start: int, config):
    import wandb

    directory.mkdir(parents=True, exist_ok=True)
    id_file = directory / "run-id"
    run_id = id_file.read_text().strip() if start and id_file.is_file() else ""
    if not run_id:
        run_id = secrets.token_hex(4)
        id_file.write_text(run_id + "\n")
    settings = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(config or {})
    settings = json.loads(json.dumps(settings, default=str))  # plain values only (a memory limit as its text)
    return wandb.init(project=project, dir=str(directory.parent), mode="offline", id=run_id, resume="allow",
                      config=settings)
