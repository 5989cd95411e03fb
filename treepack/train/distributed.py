"""Data parallelism over ``torch.distributed``: each rank's share of a global batch, and the global normaliser.

The contract that makes a data-parallel step *identical* to the single-process one (up to the order of
float sums): every rank sees the same global batch (the same packs in the same order: the batch of a step
is a pure function of the config and the step number), computes the normalisers over the **whole** batch
(`BatchTotals`: loss tokens and sequences of every rank's packs, fixed before any forward), and
back-propagates only its share. Then the sum over ranks of the rank losses is the batch loss, and
gradients must be *summed* over ranks, never averaged (FSDP averages by default: `sum_gradients`).

The split (`shard_batch`) is `treepack.pack.balance.balance_units` over the batch's packs with the FLOP
model of the actual model (``6 x params x tokens + 6 x d_model x vocab x predicted + 12 x layers x heads x
head_dim x attention pairs``, design §9) and the layout the mode runs: the pack's trie (tree, dfs), flat
sequences (dense) or the trie's leaf sequences (dense-leaf). Whole packs go to ranks first (packs share no
tokens, so nothing is computed twice); a pack is cut into pieces across ranks only when that lowers the
predicted step time by at least 1%, at the cut that duplicates the least shared prefix. It is
deterministic (integer costs, fixed tie-breaks), so every rank computes the same split without talking.
Where a user's ranks hold only their own data, `global_totals` all-reduces the two counts instead.
`treepack.hf.shard_packs` is this same split with ``min_gain=KEEP_WHOLE`` (never a cut pack: a Hugging
Face model takes a pack whole) and a named cost (tokens, or a model shape's FLOPs): one balance, one
`RankShare`, whichever door a user comes in by.

Library use (a user's FSDP loop):

    share = shard_batch(global_batch_packs, flops=flop_model(model_args), mode="tree")
    for pack in share.packs:
        loss = my_pack_loss(pack, share.totals)  # normalised by the global batch
        loss.backward()
    # gradients: sum over ranks (call sum_gradients(model) once after fully_shard)
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from treepack.errors import TreepackError
from treepack.pack.balance import MIN_GAIN, UnitSplit, balance_units, sub_pack
from treepack.pack.cost import FlopModel, Work, pack_run_costs, pack_work
from treepack.pack.layout import Pack
from treepack.train.losses import BatchTotals, LossRows

# A first split this unbalanced, with under 2 packs a rank, says so: whole packs cannot be evened out, and cutting
# one recomputes its shared prefix (one 64K pack a rank of long agent chains: 19-35% apart under any cost model,
# benchmarks/results/2026-11-29-simulated-ranks-h200.md)
ROOM_IMBALANCE = 1.10

# How each mode lays a pack out, for the cost model; any other mode (tree, dfs, ...) runs the pack's trie.
MODE_LAYOUTS = {"dense": "flat", "dense-leaf": "leaf"}


def layout_of_mode(mode: str) -> str:
    """The `treepack.pack.balance` layout whose FLOPs a mode spends on a pack."""
    return MODE_LAYOUTS.get(mode, "tree")


def si(x: float, unit: str = "") -> str:
    """3 significant digits and an SI prefix: si(987) = '987', si(12345) = '12.3k', si(7.89e12, ' FLOP')
    = '7.89 TFLOP'."""
    sep, name = (" ", unit.strip()) if unit.startswith(" ") else ("", unit)
    for prefix, div in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= div:
            v = x / div
            digits = f"{v:.2f}" if abs(v) < 10 else f"{v:.1f}" if abs(v) < 100 else f"{v:.0f}"
            return f"{digits}{sep}{prefix}{name}"
    return f"{x:.0f}{sep}{name}"


def flop_model(args) -> FlopModel:
    """The FLOP model of a `treepack.train.model.ModelArgs` (the trained model's own shape)."""
    return FlopModel(per_token=6 * args.num_params(embeddings=False), per_predicted=6 * args.hidden_size * args.vocab_size,
                     per_pair=12 * args.num_layers * args.num_heads * args.head_dim, name="model")


def rank_and_world(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """(rank, world size): the given ones, else the process group's, else (0, 1)."""
    if world_size is None:
        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if rank is None:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if not 0 <= rank < world_size:
        raise TreepackError(f"rank must be in [0, world_size), got rank {rank}, world_size {world_size}")
    return rank, world_size


@dataclass
class RankShare:
    """One rank's share of a global batch: its packs, the batch's normalisers, and every rank's load."""

    rank: int
    world_size: int
    packs: list[Pack]  # this rank's packs, in batch order: whole packs, or pieces of the packs that were cut
    index: list[int]  # batch position of each of them (of the pack a piece was cut from)
    totals: BatchTotals  # normalisers of the WHOLE global batch (every rank's packs)
    split: UnitSplit  # which rank runs which piece of which pack
    rank_work: list[Work]  # exact work of every rank (tokens, predicted tokens, attention pairs)
    rank_cost: list[int]  # exact predicted cost of every rank: fwd+bwd FLOPs, or tokens (``cost``)
    rank_packs: list[int]  # packs (or pieces) of every rank
    layout: str = "tree"
    cost: str = "flops"  # what rank_cost counts: "flops", or "tokens" (the `TOKENS` cost model)
    extra: dict = field(default_factory=dict)
    cut_tokens: int = 0  # tokens the cut packs' pieces compute beyond those packs whole (shared prefixes again)

    @property
    def ddp_loss_scale(self) -> float:
        """Factor for each rank's loss when gradients are averaged over ranks (DDP) instead of summed."""
        return float(self.world_size)

    @property
    def imbalance(self) -> float:
        """Predicted: costliest rank / mean rank (1.0 = perfect)."""
        mean = sum(self.rank_cost) / self.world_size
        return max(self.rank_cost) / mean if mean else 1.0

    @property
    def n_split_packs(self) -> int:
        return len(self.split.split_units)

    def table(self, step: int | None = None) -> list[str]:
        """The split as printed by the trainer: one line per rank, then the imbalance."""
        total = sum(self.rank_cost) or 1
        head = f"split{'' if step is None else f' of step {step}'} over {self.world_size} ranks"
        n_packs = self.split.n_units
        what = "tokens" if self.cost == "tokens" else "fwd+bwd FLOPs"
        cut = (f"{self.n_split_packs} of {n_packs} packs cut, recomputing {si(self.cut_tokens)} tokens "
               f"(+{100 * self.split.cut_share:.1f}% {what.split()[-1]})" if self.n_split_packs
               else f"{n_packs} packs, none cut")
        lines = [f"{head} ({cut}; cost: {what} of the {self.layout} layout):"]
        for r in range(self.world_size):
            cost = "" if self.cost == "tokens" else f" | {si(self.rank_cost[r], ' FLOP')}"
            lines.append(f"  rank {r}: {self.rank_packs[r]} packs | {si(self.rank_work[r].tokens)} tokens"
                         f"{cost} ({100 * self.rank_cost[r] / total:.1f}%)")
        lines.append(f"  imbalance {100 * (self.imbalance - 1):.1f}% (costliest rank / mean - 1)")
        if self.imbalance > ROOM_IMBALANCE and n_packs < 2 * self.world_size:
            lines.append(f"  {n_packs} packs over {self.world_size} ranks leave the balance little room: more packs a "
                         "step let it even the ranks out")
        return lines

    def to_json(self) -> dict:
        return {"rank_tokens": [w.tokens for w in self.rank_work], "rank_cost": self.rank_cost,
                "rank_packs": self.rank_packs, "imbalance_predicted": self.imbalance,
                "split_packs": self.n_split_packs, "cut_tokens": self.cut_tokens, "cut_cost": self.split.cut_cost}


def shard_batch(packs: list[Pack], *, flops, mode: str = "tree", rank: int | None = None,
                world_size: int | None = None, totals: BatchTotals | None = None, min_gain: float = MIN_GAIN
                ) -> RankShare:
    """This rank's share of the global batch ``packs`` (every rank passes the same list, in the same
    order) and the normalisers of the whole batch; rank and world size default to the process group's.
    ``flops``: a `FlopModel` (`TOKENS` balances tokens), or the `ModelArgs` of the trained model;
    ``mode``: the execution mode's name (its layout decides the cost: `MODE_LAYOUTS`). ``min_gain``: the
    step time a cut pack must save (`KEEP_WHOLE`: whole packs only).
    ``totals`` overrides the normalisers (e.g. `global_totals` of a larger batch). GRPO advantages that
    are normalised per group must be computed on the whole batch first (`losses.group_advantages`)."""
    rank, world_size = rank_and_world(rank, world_size)
    return _shares(packs, flops, mode, world_size, totals, min_gain, ranks=(rank,))[0]


def every_share(packs: list[Pack], *, flops, world_size: int, mode: str = "tree", totals: BatchTotals | None = None,
                min_gain: float = MIN_GAIN) -> list[RankShare]:
    """`shard_batch` of every rank from one split (``[shard_batch(..., rank=r) for r in ranks]`` computes the
    split once per rank): what one process rehearsing ``world_size`` ranks runs (`train.sync.SimulatedRanks`)."""
    if world_size < 1:
        raise TreepackError(f"world_size must be >= 1, got {world_size}")
    return _shares(packs, flops, mode, world_size, totals, min_gain, ranks=tuple(range(world_size)))


def _shares(packs: list[Pack], flops, mode: str, world_size: int, totals: BatchTotals | None, min_gain: float,
            ranks: tuple[int, ...]) -> list[RankShare]:
    """The split of ``packs`` over ``world_size`` ranks, as the `RankShare` of each of ``ranks``."""
    if not isinstance(flops, FlopModel):  # a ModelArgs
        flops = flop_model(flops)
    layout = layout_of_mode(mode)
    if totals is None:
        totals = BatchTotals.of([LossRows.from_pack(p) for p in packs])
    units = [_run_costs(p, flops, layout) for p in packs]
    split = balance_units(units, world_size, min_gain=min_gain)
    mine: dict[int, tuple[list[Pack], list[int]]] = {r: ([], []) for r in ranks}
    rank_work = [Work() for _ in range(world_size)]
    rank_cost = [0] * world_size
    rank_packs = [0] * world_size
    for r in range(world_size):
        for piece in split.rank_pieces(r):
            if piece.whole:
                pack, work = packs[piece.unit], units[piece.unit].work
            else:
                pack = sub_pack(packs[piece.unit], piece.start, piece.stop)
                work = pack_work(pack, layout)
            rank_work[r] = rank_work[r] + work
            rank_cost[r] += flops.cost(work)
            rank_packs[r] += 1
            if r in mine:
                mine[r][0].append(pack)
                mine[r][1].append(piece.unit)
    counts_tokens = (flops.per_token, flops.per_predicted, flops.per_pair) == (1, 0, 0)
    cut_tokens = sum(w.tokens for w in rank_work) - sum(u.work.tokens for u in units)
    return [RankShare(rank=r, world_size=world_size, packs=mine[r][0], index=mine[r][1], totals=totals, split=split,
                      rank_work=rank_work, rank_cost=rank_cost, rank_packs=rank_packs, layout=layout,
                      cost="tokens" if counts_tokens else "flops", cut_tokens=cut_tokens)
            for r in ranks]


# The arrays a pack's costs read. A step's packs share them with the run's packs (GRPO's advantages make new
# `Pack` objects around the same arrays), and their costs took ~30 ms of host time a step to recompute
# (8 packs of 16k): computed once per array set instead.
_COST_FIELDS = ("seq_offsets", "seq_token_index", "seq_loss_mask", "seq_leaf", "subtree_end")
_RUN_COSTS: dict[int, tuple] = {}


def _run_costs(pack: Pack, flops: FlopModel, layout: str):
    """`pack_run_costs`, once per set of the pack's arrays (read-only once a pack is built)."""
    arrays = tuple(getattr(pack, f) for f in _COST_FIELDS)
    ident = (tuple(id(a) for a in arrays), int(pack.n_real), flops, layout)
    key = id(arrays[1])
    hit = _RUN_COSTS.get(key)
    if hit is not None and hit[0]() is arrays[1] and hit[1] == ident:
        return hit[2]
    costs = pack_run_costs(pack, flops, layout)
    try:
        ref = weakref.ref(arrays[1], lambda _, key=key: _RUN_COSTS.pop(key, None))
    except TypeError:  # not a weak-referenceable array: no cache
        return costs
    _RUN_COSTS[key] = (ref, ident, costs)
    return costs


def global_totals(local: BatchTotals | list[LossRows], group=None) -> BatchTotals:
    """The normalisers of the global batch when each rank holds only its own packs: an all-reduce (sum) of
    the local loss tokens and sequences, given as `BatchTotals` or as the rank's `LossRows`. Without a
    process group, the local totals. (`treepack.hf.global_totals` is this function.)"""
    if not isinstance(local, BatchTotals):
        local = BatchTotals.of(local)
    return all_reduce_totals(local, group)


def all_reduce_totals(local: BatchTotals, group=None) -> BatchTotals:
    """Sum of every rank's `BatchTotals` (one all-reduce of two int64s; identity without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return local
    backend = dist.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    t = torch.tensor([local.loss_tokens, local.sequences], dtype=torch.int64, device=device)
    dist.all_reduce(t, group=group)
    return BatchTotals(loss_tokens=int(t[0]), sequences=int(t[1]))


def sum_gradients(model: torch.nn.Module) -> None:
    """Make FSDP2 sum gradients over ranks instead of averaging them (treepack's losses are already
    normalised by the global batch): divide factor 1 on every ``fully_shard``-ed module of ``model``."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            if hasattr(module, "set_gradient_divide_factor"):
                module.set_gradient_divide_factor(1.0)
            else:  # torch < 2.7
                module.set_reduce_scatter_divide_factor(1.0)


def under_torchrun() -> bool:
    """Whether this process was started by torchrun (or another launcher that sets its variables)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"))


def gather_floats(values: list[float], device: torch.device) -> np.ndarray:
    """[world, len(values)] float64: every rank's values, on every rank (one all-gather)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if not (dist.is_available() and dist.is_initialized()):
        return t[None].cpu().numpy()
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return torch.stack(out).cpu().numpy()


def broadcast_floats(values, device: torch.device, src: int = 0) -> np.ndarray:
    """Rank ``src``'s float64 values on every rank (the values of the others are ignored)."""
    t = torch.tensor(np.asarray(values, dtype=np.float64), dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.broadcast(t, src=src)
    return t.cpu().numpy()
