"""verl's FSDP actor with treepack computing the response log-probs of each micro-batch.

verl's ``DataParallelPPOActor._forward_micro_batch(micro_batch, temperature, calculate_entropy)`` scores the
response part, [B, R], of ``input_ids`` / ``attention_mask`` [B, L] (prompts padded on the left, responses on
the right). `TreeDataParallelPPOActor` computes it with `treepack.hf.padded_logprobs`: rows are stripped to
their tokens, packed into prefix trees (a GRPO group's prompt once) and scattered back, under the same
autocast verl uses (``fsdp_config.dtype``). verl already cut the batch into micro-batches
(``ppo_micro_batch_size_per_gpu`` rows, or ``ppo_max_token_len_per_gpu`` tokens with ``use_dynamic_bsz``): one
micro-batch is one tree forward, so its memory budget stays verl's; the result's dtype is verl's (float32,
float64 for a float64 model). verl 0.7 returns a dict (``log_probs``, ``entropys``), 0.6 a tuple
``(entropy, log_probs)``: the override answers in the form its parent does.

Use it where verl builds its actor, e.g. in your worker (verl runs workers as Ray actors: do it in code the
worker process imports)::

    import verl.workers.fsdp_workers as workers
    from treepack.hf.verl import TreeDataParallelPPOActor
    workers.DataParallelPPOActor = TreeDataParallelPPOActor   # before the worker builds its actor

Sharing happens within one micro-batch, so make micro-batches hold whole groups (``ppo_micro_batch_size_per_gpu``
a multiple of ``rollout.n``); verl's padding-free paths (``use_remove_padding``, fused kernels, its prefix
grouper) are replaced by the tree; Ulysses sequence parallelism (a sequence split over ranks), multimodal
micro-batches and ``calculate_sum_pi_squared`` fall back to verl's forward. Needs verl 0.6 or 0.7 (0.8 removed
``DataParallelPPOActor`` for its engine workers); tested with 0.7.1.
"""

from __future__ import annotations

import torch
from packaging.version import Version

from treepack.hf.logprobs import padded_logprobs

try:
    import verl
    from verl.workers.actor.dp_actor import DataParallelPPOActor
except ImportError as e:  # pragma: no cover - the import error says what is missing
    raise ImportError("treepack.hf.verl needs verl's DataParallelPPOActor (verl 0.6 or 0.7): pip install "
                      "'verl>=0.6,<0.8'") from e

RETURNS_DICT = Version(verl.__version__) >= Version("0.7")


def tree_forward_micro_batch(actor_module, micro_batch, temperature: float, calculate_entropy: bool = False, *,
                             device_type: str = "cuda", param_dtype: torch.dtype = torch.bfloat16
                             ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(entropy [B, R] or None, log_probs [B, R]) of a verl micro-batch, computed by tree packing under verl's
    autocast (``param_dtype`` on ``device_type``)."""
    response_length = micro_batch["responses"].size(-1)
    autocast = param_dtype in (torch.bfloat16, torch.float16)
    with torch.autocast(device_type=device_type, dtype=param_dtype, enabled=autocast):
        log_probs, entropy = padded_logprobs(actor_module, micro_batch["input_ids"], micro_batch["attention_mask"],
                                             response_length, temperature=temperature,
                                             return_entropy=calculate_entropy)
    return entropy, log_probs


class TreeDataParallelPPOActor(DataParallelPPOActor):
    """verl's actor with a tree-packed forward (same log-probs, shared prompts computed once)."""

    def _forward_micro_batch(self, micro_batch, temperature, calculate_entropy=False):
        if ("multi_modal_inputs" in micro_batch.keys() or self.use_ulysses_sp  # noqa: SIM118 (TensorDict)
                or self.config.get("calculate_sum_pi_squared", False)):
            return super()._forward_micro_batch(micro_batch, temperature, calculate_entropy)
        entropy, log_probs = tree_forward_micro_batch(
            self.actor_module, micro_batch, temperature, calculate_entropy, device_type=self.device_name,
            param_dtype=getattr(self, "param_dtype", torch.bfloat16))
        if not RETURNS_DICT:
            return entropy, log_probs
        out = {"log_probs": log_probs}
        if calculate_entropy:
            out["entropys"] = entropy
        return out
