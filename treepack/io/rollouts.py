"""A batch of rollouts in flat arrays: the one data structure every stage after reading works on.

A ``Rollouts`` batch is columnar: one flat int32 token buffer plus int64 offsets (the Arrow list layout),
so memory stays ~ the token data (4 bytes a token) and every downstream step (sorting, LCPs, packing) is
vectorised numpy over that buffer. Reading and validating input files is `treepack.io.ingest`; the way back
out (records, Arrow, files) is `treepack.io.records`.
"""


from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from treepack.io.extras import Extras

TOKEN_ALIASES = ("input_ids", "tokens", "token_ids")
GROUP_ALIASES = ("tree_id", "group_id")
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # JSON integers have no bounds; steps, int ids and shards do

Progress = Callable[[int], None]  # called with the number of input bytes just consumed


@dataclass
class Source:
    """One input file: where it came from, its content hash and what was read from it."""

    path: str
    sha256: str
    n_records: int = 0  # records kept
    n_skipped: int = 0  # records skipped (only with on_error="skip")
    format: str = "jsonl"


@dataclass
class Rollouts:
    """A batch of rollout sequences as flat columnar arrays (n = sequences, N = their total tokens)."""

    tokens: np.ndarray  # int32 [N] all sequences back to back
    offsets: np.ndarray  # int64 [n+1] sequence i is tokens[offsets[i]:offsets[i+1]]
    ids: list  # [n] sample ids (str or int; default: 0-based record index in its file)
    loss_mask: np.ndarray | None = None  # uint8 [N] 1 = training target (None: all ones)
    logprobs: np.ndarray | None = None  # float64 [N] behaviour log-probs (NaN where a record had none)
    groups: np.ndarray | None = None  # int64 [n] code of tree_id/group_id (index into group_names)
    group_names: list | None = None  # distinct tree_id values in first-seen order
    steps: np.ndarray | None = None  # int64 [n] training step
    advantages: np.ndarray | None = None  # float64 [n] (NaN where a record had none)
    rewards: np.ndarray | None = None  # float64 [n] (NaN where a record had none)
    sources: list[Source] = field(default_factory=list)
    skipped: Counter = field(default_factory=Counter)  # reason -> count
    skipped_examples: list[str] = field(default_factory=list)  # first few skip messages, verbatim
    skipped_files: list[tuple[str, str]] = field(default_factory=list)  # (path, why) of files a directory had
    n_duplicate_ids: int = 0  # records whose given id an earlier record already had
    duplicate_example: str | None = None  # where the first such id is, verbatim
    extras: Extras | None = None  # what an exact unpack needs besides the fields above (`treepack.io.extras`)

    def __len__(self) -> int:
        return int(self.offsets.shape[0] - 1)

    @property
    def n_sequences(self) -> int:
        return len(self)

    @property
    def n_tokens(self) -> int:
        return int(self.offsets[-1])

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def n_skipped(self) -> int:
        return int(sum(self.skipped.values()))

    def sequence(self, i: int) -> np.ndarray:
        """Sequence ``i``'s tokens (a view of the flat buffer)."""
        return self.tokens[self.offsets[i] : self.offsets[i + 1]]

    def loss_mask_of(self, i: int) -> np.ndarray:
        """Sequence ``i``'s loss mask (all ones when the batch has none)."""
        n = int(self.offsets[i + 1] - self.offsets[i])
        if self.loss_mask is None:
            return np.ones(n, dtype=np.uint8)
        return self.loss_mask[self.offsets[i] : self.offsets[i + 1]]

    def select(self, index: np.ndarray) -> Rollouts:
        """The sub-batch of the given sequence indices, in that order."""
        index = np.asarray(index, dtype=np.int64)
        starts, lens = self.offsets[:-1][index], self.lengths[index]
        offsets = np.zeros(len(index) + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        gather = ranges(starts, lens)

        def take_flat(a):
            return None if a is None else a[gather]

        def take_seq(a):
            return None if a is None else a[index]

        return Rollouts(
            tokens=self.tokens[gather],
            offsets=offsets,
            ids=[self.ids[i] for i in index.tolist()],
            loss_mask=take_flat(self.loss_mask),
            logprobs=take_flat(self.logprobs),
            groups=take_seq(self.groups),
            group_names=self.group_names,
            steps=take_seq(self.steps),
            advantages=take_seq(self.advantages),
            rewards=take_seq(self.rewards),
            sources=self.sources,
            extras=None if self.extras is None else self.extras.select(index),
        )


def ranges(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(s, s + l)`` for each (s, l), vectorised."""
    lens = np.asarray(lens, dtype=np.int64)
    seg_start = np.cumsum(lens) - lens
    return np.arange(int(lens.sum()), dtype=np.int64) + np.repeat(np.asarray(starts, np.int64) - seg_start, lens)
