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
- ``optimal``: Tree Training Appendix A.2's multi-path DP, made exact (``treepack.pack.multipath``); exponential,
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

import itertools
import time
from dataclasses import dataclass, field

import numpy as np

from treepack.errors import CapacityError, TreepackError
from treepack.io.rollouts import Rollouts
from treepack.io.sequences import check_rollouts
from treepack.pack.multipath import BudgetExceeded, TreeView, solve
from treepack.pack.packers import (
    Forest,
    bottom_up_labels,
    contiguous_cut,
    dfs_labels,
    dfs_order_deepest_first,
    first_fit_labels,
    next_fit,  # noqa: F401 (re-exported: moved to treepack.pack.packers, still importable from here)
    renumber,
)
from treepack.sizes import parse_size
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
    return f"sequence {r.ids[i]!r}"  # in memory: the id is what the caller knows it by


def _same_batch(tree: PrefixTree, r: Rollouts) -> bool:
    """Whether ``tree`` was built from ``r``'s tokens (a tree of other data is rebuilt, not trusted)."""
    if tree.tokens is r.tokens and tree.offsets is r.offsets:
        return True
    return np.array_equal(tree.offsets, r.offsets) and np.array_equal(tree.tokens, r.tokens)


def pack_sequences(
    rollouts: Rollouts,
    capacity: int,
    *,
    strategy: str = "best",
    group_by: str | None = None,
    oversize: str = "error",
    oversize_hint: str = "use --oversize skip to drop such sequences",
    tree: PrefixTree | None = None,
) -> Packing:
    """Pack every sequence of ``rollouts`` into packs whose union trie has at most ``capacity`` tokens.

    ``group_by="tree_id"`` keeps each tree_id its own trie (no sharing across groups); sharing never crosses
    a ``step`` and neither do packs. ``oversize``: a sequence longer than ``capacity`` raises
    ``CapacityError`` naming it and ending with ``oversize_hint`` (``"error"``) or is left out and counted
    (``"skip"``). ``tree`` reuses a PrefixTree already built from the same rollouts and ``group_by`` (one of
    other tokens or scopes is rebuilt). ``capacity``: tokens, or a size such as "60k" (`treepack.sizes`).
    """
    check_rollouts(rollouts)
    if strategy not in STRATEGIES:
        raise TreepackError(f"unknown packing strategy {strategy!r}: expected one of {', '.join(STRATEGIES)}")
    if oversize not in OVERSIZE:
        raise TreepackError(f"oversize must be 'error' or 'skip', got {oversize!r}")
    capacity = parse_size(capacity, what="capacity") if isinstance(capacity, str) else capacity
    if not isinstance(capacity, (int, np.integer)) or isinstance(capacity, bool):
        raise TreepackError(f"capacity must be a whole number of tokens or a size such as \"60k\", got {capacity!r}")
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
                f"{describe_sequence(rollouts, i)} has {int(lengths[i]):,} tokens > capacity {capacity:,}; {oversize_hint}"
            )
        keep = np.setdiff1d(np.arange(n, dtype=np.int64), too_long)
        rollouts = rollouts.select(keep)
        tree = None
    scope, _ = scope_codes(rollouts, group_by)
    batch_in = np.zeros(len(rollouts), np.int64) if rollouts.steps is None else rollouts.steps
    if (tree is None or not _same_batch(tree, rollouts) or not _batches_contiguous(batch_in[tree.order])
            or not np.array_equal(tree.scope, np.zeros(len(rollouts), np.int64) if scope is None else scope[tree.order])):
        tree = PrefixTree.from_arrays(rollouts.tokens, rollouts.offsets, scope)
    forest = Forest(tree, batch_in[tree.order], capacity)
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
# optimal (and the beam of it that `best` uses): Tree Training's multi-path DP, see treepack.pack.multipath


def step_views(f: Forest) -> list[TreeView]:
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


def _step_of(sizes: np.ndarray, b: int | None = None) -> str:
    """``a step of 24 sequences``, or, where the input is one step (no ``step`` field), ``24 sequences in one
    step (no 'step' field)``."""
    n = int(sizes.max() if b is None else sizes[b])
    if len(sizes) == 1:
        return f"{n:,} sequences in one step (no 'step' field, or one value of it)"
    return f"a step of {n:,} sequences"


def optimal_labels(f: Forest, max_sequences: int = OPTIMAL_MAX_SEQUENCES) -> np.ndarray:
    """The minimum-N_pack packing, by the exact multi-path DP; refused on steps above ``max_sequences``."""
    sizes = np.diff(f.batch_bounds)
    if sizes.max(initial=0) > max_sequences:
        raise TreepackError(
            f"strategy 'optimal' is an exact exponential-time DP, limited to {max_sequences} sequences per step; "
            f"this input has {_step_of(sizes)} (use strategy 'best')"
        )
    labels, _ = best_labels(f, exact_budget=0)
    upper = _per_batch(f, labels)[0]
    views = step_views(f)
    for b, view in enumerate(views):
        try:
            labels, _ = _replace_batch(f, labels, b, int(upper[b]), view, budget=OPTIMAL_BUDGET)
        except BudgetExceeded:
            raise TreepackError(
                f"strategy 'optimal': the exact DP tried more than {OPTIMAL_BUDGET:,} assignments on "
                f"{_step_of(sizes, b)}; the tree is too large for it (use strategy 'best')"
            ) from None
    return renumber(f, labels)


def _replace_batch(f: Forest, labels: np.ndarray, b: int, upper: int, view: TreeView, *,
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


def areal_dta_key(f: Forest) -> np.ndarray:
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


def candidate_orders(f: Forest) -> dict[str, np.ndarray]:
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


def _per_batch(f: Forest, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(N_pack, packs) per batch of a labelling."""
    nb = len(f.batch_bounds) - 1
    uniq = np.unique(labels)
    first_rank = np.full(int(labels.max()) + 1, -1, dtype=np.int64)
    first_rank[labels[::-1]] = np.arange(f.n - 1, -1, -1)
    packs = np.bincount(f.batch[first_rank[uniq]], minlength=nb)
    return f.cost(labels), packs


def best_labels(f: Forest, exact_budget: int | None = None) -> tuple[np.ndarray, dict]:
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
    labels = renumber(f, f.batch * (f.n + 1) + combined)  # candidates' labels overlap: key by batch too
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
        labels = renumber(f, f.batch * (f.n + 1) + labels)
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
