"""Public entry point of tree attention: validation, then the backend the registry resolves for the call.

Backends (registry.py; each imported on first use, so ``import treepack.kernels`` needs neither triton nor a
GPU):

* ``reference`` (reference.py): pure torch, any device and dtype, autograd; the oracle.
* ``flex`` (flex.py): torch's FlexAttention with a mask_mod of the same contract; a baseline to beat.
* ``triton`` (triton.py): fused forward + backward that consumes the per-pack block schedule of
  blocks.py; CUDA (or the Triton interpreter on CPU), bf16/fp16/fp32, head dims 32/64/128.
* ``fa4`` (fa4.py): FlashAttention-4's CuTe DSL kernels (Hopper, Blackwell) with block sparsity and a
  mask_mod over the same contract; bf16/fp16, head dims 64/128; the optional extra ``treepack[fa4]``.
* ``auto``: the fastest exact backend for the call by a measured table (`registry.resolve` over
  backends.py's table): fa4 for large calls where it is installed, triton otherwise, reference off CUDA.

Validation costs no host sync: shapes, dtypes and devices only. The values of ``subtree_end``
(``k < subtree_end[k] <= T``) are checked once per pack by `prepare`, and on every reference call given a
plain tensor (a host sync, on the slow path only); pass a `TreeMaskInfo` from `prepare` to every layer to build the block schedule only once.

Shape suffixes: T pack tokens, P prefix tokens, H query heads, K kv heads, D head dim.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import registry
from .backends import TRITON_DTYPES, TRITON_HEAD_DIMS, triton_supports
from .blocks import TreeMaskInfo, _dtype_name

__all__ = ["TRITON_DTYPES", "TRITON_HEAD_DIMS", "tree_attention", "triton_unsupported_reason"]


def _shape(t: Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def triton_unsupported_reason(q: Tensor) -> str | None:
    """Why the triton backend cannot run on these (validated) inputs, or None if it can."""
    return triton_supports(registry.AttentionCall.of(q))


def _validate(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    subtree_end: Tensor | TreeMaskInfo,
    prefix_k: Tensor | None,
    prefix_v: Tensor | None,
    impl: str,
) -> Tensor:
    if impl not in registry.names("tree"):
        impls = registry.names("tree")
        raise ValueError(f"impl must be one of {', '.join(repr(i) for i in impls)}, got {impl!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 3:
        raise ValueError(f"q must have shape [T, Hq, D], got {_shape(q)}")
    T, H, D = q.shape
    if k.dim() != 3 or k.shape[0] != T or k.shape[2] != D:
        raise ValueError(f"k must have shape [T, Hkv, D]=[{T}, Hkv, {D}], got {_shape(k)}")
    if v.shape != k.shape:
        raise ValueError(f"v must have the shape of k {_shape(k)}, got {_shape(v)}")
    K = k.shape[1]
    if K == 0 or H % K != 0:
        raise ValueError(f"query heads Hq={H} must be a multiple of kv heads Hkv={K} (GQA)")
    if not q.dtype.is_floating_point or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(
            "q, k and v must share one floating dtype, got "
            f"q {_dtype_name(q.dtype)}, k {_dtype_name(k.dtype)}, v {_dtype_name(v.dtype)}"
        )
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k and v must be on one device, got q {q.device}, k {k.device}, v {v.device}")

    if isinstance(subtree_end, TreeMaskInfo):
        subtree_end_T = subtree_end.subtree_end_T
        if subtree_end.num_tokens != T:
            raise ValueError(f"subtree_end (a TreeMaskInfo) covers T={subtree_end.num_tokens} tokens, q has T={T}")
    elif isinstance(subtree_end, Tensor):
        subtree_end_T = subtree_end
        if subtree_end.dtype != torch.int32 or subtree_end.shape != (T,):
            raise ValueError(
                f"subtree_end must be int32 of shape [T]=[{T}], "
                f"got {_dtype_name(subtree_end.dtype)} of shape {_shape(subtree_end)}"
            )
    else:
        raise TypeError(f"subtree_end must be an int32 tensor or a TreeMaskInfo, got {type(subtree_end).__name__}")
    if subtree_end_T.device != q.device:
        raise ValueError(f"subtree_end must be on the device of q ({q.device}), got {subtree_end_T.device}")

    if (prefix_k is None) != (prefix_v is None):
        raise ValueError("prefix_k and prefix_v must be given together")
    if prefix_k is not None:
        if prefix_k.dim() != 3 or prefix_k.shape[1:] != k.shape[1:]:
            raise ValueError(f"prefix_k must have shape [P, Hkv, D]=[P, {K}, {D}], got {_shape(prefix_k)}")
        if prefix_v.shape != prefix_k.shape:
            raise ValueError(f"prefix_v must have the shape of prefix_k {_shape(prefix_k)}, got {_shape(prefix_v)}")
        if prefix_k.dtype != q.dtype or prefix_v.dtype != q.dtype:
            raise ValueError(
                f"prefix_k and prefix_v must have the dtype of q ({_dtype_name(q.dtype)}), "
                f"got {_dtype_name(prefix_k.dtype)} and {_dtype_name(prefix_v.dtype)}"
            )
        if prefix_k.device != q.device or prefix_v.device != q.device:
            raise ValueError(
                f"prefix_k and prefix_v must be on the device of q ({q.device}), "
                f"got {prefix_k.device} and {prefix_v.device}"
            )
    return subtree_end_T


def tree_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    subtree_end: Tensor | TreeMaskInfo,
    *,
    prefix_k: Tensor | None = None,
    prefix_v: Tensor | None = None,
    scale: float | None = None,
    impl: str = "auto",
) -> Tensor:
    """Softmax attention over a packed prefix tree (tokens in DFS preorder).

    Query q attends key k iff ``k <= q < subtree_end[k]``: the subtree of k is the contiguous range
    [k, subtree_end[k]), so each query sees exactly its ancestors and itself, i.e. the causal context of
    every root-to-leaf path through it. A cached prefix (DFS mode: the KV of the path above the segment)
    is visible to every query and comes before the segment's keys.

    Example: a root ``a b`` branching into ``c d`` and ``e``; subtree_end = [5, 5, 4, 4, 5]::

                      keys: prefix | a b c d e
            query a (0)      1 1 1 | 1 . . . .
            query b (1)      1 1 1 | 1 1 . . .
            query c (2)      1 1 1 | 1 1 1 . .
            query d (3)      1 1 1 | 1 1 1 1 .
            query e (4)      1 1 1 | 1 1 . . 1      (e skips its sibling branch c d)

    Args:
        q: [T, Hq, D] queries; bfloat16, float16, float32 or float64.
        k: [T, Hkv, D] keys, same dtype and device; Hq % Hkv == 0 (GQA: query head h reads kv head
            h // (Hq // Hkv)).
        v: [T, Hkv, D] values, same as k.
        subtree_end: int32 [T], exclusive end of each token's subtree with k < subtree_end[k] <= T
            (padding tokens: subtree_end[q] = q + 1), or a `TreeMaskInfo` from `prepare(subtree_end)`,
            built once per pack and reused by every layer (required for speed with ``impl="triton"``).
        prefix_k: optional [P, Hkv, D] cached keys visible to every query (same dtype and device).
        prefix_v: optional [P, Hkv, D] cached values; given together with prefix_k.
        scale: softmax scale, default 1 / sqrt(D).
        impl: "reference" (pure torch), "flex" (FlexAttention), "triton" (fused kernels, CUDA), "fa4"
            (FlashAttention-4, Hopper / Blackwell, bf16 / fp16) or "auto" (the fastest of fa4 and triton for
            the call's size, else reference: `registry.resolve`); the names are `registry.names("tree")`.

    Returns:
        [T, Hq, D] attention output in the dtype of q. Differentiable in q, k, v, prefix_k and prefix_v.
    """
    _validate(q, k, v, subtree_end, prefix_k, prefix_v, impl)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if prefix_k is not None and prefix_k.shape[0] == 0:
        prefix_k = prefix_v = None
    cache = subtree_end.cache if isinstance(subtree_end, TreeMaskInfo) else {}
    call = registry.AttentionCall.of(q, k, v, prefix_k, prefix_v, prefix=0 if prefix_k is None else prefix_k.shape[0],
                                     pairs=cache.get("pairs"), whole_tokens=cache.get("whole_tokens", 0))
    try:
        backend = registry.resolve("tree", impl, call)
    except registry.BackendError as exc:
        raise ValueError(f"impl={impl!r}: {exc.reason}") from None
    return backend.run(q, k, v, subtree_end, prefix_k=prefix_k, prefix_v=prefix_v, scale=float(scale))
