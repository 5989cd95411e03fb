"""Data-parallel use: which packs each rank runs, and the normaliser that makes the ranks add up exactly.

`shard_packs` is the trainer's own balance (`treepack.train.distributed.shard_batch`, one `RankShare`
type for both) with two choices made for a Hugging Face loop: packs stay whole (``min_gain=KEEP_WHOLE``:
the model takes a pack, not a piece of one; the trainer may cut a pack across ranks when that saves >= 1%
of the step, recomputing its shared prefix), and the cost is named (``tokens``: real tokens per pack, the
default; ``flops``: design §9 for a named model shape, which weighs deep packs' attention pairs and the
head's loss tokens). The packs of each global batch (e.g. one ``step`` of the rollouts) go to ranks by
the better of LPT and the contiguous AReaL-DTA split (`treepack.pack.balance.assign_units`): packs share
no tokens, so contiguity buys nothing, and [5, 5, 3, 3] over 2 ranks balances 8/8, contiguously at best
10/6. Each rank's packs keep the batch order; every rank computes the same split from the same pack list,
without communication.

The losses normalise by counts over the *global* batch (loss tokens, sequences with a loss; `BatchTotals`):
``RankShare.totals`` holds them, so each rank's ``loss(..., totals=share.totals)`` is its exact share and
the SUM of the ranks' gradients is the gradient of one process over the whole batch (all-reduce SUM; under
DDP, which averages, scale each rank's loss by ``share.ddp_loss_scale`` = world size). When a rank only
knows its own packs, `global_totals` all-reduces the local counts instead.
"""

from __future__ import annotations

from collections.abc import Sequence

from treepack.pack.balance import KEEP_WHOLE, cost_model
from treepack.pack.layout import Pack
from treepack.train.distributed import RankShare, global_totals, shard_batch
from treepack.train.losses import BatchTotals, LossRows

__all__ = ["RankShare", "global_totals", "pack_totals", "shard_packs"]  # global_totals: the trainer's own


def pack_totals(packs: Sequence[Pack]) -> BatchTotals:
    """Loss rows and sequences with at least one row, over ``packs`` (a sequence's first token never
    counts: nothing predicts it)."""
    return BatchTotals.of([LossRows.from_pack(p) for p in packs])


def shard_packs(packs: Sequence[Pack], rank: int | None = None, world_size: int | None = None, *,
                cost: str = "tokens", model: str | None = None) -> RankShare:
    """This rank's whole packs of one global batch and the batch-wide normaliser (see the module
    docstring); rank and world size default to the process group's. ``cost``: ``tokens`` or ``flops``
    (for ``model``'s shape, `treepack.stats.MODEL_SHAPES`; the default model if None)."""
    return shard_batch(list(packs), flops=cost_model(cost, model), rank=rank, world_size=world_size,
                       min_gain=KEEP_WHOLE)



