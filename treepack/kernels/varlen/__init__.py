"""Causal attention over independent sequences laid back to back (padding-free packing, "varlen").

This is what the field's trainers run for a packed micro-batch (TRL ``padding_free``, verl
``use_remove_padding``): one call per layer over every sequence of the micro-batch, each attending causally
within itself. treepack's dense baselines run it, and so does tree mode for a pack that is a forest of chains
(every sequence of a tree a prefix of the next: multi-turn histories without dropped thinking), where the tree
mask *is* block-diagonal causal and the dense kernel is the fastest exact one.

- `reference`: pure torch (per-sequence SDPA, query-chunked and checkpointed off CUDA): any device, float64;
- `fast`: FlashAttention-4's varlen kernel (Hopper / Blackwell, bf16 / fp16) or torch's own flash varlen;
- `api`: ``causal_varlen_attention(q, k, v, lengths, impl=...)`` validates and dispatches, and
  ``chain_forest_lengths`` recognises a tree mask that is a forest of chains.
"""

from treepack.kernels.varlen.api import (
    VARLEN_IMPLS,
    CausalBatch,
    causal_varlen_attention,
    chain_forest_lengths,
    varlen_unsupported_reason,
)

__all__ = ["VARLEN_IMPLS", "CausalBatch", "causal_varlen_attention", "chain_forest_lengths", "varlen_unsupported_reason"]
