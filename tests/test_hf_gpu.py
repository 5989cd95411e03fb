"""treepack.hf on CUDA in bf16 autocast (skipped without CUDA): every tree backend against the model's own
per-sequence forward.

Rule (as benchmarks/hf.py's agreement section): both the tree run and the model's own per-sequence run in bf16
autocast are compared with the per-sequence run in float32 (TF32 off); the tree's error on the log-probs and
on every parameter's gradient of a GRPO-style loss must be at most 2x the per-sequence run's plus a small
floor. The sequences share a 700-token trunk, so a forced ``attention="fa4"`` runs FA4 (when installed)
with partial and full blocks, and the head's log-probs run through the Triton kernels (CUDA, float32
accumulation).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hf_models import reference_logprobs
from test_fa4_gpu import _fa4_ready

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
transformers = pytest.importorskip("transformers")

VOCAB = 512


def _model():
    cfg = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                   max_position_embeddings=4096, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    return model.float().cuda().train()


def _sequences() -> list[list[int]]:
    """A trunk of 700 tokens, branches of 40-300 tokens off it at several depths, one prefix of another."""
    rng = np.random.default_rng(7)
    trunk = rng.integers(0, VOCAB, 700).tolist()
    seqs = [trunk[:cut] + rng.integers(0, VOCAB, int(n)).tolist()
            for cut, n in ((700, 300), (700, 180), (650, 40), (420, 260), (700, 90))]
    return seqs + [seqs[0][:500]]


def _run(model, seqs, coef, attention: str | None, autocast: bool):
    """Log-probs (float64, concatenated) and parameter gradients of sum(coef * logp)."""
    from treepack.hf import token_logprobs

    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        if attention is None:  # the model's own forward, one sequence at a time
            lps = reference_logprobs(model, seqs)
        else:
            lps = token_logprobs(model, seqs, attention=attention)
    lp = torch.cat(lps)
    (coef * lp).sum().backward()
    grads = {n: p.grad.detach().double().clone() for n, p in model.named_parameters() if p.grad is not None}
    return lp.detach().double(), grads


def _grad_err(got: dict, ref: dict) -> float:
    assert set(got) == set(ref)
    return max(float((got[n] - ref[n]).norm() / ref[n].norm().clamp_min(1e-12)) for n in ref)


@pytest.mark.parametrize("attention", ["auto", "triton", "fa4"])
def test_hf_tree_in_bf16_is_as_close_to_float32_as_the_models_own_forward(attention):
    if attention == "fa4" and not _fa4_ready():
        pytest.skip("needs flash-attn-4 on Hopper / Blackwell")
    model, seqs = _model(), _sequences()
    coef = torch.randn(sum(len(s) - 1 for s in seqs), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        ref_lp, ref_g = _run(model, seqs, coef, None, autocast=False)
        seq_lp, seq_g = _run(model, seqs, coef, None, autocast=True)
        tree_lp, tree_g = _run(model, seqs, coef, attention, autocast=True)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    seq_err, tree_err = float((seq_lp - ref_lp).abs().max()), float((tree_lp - ref_lp).abs().max())
    assert tree_err <= 2 * seq_err + 1e-3, f"{attention}: log-probs {tree_err:.3g} vs per-sequence {seq_err:.3g}"
    seq_gerr, tree_gerr = _grad_err(seq_g, ref_g), _grad_err(tree_g, ref_g)
    assert tree_gerr <= 2 * seq_gerr + 1e-3, f"{attention}: gradients {tree_gerr:.3g} vs per-sequence {seq_gerr:.3g}"
