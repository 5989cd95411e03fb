"""The balance's cost model fitted to measured rank times (`treepack.train.calibration`): the fit recovers
the rates that made the times, steps that compiled are not observed, and a split priced by the fit is
balanced in the times where the FLOP model's split is not."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import rollouts_from

from treepack.pack.cost import FlopModel, Work, pack_run_costs
from treepack.pack.layout import build_pack
from treepack.train.calibration import CostCalibration, Fit, nnls
from treepack.train.distributed import shard_batch

BASE = FlopModel(per_token=6_000, per_predicted=2_000, per_pair=100, name="toy")
TRUTH = (1e-9, 2.5e-9, 4e-4)  # seconds per matmul FLOP, per attention FLOP, per call


def true_seconds(work: Work, truth=TRUTH) -> float:
    mm = BASE.per_token * work.tokens + BASE.per_predicted * work.predicted
    return truth[0] * mm + truth[1] * BASE.per_pair * work.pairs + truth[2] * work.calls


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(100, 5000), st.integers(0, 500), st.integers(0, 2_000_000), st.integers(1, 4)),
                min_size=6, max_size=24))
def test_nnls_recovers_the_rates(works):
    X = np.array([[BASE.per_token * t + BASE.per_predicted * p, BASE.per_pair * q, c] for t, p, q, c in works], float)
    if np.linalg.matrix_rank(X / X.max(axis=0).clip(min=1)) < 3:
        return
    y = X @ np.array(TRUTH)
    coef = nnls(X / X.max(axis=0), y) / X.max(axis=0)
    assert np.allclose(coef, TRUTH, rtol=1e-6)


def test_nnls_drops_a_column_that_would_be_negative():
    X = np.array([[1.0, 0.0], [2.0, 0.1], [3.0, 0.0]])
    y = np.array([1.0, 1.9, 3.0])  # the second column alone would need a negative rate
    coef = nnls(X, y)
    assert coef[1] == 0 and coef[0] == pytest.approx(14.0 / 14.0, rel=0.05)


def test_the_fit_prices_pairs_and_calls_in_matmul_flops():
    cal = CostCalibration(BASE, skip=0)
    rng = np.random.default_rng(0)
    for _ in range(4):
        works = [Work(int(rng.integers(500, 4000)), int(rng.integers(0, 400)), int(rng.integers(0, 3_000_000)),
                      int(rng.integers(1, 4))) for _ in range(4)]
        cal.observe(works, np.array([true_seconds(w) for w in works]), compiled=False)
    cal.adopt(cal.refit())
    assert cal.fit.rel_error < 1e-9
    model = cal.model()
    assert model.per_pair == round(BASE.per_pair * 2.5)  # attention runs at 1/2.5 of the matmul rate
    assert model.per_call == round(4e-4 / 1e-9)  # a call costs what 400k matmul FLOPs cost
    assert (model.per_token, model.per_predicted) == (BASE.per_token, BASE.per_predicted)


def test_compiling_and_first_steps_are_not_observed():
    cal = CostCalibration(BASE, skip=2, min_steps=2)
    works = [Work(1000, 10, 10_000, 1), Work(2000, 20, 90_000, 2)]
    secs = np.array([true_seconds(w) for w in works])
    for compiled in (False, False, True, False):  # steps 1-2 skipped, step 3 compiled: one kept
        cal.observe(works, secs, compiled=compiled)
    assert len(cal.steps) == 1 and cal.refit() is None
    assert cal.model() is BASE  # no fit yet: the FLOP model


def test_a_measured_split_balances_the_times_the_flop_split_does_not():
    """Random batches of chains (long single sequences: attention-heavy) and packs of short answers, under
    rates where attention and calls cost more than the FLOP model says: fitted to the packs' own times,
    the model predicts each split's time imbalance exactly, and its splits are balanced in time where the
    FLOP model's are not."""
    rng = np.random.default_rng(1)
    flop_imb, measured_imb = [], []
    for _ in range(12):
        packs = [build_pack(rollouts_from([list(range(1, int(rng.integers(150, 500))))]))
                 for _ in range(int(rng.integers(3, 7)))]
        packs += [build_pack(rollouts_from([[int(t) for t in rng.integers(2, 10_000, 20)] for _ in range(int(n))]))
                  for n in rng.integers(4, 30, int(rng.integers(6, 11)))]
        order = rng.permutation(len(packs))
        packs = [packs[i] for i in order]
        alone = [pack_run_costs(p, BASE).work for p in packs]
        cal = CostCalibration(BASE, skip=0)
        cal.observe(alone, np.array([true_seconds(w) for w in alone]), compiled=False)
        cal.observe(alone, np.array([true_seconds(w) for w in alone]), compiled=False)
        cal.adopt(cal.refit())
        for model, out in ((BASE, flop_imb), (cal.model(), measured_imb)):
            split = shard_batch(packs, flops=model, mode="tree", rank=0, world_size=3)
            seconds = np.array([true_seconds(w) for w in split.rank_work])
            out.append(seconds.max() / seconds.mean() - 1)
            if model is not BASE:  # the fitted model's prediction is the times' imbalance
                assert out[-1] == pytest.approx(split.imbalance - 1, abs=1e-3)
    assert np.mean(measured_imb) < 0.5 * np.mean(flop_imb), (measured_imb, flop_imb)


def test_fit_round_trips_through_an_array():
    f = Fit(1e-9, 2e-9, 3e-4, 0.01)
    assert Fit(*f.as_array().tolist()) == f


def test_a_step_without_a_finite_time_is_not_observed():
    cal = CostCalibration(BASE, skip=0)
    works = [Work(1000, 0, 1000, 1), Work(2000, 0, 4000, 2)]
    cal.observe(works, np.array([1.0, np.nan]), compiled=False)
    cal.observe(works, np.array([np.inf, 2.0]), compiled=False)
    assert len(cal.steps) == 0
    cal.observe(works, np.array([1.0, 2.0]), compiled=False)
    assert len(cal.steps) == 1
