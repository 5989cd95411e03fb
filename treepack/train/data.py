"""Where training gets its packs: packed shard directories, or rollouts packed here (`treepack verify` packs
rollout files as `treepack pack` does).

Rollout files are packed on the fly by `treepack.pack.pack_rollouts` with ``whole_trees=True`` (docs/design.md
§5): trees (``tree_id`` groups, split by ``step``) whole and in input order, the trees of a pack sharing their
common prefixes, a tree larger than the capacity cut by ``treepack pack``'s ``best`` packer, so that every GRPO
group that fits a pack trains in one step (`treepack.pack.packs` has the policy and its numbers).

A global batch is ``packs_per_step`` consecutive packs of an epoch order; the order of epoch e is a
permutation seeded by (seed, e), so the batch of any step is a pure function of the config and the step
number and a resumed run sees exactly the batches it would have seen.

The dense modes' plan of one pack (`plan_dense`): which of its sequences are forwarded ("lanes": every
sequence with a loss row for ``dense``, one per leaf path for ``dense-leaf``, cut after its last target),
in which micro-batches (first-fit decreasing under a token budget: at most 11/9 of the fewest micro-batches
+ 1; the tau-bench sample's first 8 packs at 16K need 7-13, at most one above ceil(flat tokens / pack
tokens)), and from which lane position each loss row reads its log-prob. Numpy only, O(F + R) plus the
packing loop over lanes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from treepack.errors import ConfigError, InputError, TreepackError
from treepack.io.ingest import read_rollouts
from treepack.io.rollouts import Rollouts, ranges
from treepack.pack.layout import Pack, build_pack, relayout
from treepack.pack.packs import pack_rollouts as pack_whole_trees
from treepack.tree import PrefixTree


def pack_rollouts(r: Rollouts, capacity: int, *, max_packs: int | None = None) -> Iterator[Pack]:
    """Packs of whole trees, each with a union trie of at most ``capacity`` tokens (see the module doc)."""
    return iter(pack_whole_trees(r, capacity, whole_trees=True, max_packs=max_packs))


def leaf_sequences(r: Rollouts) -> np.ndarray:
    """Input indices of one sequence per leaf of the trie, ascending: duplicates and proper prefixes of
    another sequence dropped (the leaves' own tokens only; `plan_dense` with ``leaves=True`` also hosts the
    dropped sequences' loss rows, which `treepack train`'s ``dense-leaf`` mode needs for the same loss)."""
    tree = PrefixTree.from_arrays(r.tokens, r.offsets)
    return np.sort(tree.order[tree.is_leaf_seq])


def dense_batches(r: Rollouts, index: np.ndarray, budget: int) -> list[Pack]:
    """Whole sequences ``index`` in that order, micro-batches of <= ``budget`` flat tokens (a longer
    sequence alone): the benchmarks' dense baselines, one pack per micro-batch."""
    packs, current, size = [], [], 0
    for i in np.asarray(index).tolist():
        n = int(r.lengths[i])
        if current and size + n > budget:
            packs.append(build_pack(r, np.asarray(current)))
            current, size = [], 0
        current.append(i)
        size += n
    if current:
        packs.append(build_pack(r, np.asarray(current)))
    return packs


# --------------------------------------------------------------------------------------------------
# Dense micro-batches of one pack (modes dense and dense-leaf)


@dataclass
class DensePlan:
    """How a dense mode runs one pack: the sequences it forwards ("lanes"), how many tokens of each, in
    which micro-batches, and which lane position each loss row reads its log-prob from. Legend: Q lanes,
    B micro-batches, R loss rows."""

    seq_Q: np.ndarray  # int64 pack sequence of each lane, micro-batch by micro-batch
    length_Q: np.ndarray  # int64 tokens forwarded of each lane (its first tokens)
    batch_B1: np.ndarray  # int64 [B+1] split of the lanes into micro-batches
    lane_R: np.ndarray  # int64 lane whose forward yields row r's log-prob
    pos_R: np.ndarray  # int64 position of row r's target in that lane (>= 1): read at pos_R - 1

    @property
    def n_batches(self) -> int:
        return int(self.batch_B1.shape[0] - 1)

    @property
    def tokens(self) -> int:
        return int(self.length_Q.sum())

    @property
    def pairs(self) -> int:
        """Visible (query, key) pairs of causal attention over the lanes."""
        return int((self.length_Q * (self.length_Q + 1) // 2).sum())

    @property
    def predicted(self) -> int:
        """Distinct (lane, position) log-probs the rows read."""
        return int(np.unique(self.lane_R * (int(self.length_Q.max(initial=0)) + 1) + self.pos_R).shape[0])

    def batch_rows(self) -> list[np.ndarray]:
        """Row indices of each micro-batch (ascending within each)."""
        if self.n_batches == 0:
            return []
        batch_Q = np.repeat(np.arange(self.n_batches), np.diff(self.batch_B1))
        batch_R = batch_Q[self.lane_R]
        order = np.argsort(batch_R, kind="stable")
        return np.split(order, np.cumsum(np.bincount(batch_R, minlength=self.n_batches))[:-1])


def _fill(length_Q: np.ndarray, budget: int) -> list[list[int]]:
    """First-fit decreasing: lanes into the fewest micro-batches of <= ``budget`` tokens (<= 11/9 of the
    optimum + 1; a lane longer than the budget alone), lanes ascending inside each, batches by first lane."""
    bins: list[list[int]] = []
    free: list[int] = []
    for q in np.argsort(-length_Q, kind="stable").tolist():
        n = int(length_Q[q])
        for b, room in enumerate(free):
            if n <= room:
                bins[b].append(q)
                free[b] -= n
                break
        else:
            bins.append([q])
            free.append(budget - n)
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])


def plan_dense(pack: Pack, token_R: np.ndarray, seq_R: np.ndarray, flat_R: np.ndarray, *, leaves: bool,
               budget: int) -> DensePlan:
    """The micro-batches of ``dense`` (``leaves`` False: every sequence with a loss row, whole) or ``dense-leaf`` (one
    lane per leaf of the pack's sub-trie, forwarded up to its last target; a row of a duplicate or of a
    prefix of another sequence reads the same log-prob from a lane whose path holds its target).

    Only the sequences' own fields are read (``seq_offsets``, ``seq_token_index``): never ``parent``,
    ``subtree_end`` or ``position_ids``, so a pack whose tree fields lie still gets a correct baseline.
    A path is a prefix of another iff its last pack token lies on the other path before that path's end.
    """
    offsets_S1 = np.asarray(pack.seq_offsets, dtype=np.int64)
    index_F = np.asarray(pack.seq_token_index, dtype=np.int64)
    S = offsets_S1.shape[0] - 1
    length_S = np.diff(offsets_S1)
    j_R = flat_R - offsets_S1[seq_R]
    if not leaves:  # every sequence with a loss row, whole
        seq_Q = np.flatnonzero(np.bincount(seq_R, minlength=S) > 0)
        length_Q = length_S[seq_Q]
        lane_of_S = np.full(S, -1, dtype=np.int64)
        lane_of_S[seq_Q] = np.arange(seq_Q.shape[0])
        lane_R, pos_R = lane_of_S[seq_R], j_R
    else:
        T = int(np.asarray(pack.input_ids).shape[0])
        inner_F = np.ones(index_F.shape[0], dtype=bool)
        inner_F[offsets_S1[1:] - 1] = False  # last token of each path
        continues_T = np.zeros(T, dtype=bool)
        continues_T[index_F[inner_F]] = True  # some path goes on after this token
        last_S = index_F[offsets_S1[1:] - 1]
        candidates = np.flatnonzero(~continues_T[last_S])
        _, first = np.unique(last_S[candidates], return_index=True)  # duplicates: the first one
        leaf_L = np.sort(candidates[first])
        # Host of every token on a leaf path: one lane holding it (any does; numpy keeps one writer).
        host_T = np.full(T, -1, dtype=np.int64)
        host_T[index_F[ranges(offsets_S1[leaf_L], length_S[leaf_L])]] = np.repeat(np.arange(leaf_L.shape[0]),
                                                                                   length_S[leaf_L])
        host_R = host_T[token_R]
        ok = host_R >= 0
        ok[ok] = j_R[ok] < length_S[leaf_L[host_R[ok]]]
        ok[ok] = index_F[offsets_S1[leaf_L[host_R[ok]]] + j_R[ok]] == token_R[ok]
        if not ok.all():
            r = int(np.argmin(ok))
            raise TreepackError(f"sequence {pack.seq_ids[int(seq_R[r])]!r}: its path is not a prefix of a leaf path "
                             f"(pack token {int(token_R[r])} at depth {int(j_R[r])}); seq_token_index is not a trie")
        need_L = np.zeros(leaf_L.shape[0], dtype=np.int64)
        np.maximum.at(need_L, host_R, j_R)
        keep = np.flatnonzero(need_L > 0)  # a leaf whose path holds no target is not forwarded
        lane_of_L = np.full(leaf_L.shape[0], -1, dtype=np.int64)
        lane_of_L[keep] = np.arange(keep.shape[0])
        seq_Q, length_Q = leaf_L[keep], need_L[keep]
        lane_R, pos_R = lane_of_L[host_R], j_R
    bins = _fill(length_Q, max(int(budget), 1))
    order_Q = np.asarray([q for b in bins for q in b], dtype=np.int64)
    new_of_Q = np.empty(order_Q.shape[0], dtype=np.int64)
    new_of_Q[order_Q] = np.arange(order_Q.shape[0])
    batch_B1 = np.zeros(len(bins) + 1, dtype=np.int64)
    np.cumsum([len(b) for b in bins], out=batch_B1[1:])
    return DensePlan(seq_Q=np.asarray(seq_Q, np.int64)[order_Q], length_Q=np.asarray(length_Q, np.int64)[order_Q],
                     batch_B1=batch_B1, lane_R=new_of_Q[lane_R], pos_R=np.asarray(pos_R, np.int64))


def load_packs(
    sources: str | Path | list,
    *,
    capacity: int | None = None,
    max_packs: int | None = None,
    progress: Callable[[int], None] | None = None,
    child_order: str = "lex",
) -> list[Pack]:
    """Packs from a packed shard directory (``manifest.json`` inside), or from rollout files packed at
    ``capacity``. ``max_packs`` stops early (verification of a sample). ``child_order``: the DFS order of
    each pack's tokens (`treepack.pack.layout.relayout`; ``lex`` = as packed)."""
    if isinstance(sources, (str, Path)):
        sources = [sources]
    paths = [Path(s) for s in sources]
    if len(paths) == 1 and paths[0].is_dir() and (paths[0] / "manifest.json").is_file():
        try:
            from treepack.pack.shard_reader import read_packs
        except ImportError:
            raise ConfigError(f"{paths[0]}: reading packed shards needs treepack.pack.shards") from None
        packs = []
        for pack in read_packs(paths[0]):
            packs.append(relayout(pack, child_order))
            if max_packs is not None and len(packs) >= max_packs:
                break
        return packs
    if capacity is None:
        raise ConfigError("packing rollout files needs a capacity (e.g. --capacity 16k)")
    r = read_rollout_files(paths, progress=progress)
    return [relayout(p, child_order) for p in pack_rollouts(r, capacity, max_packs=max_packs)]


def read_rollout_files(paths: list[Path], *, progress: Callable[[int], None] | None = None) -> Rollouts:
    """The records of rollout files (``-``: stdin), refusing a missing path or an input without records."""
    for p in paths:
        if str(p) != "-" and not p.exists():
            raise InputError(f"{p}: no such file or directory")
    r = read_rollouts([str(p) for p in paths], progress=progress)
    if len(r) == 0:
        raise InputError(f"{', '.join(map(str, paths))}: no rollout records")
    return r


def data_where(sources: str | Path | list) -> str:
    """``"<path>: "`` when the data is one file or directory (it prefixes messages about its records), else ``""``."""
    paths = [sources] if isinstance(sources, (str, Path)) else list(sources)
    return f"{paths[0]}: " if len(paths) == 1 else ""


def compact_vocab(packs: list[Pack]) -> tuple[list[Pack], np.ndarray]:
    """Remap token ids to 0..n-1 over the ids present: (remapped packs, the original id of each new id).

    For random-init models only (tiny CPU runs, `treepack verify`): a 151,669-entry Qwen vocabulary makes
    every log-prob a 151k-wide softmax, while a tau-bench pack uses ~3.4k distinct ids. The model then
    learns (or checks) the same thing on an equally valid, smaller vocabulary."""
    ids = np.unique(np.concatenate([np.asarray(p.input_ids[: p.n_real]) for p in packs]))
    remapped = [dataclasses.replace(p, input_ids=np.searchsorted(ids, np.asarray(p.input_ids)).astype(np.int32))
                for p in packs]
    return remapped, ids


def epoch_order(n_packs: int, epoch: int, *, seed: int, shuffle: bool) -> np.ndarray:
    """The pack order of one epoch (a seeded permutation, or file order)."""
    if not shuffle:
        return np.arange(n_packs)
    return np.random.default_rng([seed, epoch]).permutation(n_packs)


def batch_indices(step: int, n_packs: int, packs_per_step: int, *, seed: int, shuffle: bool) -> list[int]:
    """Pack indices of global batch ``step`` (0-based): consecutive slots of the concatenated epoch orders."""
    out = []
    for slot in range(step * packs_per_step, (step + 1) * packs_per_step):
        epoch, i = divmod(slot, n_packs)
        out.append(int(epoch_order(n_packs, epoch, seed=seed, shuffle=shuffle)[i]))
    return out
