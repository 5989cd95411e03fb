"""Packs as a torch ``IterableDataset``: from a packed shard directory, rollout files, or rollouts in memory.

A trainer's loop over packs is three lines::

    for batch in torch.utils.data.DataLoader(PackDataset("packs/"), batch_size=None):
        out = pack_logprobs(model, batch)                       # log-probs of the pack's tokens
        loss = policy_loss(out.per_sequence(), batch.old_logprobs_per_sequence(), batch.advantages,
                           batch.loss_masks()); loss.backward()

Sources (`PackDataset`):
- a directory written by ``treepack pack`` (``manifest.json`` inside): its packs as stored, read lazily
  shard by shard (the packing was chosen offline, with the ``best`` strategy);
- rollout files (``.jsonl[.gz]``, ``.parquet``) or a `Rollouts` batch: packed here by
  `treepack.pack.pack_rollouts` with the ``best`` strategy at ``capacity`` (one pack of everything when None);
- token lists straight out of a generator (`PackDataset([[1, 2, 3], ...])`), or a batch of them with loss
  masks, behaviour log-probs, rewards/advantages and group labels (GRPO groups) from `rollouts_from_sequences`
  (`treepack.io.sequences`, numpy only) — packed on the fly.

Each item is a `TreeBatch` (the pack's tensors, CPU; ``pin_memory`` supported). Splitting: packs are
dealt to DataLoader workers round robin; with ``world_size > 1`` each rank first takes its share of all
the source's packs, balanced as one batch (`treepack.hf.parallel.shard_packs`: whole packs, token-balanced,
each rank's in pack order; split per step yourself with `shard_packs` where steps matter) or, for shards
written with ``--balance K``, the rank stored in the shard.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from torch.utils.data import IterableDataset, get_worker_info

from treepack.errors import TreepackError
from treepack.hf.batch import TreeBatch
from treepack.io.rollouts import Rollouts
from treepack.io.sequences import rollouts_from_sequences
from treepack.pack.layout import Pack
from treepack.pack.packs import pack_rollouts
from treepack.train.distributed import rank_and_world


class PackDataset(IterableDataset):
    """Tree packs as `TreeBatch` items (see the module docstring); ``batch_size=None`` in the DataLoader."""

    def __init__(self, source, *, capacity: int | None = None, strategy: str = "best", rank: int = 0,
                 world_size: int = 1) -> None:
        super().__init__()
        rank_and_world(rank, world_size)  # the same check (and message) as shard_packs
        self.source, self.capacity, self.strategy = source, capacity, strategy
        self.rank, self.world_size = rank, world_size

    def _is_shard_dir(self) -> bool:
        return isinstance(self.source, (str, Path)) and (Path(self.source) / "manifest.json").is_file()

    def packs(self) -> Iterator[Pack]:
        """This rank's packs, in order (before the split over workers)."""
        if self._is_shard_dir():
            from treepack.pack.shard_reader import read_packs

            packs = read_packs(self.source)
            if self.world_size == 1:
                yield from packs
                return
            packs = list(packs)
            if packs and all("rank" in p.meta and p.meta["rank"] is not None for p in packs):
                yield from (p for p in packs if int(p.meta["rank"]) == self.rank)
                return
        else:
            r = self.source
            paths = [r] if isinstance(r, (str, Path)) else None if isinstance(r, Rollouts) else list(r)
            if paths and not all(isinstance(p, (str, Path)) for p in paths):  # token lists: see the module doc
                r = rollouts_from_sequences(paths)
            elif paths is not None:
                from treepack.io.ingest import read_rollouts

                r = read_rollouts([str(p) for p in paths])
            packs = pack_rollouts(r, self.capacity, strategy=self.strategy)
            if self.world_size == 1:
                yield from packs
                return
        from treepack.hf.parallel import shard_packs

        yield from shard_packs(packs, self.rank, self.world_size).packs

    def __iter__(self) -> Iterator[TreeBatch]:
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        for i, pack in enumerate(self.packs()):
            if i % nw == wid:
                yield TreeBatch.from_pack(pack)


def collate_pack(items) -> TreeBatch:
    """DataLoader ``collate_fn`` for ``batch_size=1``: one pack is one batch (packs are not stacked)."""
    if isinstance(items, TreeBatch):
        return items
    if len(items) != 1:
        raise TreepackError(f"a tree pack is its own batch: use batch_size=None or 1, got {len(items)} items")
    return items[0]
