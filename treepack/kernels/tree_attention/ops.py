"""Registering a tree-attention kernel's forward and backward as ``torch.ops.treepack`` operators.

Why: a registered op with a fake kernel is what ``torch.compile`` traces around (the kernel stays opaque inside
a compiled decoder layer), and its autograd formula saves only what the backward needs. The ops are defined
on a plain `torch.library.Library` with Python kernels, not with ``torch.library.custom_op``: in a profiled
dfs step (~800 attention calls) custom_op's per-call wrapper cost ~0.45 ms of host time a call, the largest
single host cost of the step (benchmarks/results/2026-11-25-fa4-replay-h200.md). Same schema, fake kernels and
autograd as custom_op would register; ``torch.library.opcheck`` passes on the Triton op (test_tree_attention).

Each op also gets a FLOP formula (`torch.utils.flop_counter`), so that FLOP counters and torch's activation
memory-budget partitioner see attention as the expensive op it is rather than as free to recompute. The
formula only sees shapes, not the mask, so it counts the causal bound: every query sees the whole prefix
and every earlier key of its call, which is at least as many pairs as any tree has.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.flop_counter import register_flop_formula

__all__ = ["causal_pairs_bound", "register_kernel_ops"]

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
    fwd_op, bwd_op = getattr(packet, f"{name}_fwd"), getattr(packet, f"{name}_bwd")
    register_flop_formula(fwd_op)(_fwd_flops)
    register_flop_formula(bwd_op)(_bwd_flops)
    return fwd_op.default, bwd_op.default


def causal_pairs_bound(queries: int, prefix: int) -> int:
    """Query-key pairs of ``queries`` tokens after a ``prefix`` if each saw the prefix and every earlier
    token (itself included): the most a tree (or chain) of that many tokens can have."""
    return queries * prefix + queries * (queries + 1) // 2


def _fwd_flops(q_shape, k_shape, v_shape, prefix_k_shape, prefix_v_shape, *args, out_shape=None, **kwargs) -> int:
    T, H, D = q_shape
    return 4 * H * D * causal_pairs_bound(T, 0 if prefix_k_shape is None else prefix_k_shape[0])


def _bwd_flops(grad_out_shape, q_shape, k_shape, v_shape, prefix_k_shape, prefix_v_shape, *args, out_shape=None,
               **kwargs) -> int:
    """Twice the forward's matmuls (dS and dP, then dQ, dK and dV): design §9's 12 FLOPs per pair, head and
    dimension for forward and backward together."""
    T, H, D = q_shape
    return 8 * H * D * causal_pairs_bound(T, 0 if prefix_k_shape is None else prefix_k_shape[0])
