"""Pure-torch tree attention: the oracle every other backend is tested against.

Plain softmax attention under the mask ``k <= q < subtree_end[k]`` (plus P cached-prefix keys visible to
every query), written so that it is obviously right and still usable on real packs:

* Query chunks. Queries [q0, q1) only ever see keys < q1 (k <= q), so a chunk builds an
  [Hq, C, P + q1] score block instead of [Hq, T, P + T]. For T = 32k, Hq = 16 and float32 the full matrix
  would be 64 GiB; the default budget of 2^27 score elements (512 MiB in float32) gives chunks of 256
  queries and never more than one chunk alive at a time.
* Autograd through checkpointed chunks: with gradients enabled and more than one chunk, each chunk runs
  under `torch.utils.checkpoint`, so backward recomputes the chunk's probabilities instead of keeping all
  of them (O(T^2) memory otherwise). The math is torch's own, differentiated by torch: nothing to trust.
* Any dtype, any device. Computes in the input dtype, like a same-dtype torch run (float64 on CPU is what
  the equivalence tests use, ~1e-15 relative error). Every row has at least its own key (subtree_end[q]
  > q), so no row of the softmax is empty.
* Chunk-size invariant: a row's result does not depend on which chunk it lands in beyond the extra
  masked zeros in its softmax sum, which are exact.

Shape suffixes: T pack tokens, P prefix tokens, S = P + keys of a chunk, C queries of a chunk,
H query heads, K kv heads, G = H // K (GQA group), D head dim.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

__all__ = ["DEFAULT_SCORE_BUDGET", "tree_attention_reference"]

DEFAULT_SCORE_BUDGET = 1 << 27  # score elements per chunk (Hq * C * (P + q1))


def _chunk(
    q_CHD: Tensor,
    k_TKD: Tensor,
    v_TKD: Tensor,
    prefix_k_PKD: Tensor | None,
    prefix_v_PKD: Tensor | None,
    subtree_end_T: Tensor,
    q0: int,
    scale: float,
) -> Tensor:
    # Slicing and concatenation happen in here so that a checkpointed chunk saves only views of the
    # caller's tensors, never a copy of its keys.
    C, H, D = q_CHD.shape
    K = k_TKD.shape[1]
    q1 = q0 + C
    keys_SKD, values_SKD = k_TKD[:q1], v_TKD[:q1]
    prefix_len = 0 if prefix_k_PKD is None else prefix_k_PKD.shape[0]
    if prefix_len:
        keys_SKD = torch.cat([prefix_k_PKD, keys_SKD], dim=0)
        values_SKD = torch.cat([prefix_v_PKD, values_SKD], dim=0)
    S = keys_SKD.shape[0]
    q_KGCD = q_CHD.view(C, K, H // K, D).permute(1, 2, 0, 3)
    scores_KGCS = torch.einsum("kgcd,skd->kgcs", q_KGCD, keys_SKD) * scale
    pos_q_C = torch.arange(q0, q1, device=q_CHD.device)
    pos_k_S = torch.arange(S - prefix_len, device=q_CHD.device)
    tree_CS = (pos_k_S[None, :] <= pos_q_C[:, None]) & (
        pos_q_C[:, None] < subtree_end_T[: S - prefix_len][None, :].long()
    )
    if prefix_len:
        tree_CS = torch.cat([tree_CS.new_ones(C, prefix_len), tree_CS], dim=1)
    scores_KGCS = scores_KGCS.masked_fill(~tree_CS, float("-inf"))
    probs_KGCS = torch.softmax(scores_KGCS, dim=-1)
    out_KGCD = torch.einsum("kgcs,skd->kgcd", probs_KGCS, values_SKD)
    return out_KGCD.permute(2, 0, 1, 3).reshape(C, H, D)


def tree_attention_reference(
    q_THD: Tensor,
    k_TKD: Tensor,
    v_TKD: Tensor,
    subtree_end_T: Tensor,
    *,
    prefix_k_PKD: Tensor | None = None,
    prefix_v_PKD: Tensor | None = None,
    scale: float,
    chunk_size: int | None = None,
    score_budget: int = DEFAULT_SCORE_BUDGET,
) -> Tensor:
    """Tree attention by masked softmax over query chunks. Inputs are assumed validated (see api).

    ``chunk_size`` fixes the queries per chunk; by default it is the largest power of two (<= 1024)
    whose score block fits ``score_budget`` elements.
    """
    T, H, D = q_THD.shape
    P = 0 if prefix_k_PKD is None else prefix_k_PKD.shape[0]
    if T == 0:
        return q_THD.new_empty(T, H, D)
    if chunk_size is None:
        chunk_size = 1024
        while chunk_size > 1 and H * chunk_size * (P + T) > score_budget:
            chunk_size //= 2
    differentiable = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q_THD, k_TKD, v_TKD, prefix_k_PKD, prefix_v_PKD)
    )
    use_checkpoint = differentiable and T > chunk_size
    outs = []
    for q0 in range(0, T, chunk_size):
        q1 = min(q0 + chunk_size, T)
        args = (q_THD[q0:q1], k_TKD, v_TKD, prefix_k_PKD, prefix_v_PKD, subtree_end_T, q0, scale)
        if use_checkpoint:
            outs.append(checkpoint(_chunk, *args, use_reentrant=False))
        else:
            outs.append(_chunk(*args))
    return torch.cat(outs, dim=0) if len(outs) > 1 else outs[0]


def run_reference(q_THD: Tensor, k_TKD: Tensor, v_TKD: Tensor, subtree_end, *, prefix_k: Tensor | None = None,
                  prefix_v: Tensor | None = None, scale: float) -> Tensor:
    """The registry's entry (`registry.py`): subtree_end a plain int32 tensor, whose values are checked here
    (one host sync), or a `TreeMaskInfo`, checked once by `prepare`."""
    from .blocks import TreeMaskInfo, check_subtree_end_values

    if isinstance(subtree_end, TreeMaskInfo):
        subtree_end_T = subtree_end.subtree_end_T
    else:
        subtree_end_T = subtree_end
        check_subtree_end_values(subtree_end_T)
    return tree_attention_reference(q_THD, k_TKD, v_TKD, subtree_end_T, prefix_k_PKD=prefix_k, prefix_v_PKD=prefix_v,
                                    scale=scale)
