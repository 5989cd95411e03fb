"""The numbers of one training step: its fixed-format line, its ``metrics.jsonl`` record, its FLOPs and MFU.

Each step prints one line, e.g.
``step 00042 | loss 1.234 | tokens 12.3k | tok/s 123k | flat tok/s 456k | mem 12.3 GB | mfu 41%``:
``tokens`` are the tokens the model forwarded in the step (N_tree for tree mode), ``flat tok/s`` the
dense-equivalent throughput (the batch's sum of sequence lengths per second), ``mem`` the peak (CUDA:
allocated this step; CPU: the process's peak RSS) and ``mfu`` (CUDA, 16-bit only) the useful FLOPs of
the FLOP model (`step_flops`: 6 x non-embedding params x tokens + 6 x d_model x vocab x predicted tokens + 12 x
layers x heads x head_dim x visible attention pairs) over the bf16 matmul ceiling measured on the device at start
(`peak_flops`). The same numbers go to ``metrics.jsonl`` (and TensorBoard / W&B: `treepack.train.run_log`). A
step's numbers stay on the device until they are read (`QueuedStep`), so the host never drains the GPU between
steps.
"""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from treepack.pack.layout import Pack
from treepack.train.architecture import ModelArgs

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
        if self.extra.get("compiles"):  # this step stopped for the compiler (`compile_count`)
            parts.append(f"compiled {self.extra['compiles']:.0f}")
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
    share: object = None  # the step's `treepack.train.sync.Share`: what a data-parallel step's numbers are gathered over

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


def visible_pairs(pack: Pack, mode: str) -> int:
    """Query-key pairs the attention of ``mode`` computes over ``pack`` (causal per sequence for dense)."""
    if mode == "dense":
        lengths = np.diff(np.asarray(pack.seq_offsets, dtype=np.int64))
        return int((lengths * (lengths + 1) // 2).sum())
    n = int(pack.n_real)
    return int((np.asarray(pack.subtree_end[:n], dtype=np.int64) - np.arange(n)).sum())


def step_flops(args: ModelArgs, tokens: int, predicted: int, pairs: int) -> float:
    """docs/design.md §9's FLOP model (forward + backward)."""
    return (6.0 * args.num_params(embeddings=False) * tokens + 6.0 * args.hidden_size * args.vocab_size * predicted
            + 12.0 * args.num_layers * args.num_heads * args.head_dim * pairs)


_MEASURED_PEAK: dict[int, float] = {}


def peak_flops(device: torch.device) -> float | None:
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


def mem_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux reports KiB

