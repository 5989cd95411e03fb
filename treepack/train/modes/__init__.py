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
  graph is bounded by ``[train.dfs] block_size`` tokens. It runs its backward inside the call (``backward_done``);
  callers use ``ModeResult.backward()``, which is ``loss.backward()`` for the other modes.
- ``auto`` (`treepack.train.modes.auto`): per pack, the faster of tree and dense-leaf by the FLOP model
  and a measured speed table (same loss, same gradients).

The modes are a registry: each one registers its name, the attention family its calls run (``tree``: the
tree mask; ``causal``: independent sequences, the dense baselines) and a factory that takes the ``[train]``
settings whole (`TrainConfig`, ``[train.dfs]`` included). `make_mode` builds one by name; config validation
asks `mode_family` (`registry`) which attention backends a mode may name (`treepack.kernels.tree_attention.
registry`). A new mode is one module (a `Mode` subclass) plus one `register_mode` line at the end of this file.

Legend: T pack tokens, F flat tokens (sum of the pack's sequence lengths), R loss rows, U pack tokens
whose log-prob is needed, D hidden size.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from treepack.train.modes.auto import AutoMode, SpeedTable
from treepack.train.modes.base import LayoutError, Mode, ModeResult
from treepack.train.modes.dense import DenseMode
from treepack.train.modes.dfs import DfsMode
from treepack.train.modes.registry import (
    ModeExtras,
    ModeSpec,
    mode_family,
    mode_names,
    mode_spec,
    register_mode,
)
from treepack.train.modes.tree import TreeMode

if TYPE_CHECKING:
    from treepack.train.config import TrainConfig

__all__ = ["MODES", "AutoMode", "DenseMode", "DfsMode", "LayoutError", "Mode", "ModeExtras", "ModeResult", "ModeSpec",
           "TreeMode", "make_mode", "mode_family", "mode_names", "register_mode"]


def make_mode(name: str, train: TrainConfig | None = None, *, speed_table: SpeedTable | None = None,
              sft_fast_path: bool = True, merge_pops: bool = True, **changes) -> Mode:
    """The mode ``name`` built from ``train`` (None: the defaults) with ``changes`` (fields of `TrainConfig`,
    e.g. ``attention="reference", dfs=DfsConfig(block_size=64)``), validated as a config file is: an
    attention backend that does not serve the mode's family, a bad size, are `ConfigError`s naming the key."""
    from treepack.train.config import TrainConfig

    spec = mode_spec(name)
    train = (TrainConfig(mode=name, **changes) if train is None
             else dataclasses.replace(train, mode=name, **changes))
    if speed_table is None and train.speed_table:
        speed_table = SpeedTable.load(train.speed_table)
    return spec.factory(train, ModeExtras(speed_table, sft_fast_path, merge_pops))


def _tree(train: TrainConfig, extras: ModeExtras) -> TreeMode:
    return TreeMode(train.attention, chunk_rows=train.logits_chunk, sft_fast_path=extras.sft_fast_path)


def _dense(train: TrainConfig, extras: ModeExtras, *, leaves: bool = False) -> DenseMode:
    return DenseMode(train.attention, chunk_rows=train.logits_chunk, leaves=leaves,
                     micro_batch_tokens=train.micro_batch_token_count)


def _dfs(train: TrainConfig, extras: ModeExtras) -> DfsMode:
    return DfsMode(train.attention, chunk_rows=train.logits_chunk, dfs=train.dfs, sft_fast_path=extras.sft_fast_path,
                   merge_pops=extras.merge_pops)


def _auto(train: TrainConfig, extras: ModeExtras) -> AutoMode:
    leaf = DenseMode("auto", chunk_rows=train.logits_chunk, leaves=True, micro_batch_tokens=train.micro_batch_token_count)
    return AutoMode(_tree(train, extras), leaf, table=extras.speed_table)


# What registers (one line per mode; a new mode: its module, then one line here)
register_mode("tree", _tree, family="tree")
register_mode("dense", _dense, family="causal")
register_mode("dense-leaf", lambda train, extras: _dense(train, extras, leaves=True), family="causal")
register_mode("dfs", _dfs, family="tree")
register_mode("auto", _auto, family="tree")

MODES = mode_names()  # the built-in modes, in the order help texts list them
