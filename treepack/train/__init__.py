"""Training on packs: one model, one loss, several execution modes with the same gradients.

- ``config``: the TOML config as nested dataclasses (``treepack train config.toml``);
- ``model``: Qwen3 / Qwen2 / Llama decoder driven by ``position_ids`` and an ``AttentionContext``;
- ``attention``: ``AttentionContext``, which keys each query sees (tree mask or causal) and the call;
- ``compiled``: ``torch.compile`` of the layer math and the loss chunks on CUDA;
- ``losses``: per-(sequence, token) rows, SFT and GRPO/PPO-clip, global-batch normalisation;
- ``modes``: ``tree`` (one pass per pack), ``dfs`` (depth first, bounded graph), the baselines ``dense``
  and ``dense-leaf`` (micro-batched), ``auto`` (per pack the faster of tree and dense-leaf);
- ``data``: packs from shard directories or rollouts packed on the fly, global batches;
- ``loop``: the one training loop, any world size; ``sync``: its gradient sync (one process, or FSDP2 ranks:
  ``parallel``, ``fsdp``, ``distributed``); ``model_source``: where the model comes from (``hf`` registers from
  ``treepack.hf.trainer``); ``metrics``, ``run_log``: a step's numbers and where they go (metrics.jsonl,
  TensorBoard, W&B); ``checkpoint``: save/resume in either format; ``verify``: every mode against a dense baseline.

Importing this package imports nothing heavy; the submodules other than ``config`` and ``data`` need torch.
"""
