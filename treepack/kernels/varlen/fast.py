"""The fast varlen backends: FlashAttention-4's varlen kernel, and torch's own flash varlen.

One call per layer covers every sequence of a micro-batch; no padding, no per-sequence launches, GQA read
in the kernel (no repeated key/value heads). Both are exact causal attention (the same function as
`reference`, to bf16 rounding); tests/test_varlen_gpu.py compares them with the float32 reference.

- ``fa4``: ``flash_attn.cute.flash_attn_varlen_func`` (the optional extra ``treepack[fa4]``): Hopper sm90 and
  datacenter Blackwell sm100, bf16 / fp16, head dims 64 / 128. The kernel the field's baseline runs on Hopper.
- ``flash``: ``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.9, CUDA, bf16 / fp16): where FA4 is not
  installed. Its keyword for causality and GQA changed across torch releases: read from its signature.

Legend: T queries, N keys, H query heads, K key/value heads, E head dim, S sequences.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import Tensor

FAST_DTYPES = (torch.bfloat16, torch.float16)


def fa4_varlen(q_THE: Tensor, k_NKE: Tensor, v_NKE: Tensor, cu_q_S1: Tensor, cu_k_S1: Tensor, max_q: int,
               max_k: int, scale: float) -> Tensor:
    """FA4's varlen causal forward (its autograd function gives the backward). Where a sequence has fewer
    queries than keys, its queries are its last tokens (causality aligned at the bottom right)."""
    from flash_attn.cute.interface import flash_attn_varlen_func

    out = flash_attn_varlen_func(q_THE, k_NKE, v_NKE, cu_seqlens_q=cu_q_S1, cu_seqlens_k=cu_k_S1,
                                 max_seqlen_q=max_q, max_seqlen_k=max_k, softmax_scale=scale, causal=True)
    return out[0] if isinstance(out, tuple) else out


@functools.cache
def _torch_varlen():
    """torch's varlen entry point and the keywords its signature takes (None if this torch has none)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    return varlen_attn, causal, "enable_gqa" in params


def torch_varlen_available() -> bool:
    return _torch_varlen() is not None


def torch_varlen(q_THE: Tensor, k_NKE: Tensor, v_NKE: Tensor, cu_q_S1: Tensor, cu_k_S1: Tensor, max_q: int,
                 max_k: int, scale: float) -> Tensor:
    """torch's flash varlen causal attention (bottom-right aligned, as FA4); key/value heads repeated only
    where it reads no GQA."""
    varlen_attn, causal, gqa = _torch_varlen()
    groups = q_THE.shape[1] // k_NKE.shape[1]
    kwargs = dict(causal, scale=scale)
    if groups > 1:
        if gqa:
            kwargs["enable_gqa"] = True
        else:
            k_NKE, v_NKE = k_NKE.repeat_interleave(groups, dim=1), v_NKE.repeat_interleave(groups, dim=1)
    return varlen_attn(q_THE, k_NKE, v_NKE, cu_q_S1, cu_k_S1, max_q, max_k, **kwargs)
