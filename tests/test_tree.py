"""PrefixTree against the naive dict trie: every array, on random forests."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from oracle import NaiveTrie
from strategies import rollouts_from, sequence_lists
from treepack.tree import PrefixTree, adjacent_lcp, lexicographic_order


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
        x, y = seqs[i], seqs[j]
        k = 0
        while k < min(len(x), len(y)) and x[k] == y[k]:
            k += 1
        assert g == k


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
