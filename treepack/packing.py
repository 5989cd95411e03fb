"""Packing: cut each global batch's prefix trees into packs of at most ``capacity`` trie tokens, repeating
as few shared-prefix tokens as possible (N_pack -> N_tree, so ERR -> POR).

Legend: n = sequences, V = compressed trie nodes, P = packs, C = capacity (tokens). Sequences are named by
their *rank* i in the PrefixTree's lexicographic order, which is a DFS leaf order of the trie.

The cost of a pack is the size of the union trie of its sequences, and the total is
``N_pack = sum over nodes v of len(v) x (packs that touch v's subtree)``. Two facts make it cheap to work with:
- LCP of ranks r < s is ``min(lcp[r+1..s])`` (a sparse table answers it in O(1), vectorised), so the cost
  of any pack is ``sum L - sum LCP(consecutive members by rank)`` (``pack_tokens``);
- in any DFS leaf order (children of each node permuted at will, a subtree's sequences contiguous) a
  contiguous group [a..b] costs ``lcp_a + sum_{k=a..b} (L_k - lcp_k)``, lcp taken with the previous
  sequence *in that order*: so cutting the order into groups costs ``N_tree + sum of lcp at the cuts``.

Strategies (all on the same tree; packs never cross a ``step``, sharing never crosses a scope):
- ``first-fit``: AReaL's production packer (``_greedy_build_tries``): sequences in input order, each into
  the first pack whose trie it fits (``load + L - maxLCP(s, pack) <= C``), else a new pack. Reproduced
  exactly (tests compare pack for pack with a port of AReaL's dict trie) without its O(n x P) trie walks:
  the packs sharing more than the step-wide header with ``s`` are those present in the subtrees of ``s``'s
  ancestors, kept as sets per node; the others are one vectorised ``argmax`` over the pack loads.
- ``dfs``: Tree Training's heuristic (§3.3): children visited deepest leaf first (similar depths stay
  together), one DFS traversal, a new pack whenever the next sequence would overflow.
- ``optimal``: Tree Training Appendix A.2's multi-path DP, made exact (``treepack.multipath``); exponential,
  so refused above ``OPTIMAL_MAX_SEQUENCES`` sequences per step or ``OPTIMAL_BUDGET`` assignments.
- ``best`` (default), per step the cheapest of:
  1. the *optimal contiguous cut* of several DFS leaf orders (lexicographic, subtree size descending,
     deepest leaf first, AReaL-DTA Algorithm 1's order, and the order of the bottom-up bins below):
     ``f[b] = min f[a-1] + lcp_a`` over feasible groups [a..b]; feasibility is monotone in b, so a
     lazy-deletion heap makes it O(n log n);
  2. the *bottom-up* bin packing: leaves to roots, each node packs its children's bins by best-fit
     decreasing within ``C - depth - len`` (packs need not be contiguous in any order: pieces of two
     subtrees may share two packs). It wins on most inputs;
  3. first-fit and dfs (so ``best`` never loses to either);
  then, on steps of up to ``BEAM_MAX_SEQUENCES`` sequences, the multi-path DP with a beam of ``BEAM``
  states per node (it keeps, e.g., a subtree split in two packs when that lets both halves fit beside
  other subtrees), and on steps of up to ``OPTIMAL_MAX_SEQUENCES``, the exact DP within
  ``BEST_EXACT_BUDGET`` assignments (so ``best`` equals ``optimal`` wherever that is cheap).
  Each refinement only replaces a step's packs when it is strictly cheaper: ``best`` is never worse
  than any candidate, by construction. The objective is N_pack (ERR), ties broken by fewer packs; so
  on GRPO data it keeps groups whole (a cut inside a group repeats its prompt, a cut between groups only
  the system prompt) even when that takes more, emptier packs than first-fit.

Measured (benchmarks/results/2026-11-21-packing.md; AMD EPYC, 2 cores): on 9 datasets (5 synthetic kinds,
4 real files) x 4 capacities (8k-60k) x 2 input orders, ``best`` is above AReaL's first-fit in 70 of 72
rows (equal in the 2 where one pack holds everything): +0.15 to +5.1 ERR points in input order, +3.6 to +48
points shuffled (first-fit depends on the order, ``best`` does not); above Tree Training's dfs by up to
3.1 points; at 32k-60k within 0.42 points of the capacity-aware bound (1 - sum_v len(v) ceil(size(v) /
(C - depth(v))) / N_flat) on every dataset. It equals ``optimal`` on all 130 single trees (<= 12
sequences) of those datasets where the exact DP finishes, before its own exact step too. 100M tokens
(200k sequences, the most per token) pack at 60k in ~8 s with the tree build (first-fit ~5 s, dfs ~2 s).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from treepack.errors import CapacityError, TreepackError
from treepack.multipath import BudgetExceeded, TreeView, solve
from treepack.rollouts import Rollouts
from treepack.tree import PrefixTree, scope_codes

STRATEGIES = ("best", "first-fit", "dfs", "optimal")
OVERSIZE = ("error", "skip")
# The exact DP is exponential: refused above this many sequences per step, and above OPTIMAL_BUDGET
# assignments tried (the real bound: deep trees with varied lengths blow up sooner than random ones).
OPTIMAL_MAX_SEQUENCES = 20
OPTIMAL_BUDGET = 2_000_000
BEST_EXACT_BUDGET = 20_000  # `best` runs the exact DP on steps of <= OPTIMAL_MAX_SEQUENCES within this budget
BEAM = 4  # states kept per node by the beam DP in `best`
BEAM_MAX_SEQUENCES = 20_000  # the beam DP runs on steps up to this size
FEW_ORDERS_ABOVE = 50_000  # `best` cuts fewer candidate orders above this many sequences


@dataclass
class Packing:
    """The result of packing: which input sequences go together, and what it costs."""

    strategy: str
    capacity: int
    packs: list[np.ndarray]  # each: int64 input-sequence indices (into the Rollouts) of one pack, in DFS order
    pack_tokens: np.ndarray  # int64 [n_packs] tokens of each pack's union sub-trie (scopes kept apart)
    n_flat_tokens: int  # tokens of the packed sequences (what dense training computes)
    seconds: float  # wall time of pack_sequences (a tree build included unless a tree was given)
    n_oversize_skipped: int = 0  # sequences longer than the capacity, dropped with oversize="skip"
    n_tree_tokens: int = 0  # tokens of the whole trie of the packed sequences (N_tree: the lower bound)
    pack_steps: np.ndarray | None = None  # int64 [n_packs] the step of each pack's sequences (None: no steps)
    pack_attention_pairs: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # sum of depth+1
    oversize_skipped: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # their input indices
    details: dict = field(default_factory=dict)  # `best`: N_pack of every candidate it tried, and the winner

    @property
    def n_packs(self) -> int:
        return len(self.packs)

    @property
    def n_pack_tokens(self) -> int:
        return int(self.pack_tokens.sum())

    @property
    def err(self) -> float:
        """Effective reuse ratio: 1 - N_pack / N_flat."""
        return 1.0 - self.n_pack_tokens / self.n_flat_tokens if self.n_flat_tokens else 0.0

    @property
    def por(self) -> float:
        """Potential overlap ratio of the packed sequences: 1 - N_tree / N_flat (ERR's upper bound)."""
        return 1.0 - self.n_tree_tokens / self.n_flat_tokens if self.n_flat_tokens else 0.0


def describe_sequence(r: Rollouts, i: int) -> str:
    """``file: sequence id 'x' (record 17)``: where input sequence ``i`` came from (record: 0-based, in its file)."""
    base = 0
    for src in r.sources:
        if i < base + src.n_records:
            name = "<stdin>" if src.path == "-" else src.path
            return f"{name}: sequence id {r.ids[i]!r} (record {i - base})"
        base += src.n_records
    return f"sequence id {r.ids[i]!r} (record {i})"


def pack_sequences(
    rollouts: Rollouts,
    capacity: int,
    *,
    strategy: str = "best",
    group_by: str | None = None,
    oversize: str = "error",
    tree: PrefixTree | None = None,
) -> Packing:
    """Pack every sequence of ``rollouts`` into packs whose union trie has at most ``capacity`` tokens.

    ``group_by="tree_id"`` keeps each tree_id its own trie (no sharing across groups); sharing never crosses
    a ``step`` and neither do packs. ``oversize``: a sequence longer than ``capacity`` raises
    ``CapacityError`` naming it (``"error"``) or is left out and counted (``"skip"``). ``tree`` reuses a
    PrefixTree already built from the same rollouts and ``group_by``.
    """
    if strategy not in STRATEGIES:
        raise TreepackError(f"unknown packing strategy {strategy!r}: expected one of {', '.join(STRATEGIES)}")
    if oversize not in OVERSIZE:
        raise TreepackError(f"oversize must be 'error' or 'skip', got {oversize!r}")
    capacity = int(capacity)
    if capacity <= 0:
        raise TreepackError(f"capacity must be positive, got {capacity}")
    t0 = time.perf_counter()
    n = len(rollouts)
    lengths = rollouts.lengths
    too_long = np.flatnonzero(lengths > capacity)
    keep = None
    if len(too_long):
        if oversize == "error":
            i = int(too_long[0])
            raise CapacityError(
                f"{describe_sequence(rollouts, i)} has {int(lengths[i]):,} tokens > capacity {capacity:,}; "
                "use --oversize skip to drop such sequences"
            )
        keep = np.setdiff1d(np.arange(n, dtype=np.int64), too_long)
        rollouts = rollouts.select(keep)
        tree = None
    scope, _ = scope_codes(rollouts, group_by)
    batch_in = np.zeros(len(rollouts), np.int64) if rollouts.steps is None else rollouts.steps
    if (tree is None or tree.n_sequences != len(rollouts) or not _batches_contiguous(batch_in[tree.order])
            or not np.array_equal(tree.scope, np.zeros(len(rollouts), np.int64) if scope is None else scope[tree.order])):
        tree = PrefixTree.from_arrays(rollouts.tokens, rollouts.offsets, scope)
    forest = _Forest(tree, batch_in[tree.order], capacity)
    if forest.n == 0:
        labels, details = np.zeros(0, np.int64), {}
    elif strategy == "first-fit":
        labels, details = first_fit_labels(forest), {}
    elif strategy == "dfs":
        labels, details = dfs_labels(forest), {}
    elif strategy == "optimal":
        labels, details = optimal_labels(forest), {}
    else:
        labels, details = best_labels(forest)
    packs_sorted, pack_tokens, pack_pairs = forest.packs_of(labels)
    to_input = tree.order if keep is None else keep[tree.order]
    packs = [to_input[p] for p in packs_sorted]
    pack_steps = None
    if rollouts.steps is not None and len(packs_sorted):
        pack_steps = np.asarray([int(batch_in[tree.order[p[0]]]) for p in packs_sorted], dtype=np.int64)
    return Packing(
        strategy=strategy,
        capacity=capacity,
        packs=packs,
        pack_tokens=pack_tokens,
        n_flat_tokens=int(tree.n_flat_tokens),
        seconds=time.perf_counter() - t0,
        n_oversize_skipped=len(too_long),
        n_tree_tokens=int(tree.n_tree_tokens),
        pack_steps=pack_steps,
        pack_attention_pairs=pack_pairs,
        oversize_skipped=too_long.astype(np.int64),
        details=details,
    )


def _batches_contiguous(batch: np.ndarray) -> bool:
    return bool(np.all(batch[1:] >= batch[:-1])) if len(batch) > 1 else True


# --------------------------------------------------------------------------------------------------
# The forest: ranks, LCP queries, nodes, and the exact cost of any packing


class _SparseTable:
    """Range minimum (or maximum) of a fixed int array in O(1) per query, vectorised over queries."""

    def __init__(self, a: np.ndarray, op: Callable = np.minimum):
        a = np.asarray(a, dtype=np.int32)  # lengths and LCPs fit; halves the n log n table
        self.op = op
        self.levels = [a]
        k = 1
        while 2 * k <= len(a):
            prev = self.levels[-1]
            self.levels.append(op(prev[:-k], prev[k:]))
            k *= 2

    def query(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """op over ``a[lo:hi]`` for each pair (hi > lo)."""
        lo = np.asarray(lo, dtype=np.int64)
        hi = np.asarray(hi, dtype=np.int64)
        span = hi - lo
        k = np.zeros(len(span), dtype=np.int64)
        if len(span):
            k = np.floor(np.log2(np.maximum(span, 1))).astype(np.int64)
            k[(1 << k) > span] -= 1  # float rounding guard
        out = np.empty(len(span), dtype=np.int64)
        for level in np.unique(k):
            sel = k == level
            tab = self.levels[int(level)]
            out[sel] = self.op(tab[lo[sel]], tab[hi[sel] - (1 << int(level))])
        return out


class _Forest:
    """A PrefixTree seen by the packers: ranks, batches (steps), LCP of any two ranks, node paths."""

    def __init__(self, tree: PrefixTree, batch: np.ndarray, capacity: int):
        self.t = tree
        self.C = int(capacity)
        self.n = tree.n_sequences
        self.L = tree.lengths
        self.lcp = tree.lcp
        codes = np.unique(batch, return_inverse=True)[1] if self.n else np.zeros(0, np.int64)
        self.batch = codes.reshape(-1).astype(np.int64)  # step code of each rank, non-decreasing
        self.batch_bounds = (np.flatnonzero(np.r_[True, self.batch[1:] != self.batch[:-1], True]) if self.n
                             else np.zeros(1, np.int64))  # ranks [bounds[b], bounds[b+1]) are step b
        self._rmq: _SparseTable | None = None

    # ---------------------------------------------------------------- LCP and costs

    @property
    def rmq(self) -> _SparseTable:
        if self._rmq is None:
            self._rmq = _SparseTable(self.lcp)
        return self._rmq

    def lcp_of(self, r: np.ndarray, s: np.ndarray) -> np.ndarray:
        """LCP of the sequences of ranks r and s (elementwise; r != s); 0 across scopes."""
        r = np.asarray(r, dtype=np.int64)
        s = np.asarray(s, dtype=np.int64)
        lo, hi = np.minimum(r, s), np.maximum(r, s)
        out = np.empty(len(r), dtype=np.int64)
        adj = hi == lo + 1
        out[adj] = self.lcp[hi[adj]]
        far = ~adj
        if far.any():
            out[far] = self.rmq.query(lo[far] + 1, hi[far] + 1)
        return out

    def order_lcp(self, perm: np.ndarray) -> np.ndarray:
        """LCP of each sequence of an order with the previous one (0 at the start of a batch)."""
        out = np.zeros(len(perm), dtype=np.int64)
        if len(perm) > 1:
            out[1:] = self.lcp_of(perm[:-1], perm[1:])
            out[1:][self.batch[perm[1:]] != self.batch[perm[:-1]]] = 0
        return out

    def packs_of(self, labels: np.ndarray) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
        """(ranks of each pack in DFS order, its union-trie tokens, its attention pairs); checks the capacity.

        A member's new tokens are those below its LCP with the previous member (by rank); a token at depth
        d attends to its d + 1 ancestors-or-self, so a member adds (L(L+1) - lcp(lcp+1)) / 2 pairs.
        """
        if self.n == 0:
            return [], np.zeros(0, np.int64), np.zeros(0, np.int64)
        labels = np.asarray(labels, dtype=np.int64)
        if len(labels) != self.n or labels.min() < 0:
            raise AssertionError("every sequence must be in exactly one pack")
        idx = np.lexsort((np.arange(self.n), labels))
        lab = labels[idx]
        n_packs = int(lab[-1]) + 1
        shared = np.zeros(self.n, dtype=np.int64)
        same = lab[1:] == lab[:-1]
        if same.any():
            shared[1:][same] = self.lcp_of(idx[:-1][same], idx[1:][same])
        tokens = np.bincount(lab, weights=self.L[idx] - shared, minlength=n_packs).astype(np.int64)
        bounds = np.searchsorted(lab, np.arange(n_packs + 1))
        if np.any(bounds[1:] == bounds[:-1]):
            raise AssertionError("pack labels must be 0..P-1 with no empty pack")
        if tokens.max() > self.C:
            raise AssertionError(f"a pack has {int(tokens.max())} tokens > capacity {self.C}")
        if np.any(self.batch[idx][1:][same] != self.batch[idx][:-1][same]):
            raise AssertionError("a pack crosses a step")
        Ls = self.L[idx]
        pairs = np.bincount(lab, weights=(Ls * (Ls + 1) - shared * (shared + 1)) // 2, minlength=n_packs)
        return [idx[bounds[p] : bounds[p + 1]] for p in range(n_packs)], tokens, pairs.astype(np.int64)

    def cost(self, labels: np.ndarray) -> np.ndarray:
        """Union-trie tokens per batch (int64 [n_batches]) of a labelling (no capacity check)."""
        idx = np.lexsort((np.arange(self.n), labels))
        lab = labels[idx]
        shared = np.zeros(self.n, dtype=np.int64)
        same = lab[1:] == lab[:-1]
        shared[1:][same] = self.lcp_of(idx[:-1][same], idx[1:][same])
        return np.bincount(self.batch[idx], weights=self.L[idx] - shared).astype(np.int64)

    # ---------------------------------------------------------------- nodes

    @property
    def end_node(self) -> np.ndarray:
        """int64 [n] the node holding each sequence's last token (sequences end at node ends)."""
        if not hasattr(self, "_end_node"):
            self._end_node = np.searchsorted(self.t.node_start, self.t.seq_end_token, side="right") - 1
        return self._end_node

    @property
    def end_depth(self) -> np.ndarray:
        """int64 [V] depth just below each node: tokens on the path from the root through the node."""
        return self.t.node_depth + self.t.node_len

    def node_batch(self) -> np.ndarray:
        return self.batch[self.t.node_seq]

    def subtree_end_node(self) -> np.ndarray:
        """int64 [V] exclusive end of each node's subtree in node (preorder) indices."""
        return np.searchsorted(self.t.node_start, self.t.node_end, side="left")

    def dfs_order(self, key: np.ndarray) -> np.ndarray:
        """A DFS leaf order with each node's children (and each batch's roots) sorted by ``key`` ascending.

        Ties keep the lexicographic order; sequences ending at a node come before its children. The
        position of a node is the sum, over its ancestors and itself, of what precedes it among its
        siblings: a difference array over preorder subtree ranges, so everything is vectorised.
        """
        t = self.t
        V = t.n_nodes
        parent = t.node_parent
        count = t.node_count
        ends_at = np.bincount(self.end_node, minlength=V)
        roots = parent < 0
        group = np.where(roots, -1 - self.node_batch(), parent)
        order = np.lexsort((np.arange(V), key, group))
        g = group[order]
        c = count[order]
        csum = np.cumsum(c) - c
        first = np.r_[True, g[1:] != g[:-1]]
        start_of_group = np.maximum.accumulate(np.where(first, np.arange(V), 0))
        off = np.empty(V, dtype=np.int64)
        off[order] = csum - csum[start_of_group]
        batch_first = self.batch_bounds[:-1]
        base = np.where(roots, batch_first[self.node_batch()], ends_at[np.maximum(parent, 0)])
        local = base + off
        sub_end = self.subtree_end_node()
        diff = np.bincount(np.arange(V), weights=local, minlength=V + 1) - np.bincount(sub_end, weights=local, minlength=V + 1)
        pos = np.cumsum(diff)[:V].astype(np.int64)
        en = self.end_node
        seq_pos = pos[en] + (np.arange(self.n) - np.searchsorted(en, en, side="left"))
        perm = np.empty(self.n, dtype=np.int64)
        perm[seq_pos] = np.arange(self.n)
        return perm

    def subtree_max_length(self) -> np.ndarray:
        """int64 [V] longest sequence in each node's subtree (its deepest leaf)."""
        lo = self.t.node_seq
        return _SparseTable(self.L, np.maximum).query(lo, lo + self.t.node_count)

    def children(self) -> list[list[int]]:
        kids: list[list[int]] = [[] for _ in range(self.t.n_nodes)]
        for v, p in enumerate(self.t.node_parent.tolist()):
            if p >= 0:
                kids[p].append(v)
        return kids


# --------------------------------------------------------------------------------------------------
# first-fit (AReaL)


def first_fit_labels(f: _Forest, input_order: np.ndarray | None = None) -> np.ndarray:
    """AReaL's greedy trie packing, exactly: each sequence (in input order) into the first pack it fits."""
    t = f.t
    C = f.C
    if input_order is None:
        input_order = np.argsort(t.order, kind="stable")  # rank of input 0, 1, 2, ...
    parent = t.node_parent.tolist()
    end_depth = f.end_depth.tolist()
    end_node = f.end_node.tolist()
    L = f.L.tolist()
    batch = f.batch.tolist()
    n_batches = len(f.batch_bounds) - 1
    present: list[set | None] = [None] * t.n_nodes  # packs that hold a sequence of the node's subtree
    floor = [0] * t.n_nodes  # a lower bound on the loads of those packs (loads only grow): skips most scans
    loads = [np.zeros(f.batch_bounds[b + 1] - f.batch_bounds[b], dtype=np.int64) for b in range(n_batches)]
    n_packs = [0] * n_batches
    local = np.empty(f.n, dtype=np.int64)
    for i in input_order.tolist():
        b = batch[i]
        P = n_packs[b]
        load = loads[b]
        Li = L[i]
        path = []
        v = end_node[i]
        while v >= 0:
            path.append(v)
            v = parent[v]
        path.reverse()
        best = P
        if P:
            # levels whose subtree every pack touches share the same prefix with every pack: one argmax
            j0 = -1
            while j0 + 1 < len(path) and present[path[j0 + 1]] is not None and len(present[path[j0 + 1]]) == P:
                j0 += 1
            thr = C - Li + (end_depth[path[j0]] if j0 >= 0 else 0)
            hit = load[:P] <= thr
            k = int(hit.argmax())
            if hit[k]:
                best = k
            # deeper levels: the packs sharing more with s, deepest first (a pack's deepest level decides)
            seen_size = 0
            for j in range(len(path) - 1, j0, -1):
                v = path[j]
                s = present[v]
                if s is None or len(s) == seen_size:
                    continue
                seen_size = len(s)
                thr = C - Li + end_depth[v]
                if floor[v] > thr:
                    continue
                if len(s) > 32:  # big set: the few packs below `best` with room, then membership
                    for p in np.flatnonzero(load[:best] <= thr).tolist():
                        if p in s:
                            best = p
                            break
                else:
                    lo = None
                    for p in s:
                        lp = load[p]
                        if lo is None or lp < lo:
                            lo = lp
                        if p < best and lp <= thr:
                            best = p
                    floor[v] = int(lo)
        if best == P:
            n_packs[b] = P + 1
            load[best] = Li
        else:
            shared = 0
            for v in reversed(path):  # deepest ancestor whose subtree the pack already touches
                s = present[v]
                if s is not None and best in s:
                    shared = end_depth[v]
                    break
            load[best] += Li - shared
        local[i] = best
        new_load = int(load[best])
        for v in reversed(path):
            s = present[v]
            if s is None:
                present[v] = {best}
                floor[v] = new_load
            elif best in s:
                break
            else:
                s.add(best)
                floor[v] = min(floor[v], new_load)
    return _globalize(f, local, n_packs)


def _globalize(f: _Forest, local: np.ndarray, n_packs: list[int]) -> np.ndarray:
    """Per-batch pack numbers -> global ones (batches in order)."""
    offset = np.cumsum([0] + n_packs[:-1])
    return local + np.asarray(offset, dtype=np.int64)[f.batch]


# --------------------------------------------------------------------------------------------------
# dfs (Tree Training) and contiguous cuts of an order


def dfs_order_deepest_first(f: _Forest) -> np.ndarray:
    """Tree Training's traversal: children with the deepest leaf first (so similar depths stay together)."""
    return f.dfs_order(-f.subtree_max_length())


def dfs_labels(f: _Forest) -> np.ndarray:
    """Tree Training's packing: one DFS traversal, a new pack whenever the next sequence would overflow."""
    perm = dfs_order_deepest_first(f)
    return next_fit(f, perm)


def next_fit(f: _Forest, perm: np.ndarray) -> np.ndarray:
    """Greedy cut of an order: close the pack when the next sequence's new tokens do not fit."""
    add = (f.L[perm] - f.order_lcp(perm)).tolist()
    full = f.L[perm].tolist()
    b = f.batch[perm].tolist()
    C = f.C
    out = np.empty(f.n, dtype=np.int64)
    pack = -1
    load = 0
    prev_b = -1
    lab = [0] * len(add)
    for k in range(len(add)):
        if b[k] != prev_b or load + add[k] > C:
            pack += 1
            load = full[k]
            prev_b = b[k]
        else:
            load += add[k]
        lab[k] = pack
    out[perm] = lab
    return out


def contiguous_cut(f: _Forest, perm: np.ndarray) -> np.ndarray:
    """The optimal cut of an order into contiguous packs: min sum of lcp at pack starts.

    f[b] = min over a of f[a-1] + lcp_a, over a with lcp_a + sum_{k=a..b} add_k <= C, i.e. with
    g(a) = D(a) - L_a >= D(b) - C (D = prefix sums of add = L - lcp). D(b) grows with b, so a start that
    becomes infeasible stays so: a min-heap with lazy deletion gives O(n log n). Heap keys are single ints
    ``cost * M + a`` (ties go to the earlier start, which tends to need fewer packs).
    """
    C = f.C
    lcp = f.order_lcp(perm)
    L = f.L[perm]
    D = np.cumsum(L - lcp)
    g = (D - L).tolist()
    Dl = D.tolist()
    lcpl = lcp.tolist()
    n = len(perm)
    M = n + 1
    choice = [0] * n
    push, pop = heapq.heappush, heapq.heappop
    batch_of = f.batch[perm]
    bounds = np.flatnonzero(np.r_[True, batch_of[1:] != batch_of[:-1], True]).tolist() if n else [0]
    for lo, hi in itertools.pairwise(bounds):  # packs never cross a batch
        heap: list[int] = []
        cost_prev = 0  # best cost of the sequences before k
        for k in range(lo, hi):
            push(heap, (cost_prev + lcpl[k]) * M + k)
            lim = Dl[k] - C
            top = heap[0]
            while g[top % M] < lim:
                pop(heap)
                top = heap[0]
            cost_prev = top // M
            choice[k] = top % M
    lab_sorted = np.empty(n, dtype=np.int64)
    k = n - 1
    groups = []
    while k >= 0:
        a = choice[k]
        groups.append((a, k + 1))
        k = a - 1
    groups.reverse()
    for p, (a, e) in enumerate(groups):
        lab_sorted[a:e] = p
    out = np.empty(n, dtype=np.int64)
    out[perm] = lab_sorted
    return out


# --------------------------------------------------------------------------------------------------
# bottom-up best-fit decreasing (non-contiguous packs), and the child order it induces


def bottom_up_labels(f: _Forest) -> tuple[np.ndarray, np.ndarray]:
    """Bin packing at every node, leaves to roots: (labels, a child-order key for ``dfs_order``).

    At node v the packs ("bins") of its children are items; best-fit decreasing groups them into as few
    bins as fit ``C - depth(v) - len(v)``, and each bin then holds v's tokens once. Pieces of two subtrees
    may so share two packs, which no contiguous cut of a DFS order can express. The key lists each
    node's children in the order of the bins they joined (bins by creation, largest items first).
    """
    t = f.t
    C = f.C
    V = t.n_nodes
    parent = t.node_parent.tolist()
    wlen = t.node_len.tolist()
    end_depth = f.end_depth.tolist()
    node_batch = f.node_batch().tolist()
    n_kids = t.node_children.tolist()
    en = f.end_node
    ends_first = np.searchsorted(en, np.arange(V), side="left").tolist()
    ends_last = np.searchsorted(en, np.arange(V), side="right").tolist()
    pending: list[list | None] = [None] * V  # (load, bin id, child node) of the children's bins
    n_batches = len(f.batch_bounds) - 1
    root_pending: list[list] = [[] for _ in range(n_batches)]
    bin_parent: list[int] = []
    seq_bin = np.empty(f.n, dtype=np.int64)
    key = [0] * V
    bisect_left, insort = bisect.bisect_left, bisect.insort

    def best_fit(items: list, inner: int) -> list[list]:
        """items: (load, bin id, node); returns bins [sum, [bin ids]] (largest items first)."""
        items.sort(key=lambda it: -it[0])
        bins: list[list] = []
        residual: list[tuple[int, int]] = []  # sorted (residual, bin index)
        for load, bid, node in items:
            j = bisect_left(residual, (load, -1))
            if j < len(residual):
                r, k = residual.pop(j)
                bins[k][0] += load
                bins[k][1].append(bid)
                insort(residual, (r - load, k))
            else:
                k = len(bins)
                bins.append([load, [bid]])
                insort(residual, (inner - load, k))
            if node >= 0 and (key[node] == 0 or k + 1 < key[node]):
                key[node] = k + 1
        return bins

    for v in range(V - 1, -1, -1):
        items = pending[v]
        w = wlen[v]
        if items is None:  # a leaf: one new bin
            bid = len(bin_parent)
            bin_parent.append(-1)
            out = [(w, bid, v)]
        elif n_kids[v] == 1:  # one child: its bins did not fit together there, nor will they here
            out = [(load + w, bid, v) for load, bid, _ in items]
            key[items[0][2]] = 1
        else:
            out = []
            for load, members in best_fit(items, C - end_depth[v]):
                bid = len(bin_parent)
                bin_parent.append(-1)
                for m in members:
                    bin_parent[m] = bid
                out.append((load + w, bid, v))
        a, e = ends_first[v], ends_last[v]
        if e > a:
            seq_bin[a:e] = out[0][1]
        p = parent[v]
        if p < 0:
            root_pending[node_batch[v]].extend(out)
        elif pending[p] is None:
            pending[p] = out
        else:
            pending[p].extend(out)
        pending[v] = None
    for b in range(n_batches):
        for load, members in best_fit(root_pending[b], C):
            bid = len(bin_parent)
            bin_parent.append(-1)
            for m in members:
                bin_parent[m] = bid
    top = np.empty(len(bin_parent), dtype=np.int64)
    bp = bin_parent
    for b in range(len(bp) - 1, -1, -1):
        top[b] = b if bp[b] < 0 else top[bp[b]]
    labels = _renumber(f, top[seq_bin])
    return labels, np.asarray(key, dtype=np.int64)


def _renumber(f: _Forest, labels: np.ndarray) -> np.ndarray:
    """Pack ids 0..P-1 by first appearance in rank order (batches stay in order)."""
    _, first, inv = np.unique(labels, return_index=True, return_inverse=True)
    rank_of = np.empty(len(first), dtype=np.int64)
    rank_of[np.argsort(first, kind="stable")] = np.arange(len(first))
    return rank_of[inv.reshape(-1)]


# --------------------------------------------------------------------------------------------------
# optimal (and the beam of it that `best` uses): Tree Training's multi-path DP, see treepack.multipath


def step_views(f: _Forest) -> list[TreeView]:
    """The nodes of each step as a ``multipath.TreeView`` (with the per-node lower bound of extra tokens)."""
    t = f.t
    C = f.C
    size = t.node_end - t.node_start
    lbx = t.node_len * (-(-size // (C - t.node_depth)) - 1)
    csum = np.r_[0, np.cumsum(lbx)]
    lbx_sub = (csum[f.subtree_end_node()] - csum[: t.n_nodes]).tolist()
    kids = f.children()
    en = f.end_node
    starts = np.flatnonzero(np.r_[True, en[1:] != en[:-1]]) if f.n else np.zeros(0, np.int64)
    bounds = np.r_[starts, f.n]
    ends = {int(en[a]): tuple(range(int(a), int(e))) for a, e in itertools.pairwise(bounds)}
    nb = f.node_batch()
    w, depth, size_l = t.node_len.tolist(), t.node_depth.tolist(), size.tolist()
    views = []
    node_bounds = np.searchsorted(nb, np.arange(len(f.batch_bounds)))  # nodes of a batch are contiguous
    for b in range(len(f.batch_bounds) - 1):
        lo, hi = int(node_bounds[b]), int(node_bounds[b + 1])
        roots = [v for v in range(lo, hi) if t.node_parent[v] < 0]
        views.append(TreeView(kids=kids, roots=roots, w=w, depth=depth, size=size_l, ends=ends, lbx_sub=lbx_sub,
                              order=list(range(hi - 1, lo - 1, -1))))
    return views


def optimal_labels(f: _Forest, max_sequences: int = OPTIMAL_MAX_SEQUENCES) -> np.ndarray:
    """The minimum-N_pack packing, by the exact multi-path DP; refused on steps above ``max_sequences``."""
    sizes = np.diff(f.batch_bounds)
    if sizes.max(initial=0) > max_sequences:
        raise TreepackError(
            f"strategy 'optimal' is an exact exponential-time DP, limited to {max_sequences} sequences per step; "
            f"this input has a step of {int(sizes.max()):,} sequences (use strategy 'best')"
        )
    labels, _ = best_labels(f, exact_budget=0)
    upper = _per_batch(f, labels)[0]
    views = step_views(f)
    for b, view in enumerate(views):
        try:
            labels, _ = _replace_batch(f, labels, b, int(upper[b]), view, budget=OPTIMAL_BUDGET)
        except BudgetExceeded:
            raise TreepackError(
                f"strategy 'optimal': the exact DP tried more than {OPTIMAL_BUDGET:,} assignments on a step of "
                f"{int(sizes[b]):,} sequences; the tree is too large for it (use strategy 'best')"
            ) from None
    return _renumber(f, labels)


def _replace_batch(f: _Forest, labels: np.ndarray, b: int, upper: int, view: TreeView, *,
                   beam: int | None = None, budget: int | None = None) -> tuple[np.ndarray, int]:
    """(labels, N_pack of step b): step b's packs replaced by the DP's when they cost less than ``upper``
    (the current N_pack of the step), or as much in fewer packs."""
    lo, hi = int(f.batch_bounds[b]), int(f.batch_bounds[b + 1])
    n_tree = int(f.t.seg_start[hi] - f.t.seg_start[lo])
    found = solve(view, f.C, upper - n_tree, beam=beam, budget=budget)
    if found is None:
        return labels, upper
    cost = n_tree + found[0]
    if cost > upper or cost == upper and len(found[1]) >= len(np.unique(labels[lo:hi])):
        return labels, upper
    labels = labels.copy()
    fresh = int(labels.max()) + 1
    for p, members in enumerate(found[1]):
        labels[members] = fresh + p
    return labels, cost


# --------------------------------------------------------------------------------------------------
# best


def areal_dta_key(f: _Forest) -> np.ndarray:
    """AReaL-DTA Algorithm 1's child order: leaf children first, then by ``tail`` (the depth its order ends at)."""
    t = f.t
    parent = t.node_parent.tolist()
    end_depth = f.end_depth.tolist()
    V = t.n_nodes
    big = int(f.L.max(initial=0)) + 1
    first: list[int | None] = [None] * V  # min (internal, tail) over children, as internal * big + tail
    key = [0] * V
    for v in range(V - 1, -1, -1):
        tail = end_depth[v] if first[v] is None else first[v] % big
        key[v] = (0 if first[v] is None else big) + tail
        p = parent[v]
        if p >= 0 and (first[p] is None or key[v] < first[p]):
            first[p] = key[v]
    return np.asarray(key, dtype=np.int64)


def candidate_orders(f: _Forest) -> dict[str, np.ndarray]:
    """DFS leaf orders worth cutting: the child orders that decide which subtrees end up side by side.

    Above ``FEW_ORDERS_ABOVE`` sequences only the two that ever won alone in the benchmark are cut (plus the
    bottom-up bin order in ``best_labels``), to stay within the time budget on 100M-token inputs.
    """
    size = f.t.node_end - f.t.node_start
    orders = {"lexicographic": np.arange(f.n, dtype=np.int64), "size-desc": f.dfs_order(-size)}
    if f.n <= FEW_ORDERS_ABOVE:
        orders["deepest-first"] = dfs_order_deepest_first(f)
        orders["areal-dta"] = f.dfs_order(areal_dta_key(f))
    return orders


def _per_batch(f: _Forest, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(N_pack, packs) per batch of a labelling."""
    nb = len(f.batch_bounds) - 1
    uniq = np.unique(labels)
    first_rank = np.full(int(labels.max()) + 1, -1, dtype=np.int64)
    first_rank[labels[::-1]] = np.arange(f.n - 1, -1, -1)
    packs = np.bincount(f.batch[first_rank[uniq]], minlength=nb)
    return f.cost(labels), packs


def best_labels(f: _Forest, exact_budget: int | None = None) -> tuple[np.ndarray, dict]:
    """The cheapest, per step, of every candidate (see the module docstring); never worse than any of them.

    ``exact_budget``: assignments the exact DP may try per small step (default ``BEST_EXACT_BUDGET``; 0: none).
    """
    exact_budget = BEST_EXACT_BUDGET if exact_budget is None else exact_budget
    cands: dict[str, np.ndarray] = {}
    for name, perm in candidate_orders(f).items():
        cands[f"cut/{name}"] = contiguous_cut(f, perm)
    bottom_up, key = bottom_up_labels(f)
    cands["bottom-up"] = bottom_up
    cands["cut/bins"] = contiguous_cut(f, f.dfs_order(key))
    cands["first-fit"] = first_fit_labels(f)
    cands["dfs"] = dfs_labels(f)
    names = list(cands)
    stats = [_per_batch(f, cands[k]) for k in names]
    tokens = np.stack([s[0] for s in stats])
    packs = np.stack([s[1] for s in stats])
    pick = np.lexsort((packs, tokens), axis=0)[0]
    combined = np.empty(f.n, dtype=np.int64)
    for b in range(len(f.batch_bounds) - 1):
        lo, hi = f.batch_bounds[b], f.batch_bounds[b + 1]
        combined[lo:hi] = cands[names[pick[b]]][lo:hi]
    labels = _renumber(f, f.batch * (f.n + 1) + combined)  # candidates' labels overlap: key by batch too
    details = {"candidates": {k: int(tokens[i].sum()) for i, k in enumerate(names)},
               "chosen": {names[i]: int((pick == i).sum()) for i in np.unique(pick).tolist()}}
    upper = tokens[pick, np.arange(tokens.shape[1])]
    sizes = np.diff(f.batch_bounds)
    refine = np.flatnonzero((sizes <= BEAM_MAX_SEQUENCES) | (exact_budget > 0) & (sizes <= OPTIMAL_MAX_SEQUENCES))
    if len(refine):
        views = step_views(f)
        for b in refine.tolist():
            cost = int(upper[b])
            if sizes[b] <= BEAM_MAX_SEQUENCES:
                labels, cost = _replace_batch(f, labels, b, cost, views[b], beam=BEAM)
            if exact_budget and sizes[b] <= OPTIMAL_MAX_SEQUENCES:
                try:
                    labels, cost = _replace_batch(f, labels, b, cost, views[b], budget=exact_budget)
                except BudgetExceeded:
                    pass
            upper[b] = cost
        labels = _renumber(f, f.batch * (f.n + 1) + labels)
    details["n_pack_tokens"] = int(upper.sum())
    return labels, details


def compare_strategies(
    rollouts: Rollouts, capacity: int, *, group_by: str | None = None, oversize: str = "error",
    tree: PrefixTree | None = None,
) -> dict[str, Packing | str]:
    """Every strategy on the same data: its Packing, or the message of its refusal (``optimal`` on big trees)."""
    out: dict[str, Packing | str] = {}
    for name in STRATEGIES:
        try:
            out[name] = pack_sequences(rollouts, capacity, strategy=name, group_by=group_by, oversize=oversize, tree=tree)
        except CapacityError:
            raise
        except TreepackError as exc:
            out[name] = str(exc)
    return out
