"""The decoder: same logits as ``transformers`` for Qwen3 / Qwen2 / Llama checkpoints, checkpoint I/O and
its errors, cached-prefix forwards (the DFS contract), and the causal path's chunking."""

from __future__ import annotations

import json

import pytest
import torch

from treepack.errors import ConfigError
from treepack.train.attention import AttentionContext
from treepack.train.model import Decoder, ModelArgs

transformers = pytest.importorskip("transformers", reason="transformers is not installed")

HF_CASES = {
    # Qwen3: q/k norm, explicit head_dim != hidden / heads, tied head
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 24, "tie_word_embeddings": True}),
    # Qwen2: q/k/v biases, untied
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": False}),
    # Llama: attention and MLP biases, llama3 RoPE scaling exercised beyond its original context
    "llama": ("LlamaConfig", "LlamaForCausalLM", {
        "attention_bias": True, "mlp_bias": True,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    }),
}


def _hf_model(family: str):
    cfg_name, model_name, extra = HF_CASES[family]
    cfg = getattr(transformers, cfg_name)(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(cfg).eval()
    with torch.no_grad():  # move every weight (norms and biases included) off its init value
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module", params=sorted(HF_CASES))
def hf_checkpoint(request, tmp_path_factory):
    model = _hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return request.param, model, path


def test_logits_match_transformers(hf_checkpoint):
    family, hf, path = hf_checkpoint
    ours = Decoder.from_pretrained(path, dtype=torch.float32)
    assert ours.args.family == family
    ids = torch.randint(0, 101, (1, 80), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits[0]
        for ctx in (AttentionContext.causal([80]), AttentionContext.causal([80], impl="reference")):
            got = ours.logits(ours(ids[0], torch.arange(80), ctx).hidden_TD)
            assert (got - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


def test_tree_positions_reproduce_each_sequence(hf_checkpoint):
    """Two sequences sharing a prefix, packed as a tree with restored positions: each leaf's logits equal
    transformers' logits of that sequence alone."""
    _, hf, path = hf_checkpoint
    ours = Decoder.from_pretrained(path, dtype=torch.float32)
    a, b = [5, 6, 7, 8, 9], [5, 6, 7, 40, 41, 42]
    ids = torch.tensor([5, 6, 7, 8, 9, 40, 41, 42])  # DFS preorder: shared 5 6 7, then 8 9, then 40 41 42
    pos = torch.tensor([0, 1, 2, 3, 4, 3, 4, 5])
    end = torch.tensor([8, 8, 8, 5, 5, 8, 8, 8], dtype=torch.int32)
    with torch.no_grad():
        got = ours.logits(ours(ids, pos, AttentionContext.tree(end, "reference")).hidden_TD)
        ref_a, ref_b = hf(torch.tensor([a])).logits[0], hf(torch.tensor([b])).logits[0]
    assert torch.allclose(got[[0, 1, 2, 3, 4]], ref_a, atol=1e-5)
    assert torch.allclose(got[[0, 1, 2, 5, 6, 7]], ref_b, atol=1e-5)


def test_save_and_reload_round_trip(tmp_path):
    args = ModelArgs.for_family("qwen2", vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=2,
                                num_heads=4, num_kv_heads=2, head_dim=8, tie_embeddings=True)
    m = Decoder.random_init(args, seed=3)
    m.save_pretrained(tmp_path)
    back = Decoder.from_pretrained(tmp_path)
    assert back.args == args
    for (n1, p1), (n2, p2) in zip(m.state_dict().items(), back.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)  # our files load in transformers too
    ids = torch.arange(10)
    with torch.no_grad():
        got = m.logits(m(ids, torch.arange(10), AttentionContext.causal([10])).hidden_TD)
        assert torch.allclose(got, hf(ids[None]).logits[0], atol=1e-5)


def test_random_init_is_seeded_and_follows_the_family():
    q3 = ModelArgs.for_family("qwen3", vocab_size=20)
    a, b = Decoder.random_init(q3, seed=1), Decoder.random_init(q3, seed=1)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.head_weight, Decoder.random_init(q3, seed=2).head_weight)
    names = dict(a.named_parameters())
    assert "model.layers.0.self_attn.q_norm.weight" in names and "model.layers.0.self_attn.q_proj.bias" not in names
    q2 = dict(Decoder.random_init(ModelArgs.for_family("qwen2", vocab_size=20)).named_parameters())
    assert "model.layers.0.self_attn.q_proj.bias" in q2 and "model.layers.0.self_attn.o_proj.bias" not in q2
    assert sum(p.numel() for p in a.parameters()) == q3.num_params()


def test_checkpoint_errors(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        Decoder.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ConfigError, match="model_type 'gpt2' is not supported"):
        Decoder.from_pretrained(tmp_path)
    args = ModelArgs.for_family("llama", vocab_size=16, hidden_size=16, intermediate_size=16, num_layers=1,
                                num_heads=2, num_kv_heads=1, head_dim=8)
    Decoder.random_init(args).save_pretrained(tmp_path)
    from safetensors.torch import load_file, save_file

    state = load_file(str(tmp_path / "model.safetensors"))
    del state["model.norm.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match="checkpoint lacks model.norm.weight"):
        Decoder.from_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="RoPE type 'yarn' is not supported"):
        Decoder.from_pretrained(tmp_path)


def test_cached_prefix_forward_equals_full_forward():
    """The DFS contract: forward a prefix with return_kv, then a suffix over it with past_kv."""
    args = ModelArgs.for_family("qwen3", vocab_size=30, hidden_size=32, intermediate_size=48, num_layers=2,
                                num_heads=4, num_kv_heads=2, head_dim=8)
    m = Decoder.random_init(args, seed=0, dtype=torch.float64)
    ids = torch.randint(0, 30, (12,), generator=torch.Generator().manual_seed(0))
    full = m(ids, torch.arange(12), AttentionContext.causal([12])).hidden_TD
    head = m(ids[:7], torch.arange(7), AttentionContext.causal([7]), return_kv=True)
    assert len(head.kv) == 2 and head.kv[0][0].shape == (7, 2, 8)
    chain = torch.full((5,), 5, dtype=torch.int32)  # the suffix is one causal chain
    tail = m(ids[7:], torch.arange(7, 12), AttentionContext.tree(chain, "reference"), past_kv=head.kv)
    assert torch.allclose(torch.cat([head.hidden_TD, tail.hidden_TD]), full, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="one \\(k, v\\) per layer"):
        m(ids[7:], torch.arange(7, 12), AttentionContext.tree(chain, "reference"), past_kv=head.kv[:1])


def test_causal_chunks_and_kernel_chains_agree(monkeypatch):
    import treepack.kernels.varlen.reference as attention_mod

    args = ModelArgs.for_family("llama", vocab_size=30, hidden_size=32, intermediate_size=48, num_layers=1,
                                num_heads=4, num_kv_heads=2, head_dim=8)
    m = Decoder.random_init(args, seed=0, dtype=torch.float64)
    lengths = [9, 1, 14]
    ids = torch.randint(0, 30, (24,), generator=torch.Generator().manual_seed(2))
    pos = torch.cat([torch.arange(n) for n in lengths])
    one = m(ids, pos, AttentionContext.causal(lengths)).hidden_TD
    chains = m(ids, pos, AttentionContext.causal(lengths, impl="reference")).hidden_TD
    monkeypatch.setattr(attention_mod, "CAUSAL_SCORE_BUDGET", 4 * 3)  # 3 queries per SDPA call
    chunked = m(ids, pos, AttentionContext.causal(lengths)).hidden_TD
    assert torch.allclose(one, chains, rtol=0, atol=1e-13) and torch.allclose(one, chunked, rtol=0, atol=1e-13)
    g1 = torch.autograd.grad(chunked.square().sum(), m.model.layers[0].self_attn.q_proj.weight)[0]
    monkeypatch.setattr(attention_mod, "CAUSAL_SCORE_BUDGET", 1 << 24)
    g0 = torch.autograd.grad(m(ids, pos, AttentionContext.causal(lengths)).hidden_TD.square().sum(),
                             m.model.layers[0].self_attn.q_proj.weight)[0]
    assert torch.allclose(g0, g1, rtol=0, atol=1e-12)


def test_random_init_drawn_on_the_device_has_the_same_distribution():
    args = ModelArgs.for_family("qwen2", vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=2,
                                num_heads=4, num_kv_heads=2, head_dim=16, init_std=0.05)
    fast = Decoder.random_init(args, seed=1, dtype=torch.bfloat16, draw_on_device=True)
    assert fast.dtype == torch.bfloat16
    for name, p in fast.named_parameters():
        if name.endswith("norm.weight"):
            assert bool((p == 1).all()), name
        elif name.endswith(".bias"):
            assert bool((p == 0).all()), name
        else:
            assert abs(float(p.float().std()) - 0.05) < 0.01, name
    again = Decoder.random_init(args, seed=1, dtype=torch.bfloat16, draw_on_device=True)
    assert all(torch.equal(a, b) for a, b in zip(fast.parameters(), again.parameters()))  # seeded


def test_activation_memory_budget_is_in_force_while_compiled_layers_run(monkeypatch):
    """``activation_memory_budget`` reaches torch's partitioner: it is the functorch setting while the
    compiled layer functions are called (which is when they compile), and only then."""
    import torch._functorch.config as functorch_config

    from treepack.train import model as model_mod

    seen: list[tuple[bool, float]] = []

    def spy(fn, enabled):
        def run(*a, **k):
            seen.append((enabled, functorch_config.activation_memory_budget))
            return fn(*a, **k)  # eager: only the setting at call time matters here
        return run

    monkeypatch.setattr(model_mod, "pick", spy)
    model = Decoder.random_init(ModelArgs(), seed=0)
    model.activation_memory_budget = 0.6
    ids = torch.arange(10)
    ctx = AttentionContext.tree(torch.full((10,), 10, dtype=torch.int32))
    before = functorch_config.activation_memory_budget
    for mode, budget in (("on", 0.6), ("off", before)):
        model.compile = mode
        seen.clear()
        model(ids, ids, ctx)
        assert seen and all(b == budget for _, b in seen), (mode, seen)
        assert functorch_config.activation_memory_budget == before


def test_compile_failure_falls_back_to_eager_with_one_warning(monkeypatch):
    """A toolchain that cannot compile must not stop training: the eager function runs, with a warning."""
    import warnings

    from torch._dynamo.exc import BackendCompilerFailed

    from treepack.train import compiled as compiled_mod

    def broken_compile(fn, **kw):
        def run(*a, **k):
            error = BackendCompilerFailed.__new__(BackendCompilerFailed)  # its __init__ differs across torch versions
            Exception.__init__(error, "no C compiler found")
            raise error
        return run

    monkeypatch.setattr(compiled_mod, "_compiled", {})
    monkeypatch.setattr(compiled_mod.torch, "compile", broken_compile)

    def double(x):
        return 2 * x

    twin = compiled_mod.compiled(double)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert torch.equal(twin(torch.ones(3)), 2 * torch.ones(3))
        assert torch.equal(twin(torch.ones(2)), 2 * torch.ones(2))  # eager from now on, no second warning
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "torch.compile failed for double" in messages[0], messages
