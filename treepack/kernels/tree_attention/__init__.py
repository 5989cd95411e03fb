"""Tree attention: softmax attention under the mask ``k <= q < subtree_end[k]`` (docs/design.md §6, §8).

``tree_attention`` validates and runs the backend that `registry.resolve` picks (reference, flex, triton,
fa4; ``registry`` is the one table of attention backends, tree and causal); ``prepare`` builds the per-pack
block schedule once for all layers; ``tree_mask`` and ``chains_subtree_end`` are helpers for tests and for
the dense baseline (a forest of causal chains).
"""

from .api import tree_attention, triton_unsupported_reason
from .blocks import TreeMaskInfo, chains_subtree_end, prepare, tree_mask, visible_pairs
from .registry import AttentionCall, BackendError, register_backend, resolve

__all__ = [
    "AttentionCall",
    "BackendError",
    "TreeMaskInfo",
    "chains_subtree_end",
    "prepare",
    "register_backend",
    "resolve",
    "tree_attention",
    "tree_mask",
    "triton_unsupported_reason",
    "visible_pairs",
]
