"""DFS mode: the schedule's invariants, exact equality with dense (float64), and bounded memory.

Equivalence runs a tiny random Qwen3-layout model in float64 on the CPU: loss and every parameter
gradient of ``dfs`` must equal ``dense`` to 1e-9 relative on random trees with branch points, duplicates,
prefix-of-another sequences, loss masks, per-sequence advantages and suffixes longer than several blocks.
"""

from __future__ import annotations

import itertools
import json
import re

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import rollouts_from, sequence_lists

from treepack.errors import ConfigError
from treepack.pack.layout import build_pack
from treepack.train.config import DfsConfig, parse_config
from treepack.train.losses import BatchTotals, LossRows, Objective
from treepack.train.model import Decoder
from treepack.train.modes import LayoutError, make_mode
from treepack.train.modes.dfs import DfsMode, merge_work
from treepack.train.modes.dfs_schedule import leaf_order, plan, tree_nodes
from treepack.train.verify import tiny_model_args, verify_packs

TOL = 1e-9
VOCAB = 16


# --------------------------------------------------------------------------------------------------
# Inputs


def random_sequences(seed: int, n: int = 10, vocab: int = VOCAB, grow: int = 40) -> list[list[int]]:
    """Sequences that branch, repeat, cut each other short and grow private suffixes of up to ``grow``."""
    rng = np.random.default_rng(seed)
    trunk = rng.integers(0, vocab, min(24, grow)).tolist()
    seqs: list[list[int]] = []
    for _ in range(n):
        r = rng.random()
        if seqs and r < 0.15:
            seqs.append(list(seqs[rng.integers(len(seqs))]))  # duplicate
        elif seqs and r < 0.3:
            base = seqs[rng.integers(len(seqs))]
            seqs.append(base[: rng.integers(1, len(base) + 1)])  # prefix of another
        elif seqs and r < 0.7:
            base = seqs[rng.integers(len(seqs))]
            cut = int(rng.integers(0, len(base) + 1))
            seqs.append(base[:cut] + rng.integers(0, vocab, int(rng.integers(1, grow))).tolist())  # branch
        else:
            seqs.append(trunk[: rng.integers(1, len(trunk) + 1)] + rng.integers(0, vocab, int(rng.integers(1, grow))).tolist())
    return seqs


def make_pack(seqs, seed: int = 0, *, masked: bool = True, groups=None):
    rng = np.random.default_rng(seed + 1000)
    masks = [(rng.random(len(s)) < 0.7).astype(int).tolist() for s in seqs] if masked else None
    r = rollouts_from(seqs, masks=masks, groups=groups, advantages=rng.standard_normal(len(seqs)))
    return build_pack(r)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model() -> Decoder:
    return Decoder.random_init(tiny_model_args(VOCAB), seed=0, dtype=torch.float64)


def run(model, pack, name, objective, **options):
    rows = LossRows.from_pack(pack)
    totals = BatchTotals.of([rows])
    model.zero_grad(set_to_none=True)
    out = make_mode(name, **options)(model, pack, rows, objective, totals)
    out.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return out, grads


def assert_same(out, grads, ref_out, ref_grads):
    loss, ref_loss = out.loss.item(), ref_out.loss.item()
    assert abs(loss - ref_loss) <= TOL * abs(ref_loss)
    assert torch.allclose(out.logp_R, ref_out.logp_R, rtol=0, atol=1e-12)
    # A gradient that is exactly zero in exact arithmetic (q of a lone token) is round-off in dense: ~1e-16
    # absolute. Such parameters are held to the model's largest gradient instead of their own scale.
    floor = 1e-6 * max(g.abs().max().item() for g in ref_grads.values())
    for name, g in grads.items():
        scale = ref_grads[name].abs().max().item()
        assert (g - ref_grads[name]).abs().max().item() <= TOL * max(scale, floor), name


# --------------------------------------------------------------------------------------------------
# Schedule invariants (numpy only)


def ancestors(parent, t):
    out = []
    while t >= 0:
        out.append(t)
        t = parent[t]
    return out[::-1]


def check_schedule(parent_T, sched, block, keep):
    """Replay a schedule against a model of the path cache; every exactness condition of the module doc."""
    parent = parent_T.tolist()
    cache: dict[int, int] = {}  # depth -> token whose K/V the row holds
    readers: dict[int, int] = {}  # token -> last step that read its cached K/V
    done: dict[int, int] = {}  # token -> step that forwarded it with grad
    kept_open: dict[int, list[int]] = {}
    live = peak = 0
    if 0 < len(parent) <= (block or 10**9) and any(st.is_tree and not st.n_anchor for st in sched.steps):  # one call
        (step,) = sched.steps
        assert step.kind == "grad" and step.lo == 0 and not step.kv_grad
        assert step.tokens_C.tolist() == list(range(len(parent)))
        naive = [max(u for u in range(t, len(parent)) if t in ancestors(parent, u)) + 1 for t in range(len(parent))]
        assert step.subtree_end_C.tolist() == naive
        assert sched.peak_graph_tokens == sched.grad_tokens == len(parent) and sched.anchor_tokens == 0
        return
    for k, step in enumerate(sched.steps):
        toks = step.tokens_C.tolist()
        own, riding = toks[: step.n_own], toks[step.n_own :]  # riding: a merged anchor, after the call's own
        assert step.n_anchor == 0 or (step.kind == "grad" and step.is_tree)
        path = ancestors(parent, toks[0])
        assert len(path) - 1 == step.lo  # the segment starts at depth lo ...
        head = own[: step.path_rows]  # path rows [lo, lo + path_rows): a chain ...
        assert all(parent[b] == a for a, b in itertools.pairwise(head))
        if step.is_tree:  # ... then whole subtrees below it, with the call's own mask
            assert step.kind == "grad" and step.n <= (block or 10**9)
            below = own[step.path_rows :]
            top = head[-1] if head else parent[toks[0]]
            assert all(parent[t] in head or parent[t] in below or parent[t] == top for t in below)
            local = {t: i for i, t in enumerate(toks)}
            naive = [max(local[u] for u in toks if t in ancestors(parent, u)) + 1 for t in toks]
            assert step.subtree_end_C.tolist() == naive
            for t in below:  # every descendant of a subtree token is in the call
                assert all(u in local for u in range(t, len(parent)) if t in ancestors(parent, u))
        else:
            assert step.path_rows == step.n
        if riding:  # a chain at depth lo beside the call's own tokens: same cached ancestors, none of its own
            assert ancestors(parent, riding[0])[:-1] == path[:-1]
            assert all(parent[b] == a for a, b in itertools.pairwise(riding))
            assert not set(riding) & set(own)
        for d in range(step.lo):  # it reads exactly its ancestors' rows
            assert cache.get(d) == path[d], (k, d)
            readers[path[d]] = k
        if step.kind in ("anchor", "keep"):
            for d, t in enumerate(toks, step.lo):
                cache[d] = t
        if step.kind in ("grad", "keep"):
            assert step.n <= (block or 10**9)
            for t in own:
                assert t not in done, "forwarded with grad twice"
                done[t] = k
        if step.kind == "keep":
            kept_open[step.lo] = toks
            live += step.n
        if step.kind == "grad":
            peak = max(peak, live + step.n)
        if step.kind == "release":
            assert kept_open.pop(step.lo) == toks
            live -= step.n
        if step.kind in ("grad", "release"):
            for i, t in enumerate(own):  # popped after every reader of its row; rows nobody read need no dK/dV
                assert readers.get(t, -1) < k
                if not step.kv_grad or i >= step.path_rows:
                    assert t not in readers
        for d, t in enumerate(riding, step.lo):  # cached after the call, for the calls below it
            cache[d] = t
        peak = max(peak, live)
    assert not kept_open and live == 0
    assert sorted(done) == list(range(len(parent)))  # every token exactly once
    assert peak == sched.peak_graph_tokens <= (block or 10**9) + keep
    assert sched.grad_tokens == len(parent)


@pytest.mark.parametrize("subtree_calls", [True, False])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seqs=sequence_lists(max_seqs=10, max_len=14, vocab=3), block=st.sampled_from([0, 1, 2, 3, 7]),
       keep=st.sampled_from([0, 2, 5, 1000]), order=st.sampled_from(["backward", "layout"]),
       merge=st.sampled_from([0, 2, 1000]), pops=st.booleans())
def test_schedule_replays_exactly(seqs, block, keep, order, subtree_calls, merge, pops):
    pack = build_pack(rollouts_from(seqs))
    parent_T = np.asarray(pack.parent[: pack.n_real], dtype=np.int64)
    sched = plan(parent_T, block_size=block, keep_tokens=keep, order=order, subtree_calls=subtree_calls,
                 merge_anchor_tokens=merge, merge_pops=pops)
    check_schedule(parent_T, sched, block, keep)
    no_pops = plan(parent_T, block_size=block, keep_tokens=keep, order=order, subtree_calls=subtree_calls,
                   merge_anchor_tokens=merge, merge_pops=False)
    assert len(sched.steps) <= len(no_pops.steps) and sched.anchor_tokens == no_pops.anchor_tokens
    if not subtree_calls:  # AReaL-DTA's walk stays leaf by leaf
        assert len(sched.steps) == len(no_pops.steps)
    unmerged = plan(parent_T, block_size=block, keep_tokens=keep, order=order, subtree_calls=subtree_calls,
                    merge_anchor_tokens=0, merge_pops=pops)
    merged = [st for st in sched.steps if st.n_anchor]
    assert all(st.n_anchor <= merge for st in merged)
    # each merge removes exactly one call and moves no token: the same anchors, riding instead of alone
    assert len(sched.steps) + len(merged) == len(unmerged.steps)
    assert sched.anchor_tokens == unmerged.anchor_tokens and sched.grad_tokens == unmerged.grad_tokens
    assert sched.max_depth == int(pack.position_ids.max()) + 1
    assert sched.n_leaves == int(np.sum(np.bincount(parent_T[parent_T >= 0], minlength=pack.n_real) == 0))


def test_anchor_tokens_match_the_formula():
    """keep=0, leaf by leaf: anchors = tokens shared by >= 2 leaves + each leaf's own tokens beyond one block."""
    seqs = random_sequences(3, n=14)
    pack = build_pack(rollouts_from(seqs))
    parent_T = np.asarray(pack.parent[: pack.n_real], dtype=np.int64)
    n = pack.n_real
    leaf_T = np.bincount(parent_T[parent_T >= 0], minlength=n) == 0
    below = leaf_T.astype(int)
    for t in range(n - 1, 0, -1):
        if parent_T[t] >= 0:
            below[parent_T[t]] += below[t]
    leaf_of = np.where(leaf_T, np.arange(n), -1)
    for t in range(n - 1, 0, -1):  # a token with one leaf below has one child: inherit its leaf
        if parent_T[t] >= 0 and below[parent_T[t]] == 1:
            leaf_of[parent_T[t]] = leaf_of[t]
    tail = np.bincount(leaf_of[below == 1], minlength=n)  # each leaf's own tokens
    for block in (1, 4, 7, n - 1, n, 0):
        expected = int((below >= 2).sum()) + int(np.maximum(tail - (block or n), 0).sum())
        for order in ("backward", "layout"):  # AReaL-DTA's walk, leaf by leaf
            assert plan(parent_T, block_size=block, order=order, subtree_calls=False).anchor_tokens == expected
        if block == 0 or block >= n:  # with subtree calls the whole tree is one call: nothing is anchored
            assert plan(parent_T, block_size=block).anchor_tokens == 0


def test_backward_order_is_algorithm_1():
    """Reverse of the DFS whose children are sorted by (is internal, tail) ascending, tail = first leaf's depth."""
    # 0 -> 1 -> 2 (leaf, path of 3 tokens)
    #        -> 3 -> 4 -> 5 (leaf, 5 tokens)
    #             -> 6 (leaf, 4 tokens)
    #   -> 7 (leaf, 2 tokens)
    parent_T = np.array([-1, 0, 1, 1, 3, 4, 3, 0])
    nodes = tree_nodes(parent_T)
    leaves = [int(nodes.end_N[n]) - 1 for n in leaf_order(nodes, "backward")]
    # Ascending (leaf first, shorter tail first): at 3: 6 (tail 4), then 4-5 (tail 5), tail(3) = 4; at 1:
    # 2 (leaf, 3), then 3 (internal), tail(1) = 3; at 0: 7 (leaf, 2), then 1. DFS: 7, 2, 6, 5; reversed:
    assert leaves == [5, 6, 2, 7]
    assert [int(nodes.end_N[n]) - 1 for n in leaf_order(nodes, "layout")] == [2, 5, 6, 7]


def test_pruning_drops_tokens_without_loss_below():
    seqs = [[1, 2, 3, 4], [1, 2, 5, 6, 7]]
    masks = [[0, 0, 1, 1], [0, 0, 0, 0, 0]]  # the second sequence trains on nothing
    pack = build_pack(rollouts_from(seqs, masks=masks))
    rows = LossRows.from_pack(pack)
    mode = DfsMode(dfs=DfsConfig(block_size=2))
    out = mode(Decoder.random_init(tiny_model_args(8), dtype=torch.float64), pack, rows, Objective(),
               BatchTotals.of([rows]))
    # live: 1, 2 (parent of 3), 3 (parent of 4); pruned: 4 (a leaf's last token) and 5, 6, 7
    assert out.metrics["pruned_tokens"] == 4
    assert out.metrics["grad_tokens"] == 3


def test_plan_rejects_a_non_preorder_parent():
    with pytest.raises(ValueError, match="parent must precede"):
        plan(np.array([-1, 2, 0]))


# --------------------------------------------------------------------------------------------------
# Equivalence with dense (float64)


DFS_CONFIGS = [DfsConfig(block_size=b) for b in (7, 40, 2048, 0)] + [
    DfsConfig(block_size=7, keep_tokens=12),
    DfsConfig(block_size=5, keep_tokens=10**6, order="layout"),
    DfsConfig(block_size=7, subtree_calls=False),  # AReaL-DTA's walk, leaf by leaf
    DfsConfig(block_size=2048, subtree_calls=False),
]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("kind", ["sft", "grpo"])
@pytest.mark.parametrize("size", ["small", "large"])
def test_dfs_equals_dense(model, seed, kind, size):
    """Large trees (~250 tokens, suffixes of up to 40) over blocks 7, 2048, unlimited and kept graphs;
    small ones (~60 tokens) also with block 1, i.e. one model call per token."""
    seqs = random_sequences(seed, n=10, grow=40) if size == "large" else random_sequences(seed, n=5, grow=10)
    pack = make_pack(seqs, seed)
    objective = Objective(kind=kind, normalization="sequence" if seed % 2 else "token", clip_low=0.1, clip_high=0.1)
    ref = run(model, pack, "dense", objective)
    configs = DFS_CONFIGS if size == "large" else [DfsConfig(block_size=1), DfsConfig(block_size=1, keep_tokens=3)]
    for cfg in configs:
        out, grads = run(model, pack, "dfs", objective, dfs=cfg)
        assert_same(out, grads, *ref)
        assert out.backward_done and not out.loss.requires_grad
        w = out.metrics
        assert w["grad_tokens"] + w["pruned_tokens"] == pack.n_real == w["backward_tokens"] + w["pruned_tokens"]
        assert w["peak_graph_tokens"] <= (cfg.block or pack.n_real) + cfg.keep_tokens


# (seed, block): random_sequences(seed, n=8, grow=12) whose schedule merges anchors into grad calls
MERGING = [(2, 6), (7, 6), (14, 10), (14, 16), (16, 10)]
# (seed, block): ... whose schedule pops a path upward in fewer calls with `dfs_schedule._merge_pops`
POP_MERGING = [(6, 16), (13, 10), (20, 24), (36, 16), (47, 24)]


@pytest.mark.parametrize(("seed", "block"), MERGING)
@pytest.mark.parametrize("kind", ["sft", "grpo"])
def test_dfs_equals_dense_with_anchors_merged_into_grad_calls(model, seed, block, kind):
    """An anchor riding along in a grad call (`dfs_schedule._merge_anchor`) changes no loss and no gradient,
    saves one model call per merge and counts its tokens as anchored."""
    pack = make_pack(random_sequences(seed, n=8, grow=12), seed)
    rows = LossRows.from_pack(pack)
    merged = DfsMode(dfs=DfsConfig(block_size=block)).schedule(pack, rows)
    alone = DfsMode(dfs=DfsConfig(block_size=block, merge_anchor_tokens=0)).schedule(pack, rows)
    n_merged = sum(1 for st in merged.steps if st.n_anchor)
    assert n_merged > 0 and len(merged.steps) == len(alone.steps) - n_merged
    objective = Objective(kind=kind, normalization="sequence" if seed % 2 else "token", clip_low=0.1, clip_high=0.1)
    ref = run(model, pack, "dense", objective)
    for merge in (0, 10**6):
        out, grads = run(model, pack, "dfs", objective, dfs=DfsConfig(block_size=block, merge_anchor_tokens=merge))
        assert_same(out, grads, *ref)
        w = out.metrics
        assert w["model_calls"] == len((merged if merge else alone).steps) - (merged if merge else alone).count("release")
        assert w["anchor_tokens"] == alone.anchor_tokens
        assert w["grad_tokens"] + w["pruned_tokens"] == pack.n_real == w["backward_tokens"] + w["pruned_tokens"]
        assert w["peak_graph_tokens"] <= block


@pytest.mark.parametrize(("seed", "block"), POP_MERGING)
@pytest.mark.parametrize("kind", ["sft", "grpo"])
def test_dfs_equals_dense_with_pops_merged(model, seed, block, kind):
    """Consecutive pops of one path in one call (`dfs_schedule._merge_pops`): fewer calls, the same tokens
    forwarded and anchored, and the loss and gradients of dense."""
    pack = make_pack(random_sequences(seed, n=8, grow=12), seed)
    rows = LossRows.from_pack(pack)
    merged = DfsMode(dfs=DfsConfig(block_size=block)).schedule(pack, rows)
    apart = DfsMode(dfs=DfsConfig(block_size=block), merge_pops=False).schedule(pack, rows)
    assert len(merged.steps) < len(apart.steps)
    assert (merged.grad_tokens, merged.anchor_tokens) == (apart.grad_tokens, apart.anchor_tokens)
    objective = Objective(kind=kind, normalization="sequence" if seed % 2 else "token", clip_low=0.1, clip_high=0.1)
    ref = run(model, pack, "dense", objective)
    for pops in (False, True):
        out, grads = run(model, pack, "dfs", objective, dfs=DfsConfig(block_size=block), merge_pops=pops)
        assert_same(out, grads, *ref)
        assert out.metrics["model_calls"] == len((merged if pops else apart).steps)
        assert out.metrics["peak_graph_tokens"] <= block


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_multi_tensor_add_per_call_sums_the_same_bits(monkeypatch, dtype):
    """`_GradSum`: each call's gradients are set aside and added with one ``torch._foreach_add_`` instead of
    autograd's add per parameter. Same ``old + new`` per element, so the gradients are bit for bit those of
    autograd's own accumulation, also on top of gradients an earlier pack of the step left in ``.grad``."""
    from treepack.train.modes import dfs as dfs_mode

    net = Decoder.random_init(tiny_model_args(VOCAB), seed=1, dtype=dtype)
    packs = [make_pack(random_sequences(seed, n=8, grow=12), seed) for seed in (5, 6)]
    objective = Objective(kind="grpo", clip_low=0.1, clip_high=0.1)
    grads = {}
    for at_once in (False, True):
        monkeypatch.setattr(dfs_mode, "SUM_GRADS_AT_ONCE", at_once)
        net.zero_grad(set_to_none=True)
        calls = 0
        for pack in packs:
            rows = LossRows.from_pack(pack)
            out = make_mode("dfs", dfs=DfsConfig(block_size=12))(net, pack, rows, objective, BatchTotals.of([rows]))
            calls += out.metrics["model_calls"]
        assert calls > len(packs) + 2  # several calls per pack: the sums are exercised
        grads[at_once] = {n: p.grad.clone() for n, p in net.named_parameters()}
    for name, g in grads[True].items():
        assert torch.equal(g, grads[False][name]), name


def test_dfs_equals_dense_with_behaviour_logprobs_and_kl(model):
    import dataclasses

    pack = make_pack(random_sequences(11), 11)
    rng = np.random.default_rng(0)
    pack = dataclasses.replace(pack, seq_logprobs=rng.normal(-2.5, 0.3, pack.seq_token_index.shape[0]))
    objective = Objective(kind="grpo", clip_low=0.2, clip_high=0.28, kl_coef=0.05)
    ref = run(model, pack, "dense", objective)
    out, grads = run(model, pack, "dfs", objective, dfs=DfsConfig(block_size=3, keep_tokens=8))
    assert_same(out, grads, *ref)
    assert "clip_fraction" in out.metrics


def test_dfs_equals_dense_on_a_forest_and_a_single_token(model):
    seqs = [[1, 2, 3], [1, 2, 3], [4], [5, 6], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
    pack = make_pack(seqs, groups=["a", "a", "b", "c", "a"], masked=False)
    objective = Objective()
    ref = run(model, pack, "dense", objective)
    for block in (1, 2, 0):
        assert_same(*run(model, pack, "dfs", objective, dfs=DfsConfig(block_size=block)), *ref)



@pytest.mark.parametrize("kind", ["sft", "grpo"])
def test_dfs_on_a_pack_without_loss_rows(model, kind):
    """A pack that trains on nothing (masked out, or one-token sequences) in a batch whose other pack does:
    dfs prunes every token, runs no call, and the batch's gradients equal dense's."""
    idle = [rollouts_from([[1, 2, 3], [1, 2, 4]], masks=[[0, 0, 0], [0, 0, 0]], advantages=[1.0, -1.0]),
            rollouts_from([[5], [6], [5]], advantages=[1.0, 0.5, -1.0])]
    for r in idle:
        packs = [build_pack(r), make_pack(random_sequences(3), 3)]
        rows = [LossRows.from_pack(p) for p in packs]
        totals = BatchTotals.of(rows)
        objective = Objective(kind=kind)
        grads = {}
        for name, options in (("dense", {}), ("dfs", {}), ("dfs", {"dfs": DfsConfig(block_size=1, subtree_calls=False)})):
            model.zero_grad(set_to_none=True)
            losses = []
            for p, row in zip(packs, rows):
                out = make_mode(name, **options)(model, p, row, objective, totals)
                out.backward()
                losses.append(out.loss.item())
            assert losses[0] == 0.0
            grads[name, str(options)] = {n: q.grad.detach().clone() for n, q in model.named_parameters()}
        ref = grads["dense", "{}"]
        for key, g in grads.items():
            for n, v in g.items():
                assert (v - ref[n]).abs().max().item() <= TOL * max(ref[n].abs().max().item(), 1e-12), (key, n)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(seqs=sequence_lists(max_seqs=8, max_len=12, vocab=3), block=st.sampled_from([1, 3, 0]),
       keep=st.sampled_from([0, 4]), kind=st.sampled_from(["sft", "grpo"]))
def test_dfs_equals_dense_on_hypothesis_trees(model, seqs, block, keep, kind):
    pack = make_pack(seqs, len(seqs))
    if LossRows.from_pack(pack).n_rows == 0:
        rows = LossRows.from_pack(pack)
        out = make_mode("dfs", dfs=DfsConfig(block_size=block))(model, pack, rows, Objective(kind=kind), BatchTotals.of([rows]))
        assert out.loss.item() == 0.0 and out.logp_R.numel() == 0
        return
    objective = Objective(kind=kind)
    ref = run(model, pack, "dense", objective)
    assert_same(*run(model, pack, "dfs", objective, dfs=DfsConfig(block_size=block, keep_tokens=keep)), *ref)
    assert_same(*run(model, pack, "dfs", objective, dfs=DfsConfig(block_size=block, keep_tokens=keep,
                                                                  subtree_calls=False)), *ref)


def test_verify_runs_dfs_and_reports_its_work():
    packs = [make_pack(random_sequences(s), s) for s in (5, 6)]
    report = verify_packs(packs, modes=("dense", "tree", "dfs"), mode_options={"dfs": DfsConfig(block_size=4)})
    assert report.ok, report.failures
    assert report.modes["dfs"].max_rel_grad_diff <= TOL
    work = report.to_json()["modes"]["dfs"]["work"]
    assert work["grad_tokens"] + work["pruned_tokens"] == sum(p.n_real for p in packs)
    assert work["peak_graph_tokens"] <= 4 and work["anchor_tokens"] > 0


def test_verify_float32_within_twice_dense_error():
    report = verify_packs([make_pack(random_sequences(8), 8)], modes=("dense", "dfs"), dtype="float32",
                          mode_options={"dfs": DfsConfig(block_size=5)})
    assert report.ok, report.failures


def test_corrupted_parent_is_a_layout_error(model):
    import dataclasses

    pack = make_pack(random_sequences(1), 1)
    parent = np.asarray(pack.parent).copy()
    parent[5] = 7
    bad = dataclasses.replace(pack, parent=parent)
    rows = LossRows.from_pack(bad)
    with pytest.raises(LayoutError, match="parent must precede"):
        make_mode("dfs")(model, bad, rows, Objective(), BatchTotals.of([rows]))


# --------------------------------------------------------------------------------------------------
# Memory: live activations grow with the longest path, not with the tree


class SavedBytes:
    """Bytes of tensors autograd holds for backward, alive at once (a CPU memory probe)."""

    def __init__(self) -> None:
        self.live = self.peak = 0

    def __enter__(self):
        probe = self

        class Handle:
            def __init__(self, t):
                self.t, self.n = t, t.numel() * t.element_size()
                probe.live += self.n
                probe.peak = max(probe.peak, probe.live)

            def __del__(self):
                probe.live -= self.n

        self._hooks = torch.autograd.graph.saved_tensors_hooks(Handle, lambda h: h.t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


def comb(branches: int) -> list[list[int]]:
    """A 48-token trunk with ``branches`` 24-token branches: the longest path stays 72 tokens."""
    rng = np.random.default_rng(branches)
    trunk = rng.integers(0, VOCAB, 48).tolist()
    return [trunk + [b % VOCAB] + rng.integers(0, VOCAB, 23).tolist() for b in range(branches)]


def peak_saved(model, pack, name, **options) -> tuple[int, dict]:
    rows = LossRows.from_pack(pack)
    model.zero_grad(set_to_none=True)
    with SavedBytes() as probe:
        out = make_mode(name, **options)(model, pack, rows, Objective(), BatchTotals.of([rows]))
        out.backward()
    return probe.peak, out.metrics


def test_peak_memory_follows_the_longest_path_not_the_tree(model):
    small, large = make_pack(comb(2), masked=False), make_pack(comb(16), masked=False)
    assert large.n_real > 4 * small.n_real
    dfs_small, w_small = peak_saved(model, small, "dfs", dfs=DfsConfig(block_size=16))
    dfs_large, w_large = peak_saved(model, large, "dfs", dfs=DfsConfig(block_size=16))
    tree_small, _ = peak_saved(model, small, "tree")
    tree_large, _ = peak_saved(model, large, "tree")
    assert w_small["peak_graph_tokens"] == w_large["peak_graph_tokens"] == 16
    assert w_small["kv_rows"] == w_large["kv_rows"] == 71  # the leaves' last tokens predict nothing
    # Parameters saved by every linear layer are a constant floor; on top of it dfs stays flat.
    assert dfs_large <= 1.05 * dfs_small
    assert tree_large >= 2.5 * tree_small
    assert dfs_large < tree_large


# --------------------------------------------------------------------------------------------------
# Configuration and helpers


def test_config_accepts_dfs_and_checks_its_keys():
    base = '[data]\nshards = "p"\n[train]\nmode = "dfs"\n'
    dfs = base + "[train.dfs]\n"
    cfg = parse_config(dfs + "block_size = 0\nkeep_tokens = 4096\n")
    assert (cfg.train.mode, cfg.train.dfs.block, cfg.train.dfs.keep_tokens) == ("dfs", 0, 4096)
    assert parse_config(base).train.dfs == DfsConfig()  # the default block: sized from the GPU's memory
    assert DfsConfig().block == "auto"
    for text, block in (("8192", 8192), ('"8k"', 8000), ('"8K"', 8192), ('"auto"', "auto")):
        assert parse_config(dfs + f"block_size = {text}\n").train.dfs.block == block
    assert cfg.train.dfs.subtree_calls and not parse_config(dfs + "subtree_calls = false\n").train.dfs.subtree_calls
    assert not make_mode("dfs", dfs=DfsConfig(subtree_calls=False)).subtree_calls
    assert parse_config(dfs + "merge_anchor_tokens = 0\n").train.dfs.merge_anchor_tokens == 0
    assert make_mode("dfs", dfs=DfsConfig(merge_anchor_tokens=0)).merge_anchor_tokens == 0
    with pytest.raises(ConfigError, match="^config.toml: train.dfs.merge_anchor_tokens must be >= 0, got -1$"):
        parse_config(dfs + "merge_anchor_tokens = -1\n")
    for bad in ("-1", '"big"', '"1.5k2"', "true"):
        with pytest.raises(ConfigError, match="^config.toml: train.dfs.block_size must be "):
            parse_config(dfs + f"block_size = {bad}\n")
    with pytest.raises(ConfigError, match='^train.dfs.block_size must be a number of tokens such as 8192 or "8K", '
                                          "0 \\(unlimited\\) or \"auto\", got 'big'$"):
        make_mode("dfs", dfs=DfsConfig(block_size="big"))
    with pytest.raises(ConfigError, match="^config.toml: train.dfs.order must be one of backward, layout, got 'bfs'$"):
        parse_config(dfs + 'order = "bfs"\n')
    sdpa = ("train.attention = 'sdpa' runs independent causal sequences; train.mode = 'dfs' needs auto, reference, "
            "flex, triton or fa4")
    with pytest.raises(ConfigError) as err:
        parse_config(base + 'attention = "sdpa"\n')
    assert str(err.value) == f"config.toml: {sdpa}"
    with pytest.raises(ConfigError) as err:  # the same check, in the same words, from Python
        make_mode("dfs", attention="sdpa")
    assert str(err.value) == sdpa
    assert parse_config(base + "activation_memory_budget = 0.7\n").train.activation_memory_budget == 0.7
    for bad in ("0", "1.5"):
        with pytest.raises(ConfigError, match=r"train.activation_memory_budget must be in \(0, 1\], got"):
            parse_config(base + f"activation_memory_budget = {bad}\n")


@pytest.mark.parametrize("key", ["block_size", "keep_tokens", "order", "subtree_calls", "merge_anchor_tokens",
                                 "cuda_graphs"])
def test_flat_dfs_keys_are_refused_with_their_new_place(key):
    base = '[data]\nshards = "p"\n[train]\nmode = "dfs"\n'
    with pytest.raises(ConfigError) as err:
        parse_config(base + f"dfs_{key} = 1\n")
    assert str(err.value) == f"config.toml: train.dfs_{key} moved to [train.dfs] {key}"


def test_several_flat_dfs_keys_are_refused_in_one_line():
    with pytest.raises(ConfigError) as err:
        parse_config('[data]\nshards = "p"\n[train]\ndfs_block_size = 8\ndfs_order = "layout"\n')
    assert str(err.value) == ("config.toml: train.dfs_block_size moved to [train.dfs] block_size, "
                              "train.dfs_order moved to [train.dfs] order")


def test_merge_work_sums_counts_and_keeps_peaks():
    a = {"grad_tokens": 10, "anchor_tokens": 5, "peak_graph_tokens": 7, "kv_rows": 30, "clip_fraction": 0.1}
    b = {"grad_tokens": 20, "anchor_tokens": 0, "peak_graph_tokens": 9, "kv_rows": 12}
    total = merge_work(merge_work({}, a), b)
    assert total == {"grad_tokens": 30, "anchor_tokens": 5, "peak_graph_tokens": 9, "kv_rows": 30,
                     "anchor_share": 5 / 35}
    assert merge_work({}, {"clip_fraction": 0.2}) == {}


# --------------------------------------------------------------------------------------------------
# Command line: train and verify with mode dfs


def test_train_cli_dfs_follows_the_tree_trajectory(tmp_path):
    from cli_helpers import run as cli
    from test_train_cli import metrics, write_config

    assert cli("train", write_config(tmp_path, mode="tree", out="tree")).code == 0
    r = cli("train", write_config(tmp_path, mode="dfs", out="dfs", extra="[train.dfs]\nblock_size = 3\n"))
    assert r.code == 0, r.err
    first = next(line for line in r.out.splitlines() if line.startswith("step "))  # after the start banner
    assert re.fullmatch(r"step 00001 \| .* \| mem \d+\.\d GB \| anchor \d+% \| graph 3", first)
    tree, dfs = metrics(tmp_path / "tree"), metrics(tmp_path / "dfs")
    assert [m["loss"] for m in dfs] == pytest.approx([m["loss"] for m in tree], rel=1e-9)
    assert all(m["peak_graph_tokens"] <= 3 and m["anchor_tokens"] > 0 for m in dfs)
    assert all(m["grad_tokens"] + m["anchor_tokens"] == m["tokens"] for m in dfs)


def test_verify_cli_with_dfs(tmp_path):
    from cli_helpers import run as cli
    from test_train_cli import write_rollouts

    data = write_rollouts(tmp_path / "r.jsonl")
    r = cli("verify", data, "--capacity", "40", "--packs", "0", "--modes", "dense,tree,dfs", "--dfs-block-size", "2",
            "--loss", "grpo", "--json")
    assert r.code == 0, r.err
    out = json.loads(r.out)
    assert out["ok"] and out["max_rel_grad_diff"] <= TOL and set(out["losses"]) == {"dense", "tree", "dfs"}
    work = out["modes"]["dfs"]["work"]
    assert work["peak_graph_tokens"] == 2 and work["backward_tokens"] == work["grad_tokens"]
    r = cli("verify", data, "--capacity", "40", "--modes", "dense,dfs", "--dfs-block-size", "0")
    assert r.code == 0 and "OK: every mode matches dense" in r.out
    assert re.search(r"dfs: \d+ tokens forwarded with grad, \d+ without \(anchors, [\d.]+%\)", r.out)
    r = cli("verify", data, "--capacity", "40", "--modes", "dense,dfs", "--dfs-block-size", "-1")
    assert r.code == 2 and 'Invalid value for --dfs-block-size: must be >= 0 (0: unlimited) or "auto", got -1' in r.err
    for block in ("auto", "1k"):  # the forms [train.dfs] block_size takes
        r = cli("verify", data, "--capacity", "40", "--modes", "dense,dfs", "--dfs-block-size", block)
        assert r.code == 0 and "OK: every mode matches dense" in r.out, r.err
    r = cli("verify", data, "--capacity", "40", "--modes", "dense")  # nothing to compare: not an OK
    assert r.code == 2 and "name at least one mode to compare with the baseline (dense), got 'dense'" in r.err
