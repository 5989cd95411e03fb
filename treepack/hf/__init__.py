"""treepack inside any trainer: tree-packed forward for Hugging Face causal LMs, and the RL losses on top.

    from treepack.hf import token_logprobs, policy_loss, grpo_advantages
    logps = token_logprobs(model, sequences)          # per sequence: log p(x_t | x_<t), t >= 1
    loss = policy_loss(logps, old_logps, grpo_advantages(rewards, groups), loss_masks)

The sequences are packed into prefix trees (every shared prefix once per pack) and run through the
model's own modules with tree attention (an ``attn_implementation`` registered with transformers, and a
mask function beside it) and depth positions; a self-check on first use compares one small pack with the
model's per-sequence forward. Modules: `logprobs` (token_logprobs; padded_logprobs for TRL/verl batches), `forward`
(pack_logprobs), `batch` (TreeBatch), `attention` (the attention and mask functions), `support`
(which models, refused by name otherwise), `check` (the self-check, exact_float64), `losses`, `data`
(PackDataset), `parallel` (each rank's packs and the global normaliser), `trainer` (``treepack train``
with ``model.source = "hf"``); `trl` and `verl` (TRL's GRPOTrainer and verl's actor, tree-packed; imported
only by name, they need those libraries). torch and transformers are imported here and nowhere below train/.
"""

from treepack.hf.attention import IMPLEMENTATION, TreeAttentionError, register
from treepack.hf.batch import PackLogprobs, TreeBatch
from treepack.hf.check import SelfCheckError, exact_float64, self_check
from treepack.hf.data import PackDataset, collate_pack, pack_rollouts
from treepack.hf.forward import pack_logprobs, sequence_logprobs
from treepack.hf.logprobs import padded_logprobs, token_logprobs
from treepack.hf.losses import (
    AGGREGATIONS,
    batch_totals,
    grpo_advantages,
    gspo_loss,
    policy_loss,
    rloo_advantages,
    sft_loss,
)
from treepack.hf.parallel import RankShare, global_totals, pack_totals, shard_packs
from treepack.hf.support import UnsupportedModelError
from treepack.io.sequences import rollouts_from_sequences  # numpy only; exported here for trainers
from treepack.train.losses import BatchTotals, kl_estimate

__all__ = [
    "AGGREGATIONS",
    "IMPLEMENTATION",
    "BatchTotals",
    "PackDataset",
    "PackLogprobs",
    "RankShare",
    "SelfCheckError",
    "TreeAttentionError",
    "TreeBatch",
    "UnsupportedModelError",
    "batch_totals",
    "collate_pack",
    "exact_float64",
    "global_totals",
    "grpo_advantages",
    "gspo_loss",
    "kl_estimate",
    "pack_logprobs",
    "pack_rollouts",
    "pack_totals",
    "padded_logprobs",
    "policy_loss",
    "register",
    "rloo_advantages",
    "rollouts_from_sequences",
    "self_check",
    "sequence_logprobs",
    "sft_loss",
    "shard_packs",
    "token_logprobs",
]
