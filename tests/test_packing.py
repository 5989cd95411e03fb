"""Packing strategies: validity on random trees, exactness against brute force and AReaL's own algorithm,
``best`` never worse than any other strategy, and ERR on the real rollouts."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracle import areal_first_fit, brute_force_packing, trie_tokens
from strategies import rollouts_from, sequence_lists

from treepack.errors import CapacityError, TreepackError
from treepack.io.ingest import read_rollouts
from treepack.io.rollouts import Source
from treepack.pack import strategies as packing
from treepack.pack.strategies import STRATEGIES, Packing, pack_sequences
from treepack.tree import PrefixTree

# the real rollouts (tau-bench, ToolBench, GSM8K, hh-rlhf) next to the repository, and the bundled tau-bench slice
REAL = sorted((Path(__file__).resolve().parents[2] / "shared" / "data" / "rollouts").glob("*.parquet")) + sorted(
    (Path(__file__).resolve().parents[1] / "treepack" / "datasets" / "samples").glob("*.parquet"))
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _check_valid(r, p: Packing, capacity: int, scopes=None, steps=None) -> None:
    """Every sequence exactly once, every pack within capacity, pack_tokens = an independent trie count."""
    seqs = [r.sequence(i).tolist() for i in range(len(r))]
    members = np.concatenate(p.packs) if p.packs else np.zeros(0, np.int64)
    assert sorted(members.tolist()) == sorted(set(range(len(r))) - set(p.oversize_skipped.tolist()))
    for pk, tokens in zip(p.packs, p.pack_tokens.tolist()):
        idx = pk.tolist()
        sc = None if scopes is None else [scopes[i] for i in idx]
        assert tokens == trie_tokens([seqs[i] for i in idx], sc)
        assert tokens <= capacity
        if steps is not None:
            assert len({steps[i] for i in idx}) == 1, "a pack crosses a step"
    assert p.n_pack_tokens == int(p.pack_tokens.sum())
    assert p.err == pytest.approx(1 - p.n_pack_tokens / p.n_flat_tokens)


@st.composite
def packing_inputs(draw, max_seqs=12):
    seqs = draw(sequence_lists(max_seqs=max_seqs, max_len=9, vocab=3))
    longest = max(map(len, seqs))
    total = trie_tokens(seqs)
    capacity = draw(st.integers(longest, max(longest, total)))
    return seqs, capacity


@FAST
@given(packing_inputs(), st.sampled_from(["first-fit", "dfs", "best", "optimal"]))
def test_every_strategy_is_valid(inp, strategy):
    seqs, capacity = inp
    r = rollouts_from(seqs)
    p = pack_sequences(r, capacity, strategy=strategy)
    _check_valid(r, p, capacity)
    assert p.n_pack_tokens >= p.n_tree_tokens == trie_tokens(seqs)


@FAST
@given(packing_inputs(max_seqs=10), st.data())
def test_steps_and_scopes_are_respected(inp, data):
    seqs, capacity = inp
    n = len(seqs)
    steps = data.draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))
    groups = data.draw(st.lists(st.sampled_from(["a", "b"]), min_size=n, max_size=n))
    r = rollouts_from(seqs, groups=groups)
    r.steps = np.asarray(steps, dtype=np.int64)
    scopes = [(s, g) for s, g in zip(steps, groups)]
    for strategy in ("first-fit", "dfs", "best", "optimal"):
        p = pack_sequences(r, capacity, strategy=strategy, group_by="tree_id")
        _check_valid(r, p, capacity, scopes=scopes, steps=steps)
        assert p.pack_steps.tolist() == [steps[int(pk[0])] for pk in p.packs]


@settings(max_examples=120, deadline=None)
@given(packing_inputs(max_seqs=6), st.data())
def test_optimal_equals_brute_force(inp, data):
    seqs, capacity = inp
    steps = data.draw(st.lists(st.integers(0, 1), min_size=len(seqs), max_size=len(seqs)))
    r = rollouts_from(seqs)
    r.steps = np.asarray(steps, dtype=np.int64)
    p = pack_sequences(r, capacity, strategy="optimal")
    _check_valid(r, p, capacity, steps=steps)
    assert p.n_pack_tokens == brute_force_packing(seqs, capacity, batches=steps)


@FAST
@given(packing_inputs(max_seqs=14))
def test_best_never_loses(inp):
    seqs, capacity = inp
    r = rollouts_from(seqs)
    best = pack_sequences(r, capacity)
    others = {s: pack_sequences(r, capacity, strategy=s).n_pack_tokens for s in ("first-fit", "dfs", "optimal")}
    assert best.n_pack_tokens <= min(others.values()), others
    if len(seqs) <= 8:  # `best` runs the exact DP itself where it is cheap
        assert best.n_pack_tokens == others["optimal"]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=7), min_size=1, max_size=25), st.data())
def test_first_fit_is_areal_pack_for_pack(seqs, data):
    capacity = data.draw(st.integers(max(map(len, seqs)), max(map(len, seqs)) * 4))
    p = pack_sequences(rollouts_from(seqs), capacity, strategy="first-fit")
    got = [sorted(pk.tolist()) for pk in p.packs]
    assert got == [sorted(pk) for pk in areal_first_fit(seqs, capacity)]


def _forest(seqs, capacity):
    r = rollouts_from(seqs)
    tree = PrefixTree.build(r)
    return packing.Forest(tree, np.zeros(len(seqs), np.int64), capacity), tree


@settings(max_examples=100, deadline=None)
@given(packing_inputs(max_seqs=8), st.randoms(use_true_random=False))
def test_contiguous_cut_is_optimal_for_its_order(inp, rnd):
    seqs, capacity = inp
    f, tree = _forest(seqs, capacity)
    key = np.asarray([rnd.random() for _ in range(tree.n_nodes)])
    perm = f.dfs_order(key)
    assert sorted(perm.tolist()) == list(range(len(seqs)))
    labels = packing.contiguous_cut(f, perm)
    _, tokens, _ = f.packs_of(labels)
    order_seqs = [seqs[int(tree.order[i])] for i in perm.tolist()]
    best = None
    n = len(perm)
    for mask in range(1 << (n - 1)):  # every set of cut points
        cuts = [0] + [k + 1 for k in range(n - 1) if mask >> k & 1] + [n]
        costs = [trie_tokens(order_seqs[a:b]) for a, b in itertools.pairwise(cuts)]
        if max(costs) <= capacity and (best is None or sum(costs) < best):
            best = sum(costs)
    assert int(tokens.sum()) == best


@settings(max_examples=80, deadline=None)
@given(packing_inputs(max_seqs=10), st.randoms(use_true_random=False))
def test_dfs_orders_keep_subtrees_contiguous(inp, rnd):
    seqs, capacity = inp
    f, tree = _forest(seqs, capacity)
    perm = f.dfs_order(np.asarray([rnd.random() for _ in range(tree.n_nodes)]))
    order_seqs = [tuple(seqs[int(tree.order[i])]) for i in perm.tolist()]
    # every prefix's sequences form one run (a subtree is contiguous)
    for s in set(order_seqs):
        for k in range(1, len(s) + 1):
            hits = [j for j, t in enumerate(order_seqs) if t[:k] == s[:k]]
            assert hits == list(range(hits[0], hits[-1] + 1))


def test_oversize_error_names_the_sequence():
    r = rollouts_from([[1, 2, 3], [1, 2, 3, 4, 5, 6]], ids=["a", "x"])
    r.sources = [Source(path="rollouts.jsonl", sha256="0", n_records=2)]
    with pytest.raises(CapacityError) as exc:
        pack_sequences(r, 5)
    assert str(exc.value) == ("rollouts.jsonl: sequence id 'x' (record 1) has 6 tokens > capacity 5; "
                              "use --oversize skip to drop such sequences")
    p = pack_sequences(r, 5, oversize="skip")
    assert p.n_oversize_skipped == 1 and p.oversize_skipped.tolist() == [1]
    assert [pk.tolist() for pk in p.packs] == [[0]] and p.n_flat_tokens == 3


def test_bad_arguments():
    r = rollouts_from([[1, 2]])
    with pytest.raises(TreepackError, match="unknown packing strategy 'nope'"):
        pack_sequences(r, 4, strategy="nope")
    with pytest.raises(TreepackError, match="capacity must be positive"):
        pack_sequences(r, 0)
    with pytest.raises(TreepackError, match="oversize must be"):
        pack_sequences(r, 4, oversize="drop")


def test_optimal_refuses_big_steps():
    seqs = [[i % 3, i % 5, i] for i in range(packing.OPTIMAL_MAX_SEQUENCES + 1)]
    with pytest.raises(TreepackError, match=r"limited to 20 sequences per step; this input has 21 sequences in one step \(no 'step' field"):
        pack_sequences(rollouts_from(seqs), 10, strategy="optimal")


def test_tiny_known_case():
    # shared prefix [1, 2, 3] of length 3; four leaves of 2 tokens each: capacity 7 fits prefix + 2 leaves
    seqs = [[1, 2, 3, 4, 4], [1, 2, 3, 5, 5], [1, 2, 3, 6, 6], [1, 2, 3, 7, 7]]
    for strategy in STRATEGIES:
        p = pack_sequences(rollouts_from(seqs), 7, strategy=strategy)
        assert (p.n_packs, p.n_pack_tokens) == (2, 14), strategy
    assert pack_sequences(rollouts_from(seqs), 7).err == pytest.approx(1 - 14 / 20)


@pytest.mark.parametrize("path", REAL, ids=lambda p: Path(p).stem)
def test_real_rollouts_best_beats_areal_first_fit(path):
    r = read_rollouts(path)
    rng = np.random.default_rng(0)
    shuffled = r.select(rng.permutation(len(r)))
    for capacity in (8000, 16000):
        for data in (r, shuffled):
            tree = PrefixTree.build(data)
            best = pack_sequences(data, capacity, oversize="skip", tree=tree)
            ff = pack_sequences(data, capacity, strategy="first-fit", oversize="skip", tree=tree)
            _check_valid_fast(best, capacity)
            assert best.err >= ff.err
            assert best.err > ff.err or ff.n_pack_tokens == ff.n_tree_tokens  # strictly, unless FF is ideal
            assert best.err <= best.por


def _check_valid_fast(p: Packing, capacity: int) -> None:
    assert int(p.pack_tokens.max()) <= capacity
    members = np.concatenate(p.packs)
    assert len(np.unique(members)) == len(members)
