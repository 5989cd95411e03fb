"""One pack as the tensors a tree forward reads, and the way from token lists to packs.

`TreeBatch` is a `treepack.pack.layout.Pack` as torch tensors (CPU until ``.to(device)``): the tree
fields (``input_ids``, ``position_ids`` = depth, ``parent``, ``subtree_end``) and the per-sequence
fields (paths, loss masks, behaviour log-probs, advantages) in the pack's sequence order (DFS leaf order;
``seq_index`` maps back to the input). `PackLogprobs` is what a forward over it returns: one log-prob per
pack token, read at its parent, gathered per sequence on demand, so a token shared by k sequences is
computed once and its gradient is the sum of the k sequences' (Tree Training's gradient restoration).

`plan_packs` turns token lists into packs through `treepack.pack.pack_rollouts` (docs/design.md §5): one pack
of all of them, or treepack's ``best`` packing at a capacity (N_pack close to N_tree, ERR close to POR).

Legend: T pack tokens, S sequences, F their flat tokens (sum of lengths), R targets (F - S).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from treepack.io.sequences import rollouts_of
from treepack.pack.layout import Pack

# --------------------------------------------------------------------------------------------------
# One pack as tensors


@dataclass
class TreeBatch:
    """The tensors of one pack that the tree forward and the losses read (CPU until `to`)."""

    input_ids: Tensor  # int64 [T]
    position_ids: Tensor  # int64 [T] depth
    parent: Tensor  # int64 [T] -1 at roots and padding
    subtree_end: Tensor  # int32 [T]
    seq_offsets: Tensor  # int64 [S+1] split of the flat per-sequence-token arrays
    seq_token_index: Tensor  # int64 [F] pack index of each sequence's j-th token
    loss_mask: Tensor  # bool [F] 1 where that sequence trains on the token (first tokens included as given)
    seq_index: Tensor  # int64 [S] index of each sequence in the input (packs list sequences in DFS order)
    old_logprobs: Tensor | None = None  # float64 [F] behaviour log-probs per sequence token (NaN: none)
    advantages: Tensor | None = None  # float64 [S]
    rewards: Tensor | None = None  # float64 [S]
    groups: list | None = None  # [S] tree_id / group of each sequence
    n_real: int = 0  # tokens [0, n_real) are real

    @classmethod
    def from_pack(cls, pack: Pack) -> TreeBatch:
        """The pack's arrays as CPU tensors (copies: a shard's arrays are read-only)."""

        def t(a, dtype):
            return None if a is None else torch.tensor(np.asarray(a), dtype=dtype)  # a copy: shard arrays are read-only

        return cls(
            input_ids=t(pack.input_ids, torch.long), position_ids=t(pack.position_ids, torch.long),
            parent=t(pack.parent, torch.long), subtree_end=t(pack.subtree_end, torch.int32),
            seq_offsets=t(pack.seq_offsets, torch.long), seq_token_index=t(pack.seq_token_index, torch.long),
            loss_mask=t(pack.seq_loss_mask, torch.bool), seq_index=t(pack.seq_index, torch.long),
            old_logprobs=t(pack.seq_logprobs, torch.float64), advantages=t(pack.advantages, torch.float64),
            rewards=t(pack.rewards, torch.float64), groups=pack.seq_groups, n_real=int(pack.n_real),
        )

    @property
    def n_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def n_sequences(self) -> int:
        return int(self.seq_offsets.shape[0] - 1)

    @property
    def lengths(self) -> Tensor:
        return self.seq_offsets[1:] - self.seq_offsets[:-1]

    def target_flat(self) -> Tensor:
        """int64 [R]: flat indices (into the [F] arrays) of every sequence token but the first."""
        first = torch.zeros(int(self.seq_offsets[-1]), dtype=torch.bool, device=self.seq_offsets.device)
        first[self.seq_offsets[:-1][self.lengths > 0]] = True
        return torch.nonzero(~first)[:, 0]

    def per_sequence(self, values_F: Tensor) -> list[Tensor]:
        """Split a flat per-sequence-token array [F] into one tensor per sequence."""
        return list(torch.split(values_F, self.lengths.tolist()))

    def loss_masks(self) -> list[Tensor]:
        """Each sequence's per-token loss mask [L] (what the losses take)."""
        return self.per_sequence(self.loss_mask)

    def old_logprobs_per_sequence(self) -> list[Tensor] | None:
        """Each sequence's per-token behaviour log-probs [L] (NaN where none), or None."""
        return None if self.old_logprobs is None else self.per_sequence(self.old_logprobs)

    def to(self, device, non_blocking: bool = False) -> TreeBatch:
        """The batch with every tensor on ``device`` (other fields as they are)."""
        out = {}
        for name, value in self.__dict__.items():
            out[name] = value.to(device, non_blocking=non_blocking) if isinstance(value, Tensor) else value
        return TreeBatch(**out)

    def pin_memory(self) -> TreeBatch:
        out = {n: v.pin_memory() if isinstance(v, Tensor) else v for n, v in self.__dict__.items()}
        return TreeBatch(**out)


@dataclass
class PackLogprobs:
    """Log-probs of one pack: one per pack token (read at its parent), gathered per sequence on demand."""

    batch: TreeBatch  # on the model's device
    logp_T: Tensor  # [T] float32 (float64 for float64 models); 0 where not computed (roots, padding)
    computed_T: Tensor  # bool [T] which tokens were computed
    entropy_T: Tensor | None = None  # [T] predictive entropy at the parent, when asked
    extra: dict = field(default_factory=dict)

    def targets(self) -> Tensor:
        """[R] log-probs of every sequence token but the first, sequences back to back (input order of the
        pack: `TreeBatch.seq_index`)."""
        index_R = self.batch.seq_token_index[self.batch.target_flat()]
        return self.logp_T[index_R]

    def per_sequence(self, values_T: Tensor | None = None) -> list[Tensor]:
        """Each sequence's [L - 1] log-probs (or entropies: ``values_T=out.entropy_T``), pack order."""
        values_T = self.logp_T if values_T is None else values_T
        index_R = self.batch.seq_token_index[self.batch.target_flat()]
        sizes = (self.batch.lengths - 1).clamp(min=0).tolist()
        return list(torch.split(values_T[index_R], sizes))


# --------------------------------------------------------------------------------------------------
# Token lists -> packs


def plan_packs(arrays: list[np.ndarray], capacity: int | None) -> list[Pack]:
    """Packs of the non-empty sequences: one pack of all of them (``capacity=None``), else treepack's
    packing at ``capacity`` trie tokens per pack. ``seq_index`` refers to positions in ``arrays``."""
    from treepack.pack.packs import pack_rollouts

    keep = np.asarray([i for i, a in enumerate(arrays) if len(a) > 0], dtype=np.int64)
    if len(keep) == 0:
        return []
    r = rollouts_of([arrays[i] for i in keep.tolist()])
    r.ids = keep.tolist()  # errors name the caller's sequence, not its place among the non-empty ones
    packs = pack_rollouts(r, capacity)
    for p in packs:
        p.seq_index = keep[p.seq_index]
    return packs
