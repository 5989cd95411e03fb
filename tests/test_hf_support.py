"""Which models treepack.hf runs and which it refuses, by name, with the reason; the run-time guards
(attention calls per forward, keywords it does not implement, dropout, length-dependent RoPE)."""

from __future__ import annotations

import pytest
import torch
from hf_models import grads, reference_logprobs, rel_diff, tiny_model, tree_sequences

from treepack.hf import TreeAttentionError, UnsupportedModelError, exact_float64, token_logprobs

transformers = pytest.importorskip("transformers")
SEQS = tree_sequences(seed=4)


def build(cls_name: str, **cfg):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls_name)(**cfg)).double()


REFUSED = {
    "mamba": (lambda: build("MambaConfig", vocab_size=40, hidden_size=16, num_hidden_layers=2, state_size=4),
              "MambaForCausalLM (model_type 'mamba') has Mamba (state-space layers): layers that are not attention"),
    "qwen3_next": (lambda: build("Qwen3NextConfig", vocab_size=40, hidden_size=32, intermediate_size=32,
                                 num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                 linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8,
                                 linear_value_head_dim=8, num_experts=2, num_experts_per_tok=1,
                                 moe_intermediate_size=16, shared_expert_intermediate_size=16,
                                 layer_types=["linear_attention", "full_attention"]),
                   "(model_type 'qwen3_next') has gated delta-net (linear attention) layers"),
    "lfm2": (lambda: build("Lfm2Config", vocab_size=40, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, layer_types=["conv", "full_attention"]),
             "(model_type 'lfm2') has short-convolution layers"),
    "gpt_oss": (lambda: build("GptOssConfig", vocab_size=40, hidden_size=32, intermediate_size=32,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                              num_local_experts=2, num_experts_per_tok=1, sliding_window=4,
                              layer_types=["sliding_attention", "full_attention"]),
                "(model_type 'gpt_oss'): attention sinks"),
    "doge": (lambda: build("DogeConfig", vocab_size=40, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1),
             "DogeForCausalLM (model_type 'doge'): dynamic mask attention"),
    "bloom": (lambda: build("BloomConfig", vocab_size=40, hidden_size=32, n_layer=2, n_head=2),
              "BloomForCausalLM does not route attention through transformers' AttentionInterface"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_refused_by_name(name):
    make, message = REFUSED[name]
    with pytest.raises(UnsupportedModelError) as err:
        token_logprobs(make(), SEQS)
    assert message in str(err.value)


def test_gemma3n_and_multimodal_gemma3_refused_by_name():
    from treepack.hf.support import REFUSED as names

    assert "not verified" in names["gemma3n"] and "Gemma3ForCausalLM" in names["gemma3"]
    model = tiny_model("gemma3")
    model.config.use_bidirectional_attention = True  # EmbeddingGemma-style
    with pytest.raises(UnsupportedModelError, match="attends bidirectionally"):
        token_logprobs(model, SEQS)


def test_a_layer_that_bypasses_the_attention_interface_is_refused(monkeypatch):
    model = tiny_model("qwen3")
    attn = model.model.layers[1].self_attn
    monkeypatch.setattr(attn, "forward", lambda hidden_states, *a, **k: (torch.zeros_like(hidden_states), None))
    with pytest.raises(UnsupportedModelError, match="1 attention calls went through treepack's attention function "
                                                    "in one forward, the model has 2 decoder layers"):
        token_logprobs(model, SEQS, check=False)


def test_keywords_the_tree_kernel_does_not_implement_are_refused():
    with pytest.raises(TreeAttentionError, match="GptOssAttention passes 's_aux' to its attention function"):
        from treepack.hf.support import REFUSED as names

        saved = names.pop("gpt_oss")
        try:
            token_logprobs(REFUSED["gpt_oss"][0](), SEQS, check=False)
        finally:
            names["gpt_oss"] = saved


def test_attention_dropout_in_training_mode_is_refused():
    model = tiny_model("qwen3", attention_dropout=0.1)
    with pytest.raises(TreeAttentionError, match=r"attention dropout \(0.1\) is not supported"):
        token_logprobs(model, SEQS, check=False)
    token_logprobs(model.eval(), SEQS, check=False)  # eval: no dropout


def test_length_dependent_rope_refuses_packs_across_its_threshold():
    """Phi-3 longrope switches factors at original_max_position_embeddings (here 8): a pack with sequences on
    both sides would differ from their per-sequence forwards; on one side it is exact."""
    rope = {"rope_type": "longrope", "short_factor": [1.0, 1.5], "long_factor": [2.0, 3.0],
            "original_max_position_embeddings": 8, "factor": 8.0}
    model = tiny_model("phi3", sliding_window=None, rope_scaling=rope, max_position_embeddings=64,
                       original_max_position_embeddings=8)
    with pytest.raises(UnsupportedModelError, match="changes frequencies with the sequence length at 8 tokens"):
        token_logprobs(model, [[1, 2, 3], list(range(1, 12))], check=False)
    short = [[1, 2, 3, 4], [1, 2, 5, 6, 7], [1, 2, 5]]
    with exact_float64():
        got = token_logprobs(model, short)
        ref = reference_logprobs(model, short)
    assert max(float((g.detach() - r.detach()).abs().max()) for g, r in zip(got, ref)) <= 1e-9


def test_exact_float64_casts_integer_positions_to_float64():
    """Rotary embeddings multiply float64 inverse frequencies by ``position_ids.float()`` (transformers releases
    differ in which operand they cast): under exact_float64 every cast to a low float gives float64, integer
    inputs included, so the product runs in float64 instead of failing on mixed dtypes."""
    inv = torch.rand(4, dtype=torch.float64)
    pos = torch.arange(5)
    with exact_float64():
        a, b = inv[None, :, None].float(), pos[None, None, :].float()
        assert (a.dtype, b.dtype, (a @ b).dtype) == (torch.float64,) * 3
        assert pos.to(torch.float32).dtype == torch.float64
        assert pos.type_as(torch.zeros(1, dtype=torch.bfloat16)).dtype == torch.float64
        assert inv.type(torch.float32).dtype == torch.float64  # DeepSeek's routers
        assert inv.type(dtype=torch.float32).dtype == torch.float64
        assert pos.to("cpu").dtype == torch.int64 and pos.long().dtype == torch.int64
    assert pos.float().dtype == torch.float32  # outside the block, untouched


def test_unknown_head_family_uses_the_models_own_logits():
    """Granite scales its logits after lm_head: not a family whose head we run, so the model's own forward
    computes them (logits_to_keep = the needed rows) and the numbers still match."""
    model = build("GraniteConfig", vocab_size=40, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, logits_scaling=4.0, bos_token_id=0,
                  eos_token_id=1, pad_token_id=0)
    from treepack.hf.forward import prepare_model

    assert prepare_model(model).head == "model"
    with exact_float64():
        model.zero_grad()
        sum(lp.sum() for lp in token_logprobs(model, SEQS)).backward()
        g_tree = grads(model)
        model.zero_grad()
        sum(lp.sum() for lp in reference_logprobs(model, SEQS)).backward()
    assert rel_diff(g_tree, grads(model))[0] <= 1e-9


def test_backend_errors_are_clear():
    model = tiny_model("qwen3")
    with pytest.raises(TreeAttentionError, match="^attention must be one of auto, reference, flex, triton, fa4, "
                                                 "got 'fast'$"):
        token_logprobs(model, SEQS, attention="fast", check=False)
    with pytest.raises(TreeAttentionError, match="^attention 'sdpa' runs independent causal sequences; tree "
                                                 "attention needs auto, reference, flex, triton or fa4$"):
        token_logprobs(model, SEQS, attention="sdpa", check=False)
    with pytest.raises(TreeAttentionError, match="^attention='flex': torch's FlexAttention has no backward on CPU"):
        token_logprobs(model, SEQS, attention="flex", check=False)
    with pytest.raises(TreeAttentionError, match="^attention='triton': the triton backend needs CUDA tensors"):
        token_logprobs(model, SEQS, attention="triton", check=False)
    with pytest.raises(TreeAttentionError, match="^attention='fa4': the fa4 backend needs CUDA tensors, got cpu$"):
        token_logprobs(model, SEQS, attention="fa4", check=False)


def test_wrappers():
    """torch.compile'd models run their eager module (the tree changes every pack); DataParallel's thread
    replicas can not see the tree and are refused."""
    model = tiny_model("qwen3")
    plain = token_logprobs(model, SEQS)
    compiled = token_logprobs(torch.compile(model), SEQS)
    assert all(torch.equal(a, b) for a, b in zip(plain, compiled))
    with pytest.raises(UnsupportedModelError, match="torch.nn.DataParallel runs its replicas in threads"):
        token_logprobs(torch.nn.DataParallel(model), SEQS)
