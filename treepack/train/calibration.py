"""The balance's cost model fitted to the ranks' measured times: attention against matmul FLOPs, and the
fixed time of a model call.

Why: the FLOP model (design §9) prices an attention pair as 12 x layers x heads x head_dim FLOPs at the
matmuls' rate and a pack's call as free. Neither holds on a GPU: the attention kernel runs at its own rate
(FA4's tree kernel 0.75-0.98x its dense varlen kernel per pair, which is not the GEMMs' rate), and each
pack or piece of one costs host time and launches whatever its size (a piece of a cut pack is a second
call). Where the attention share of the ranks' work differs, or one rank runs more pieces, the FLOP model
predicts a balanced step that the GPUs run unbalanced (issue measurements on 4 GPUs: 1-6% predicted,
20-24% measured).

Every data-parallel step gives one observation per rank: its work (matmul FLOPs, attention FLOPs, calls)
and its measured compute seconds (CUDA events around its packs). Over a window of recent steps that did
not compile anything, ``seconds = a x matmul FLOPs + b x attention FLOPs + c x calls`` is fitted by
non-negative least squares; the balance then prices pairs at ``b / a`` of the FLOP model's price and a
call at ``c / a`` matmul FLOPs. The first steps (compiling) are not observed, and until a fit exists the
FLOP model is used. Every rank must make the same split without talking: rank 0's fit is broadcast.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, replace

import numpy as np

from treepack.pack.cost import FlopModel, Work

# the fitted attention price is kept within this factor of the FLOP model's (a window whose ranks all had
# the same attention share cannot tell the two rates apart: lstsq may then put any weight on either)
ATTENTION_RANGE = (0.25, 4.0)


@dataclass(frozen=True)
class Fit:
    """Seconds per matmul FLOP, per attention FLOP and per call; and how well they explain the window."""

    per_mm_flop: float
    per_attention_flop: float
    per_call: float
    rel_error: float  # mean |predicted - measured| / mean measured over the window's observations

    def as_array(self) -> np.ndarray:
        return np.array([self.per_mm_flop, self.per_attention_flop, self.per_call, self.rel_error])


def nnls(X: np.ndarray, y: np.ndarray, required: int = 0) -> np.ndarray | None:
    """Non-negative least squares for a few columns, by trying every subset of them (column ``required``
    always in): the subset whose unconstrained fit is all positive with the smallest residual."""
    best, best_res = None, np.inf
    cols = range(X.shape[1])
    for k in range(1, X.shape[1] + 1):
        for subset in itertools.combinations(cols, k):
            if required not in subset:
                continue
            coef, *_ = np.linalg.lstsq(X[:, subset], y, rcond=None)
            if np.any(coef <= 0):
                continue
            res = float(np.sum((X[:, subset] @ coef - y) ** 2))
            if res < best_res:
                best_res, best = res, np.zeros(X.shape[1])
                best[list(subset)] = coef
    return best


class CostCalibration:
    """Observations of (rank work, rank seconds) and the cost model fitted to them."""

    def __init__(self, base: FlopModel, *, window: int = 16, skip: int = 2, min_steps: int = 2) -> None:
        self.base = base
        self.skip = skip  # first observed steps left out (compiles, allocator warm-up)
        self.min_steps = min_steps
        self.steps: deque[tuple[np.ndarray, np.ndarray]] = deque(maxlen=window)
        self.seen = 0
        self.fit: Fit | None = None

    def features(self, work: Work) -> np.ndarray:
        """(matmul FLOPs, attention FLOPs, calls) of one rank's work under the base FLOP model."""
        b = self.base
        return np.array([b.per_token * work.tokens + b.per_predicted * work.predicted, b.per_pair * work.pairs,
                         work.calls], dtype=np.float64)

    def observe(self, rank_work: list[Work], rank_seconds: np.ndarray, *, compiled: bool) -> None:
        """One step: every rank's work and measured seconds. A step in which a rank compiled is not kept."""
        self.seen += 1
        seconds = np.asarray(rank_seconds, dtype=np.float64)
        if self.seen <= self.skip or compiled or not np.isfinite(seconds).all():
            return
        X = np.stack([self.features(w) for w in rank_work])
        self.steps.append((X, seconds))

    def refit(self) -> Fit | None:
        """Fit the window (None until ``min_steps`` steps are in it, or when no positive fit exists)."""
        if len(self.steps) < self.min_steps:
            return None
        X = np.concatenate([x for x, _ in self.steps])
        y = np.concatenate([s for _, s in self.steps])
        scale = X.max(axis=0)
        scale[scale == 0] = 1.0
        coef = nnls(X / scale, y)
        if coef is None:
            return None
        coef = coef / scale
        pred = X @ coef
        return Fit(*coef.tolist(), rel_error=float(np.abs(pred - y).mean() / max(y.mean(), 1e-12)))

    def adopt(self, fit: Fit | None) -> None:
        self.fit = fit

    def model(self) -> FlopModel:
        """The balance's cost model: the base FLOP model, its pair and call prices from the fit (in matmul FLOPs)."""
        f = self.fit
        if f is None or f.per_mm_flop <= 0:
            return self.base
        lo, hi = ATTENTION_RANGE
        attention = min(max(f.per_attention_flop / f.per_mm_flop, lo), hi)
        return replace(self.base, per_pair=max(1, round(self.base.per_pair * attention)),
                       per_call=round(f.per_call / f.per_mm_flop), name=f"{self.base.name} (measured)")
