"""treepack.hf.shard_packs is the trainer's balance (train.distributed.shard_batch) with whole packs: the
same split wherever the trainer cuts nothing, every rank's packs in batch order and all ranks together the
batch exactly once, never worse than the best contiguous split (brute force), the batch's normalisers on
every rank (counted from the sequences), and the one rank/cost error message of both doors."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import rollouts_from, sequence_lists

pytest.importorskip("transformers")

from treepack.errors import TreepackError
from treepack.hf import BatchTotals, PackDataset, RankShare, shard_packs
from treepack.pack.balance import MIN_GAIN, cost_model
from treepack.pack.cost import pack_work
from treepack.pack.layout import build_pack
from treepack.train.distributed import shard_batch

FEW = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def batches(draw):
    """A global batch: up to 6 packs of up to 5 prefix-sharing sequences, random loss masks."""
    batch, naive = [], BatchTotals(0, 0)
    for t in range(draw(st.integers(0, 6))):
        seqs = draw(sequence_lists(max_seqs=5, max_len=6, vocab=3))
        masks = [draw(st.lists(st.integers(0, 1), min_size=len(s), max_size=len(s))) for s in seqs]
        batch.append(build_pack(rollouts_from(seqs, masks=masks, ids=[f"{t}/{i}" for i in range(len(seqs))])))
        rows = [sum(m[1:]) for m in masks]  # a sequence's first token is never predicted
        naive = BatchTotals(naive.loss_tokens + sum(rows), naive.sequences + sum(n > 0 for n in rows))
    return batch, naive


def best_contiguous(costs: list[int], k: int) -> int:
    """The smallest costliest rank over every cut of the list into at most k contiguous runs."""
    n = len(costs)
    best = sum(costs)
    for m in range(1, min(k, n)):
        for cuts in itertools.combinations(range(1, n), m):
            bounds = (0, *cuts, n)
            best = min(best, max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds)))
    return best


@FEW
@given(batches(), st.integers(1, 5), st.sampled_from(["tokens", "flops"]))
def test_shard_packs_is_the_trainers_balance_with_whole_packs(case, world, cost):
    batch, naive = case
    flops = cost_model(cost)
    shares = [shard_packs(batch, r, world, cost=cost) for r in range(world)]
    trainer = [shard_batch(batch, flops=flops, rank=r, world_size=world) for r in range(world)]
    assert [(type(s), s.rank, s.world_size) for s in shares] == [(RankShare, r, world) for r in range(world)]
    # whole packs of the batch itself, in batch order on each rank, every pack on exactly one rank
    assert sorted(i for s in shares for i in s.index) == list(range(len(batch)))
    for s in shares:
        assert s.index == sorted(s.index) and len(s.packs) == len(s.index)
        assert all(p is batch[i] for p, i in zip(s.packs, s.index))
        assert not s.split.split_units and s.totals == naive
        assert s.rank_cost == shares[0].rank_cost  # every rank computes the same split
    assert shares[0].rank_cost == [sum(flops.cost(pack_work(p)) for p in s.packs) for s in shares]
    assert max(shares[0].rank_cost) <= best_contiguous([flops.cost(pack_work(p)) for p in batch], world)
    assert shares[0].split.loads == shares[0].rank_cost  # whole packs: the balance's costs are exact
    if trainer[0].split.split_units:  # the trainer cut a pack only because that beat the whole-pack split
        assert max(trainer[0].split.loads) < max(shares[0].split.loads) * (1 - MIN_GAIN)
    else:
        assert [s.index for s in trainer] == [s.index for s in shares]
        assert [[id(p) for p in s.packs] for s in trainer] == [[id(p) for p in s.packs] for s in shares]
        assert trainer[0].rank_cost == shares[0].rank_cost


def test_defaults_errors_and_the_tokens_table():
    batch = [build_pack(rollouts_from(s)) for s in ([[1, 2, 3], [1, 2, 4]], [[5, 6]], [[7, 8, 9, 10]])]
    alone = shard_packs(batch)  # no process group: rank 0 of 1
    assert (alone.rank, alone.world_size, alone.index) == (0, 1, [0, 1, 2])
    assert alone.ddp_loss_scale == 1.0 and shard_packs(batch, 1, 3).ddp_loss_scale == 3.0
    table = shard_packs(batch, 0, 2).table()
    assert table[0] == "split over 2 ranks (3 packs, none cut; cost: tokens of the tree layout):"
    assert all("FLOP" not in line for line in table)
    message = "rank must be in [0, world_size), got rank 2, world_size 2"
    for call in (lambda: shard_packs(batch, 2, 2), lambda: PackDataset(batch, rank=2, world_size=2),
                 lambda: shard_batch(batch, flops=cost_model(), rank=2, world_size=2)):
        with pytest.raises(TreepackError) as err:
            call()
        assert str(err.value) == message
    with pytest.raises(TreepackError, match=r"^balance cost must be one of tokens, flops, got 'time'$"):
        shard_packs(batch, 0, 2, cost="time")
    with pytest.raises(TreepackError, match=r"^unknown model 'gpt'; known: "):
        shard_packs(batch, 0, 2, cost="flops", model="gpt")
