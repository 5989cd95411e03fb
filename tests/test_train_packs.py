"""`treepack.train.data.pack_rollouts`: the packs `treepack train` builds from rollout files.

Invariants against a naive reference (every sequence once, capacity, trees kept whole when they fit), and
the split of a tree larger than the capacity: by `treepack pack`'s ``best`` packer, never by input order."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import rollouts_from, sequence_lists

from treepack.pack.strategies import pack_sequences
from treepack.train.data import pack_rollouts
from treepack.tree import PrefixTree


def trie_tokens(seqs: list[list[int]]) -> int:
    """Naive union-trie size: distinct prefixes (0 for no sequences)."""
    return len({tuple(s[: j + 1]) for s in seqs for j in range(len(s))})


@settings(max_examples=40, deadline=None)
@given(seqs=sequence_lists(max_seqs=14, max_len=9, vocab=3), n_trees=st.integers(1, 3), slack=st.integers(0, 12),
       data=st.data())
def test_packs_hold_every_sequence_once_within_capacity(seqs, n_trees, slack, data):
    groups = [str(data.draw(st.integers(0, n_trees - 1))) for _ in seqs]
    r = rollouts_from(seqs, groups=groups)
    capacity = max(len(s) for s in seqs) + slack
    packs = list(pack_rollouts(r, capacity))
    seen = np.concatenate([p.seq_index for p in packs])
    assert sorted(seen.tolist()) == list(range(len(seqs)))
    for p in packs:
        members = p.seq_index.tolist()
        per_tree = sum(trie_tokens([seqs[i] for i in members if groups[i] == g]) for g in set(groups))
        assert p.n_real == per_tree <= capacity  # trees of one pack share no tokens
    for g in set(groups):  # a tree that fits stays in one pack; a larger one is cut as `best` cuts it
        mine = [i for i, x in enumerate(groups) if x == g]
        size = trie_tokens([seqs[i] for i in mine])
        holding = [p for p in packs if set(p.seq_index.tolist()) & set(mine)]
        if size <= capacity:
            assert len(holding) == 1
        else:
            best = pack_sequences(r.select(np.asarray(mine)), capacity, strategy="best")
            assert sum(p.n_real for p in holding) == best.n_pack_tokens
            firsts = [int(p.seq_index.min()) for p in holding]
            assert firsts == sorted(firsts)


def test_interleaved_chains_are_not_cut_mid_chain():
    """Two multi-turn chains whose turns alternate in the input: each pack holds one whole chain, so no
    turn is forwarded twice (cutting runs of input order repeated the earlier turns of both chains)."""
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 50, 40).tolist(), rng.integers(50, 100, 40).tolist()
    seqs, ids = [], []
    for turn in range(1, 5):
        seqs += [a[: 10 * turn], b[: 10 * turn]]
        ids += [f"a{turn}", f"b{turn}"]
    r = rollouts_from(seqs, ids=ids)
    packs = list(pack_rollouts(r, 45))
    assert [sorted(p.seq_ids) for p in packs] == [["a1", "a2", "a3", "a4"], ["b1", "b2", "b3", "b4"]]
    assert sum(p.n_real for p in packs) == PrefixTree.from_arrays(r.tokens, r.offsets).n_tree_tokens == 80
