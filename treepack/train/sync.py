"""How the one training loop (`treepack.train.loop.train`) spreads a step over processes: the gradient sync.

A step is the same at any world size: take this process's share of the global batch, run its packs (each
back-propagates its part of the batch loss, normalised over the WHOLE batch, so summed gradients are exact),
reduce the gradients, clip, AdamW. Everything that depends on the number of processes sits behind one interface
the loop calls, so there is one loop, one start-up, one resume and one step line:

- `share(batch)`: this process's packs, their loss rows, and the whole batch's normalisers (`BatchTotals`);
- `begin(share)` / `finish(share)`: around the packs, the after-backward reduction (FSDP2: gather every unit
  once, reduce-scatter once; one process: nothing);
- `grad_norm(params, max_norm)`: the global gradient norm, clipping;
- `step_stats(queued, peak)`: the step's numbers over every rank (one all-gather) and `line_extras`, what the
  step line adds (``| dp N | imbalance P% pred / M% meas | idle I%``);
- `save` / `load`: the checkpoint format (`treepack.train.checkpoint`: safetensors from one process, DCP from
  ranks; either resumes either).

`SingleProcess` is the plain run: the whole batch, no collective, and a step's numbers read back while the next
step's first pack is queued (`QueuedStep`: the host never drains the GPU between steps). `DataParallel` is
``torchrun``'s (FSDP2 over the ranks of a `treepack.train.parallel.ProcessGroup`): the sharing-aware split
(`distributed.shard_batch`), `fsdp.Accumulation` (one reduce-scatter a step, gradients summed, never averaged),
and a step's numbers gathered as soon as it ends (a collective every rank reaches at the same point). At world
size 1 it shards nothing: FSDP over one rank cost 21.8% more time per step than the plain loop on an H100
(Qwen3-0.6B shape, tau-bench packs of 16k; benchmarks/results/2026-11-25-distributed-h100.md), so the rank runs
the plain loop's operations plus one all-gather of the step's numbers, and still saves DCP checkpoints.
`SimulatedRanks` (``treepack train --simulate-ranks N``) rehearses N ranks in one process: their split, each
rank's share timed, the step line and metrics of a data-parallel run, the plain run's gradients.

Rank 0 prints the split of the first step (per-rank packs, tokens, predicted FLOPs, imbalance). ``pred`` is the
balance's costliest rank over the mean, ``meas`` the same for the ranks' measured compute times, ``idle`` the
share of the ranks' step time spent waiting for the slowest. ``metrics.jsonl`` gets every rank's tokens,
predicted FLOPs, measured compute and idle seconds and predicted seconds (its predicted FLOPs at the step's
measured FLOP rate); ``tokens`` and ``mfu`` are over all ranks (MFU = model FLOPs / (seconds x N x peak)); a
mode's own figures (dfs accounting, GRPO clip fraction) are rank 0's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from treepack.pack.layout import Pack
from treepack.train.checkpoint import load_checkpoint, save_checkpoint
from treepack.train.compile_count import KINDS
from treepack.train.losses import BatchTotals, LossRows
from treepack.train.metrics import QueuedStep, StepStats


@dataclass
class Share:
    """One process's part of a step's global batch."""

    packs: list[Pack]  # the packs (or pieces of packs) this process runs, in batch order
    rows: list[LossRows]  # their loss rows
    totals: BatchTotals  # normalisers of the WHOLE global batch
    split: object = None  # data parallel: the `distributed.RankShare` (every rank's load)
    timer: PackTimer | None = None  # data parallel: this rank's compute time of the packs (simulated: each rank's)


class SingleProcess:
    """One process: the whole batch, no collective."""

    rank = 0
    world_size = 1
    sharded = False  # whether the model's parameters are sharded over ranks
    defer_readback = True  # a step's numbers may be read during the next step

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def prepare(self, model) -> None:
        """Called once the model is built, before its optimizer."""

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Called once the optimizer is built, before a checkpoint is loaded into it."""

    def describe(self, param_dtype: torch.dtype, autocast_dtype: torch.dtype | None) -> list[str]:
        return []

    def share(self, batch: list[Pack]) -> Share:
        rows = [LossRows.from_pack(p) for p in batch]
        return Share(packs=batch, rows=rows, totals=BatchTotals.of(rows))

    def split_lines(self, share: Share, step: int) -> list[str]:
        """How the step's batch is split over ranks (printed at a run's first step)."""
        return []

    def begin(self, share: Share) -> None:
        """Before the step's first pack."""

    def pack_done(self, share: Share) -> None:
        """After each pack's backward."""

    def finish(self, share: Share) -> None:
        """After the step's last backward: the gradients are the batch's once this returns (or is queued)."""

    def grad_norm(self, params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        """The global gradient norm, a 0-d tensor (reading it is the caller's host sync); clips when max_norm > 0."""
        if max_norm > 0:
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
        return torch.linalg.vector_norm(torch.stack([p.grad.detach().norm() for p in params if p.grad is not None]))

    def step_stats(self, q: QueuedStep, peak: float | None) -> StepStats:
        """A queued step read back (waiting for its end on the device only)."""
        loss, norm, seconds = q.read()
        return StepStats(step=q.step, loss=loss, lr=q.lr, grad_norm=norm, tokens=q.tokens, flat_tokens=q.flat_tokens,
                         loss_tokens=q.loss_tokens, seconds=seconds, mem_gb=q.mem_gb,
                         mfu=q.flops / seconds / peak if peak else None, extra=q.extra)

    def line_extras(self, stats: StepStats) -> str:
        return ""

    def save(self, out_dir, model, optimizer, state: dict, *, final: bool) -> None:
        save_checkpoint(out_dir, model, optimizer, state)

    def load(self, out_dir, model, optimizer) -> dict:
        return load_checkpoint(out_dir, model, optimizer)

    def barrier(self) -> None:
        """Wait for every rank."""


class DataParallel(SingleProcess):
    """The ranks of a `treepack.train.parallel.ProcessGroup`, FSDP2 when there is more than one."""

    defer_readback = False  # a step's numbers are gathered over ranks as soon as it ends

    def __init__(self, group, mode: str, balance: str = "flops") -> None:
        super().__init__(group.device)
        self.group = group
        self.mode = mode  # the execution mode's name: its layout is what the balance costs
        self.rank, self.world_size = group.rank, group.world_size
        self.sharded = group.world_size > 1
        self.measured = balance == "measured" or (balance == "auto" and group.device.type == "cuda")
        self.flops = self.accumulation = self.calibration = None

    def prepare(self, model) -> None:
        from treepack.train.distributed import flop_model
        from treepack.train.fsdp import Accumulation, shard_model

        if self.sharded:
            shard_model(model, self.group.mesh)  # float32 parameters gathered; bf16 under autocast, as one process
        self.flops = flop_model(model.args)
        if self.measured and self.world_size > 1:
            from treepack.train.calibration import CostCalibration

            self.calibration = CostCalibration(self.flops)
        self.accumulation = Accumulation(model)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        if self.sharded and not optimizer.defaults.get("fused"):
            for g in optimizer.param_groups:  # AdamW picks its per-tensor loop for DTensors unless told otherwise
                g["foreach"] = True

    def describe(self, param_dtype: torch.dtype, autocast_dtype: torch.dtype | None) -> list[str]:
        precision = str(param_dtype).removeprefix("torch.")
        if autocast_dtype is not None:
            precision = "bf16 autocast, float32 parameters and gradient reduction"
        return [(f"data parallel: {self.world_size} ranks ({self.group.backend}, {self.device.type}), "
                 f"{'FSDP2' if self.sharded else 'one rank, not sharded'}, {precision}")]

    def share(self, batch: list[Pack]) -> Share:
        from treepack.train.distributed import shard_batch

        flops = self.calibration.model() if self.calibration is not None else self.flops
        split = shard_batch(batch, flops=flops, mode=self.mode, rank=self.rank, world_size=self.world_size)
        return Share(packs=split.packs, rows=[LossRows.from_pack(p) for p in split.packs], totals=split.totals,
                     split=split)

    def split_lines(self, share: Share, step: int) -> list[str]:
        return share.split.table(step)

    def begin(self, share: Share) -> None:
        self.accumulation.begin()
        share.timer = PackTimer(self.device)

    def finish(self, share: Share) -> None:
        share.timer.stop()
        self.accumulation.finish()  # queued behind the packs: no host sync until the step's numbers are read

    def grad_norm(self, params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        from treepack.train.fsdp import grad_norm

        return grad_norm(params, max_norm)

    def step_stats(self, q: QueuedStep, peak: float | None) -> StepStats:
        """The step's numbers over all ranks, with the per-rank balance figures in ``extra``."""
        from treepack.train.distributed import gather_floats

        loss, norm, seconds = q.read()
        share = q.share
        kinds = [f"compiled_{k}" for k in KINDS]
        ranks = gather_floats([loss, q.tokens, share.timer.seconds(), q.mem_gb, q.extra.get("compiles", 0),
                               *(q.extra.get(k, 0) for k in kinds)], self.device)
        compute = ranks[:, 2]
        flops = float(sum(self.flops.cost(w) for w in share.split.rank_work))  # model FLOPs, not the balance's cost
        world = self.world_size
        dp = {
            "world_size": world, **balance_figures(share.split, compute),
            # what each rank compiled in the step: in all, and by kind (graphs, Triton, FA4: `compile_count.KINDS`)
            "rank_compiles": ranks[:, 4].astype(int).tolist(), "compiles": int(ranks[:, 4].max()),
            **{f"rank_{k}": ranks[:, 5 + i].astype(int).tolist() for i, k in enumerate(kinds)},
        }
        if self.calibration is not None:
            dp.update(self._calibrate(share, compute, compiled=bool(ranks[:, 4].max() > 0)))
        return StepStats(
            step=q.step, loss=float(ranks[:, 0].sum()), lr=q.lr, grad_norm=norm, tokens=int(ranks[:, 1].sum()),
            flat_tokens=q.flat_tokens, loss_tokens=q.loss_tokens, seconds=seconds, mem_gb=float(ranks[:, 3].max()),
            mfu=flops / seconds / (peak * world) if peak else None,
            extra={**{k: v for k, v in q.extra.items() if k not in kinds}, **dp},  # this rank's counts: in the lists
        )

    def _calibrate(self, share: Share, compute: np.ndarray, *, compiled: bool) -> dict:
        """Observe the step's rank times, refit the balance's cost model on rank 0 and give every rank that
        fit (the next split must be the same on every rank). Returns the fit's figures for the metrics."""
        from treepack.train.calibration import Fit
        from treepack.train.distributed import broadcast_floats

        cal = self.calibration
        cal.observe(share.split.rank_work, compute, compiled=compiled)
        fit = cal.refit() if self.rank == 0 else None
        got = broadcast_floats(fit.as_array() if fit is not None else np.full(4, np.nan), self.device)
        cal.adopt(None if np.isnan(got).any() else Fit(*got.tolist()))
        return fit_figures(cal)

    def line_extras(self, stats: StepStats) -> str:
        return balance_line(stats.extra)

    def save(self, out_dir, model, optimizer, state: dict, *, final: bool) -> None:
        save_checkpoint(out_dir, model, optimizer, state, distributed=True, export_model=final)

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()


class SimulatedRanks(SingleProcess):
    """One process rehearses a step of ``world_size`` data-parallel ranks: the split their ranks would make
    (`distributed.every_share`), every rank's packs one rank after the other, each rank's share timed.

    Why: to see how a run will balance on N GPUs, and let the balance's cost model learn from measured times
    (`train.balance`), on one GPU. The gradients are the plain run's up to the order of float sums: every
    share's loss is normalised over the whole batch, and the backward passes sum into one set of gradients as
    the ranks' reduction would. What it does not show: collectives, the ranks' compiles (a shape one simulated
    rank compiled is cached for the next), and the speed of N GPUs (the step runs on this one)."""

    def __init__(self, device: torch.device, mode: str, world_size: int, balance: str = "flops") -> None:
        super().__init__(device)
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.mode, self.simulated = mode, world_size
        self.measured = balance == "measured" or (balance == "auto" and device.type == "cuda")
        self.flops = self.calibration = None

    def prepare(self, model) -> None:
        from treepack.train.distributed import flop_model

        self.flops = flop_model(model.args)
        if self.measured and self.simulated > 1:
            from treepack.train.calibration import CostCalibration

            self.calibration = CostCalibration(self.flops)

    def describe(self, param_dtype: torch.dtype, autocast_dtype: torch.dtype | None) -> list[str]:
        return [(f"simulated data parallel: {self.simulated} ranks' shares run one after another in this process "
                 "(their split, timed per rank; gradients as one process)")]

    def share(self, batch: list[Pack]) -> Share:
        from treepack.train.distributed import every_share

        flops = self.calibration.model() if self.calibration is not None else self.flops
        shares = every_share(batch, flops=flops, mode=self.mode, world_size=self.simulated)
        packs = [p for s in shares for p in s.packs]
        return Share(packs=packs, rows=[LossRows.from_pack(p) for p in packs], totals=shares[0].totals,
                     split=shares[0])

    def split_lines(self, share: Share, step: int) -> list[str]:
        return share.split.table(step)

    def begin(self, share: Share) -> None:
        share.timer = PackTimer(self.device, rank_ends=np.cumsum(share.split.rank_packs).tolist())

    def pack_done(self, share: Share) -> None:
        share.timer.pack_done()

    def step_stats(self, q: QueuedStep, peak: float | None) -> StepStats:
        stats = super().step_stats(q, peak)
        compute = q.share.timer.intervals()
        dp = {"world_size": self.simulated, "simulated": True, **balance_figures(q.share.split, compute)}
        if self.calibration is not None:
            cal = self.calibration
            cal.observe(q.share.split.rank_work, compute, compiled=bool(q.extra.get("compiles", 0)))
            cal.adopt(cal.refit())
            dp.update(fit_figures(cal))
        stats.extra = {**stats.extra, **dp}
        return stats

    def line_extras(self, stats: StepStats) -> str:
        return balance_line(stats.extra)


def balance_figures(split, compute: np.ndarray) -> dict:
    """A data-parallel step's balance for the metrics: the split (`distributed.RankShare.to_json`), every rank's
    measured compute and idle seconds, its predicted seconds (its predicted cost at the step's measured rate),
    the measured imbalance (costliest rank / mean) and the share of the ranks' time spent waiting."""
    compute = np.asarray(compute, dtype=np.float64)
    cost = np.asarray(split.rank_cost, dtype=np.float64)
    rate = cost.sum() / compute.sum() if compute.sum() > 0 else 0.0  # the step's measured FLOP/s per rank
    predicted = cost / rate if rate else np.zeros_like(cost)
    idle = compute.max() - compute
    return {
        **split.to_json(), "rank_seconds": compute.tolist(), "rank_idle_seconds": idle.tolist(),
        "rank_predicted_seconds": predicted.tolist(),
        "imbalance_measured": float(compute.max() / compute.mean()) if compute.mean() > 0 else 1.0,
        "idle_fraction": float(idle.sum() / (len(compute) * compute.max())) if compute.max() > 0 else 0.0,
    }


def fit_figures(calibration) -> dict:
    """The fitted cost model's figures for the metrics (none until a fit exists)."""
    if calibration.fit is None:
        return {}
    model = calibration.model()
    return {"cost_attention_factor": model.per_pair / calibration.base.per_pair,
            "cost_call_flops": model.per_call, "cost_fit_error": calibration.fit.rel_error}


def balance_line(extra: dict) -> str:
    """What a data-parallel step line adds: ``| dp N | imbalance P% pred / M% meas | idle I%`` (``simulated dp``
    when one process rehearsed the ranks)."""
    dp = "simulated dp" if extra.get("simulated") else "dp"
    return (f" | {dp} {extra['world_size']} | imbalance {100 * (extra['imbalance_predicted'] - 1):.1f}% pred / "
            f"{100 * (extra['imbalance_measured'] - 1):.1f}% meas | idle {100 * extra['idle_fraction']:.1f}%")


class PackTimer:
    """Compute time of a step's packs: CUDA events (read once the step is done, so the host queues the gradient
    sync, clipping and AdamW behind the packs instead of waiting for them), or the host clock on a CPU, where
    every op finishes before the next starts. A rank marks the start and the end of its packs; a simulated run
    (``rank_ends``: packs run by the end of each rank's share, cumulative) also each rank's end."""

    def __init__(self, device: torch.device, rank_ends: list[int] | None = None) -> None:
        self.cuda = device.type == "cuda"
        self.rank_ends = rank_ends
        self.packs = 0
        self.marks = [self._now()]
        self._advance(self.marks[0])

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _advance(self, now=None) -> None:
        """Mark the end of every rank whose last pack has run (one mark for all of them: a rank without packs
        takes no time)."""
        ends = self.rank_ends
        while ends is not None and len(self.marks) <= len(ends) and ends[len(self.marks) - 1] <= self.packs:
            now = self._now() if now is None else now
            self.marks.append(now)

    def pack_done(self) -> None:
        self.packs += 1
        self._advance()

    def stop(self) -> None:
        if self.rank_ends is None:
            self.marks.append(self._now())

    def intervals(self) -> np.ndarray:
        """Seconds between consecutive marks: a rank's compute, or every simulated rank's."""
        if not self.cuda:
            return np.diff(np.asarray(self.marks, dtype=np.float64))
        self.marks[-1].synchronize()
        return np.array([a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])])

    def seconds(self) -> float:
        return float(self.intervals().sum())
