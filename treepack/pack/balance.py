"""Load balance across K data-parallel ranks: which rank computes which packs (or pieces of packs).

Two uses, one principle (minimise the costliest rank: the step waits for it):
- ``balance_packs`` (``treepack pack --balance K``): per ``step``, the packs in DFS order are split into K
  contiguous runs, AReaL-DTA Algorithm 4 on packs: binary search on the bottleneck ``tau`` with a greedy
  feasibility check, O(P log(sum of costs)) with integer costs, exactly ``min(K, P)`` non-empty runs
  (lines 30-32). Costs (``BALANCE_COSTS``): ``tokens`` (real tokens), or ``flops``: the FLOP model of
  docs/design.md §9 with the named model shape (`treepack.pack.cost`).
- ``balance_units`` (the trainer, each global batch): sharing-aware. Units (packs, or whole trees) share no
  tokens, so whole units are assigned first, by the best of LPT with move/swap refinement, the
  contiguous split (contiguity buys nothing between packs; a non-contiguous assignment often balances
  better: [5, 5, 3, 3] over 2 ranks is 8/8, contiguous at best 10/6) and `_fill` at the smallest room
  that fits every unit whole. Only then may a unit be cut across ranks, which computes its shared prefix
  twice: the smallest bottleneck ``tau`` for which `_fill` fits every unit into K ranks (cutting a unit
  only when no whole one fits the room left, at the cut that duplicates least) is found by binary
  search, and the cut assignment is kept only if it cuts and lowers the predicted step time by
  ``MIN_GAIN`` (1%) or more against the whole split; otherwise the answer is the whole split itself.
  ``min_gain=KEEP_WHOLE`` never cuts and returns that whole split (what ``treepack.hf.shard_packs`` asks
  for: its users feed whole packs to a model), the very split the trainer runs whenever it cuts nothing.
  Costs are FLOPs of the layout the mode runs (`treepack.pack.cost.RunCosts`), so a rank of long, deep
  trees is not mistaken for a light one. ``split_run`` is Algorithm 4 itself (one unit, K contiguous
  pieces, LCP-aware costs): what the cutting uses, and the baseline of ``benchmarks/balance.py``.
  Every piece's predicted cost is exact: it equals the cost of the pack the piece becomes, recomputed
  from its sequences alone (a property test checks every piece and every rank's load; a remainder priced
  without the shared prefix it computes again once passed every other test: a 5-sequence comb of 10 tree
  tokens over 2 ranks was predicted at 6 and 4 tokens, and the ranks computed 6 and 9, where the exact
  split computes 7 and 7). ``UnitSplit.cut_cost`` says what cutting costs: the work the cut units' pieces
  do beyond those units whole (4 of the comb's 10 tokens again, ``cut_share`` 0.4).
  Everything is deterministic (integer costs, fixed tie-breaks): every rank computes the same split with
  no communication.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from dataclasses import dataclass

import numpy as np

from treepack.errors import TreepackError
from treepack.io.rollouts import Rollouts, ranges
from treepack.pack.cost import TOKENS, FlopModel, RunCosts
from treepack.pack.layout import Pack, build_pack, reorder
from treepack.stats import DEFAULT_MODEL, MODEL_SHAPES

BALANCE_COSTS = ("tokens", "flops")


def _check_cost(cost: str) -> None:
    if cost not in BALANCE_COSTS:
        raise TreepackError(f"balance cost must be one of {', '.join(BALANCE_COSTS)}, got {cost!r}")


def cost_model(cost: str = "tokens", model: str | None = None) -> FlopModel:
    """The `FlopModel` a balance cost names: ``tokens`` (1 per token through the layers) or ``flops``
    (design §9 for ``model``'s shape, `DEFAULT_MODEL` if None: loss tokens pay the head, pairs attention)."""
    _check_cost(cost)
    return TOKENS if cost == "tokens" else FlopModel.named(model or DEFAULT_MODEL)


def pack_costs(tokens: np.ndarray, attention_pairs: np.ndarray, cost: str = "tokens",
               model: str = DEFAULT_MODEL) -> list[int]:
    """Cost of each pack as exact integers: its tokens, or its fwd+bwd FLOPs under ``model``'s shape."""
    _check_cost(cost)
    if cost == "tokens":
        return [int(t) for t in tokens]
    if model not in MODEL_SHAPES:
        raise TreepackError(f"unknown model {model!r}; known: {', '.join(MODEL_SHAPES)}")
    m = MODEL_SHAPES[model]
    per_token = 6 * m.non_embedding_params + 6 * m.d_model * m.vocab
    per_pair = 12 * m.n_layers * m.n_heads * m.head_dim
    return [per_token * int(t) + per_pair * int(p) for t, p in zip(tokens, attention_pairs)]


def split_contiguous(costs: list[int], k: int) -> list[int]:
    """Group index (0..k-1) of each item: k contiguous runs minimising the largest run's total cost.

    Exactly ``min(k, len(costs))`` runs are non-empty; runs are numbered left to right.
    """
    if k < 1:
        raise TreepackError(f"the number of ranks must be >= 1, got {k}")
    n = len(costs)
    if n == 0:
        return []
    if k >= n:
        return list(range(n))

    def greedy(tau: int) -> list[int] | None:
        out, g, run = [], 0, 0
        for c in costs:
            if run and run + c > tau:
                g += 1
                run = 0
            out.append(g)
            run += c
        return out if g < k else None

    lo, hi = max(costs), sum(costs)
    while lo < hi:
        mid = (lo + hi) // 2
        if greedy(mid) is not None:
            hi = mid
        else:
            lo = mid + 1
    groups = greedy(lo)
    assert groups is not None
    # Algorithm 4 lines 30-32: split runs (the last one first) until there are exactly k; splitting
    # never raises the bottleneck
    bounds = [i for i in range(n) if i == 0 or groups[i] != groups[i - 1]] + [n]
    while len(bounds) - 1 < k:
        g = next(g for g in range(len(bounds) - 2, -1, -1) if bounds[g + 1] - bounds[g] > 1)
        bounds.insert(g + 1, bounds[g + 1] - 1)
    groups = [g for g, (a, b) in enumerate(itertools.pairwise(bounds)) for _ in range(a, b)]
    return groups


@dataclass
class Balance:
    """The rank of every pack and the resulting per-rank loads."""

    k: int
    cost: str
    model: str | None
    ranks: np.ndarray  # int32 [P] rank of each pack
    loads: list[dict]  # per step: {"step", "max", "mean", "imbalance", "per_rank": [cost per rank]}

    def to_dict(self) -> dict:
        return {"k": self.k, "cost": self.cost, "model": self.model, "steps": self.loads}

    @property
    def max_imbalance(self) -> float:
        return max((s["imbalance"] for s in self.loads), default=1.0)


def balance_packs(costs: list[int], steps: np.ndarray | None, k: int, *, cost: str = "tokens",
                  model: str | None = None) -> Balance:
    """Assign each pack (in DFS order, grouped by step) a rank: ``split_contiguous`` within each step."""
    n = len(costs)
    has_steps = steps is not None
    steps = np.zeros(n, dtype=np.int64) if steps is None else np.asarray(steps, dtype=np.int64)
    ranks = np.zeros(n, dtype=np.int32)
    loads = []
    for step in np.unique(steps).tolist():
        idx = np.flatnonzero(steps == step)
        sub = [costs[i] for i in idx.tolist()]
        groups = split_contiguous(sub, k)
        ranks[idx] = groups
        per_rank = [0] * k
        for g, c in zip(groups, sub):
            per_rank[g] += c
        mx = max(per_rank)
        mean = sum(per_rank) / k
        loads.append({"step": int(step) if has_steps else None, "max": mx, "mean": mean, "imbalance": mx / mean if mean else 1.0,
                      "per_rank": per_rank})
    return Balance(k=k, cost=cost, model=model if cost == "flops" else None, ranks=ranks, loads=loads)


# --------------------------------------------------------------------------------------------------
# Sharing-aware split of one global batch over K data-parallel ranks (the trainer's balance)


MIN_GAIN = 0.01  # a pack is cut across ranks only when that lowers the predicted step time by >= 1%
KEEP_WHOLE = 1.0  # the min_gain that never cuts: no cut lowers the step time by 100%


def split_run(costs: RunCosts, m: int, *, exactly: bool = False) -> list[int]:
    """Start indices of at most ``m`` contiguous pieces of a unit's sequences minimising the costliest
    piece: AReaL-DTA Algorithm 4 with ``RunCosts`` (binary search on the bottleneck tau, greedy
    feasibility). ``exactly``: split pieces further (the last splittable one first, as the paper does)
    until there are ``min(m, n)``."""
    n = costs.n
    if n == 0:
        return []
    full, inc = costs.full.tolist(), costs.inc.tolist()
    extra = costs.per_extra and len(costs.extra_seq)
    with_extra = set(costs.extra_seq.tolist()) if extra else set()

    def greedy(tau: int) -> list[int] | None:
        starts, run = [0], full[0]
        for s in range(1, n):
            add = costs.step(starts[-1], s) if s in with_extra else inc[s]
            if run + add > tau:
                starts.append(s)
                if len(starts) > m:
                    return None
                run = full[s]
            else:
                run += add
        return starts

    lo, hi = max(full), costs.run(0, n)
    while lo < hi:
        mid = (lo + hi) // 2
        if greedy(mid) is not None:
            hi = mid
        else:
            lo = mid + 1
    starts = greedy(lo)
    assert starts is not None
    if exactly:
        bounds = starts + [n]
        while len(bounds) - 1 < min(m, n):
            for g in range(len(bounds) - 2, -1, -1):
                if bounds[g + 1] - bounds[g] > 1:
                    bounds.insert(g + 1, bounds[g + 1] - 1)
                    break
        starts = bounds[:-1]
    return starts


def _assign_lpt(costs: list[int], k: int) -> list[int]:
    """Longest processing time first, then moves and swaps between the costliest and the cheapest rank
    while they lower the costlier of the two."""
    ranks = [0] * len(costs)
    heap = [(0, r) for r in range(k)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, r = heapq.heappop(heap)
        ranks[i] = r
        heapq.heappush(heap, (load + costs[i], r))
    loads = [0] * k
    members: list[list[int]] = [[] for _ in range(k)]
    for i, r in enumerate(ranks):
        loads[r] += costs[i]
        members[r].append(i)
    for _ in range(4 * len(costs) + 4):
        hi = max(range(k), key=lambda r: (loads[r], -r))
        lo = min(range(k), key=lambda r: (loads[r], r))
        gap = loads[hi] - loads[lo]
        best, move = 0, None  # the move or swap whose transfer d (0 < d < gap) is closest to gap / 2
        for i in members[hi]:
            for j in [None, *members[lo]]:
                d = costs[i] - (0 if j is None else costs[j])
                if 0 < d < gap and min(d, gap - d) > best:
                    best, move = min(d, gap - d), (i, j)
        if move is None:
            break
        i, j = move
        members[hi].remove(i)
        members[lo].append(i)
        ranks[i] = lo
        loads[hi] -= costs[i]
        loads[lo] += costs[i]
        if j is not None:
            members[lo].remove(j)
            members[hi].append(j)
            ranks[j] = hi
            loads[lo] -= costs[j]
            loads[hi] += costs[j]
    return ranks


def assign_units(costs: list[int], k: int) -> list[int]:
    """Rank of each unit: the better (lower costliest rank) of LPT with refinement and the optimal
    contiguous split (`split_contiguous`); units never share tokens, so neither needs contiguity."""
    if not costs:
        return []
    candidates = [_assign_lpt(costs, k), split_contiguous(costs, k)]

    def bottleneck(ranks: list[int]) -> int:
        loads = [0] * k
        for c, r in zip(costs, ranks):
            loads[r] += c
        return max(loads)

    return min(candidates, key=bottleneck)


@dataclass
class Piece:
    """Sequences ``[start, stop)`` (in the unit's order) of unit ``unit``, with their predicted cost."""

    unit: int
    start: int
    stop: int
    cost: int
    whole: bool  # the entire unit (not split)


@dataclass
class UnitSplit:
    """Which rank runs which piece of which unit, and the predicted load of every rank."""

    k: int
    pieces: list[Piece]
    ranks: list[int]  # rank of each piece
    loads: list[int]  # predicted cost per rank
    n_units: int
    cut_cost: int = 0  # what cutting costs: the cut units' pieces less those units whole (prefixes done again)

    @property
    def cut_share(self) -> float:
        """``cut_cost`` over the cost of the batch's units whole: the work cutting adds to the step."""
        base = sum(self.loads) - self.cut_cost
        return self.cut_cost / base if base else 0.0

    @property
    def imbalance(self) -> float:
        """Costliest rank over the mean rank: the predicted step time over a perfect balance's."""
        mean = sum(self.loads) / self.k
        return max(self.loads) / mean if mean else 1.0

    @property
    def idle_fraction(self) -> float:
        """Share of the ranks' time spent waiting for the costliest one: 1 - mean / max."""
        top = max(self.loads)
        return 1.0 - sum(self.loads) / (self.k * top) if top else 0.0

    @property
    def split_units(self) -> list[int]:
        return sorted({p.unit for p in self.pieces if not p.whole})

    def rank_pieces(self, rank: int) -> list[Piece]:
        """The pieces of ``rank``, in unit order (deterministic on every rank)."""
        return sorted((p for p, r in zip(self.pieces, self.ranks) if r == rank), key=lambda p: (p.unit, p.start))


def _fill(units: list[RunCosts], k: int, tau: int, slack: int) -> list[tuple[int, int, int, int, int]] | None:
    """Pieces (unit, start, stop, cost, rank) filling K ranks up to ``tau`` each, or None if they do not fit.

    Rank by rank, the costliest remaining pieces that fit the room go in whole; when none fits and more
    than ``slack`` is left, the costliest remaining piece is cut: its sequences up to the cut that wastes
    least (room left unfilled + the shared prefix the remainder pays again) fill the room."""
    remaining = sorted((c.whole, u, 0, c.n) for u, c in enumerate(units) if c.n)  # ascending cost
    out = []
    for rank in range(k):
        room = tau
        while remaining:
            i = bisect.bisect_right(remaining, (room, len(units), 0, 0)) - 1
            if i >= 0:
                cost, u, a, b = remaining.pop(i)
                out.append((u, a, b, cost, rank))
                room -= cost
                continue
            if room <= slack:
                break
            cost, u, a, b = remaining[-1]
            c = units[u]
            # the head [a, s) goes in; the remainder [s, b) pays again for what it shares with the head
            s_all = np.arange(a + 1, b)
            heads = c.heads(a, s_all)
            ok = heads <= room
            fits, heads = s_all[ok], heads[ok]
            if not len(fits):
                break
            tails = c.tails(fits, b)
            waste = room - heads + (heads + tails - cost)  # room left unfilled + work done twice
            i = int(np.argmin(waste))
            s, head = int(fits[i]), int(heads[i])
            remaining.pop()
            out.append((u, a, s, head, rank))
            room -= head
            bisect.insort(remaining, (int(tails[i]), u, s, b))
        if not remaining:
            return out
    return None


def balance_units(units: list[RunCosts], k: int, *, min_gain: float = MIN_GAIN) -> UnitSplit:
    """Sharing-aware K-way balance of one global batch of units (packs or trees: they share no tokens).

    Whole units first (no prefix is duplicated): the better of `assign_units` and `_fill` at the smallest
    room tau (binary search) that fits every unit whole. Then the splittable variant: the smallest tau
    for which `_fill` fits every unit into K ranks, cutting a unit only where no whole piece fits the room
    left, at the cut that duplicates least; its pieces are re-assigned by `assign_units` when that does
    better. It is taken only if it cuts and lowers the predicted step time (the costliest rank) by at
    least ``min_gain`` against the whole split: a shared prefix is computed on two ranks only when that is
    what it takes to cut the step time. So whenever nothing is cut, the answer is the whole split, the
    same as ``min_gain >= 1`` (`KEEP_WHOLE`) gives, which skips the second search.
    """
    if k < 1:
        raise TreepackError(f"the number of ranks must be >= 1, got {k}")
    whole = [Piece(u, 0, c.n, c.whole, True) for u, c in enumerate(units) if c.n]
    best = _split_of(whole, assign_units([p.cost for p in whole], k), k, len(units))
    if k == 1 or not whole:
        return best
    floor = -(-sum(p.cost for p in whole) // k)
    found = _search(units, k, max(max(p.cost for p in whole), floor), max(best.loads), None)
    if found is not None:
        packed = _split_of_fill(found, units, k)
        best = packed if max(packed.loads) < max(best.loads) else best
    if min_gain >= 1 or all(c.n < 2 for c in units):
        return best
    longest = max(int(c.full.max()) for c in units if c.n)  # no piece is cheaper than its costliest sequence
    found = _search(units, k, max(longest, floor), max(best.loads), min_gain)
    if found is None:
        return best
    split = _split_of_fill(found, units, k)
    return split if split.split_units and max(split.loads) < max(best.loads) * (1 - min_gain) else best


def _search(units: list[RunCosts], k: int, lo: int, hi: int, min_gain: float | None
            ) -> list[tuple[int, int, int, int, int]] | None:
    """`_fill` at the smallest room tau in [lo, hi) that fits (binary search to 1e-4); ``min_gain`` None:
    whole units only (the slack is the whole room, so nothing is cut)."""
    found = None
    while lo < hi and (hi - lo) > lo * 1e-4:
        tau = (lo + hi) // 2
        fill = _fill(units, k, tau, tau if min_gain is None else int(tau * min_gain))
        if fill is None:
            lo = tau + 1
        else:
            hi, found = tau, fill
    return found


def _split_of_fill(found: list[tuple[int, int, int, int, int]], units: list[RunCosts], k: int) -> UnitSplit:
    """The `_fill` pieces in unit order, on `_fill`'s ranks or `assign_units`', whichever is better."""
    pieces = [Piece(u, a, b, cost, a == 0 and b == units[u].n) for u, a, b, cost, _ in found]
    order = sorted(range(len(pieces)), key=lambda i: (pieces[i].unit, pieces[i].start))
    pieces = [pieces[i] for i in order]
    ranks = [found[i][4] for i in order]
    cut = {p.unit for p in pieces if not p.whole}
    cut_cost = sum(p.cost for p in pieces if p.unit in cut) - sum(units[u].whole for u in cut)
    best = min(_split_of(pieces, ranks, k, len(units)),
               _split_of(pieces, assign_units([p.cost for p in pieces], k), k, len(units)),
               key=lambda s: max(s.loads))
    best.cut_cost = cut_cost
    return best


def _split_of(pieces: list[Piece], ranks: list[int], k: int, n_units: int) -> UnitSplit:
    loads = [0] * k
    for p, r in zip(pieces, ranks):
        loads[r] += p.cost
    return UnitSplit(k=k, pieces=pieces, ranks=list(ranks), loads=loads, n_units=n_units)


def sub_pack(pack: Pack, start: int, stop: int) -> Pack:
    """Sequences ``[start, stop)`` of ``pack`` (its sequence order) as a pack of their own: the restriction
    of the pack's trie to them (sequences share tokens exactly where they did in ``pack``), its tokens and
    sequences in the pack's own order (restricted to the piece: a `relayout` pack's order is kept)."""
    off = np.asarray(pack.seq_offsets, dtype=np.int64)
    lo, hi = int(off[start]), int(off[stop])
    tok_F = np.asarray(pack.seq_token_index[lo:hi], dtype=np.int64)
    offsets = off[start : stop + 1] - lo
    root_S = tok_F[offsets[:-1]]  # sequences of one trie of the pack share its root token
    groups = group_names = None
    if pack.seq_groups is not None:
        group_names = list(dict.fromkeys(pack.seq_groups[start:stop]))
        code = {g: i for i, g in enumerate(group_names)}
        groups = np.asarray([code[g] for g in pack.seq_groups[start:stop]], dtype=np.int64)

    def seq(a):
        return None if a is None else np.asarray(a)[start:stop]

    r = Rollouts(
        tokens=np.asarray(pack.input_ids, dtype=np.int32)[tok_F], offsets=offsets, ids=list(pack.seq_ids[start:stop]),
        loss_mask=np.asarray(pack.seq_loss_mask[lo:hi], dtype=np.uint8),
        logprobs=None if pack.seq_logprobs is None else np.asarray(pack.seq_logprobs[lo:hi]),
        groups=groups, group_names=group_names, steps=seq(pack.seq_steps), advantages=seq(pack.advantages),
        rewards=seq(pack.rewards),
    )
    out = build_pack(r, scope=root_S)  # lexicographic; then the pack's own order, restricted to the piece
    src_F = ranges(offsets[:-1][out.seq_index], np.diff(offsets)[out.seq_index])
    key_T = np.empty(out.n_real, dtype=np.int64)
    key_T[np.asarray(out.seq_token_index, dtype=np.int64)] = tok_F[src_F]
    out = reorder(out, key_T)
    out.seq_index = np.asarray(pack.seq_index)[start:stop][out.seq_index]
    # the whole pack's size: its pieces run the attention kernel it would (`AttentionContext.tree`)
    out.meta = {**pack.meta, "piece": [int(start), int(stop)],
                "piece_of_tokens": int(pack.meta.get("piece_of_tokens", pack.n_real))}
    return out
