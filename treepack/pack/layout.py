"""A pack laid out for training: the arrays of docs/design.md §6, in DFS preorder of the pack's sub-trie.

Legend: T = tokens in the pack (real + padding), S = sequences in the pack, F = sum of the S sequences'
lengths (their flat tokens).

Mask contract: query q may attend key k iff ``k <= q < subtree_end[k]`` (k is q or one of its ancestors).
In DFS preorder the subtree of k is the contiguous range ``[k, subtree_end[k])``, so one int per token
replaces the T x T mask. The logits at ``parent[p]`` predict ``input_ids[p]``: a branch point's hidden state
feeds every child's target, with no special case.

Per-sequence token fields (loss mask, behaviour log-probs) live in flat ``[F]`` arrays split by
``seq_offsets``: a token shared by several sequences may be a training target in one and context in
another (multi-turn histories), so these can not be per pack token. ``seq_token_index[seq_offsets[s] + j]``
is the pack index of sequence s's j-th token: its path, root to leaf.

``loss_weight[p]`` counts the sequences whose loss mask is 1 at p's position, except at roots: position 0
is never predicted (nothing precedes it), so it never weighs anything.

`build_pack` visits children in lexicographic order; `relayout` gives the same pack in another DFS order
(``largest-first``: each node's children by subtree size, largest first), which changes no number of the
training step but the attention kernel's blocks (fewer partial ones on ToolBench, see there).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from treepack.errors import TreepackError
from treepack.io.rollouts import ranges
from treepack.io.sequences import check_rollouts, check_token_buffer

if TYPE_CHECKING:
    from treepack.io.rollouts import Rollouts


@dataclass
class Pack:
    """One training pack (the trainer's unit of a forward/backward pass)."""

    input_ids: np.ndarray  # int32 [T] token ids (0 at padding)
    position_ids: np.ndarray  # int32 [T] depth = offset in the original sequence (RoPE positions)
    parent: np.ndarray  # int32 [T] index of the previous token on the path, -1 at a root (and padding)
    subtree_end: np.ndarray  # int32 [T] exclusive end of the token's subtree (padding: q + 1)
    scale: np.ndarray  # float32 [T] sequences of the pack whose path contains the token
    loss_weight: np.ndarray  # float32 [T] sequences of the pack that train on predicting this token
    n_real: int  # tokens [0, n_real) are real, [n_real, T) padding
    seq_ids: list  # [S] sample ids (str or int) as in the input
    seq_index: np.ndarray  # int64 [S] global record index in the input (restores input order)
    seq_leaf: np.ndarray  # int32 [S] pack index of each sequence's last token
    seq_offsets: np.ndarray  # int64 [S+1] split of the flat per-sequence-token arrays below
    seq_token_index: np.ndarray  # int32 [F] pack index of each sequence's j-th token (its path)
    seq_loss_mask: np.ndarray  # uint8 [F] 1 where that sequence trains on the token
    seq_logprobs: np.ndarray | None = None  # float64 [F] behaviour log-probs, when the input had them
    advantages: np.ndarray | None = None  # float64 [S] per-sequence advantage, when present
    rewards: np.ndarray | None = None  # float64 [S] per-sequence reward, when present
    seq_groups: list | None = None  # [S] tree_id/group_id of each sequence, when present
    seq_steps: np.ndarray | None = None  # int64 [S] training step of each sequence, when present
    meta: dict = field(default_factory=dict)

    @property
    def n_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def n_sequences(self) -> int:
        return int(self.seq_leaf.shape[0])

    @property
    def seq_lengths(self) -> np.ndarray:
        return np.diff(self.seq_offsets)

    def path(self, s: int) -> np.ndarray:
        """Pack indices of sequence ``s``'s tokens, root to leaf."""
        return self.seq_token_index[self.seq_offsets[s] : self.seq_offsets[s + 1]]

    def sequence_tokens(self, s: int) -> np.ndarray:
        return self.input_ids[self.path(s)]


def build_pack(
    r: Rollouts,
    index: np.ndarray | list[int] | None = None,
    *,
    scope: np.ndarray | None = None,
    pad_to: int | None = None,
) -> Pack:
    """Lay out the sub-trie of sequences ``index`` of a batch (all of them by default) as a ``Pack``.

    ``scope`` (int64 per sequence of ``r``) keeps sequences of different scopes in separate trees even if
    their tokens agree. Sequences appear in DFS leaf order (lexicographic). ``pad_to`` appends padding so
    that T is a multiple of it; padding tokens attend only to themselves and weigh nothing.
    """
    from treepack.tree import PrefixTree

    check_rollouts(r, deep=False)  # O(1): this runs once per pack of a batch; its sequences are checked below
    if index is None:
        index = np.arange(len(r), dtype=np.int64)
    index = np.asarray(index, dtype=np.int64)
    if len(index) == 0:
        raise TreepackError("a pack needs at least one sequence")
    if int(index.min()) < 0 or int(index.max()) >= len(r) or len(np.unique(index)) != len(index):
        raise TreepackError(f"a pack's sequences must be distinct indices in [0, {len(r)}), got {index.tolist()[:8]}")
    if pad_to is not None and (isinstance(pad_to, bool) or int(pad_to) <= 0):
        raise TreepackError(f"pad_to must be positive, got {pad_to!r}")
    starts, ends = r.offsets[index], r.offsets[index + 1]
    if (int(r.offsets[0]) != 0 or int(r.offsets[-1]) != len(r.tokens) or bool((ends <= starts).any())
            or int(ends.max()) > len(r.tokens)):
        check_token_buffer(r.tokens, r.offsets, r.ids)  # a broken batch: the whole check names what is wrong
    sub = r.select(index)
    check_token_buffer(sub.tokens, sub.offsets, [r.ids[i] for i in index.tolist()])
    tree = PrefixTree.from_arrays(sub.tokens, sub.offsets, None if scope is None else np.asarray(scope)[index])
    order = tree.order
    seq_offsets, token_index = tree.paths()
    n_real = tree.n_tree_tokens
    src = ranges(sub.offsets[:-1][order], tree.lengths)  # flat input positions of each sorted sequence
    if sub.loss_mask is None:
        seq_loss_mask = np.ones(len(src), dtype=np.uint8)
    else:
        seq_loss_mask = sub.loss_mask[src]
    depth_of_entry = ranges(np.zeros(len(order), np.int64), tree.lengths)
    trains = (seq_loss_mask > 0) & (depth_of_entry > 0)  # a root token is never predicted
    loss_weight = np.bincount(token_index, weights=trains, minlength=n_real).astype(np.float32)
    input_ids = tree.token_ids().astype(np.int32)
    position_ids = tree.token_depth()
    parent = tree.token_parent()
    subtree_end = tree.token_subtree_end()
    scale = tree.token_count().astype(np.float32)
    n_total = n_real if not pad_to else -(-n_real // pad_to) * pad_to
    if n_total > n_real:
        pad = n_total - n_real
        q = np.arange(n_real, n_total, dtype=np.int32)
        input_ids = np.concatenate([input_ids, np.zeros(pad, np.int32)])
        position_ids = np.concatenate([position_ids, np.zeros(pad, np.int32)])
        parent = np.concatenate([parent, np.full(pad, -1, np.int32)])
        subtree_end = np.concatenate([subtree_end, q + 1])
        scale = np.concatenate([scale, np.zeros(pad, np.float32)])
        loss_weight = np.concatenate([loss_weight, np.zeros(pad, np.float32)])

    def per_seq(a):
        return None if a is None else a[order]

    return Pack(
        input_ids=input_ids,
        position_ids=position_ids,
        parent=parent,
        subtree_end=subtree_end,
        scale=scale,
        loss_weight=loss_weight,
        n_real=n_real,
        seq_ids=[sub.ids[i] for i in order.tolist()],
        seq_index=index[order],
        seq_leaf=token_index[seq_offsets[1:] - 1].astype(np.int32),
        seq_offsets=seq_offsets,
        seq_token_index=token_index.astype(np.int32),
        seq_loss_mask=seq_loss_mask.astype(np.uint8),
        seq_logprobs=None if sub.logprobs is None else sub.logprobs[src],
        advantages=per_seq(sub.advantages),
        rewards=per_seq(sub.rewards),
        seq_groups=None if sub.groups is None else [r.group_names[g] for g in sub.groups[order].tolist()],
        seq_steps=per_seq(sub.steps),
    )


# --------------------------------------------------------------------------------------------------
# Another DFS order of the same pack

CHILD_ORDERS = ("lex", "largest-first")


def preorder_by_key(parent_T: np.ndarray, subtree_end_T: np.ndarray, key_T: np.ndarray) -> np.ndarray:
    """int64 [T]: the new index of each token in the DFS preorder that visits each node's children (and the
    roots) by ascending ``key_T``, ties in their current order. The tokens must be in a DFS preorder now
    (k's subtree is ``[k, subtree_end_T[k])``), which makes it one sort and two prefix sums, no walk: a
    token's new index is, summed over its ancestors and itself, 1 + the subtree sizes of the siblings
    visited before it (minus 1), and each such term covers a contiguous subtree of the current order."""
    parent_T = np.asarray(parent_T, dtype=np.int64)
    end_T = np.asarray(subtree_end_T, dtype=np.int64)
    T = parent_T.shape[0]
    index_T = np.arange(T, dtype=np.int64)
    size_T = end_T - index_T
    if T and (np.any(parent_T >= index_T) or np.any(size_T < 1) or np.any(end_T > T)):
        raise TreepackError("parent/subtree_end are not a DFS preorder (parent[k] < k < subtree_end[k] <= T)")
    order = np.lexsort((index_T, np.asarray(key_T), parent_T))  # siblings together, by key, then index
    size_sorted = size_T[order]
    before = np.cumsum(size_sorted) - size_sorted  # sizes before each token in the sorted list ...
    par_sorted = parent_T[order]
    first = np.flatnonzero(np.r_[True, par_sorted[1:] != par_sorted[:-1]])
    before -= np.repeat(before[first], np.diff(np.r_[first, T]))  # ... and before it among its siblings
    step_T = np.empty(T, dtype=np.int64)
    step_T[order] = before + 1
    # Each token adds its step to its subtree [k, end[k]): a difference array, then a prefix sum.
    delta = np.zeros(T + 1, dtype=np.int64)
    delta[:T] = step_T
    delta -= np.bincount(end_T, weights=step_T, minlength=T + 1).astype(np.int64)  # exact below 2^53
    new_T = np.cumsum(delta[:T]) - 1
    if T and (new_T.min() < 0 or new_T.max() >= T
              or not np.array_equal(np.bincount(new_T, minlength=T), np.ones(T, dtype=np.int64))):
        raise TreepackError("parent and subtree_end disagree: they do not describe one tree in DFS preorder")
    return new_T


def relayout(pack: Pack, child_order: str) -> Pack:
    """The same pack in another DFS order: ``lex`` (as `build_pack` lays it out: the pack itself) or
    ``largest-first`` (each node's children, and the roots, by subtree size descending; ties lexicographic).

    Why: any DFS preorder meets the mask contract and gives the same attention, loss and gradients, but not
    the same 128 x 128 blocks: on ToolBench's 32K packs (short answers under long shared prompts) FA4 visits
    25% fewer partial blocks largest-first (2,941 -> 2,212) and 4.7% fewer blocks in all, and it never did
    worse on tau-bench, tau2-think, agentic-think or grpo-math (0.1-1.0% fewer blocks;
    benchmarks/results/2026-11-25-fa4-blocks.md, counted on the CPU; the GPU time is not measured yet).
    Vectorised (`reorder`): on one CPU core 2.0-2.1 ms for a 31,866-token ToolBench pack (140 sequences),
    3.8-4.2 ms for one of 59,162 tokens (two runs, median of 20-30 calls each).
    """
    if child_order not in CHILD_ORDERS:
        raise TreepackError(f"child order must be one of {', '.join(CHILD_ORDERS)}, got {child_order!r}")
    if child_order == "lex":
        return pack
    n = int(pack.n_real)
    return reorder(pack, np.arange(n, dtype=np.int64) - np.asarray(pack.subtree_end[:n], dtype=np.int64))


def reorder(pack: Pack, key_T: np.ndarray) -> Pack:
    """The pack in the DFS order that visits each node's children (and the roots) by ascending ``key_T``
    (one key per real token; ties in the current order): `preorder_by_key` applied to every field.

    Every per-token array is permuted (``parent`` and ``seq_token_index`` / ``seq_leaf`` renumbered,
    ``subtree_end`` recomputed); padding stays at the end as it was; the sequences are re-sorted into the
    new DFS leaf order (a prefix of another first, duplicates in their current order) with every
    per-sequence field; ``meta`` is kept. The pack itself when nothing moves."""
    n, T = int(pack.n_real), pack.n_tokens
    end_T = np.asarray(pack.subtree_end, dtype=np.int64)
    size_T = end_T - np.arange(T, dtype=np.int64)
    new_T = np.arange(T, dtype=np.int64)  # padding [n, T) keeps its place
    new_T[:n] = preorder_by_key(pack.parent[:n], end_T[:n], key_T)
    if np.array_equal(new_T, np.arange(T)):
        return pack
    old_T = np.empty(T, dtype=np.int64)
    old_T[new_T] = np.arange(T, dtype=np.int64)
    parent_T = np.asarray(pack.parent, dtype=np.int64)[old_T]
    parent_T = np.where(parent_T >= 0, new_T[np.maximum(parent_T, 0)], -1)
    leaf_S = new_T[np.asarray(pack.seq_leaf, dtype=np.int64)]
    seq = np.argsort(leaf_S, kind="stable")  # DFS leaf order: an ancestor (prefix) first, ties as they were
    offsets_S1 = np.asarray(pack.seq_offsets, dtype=np.int64)
    length_S = np.diff(offsets_S1)[seq]
    flat = ranges(offsets_S1[:-1][seq], length_S)
    seq_offsets = np.zeros_like(offsets_S1)
    np.cumsum(length_S, out=seq_offsets[1:])

    def like(a, values):
        return np.asarray(values).astype(np.asarray(a).dtype, copy=False)

    def per_seq(a):
        return None if a is None else np.asarray(a)[seq]

    return Pack(
        input_ids=np.asarray(pack.input_ids)[old_T],
        position_ids=np.asarray(pack.position_ids)[old_T],
        parent=like(pack.parent, parent_T),
        subtree_end=like(pack.subtree_end, np.arange(T, dtype=np.int64) + size_T[old_T]),
        scale=np.asarray(pack.scale)[old_T],
        loss_weight=np.asarray(pack.loss_weight)[old_T],
        n_real=pack.n_real,
        seq_ids=[pack.seq_ids[i] for i in seq.tolist()],
        seq_index=per_seq(pack.seq_index),
        seq_leaf=like(pack.seq_leaf, leaf_S[seq]),
        seq_offsets=seq_offsets,
        seq_token_index=like(pack.seq_token_index, new_T[np.asarray(pack.seq_token_index, dtype=np.int64)[flat]]),
        seq_loss_mask=np.asarray(pack.seq_loss_mask)[flat],
        seq_logprobs=None if pack.seq_logprobs is None else np.asarray(pack.seq_logprobs)[flat],
        advantages=per_seq(pack.advantages),
        rewards=per_seq(pack.rewards),
        seq_groups=None if pack.seq_groups is None else [pack.seq_groups[i] for i in seq.tolist()],
        seq_steps=per_seq(pack.seq_steps),
        meta=dict(pack.meta),
    )
