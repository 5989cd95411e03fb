"""Which keys each query of a model call sees, and the attention computation that follows from it.

`AttentionContext` is built once per forward from the pack (for tree mode it carries the kernel's
`TreeMaskInfo`, whose block schedule is reused by every layer) and handed to each layer. Two kinds:
``tree`` (``treepack.kernels.tree_attention`` with the mask ``k <= q < subtree_end[k]``, plus an optional
cached prefix visible to every query) and ``causal`` (independent sequences laid end to end, the dense
baseline that shares no code with the tree kernel: ``treepack.kernels.varlen``, one varlen call per layer on
a GPU, SDPA per sequence on a CPU; or a tree kernel over chains). Which backend runs a call is the kernels'
registry's answer (`treepack.kernels.tree_attention.registry.resolve`).

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
from torch import Tensor

from treepack.errors import ConfigError
from treepack.kernels.tree_attention import registry
from treepack.kernels.tree_attention.registry import AttentionCall, BackendError

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
    ``kind="causal"``: independent causal sequences of ``lengths`` laid end to end, run by the causal
    backend ``impl`` resolves to per call (``sdpa``: ``F.scaled_dot_product_attention`` per sequence): the dense
    baseline.
    """

    kind: str  # "tree" | "causal"
    impl: str = "auto"  # a backend name of the kind's family in the registry, or auto
    mask: Any = None  # tree: int32 [T] subtree_end or TreeMaskInfo
    lengths: tuple[int, ...] = ()  # causal: sequence lengths, summing to T
    batch: Any = None  # causal: the lengths as a `treepack.kernels.varlen.CausalBatch` (offsets on the device)
    segments: tuple[tuple[int, int, Tensor], ...] = ()  # reference backend: (start, end, local subtree_end)
    schedule: KernelSchedule | None = None  # built by the caller (a dfs call graph's masked prefix); else derived

    @classmethod
    def tree(cls, subtree_end_T: Tensor, impl: str = "auto", *, host: np.ndarray | None = None,
             whole_tokens: int = 0) -> AttentionContext:
        """Tree attention over one pack; prepares the kernel's block schedule once when it will be used.

        ``host``: the same ``subtree_end`` on the host, when the caller has it: the checks and per-pack
        numbers are then computed there, with no host sync, so the host can queue this pack while the GPU
        still runs the previous one. ``whole_tokens``: the pack is a piece of a pack of that many tokens cut
        across ranks; ``auto`` runs it with its whole pack's kernel (`backends.pick_backend`)."""
        from treepack.kernels import prepare
        from treepack.kernels.tree_attention.blocks import check_subtree_end_values

        try:
            registry.check("tree", impl)
        except BackendError as exc:
            raise ConfigError(str(exc)) from None
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
                info.cache["whole_tokens"] = int(whole_tokens)
            return cls(kind="tree", impl=impl, mask=info)
        segments = _independent_segments(subtree_end_T) if impl in ("auto", "reference") else ()
        return cls(kind="tree", impl=impl, mask=subtree_end_T, segments=segments)

    @classmethod
    def causal(cls, lengths: Sequence[int], impl: str = "auto", device: torch.device | None = None
               ) -> AttentionContext:
        """Independent causal sequences: a causal backend (auto: resolved per call; SDPA per sequence on a
        CPU), or a tree kernel named over a forest of chains."""
        from treepack.kernels.varlen import CausalBatch

        lengths = tuple(int(n) for n in lengths)
        try:
            chains = impl != "auto" and registry.backend("causal", impl).chains
        except BackendError as exc:
            raise ConfigError(str(exc)) from None
        if not chains:
            return cls(kind="causal", impl=impl, lengths=lengths, batch=CausalBatch.of(lengths, device))
        from treepack.kernels import chains_subtree_end

        return cls.tree(chains_subtree_end(lengths, device=device), impl)

    def kernel_schedule(self, device: torch.device, dtype: torch.dtype, heads: int, head_dim: int,
                        prefix_len: int = 0) -> KernelSchedule | None:
        """The fused kernel's inputs when this context runs one (a tree mask on CUDA, or on CPU under Triton's
        interpreter with impl triton; a dtype and head dim it supports), else None: what lets a compiled layer
        call the kernel itself. Built once per forward (``prefix_len``: the cached keys every layer sees).
        The backend is the registry's answer for the call (auto: fa4 for large calls where installed, else
        triton); one that cannot run leaves the call to the eager path, which reports why."""
        from treepack.kernels import TreeMaskInfo
        from treepack.kernels.tree_attention.backends import interpreting

        if self.schedule is not None:
            return self.schedule
        runs_triton = device.type == "cuda" or (device.type == "cpu" and interpreting() and self.impl == "triton")
        if self.kind != "tree" or not runs_triton or not isinstance(self.mask, (TreeMaskInfo, Tensor)):
            return None
        mask_T = self.mask.subtree_end_T if isinstance(self.mask, TreeMaskInfo) else self.mask
        T = mask_T.shape[0]
        cache = self.mask.cache if isinstance(self.mask, TreeMaskInfo) else {}
        call = AttentionCall(device, dtype, heads, head_dim, T, prefix_len, cache.get("pairs"),
                             whole_tokens=cache.get("whole_tokens", 0))
        try:
            op = registry.resolve("tree", self.impl, call).name
        except BackendError:
            return None
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
        from treepack.kernels.tree_attention.triton import GPU_DEFAULT, PINNED, schedule_for

        config = PINNED if interpreting() else GPU_DEFAULT
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
        try:
            backend = registry.resolve("causal", self.impl, AttentionCall.of(q_THE, k_TKE, v_TKE))
        except BackendError as exc:
            raise ValueError(f"impl={self.impl!r}: {exc.reason}") from None
        return backend.run(q_THE, k_TKE, v_TKE, self.batch if self.batch is not None else self.lengths)


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
