"""TRL's GRPOTrainer with treepack computing its token log-probs: `TreeGRPOTrainer`.

TRL scores a batch in ``GRPOTrainer._get_per_token_logps_and_entropies(model, input_ids, attention_mask,
logits_to_keep, batch_size, compute_entropy, ...)``: ``input_ids`` [B, P + C] (prompts padded on the left,
completions on the right), and it wants the log-probs of the C completion columns, [B, C]. The G completions
of a prompt repeat the prompt G times in that batch; `treepack.hf.padded_logprobs` strips the padding, packs
the rows into trees (the prompt once) and scatters the result back into [B, C]. The override keeps what the
caller asked for: TRL's ``batch_size`` (the reference and old-policy passes chunk a 16-row batch into 8-row
forwards; so does the tree), and TRL's dtype: float32 from TRL 1.15 on (its fused LM head returns float32 in
every precision), the logits' dtype before (float32, float64 for a float64 model; a bf16 model's bf16 log-probs
come back as float32 here).

Whole groups (``whole_groups=True``): with ``steps_per_generation`` > 1 TRL shuffles the generation batch
row by row before cutting it into steps, so a loss call holds pieces of many groups. Measured with TRL 1.16
(G = 4, 8 rows per step, 2 steps per generation, 24 loss calls): TRL's row shuffle puts 3.75 prompts in a
call, 2.17 completions per prompt on average (2 to 2.67; 2.08 expected by counting); with ``whole_groups``
every call holds 2 whole groups, 4 completions per prompt: each prompt is computed once for 4 completions
instead of once for about 2. The option shuffles whole groups instead (rows stay random across steps
at the group level); each step then sees ``per_device_train_batch_size / G`` prompts instead of a random
mix, which is what TRL's ``steps_per_generation = 1`` does anyway. If the generation batch does not arrive as
runs of G rows with the same prompt (several processes cutting groups), TRL's row shuffle runs and
`TreeGRPOTrainer.whole_group_fallbacks` counts it.

Needs ``trl>=1.7,<2`` (its three-value return; tests/test_trl.py passes with 1.7.1 and 1.16.0). Multimodal inputs and MoE auxiliary losses
fall back to TRL's own forward.
"""

from __future__ import annotations

import torch
from packaging.version import Version
from torch import Tensor

from treepack.hf.logprobs import padded_logprobs

try:
    import trl
    import trl.trainer.grpo_trainer as _grpo
    from trl import GRPOTrainer
except ImportError as e:  # pragma: no cover - the import error says what is missing
    raise ImportError("treepack.hf.trl needs TRL: pip install 'trl>=1.7,<2'") from e

# TRL's fused LM head (1.15 on) accumulates and returns float32; before, the logits' dtype (padded_logprobs' default)
TRL_LOGPROB_DTYPE = torch.float32 if Version(trl.__version__) >= Version("1.15") else None


def group_runs(batch: dict, group_size: int) -> bool:
    """True when the batch's rows come as consecutive runs of ``group_size`` rows sharing one prompt (TRL's
    sampler order: each prompt repeated G times)."""
    ids, mask = batch.get("prompt_ids"), batch.get("prompt_mask")
    if not isinstance(ids, Tensor) or ids.dim() != 2 or ids.shape[0] % group_size:
        return False
    ids = ids.masked_fill(mask == 0, -1) if isinstance(mask, Tensor) else ids
    runs = ids.view(ids.shape[0] // group_size, group_size, -1)
    return bool((runs == runs[:, :1]).all())


def shuffle_groups(batch: dict, group_size: int) -> dict:
    """TRL's ``shuffle_sequence_dict`` with whole groups: one random order of the groups, each group's rows
    kept together and in order (values: tensors with a batch dimension, lists, 0-d tensors, None)."""
    n = len(next(v for v in batch.values() if v is not None))
    order = torch.randperm(n // group_size)
    permutation = (order[:, None] * group_size + torch.arange(group_size)).reshape(-1)

    def permute(v):
        if v is None or (isinstance(v, Tensor) and v.dim() == 0):
            return v
        return v[permutation] if isinstance(v, Tensor) else [v[i] for i in permutation.tolist()]

    return {key: permute(value) for key, value in batch.items()}


class TreeGRPOTrainer(GRPOTrainer):
    """GRPOTrainer whose log-prob forward is tree-packed (same numbers, shared prompts computed once).

    ``whole_groups``: keep each prompt's completions in the same step when TRL splits a generation batch
    (``steps_per_generation`` > 1); off by default, which trains exactly like ``GRPOTrainer``."""

    def __init__(self, *args, whole_groups: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        if whole_groups and not callable(getattr(_grpo, "shuffle_sequence_dict", None)):
            raise RuntimeError("whole_groups: this TRL release has no grpo_trainer.shuffle_sequence_dict to "
                               "replace; use trl>=1.7,<2 or whole_groups=False")
        self.whole_groups = whole_groups
        self.whole_group_fallbacks = 0  # generation batches whose rows did not come in groups

    def _prepare_inputs(self, generation_batch):
        if not (self.whole_groups and self.model.training):
            return super()._prepare_inputs(generation_batch)
        G = self.num_generations
        row_shuffle = _grpo.shuffle_sequence_dict

        def shuffle(batch):
            if group_runs(batch, G):
                return shuffle_groups(batch, G)
            self.whole_group_fallbacks += 1
            return row_shuffle(batch)

        _grpo.shuffle_sequence_dict = shuffle  # the name TRL's _prepare_inputs calls, for this call only
        try:
            return super()._prepare_inputs(generation_batch)
        finally:
            _grpo.shuffle_sequence_dict = row_shuffle

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep,
                                           batch_size=None, compute_entropy=False, compute_aux_loss=False,
                                           **multimodal):
        if compute_aux_loss or any(v is not None for v in multimodal.values()):
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **multimodal)
        logps, entropies = padded_logprobs(model, input_ids, attention_mask, logits_to_keep,
                                           temperature=self.temperature, return_entropy=compute_entropy,
                                           batch_size=batch_size, dtype=TRL_LOGPROB_DTYPE)
        return logps, entropies, None
