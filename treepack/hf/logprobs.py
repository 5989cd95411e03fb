"""The one-call APIs: token lists in, per-sequence log-probs out; and trainers' padded batches.

`token_logprobs` packs the given sequences (`treepack.hf.batch.plan_packs`: one pack, or treepack's
packing at a capacity), runs the self-check on first use (`treepack.hf.check`), forwards each pack
(`treepack.hf.forward.pack_logprobs`) and returns each sequence's log-probs in input order.

`padded_logprobs` is the bridge to TRL's and verl's actors: TRL (``GRPOTrainer.
_get_per_token_logps_and_entropies``) and verl (``DataParallelPPOActor._forward_micro_batch``) score a
batch as ``input_ids`` [B, L] with an ``attention_mask`` (prompts padded on the left, completions on the
right) and want the log-probs of the last ``logits_to_keep`` columns, [B, C]. It strips each row to its
real tokens, runs `token_logprobs` over the rows (the G completions of a prompt share the prompt once per
pack), and scatters the result back into the [B, C] layout, 0 where a column is padding or the first
token of its row. RoPE is relative, so dropping a row's left padding (its tokens start at position 0
here, at the pad count there) changes the attention math only by float rounding of the angles.

It keeps the caller's memory budget and dtype: ``batch_size`` cuts the rows into consecutive chunks of that
many, one tree forward each, as TRL chunks its own forward (a chunk's tree holds at most the chunk's real
tokens, never more than the [batch_size, L] rows TRL would run; TRL's rows come in prompt order, so a chunk
of 8 rows holds two whole groups of 4); ``dtype`` is what the replaced call returned (TRL's fused head:
float32 whatever the model's precision).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from treepack.errors import TreepackError
from treepack.hf.batch import TreeBatch, plan_packs
from treepack.hf.check import ensure_checked
from treepack.hf.forward import (
    DEFAULT_CHUNK_ROWS,
    logprob_dtype,
    model_device_dtype,
    pack_logprobs,
    prepare_model,
)
from treepack.io.sequences import token_arrays


def token_logprobs(model: nn.Module, sequences: Sequence, *, capacity: int | None = None,
                   attention: str = "auto", check: bool = True, temperature: float = 1.0,
                   return_entropy: bool = False, chunk_rows: int = DEFAULT_CHUNK_ROWS):
    """For each token list, ``log p(x_t | x_<t)`` for t = 1..L-1 (a tensor of length L-1), differentiable
    w.r.t. the model's parameters, computed by tree packing through the model's own modules.

    ``capacity``: most tree tokens per forward (None: all sequences in one pack); ``attention``: auto |
    reference | flex | triton | fa4 (auto, on CUDA: FA4 for large calls when installed, else the Triton
    kernel); ``check``: on the first call per model (and dtype, device, attention), run the self-check
    (`treepack.hf.check`) and raise `SelfCheckError` if tree and per-sequence disagree;
    ``temperature``: divide the logits by it (score samples drawn at that temperature);
    ``return_entropy``: also return each target's predictive entropy, ``(logps, entropies)``.
    Log-probs are float32 (float64 for float64 models), in input order; empty for sequences of < 2 tokens.
    """
    arrays = token_arrays(sequences, allow_empty=True)
    prep = prepare_model(model)
    device, dtype = model_device_dtype(prep.hf)
    vocab = prep.hf.get_input_embeddings().weight.shape[0]
    for i, a in enumerate(arrays):
        if a.size and int(a.max()) >= vocab:
            raise TreepackError(f"sequence {i}: token id {int(a.max())} is outside the model's vocabulary ({vocab})")
    if check:
        ensure_checked(model, arrays, attention=attention)
    logps: list[Tensor | None] = [None] * len(arrays)
    entropies: list[Tensor | None] = [None] * len(arrays)
    for pack in plan_packs(arrays, capacity):
        res = pack_logprobs(model, TreeBatch.from_pack(pack), attention=attention, temperature=temperature,
                            entropy=return_entropy, chunk_rows=chunk_rows)
        order = pack.seq_index.tolist()
        for i, lp in zip(order, res.per_sequence()):
            logps[i] = lp
        if return_entropy:
            for i, h in zip(order, res.per_sequence(res.entropy_T)):
                entropies[i] = h
    empty = torch.zeros(0, dtype=logprob_dtype(dtype), device=device)
    logps = [empty if lp is None else lp for lp in logps]
    if return_entropy:
        return logps, [empty if h is None else h for h in entropies]
    return logps


def padded_logprobs(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, logits_to_keep: int, *,
                    temperature: float = 1.0, return_entropy: bool = False, capacity: int | None = None,
                    attention: str = "auto", check: bool = True, chunk_rows: int = DEFAULT_CHUNK_ROWS,
                    batch_size: int | None = None,
                    dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor | None]:
    """(log-probs [B, C], entropies [B, C] or None) of the last C = ``logits_to_keep`` columns of a padded
    batch, computed by tree packing (see the module docstring). Differentiable like `token_logprobs`.

    ``batch_size``: most rows per tree forward (consecutive chunks, the last one shorter; None: all rows);
    ``dtype``: the result's dtype (None: float32, float64 for float64 models)."""
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise TreepackError(f"input_ids and attention_mask must both be [B, L], got {list(input_ids.shape)} "
                            f"and {list(attention_mask.shape)}")
    B, L = input_ids.shape
    C = int(logits_to_keep)
    if not 0 < C <= L:
        raise TreepackError(f"logits_to_keep must be in [1, {L}], got {C}")
    if batch_size is not None and int(batch_size) < 1:
        raise TreepackError(f"batch_size must be >= 1, got {batch_size}")
    mask = attention_mask.bool()
    rows = [torch.nonzero(mask[b])[:, 0] for b in range(B)]
    seqs = [input_ids[b, cols] for b, cols in enumerate(rows)]
    step = int(batch_size) if batch_size is not None else max(B, 1)
    logps: list[Tensor] = []
    entropies: list[Tensor] | None = [] if return_entropy else None
    for start in range(0, B, step):
        out = token_logprobs(model, seqs[start : start + step], capacity=capacity, attention=attention, check=check,
                             temperature=temperature, return_entropy=return_entropy, chunk_rows=chunk_rows)
        logps += out[0] if return_entropy else out
        if return_entropy:
            entropies += out[1]
    device = input_ids.device
    if dtype is None:
        dtype = logps[0].dtype if logps else torch.float32

    def scatter(values: list[Tensor]) -> Tensor:
        b_R = torch.cat([torch.full((max(len(c) - 1, 0),), b, dtype=torch.long, device=device)
                         for b, c in enumerate(rows)])
        col_R = torch.cat([c[1:] for c in rows]).to(device)
        v_R = torch.cat(values).to(device=device, dtype=dtype)
        keep = col_R >= L - C
        grid = torch.zeros(B, C, dtype=dtype, device=device)
        return grid.index_put((b_R[keep], col_R[keep] - (L - C)), v_R[keep])

    return scatter(logps), (scatter(entropies) if entropies is not None else None)
