"""Causal varlen attention: validation and dispatch (``impl = auto | sdpa | fa4 | flash``).

``sdpa`` is the per-sequence path of `reference` (any device and dtype, float64 included: the equivalence
tests and every CPU run); ``fa4`` and ``flash`` are the one-call kernels of `fast`. ``auto`` takes FA4 where
it runs (installed, Hopper / Blackwell, 16-bit, head dim 64 / 128), else torch's flash varlen on CUDA in 16 bit,
else ``sdpa``. On a CPU ``auto`` is therefore ``sdpa``, bit for bit what the dense baselines always ran there.

`CausalBatch` holds a micro-batch's lengths and their cumulative offsets on the device, built once per
forward and read by every layer (no per-layer host-to-device copy). `chain_forest_lengths` recognises a tree
mask that is a forest of chains, which this kernel computes exactly (tree mode hands such packs here).

Legend: T tokens, H query heads, K key/value heads, E head dim, S sequences.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from treepack.kernels.varlen.fast import FAST_DTYPES, fa4_varlen, torch_varlen, torch_varlen_available
from treepack.kernels.varlen.reference import causal_attention_reference

VARLEN_IMPLS = ("auto", "sdpa", "fa4", "flash")
FA4_VARLEN_HEAD_DIMS = (64, 128)


@dataclass(frozen=True)
class CausalBatch:
    """Independent causal sequences laid back to back: ``lengths`` (each >= 1) and, on the device the call
    runs on, ``cu_seqlens_S1`` (int32 [S + 1], 0 first) and the longest length."""

    lengths: tuple[int, ...]
    cu_seqlens_S1: Tensor | None = None
    max_len: int = 0

    @classmethod
    def of(cls, lengths: Sequence[int], device: torch.device | str | None = None) -> CausalBatch:
        lengths = tuple(int(n) for n in lengths)
        if any(n < 1 for n in lengths):
            raise ValueError(f"sequence lengths must be >= 1, got {min(lengths)}")
        if device is None or torch.device(device).type != "cuda":
            return cls(lengths, None, max(lengths, default=0))
        cu = np.zeros(len(lengths) + 1, dtype=np.int32)
        np.cumsum(lengths, out=cu[1:])
        cu_S1 = torch.from_numpy(cu).pin_memory().to(device, non_blocking=True)
        return cls(lengths, cu_S1, max(lengths, default=0))

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)


def unsupported_reason(impl: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why ``impl`` cannot run on this device, dtype and head dim (None: it can)."""
    if impl == "sdpa":
        return None
    if device.type != "cuda":
        return f"the {impl} varlen backend needs CUDA tensors, got {device}"
    if dtype not in FAST_DTYPES:
        return f"the {impl} varlen backend needs bfloat16 or float16, got {str(dtype).removeprefix('torch.')}"
    if impl == "fa4":
        from treepack.kernels.tree_attention.fa4 import fa4_importable, fa4_supported_device

        if head_dim not in FA4_VARLEN_HEAD_DIMS:
            return f"the fa4 varlen backend supports head dims 64, 128, got D={head_dim}"
        if not fa4_supported_device(device):
            return "the fa4 varlen backend needs a Hopper (sm90) or Blackwell (sm100) GPU"
        if not fa4_importable():
            return "flash-attn-4 is not installed (pip install 'treepack[fa4]')"
        return None
    if impl == "flash":
        return None if torch_varlen_available() else "this torch has no torch.nn.attention.varlen"
    return f"unknown varlen backend {impl!r} (one of {', '.join(VARLEN_IMPLS)})"


def varlen_unsupported_reason(impl: str, q: Tensor) -> str | None:
    """`unsupported_reason` for the queries ``q`` ([T, H, E])."""
    return unsupported_reason(impl, q.device, q.dtype, int(q.shape[-1]))


def supports_fa4(call) -> str | None:
    """The registry's check (`treepack.kernels.tree_attention.registry.AttentionCall`) for FA4 varlen."""
    return unsupported_reason("fa4", call.device, call.dtype, call.head_dim)


def supports_flash(call) -> str | None:
    """The registry's check for torch's flash varlen."""
    return unsupported_reason("flash", call.device, call.dtype, call.head_dim)


def run_sdpa(q_THE: Tensor, k_TKE: Tensor, v_TKE: Tensor, batch: CausalBatch | Sequence[int]) -> Tensor:
    """The registry's run of the per-sequence path."""
    lengths = batch.lengths if isinstance(batch, CausalBatch) else tuple(batch)
    return causal_attention_reference(q_THE, k_TKE, v_TKE, lengths)


def run_fa4(q_THE: Tensor, k_TKE: Tensor, v_TKE: Tensor, batch: CausalBatch | Sequence[int]) -> Tensor:
    return causal_varlen_attention(q_THE, k_TKE, v_TKE, batch, impl="fa4")


def run_flash(q_THE: Tensor, k_TKE: Tensor, v_TKE: Tensor, batch: CausalBatch | Sequence[int]) -> Tensor:
    return causal_varlen_attention(q_THE, k_TKE, v_TKE, batch, impl="flash")


def pick_varlen(q: Tensor) -> str:
    """The backend ``impl="auto"`` runs for these inputs: fa4, else flash, else sdpa."""
    for impl in ("fa4", "flash"):
        if varlen_unsupported_reason(impl, q) is None:
            return impl
    return "sdpa"


def causal_varlen_attention(q_THE: Tensor, k_TKE: Tensor, v_TKE: Tensor, batch: CausalBatch | Sequence[int], *,
                            impl: str = "auto") -> Tensor:
    """Causal attention within each sequence of ``batch`` (lengths summing to T), softmax scale 1 / sqrt(E).

    Args:
        q_THE: [T, H, E] queries; k_TKE, v_TKE: [T, K, E] keys and values, H % K == 0 (GQA).
        batch: a `CausalBatch` (built once per forward on the device) or the lengths.
        impl: auto | sdpa | fa4 | flash (module doc).
    Returns: [T, H, E] in q's dtype, differentiable in q, k and v.
    """
    if impl not in VARLEN_IMPLS:
        raise ValueError(f"impl must be one of {', '.join(repr(i) for i in VARLEN_IMPLS)}, got {impl!r}")
    if not isinstance(batch, CausalBatch):
        batch = CausalBatch.of(batch, q_THE.device)
    T = q_THE.shape[0]
    if batch.num_tokens != T:
        raise ValueError(f"causal attention: sequence lengths sum to {batch.num_tokens}, tokens T={T}")
    if impl == "auto":
        impl = pick_varlen(q_THE)
    reason = varlen_unsupported_reason(impl, q_THE)
    if reason is not None:
        raise ValueError(f"impl={impl!r}: {reason}")
    if impl == "sdpa" or T == 0:
        return causal_attention_reference(q_THE, k_TKE, v_TKE, batch.lengths)
    cu_S1 = batch.cu_seqlens_S1
    if cu_S1 is None or cu_S1.device != q_THE.device:
        cu_S1 = CausalBatch.of(batch.lengths, q_THE.device).cu_seqlens_S1
    scale = 1.0 / math.sqrt(q_THE.shape[-1])
    run = fa4_varlen if impl == "fa4" else torch_varlen
    return run(q_THE.contiguous(), k_TKE.contiguous(), v_TKE.contiguous(), cu_S1, cu_S1, batch.max_len,
               batch.max_len, scale)


def chain_forest_lengths(subtree_end_T: np.ndarray | Tensor) -> tuple[int, ...] | None:
    """The chain lengths when the tree mask ``k <= q < subtree_end[k]`` is a forest of chains (each token's
    subtree runs to its chain's end, so the mask is block-diagonal causal), else None.

    Token k+1 lies in k's subtree iff ``k + 1 < subtree_end[k]``; the forest is one of chains iff then
    ``subtree_end[k + 1] == subtree_end[k]`` (k's only child is k+1), and each chain starting at s of length L
    has ``subtree_end[s] == s + L``."""
    if isinstance(subtree_end_T, Tensor):
        subtree_end_T = subtree_end_T.detach().cpu().numpy()
    end_T = np.asarray(subtree_end_T, dtype=np.int64)
    T = end_T.shape[0]
    if T == 0:
        return None
    inside_K = end_T[:-1] > np.arange(1, T)  # k + 1 is in k's subtree
    if np.any(end_T[1:][inside_K] != end_T[:-1][inside_K]):
        return None
    starts = np.flatnonzero(np.concatenate(([True], ~inside_K)))
    lengths = np.diff(np.append(starts, T))
    if np.any(end_T[starts] != starts + lengths):
        return None
    return tuple(int(n) for n in lengths)
