"""Losses per (sequence, token), identical whether log-probs come from tree tokens or flat sequences.

A loss **row** is one (sequence s, position j >= 1) with ``loss_mask = 1``: the log-prob of s's j-th token
given its first j tokens. Every mode produces the same rows in the same order (sequence-major), so the
loss formula is shared verbatim and the modes differ only in where a row's hidden state comes from:
- dense: row (s, j) reads the flat concatenation of the pack's sequences at ``offset_s + j - 1``;
- tree: row (s, j) targets pack token ``p = path_s[j]`` and reads the hidden state at ``parent[p]``.
  Shared prefix tokens are computed once (one log-prob per pack token) and gathered into every row that
  uses them, so autograd sums their gradients over the sequences: this *is* Tree Training's gradient
  restoration (the scaler of §3.2.4 falls out of the gather's backward), with no explicit scale tensor.

Objectives (``Objective``):
- SFT: ``-sum_rows w_r * logp_r``.
- GRPO / PPO-clip: ``ratio = exp(logp - behaviour_logp)`` (behaviour log-probs from the data, else the
  detached current ones: on-policy, ratio 1), per-sequence advantage A, ``loss_r = -min(ratio * A,
  clip(ratio, 1 - eps_low, 1 + eps_high) * A)``, plus an optional ``kl_coef`` x k3-estimator KL to the
  reference log-probs (off by default).
- Normalisation weights ``w_r``, fixed over the *global batch* (all packs of one optimizer step) before
  any forward, so gradient accumulation over packs is exact: ``token`` mean (``1 / loss tokens of the
  batch``) or ``sequence`` mean (``1 / (sequences of the batch * loss tokens of s)``).
- Fast SFT path (tree mode, token mean): ``-sum_p loss_weight[p] * logp_p / N`` over pack tokens, with
  ``loss_weight[p]`` = how many sequences train on p; no per-sequence arrays at all.

Log-probs never materialise full-vocabulary logits for all rows: `target_logprobs` computes them in row
chunks, saving only the hidden rows and one log-sum-exp per row, and recomputes them in backward in
vocabulary blocks of the same size. For V = 151,936 and 4,096-row chunks the live logits are 2.5 GB in float32 instead of
19 GB for a 32k-token pack.

Legend: R loss rows, U pack tokens whose log-prob is needed, S sequences, T pack tokens, F flat tokens
(sum of sequence lengths), D hidden size, V vocabulary, C rows of a chunk.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from treepack.errors import ConfigError, InputError, TreepackError
from treepack.kernels.logprobs import (
    grad_logits_reference_,
    grad_logits_triton_,
    lse_and_logprob_reference,
    lse_and_logprob_triton,
    triton_supported,
)
from treepack.pack.layout import Pack
from treepack.train.compiled import pick
from treepack.train.transfer import to_device

LOSSES = ("sft", "grpo")
NORMALIZATIONS = ("token", "sequence")
DEFAULT_CHUNK_ROWS = 4096


# --------------------------------------------------------------------------------------------------
# Chunked log-probs of targets


def _mm_dtype(hidden: Tensor) -> torch.dtype:
    dev = hidden.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return hidden.dtype


LOGPROB_KERNELS = "auto"  # auto: `treepack.kernels.logprobs`' Triton kernels where they run, compiled path or
# eager; "inductor": the reference everywhere, compiled by Inductor on the compiled path (the A/B baseline of
# benchmarks/logprob_kernels.py)


def _triton_logprobs(logits: Tensor, acc: torch.dtype) -> bool:
    """Whether the Triton kernels run on these logits: CUDA, float32 accumulation (eager callers, such as
    `treepack.hf`'s head, included).

    Why: compiled from the reference, Inductor read a 4,096 x 151,936 bf16 chunk at 1.29 TB/s (0.965 ms; its
    log-sum-exp reads each row twice) and rewrote a backward block at 1.20 TB/s; the kernels 2.65 / 2.68 TB/s
    (1x H100, results/2026-11-26-logprob-kernels-h100.md)."""
    return LOGPROB_KERNELS == "auto" and acc == torch.float32 and triton_supported(logits)


MIN_STATIC_ROWS = 64
STATIC_CHUNKS = True  # False: one dynamic-shape graph for every chunk (the A/B baseline of benchmarks/logprobs.py)


def static_rows(rows: int, chunk: int) -> int:
    """Rows a compiled forward chunk of ``rows`` rows is computed over: the smallest of ``chunk``,
    ``chunk / 4``, ``chunk / 16``, ... (at least `MIN_STATIC_ROWS`) that holds them.

    Why: compiled with dynamic shapes, the log-sum-exp reduction keeps the launch configuration Inductor
    picked for its first launch, whatever the row counts after. In one dfs process that kernel took 80 ms of
    a 1.0 s step (3.2 ms a launch), in another under 11 ms; with static shapes it was not among a profiled
    step's 16 longest kernels (< 9 ms), and 4 full 1,024-row chunks took 3.00 ms against 3.37-3.73 ms
    dynamic (1x H100, results/2026-11-26-logprob-chunks-dfs-h100.md). Each static shape is tuned at its
    own size."""
    size = max(chunk, 1)
    while size // 4 >= max(rows, MIN_STATIC_ROWS):
        size //= 4
    return size


def _padded_chunk_logprobs(h_RD: Tensor, w_VD: Tensor, target_R: Tensor, chunk: int, acc: torch.dtype,
                           lse_R: Tensor, logp_R: Tensor) -> None:
    """The compiled forward: each chunk's logits written into a buffer of `static_rows` rows, so the
    compiled reduction sees a few static shapes. Rows past the chunk's own hold stale values; each row is
    reduced on its own and those results are dropped."""
    R, V = h_RD.shape[0], w_VD.shape[0]
    if R == 0:
        return
    logprobs = pick(lse_and_logprob_reference, True, dynamic=False)
    last = R - (R - 1) // chunk * chunk
    padded_R = R - last + static_rows(last, chunk)
    target_P = F.pad(target_R, (0, padded_R - R))
    buffer_SV: Tensor | None = None
    with torch.autocast(h_RD.device.type, enabled=False):  # an out= matmul; inputs are already cast
        for r0 in range(0, R, chunk):
            C = min(chunk, R - r0)
            S = static_rows(C, chunk)
            if buffer_SV is None or buffer_SV.shape[0] != S:
                buffer_SV = h_RD.new_empty(S, V)
            torch.mm(h_RD[r0 : r0 + C], w_VD.T, out=buffer_SV[:C])
            lse_S, logp_S = logprobs(buffer_SV, target_P[r0 : r0 + S], acc)
            lse_R[r0 : r0 + C], logp_R[r0 : r0 + C] = lse_S[:C], logp_S[:C]


_WIDE_GEMM: dict[str, bool] = {"cuda": True}


def _matmul_into(out: Tensor, a: Tensor, b: Tensor, *, accumulate: bool) -> None:
    """``out (+)= a @ b`` where ``out`` may be wider than ``a`` and ``b`` (16-bit inputs, float32 result).

    On CUDA cuBLAS's 16-bit-in, float32-out GEMM (``mm``/``addmm`` with ``out_dtype``) writes the result
    in place, with no 16-bit product and no float32 copy of it; elsewhere (CPU, an older torch) the product
    is formed in the input dtype and cast."""
    if out.dtype == a.dtype:
        if accumulate:
            out.addmm_(a, b)
        else:
            torch.mm(a, b, out=out)
        return
    dev = out.device.type
    if _WIDE_GEMM.get(dev, False):
        try:
            if accumulate:
                torch.ops.aten.addmm.dtype_out(out, a, b, out.dtype, out=out)
            else:
                torch.ops.aten.mm.dtype_out(a, b, out.dtype, out=out)
            return
        except (RuntimeError, AttributeError, NotImplementedError):
            _WIDE_GEMM[dev] = False
    if accumulate:
        out += (a @ b).to(out.dtype)
    else:
        out.copy_(a @ b)


def vocab_block(rows: int, vocab: int, chunk_rows: int) -> int:
    """Vocabulary columns per backward block: as many logits as a forward chunk of ``chunk_rows`` rows
    (rows x block <= chunk_rows x vocab), a multiple of 128."""
    blocks = max(1, -(-rows // max(chunk_rows, 1)))
    per_block = -(-vocab // blocks)
    return min(vocab, -(-per_block // 128) * 128)


class _TargetLogProb(torch.autograd.Function):
    """logp_R = log_softmax(hidden_RD @ weight_VD.T)[r, target_R[r]], logits recomputed in backward.

    Forward: row chunks (a row's log-sum-exp needs its whole vocabulary), saving one log-sum-exp per row.
    Backward: vocabulary blocks over all rows at once, as many logits per block as a forward chunk. Each
    block's weight gradient is then one GEMM over every row (float32 accumulation inside cuBLAS, rounded
    once) written straight into its rows of the result, and the hidden-state gradient, [R, D], is the
    small sum. Row chunks would need a [V, D] float32 accumulator beside the result (0.58 GiB for Qwen3's
    vocabulary) at the moment a DFS call's whole graph is alive: its memory peak."""

    @staticmethod
    def forward(ctx, hidden_RD: Tensor, weight_VD: Tensor, target_R: Tensor, chunk: int, compiled: bool,
                working_VD: Tensor | None) -> Tensor:
        mm = _mm_dtype(hidden_RD)
        acc = torch.float64 if mm == torch.float64 else torch.float32
        h_RD, w_VD = hidden_RD.to(mm), _operand(weight_VD, working_VD, mm)
        R = h_RD.shape[0]
        logp_R = torch.empty(R, dtype=acc, device=h_RD.device)
        lse_R = torch.empty(R, dtype=acc, device=h_RD.device)
        if R and _triton_logprobs(h_RD, acc):
            buffer_CV = h_RD.new_empty(min(chunk, R), w_VD.shape[0])
            with torch.autocast(h_RD.device.type, enabled=False):  # an out= matmul; inputs are already cast
                for r0 in range(0, R, chunk):
                    C = min(chunk, R - r0)
                    torch.mm(h_RD[r0 : r0 + C], w_VD.T, out=buffer_CV[:C])
                    lse_and_logprob_triton(buffer_CV[:C], target_R[r0 : r0 + C], acc,
                                           out=(lse_R[r0 : r0 + C], logp_R[r0 : r0 + C]))
        elif compiled and STATIC_CHUNKS:
            _padded_chunk_logprobs(h_RD, w_VD, target_R, chunk, acc, lse_R, logp_R)
        else:
            logprobs = pick(lse_and_logprob_reference, compiled)
            for r0 in range(0, R, chunk):
                lse_R[r0 : r0 + chunk], logp_R[r0 : r0 + chunk] = logprobs(
                    h_RD[r0 : r0 + chunk] @ w_VD.T, target_R[r0 : r0 + chunk], acc
                )
        ctx.save_for_backward(hidden_RD, weight_VD, target_R, lse_R)
        ctx.chunk, ctx.mm, ctx.compiled = chunk, mm, compiled
        ctx.working, ctx.weight = working_VD, weight_VD  # the parameter itself: its .grad at backward time
        return logp_R

    @staticmethod
    def backward(ctx, grad_R: Tensor):
        hidden_RD, weight_VD, target_R, lse_R = ctx.saved_tensors
        mm = ctx.mm
        acc = lse_R.dtype
        h_RD, w_VD = hidden_RD.to(mm), _operand(weight_VD, ctx.working, mm)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        R, V = h_RD.shape[0], w_VD.shape[0]
        grad_h_RD = torch.zeros(hidden_RD.shape, dtype=acc, device=h_RD.device) if need_h else None
        # with a working copy the weight's gradient goes straight into its .grad once that exists (no [V, D]
        # gradient for autograd to add): `treepack.train.working_weights`
        into_VD = ctx.weight.grad if need_w and ctx.working is not None else None
        grad_w_VD = torch.empty_like(weight_VD) if need_w and into_VD is None else None
        B = vocab_block(R, V, ctx.chunk)
        for v0 in range(0, V, B):
            w_BD = w_VD[v0 : v0 + B]
            grad_RB = h_RD @ w_BD.T
            grad_logits_ = (grad_logits_triton_ if _triton_logprobs(grad_RB, acc)
                            else pick(grad_logits_reference_, ctx.compiled))
            grad_logits_(grad_RB, lse_R, grad_R, target_R, v0)
            if need_h:
                _matmul_into(grad_h_RD, grad_RB, w_BD, accumulate=True)
            if into_VD is not None:
                _matmul_into(into_VD[v0 : v0 + B], grad_RB.T, h_RD, accumulate=True)
            elif need_w:
                _matmul_into(grad_w_VD[v0 : v0 + B], grad_RB.T, h_RD, accumulate=False)
            del grad_RB
        if need_h:
            grad_h_RD = grad_h_RD.to(hidden_RD.dtype)
        return grad_h_RD, grad_w_VD, None, None, None, None


def _operand(weight_VD: Tensor, working_VD: Tensor | None, mm: torch.dtype) -> Tensor:
    """The head weight in the matmul dtype: its working copy when that holds this dtype, else a cast."""
    return working_VD if working_VD is not None and working_VD.dtype == mm else weight_VD.to(mm)


def target_logprobs(hidden_RD: Tensor, weight_VD: Tensor, target_R: Tensor,
                    chunk_rows: int = DEFAULT_CHUNK_ROWS, *, compiled: bool = False,
                    working: Tensor | None = None) -> Tensor:
    """Log-prob [R] of ``target_R`` under ``softmax(hidden_RD @ weight_VD.T)``, in float32 (float64 for
    float64 inputs), at most ``chunk_rows`` x V logits alive at a time in forward and backward. On CUDA
    with float32 accumulation the softmax passes are `treepack.kernels.logprobs`' Triton kernels; elsewhere
    the reference, through `torch.compile` when ``compiled``.

    ``working``: the weight's 16-bit copy (`treepack.train.working_weights.head_copy`), read instead of a
    cast; the backward then adds the weight's gradient into ``weight_VD.grad`` in place when that exists."""
    if hidden_RD.shape[0] == 0:
        acc = torch.float64 if hidden_RD.dtype == torch.float64 else torch.float32
        return (hidden_RD.sum(-1) + weight_VD.sum() * 0).to(acc)  # empty, still attached to the graph
    return _TargetLogProb.apply(hidden_RD, weight_VD, target_R.long(), int(chunk_rows), bool(compiled), working)


# --------------------------------------------------------------------------------------------------
# Loss rows of a pack (numpy, shared by every mode)


@dataclass
class LossRows:
    """The (sequence, position) rows of one pack that carry a loss, sequence-major."""

    seq_R: np.ndarray  # int64 sequence index in the pack
    flat_R: np.ndarray  # int64 index of the target in the flat concatenation of the pack's sequences
    token_R: np.ndarray  # int64 pack index of the target token (path_s[j])
    behaviour_logp_R: np.ndarray | None  # float64 behaviour log-probs when the pack has them (NaN: none)
    loss_tokens_S: np.ndarray  # int64 rows per sequence
    advantage_S: np.ndarray | None  # float64 per-sequence advantage, when known

    @property
    def n_rows(self) -> int:
        return int(self.seq_R.shape[0])

    @property
    def n_sequences_with_loss(self) -> int:
        return int((self.loss_tokens_S > 0).sum())

    @classmethod
    def from_pack(cls, pack: Pack) -> LossRows:
        """Rows from the sequences' own fields (``seq_offsets``, ``seq_loss_mask``, ``seq_token_index``):
        a sequence's first token is never predicted, whatever its mask says."""
        offsets_S1 = np.asarray(pack.seq_offsets, dtype=np.int64)
        S = offsets_S1.shape[0] - 1
        mask_F = np.asarray(pack.seq_loss_mask).astype(bool, copy=True)
        mask_F[offsets_S1[:-1][np.diff(offsets_S1) > 0]] = False
        flat_R = np.flatnonzero(mask_F).astype(np.int64)
        seq_R = np.searchsorted(offsets_S1, flat_R, side="right").astype(np.int64) - 1
        token_R = np.asarray(pack.seq_token_index, dtype=np.int64)[flat_R]
        behaviour = None
        if pack.seq_logprobs is not None:
            behaviour = np.asarray(pack.seq_logprobs, dtype=np.float64)[flat_R]
            if np.isnan(behaviour).all():
                behaviour = None  # NaN marks a record without log-probs: its rows are on-policy
        adv = None if pack.advantages is None else np.asarray(pack.advantages, dtype=np.float64)
        return cls(seq_R=seq_R, flat_R=flat_R, token_R=token_R, behaviour_logp_R=behaviour,
                   loss_tokens_S=np.bincount(seq_R, minlength=S).astype(np.int64), advantage_S=adv)


@dataclass(frozen=True)
class BatchTotals:
    """Normalisers over one global batch, fixed before its first forward (exact grad accumulation)."""

    loss_tokens: int  # loss rows over every pack of the batch
    sequences: int  # sequences of the batch with at least one loss row

    @classmethod
    def of(cls, rows: list[LossRows]) -> BatchTotals:
        return cls(loss_tokens=sum(r.n_rows for r in rows), sequences=sum(r.n_sequences_with_loss for r in rows))


def row_weights(rows: LossRows, totals: BatchTotals, normalization: str) -> np.ndarray:
    """w_R such that the batch loss is ``sum_r w_r * loss_r`` (float64)."""
    if normalization == "token":
        return np.full(rows.n_rows, 1.0 / max(totals.loss_tokens, 1), dtype=np.float64)
    if normalization == "sequence":
        return 1.0 / (max(totals.sequences, 1) * rows.loss_tokens_S[rows.seq_R].astype(np.float64))
    raise ConfigError(f"normalization must be one of {', '.join(NORMALIZATIONS)}, got {normalization!r}")


# --------------------------------------------------------------------------------------------------
# Objectives


@dataclass(frozen=True)
class Objective:
    """What is minimised, per row: SFT NLL or the GRPO/PPO-clip surrogate."""

    kind: str = "sft"  # sft | grpo
    normalization: str = "token"  # token | sequence
    clip_low: float = 0.2  # eps_low: ratio clipped below at 1 - clip_low
    clip_high: float = 0.2  # eps_high: ratio clipped above at 1 + clip_high (DAPO's clip-higher: 0.28)
    kl_coef: float = 0.0  # weight of the k3 KL to the reference log-probs (0: off)

    def __post_init__(self) -> None:
        if self.kind not in LOSSES:
            raise ConfigError(f"loss kind must be one of {', '.join(LOSSES)}, got {self.kind!r}")
        if self.normalization not in NORMALIZATIONS:
            raise ConfigError(f"normalization must be one of {', '.join(NORMALIZATIONS)}, got {self.normalization!r}")
        if not (0 <= self.clip_low < 1) or self.clip_high < 0:
            raise ConfigError(f"clip range must satisfy 0 <= clip_low < 1 and clip_high >= 0, "
                              f"got {self.clip_low}, {self.clip_high}")
        if self.kl_coef < 0:
            raise ConfigError(f"kl_coef must be >= 0, got {self.kl_coef}")

    def row_tensors(self, rows: LossRows, totals: BatchTotals, *, device, dtype) -> dict[str, Tensor]:
        """The per-row inputs of `loss` as tensors (weights, advantages, behaviour log-probs)."""
        out = {"weight_R": to_device(row_weights(rows, totals, self.normalization), device, dtype)}
        if self.kind == "grpo":
            if rows.advantage_S is None:
                raise TreepackError("the grpo loss needs per-sequence advantages; these packs have none")
            out["advantage_R"] = to_device(rows.advantage_S[rows.seq_R], device, dtype)
            if rows.behaviour_logp_R is not None:
                out["behaviour_logp_R"] = to_device(rows.behaviour_logp_R, device, dtype)
        return out

    def loss(self, logp_R: Tensor, weight_R: Tensor, advantage_R: Tensor | None = None,
             behaviour_logp_R: Tensor | None = None, ref_logp_R: Tensor | None = None) -> Tensor:
        """Scalar loss of these rows (their share of the batch loss: sum over packs gives the batch's)."""
        if self.kind == "sft":
            return -(weight_R * logp_R).sum()
        return (weight_R * self.grpo_row_loss(logp_R, advantage_R, behaviour_logp_R, ref_logp_R)).sum()

    def grpo_row_loss(self, logp_R: Tensor, advantage_R: Tensor, behaviour_logp_R: Tensor | None,
                      ref_logp_R: Tensor | None) -> Tensor:
        if behaviour_logp_R is None:
            behaviour = logp_R.detach()
        else:  # rows of records without behaviour log-probs (NaN) are on-policy
            behaviour = torch.where(torch.isnan(behaviour_logp_R), logp_R.detach(), behaviour_logp_R)
        ratio_R = torch.exp(logp_R - behaviour)
        clipped_R = torch.clamp(ratio_R, 1.0 - self.clip_low, 1.0 + self.clip_high)
        loss_R = -torch.minimum(ratio_R * advantage_R, clipped_R * advantage_R)
        if self.kl_coef > 0:
            ref = behaviour if ref_logp_R is None else ref_logp_R
            loss_R = loss_R + self.kl_coef * kl_estimate(logp_R, ref, "k3")
        return loss_R

    def clip_fraction(self, logp_R: Tensor, behaviour_logp_R: Tensor | None) -> Tensor | float:
        """Share of rows whose ratio lies outside the clip range (a PPO health metric). A tensor on the rows'
        device, read back with the step's loss: reading it per pack would make the host wait for the pack."""
        if behaviour_logp_R is None or logp_R.numel() == 0:
            return 0.0
        ratio = torch.exp(logp_R.detach() - behaviour_logp_R)  # NaN rows (on-policy) count as unclipped
        return ((ratio < 1 - self.clip_low) | (ratio > 1 + self.clip_high)).float().mean()


KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(logp_R: Tensor, ref_logp_R: Tensor, estimator: str = "k3") -> Tensor:
    """Per-row estimate of KL(pi || pi_ref) from tokens sampled from pi (Schulman's estimators):
    k1 = logp - ref (unbiased, high variance), k2 = (logp - ref)^2 / 2, k3 = exp(ref - logp) - (ref - logp) - 1
    (unbiased, non-negative, low variance; GRPO's)."""
    if estimator not in KL_ESTIMATORS:
        raise ConfigError(f"kl estimator must be one of {', '.join(KL_ESTIMATORS)}, got {estimator!r}")
    delta_R = ref_logp_R - logp_R
    if estimator == "k1":
        return -delta_R
    if estimator == "k2":
        return 0.5 * delta_R * delta_R
    return torch.exp(delta_R) - delta_R - 1.0


def token_weights_fast(pack: Pack, rows: LossRows, totals: BatchTotals, normalization: str
                       ) -> tuple[np.ndarray, np.ndarray]:
    """Pack tokens U and weights w_U of the fast SFT path: ``loss = -sum_u w_u * logp_u``.

    Token mean reads the pack's ``loss_weight`` (sequences training on each token) and needs no rows;
    sequence mean scatters the row weights onto their tokens. Returns (token_U int64, weight_U float64).
    """
    if normalization == "token":
        weight_T = np.asarray(pack.loss_weight, dtype=np.float64)
        is_root_T = np.asarray(pack.parent) < 0
        token_U = np.flatnonzero((weight_T > 0) & ~is_root_T)
        return token_U, weight_T[token_U] / max(totals.loss_tokens, 1)
    w_T = np.bincount(rows.token_R, weights=row_weights(rows, totals, normalization),
                      minlength=int(np.asarray(pack.input_ids).shape[0]))
    token_U = np.flatnonzero(w_T > 0)
    return token_U, w_T[token_U]


def check_rewards(packs: list[Pack], where: str = "") -> None:
    """Before the first step: every sequence has an advantage or a reward (what `group_advantages` needs), so
    that a missing reward stops the run at its start instead of at the step that batches it. ``where``
    prefixes the message (the data source)."""
    missing, first = 0, None  # first: (record index, id) of the earliest record without either
    for p in packs:
        if p.advantages is not None:
            continue
        bad = (np.arange(p.n_sequences) if p.rewards is None
               else np.flatnonzero(np.isnan(np.asarray(p.rewards, dtype=np.float64))))
        missing += len(bad)
        for s in bad.tolist():
            if first is None or int(p.seq_index[s]) < first[0]:
                first = (int(p.seq_index[s]), p.seq_ids[s])
    if first is not None:
        total = sum(p.n_sequences for p in packs)
        raise InputError(f"{where}record {first[0]} (id {first[1]!r}): no 'reward' (nor 'advantage'); the grpo loss "
                         f"needs one for every sequence ({missing:,} of {total:,} have neither)")


def check_grpo_data(packs: list[Pack], kl_coef: float, where: str = "") -> None:
    """Before the first step of a GRPO run: every sequence has a reward or an advantage (`check_rewards`), and a
    KL penalty has the records' behaviour log-probs to compare with; without them it would compare the policy
    with itself (0, no gradient) and the setting would do nothing."""
    check_rewards(packs, where)
    if kl_coef > 0 and all(LossRows.from_pack(p).behaviour_logp_R is None for p in packs):
        raise ConfigError(f"train.loss.kl_coef = {kl_coef:g} needs behaviour log-probs ('logprobs' of the records), "
                          "which the data have none of: the KL to them would be 0")


def prepare_grpo_data(packs: list[Pack], kl_coef: float, where: str = "") -> tuple[list[Pack], str | None]:
    """What a GRPO run does with its packs before step 1: `check_grpo_data`, then the advantages of named groups
    (``tree_id``) from each whole group (`whole_group_advantages`); with `flat_groups_notice`'s line, if any."""
    check_grpo_data(packs, kl_coef, where)
    return whole_group_advantages(packs), flat_groups_notice(packs)


def _group_keys(p: Pack) -> list[str]:
    """Each sequence's GRPO group: ``(step, tree_id)`` as one string (None where the pack has no such field)."""
    names = p.seq_groups if p.seq_groups is not None else [None] * p.n_sequences
    steps = p.seq_steps.tolist() if p.seq_steps is not None else [None] * p.n_sequences
    return [f"{step}\x00{name}" for step, name in zip(steps, names)]


def flat_groups_notice(packs: list[Pack]) -> str | None:
    """A line when some GRPO groups cannot teach anything: a group of one sequence, or whose rewards are all
    equal, has advantage 0 for each of its sequences, so they add no gradient (tau-bench's tasks hold one
    trajectory each: a run on them trains on nothing, at loss 0.000, unless the data give advantages). Counted
    over the groups `whole_group_advantages` normalises (before it runs); None when none is flat."""
    todo = [p for p in packs if p.advantages is None]
    if not todo or any(p.rewards is None or p.seq_groups is None for p in todo):
        return None
    rewards: dict[str, list[float]] = {}
    for p in todo:
        for key, reward in zip(_group_keys(p), np.asarray(p.rewards, dtype=np.float64).tolist()):
            rewards.setdefault(key, []).append(reward)
    alone = sum(1 for r in rewards.values() if len(r) == 1)
    equal = sum(1 for r in rewards.values() if len(r) > 1 and max(r) == min(r))
    if not alone + equal:
        return None
    seqs = sum(len(r) for r in rewards.values() if len(r) == 1 or max(r) == min(r))
    return (f"grpo: {alone + equal:,} of {len(rewards):,} groups (tree_id) have one sequence ({alone:,}) or equal "
            f"rewards ({equal:,}): their {seqs:,} sequences get advantage 0 and add no gradient")


def whole_group_advantages(packs: list[Pack], eps: float = 1e-6) -> list[Pack]:
    """`group_advantages` over every pack at once when every sequence that needs one names its group
    (``tree_id``): a group's mean and std are then those of the whole group, ``(step, tree_id)``, wherever the
    packer put its sequences. ``treepack pack``'s packers may cut a group between packs, and two packs of one
    group may fall in different optimizer steps, where advantages from each step's packs alone would
    normalise each part by its own statistics. Packs of unnamed sequences are left to `group_advantages` per
    step batch (the batch is their group)."""
    todo = [p for p in packs if p.advantages is None]
    if not todo or any(p.seq_groups is None for p in todo):
        return packs
    return group_advantages(packs, eps)


def group_advantages(packs: list[Pack], eps: float = 1e-6) -> list[Pack]:
    """GRPO advantages for packs that have none: each sequence's reward minus its group's mean, over the
    group's std (+ eps), groups being ``(step, tree_id)`` within the given packs (one global batch; without
    ``tree_id`` the batch is one group per step). Packs that already carry advantages are returned unchanged."""
    todo = [i for i, p in enumerate(packs) if p.advantages is None]
    if not todo:
        return packs
    rewards, groups = [], []
    for i in todo:
        p = packs[i]
        if p.rewards is None:
            raise TreepackError("the grpo loss needs per-sequence advantages or rewards; these packs have neither")
        r = np.asarray(p.rewards, dtype=np.float64)
        if np.isnan(r).any():
            s = int(np.flatnonzero(np.isnan(r))[0])
            raise TreepackError(f"the grpo loss needs a reward for every sequence; sequence {p.seq_ids[s]!r} has none")
        rewards.append(r)
        groups.extend(_group_keys(p))
    reward_S = np.concatenate(rewards)
    _, code_S = np.unique(np.asarray(groups), return_inverse=True)
    count_G = np.bincount(code_S)
    mean_G = np.bincount(code_S, weights=reward_S) / count_G
    var_G = np.bincount(code_S, weights=(reward_S - mean_G[code_S]) ** 2) / count_G
    adv_S = (reward_S - mean_G[code_S]) / (np.sqrt(var_G[code_S]) + eps)
    out, start = list(packs), 0
    for i in todo:
        n = packs[i].n_sequences
        out[i] = dataclasses.replace(packs[i], advantages=adv_S[start : start + n])
        start += n
    return out
