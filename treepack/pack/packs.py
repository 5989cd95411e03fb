"""Rollouts to laid-out packs: `pack_rollouts`, the one way in for every caller that trains on packs.

`treepack.pack.strategies.pack_sequences` decides which sequences share a pack (``treepack pack`` and
``stats --capacity`` stop there and write or count its `Packing`); `pack_rollouts` lays those packs out
(`treepack.pack.layout.build_pack`, docs/design.md §6) for the callers that train on them at once:
``treepack train`` and ``treepack verify`` on rollout files (`treepack.train.data`), `treepack.hf`'s
`PackDataset` and ``token_logprobs`` (token lists, `treepack.hf.batch.plan_packs`). Three policies:

- ``capacity=None``: every sequence in one pack (``treepack.hf``'s default: one forward of the whole batch);
- a capacity: the packs of ``pack_sequences`` with ``strategy`` (``best`` by default: N_pack close to
  N_tree), each pack's sequences in DFS leaf order;
- a capacity and ``whole_trees=True``: what ``treepack train`` does with rollout files. The packing
  strategies optimise N_pack over the whole batch and may cut a GRPO group between packs, hence between
  optimizer steps (its advantages still come from the whole group: `treepack.train.losses.
  whole_group_advantages`); this policy trains every group in one step, is predictable, and never repeats a
  prefix it need not. Trees (``tree_id`` groups, split by ``step`` when present; without ``tree_id`` the
  whole input is one tree) are taken in input order; a tree joins the current pack when the pack's union
  trie still fits the capacity, else starts a new pack. Trees of one pack share their common prefixes (a
  system prompt, a task's opening turns), as in ``treepack pack``'s forest: the pack's size is the union's
  (`UnionSize`), not the sum of its trees'. Summing them (the first policy) kept the shared prompt once per
  tree: 144 held-out tau-bench retail records at 32K took 3 packs of 63,018 tokens (as many as the leaf
  sequences, so tree mode saved nothing over dense-leaf) instead of 2 of 54,508, and ToolBench 3 packs of
  66,985 instead of 2 of 59,482. A tree larger than the capacity is cut by ``strategy`` (``best``), which
  repeats as few shared-prefix tokens as it can. Cutting it instead into contiguous runs of input order (the
  first policy) split multi-turn chains between packs, so a record's earlier turns became a leaf of one pack
  and were forwarded again in the next. Packs of a split tree come in the order of their first sequence,
  each pack's sequences in input order.

Cost: the strategies' (``best``: ~8 s for 100M tokens at 60k) plus one `build_pack` per pack, O(its flat
tokens); whole trees add one trie of the batch and an O(1) range minimum per pair of adjacent members.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from treepack.errors import CapacityError
from treepack.io.rollouts import Rollouts
from treepack.pack.layout import Pack, build_pack
from treepack.pack.strategies import describe_sequence, pack_sequences
from treepack.sizes import parse_size
from treepack.tree import PrefixTree, RangeMin, scope_codes

# a sequence over the capacity: what a library caller can change (the CLI's hint names --oversize)
CAPACITY_HINT = "raise capacity, or pass capacity=None to forward every sequence in one pack"


def pack_rollouts(r: Rollouts, capacity: int | str | None, *, strategy: str = "best",
                  whole_trees: bool = False, max_packs: int | None = None,
                  oversize_hint: str = CAPACITY_HINT) -> list[Pack]:
    """Every sequence of ``r`` in laid-out packs of at most ``capacity`` trie tokens (see the module doc).

    ``capacity``: tokens, a size such as "60k", or None for one pack of everything. ``strategy``: one of
    `treepack.pack.strategies.STRATEGIES`; with ``whole_trees`` it cuts only the trees larger than the
    capacity. ``max_packs``: stop after this many packs (whole trees: the rest is never packed). A sequence
    longer than the capacity raises ``CapacityError`` naming it (ending with ``oversize_hint``; whole trees:
    with the capacity)."""
    if len(r) == 0:
        return []
    if capacity is None:
        return [build_pack(r)]
    capacity = parse_size(capacity, what="capacity") if isinstance(capacity, str) else int(capacity)
    if whole_trees:
        packs = _whole_trees(r, capacity, strategy)
        return [p for _, p in zip(range(max_packs), packs)] if max_packs is not None else list(packs)
    packing = pack_sequences(r, capacity, strategy=strategy, oversize_hint=oversize_hint)
    return [build_pack(r, index) for index in packing.packs[:max_packs]]


def _whole_trees(r: Rollouts, capacity: int, strategy: str) -> Iterator[Pack]:
    """Packs of whole trees in input order, each with a union trie of at most ``capacity`` tokens."""
    lengths = r.lengths
    too_long = np.flatnonzero(lengths > capacity)
    if too_long.size:
        i = int(too_long[0])
        raise CapacityError(f"{describe_sequence(r, i)} has {int(lengths[i])} tokens, more than the capacity "
                            f"{capacity}")
    shared, _ = scope_codes(r)  # what may share tokens in a pack: sequences of one step, whatever their tree
    # what stays whole: a tree of a step
    unit, _ = scope_codes(r, "tree_id" if r.groups is not None else None)
    if unit is None:
        unit = np.zeros(len(r), dtype=np.int64)
    # Trees in order of first appearance; sequences of a tree in input order.
    _, first = np.unique(unit, return_index=True)
    tree_order = unit[np.sort(first)]
    members = {int(t): np.flatnonzero(unit == t) for t in tree_order.tolist()}
    union = UnionSize(r, shared)
    current: list[np.ndarray] = []
    current_ranks = np.zeros(0, dtype=np.int64)
    for t in tree_order.tolist():
        index = members[int(t)]
        ranks = np.sort(union.rank[index])
        if union(ranks) <= capacity:
            merged = np.union1d(current_ranks, ranks)
            if not current or union(merged) <= capacity:
                current.append(index)
                current_ranks = merged
                continue
            yield build_pack(r, np.concatenate(current), scope=shared)
            current, current_ranks = [index], ranks
            continue
        if current:
            yield build_pack(r, np.concatenate(current), scope=shared)
            current, current_ranks = [], np.zeros(0, dtype=np.int64)
        for run in _split_tree(r, index, capacity, strategy):
            yield build_pack(r, run, scope=shared)
    if current:
        yield build_pack(r, np.concatenate(current), scope=shared)


def _split_tree(r: Rollouts, index: np.ndarray, capacity: int, strategy: str) -> list[np.ndarray]:
    """The sequences ``index`` (one tree larger than ``capacity``) cut into packs by ``strategy``: each
    pack's sequences ascending, packs in the order of their first sequence."""
    packing = pack_sequences(r.select(index), capacity, strategy=strategy)
    runs = [np.sort(index[p]) for p in packing.packs]
    return sorted(runs, key=lambda run: int(run[0]))


class UnionSize:
    """Trie tokens of the union of any set of a batch's sequences, from one trie of the whole batch: with
    the sequences in the trie's (lexicographic) order, the union's size is the sum of their lengths minus,
    for each after the first, its longest common prefix with the one before it among the set, which is the
    minimum of the adjacent LCPs between the two (a range minimum, O(1) a pair). Sequences of different
    scopes (steps) share nothing."""

    def __init__(self, r: Rollouts, scope: np.ndarray | None) -> None:
        whole = PrefixTree.from_arrays(r.tokens, r.offsets, scope)
        self.rank = np.empty(len(r), dtype=np.int64)
        self.rank[whole.order] = np.arange(len(r))
        self.lengths = whole.lengths
        self.lcp = RangeMin(whole.lcp.astype(np.int32))  # lengths < 2^31 (check_token_buffer)

    def __call__(self, ranks: np.ndarray) -> int:
        """Trie tokens of the sequences at the sorted, distinct trie ranks ``ranks``."""
        size = int(self.lengths[ranks].sum())
        if len(ranks) > 1:
            size -= int(self.lcp(ranks[:-1] + 1, ranks[1:] + 1).sum(dtype=np.int64))
        return size
