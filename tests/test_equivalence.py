"""Tree mode trains exactly like the dense baseline (float64, CPU): loss, log-probs and every parameter
gradient within 1e-9 relative, for SFT and GRPO, both normalisations, on random trees with branch points,
duplicates, prefix-of-another sequences, partial loss masks, behaviour log-probs and distinct advantages.
`treepack.train.verify` must report it, and must fail on packs whose ``parent`` or ``subtree_end`` lie.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import rollouts_from, sequence_lists

from treepack.pack.layout import build_pack
from treepack.train.config import DfsConfig
from treepack.train.losses import BatchTotals, LossRows, Objective
from treepack.train.model import Decoder, ModelArgs
from treepack.train.modes import make_mode
from treepack.train.verify import check_pack, tiny_model_args, verify_packs

TOL = 1e-9
VOCAB = 13


def random_sequences(rng: np.random.Generator, n: int) -> list[list[int]]:
    """Branches off a shared trunk, duplicates, prefixes of other sequences, fresh roots."""
    trunk = rng.integers(0, VOCAB, 20).tolist()
    seqs: list[list[int]] = []
    for _ in range(n):
        r = rng.random()
        if seqs and r < 0.15:
            seqs.append(list(seqs[rng.integers(len(seqs))]))
        elif seqs and r < 0.3:
            base = seqs[rng.integers(len(seqs))]
            seqs.append(base[: rng.integers(1, len(base) + 1)])
        elif r < 0.9:
            seqs.append(trunk[: rng.integers(1, len(trunk) + 1)] + rng.integers(0, VOCAB, rng.integers(1, 15)).tolist())
        else:
            seqs.append(rng.integers(0, VOCAB, rng.integers(1, 15)).tolist())
    return seqs


def make_pack(seqs, seed: int, *, groups=None, logprobs: bool = True, pad_to: int | None = None):
    rng = np.random.default_rng(seed)
    masks = [(rng.random(len(s)) < 0.6).astype(int).tolist() for s in seqs]
    r = rollouts_from(seqs, masks=masks, groups=groups, advantages=rng.standard_normal(len(seqs)))
    if logprobs:  # behaviour log-probs near the model's (~ -log VOCAB), so some ratios clip and some not
        r.logprobs = -np.log(VOCAB) + 0.3 * rng.standard_normal(int(r.offsets[-1]))
    return build_pack(r, pad_to=pad_to)


@pytest.fixture(scope="module")
def model() -> Decoder:
    return Decoder.random_init(tiny_model_args(VOCAB), seed=0, dtype=torch.float64)


def run(model, packs, mode, objective, **options):
    """Loss, per-row log-probs and gradients of one global batch of ``packs`` in ``mode``."""
    rows = [LossRows.from_pack(p) for p in packs]
    totals = BatchTotals.of(rows)
    model.zero_grad(set_to_none=True)
    loss, logps = 0.0, []
    m = make_mode(mode, **options)
    for p, r in zip(packs, rows):
        out = m(model, p, r, objective, totals)
        out.backward()
        loss += out.loss.item()
        logps.append(out.logp_R)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return loss, torch.cat(logps), grads


def rel_diffs(grads, ref):
    """max |g - g_ref| / max |g_ref| per parameter, the denominator floored as `treepack verify` does (a
    parameter whose true gradient is 0 holds rounding noise in one mode and exact zeros in the other). When
    every reference gradient is 0 (GRPO with one sequence: its standardised advantage is 0), the absolute
    difference is what is compared."""
    floor = 1e-6 * max(float(g.abs().max()) for g in ref.values()) or 1.0
    return {n: float((grads[n] - ref[n]).abs().max()) / max(float(ref[n].abs().max()), floor) for n in ref}


def assert_equivalent(model, packs, objective, **tree_options):
    loss_d, logp_d, g_d = run(model, packs, "dense", objective)
    loss_t, logp_t, g_t = run(model, packs, "tree", objective, **tree_options)
    assert abs(loss_t - loss_d) <= TOL * abs(loss_d)
    assert torch.allclose(logp_t, logp_d, rtol=0, atol=1e-12)
    rel = rel_diffs(g_t, g_d)  # (run() fails on a parameter without .grad: nothing is silently detached)
    worst = max(rel, key=rel.get)
    assert rel[worst] <= TOL, f"{worst}: {rel[worst]:.3g}"
    return rel


OBJECTIVES = [
    Objective("sft", "token"),
    Objective("sft", "sequence"),
    Objective("grpo", "token"),
    Objective("grpo", "sequence", clip_low=0.1, clip_high=0.28, kl_coef=0.05),
]


@pytest.mark.parametrize("objective", OBJECTIVES, ids=lambda o: f"{o.kind}-{o.normalization}")
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tree_equals_dense(model, objective, seed):
    rng = np.random.default_rng(seed)
    pack = make_pack(random_sequences(rng, 12), seed)
    assert pack.scale.max() > 1 and (np.bincount(pack.parent[pack.parent >= 0]) > 1).any()  # shares, branches
    rel = assert_equivalent(model, [pack], objective)
    assert np.mean(list(rel.values())) < 1e-12


@pytest.mark.parametrize("kind", ["sft", "grpo"])
def test_gather_path_equals_fast_path_and_dense(model, kind):
    """SFT's loss_weight fast path and the per-row gather path agree with dense (and each other)."""
    pack = make_pack(random_sequences(np.random.default_rng(7), 10), 7)
    objective = Objective(kind, "token")
    assert_equivalent(model, [pack], objective, sft_fast_path=False)
    assert_equivalent(model, [pack], objective, sft_fast_path=True)


def test_global_batch_of_several_packs(model):
    """Normalisers span the batch: two packs accumulated equal one pack holding every sequence."""
    seqs = random_sequences(np.random.default_rng(3), 14)
    rng = np.random.default_rng(3)
    masks = [(rng.random(len(s)) < 0.6).astype(int).tolist() for s in seqs]
    r = rollouts_from(seqs, masks=masks, advantages=rng.standard_normal(len(seqs)))
    halves = [build_pack(r, np.arange(0, 7)), build_pack(r, np.arange(7, 14))]
    whole = [build_pack(r)]
    for objective in (Objective("sft", "token"), Objective("grpo", "sequence")):
        loss_w, _, g_w = run(model, whole, "dense", objective)
        loss_h, _, g_h = run(model, halves, "tree", objective)
        assert abs(loss_h - loss_w) <= TOL * abs(loss_w)
        assert max(rel_diffs(g_h, g_w).values()) <= TOL


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seqs=sequence_lists(max_seqs=8, max_len=10, vocab=4), seed=st.integers(0, 2**16),
       kind=st.sampled_from(["sft", "grpo"]), norm=st.sampled_from(["token", "sequence"]))
def test_tree_equals_dense_property(model, seqs, seed, kind, norm):
    pack = make_pack(seqs, seed)
    if LossRows.from_pack(pack).n_rows == 0:
        return  # nothing to train on: both losses are 0
    assert_equivalent(model, [pack], Objective(kind, norm))


@pytest.mark.parametrize("family,tie", [("qwen2", True), ("llama", False)])
def test_other_families_and_tied_head(family, tie):
    args = ModelArgs.for_family(family, vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_layers=2,
                                num_heads=4, num_kv_heads=1, head_dim=8, tie_embeddings=tie)
    m = Decoder.random_init(args, seed=1, dtype=torch.float64)
    pack = make_pack(random_sequences(np.random.default_rng(5), 8), 5, pad_to=16)  # with padding tokens
    assert pack.n_tokens > pack.n_real
    assert_equivalent(m, [pack], Objective("grpo", "token"))


def test_forest_split_matches_single_call(model, monkeypatch):
    """Independent trees of a pack run as separate reference calls: identical results."""
    import treepack.train.attention as attention_mod

    seqs = [[i % 4] + s for i, s in enumerate(random_sequences(np.random.default_rng(11), 12))]
    pack = make_pack(seqs, 11)  # four trees: the root token is the group
    objective = Objective("sft", "token")
    _, logp_one, g_one = run(model, [pack], "tree", objective)
    monkeypatch.setattr(attention_mod, "SEGMENT_MIN_TOKENS", 4)
    ctx = attention_mod.AttentionContext.tree(torch.as_tensor(pack.subtree_end), "reference")
    assert len(ctx.segments) >= 2
    _, logp_split, g_split = run(model, [pack], "tree", objective, attention="reference")
    assert torch.allclose(logp_one, logp_split, rtol=0, atol=1e-13)
    assert max(rel_diffs(g_split, g_one).values()) <= 1e-12


# --------------------------------------------------------------------------------------------------
# verify: reports equivalence, catches corrupted packs


@pytest.fixture(scope="module")
def packs():
    rng = np.random.default_rng(21)
    return [make_pack(random_sequences(rng, 8), 21 + i) for i in range(2)]


def test_verify_reports_equivalence(packs):
    report = verify_packs(packs, loss="grpo")
    assert report.ok, report.failures
    assert report.layout_problem_count == 0
    assert 0 <= report.max_rel_grad_diff <= TOL and report.max_logprob_diff < 1e-12
    j = report.to_json()
    assert {"ok", "max_rel_grad_diff", "mean_rel_grad_diff", "max_logprob_diff", "losses"} <= set(j)
    assert set(j["losses"]) == {"dense", "tree"}
    assert abs(j["losses"]["tree"] - j["losses"]["dense"]) <= TOL * abs(j["losses"]["dense"])


def _corrupt_parent(p):
    parent = p.parent.copy()
    # re-hang a deep token onto its grandparent: still a preorder forest, wrong tree
    q = int(np.flatnonzero((parent >= 0) & (parent[np.maximum(parent, 0)] >= 0))[-1])
    parent[q] = parent[parent[q]]
    return dataclasses.replace(p, parent=parent)


def _corrupt_subtree_end(p):
    end = p.subtree_end.copy()
    k = int(np.flatnonzero(end < p.n_real)[0])  # a token whose subtree stops before the end: widen it
    end[k] += 1
    return dataclasses.replace(p, subtree_end=end)


@pytest.mark.parametrize("corrupt", [_corrupt_parent, _corrupt_subtree_end], ids=["parent", "subtree_end"])
def test_verify_fails_on_corrupted_pack(packs, corrupt):
    bad = [packs[0], corrupt(packs[1])]
    problems, n = check_pack(bad[1])
    assert n > 0 and problems
    report = verify_packs(bad, loss="sft")
    assert not report.ok
    assert report.layout_problem_count > 0
    # the numbers disagree too, independently of the layout check
    assert report.modes["tree"].error or report.max_rel_grad_diff > TOL or report.max_logprob_diff > 1e-9


def test_verify_low_precision_rule(packs):
    report = verify_packs(packs, dtype="float32", loss="sft")
    assert report.ok, report.failures
    assert report.modes["tree"].ref_rel_grad_diff is not None
    assert report.modes["tree"].ref_rel_grad_diff <= 2 * report.modes["dense"].ref_rel_grad_diff + 1e-6


def test_verify_loss_that_cancels_to_zero():
    """On-policy GRPO with sequence-mean normalisation: the batch loss is -mean(A) = 0 in exact arithmetic
    (advantages of mean 0), so each mode's loss is rounding of ~1e-17. That is no disagreement: the loss gap
    is relative to the size of the loss's terms, not to the baseline's rounding of 0."""
    rng = np.random.default_rng(0)
    seqs, masks, history = [], [], []
    for _ in range(5):  # turns of one conversation: each trains on its 4 answer tokens
        history = history + rng.integers(0, VOCAB, 7).tolist()
        seqs.append(list(history))
        masks.append([0] * (len(history) - 4) + [1] * 4)
    r = rollouts_from(seqs, masks=masks, advantages=[-2.0, -1.0, 0.0, 1.0, 2.0])
    report = verify_packs([build_pack(r)], modes=("dense", "dense-leaf", "tree", "dfs"), loss="grpo",
                          normalization="sequence", mode_options={"dfs": DfsConfig(block_size=1)})
    assert report.ok, report.failures
    assert all(abs(m.loss) < 1e-15 for m in report.modes.values())
