"""PrefixTree against the naive dict trie: every array, on random forests."""

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracle import NaiveTrie
from strategies import rollouts_from, sequence_lists

import treepack.tree as tree_module
from treepack.tree import PrefixTree, adjacent_lcp, lexicographic_order, sorted_with_lcp


def build(seqs, scopes=None):
    r = rollouts_from(seqs)
    return PrefixTree.from_arrays(r.tokens, r.offsets, None if scopes is None else np.asarray(scopes))


@settings(max_examples=300, deadline=None)
@given(seqs=sequence_lists(), data=st.data())
def test_tree_arrays_equal_naive_trie(seqs, data):
    scopes = data.draw(st.none() | st.lists(st.integers(0, 2), min_size=len(seqs), max_size=len(seqs)))
    tree = build(seqs, scopes)
    naive = NaiveTrie(seqs, scopes)
    assert tree.n_tree_tokens == naive.n_tree
    assert tree.token_ids().tolist() == naive.ids
    assert tree.token_depth().tolist() == naive.depth
    assert tree.token_parent().tolist() == naive.parent
    assert tree.token_subtree_end().tolist() == naive.subtree_end
    assert tree.token_count().tolist() == naive.count()
    assert tree.n_nodes == naive.n_nodes()
    assert int(tree.is_leaf_seq.sum()) == len(naive.leaves())
    offsets, index = tree.paths()
    for i in range(len(seqs)):
        assert index[offsets[i] : offsets[i + 1]].tolist() == naive.paths[tree.order[i]]


@settings(max_examples=200, deadline=None)
@given(seqs=sequence_lists(max_seqs=10, max_len=40, vocab=2))
def test_adjacent_lcp_matches_python(seqs):
    r = rollouts_from(seqs)
    order = lexicographic_order(r.tokens, r.offsets)
    a, b = order[:-1], order[1:]
    cap = np.minimum(r.lengths[a], r.lengths[b])
    got = adjacent_lcp(r.tokens, r.offsets[a], r.offsets[b], cap)
    for (i, j), g in zip(zip(a, b), got):
        assert g == python_lcp(seqs[i], seqs[j])


def python_lcp(x, y):
    k = 0
    while k < min(len(x), len(y)) and x[k] == y[k]:
        k += 1
    return k


def check_sorted_with_lcp(seqs, scopes=None):
    """order and lcp against Python's stable sort of (scope, token list) and a token-by-token LCP."""
    r = rollouts_from(seqs)
    order, lcp = sorted_with_lcp(r.tokens, r.offsets, None if scopes is None else np.asarray(scopes))
    sc = scopes if scopes is not None else [0] * len(seqs)
    assert order.tolist() == sorted(range(len(seqs)), key=lambda i: (sc[i], seqs[i]))
    want = [0] + [python_lcp(seqs[i], seqs[j]) if sc[i] == sc[j] else 0 for i, j in itertools.pairwise(order)]
    assert lcp.tolist() == want[: len(seqs)]


@pytest.mark.parametrize("packed_key_limit", [2**62, 0])  # 0: the unpacked (group, class) sort keys
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seqs=sequence_lists(max_seqs=16, max_len=12, vocab=3), data=st.data())
def test_sorted_with_lcp_matches_python_sorted(monkeypatch, packed_key_limit, seqs, data):
    monkeypatch.setattr(tree_module, "_PACKED_KEY_LIMIT", packed_key_limit)
    # scope codes past 255 and 65535: their order is numeric, not that of their bytes
    scopes = data.draw(st.none() | st.lists(st.sampled_from([0, 1, 255, 256, 70000]), min_size=len(seqs), max_size=len(seqs)))
    check_sorted_with_lcp(seqs, scopes)


@pytest.mark.parametrize("window_max, chunk", [(1 << 16, 1 << 21), (32, 64)])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])  # same patch for all
@given(data=st.data())
def test_sorted_with_lcp_long_shared_prefixes(monkeypatch, window_max, chunk, data):
    """Prefixes of thousands of tokens: galloping windows, their cap, chunking and the buffer's end."""
    monkeypatch.setattr(tree_module, "_WINDOW_MAX", window_max)
    monkeypatch.setattr(tree_module, "_LCP_CHUNK", chunk)
    seed = data.draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 3, 3000).tolist()
    seqs = []
    for _ in range(data.draw(st.integers(2, 12))):
        cut = int(rng.integers(0, len(base) + 1))
        tail = rng.integers(0, 3, int(rng.integers(0 if cut else 1, 40))).tolist()
        seqs.append(base[:cut] + tail)
    seqs.append(list(base))  # the longest (a pivot) last in the buffer: its windows reach the end
    seqs = [s for s in seqs if s] or [[0]]
    check_sorted_with_lcp(seqs)


def test_order_is_lexicographic_with_prefix_first():
    seqs = [[3, 1], [1, 2, 3], [1, 2], [1, 2], [0]]
    r = rollouts_from(seqs)
    order = lexicographic_order(r.tokens, r.offsets).tolist()
    assert [seqs[i] for i in order] == sorted(seqs)


def test_long_shared_prefix_gallops_past_window():
    base = list(range(5000))
    seqs = [base + [1], base + [2], base[:4000], base]
    tree = build(seqs)
    assert tree.n_tree_tokens == 5002
    assert tree.n_nodes == 4  # [0,4000), [4000,5000), and the two one-token leaves
    assert int(tree.is_leaf_seq.sum()) == 2


def test_duplicates_end_at_the_same_node():
    tree = build([[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    assert tree.n_tree_tokens == 3
    assert tree.n_nodes == 1
    assert tree.seq_end_token.tolist() == [2, 2, 2]
    assert tree.node_count.tolist() == [3]


def test_scopes_never_share():
    tree = build([[1, 2], [1, 2]], scopes=[0, 1])
    assert tree.n_tree_tokens == 4
    assert (tree.node_parent == -1).sum() == 2


def test_single_token_sequences():
    tree = build([[7], [7], [8]])
    assert tree.n_tree_tokens == 2
    assert tree.token_subtree_end().tolist() == [1, 2]
