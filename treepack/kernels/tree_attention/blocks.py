"""Tree-mask helpers and the per-pack block schedule shared by every tree-attention backend.

The mask contract (docs/design.md §6): tokens of a pack are in DFS preorder, and query q may attend key k iff
``k <= q < subtree_end[k]``. One int32 per token describes the whole mask; nothing here is quadratic in T
except the dense `tree_mask` that tests use as an oracle.

`prepare` turns `subtree_end` into a `TreeMaskInfo`: everything a blocked kernel needs to skip work,
computed once per pack with a handful of vectorised torch ops on the pack's device (no Python loop over
tokens, one host sync for validation) and then reused by every layer of the model:

* per key block (``block_n`` keys): min and max of ``subtree_end`` over the block. A key block [k0, k1) is
  *fully visible* to a query block [q0, q1) iff ``k1 - 1 <= q0`` and ``min > q1 - 1`` (no mask test), and
  *empty* iff ``k0 > q1 - 1`` or ``max <= q0``. Both tests are exact for aligned blocks: a non-empty pair
  of blocks always holds at least one visible (q, k).
* per query block (``block_m`` queries): its non-empty key blocks, the fully visible ones first, then the
  partial ones (a compacted [M, N] int32 table plus two counts). The visible keys of a query are its
  ancestors, scattered over [0, q]; on a tree with many branches most key blocks below the diagonal are
  empty, and the kernels loop only over the listed ones, in two loops: one with no mask test at all and
  one with it (no per-block branch inside a loop, so both software-pipeline). The table costs 4·M·N
  bytes: 256 KiB for a 32k-token pack at 128 x 128 blocks.
* the query blocks in order of decreasing work (listed key blocks), so that the kernels start the
  longest programs first (longest-processing-time scheduling; ragged trees otherwise leave a tail).

The transposed direction needs no table: the queries that see key k are exactly [k, subtree_end[k]), so
the queries that see a key block [k0, k1) form the contiguous range [k0, max subtree_end[k0:k1]).

A kernel may use a query block smaller than ``block_m`` if it divides it: the list of the enclosing
schedule row is a superset of the exact one, and the per-pair mask test keeps the result exact.

Shape suffixes: T pack tokens, P cached-prefix tokens, M query blocks, N key blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = [
    "TreeMaskInfo",
    "chains_subtree_end",
    "check_subtree_end_values",
    "prepare",
    "tree_mask",
    "visible_pairs",
]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_subtree_end_values(subtree_end_T: Tensor) -> None:
    """Raise ValueError unless ``k < subtree_end[k] <= T`` for every token k (one host sync)."""
    T = subtree_end_T.numel()
    if T == 0:
        return
    pos_T = torch.arange(T, device=subtree_end_T.device, dtype=subtree_end_T.dtype)
    bad_T = (subtree_end_T <= pos_T) | (subtree_end_T > T)
    if bool(bad_T.any()):
        k = int(bad_T.nonzero()[0, 0])
        raise ValueError(
            f"subtree_end must satisfy k < subtree_end[k] <= T={T} for every token k, "
            f"got subtree_end[{k}]={int(subtree_end_T[k])}"
        )


@dataclass(frozen=True, eq=False)
class TreeMaskInfo:
    """Block schedule of one pack: build it once with `prepare` and pass it to every layer.

    Accepted by `tree_attention` wherever a ``subtree_end`` tensor is.
    """

    subtree_end_T: Tensor  # int32 [T]: exclusive end of each token's subtree (the mask contract)
    block_m: int  # queries per schedule row
    block_n: int  # keys per key block
    kv_min_N: Tensor  # int32 [N]: min subtree_end over a key block; 0 for a ragged last block (never full)
    kv_max_N: Tensor  # int32 [N]: max subtree_end over a key block
    kv_list_MN: Tensor  # int32 [M, N]: per query block, full key blocks then partial ones, padded with N
    kv_full_M: Tensor  # int32 [M]: entries [0, kv_full_M) of a row are fully visible key blocks
    kv_count_M: Tensor  # int32 [M]: entries [kv_full_M, kv_count_M) are partial, the rest padding
    q_order_M: Tensor  # int32 [M]: query blocks by decreasing kv_count_M (the launch order)
    cache: dict = field(default_factory=dict, repr=False)  # backend-specific derived objects (flex masks)

    @property
    def num_tokens(self) -> int:
        return self.subtree_end_T.numel()

    @property
    def device(self) -> torch.device:
        return self.subtree_end_T.device

    def nonempty_blocks(self) -> int:
        """Number of (query block, key block) pairs the forward visits (host sync)."""
        return int(self.kv_count_M.sum())


def prepare(
    subtree_end: Tensor, *, block_m: int = 128, block_n: int = 128, validate: bool = True
) -> TreeMaskInfo:
    """Build the block schedule of a pack from ``subtree_end`` (int32 [T]) on its device.

    The defaults match the triton backend's GPU tiles; a TreeMaskInfo of other blocks still works (the
    backend derives and caches the one it needs). 0.35 ms for a 31k-token pack on an H200.

    ``validate`` checks ``k < subtree_end[k] <= T`` (one host sync); the kernels trust it afterwards.
    """
    if not isinstance(subtree_end, Tensor) or subtree_end.dtype != torch.int32 or subtree_end.dim() != 1:
        got = (
            f"{_dtype_name(subtree_end.dtype)} of shape {list(subtree_end.shape)}"
            if isinstance(subtree_end, Tensor)
            else type(subtree_end).__name__
        )
        raise ValueError(f"subtree_end must be int32 of shape [T], got {got}")
    for name, b in (("block_m", block_m), ("block_n", block_n)):
        if b < 1 or b & (b - 1):
            raise ValueError(f"{name} must be a power of two, got {b}")
    subtree_end_T = subtree_end.contiguous()
    if validate:
        check_subtree_end_values(subtree_end_T)
    T, dev = subtree_end_T.numel(), subtree_end_T.device
    N, M = _cdiv(T, block_n), _cdiv(T, block_m)
    ragged = N * block_n - T
    kv_max_N = torch.nn.functional.pad(subtree_end_T, (0, ragged), value=0).view(N, block_n).amax(1)
    # A ragged last block is padded with 0 so that its min is 0 (never full). No item assignment: writing
    # a Python scalar into a CUDA tensor is a host-to-device copy that waits for the GPU's queue to drain.
    kv_min_N = torch.nn.functional.pad(subtree_end_T, (0, ragged), value=0).view(N, block_n).amin(1)
    q0_M = torch.arange(M, device=dev, dtype=torch.int32) * block_m
    q_last_M = torch.clamp(q0_M + block_m, max=T) - 1
    k0_N = torch.arange(N, device=dev, dtype=torch.int32) * block_n
    nonempty_MN = (k0_N[None, :] <= q_last_M[:, None]) & (kv_max_N[None, :] > q0_M[:, None])
    full_MN = (k0_N[None, :] + (block_n - 1) <= q0_M[:, None]) & (kv_min_N[None, :] > q_last_M[:, None])
    kv_count_M = nonempty_MN.sum(1, dtype=torch.int32)
    kv_full_M = full_MN.sum(1, dtype=torch.int32)
    # Sort key: full blocks first (kb), then partial ones (N + kb), then padding (2N); ascending within each.
    kb_N = torch.arange(N, device=dev, dtype=torch.int32)
    key_MN = torch.where(full_MN, kb_N, torch.where(nonempty_MN, N + kb_N, 2 * N))
    key_MN = key_MN.sort(dim=1).values
    kv_list_MN = torch.where(key_MN < N, key_MN, torch.where(key_MN < 2 * N, key_MN - N, N)).to(torch.int32)
    q_order_M = torch.argsort(kv_count_M, descending=True, stable=True).to(torch.int32)
    return TreeMaskInfo(
        subtree_end_T=subtree_end_T,
        block_m=block_m,
        block_n=block_n,
        kv_min_N=kv_min_N.contiguous(),
        kv_max_N=kv_max_N.contiguous(),
        kv_list_MN=kv_list_MN.contiguous(),
        kv_full_M=kv_full_M.contiguous(),
        kv_count_M=kv_count_M.contiguous(),
        q_order_M=q_order_M.contiguous(),
    )


def tree_mask(subtree_end: Tensor | TreeMaskInfo, prefix_len: int = 0) -> Tensor:
    """Dense boolean mask [T, P + T] of the contract (True = may attend); P prefix keys come first.

    Quadratic in T: meant for tests and small examples.
    """
    subtree_end_T = subtree_end.subtree_end_T if isinstance(subtree_end, TreeMaskInfo) else subtree_end
    T = subtree_end_T.numel()
    pos_T = torch.arange(T, device=subtree_end_T.device)
    tree_TT = (pos_T[None, :] <= pos_T[:, None]) & (pos_T[:, None] < subtree_end_T[None, :].long())
    if prefix_len == 0:
        return tree_TT
    prefix_TP = torch.ones(T, prefix_len, dtype=torch.bool, device=subtree_end_T.device)
    return torch.cat([prefix_TP, tree_TT], dim=1)


def chains_subtree_end(lengths: Sequence[int] | Tensor, device: torch.device | str | None = None) -> Tensor:
    """``subtree_end`` (int32 [sum(lengths)]) of independent causal sequences laid end to end.

    A chain is a tree whose every token has one child: each token's subtree ends where its sequence
    ends, so the tree mask becomes block-diagonal causal (the dense baseline is a forest of chains).
    """
    lengths_S = torch.as_tensor(lengths, dtype=torch.int64, device=device)
    if lengths_S.dim() != 1 or bool((lengths_S < 1).any()):
        raise ValueError(f"lengths must be a 1-d list of positive ints, got {lengths_S.tolist()}")
    ends_S = lengths_S.cumsum(0)
    return torch.repeat_interleave(ends_S, lengths_S).to(torch.int32)


def visible_pairs(subtree_end: Tensor | TreeMaskInfo, prefix_len: int = 0) -> int:
    """Number of visible (query, key) pairs: sum over keys of subtree size, plus P per query."""
    subtree_end_T = subtree_end.subtree_end_T if isinstance(subtree_end, TreeMaskInfo) else subtree_end
    T = subtree_end_T.numel()
    pos_T = torch.arange(T, device=subtree_end_T.device, dtype=torch.int64)
    return int((subtree_end_T.long() - pos_T).sum()) + prefix_len * T
