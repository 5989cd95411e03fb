"""The FA4 backend's inputs and the backend choice, on CPU (the kernels themselves: test_fa4_gpu.py).

* `fa4_tables`: every (query block, key block) with a visible pair is listed, full blocks are entirely
  visible, the backward's lists (query blocks of 128 or 80 rows) classify the same way transposed, and the key_end mask (``n - P <= m < key_end[n]``, the
  mask_mod's formula) equals the contract's dense mask, with and without a cached prefix (hypothesis).
* `pick_backend`: reference off CUDA; on a (simulated) Hopper GPU with FA4 installed, fa4 from
  `FA4_MIN_FLOPS` on and triton below it; triton when FA4 is missing.
* ``impl="fa4"`` off CUDA fails with a message naming the reason.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_tree_attention import make_qkv, random_subtree_end

from treepack.kernels import tree_attention
from treepack.kernels.tree_attention import backends, fa4, registry
from treepack.kernels.tree_attention.blocks import tree_mask, visible_pairs


def _blocks(mask_TS: torch.Tensor, Bq: int, Bk: int | None = None) -> torch.Tensor:
    """[M, N] any-visible per (query block of Bq rows, key block of Bk columns) of a dense mask."""
    Bk = Bq if Bk is None else Bk
    T, S = mask_TS.shape
    M, N = -(-T // Bq), -(-S // Bk)
    padded = torch.zeros(M * Bq, N * Bk, dtype=torch.bool)
    padded[:T, :S] = mask_TS
    return padded.view(M, Bq, N, Bk).any(3).any(1)


def _listed(cnt, idx) -> list[set[int]]:
    return [set(idx[0, 0, r, : int(cnt[0, 0, r])].tolist()) for r in range(cnt.shape[-1])]


def _check_grid(mask, partial, full, Bq, Bk):
    """Rows are query blocks of Bq: no block both partial and full, every visible block listed, full blocks
    entirely visible (a ragged key block never full)."""
    visible = _blocks(mask, Bq, Bk)
    assert len(partial) == visible.shape[0]
    for i in range(visible.shape[0]):
        assert not partial[i] & full[i]
        assert partial[i] | full[i] >= set(visible[i].nonzero().flatten().tolist())
        for j in full[i]:
            blk = mask[i * Bq:(i + 1) * Bq, j * Bk:(j + 1) * Bk]
            assert blk.shape[1] == Bk and bool(blk.all())


@settings(max_examples=25, deadline=None)
@given(T=st.integers(1, 700), P=st.sampled_from([0, 1, 127, 128, 300]), seed=st.integers(0, 10_000),
       branch=st.sampled_from([0.0, 0.05, 0.3]), bwd_q=st.sampled_from(fa4.FA4_BWD_BLOCKS_Q))
def test_fa4_tables_cover_exactly_the_visible_blocks(T, P, seed, branch, bwd_q):
    se = random_subtree_end(T, seed=seed, branch=branch)
    B = fa4.FA4_BLOCK
    key_end, pc, pi, fc, fi, bpc, bpi, bfc, bfi = fa4.fa4_tables(se, P, bwd_block_q=bwd_q)
    mask = tree_mask(se, P)  # [T, P + T]
    S = P + T
    n, m = torch.arange(S), torch.arange(T)
    assert torch.equal((n[None] - P <= m[:, None]) & (m[:, None] < key_end[:S][None].long()), mask)
    _check_grid(mask, _listed(pc, pi), _listed(fc, fi), B, B)
    # the backward's lists: per key block its query blocks of bwd_q rows, the same classification transposed
    bwd_partial, bwd_full = _listed(bpc, bpi), _listed(bfc, bfi)
    assert len(bwd_partial) == -(-S // B)
    M = -(-T // bwd_q)
    _check_grid(mask, [{j for j in range(len(bwd_partial)) if i in bwd_partial[j]} for i in range(M)],
                [{j for j in range(len(bwd_full)) if i in bwd_full[j]} for i in range(M)], bwd_q, B)
    if bwd_q == B:  # the forward's classification, transposed
        partial, full = _listed(pc, pi), _listed(fc, fi)
        for j, (bp, bf) in enumerate(zip(bwd_partial, bwd_full)):
            assert bp == {i for i in range(len(partial)) if j in partial[i]}
            assert bf == {i for i in range(len(full)) if j in full[i]}


@settings(max_examples=25, deadline=None)
@given(T=st.integers(1, 400), P=st.sampled_from([128, 300, 1024]), valid=st.floats(0, 1), seed=st.integers(0, 10_000),
       bwd_q=st.sampled_from(fa4.FA4_BWD_BLOCKS_Q))
def test_fa4_tables_hide_the_prefix_rows_past_prefix_valid(T, P, valid, seed, bwd_q):
    """A fixed-shape call (dfs CUDA graphs) reads P prefix rows of which only the first ``prefix_valid`` are
    real: the tables must give exactly the mask of that shorter prefix, and skip key blocks of hidden rows."""
    se = random_subtree_end(T, seed=seed, branch=0.05)
    v = int(valid * P)
    B = fa4.FA4_BLOCK
    key_end, pc, pi, fc, fi, bpc, bpi, bfc, bfi = fa4.fa4_tables(se, P, bwd_block_q=bwd_q,
                                                                  prefix_valid=torch.tensor([v]))
    mask = tree_mask(se, P)
    mask[:, v:P] = False  # rows [v, P) of the prefix are seen by no query
    S = P + T
    n, m = torch.arange(S), torch.arange(T)
    assert torch.equal((n[None] - P <= m[:, None]) & (m[:, None] < key_end[:S][None].long()), mask)
    partial, full = _listed(pc, pi), _listed(fc, fi)
    _check_grid(mask, partial, full, B, B)
    hidden_blocks = set(range(-(-v // B), P // B))  # key blocks holding hidden rows only
    assert not any((p | f) & hidden_blocks for p, f in zip(partial, full))
    bwd_partial, bwd_full = _listed(bpc, bpi), _listed(bfc, bfi)
    assert all(not bwd_partial[j] and not bwd_full[j] for j in hidden_blocks)
    M = -(-T // bwd_q)
    _check_grid(mask, [{j for j in range(len(bwd_partial)) if i in bwd_partial[j]} for i in range(M)],
                [{j for j in range(len(bwd_full)) if i in bwd_full[j]} for i in range(M)], bwd_q, B)


def test_fa4_tables_reject_an_unsupported_backward_block():
    with pytest.raises(ValueError, match="bwd_block_q must be one of"):
        fa4.fa4_tables(random_subtree_end(50, seed=0), 0, bwd_block_q=96)


def test_fa4_tables_list_no_empty_block_on_a_forest():
    se = random_subtree_end(1500, seed=3, branch=0.05)
    _, pc, pi, fc, fi, *_ = fa4.fa4_tables(se, 0)
    visible = _blocks(tree_mask(se), fa4.FA4_BLOCK)
    listed = sum(len(a | b) for a, b in zip(_listed(pc, pi), _listed(fc, fi)))
    assert listed == int(visible.sum())


def test_pick_backend_off_cuda_is_the_reference():
    assert backends.pick_backend(4096, 16, 128, torch.bfloat16, torch.device("cpu")) == "reference"


@pytest.mark.parametrize("fa4_installed", [True, False])
def test_pick_backend_by_measured_crossover(monkeypatch, fa4_installed):
    monkeypatch.setattr(fa4, "fa4_supported_device", lambda device: True)
    monkeypatch.setattr(fa4, "fa4_importable", lambda: fa4_installed)
    cuda = torch.device("cuda")
    H, D = 16, 128
    pairs_at = backends.FA4_MIN_FLOPS / backends.visible_pair_flops(1, H, D)
    big, small = int(pairs_at * 2), int(pairs_at / 2)
    expect_big = "fa4" if fa4_installed else "triton"
    assert backends.pick_backend(8192, H, D, torch.bfloat16, cuda, pairs=big) == expect_big
    assert backends.pick_backend(8192, H, D, torch.bfloat16, cuda, pairs=small) == "triton"
    # no pairs given: the causal bound over the call and its prefix
    T = 64
    P = int(pairs_at * 4 / T)
    assert backends.pick_backend(T, H, D, torch.bfloat16, cuda, prefix_len=P) == expect_big
    assert backends.pick_backend(T, H, D, torch.bfloat16, cuda) == "triton"
    # fa4 runs bf16 / fp16 only: float32 stays on the Triton kernel
    assert backends.pick_backend(8192, H, D, torch.float32, cuda, pairs=big) == "triton"
    # a whole pack of FA4_MIN_TOKENS or more (many short sequences: few pairs) goes to FA4; not with a prefix
    many = backends.FA4_MIN_TOKENS
    assert backends.pick_backend(many, H, D, torch.bfloat16, cuda, pairs=small) == expect_big
    assert backends.pick_backend(many - 1, H, D, torch.bfloat16, cuda, pairs=small) == "triton"
    assert backends.pick_backend(many, H, D, torch.bfloat16, cuda, prefix_len=1, pairs=small) == "triton"
    # a piece of such a pack (cut across data-parallel ranks) runs its whole pack's kernel, whatever its size
    assert backends.pick_backend(2000, H, D, torch.bfloat16, cuda, pairs=small, whole_tokens=many) == expect_big
    assert backends.pick_backend(2000, H, D, torch.bfloat16, cuda, pairs=small, whole_tokens=many - 1) == "triton"
    assert registry._auto_tree(registry.AttentionCall(cuda, torch.bfloat16, H, D, 2000, 0, small,
                                                      whole_tokens=many)) == expect_big


def test_attention_seconds_grows_with_pairs_and_calls():
    one = backends.attention_seconds("fa4", 10**9, 16, 128)
    assert backends.attention_seconds("fa4", 2 * 10**9, 16, 128) > one
    assert backends.attention_seconds("fa4", 10**9, 16, 128, calls=10_000) > one  # each call has a floor
    assert backends.attention_seconds("triton", 10**9, 16, 128) > one  # fa4's measured rate is higher


def test_fa4_impl_off_cuda_fails_with_the_reason():
    se = random_subtree_end(50, seed=0)
    q, k, v, _, _ = make_qkv(50, 4, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="impl='fa4': the fa4 backend needs CUDA tensors"):
        tree_attention(q, k, v, se, impl="fa4")


def test_visible_pair_flops_counts_fwd_and_bwd():
    se = random_subtree_end(300, seed=1)
    pairs = visible_pairs(se)
    assert backends.visible_pair_flops(pairs, 16, 128) == 3.5 * 4 * pairs * 128 * 16


def _star(prefix: int, branches: int, length: int) -> torch.Tensor:
    """A shared prefix (a chain) and ``branches`` leaves of ``length`` tokens under its last token."""
    T = prefix + branches * length
    se = [T] * prefix
    for b in range(branches):
        end = prefix + (b + 1) * length
        se += [end] * length
    return torch.tensor(se, dtype=torch.int32)


def _with_host(se: torch.Tensor):
    from treepack.kernels import prepare

    info = prepare(se)
    info.cache["host_subtree_end"] = se  # what AttentionContext.tree(..., host=) leaves on a CUDA pack
    return info


def test_heads_fast_is_chosen_for_a_prefix_every_query_sees_not_for_a_chain(monkeypatch):
    """One long CTA per prefix key block (it sees every query) makes FA4's head-major grid end on a tail;
    a causal chain's work falls off evenly and keeps FA4's order. The choice is Hopper's only, and needs
    the host copy (no sync per call)."""
    from treepack.kernels import prepare

    star = fa4.fa4_tail_share(_with_host(_star(2048, 300, 100)))
    chain = fa4.fa4_tail_share(_with_host(torch.full((32768,), 32768, dtype=torch.int32)))
    assert fa4.predicted_tail(star, 16) >= fa4.HEADS_FAST_AT > fa4.predicted_tail(chain, 16)
    # a dfs call over cached rows: every query sees them, their blocks are the longest CTAs
    over_prefix = fa4.fa4_tail_share(_with_host(torch.full((4096,), 4096, dtype=torch.int32)), prefix_len=1024)
    assert fa4.predicted_tail(over_prefix, 16) >= fa4.HEADS_FAST_AT
    assert fa4.fa4_tail_share(prepare(_star(2048, 300, 100))) is None  # no host copy
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(fa4, "_arch_major", lambda index: 9)
    assert (fa4.bwd_order(star, 16, cuda), fa4.bwd_order(chain, 16, cuda), fa4.bwd_order(None, 16, cuda)) == (1, 0, 0)
    monkeypatch.setattr(fa4, "FA4_BWD_ORDER", "heads-fast")
    assert fa4.bwd_order(chain, 16, cuda) == 1
    monkeypatch.setattr(fa4, "_arch_major", lambda index: 10)  # Blackwell: its own backward kernel
    assert fa4.bwd_order(star, 16, cuda) == 0
    assert fa4.bwd_order(star, 16, torch.device("cpu")) == 0


def test_tail_share_is_cached_on_the_pack():
    info = _with_host(_star(1024, 40, 50))
    first = fa4.fa4_tail_share(info)
    info.cache[("fa4-tail", fa4.FA4_BWD_BLOCK_Q)] = -1.0
    assert first > 0 and fa4.fa4_tail_share(info) == -1.0


@pytest.mark.parametrize(("variable", "value", "expect", "warning"), [
    ("TREEPACK_FA4_BWD_ORDER", "heads-fast", "FA4_BWD_ORDER=heads-fast", None),
    ("TREEPACK_FA4_BWD_ORDER", " FA4 ", "FA4_BWD_ORDER=fa4", None),
    ("TREEPACK_FA4_BWD_ORDER", "", "FA4_BWD_ORDER=auto", None),
    ("TREEPACK_FA4_BWD_ORDER", "sideways", "FA4_BWD_ORDER=auto", "TREEPACK_FA4_BWD_ORDER='sideways' is not auto"),
    ("TREEPACK_FA4_MASK", "per-score", "MASK_PER_KEY=False", None),
    ("TREEPACK_FA4_MASK", " Per-Key ", "MASK_PER_KEY=True", None),
    ("TREEPACK_FA4_MASK", "", "MASK_PER_KEY=True", None),
    ("TREEPACK_FA4_MASK", "per-pair", "MASK_PER_KEY=True", "TREEPACK_FA4_MASK='per-pair' is not per-key or per-score"),
    ("TREEPACK_FA4_FWD_ORDER", " LPT ", "FA4_FWD_ORDER=lpt", None),
    ("TREEPACK_FA4_FWD_ORDER", "", "FA4_FWD_ORDER=fa4", None),
    ("TREEPACK_FA4_FWD_ORDER", "backwards", "FA4_FWD_ORDER=fa4", "TREEPACK_FA4_FWD_ORDER='backwards' is not lpt or fa4"),
])
def test_fa4_settings_from_the_environment(variable, value, expect, warning):
    """The run-wide FA4 settings read at import; an unknown value warns once and keeps the default."""
    import subprocess
    import sys

    name = expect.split("=")[0]
    code = f"from treepack.kernels.tree_attention import fa4; print('{name}=' + str(fa4.{name}))"
    run = subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True, text=True, check=True,
                         env={**__import__("os").environ, variable: value})
    assert run.stdout.strip() == expect
    assert (warning is not None and warning in run.stderr) == (warning is not None)
    assert "RuntimeWarning" not in run.stderr or warning is not None


@settings(max_examples=25, deadline=None)
@given(T=st.integers(1, 700), seed=st.integers(0, 2**16))
def test_tail_share_counts_the_backward_block_lists(T, seed):
    """The per-key-block work behind the tail share is what FA4's backward lists (fa4_tables) hold."""
    se = random_subtree_end(T, seed=seed)
    info = _with_host(se)
    tables = fa4.fa4_tables(se, 0)
    cost_N = 2 * (tables[7][0, 0].float() + 1.5 * tables[5][0, 0].float()) + 1.0
    assert fa4.fa4_tail_share(info) == pytest.approx(float(cost_N.max() * 132 / cost_N.sum()), rel=1e-6)


@settings(max_examples=25, deadline=None)
@given(T=st.integers(1, 700), P=st.integers(0, 600), hidden=st.integers(0, 200), seed=st.integers(0, 2**16))
def test_tail_share_counts_a_prefix_and_its_hidden_rows(T, P, hidden, seed):
    """With cached rows (a dfs call), some hidden as a CUDA graph's prefix bucket hides them, the work per key
    block is still what FA4's backward lists hold for that call (fa4_tables with ``prefix_valid``)."""
    se = random_subtree_end(T, seed=seed)
    visible = max(P - hidden, 0)
    tables = fa4.fa4_tables(se, P, prefix_valid=torch.tensor([visible]) if P else None)
    cost_N = 2 * (tables[7][0, 0].float() + 1.5 * tables[5][0, 0].float()) + 1.0
    expect = float(cost_N.max() * 132 / cost_N.sum())
    assert fa4.tail_share(se.numpy(), P, prefix_visible=visible if P else None) == pytest.approx(expect, rel=1e-6)
    assert fa4.fa4_tail_share(_with_host(se), P, prefix_visible=visible if P else None) == pytest.approx(expect,
                                                                                                       rel=1e-6)


def _fake_fa4_schedulers(monkeypatch, *, lpt_field: bool = True):
    """``flash_attn.cute``'s tile_scheduler and flash_fwd_sm90 modules, as far as `fa4_order` reads them."""
    import dataclasses
    import sys
    import types

    schedulers = types.ModuleType("flash_attn.cute.tile_scheduler")

    @dataclasses.dataclass
    class TileSchedulerArguments:
        num_block: int
        lpt: bool = False

    if not lpt_field:
        TileSchedulerArguments = dataclasses.make_dataclass("TileSchedulerArguments", [("num_block", int)])

    class SingleTileScheduler:
        pass

    class SingleTileLPTScheduler:
        @staticmethod
        def to_underlying_arguments(args, **kwargs):
            return ("lpt params", args, kwargs)

    schedulers.TileSchedulerArguments = TileSchedulerArguments
    schedulers.SingleTileScheduler, schedulers.SingleTileLPTScheduler = SingleTileScheduler, SingleTileLPTScheduler
    forward = types.ModuleType("flash_attn.cute.flash_fwd_sm90")
    forward.SingleTileScheduler = SingleTileScheduler
    package = types.ModuleType("flash_attn.cute")
    package.tile_scheduler, package.flash_fwd_sm90 = schedulers, forward
    for name, module in (("flash_attn", types.ModuleType("flash_attn")), ("flash_attn.cute", package),
                         ("flash_attn.cute.tile_scheduler", schedulers), ("flash_attn.cute.flash_fwd_sm90", forward)):
        monkeypatch.setitem(sys.modules, name, module)
    return schedulers, forward


@pytest.fixture
def fresh_fa4_order():
    from treepack.kernels.tree_attention import fa4_order

    fa4_order.longest_first_unavailable.cache_clear()
    fa4_order._longest_first.cache_clear()
    yield fa4_order
    fa4_order.longest_first_unavailable.cache_clear()
    fa4_order._longest_first.cache_clear()


def test_the_tree_forward_is_built_longest_first_and_nothing_else_is(monkeypatch, fresh_fa4_order):
    """Inside `fa4_forward_order("lpt")` FA4's sm90 forward takes the LPT scheduler with ``lpt`` forced on;
    outside it, and with ``"fa4"``, its own plain scheduler."""
    schedulers, forward = _fake_fa4_schedulers(monkeypatch)
    plain = forward.SingleTileScheduler
    assert fresh_fa4_order.longest_first_unavailable() == ""
    with fresh_fa4_order.fa4_forward_order("lpt"):
        chosen = forward.SingleTileScheduler
        assert issubclass(chosen, schedulers.SingleTileLPTScheduler)
        tag, args, kwargs = chosen.to_underlying_arguments(schedulers.TileSchedulerArguments(7), loc=None)
        assert tag == "lpt params" and args.lpt is True and args.num_block == 7 and kwargs == {"loc": None}
    assert forward.SingleTileScheduler is plain
    with fresh_fa4_order.fa4_forward_order("fa4"):
        assert forward.SingleTileScheduler is plain


def test_a_flash_attn_without_the_lpt_field_keeps_its_order(monkeypatch, fresh_fa4_order):
    _, forward = _fake_fa4_schedulers(monkeypatch, lpt_field=False)
    plain = forward.SingleTileScheduler
    assert "no lpt field" in fresh_fa4_order.longest_first_unavailable()
    with fresh_fa4_order.fa4_forward_order("lpt"):
        assert forward.SingleTileScheduler is plain
