"""The training loop behind ``treepack train``: packs -> global batches -> AdamW steps, one log line each.

One optimizer step = one global batch = ``data.packs_per_step`` packs. The loss normalisers (loss tokens,
sequences) are summed over the whole batch before its first forward, and each pack back-propagates its
share, so gradient accumulation over packs equals one backward over the batch (exact, not averaged per
pack). The mode (tree, dense, dfs) changes only how a pack's share is computed; batches, losses,
optimizer and logging are shared, so a tree run and a dense run of one config follow the same
trajectory up to float rounding.

Precision: ``float32``/``float64`` keep parameters and compute in that dtype; ``bfloat16`` keeps float32
parameters and AdamW state and runs forward/backward under bf16 autocast (the default on CUDA);
log-probs and losses are float32 (float64 for float64 models) whatever the autocast dtype.

Each step prints one fixed-format line, e.g.
``step 00042 | loss 1.234 | tokens 12.3k | tok/s 123k | flat tok/s 456k | mem 12.3 GB | mfu 41%``:
``tokens`` are the tokens the model forwarded in the step (N_tree for tree mode), ``flat tok/s`` the
dense-equivalent throughput (the batch's sum of sequence lengths per second), ``mem`` the peak (CUDA:
allocated this step; CPU: the process's peak RSS) and ``mfu`` (CUDA, 16-bit only) the useful FLOPs of
DESIGN §9's model over the bf16 matmul ceiling measured on the device at start (`_peak_flops`). The same
numbers go to ``metrics.jsonl``. A step's line comes once the next step's first pack is queued (`QueuedStep`:
the host never drains the GPU between steps); on CUDA its time is the device's, from the step's start to its
end, idle included.
"""

from __future__ import annotations

import contextlib
import json
import math
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from treepack.errors import ConfigError
from treepack.pack.layout import Pack
from treepack.train.banner import banner, eta_line
from treepack.train.checkpoint import has_checkpoint, load_checkpoint, open_metrics, save_checkpoint
from treepack.train.collector import Pauses, freeze_warmup, thaw
from treepack.train.config import RunConfig
from treepack.train.data import batch_indices, compact_vocab, data_where, load_packs
from treepack.train.losses import BatchTotals, LossRows, Objective, group_advantages, prepare_grpo_data
from treepack.train.memory_limit import capped, describe_memory_limit
from treepack.train.model import Decoder, ModelArgs
from treepack.train.modes import Mode, make_mode
from treepack.train.modes.auto import AutoMode, SpeedTable
from treepack.train.modes.dfs import DfsMode, merge_work
from treepack.train.working_weights import WorkingWeights, applies

# Dense bf16 tensor-core datasheet peaks (FLOP/s) by device-name substring: MFU's fallback where measuring fails.
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "L4": 121e12}


@dataclass
class StepStats:
    step: int  # 1-based optimizer step
    loss: float
    lr: float
    grad_norm: float
    tokens: int  # tokens the model forwarded
    flat_tokens: int  # sum of the batch's sequence lengths (what dense training computes)
    loss_tokens: int
    seconds: float
    mem_gb: float
    mfu: float | None = None
    extra: dict = field(default_factory=dict)

    def line(self) -> str:
        parts = [
            f"step {self.step:05d}",
            f"loss {self.loss:.3f}",
            f"tokens {human(self.tokens)}",
            f"tok/s {human(self.tokens / self.seconds)}",
            f"flat tok/s {human(self.flat_tokens / self.seconds)}",
            f"mem {self.mem_gb:.1f} GB",
        ]
        if self.mfu is not None:
            parts.append(f"mfu {100 * self.mfu:.0f}%")
        if "anchor_share" in self.extra:  # dfs: share of no-grad re-forwards, most tokens with a live graph
            parts.append(f"anchor {100 * self.extra['anchor_share']:.0f}% | graph {human(self.extra['peak_graph_tokens'])}")
        return " | ".join(parts)

    def to_json(self) -> dict:
        out = {
            "step": self.step, "loss": self.loss, "lr": self.lr, "grad_norm": self.grad_norm,
            "tokens": self.tokens, "flat_tokens": self.flat_tokens, "loss_tokens": self.loss_tokens,
            "seconds": self.seconds, "tok_per_s": self.tokens / self.seconds,
            "flat_tok_per_s": self.flat_tokens / self.seconds, "mem_gb": self.mem_gb,
        }
        if self.mfu is not None:
            out["mfu"] = self.mfu
        return {**out, **self.extra}


@dataclass
class TrainResult:
    output_dir: Path
    first_step: int  # first step run by this call (1-based); > last_step when resumed at the end
    last_step: int
    losses: list[float]  # loss of every step of the run so far (resumed steps included)
    stats: list[StepStats] = field(default_factory=list)  # this call's steps


@dataclass
class QueuedStep:
    """A step whose work is queued on the device, read back later: `train` reads step N once step N + 1's
    first pack is queued, so the host never waits for the GPU to drain at a step's end and the GPU never waits
    for the host to refill its queue (a ToolBench step on an H100 spent ~5 ms idle at each boundary, then
    ~1 ms at each of the first layers of the next forward, whose host time per layer exceeds the GPU's).
    The loss and gradient norm come back through a pinned, non-blocking copy, the step's time from CUDA
    events at its start and end (its GPU-timeline duration, idle included), so reading it waits for the
    step's end only, not for what was queued after it."""

    step: int  # 1-based
    lr: float
    tokens: int
    flat_tokens: int
    loss_tokens: int
    flops: float
    mem_gb: float
    extra: dict
    seconds: float  # without a device: the host's time from the step's start to its end
    values: torch.Tensor  # (loss, grad norm, *device metrics), float64; on the host once `done` is reached
    begin: torch.cuda.Event | None  # CUDA: the step's start and end on the device's timeline
    done: torch.cuda.Event | None
    device_metrics: tuple[str, ...] = ()  # keys of ``extra`` that were tensors, read back in ``values``

    @classmethod
    def queue(cls, *, loss: torch.Tensor, norm: torch.Tensor, started: float, begin: torch.cuda.Event | None,
              extra: dict, **fields) -> QueuedStep:
        # scalars without a graph (the loss was detached, the norm taken without grad); metrics the modes
        # left on the device (GRPO's clip fraction) come back in the same copy
        names = tuple(sorted(k for k, v in extra.items() if isinstance(v, torch.Tensor)))
        values = torch.stack([t.double() if t.dim() == 0 else t.double().reshape(())
                              for t in (loss, norm, *(extra[k] for k in names))])
        seconds, done = max(time.perf_counter() - started, 1e-9), None
        if begin is not None:
            values = values.to("cpu", non_blocking=True)  # into pinned memory, ordered before `done`
            done = torch.cuda.Event(enable_timing=True)
            done.record()
        return cls(values=values, seconds=seconds, begin=begin, done=done, extra=extra, device_metrics=names,
                   **fields)

    def read(self) -> tuple[float, float, float]:
        """(loss, grad norm, seconds); the device metrics into ``extra`` as floats."""
        seconds = self.seconds
        if self.done is not None:
            self.done.synchronize()
            seconds = max(self.begin.elapsed_time(self.done) / 1e3, 1e-9)
        loss, norm, *metrics = self.values.tolist()
        self.extra.update(zip(self.device_metrics, metrics))
        return loss, norm, seconds


def human(x: float) -> str:
    """3 significant digits with k/M/G: 987, 12.3k, 123k, 1.23M."""
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3), ("", 1.0)):
        if abs(x) >= div or unit == "":
            v = x / div
            if unit == "":
                return f"{v:.0f}"
            return f"{v:.2f}{unit}" if abs(v) < 10 else f"{v:.1f}{unit}" if abs(v) < 100 else f"{v:.0f}{unit}"
    return f"{x:.0f}"  # pragma: no cover


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
    """The configured model: a local checkpoint, or a random init whose vocabulary covers the data."""
    m = cfg.model
    max_id = max(int(np.asarray(p.input_ids[: p.n_real]).max(initial=0)) for p in packs)
    if m.resolved_source() == "hf":  # transformers' own modules, tree-packed through treepack.hf
        from treepack.hf.trainer import HFCausalLM

        model = HFCausalLM.from_pretrained(m.checkpoint, dtype=dtype, device=device)
    elif m.checkpoint:
        model = Decoder.from_pretrained(m.checkpoint, dtype=dtype, device=device)
    else:
        vocab = m.vocab_size or max_id + 1
        args = ModelArgs.for_family(
            m.family, vocab_size=vocab, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
            num_layers=m.num_layers, num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
            rope_theta=m.rope_theta, tie_embeddings=m.tie_embeddings, init_std=m.init_std,
        )
        model = Decoder.random_init(args, seed=cfg.train.seed, dtype=dtype, device=device)
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
    """The configured execution mode (the single-process and the data-parallel loops share it)."""
    attention = cfg.train.attention
    if cfg.train.mode == "dense" and attention == "auto":
        attention = "sdpa"
    if cfg.model.resolved_source() == "hf":
        from treepack.hf.trainer import make_hf_mode

        return make_hf_mode(cfg.train.mode, attention=attention, chunk_rows=cfg.train.logits_chunk)
    return make_mode(cfg.train.mode, attention=attention, chunk_rows=cfg.train.logits_chunk,
                     micro_batch_tokens=cfg.train.micro_batch_token_count,
                     speed_table=SpeedTable.load(cfg.train.speed_table) if cfg.train.speed_table else None,
                     **({"dfs_block_size": cfg.train.dfs_block, "dfs_keep_tokens": cfg.train.dfs_keep_tokens,
                         "dfs_order": cfg.train.dfs_order, "dfs_subtree_calls": cfg.train.dfs_subtree_calls,
                         "dfs_merge_anchor_tokens": cfg.train.dfs_merge_anchor_tokens,
                         "dfs_cuda_graphs": cfg.train.dfs_cuda_graphs}
                        if cfg.train.mode == "dfs" else {}))


def _visible_pairs(pack: Pack, mode: str) -> int:
    if mode == "dense":
        lengths = np.diff(np.asarray(pack.seq_offsets, dtype=np.int64))
        return int((lengths * (lengths + 1) // 2).sum())
    n = int(pack.n_real)
    return int((np.asarray(pack.subtree_end[:n], dtype=np.int64) - np.arange(n)).sum())


def _step_flops(args: ModelArgs, tokens: int, predicted: int, pairs: int) -> float:
    """DESIGN §9's FLOP model (forward + backward)."""
    return (6.0 * args.num_params(embeddings=False) * tokens + 6.0 * args.hidden_size * args.vocab_size * predicted
            + 12.0 * args.num_layers * args.num_heads * args.head_dim * pairs)


def _manages_gc(model: Decoder, device: torch.device) -> bool:
    """Whether the loop freezes the first step's objects and times collections (`treepack.train.collector`):
    where that step compiles (CUDA by default); an eager CPU run leaves little behind."""
    return model.uses_compiled(device)


_MEASURED_PEAK: dict[int, float] = {}


def _peak_flops(device: torch.device) -> float | None:
    """The bf16 matmul ceiling MFU divides by: measured once per process and GPU (an 8192^3 bf16 matmul on
    random data, median of 20 after 10 warm-ups, ~50 ms: a GPU still at idle clocks would read low and
    inflate MFU), which is what the hardware delivers (H100 / H200: ~740-800 TFLOP/s against a 989
    datasheet peak); the datasheet table only where measuring fails. A burst figure, so MFU errs low: after a
    second of such matmuls the power limit holds them at ~645-680 TFLOP/s, below the ~750 a training step's
    own GEMMs reach (benchmarks/results/2026-11-26-toolbench-step-h200-h100.md)."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _MEASURED_PEAK:
        try:
            a, b = (torch.randn(8192, 8192, device=device, dtype=torch.bfloat16) for _ in range(2))
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            for _ in range(10):
                torch.matmul(a, b)
            times = []
            for _ in range(20):
                start.record()
                torch.matmul(a, b)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            del a, b
            _MEASURED_PEAK[index] = 2 * 8192**3 / sorted(times)[len(times) // 2]
        except RuntimeError:  # out of memory or no kernel: the datasheet peak
            name = torch.cuda.get_device_name(device)
            peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)
            if peak is None:
                return None
            _MEASURED_PEAK[index] = peak
    return _MEASURED_PEAK[index]


def _mem_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux reports KiB


def train(cfg: RunConfig, *, packs: list[Pack] | None = None, log: Callable[[str], None] = print) -> TrainResult:
    """Run (or resume) the configured training; ``packs`` overrides the data section (tests, notebooks). The
    run holds ``train.memory_limit`` (`capped`) from before its model is built until it ends."""
    with capped(cfg.train.memory, resolve_precision(cfg.train.device, cfg.train.dtype)[0], cfg.train.mode):
        return _train(cfg, packs, log)


def _train(cfg: RunConfig, packs: list[Pack] | None, log: Callable[[str], None]) -> TrainResult:
    device, param_dtype, autocast_dtype = resolve_precision(cfg.train.device, cfg.train.dtype)
    torch.manual_seed(cfg.train.seed)
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
    out_dir.mkdir(parents=True, exist_ok=True)
    if cfg.model.compact_vocab:
        packs = compact_vocab_of_run(cfg, packs, out_dir, write=True)
    model = build_model(cfg, packs, device, param_dtype)
    check_attention(cfg.train.attention, model, device, autocast_dtype or param_dtype)
    optimizer = make_optimizer(model, cfg)
    objective = Objective(kind=cfg.train.loss.kind, normalization=cfg.train.loss.normalization,
                          clip_low=cfg.train.loss.clip_low, clip_high=cfg.train.loss.clip_high,
                          kl_coef=cfg.train.loss.kl_coef)
    mode = build_mode(cfg)
    for line in banner(cfg, model, packs, device, param_dtype, autocast_dtype):  # what runs, before any notice
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
        state = load_checkpoint(out_dir, model, optimizer)
        start, losses = int(state["step"]), list(state.get("losses", []))
        log(f"resumed from {out_dir / 'checkpoint'} at step {start}")
        notice = reapply_optimizer_settings(optimizer, cfg)
        if notice:
            log(notice)
    metrics_file = None
    if cfg.output.metrics:  # closed in the finally below (the loop body is too long for a with-block)
        metrics_file = open_metrics(out_dir / cfg.output.metrics, start)
    # 16-bit copies of the matrix weights, cast once a step instead of once a model call
    working = WorkingWeights(model, autocast_dtype) if applies(model, autocast_dtype) else None
    peak = _peak_flops(device) if autocast_dtype is not None else None
    if peak:
        log(f"mfu: model FLOPs over this GPU's bf16 matmul ceiling, measured now: {peak / 1e12:.0f} TFLOP/s")
    autocast = (torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype is not None
                else contextlib.nullcontext())
    stats_run: list[StepStats] = []
    params = [p for p in model.parameters()]

    def save(step: int) -> None:
        save_checkpoint(out_dir, model, optimizer, {"step": step, "losses": losses})

    for line in filter(None, [describe_memory_limit(cfg.train.memory, model, device, autocast_dtype or param_dtype)]):
        log(line)
    if isinstance(mode, DfsMode):  # how large its calls may be (on this GPU), and why
        with autocast:
            log(mode.describe_block(model, packs, autocast_dtype or param_dtype))
    if model.uses_compiled(device) or (device.type == "cuda" and cfg.train.mode not in ("dense", "dense-leaf")):
        log("the first steps compile the kernels (torch.compile, Triton autotuning): expect them to take "
            "tens of seconds longer than the rest")

    # Compiled runs: the first step's compile leaves objects every later full collection would rescan (a
    # pause of ~0.5 s in a step on an H100 host): frozen after it, and every step's collections timed.
    pauses = Pauses() if _manages_gc(model, device) else None
    frozen = False
    queued: QueuedStep | None = None

    def finish(q: QueuedStep) -> None:
        """Read a queued step back (waiting for its end on the device only), then log, record and save it."""
        nonlocal frozen
        loss, grad_norm, seconds = q.read()
        losses.append(loss)
        stats = StepStats(step=q.step, loss=loss, lr=q.lr, grad_norm=grad_norm, tokens=q.tokens,
                          flat_tokens=q.flat_tokens, loss_tokens=q.loss_tokens, seconds=seconds, mem_gb=q.mem_gb,
                          mfu=q.flops / seconds / peak if peak else None, extra=q.extra)
        stats_run.append(stats)
        if q.step % cfg.output.log_every == 0 or q.step == cfg.train.steps:
            log(stats.line())
        eta = eta_line([x.seconds for x in stats_run], q.step, cfg.train.steps)
        if eta:
            log(eta)
        if metrics_file is not None:
            metrics_file.write(json.dumps(stats.to_json()) + "\n")
            metrics_file.flush()
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
            begin = None
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
                begin = torch.cuda.Event(enable_timing=True)
                begin.record()
            batch = step_batch(step, packs, cfg, objective)
            rows = [LossRows.from_pack(p) for p in batch]
            totals = BatchTotals.of(rows)
            lr = lr_at(step, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            # No host sync inside a step (the loss is summed on the device, the norm read back later): the host
            # queues the next pack while the GPU still runs the one before.
            loss_sum, tokens, flops, extra, work = None, 0, 0.0, {}, {}
            for pack, row in zip(batch, rows):
                with autocast:
                    out = mode(model, pack, row, objective, totals)
                out.backward()
                if queued is not None:  # the step before, read back once this step's first pack is queued
                    finish(queued)
                    queued = None
                pack_loss = out.loss.detach().double()  # float64, as the float sum it replaces
                loss_sum = pack_loss if loss_sum is None else loss_sum + pack_loss
                tokens += out.forward_tokens
                predicted = out.predicted_tokens
                if predicted is None:
                    predicted = row.n_rows if cfg.train.mode == "dense" else int(np.unique(row.token_R).shape[0])
                pairs = out.attention_pairs if out.attention_pairs is not None else _visible_pairs(pack, cfg.train.mode)
                # Model FLOPs count the useful work once: dfs's no-grad re-forwards (anchors) are not in them.
                useful = out.metrics.get("grad_tokens", out.forward_tokens)
                flops += _step_flops(model.args, useful, predicted, pairs)
                work = merge_work(work, out.metrics)  # dfs accounting: counts add up, peaks take the maximum
                for k, v in out.metrics.items():  # a tensor stays on the device until the step is read back
                    if isinstance(v, (int, float, torch.Tensor)) and k not in work:
                        extra[k] = extra.get(k, 0.0) + v / len(batch)
            extra.update(work)
            if pauses is not None:
                extra["gc_seconds"], extra["gc_full"] = pauses.take()
            if cfg.train.grad_clip > 0:
                norm = torch.nn.utils.clip_grad_norm_(params, cfg.train.grad_clip)
            else:
                norm = torch.linalg.vector_norm(torch.stack([p.grad.detach().norm() for p in params if p.grad is not None]))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if working is not None:
                working.refresh()
            queued = QueuedStep.queue(
                step=step + 1, lr=lr, tokens=tokens, flops=flops, extra=extra, started=t0, begin=begin,
                flat_tokens=sum(int(np.asarray(p.seq_offsets)[-1]) for p in batch), loss_tokens=totals.loss_tokens,
                # dfs's CUDA graphs keep their memory in a pool that max_memory_allocated stops seeing
                mem_gb=_mem_gb(device) + extra.get("graph_pool_bytes", 0) / 1e9,
                loss=loss_sum if loss_sum is not None else torch.zeros((), dtype=torch.float64, device=device), norm=norm)
            # Read back now, not during the next step: at the first step (the warm-up's objects are frozen
            # after it), before a checkpoint, and at the last step (so none is left queued after the loop).
            saves = cfg.output.save_every and (step + 1) % cfg.output.save_every == 0
            if step == start or saves or step + 1 == cfg.train.steps:
                finish(queued)
                queued = None
        if start < cfg.train.steps:
            save(cfg.train.steps)
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
        if metrics_file is not None:
            metrics_file.close()
    return TrainResult(output_dir=out_dir, first_step=start + 1, last_step=cfg.train.steps, losses=losses,
                       stats=stats_run)
