"""PackDataset: packs from a shard directory, rollout files or in-memory rollouts, split over DataLoader
workers and data-parallel ranks without losing or repeating a sequence; the three-line loop over it gives
the loss and gradients of token_logprobs over the same sequences; shard_packs + the global normaliser make
per-rank losses add up to the one-process loss."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hf_models import grads, loss_masks, rel_diff, tiny_model, tree_sequences
from torch.utils.data import DataLoader

from treepack.hf import (
    PackDataset,
    TreeBatch,
    collate_pack,
    exact_float64,
    global_totals,
    pack_logprobs,
    pack_rollouts,
    pack_totals,
    policy_loss,
    rollouts_from_sequences,
    shard_packs,
    token_logprobs,
)
from treepack.io.records import write_rollouts
from treepack.pack.shard_reader import read_packs
from treepack.pack.shards import write_shards
from treepack.pack.strategies import pack_sequences

SEQS = tree_sequences(seed=21, n=14)
N = len(SEQS)


def rollouts():
    rng = np.random.default_rng(0)
    return rollouts_from_sequences(
        SEQS, loss_masks=loss_masks(SEQS, 21), advantages=rng.standard_normal(N),
        logprobs=[-3.5 + 0.3 * rng.standard_normal(len(s)) for s in SEQS], groups=[i % 4 for i in range(N)])


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory):
    r = rollouts()
    out = tmp_path_factory.mktemp("packs") / "packs"
    write_shards(r, pack_sequences(r, 30), out, pad_to=8, balance=2)
    return out


def seen(batches) -> list[int]:
    return sorted(i for b in batches for i in b.seq_index.tolist())


def test_every_source_yields_every_sequence_once(shard_dir, tmp_path):
    assert seen(PackDataset(shard_dir)) == list(range(N))
    path = tmp_path / "r.jsonl"
    write_rollouts(rollouts(), str(path))
    assert seen(PackDataset(path, capacity=30)) == list(range(N))
    assert seen(PackDataset(rollouts(), capacity=30)) == list(range(N))
    assert seen(PackDataset(rollouts())) == list(range(N))  # one pack
    assert seen(PackDataset(SEQS, capacity=30)) == list(range(N))  # token lists as they are
    assert seen(PackDataset([np.asarray(s) for s in SEQS])) == list(range(N))


def test_workers_and_ranks_split_without_loss_or_repeat(shard_dir):
    loader = DataLoader(PackDataset(shard_dir), batch_size=None, num_workers=2)
    assert seen(loader) == list(range(N))
    loader = DataLoader(PackDataset(rollouts(), capacity=30), batch_size=1, collate_fn=collate_pack)
    assert seen(loader) == list(range(N))
    for source in (shard_dir, rollouts()):  # stored ranks (--balance 2), or a balanced split here
        parts = [seen(PackDataset(source, capacity=30, rank=k, world_size=2)) for k in range(2)]
        assert sorted(parts[0] + parts[1]) == list(range(N)) and parts[0] and parts[1]


def test_three_line_loop_equals_token_logprobs(shard_dir):
    """Packs from shards (padded to 8, stored loss masks and behaviour log-probs) give the loss and the
    gradients of token_logprobs over the same sequences."""
    model = tiny_model("qwen3")
    r = rollouts()
    batches = list(PackDataset(shard_dir))
    totals = pack_totals(list(read_packs(shard_dir)))
    with exact_float64():
        model.zero_grad(set_to_none=True)
        loss_loop = 0.0
        for batch in DataLoader(PackDataset(shard_dir), batch_size=None):
            out = pack_logprobs(model, batch)
            loss = policy_loss(out.per_sequence(), batch.old_logprobs_per_sequence(), batch.advantages,
                               batch.loss_masks(), totals=totals)
            loss.backward()
            loss_loop += float(loss.detach())
        g_loop = grads(model)
        model.zero_grad(set_to_none=True)
        old = [torch.as_tensor(r.logprobs[r.offsets[i]:r.offsets[i + 1]]) for i in range(N)]
        masks = [r.loss_mask_of(i) for i in range(N)]
        whole = policy_loss(token_logprobs(model, SEQS), old, r.advantages, masks)
        whole.backward()
    assert len(batches) > 1
    assert abs(loss_loop - float(whole.detach())) <= 1e-12
    assert rel_diff(g_loop, grads(model))[0] <= 1e-9


@pytest.mark.parametrize("world", [1, 2, 3])
def test_ranks_add_up_to_one_process(world):
    model = tiny_model("llama")
    packs = pack_rollouts(rollouts(), 24)
    with exact_float64():
        model.zero_grad(set_to_none=True)
        total = 0.0
        shares = [shard_packs(packs, k, world) for k in range(world)]
        for share in shares:
            for p in share.packs:
                b = TreeBatch.from_pack(p)
                loss = policy_loss(pack_logprobs(model, b).per_sequence(), None, b.advantages, b.loss_masks(),
                                   aggregation="seq-mean-token-mean", totals=share.totals)
                loss.backward()
                total += float(loss.detach())
        g_ranks = grads(model)
        model.zero_grad(set_to_none=True)
        r = rollouts()
        whole = policy_loss(token_logprobs(model, SEQS), None, r.advantages, [r.loss_mask_of(i) for i in range(N)],
                            aggregation="seq-mean-token-mean")
        whole.backward()
    assert sorted(i for s in shares for i in s.index) == list(range(len(packs)))
    assert all(s.index == sorted(s.index) and all(p is packs[i] for p, i in zip(s.packs, s.index))
               for s in shares)  # whole packs, in the pack order
    assert all(s.totals == pack_totals(packs) for s in shares)
    assert abs(total - float(whole.detach())) <= 1e-12
    assert rel_diff(g_ranks, grads(model))[0] <= 1e-9


def _all_reduce_worker(rank: int, world: int, port: int, out):
    import torch.distributed as dist

    from treepack.train.losses import BatchTotals

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        out[rank] = global_totals(BatchTotals(loss_tokens=10 + rank, sequences=1 + rank))
    finally:
        dist.destroy_process_group()


def test_global_totals_all_reduce():
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    manager = mp.Manager()
    out = manager.dict()
    mp.spawn(_all_reduce_worker, args=(2, port, out), nprocs=2, join=True)
    assert out[0] == out[1] and out[0].loss_tokens == 21 and out[0].sequences == 3


def test_global_totals_is_the_trainers_and_takes_rows():
    from treepack.train import distributed
    from treepack.train.losses import BatchTotals, LossRows

    assert global_totals is distributed.global_totals
    packs = pack_rollouts(rollouts(), 24)
    rows = [LossRows.from_pack(p) for p in packs]
    assert global_totals(rows) == BatchTotals.of(rows) == global_totals(BatchTotals.of(rows))  # no process group


def test_a_sequence_over_the_capacity_names_the_argument_not_a_cli_flag():
    from treepack.errors import CapacityError
    from treepack.hf import token_logprobs

    longest = max(len(s) for s in SEQS)
    with pytest.raises(CapacityError, match="raise capacity, or pass capacity=None") as err:
        list(PackDataset(rollouts(), capacity=longest - 1).packs())
    assert "--oversize" not in str(err.value)
    with pytest.raises(CapacityError, match="raise capacity, or pass capacity=None"):
        token_logprobs(tiny_model("qwen3"), SEQS, capacity=longest - 1, check=False)
