"""Execution modes: how one pack becomes one loss with a graph. Same packs, same rows, same loss formula.

- ``dense`` (the baseline): every sequence on its own. The flat concatenation of the pack's sequences is
  rebuilt from the per-sequence paths only (``input_ids[seq_token_index]``, positions 0..L-1), and run as
  independent causal sequences (per-sequence SDPA by default: no code shared with the tree kernel). It
  never reads ``parent``, ``subtree_end``, ``position_ids``, ``scale`` or ``loss_weight``, so a pack whose
  tree fields are wrong still gets a correct baseline and `treepack verify` sees the difference.
  Cost: sum_s L_s tokens (N_flat) through every layer.
- ``tree``: one forward over the pack's T tree tokens with the tree mask (``subtree_end``) and restored
  positions (``position_ids``); each needed pack token p gets one log-prob, read at ``parent[p]``; rows
  gather them, so a shared token's gradient is summed over its sequences (gradient restoration). SFT with
  token-mean uses the fast path over ``loss_weight`` (no per-row tensors). Cost: T = N_tree tokens.
- ``dfs`` (AReaL-DTA; ``treepack/train/dfs.py``): walks the pack's tree depth first, forwarding each
  chain segment over the cached keys/values of its path and back-propagating as it pops, so the live
  graph is bounded by ``dfs_block_size`` tokens. It runs its backward inside the call (``backward_done``);
  callers use ``ModeResult.backward()``, which is ``loss.backward()`` for the other modes.

Legend: T pack tokens, F flat tokens (sum of the pack's sequence lengths), R loss rows, U pack tokens
whose log-prob is needed, D hidden size.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from treepack.errors import ConfigError, TreepackError
from treepack.layout import Pack
from treepack.train.attention import AttentionContext
from treepack.train.losses import BatchTotals, LossRows, Objective, target_logprobs, token_weights_fast
from treepack.train.model import Decoder

MODES = ("dense", "tree", "dfs")


class LayoutError(TreepackError):
    """A pack whose tree fields can not be executed (e.g. a loss target without a parent)."""


@dataclass
class ModeResult:
    loss: Tensor  # scalar, with graph: this pack's share of the batch loss
    logp_R: Tensor  # detached log-probs of the pack's loss rows (sequence-major)
    forward_tokens: int  # tokens the forward computed (N_tree for tree, N_flat for dense)
    metrics: dict = field(default_factory=dict)
    backward_done: bool = False  # dfs back-propagates inside the call; its loss is then detached

    def backward(self) -> None:
        """Back-propagate this pack's loss into the parameters' ``.grad`` (already done for dfs)."""
        if not self.backward_done:
            self.loss.backward()


def _row_dtype(model: Decoder) -> torch.dtype:
    return torch.float64 if model.dtype == torch.float64 else torch.float32


class Mode(ABC):
    """Base: turns (model, pack, rows) into a `ModeResult`; subclasses pick where hidden states come from."""

    name = "mode"

    def __init__(self, attention: str, *, chunk_rows: int) -> None:
        self.attention = attention
        self.chunk_rows = chunk_rows

    @abstractmethod
    def __call__(self, model: Decoder, pack: Pack, rows: LossRows, objective: Objective,
                 totals: BatchTotals) -> ModeResult:
        """One pack's loss (and, for dfs, its gradients) under this mode."""

    def _finish(self, objective: Objective, logp_R: Tensor, tensors: dict, loss: Tensor | None,
                forward_tokens: int) -> ModeResult:
        if loss is None:
            loss = objective.loss(logp_R, **tensors)
        metrics = {}
        if objective.kind == "grpo":
            metrics["clip_fraction"] = objective.clip_fraction(logp_R, tensors.get("behaviour_logp_R"))
        return ModeResult(loss=loss, logp_R=logp_R.detach(), forward_tokens=forward_tokens, metrics=metrics)


class DenseMode(Mode):
    """Each sequence separately: the flat concatenation of the pack's sequences, causal per sequence."""

    name = "dense"

    def __init__(self, attention: str = "sdpa", *, chunk_rows: int = 4096) -> None:
        super().__init__(attention, chunk_rows=chunk_rows)

    def __call__(self, model, pack, rows, objective, totals) -> ModeResult:
        dev = model.device
        offsets_S1 = np.asarray(pack.seq_offsets, dtype=np.int64)
        lengths_S = np.diff(offsets_S1)
        index_F = np.asarray(pack.seq_token_index, dtype=np.int64)
        ids_F = torch.as_tensor(np.asarray(pack.input_ids)[index_F], dtype=torch.long, device=dev)
        pos_F = np.arange(index_F.shape[0], dtype=np.int64) - np.repeat(offsets_S1[:-1], lengths_S)
        pos_F = torch.as_tensor(pos_F, device=dev)
        attn = AttentionContext.causal([n for n in lengths_S.tolist() if n > 0], self.attention, device=dev)
        hidden_FD = model(ids_F, pos_F, attn).hidden_TD
        flat_R = torch.as_tensor(rows.flat_R, device=dev)
        logp_R = target_logprobs(hidden_FD[flat_R - 1], model.head_weight, ids_F[flat_R], self.chunk_rows,
                                 compiled=model.uses_compiled(dev))
        tensors = objective.row_tensors(rows, totals, device=dev, dtype=_row_dtype(model))
        return self._finish(objective, logp_R, tensors, None, int(index_F.shape[0]))


class TreeMode(Mode):
    """One forward over the pack's tree tokens; log-probs read at ``parent``; rows gather them."""

    name = "tree"

    def __init__(self, attention: str = "auto", *, chunk_rows: int = 4096, sft_fast_path: bool = True) -> None:
        super().__init__(attention, chunk_rows=chunk_rows)
        self.sft_fast_path = sft_fast_path

    def __call__(self, model, pack, rows, objective, totals) -> ModeResult:
        dev = model.device
        T = pack.n_tokens
        ids_T = torch.tensor(np.asarray(pack.input_ids), dtype=torch.long, device=dev)
        pos_T = torch.tensor(np.asarray(pack.position_ids), dtype=torch.long, device=dev)
        subtree_end_T = torch.tensor(np.asarray(pack.subtree_end), dtype=torch.int32, device=dev)
        attn = AttentionContext.tree(subtree_end_T, self.attention)
        hidden_TD = model(ids_T, pos_T, attn).hidden_TD

        fast = self.sft_fast_path and objective.kind == "sft"
        if fast:
            fast_U, fast_w_U = token_weights_fast(pack, rows, totals, objective.normalization)
            token_U = np.union1d(fast_U, rows.token_R)
        else:
            token_U = np.unique(rows.token_R)
        parent_U = np.asarray(pack.parent, dtype=np.int64)[token_U]
        bad = (parent_U < 0) | (parent_U >= T)
        if bad.any():
            u = int(token_U[np.argmax(bad)])
            raise LayoutError(f"pack token {u} is a training target but its parent is {int(parent_U[np.argmax(bad)])}")
        token_U_t = torch.as_tensor(token_U, device=dev)
        logp_U = target_logprobs(hidden_TD[torch.as_tensor(parent_U, device=dev)], model.head_weight,
                                 ids_T[token_U_t], self.chunk_rows, compiled=model.uses_compiled(dev))
        # Rows gather their token's log-prob: the gather's backward sums shared tokens' gradients.
        logp_R = logp_U[torch.as_tensor(np.searchsorted(token_U, rows.token_R), device=dev)]
        row_dtype = _row_dtype(model)
        loss = None
        if fast:
            weight_U = np.zeros(token_U.shape[0], dtype=np.float64)
            weight_U[np.searchsorted(token_U, fast_U)] = fast_w_U
            loss = -(torch.as_tensor(weight_U, dtype=row_dtype, device=dev) * logp_U).sum()
            tensors = {}
        else:
            tensors = objective.row_tensors(rows, totals, device=dev, dtype=row_dtype)
        return self._finish(objective, logp_R, tensors, loss, T)


def make_mode(name: str, *, attention: str | None = None, chunk_rows: int = 4096,
              sft_fast_path: bool = True, dfs_block_size: int | None = 2048, dfs_keep_tokens: int = 0,
              dfs_order: str = "backward", dfs_subtree_calls: bool = True) -> Mode:
    """A mode by name; ``attention`` None picks its default (dense: sdpa, tree and dfs: auto)."""
    if name == "dfs":
        from treepack.train.dfs import DfsMode

        return DfsMode(attention or "auto", chunk_rows=chunk_rows, block_size=dfs_block_size,
                       keep_tokens=dfs_keep_tokens, order=dfs_order, sft_fast_path=sft_fast_path,
                       subtree_calls=dfs_subtree_calls)
    if name == "dense":
        return DenseMode(attention or "sdpa", chunk_rows=chunk_rows)
    if name == "tree":
        if attention == "sdpa":
            raise ConfigError("attention 'sdpa' runs independent causal sequences; tree mode needs a tree kernel "
                              "(auto, reference, flex or triton)")
        return TreeMode(attention or "auto", chunk_rows=chunk_rows, sft_fast_path=sft_fast_path)
    raise ConfigError(f"unknown mode {name!r} (modes: {', '.join(MODES)})")
