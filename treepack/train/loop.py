"""The training loop behind ``treepack train``, one process or many: packs -> global batches -> AdamW steps,
one log line each.

One optimizer step = one global batch = ``data.packs_per_step`` packs. The loss normalisers (loss tokens,
sequences) are summed over the whole batch before its first forward, and each pack back-propagates its
share, so gradient accumulation over packs equals one backward over the batch (exact, not averaged per
pack). The mode (tree, dense, dfs) changes only how a pack's share is computed; batches, losses,
optimizer and logging are shared, so a tree run and a dense run of one config follow the same
trajectory up to float rounding.

One loop for every world size: what depends on the number of processes (each rank's share of the batch, the
gradient reduction, the global norm, the step's numbers over ranks, the checkpoint format) is a gradient-sync
strategy (`treepack.train.sync`): `SingleProcess` here, `DataParallel` under ``torchrun``
(`treepack.train.parallel.train_distributed`, FSDP2), which gives the single process's update at any world size.
The model comes from a registered source (`treepack.train.model_source`: our decoder, or transformers' modules).

Precision: ``float32``/``float64`` keep parameters and compute in that dtype; ``bfloat16`` keeps float32
parameters and AdamW state and runs forward/backward under bf16 autocast (the default on CUDA);
log-probs and losses are float32 (float64 for float64 models) whatever the autocast dtype.

Each step prints one fixed-format line (`treepack.train.metrics.StepStats`), e.g.
``step 00042 | loss 1.234 | tokens 12.3k | tok/s 123k | flat tok/s 456k | mem 12.3 GB | mfu 41%``, and its numbers
go to ``metrics.jsonl`` (and TensorBoard / W&B when asked: `treepack.train.run_log`). A step's line comes once
the next step's first pack is queued (`QueuedStep`: the host never drains the GPU between steps); on CUDA its
time is the device's, from the step's start to its end, idle included.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from treepack.errors import ConfigError
from treepack.pack.layout import Pack
from treepack.train.banner import banner, eta_line
from treepack.train.checkpoint import has_checkpoint
from treepack.train.collector import Pauses, freeze_warmup, thaw
from treepack.train.compile_count import KINDS, compiled_by_kind
from treepack.train.config import RunConfig
from treepack.train.data import batch_indices, compact_vocab, data_where, load_packs
from treepack.train.losses import LossRows, Objective, group_advantages, prepare_grpo_data
from treepack.train.memory_limit import capped, describe_memory_limit
from treepack.train.metrics import QueuedStep, StepStats, mem_gb, peak_flops, step_flops, visible_pairs
from treepack.train.model import Decoder
from treepack.train.model_source import model_source
from treepack.train.modes import Mode, make_mode
from treepack.train.modes.auto import AutoMode
from treepack.train.modes.dfs import DfsMode, merge_work
from treepack.train.run_log import RunLog, check_run_log
from treepack.train.sync import SingleProcess
from treepack.train.working_weights import WorkingWeights, applies


@dataclass
class TrainResult:
    output_dir: Path
    first_step: int  # first step run by this call (1-based); > last_step when resumed at the end
    last_step: int
    losses: list[float]  # loss of every step of the run so far (resumed steps included)
    stats: list[StepStats] = field(default_factory=list)  # this call's steps


def resolve_precision(device: str, dtype: str) -> tuple[torch.device, torch.dtype, torch.dtype | None]:
    """(device, parameter dtype, autocast dtype or None) for the config's device and dtype strings."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device = 'cuda' but CUDA is not available")
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    if dtype == "bfloat16":
        return torch.device(device), torch.float32, torch.bfloat16
    return torch.device(device), {"float32": torch.float32, "float64": torch.float64}[dtype], None


def lr_at(step: int, cfg: RunConfig) -> float:
    """Learning rate of 0-based step ``step``: linear warm-up, then constant or cosine to min_lr_ratio."""
    t = cfg.train
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    if t.schedule == "constant":
        return t.lr
    progress = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps - 1)
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def compact_vocab_of_run(cfg: RunConfig, packs: list[Pack], out_dir: Path, *, write: bool) -> list[Pack]:
    """``model.compact_vocab``: the packs with their ids renumbered 0..n-1, and the map in ``vocab.json``. A run
    that resumes must see the ids its checkpoint was trained on: other data would give its embedding rows to
    other tokens (or another row count), so that is refused before anything is written."""
    if cfg.model.checkpoint:
        raise ConfigError("model.compact_vocab renumbers token ids: only for random-init models, not a checkpoint")
    packs, original_ids = compact_vocab(packs)
    path = out_dir / "vocab.json"
    if cfg.output.resume and has_checkpoint(out_dir) and path.is_file():
        saved = json.loads(path.read_text())["original_ids"]
        if saved != original_ids.tolist():
            raise ConfigError(f"{path}: model.compact_vocab: the data's token ids are not the ones the checkpoint was "
                              f"trained on ({len(original_ids):,} distinct ids against {len(saved):,}, or others); use "
                              "a new output.dir or set output.resume = false")
    elif write:
        path.write_text(json.dumps({"original_ids": original_ids.tolist()}) + "\n")
    return packs


def build_model(cfg: RunConfig, packs: list[Pack], device: torch.device, dtype: torch.dtype) -> Decoder:
    """The configured model (`treepack.train.model_source`): a local checkpoint, or a random init whose vocabulary
    covers the data."""
    m = cfg.model
    max_id = max(int(np.asarray(p.input_ids[: p.n_real]).max(initial=0)) for p in packs)
    source = model_source(m.resolved_source())  # treepack (our decoder), hf (transformers' modules), ...
    model = source.load(m, vocab_size=max_id + 1, seed=cfg.train.seed, dtype=dtype, device=device)
    if max_id >= model.args.vocab_size:
        what = ("the data has " + (f"{max_id + 1:,} distinct token ids (model.compact_vocab renumbers them 0..n-1)"
                                   if cfg.model.compact_vocab else f"token id {max_id}"))
        where = "the checkpoint's vocabulary" if m.checkpoint else "model.vocab_size"
        raise ConfigError(f"{what}, more than {where} holds ({model.args.vocab_size:,})"
                          + ("" if m.checkpoint else "; set it higher, or 0 for the data's largest id + 1"))
    model.activation_checkpointing = cfg.train.activation_checkpointing
    model.compile = cfg.train.compile
    model.activation_memory_budget = cfg.train.activation_memory_budget
    return model


def check_attention(impl: str, model: Decoder, device: torch.device, dtype: torch.dtype) -> None:
    """A named kernel that cannot run here (triton, fa4 or flex on a CPU, fa4 in float32, ...) stops the run before
    its first step with the kernel's own reason, instead of a traceback from inside that step."""
    if impl == "flex" and device.type != "cuda":  # training needs its backward
        raise ConfigError("train.attention = 'flex': torch's FlexAttention has no backward on CPU; "
                          "use 'reference' or 'auto' there")
    if impl not in ("triton", "fa4"):
        return
    from treepack.kernels.tree_attention.api import triton_unsupported_reason
    from treepack.kernels.tree_attention.fa4 import fa4_unsupported_reason

    query = torch.empty(0, model.args.num_heads, model.args.head_dim, device=device, dtype=dtype)
    reason = (fa4_unsupported_reason if impl == "fa4" else triton_unsupported_reason)(query)
    if reason is not None:
        raise ConfigError(f"train.attention = '{impl}': {reason}")


def make_optimizer(model: Decoder, cfg: RunConfig) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not on norms and biases).

    On CUDA, torch's fused kernel: one pass over parameters, gradients and both moments instead of the
    multi-tensor loop's many (AdamW and clipping took 13 ms of a ToolBench tree step's GPU time on an H200,
    benchmarks/results/2026-11-25-child-order-h200.md), for FSDP2's sharded (DTensor) parameters too, where
    it is one DTensor dispatch instead of the loop's dozen over every parameter (17-27 ms of host time a
    step on an H100 host, benchmarks/results/2026-11-27-distributed-sync-2xh100.md)."""
    from torch.distributed.tensor import DTensor

    t = cfg.train
    params = list(model.parameters())
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = bool(params) and all(p.device.type == "cuda" and type(p.data) in (torch.Tensor, DTensor) for p in params)
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8, fused=fused or None)


def reapply_optimizer_settings(optimizer: torch.optim.AdamW, cfg: RunConfig) -> str | None:
    """After a resume, the configured AdamW settings replace the checkpoint's (torch's ``load_state_dict`` takes
    the saved groups' betas and weight decay); returns the log line naming what changed, if anything. The
    learning rate is set every step from the schedule, so it is not listed."""
    t = cfg.train
    wanted = [{"betas": (t.beta1, t.beta2), "weight_decay": t.weight_decay}, {"betas": (t.beta1, t.beta2)}]
    changed: dict[str, str] = {}
    for group, settings in zip(optimizer.param_groups, wanted):
        for key, value in settings.items():
            old = group[key]
            if key == "betas":
                for name, a, b in (("beta1", old[0], value[0]), ("beta2", old[1], value[1])):
                    if float(a) != float(b):
                        changed[f"train.{name}"] = f"train.{name} {float(a):g} -> {float(b):g}"
                group[key] = (float(value[0]), float(value[1]))
            else:
                if float(old) != float(value):
                    changed[f"train.{key}"] = f"train.{key} {float(old):g} -> {float(value):g}"
                group[key] = float(value)
    if not changed:
        return None
    return f"resumed with the config's AdamW settings, not the checkpoint's: {', '.join(changed.values())}"


def step_batch(step: int, packs: list[Pack], cfg: RunConfig, objective: Objective) -> list[Pack]:
    """The packs of one optimizer step (the same on every rank), with GRPO advantages over their groups."""
    batch = [packs[i] for i in batch_indices(step, len(packs), cfg.data.packs_per_step,
                                             seed=cfg.train.seed, shuffle=cfg.data.shuffle)]
    return group_advantages(batch) if objective.kind == "grpo" else batch


def build_mode(cfg: RunConfig) -> Mode:
    """The configured execution mode, for the model source the config names."""
    attention = cfg.train.attention
    if cfg.train.mode == "dense" and attention == "auto":
        attention = "sdpa"
    source = model_source(cfg.model.resolved_source())
    if source.make_mode is not None:  # a source with modes of its own (hf: transformers' modules, tree or dense)
        return source.make_mode(cfg.train.mode, attention=attention, chunk_rows=cfg.train.logits_chunk)
    return make_mode(cfg.train.mode, cfg.train)  # the [train] settings whole ([train.dfs] included)


def _manages_gc(model: Decoder, device: torch.device) -> bool:
    """Whether the loop freezes the first step's objects and times collections (`treepack.train.collector`):
    where that step compiles (CUDA by default); an eager CPU run leaves little behind."""
    return model.uses_compiled(device)


def train(cfg: RunConfig, *, packs: list[Pack] | None = None, log: Callable[[str], None] = print,
          sync: SingleProcess | None = None) -> TrainResult:
    """Run (or resume) the configured training; ``packs`` overrides the data section (tests, notebooks);
    ``sync``: how the step is spread over processes (default: this one alone, `SingleProcess`). The run holds
    ``train.memory_limit`` (`capped`) from before its model is built until it ends."""
    if sync is None:
        sync = SingleProcess(resolve_precision(cfg.train.device, cfg.train.dtype)[0])
    with capped(cfg.train.memory, sync.device, cfg.train.mode):
        return _train(cfg, packs, log, sync)


def _train(cfg: RunConfig, packs: list[Pack] | None, log: Callable[[str], None], sync: SingleProcess) -> TrainResult:
    device = sync.device
    _, param_dtype, autocast_dtype = resolve_precision(device.type, cfg.train.dtype)
    torch.manual_seed(cfg.train.seed)
    check_run_log(cfg.output)
    where = ""
    if packs is None:
        source = cfg.data.shards or cfg.data.rollouts
        packs = load_packs(source, capacity=cfg.data.capacity_tokens, child_order=cfg.child_order)
        where = data_where(source)
    if not packs:
        raise ConfigError("the data section yields no packs")
    flat = None  # a line when some GRPO groups have nothing to learn from
    if cfg.train.loss.kind == "grpo":
        packs, flat = prepare_grpo_data(packs, cfg.train.loss.kl_coef, where)
    if cfg.data.packs_per_step > len(packs):
        raise ConfigError(f"data.packs_per_step ({cfg.data.packs_per_step}) exceeds the packs in the data "
                          f"({len(packs)})")
    out_dir = Path(cfg.output.dir)
    if sync.rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
    if cfg.model.compact_vocab:
        packs = compact_vocab_of_run(cfg, packs, out_dir, write=sync.rank == 0)
    sync.barrier()  # vocab.json is written before any rank reads the directory
    model = build_model(cfg, packs, device, param_dtype)
    check_attention(cfg.train.attention, model, device, autocast_dtype or param_dtype)
    sync.prepare(model)  # data parallel: FSDP2 over the ranks
    optimizer = make_optimizer(model, cfg)
    sync.prepare_optimizer(optimizer)
    objective = Objective(kind=cfg.train.loss.kind, normalization=cfg.train.loss.normalization,
                          clip_low=cfg.train.loss.clip_low, clip_high=cfg.train.loss.clip_high,
                          kl_coef=cfg.train.loss.kl_coef)
    mode = build_mode(cfg)
    for line in banner(cfg, model, packs, device, param_dtype, autocast_dtype):  # what runs, before any notice
        log(line)
    for line in sync.describe(param_dtype, autocast_dtype):
        log(line)
    if flat:
        log(flat)
    if isinstance(mode, AutoMode):  # which mode runs each pack, and why
        for line in mode.describe(model, packs, [LossRows.from_pack(p) for p in packs], dtype=autocast_dtype):
            log(line)

    start, losses = 0, []
    if not cfg.output.resume and has_checkpoint(out_dir):
        log(f"output.resume = false: starting over; the checkpoint in {out_dir / 'checkpoint'} will be replaced")
    if cfg.output.resume and has_checkpoint(out_dir):
        state = sync.load(out_dir, model, optimizer)
        start, losses = int(state["step"]), list(state.get("losses", []))
        saved_by = f" (saved by {state['world_size']} rank(s))" if "world_size" in state else ""
        log(f"resumed from {out_dir / 'checkpoint'} at step {start}{saved_by}")
        notice = reapply_optimizer_settings(optimizer, cfg)
        if notice:
            log(notice)
    # metrics.jsonl, TensorBoard, W&B (rank 0's); closed in the finally below (the loop body is too long for a with)
    run_log = RunLog(out_dir, cfg.output, start, config=cfg, enabled=sync.rank == 0)
    # 16-bit copies of the matrix weights, cast once a step instead of once a model call
    working = WorkingWeights(model, autocast_dtype) if not sync.sharded and applies(model, autocast_dtype) else None
    peak = peak_flops(device) if autocast_dtype is not None else None
    if peak:
        log(f"mfu: model FLOPs over this GPU's bf16 matmul ceiling, measured now: {peak / 1e12:.0f} TFLOP/s")
    autocast = (torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype is not None
                else contextlib.nullcontext())
    stats_run: list[StepStats] = []
    params = [p for p in model.parameters()]

    def save(step: int, *, final: bool = False) -> None:
        sync.save(out_dir, model, optimizer, {"step": step, "losses": losses}, final=final)

    for line in filter(None, [describe_memory_limit(cfg.train.memory, model, device, autocast_dtype or param_dtype)]):
        log(line)
    if isinstance(mode, DfsMode):  # how large its calls may be (on this GPU; a rank's shard of the state), and why
        with autocast:
            log(mode.describe_block(model, packs, autocast_dtype or param_dtype))
    if model.uses_compiled(device) or (device.type == "cuda" and cfg.train.mode not in ("dense", "dense-leaf")):
        log("the first steps compile the kernels (torch.compile, Triton autotuning): expect them to take "
            "tens of seconds longer than the rest")
    for line in run_log.lines(out_dir):
        log(line)

    # Compiled runs: the first step's compile leaves objects every later full collection would rescan (a
    # pause of ~0.5 s in a step on an H100 host): frozen after it, and every step's collections timed.
    pauses = Pauses() if _manages_gc(model, device) else None
    frozen = False
    queued: QueuedStep | None = None

    def finish(q: QueuedStep) -> None:
        """Read a queued step back (over every rank when data-parallel), then log, record and save it."""
        nonlocal frozen
        stats = sync.step_stats(q, peak)
        losses.append(stats.loss)
        stats_run.append(stats)
        if q.step % cfg.output.log_every == 0 or q.step == cfg.train.steps:
            log(stats.line() + sync.line_extras(stats))
        eta = eta_line([x.seconds for x in stats_run], q.step, cfg.train.steps)
        if eta:
            log(eta)
        run_log.write(stats)
        if cfg.output.save_every and q.step % cfg.output.save_every == 0 and q.step < cfg.train.steps:
            save(q.step)
        if pauses is not None and not frozen:
            freeze_warmup()
            frozen = True
            pauses.take()  # that collection is not the next step's

    if pauses is not None:
        pauses.start()  # stopped in the finally below
    try:
        for step in range(start, cfg.train.steps):
            t0 = time.perf_counter()
            compiled_before = compiled_by_kind()
            begin = None
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
                begin = torch.cuda.Event(enable_timing=True)
                begin.record()
            batch = step_batch(step, packs, cfg, objective)
            share = sync.share(batch)  # this process's packs; normalisers over the whole batch
            if step == start:
                for line in sync.split_lines(share, step + 1):
                    log(line)
            lr = lr_at(step, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            sync.begin(share)
            # No host sync inside a step (the loss is summed on the device, the norm read back later): the host
            # queues the next pack while the GPU still runs the one before.
            loss_sum, tokens, flops, extra, work = None, 0, 0.0, {}, {}
            for pack, row in zip(share.packs, share.rows):
                with autocast:
                    out = mode(model, pack, row, objective, share.totals)
                out.backward()
                sync.pack_done(share)
                if queued is not None:  # the step before, read back once this step's first pack is queued
                    done, queued = queued, None
                    finish(done)
                pack_loss = out.loss.detach().double()  # float64, as the float sum it replaces
                loss_sum = pack_loss if loss_sum is None else loss_sum + pack_loss
                tokens += out.forward_tokens
                predicted = out.predicted_tokens
                if predicted is None:
                    predicted = row.n_rows if cfg.train.mode == "dense" else int(np.unique(row.token_R).shape[0])
                pairs = out.attention_pairs if out.attention_pairs is not None else visible_pairs(pack, cfg.train.mode)
                # Model FLOPs count the useful work once: dfs's no-grad re-forwards (anchors) are not in them.
                useful = out.metrics.get("grad_tokens", out.forward_tokens)
                flops += step_flops(model.args, useful, predicted, pairs)
                work = merge_work(work, out.metrics)  # dfs accounting: counts add up, peaks take the maximum
                for k, v in out.metrics.items():  # a tensor stays on the device until the step is read back
                    if isinstance(v, (int, float, torch.Tensor)) and k not in work:
                        extra[k] = extra.get(k, 0.0) + v / len(share.packs)
            sync.finish(share)  # the gradients of the whole batch (data parallel: one reduce-scatter)
            extra.update(work)
            # graphs and kernels this step compiled, by kind (`compile_count.KINDS`): the step line's "compiled N"
            kinds = {f"compiled_{k}": a - b for k, a, b in zip(KINDS, compiled_by_kind(), compiled_before)}
            extra.update(kinds, compiles=sum(kinds.values()))
            if pauses is not None:
                extra["gc_seconds"], extra["gc_full"] = pauses.take()
            norm = sync.grad_norm(params, cfg.train.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if working is not None:
                working.refresh()
            queued = QueuedStep.queue(
                step=step + 1, lr=lr, tokens=tokens, flops=flops, extra=extra, started=t0, begin=begin, share=share,
                flat_tokens=sum(int(np.asarray(p.seq_offsets)[-1]) for p in batch), loss_tokens=share.totals.loss_tokens,
                # dfs's CUDA graphs keep their memory in a pool that max_memory_allocated stops seeing
                mem_gb=mem_gb(device) + extra.get("graph_pool_bytes", 0) / 1e9,
                loss=loss_sum if loss_sum is not None else torch.zeros((), dtype=torch.float64, device=device), norm=norm)
            # Read back now, not during the next step: at the first step (the warm-up's objects are frozen
            # after it), before a checkpoint, at the last step (so none is left queued after the loop), and at
            # every step of a data-parallel run (its numbers are gathered over the ranks, a collective).
            saves = cfg.output.save_every and (step + 1) % cfg.output.save_every == 0
            if not sync.defer_readback or step == start or saves or step + 1 == cfg.train.steps:
                done, queued = queued, None  # not read twice if reading it fails (a collective, data-parallel)
                finish(done)
        if start < cfg.train.steps and cfg.output.save_final:
            save(cfg.train.steps, final=True)
    except BaseException:
        if queued is not None:  # the step before the failure did run: its line is not lost
            with contextlib.suppress(Exception):
                finish(queued)
        raise
    finally:
        if pauses is not None:
            pauses.stop()
        if frozen:
            thaw()
        run_log.close()
    return TrainResult(output_dir=out_dir, first_step=start + 1, last_step=cfg.train.steps, losses=losses,
                       stats=stats_run)
