"""Tree attention as varlen attention over leaf paths: every query once, its ancestors' keys gathered.

In DFS preorder the tokens a leaf adds to the pack (those after the previous leaf, through the leaf itself)
are contiguous, and they are the last tokens of the leaf's root-to-leaf path. So a pack's T queries, in the
order they already have, split into one segment per leaf, and segment s attends causally over the keys of its
leaf's whole path, gathered into a key array (``key_index``): the varlen kernel with ``seqlen_q <= seqlen_k``
and causality aligned at the bottom right computes exactly the tree mask ``k <= q < subtree_end[k]``, pair
for pair, with every tile dense except the diagonal and the segments' ragged ends. No query is computed
twice and the output needs no reordering; the price is the gathered keys and values (the leaf paths' tokens,
N_leaf >= T, in each layer's forward, and the sum of their gradients in backward) and tiles of 128
query rows that a short segment fills only in part. `padded_pairs` counts that waste, so a caller can weigh
it against the tree kernel (`paths_pay`).

Measured on one H200 against FA4's tree kernel (benchmarks/results/2026-11-28-attention-paths-h200.md, first
32K pack of each source, fwd+bwd): the forward is 4-12% faster (tau-bench 1.27 vs 1.39 ms, ToolBench 0.90 vs
1.02), but the backward's sum of the gathered keys' gradients and FA4's varlen backward over
``seqlen_q < seqlen_k`` made fwd+bwd no faster on chain-like packs and 1.3-1.5x slower on branchy or short
ones. Summing each key's copies as its own copy plus the extra ones (`_GatherPaths`, 0.07 instead of 0.27 ms
a tensor on tau-bench) brought it level with the tree kernel on tau-bench (5.96 vs 5.93 ms) and ahead on
tau2 (4.11 vs 4.19), still 1.05-1.55x slower on GSM8K, hh-rlhf and ToolBench
(benchmarks/results/2026-11-29-modes-h200.md). So training does not route packs here; the module stays as a
tested, measured kernel (`benchmarks/attention_backends.py --runners tree/paths`) for forward-only scoring,
where it is faster.

Legend: T pack tokens (queries), N gathered keys (sum of the leaf paths' lengths), S leaves (segments).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

QUERY_TILE = 128  # query rows per tile of FA4's (and FlashAttention's) Hopper kernels at head dim 128


@dataclass(frozen=True)
class PathPlan:
    """One pack's leaf segments: queries ``[cu_q[s], cu_q[s+1])`` (preorder tokens) attend the keys
    ``key_index[cu_k[s]:cu_k[s+1]]`` (the leaf's path, root first), the last of them the queries themselves."""

    cu_q_S1: np.ndarray  # int32 [S + 1]
    cu_k_S1: np.ndarray  # int32 [S + 1]
    key_index_N: np.ndarray  # int64 [N]: the pack token of each gathered key
    pairs: int  # visible pairs: sum over segments of the causal pairs of q rows over k keys (= the tree's)
    own_T: np.ndarray  # int64 [T]: each token's own copy among the gathered keys (where it is also a query)
    extra_X: np.ndarray  # int64 [X = N - T]: the other copies (ancestors re-read by a later leaf)

    @property
    def num_segments(self) -> int:
        return self.cu_q_S1.shape[0] - 1

    @property
    def max_q(self) -> int:
        return int(np.diff(self.cu_q_S1).max(initial=0))

    @property
    def max_k(self) -> int:
        return int(np.diff(self.cu_k_S1).max(initial=0))

    def padded_pairs(self, tile: int = QUERY_TILE) -> int:
        """Pairs the kernel computes when each segment's queries fill whole tiles of ``tile`` rows (each
        tile's rows times the keys its last row sees): the work a short segment wastes."""
        q_S = np.diff(self.cu_q_S1).astype(np.int64)
        k_S = np.diff(self.cu_k_S1).astype(np.int64)
        tiles_S = -(-q_S // tile)
        # tile j of a segment ends at row min((j+1) tile, q) - 1, which sees k - q + that row + 1 keys
        total = 0
        for q, k, n in zip(q_S.tolist(), k_S.tolist(), tiles_S.tolist()):
            ends = np.minimum((np.arange(n) + 1) * tile, q)
            total += int((tile * (k - q + ends)).sum())
        return total


def plan_paths(subtree_end_T: np.ndarray | Tensor) -> PathPlan:
    """The leaf segments of a pack from its ``subtree_end`` (host array). O(N) numpy work plus a loop over
    the leaves: path(leaf) = the previous leaf's path cut to the ancestors whose subtree reaches this leaf
    (a prefix, since ancestors' subtree ends are nested), then the tokens after the previous leaf."""
    if isinstance(subtree_end_T, Tensor):
        subtree_end_T = subtree_end_T.detach().cpu().numpy()
    end_T = np.asarray(subtree_end_T, dtype=np.int64)
    T = end_T.shape[0]
    leaves = np.flatnonzero(end_T == np.arange(1, T + 1))
    parts: list[np.ndarray] = []
    k_lengths = np.empty(leaves.shape[0], dtype=np.int64)
    path = np.zeros(0, dtype=np.int64)
    prev = -1
    for s, leaf in enumerate(leaves.tolist()):
        keep = int(np.count_nonzero(end_T[path] > leaf))
        path = np.concatenate((path[:keep], np.arange(prev + 1, leaf + 1, dtype=np.int64)))
        parts.append(path)
        k_lengths[s] = path.shape[0]
        prev = leaf
    cu_q = np.zeros(leaves.shape[0] + 1, dtype=np.int32)
    cu_q[1:] = leaves + 1
    cu_k = np.zeros(leaves.shape[0] + 1, dtype=np.int32)
    np.cumsum(k_lengths, out=cu_k[1:])
    q_S = np.diff(cu_q).astype(np.int64)
    pairs = int((q_S * (k_lengths - q_S) + q_S * (q_S + 1) // 2).sum())
    key_index = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    # token t of segment s is its path's key cu_k[s+1] - (cu_q[s+1] - t): the segment's keys end with its queries
    seg_T = np.repeat(np.arange(leaves.shape[0]), q_S)
    own = cu_k[1:].astype(np.int64)[seg_T] - cu_q[1:].astype(np.int64)[seg_T] + np.arange(T, dtype=np.int64)
    is_own = np.zeros(key_index.shape[0], dtype=bool)
    is_own[own] = True
    return PathPlan(cu_q, cu_k, key_index, pairs, own, np.flatnonzero(~is_own))


@dataclass(frozen=True)
class DevicePaths:
    """A `PathPlan` on the device a forward runs on: built once per pack, read by every layer."""

    plan: PathPlan
    cu_q_S1: Tensor
    cu_k_S1: Tensor
    key_index_N: Tensor
    own_T: Tensor
    extra_X: Tensor
    extra_token_X: Tensor  # the pack token of each extra copy

    @classmethod
    def of(cls, plan: PathPlan, device: torch.device | str) -> DevicePaths:
        def up(a):
            t = torch.from_numpy(np.ascontiguousarray(a))
            return t.pin_memory().to(device, non_blocking=True) if torch.device(device).type == "cuda" else t.to(device)

        return cls(plan, up(plan.cu_q_S1), up(plan.cu_k_S1), up(plan.key_index_N), up(plan.own_T), up(plan.extra_X),
                   up(plan.key_index_N[plan.extra_X]))


class _GatherPaths(torch.autograd.Function):
    """Keys and values gathered along the leaf paths; backward sums each token's copies.

    Why not ``index_select``'s own backward: it is one atomic ``index_add_`` over all N copies, 0.27 ms per
    tensor on a tau-bench pack (1x H200). Every token has exactly one copy where it is a query too; gathering
    those (a plain copy) and adding only the X extra copies takes 0.07 ms
    (benchmarks/results/2026-11-29-modes-h200.md, `benchmarks/paths_scatter.py`)."""

    @staticmethod
    def forward(ctx, k_TKE: Tensor, v_TKE: Tensor, paths: DevicePaths) -> tuple[Tensor, Tensor]:
        ctx.paths = paths
        return k_TKE.index_select(0, paths.key_index_N), v_TKE.index_select(0, paths.key_index_N)

    @staticmethod
    def backward(ctx, dk_NKE: Tensor, dv_NKE: Tensor):
        p = ctx.paths

        def fold(d_NKE: Tensor | None) -> Tensor | None:
            if d_NKE is None:
                return None
            return d_NKE.index_select(0, p.own_T).index_add_(0, p.extra_token_X, d_NKE.index_select(0, p.extra_X))

        return fold(dk_NKE), fold(dv_NKE), None


def paths_attention_reference(q_THE: Tensor, k_TKE: Tensor, v_TKE: Tensor, paths: DevicePaths) -> Tensor:
    """Pure torch: each segment's queries over its gathered keys, causal at the bottom right (float64 tests)."""
    import torch.nn.functional as F

    plan = paths.plan
    groups = q_THE.shape[1] // k_TKE.shape[1]
    k_NKE, v_NKE = k_TKE.index_select(0, paths.key_index_N), v_TKE.index_select(0, paths.key_index_N)
    outs = []
    for s in range(plan.num_segments):
        q0, q1 = int(plan.cu_q_S1[s]), int(plan.cu_q_S1[s + 1])
        k0, k1 = int(plan.cu_k_S1[s]), int(plan.cu_k_S1[s + 1])
        Lq, Lk = q1 - q0, k1 - k0
        q = q_THE[q0:q1].transpose(0, 1)[None]
        k = k_NKE[k0:k1].transpose(0, 1).repeat_interleave(groups, dim=0)[None]
        v = v_NKE[k0:k1].transpose(0, 1).repeat_interleave(groups, dim=0)[None]
        visible = torch.arange(Lk, device=q.device)[None, :] <= torch.arange(Lk - Lq, Lk, device=q.device)[:, None]
        outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=visible)[0].transpose(0, 1))
    return torch.cat(outs, dim=0) if outs else q_THE.new_zeros(q_THE.shape)


def paths_attention(q_THE: Tensor, k_TKE: Tensor, v_TKE: Tensor, paths: DevicePaths, *, impl: str = "fa4") -> Tensor:
    """Tree attention over the pack's leaf segments (module doc) with the varlen kernel ``impl`` (fa4 | flash
    | sdpa: the reference). Differentiable in q, k and v (the gather's backward sums each key's gradient over
    the segments that read it: `_GatherPaths`)."""
    import math

    from treepack.kernels.varlen.fast import fa4_varlen, torch_varlen

    if impl == "sdpa":
        return paths_attention_reference(q_THE, k_TKE, v_TKE, paths)
    plan = paths.plan
    k_NKE, v_NKE = _GatherPaths.apply(k_TKE, v_TKE, paths)
    run = fa4_varlen if impl == "fa4" else torch_varlen
    return run(q_THE.contiguous(), k_NKE, v_NKE, paths.cu_q_S1, paths.cu_k_S1, plan.max_q, plan.max_k,
               1.0 / math.sqrt(q_THE.shape[-1]))


# Paths pay (forward only: measured above) where their tiles waste at most this share of pairs beyond the tree's
# own: FA4's tree kernel runs at 0.87-0.98x FA4 varlen's forward rate per pair on long-segment packs.
PATHS_MAX_PADDING = 1.10


def paths_pay(plan: PathPlan) -> bool:
    """Whether a pack's leaf segments should run a forward through the varlen kernel instead of the tree
    kernel (the backward does not pay: module doc)."""
    return plan.pairs > 0 and plan.padded_pairs() <= PATHS_MAX_PADDING * plan.pairs
