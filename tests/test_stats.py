"""The design §4 numbers against a naive dict trie, on random rollouts and on every real rollout file."""

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import naive_stats
from strategies import rollouts_from, sequence_lists

from treepack.io.ingest import read_rollouts
from treepack.stats import MODEL_SHAPES, Gate, compute_stats
from treepack.tree import PrefixTree

REAL = Path(__file__).resolve().parents[2] / "shared" / "data" / "rollouts"
KEYS = ("n_sequences", "n_flat_tokens", "n_tree_tokens", "n_leaves", "max_depth")
RATIOS = ("compression", "por", "c_leaf", "c_attn")


def assert_matches(st_, ref):
    d = st_.to_dict()
    for k in KEYS:
        assert d[k] == ref[k], k
    for k in RATIOS:
        assert d[k] == pytest.approx(ref[k], rel=1e-12), k


@settings(max_examples=200, deadline=None)
@given(seqs=sequence_lists(max_seqs=15, max_len=10, vocab=3), data=st.data())
def test_stats_equal_naive(seqs, data):
    groups = data.draw(st.none() | st.lists(st.sampled_from(["a", "b"]), min_size=len(seqs), max_size=len(seqs)))
    r = rollouts_from(seqs, groups=groups)
    tree = PrefixTree.build(r, group_by="tree_id" if groups else None)
    scopes = None if groups is None else groups
    assert_matches(compute_stats(tree), naive_stats(seqs, scopes))


def test_duplicate_and_prefix_counts():
    r = rollouts_from([[1, 2, 3], [1, 2, 3], [1, 2], [1, 2, 4], [5]])
    st_ = compute_stats(PrefixTree.build(r))
    assert st_.n_duplicates == 1
    assert st_.n_prefix_of_another == 1  # [1, 2]
    assert st_.n_leaves == 3
    assert st_.branching == {2: 1}
    assert st_.n_trees == 2


def test_flop_speedup_between_one_and_c():
    r = rollouts_from([[1] * 100 + [2], [1] * 100 + [3]])
    st_ = compute_stats(PrefixTree.build(r))
    assert 1.0 < st_.flop_speedup <= st_.compression + 1e-12
    m = MODEL_SHAPES["qwen3-0.6b"]
    assert m.non_embedding_params == pytest.approx(0.44e9, rel=0.05)  # Qwen3-0.6B: 0.44B non-embedding


def naive_predicted(seqs, masks, scopes) -> tuple[int, int]:
    """Head rows: targets (position >= 1, loss mask 1) per sequence, and distinct (scope, prefix) target nodes."""
    flat = sum(sum(m[1:]) for m in masks)
    nodes = {(scope, tuple(s[: j + 1])) for s, m, scope in zip(seqs, masks, scopes) for j in range(1, len(s)) if m[j]}
    return flat, len(nodes)


@settings(max_examples=200, deadline=None)
@given(seqs=sequence_lists(max_seqs=15, max_len=10, vocab=3), data=st.data())
def test_the_flop_models_head_rows_are_the_loss_targets(seqs, data):
    """design §9 prices the head by predicted tokens, not all tokens: with a loss mask that is a function of the
    prefix (sequences sharing a token agree on it), the tree's rows are the distinct target nodes exactly."""
    from treepack.stats import predicted_tokens

    groups = data.draw(st.none() | st.lists(st.sampled_from(["a", "b"]), min_size=len(seqs), max_size=len(seqs)))
    masks = [[hash((tuple(s[: j + 1]), 7)) % 2 for j in range(len(s))] for s in seqs]
    scopes = groups or [None] * len(seqs)
    for with_mask in (True, False):
        r = rollouts_from(seqs, masks=masks if with_mask else None, groups=groups)
        tree = PrefixTree.build(r, group_by="tree_id" if groups else None)
        ref = naive_predicted(seqs, masks if with_mask else [[1] * len(s) for s in seqs], scopes)
        assert predicted_tokens(tree, r) == ref
    st_ = compute_stats(tree, rollouts=r)
    m = MODEL_SHAPES[st_.model]
    pairs_flat, pairs_tree = st_.attention_pairs_flat, st_.attention_pairs_tree
    assert st_.flop_speedup == pytest.approx(m.flops(st_.n_flat_tokens, ref[0], pairs_flat)
                                             / m.flops(st_.n_tree_tokens, ref[1], pairs_tree), rel=1e-12)


def test_gate_names_every_failure():
    r = rollouts_from([[1, 2, 3], [4, 5]])
    st_ = compute_stats(PrefixTree.build(r))
    failures = Gate(min_compression=2, min_por=0.5, max_seq_len=2).check(st_)
    assert failures == [
        "compression 1.0000 < --min-compression 2",
        "por 0.0000 < --min-por 0.5",
        "max sequence length 3 > --max-seq-len 2",
    ]
    assert Gate(min_compression=1, min_por=0, max_seq_len=3).check(st_) == []


@pytest.mark.parametrize("name", ["tau_bench_grok3_retail", "toolbench_dfs", "gsm8k_model_solutions", "hh_rlhf_harmless_test"])
@pytest.mark.parametrize("group_by", [None, "tree_id"])
def test_real_rollouts_equal_naive(name, group_by):
    path = REAL / f"{name}.parquet"
    if not path.exists():
        pytest.skip(f"{path} not available")
    r = read_rollouts(path)
    seqs = [r.sequence(i).tolist() for i in range(len(r))]
    scopes = None if group_by is None else [r.group_names[g] for g in r.groups.tolist()]
    assert_matches(compute_stats(PrefixTree.build(r, group_by=group_by)), naive_stats(seqs, scopes))
