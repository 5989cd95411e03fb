"""Token sequences held in memory -> a `Rollouts` batch, checked as the file readers check theirs.

The file readers (`treepack.io.ingest`) refuse, naming the record, what the later stages cannot take: token ids
that are not integers in [0, 2**31 - 1] (the token buffer is int32), empty sequences, per-token fields of the
wrong length. Batches built in memory go through the same rules here: `rollouts_from_sequences` builds one from
lists, numpy arrays or 1-d tensors, and `check_rollouts` guards the library's entry points (`PrefixTree.build`,
`pack_sequences`, `build_pack`) against a hand-made `Rollouts`, so a bad id fails with one line instead of
wrapping to another token or crashing deep inside. numpy only (a tensor is read through ``.detach().cpu()``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from treepack.errors import InputError
from treepack.io.rollouts import INT32_MAX, Rollouts


def _array(value) -> np.ndarray:
    """A list, numpy array or tensor as a numpy array (no copy where there is none to make)."""
    if hasattr(value, "detach"):  # a torch tensor, without importing torch
        value = value.detach().cpu().numpy()
    return np.asarray(value)


def token_arrays(sequences: Sequence, *, allow_empty: bool = False) -> list[np.ndarray]:
    """Token lists / arrays / 1-d tensors -> int64 numpy arrays; a bad one is an `InputError` naming it."""
    out = []
    for i, s in enumerate(sequences):
        a = _array(s)
        if a.ndim != 1:
            raise InputError(f"sequence {i}: expected a 1-d list of token ids, got shape {list(a.shape)}")
        if a.size == 0:
            if not allow_empty:
                raise InputError(f"sequence {i} is empty (a sequence needs at least one token)")
            out.append(np.zeros(0, np.int64))
            continue
        if not np.issubdtype(a.dtype, np.integer):
            raise InputError(f"sequence {i}: token ids must be integers, got {a.dtype}")
        low, high = int(a.min()), int(a.max())
        if low < 0 or high > INT32_MAX:
            bad = low if low < 0 else high
            raise InputError(f"sequence {i}: token id {bad} is outside [0, {INT32_MAX}]")
        out.append(a.astype(np.int64))
    return out


def rollouts_of(arrays: list[np.ndarray], **fields) -> Rollouts:
    """A batch of already checked int64 token arrays (`token_arrays`); ``fields`` as `Rollouts` takes them."""
    lengths = np.asarray([len(a) for a in arrays], dtype=np.int64)
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = np.concatenate(arrays).astype(np.int32) if arrays else np.zeros(0, np.int32)
    return Rollouts(tokens=tokens, offsets=offsets, ids=list(range(len(arrays))), **fields)


def rollouts_from_sequences(sequences: Sequence, *, loss_masks=None, logprobs=None, rewards=None,
                            advantages=None, groups=None, ids=None) -> Rollouts:
    """A `Rollouts` batch from in-memory token lists (one entry per sequence in each optional field;
    ``loss_masks`` and ``logprobs`` per token, as rollout records store them; ``groups``: GRPO group labels,
    kept as ``tree_id``)."""
    arrays = token_arrays(sequences)
    n = len(arrays)
    lengths = [len(a) for a in arrays]

    def count(values, name):
        if len(values) != n:
            raise InputError(f"{name}: {len(values)} entries for {n} sequences")

    def per_token(values, name, dtype):
        if values is None:
            return None
        count(values, name)
        out = []
        for s, (v, L) in enumerate(zip(values, lengths)):
            v = _array(v).astype(dtype)
            if v.shape != (L,):
                raise InputError(f"{name}: sequence {s} has {v.shape[0] if v.ndim else 0} values for {L} tokens")
            out.append(v)
        return np.concatenate(out) if out else np.zeros(0, dtype)

    def per_seq(values, name):
        if values is None:
            return None
        v = _array(values).astype(np.float64)
        if v.shape != (n,):
            raise InputError(f"{name}: expected one value per sequence ({n}), got shape {list(v.shape)}")
        return v

    r = rollouts_of(arrays, loss_mask=per_token(loss_masks, "loss_masks", np.uint8),
                    logprobs=per_token(logprobs, "logprobs", np.float64),
                    rewards=per_seq(rewards, "rewards"), advantages=per_seq(advantages, "advantages"))
    if groups is not None:
        count(groups, "groups")
        names: dict = {}
        try:
            r.groups = np.asarray([names.setdefault(g, len(names)) for g in groups], dtype=np.int64)
        except TypeError as exc:
            raise InputError(f"groups: labels must be strings or numbers ({exc})") from None
        r.group_names = list(names)
    if ids is not None:
        count(ids, "ids")
        r.ids = list(ids)
    return r


def _require_arrays(tokens, offsets, what: str) -> None:
    if not isinstance(tokens, np.ndarray) or not isinstance(offsets, np.ndarray):
        raise InputError(f"{what}: tokens and offsets must be numpy arrays (rollouts_from_sequences builds a batch "
                         "from lists)")


def check_token_buffer(tokens, offsets, ids: list | None = None, what: str = "Rollouts") -> None:
    """Refuse a flat token buffer the trie cannot take (one line naming the field): tokens not a 1-d integer
    numpy array of ids in [0, 2**31 - 1], offsets not running from 0 to the buffer's end, an empty sequence or
    offsets that go back. O(N), vectorised."""
    _require_arrays(tokens, offsets, what)
    if tokens.ndim != 1 or (tokens.size and not np.issubdtype(tokens.dtype, np.integer)):
        raise InputError(f"{what}: tokens must be a 1-d integer array, got {tokens.dtype} of shape "
                         f"{list(tokens.shape)}")
    if offsets.ndim != 1 or len(offsets) < 1 or not np.issubdtype(offsets.dtype, np.integer):
        raise InputError(f"{what}: offsets must be a 1-d integer array of n + 1 entries")
    if int(offsets[0]) != 0 or int(offsets[-1]) != len(tokens):
        raise InputError(f"{what}: offsets must run from 0 to len(tokens) = {len(tokens):,}, got "
                         f"{int(offsets[0])} .. {int(offsets[-1])}")
    lengths = np.diff(offsets)
    if len(lengths) and int(lengths.min()) <= 0:
        i = int(np.flatnonzero(lengths <= 0)[0])
        name = f"sequence {ids[i]!r}" if ids is not None and i < len(ids) else f"sequence {i}"
        raise InputError(f"{what}: {name} " + ("is empty" if lengths[i] == 0 else "has offsets that go back"))
    if tokens.size:
        low, high = int(tokens.min()), int(tokens.max())
        if low < 0 or high > INT32_MAX:
            raise InputError(f"{what}: token id {low if low < 0 else high} is outside [0, {INT32_MAX}]")


def check_rollouts(r: Rollouts, *, deep: bool = True) -> None:
    """Per-token / per-sequence fields of the right length, and (``deep``) `check_token_buffer` of the batch.
    Without ``deep`` it costs O(1), for callers that check a sub-batch's buffer themselves (`build_pack`, once
    per pack of a large batch)."""
    if deep:
        check_token_buffer(r.tokens, r.offsets, r.ids)
    else:
        _require_arrays(r.tokens, r.offsets, "Rollouts")
    n, N = len(r.offsets) - 1, len(r.tokens)
    if len(r.ids) != n:
        raise InputError(f"Rollouts.ids: {len(r.ids)} entries for {n} sequences")
    for name in ("loss_mask", "logprobs"):
        a = getattr(r, name)
        if a is not None and len(a) != N:
            raise InputError(f"Rollouts.{name}: {len(a):,} values for {N:,} tokens")
    for name in ("groups", "steps", "advantages", "rewards"):
        a = getattr(r, name)
        if a is not None and len(a) != n:
            raise InputError(f"Rollouts.{name}: {len(a):,} values for {n:,} sequences")
