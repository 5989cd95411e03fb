"""`treepack.pack.pack_rollouts`, the one way from rollouts to laid-out packs: every policy holds each
sequence once within the capacity, equals what the packers decide, and is what `treepack.train` and
`treepack.hf` call."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import rollouts_from, sequence_lists

import treepack.hf
import treepack.pack
import treepack.train.data
from treepack.errors import CapacityError
from treepack.pack.layout import build_pack
from treepack.pack.packs import pack_rollouts
from treepack.pack.strategies import pack_sequences


def trie_tokens(seqs) -> int:
    """Naive union-trie size: distinct prefixes."""
    return len({tuple(s[: j + 1]) for s in seqs for j in range(len(s))})


FIELDS = ("input_ids", "position_ids", "parent", "subtree_end", "scale", "loss_weight", "seq_index",
          "seq_leaf")


def same_pack(a, b) -> bool:
    return all(np.array_equal(getattr(a, f), getattr(b, f)) for f in FIELDS)


def test_there_is_one_front_door():
    assert treepack.pack.pack_rollouts is pack_rollouts
    assert treepack.hf.pack_rollouts is pack_rollouts


@settings(max_examples=60, deadline=None)
@given(seqs=sequence_lists(max_seqs=14, max_len=9, vocab=3), n_trees=st.integers(1, 3),
       slack=st.integers(0, 10), whole=st.booleans(), data=st.data())
def test_every_policy_holds_each_sequence_once_within_the_capacity(seqs, n_trees, slack, whole, data):
    groups = [str(data.draw(st.integers(0, n_trees - 1))) for _ in seqs]
    r = rollouts_from(seqs, groups=groups)
    capacity = max(len(s) for s in seqs) + slack
    packs = pack_rollouts(r, capacity, whole_trees=whole)
    seen = np.concatenate([p.seq_index for p in packs])
    assert sorted(seen.tolist()) == list(range(len(seqs)))
    for p in packs:
        assert p.n_tokens == trie_tokens([seqs[i] for i in p.seq_index.tolist()]) <= capacity
    k = data.draw(st.integers(1, len(packs)))
    first = pack_rollouts(r, capacity, whole_trees=whole, max_packs=k)
    assert len(first) == k and all(same_pack(a, b) for a, b in zip(first, packs))


@settings(max_examples=30, deadline=None)
@given(seqs=sequence_lists(max_seqs=12, max_len=8, vocab=3), slack=st.integers(0, 8),
       strategy=st.sampled_from(["best", "first-fit", "dfs"]))
def test_a_capacity_lays_out_the_strategys_packs(seqs, slack, strategy):
    r = rollouts_from(seqs)
    capacity = max(len(s) for s in seqs) + slack
    want = [build_pack(r, index) for index in pack_sequences(r, capacity, strategy=strategy).packs]
    got = pack_rollouts(r, capacity, strategy=strategy)
    assert len(got) == len(want) and all(same_pack(a, b) for a, b in zip(got, want))


def test_whole_trees_is_what_train_packs_rollout_files_with():
    seqs = [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6], [7, 8, 9], [7, 8, 1, 2]]
    r = rollouts_from(seqs, groups=["a", "a", "b", "c", "c"])
    got = list(treepack.train.data.pack_rollouts(r, 8))
    want = pack_rollouts(r, 8, whole_trees=True)
    order = [[0, 1, 2], [4, 3]]  # trees a and b share [1, 2]; c does not fit beside them; DFS leaf order
    assert [p.seq_index.tolist() for p in got] == [p.seq_index.tolist() for p in want] == order


def test_no_capacity_is_one_pack_and_no_sequences_no_pack():
    r = rollouts_from([[1, 2, 3], [1, 2, 4], [5]])
    (pack,) = pack_rollouts(r, None)
    assert same_pack(pack, build_pack(r))
    assert pack_rollouts(r.select(np.zeros(0, np.int64)), 4) == []


def test_a_size_reads_as_the_cli_reads_it():
    r = rollouts_from([[1] * 1000, [1] * 999 + [2], [3] * 24])
    packs = [[p.seq_index.tolist() for p in pack_rollouts(r, capacity)] for capacity in ("1k", 1000)]
    assert packs[0] == packs[1] == [[0], [1], [2]]


def test_a_sequence_over_the_capacity_is_named_with_what_to_change():
    r = rollouts_from([[1, 2, 3], [1, 2, 3, 4, 5]], ids=["short", "long"])
    with pytest.raises(CapacityError) as err:
        pack_rollouts(r, 4)
    assert str(err.value) == ("sequence 'long' has 5 tokens > capacity 4; raise capacity, or pass "
                              "capacity=None to forward every sequence in one pack")
    with pytest.raises(CapacityError) as err:
        pack_rollouts(r, 4, whole_trees=True)
    assert str(err.value) == "sequence 'long' has 5 tokens, more than the capacity 4"
