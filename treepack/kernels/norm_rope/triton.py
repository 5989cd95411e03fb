"""Triton kernels for `norm_rope_reference`: per-head RMSNorm then RoPE, forward and backward, one pass each.

Why not Inductor: compiled from the reference inside the decoder layer, the queries' forward ran at ~1.2 TB/s
(its rotate-half reads the row twice through masked loads), and the backward wrote the RoPE gradient to a
float32 [T, N, E] buffer that a second kernel read back for the norm's two reductions: queries and keys took
~0.6 ms of a Qwen3-0.6B layer's fused kernels per 22k-token pack on an H100, five kernels and two float32
round trips. Here the forward reads x once and writes the result; the backward reads the gradient and x
once, writes dx, and leaves one float32 row of weight-gradient partial sums per program
(benchmarks/results/2026-11-26-norm-rope-kernels-h100.md).

A program holds whole tokens (all N heads of each; the token's angles are loaded once for its heads) as two
halves of E/2 columns, which is what RoPE's rotate-half pairs up (column i with i + E/2). The roundings of
the reference are kept: the normalised values in x's dtype, the weighted values in the weight's dtype when
it is 16-bit, and the same for their gradients.

Legend: T tokens, N heads (NP: padded to a power of two), E head dim, H = E / 2.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: `triton_supported` says no
    triton = None

FWD_BLOCK_R = 64  # rows (token x head) a forward program holds, whole tokens (64 x 128 bf16: 16 KiB in and out)
BWD_BLOCK_R = 64  # rows a backward program holds; one float32 weight-gradient row of partial sums per program
NUM_WARPS = 4


def triton_supported(x: Tensor, weight: Tensor, cos: Tensor) -> bool:
    """Whether the kernels run here: CUDA, a [T, N, E] float tensor with E/2 a power of two, a weight of E
    values, and float32 angles of [T, E]."""
    if triton is None or not x.is_cuda or x.dim() != 3:
        return False
    E = x.shape[-1]
    return (x.dtype in (torch.bfloat16, torch.float16, torch.float32) and E >= 2 and E % 2 == 0
            and (E // 2) & (E // 2 - 1) == 0 and weight.shape == (E,)
            and weight.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and cos.dtype == torch.float32 and cos.shape == (x.shape[0], E))


if triton is not None:

    @triton.jit
    def _tile(pid, T, N: tl.constexpr, NP: tl.constexpr, H: tl.constexpr, BLOCK_T: tl.constexpr):
        """A program's tile: BLOCK_T tokens x NP heads (N real) x H columns. The 64-bit element offset of its
        first token in x ([T, N, 2H]) and in the angles ([T, 2H]); 32-bit offsets of the first half within
        them and the masks (the angles: one row a token, shared by its heads)."""
        t0 = pid * BLOCK_T
        t = tl.arange(0, BLOCK_T)
        n = tl.arange(0, NP)[None, :, None]
        col = tl.arange(0, H)
        xo = t[:, None, None] * (N * 2 * H) + n * (2 * H) + col[None, None, :]
        ao = t[:, None] * (2 * H) + col[None, :]
        ok = (t0 + t < T)[:, None]
        return t0.to(tl.int64) * (N * 2 * H), xo, ok[:, :, None] & (n < N), t0.to(tl.int64) * (2 * H), ao, ok

    @triton.jit
    def _angles(cos_ptr, sin_ptr, ao, aok, H: tl.constexpr):
        """cos and sin halves of each token, [BLOCK_T, 1, H] (broadcast over the heads)."""
        c1 = tl.load(cos_ptr + ao, mask=aok, other=0.0)[:, None, :]
        c2 = tl.load(cos_ptr + ao + H, mask=aok, other=0.0)[:, None, :]
        s1 = tl.load(sin_ptr + ao, mask=aok, other=0.0)[:, None, :]
        s2 = tl.load(sin_ptr + ao + H, mask=aok, other=0.0)[:, None, :]
        return c1, c2, s1, s2

    @triton.jit
    def _normalised(x1, x2, eps, H: tl.constexpr, XT: tl.constexpr):
        """1 / rms of each head's row and the normalised halves, rounded to x's dtype as the reference does."""
        inv = tl.math.rsqrt((tl.sum(x1 * x1, 2) + tl.sum(x2 * x2, 2)) / (2 * H) + eps)[:, :, None]
        return inv, (x1 * inv).to(XT).to(tl.float32), (x2 * inv).to(XT).to(tl.float32)

    @triton.jit(do_not_specialize=["T"])  # one variant for every token count
    def _norm_rope_fwd_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, T, eps, N: tl.constexpr,
                              NP: tl.constexpr, H: tl.constexpr, BLOCK_T: tl.constexpr, ROUND_Y: tl.constexpr):
        """out = rope(w * bf16(x / rms(x))): halves y1, y2 of the weighted row give y1 c1 - y2 s1 and
        y2 c2 + y1 s2 (the reference's x cos + rotate_half(x) sin)."""
        x_base, xo, ok, a_base, ao, aok = _tile(tl.program_id(0), T, N, NP, H, BLOCK_T)
        x_ptr += x_base
        out_ptr += x_base
        cos_ptr += a_base
        sin_ptr += a_base
        XT = x_ptr.dtype.element_ty
        x1 = tl.load(x_ptr + xo, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + xo + H, mask=ok, other=0.0).to(tl.float32)
        _, n1, n2 = _normalised(x1, x2, eps, H, XT)
        col = tl.arange(0, H)[None, None, :]
        y1 = tl.load(w_ptr + col).to(tl.float32) * n1
        y2 = tl.load(w_ptr + H + col).to(tl.float32) * n2
        if ROUND_Y:  # a 16-bit weight: the reference's product is in that dtype
            y1 = y1.to(w_ptr.dtype.element_ty).to(tl.float32)
            y2 = y2.to(w_ptr.dtype.element_ty).to(tl.float32)
        c1, c2, s1, s2 = _angles(cos_ptr, sin_ptr, ao, aok, H)
        tl.store(out_ptr + xo, (y1 * c1 - y2 * s1).to(XT), mask=ok)
        tl.store(out_ptr + xo + H, (y2 * c2 + y1 * s2).to(XT), mask=ok)

    @triton.jit(do_not_specialize=["T"])  # one variant for every token count
    def _norm_rope_bwd_kernel(g_ptr, x_ptr, w_ptr, cos_ptr, sin_ptr, dx_ptr, dw_ptr, T, eps, N: tl.constexpr,
                              NP: tl.constexpr, H: tl.constexpr, BLOCK_T: tl.constexpr, ROUND_Y: tl.constexpr):
        """From the output's gradient g: dy (RoPE's transpose: dy1 = g1 c1 + g2 s2, dy2 = g2 c2 - g1 s1), the
        weight's partial sums of dy n over the program's rows, dn = dy w, and RMSNorm's
        dx = dn / rms - x sum(dn x) / (E rms^3)."""
        pid = tl.program_id(0)
        x_base, xo, ok, a_base, ao, aok = _tile(pid, T, N, NP, H, BLOCK_T)
        g_ptr += x_base
        x_ptr += x_base
        dx_ptr += x_base
        cos_ptr += a_base
        sin_ptr += a_base
        XT = x_ptr.dtype.element_ty
        col = tl.arange(0, H)
        g1 = tl.load(g_ptr + xo, mask=ok, other=0.0).to(tl.float32)
        g2 = tl.load(g_ptr + xo + H, mask=ok, other=0.0).to(tl.float32)
        c1, c2, s1, s2 = _angles(cos_ptr, sin_ptr, ao, aok, H)
        dy1 = g1 * c1 + g2 * s2
        dy2 = g2 * c2 - g1 * s1
        if ROUND_Y:  # the gradient of a 16-bit product is 16-bit
            dy1 = dy1.to(w_ptr.dtype.element_ty).to(tl.float32)
            dy2 = dy2.to(w_ptr.dtype.element_ty).to(tl.float32)
        x1 = tl.load(x_ptr + xo, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + xo + H, mask=ok, other=0.0).to(tl.float32)
        inv, n1, n2 = _normalised(x1, x2, eps, H, XT)
        # masked rows load zeros: their dy is 0, so they add nothing to the weight's sums
        tl.store(dw_ptr + pid * (2 * H) + col, tl.sum(tl.sum(dy1 * n1, 1), 0))
        tl.store(dw_ptr + pid * (2 * H) + H + col, tl.sum(tl.sum(dy2 * n2, 1), 0))
        dn1 = (dy1 * tl.load(w_ptr + col[None, None, :]).to(tl.float32)).to(XT).to(tl.float32)
        dn2 = (dy2 * tl.load(w_ptr + H + col[None, None, :]).to(tl.float32)).to(XT).to(tl.float32)
        coef = inv * inv * inv * ((tl.sum(dn1 * x1, 2) + tl.sum(dn2 * x2, 2)) / (2 * H))[:, :, None]
        tl.store(dx_ptr + xo, (dn1 * inv - x1 * coef).to(XT), mask=ok)
        tl.store(dx_ptr + xo + H, (dn2 * inv - x2 * coef).to(XT), mask=ok)


def _block_t(N: int, rows: int) -> tuple[int, int]:
    """(heads padded to a power of two, tokens a program holds) for about ``rows`` rows a program."""
    NP = triton.next_power_of_2(N)
    return NP, max(1, rows // NP)


def _round_y(x: Tensor, weight: Tensor) -> bool:
    """Whether the reference's weighted values (weight x normalised, in the promoted dtype) are 16-bit: weight
    and x of the same 16-bit dtype."""
    return torch.promote_types(weight.dtype, x.dtype) in (torch.bfloat16, torch.float16)


def norm_rope_fwd_triton(x_TNE: Tensor, weight_E: Tensor, cos_TE: Tensor, sin_TE: Tensor, eps: float) -> Tensor:
    """`norm_rope_reference` in one pass (a [T, N, E] tensor that `triton_supported` accepts)."""
    x_TNE, cos_TE, sin_TE = x_TNE.contiguous(), cos_TE.contiguous(), sin_TE.contiguous()
    T, N, E = x_TNE.shape
    out = torch.empty_like(x_TNE)
    if T * N:
        NP, BLOCK_T = _block_t(N, FWD_BLOCK_R)
        _norm_rope_fwd_kernel[(triton.cdiv(T, BLOCK_T),)](
            x_TNE, weight_E.contiguous(), cos_TE, sin_TE, out, T, float(eps), N=N, NP=NP, H=E // 2,
            BLOCK_T=BLOCK_T, ROUND_Y=_round_y(x_TNE, weight_E), num_warps=NUM_WARPS)
    return out


def norm_rope_bwd_triton(grad_TNE: Tensor, x_TNE: Tensor, weight_E: Tensor, cos_TE: Tensor, sin_TE: Tensor,
                         eps: float) -> tuple[Tensor, Tensor]:
    """(dx, dweight) of `norm_rope_reference` given the output's gradient: one pass over the rows, then the
    weight's float32 partial sums (one row per program) summed and cast to the weight's dtype."""
    grad_TNE, x_TNE = grad_TNE.contiguous(), x_TNE.contiguous()
    cos_TE, sin_TE = cos_TE.contiguous(), sin_TE.contiguous()
    T, N, E = x_TNE.shape
    dx = torch.empty_like(x_TNE)
    if T * N == 0:
        return dx, torch.zeros_like(weight_E)
    NP, BLOCK_T = _block_t(N, BWD_BLOCK_R)
    programs = triton.cdiv(T, BLOCK_T)
    partial = torch.empty(programs, E, dtype=torch.float32, device=x_TNE.device)
    _norm_rope_bwd_kernel[(programs,)](
        grad_TNE, x_TNE, weight_E.contiguous(), cos_TE, sin_TE, dx, partial, T, float(eps), N=N, NP=NP, H=E // 2,
        BLOCK_T=BLOCK_T, ROUND_Y=_round_y(x_TNE, weight_E), num_warps=NUM_WARPS)
    return dx, partial.sum(0).to(weight_E.dtype)
