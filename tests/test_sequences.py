"""In-memory batches (`treepack.io.sequences`): built from lists, arrays and tensors as the file readers build
theirs, and refused with one line naming the field where the later stages cannot take them; the library's entry
points (`PrefixTree`, `pack_sequences`, `build_pack`, `write_shards`, `compute_stats`, `tree_attention`) guarded."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treepack.errors import CapacityError, InputError, TreepackError
from treepack.io.rollouts import Rollouts
from treepack.io.sequences import check_rollouts, rollouts_from_sequences
from treepack.pack.layout import build_pack
from treepack.pack.shard_reader import read_manifest
from treepack.pack.shards import write_shards
from treepack.pack.strategies import pack_sequences
from treepack.stats import compute_stats
from treepack.tree import PrefixTree

sequences = st.lists(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=12), min_size=0, max_size=8)


@given(seqs=sequences)
@settings(max_examples=100, deadline=None)
def test_lists_arrays_and_tensors_give_the_same_batch(seqs):
    want = rollouts_from_sequences(seqs)
    assert want.tokens.dtype == np.int32 and want.tokens.tolist() == [t for s in seqs for t in s]
    assert want.offsets.tolist() == np.cumsum([0] + [len(s) for s in seqs]).tolist()
    assert want.ids == list(range(len(seqs)))
    for form in ([np.asarray(s, np.int64) for s in seqs], [torch.tensor(s, dtype=torch.int64) for s in seqs]):
        got = rollouts_from_sequences(form)
        assert np.array_equal(got.tokens, want.tokens) and np.array_equal(got.offsets, want.offsets)
    check_rollouts(want)


@pytest.mark.parametrize("seqs,message", [
    ([[1, 2**31], [1, 0]], "sequence 0: token id 2147483648 is outside [0, 2147483647]"),
    ([[1, 2], [1, -5]], "sequence 1: token id -5 is outside [0, 2147483647]"),
    ([[1, 2], []], "sequence 1 is empty (a sequence needs at least one token)"),
    ([[1.0, 2.0]], "sequence 0: token ids must be integers, got float64"),
    ([[[1, 2]]], "sequence 0: expected a 1-d list of token ids, got shape [1, 2]"),
    ([np.array([1, 2**63 + 5], np.uint64)], "sequence 0: token id 9223372036854775813 is outside [0, 2147483647]"),
])
def test_bad_sequences_are_refused_by_name(seqs, message):
    with pytest.raises(InputError) as info:
        rollouts_from_sequences(seqs)
    assert str(info.value) == message


@pytest.mark.parametrize("fields,message", [
    ({"loss_masks": [[1, 1]]}, "loss_masks: 1 entries for 2 sequences"),
    ({"loss_masks": [[1, 1], [1]]}, "loss_masks: sequence 1 has 1 values for 2 tokens"),
    ({"rewards": [1.0]}, "rewards: expected one value per sequence (2), got shape [1]"),
    ({"ids": ["a"]}, "ids: 1 entries for 2 sequences"),
    ({"groups": [[1], [2]]}, "groups: labels must be strings or numbers (unhashable type: 'list')"),
])
def test_bad_fields_are_refused_by_name(fields, message):
    with pytest.raises(InputError) as info:
        rollouts_from_sequences([[1, 2], [1, 3]], **fields)
    assert str(info.value) == message


def _hand_made(**change) -> Rollouts:
    fields = {"tokens": np.array([1, 2, 1, 3], np.int32), "offsets": np.array([0, 2, 4]), "ids": ["a", "b"]}
    return Rollouts(**{**fields, **change})


@pytest.mark.parametrize("change,message", [
    ({"tokens": [1, 2, 1, 3]}, ("Rollouts: tokens and offsets must be numpy arrays (rollouts_from_sequences builds a "
                               "batch from lists)")),
    ({"tokens": np.array([1.0, 2, 1, 3])}, "Rollouts: tokens must be a 1-d integer array, got float64 of shape [4]"),
    ({"offsets": np.array([0, 2, 9])}, "Rollouts: offsets must run from 0 to len(tokens) = 4, got 0 .. 9"),
    ({"offsets": np.array([0, 3, 2, 4]), "ids": ["a", "b", "c"]}, "Rollouts: sequence 'b' has offsets that go back"),
    ({"offsets": np.array([0, 2, 2, 4]), "ids": ["a", "b", "c"]}, "Rollouts: sequence 'b' is empty"),
    ({"tokens": np.array([1, -5, 1, 3], np.int32)}, "Rollouts: token id -5 is outside [0, 2147483647]"),
    ({"ids": ["a"]}, "Rollouts.ids: 1 entries for 2 sequences"),
    ({"loss_mask": np.ones(3, np.uint8)}, "Rollouts.loss_mask: 3 values for 4 tokens"),
    ({"steps": np.zeros(3, np.int64)}, "Rollouts.steps: 3 values for 2 sequences"),
])
def test_a_hand_made_batch_is_refused_at_every_entry_point(change, message, tmp_path):
    r = _hand_made(**change)
    for call in (lambda: pack_sequences(r, 8), lambda: build_pack(r), lambda: check_rollouts(r)):
        with pytest.raises(InputError) as info:
            call()
        assert str(info.value) == message


def test_prefix_tree_from_arrays_checks_its_buffer():
    with pytest.raises(InputError, match=r"^PrefixTree: offsets must run from 0 to len\(tokens\) = 6, got 0 \.\. 9$"):
        PrefixTree.from_arrays(np.arange(6), np.array([0, 3, 9]))
    with pytest.raises(InputError, match=r"^PrefixTree: sequence 1 has offsets that go back$"):
        PrefixTree.from_arrays(np.arange(6), np.array([0, 4, 3, 6]))
    with pytest.raises(InputError, match=r"^PrefixTree: tokens must be a 1-d integer array"):
        PrefixTree.from_arrays(np.array([[1, 2, 3], [1, 2, 4]]), np.array([0, 1, 2]))
    with pytest.raises(InputError, match=r"^PrefixTree: scope has 1 values for 2 sequences$"):
        PrefixTree.from_arrays(np.arange(6), np.array([0, 3, 6]), np.zeros(1, np.int64))


def test_capacity_takes_sizes_and_refuses_other_types():
    r = rollouts_from_sequences([[1, 2, 3], [1, 2, 4]])
    assert pack_sequences(r, "60k").capacity == 60_000 and pack_sequences(r, np.int64(8)).capacity == 8
    for bad in (2.7, True, "lots"):
        with pytest.raises(TreepackError, match="capacity"):
            pack_sequences(r, bad)


def test_a_tree_of_other_data_is_rebuilt_not_trusted():
    a = rollouts_from_sequences([[1, 2], [1, 3]])
    b = rollouts_from_sequences([[5, 6], [7, 8]])
    fresh = pack_sequences(a, 3)
    reused = pack_sequences(a, 3, tree=PrefixTree.build(b))
    assert (reused.pack_tokens.tolist(), reused.err) == (fresh.pack_tokens.tolist(), fresh.err) == ([3], 0.25)


def test_build_pack_refuses_what_write_shards_refuses():
    r = rollouts_from_sequences([[1, 2], [1, 3]])
    for index in ([0, 0], [-1], [2]):
        with pytest.raises(TreepackError, match=r"^a pack's sequences must be distinct indices in \[0, 2\)"):
            build_pack(r, index)
    for pad_to in (0, -4):
        with pytest.raises(TreepackError, match=f"^pad_to must be positive, got {pad_to}$"):
            build_pack(r, pad_to=pad_to)


def test_write_shards_names_a_group_by_mismatch_and_fills_the_stats(tmp_path):
    r = rollouts_from_sequences([[1, 2, 3], [1, 2, 4], [1, 2, 5]], groups=["x", "y", "x"])
    packing = pack_sequences(r, 100, group_by="tree_id")
    with pytest.raises(TreepackError, match=r"write_shards needs the rollouts and the group_by the packing was made"):
        write_shards(r, packing, tmp_path / "bad")
    write_shards(r, pack_sequences(r, 100), tmp_path / "ok")
    manifest = read_manifest(tmp_path / "ok")["stats"]
    want = compute_stats(PrefixTree.build(r), rollouts=r)
    assert (manifest["por"], manifest["compression"], manifest["c_leaf"]) == (want.por, want.compression, want.c_leaf)


def test_compute_stats_names_an_unknown_model():
    with pytest.raises(TreepackError, match=r"^unknown model shape 'qwen3-32b': expected one of "):
        compute_stats(PrefixTree.build(rollouts_from_sequences([[1, 2]])), model="qwen3-32b")


def test_the_reference_attention_checks_subtree_end_values():
    from treepack.kernels.tree_attention.api import tree_attention

    q = torch.randn(2, 2, 8, dtype=torch.float64)
    for values, k in (([0, 2], 0), ([2, 1], 1), ([2, 3], 1)):
        with pytest.raises(ValueError, match=rf"got subtree_end\[{k}\]={values[k]}$"):
            tree_attention(q, q, q, torch.tensor(values, dtype=torch.int32), impl="reference")


def test_in_memory_capacity_errors_name_the_callers_sequence():
    from treepack.hf.batch import plan_packs

    with pytest.raises(CapacityError, match=r"^sequence 1 has 5 tokens > capacity 3; raise capacity"):
        plan_packs([np.zeros(0, np.int64), np.arange(5)], 3)
