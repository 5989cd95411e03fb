"""The losses RL trainers put on top of token log-probs, as plain functions of per-sequence tensors.

Inputs are what `token_logprobs` returns: one tensor of L_s - 1 target log-probs per sequence (target t
is token t given tokens < t, t = 1..L_s-1). Per-token side inputs (loss masks, behaviour ``old``
log-probs, reference log-probs) may be given per *target* (length L_s - 1) or per *token* (length L_s,
as rollout records store them: the first entry, which nothing predicts, is dropped). A loss row is one
(sequence, target) with mask 1.

Aggregations (how rows become one number; names as in verl's ``loss_agg_mode``), with N = loss rows and
S = sequences with at least one row, both over the whole global batch (`BatchTotals`, pass ``totals`` when
a batch is split over packs, accumulation steps or data-parallel ranks, so the sum of the parts is the
loss of the whole):
- ``token-mean``: sum of row losses / N (DAPO, TRL's default);
- ``seq-mean-token-mean``: mean over sequences of each sequence's row mean (GRPO as published);
- ``seq-mean-token-sum``: mean over sequences of each sequence's row sum;
- ``seq-mean-token-sum-norm``: sum of row losses / (S x ``constant``): Dr. GRPO's constant normaliser
  (TRL's ``dr_grpo``: ``constant`` = max completion length), no length bias.

Objectives: `sft_loss` (NLL); `policy_loss` (PPO-clip, which is GRPO/DAPO's surrogate: ratio = exp(logp -
old), ``-min(ratio A, clip(ratio, 1 - clip_low, 1 + clip_high) A)`` per row, old = the detached current
log-probs where none are given or NaN: on-policy, ratio 1); `gspo_loss` (GSPO: one ratio per sequence,
``exp(mean over its rows of logp - old)``, clipped per sequence, averaged over sequences); and, in both
policy losses, ``kl_coef`` x a KL estimate to reference log-probs (`kl_estimate`: k1 = logp - ref,
k3 = exp(ref - logp) - (ref - logp) - 1, Schulman's unbiased low-variance estimator). Advantages from
group rewards: `grpo_advantages` ((r - group mean) / (group std + eps); ``scale=False``: Dr. GRPO's
unscaled r - mean) and `rloo_advantages` (r minus the mean of the *other* members of the group).

The per-row formulas are those of `treepack.train.losses` (shared with ``treepack train``); everything
here is checked against a plain per-sequence loop in float64 (tests/test_hf_losses.py).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np
import torch
from torch import Tensor

from treepack.errors import TreepackError
from treepack.train.losses import BatchTotals, Objective, kl_estimate

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


class LossInputError(TreepackError):
    """Loss inputs that do not line up with the log-probs (lengths, missing fields)."""


def _aligned(values, logps: Sequence[Tensor], name: str, *, dtype, fill=None) -> Tensor | None:
    """Per-target flat tensor [R] from per-sequence values of length L-1 (targets) or L (tokens). For a bool
    ``dtype`` the values must be 0 or 1 (checked where they are on the host: a GPU tensor is taken as is)."""
    if values is None:
        return None
    if len(values) != len(logps):
        raise LossInputError(f"{name}: {len(values)} sequences, log-probs have {len(logps)}")
    device = logps[0].device if len(logps) else None
    out = []
    for s, (v, lp) in enumerate(zip(values, logps)):
        if dtype == torch.bool and not (isinstance(v, Tensor) and v.device.type != "cpu"):
            host = torch.as_tensor(v)
            odd = host[(host != 0) & (host != 1)] if host.dtype != torch.bool else host[:0]
            if odd.numel():
                raise LossInputError(f"{name}: sequence {s} holds {odd[0].item():g}; a loss mask is 0 or 1")
        v = torch.as_tensor(v, device=device)
        n = lp.shape[0]
        if v.shape[0] == n + 1:
            v = v[1:]
        elif v.shape[0] != n:
            raise LossInputError(f"{name}: sequence {s} has {v.shape[0]} values; its log-probs have {n} "
                                 f"(give one per target, {n}, or one per token, {n + 1})")
        out.append(v.to(dtype))
    return torch.cat(out) if out else torch.zeros(0, dtype=dtype, device=device)


def _rows(logps: Sequence[Tensor], loss_masks) -> tuple[Tensor, Tensor, Tensor, int]:
    """(logp_R, seq_R, mask_R as bool over all targets, S): flat targets of every sequence."""
    if not len(logps):
        raise LossInputError("no sequences")
    logp_R = torch.cat(list(logps))
    lengths = torch.as_tensor([lp.shape[0] for lp in logps], device=logp_R.device)
    seq_R = torch.repeat_interleave(torch.arange(len(logps), device=logp_R.device), lengths)
    mask_R = _aligned(loss_masks, logps, "loss_masks", dtype=torch.bool)
    if mask_R is None:
        mask_R = torch.ones_like(logp_R, dtype=torch.bool)
    return logp_R, seq_R, mask_R, len(logps)


def batch_totals(logps: Sequence[Tensor], loss_masks=None) -> BatchTotals:
    """The normalisers of these sequences: loss rows, and sequences with at least one row."""
    _, seq_R, mask_R, S = _rows(logps, loss_masks)
    per_seq = torch.bincount(seq_R[mask_R], minlength=S)
    return BatchTotals(loss_tokens=int(mask_R.sum()), sequences=int((per_seq > 0).sum()))


def row_weights(seq_R: Tensor, mask_R: Tensor, S: int, aggregation: str, totals: BatchTotals,
                constant: float | None, dtype) -> Tensor:
    """w_R with loss = sum_r w_r loss_r (0 off the mask)."""
    if aggregation not in AGGREGATIONS:
        raise LossInputError(f"aggregation must be one of {', '.join(AGGREGATIONS)}, got {aggregation!r}")
    m = mask_R.to(dtype)
    if aggregation == "token-mean":
        return m / max(totals.loss_tokens, 1)
    seqs = max(totals.sequences, 1)
    if aggregation == "seq-mean-token-mean":
        rows_S = torch.bincount(seq_R, weights=m, minlength=S).clamp(min=1)
        return m / (seqs * rows_S[seq_R])
    if aggregation == "seq-mean-token-sum":
        return m / seqs
    if constant is None or constant <= 0:
        raise LossInputError("aggregation 'seq-mean-token-sum-norm' (Dr. GRPO) needs constant > 0, e.g. the "
                             "max completion length")
    return m / (seqs * float(constant))


def sft_loss(logps: Sequence[Tensor], loss_masks=None, *, aggregation: str = "token-mean",
             totals: BatchTotals | None = None, constant: float | None = None) -> Tensor:
    """Negative log-likelihood of the loss rows, aggregated."""
    logp_R, seq_R, mask_R, S = _rows(logps, loss_masks)
    totals = totals or batch_totals(logps, loss_masks)
    w_R = row_weights(seq_R, mask_R, S, aggregation, totals, constant, logp_R.dtype)
    return -(w_R * logp_R).sum()


def _kl(logp_R, ref_R, kl_coef, estimator):
    if ref_R is None or kl_coef == 0:
        return 0.0
    return kl_coef * kl_estimate(logp_R, ref_R, estimator)


def policy_loss(logps: Sequence[Tensor], old_logps, advantages, loss_masks=None, *, clip_low: float = 0.2,
                clip_high: float = 0.2, aggregation: str = "token-mean", ref_logps=None, kl_coef: float = 0.0,
                kl_estimator: str = "k3", totals: BatchTotals | None = None,
                constant: float | None = None) -> Tensor:
    """PPO-clip / GRPO surrogate with per-sequence advantages (see the module docstring)."""
    logp_R, seq_R, mask_R, S = _rows(logps, loss_masks)
    dtype = logp_R.dtype
    old_R = _aligned(old_logps, logps, "old_logps", dtype=dtype)
    ref_R = _aligned(ref_logps, logps, "ref_logps", dtype=dtype)
    adv_S = torch.as_tensor(advantages, dtype=dtype, device=logp_R.device)
    if adv_S.shape != (S,):
        raise LossInputError(f"advantages: expected one per sequence ({S}), got shape {list(adv_S.shape)}")
    objective = Objective("grpo", clip_low=clip_low, clip_high=clip_high)
    loss_R = objective.grpo_row_loss(logp_R, adv_S[seq_R], old_R, None) + _kl(logp_R, ref_R, kl_coef, kl_estimator)
    totals = totals or batch_totals(logps, loss_masks)
    w_R = row_weights(seq_R, mask_R, S, aggregation, totals, constant, dtype)
    return (w_R * loss_R).sum()


def gspo_loss(logps: Sequence[Tensor], old_logps, advantages, loss_masks=None, *, clip_low: float = 3e-4,
              clip_high: float = 4e-4, ref_logps=None, kl_coef: float = 0.0, kl_estimator: str = "k3",
              totals: BatchTotals | None = None) -> Tensor:
    """GSPO: sequence ratio s = exp(mean over the sequence's rows of logp - old), per-sequence clipped
    surrogate ``-min(s A, clip(s) A)`` averaged over sequences (the KL, if any, as seq-mean-token-mean)."""
    logp_R, seq_R, mask_R, S = _rows(logps, loss_masks)
    dtype = logp_R.dtype
    old_R = _aligned(old_logps, logps, "old_logps", dtype=dtype)
    old_R = logp_R.detach() if old_R is None else torch.where(torch.isnan(old_R), logp_R.detach(), old_R)
    adv_S = torch.as_tensor(advantages, dtype=dtype, device=logp_R.device)
    if adv_S.shape != (S,):
        raise LossInputError(f"advantages: expected one per sequence ({S}), got shape {list(adv_S.shape)}")
    m_R = mask_R.to(dtype)
    rows_S = torch.bincount(seq_R, weights=m_R, minlength=S)
    log_ratio_S = torch.zeros(S, dtype=dtype, device=logp_R.device).index_add(0, seq_R, m_R * (logp_R - old_R))
    ratio_S = torch.exp(log_ratio_S / rows_S.clamp(min=1))
    clipped_S = torch.clamp(ratio_S, 1.0 - clip_low, 1.0 + clip_high)
    loss_S = -torch.minimum(ratio_S * adv_S, clipped_S * adv_S)
    totals = totals or batch_totals(logps, loss_masks)
    loss = (loss_S * (rows_S > 0).to(dtype)).sum() / max(totals.sequences, 1)
    ref_R = _aligned(ref_logps, logps, "ref_logps", dtype=dtype)
    if ref_R is not None and kl_coef:
        w_R = row_weights(seq_R, mask_R, S, "seq-mean-token-mean", totals, None, dtype)
        loss = loss + (w_R * _kl(logp_R, ref_R, kl_coef, kl_estimator)).sum()
    return loss


# --------------------------------------------------------------------------------------------------
# Advantages


def _group_codes(groups: Sequence[Hashable] | None, n: int, group_size: int | None) -> np.ndarray:
    if groups is not None and group_size is not None:
        raise LossInputError("give groups or group_size, not both")
    if group_size is not None:
        if group_size < 1 or n % group_size:
            raise LossInputError(f"{n} rewards do not split into groups of {group_size}")
        return np.arange(n) // group_size
    if groups is None:
        return np.zeros(n, dtype=np.int64)
    if len(groups) != n:
        raise LossInputError(f"groups: {len(groups)} entries for {n} rewards")
    codes: dict = {}
    return np.asarray([codes.setdefault(g, len(codes)) for g in groups], dtype=np.int64)


def grpo_advantages(rewards, groups: Sequence[Hashable] | None = None, *, group_size: int | None = None,
                    scale: bool = True, eps: float = 1e-6, unbiased: bool = True) -> Tensor:
    """GRPO's group-relative advantages: (r - mean of the group) / (std of the group + eps) (float64).

    ``groups``: a label per reward (same label, same prompt), or ``group_size`` for consecutive groups;
    ``scale=False``: Dr. GRPO (no division by the std); ``unbiased``: the sample std (n - 1, as TRL and
    verl compute it; a group of one gets advantage 0)."""
    r = torch.as_tensor(np.asarray(rewards, dtype=np.float64))
    code = torch.as_tensor(_group_codes(groups, r.shape[0], group_size))
    G = int(code.max()) + 1 if r.numel() else 0
    count = torch.bincount(code, minlength=G).to(torch.float64)
    mean = torch.zeros(G, dtype=torch.float64).index_add(0, code, r) / count
    centred = r - mean[code]
    if not scale:
        return centred
    ss = torch.zeros(G, dtype=torch.float64).index_add(0, code, centred**2)
    var = ss / (count - 1).clamp(min=1) if unbiased else ss / count
    return centred / (var.sqrt()[code] + eps)


def rloo_advantages(rewards, groups: Sequence[Hashable] | None = None, *, group_size: int | None = None) -> Tensor:
    """RLOO: r_i minus the mean reward of the other members of its group (a group of one gets 0)."""
    r = torch.as_tensor(np.asarray(rewards, dtype=np.float64))
    code = torch.as_tensor(_group_codes(groups, r.shape[0], group_size))
    G = int(code.max()) + 1 if r.numel() else 0
    count = torch.bincount(code, minlength=G).to(torch.float64)
    total = torch.zeros(G, dtype=torch.float64).index_add(0, code, r)
    others = (count[code] - 1).clamp(min=1)
    adv = r - (total[code] - r) / others
    return torch.where(count[code] > 1, adv, torch.zeros_like(adv))
