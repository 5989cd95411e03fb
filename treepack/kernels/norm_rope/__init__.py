"""Qwen3's query / key path between the projection and attention: RMSNorm of each head, then RoPE.

``reference`` holds the pure-torch math (the decoder's own: `rms_norm`, `apply_rope`) every backend is tested
against; ``triton`` the CUDA kernels, one pass forward and one backward; ``op`` registers them as
``torch.ops.treepack`` operators with autograd and dispatches (`norm_rope`).
"""

from .op import norm_rope
from .reference import apply_rope, norm_rope_grads_reference, norm_rope_reference, rms_norm, rotate_half
from .triton import norm_rope_bwd_triton, norm_rope_fwd_triton, triton_supported

__all__ = [
    "apply_rope",
    "norm_rope",
    "norm_rope_bwd_triton",
    "norm_rope_fwd_triton",
    "norm_rope_grads_reference",
    "norm_rope_reference",
    "rms_norm",
    "rotate_half",
    "triton_supported",
]
