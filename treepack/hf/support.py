"""Which Hugging Face models the tree forward can run, and how to reach their parts.

A tree forward is exact only if every token's computation depends on the other tokens through attention
alone, and that attention goes through ``AttentionInterface`` with the causal rule on each path. So:

- **Refused by name**: models whose layers are not all attention. Recurrent or hybrid layers (Mamba,
  linear attention, gated delta-nets, short convolutions) carry a state along the *layout*, which in a
  pack interleaves branches; no mask fixes that (`NOT_ATTENTION_ONLY`, and any ``layer_types`` entry
  other than full or sliding attention).
- **Gemma 2 / Gemma 3**: supported are Gemma 2 (attention-logit soft-capping, sliding-window layers,
  final-logit soft-capping) and Gemma 3 text (``gemma3_text``: sliding and global layers, per-layer RoPE
  bases, q/k norms). Refused by name: Gemma 3 multimodal (``gemma3``: images attend bidirectionally),
  Gemma 3n (``gemma3n``: AltUp, per-layer inputs and cross-layer KV sharing; not verified), and any Gemma
  with ``use_bidirectional_attention`` (EmbeddingGemma). On CUDA the soft-capped and windowed layers run
  FlexAttention (the Triton tree kernel has neither feature); a window that no path reaches is dropped.
- **RoPE that depends on the sequence length** (``dynamic`` NTK, Phi-3 ``longrope``) switches its
  frequencies at ``original_max_position_embeddings``: a pack is accepted only when no sequence crosses it,
  since the per-sequence forward of a short sequence would use the short factors.
- Everything else is checked at run time: each forward must call the attention function once per decoder
  layer (a layer that bypasses ``AttentionInterface`` is refused), and the first-use self-check compares
  one small pack against the model's own per-sequence forward.

The output head is run by us in row chunks (`HEAD_FAMILIES`: ``lm_head`` plus Gemma's final soft-cap, the
families whose ``ForCausalLM.forward`` does nothing else), so full-vocabulary logits never exist for the
whole pack; other models get their logits from their own ``forward`` with ``logits_to_keep``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from treepack.errors import TreepackError

NOT_ATTENTION_ONLY = {
    "mamba": "Mamba (state-space layers)", "mamba2": "Mamba-2 (state-space layers)",
    "falcon_mamba": "Mamba (state-space layers)", "rwkv": "RWKV (recurrent layers)",
    "xlstm": "xLSTM (recurrent layers)", "recurrent_gemma": "Griffin recurrent blocks",
    "jamba": "Mamba layers", "zamba": "Mamba layers", "zamba2": "Mamba-2 layers", "bamba": "Mamba-2 layers",
    "falcon_h1": "parallel Mamba-2 heads", "granitemoehybrid": "Mamba-2 layers", "nemotron_h": "Mamba-2 layers",
    "nemotron_h_omni": "Mamba-2 layers", "lfm2": "short-convolution layers", "lfm2_moe": "short-convolution layers",
    "lfm2_vl": "short-convolution layers", "lfm3": "short-convolution layers", "lfm3_vl": "short-convolution layers",
    "minimax": "lightning (linear) attention layers", "qwen3_next": "gated delta-net (linear attention) layers",
    "qwen3_5": "gated delta-net (linear attention) layers", "qwen3_5_moe": "gated delta-net (linear attention) layers",
    "kimi_linear": "linear attention layers", "olmo_hybrid": "linear attention layers",
    "bailing_hybrid": "linear attention layers", "plamo2": "Mamba layers",
}
REFUSED = {
    "gemma3": "Gemma 3 multimodal (image tokens attend bidirectionally); load the text model "
              "(Gemma3ForCausalLM, model_type 'gemma3_text') instead",
    "gemma3n": "Gemma 3n (AltUp, per-layer inputs, cross-layer KV sharing) is not verified with tree attention",
    "llama4": "Llama 4 (chunked attention layers and multimodal inputs)",
    "gpt_oss": "attention sinks (a learned per-head logit in every softmax) are not in treepack's tree kernels",
    "doge": "dynamic mask attention (a learned bias from the values added to every score, keys masked by its "
            "top-k) is not in treepack's tree kernels",
}
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")
# model_type -> its ForCausalLM.forward is `lm_head(hidden)` (+ final_logit_softcapping where set), nothing else
HEAD_FAMILIES = frozenset({
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phi3", "olmo", "olmo2", "olmo3",
    "olmoe", "gemma", "gemma2", "gemma3_text",
})


class UnsupportedModelError(TreepackError):
    """A model the tree forward can not run exactly; the message names the model type and the feature."""


def unwrap(model: nn.Module) -> nn.Module:
    """The ``transformers`` causal LM inside DDP / torch.compile / PEFT wrappers (PEFT injects its LoRA
    layers in place, so running the inner model runs the adapters)."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        if hasattr(model, "_orig_mod"):  # torch.compile
            model = model._orig_mod
        elif type(model).__name__ == "DataParallel":
            raise UnsupportedModelError(
                "torch.nn.DataParallel runs its replicas in threads, where the tree being forwarded is not "
                "visible; use DistributedDataParallel (one process per GPU)")
        elif type(model).__name__ == "DistributedDataParallel" and hasattr(model, "module"):
            model = model.module
        elif hasattr(model, "get_base_model") and callable(model.get_base_model):  # peft.PeftModel
            config = getattr(model, "active_peft_config", None)
            if getattr(config, "is_prompt_learning", False):
                kind = getattr(config.peft_type, "value", config.peft_type)
                raise UnsupportedModelError(
                    f"PEFT {kind} adds virtual tokens (prompt learning): only adapters that wrap the model's layers "
                    "(LoRA and the like) can be tree-packed")
            model = model.get_base_model()
        elif type(model).__name__ == "FullyShardedDataParallel" and hasattr(model, "module"):
            model = model.module
    return model


def _configs(model: nn.Module) -> list:
    """Every distinct transformers config the model's modules read (sub-configs included)."""
    from transformers import PretrainedConfig

    out, ids = [], set()

    def add(cfg) -> None:
        if isinstance(cfg, PretrainedConfig) and id(cfg) not in ids:
            ids.add(id(cfg))
            out.append(cfg)
            for key in getattr(cfg, "sub_configs", {}) or {}:
                add(getattr(cfg, key, None))

    for m in model.modules():
        add(getattr(m, "config", None))
    return out


def rope_type(cfg) -> str:
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if isinstance(rope, dict) and rope and all(isinstance(v, dict) for v in rope.values()):  # per layer type
        types = {v.get("rope_type", v.get("type", "default")) for v in rope.values()}
        return next((t for t in types if t in LENGTH_DEPENDENT_ROPE), "default")
    return rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"


def check_supported(model: nn.Module) -> None:
    """Raise `UnsupportedModelError` naming the model type and the reason, for models the tree forward
    can not run exactly (see the module docstring)."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise UnsupportedModelError(f"{type(model).__name__} is not a transformers PreTrainedModel")
    name = type(model).__name__
    for cfg in _configs(model):
        mt = getattr(cfg, "model_type", "") or ""
        if mt in NOT_ATTENTION_ONLY:
            raise UnsupportedModelError(
                f"{name} (model_type '{mt}') has {NOT_ATTENTION_ONLY[mt]}: layers that are not attention carry "
                "state along the packed layout, so tree packing can not run them; only attention-only models "
                "are supported")
        if mt in REFUSED:
            raise UnsupportedModelError(f"{name} (model_type '{mt}'): {REFUSED[mt]}")
        bad = sorted({t for t in (getattr(cfg, "layer_types", None) or []) if t not in ATTENTION_LAYER_TYPES})
        if bad:
            raise UnsupportedModelError(
                f"{name} (model_type '{mt}') has layers of type {', '.join(repr(b) for b in bad)}: only "
                f"{' and '.join(ATTENTION_LAYER_TYPES)} layers can be tree-packed")
        if getattr(cfg, "use_bidirectional_attention", False) or getattr(cfg, "is_causal", True) is False:
            raise UnsupportedModelError(f"{name} (model_type '{mt}') attends bidirectionally: not a causal LM")
    if not getattr(model, "_supports_attention_backend", False) and not model._can_set_attn_implementation():
        raise UnsupportedModelError(f"{name} does not route attention through transformers' AttentionInterface")


def max_length_for(model: nn.Module) -> int | None:
    """Longest sequence a pack may hold for length-dependent RoPE (None: no limit)."""
    for cfg in _configs(model):
        if rope_type(cfg) in LENGTH_DEPENDENT_ROPE:
            rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
            limit = rope.get("original_max_position_embeddings") or getattr(
                cfg, "original_max_position_embeddings", None) or getattr(cfg, "max_position_embeddings", None)
            return int(limit)
    return None


def model_type(model: nn.Module) -> str:
    return getattr(model.config, "model_type", "") or ""


def decoder_layers(model: nn.Module) -> int:
    """Decoder layers of the model (the attention calls one forward must make)."""
    body = model.base_model if model.base_model is not model else model
    layers = getattr(body, "layers", None)
    if layers is not None:
        n = getattr(model.config, "num_hidden_layers", None)
        return min(len(layers), n) if isinstance(n, int) else len(layers)
    return int(model.config.num_hidden_layers)


def install_treepack(model: nn.Module) -> None:
    """Route the model's attention through ``treepack`` from now on (every config its modules read; calls
    without a tree keep running the previous implementation: `treepack.hf.attention.install`)."""
    from treepack.hf.attention import install

    for cfg in _configs(model):
        install(cfg)


@contextlib.contextmanager
def attention_implementation(model: nn.Module, name: str) -> Iterator[None]:
    """Route the model's attention and mask building through ``name`` for the duration of the block
    (every config its modules read; restored on exit, also on error)."""
    saved = [(cfg, cfg.__dict__.get("_attn_implementation_internal")) for cfg in _configs(model)]
    try:
        for cfg, _ in saved:
            cfg._attn_implementation_internal = name
        yield
    finally:
        for cfg, value in saved:
            cfg._attn_implementation_internal = value


def final_logit_softcap(model: nn.Module) -> float | None:
    value = getattr(model.config, "final_logit_softcapping", None)
    return float(value) if value else None
