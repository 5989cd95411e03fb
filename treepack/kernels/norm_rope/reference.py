"""Pure-torch RMSNorm and rotary embedding: the decoder's own math and the oracle of the fused kernels.

Computed as ``transformers`` computes them: RMSNorm upcasts 16-bit inputs to float32, rounds the normalised
values back to the input dtype and multiplies by the weight in the promoted dtype; RoPE rotates halves
(``rotate_half``), in the dtype of cos and sin (float32, float64 for float64 models).

Legend: T tokens, N heads, E head dim.
"""

from __future__ import annotations

import torch
from torch import Tensor


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last axis as ``transformers`` computes it (16-bit inputs upcast to float32)."""
    dtype = x.dtype
    xf = x.float() if dtype in (torch.float16, torch.bfloat16) else x
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x_TNE: Tensor, cos_TE: Tensor, sin_TE: Tensor) -> Tensor:
    cos, sin = cos_TE[:, None, :], sin_TE[:, None, :]
    return (x_TNE * cos + rotate_half(x_TNE) * sin).to(x_TNE.dtype)


def norm_rope_reference(x_TNE: Tensor, weight_E: Tensor, cos_TE: Tensor, sin_TE: Tensor, eps: float) -> Tensor:
    """Qwen3's query / key path after the projection: RMSNorm of each head's E values, then RoPE at each token's
    angles; the result in x's dtype (what the attention kernel takes)."""
    return apply_rope(rms_norm(x_TNE, weight_E, eps), cos_TE, sin_TE).to(x_TNE.dtype)


def norm_rope_grads_reference(grad_TNE: Tensor, x_TNE: Tensor, weight_E: Tensor, cos_TE: Tensor, sin_TE: Tensor,
                              eps: float) -> tuple[Tensor, Tensor]:
    """(dx, dweight) of `norm_rope_reference` written out, with eager autograd's roundings (the gradient of a
    16-bit value is 16-bit): RoPE's transpose (``rotate_half``'s is cat(z2, -z1)), the weight's product, and
    RMSNorm's dx = dn / rms - x mean(dn x) / rms^3. The operator's CPU kernel (autograd does not record inside
    an operator's kernel)."""
    dtype = x_TNE.dtype
    xf = x_TNE.float() if dtype in (torch.float16, torch.bfloat16) else x_TNE
    inv = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    n = (xf * inv).to(dtype)
    y_dtype = torch.promote_types(weight_E.dtype, dtype)
    g = grad_TNE.to(torch.promote_types(y_dtype, cos_TE.dtype))
    gs1, gs2 = (g * sin_TE[:, None, :]).chunk(2, dim=-1)
    dy = (g * cos_TE[:, None, :] + torch.cat([gs2, -gs1], dim=-1)).to(y_dtype)
    dweight = (dy * n).sum(dim=(0, 1)).to(weight_E.dtype)
    dn = (dy * weight_E).to(dtype).to(xf.dtype)
    dxf = dn * inv - xf * inv.pow(3) * (dn * xf).mean(-1, keepdim=True)
    return dxf.to(dtype), dweight
