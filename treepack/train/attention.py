"""Which keys each query of a model call sees, and the attention computation that follows from it.

`AttentionContext` is built once per forward from the pack (for tree mode it carries the kernel's
`TreeMaskInfo`, whose block schedule is reused by every layer) and handed to each layer. Two kinds:
``tree`` (``treepack.kernels.tree_attention`` with the mask ``k <= q < subtree_end[k]``, plus an optional
cached prefix visible to every query) and ``causal`` (independent sequences laid end to end: per-sequence
SDPA, the dense baseline that shares no code with the tree kernel, or the tree kernel over chains).

Legend (shape suffixes): T call tokens, P cached-prefix tokens, H query heads, K key/value heads, E head
dim, S sequences (or keys of one causal chunk), C queries of a chunk.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from treepack.errors import ConfigError

ATTENTION_IMPLS = ("auto", "reference", "flex", "triton", "fa4", "sdpa")

KV = tuple[Tensor, Tensor]  # (keys [P or T, K, E], values [P or T, K, E]) of one layer


# --------------------------------------------------------------------------------------------------
# Attention context: built once per forward, read by every layer


@dataclass(frozen=True)
class KernelSchedule:
    """What a tree kernel's custom op takes besides q, k, v and the prefix: resolved once per forward, outside
    the compiled layer, so the traced code is only tensor math and the op call."""

    op: str  # "triton" (treepack::tree_attention_fwd) | "fa4" (treepack::tree_attention_fa4_fwd)
    tensors: tuple[Tensor, ...]  # triton: blocks.TreeMaskInfo's schedule; fa4: fa4.fa4_tables (key_end, block lists)
    config: list[int]  # triton: KernelConfig.as_list(); fa4: [backward query block rows, backward grid order]


@dataclass
class AttentionContext:
    """Which keys each query sees, for one forward over T tokens (plus an optional cached prefix).

    ``kind="tree"``: the mask ``k <= q < subtree_end[k]`` through ``treepack.kernels.tree_attention``;
    ``mask`` is an int32 [T] tensor or the kernel's prepared `TreeMaskInfo` (block schedule built once);
    for the reference backend, ``segments`` cuts the pack into runs no other query attends into.
    ``kind="causal"``: independent causal sequences of ``lengths`` laid end to end, each run through
    ``F.scaled_dot_product_attention`` (``impl="sdpa"``): the dense baseline.
    """

    kind: str  # "tree" | "causal"
    impl: str = "auto"  # tree kernel backend (auto | reference | flex | triton | fa4) or "sdpa" for causal
    mask: Any = None  # tree: int32 [T] subtree_end or TreeMaskInfo
    lengths: tuple[int, ...] = ()  # causal: sequence lengths, summing to T
    segments: tuple[tuple[int, int, Tensor], ...] = ()  # reference backend: (start, end, local subtree_end)
    schedule: KernelSchedule | None = None  # built by the caller (a dfs call graph's masked prefix); else derived

    @classmethod
    def tree(cls, subtree_end_T: Tensor, impl: str = "auto", *, host: np.ndarray | None = None) -> AttentionContext:
        """Tree attention over one pack; prepares the kernel's block schedule once when it will be used.

        ``host``: the same ``subtree_end`` on the host, when the caller has it: the checks and per-pack
        numbers are then computed there, with no host sync, so the host can queue this pack while the GPU
        still runs the previous one."""
        from treepack.kernels import prepare
        from treepack.kernels.tree_attention.blocks import check_subtree_end_values

        if impl not in ATTENTION_IMPLS or impl == "sdpa":
            raise ConfigError(f"tree attention impl must be auto, reference, flex, triton or fa4, got {impl!r}")
        subtree_end_T = subtree_end_T.to(torch.int32)
        # The schedule validates k < subtree_end[k] <= T (one sync, or none with ``host``) and lets the GPU
        # backends skip masked blocks; the reference backend (auto off CUDA) reads subtree_end directly, one
        # call per run of independent trees since its cost grows with the square of a call's tokens.
        if subtree_end_T.device.type == "cuda" and impl != "reference":
            if host is None:
                info = prepare(subtree_end_T)
            else:
                host_T = torch.from_numpy(np.ascontiguousarray(host, dtype=np.int32))
                check_subtree_end_values(host_T)
                info = prepare(subtree_end_T, validate=False)
                info.cache["host_subtree_end"] = host_T  # for per-pack choices (fa4.fa4_tail_share)
            if impl == "auto":  # the pack's visible pairs size its calls for pick_backend (a sync without host)
                from treepack.kernels import visible_pairs

                info.cache["pairs"] = visible_pairs(info if host is None else host_T)
            return cls(kind="tree", impl=impl, mask=info)
        segments = _independent_segments(subtree_end_T) if impl in ("auto", "reference") else ()
        return cls(kind="tree", impl=impl, mask=subtree_end_T, segments=segments)

    @classmethod
    def causal(cls, lengths: Sequence[int], impl: str = "sdpa", device: torch.device | None = None
               ) -> AttentionContext:
        """Independent causal sequences: SDPA per sequence, or the tree kernel over a forest of chains."""
        lengths = tuple(int(n) for n in lengths)
        if impl == "sdpa":
            return cls(kind="causal", impl="sdpa", lengths=lengths)
        from treepack.kernels import chains_subtree_end

        return cls.tree(chains_subtree_end(lengths, device=device), impl)

    def kernel_schedule(self, device: torch.device, dtype: torch.dtype, heads: int, head_dim: int,
                        prefix_len: int = 0) -> KernelSchedule | None:
        """The fused kernel's inputs when this context runs one (a tree mask on CUDA, or on CPU under Triton's
        interpreter with impl triton; a dtype and head dim it supports), else None: what lets a compiled layer
        call the kernel itself. Built once per forward (``prefix_len``: the cached keys every layer sees).
        ``impl="auto"`` asks `backends.pick_backend` (fa4 for large calls where installed, else triton)."""
        from treepack.kernels import TreeMaskInfo
        from treepack.kernels.tree_attention.api import _interpreting
        from treepack.kernels.tree_attention.backends import pick_backend

        if self.schedule is not None:
            return self.schedule
        runs_triton = device.type == "cuda" or (device.type == "cpu" and _interpreting() and self.impl == "triton")
        if self.kind != "tree" or self.impl not in ("auto", "triton", "fa4") or not runs_triton:
            return None
        if not isinstance(self.mask, (TreeMaskInfo, Tensor)):
            return None
        mask_T = self.mask.subtree_end_T if isinstance(self.mask, TreeMaskInfo) else self.mask
        T = mask_T.shape[0]
        op = self.impl
        if op == "auto":
            pairs = self.mask.cache.get("pairs") if isinstance(self.mask, TreeMaskInfo) else None
            op = pick_backend(T, heads, head_dim, dtype, device, prefix_len=prefix_len, pairs=pairs)
        if op == "fa4":
            from treepack.kernels.tree_attention import fa4

            if dtype not in fa4.FA4_DTYPES or head_dim not in fa4.FA4_HEAD_DIMS or T <= fa4.FA4_BLOCK:
                return None  # the eager path reports what is unsupported; one block: Dynamo would specialise it
            block_q = fa4.FA4_BWD_BLOCK_Q  # read at call time: benchmarks switch it
            order = fa4.bwd_order(fa4.fa4_tail_share(self.mask, prefix_len, bwd_block_q=block_q), heads, device)
            return KernelSchedule(op="fa4", tensors=fa4.fa4_tables(self.mask, prefix_len, bwd_block_q=block_q),
                                  config=[block_q, order])
        if op != "triton":
            return None
        from treepack.kernels.tree_attention.api import TRITON_DTYPES, TRITON_HEAD_DIMS, _triton_importable

        if dtype not in TRITON_DTYPES or head_dim not in TRITON_HEAD_DIMS or not _triton_importable():
            return None
        from treepack.kernels.tree_attention.triton import GPU_DEFAULT, PINNED, schedule_for

        config = PINNED if _interpreting() else GPU_DEFAULT
        if T <= max(config.sched_m, config.sched_n):
            return None  # one schedule block: Dynamo would specialise (recompile) for its size-1 tables
        info = schedule_for(self.mask, config)
        return KernelSchedule(
            op="triton",
            tensors=(info.subtree_end_T, info.kv_list_MN, info.kv_full_M, info.kv_count_M, info.q_order_M),
            config=config.as_list(),
        )

    def attend(self, q_THE: Tensor, k_TKE: Tensor, v_TKE: Tensor, prefix: KV | None) -> Tensor:
        if self.kind == "tree":
            from treepack.kernels import tree_attention

            prefix_k, prefix_v = prefix if prefix is not None else (None, None)
            if len(self.segments) > 1:
                return torch.cat([
                    tree_attention(q_THE[a:b], k_TKE[a:b], v_TKE[a:b], end_local, prefix_k=prefix_k,
                                   prefix_v=prefix_v, impl=self.impl)
                    for a, b, end_local in self.segments
                ], dim=0)
            return tree_attention(q_THE, k_TKE, v_TKE, self.mask, prefix_k=prefix_k, prefix_v=prefix_v,
                                  impl=self.impl)
        if prefix is not None:
            raise ValueError("a cached prefix needs a tree attention context (the causal one has none)")
        return _causal_sdpa(q_THE, k_TKE, v_TKE, self.lengths)


SEGMENT_MIN_TOKENS = 1024  # independent trees are grouped into calls of at least this many tokens


def _independent_segments(subtree_end_T: Tensor) -> tuple[tuple[int, int, Tensor], ...]:
    """Cut a pack into runs of tokens that no query outside the run attends into (for the reference
    backend, whose cost is quadratic in the tokens of a call, not in the visible pairs).

    Token k starts an independent run iff no earlier key is visible at k: ``max_{j<k} subtree_end[j] <= k``
    (the mask's own definition, so the cut is exact for any subtree_end). Runs are merged up to
    `SEGMENT_MIN_TOKENS`: a pack of 100 GSM8K trees of ~150 tokens costs 100 x 150^2 scores instead of
    15k^2. Invalid values (``subtree_end[k] <= k`` or ``> T``) get no cut, so the kernel reports them.
    """
    end_T = subtree_end_T.detach().cpu().numpy().astype(np.int64)
    T = end_T.shape[0]
    if T == 0 or np.any(end_T <= np.arange(T)) or np.any(end_T > T):
        return ()
    reach_T = np.maximum.accumulate(end_T)
    starts = [0] + (np.flatnonzero(reach_T[:-1] <= np.arange(1, T)) + 1).tolist()
    cuts = [0]
    for k in starts[1:]:
        if k - cuts[-1] >= SEGMENT_MIN_TOKENS:
            cuts.append(k)
    if len(cuts) == 1:
        return ()
    cuts.append(T)
    return tuple((a, b, subtree_end_T[a:b] - a) for a, b in itertools.pairwise(cuts))


CAUSAL_SCORE_BUDGET = 1 << 24  # score elements per SDPA call of the causal path (128 MiB in float64)


def _causal_chunk(q_HCE: Tensor, k_HSE: Tensor, v_HSE: Tensor, q0: int) -> Tensor:
    """Queries q0..q0+C of one sequence over its keys 0..S-1 (S = q0 + C), causally."""
    C, S = q_HCE.shape[1], k_HSE.shape[1]
    q, k, v = q_HCE[None], k_HSE[None], v_HSE[None]  # [1, H, *, E]: the fused kernels need 4-d inputs
    if q0 == 0 and C == S:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)[0]
    dev = q_HCE.device
    visible_CS = torch.arange(S, device=dev)[None, :] <= torch.arange(q0, q0 + C, device=dev)[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible_CS)[0]


def _causal_sdpa(q_THE: Tensor, k_TKE: Tensor, v_TKE: Tensor, lengths: Sequence[int]) -> Tensor:
    """Causal attention within each of the concatenated sequences. On CUDA: one ``is_causal`` SDPA call
    per sequence (flash / memory-efficient kernels, O(L) memory). Elsewhere SDPA's math path keeps the
    O(L^2) probabilities for backward (27 GB in float64 for the 53 sequences of two 16k-token tau-bench
    packs), so there a sequence runs in query chunks of at most `CAUSAL_SCORE_BUDGET` scores, each
    checkpointed: memory O(chunk) at the price of recomputing the forward once."""
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
        # CUDA's flash / memory-efficient kernels keep O(L) state: one causal call per sequence there.
        chunk = n if q_THE.device.type == "cuda" else max(1, CAUSAL_SCORE_BUDGET // (H * n))
        parts = []
        for q0 in range(0, n, chunk):
            q1 = min(q0 + chunk, n)
            args = (q_HLE[:, q0:q1], k_HLE[:, :q1], v_HLE[:, :q1], q0)
            parts.append(checkpoint(_causal_chunk, *args, use_reentrant=False) if recompute else _causal_chunk(*args))
        outs.append((torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]).transpose(0, 1))
        start += n
    return torch.cat(outs, dim=0) if len(outs) != 1 else outs[0]
