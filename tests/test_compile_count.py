"""What a step compiled (`treepack.train.compile_count`) and the token dimensions compiled as symbols
(`treepack.train.compiled.varying`): one graph for every token count, none for a new layout."""

from __future__ import annotations

import sys
import types

import pytest

torch = pytest.importorskip("torch")

from treepack.train import compile_count
from treepack.train.compiled import compiled, varying


@varying("x_TD", "o_THE")
def _scaled_sum(x_TD, o_THE, w_D):
    return x_TD * w_D + o_THE.reshape(x_TD.shape[0], -1)


def test_one_graph_serves_every_token_count():
    fn = compiled(_scaled_sum)
    w_D = torch.randn(8)
    before = compile_count.compiled_so_far()
    for T in (5, 7, 64, 3):
        x_TD, o_THE = torch.randn(T, 8), torch.randn(T, 2, 4)
        assert torch.equal(fn(x_TD, o_THE, w_D), _scaled_sum(x_TD, o_THE, w_D))
    assert compile_count.compiled_so_far() - before == 1


def _scaled_by_config(x_TD, config):
    return x_TD * config[0] + config[1]


def test_an_undeclared_function_keeps_integers_symbolic():
    """A fused layer takes per-pack kernel settings as integers (`model.layer_with_tree_kernel`): a new value
    must not recompile its graph."""
    fn = compiled(_scaled_by_config)
    before = compile_count.compiled_so_far()
    for T, config in ((5, [128, 0]), (7, [128, 1]), (9, [64, 1])):
        x_TD = torch.randn(T, 8)
        assert torch.equal(fn(x_TD, config), _scaled_by_config(x_TD, config))
    assert compile_count.compiled_so_far() - before == 1


def test_a_declared_name_must_exist():
    with pytest.raises(TypeError, match="has no argument 'y_TD'"):
        varying("y_TD")(lambda x_TD: x_TD)


def test_counts_kernel_variants_of_fa4_and_triton(monkeypatch):
    interface = types.ModuleType("flash_attn.cute.interface")

    def fwd():
        pass

    fwd.compile_cache = types.SimpleNamespace(cache={})
    interface._flash_attn_fwd = fwd
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", interface)

    class JITFunction:  # the attributes of triton.jit's object that the count reads
        def __init__(self):
            self.device_caches = {0: ({}, None)}

    class Autotuner:
        def __init__(self):
            self.cache, self.fn = {}, JITFunction()

    kernels = types.ModuleType("treepack.kernels.norm_rope.triton")
    kernels.jit, kernels.tuned = JITFunction(), Autotuner()
    monkeypatch.setitem(sys.modules, "treepack.kernels.norm_rope.triton", kernels)
    before = compile_count.compiled_so_far()
    fwd.compile_cache.cache[("bf16", 128)] = object()
    kernels.jit.device_caches[0][0]["T"] = object()
    kernels.jit.device_caches[0][0]["T16"] = object()
    kernels.tuned.cache[("k",)] = object()
    assert compile_count.compiled_so_far() - before == 4


def test_the_step_line_says_what_a_step_compiled():
    from treepack.train.metrics import StepStats

    def line(extra):
        return StepStats(step=3, loss=1.0, lr=1e-3, grad_norm=0.5, tokens=1000, flat_tokens=2000, loss_tokens=500,
                         seconds=0.5, mem_gb=1.0, extra=extra).line()

    assert line({"compiles": 0}) == ("step 00003 | loss 1.000 | tokens 1.00k | tok/s 2.00k | flat tok/s 4.00k | "
                                     "mem 1.0 GB")
    assert line({"compiles": 14}).endswith(" | mem 1.0 GB | compiled 14")


def test_integer_arguments_of_a_kernel_op_stay_symbolic_in_a_compiled_graph():
    """The FA4 op takes per-pack settings (backward block rows, grid order) as ``SymInt``: inside a compiled layer
    a new value is a new input, not a new graph. Declared ``int``, the same op compiles one graph per value (the
    layer recompiled at the first pack of the other grid order). Shown on a CPU op registered like the kernels."""
    from treepack.kernels.tree_attention import fa4  # noqa: F401 - defines the real op (its schema is checked)
    from treepack.kernels.tree_attention.ops import register_kernel_ops

    for op in (torch.ops.treepack.tree_attention_fa4_fwd, torch.ops.treepack.tree_attention_fa4_bwd):
        assert "SymInt bwd_block_q, SymInt bwd_order)" in str(op.default._schema)

    def fwd(q, k, v, prefix_k, prefix_v, rows, order):
        return q * (rows + order), q.new_zeros(q.shape[1], q.shape[0])

    def fake(q, k, v, prefix_k, prefix_v, rows, order):
        return torch.empty_like(q), q.new_empty(q.shape[1], q.shape[0])

    graphs = {}
    for kind in ("int", "SymInt"):
        op, _ = register_kernel_ops(
            f"symint_probe_{kind.lower()}", f"{kind} rows, {kind} order", fwd=fwd, fwd_fake=fake, bwd=fwd,
            bwd_fake=fake, backward=lambda ctx, *g: None, setup_context=lambda ctx, inputs, output: None,
            dispatch_key="CPU")
        fn = compiled(lambda x, config, op=op: op(x, x, x, None, None, config[0], config[1])[0] + 1)
        before = compile_count.compiled_so_far()
        for T, config in ((130, [128, 0]), (260, [128, 1]), (390, [64, 1]), (520, [64, 2])):
            x = torch.randn(T, 2, 4)
            assert torch.equal(fn(x, config), x * sum(config) + 1)
        graphs[kind] = compile_count.compiled_so_far() - before
    assert graphs == {"int": 4, "SymInt": 1}


def test_the_compile_options_drop_the_norm_fusion_size_guard():
    """Where this torch has the option, every compiled region takes Inductor's non-strict mix-order reduction
    (`compiled.inductor_options`): the norm-backward fusion no longer depends on the token count."""
    import torch._inductor.config as inductor_config

    from treepack.train.compiled import inductor_options

    has = hasattr(getattr(inductor_config, "triton", None), "mix_order_reduction_non_strict_mode")
    assert inductor_options() == ({"triton.mix_order_reduction_non_strict_mode": True} if has else {})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Inductor's Triton backend needs CUDA")
def test_a_region_compiles_once_across_the_norm_fusion_threshold():
    """The post-attention region (RMSNorm + SwiGLU, forward and backward) on 8,192 tokens, then 3,000, then
    6,000: one graph. Before the non-strict option, the first call's ``T >= 5120`` guard (Inductor's
    mix-order reduction threshold at 1,024 columns) made the 3,000-token call compile a second graph."""
    from treepack.train.model import attention_output_and_mlp

    torch.manual_seed(0)
    dev, D, F_ = "cuda", 1024, 3072
    o_w, norm_w, gate_w, up_w, down_w = ((torch.randn(*s, device=dev, dtype=torch.bfloat16) * 0.02).requires_grad_()
                                         for s in ((D, 2048), (D,), (F_, D), (F_, D), (D, F_)))
    fn = compiled(attention_output_and_mlp)
    before = compile_count.compiled_so_far()
    for T in (8192, 3000, 6000):
        x = torch.randn(T, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
        o = torch.randn(T, 16, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
        args = (x, o, o_w, None, norm_w, 1e-6, gate_w, None, up_w, None, down_w, None)
        out = fn(*args)
        grads = torch.autograd.grad(out.float().sum(), (x, o, norm_w))
        ref = attention_output_and_mlp(*args)
        ref_grads = torch.autograd.grad(ref.float().sum(), (x, o, norm_w))
        torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, r, atol=5e-2 * r.abs().max().item(), rtol=5e-2)
    assert compile_count.compiled_so_far() - before == 1
