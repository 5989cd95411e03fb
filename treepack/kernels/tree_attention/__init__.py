"""Tree attention: softmax attention under the mask ``k <= q < subtree_end[k]`` (DESIGN §6, §8).

``tree_attention`` validates and dispatches to a backend (reference, flex, triton); ``prepare`` builds the
per-pack block schedule once for all layers; ``tree_mask`` and ``chains_subtree_end`` are helpers for tests
and for the dense baseline (a forest of causal chains).
"""

from .api import tree_attention, triton_unsupported_reason
from .blocks import TreeMaskInfo, chains_subtree_end, prepare, tree_mask, visible_pairs

__all__ = [
    "TreeMaskInfo",
    "chains_subtree_end",
    "prepare",
    "tree_attention",
    "tree_mask",
    "triton_unsupported_reason",
    "visible_pairs",
]
