"""`treepack.train.data.pack_rollouts`: the packs `treepack train` builds from rollout files.

Invariants against a naive reference (every sequence once, capacity, trees kept whole when they fit, trees of
a pack sharing their prefixes, steps sharing nothing, a new pack only when the next tree does not fit), the
union sizes the packer adds up, and the split of a tree larger than the capacity: by `treepack pack`'s
``best`` packer, never by input order."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import rollouts_from, sequence_lists

from treepack.pack.packs import UnionSize
from treepack.pack.strategies import pack_sequences
from treepack.train.data import pack_rollouts
from treepack.tree import PrefixTree


def trie_tokens(seqs: list[list[int]]) -> int:
    """Naive union-trie size: distinct prefixes (0 for no sequences)."""
    return len({tuple(s[: j + 1]) for s in seqs for j in range(len(s))})


def steps_of(r, steps):
    r.steps = np.asarray(steps, dtype=np.int64)
    return r


@settings(max_examples=60, deadline=None)
@given(seqs=sequence_lists(max_seqs=14, max_len=9, vocab=3), n_trees=st.integers(1, 3), n_steps=st.integers(1, 2),
       slack=st.integers(0, 12), data=st.data())
def test_packs_hold_every_sequence_once_within_capacity(seqs, n_trees, n_steps, slack, data):
    groups = [str(data.draw(st.integers(0, n_trees - 1))) for _ in seqs]
    steps = [data.draw(st.integers(0, n_steps - 1)) for _ in seqs]
    r = steps_of(rollouts_from(seqs, groups=groups), steps)
    capacity = max(len(s) for s in seqs) + slack
    packs = list(pack_rollouts(r, capacity))
    seen = np.concatenate([p.seq_index for p in packs])
    assert sorted(seen.tolist()) == list(range(len(seqs)))

    def union(members):  # trees of a pack share their prefixes, steps share nothing
        return sum(trie_tokens([seqs[i] for i in members if steps[i] == k]) for k in set(steps))

    for p in packs:
        assert p.n_real == union(p.seq_index.tolist()) <= capacity
    units = {(g, k) for g, k in zip(groups, steps)}
    whole = []  # per pack: the trees it holds whole, None for a pack of a cut tree
    for p in packs:
        keys = {(groups[i], steps[i]) for i in p.seq_index.tolist()}
        whole.append(keys if all(sum(1 for u in zip(groups, steps) if u == key) ==
                                 sum(1 for i in p.seq_index.tolist() if (groups[i], steps[i]) == key)
                                 for key in keys) else None)
    for g, k in units:  # a tree that fits stays in one pack; a larger one is cut as `best` cuts it
        mine = [i for i in range(len(seqs)) if (groups[i], steps[i]) == (g, k)]
        holding = [p for p in packs if set(p.seq_index.tolist()) & set(mine)]
        if union(mine) <= capacity:
            assert len(holding) == 1
        else:
            best = pack_sequences(r.select(np.asarray(mine)), capacity, strategy="best")
            assert sum(p.n_real for p in holding) == best.n_pack_tokens
            assert all(set(p.seq_index.tolist()) <= set(mine) for p in holding)
            firsts = [int(p.seq_index.min()) for p in holding]
            assert firsts == sorted(firsts)
    for a, b, p_a, p_b in zip(whole, whole[1:], packs, packs[1:]):  # greedy: the next tree did not fit
        if a is not None and b is not None:
            first = min(p_b.seq_index.tolist())
            key = (groups[first], steps[first])
            nxt = [i for i in range(len(seqs)) if (groups[i], steps[i]) == key]
            assert union(p_a.seq_index.tolist() + nxt) > capacity


@settings(max_examples=80, deadline=None)
@given(seqs=sequence_lists(max_seqs=16, max_len=9, vocab=3), n_steps=st.integers(1, 3), data=st.data())
def test_union_size_is_the_trie_of_any_subset(seqs, n_steps, data):
    steps = [data.draw(st.integers(0, n_steps - 1)) for _ in seqs]
    r = steps_of(rollouts_from(seqs), steps)
    union = UnionSize(r, np.asarray(steps, dtype=np.int64))
    subset = sorted(data.draw(st.sets(st.integers(0, len(seqs) - 1), min_size=1)))
    naive = sum(trie_tokens([seqs[i] for i in subset if steps[i] == k]) for k in set(steps))
    assert union(np.sort(union.rank[subset])) == naive


def test_trees_of_a_pack_share_their_system_prompt():
    """Three GRPO groups behind one system prompt: whole groups, the prompt once per pack, so the tree forwards
    fewer tokens than the leaves (summing the trees' sizes kept the prompt once per group)."""
    prompt = list(range(100, 140))
    seqs, groups = [], []
    for g in range(3):
        for k in range(2):
            seqs.append(prompt + [g, k, 7])
            groups.append(f"g{g}")
    r = rollouts_from(seqs, groups=groups)
    packs = list(pack_rollouts(r, 60))
    assert [sorted(set(np.asarray(groups)[p.seq_index])) for p in packs] == [["g0", "g1", "g2"]]
    assert packs[0].n_real == 40 + 3 * (1 + 2 * 2) == 55
    packs = list(pack_rollouts(r, 50))  # the third group no longer fits: a new pack, the prompt again
    assert [sorted(set(np.asarray(groups)[p.seq_index])) for p in packs] == [["g0", "g1"], ["g2"]]
    assert [p.n_real for p in packs] == [50, 45]


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
