"""Execution modes: how one pack becomes one loss with a graph. Same packs, same rows, same loss formula.

- ``dense`` / ``dense-leaf`` (the baselines; `treepack.train.modes.dense`): every sequence on its own, or
  only the leaf sequences (a duplicate or a prefix of another sequence reads its log-probs from a leaf),
  rebuilt from the per-sequence paths only (``input_ids[seq_token_index]``, positions 0..L-1) and run as
  independent causal sequences in micro-batches of at most the pack's token count, each back-propagated
  before the next (``backward_done``). They never read ``parent``, ``subtree_end``, ``position_ids``,
  ``scale`` or ``loss_weight``, so a pack whose tree fields are wrong still gets a correct baseline and
  `treepack verify` sees the difference. Cost: sum_s L_s tokens (N_flat), or the leaves' tokens.
- ``tree``: one forward over the pack's T tree tokens with the tree mask (``subtree_end``) and restored
  positions (``position_ids``); each needed pack token p gets one log-prob, read at ``parent[p]``; rows
  gather them, so a shared token's gradient is summed over its sequences (gradient restoration). SFT with
  token-mean uses the fast path over ``loss_weight`` (no per-row tensors). Cost: T = N_tree tokens.
- ``dfs`` (AReaL-DTA; `treepack.train.modes.dfs`): walks the pack's tree depth first, forwarding each
  chain segment over the cached keys/values of its path and back-propagating as it pops, so the live
  graph is bounded by ``dfs_block_size`` tokens. It runs its backward inside the call (``backward_done``);
  callers use ``ModeResult.backward()``, which is ``loss.backward()`` for the other modes.
- ``auto`` (`treepack.train.modes.auto`): per pack, the faster of tree and dense-leaf by the FLOP model
  and a measured speed table (same loss, same gradients).

Legend: T pack tokens, F flat tokens (sum of the pack's sequence lengths), R loss rows, U pack tokens
whose log-prob is needed, D hidden size.
"""

from __future__ import annotations

from treepack.errors import ConfigError
from treepack.train.modes.auto import AutoMode, SpeedTable
from treepack.train.modes.base import LayoutError, Mode, ModeResult
from treepack.train.modes.dense import DenseMode
from treepack.train.modes.dfs import DfsMode
from treepack.train.modes.dfs_schedule import MERGE_ANCHOR_TOKENS
from treepack.train.modes.tree import TreeMode

MODES = ("tree", "dense", "dense-leaf", "dfs", "auto")

__all__ = ["MODES", "AutoMode", "DenseMode", "DfsMode", "LayoutError", "Mode", "ModeResult", "TreeMode", "make_mode"]


def make_mode(name: str, *, attention: str | None = None, chunk_rows: int = 4096,
              sft_fast_path: bool = True, dfs_block_size: int | None = 2048, dfs_keep_tokens: int = 0,
              dfs_order: str = "backward", dfs_subtree_calls: bool = True,
              dfs_merge_anchor_tokens: int = MERGE_ANCHOR_TOKENS, dfs_merge_pops: bool = True,
              dfs_cuda_graphs: bool = False,
              micro_batch_tokens: int | None = None, speed_table: SpeedTable | None = None) -> Mode:
    """A mode by name. ``attention`` None picks its default: the dense modes sdpa (for "auto" too), tree, dfs
    and auto's tree part the tree kernel's auto. ``micro_batch_tokens``: the dense modes' micro-batch bound
    (None: each pack's token count). ``speed_table``: auto's prices (None: the built-in one for the device)."""
    if name == "dfs":
        return DfsMode(attention or "auto", chunk_rows=chunk_rows, block_size=dfs_block_size,
                       keep_tokens=dfs_keep_tokens, order=dfs_order, sft_fast_path=sft_fast_path,
                       subtree_calls=dfs_subtree_calls, merge_anchor_tokens=dfs_merge_anchor_tokens,
                       merge_pops=dfs_merge_pops, cuda_graphs=dfs_cuda_graphs)
    if name in ("dense", "dense-leaf"):
        return DenseMode("sdpa" if attention in (None, "auto") else attention, chunk_rows=chunk_rows,
                         leaves=name == "dense-leaf", micro_batch_tokens=micro_batch_tokens)
    if name in ("tree", "auto"):
        if attention == "sdpa":
            raise ConfigError(f"attention 'sdpa' runs independent causal sequences; {name} mode needs a tree "
                              "kernel (auto, reference, flex, triton or fa4)")
        tree = TreeMode(attention or "auto", chunk_rows=chunk_rows, sft_fast_path=sft_fast_path)
        if name == "tree":
            return tree
        leaf = DenseMode("sdpa", chunk_rows=chunk_rows, leaves=True, micro_batch_tokens=micro_batch_tokens)
        return AutoMode(tree, leaf, table=speed_table)
    raise ConfigError(f"unknown mode {name!r} (modes: {', '.join(MODES)})")
