"""Triton kernels for the language-model head's two memory-bound passes over a chunk of logits.

Why not Inductor: compiled from `reference`, both passes ran at ~1.2-1.3 TB/s on an H100. The forward's
log-sum-exp is a maximum, then a sum, each a pass over the row (1.29 TB/s counted once is 2.6 counted
twice); why the pointwise backward stays at 1.2 was not pinned down (its flattened [R, B] index is one
suspect). Here the forward reads a row once (a running maximum and sum per block of columns) and the
backward walks one row span per program: 2.5-2.7 TB/s (results/2026-11-26-logprob-kernels-h100.md).

Legend: R rows (each one position's logits over the vocabulary, or a block of it), V / B columns.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: `triton_supported` says no
    triton = None

FWD_BLOCK_V = 4096  # columns a forward program holds per iteration (bf16: 8 KiB a row step)
FWD_PROGRAMS = 4096  # rows are split into column spans until about this many programs run (a few waves)
BWD_BLOCK = 4096
BWD_SPAN = 16384  # columns per backward program (rows x spans programs)


def triton_supported(logits: Tensor) -> bool:
    """Whether the kernels run on these logits: CUDA, 16- or 32-bit floats, rows of contiguous columns."""
    return (triton is not None and logits.is_cuda and logits.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and logits.dim() == 2 and logits.stride(1) == 1)


if triton is not None:

    # Integer arguments that change with the batch (strides, sizes, the number of column spans) are runtime
    # values Triton does not specialise on: as compile-time constants, or specialised on (1, multiples of 16),
    # each new row count compiled kernel variants inside the step that met it (2 per new span count: the
    # "compiled 2" / "compiled 4" of tau-bench steps, results/2026-11-28-step-compiles-h200.md)
    @triton.jit(do_not_specialize=["stride_r", "V", "span", "split"])
    def _lse_partial_kernel(logits_ptr, stride_r, target_ptr, out1_ptr, out2_ptr, V, span, split,
                            WHOLE: tl.constexpr, BLOCK_V: tl.constexpr):
        """Program (row r, span k) over columns [k span, (k + 1) span): a running maximum m and sum s of
        exp(x - m), one block of columns at a time (one exp per logit; rescaling s is one exp per block).
        WHOLE (one span a row): the row's lse and target log-prob into out1 / out2; else (m, s) into out1 /
        out2 [R, split]."""
        r = tl.program_id(0).to(tl.int64)
        k = tl.program_id(1)
        row = logits_ptr + r * stride_r
        lo = k * span
        hi = tl.minimum(lo + span, V)
        cols = tl.arange(0, BLOCK_V)
        m = tl.max(tl.load(row + lo + cols, mask=lo + cols < hi, other=float("-inf")).to(tl.float32), axis=0)
        s = tl.zeros([], dtype=tl.float32)
        for v0 in range(lo, hi, BLOCK_V):
            x = tl.load(row + v0 + cols, mask=v0 + cols < hi, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, axis=0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
            m = m_new
        if WHOLE:
            lse = m + tl.log(s)
            x_t = tl.load(row + tl.load(target_ptr + r)).to(tl.float32)
            tl.store(out1_ptr + r, lse)
            tl.store(out2_ptr + r, x_t - lse)
        else:
            tl.store(out1_ptr + r * split + k, m)
            tl.store(out2_ptr + r * split + k, s)

    @triton.jit(do_not_specialize=["stride_r", "split"])
    def _lse_combine_kernel(logits_ptr, stride_r, target_ptr, m_ptr, s_ptr, lse_ptr, logp_ptr, split,
                            SPLIT_P2: tl.constexpr):
        """A row's lse from its spans' (m, s): M + log(sum s exp(m - M)); and the target's log-prob.
        ``SPLIT_P2``: a power of two >= any split of the vocabulary (one value per vocabulary size)."""
        r = tl.program_id(0).to(tl.int64)
        k = tl.arange(0, SPLIT_P2)
        m = tl.load(m_ptr + r * split + k, mask=k < split, other=float("-inf"))
        s = tl.load(s_ptr + r * split + k, mask=k < split, other=0.0)
        top = tl.max(m, axis=0)
        lse = top + tl.log(tl.sum(tl.where(k < split, s * tl.exp(m - top), 0.0), axis=0))
        x_t = tl.load(logits_ptr + r * stride_r + tl.load(target_ptr + r)).to(tl.float32)
        tl.store(lse_ptr + r, lse)
        tl.store(logp_ptr + r, x_t - lse)

    @triton.jit(do_not_specialize=["stride_r", "B", "v0"])
    def _grad_logits_kernel(logits_ptr, stride_r, lse_ptr, g_ptr, target_ptr, B, v0,
                            SPAN: tl.constexpr, BLOCK: tl.constexpr):
        """Program (row r, span k), in place: x <- g (onehot(target) - exp(x - lse)) over the span's columns."""
        r = tl.program_id(0).to(tl.int64)
        start = tl.program_id(1) * SPAN
        row = logits_ptr + r * stride_r
        lse = tl.load(lse_ptr + r)
        g = tl.load(g_ptr + r).to(tl.float32)
        t = tl.load(target_ptr + r) - v0
        cols = tl.arange(0, BLOCK)
        for c0 in range(start, tl.minimum(start + SPAN, B), BLOCK):
            c = c0 + cols
            x = tl.load(row + c, mask=c < B, other=0.0).to(tl.float32)
            out = g * (tl.where(c == t, 1.0, 0.0) - tl.exp(x - lse))
            tl.store(row + c, out.to(logits_ptr.dtype.element_ty), mask=c < B)


def lse_and_logprob_triton(logits_CV: Tensor, target_C: Tensor, acc: torch.dtype,
                           out: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """`lse_and_logprob_reference` in one pass over the logits (``acc``: float32), into ``out`` where given
    (contiguous float32: the results are those tensors). Few rows are split into
    column spans (one program each, then a combine) so that enough programs keep the memory busy: one
    program per row ran 1,024 x 151,936 bf16 logits at 668 GB/s against 2.8 TB/s for 4,096 rows."""
    if acc != torch.float32:
        raise ValueError(f"the Triton log-prob kernels accumulate in float32, not {acc}")
    C, V = logits_CV.shape
    target_C = target_C.contiguous()
    if out is not None and all(o.is_contiguous() and o.dtype == acc for o in out):
        lse_C, logp_C = out  # written in place (contiguous slices of the caller's results)
    else:
        lse_C = torch.empty(C, dtype=acc, device=logits_CV.device)
        logp_C = torch.empty(C, dtype=acc, device=logits_CV.device)
    if C == 0:
        return lse_C, logp_C
    _build_both_paths(logits_CV, target_C, acc)
    most = -(-V // FWD_BLOCK_V)  # spans of at least one block each
    split = max(1, min(-(-FWD_PROGRAMS // C), most))
    span = -(-V // split)
    if split == 1:
        _lse_partial_kernel[(C, 1)](logits_CV, logits_CV.stride(0), target_C, lse_C, logp_C, V, span, 1,
                                    WHOLE=True, BLOCK_V=FWD_BLOCK_V, num_warps=8)
        return lse_C, logp_C
    m_CK = torch.empty(C, split, dtype=acc, device=logits_CV.device)
    s_CK = torch.empty(C, split, dtype=acc, device=logits_CV.device)
    _lse_partial_kernel[(C, split)](logits_CV, logits_CV.stride(0), target_C, m_CK, s_CK, V, span, split,
                                    WHOLE=False, BLOCK_V=FWD_BLOCK_V, num_warps=8)
    _lse_combine_kernel[(C,)](logits_CV, logits_CV.stride(0), target_C, m_CK, s_CK, lse_C, logp_C, split,
                              SPLIT_P2=triton.next_power_of_2(most), num_warps=1)
    return lse_C, logp_C


_BUILT: set[tuple] = set()  # (vocabulary, logits dtype, device) whose forward kernels are built


def _build_both_paths(logits_CV: Tensor, target_C: Tensor, acc: torch.dtype) -> None:
    """At the first call for a vocabulary size, dtype and device, run both forward paths (whole rows, and split
    rows + combine) on its first row into scratch: all three kernels compile in the run's first step, not inside
    the later step whose last chunk first has few rows (2 kernels at once: the "compiled 2" steps of
    results/2026-11-28-step-compiles-h200.md had that signature)."""
    key = (logits_CV.shape[1], logits_CV.dtype, logits_CV.device)
    if key in _BUILT:
        return
    _BUILT.add(key)
    V, row, target = logits_CV.shape[1], logits_CV[:1], target_C[:1]
    most = -(-V // FWD_BLOCK_V)
    # separate allocations: Triton specialises on pointers' 16-byte alignment, as the real calls' buffers have it
    scratch = [torch.empty(max(most, 1), dtype=acc, device=logits_CV.device) for _ in range(4)]
    _lse_partial_kernel[(1, 1)](row, row.stride(0), target, scratch[0], scratch[1], V, V, 1,
                                WHOLE=True, BLOCK_V=FWD_BLOCK_V, num_warps=8)
    if most > 1:
        span = -(-V // most)
        _lse_partial_kernel[(1, most)](row, row.stride(0), target, scratch[0], scratch[1], V, span, most,
                                       WHOLE=False, BLOCK_V=FWD_BLOCK_V, num_warps=8)
        _lse_combine_kernel[(1,)](row, row.stride(0), target, scratch[0], scratch[1], scratch[2], scratch[3], most,
                                  SPLIT_P2=triton.next_power_of_2(most), num_warps=1)


def grad_logits_triton_(logits_RB: Tensor, lse_R: Tensor, g_R: Tensor, target_R: Tensor, v0: int) -> None:
    """`grad_logits_reference_` in one pass, in place (``lse_R``: float32)."""
    if lse_R.dtype != torch.float32:
        raise ValueError(f"the Triton log-prob kernels accumulate in float32, not {lse_R.dtype}")
    R, B = logits_RB.shape
    lse_R, g_R, target_R = lse_R.contiguous(), g_R.contiguous(), target_R.contiguous()  # g_R may be expanded
    if R and B:
        _grad_logits_kernel[(R, -(-B // BWD_SPAN))](logits_RB, logits_RB.stride(0), lse_R, g_R, target_R, B,
                                                     int(v0), SPAN=BWD_SPAN, BLOCK=BWD_BLOCK, num_warps=8)
