"""Every treepack.hf loss equals its plain per-sequence definition (float64): written here as loops over
sequences and tokens, the way the papers state them, on random inputs (hypothesis)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treepack.hf import (
    BatchTotals,
    batch_totals,
    grpo_advantages,
    gspo_loss,
    kl_estimate,
    policy_loss,
    rloo_advantages,
    sft_loss,
)
from treepack.hf.losses import LossInputError

TOL = 1e-12


@st.composite
def batches(draw):
    """Per-sequence log-probs (L_s - 1 targets), per-token masks (L_s), old/ref log-probs, advantages."""
    n = draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 9, n)
    logps = [torch.tensor(-rng.exponential(1.0, L - 1), requires_grad=True) for L in lengths]
    masks = [(rng.random(L) < 0.7).astype(int) for L in lengths]
    old = [torch.tensor(lp.detach().numpy() + 0.3 * rng.standard_normal(L - 1)) for lp, L in zip(logps, lengths)]
    for o in old:  # some rows on-policy (no behaviour log-prob)
        o[torch.as_tensor(rng.random(o.shape[0]) < 0.2)] = float("nan")
    ref = [torch.tensor(lp.detach().numpy() + 0.3 * rng.standard_normal(L - 1)) for lp, L in zip(logps, lengths)]
    adv = torch.tensor(rng.standard_normal(n))
    return logps, masks, old, ref, adv


def rows_of(masks):
    """Per sequence, the target indices t (0-based over L-1 targets) with mask 1 (token t+1 trained)."""
    return [[t for t in range(len(m) - 1) if m[t + 1]] for m in masks]


def naive_aggregate(per_row, masks, agg, constant=None):
    """per_row[s][t] -> the aggregation, by its definition."""
    rows = rows_of(masks)
    seqs = [s for s in range(len(rows)) if rows[s]]
    if agg == "token-mean":
        n = sum(len(r) for r in rows)
        return sum(per_row[s][t] for s in seqs for t in rows[s]) / max(n, 1)
    if agg == "seq-mean-token-mean":
        return sum(sum(per_row[s][t] for t in rows[s]) / len(rows[s]) for s in seqs) / max(len(seqs), 1)
    if agg == "seq-mean-token-sum":
        return sum(sum(per_row[s][t] for t in rows[s]) for s in seqs) / max(len(seqs), 1)
    return sum(sum(per_row[s][t] for t in rows[s]) for s in seqs) / (max(len(seqs), 1) * constant)


def ppo_row(lp, old, a, lo, hi):
    old = lp.detach() if math.isnan(float(old)) else old
    ratio = torch.exp(lp - old)
    return -torch.minimum(ratio * a, torch.clamp(ratio, 1 - lo, 1 + hi) * a)


def k3(lp, ref):
    return torch.exp(ref - lp) - (ref - lp) - 1


def _f(x) -> float:
    return float(x.detach()) if torch.is_tensor(x) else float(x)


def assert_same(a, b):
    assert abs(_f(a) - _f(b)) <= TOL * max(1.0, abs(_f(b)))


def assert_same_grads(loss_a, loss_b, logps):
    if not (torch.is_tensor(loss_b) and loss_b.requires_grad):
        return  # no loss rows: nothing depends on the log-probs
    ga = torch.autograd.grad(loss_a, logps, allow_unused=True, retain_graph=True)
    gb = torch.autograd.grad(loss_b, logps, allow_unused=True, retain_graph=True)
    for x, y, lp in zip(ga, gb, logps):
        x = torch.zeros_like(lp) if x is None else x
        y = torch.zeros_like(lp) if y is None else y
        assert x.numel() == 0 or float((x - y).abs().max()) <= TOL


AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


@settings(max_examples=40, deadline=None)
@given(batches(), st.sampled_from(AGGS))
def test_sft(batch, agg):
    logps, masks, *_ = batch
    got = sft_loss(logps, masks, aggregation=agg, constant=17.0)
    want = naive_aggregate([[-lp[t] for t in range(lp.shape[0])] for lp in logps], masks, agg, 17.0)
    assert_same(got, want)
    assert_same_grads(got, want, logps)


@settings(max_examples=40, deadline=None)
@given(batches(), st.sampled_from(AGGS), st.sampled_from(["k1", "k2", "k3"]))
def test_ppo_clip_grpo(batch, agg, est):
    logps, masks, old, ref, adv = batch
    lo, hi, beta = 0.2, 0.28, 0.05
    got = policy_loss(logps, old, adv, masks, clip_low=lo, clip_high=hi, aggregation=agg, ref_logps=ref,
                      kl_coef=beta, kl_estimator=est, constant=9.0)
    per_row = [[ppo_row(lp[t], o[t], adv[s], lo, hi) + beta * kl_estimate(lp[t], r[t], est)
                for t in range(lp.shape[0])] for s, (lp, o, r) in enumerate(zip(logps, old, ref))]
    want = naive_aggregate(per_row, masks, agg, 9.0)
    assert_same(got, want)
    assert_same_grads(got, want, logps)


def test_kl_estimators_by_definition():
    lp, ref = torch.tensor([-1.0, -2.5, -0.1]), torch.tensor([-1.2, -2.0, -0.1])
    assert torch.allclose(kl_estimate(lp, ref, "k1"), lp - ref, rtol=0, atol=1e-15)
    assert torch.allclose(kl_estimate(lp, ref, "k2"), 0.5 * (lp - ref) ** 2, rtol=0, atol=1e-15)
    assert torch.allclose(kl_estimate(lp, ref, "k3"), k3(lp, ref), rtol=0, atol=1e-15)


@settings(max_examples=40, deadline=None)
@given(batches())
def test_gspo(batch):
    logps, masks, old, ref, adv = batch
    lo, hi, beta = 0.05, 0.07, 0.02
    got = gspo_loss(logps, old, adv, masks, clip_low=lo, clip_high=hi, ref_logps=ref, kl_coef=beta)
    rows = rows_of(masks)
    seqs = [s for s in range(len(rows)) if rows[s]]
    want = 0.0
    for s in seqs:
        lp, o = logps[s], old[s]
        delta = [lp[t] - (lp[t].detach() if math.isnan(float(o[t])) else o[t]) for t in rows[s]]
        ratio = torch.exp(sum(delta) / len(delta))  # the sequence-level importance ratio
        a = adv[s]
        want = want - torch.minimum(ratio * a, torch.clamp(ratio, 1 - lo, 1 + hi) * a) / len(seqs)
        want = want + beta * sum(k3(lp[t], ref[s][t]) for t in rows[s]) / len(rows[s]) / len(seqs)
    assert_same(got, want)
    assert_same_grads(got, want, logps)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-5, 5), min_size=1, max_size=12), st.integers(1, 4))
def test_group_advantages(rewards, n_groups):
    groups = [i % n_groups for i in range(len(rewards))]
    grpo = grpo_advantages(rewards, groups)
    grpo_pop = grpo_advantages(rewards, groups, unbiased=False)
    dr = grpo_advantages(rewards, groups, scale=False)
    rloo = rloo_advantages(rewards, groups)
    for i, (r, g) in enumerate(zip(rewards, groups)):
        members = [x for x, h in zip(rewards, groups) if h == g]
        mean = sum(members) / len(members)
        var_s = sum((x - mean) ** 2 for x in members) / max(len(members) - 1, 1)
        var_p = sum((x - mean) ** 2 for x in members) / len(members)
        assert abs(float(dr[i]) - (r - mean)) <= 1e-12
        assert abs(float(grpo[i]) - (r - mean) / (math.sqrt(var_s) + 1e-6)) <= 1e-9
        assert abs(float(grpo_pop[i]) - (r - mean) / (math.sqrt(var_p) + 1e-6)) <= 1e-9
        others = [x for j, (x, h) in enumerate(zip(rewards, groups)) if h == g and j != i]
        want = r - sum(others) / len(others) if others else 0.0
        assert abs(float(rloo[i]) - want) <= 1e-12


def test_group_size_and_labels_agree():
    r = [1.0, 0.0, 0.5, 0.2, 0.9, 0.4]
    assert torch.equal(grpo_advantages(r, group_size=3), grpo_advantages(r, ["a", "a", "a", "b", "b", "b"]))


def test_per_token_and_per_target_inputs_agree():
    """Masks and old log-probs given per token (length L, as rollouts store them) or per target (L - 1)."""
    lp = [torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-0.3])]
    mask_tok = [[0, 1, 0, 1], [1, 1]]
    mask_tgt = [m[1:] for m in mask_tok]
    old_tok = [torch.tensor([0.0, -1.1, -2.2, -0.4]), torch.tensor([0.0, -0.2])]
    old_tgt = [o[1:] for o in old_tok]
    a = torch.tensor([0.5, -1.0])
    assert_same(policy_loss(lp, old_tok, a, mask_tok), policy_loss(lp, old_tgt, a, mask_tgt))


def test_global_normaliser_makes_parts_add_up():
    """Losses of two halves with the whole batch's totals sum to the whole batch's loss."""
    rng = np.random.default_rng(0)
    lps = [torch.tensor(-rng.exponential(1.0, n)) for n in (3, 5, 2, 4)]
    masks = [(rng.random(n + 1) < 0.6).astype(int) for n in (3, 5, 2, 4)]
    adv = torch.tensor(rng.standard_normal(4))
    totals = batch_totals(lps, masks)
    assert isinstance(totals, BatchTotals)
    for agg in AGGS:
        whole = policy_loss(lps, None, adv, masks, aggregation=agg, constant=5)
        parts = sum(policy_loss(lps[i:i + 2], None, adv[i:i + 2], masks[i:i + 2], aggregation=agg, totals=totals,
                                constant=5) for i in (0, 2))
        assert_same(parts, whole)


def test_input_errors_say_what_is_wrong():
    lp = [torch.tensor([-1.0, -2.0])]
    with pytest.raises(LossInputError, match="loss_masks: sequence 0 has 5 values; its log-probs have 2 "
                                             r"\(give one per target, 2, or one per token, 3\)"):
        sft_loss(lp, [[1, 1, 1, 1, 1]])
    with pytest.raises(LossInputError, match=r"advantages: expected one per sequence \(1\), got shape \[2\]"):
        policy_loss(lp, None, [0.1, 0.2])
    with pytest.raises(LossInputError, match=r"^loss_masks: sequence 0 holds 0.5; a loss mask is 0 or 1$"):
        policy_loss(lp, None, [0.1], [[1, 0.5]])  # a weight would have counted as 1
    assert sft_loss(lp, [[True, False]]) == sft_loss(lp, [[1, 0]]) == sft_loss(lp, [np.array([1.0, 0.0])])
    with pytest.raises(LossInputError, match="needs constant > 0"):
        sft_loss(lp, aggregation="seq-mean-token-sum-norm")
    with pytest.raises(LossInputError, match="aggregation must be one of token-mean, seq-mean-token-mean"):
        sft_loss(lp, aggregation="mean")
