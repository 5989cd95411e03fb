"""Kernels of treepack: per operation a pure-torch reference (the oracle), a Triton kernel (forward and
backward) and one validating API that dispatches between them. Importing this package needs neither a GPU
nor triton: backends are imported on first use.
"""

from .tree_attention import (
    TreeMaskInfo,
    chains_subtree_end,
    prepare,
    tree_attention,
    tree_mask,
    visible_pairs,
)

__all__ = ["TreeMaskInfo", "chains_subtree_end", "prepare", "tree_attention", "tree_mask", "visible_pairs"]
