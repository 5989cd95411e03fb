"""``torch.ops.treepack.norm_rope_fwd`` / ``_bwd``: the fused kernels as operators, with autograd, and
`norm_rope`, which the decoder calls.

Why an operator: inside a compiled decoder layer the kernels stay opaque to Inductor (which would otherwise
trace into them) and the backward saves only x; defined on a plain `torch.library.Library` like the
tree-attention ops (a cheaper call than ``torch.library.custom_op``'s wrapper). CUDA runs the Triton
kernels; CPU runs the reference (so ``torch.library.opcheck`` and CPU tests exercise the same operator).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .reference import norm_rope_grads_reference, norm_rope_reference
from .triton import norm_rope_bwd_triton, norm_rope_fwd_triton, triton_supported

__all__ = ["NORM_ROPE_KERNELS", "norm_rope"]

NORM_ROPE_KERNELS = "auto"  # auto: the operator where `triton_supported`; "reference": the reference everywhere
# (compiled by Inductor on the compiled path: the A/B baseline of benchmarks/norm_rope.py)

_LIB = torch.library.Library("treepack", "FRAGMENT")
_LIB.define("norm_rope_fwd(Tensor x, Tensor weight, Tensor cos, Tensor sin, float eps) -> Tensor")
_LIB.define("norm_rope_bwd(Tensor grad, Tensor x, Tensor weight, Tensor cos, Tensor sin, float eps) "
            "-> (Tensor, Tensor)")


_LIB.impl("norm_rope_fwd", norm_rope_fwd_triton, "CUDA")
_LIB.impl("norm_rope_bwd", norm_rope_bwd_triton, "CUDA")
_LIB.impl("norm_rope_fwd", norm_rope_reference, "CPU")  # autograd records nothing inside a kernel
_LIB.impl("norm_rope_bwd", norm_rope_grads_reference, "CPU")


@torch.library.register_fake("treepack::norm_rope_fwd", lib=_LIB)
def _fwd_fake(x, weight, cos, sin, eps):
    return torch.empty_like(x)


@torch.library.register_fake("treepack::norm_rope_bwd", lib=_LIB)
def _bwd_fake(grad, x, weight, cos, sin, eps):
    return torch.empty_like(x), torch.empty_like(weight)


def _setup_context(ctx, inputs, output):
    x, weight, cos, sin, eps = inputs
    ctx.save_for_backward(x, weight, cos, sin)
    ctx.eps = eps


def _backward(ctx, grad):
    x, weight, cos, sin = ctx.saved_tensors
    dx, dw = torch.ops.treepack.norm_rope_bwd(grad, x, weight, cos, sin, ctx.eps)
    return dx, dw, None, None, None


torch.library.register_autograd("treepack::norm_rope_fwd", _backward, setup_context=_setup_context, lib=_LIB)


def norm_rope(x_TNE: Tensor, weight_E: Tensor, cos_TE: Tensor, sin_TE: Tensor, eps: float) -> Tensor:
    """`norm_rope_reference` (RMSNorm of each head, then RoPE; the result in x's dtype): the fused operator on
    CUDA where `triton_supported`, the reference elsewhere (CPU, float64, odd head sizes)."""
    if NORM_ROPE_KERNELS == "auto" and triton_supported(x_TNE, weight_E, cos_TE):
        return torch.ops.treepack.norm_rope_fwd(x_TNE, weight_E, cos_TE, sin_TE, eps)
    return norm_rope_reference(x_TNE, weight_E, cos_TE, sin_TE, eps)
