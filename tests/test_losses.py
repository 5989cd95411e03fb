"""Losses: chunked target log-probs, loss rows of a pack, normalisations, GRPO/PPO-clip, advantages."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import rollouts_from
from torch import Tensor

from treepack.errors import ConfigError, TreepackError
from treepack.pack.layout import build_pack
from treepack.train import losses
from treepack.train.losses import (
    BatchTotals,
    LossRows,
    Objective,
    flat_groups_notice,
    group_advantages,
    prepare_grpo_data,
    row_weights,
    static_rows,
    target_logprobs,
    token_weights_fast,
    vocab_block,
    whole_group_advantages,
)


@pytest.mark.parametrize("chunk", [1, 3, 7, 100])
def test_target_logprobs_matches_log_softmax(chunk):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(7, 5, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(11, 5, dtype=torch.float64, generator=g, requires_grad=True)
    t = torch.randint(0, 11, (7,), generator=g)
    coef = torch.randn(7, dtype=torch.float64, generator=g)
    ref = torch.log_softmax(h @ w.T, dim=-1).gather(1, t[:, None])[:, 0]
    got = target_logprobs(h, w, t, chunk_rows=chunk)
    assert torch.allclose(got, ref, rtol=0, atol=1e-14)
    gh_ref, gw_ref = torch.autograd.grad((coef * ref).sum(), (h, w))
    gh, gw = torch.autograd.grad((coef * got).sum(), (h, w))
    assert torch.allclose(gh, gh_ref, rtol=0, atol=1e-14)
    assert torch.allclose(gw, gw_ref, rtol=0, atol=1e-14)


@settings(max_examples=40, deadline=None)
@given(R=st.integers(1, 40), V=st.integers(1, 600), D=st.integers(1, 6), chunk=st.integers(1, 50),
       seed=st.integers(0, 2**16))
def test_target_logprobs_blocks_match_naive(R, V, D, chunk, seed):
    """Row chunks forward, vocabulary blocks backward (several when rows > chunk and V > 128): the log-probs
    and both gradients of a naive full log-softmax, in float64."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(R, D, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(V, D, dtype=torch.float64, generator=g, requires_grad=True)
    t = torch.randint(0, V, (R,), generator=g)
    coef = torch.randn(R, dtype=torch.float64, generator=g)
    ref = torch.log_softmax(h @ w.T, dim=-1).gather(1, t[:, None])[:, 0]
    got = target_logprobs(h, w, t, chunk_rows=chunk)
    assert torch.allclose(got, ref, rtol=0, atol=1e-12)
    for a, b in zip(torch.autograd.grad((coef * got).sum(), (h, w)), torch.autograd.grad((coef * ref).sum(), (h, w))):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)


@given(rows=st.integers(1, 100_000), vocab=st.integers(1, 300_000), chunk=st.integers(1, 8192))
def test_vocab_block_bounds_the_logits_of_a_block(rows, vocab, chunk):
    b = vocab_block(rows, vocab, chunk)
    assert 1 <= b <= vocab and (b == vocab or b % 128 == 0)
    blocks = -(-vocab // b)
    assert blocks <= max(1, -(-rows // chunk))  # no more blocks than the forward has chunks
    assert rows * b <= max(rows, chunk) * vocab + rows * 128  # a block's logits <= a chunk's (+ rounding)


@given(rows=st.integers(0, 20_000), chunk=st.integers(1, 20_000))
def test_static_rows_is_the_smallest_quarter_power_of_the_chunk_that_holds_the_rows(rows, chunk):
    rows = min(rows, chunk)
    sizes = [chunk]
    while sizes[-1] // 4 >= losses.MIN_STATIC_ROWS:
        sizes.append(sizes[-1] // 4)
    fits = [s for s in sizes if s >= max(rows, min(chunk, losses.MIN_STATIC_ROWS))]
    assert static_rows(rows, chunk) == min(fits)


@settings(max_examples=30, deadline=None)
@given(R=st.integers(0, 300), V=st.integers(1, 300), chunk=st.integers(1, 400), seed=st.integers(0, 2**16))
def test_padded_compiled_forward_matches_the_plain_one(R, V, chunk, seed):
    """The compiled forward (chunks padded to static row counts, stale rows dropped) run eagerly: the same
    log-probs as the plain forward, bit for bit, and the same gradients; the buffer starts as NaN so a stale
    row leaking into a real one would show."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(R, 8, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(V, 8, dtype=torch.float64, generator=g, requires_grad=True)
    t = torch.randint(0, V, (R,), generator=g)
    coef = torch.randn(R, dtype=torch.float64, generator=g)
    plain = target_logprobs(h, w, t, chunk_rows=chunk)
    real_empty = Tensor.new_empty
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(losses, "pick", lambda fn, enabled, dynamic=True: fn)
        patch.setattr(Tensor, "new_empty", lambda self, *size, **kw: real_empty(self, *size, **kw).fill_(float("nan")))
        padded = target_logprobs(h, w, t, chunk_rows=chunk, compiled=True)
        assert torch.equal(padded, plain)
        if R:
            for a, b in zip(torch.autograd.grad((coef * padded).sum(), (h, w)),
                            torch.autograd.grad((coef * plain).sum(), (h, w))):
                assert torch.equal(a, b)


def test_target_logprobs_gradcheck_and_repeated_rows():
    g = torch.Generator().manual_seed(1)
    h_base = torch.randn(3, 4, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(6, 4, dtype=torch.float64, generator=g, requires_grad=True)
    rows = torch.tensor([0, 0, 2, 1, 0])  # a branch point's hidden state predicts several targets
    t = torch.tensor([1, 5, 0, 3, 1])
    assert torch.autograd.gradcheck(lambda h, w: target_logprobs(h[rows], w, t, chunk_rows=2), (h_base, w))


def test_target_logprobs_empty_rows_keep_graph():
    w = torch.randn(6, 4, requires_grad=True)
    out = target_logprobs(torch.zeros(0, 4, requires_grad=True), w, torch.zeros(0, dtype=torch.long))
    assert out.shape == (0,)
    out.sum().backward()
    assert w.grad is not None and float(w.grad.abs().sum()) == 0.0


def _pack():
    seqs = [[1, 2, 3, 4], [1, 2, 5], [1, 2, 3, 4], [1, 2]]  # branch at 2, a duplicate, a prefix of another
    masks = [[1, 1, 0, 1], [0, 1, 1], [1, 1, 1, 1], [1, 0]]
    return build_pack(rollouts_from(seqs, masks=masks, advantages=[1.0, -1.0, 0.5, 2.0]))


def test_loss_rows_of_a_pack():
    pack = _pack()
    rows = LossRows.from_pack(pack)
    # a sequence's first token is never a target, whatever its mask
    per_seq = {pack.seq_ids[s]: int(n) for s, n in enumerate(rows.loss_tokens_S)}
    assert per_seq == {0: 2, 1: 2, 2: 3, 3: 0}
    assert rows.n_rows == 7 and rows.n_sequences_with_loss == 3
    for r in range(rows.n_rows):
        s, f = rows.seq_R[r], rows.flat_R[r]
        assert pack.seq_offsets[s] < f < pack.seq_offsets[s + 1]
        assert rows.token_R[r] == pack.seq_token_index[f]
    assert rows.behaviour_logp_R is None
    assert np.allclose(rows.advantage_S, [pack.advantages[s] for s in range(pack.n_sequences)])


def test_normalisations():
    rows = LossRows.from_pack(_pack())
    totals = BatchTotals(loss_tokens=14, sequences=6)  # as if the global batch had another pack like it
    w_tok = row_weights(rows, totals, "token")
    assert np.allclose(w_tok, 1 / 14)
    w_seq = row_weights(rows, totals, "sequence")
    per_seq = np.bincount(rows.seq_R, weights=w_seq, minlength=4)
    assert np.allclose(per_seq[rows.loss_tokens_S > 0], 1 / 6) and per_seq[rows.loss_tokens_S == 0].sum() == 0
    with pytest.raises(ConfigError, match="normalization"):
        row_weights(rows, totals, "batch")


def test_fast_path_weights_are_the_row_weights_summed_per_token():
    pack = _pack()
    rows = LossRows.from_pack(pack)
    totals = BatchTotals.of([rows])
    for norm in ("token", "sequence"):
        token_U, w_U = token_weights_fast(pack, rows, totals, norm)
        expect = np.bincount(rows.token_R, weights=row_weights(rows, totals, norm), minlength=pack.n_tokens)
        assert np.allclose(w_U, expect[token_U]) and np.allclose(expect.sum(), w_U.sum())


def test_grpo_clip_semantics():
    obj = Objective("grpo", clip_low=0.2, clip_high=0.3)
    logp = torch.log(torch.tensor([1.5, 1.5, 0.5, 0.5, 1.0], dtype=torch.float64)).requires_grad_()
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 2.0], dtype=torch.float64)
    behaviour = torch.zeros(5, dtype=torch.float64)  # ratios 1.5, 1.5, 0.5, 0.5, 1.0
    loss_R = obj.grpo_row_loss(logp, adv, behaviour, None)
    # A > 0: min(r, 1.3) A; A < 0: max(r, 0.8) A (pessimistic)
    assert torch.allclose(loss_R, -torch.tensor([1.3, -1.5, 0.5, -0.8, 2.0], dtype=torch.float64))
    (grad,) = torch.autograd.grad(loss_R.sum(), logp)
    # clipped rows carry no gradient; unclipped rows d(-rA)/dlogp = -rA
    assert torch.allclose(grad, torch.tensor([0.0, 1.5, -0.5, 0.0, -2.0], dtype=torch.float64))
    assert float(obj.clip_fraction(logp, behaviour)) == pytest.approx(4 / 5)


def test_grpo_on_policy_without_behaviour_logprobs():
    obj = Objective("grpo")
    logp = torch.tensor([-1.0, -2.0], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([0.5, -3.0], dtype=torch.float64)
    w = torch.tensor([0.5, 0.5], dtype=torch.float64)
    loss = obj.loss(logp, w, adv)
    (grad,) = torch.autograd.grad(loss, logp)
    assert loss.item() == pytest.approx(-(0.5 * 0.5 - 3.0 * 0.5))  # ratio 1
    assert torch.allclose(grad, -w * adv)  # the policy gradient


def test_grpo_rows_without_behaviour_logprobs_are_on_policy():
    obj = Objective("grpo")
    logp = torch.tensor([-1.0, -2.0], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([1.0, 1.0], dtype=torch.float64)
    behaviour = torch.tensor([float("nan"), -1.0], dtype=torch.float64)  # the first record had none
    loss_R = obj.grpo_row_loss(logp, adv, behaviour, None)
    assert loss_R[0].item() == -1.0 and loss_R[1].item() == pytest.approx(-min(np.exp(-1.0), 1.2))


def test_kl_term_k3():
    obj = Objective("grpo", kl_coef=0.1)
    logp = torch.tensor([-1.0, -1.0], dtype=torch.float64)
    adv = torch.zeros(2, dtype=torch.float64)
    ref = torch.tensor([-1.0, -1.5], dtype=torch.float64)
    loss_R = obj.grpo_row_loss(logp, adv, logp, ref)
    delta = ref - logp
    assert torch.allclose(loss_R, 0.1 * (torch.exp(delta) - delta - 1))
    assert loss_R[0] == 0 and loss_R[1] > 0


def test_objective_checks():
    with pytest.raises(ConfigError, match="loss kind"):
        Objective("dpo")
    with pytest.raises(ConfigError, match="clip range"):
        Objective("grpo", clip_low=1.0)
    rows = LossRows.from_pack(build_pack(rollouts_from([[1, 2, 3]])))
    with pytest.raises(TreepackError, match="advantages"):
        Objective("grpo").row_tensors(rows, BatchTotals.of([rows]), device="cpu", dtype=torch.float64)


def test_group_advantages():
    r = rollouts_from([[1, 2], [1, 3], [4, 5], [4, 6], [4, 7]], groups=["a", "a", "b", "b", "b"])
    r.rewards = np.array([1.0, 0.0, 2.0, 2.0, 5.0])
    packs = [build_pack(r, [0, 1, 2]), build_pack(r, [3, 4])]  # group b spans two packs of one batch
    out = group_advantages(packs)
    adv = {(p.seq_groups[s], float(p.rewards[s])): float(p.advantages[s]) for p in out for s in range(p.n_sequences)}
    assert adv[("a", 1.0)] == pytest.approx(1.0, abs=1e-5) and adv[("a", 0.0)] == pytest.approx(-1.0, abs=1e-5)
    b = np.array([2.0, 2.0, 5.0])
    assert adv[("b", 5.0)] == pytest.approx((5 - b.mean()) / (b.std() + 1e-6))
    r.rewards = np.array([1.0, np.nan, 2.0, 2.0, 5.0])
    with pytest.raises(TreepackError, match="needs a reward for every sequence; sequence 1 has none"):
        group_advantages([build_pack(r)])


def test_whole_group_advantages_span_the_steps_a_group_was_cut_between():
    """`treepack pack`'s packers may cut a group between packs that train in different steps: each part's
    advantages come from the whole group, as if the group had been in one pack. Unnamed sequences stay per batch."""
    r = rollouts_from([[1, 2], [1, 3], [1, 4], [1, 5]], groups=["g", "g", "g", "g"])
    r.rewards = np.array([0.0, 1.0, 3.0, 4.0])
    packs = [build_pack(r, [0, 1]), build_pack(r, [2, 3])]
    whole, _ = prepare_grpo_data(packs, kl_coef=0.0)
    per_step = [group_advantages([p])[0] for p in whole]  # one pack a step: each keeps the whole-group values
    g = r.rewards
    want = (g - g.mean()) / (g.std() + 1e-6)
    assert np.concatenate([p.advantages for p in per_step]) == pytest.approx(want, rel=1e-12)
    alone = np.concatenate([group_advantages([p])[0].advantages for p in packs])  # what each step computed before
    assert alone == pytest.approx([-1, 1, -1, 1], abs=1e-5)
    r.steps = np.array([0, 0, 1, 1])  # a group is (step, tree_id): the same tree_id in two steps is two groups
    stepped = whole_group_advantages([build_pack(r, [0, 1, 2, 3])])[0]
    assert stepped.advantages == pytest.approx([-1, 1, -1, 1], abs=1e-5)
    r.groups = r.group_names = None
    r.steps = None
    unnamed = [build_pack(r, [0, 1]), build_pack(r, [2, 3])]
    assert whole_group_advantages(unnamed) is unnamed and all(p.advantages is None for p in unnamed)


def test_flat_groups_notice_counts_groups_without_a_signal():
    """Groups of one sequence, or of equal rewards, get advantage 0: said once, before step 1."""
    r = rollouts_from([[1, 2], [1, 3], [4, 5], [4, 6], [7, 8]], groups=["a", "a", "b", "b", "c"])
    r.rewards = np.array([1.0, 0.0, 2.0, 2.0, 5.0])
    packs = [build_pack(r, [0, 1, 2]), build_pack(r, [3, 4])]
    assert flat_groups_notice(packs) == ("grpo: 2 of 3 groups (tree_id) have one sequence (1) or equal rewards (1): "
                                         "their 3 sequences get advantage 0 and add no gradient")
    r.rewards = np.array([1.0, 0.0, 2.0, 3.0, 5.0])
    r.groups = np.array([0, 0, 1, 1, 1])
    assert flat_groups_notice([build_pack(r)]) is None
    assert flat_groups_notice(prepare_grpo_data([build_pack(r)], kl_coef=0.0)[0]) is None  # advantages given: nothing to say
