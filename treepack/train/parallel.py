"""The data-parallel training loop: ``torchrun --nproc-per-node N -m treepack train config.toml``.

The same config, batches, losses and optimizer as `treepack.train.loop.train`, on N ranks: every rank
builds the same global batch of step s, takes its share (`distributed.shard_batch`: the sharing-aware
balance, normalisers over the whole batch), accumulates its gradients with no collective
(`fsdp.Accumulation`), and one reduce-scatter per step sums them; AdamW then updates each rank's shard. The
update is the single-process one up to the order of float sums (float64: ~1e-15 relative), whatever N.

Rank 0 prints the split of the first step (per-rank packs, tokens, predicted FLOPs, imbalance) and one
line per step: the single-process line plus ``dp N | imbalance P% pred / M% meas | idle I%``, where
*pred* is the balance's costliest rank over the mean, *meas* the same for the ranks' measured compute
times, and *idle* the share of the ranks' step time spent waiting for the slowest rank. ``metrics.jsonl``
also gets every rank's tokens, predicted FLOPs, measured compute seconds, idle seconds and predicted seconds
(its predicted FLOPs at the step's measured FLOP rate); ``tokens`` and ``mfu`` are over all ranks
(MFU = model FLOPs / (seconds x N x peak)); a mode's own figures (dfs accounting, GRPO clip fraction)
are rank 0's.

Process group: NCCL on CUDA (one GPU per local rank), gloo on CPU (the tests: float64, any N on one host).
At world size 1 the model is not sharded: FSDP over one rank shards nothing and cost 21.8% more time per
step than the plain loop on an H100 (Qwen3-0.6B shape, tau-bench packs of 16k, compile off;
benchmarks/results/2026-11-25-distributed-h100.md); unsharded, the rank runs the plain loop's operations
(bf16 autocast included) plus the split and one all-gather of the step's numbers, and still saves DCP
checkpoints that any world size resumes.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from treepack.errors import ConfigError, TreepackError
from treepack.pack.layout import Pack
from treepack.train.checkpoint import has_checkpoint, open_metrics
from treepack.train.config import RunConfig
from treepack.train.data import data_where, load_packs
from treepack.train.dcp import load_distributed, save_distributed
from treepack.train.distributed import flop_model, gather_floats, shard_batch
from treepack.train.fsdp import Accumulation, grad_norm, shard_model
from treepack.train.loop import (
    StepStats,
    TrainResult,
    _mem_gb,
    _peak_flops,
    build_mode,
    build_model,
    check_attention,
    compact_vocab_of_run,
    lr_at,
    make_optimizer,
    reapply_optimizer_settings,
    resolve_precision,
    step_batch,
)
from treepack.train.losses import LossRows, Objective, prepare_grpo_data
from treepack.train.memory_limit import capped, describe_memory_limit
from treepack.train.modes.dfs import DfsMode, merge_work


class ProcessGroup:
    """The default process group (initialised here from torchrun's environment unless it already is),
    its device (one GPU per local rank on CUDA) and a 1-D device mesh over every rank."""

    def __init__(self, device: str) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
        if use_cuda:
            if not torch.cuda.is_available():
                raise ConfigError("train.device = 'cuda' but CUDA is not available")
            if local_rank >= torch.cuda.device_count():
                raise ConfigError(f"local rank {local_rank} has no GPU of its own ({torch.cuda.device_count()} "
                                  "visible): run at most one process per GPU")
            torch.cuda.set_device(local_rank)
            self.device = torch.device("cuda", local_rank)
        else:
            self.device = torch.device("cpu")
        self.owned = not dist.is_initialized()
        if self.owned:
            dist.init_process_group("nccl" if use_cuda else "gloo", device_id=self.device if use_cuda else None)
        self.backend = dist.get_backend()
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.mesh = init_device_mesh(self.device.type, (self.world_size,))

    def close(self, *, ok: bool = True) -> None:
        """Free FSDP's state while the interpreter is alive (its gloo work objects otherwise race the
        teardown and can abort a successful run), then leave the group if we made it. After a failure no
        barrier: the other ranks may be stuck in a collective, and torchrun stops them when this one exits."""
        gc.collect()
        if self.owned and dist.is_initialized():
            if ok:
                dist.barrier()
            dist.destroy_process_group()


def train_distributed(cfg: RunConfig, *, packs: list[Pack] | None = None,
                      log: Callable[[str], None] = print) -> TrainResult:
    """Run (or resume) the configured training on every rank of torchrun's world; only rank 0 logs."""
    group = ProcessGroup(cfg.train.device)
    try:
        with capped(cfg.train.memory, group.device, cfg.train.mode):  # this rank's GPU
            result = _train(cfg, group, packs, log if group.rank == 0 else (lambda line: None))
    except BaseException:
        group.close(ok=False)
        raise
    group.close()
    return result


def _train(cfg: RunConfig, group: ProcessGroup, packs: list[Pack] | None, log: Callable[[str], None]) -> TrainResult:
    device = group.device
    _, param_dtype, autocast_dtype = resolve_precision(device.type, cfg.train.dtype)
    torch.manual_seed(cfg.train.seed)
    where = ""
    if packs is None:
        packs = load_packs(cfg.data.shards or cfg.data.rollouts, capacity=cfg.data.capacity_tokens,
                           child_order=cfg.child_order)
        where = data_where(cfg.data.shards or cfg.data.rollouts)
    if not packs:
        raise ConfigError("the data section yields no packs")
    flat = None  # a line when some GRPO groups have nothing to learn from
    if cfg.train.loss.kind == "grpo":
        packs, flat = prepare_grpo_data(packs, cfg.train.loss.kl_coef, where)
    if cfg.data.packs_per_step > len(packs):
        raise ConfigError(f"data.packs_per_step ({cfg.data.packs_per_step}) exceeds the packs in the data "
                          f"({len(packs)})")
    out_dir = Path(cfg.output.dir)
    if group.rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
    if cfg.model.compact_vocab:
        packs = compact_vocab_of_run(cfg, packs, out_dir, write=group.rank == 0)
    dist.barrier()
    model = build_model(cfg, packs, device, param_dtype)
    check_attention(cfg.train.attention, model, device, autocast_dtype or param_dtype)
    sharded = group.world_size > 1  # FSDP over one rank shards nothing: +21.8% step time on an H100
    if sharded:
        shard_model(model, group.mesh)  # float32 parameters gathered; bf16 under autocast, as one process
    optimizer = make_optimizer(model, cfg)
    if sharded and not optimizer.defaults.get("fused"):
        for g in optimizer.param_groups:  # AdamW picks its per-tensor loop for DTensors unless told otherwise
            g["foreach"] = True
    autocast = (torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype is not None
                else contextlib.nullcontext())
    objective = Objective(kind=cfg.train.loss.kind, normalization=cfg.train.loss.normalization,
                          clip_low=cfg.train.loss.clip_low, clip_high=cfg.train.loss.clip_high,
                          kl_coef=cfg.train.loss.kl_coef)
    mode = build_mode(cfg)
    for line in filter(None, [describe_memory_limit(cfg.train.memory, model, device, autocast_dtype or param_dtype)]):
        log(line)
    if isinstance(mode, DfsMode):  # an auto block counts this rank's shard of the state
        with autocast:
            log(mode.describe_block(model, packs, autocast_dtype or param_dtype))
    flops = flop_model(model.args)
    accumulation = Accumulation(model)
    params = list(model.parameters())

    start, losses = 0, []
    if not cfg.output.resume and has_checkpoint(out_dir):
        log(f"output.resume = false: starting over; the checkpoint in {out_dir / 'checkpoint'} will be replaced")
    if cfg.output.resume and has_checkpoint(out_dir):
        state = load_distributed(out_dir, model, optimizer)
        start, losses = int(state["step"]), list(state.get("losses", []))
        log(f"resumed from {out_dir / 'checkpoint'} at step {start} (saved by {state.get('world_size', 1)} rank(s))")
        notice = reapply_optimizer_settings(optimizer, cfg)
        if notice:
            log(notice)
    precision = str(param_dtype).removeprefix("torch.")
    if autocast_dtype is not None:
        precision = "bf16 autocast, float32 parameters and gradient reduction"
    log(f"data parallel: {group.world_size} ranks ({group.backend}, {device.type}), "
        f"{'FSDP2' if sharded else 'one rank, not sharded'}, {precision}")
    if flat:
        log(flat)
    metrics_file = None
    if cfg.output.metrics and group.rank == 0:
        metrics_file = open_metrics(out_dir / cfg.output.metrics, start)
    peak = _peak_flops(device) if autocast_dtype is not None else None
    stats_run: list[StepStats] = []

    def save(step: int, *, final: bool) -> None:
        save_distributed(out_dir, model, optimizer, {"step": step, "losses": losses}, export_model=final)

    try:
        for step in range(start, cfg.train.steps):
            t0 = time.perf_counter()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            batch = step_batch(step, packs, cfg, objective)
            share = shard_batch(batch, flops=flops, mode=cfg.train.mode, rank=group.rank,
                                world_size=group.world_size)
            if step == start:
                for line in share.table(step + 1):
                    log(line)
            lr = lr_at(step, cfg)
            for g in optimizer.param_groups:
                g["lr"] = lr
            accumulation.begin()
            timer = PackTimer(device)
            loss_sum, tokens, extra, work = None, 0, {}, {}
            for pack in share.packs:
                rows = LossRows.from_pack(pack)
                with autocast:
                    out = mode(model, pack, rows, objective, share.totals)
                out.backward()
                pack_loss = out.loss.detach().double()  # summed on the device: no host sync between packs
                loss_sum = pack_loss if loss_sum is None else loss_sum + pack_loss
                tokens += out.forward_tokens
                work = merge_work(work, out.metrics)
                for k, v in out.metrics.items():
                    if isinstance(v, (int, float, torch.Tensor)) and k not in work:
                        extra[k] = extra.get(k, 0.0) + v / max(len(share.packs), 1)
            timer.stop()
            # queued behind the packs, no host sync until the step's numbers are read below
            accumulation.finish()
            norm_t = grad_norm(params, cfg.train.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t_compute = timer.seconds()
            extra = {k: float(v) for k, v in extra.items()}  # device metrics (clip fraction)
            loss = float(loss_sum) if loss_sum is not None else 0.0
            norm = float(norm_t)
            seconds = max(time.perf_counter() - t0, 1e-9)
            ranks = gather_floats([loss, tokens, t_compute, _mem_gb(device)], device)
            loss = float(ranks[:, 0].sum())
            losses.append(loss)
            stats = _step_stats(step, cfg, share, ranks, batch, lr, norm, seconds, peak, {**extra, **work})
            stats_run.append(stats)
            if (step + 1) % cfg.output.log_every == 0 or step + 1 == cfg.train.steps:
                log(stats.line() + _dp_line(stats.extra))
            if metrics_file is not None:
                metrics_file.write(json.dumps(stats.to_json()) + "\n")
                metrics_file.flush()
            if cfg.output.save_every and (step + 1) % cfg.output.save_every == 0 and step + 1 < cfg.train.steps:
                save(step + 1, final=False)
        if start < cfg.train.steps:
            save(cfg.train.steps, final=True)
    finally:
        if metrics_file is not None:
            metrics_file.close()
    return TrainResult(output_dir=out_dir, first_step=start + 1, last_step=cfg.train.steps, losses=losses,
                       stats=stats_run)


class PackTimer:
    """A rank's compute time of one step's packs: CUDA events around them (read once the step is done, so the
    host queues the gradient sync, clipping and AdamW behind the packs instead of waiting for them), or the
    host clock on a CPU, where every op finishes before the next starts."""

    def __init__(self, device: torch.device) -> None:
        self.events = None
        if device.type == "cuda":
            self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self.events[0].record()
        self.t0, self.t1 = time.perf_counter(), None

    def stop(self) -> None:
        if self.events is not None:
            self.events[1].record()
        self.t1 = time.perf_counter()

    def seconds(self) -> float:
        if self.events is None:
            return self.t1 - self.t0
        self.events[1].synchronize()
        return self.events[0].elapsed_time(self.events[1]) / 1e3


def _step_stats(step: int, cfg: RunConfig, share, ranks: np.ndarray, batch: list[Pack], lr: float, norm: float,
                seconds: float, peak: float | None, extra: dict) -> StepStats:
    """The step's numbers over all ranks, with the per-rank balance figures in ``extra``."""
    compute = ranks[:, 2]
    cost = np.asarray(share.rank_cost, dtype=np.float64)
    rate = cost.sum() / compute.sum() if compute.sum() > 0 else 0.0  # the step's measured FLOP/s per rank
    predicted = cost / rate if rate else np.zeros_like(cost)
    idle = compute.max() - compute
    world = share.world_size
    dp = {
        "world_size": world, **share.to_json(),
        "rank_seconds": compute.tolist(), "rank_idle_seconds": idle.tolist(), "rank_predicted_seconds": predicted.tolist(),
        "imbalance_measured": float(compute.max() / compute.mean()) if compute.mean() > 0 else 1.0,
        "idle_fraction": float(idle.sum() / (world * compute.max())) if compute.max() > 0 else 0.0,
    }
    total_flops = float(cost.sum())
    return StepStats(
        step=step + 1, loss=float(ranks[:, 0].sum()), lr=lr, grad_norm=norm, tokens=int(ranks[:, 1].sum()),
        flat_tokens=sum(int(np.asarray(p.seq_offsets)[-1]) for p in batch),
        loss_tokens=share.totals.loss_tokens, seconds=seconds, mem_gb=float(ranks[:, 3].max()),
        mfu=total_flops / seconds / (peak * world) if peak else None, extra={**extra, **dp},
    )


def _dp_line(extra: dict) -> str:
    return (f" | dp {extra['world_size']} | imbalance {100 * (extra['imbalance_predicted'] - 1):.1f}% pred / "
            f"{100 * (extra['imbalance_measured'] - 1):.1f}% meas | idle {100 * extra['idle_fraction']:.1f}%")


def launch(nproc: int, args: list[str]) -> int:
    """``treepack train --nproc N ARGS``: torchrun on this host (standalone rendezvous on a free port) running
    ``python -m treepack ARGS`` on N ranks. Returns the exit code: 1 when the ranks failed with their own
    ``Error:`` line (rank 0 prints it), a `TreepackError` naming the rank when one died otherwise."""
    import logging

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    for name in ("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(logging.CRITICAL)  # its failure report repeats the ranks' errors
    try:
        run(parse_args(["--standalone", f"--nproc-per-node={nproc}", "--module", "treepack", *args]))
    except ChildFailedError as exc:
        codes = {int(r): f.exitcode for r, f in exc.failures.items()}
        if 1 in codes.values():  # a rank failed with its Error line; torchrun then stopped the others
            return 1
        rank, code = min(codes.items())
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        raise TreepackError(f"rank {rank} of {nproc} {how}") from None
    return 0
