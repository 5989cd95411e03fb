"""Tree-packed forward of a Hugging Face causal LM: per-token log-probs of packed sequences.

One pack = one forward of the model's own modules over the pack's tree tokens (DFS preorder, design §6)
with ``position_ids`` = depth (each token's offset in its sequence, so RoPE sees what the per-sequence
forward sees) and the ``treepack`` attention implementation (`treepack.hf.attention`). The log-prob of
pack token p is read from the logits at ``parent[p]``, once per pack token however many sequences share
it; a sequence's log-probs gather its path (`PackLogprobs.per_sequence`), so autograd sums a shared
token's gradient over the sequences that use it: gradients equal the per-sequence ones exactly.

Cost: N_tree tokens through every layer instead of N_flat (a GRPO group of 8 answers to one 1k-token
prompt: 1k + 8 x answer instead of 8 x (1k + answer)), and visible attention pairs sum(depth + 1) over
tree tokens. Logits exist for ``chunk_rows`` rows at a time (the head runs chunked and is recomputed in
backward), so a 32k-token pack over Qwen3's 151,936-entry vocabulary holds 2.5 GB of float32 logits at
4,096-row chunks instead of 19 GB.

`pack_logprobs` is the per-pack call (for loops that back-propagate pack by pack: gradient accumulation,
data-parallel ranks); `sequence_logprobs` the per-sequence baseline through the model's own attention;
`treepack.hf.logprobs.token_logprobs` the one-call API on token lists.

Legend: T pack tokens, S sequences, F their flat tokens (sum of lengths), R targets (F - S: every token
but the first of each sequence), U pack tokens whose log-prob is computed, D hidden size, V vocabulary.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from treepack.errors import TreepackError
from treepack.hf.attention import TreeMask, active_tree, register
from treepack.hf.batch import PackLogprobs, TreeBatch
from treepack.hf.support import (
    HEAD_FAMILIES,
    UnsupportedModelError,
    check_supported,
    decoder_layers,
    final_logit_softcap,
    install_treepack,
    max_length_for,
    model_type,
    unwrap,
)

DEFAULT_CHUNK_ROWS = 4096


# --------------------------------------------------------------------------------------------------
# The forward


@dataclass
class _Prepared:
    hf: nn.Module  # the transformers model inside any wrappers
    body: nn.Module  # what returns last_hidden_state
    layers: int  # attention calls per forward
    head: str  # "linear" | "module" (chunked lm_head + soft-cap) | "model" (its forward with logits_to_keep)
    max_length: int | None  # longest sequence allowed (length-dependent RoPE)


_PREPARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _is_fsdp(model: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return isinstance(model, (FSDPModule, FullyShardedDataParallel))


def prepare_model(model: nn.Module) -> _Prepared:
    """Check the model once and register the ``treepack`` attention implementation (cached per model)."""
    hf = unwrap(model)
    prep = _PREPARED.get(hf)
    if prep is None:
        check_supported(hf)
        register()
        lm_head = hf.get_output_embeddings()
        if model_type(hf) not in HEAD_FAMILIES or lm_head is None:
            head = "model"
        elif type(lm_head) is nn.Linear and lm_head.bias is None and final_logit_softcap(hf) is None:
            head = "linear"
        else:
            head = "module"
        body = hf.base_model if hf.base_model is not hf else hf
        if _is_fsdp(model):
            head = "model"  # FSDP reshards the head's weight after the forward: let the model compute logits
        prep = _Prepared(hf=hf, body=body, layers=decoder_layers(hf), head=head, max_length=max_length_for(hf))
        _PREPARED[hf] = prep
    return prep


def model_device_dtype(hf: nn.Module) -> tuple[torch.device, torch.dtype]:
    w = hf.get_input_embeddings().weight
    return w.device, w.dtype


def logprob_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _logits_chunk(hidden_CD: Tensor, lm_head: nn.Module, softcap: float | None, temperature: float) -> Tensor:
    logits_CV = lm_head(hidden_CD)
    if softcap is not None:
        logits_CV = torch.tanh(logits_CV / softcap) * softcap
    if temperature != 1.0:
        logits_CV = logits_CV / temperature
    return logits_CV.to(logprob_dtype(logits_CV.dtype))


def _head_chunk(hidden_CD, target_C, lm_head, softcap, temperature) -> Tensor:
    logits_CV = _logits_chunk(hidden_CD, lm_head, softcap, temperature)
    return torch.log_softmax(logits_CV, dim=-1).gather(1, target_C[:, None])[:, 0]


def _entropy(logits_CV: Tensor) -> Tensor:
    logp_CV = torch.log_softmax(logits_CV.to(logprob_dtype(logits_CV.dtype)), dim=-1)
    return -(logp_CV.exp() * logp_CV).sum(-1)


def head_logprobs(prep: _Prepared, hidden_UD: Tensor, target_U: Tensor, chunk_rows: int, *,
                  temperature: float = 1.0) -> Tensor:
    """log softmax(head(hidden_U) / temperature)[target_U], ``chunk_rows`` rows of logits at a time (the
    logits are recomputed in backward, never stored)."""
    lm_head = prep.hf.get_output_embeddings()
    if prep.head == "linear":
        from treepack.train.losses import target_logprobs

        h_UD = hidden_UD if temperature == 1.0 else hidden_UD / temperature
        return target_logprobs(h_UD, lm_head.weight, target_U, chunk_rows)
    softcap = final_logit_softcap(prep.hf)
    U = hidden_UD.shape[0]
    grad = torch.is_grad_enabled()
    parts = []
    for c0 in range(0, U, chunk_rows):
        args = (hidden_UD[c0 : c0 + chunk_rows], target_U[c0 : c0 + chunk_rows], lm_head, softcap, temperature)
        parts.append(checkpoint(_head_chunk, *args, use_reentrant=False) if grad and U > chunk_rows
                     else _head_chunk(*args))
    if not parts:
        return hidden_UD.sum(-1).to(logprob_dtype(hidden_UD.dtype))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _entropy_chunk(hidden_CD, lm_head, softcap, temperature) -> Tensor:
    return _entropy(_logits_chunk(hidden_CD, lm_head, softcap, temperature))


def head_entropy(prep: _Prepared, hidden_UD: Tensor, chunk_rows: int, *, temperature: float = 1.0) -> Tensor:
    """Entropy of each row's next-token distribution, ``chunk_rows`` rows of logits at a time. Differentiable
    when grad is enabled (verl's ``entropy_coeff`` trains on it): each chunk is checkpointed, so a graph that
    only logs the entropy holds nothing but the hidden rows, and one that trains on it recomputes the logits
    in backward."""
    lm_head = prep.hf.get_output_embeddings()
    softcap = final_logit_softcap(prep.hf) if prep.head != "linear" else None
    grad = torch.is_grad_enabled()
    parts = []
    for c0 in range(0, hidden_UD.shape[0], chunk_rows):
        args = (hidden_UD[c0 : c0 + chunk_rows], lm_head, softcap, temperature)
        parts.append(checkpoint(_entropy_chunk, *args, use_reentrant=False) if grad else _entropy_chunk(*args))
    return torch.cat(parts) if parts else hidden_UD.new_zeros(0, dtype=logprob_dtype(hidden_UD.dtype))


def _check_lengths(prep: _Prepared, batch: TreeBatch) -> None:
    if prep.max_length is None or batch.n_sequences == 0:
        return
    lengths = batch.lengths
    if int(lengths.max()) > prep.max_length and int(lengths.min()) <= prep.max_length:
        raise UnsupportedModelError(
            f"{type(prep.hf).__name__}: its RoPE changes frequencies with the sequence length at "
            f"{prep.max_length} tokens, and this pack mixes sequences on both sides of it (a per-sequence "
            "forward would use different frequencies for the short ones); pack them apart")


def _last_hidden(output) -> Tensor:
    return output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]


def run_model(model: nn.Module, prep: _Prepared, input_ids: Tensor, position_ids: Tensor,
              logits_rows: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
    """One forward of the *outermost* module (DDP, FSDP and PEFT wrappers run their hooks), positions
    given: (final hidden states [T, D] captured from the body, logits of ``logits_rows`` or None)."""
    model = getattr(model, "_orig_mod", model)  # torch.compile'd: run eagerly (the tree changes every pack)
    captured: list[Tensor] = []
    handle = prep.body.register_forward_hook(lambda mod, args, out: captured.append(_last_hidden(out)))
    keep = logits_rows if logits_rows is not None else input_ids.new_zeros(0)
    try:
        out = model(input_ids=input_ids[None], position_ids=position_ids[None], attention_mask=None,
                    use_cache=False, logits_to_keep=keep)
    finally:
        handle.remove()
    hidden_TD = captured[-1][0] if captured else None
    logits = out.logits[0] if logits_rows is not None else None
    return hidden_TD, logits


def pack_logprobs(model: nn.Module, batch: TreeBatch, *, attention: str = "auto",
                  tokens: Tensor | None = None, temperature: float = 1.0, entropy: bool = False,
                  chunk_rows: int = DEFAULT_CHUNK_ROWS, _probe=None) -> PackLogprobs:
    """One tree forward of ``model`` over the pack ``batch``: log-probs of the pack's tokens.

    ``tokens`` (int64 pack indices, sorted, unique) limits which tokens get a log-prob (e.g. only loss
    tokens); default: every non-root real token. ``temperature`` divides the logits (as samplers do);
    ``entropy`` also returns each computed token's predictive entropy. Both are differentiable w.r.t. the
    model's parameters.
    """
    if temperature <= 0:
        raise TreepackError(f"temperature must be > 0, got {temperature}")
    prep = prepare_model(model)
    device, _ = model_device_dtype(prep.hf)
    batch = batch.to(device)
    _check_lengths(prep, batch)
    T = batch.n_tokens
    if tokens is None:
        real_T = torch.arange(T, device=device) < batch.n_real
        tokens = torch.nonzero(real_T & (batch.parent >= 0))[:, 0]
    tokens = tokens.to(device)
    parent_U = batch.parent[tokens]
    if bool((parent_U < 0).any()):
        raise TreepackError("a token without a parent (a root) can not be predicted")
    target_U = batch.input_ids[tokens]
    mask = TreeMask.build(batch.subtree_end, batch.position_ids, attention)
    mask.probe = _probe
    rows = inverse = None
    if prep.head == "model":
        rows, inverse = torch.unique(parent_U, return_inverse=True)
    install_treepack(prep.hf)  # idempotent; again if someone set another implementation since
    with active_tree(mask):
        hidden_TD, logits = run_model(model, prep, batch.input_ids, batch.position_ids, rows)
    if mask.calls != prep.layers:
        raise UnsupportedModelError(
            f"{type(prep.hf).__name__}: {mask.calls} attention calls went through treepack's attention "
            f"function in one forward, the model has {prep.layers} decoder layers; layers that bypass "
            "transformers' AttentionInterface can not be tree-packed")
    entropy_U = None
    if prep.head == "model":
        logits = logits.to(logprob_dtype(logits.dtype)) / temperature
        logp_U = torch.log_softmax(logits, -1)[inverse, target_U]
        if entropy:  # checkpointed: the graph keeps the logits it already has, not their log-softmax
            entropy_U = (checkpoint(_entropy, logits, use_reentrant=False) if torch.is_grad_enabled()
                         else _entropy(logits))[inverse]
    else:
        hidden_UD = hidden_TD[parent_U]
        logp_U = head_logprobs(prep, hidden_UD, target_U, chunk_rows, temperature=temperature)
        if entropy:
            entropy_U = head_entropy(prep, hidden_UD, chunk_rows, temperature=temperature)
    logp_T = torch.zeros(T, dtype=logp_U.dtype, device=device).index_put((tokens,), logp_U)
    computed_T = torch.zeros(T, dtype=torch.bool, device=device)
    computed_T[tokens] = True
    entropy_T = None
    if entropy_U is not None:
        entropy_T = torch.zeros(T, dtype=entropy_U.dtype, device=device).index_put((tokens,), entropy_U)
    return PackLogprobs(batch=batch, logp_T=logp_T, computed_T=computed_T, entropy_T=entropy_T,
                        extra={"foreign": list(mask.foreign)})


def sequence_logprobs(model: nn.Module, batch: TreeBatch, *, temperature: float = 1.0,
                      chunk_rows: int = DEFAULT_CHUNK_ROWS) -> list[Tensor]:
    """The baseline: each sequence of the pack on its own (positions 0..L-1) through the model's own
    configured attention, no tree field read; [L - 1] log-probs per sequence, the pack's order."""
    prep = prepare_model(model)
    device, _ = model_device_dtype(prep.hf)
    batch = batch.to(device)
    out = []
    for path in batch.per_sequence(batch.seq_token_index):
        ids_L = batch.input_ids[path]
        L = ids_L.shape[0]
        if L < 2:
            out.append(torch.zeros(0, dtype=logprob_dtype(model_device_dtype(prep.hf)[1]), device=device))
            continue
        pos_L = torch.arange(L, device=device)
        if prep.head == "model":
            _, logits = run_model(model, prep, ids_L, pos_L, torch.arange(L - 1, device=device))
            logits = logits.to(logprob_dtype(logits.dtype)) / temperature
            out.append(torch.log_softmax(logits, -1).gather(1, ids_L[1:, None])[:, 0])
        else:
            hidden_LD, _ = run_model(model, prep, ids_L, pos_L, None)
            out.append(head_logprobs(prep, hidden_LD[:-1], ids_L[1:], chunk_rows, temperature=temperature))
    return out
