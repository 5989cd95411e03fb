"""Tiny random transformers models of every architecture treepack.hf supports, and the references the
hf tests compare against (the model's own per-sequence forward, in float64)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

VOCAB = 40
COMMON = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}

# name -> (config class, extra config); windows of 4-6 tokens so that the test sequences cross them
ARCHS = {
    "qwen3": ("Qwen3Config", {"head_dim": 8}),
    "qwen3-window": ("Qwen3Config", {"head_dim": 8, "use_sliding_window": True, "sliding_window": 4,
                                     "max_window_layers": 1}),
    "qwen2": ("Qwen2Config", {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1}),
    "llama": ("LlamaConfig", {"attention_bias": True, "mlp_bias": True, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}}),
    "mistral": ("MistralConfig", {"head_dim": 8, "sliding_window": 5}),
    "gemma2": ("Gemma2Config", {"head_dim": 8, "sliding_window": 4, "attn_logit_softcapping": 2.0,
                                "final_logit_softcapping": 3.0, "query_pre_attn_scalar": 16}),
    "gemma3": ("Gemma3TextConfig", {"head_dim": 8, "sliding_window": 4, "query_pre_attn_scalar": 16,
                                    "layer_types": ["sliding_attention", "full_attention"]}),
    "phi3": ("Phi3Config", {"sliding_window": 6, "partial_rotary_factor": 0.5, "pad_token_id": 0,
                            "eos_token_id": 1, "bos_token_id": 1}),
    "qwen3_moe": ("Qwen3MoeConfig", {"head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 16, "decoder_sparse_step": 1}),
    "olmoe": ("OlmoeConfig", {"num_experts": 4, "num_experts_per_tok": 2}),
    # sliding layers whose window reaches attention only through the mask the model builds
    "qwen2_moe-window": ("Qwen2MoeConfig", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 2,
                                            "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                                            "shared_expert_intermediate_size": 16}),
    # MLA: value heads narrower than query/key heads; a router computed in x.type(torch.float32)
    "deepseek_v3": ("DeepseekV3Config", {"num_key_value_heads": 4, "q_lora_rank": 16, "kv_lora_rank": 16,
                                         "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
                                         "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1,
                                         "topk_group": 1, "moe_intermediate_size": 16, "first_k_dense_replace": 1}),
    # .view()s the attention output (needs it contiguous)
    "jetmoe": ("JetMoeConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "kv_channels": 8}),
}
# What the model's own forward uses: sdpa, except soft-capped Gemma 2 (sdpa has no soft-cap)
REFERENCE_ATTENTION = {"gemma2": "eager"}


def tiny_model(name: str, *, dtype: torch.dtype = torch.float64, seed: int = 0, std: float = 0.3, **overrides):
    """A two-layer random model of architecture ``name`` (weights ~ N(0, std): large enough that every
    token's context matters), in ``dtype``, in training mode with its reference attention."""
    cls_name, extra = ARCHS[name]
    cfg = getattr(transformers, cls_name)(**{**COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    attn = REFERENCE_ATTENTION.get(name, "sdpa")
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    if dtype == torch.float64 and hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")  # grouped matmuls have no float64 kernel
    return model.to(dtype).train()


def tree_sequences(seed: int, n: int = 8, vocab: int = VOCAB) -> list[list[int]]:
    """Branches off a shared trunk, duplicates, prefixes of other sequences, fresh roots, one 1-token
    sequence; long enough to cross the test models' sliding windows."""
    rng = np.random.default_rng(seed)
    trunk = rng.integers(0, vocab, 12).tolist()
    seqs = [trunk + rng.integers(0, vocab, 5).tolist(), trunk[:7] + rng.integers(0, vocab, 6).tolist()]
    while len(seqs) < n - 1:
        r = rng.random()
        if r < 0.2:
            seqs.append(list(seqs[rng.integers(len(seqs))]))
        elif r < 0.4:
            base = seqs[rng.integers(len(seqs))]
            seqs.append(base[: rng.integers(2, len(base) + 1)])
        elif r < 0.85:
            cut = int(rng.integers(1, len(trunk) + 1))
            seqs.append(trunk[:cut] + rng.integers(0, vocab, rng.integers(1, 8)).tolist())
        else:
            seqs.append(rng.integers(0, vocab, rng.integers(2, 10)).tolist())
    return seqs + [[int(rng.integers(0, vocab))]]


def loss_masks(seqs, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed + 1000)
    return [(rng.random(len(s)) < 0.7).astype(int).tolist() for s in seqs]


def reference_logprobs(model, seqs, *, temperature: float = 1.0) -> list[torch.Tensor]:
    """The model's own forward, one sequence at a time, full logits: log p(x_t | x_<t), t >= 1."""
    out = []
    for s in seqs:
        ids = torch.tensor(s, device=model.device)[None]
        logits = model(input_ids=ids).logits[0, :-1] / temperature
        acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
        out.append(torch.log_softmax(logits.to(acc), -1).gather(1, ids[0, 1:, None])[:, 0])
    return out


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def rel_diff(got: dict, ref: dict) -> tuple[float, str]:
    """Worst max |g - g_ref| / max |g_ref| over parameters (denominator floored at 1e-6 of the largest
    gradient, as `treepack verify` does) and its parameter; every parameter must have a gradient in both."""
    assert set(got) == set(ref), sorted(set(got) ^ set(ref))
    floor = 1e-6 * max(float(g.abs().max()) for g in ref.values())
    rel = {n: float((got[n] - ref[n]).abs().max()) / max(float(ref[n].abs().max()), floor) for n in ref}
    worst = max(rel, key=rel.get)
    return rel[worst], worst
