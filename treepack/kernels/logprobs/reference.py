"""Pure-torch log-sum-exp / target log-prob of logit rows and their logits gradient (the kernels' reference)."""

from __future__ import annotations

import torch
from torch import Tensor


def lse_and_logprob_reference(logits_CV: Tensor, target_C: Tensor, acc: torch.dtype) -> tuple[Tensor, Tensor]:
    """(log-sum-exp, log-prob of the target) of each row, computed in ``acc``."""
    logits_CV = logits_CV.to(acc)
    lse_C = torch.logsumexp(logits_CV, dim=-1)
    return lse_C, logits_CV.gather(1, target_C[:, None])[:, 0] - lse_C


def grad_logits_reference_(logits_RB: Tensor, lse_R: Tensor, g_R: Tensor, target_R: Tensor, v0: int) -> None:
    """Overwrite a block of logits (vocabulary columns [v0, v0 + B)) with d(sum_r g_r logp_r) / d logits
    = g_r (onehot(target_r) - softmax(logits_r)), computed in ``lse_R``'s dtype: one pointwise pass, in
    place (no second [R, B] buffer at the backward's memory peak), the one-hot a comparison, not a scatter."""
    acc = lse_R.dtype
    hit_RB = (torch.arange(logits_RB.shape[1], device=logits_RB.device) + v0)[None, :] == target_R[:, None]
    p_RB = torch.exp(logits_RB.to(acc) - lse_R[:, None])
    logits_RB.copy_(g_R.to(acc)[:, None] * (hit_RB.to(acc) - p_RB))
