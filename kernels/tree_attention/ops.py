"""Registering a tree-attention kernel's forward and backward as ``torch.ops.treepack`` operators.

Why: a registered op with a fake kernel is what ``torch.compile`` traces around (the kernel stays opaque inside
a compiled decoder layer), and its autograd formula saves only what the backward needs. The ops are defined
on a plain `torch.library.Library` with Python kernels, not with ``torch.library.custom_op``: in a profiled
dfs step (~800 attention calls) custom_op's per-call wrapper cost ~0.45 ms of host time a call, the largest
single host cost of the step (benchmarks/results/2026-11-25-fa4-replay-h200.md). Same schema, fake kernels and
autograd as custom_op would register; ``torch.library.opcheck`` passes on the Triton op (test_tree_attention).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["register_kernel_ops"]

_LIB = torch.library.Library("treepack", "FRAGMENT")

# the arguments every kernel pair shares ahead of its own: the queries, keys and values, and the cached prefix
_FWD_HEAD = "Tensor q, Tensor k, Tensor v, Tensor? prefix_k, Tensor? prefix_v"
_BWD_HEAD = "Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor? prefix_k, Tensor? prefix_v, Tensor out, Tensor lse"


def register_kernel_ops(name: str, tail: str, *, fwd: Callable, fwd_fake: Callable, bwd: Callable,
                        bwd_fake: Callable, backward: Callable, setup_context: Callable, dispatch_key: str):
    """Define ``treepack::{name}_fwd`` -> (out, lse) and ``treepack::{name}_bwd`` -> (dq, dk, dv, dprefix_k,
    dprefix_v), both taking the shared head and then ``tail`` (the kernel's own schema arguments); register
    the kernels for ``dispatch_key``, the fake kernels, and ``backward`` as the forward's autograd formula.
    Returns the two OpOverloads."""
    _LIB.define(f"{name}_fwd({_FWD_HEAD}, {tail}) -> (Tensor, Tensor)")
    _LIB.define(f"{name}_bwd({_BWD_HEAD}, {tail}) -> (Tensor, Tensor, Tensor, Tensor, Tensor)")
    for op, kernel, fake in ((f"{name}_fwd", fwd, fwd_fake), (f"{name}_bwd", bwd, bwd_fake)):
        _LIB.impl(op, kernel, dispatch_key)
        torch.library.register_fake(f"treepack::{op}", fake, lib=_LIB)
    torch.library.register_autograd(f"treepack::{name}_fwd", backward, setup_context=setup_context, lib=_LIB)
    packet = torch.ops.treepack
    return getattr(packet, f"{name}_fwd").default, getattr(packet, f"{name}_bwd").default
