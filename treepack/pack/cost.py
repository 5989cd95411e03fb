"""What one fwd+bwd pass over a pack, or over a run of sequences, costs: docs/design.md §9's FLOP model.

``FlopModel`` turns a `Work` (tokens through the layers, tokens whose log-prob the head computes, visible
(query, key) attention pairs) into FLOPs: ``6 x non-embedding params x tokens + 6 x d_model x vocab x
predicted + 12 x layers x heads x head_dim x pairs``, as exact integers. A pack's work depends on how the
mode lays it out (``LAYOUTS``): its trie (tree and dfs modes: T = N_tree tokens, pairs = sum of depth + 1),
every sequence on its own (dense: N_flat tokens, L (L + 1) / 2 pairs each), or only the trie's leaf
sequences on their own (dense-leaf). Counting pairs matters: a 9k-token agent conversation costs its
attention pairs as much as 40k tokens of short answers, so a token-only balance gives one rank of long
trees far more work than it thinks.

``RunCosts`` prices every contiguous run of a unit's sequences in a DFS leaf order of its trie, so the
balance can try cuts in O(1) each: a run ``[a, b)`` costs ``full[a] + inc[a+1:b].sum()``, ``full`` being a
sequence on its own and ``inc`` what it adds after its predecessor (its tokens past their LCP), plus the
head's rows no two arrays can express: a sequence that trains on a token it shares with its predecessor,
which no sequence in between trains on (a later turn trained, an earlier one context only). Those rows are
kept as (sequence, nearest earlier sequence that trains on the token) points and counted for the run; there
are none when shared tokens are trained alike. Every run's price is exact in every layout: it equals the
cost of the pack built from the run's sequences alone (``tests/test_balance.py`` checks every run, and every
piece a balance makes). Before the points, a cut pack's predicted head term was a lower bound, and a
dense-leaf piece counted a sequence cut from its extension as no leaf at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from treepack.errors import TreepackError
from treepack.io.rollouts import Rollouts, ranges
from treepack.pack.layout import Pack
from treepack.stats import MODEL_SHAPES, ModelShape

LAYOUTS = ("tree", "flat", "leaf")


@dataclass(frozen=True)
class Work:
    """What one fwd+bwd pass computes: tokens through the layers, tokens whose log-prob the head
    computes, visible (query, key) attention pairs, and model calls (one a pack or piece of a pack)."""

    tokens: int = 0
    predicted: int = 0
    pairs: int = 0
    calls: int = 0

    def __add__(self, other: Work) -> Work:
        return Work(self.tokens + other.tokens, self.predicted + other.predicted, self.pairs + other.pairs,
                    self.calls + other.calls)


@dataclass(frozen=True)
class FlopModel:
    """docs/design.md §9's FLOP model as integer coefficients: ``per_token x tokens + per_predicted x predicted +
    per_pair x pairs`` (fwd+bwd: 6 x non-embedding params, 6 x d_model x vocab, 12 x layers x heads x head_dim),
    plus ``per_call`` for each pack or piece the model runs: 0 in the FLOP model; a measured model
    (`treepack.train.calibration`) prices the host and launch time of a call, and weighs pairs by what
    attention takes per FLOP against the matmuls."""

    per_token: int
    per_predicted: int
    per_pair: int
    name: str = ""
    per_call: int = 0

    @classmethod
    def of_shape(cls, shape: ModelShape) -> FlopModel:
        return cls(per_token=6 * shape.non_embedding_params, per_predicted=6 * shape.d_model * shape.vocab,
                   per_pair=12 * shape.n_layers * shape.n_heads * shape.head_dim, name=shape.name)

    @classmethod
    def named(cls, model: str) -> FlopModel:
        if model not in MODEL_SHAPES:
            raise TreepackError(f"unknown model {model!r}; known: {', '.join(MODEL_SHAPES)}")
        return cls.of_shape(MODEL_SHAPES[model])

    def cost(self, work: Work) -> int:
        return (self.per_token * work.tokens + self.per_predicted * work.predicted + self.per_pair * work.pairs
                + self.per_call * work.calls)

    def costs(self, tokens: np.ndarray, predicted: np.ndarray, pairs: np.ndarray) -> np.ndarray:
        """Vectorised `cost` without the calls (int64; the coefficients and counts of real batches stay far
        below 2**63)."""
        return (self.per_token * np.asarray(tokens, np.int64) + self.per_predicted * np.asarray(predicted, np.int64)
                + self.per_pair * np.asarray(pairs, np.int64))


TOKENS = FlopModel(1, 0, 0, name="tokens")  # a cost of 1 per token through the layers: a token-count balance


def _pairs(n: np.ndarray) -> np.ndarray:
    """Causal (query, key) pairs of a chain of n tokens: n (n + 1) / 2."""
    n = np.asarray(n, dtype=np.int64)
    return n * (n + 1) // 2


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise TreepackError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")


class _PackSequences:
    """Per-sequence numbers of a pack, in its sequence order (a DFS leaf order of its trie)."""

    def __init__(self, pack: Pack) -> None:
        off = np.asarray(pack.seq_offsets, dtype=np.int64)
        self.S = S = off.shape[0] - 1
        self.lengths = np.diff(off)
        tok_F = np.asarray(pack.seq_token_index, dtype=np.int64)
        seq_F = np.repeat(np.arange(S), self.lengths)
        depth_F = np.arange(tok_F.shape[0], dtype=np.int64) - off[:-1][seq_F]
        self.row_F = (np.asarray(pack.seq_loss_mask) > 0) & (depth_F > 0)  # a loss row: trained, not the first token
        # LCP with the previous sequence = its path tokens that are ancestors-or-self of the previous leaf
        leaf = np.asarray(pack.seq_leaf, dtype=np.int64)
        end = np.asarray(pack.subtree_end, dtype=np.int64)
        prev_leaf_F = np.r_[-1, leaf[:-1]][seq_F] if S else np.zeros(0, np.int64)
        shared_F = (tok_F <= prev_leaf_F) & (end[tok_F] > prev_leaf_F)
        self.lcp = np.bincount(seq_F, weights=shared_F, minlength=S).astype(np.int64)
        self.rows = np.bincount(seq_F, weights=self.row_F, minlength=S).astype(np.int64)
        self.new_rows = np.bincount(seq_F, weights=self.row_F & (depth_F >= self.lcp[seq_F]), minlength=S).astype(np.int64)
        self.tok_F, self.seq_F = tok_F, seq_F
        # a sequence equal to, or a proper prefix of, the next one (DFS order) is no leaf of the trie
        self.is_leaf = np.ones(S, dtype=bool)
        if S > 1:
            self.is_leaf[:-1] = self.lcp[1:] < self.lengths[:-1]
        self.extra_seq, self.extra_prev = _extra_rows(seq_F, depth_F, self.row_F, self.lcp, off[:-1])


def pack_work(pack: Pack, layout: str = "tree", *, _seqs: _PackSequences | None = None) -> Work:
    """The exact work of one pass over ``pack``: ``tree`` (its trie: tree, dfs modes), ``flat`` (every
    sequence on its own: dense) or ``leaf`` (only the trie's leaf sequences on their own: dense-leaf)."""
    _check_layout(layout)
    seqs = _seqs or _PackSequences(pack)
    predicted = int(np.unique(seqs.tok_F[seqs.row_F]).shape[0])
    if layout == "tree":
        n = int(pack.n_real)
        pairs = int((np.asarray(pack.subtree_end[:n], dtype=np.int64) - np.arange(n)).sum())
        return Work(tokens=n, predicted=predicted, pairs=pairs, calls=1)
    if layout == "flat":
        return Work(tokens=int(seqs.lengths.sum()), predicted=int(seqs.rows.sum()), pairs=int(_pairs(seqs.lengths).sum()),
                    calls=1)
    leaf = seqs.lengths[seqs.is_leaf]
    return Work(tokens=int(leaf.sum()), predicted=predicted, pairs=int(_pairs(leaf).sum()), calls=1)


def _extra_rows(seq_F: np.ndarray, depth_F: np.ndarray, row_F: np.ndarray, lcp: np.ndarray, start_S: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray]:
    """(seq, prev): the loss rows that ``full`` and ``inc`` leave out, ascending by (seq, prev). A row of
    sequence s on a token shared with s - 1 counts in a run [a, b) (a < s < b) iff no sequence of [a, s)
    trains on that token, i.e. iff ``prev`` < a, ``prev`` being the nearest earlier sequence that trains on
    it (-1: none). Rows that s - 1 trains on too never count and are not kept: the walk back through the
    sequences sharing the token starts only at the few rows left (``start_S``: each sequence's first flat
    position; flat positions run sequence by sequence, in the run order)."""
    shared_F = depth_F < lcp[seq_F]
    pos = np.flatnonzero(row_F & shared_F)
    cur = start_S[seq_F[pos] - 1] + depth_F[pos]  # the same token in the previous sequence
    keep = ~row_F[cur]
    pos, cur = pos[keep], cur[keep]
    walk = np.flatnonzero(shared_F[cur] & ~row_F[cur])
    while walk.size:  # back one sequence while the token is shared further and nobody trains on it
        c = cur[walk]
        cur[walk] = start_S[seq_F[c] - 1] + depth_F[c]
        walk = walk[shared_F[cur[walk]] & ~row_F[cur[walk]]]
    seq = seq_F[pos].astype(np.int64)
    prev = np.where(row_F[cur], seq_F[cur], -1).astype(np.int64)
    order = np.lexsort((prev, seq))
    return seq[order], prev[order]


@dataclass
class RunCosts:
    """Costs of contiguous runs of a unit's sequences (in a DFS leaf order of its trie): the run
    ``[a, b)`` costs ``full[a] + inc[a+1:b].sum()`` plus ``per_extra`` for each extra row point (``extra_seq``
    in (a, b), ``extra_prev`` < a: see `_extra_rows`). For a trie, ``full`` is a sequence alone and ``inc``
    what it adds after its predecessor (tokens past their LCP), so a cut at a deep LCP pays for the shared
    prefix twice: cutting where little is shared is cheaper, and the balance sees it. ``whole`` is the exact
    cost of the unit (the run of all its sequences unless measured otherwise)."""

    full: np.ndarray  # int64 [S]
    inc: np.ndarray  # int64 [S]
    whole: int
    work: Work | None = None  # the unit's exact work, when it is a pack
    extra_seq: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # int64 [X], ascending
    extra_prev: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # int64 [X]
    per_extra: int = 0  # the cost of one extra row (the FLOP model's per_predicted)

    @property
    def n(self) -> int:
        return int(self.full.shape[0])

    def extra(self, a: int, b: int) -> int:
        """Extra rows of the run [a, b)."""
        if not self.per_extra or not len(self.extra_seq):
            return 0
        seq, prev = self.extra_seq, self.extra_prev
        return int(((seq > a) & (seq < b) & (prev < a)).sum())

    def run(self, a: int, b: int) -> int:
        return int(self.full[a] + self.cum[b] - self.cum[a + 1]) + self.per_extra * self.extra(a, b)

    @cached_property
    def cum(self) -> np.ndarray:
        """``inc``'s prefix sums: ``cum[b] - cum[a]`` is ``inc[a:b].sum()``."""
        return np.r_[0, np.cumsum(self.inc)]

    def heads(self, a: int, stops: np.ndarray) -> np.ndarray:
        """Costs of the runs [a, s) for every s in ``stops`` (each > a), vectorised."""
        cum = self.cum
        out = self.full[a] + cum[stops] - cum[a + 1]
        if self.per_extra and len(self.extra_seq):
            seq = self.extra_seq[(self.extra_seq > a) & (self.extra_prev < a)]  # ascending
            out = out + self.per_extra * np.searchsorted(seq, stops, side="left")
        return out

    def tails(self, starts: np.ndarray, b: int) -> np.ndarray:
        """Costs of the runs [s, b) for every s in ``starts`` (each < b), vectorised: a point (seq, prev)
        with seq < b counts for the s with prev < s < seq."""
        cum = self.cum
        out = self.full[starts] + cum[b] - cum[starts + 1]
        if self.per_extra and len(self.extra_seq):
            inside = self.extra_seq < b
            prev, seq = np.sort(self.extra_prev[inside]), self.extra_seq[inside]  # seq ascending already
            count = np.searchsorted(prev, starts, side="left") - np.searchsorted(seq, starts, side="right")
            out = out + self.per_extra * count
        return out

    def step(self, start: int, s: int) -> int:
        """What sequence s adds to the run [start, s): ``run(start, s + 1) - run(start, s)``."""
        out = int(self.inc[s])
        if self.per_extra and len(self.extra_seq):
            lo, hi = np.searchsorted(self.extra_seq, [s, s + 1])
            out += self.per_extra * int(np.searchsorted(self.extra_prev[lo:hi], start, side="left"))
        return out


def run_costs(lengths: np.ndarray, lcp: np.ndarray, rows: np.ndarray, new_rows: np.ndarray, flops: FlopModel,
              layout: str = "tree", is_leaf: np.ndarray | None = None, whole: int | None = None,
              extra: tuple[np.ndarray, np.ndarray] | None = None) -> RunCosts:
    """`RunCosts` from per-sequence lengths, LCPs with the previous sequence, loss rows, loss rows past
    that LCP and the extra row points (`_extra_rows`; none if None). ``tree``: the run's trie. ``flat``:
    every sequence on its own. ``leaf``: the run's leaf sequences on their own, where the last sequence of a
    run is always a leaf: ``inc`` takes back its predecessor when that one is no leaf (a proper prefix of
    it, or equal), so only a cut between them makes the prefix a leaf of its piece. The head of ``tree``
    and ``leaf`` computes each trie token once (targets merged in)."""
    _check_layout(layout)
    lengths, lcp = np.asarray(lengths, np.int64), np.asarray(lcp, np.int64)
    full = flops.costs(lengths, rows, _pairs(lengths))
    if layout == "flat":
        inc = full.copy()
        extra = None
    elif layout == "tree":
        inc = flops.costs(lengths - lcp, new_rows, _pairs(lengths) - _pairs(lcp))
    else:
        keep = np.ones(len(lengths), bool) if is_leaf is None else np.asarray(is_leaf, bool)
        back = np.r_[0, np.where(keep[:-1], 0, lengths[:-1])] if len(lengths) else lengths  # a non-leaf predecessor
        inc = flops.costs(lengths - back, new_rows, _pairs(lengths) - _pairs(back))
    full = full + flops.per_call  # a run's first sequence brings the run's one call
    costs = RunCosts(full=full, inc=inc, whole=0)
    if extra is not None and flops.per_predicted:
        costs.extra_seq, costs.extra_prev = (np.asarray(x, np.int64) for x in extra)
        costs.per_extra = flops.per_predicted
    costs.whole = costs.run(0, costs.n) if costs.n and whole is None else int(whole or 0)
    return costs


def pack_run_costs(pack: Pack, flops: FlopModel, layout: str = "tree") -> RunCosts:
    """`RunCosts` of a pack's sequences (its own order), with its exact `pack_work` and cost as ``whole``."""
    seqs = _PackSequences(pack)
    work = pack_work(pack, layout, _seqs=seqs)
    costs = run_costs(seqs.lengths, seqs.lcp, seqs.rows, seqs.new_rows, flops, layout, is_leaf=seqs.is_leaf,
                      whole=flops.cost(work), extra=(seqs.extra_seq, seqs.extra_prev))
    costs.work = work
    return costs


def rollout_run_costs(r: Rollouts, index: np.ndarray | None = None, flops: FlopModel | None = None,
                      layout: str = "tree", scope: np.ndarray | None = None) -> tuple[np.ndarray, RunCosts]:
    """(order, costs): sequences ``index`` of ``r`` (all by default) in lexicographic order (by ``scope``
    first: no sharing across scopes) and the `RunCosts` of runs of that order."""
    from treepack.tree import sorted_with_lcp

    index = np.arange(len(r), dtype=np.int64) if index is None else np.asarray(index, dtype=np.int64)
    sub = r.select(index)
    order, lcp = sorted_with_lcp(sub.tokens, sub.offsets, None if scope is None else np.asarray(scope)[index])
    lengths = sub.lengths[order]
    starts = sub.offsets[:-1][order]
    flat = ranges(starts, lengths)
    seq_F = np.repeat(np.arange(len(order)), lengths)
    depth_F = np.arange(flat.shape[0], dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    mask_F = np.ones(flat.shape[0], bool) if sub.loss_mask is None else sub.loss_mask[flat] > 0
    row_F = mask_F & (depth_F > 0)
    rows = np.bincount(seq_F, weights=row_F, minlength=len(order)).astype(np.int64)
    new_rows = np.bincount(seq_F, weights=row_F & (depth_F >= lcp[seq_F]), minlength=len(order)).astype(np.int64)
    is_leaf = np.ones(len(order), bool)
    if len(order) > 1:
        is_leaf[:-1] = lcp[1:] < lengths[:-1]
    extra = _extra_rows(seq_F, depth_F, row_F, lcp, np.cumsum(lengths) - lengths)
    return index[order], run_costs(lengths, lcp, rows, new_rows, flops or TOKENS, layout, is_leaf=is_leaf,
                                   extra=extra)
