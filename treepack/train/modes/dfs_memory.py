"""How many tokens a dfs call may forward with grad on this GPU: ``[train.dfs] block_size = "auto"``.

A fixed block is either too small for a small model or too large for a larger one. At 2,048 tokens a call,
tau-bench's 32K packs took 4.5x tree mode's time for Qwen3-0.6B on an H100, where the memory allowed a pack in
one call (1.00x). For a 1.7B model, a 7.5k-token call adds 26 GB to 31 GB of state. So the block follows the
memory.

A call's peak is
- the run's state: the weights, their gradients and AdamW's two moments (4x the parameters' bytes), plus the
  16-bit working copies of the matrices under autocast;
- the path cache: the pack's longest path, its K/V in the compute dtype and their float32 gradients;
- the head's logits for one chunk of rows (``train.logits_chunk``), and ``OVERHEAD_BYTES`` of workspace;
- the call's saved activations, which grow with its tokens (an anchor merged into the call and kept segments
  add theirs).

The memory left for the activations, out of ``AUTO_FRACTION`` of what this process can have (free plus what
torch already holds), is divided by an estimate per token, and that gives the block. The estimate counts what a
layer keeps for its backward, times ``MARGIN``:
- its inputs to the norms, in the residual stream's dtype;
- in the compute dtype: the normed inputs, q / k / v, the attention output, and the MLP's three F-wide tensors.

Measured on an H100 (Qwen3-0.6B shape, compiled layers, FA4, calls of 1.5k-14.8k tokens), a call costs 1.32 MB
a token above a 0.56 GB intercept. The count gives 1.20 MB, and 1.51 MB with the margin
(benchmarks/results/2026-11-27-dfs-auto-block-h100.md).

With CUDA graphs, a captured call's activations stay in the graphs' pool while eager calls run beside it, so the
estimate counts them twice. Blocks are multiples of ``GRANULE`` tokens, so packs of similar paths share call
shapes. Off CUDA the block is ``CPU_BLOCK``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from treepack.pack.layout import Pack
from treepack.train.memory_limit import applied_limit, state_bytes

AUTO_FRACTION = 0.85  # of the memory this process can have: the allocator's fragmentation and the context
OVERHEAD_BYTES = 512 << 20  # what no count above covers: the pack's uploads and index arrays, library workspaces
MARGIN = 1.25  # over the counted activations: measured 1.10x the count (module doc)
GRANULE = 1024
CPU_BLOCK = 8192


def longest_path(pack: Pack) -> int:
    """Tokens on the pack's longest root-to-leaf path, the path cache's rows (positions are depths; an offset
    start only makes this larger)."""
    n = int(pack.n_real)
    return int(np.asarray(pack.position_ids[:n]).max(initial=-1)) + 1


def token_bytes(model: torch.nn.Module, compute_dtype: torch.dtype) -> float:
    """Estimated bytes a call keeps per token for its backward, over all layers, margin included."""
    a = model.args
    D, F, HE, KE = a.hidden_size, a.intermediate_size, a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    act = torch.finfo(compute_dtype).bits // 8
    residual = torch.finfo(model.dtype).bits // 8
    layer = act * (2 * D + 2 * HE + 2 * KE + 3 * F) + residual * 2 * D
    if getattr(model, "activation_checkpointing", False):  # each layer's input, and one layer recomputed at a time
        return MARGIN * (a.num_layers * D * residual + layer)
    return MARGIN * a.num_layers * layer


def path_row_bytes(model: torch.nn.Module, compute_dtype: torch.dtype) -> int:
    """One path-cache row: K and V of every layer, and their gradients (float32 for 16-bit K/V)."""
    a = model.args
    act = torch.finfo(compute_dtype).bits // 8
    return a.num_layers * 2 * a.num_kv_heads * a.head_dim * (act + max(act, 4))


def head_bytes(model: torch.nn.Module, chunk_rows: int) -> float:
    """One chunk of logits (16-bit and float32), margin included."""
    return MARGIN * chunk_rows * model.args.vocab_size * 6


def available_bytes(device: torch.device) -> int:
    """``AUTO_FRACTION`` of the memory this process can have on ``device``: free plus what torch holds, within
    ``train.memory_limit`` if one is set (`treepack.train.memory_limit`)."""
    free, _ = torch.cuda.mem_get_info(device)
    can = free + torch.cuda.memory_reserved(device)
    limit = applied_limit(device)
    return int(AUTO_FRACTION * (can if limit is None else min(can, limit)))


@dataclass(frozen=True)
class BlockPlan:
    """One auto block and the figures behind it (bytes)."""

    tokens: int
    available: int
    state: int
    cache: int
    head: int  # the logits' chunk and OVERHEAD_BYTES
    per_token: float
    extra_tokens: int = 0

    @property
    def short(self) -> bool:
        """Whether the memory left allows less than one granule: the block is a granule and may not fit."""
        return self.available - self.state - self.cache - self.head < (GRANULE + self.extra_tokens) * self.per_token

    def line(self) -> str:
        gb = 1e9
        room = self.available - self.state - self.cache - self.head
        text = (f"dfs: calls of up to {self.tokens:,} tokens (dfs.block_size = \"auto\": {max(room, 0) / gb:.1f} of "
                f"{self.available / gb:.1f} GB for a call's activations at ~{self.per_token / 1e6:.2f} MB a token, "
                f"after {self.state / gb:.1f} GB of weights and optimizer state, {self.cache / gb:.1f} GB of path "
                f"cache, {self.head / gb:.1f} GB of logits and workspace)")
        if self.short:
            text += "; memory is short: lower train.logits_chunk or turn on train.activation_checkpointing"
        return text


def plan_block(model: torch.nn.Module, *, path_tokens: int, chunk_rows: int, compute_dtype: torch.dtype,
               graphs: bool, available: int, extra_tokens: int = 0, most: int | None = None) -> BlockPlan:
    """The largest block (a multiple of ``GRANULE``, at least one) whose call, with ``extra_tokens`` beside it
    (anchors merged into a call, kept segments), fits ``available`` bytes beside the state, a
    ``path_tokens``-row path cache, the logits and ``OVERHEAD_BYTES``; capped at ``most`` tokens (a pack's size)."""
    per_token = token_bytes(model, compute_dtype) * (2 if graphs else 1)
    state = state_bytes(model, compute_dtype)
    cache = path_tokens * path_row_bytes(model, compute_dtype)
    head = int(head_bytes(model, chunk_rows)) + OVERHEAD_BYTES
    room = available - state - cache - head
    tokens = max((int(room // per_token) - extra_tokens) // GRANULE * GRANULE, GRANULE)
    if most is not None:
        tokens = min(tokens, max(-(-most // GRANULE) * GRANULE, GRANULE))
    return BlockPlan(tokens=tokens, available=available, state=state, cache=cache, head=head, per_token=per_token,
                     extra_tokens=extra_tokens)


class AutoBlock:
    """A run's auto block: the memory this process can have, read once (before the first step, while the
    optimizer's moments do not exist yet: the plan counts them), and a plan per pack."""

    def __init__(self) -> None:
        self.available: int | None = None

    def plan(self, model: torch.nn.Module, pack: Pack, *, chunk_rows: int, graphs: bool, extra_tokens: int,
             compute_dtype: torch.dtype | None = None) -> BlockPlan | None:
        """``pack``'s block and the figures behind it; None off a GPU. ``compute_dtype`` None: autocast's."""
        if model is None or model.device.type != "cuda":
            return None
        if compute_dtype is None:
            on = torch.is_autocast_enabled("cuda")
            compute_dtype = torch.get_autocast_dtype("cuda") if on else model.dtype
        if self.available is None:
            self.available = available_bytes(model.device)
        return plan_block(model, path_tokens=longest_path(pack), chunk_rows=chunk_rows, compute_dtype=compute_dtype,
                          graphs=graphs, available=self.available, extra_tokens=extra_tokens, most=int(pack.n_real))

    def tokens(self, model: torch.nn.Module | None, pack: Pack, **options) -> int:
        plan = self.plan(model, pack, **options)
        return plan.tokens if plan is not None else CPU_BLOCK

    def describe(self, model: torch.nn.Module, packs: list[Pack], **options) -> str:
        """The start line: the block of the pack with the longest path and why (the other packs' blocks are at
        least as large)."""
        plan = self.plan(model, max(packs, key=longest_path), **options)
        if plan is None:
            return f'dfs: calls of up to {CPU_BLOCK:,} tokens (dfs.block_size = "auto" off a GPU)'
        return plan.line()
