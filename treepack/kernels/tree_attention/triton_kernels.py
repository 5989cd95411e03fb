"""The Triton kernels of tree attention (``@triton.jit``): forward, delta, dK/dV and dQ over the block schedule.

Launchers, autotuning and the autograd / custom-op wrapping are in `treepack.kernels.tree_attention.triton`.

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

import triton
import triton.language as tl

__all__ = ["bwd_delta_kernel", "bwd_dkdv_kernel", "bwd_dq_kernel", "fwd_kernel"]


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


@triton.jit(do_not_specialize=["T", "P"])
def fwd_kernel(
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


@triton.jit(do_not_specialize=["T"])
def bwd_delta_kernel(
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


@triton.jit(do_not_specialize=["T", "N_KEYS"])
def bwd_dkdv_kernel(
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


@triton.jit(do_not_specialize=["T", "P"])
def bwd_dq_kernel(
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
