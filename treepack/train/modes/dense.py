"""Dense baselines: the pack's sequences as independent causal sequences, in memory-bounded micro-batches.

- ``dense``: every sequence, whole (N_flat tokens; a sequence without a loss target is skipped): what a
  trainer without prefix sharing computes.
- ``dense-leaf``: one sequence per leaf of the pack's sub-trie, cut after its last loss target; a
  duplicate or a prefix of another sequence is not forwarded: its loss rows read the log-probs of a leaf
  lane whose path holds their targets (the same hidden state: causal attention never looks ahead). This
  is the strongest simple baseline (what a careful user does by hand), and it trains the same loss.

Both read only the sequences' own fields (``seq_offsets``, ``seq_token_index``, ``input_ids``), never
``parent``/``subtree_end``/``position_ids``/``loss_weight``: `treepack verify` compares the tree modes
against them. Plan (lanes, micro-batches, where each row reads): `treepack.train.data.plan_dense`.

Memory. The lanes are forwarded in micro-batches of at most ``micro_batch_tokens`` tokens (default: the
pack's own token count, so a dense step never holds more tokens than the tree step of the same pack),
each back-propagated before the next is forwarded: gradients accumulate in ``.grad``, the live graph is
one micro-batch. Before, dense forwarded all of a pack's sequences at once, and those hold several times
the pack's tokens (the tau-bench sample's first 16K pack: 92,852 flat tokens for 14,346 pack tokens). On
an H100 (Qwen3-0.6B shape, bf16, 3 packs of 16K per step, benchmarks/results/2026-11-25-dense-modes-verify-
h100.md) dense now peaks at 45.6 GB and dense-leaf at 50.7 GB against tree's 47.2 GB on the same packs. The
mode therefore back-propagates inside the call (``ModeResult.backward_done``), like dfs.

Exactness. A row's loss term depends only on its own log-prob and its fixed per-row inputs (weight,
advantage, behaviour log-prob), so the pack's loss is the sum of its micro-batches' losses and the
gradient the sum of theirs. Rows that read one (lane, position) share one log-prob through a gather,
whose backward sums their gradients, exactly as tree mode's rows share a pack token.

Legend: Q lanes (forwarded sequences), B micro-batches, R loss rows, N tokens of a micro-batch, U
distinct positions its rows read, D hidden size.
"""

from __future__ import annotations

import numpy as np
import torch

from treepack.io.rollouts import ranges
from treepack.train.attention import AttentionContext
from treepack.train.data import DensePlan, plan_dense
from treepack.train.losses import target_logprobs
from treepack.train.modes.base import Mode, ModeResult, row_dtype
from treepack.train.transfer import to_device
from treepack.train.working_weights import head_copy

DENSE_MODES = ("dense", "dense-leaf")


class DenseMode(Mode):
    """Each sequence on its own (``leaves``: only the leaf sequences), micro-batched, backward inside."""

    def __init__(self, attention: str = "auto", *, chunk_rows: int = 4096, leaves: bool = False,
                 micro_batch_tokens: int | None = None) -> None:
        super().__init__(attention, chunk_rows=chunk_rows)
        self.leaves = leaves
        self.micro_batch_tokens = micro_batch_tokens
        self.name = "dense-leaf" if leaves else "dense"

    def plan(self, pack, rows) -> DensePlan:
        """This pack's lanes and micro-batches (numpy only: what `auto` costs before choosing)."""
        budget = self.micro_batch_tokens or pack.n_tokens
        return plan_dense(pack, rows.token_R, rows.seq_R, rows.flat_R, leaves=self.leaves, budget=budget)

    def __call__(self, model, pack, rows, objective, totals) -> ModeResult:
        plan = self.plan(pack, rows)
        dev = model.device
        dtype_R = row_dtype(model)
        compiled = model.uses_compiled(dev)
        ids_T = np.asarray(pack.input_ids, dtype=np.int64)
        offsets_S1 = np.asarray(pack.seq_offsets, dtype=np.int64)
        index_F = np.asarray(pack.seq_token_index, dtype=np.int64)
        target_R = ids_T[rows.token_R]
        tensors = objective.row_tensors(rows, totals, device=dev, dtype=dtype_R)
        logp_R = torch.zeros(rows.n_rows, dtype=dtype_R, device=dev)
        loss = torch.zeros((), dtype=dtype_R, device=dev)
        for b, rows_b in enumerate(plan.batch_rows()):
            lo, hi = int(plan.batch_B1[b]), int(plan.batch_B1[b + 1])
            length_Q = plan.length_Q[lo:hi]
            flat_N = ranges(offsets_S1[plan.seq_Q[lo:hi]], length_Q)
            pos_N = ranges(np.zeros(hi - lo, dtype=np.int64), length_Q)
            start_Q = np.cumsum(length_Q) - length_Q
            hidden_b = start_Q[plan.lane_R[rows_b] - lo] + plan.pos_R[rows_b] - 1
            read_U, first_U, inverse_b = np.unique(hidden_b, return_index=True, return_inverse=True)
            attn = AttentionContext.causal(length_Q.tolist(), self.attention, device=dev)
            # every host array goes up through `to_device` (pinned, queued): a pageable copy would wait for the
            # GPU to drain, and a step of many short sequences would idle the GPU between micro-batches
            hidden_ND = model(to_device(ids_T[index_F[flat_N]], dev), to_device(pos_N, dev), attn).hidden_TD
            logp_U = target_logprobs(hidden_ND[to_device(read_U, dev)], model.head_weight,
                                     to_device(target_R[rows_b[first_U]], dev), self.chunk_rows,
                                     compiled=compiled, working=head_copy(model))
            rows_b_t = to_device(rows_b, dev)
            logp_b = logp_U[to_device(inverse_b.reshape(-1), dev)]
            loss_b = objective.loss(logp_b, **{k: v[rows_b_t] for k, v in tensors.items()})
            loss_b.backward()
            loss += loss_b.detach()
            logp_R[rows_b_t] = logp_b.detach()
        metrics = {"micro_batches": plan.n_batches}
        if objective.kind == "grpo":
            metrics["clip_fraction"] = objective.clip_fraction(logp_R, tensors.get("behaviour_logp_R"))
        return ModeResult(loss=loss, logp_R=logp_R, forward_tokens=plan.tokens, metrics=metrics, backward_done=True,
                          predicted_tokens=plan.predicted, attention_pairs=plan.pairs)
