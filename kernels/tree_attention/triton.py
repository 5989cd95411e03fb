"""Fused tree attention in Triton: forward and backward driven by the per-pack block schedule.

Mask: query q sees key k iff ``k <= q < subtree_end[k]`` (plus P prefix keys seen by every query).
`blocks.prepare` classifies (query block, key block) pairs once per pack into empty / full / partial; the
kernels here never test an empty pair and run the mask test only on partial ones.

Forward (grid: heads x query blocks, heaviest query blocks first)
    Online softmax in base 2 (exponent = one FMA, qk·scale·log2 e - m), FlashAttention-2 style. Per
    program: one loop over prefix blocks (no tree test), one loop over the query block's *full* key blocks
    (no test at all) and one over its *partial* key blocks (tests ``k <= q < subtree_end[k]``, one int32
    load per key). Saves lse [Hq, T] in float32 (base 2) for the backward.

Backward: delta = rowsum(dO·O) (a small kernel), then two kernels, no atomics:
* dK/dV, one program per (kv head, key block of BLOCK_N1): the queries that see a key block form the
  contiguous range [k0, max subtree_end) (the union of its keys' subtree ranges, each starting inside
  the block), and inside it the fully visible query blocks are contiguous too: [k1 - 1, min
  subtree_end). So a program runs partial / full / partial loops over query blocks computed from two
  in-kernel reductions, with no table. The GQA group's query heads are looped inside the program, so dK
  and dV are summed in registers: deterministic, and no fp32 scratch of [T, Hkv, D]. Key blocks near the
  root see the whole pack; they have the lowest indices and launch first.
* dQ, one program per (head, query block): the forward's traversal (prefix, full, partial), recomputing P.
  A separate kernel costs 2 extra matmuls of 7 (P and dP are recomputed), but avoids fp32 atomics on
  dQ: in a tree the root key blocks are seen by every query block, so atomic dQ updates would pile onto
  the same rows from every dK/dV program. Deterministic results make the equivalence tests exact.

Fused backward (``KernelConfig.fused_bwd``, off by default; FlashAttention-2's CUDA design): the dQ
kernel is skipped and the dK/dV kernel also adds each tile's dQ share dS·K into a float32 [T, Hq, D]
accumulator with ``tl.atomic_add`` (pack keys and prefix keys alike), cast to q's dtype (times scale) by
torch afterwards: 5 matmuls instead of 7, for one fp32 atomic add per dQ element and visited (query block,
key block) tile. Not deterministic (the order of the fp32 additions varies). Measured on an H200
(benchmarks/attention_bwd.py): 0.96-1.13x the split backward's time, so the atomics cost about what the two
saved matmuls did; it stays opt-in.

Prefix (DFS mode): in the forward and dQ kernels a loop over P keys with only a bounds test; dK/dV of
the prefix come from the dK/dV kernel in prefix mode (all T queries, full blocks only).

Block sizes. `prepare` fixes the schedule granularity (SCHED_M x SCHED_N = 128 x 128 on GPU). Forward and
dQ use BLOCK_N = SCHED_N and a BLOCK_M dividing SCHED_M (a sub-block walks its schedule row's list,
which is a superset, and the mask keeps it exact); dK/dV choose (BLOCK_N1, BLOCK_M1) freely. On GPU the
tile shapes, warps and stages are autotuned per (head dim, GQA group, T bucket, dtype) among a few
candidates, best first; `PINNED` is the fixed configuration of the tests and of the Triton interpreter.
128 x 128 schedule blocks beat 128 x 64 by 4-5% end to end on an agent-rollout pack (fewer, larger
matmuls outweigh the extra masked work of coarser partial blocks: 89% of the visited blocks are full).

Measured (H200, bf16, Hq=16, D=128, 31k-token agent pack; benchmarks/NOTES-attention.md): forward 350-370
TFLOP/s, dQ 460-490, dK/dV 450-480 (counting only visible pairs), fwd+bwd 9.1-9.6 ms: 1.0-1.1x
FlexAttention and 109-123% of torch's varlen flash attention TFLOP/s on the dense paths (2.75-3.1x faster
in time than training every path densely).

FLOPs per visible (q, k) pair and head: forward 4·D (QK^T and PV); backward 10·D by the standard count
(2.5x forward: QK^T recompute, dP, dV, dK, dQ), which all TFLOP/s figures use. This design runs 14·D:
QK^T and dP are computed again in the dQ kernel (7 matmuls instead of 5), the price of no atomics.

`warp_specialize` (forward loops, Triton's automatic warp specialisation) is off: on an H200 with
Triton 3.6 it changed nothing measurable (2.511 vs 2.513 ms).

Shape suffixes: T pack tokens, P prefix tokens, H query heads, K kv heads, D head dim, M query blocks of
the schedule, N key blocks of the schedule.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from .blocks import TreeMaskInfo, prepare

__all__ = ["GPU_DEFAULT", "PINNED", "KernelConfig", "schedule_for", "tree_attention_triton"]

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class KernelConfig:
    """Tile shapes, warps and pipeline stages of the three kernels.

    ``autotune`` lets Triton pick the forward / dQ query block and every kernel's warps, stages and the
    dK/dV tiles on GPU; the schedule blocks (``sched_m``, ``sched_n``) are fixed by the TreeMaskInfo.
    ``fused_bwd`` computes dQ inside the dK/dV kernel (atomics; see the module docstring); that kernel
    then runs the ``dkdv_*`` tiles as given, also under ``autotune``.
    """

    sched_m: int = 128  # queries per schedule row (prepare's block_m)
    sched_n: int = 128  # keys per schedule block (prepare's block_n) = forward / dQ BLOCK_N
    fwd_block_m: int = 128  # forward queries per program, divides sched_m
    fwd_warps: int = 8
    fwd_stages: int = 3
    dq_block_m: int = 128  # dQ queries per program, divides sched_m
    dq_warps: int = 8
    dq_stages: int = 2
    dkdv_block_n: int = 128  # dK/dV keys per program
    dkdv_block_m: int = 64  # dK/dV queries per inner step
    dkdv_warps: int = 8
    dkdv_stages: int = 3
    autotune: bool = True
    # dQ by fp32 atomics from the dK/dV kernel instead of the dQ kernel; last, so that the lists of
    # `as_list` written before it existed still load (it takes its default)
    fused_bwd: bool = False

    def __post_init__(self):
        for name in ("sched_m", "sched_n", "fwd_block_m", "dq_block_m", "dkdv_block_n", "dkdv_block_m"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"KernelConfig.{name} must be a power of two >= 16, got {value}")
        for name in ("fwd_block_m", "dq_block_m"):
            if self.sched_m % getattr(self, name):
                raise ValueError(f"KernelConfig.{name}={getattr(self, name)} must divide sched_m={self.sched_m}")

    def as_list(self) -> list[int]:
        return [int(getattr(self, f.name)) for f in fields(self)]

    @staticmethod
    def from_list(values: list[int]) -> KernelConfig:
        kw = {f.name: v for f, v in zip(fields(KernelConfig), values)}
        for name in ("autotune", "fused_bwd"):
            if name in kw:
                kw[name] = bool(kw[name])
        return KernelConfig(**kw)


GPU_DEFAULT = KernelConfig()
# Small tiles: exercise ragged blocks, sub-blocks of a schedule row and several blocks per pack on tiny
# inputs; what the tests and the interpreter run.
PINNED = KernelConfig(
    sched_m=32, sched_n=16, fwd_block_m=16, fwd_warps=4, fwd_stages=1, dq_block_m=32, dq_warps=4, dq_stages=1,
    dkdv_block_n=32, dkdv_block_m=16, dkdv_warps=4, dkdv_stages=1, autotune=False,
)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# ----------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _fwd_step(
    q, m_i, l_i, acc, k_ptrs, v_ptrs, offs_m, offs_n, kv_ptr_mask, se_ptrs, scale_log2,
    MASK_TREE: tl.constexpr, MASK_BOUNDS: tl.constexpr, PRECISION: tl.constexpr,
):
    """One key block of the online softmax. offs_n are key positions in the key tensor's own frame."""
    if MASK_BOUNDS:
        k = tl.load(k_ptrs, mask=kv_ptr_mask[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=kv_ptr_mask[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    if MASK_TREE:
        se = tl.load(se_ptrs, mask=kv_ptr_mask, other=0)
        visible = (offs_n[None, :] <= offs_m[:, None]) & (offs_m[:, None] < se[None, :])
        qk = tl.where(visible, qk, float("-inf"))
    elif MASK_BOUNDS:
        qk = tl.where(kv_ptr_mask[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1) * scale_log2)
    # A row may have seen nothing yet (m = -inf): subtract 0 instead so that exp2 gives 0, not NaN.
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(qk * scale_log2 - m_sub[:, None])  # one FMA per score
    alpha = tl.math.exp2(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["P"])
def _fwd_kernel(
    Q, K, V, PK, PV, O, LSE, SE, KV_LIST, KV_FULL, KV_COUNT, Q_ORDER,
    scale_log2, T, P, T_BUCKET,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_pt, stride_ph, stride_ot, stride_oh, stride_list,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SCHED_M: tl.constexpr, HAS_PREFIX: tl.constexpr, PRECISION: tl.constexpr, WARP_SPEC: tl.constexpr,
):
    h = tl.program_id(0)
    SUB: tl.constexpr = SCHED_M // BLOCK_M
    pid = tl.program_id(1)
    row = tl.load(Q_ORDER + pid // SUB)
    q0 = row * SCHED_M + (pid % SUB) * BLOCK_M
    hk = h // GROUP
    offs_m = q0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_mask = offs_m < T
    q = tl.load(Q + offs_m[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=row_mask[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    if HAS_PREFIX:
        for p0 in range(0, P, BLOCK_N):
            kv = p0 + offs_n
            k_ptrs = PK + kv[:, None] * stride_pt + hk * stride_ph + offs_d[None, :]
            v_ptrs = PV + kv[:, None] * stride_pt + hk * stride_ph + offs_d[None, :]
            m_i, l_i, acc = _fwd_step(
                q, m_i, l_i, acc, k_ptrs, v_ptrs, offs_m, kv, kv < P, SE, scale_log2,
                MASK_TREE=False, MASK_BOUNDS=True, PRECISION=PRECISION,
            )

    n_full = tl.load(KV_FULL + row)
    n_all = tl.load(KV_COUNT + row)
    list_ptr = KV_LIST + row * stride_list
    for i in tl.range(0, n_full, warp_specialize=WARP_SPEC):
        kv = tl.load(list_ptr + i) * BLOCK_N + offs_n
        k_ptrs = K + kv[:, None] * stride_kt + hk * stride_kh + offs_d[None, :]
        v_ptrs = V + kv[:, None] * stride_kt + hk * stride_kh + offs_d[None, :]
        m_i, l_i, acc = _fwd_step(
            q, m_i, l_i, acc, k_ptrs, v_ptrs, offs_m, kv, kv < T, SE + kv, scale_log2,
            MASK_TREE=False, MASK_BOUNDS=False, PRECISION=PRECISION,
        )
    for i in tl.range(n_full, n_all, warp_specialize=WARP_SPEC):
        kv = tl.load(list_ptr + i) * BLOCK_N + offs_n
        k_ptrs = K + kv[:, None] * stride_kt + hk * stride_kh + offs_d[None, :]
        v_ptrs = V + kv[:, None] * stride_kt + hk * stride_kh + offs_d[None, :]
        m_i, l_i, acc = _fwd_step(
            q, m_i, l_i, acc, k_ptrs, v_ptrs, offs_m, kv, kv < T, SE + kv, scale_log2,
            MASK_TREE=True, MASK_BOUNDS=True, PRECISION=PRECISION,
        )

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    tl.store(
        O + offs_m[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
        out.to(O.dtype.element_ty),
        mask=row_mask[:, None],
    )
    tl.store(LSE + h * T + offs_m, m_i + tl.math.log2(l_safe), mask=row_mask)


@triton.jit
def _bwd_delta_kernel(
    O, DO, DELTA, T, stride_ot, stride_oh, stride_dot, stride_doh,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
):
    h = tl.program_id(0)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_mask = offs_m < T
    o = tl.load(O + offs_m[:, None] * stride_ot + h * stride_oh + offs_d[None, :], mask=row_mask[:, None], other=0.0)
    do = tl.load(DO + offs_m[:, None] * stride_dot + h * stride_doh + offs_d[None, :], mask=row_mask[:, None], other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + h * T + offs_m, delta, mask=row_mask)


@triton.jit
def _dkdv_steps(
    dk, dv, k, v, Q, DO, LSE, DELTA, DQ, h, offs_n, se, qb_lo, qb_hi, T, scale_log2,
    stride_qt, stride_qh, stride_dot, stride_doh, stride_dqt, stride_dqh,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, MASK_TREE: tl.constexpr, MASK_ROWS: tl.constexpr,
    ATOMIC_DQ: tl.constexpr, PRECISION: tl.constexpr,
):
    """Accumulate dK, dV of one key block over query blocks [qb_lo, qb_hi) of head h (transposed tiles).
    ATOMIC_DQ: also add each tile's dS·K (unscaled) into the float32 accumulator DQ."""
    offs_d = tl.arange(0, HEAD_DIM)
    for qb in range(qb_lo, qb_hi):
        offs_m = qb * BLOCK_M + tl.arange(0, BLOCK_M)
        q_ptrs = Q + offs_m[None, :] * stride_qt + h * stride_qh + offs_d[:, None]
        do_ptrs = DO + offs_m[:, None] * stride_dot + h * stride_doh + offs_d[None, :]
        if MASK_ROWS:
            row_mask = offs_m < T
            qT = tl.load(q_ptrs, mask=row_mask[None, :], other=0.0)
            do = tl.load(do_ptrs, mask=row_mask[:, None], other=0.0)
            lse = tl.load(LSE + h * T + offs_m, mask=row_mask, other=0.0)
            delta = tl.load(DELTA + h * T + offs_m, mask=row_mask, other=0.0)
        else:
            qT = tl.load(q_ptrs)
            do = tl.load(do_ptrs)
            lse = tl.load(LSE + h * T + offs_m)
            delta = tl.load(DELTA + h * T + offs_m)
        sT = tl.dot(k, qT, input_precision=PRECISION) * scale_log2
        pT = tl.math.exp2(sT - lse[None, :])
        if MASK_TREE:
            visible = (offs_n[:, None] <= offs_m[None, :]) & (offs_m[None, :] < se[:, None])
            pT = tl.where(visible, pT, 0.0)
        dv += tl.dot(pT.to(do.dtype), do, input_precision=PRECISION)
        dpT = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        dsT = (pT * (dpT - delta[None, :])).to(qT.dtype)
        dk += tl.dot(dsT, tl.trans(qT), input_precision=PRECISION)
        if ATOMIC_DQ:
            dq = tl.dot(tl.trans(dsT), k, input_precision=PRECISION)  # [BLOCK_M, HEAD_DIM] fp32
            dq_ptrs = DQ + offs_m[:, None] * stride_dqt + h * stride_dqh + offs_d[None, :]
            # relaxed: nothing reads DQ before the kernel ends, only the sum matters
            if MASK_ROWS:
                tl.atomic_add(dq_ptrs, dq, mask=(offs_m < T)[:, None], sem="relaxed")
            else:
                tl.atomic_add(dq_ptrs, dq, sem="relaxed")
    return dk, dv


@triton.jit(do_not_specialize=["N_KEYS"])
def _bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, DQ, SE,
    scale, scale_log2, T, N_KEYS, T_BUCKET,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_dot, stride_doh, stride_dkt, stride_dkh,
    stride_dqt, stride_dqh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr,
    IS_PREFIX: tl.constexpr, ATOMIC_DQ: tl.constexpr, PRECISION: tl.constexpr,
):
    """dK, dV of one (kv head, key block). Tree mode: keys of the pack; prefix mode: N_KEYS = P keys seen
    by all T queries. T_BUCKET (unused) is the autotuning key of T. ATOMIC_DQ (the fused backward): also
    add the tiles' dS·K into DQ (float32 [T, Hq, D], unscaled)."""
    hk = tl.program_id(0)
    k0 = tl.program_id(1) * BLOCK_N1
    offs_n = k0 + tl.arange(0, BLOCK_N1)
    offs_d = tl.arange(0, HEAD_DIM)
    key_mask = offs_n < N_KEYS
    kv_offs = offs_n[:, None] * stride_kt + hk * stride_kh + offs_d[None, :]
    k = tl.load(K + kv_offs, mask=key_mask[:, None], other=0.0)
    v = tl.load(V + kv_offs, mask=key_mask[:, None], other=0.0)
    dk = tl.zeros([BLOCK_N1, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N1, HEAD_DIM], tl.float32)
    n_qb = tl.cdiv(T, BLOCK_M1)
    if IS_PREFIX:
        # Every query sees every prefix key: full blocks, a bounds test on rows of the last one only. A
        # ragged prefix block holds zero keys past P, whose dK/dV rows are never stored. Their dQ share is
        # not dropped so: p = 2^-lse of a zero key is unbounded (the cast of dS overflows fp16 to inf for
        # lse < -16) and inf · 0 is NaN in dS·K. So with ATOMIC_DQ a ragged block (one program) runs the
        # tree test as a key bounds test: position -1 for a key (T for padding), subtree end T.
        se = offs_n
        full_hi = T // BLOCK_M1
        # Defined on both paths: Triton compiles both sides of `if ragged` (a runtime value once ATOMIC_DQ
        # sets it), and the split kernel's side is never taken.
        key_pos = tl.where(key_mask, -1, T)
        key_end = tl.zeros([BLOCK_N1], tl.int32) + T
        ragged = False
        if ATOMIC_DQ:
            ragged = k0 + BLOCK_N1 > N_KEYS
        for g in range(GROUP):
            h = hk * GROUP + g
            if ragged:
                dk, dv = _dkdv_steps(
                    dk, dv, k, v, Q, DO, LSE, DELTA, DQ, h, key_pos, key_end, 0, n_qb, T, scale_log2,
                    stride_qt, stride_qh, stride_dot, stride_doh, stride_dqt, stride_dqh,
                    HEAD_DIM=HEAD_DIM, BLOCK_M=BLOCK_M1, MASK_TREE=True, MASK_ROWS=True, ATOMIC_DQ=ATOMIC_DQ,
                    PRECISION=PRECISION,
                )
            else:
                dk, dv = _dkdv_steps(
                    dk, dv, k, v, Q, DO, LSE, DELTA, DQ, h, offs_n, se, 0, full_hi, T, scale_log2,
                    stride_qt, stride_qh, stride_dot, stride_doh, stride_dqt, stride_dqh,
                    HEAD_DIM=HEAD_DIM, BLOCK_M=BLOCK_M1, MASK_TREE=False, MASK_ROWS=False, ATOMIC_DQ=ATOMIC_DQ,
                    PRECISION=PRECISION,
                )
                dk, dv = _dkdv_steps(
                    dk, dv, k, v, Q, DO, LSE, DELTA, DQ, h, offs_n, se, full_hi, n_qb, T, scale_log2,
                    stride_qt, stride_qh, stride_dot, stride_doh, stride_dqt, stride_dqh,
                    HEAD_DIM=HEAD_DIM, BLOCK_M=BLOCK_M1, MASK_TREE=False, MASK_ROWS=True, ATOMIC_DQ=ATOMIC_DQ,
                    PRECISION=PRECISION,
                )
    else:
        se = tl.load(SE + offs_n, mask=key_mask, other=0)
        se_max = tl.max(se, 0)
        se_min = tl.min(se, 0)  # 0 in a ragged last block: no full query block there
        qb_lo = k0 // BLOCK_M1
        qb_hi = tl.cdiv(se_max, BLOCK_M1)
        full_lo = tl.minimum(tl.cdiv(k0 + BLOCK_N1 - 1, BLOCK_M1), qb_hi)
        full_hi = tl.maximum(se_min // BLOCK_M1, full_lo)
        for g in range(GROUP):
            h = hk * GROUP + g
            dk, dv = _dkdv_steps(
                dk, dv, k, v, Q, DO, LSE, DELTA, DQ, h, offs_n, se, qb_lo, full_lo, T, scale_log2,
                stride_qt, stride_qh, stride_dot, stride_doh, stride_dqt, stride_dqh,
                HEAD_DIM=HEAD_DIM, BLOCK_M=BLOCK_M1, MASK_TREE=True, MASK_ROWS=True, ATOMIC_DQ=ATOMIC_DQ,
                PRECISION=PRECISION,
            )
            dk, dv = _dkdv_steps(
                dk, dv, k, v, Q, DO, LSE, DELTA, DQ, h, offs_n, se, full_lo, full_hi, T, scale_log2,
                stride_qt, stride_qh, stride_dot, stride_doh, stride_dqt, stride_dqh,
                HEAD_DIM=HEAD_DIM, BLOCK_M=BLOCK_M1, MASK_TREE=False, MASK_ROWS=False, ATOMIC_DQ=ATOMIC_DQ,
                PRECISION=PRECISION,
            )
            dk, dv = _dkdv_steps(
                dk, dv, k, v, Q, DO, LSE, DELTA, DQ, h, offs_n, se, full_hi, qb_hi, T, scale_log2,
                stride_qt, stride_qh, stride_dot, stride_doh, stride_dqt, stride_dqh,
                HEAD_DIM=HEAD_DIM, BLOCK_M=BLOCK_M1, MASK_TREE=True, MASK_ROWS=True, ATOMIC_DQ=ATOMIC_DQ,
                PRECISION=PRECISION,
            )
    out_offs = offs_n[:, None] * stride_dkt + hk * stride_dkh + offs_d[None, :]
    tl.store(DK + out_offs, (dk * scale).to(DK.dtype.element_ty), mask=key_mask[:, None])
    tl.store(DV + out_offs, dv.to(DV.dtype.element_ty), mask=key_mask[:, None])


@triton.jit
def _dq_step(
    dq, q, do, lse, delta, k_ptrs, v_ptrs, offs_m, offs_n, kv_ptr_mask, se_ptrs, scale_log2,
    MASK_TREE: tl.constexpr, MASK_BOUNDS: tl.constexpr, PRECISION: tl.constexpr,
):
    if MASK_BOUNDS:
        k = tl.load(k_ptrs, mask=kv_ptr_mask[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=kv_ptr_mask[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
    p = tl.math.exp2(s - lse[:, None])
    if MASK_TREE:
        se = tl.load(se_ptrs, mask=kv_ptr_mask, other=0)
        visible = (offs_n[None, :] <= offs_m[:, None]) & (offs_m[:, None] < se[None, :])
        p = tl.where(visible, p, 0.0)
    elif MASK_BOUNDS:
        p = tl.where(kv_ptr_mask[None, :], p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    ds = p * (dp - delta[:, None])
    dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    return dq


@triton.jit(do_not_specialize=["P"])
def _bwd_dq_kernel(
    Q, K, V, PK, PV, DO, LSE, DELTA, DQ, SE, KV_LIST, KV_FULL, KV_COUNT, Q_ORDER,
    scale, scale_log2, T, P, T_BUCKET,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_pt, stride_ph, stride_dot, stride_doh,
    stride_dqt, stride_dqh, stride_list,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SCHED_M: tl.constexpr, HAS_PREFIX: tl.constexpr, PRECISION: tl.constexpr,
):
    h = tl.program_id(0)
    SUB: tl.constexpr = SCHED_M // BLOCK_M
    pid = tl.program_id(1)
    row = tl.load(Q_ORDER + pid // SUB)
    q0 = row * SCHED_M + (pid % SUB) * BLOCK_M
    hk = h // GROUP
    offs_m = q0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_mask = offs_m < T
    q = tl.load(Q + offs_m[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=row_mask[:, None], other=0.0)
    do = tl.load(DO + offs_m[:, None] * stride_dot + h * stride_doh + offs_d[None, :], mask=row_mask[:, None], other=0.0)
    lse = tl.load(LSE + h * T + offs_m, mask=row_mask, other=0.0)
    delta = tl.load(DELTA + h * T + offs_m, mask=row_mask, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    if HAS_PREFIX:
        for p0 in range(0, P, BLOCK_N):
            kv = p0 + offs_n
            k_ptrs = PK + kv[:, None] * stride_pt + hk * stride_ph + offs_d[None, :]
            v_ptrs = PV + kv[:, None] * stride_pt + hk * stride_ph + offs_d[None, :]
            dq = _dq_step(
                dq, q, do, lse, delta, k_ptrs, v_ptrs, offs_m, kv, kv < P, SE, scale_log2,
                MASK_TREE=False, MASK_BOUNDS=True, PRECISION=PRECISION,
            )

    n_full = tl.load(KV_FULL + row)
    n_all = tl.load(KV_COUNT + row)
    list_ptr = KV_LIST + row * stride_list
    for i in range(n_full):
        kv = tl.load(list_ptr + i) * BLOCK_N + offs_n
        k_ptrs = K + kv[:, None] * stride_kt + hk * stride_kh + offs_d[None, :]
        v_ptrs = V + kv[:, None] * stride_kt + hk * stride_kh + offs_d[None, :]
        dq = _dq_step(
            dq, q, do, lse, delta, k_ptrs, v_ptrs, offs_m, kv, kv < T, SE + kv, scale_log2,
            MASK_TREE=False, MASK_BOUNDS=False, PRECISION=PRECISION,
        )
    for i in range(n_full, n_all):
        kv = tl.load(list_ptr + i) * BLOCK_N + offs_n
        k_ptrs = K + kv[:, None] * stride_kt + hk * stride_kh + offs_d[None, :]
        v_ptrs = V + kv[:, None] * stride_kt + hk * stride_kh + offs_d[None, :]
        dq = _dq_step(
            dq, q, do, lse, delta, k_ptrs, v_ptrs, offs_m, kv, kv < T, SE + kv, scale_log2,
            MASK_TREE=True, MASK_BOUNDS=True, PRECISION=PRECISION,
        )
    tl.store(
        DQ + offs_m[:, None] * stride_dqt + h * stride_dqh + offs_d[None, :],
        (dq * scale).to(DQ.dtype.element_ty),
        mask=row_mask[:, None],
    )


# ----------------------------------------------------------------------------------------------------
# Autotuning (GPU only; the interpreter and tests run PINNED)
# ----------------------------------------------------------------------------------------------------


# Candidates, best first as measured on an H200 (benchmarks/NOTES-attention.md): shapes that lost by 1.5x
# or more there are left out; shapes that do not fit in shared memory are skipped by the autotuner.
def _fwd_configs():
    return [
        triton.Config({"BLOCK_M": bm}, num_warps=w, num_stages=s)
        for bm, w, s in [(128, 8, 3), (128, 8, 2), (64, 4, 3)]
    ]


def _dq_configs():
    return [
        triton.Config({"BLOCK_M": bm}, num_warps=w, num_stages=s)
        for bm, w, s in [(128, 8, 2), (64, 4, 3), (64, 8, 2)]
    ]


def _dkdv_configs():
    return [
        triton.Config({"BLOCK_N1": bn, "BLOCK_M1": bm}, num_warps=w, num_stages=s)
        for bn, bm, w, s in [(128, 64, 8, 3), (128, 32, 8, 3), (128, 64, 8, 2), (64, 32, 4, 2)]
    ]


_AUTOTUNED: dict[str, object] = {}


def _prune_block_m(configs, named_args, **kwargs):
    """Forward / dQ query blocks must divide the schedule row (SCHED_M)."""
    sched_m = kwargs.get("SCHED_M", named_args.get("SCHED_M", 128))
    kept = [c for c in configs if sched_m % c.kwargs["BLOCK_M"] == 0]
    return kept or [triton.Config({"BLOCK_M": sched_m}, num_warps=4, num_stages=2)]


def _autotuned(name: str):
    """Autotuned wrappers, built on first use (autotuning benchmarks on the GPU)."""
    if name not in _AUTOTUNED:
        key = ["HEAD_DIM", "GROUP", "T_BUCKET", "PRECISION", "HAS_PREFIX"]
        if name == "fwd":
            prune = {"early_config_prune": _prune_block_m}
            fn = triton.autotune(_fwd_configs(), key=[*key, "BLOCK_N"], prune_configs_by=prune)(_fwd_kernel)
        elif name == "dq":
            prune = {"early_config_prune": _prune_block_m}
            fn = triton.autotune(_dq_configs(), key=[*key, "BLOCK_N"], prune_configs_by=prune)(_bwd_dq_kernel)
        else:
            fn = triton.autotune(_dkdv_configs(), key=[*key[:-1], "IS_PREFIX"])(_bwd_dkdv_kernel)
        _AUTOTUNED[name] = fn
    return _AUTOTUNED[name]


def _t_bucket(T: int) -> int:
    return 1 << max(T - 1, 1).bit_length()


# ----------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_index_range(T: int, H: int, D: int) -> None:
    if (T + 1) * H * D >= 2**31:
        raise ValueError(f"the triton backend indexes with int32: T*Hq*D must be < 2^31, got T={T}, Hq={H}, D={D}")


_STAGES_THAT_FIT: dict[tuple, int] = {}


def _launch_fitting(kernel, grid, args, const, stages: int, **meta) -> None:
    """Launch a pinned configuration with ``stages`` pipeline stages, or the most that fit in shared
    memory (bigger dtypes, a P = 1 prefix or another GPU can overflow a tile chosen for bf16 on Hopper).
    The answer is remembered per specialisation, so a failing compile is paid once."""
    from triton.runtime.errors import OutOfResources

    key = (kernel.fn.__name__, stages, tuple(sorted({**const, **meta}.items())), args[0].dtype)
    for s in range(_STAGES_THAT_FIT.get(key, stages), 0, -1):
        try:
            kernel[grid](*args, **const, **meta, num_stages=s)
        except OutOfResources:
            if s == 1:
                raise
            continue
        _STAGES_THAT_FIT[key] = s
        return


def _launch_fwd(
    q_THD, k_TKD, v_TKD, pk_PKD, pv_PKD, subtree_end_T, kv_list_MN, kv_full_M, kv_count_M, q_order_M,
    scale: float, cfg: KernelConfig, warp_specialize: bool = False,
):
    T, H, D = q_THD.shape
    K = k_TKD.shape[1]
    P = 0 if pk_PKD is None else pk_PKD.shape[0]
    o_THD = torch.empty_like(q_THD)
    lse_HT = torch.empty(H, T, device=q_THD.device, dtype=torch.float32)
    pk, pv = (pk_PKD, pv_PKD) if P else (k_TKD, v_TKD)
    args = (
        q_THD, k_TKD, v_TKD, pk, pv, o_THD, lse_HT, subtree_end_T, kv_list_MN, kv_full_M, kv_count_M, q_order_M,
        scale * LOG2E, T, P, _t_bucket(T),
        q_THD.stride(0), q_THD.stride(1), k_TKD.stride(0), k_TKD.stride(1), pk.stride(0), pk.stride(1),
        o_THD.stride(0), o_THD.stride(1), kv_list_MN.stride(0),
    )
    const = {
        "GROUP": H // K, "HEAD_DIM": D, "BLOCK_N": cfg.sched_n, "SCHED_M": cfg.sched_m, "HAS_PREFIX": P > 0,
        "PRECISION": _precision(q_THD.dtype), "WARP_SPEC": warp_specialize,
    }
    M = triton.cdiv(T, cfg.sched_m)  # programs cover whole schedule rows (launched in q_order)
    if cfg.autotune and not _interpreting():
        grid = lambda meta: (H, M * (cfg.sched_m // meta["BLOCK_M"]))
        _autotuned("fwd")[grid](*args, **const)
    else:
        grid = (H, M * (cfg.sched_m // cfg.fwd_block_m))
        _launch_fitting(
            _fwd_kernel, grid, args, const, cfg.fwd_stages, BLOCK_M=cfg.fwd_block_m, num_warps=cfg.fwd_warps
        )
    return o_THD, lse_HT


def _launch_delta(o_THD, do_THD):
    T, H, D = o_THD.shape
    delta_HT = torch.empty(H, T, device=o_THD.device, dtype=torch.float32)
    block = 64
    _bwd_delta_kernel[(H, triton.cdiv(T, block))](
        o_THD, do_THD, delta_HT, T, o_THD.stride(0), o_THD.stride(1), do_THD.stride(0), do_THD.stride(1),
        HEAD_DIM=D, BLOCK_M=block,
    )
    return delta_HT


def _launch_dkdv(
    do_THD, q_THD, keys_NKD, values_NKD, lse_HT, delta_HT, subtree_end_T, scale, is_prefix, cfg, dq_acc_THD=None
):
    """dK, dV of the pack's keys (is_prefix=False) or of the P prefix keys seen by all queries (True).

    With ``dq_acc_THD`` (float32 [T, Hq, D]; the fused backward) the kernel also adds its dS·K tiles into
    it, unscaled. That launch is never autotuned: the autotuner's trials would add into the accumulator,
    and its reset_to_zero would wipe what the pack launch added before the prefix launch (restore_value
    would be correct but copies the accumulator inside every timed trial). It runs cfg's dkdv tiles.
    """
    T, H, D = q_THD.shape
    n_keys, K = keys_NKD.shape[0], keys_NKD.shape[1]
    dk_NKD = torch.empty_like(keys_NKD)
    dv_NKD = torch.empty_like(values_NKD)
    fused = dq_acc_THD is not None
    dq = dq_acc_THD if fused else q_THD  # unused without ATOMIC_DQ
    args = (
        q_THD, keys_NKD, values_NKD, do_THD, lse_HT, delta_HT, dk_NKD, dv_NKD, dq, subtree_end_T,
        scale, scale * LOG2E, T, n_keys, _t_bucket(T),
        q_THD.stride(0), q_THD.stride(1), keys_NKD.stride(0), keys_NKD.stride(1), do_THD.stride(0),
        do_THD.stride(1), dk_NKD.stride(0), dk_NKD.stride(1), dq.stride(0), dq.stride(1),
    )
    const = {
        "GROUP": H // K, "HEAD_DIM": D, "IS_PREFIX": is_prefix, "ATOMIC_DQ": fused,
        "PRECISION": _precision(q_THD.dtype),
    }
    if cfg.autotune and not fused and not _interpreting():
        grid = lambda meta: (K, triton.cdiv(n_keys, meta["BLOCK_N1"]))
        _autotuned("dkdv")[grid](*args, **const)
    else:
        grid = (K, triton.cdiv(n_keys, cfg.dkdv_block_n))
        _launch_fitting(
            _bwd_dkdv_kernel, grid, args, const, cfg.dkdv_stages,
            BLOCK_N1=cfg.dkdv_block_n, BLOCK_M1=cfg.dkdv_block_m, num_warps=cfg.dkdv_warps,
        )
    return dk_NKD, dv_NKD


def _launch_dq(
    do_THD, q_THD, k_TKD, v_TKD, pk_PKD, pv_PKD, lse_HT, delta_HT, subtree_end_T, kv_list_MN, kv_full_M,
    kv_count_M, q_order_M, scale, cfg,
):
    T, H, D = q_THD.shape
    K = k_TKD.shape[1]
    P = 0 if pk_PKD is None else pk_PKD.shape[0]
    dq_THD = torch.empty_like(q_THD)
    pk, pv = (pk_PKD, pv_PKD) if P else (k_TKD, v_TKD)
    args = (
        q_THD, k_TKD, v_TKD, pk, pv, do_THD, lse_HT, delta_HT, dq_THD, subtree_end_T,
        kv_list_MN, kv_full_M, kv_count_M, q_order_M,
        scale, scale * LOG2E, T, P, _t_bucket(T),
        q_THD.stride(0), q_THD.stride(1), k_TKD.stride(0), k_TKD.stride(1), pk.stride(0), pk.stride(1),
        do_THD.stride(0), do_THD.stride(1), dq_THD.stride(0), dq_THD.stride(1), kv_list_MN.stride(0),
    )
    const = {
        "GROUP": H // K, "HEAD_DIM": D, "BLOCK_N": cfg.sched_n, "SCHED_M": cfg.sched_m, "HAS_PREFIX": P > 0,
        "PRECISION": _precision(q_THD.dtype),
    }
    M = triton.cdiv(T, cfg.sched_m)
    if cfg.autotune and not _interpreting():
        grid = lambda meta: (H, M * (cfg.sched_m // meta["BLOCK_M"]))
        _autotuned("dq")[grid](*args, **const)
    else:
        grid = (H, M * (cfg.sched_m // cfg.dq_block_m))
        _launch_fitting(
            _bwd_dq_kernel, grid, args, const, cfg.dq_stages, BLOCK_M=cfg.dq_block_m, num_warps=cfg.dq_warps
        )
    return dq_THD


def _launch_bwd(
    do_THD, q_THD, k_TKD, v_TKD, pk_PKD, pv_PKD, o_THD, lse_HT, subtree_end_T, kv_list_MN, kv_full_M,
    kv_count_M, q_order_M, scale: float, cfg: KernelConfig,
):
    K, D = k_TKD.shape[1], k_TKD.shape[2]
    delta_HT = _launch_delta(o_THD, do_THD)
    # fused: dQ accumulated by the dK/dV launches (pack keys, then prefix keys) instead of the dQ kernel
    dq_acc_THD = torch.zeros(q_THD.shape, device=q_THD.device, dtype=torch.float32) if cfg.fused_bwd else None
    dk_TKD, dv_TKD = _launch_dkdv(
        do_THD, q_THD, k_TKD, v_TKD, lse_HT, delta_HT, subtree_end_T, scale, False, cfg, dq_acc_THD
    )
    if pk_PKD is not None and pk_PKD.shape[0]:
        dpk_PKD, dpv_PKD = _launch_dkdv(
            do_THD, q_THD, pk_PKD, pv_PKD, lse_HT, delta_HT, subtree_end_T, scale, True, cfg, dq_acc_THD
        )
    else:
        dpk_PKD, dpv_PKD = k_TKD.new_empty(0, K, D), v_TKD.new_empty(0, K, D)
    if cfg.fused_bwd:
        dq_THD = dq_acc_THD.mul_(scale).to(q_THD.dtype)
    else:
        dq_THD = _launch_dq(
            do_THD, q_THD, k_TKD, v_TKD, pk_PKD, pv_PKD, lse_HT, delta_HT, subtree_end_T, kv_list_MN, kv_full_M,
            kv_count_M, q_order_M, scale, cfg,
        )
    return dq_THD, dk_TKD, dv_TKD, dpk_PKD, dpv_PKD


# ----------------------------------------------------------------------------------------------------
# torch.library ops + autograd
# ----------------------------------------------------------------------------------------------------


@torch.library.custom_op("treepack::tree_attention_fwd", mutates_args=())
def tree_attention_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    prefix_k: Optional[Tensor],  # noqa: UP045 - torch.library infers the schema from it
    prefix_v: Optional[Tensor],  # noqa: UP045 - torch.library infers the schema from it
    subtree_end: Tensor,
    kv_list: Tensor,
    kv_full: Tensor,
    kv_count: Tensor,
    q_order: Tensor,
    scale: float,
    config: list[int],
) -> tuple[Tensor, Tensor]:
    """Forward: returns (out [T, Hq, D], lse [Hq, T] float32, base 2)."""
    cfg = KernelConfig.from_list(config)
    return _launch_fwd(q, k, v, prefix_k, prefix_v, subtree_end, kv_list, kv_full, kv_count, q_order, scale, cfg)


@tree_attention_fwd.register_fake
def _(q, k, v, prefix_k, prefix_v, subtree_end, kv_list, kv_full, kv_count, q_order, scale, config):
    T, H, _ = q.shape
    return torch.empty_like(q), q.new_empty(H, T, dtype=torch.float32)


@torch.library.custom_op("treepack::tree_attention_bwd", mutates_args=())
def tree_attention_bwd(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    prefix_k: Optional[Tensor],  # noqa: UP045 - torch.library infers the schema from it
    prefix_v: Optional[Tensor],  # noqa: UP045 - torch.library infers the schema from it
    out: Tensor,
    lse: Tensor,
    subtree_end: Tensor,
    kv_list: Tensor,
    kv_full: Tensor,
    kv_count: Tensor,
    q_order: Tensor,
    scale: float,
    config: list[int],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Backward: returns (dq, dk, dv, dprefix_k, dprefix_v); the prefix grads are [0, Hkv, D] without one."""
    cfg = KernelConfig.from_list(config)
    return _launch_bwd(
        grad_out.contiguous(), q, k, v, prefix_k, prefix_v, out, lse, subtree_end, kv_list, kv_full, kv_count,
        q_order, scale, cfg,
    )


@tree_attention_bwd.register_fake
def _(grad_out, q, k, v, prefix_k, prefix_v, out, lse, subtree_end, kv_list, kv_full, kv_count, q_order, scale, config):
    K, D = k.shape[1], k.shape[2]
    dpk = torch.empty_like(prefix_k) if prefix_k is not None else k.new_empty(0, K, D)
    dpv = torch.empty_like(prefix_v) if prefix_v is not None else v.new_empty(0, K, D)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dpk, dpv


def _setup_context(ctx, inputs, output):
    q, k, v, prefix_k, prefix_v, subtree_end, kv_list, kv_full, kv_count, q_order, scale, config = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, prefix_k, prefix_v, out, lse, subtree_end, kv_list, kv_full, kv_count, q_order)
    ctx.scale = scale
    ctx.config = config
    ctx.has_prefix = prefix_k is not None


def _backward(ctx, grad_out, grad_lse):
    q, k, v, prefix_k, prefix_v, out, lse, subtree_end, kv_list, kv_full, kv_count, q_order = ctx.saved_tensors
    dq, dk, dv, dpk, dpv = tree_attention_bwd(
        grad_out, q, k, v, prefix_k, prefix_v, out, lse, subtree_end, kv_list, kv_full, kv_count, q_order,
        ctx.scale, ctx.config,
    )
    if not ctx.has_prefix:
        dpk = dpv = None
    return dq, dk, dv, dpk, dpv, None, None, None, None, None, None, None


torch.library.register_autograd("treepack::tree_attention_fwd", _backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------------


def schedule_for(subtree_end: Tensor | TreeMaskInfo, cfg: KernelConfig = GPU_DEFAULT) -> TreeMaskInfo:
    """The TreeMaskInfo matching ``cfg``'s schedule blocks: the given one, one cached on it, or a new one."""
    if isinstance(subtree_end, TreeMaskInfo):
        info = subtree_end
        if (info.block_m, info.block_n) == (cfg.sched_m, cfg.sched_n):
            return info
        key = ("schedule", cfg.sched_m, cfg.sched_n)
        if key not in info.cache:
            info.cache[key] = prepare(info.subtree_end_T, block_m=cfg.sched_m, block_n=cfg.sched_n, validate=False)
        return info.cache[key]
    return prepare(subtree_end, block_m=cfg.sched_m, block_n=cfg.sched_n)


def tree_attention_triton(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    subtree_end: Tensor | TreeMaskInfo,
    *,
    prefix_k: Tensor | None = None,
    prefix_v: Tensor | None = None,
    scale: float | None = None,
    config: KernelConfig | None = None,
) -> Tensor:
    """Triton backend of `tree_attention` (inputs validated by the api). ``config`` defaults to the
    autotuned GPU configuration, or `PINNED` under the Triton interpreter."""
    T, H, D = q.shape
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    if config is None:
        config = PINNED if _interpreting() else GPU_DEFAULT
    if T == 0:
        return q.new_empty(0, H, D)
    _check_index_range(T, H, D)
    info = schedule_for(subtree_end, config)
    if prefix_k is not None and prefix_k.shape[0] == 0:
        prefix_k = prefix_v = None
    if prefix_k is not None:
        prefix_k, prefix_v = prefix_k.contiguous(), prefix_v.contiguous()
    out, _ = tree_attention_fwd(
        q.contiguous(), k.contiguous(), v.contiguous(), prefix_k, prefix_v,
        info.subtree_end_T, info.kv_list_MN, info.kv_full_M, info.kv_count_M, info.q_order_M,
        float(scale), config.as_list(),
    )
    return out

