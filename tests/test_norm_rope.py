"""The per-head RMSNorm + RoPE kernels (`treepack.kernels.norm_rope`) against their pure-torch reference.

The reference is the decoder's own math (eager autograd gives its gradients); the float64 truth is the same
math in float64. Without CUDA the Triton kernels run under Triton's interpreter in a subprocess, on shapes
drawn by hypothesis; the interpreter rounds float32 to bfloat16 by truncation where the GPU rounds to nearest,
so bfloat16 is held to within a step of eager there and exactly to eager's rounding on CUDA. The operator
(registration, fake kernel, autograd, torch.compile) is checked on the CPU, where it runs the reference.
"""

from __future__ import annotations

import json
import os
import textwrap

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from interpreter import run_interpreted

from treepack.kernels.norm_rope import (
    norm_rope,
    norm_rope_bwd_triton,
    norm_rope_fwd_triton,
    norm_rope_grads_reference,
    norm_rope_reference,
    triton_supported,
)
from treepack.kernels.norm_rope.reference import apply_rope


def inputs(T, N, E, xdt, wdt, seed, device="cpu"):
    """x [T, N, E] (scale 3), a weight near 1, RoPE angles of [T, E] (halves equal), an output gradient."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, N, E, generator=gen) * 3).to(getattr(torch, xdt))
    w = (1 + 0.5 * torch.randn(E, generator=gen)).to(getattr(torch, wdt))
    ang = torch.cat([torch.randn(T, E // 2, generator=gen) * 10] * 2, -1)
    g = torch.randn(T, N, E, generator=gen).to(x.dtype)
    return [t.to(device) for t in (x, w, ang.cos(), ang.sin(), g)]


def errors(got, x, w, cos, sin, g, eps=1e-6):
    """Per output (out, dx, dw): the largest |got - eager|, |got - truth|, |eager - truth| and |truth|."""
    ref = {}
    for name, dt in (("eager", None), ("truth", torch.float64)):
        xx = (x if dt is None else x.to(dt)).detach().requires_grad_()
        ww = (w if dt is None else w.to(dt)).detach().requires_grad_()
        c, s = (cos, sin) if dt is None else (cos.to(dt), sin.to(dt))
        y = norm_rope_reference(xx, ww, c, s, eps)
        ref[name] = (y.detach(), *torch.autograd.grad(y, (xx, ww), g.to(y.dtype)))

    def top(t):
        return float(t.abs().max()) if t.numel() else 0.0

    out = {name: [top(k.double() - e.double()), top(k.double() - t.double()), top(e.double() - t.double()),
                  top(t.double())]
           for name, k, e, t in zip(("out", "dx", "dw"), got, ref["eager"], ref["truth"])}
    # dw_e sums one term per row and head, dz_e n_e (n the normalised x, dz RoPE's backward of g): a rounding of
    # every n (the same direction each time, under truncation) moves dw by up to sum |dz_e n_e| times the step,
    # however much the terms cancel in dw itself
    xd = x.double()
    n_hat = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
    z = torch.zeros_like(n_hat, requires_grad=True)
    (dz,) = torch.autograd.grad(apply_rope(z, cos.double(), sin.double()), z, g.double())
    out["dw_terms"] = top((dz * n_hat).abs().sum((0, 1)))
    return out


SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {tests!r})
    import treepack.kernels.norm_rope.triton as K
    from test_norm_rope import errors, inputs

    for case in json.loads(sys.argv[1]):
        T, N, E, xdt, wdt, seed, block = case
        K.FWD_BLOCK_R = K.BWD_BLOCK_R = block
        x, w, cos, sin, g = inputs(T, N, E, xdt, wdt, seed)
        got = (K.norm_rope_fwd_triton(x, w, cos, sin, 1e-6), *K.norm_rope_bwd_triton(g, x, w, cos, sin, 1e-6))
        print(json.dumps({{"case": case, **errors(got, x, w, cos, sin, g)}}))
""")

cases = st.lists(
    st.tuples(st.integers(0, 9), st.integers(1, 4), st.sampled_from([2, 8, 32, 128]),
              st.sampled_from(["float32", "bfloat16", "float16"]), st.sampled_from(["float32", "same"]),
              st.integers(0, 2**16), st.sampled_from([1, 2, 8, 64])),
    min_size=8, max_size=8,
).map(lambda cs: [[T, N, E, x, x if w == "same" else w, s, b] for T, N, E, x, w, s, b in cs])


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases)
def test_triton_kernels_match_the_reference_under_the_interpreter(batch):
    results = run_interpreted(SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__))), json.dumps(batch))
    assert [r["case"] for r in results] == batch
    for r in results:
        xdt, wdt = r["case"][3], r["case"][4]
        for name in ("out", "dx", "dw"):
            vs_eager, err, eager_err, scale = r[name]
            if xdt == "bfloat16":  # truncating conversions: within a few bf16 steps of eager, no worse vs truth;
                # dw: truncation moves every term the same way, up to one bf16 step (2^-7) of the terms' sum
                terms = 2.0**-7 * r["dw_terms"] if name == "dw" else 0.0
                assert err <= 2 * eager_err + 2.0**-6 * scale + terms + 1e-6, (name, r)
            elif name == "dw" and wdt != "float32":  # eager sums 16-bit products in 16 bits; the kernel in float32
                assert err <= eager_err + 2.0**-9 * scale + 1e-6, (name, r)
            else:  # float32 and float16: eager's roundings; float32 differences inside (dx: a difference of
                # two terms) move a value by up to two float16 steps
                tol = 1e-5 if xdt == "float32" else 2.0**-9
                assert vs_eager <= tol * max(scale, 1.0), (name, r)


def test_operator_matches_the_reference_and_compiles():
    """The registered operator: opcheck (schema, fake kernel, autograd), and inside a compiled function with
    dynamic shapes, forward and backward equal to the reference's autograd."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(11, 3, 16, generator=g) * 2).requires_grad_()
    w = (1 + torch.randn(16, generator=g) * 0.3).requires_grad_()
    ang = torch.cat([torch.randn(11, 8, generator=g)] * 2, -1)
    cos, sin = ang.cos(), ang.sin()
    torch.library.opcheck(torch.ops.treepack.norm_rope_fwd.default, (x, w, cos, sin, 1e-6))
    # the backward operator has no derivative of its own (no double backward): checked on plain tensors
    torch.library.opcheck(torch.ops.treepack.norm_rope_bwd.default,
                          (torch.randn(11, 3, 16), x.detach(), w.detach(), cos, sin, 1e-6))

    ref = norm_rope_reference(x, w, cos, sin, 1e-6)
    ref_grads = torch.autograd.grad(ref.square().sum(), (x, w))
    fn = torch.compile(lambda *a: torch.ops.treepack.norm_rope_fwd(*a).square().sum(), dynamic=True, fullgraph=True)
    for T in (11, 7):  # a second length: the same dynamic graph
        loss = fn(x[:T], w, cos[:T], sin[:T], 1e-6)
        grads = torch.autograd.grad(loss, (x, w))
        ref_T = norm_rope_reference(x[:T], w, cos[:T], sin[:T], 1e-6)
        torch.testing.assert_close(loss, ref_T.square().sum())
        torch.testing.assert_close(grads, torch.autograd.grad(ref_T.square().sum(), (x, w)))
    torch.testing.assert_close(fn(x, w, cos, sin, 1e-6), ref.square().sum())
    assert ref_grads[0].shape == x.shape


@pytest.mark.parametrize(("xdt", "wdt"), [("float64", "float64"), ("float32", "float32"), ("bfloat16", "float32"),
                                         ("bfloat16", "bfloat16"), ("float16", "float16")])
def test_written_out_gradients_match_autograd(xdt, wdt):
    """`norm_rope_grads_reference` (the operator's CPU backward) against eager autograd of the reference."""
    x, w, cos, sin, g = inputs(9, 3, 32, xdt, wdt, 7)
    if xdt == "float64":
        cos, sin = cos.double(), sin.double()
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    expected = torch.autograd.grad(norm_rope_reference(xx, ww, cos, sin, 1e-6), (xx, ww), g)
    got = norm_rope_grads_reference(g, x, w, cos, sin, 1e-6)
    for a, b in zip(got, expected):
        assert a.dtype == b.dtype
        step = {"float64": 1e-12, "float32": 1e-5, "bfloat16": 2.0**-6, "float16": 2.0**-9}[str(a.dtype)[6:]]
        assert float((a.double() - b.double()).abs().max()) <= step * max(float(b.abs().max()), 1.0)


def test_dispatch_runs_the_reference_off_cuda():
    x, w = torch.randn(4, 2, 8, dtype=torch.float64), torch.ones(8, dtype=torch.float64)
    cos, sin = torch.ones(4, 8, dtype=torch.float64), torch.zeros(4, 8, dtype=torch.float64)
    assert not triton_supported(x, w, cos)
    torch.testing.assert_close(norm_rope(x, w, cos, sin, 1e-6), norm_rope_reference(x, w, cos, sin, 1e-6))


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
@pytest.mark.gpu
def test_triton_supported_on_cuda():
    x = torch.zeros(5, 16, 128, device="cuda", dtype=torch.bfloat16)
    w, cos = torch.ones(128, device="cuda"), torch.ones(5, 128, device="cuda")
    assert triton_supported(x, w, cos)
    assert not triton_supported(x.double(), w, cos)
    assert not triton_supported(torch.zeros(5, 16, 96, device="cuda"), torch.ones(96, device="cuda"),
                                torch.ones(5, 96, device="cuda"))  # E / 2 = 48: not a power of two
    assert not triton_supported(x, w, cos.double())


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize(("T", "N", "E", "xdt", "wdt"), [
    (3000, 16, 128, "bfloat16", "float32"), (3000, 8, 128, "bfloat16", "float32"), (1, 16, 128, "bfloat16", "float32"),
    (777, 4, 64, "bfloat16", "bfloat16"), (500, 16, 128, "float16", "float32"), (500, 2, 256, "float32", "float32"),
])
def test_triton_kernels_match_the_reference_on_cuda(T, N, E, xdt, wdt):
    x, w, cos, sin, g = inputs(T, N, E, xdt, wdt, T + E, device="cuda")
    got = (norm_rope_fwd_triton(x, w, cos, sin, 1e-6), *norm_rope_bwd_triton(g, x, w, cos, sin, 1e-6))
    errs = errors(got, x, w, cos, sin, g)
    for name in ("out", "dx", "dw"):
        vs_eager, err, eager_err, scale = errs[name]
        if name == "dw" and wdt != "float32":
            assert err <= eager_err + 2.0**-9 * scale, (name, errs)
        elif xdt == "float32":
            assert vs_eager <= 1e-5 * max(scale, 1.0), (name, errs)
        else:  # eager's roundings; float32 differences inside move a value by up to two 16-bit steps
            step = 2.0**-6 if xdt == "bfloat16" else 2.0**-9
            assert vs_eager <= step * max(scale, 1.0), (name, errs)
            assert err <= eager_err + step * scale, (name, errs)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize(("compile_mode", "attention"), [("on", "causal"), ("on", "tree"), ("off", "causal")])
def test_decoder_with_fused_kernels_matches_the_reference(compile_mode, attention, monkeypatch):
    """A Qwen3 decoder's loss and gradients under bf16 autocast with the kernels and with the reference
    (compiled by Inductor, or eager; around SDPA, or inside the whole-layer graph of the Triton tree kernel):
    equal within bf16 rounding."""
    from treepack.kernels.norm_rope import op
    from treepack.train.attention import AttentionContext
    from treepack.train.model import Decoder, ModelArgs

    args = ModelArgs.for_family("qwen3", vocab_size=97, hidden_size=256, intermediate_size=512, num_layers=2,
                                num_heads=4, num_kv_heads=2, head_dim=128)
    ids = torch.randint(0, 97, (300,), device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
    pos = torch.arange(300, device="cuda")
    out = {}
    for kernels in ("reference", "auto"):
        monkeypatch.setattr(op, "NORM_ROPE_KERNELS", kernels)
        torch._dynamo.reset()
        model = Decoder.random_init(args, seed=0, dtype=torch.float32, device="cuda")
        model.compile = compile_mode
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ctx = (AttentionContext.causal([300], device=torch.device("cuda")) if attention == "causal" else
                   AttentionContext.tree(torch.full((300,), 300, device="cuda"), "triton"))
            hidden = model(ids, pos, ctx).hidden_TD
        loss = hidden.float().square().mean()
        loss.backward()
        out[kernels] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    torch.testing.assert_close(out["auto"][0], out["reference"][0], rtol=2e-2, atol=0)
    grads = {name: grad for name, grad in out["reference"][1].items() if grad is not None}  # an untied head: none
    assert grads.keys() == {name for name, grad in out["auto"][1].items() if grad is not None}
    assert {"model.layers.0.self_attn.q_norm.weight", "model.layers.1.self_attn.k_norm.weight"} <= grads.keys()
    for name, grad in grads.items():
        diff = float((out["auto"][1][name] - grad).abs().max())
        assert diff <= 5e-2 * max(float(grad.abs().max()), 1e-6), name
