"""Which tree-attention backend runs a call under ``impl="auto"``: a measured table, not a guess.

The rows below are fwd+bwd times measured on one GPU (bf16, Hq 16 x D 128, Hkv 8) for the exact backends,
from ``benchmarks/attention_backends.py`` (report: benchmarks/results/2026-11-25-attention-fa4-h100.md). Two
regimes show in them:

* small calls (dfs chunks, short packs): every backend sits on a floor of ~1-1.6 ms per fwd+bwd of host
  and launch time, FA4's the highest (its Python launch path builds compile keys and block-sparse views per
  call: 1.3-1.6 ms against 1.0-1.5 ms for the Triton kernel), so the Triton kernel wins;
* large calls: the time is FLOPs over the kernel's rate, FA4's FA3-class Hopper kernels at 400-440 TFLOP/s
  on treepack's packs and 490-610 on long chains, against 320-385 for the FA2-style Triton kernel, so FA4
  wins by 1.2-1.6x.

`pick_backend` therefore runs FA4 (when it is installed and supports the GPU, dtype and head dim) for calls of
at least `FA4_MIN_FLOPS` visible-pair FLOPs (fwd+bwd = 14 · pairs · D · Hq; the measured crossover lies
between 4.9e11 and 5.4e11) and for whole packs of at least `FA4_MIN_TOKENS` tokens, else the Triton kernel,
else the reference. `attention_seconds` turns the same table into a time estimate (per-call floor + FLOPs /
rate) for choosing between training modes (``mode = "auto"``): the dense baseline's per-sequence SDPA (cuDNN)
has its own row.

Shape suffixes: T call tokens, P cached-prefix tokens.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

__all__ = ["FA4_MIN_FLOPS", "FA4_MIN_TOKENS", "MEASURED", "Rate", "attention_seconds", "interpreting", "pick_backend",
           "triton_importable", "triton_supports", "visible_pair_flops"]


@dataclass(frozen=True)
class Rate:
    """A backend's fwd+bwd cost model on one GPU: ``max(floor_ms, flops / tflops)``."""

    backend: str  # fa4 | triton | sdpa (dense causal, per sequence; cuDNN on Hopper)
    tflops: float  # fwd+bwd TFLOP/s over visible pairs on large calls (treepack's 32K packs / long chains)
    floor_ms: float  # fwd+bwd time of a small call (host + launch bound)


# Measured on 1x H100 80GB HBM3, torch 2.11.0+cu130, triton 3.6.0, flash-attn-4 4.0.0b36 (see the module doc):
# tflops = fwd+bwd per visible pair on treepack's 32K packs (fa4 400-441, triton 322-336 on the four packs with
# C_attn < 3; 258 / 313 on ToolBench's short branches), floor_ms = one small call's fwd+bwd (T 512-2048).
MEASURED: dict[str, dict[str, Rate]] = {
    "H100": {
        "fa4": Rate("fa4", tflops=425.0, floor_ms=1.5),
        "triton": Rate("triton", tflops=330.0, floor_ms=1.3),
        "sdpa": Rate("sdpa", tflops=340.0, floor_ms=0.45),
        # varlen over sequences laid back to back (treepack.kernels.varlen), one call: 1x H200, 32K packs of
        # tau-bench, tau2, tau2-think, agentic-think (benchmarks/results/2026-11-28-attention-varlen-h200.md)
        "fa4-varlen": Rate("fa4-varlen", tflops=525.0, floor_ms=1.5),
        "flash-varlen": Rate("flash-varlen", tflops=285.0, floor_ms=0.5),
    },
    # 1x H200, the same versions, every backend in one process on the first 32K pack of tau-bench, ToolBench,
    # tau2, tau2-think and agentic-think (benchmarks/results/2026-11-28-attention-varlen-h200.md): fa4 489-536
    # per pair on the long-context packs (368 on ToolBench's short branches), fa4-varlen 520-553 (412), triton
    # 326-359, cuDNN SDPA 361-435 on the packs of few leaves, torch varlen 277-301; floors as on the H100.
    # Before, the H200 used the H100's row: the tree kernel at 425 against varlen at 525, so `mode = "auto"`
    # priced tree attention 1.24x where the H200 runs it 1.04-1.07x (tau-bench, tau2).
    "H200": {
        "fa4": Rate("fa4", tflops=500.0, floor_ms=1.5),
        "triton": Rate("triton", tflops=340.0, floor_ms=1.3),
        "sdpa": Rate("sdpa", tflops=360.0, floor_ms=0.45),
        "fa4-varlen": Rate("fa4-varlen", tflops=525.0, floor_ms=1.5),
        "flash-varlen": Rate("flash-varlen", tflops=285.0, floor_ms=0.5),
    },
}
# fwd+bwd visible-pair FLOPs from which FA4 beats the Triton kernel: measured crossover between 4.9e11 (tree,
# T 2048 over an 8192-key prefix: triton 1.45 ms vs fa4 1.75) and 5.4e11 (chain, same shape: fa4 1.30 vs 1.56)
FA4_MIN_FLOPS = 6e11
# ... and a whole pack of at least this many tokens (no cached prefix) goes to FA4 whatever its pair count: a pack
# of many short sequences has few pairs but T / 128 query blocks, where the Triton kernel's backward is slow. On
# the first 32K pack of GSM8K (5.6e6 pairs, 1.6e11 FLOPs) FA4 took 2.04 ms against the Triton kernel's 4.2, on
# hh-rlhf's 2.06 against 4.1 (1x H200, benchmarks/results/2026-11-28-modes-h200.md); in a GSM8K tree step the
# Triton kernel took 359 of its 1,010 ms of GPU time. (A random tree of T 32K, every token branching, was the one
# shape where FA4 ran 5% slower: 3.00 against 2.86 ms, 1x H100.)
FA4_MIN_TOKENS = 16384
TRITON_HEAD_DIMS = (32, 64, 128)
TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


_TRITON_IMPORTABLE: bool | None = None  # cached answer (a plain global: torch.compile traces it as a constant)


def interpreting() -> bool:
    """Triton's interpreter is on (``TRITON_INTERPRET=1``): the Triton kernels run on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_importable() -> bool:
    global _TRITON_IMPORTABLE
    if _TRITON_IMPORTABLE is None:
        try:
            import triton  # noqa: F401

            _TRITON_IMPORTABLE = True
        except ImportError:
            _TRITON_IMPORTABLE = False
    return _TRITON_IMPORTABLE


def visible_pair_flops(pairs: int, heads: int, head_dim: int) -> float:
    """fwd+bwd FLOPs of attention over ``pairs`` visible (query, key) pairs: 4·D per pair and head forward,
    2.5x that backward (the count every TFLOP/s figure of treepack uses)."""
    return 14.0 * pairs * head_dim * heads


def _gpu_rates(device: torch.device | None) -> dict[str, Rate]:
    name = torch.cuda.get_device_name(device) if device is not None and device.type == "cuda" else ""
    for key, rates in MEASURED.items():
        if key in name:
            return rates
    return MEASURED["H100"]  # another GPU: the H100's row


def attention_seconds(backend: str, pairs: int, heads: int, head_dim: int, calls: int = 1,
                      device: torch.device | None = None) -> float:
    """Estimated fwd+bwd seconds of ``calls`` attention calls over ``pairs`` visible pairs in all."""
    rate = _gpu_rates(device)[backend]
    per_call = visible_pair_flops(pairs, heads, head_dim) / max(calls, 1) / (rate.tflops * 1e12)
    return calls * max(rate.floor_ms * 1e-3, per_call)


def pick_backend(num_tokens: int, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device, *,
                 prefix_len: int = 0, pairs: int | None = None, whole_tokens: int = 0) -> str:
    """The exact backend ``impl="auto"`` runs for a call of ``num_tokens`` queries (Hq ``heads`` x ``head_dim``)
    over ``prefix_len`` cached keys plus the call's own: fa4 | triton | reference.

    ``pairs``: the call's visible pairs when known (a pack's `visible_pairs`); else T·(T+1)/2 + P·T, the
    causal bound, which overestimates branchy packs and only moves the choice near the crossover.
    ``whole_tokens``: for a piece of a pack cut across data-parallel ranks, the whole pack's tokens. The piece
    runs the kernel its pack would: a piece under `FA4_MIN_TOKENS` otherwise went to the Triton kernel, which
    the run had never built, and its rank compiled mid-run (rehearsed on tau-bench, 4 ranks: step 6's first
    cut compiled, that step's measured imbalance 247 points off the prediction). The kernels' speeds differ by
    ~0.2 ms a call there."""
    from .fa4 import FA4_DTYPES, FA4_HEAD_DIMS, fa4_importable, fa4_supported_device

    if device.type != "cuda":
        return "reference"
    if pairs is None:
        pairs = num_tokens * (num_tokens + 1) // 2 + prefix_len * num_tokens
    large = (visible_pair_flops(pairs, heads, head_dim) >= FA4_MIN_FLOPS
             or (prefix_len == 0 and max(num_tokens, whole_tokens) >= FA4_MIN_TOKENS))
    if (dtype in FA4_DTYPES and head_dim in FA4_HEAD_DIMS and fa4_supported_device(device) and large
            and fa4_importable()):
        return "fa4"
    if dtype in TRITON_DTYPES and head_dim in TRITON_HEAD_DIMS and triton_importable():
        return "triton"
    return "reference"


def triton_supports(call) -> str | None:
    """Why the triton backend cannot run a `registry.AttentionCall`, or None if it can."""
    if call.device.type != "cuda" and not (call.device.type == "cpu" and interpreting()):
        return f"the triton backend needs CUDA tensors (or TRITON_INTERPRET=1 on CPU), got {call.device}"
    if call.dtype not in TRITON_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in TRITON_DTYPES)
        return f"the triton backend supports dtypes {names}, got {str(call.dtype).removeprefix('torch.')}"
    if call.head_dim not in TRITON_HEAD_DIMS:
        dims = ", ".join(str(d) for d in TRITON_HEAD_DIMS)
        return f"the triton backend supports head dims {dims}, got D={call.head_dim}"
    if not triton_importable():
        return "triton is not installed"
    return None
