"""Causal attention per sequence in pure torch: the oracle of the varlen backends, and the CPU path.

On CUDA one ``is_causal`` SDPA call per sequence (flash / memory-efficient kernels, O(L) memory). Elsewhere
SDPA's math path keeps the O(L^2) probabilities for backward (27 GB in float64 for the 53 sequences of two
16k-token tau-bench packs), so there a sequence runs in query chunks of at most `CAUSAL_SCORE_BUDGET` scores,
each checkpointed: memory O(chunk) at the price of recomputing the forward once.

Legend: T tokens of the call, H query heads, K key/value heads, E head dim, L one sequence's tokens, C
queries of a chunk, S keys of a chunk.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

CAUSAL_SCORE_BUDGET = 1 << 24  # score elements per SDPA call off CUDA (128 MiB in float64)


def _causal_chunk(q_HCE: Tensor, k_HSE: Tensor, v_HSE: Tensor, q0: int) -> Tensor:
    """Queries q0..q0+C of one sequence over its keys 0..S-1 (S = q0 + C), causally."""
    C, S = q_HCE.shape[1], k_HSE.shape[1]
    q, k, v = q_HCE[None], k_HSE[None], v_HSE[None]  # [1, H, *, E]: the fused kernels need 4-d inputs
    if q0 == 0 and C == S:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)[0]
    dev = q_HCE.device
    visible_CS = torch.arange(S, device=dev)[None, :] <= torch.arange(q0, q0 + C, device=dev)[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible_CS)[0]


def causal_attention_reference(q_THE: Tensor, k_TKE: Tensor, v_TKE: Tensor, lengths: Sequence[int]) -> Tensor:
    """Causal attention within each of the concatenated sequences of ``lengths`` (summing to T); softmax
    scale 1 / sqrt(E). Differentiable in q, k and v."""
    T, H = q_THE.shape[:2]
    if sum(lengths) != T:
        raise ValueError(f"causal attention: sequence lengths sum to {sum(lengths)}, tokens T={T}")
    groups = H // k_TKE.shape[1]
    recompute = (torch.is_grad_enabled() and q_THE.device.type != "cuda"
                 and (q_THE.requires_grad or k_TKE.requires_grad or v_TKE.requires_grad))
    outs, start = [], 0
    for n in lengths:
        q_HLE = q_THE[start : start + n].transpose(0, 1)
        k_HLE = k_TKE[start : start + n].transpose(0, 1).repeat_interleave(groups, dim=0)
        v_HLE = v_TKE[start : start + n].transpose(0, 1).repeat_interleave(groups, dim=0)
        chunk = n if q_THE.device.type == "cuda" else max(1, CAUSAL_SCORE_BUDGET // (H * n))
        parts = []
        for q0 in range(0, n, chunk):
            q1 = min(q0 + chunk, n)
            args = (q_HLE[:, q0:q1], k_HLE[:, :q1], v_HLE[:, :q1], q0)
            parts.append(checkpoint(_causal_chunk, *args, use_reentrant=False) if recompute else _causal_chunk(*args))
        outs.append((torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]).transpose(0, 1))
        start += n
    return torch.cat(outs, dim=0) if len(outs) != 1 else outs[0]
