"""A pack laid out for training: the arrays of DESIGN §6, in DFS preorder of the pack's sub-trie.

Legend: T = tokens in the pack (real + padding), S = sequences in the pack, F = sum of the S sequences'
lengths (their flat tokens).

Mask contract: query q may attend key k iff ``k <= q < subtree_end[k]`` (k is q or one of its ancestors).
In DFS preorder the subtree of k is the contiguous range ``[k, subtree_end[k])``, so one int per token
replaces the T x T mask. The logits at ``parent[p]`` predict ``input_ids[p]``: a branch point's hidden state
feeds every child's target, with no special case.

Per-sequence token fields (loss mask, behaviour log-probs) live in flat ``[F]`` arrays split by
``seq_offsets``: a token shared by several sequences may be a training target in one and context in
another (multi-turn histories), so these can not be per pack token. ``seq_token_index[seq_offsets[s] + j]``
is the pack index of sequence s's j-th token: its path, root to leaf.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from treepack.errors import TreepackError


@dataclass
class Pack:
    """One training pack (the trainer's unit of a forward/backward pass)."""

    input_ids: np.ndarray  # int32 [T] token ids (0 at padding)
    position_ids: np.ndarray  # int32 [T] depth = offset in the original sequence (RoPE positions)
    parent: np.ndarray  # int32 [T] index of the previous token on the path, -1 at a root (and padding)
    subtree_end: np.ndarray  # int32 [T] exclusive end of the token's subtree (padding: q + 1)
    scale: np.ndarray  # float32 [T] sequences of the pack whose path contains the token
    loss_weight: np.ndarray  # float32 [T] sequences of the pack that train on predicting this token
    n_real: int  # tokens [0, n_real) are real, [n_real, T) padding
    seq_ids: list  # [S] sample ids (str or int) as in the input
    seq_index: np.ndarray  # int64 [S] global record index in the input (restores input order)
    seq_leaf: np.ndarray  # int32 [S] pack index of each sequence's last token
    seq_offsets: np.ndarray  # int64 [S+1] split of the flat per-sequence-token arrays below
    seq_token_index: np.ndarray  # int32 [F] pack index of each sequence's j-th token (its path)
    seq_loss_mask: np.ndarray  # uint8 [F] 1 where that sequence trains on the token
    seq_logprobs: np.ndarray | None = None  # float64 [F] behaviour log-probs, when the input had them
    advantages: np.ndarray | None = None  # float64 [S] per-sequence advantage, when present
    rewards: np.ndarray | None = None  # float64 [S] per-sequence reward, when present
    seq_groups: list | None = None  # [S] tree_id/group_id of each sequence, when present
    seq_steps: np.ndarray | None = None  # int64 [S] training step of each sequence, when present
    meta: dict = field(default_factory=dict)

    @property
    def n_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def n_sequences(self) -> int:
        return int(self.seq_leaf.shape[0])

    @property
    def seq_lengths(self) -> np.ndarray:
        return np.diff(self.seq_offsets)

    def path(self, s: int) -> np.ndarray:
        """Pack indices of sequence ``s``'s tokens, root to leaf."""
        return self.seq_token_index[self.seq_offsets[s] : self.seq_offsets[s + 1]]

    def sequence_tokens(self, s: int) -> np.ndarray:
        return self.input_ids[self.path(s)]
