"""What one fwd+bwd pass over a pack, or over a run of sequences, costs: DESIGN §9's FLOP model.

``FlopModel`` turns a `Work` (tokens through the layers, tokens whose log-prob the head computes, visible
(query, key) attention pairs) into FLOPs: ``6 x non-embedding params x tokens + 6 x d_model x vocab x
predicted + 12 x layers x heads x head_dim x pairs``, as exact integers. A pack's work depends on how the
mode lays it out (``LAYOUTS``): its trie (tree and dfs modes: T = N_tree tokens, pairs = sum of depth + 1),
every sequence on its own (dense: N_flat tokens, L (L + 1) / 2 pairs each), or only the trie's leaf
sequences on their own (dense-leaf). Counting pairs matters: a 9k-token agent conversation costs its
attention pairs as much as 40k tokens of short answers, so a token-only balance gives one rank of long
trees far more work than it thinks.

``RunCosts`` prices every contiguous run of a unit's sequences in a DFS leaf order of its trie with two
arrays, so the balance can try cuts in O(1) each: a run ``[a, b)`` costs ``full[a] + inc[a+1:b].sum()``,
``full`` being a sequence on its own and ``inc`` what it adds after its predecessor (its tokens past their
LCP). Tokens and pairs are exact; the predicted-token term counts each sequence's loss rows past its LCP,
exact unless a sequence trains on a token its predecessor only saw as context.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from treepack.errors import TreepackError
from treepack.io.rollouts import Rollouts, _ranges
from treepack.pack.layout import Pack
from treepack.stats import MODEL_SHAPES, ModelShape

LAYOUTS = ("tree", "flat", "leaf")


@dataclass(frozen=True)
class Work:
    """What one fwd+bwd pass computes: tokens through the layers, tokens whose log-prob the head
    computes, and visible (query, key) attention pairs."""

    tokens: int = 0
    predicted: int = 0
    pairs: int = 0

    def __add__(self, other: Work) -> Work:
        return Work(self.tokens + other.tokens, self.predicted + other.predicted, self.pairs + other.pairs)


@dataclass(frozen=True)
class FlopModel:
    """DESIGN §9's FLOP model as integer coefficients: ``per_token x tokens + per_predicted x predicted +
    per_pair x pairs`` (fwd+bwd: 6 x non-embedding params, 6 x d_model x vocab, 12 x layers x heads x head_dim)."""

    per_token: int
    per_predicted: int
    per_pair: int
    name: str = ""

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
        return self.per_token * work.tokens + self.per_predicted * work.predicted + self.per_pair * work.pairs

    def costs(self, tokens: np.ndarray, predicted: np.ndarray, pairs: np.ndarray) -> np.ndarray:
        """Vectorised `cost` (int64; the coefficients and counts of real batches stay far below 2**63)."""
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


def pack_work(pack: Pack, layout: str = "tree", *, _seqs: _PackSequences | None = None) -> Work:
    """The exact work of one pass over ``pack``: ``tree`` (its trie: tree, dfs modes), ``flat`` (every
    sequence on its own: dense) or ``leaf`` (only the trie's leaf sequences on their own: dense-leaf)."""
    _check_layout(layout)
    seqs = _seqs or _PackSequences(pack)
    predicted = int(np.unique(seqs.tok_F[seqs.row_F]).shape[0])
    if layout == "tree":
        n = int(pack.n_real)
        pairs = int((np.asarray(pack.subtree_end[:n], dtype=np.int64) - np.arange(n)).sum())
        return Work(tokens=n, predicted=predicted, pairs=pairs)
    if layout == "flat":
        return Work(tokens=int(seqs.lengths.sum()), predicted=int(seqs.rows.sum()), pairs=int(_pairs(seqs.lengths).sum()))
    leaf = seqs.lengths[seqs.is_leaf]
    return Work(tokens=int(leaf.sum()), predicted=predicted, pairs=int(_pairs(leaf).sum()))


@dataclass
class RunCosts:
    """Costs of contiguous runs of a unit's sequences (in a DFS leaf order of its trie): the run
    ``[a, b)`` costs ``full[a] + inc[a+1:b].sum()``. For a trie, ``full`` is a sequence alone and ``inc``
    what it adds after its predecessor (tokens past their LCP), so a cut at a deep LCP pays for the
    shared prefix twice: cutting where little is shared is cheaper, and the balance sees it.
    ``whole`` is the exact cost of the unit (``full[0] + inc[1:].sum()`` unless measured otherwise)."""

    full: np.ndarray  # int64 [S]
    inc: np.ndarray  # int64 [S]
    whole: int
    work: Work | None = None  # the unit's exact work, when it is a pack

    @property
    def n(self) -> int:
        return int(self.full.shape[0])

    def run(self, a: int, b: int) -> int:
        return int(self.full[a] + self.inc[a + 1 : b].sum())


def run_costs(lengths: np.ndarray, lcp: np.ndarray, rows: np.ndarray, new_rows: np.ndarray, flops: FlopModel,
              layout: str = "tree", is_leaf: np.ndarray | None = None, whole: int | None = None) -> RunCosts:
    """`RunCosts` from per-sequence lengths, LCPs with the previous sequence, loss rows and loss rows past
    that LCP. The predicted (log-prob) term of a run counts each sequence's rows past its LCP: exact for
    token counts and pairs, an estimate for the head where sequences train on shared tokens."""
    _check_layout(layout)
    full = flops.costs(lengths, rows, _pairs(lengths))
    if layout == "tree":
        inc = flops.costs(lengths - lcp, new_rows, _pairs(lengths) - _pairs(lcp))
    elif layout == "flat":
        inc = full.copy()
    else:
        keep = np.ones(len(lengths), bool) if is_leaf is None else is_leaf
        full = flops.costs(np.where(keep, lengths, 0), rows, np.where(keep, _pairs(lengths), 0))
        inc = full.copy()
    total = int(full[0] + inc[1:].sum()) if len(full) else 0
    return RunCosts(full=full, inc=inc, whole=total if whole is None else int(whole))


def pack_run_costs(pack: Pack, flops: FlopModel, layout: str = "tree") -> RunCosts:
    """`RunCosts` of a pack's sequences (its own order), with its exact `pack_work` and cost as ``whole``."""
    seqs = _PackSequences(pack)
    work = pack_work(pack, layout, _seqs=seqs)
    costs = run_costs(seqs.lengths, seqs.lcp, seqs.rows, seqs.new_rows, flops, layout, is_leaf=seqs.is_leaf,
                      whole=flops.cost(work))
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
    flat = _ranges(starts, lengths)
    seq_F = np.repeat(np.arange(len(order)), lengths)
    depth_F = np.arange(flat.shape[0], dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    mask_F = np.ones(flat.shape[0], bool) if sub.loss_mask is None else sub.loss_mask[flat] > 0
    row_F = mask_F & (depth_F > 0)
    rows = np.bincount(seq_F, weights=row_F, minlength=len(order)).astype(np.int64)
    new_rows = np.bincount(seq_F, weights=row_F & (depth_F >= lcp[seq_F]), minlength=len(order)).astype(np.int64)
    is_leaf = np.ones(len(order), bool)
    if len(order) > 1:
        is_leaf[:-1] = lcp[1:] < lengths[:-1]
    return index[order], run_costs(lengths, lcp, rows, new_rows, flops or TOKENS, layout, is_leaf=is_leaf)
