"""``tree``: one forward over the pack's T tree tokens with the tree mask; every shared prefix computed once.

Attention follows ``subtree_end`` (query q sees key k iff k <= q < subtree_end[k]) and positions are restored
from ``position_ids``; each needed pack token p gets one log-prob, read at ``parent[p]``, and loss rows gather
them, so a shared token's gradient is summed over its sequences (gradient restoration). SFT with token-mean
uses the fast path over ``loss_weight`` (no per-row tensors). Cost: T = N_tree tokens.

Legend: T pack tokens, R loss rows, U pack tokens whose log-prob is needed, D hidden size.
"""

from __future__ import annotations

import numpy as np
import torch

from treepack.train.attention import AttentionContext
from treepack.train.losses import target_logprobs, token_weights_fast
from treepack.train.modes.base import LayoutError, Mode, ModeResult, row_dtype
from treepack.train.transfer import to_device
from treepack.train.working_weights import head_copy


class TreeMode(Mode):
    """One forward over the pack's tree tokens; log-probs read at ``parent``; rows gather them."""

    name = "tree"

    def __init__(self, attention: str = "auto", *, chunk_rows: int = 4096, sft_fast_path: bool = True) -> None:
        super().__init__(attention, chunk_rows=chunk_rows)
        self.sft_fast_path = sft_fast_path

    def __call__(self, model, pack, rows, objective, totals) -> ModeResult:
        dev = model.device
        T = pack.n_tokens
        ids_T = to_device(np.asarray(pack.input_ids), dev, torch.long)
        pos_T = to_device(np.asarray(pack.position_ids), dev, torch.long)
        subtree_end_T = to_device(np.asarray(pack.subtree_end), dev, torch.int32)
        attn = AttentionContext.tree(subtree_end_T, self.attention, host=np.asarray(pack.subtree_end),
                                     whole_tokens=pack.meta.get("piece_of_tokens", 0))
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
        token_U_t = to_device(token_U, dev)
        logp_U = target_logprobs(hidden_TD[to_device(parent_U, dev)], model.head_weight,
                                 ids_T[token_U_t], self.chunk_rows, compiled=model.uses_compiled(dev),
                                 working=head_copy(model))
        # Rows gather their token's log-prob: the gather's backward sums shared tokens' gradients.
        logp_R = logp_U[to_device(np.searchsorted(token_U, rows.token_R), dev)]
        rows_dtype = row_dtype(model)
        loss = None
        if fast:
            weight_U = np.zeros(token_U.shape[0], dtype=np.float64)
            weight_U[np.searchsorted(token_U, fast_U)] = fast_w_U
            loss = -(to_device(weight_U, dev, rows_dtype) * logp_U).sum()
            tensors = {}
        else:
            tensors = objective.row_tensors(rows, totals, device=dev, dtype=rows_dtype)
        return self._finish(objective, logp_R, tensors, loss, T)
