"""Shards: the exact round trip, the design §6 arrays against independent computations, shard cutting, the
manifest, and load balancing against brute force."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracle import ancestor_mask
from strategies import rollouts_from, sequence_lists

from treepack.errors import InputError, TreepackError
from treepack.io.ingest import read_rollouts
from treepack.io.records import write_rollouts
from treepack.io.rollouts import Rollouts
from treepack.pack.balance import balance_packs, pack_costs, split_contiguous
from treepack.pack.shard_reader import read_manifest, read_packs, unpack
from treepack.pack.shards import SCHEMA_VERSION, parse_shard_size, write_shards
from treepack.pack.strategies import pack_sequences

SLOW = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@st.composite
def rich_rollouts(draw, max_seqs=10):
    """Rollouts with every optional field: loss masks that differ on shared tokens, NaN log-probs, mixed ids."""
    seqs = draw(sequence_lists(max_seqs=max_seqs, max_len=8, vocab=3))
    n = len(seqs)
    masks = [draw(st.lists(st.integers(0, 1), min_size=len(s), max_size=len(s))) for s in seqs]
    ids = [draw(st.one_of(st.integers(0, 5), st.sampled_from(["a", "b", "7"]))) for _ in range(n)]
    groups = [draw(st.sampled_from(["t1", "t2", 3])) for _ in range(n)]
    r = rollouts_from(seqs, masks=masks, ids=ids)
    names = []
    for g in groups:
        if g not in names:
            names.append(g)
    r.group_names, r.groups = names, np.asarray([names.index(g) for g in groups], dtype=np.int64)
    if draw(st.booleans()):
        r.steps = np.asarray(draw(st.lists(st.integers(0, 2), min_size=n, max_size=n)), dtype=np.int64)
    if draw(st.booleans()):
        floats = st.one_of(st.just(math.nan), st.floats(-3, 0), st.sampled_from([-0.5, -0.25]))
        r.logprobs = np.asarray([draw(floats) for _ in range(r.n_tokens)], dtype=np.float64)
    r.advantages = np.asarray([draw(st.one_of(st.just(math.nan), st.floats(-2, 2))) for _ in range(n)])
    r.rewards = np.asarray([draw(st.sampled_from([0.0, 1.0, math.nan])) for _ in range(n)])
    return r


def assert_same_rollouts(a: Rollouts, b: Rollouts) -> None:
    assert np.array_equal(a.tokens, b.tokens) and np.array_equal(a.offsets, b.offsets)
    assert a.ids == b.ids and [type(x) for x in a.ids] == [type(x) for x in b.ids]
    for name in ("loss_mask", "steps"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None) and (x is None or np.array_equal(x, y)), name
    for name in ("logprobs", "advantages", "rewards"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None) and (x is None or np.array_equal(x.view(np.int64), y.view(np.int64))), name
    assert (a.groups is None) == (b.groups is None)
    if a.groups is not None:
        assert [a.group_names[g] for g in a.groups] == [b.group_names[g] for g in b.groups]


def check_pack_arrays(pack, r: Rollouts) -> None:
    """Every design §6 array of a pack against an independent computation from parent chains."""
    T, n_real = pack.n_tokens, pack.n_real
    parent = pack.parent.tolist()
    mask = ancestor_mask(parent)
    end = pack.subtree_end.tolist()
    for q in range(T):
        for k in range(T):
            assert mask[q][k] == (k <= q < end[k]), (q, k)
    scale = np.zeros(T)
    weight = np.zeros(T)
    for s, g in enumerate(pack.seq_index.tolist()):
        chain, q = [], int(pack.seq_leaf[s])
        while q != -1:
            chain.append(q)
            q = parent[q]
        chain.reverse()
        assert chain == pack.path(s).tolist()
        assert pack.input_ids[chain].tolist() == r.sequence(g).tolist()
        assert pack.position_ids[chain].tolist() == list(range(len(chain)))
        assert pack.seq_loss_mask[pack.seq_offsets[s] : pack.seq_offsets[s + 1]].tolist() == r.loss_mask_of(g).tolist()
        assert pack.seq_ids[s] == r.ids[g]
        scale[chain] += 1
        lm = r.loss_mask_of(g)
        for j, p in enumerate(chain):
            weight[p] += 1 if (lm[j] and j > 0) else 0
    assert pack.scale.tolist() == scale.tolist() and pack.loss_weight.tolist() == weight.tolist()
    assert (scale[:n_real] > 0).all() and (scale[n_real:] == 0).all()
    assert pack.parent[n_real:].tolist() == [-1] * (T - n_real)


@SLOW
@given(rich_rollouts(), st.sampled_from(["best", "first-fit", "dfs"]), st.sampled_from([None, 4]),
       st.sampled_from(["1packs", "2packs", "256M"]), st.data())
def test_round_trip_and_arrays(tmp_path_factory, r, strategy, pad_to, shard_size, data):
    longest = int(r.lengths.max())
    capacity = data.draw(st.integers(max(1, longest - 2), longest + 12))
    group_by = data.draw(st.sampled_from([None, "tree_id"]))
    p = pack_sequences(r, capacity, strategy=strategy, group_by=group_by, oversize="skip")
    if p.n_packs == 0:
        return
    out = tmp_path_factory.mktemp("packs")
    m = write_shards(r, p, out / "o", pad_to=pad_to, shard_size=shard_size, group_by=group_by,
                     balance=data.draw(st.sampled_from([None, 2])))
    assert m["counts"]["packs"] == p.n_packs and m["counts"]["oversize_skipped"] == p.n_oversize_skipped
    if shard_size.endswith("packs"):
        assert len(m["shards"]) == math.ceil(p.n_packs / int(shard_size[0]))
    kept = np.setdiff1d(np.arange(len(r)), p.oversize_skipped)
    assert_same_rollouts(unpack(out / "o"), r.select(kept))
    packs = list(read_packs(out / "o"))
    assert [pk.meta["pack_index"] for pk in packs] == list(range(p.n_packs))
    for pk, tokens in zip(packs, p.pack_tokens.tolist()):
        assert pk.n_real == tokens <= capacity
        if pad_to:
            assert pk.n_tokens % pad_to == 0 and pk.n_tokens - pk.n_real < pad_to
        check_pack_arrays(pk, r)
        if r.logprobs is not None:
            for s, g in enumerate(pk.seq_index.tolist()):
                got = pk.seq_logprobs[pk.seq_offsets[s] : pk.seq_offsets[s + 1]]
                want = r.logprobs[r.offsets[g] : r.offsets[g + 1]]
                assert np.array_equal(got.view(np.int64), want.view(np.int64))


def test_masks_that_differ_on_shared_tokens_are_stored_per_sequence(tmp_path):
    # turn 1 trains on [5, 6]; turn 2 has them as context and trains on [7]
    r = rollouts_from([[1, 5, 6], [1, 5, 6, 7]], masks=[[0, 1, 1], [0, 0, 0, 1]])
    write_shards(r, pack_sequences(r, 10), tmp_path / "o")
    row = pq.read_table(tmp_path / "o" / "shard-00000.parquet").to_pylist()[0]
    assert row["loss_mask"] == [0, -1, -1, 1]
    assert row["seq_loss_mask"] == [1, 1, 0, 0]  # sequence 0 at tokens 1, 2; then sequence 1 there
    assert row["loss_weight"] == [0.0, 1.0, 1.0, 1.0] and row["scale"] == [2.0, 2.0, 2.0, 1.0]
    assert_same_rollouts(unpack(tmp_path / "o"), r)


def test_manifest_contents(tmp_path):
    path = tmp_path / "in.jsonl"
    recs = [{"id": f"s{i}", "tree_id": "t", "input_ids": [1, 2, 3, i], "reward": 1.0} for i in range(6)]
    path.write_text("".join(json.dumps(x) + "\n" for x in recs))
    r = read_rollouts(path)
    p = pack_sequences(r, 6)
    m = write_shards(r, p, tmp_path / "o", pad_to=4, balance=2)
    assert m == read_manifest(tmp_path / "o")
    assert m["schema_version"] == SCHEMA_VERSION and m["capacity"] == 6 and m["strategy"] == "best"
    assert m["sources"][0]["sha256"] == r.sources[0].sha256 and m["sources"][0]["n_records"] == 6
    assert m["counts"] == {"records": 6, "packed_sequences": 6, "packs": 2, "skipped": 0, "skipped_reasons": {},
                           "oversize_skipped": 0, "shards": 1}
    assert m["stats"]["n_pack_tokens"] == 12 and m["stats"]["err"] == pytest.approx(1 - 12 / 24)
    assert m["stats"]["padding_tokens"] == 4  # 6 real tokens per pack, padded to 8
    assert m["fields"] == {"loss_mask": False, "logprobs": False, "tree_id": True, "step": False,
                           "advantage": False, "reward": True}
    assert m["balance"]["k"] == 2 and m["balance"]["steps"][0]["per_rank"] == [6, 6]
    assert [pk.meta["rank"] for pk in read_packs(tmp_path / "o")] == [0, 1]


def test_refuses_to_overwrite_and_reads_only_its_format(tmp_path):
    r = rollouts_from([[1, 2]])
    write_shards(r, pack_sequences(r, 4), tmp_path / "o")
    with pytest.raises(TreepackError, match="already holds packed shards"):
        write_shards(r, pack_sequences(r, 4), tmp_path / "o")
    with pytest.raises(InputError, match="no manifest.json"):
        read_manifest(tmp_path)
    m = json.loads((tmp_path / "o" / "manifest.json").read_text())
    m["schema_version"] = 99
    (tmp_path / "o" / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(InputError, match="schema version 99 is not supported"):
        list(read_packs(tmp_path / "o"))


def test_shard_sizes():
    assert parse_shard_size("256M") == ("bytes", 256 * 2**20)
    assert parse_shard_size("1000packs") == ("packs", 1000)
    assert parse_shard_size("1 pack") == ("packs", 1)
    with pytest.raises(TreepackError, match="expected bytes .e.g. 256M. or a number of packs"):
        parse_shard_size("lots")


def test_write_rollouts_formats(tmp_path):
    r = rollouts_from([[1, 2, 3], [1, 2]], masks=[[0, 1, 1], [1, 1]], ids=["a", 7])
    r.advantages = np.asarray([0.1, math.nan])
    with pytest.raises(TreepackError, match="the ids mix strings and integers"):
        write_rollouts(r, str(tmp_path / "mixed.parquet"))
    for name in ("x.jsonl", "x.jsonl.gz", "x.parquet"):
        r.ids = ["a", "7"] if name.endswith("parquet") else ["a", 7]
        write_rollouts(r, str(tmp_path / name))
        back = read_rollouts(tmp_path / name)
        assert back.ids == r.ids and np.array_equal(back.tokens, r.tokens)
        assert np.array_equal(back.loss_mask, r.loss_mask)
        assert back.advantages[0] == 0.1 and math.isnan(back.advantages[1])


# --------------------------------------------------------------------------------------------------
# balance


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=9), st.integers(1, 5))
def test_balance_equals_brute_force(costs, k):
    groups = split_contiguous(costs, k)
    n = len(costs)
    assert groups == sorted(groups) and len(set(groups)) == min(k, n) and groups[0] == 0
    got = max(sum(c for c, g in zip(costs, groups) if g == x) for x in set(groups))
    best = min(
        max(sum(costs[a:b]) for a, b in zip((0, *cut), (*cut, n)))
        for m in range(min(k, n))
        for cut in itertools.combinations(range(1, n), m)
    )
    assert got == best


def test_balance_per_step_and_flops():
    costs = pack_costs(np.array([10, 10, 10, 40]), np.array([55, 55, 55, 820]), "tokens")
    b = balance_packs(costs, np.array([0, 0, 1, 1]), 2)
    assert b.ranks.tolist() == [0, 1, 0, 1] and b.max_imbalance == pytest.approx(40 / 25)
    flops = pack_costs(np.array([10]), np.array([55]), "flops", "qwen3-0.6b")
    assert flops[0] > 10 * 6 * 0.4e9 and isinstance(flops[0], int)
    with pytest.raises(TreepackError, match="balance cost must be one of tokens, flops"):
        pack_costs(np.array([1]), np.array([1]), "time")
