"""Tree attention through torch's FlexAttention: the same contract as a ``mask_mod``.

Keys are laid out as [prefix (P) | tree (T)]; the mask_mod is
``kv < P  or  (kv - P <= q  and  q < subtree_end[kv - P])``. FlexAttention turns it into a BlockMask
(128 x 128 tiles, full / partial / empty) once per pack and prefix length: the BlockMask is cached on the
`TreeMaskInfo` when one is passed, so layers after the first reuse it. Building it evaluates the mask_mod
over all T x (P + T) pairs (compiled on CUDA, so nothing quadratic is materialised at once).

Where it runs (torch 2.4 .. 2.13):
* CUDA: forward and backward through ``torch.compile(flex_attention)``, the fused Triton template; this
  is the baseline the triton backend must beat by 1.4x (benchmarks/attention.py).
* CPU: torch offers only an unfused eager forward (it materialises the scores) and no backward, and its
  compiled CPU path rejects float64. We run the eager forward when no gradient is required and raise a
  clear error otherwise.

Shape suffixes: T pack tokens, P prefix tokens, S = P + T keys, H query heads, K kv heads, D head dim.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import Tensor

from .blocks import TreeMaskInfo

__all__ = ["FLEX_BLOCK_SIZE", "flex_block_mask", "tree_attention_flex"]

FLEX_BLOCK_SIZE = 128


def _import_flex():
    try:
        from torch.nn.attention import flex_attention as fa
    except ImportError as e:  # torch < 2.5
        raise RuntimeError(f"impl='flex' needs torch.nn.attention.flex_attention (torch >= 2.5): {e}") from e
    return fa


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    return torch.compile(_import_flex().flex_attention)


def flex_block_mask(subtree_end: Tensor | TreeMaskInfo, prefix_len: int = 0, block_size: int = FLEX_BLOCK_SIZE):
    """FlexAttention BlockMask of the tree contract over [prefix | tree] keys (cached on a TreeMaskInfo)."""
    fa = _import_flex()
    info = subtree_end if isinstance(subtree_end, TreeMaskInfo) else None
    subtree_end_T = info.subtree_end_T if info is not None else subtree_end
    key = ("flex_block_mask", prefix_len, block_size)
    if info is not None and key in info.cache:
        return info.cache[key]
    T, P = subtree_end_T.numel(), prefix_len

    def mask_mod(b, h, q_idx, kv_idx):
        tree_idx = kv_idx - P
        subtree_end = subtree_end_T[tree_idx.clamp(min=0)]
        return (kv_idx < P) | ((tree_idx <= q_idx) & (q_idx < subtree_end))

    block_mask = fa.create_block_mask(
        mask_mod,
        None,
        None,
        T,
        P + T,
        device=subtree_end_T.device,
        BLOCK_SIZE=block_size,
        _compile=subtree_end_T.device.type == "cuda",
    )
    if info is not None:
        info.cache[key] = block_mask
    return block_mask


def tree_attention_flex(
    q_THD: Tensor,
    k_TKD: Tensor,
    v_TKD: Tensor,
    subtree_end: Tensor | TreeMaskInfo,
    *,
    prefix_k: Tensor | None = None,
    prefix_v: Tensor | None = None,
    scale: float,
) -> Tensor:
    """FlexAttention backend of `tree_attention` (inputs validated by the api; no backward on CPU: the
    registry's `flex_supports` refuses such a call before it gets here)."""
    fa = _import_flex()
    on_cuda = q_THD.device.type == "cuda"
    H = q_THD.shape[1]
    P = 0 if prefix_k is None else prefix_k.shape[0]
    keys_SKD, values_SKD = k_TKD, v_TKD
    if P:
        keys_SKD = torch.cat([prefix_k, k_TKD], dim=0)
        values_SKD = torch.cat([prefix_v, v_TKD], dim=0)
    block_mask = flex_block_mask(subtree_end, P)
    q_1HTD = q_THD.permute(1, 0, 2).unsqueeze(0)
    k_1KSD = keys_SKD.permute(1, 0, 2).unsqueeze(0)
    v_1KSD = values_SKD.permute(1, 0, 2).unsqueeze(0)
    gqa = k_TKD.shape[1] != H
    if on_cuda:
        out_1HTD = _compiled_flex()(q_1HTD, k_1KSD, v_1KSD, block_mask=block_mask, scale=scale, enable_gqa=gqa)
    else:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
            out_1HTD = fa.flex_attention(q_1HTD, k_1KSD, v_1KSD, block_mask=block_mask, scale=scale, enable_gqa=gqa)
    return out_1HTD.squeeze(0).permute(1, 0, 2)
