"""The language-model head's Triton kernels (`treepack.kernels.logprobs`) against their pure-torch reference.

Without CUDA they run under Triton's interpreter in a subprocess (TRITON_INTERPRET must be set before the
kernels are defined), on random shapes drawn by hypothesis, with small column blocks so that every row is split
into spans and every span loops. With CUDA they run compiled instead, at Qwen3's vocabulary, and through
`target_logprobs` forward and backward against the reference, compiled and eager (the interpreter of older Triton
releases, such as 3.6, cannot run loops whose bounds are kernel arguments).
"""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from interpreter import run_interpreted

from treepack.kernels.logprobs import (
    grad_logits_reference_,
    grad_logits_triton_,
    lse_and_logprob_reference,
    lse_and_logprob_triton,
    triton_supported,
)

SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    import treepack.kernels.logprobs.triton as K
    from treepack.kernels.logprobs import grad_logits_reference_, lse_and_logprob_reference

    K.FWD_BLOCK_V, K.BWD_BLOCK, K.BWD_SPAN = 16, 16, 32  # many blocks per span, many spans per row
    for case in json.loads(sys.argv[1]):
        C, V, programs, v0, dtype, seed, expand = case
        K.FWD_PROGRAMS = programs
        g = torch.Generator().manual_seed(seed)
        dt = getattr(torch, dtype)
        x = (torch.randn(C, V, generator=g) * 4).to(dt)
        t = torch.randint(0, V, (C,), generator=g)
        lse_ref, logp_ref = lse_and_logprob_reference(x, t, torch.float32)
        lse, logp = K.lse_and_logprob_triton(x, t, torch.float32)
        block = x[:, v0:]
        gr = torch.randn(1, generator=g).expand(C) if expand else torch.randn(C, generator=g)
        ref, got = block.clone(), block.clone()
        grad_logits_reference_(ref, lse_ref, gr, t, v0)
        K.grad_logits_triton_(got, lse_ref, gr, t, v0)
        print(json.dumps({"case": case, "lse": float((lse - lse_ref).abs().max()),
                          "logp": float((logp - logp_ref).abs().max()),
                          "grad": float((got.float() - ref.float()).abs().max()),
                          "grad_scale": float(ref.float().abs().max())}))
""")

cases = st.lists(
    st.tuples(st.integers(1, 9), st.integers(1, 200), st.sampled_from([1, 4, 64]), st.integers(0, 0),
              st.sampled_from(["float32", "bfloat16"]), st.integers(0, 2**16), st.booleans()),
    min_size=6, max_size=6,
).map(lambda cs: [[C, V, p, min(v0 + (s % V), V - 1), d, s, e] for C, V, p, v0, d, s, e in cs])


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases)
def test_triton_kernels_match_the_reference_under_the_interpreter(batch):
    results = run_interpreted(SCRIPT, json.dumps(batch))
    assert [r["case"] for r in results] == batch
    for r in results:
        bf16 = r["case"][4] == "bfloat16"
        assert r["lse"] <= 1e-5 * 4 and r["logp"] <= 1e-5 * 4, r
        # the same float32 value rounded to bfloat16 on both sides, up to one exp ulp: at most one bf16 step
        assert r["grad"] <= (2.0**-7 if bf16 else 1e-6) * max(r["grad_scale"], 1.0), r


def test_triton_supported_needs_cuda_and_contiguous_columns():
    assert not triton_supported(torch.zeros(3, 5))  # CPU
    if torch.cuda.is_available():
        assert triton_supported(torch.zeros(3, 5, device="cuda", dtype=torch.bfloat16))
        assert not triton_supported(torch.zeros(5, 3, device="cuda").T)
        assert not triton_supported(torch.zeros(3, 5, device="cuda", dtype=torch.float64))


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize(("rows", "vocab"), [(1, 151936), (37, 151936), (1024, 151936), (4096, 151936), (300, 1000)])
def test_triton_kernels_match_the_reference_on_cuda(rows, vocab):
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = (torch.randn(rows, vocab, device="cuda", generator=g) * 4).to(torch.bfloat16)
    t = torch.randint(0, vocab, (rows,), device="cuda", generator=g)
    lse_ref, logp_ref = lse_and_logprob_reference(x.double(), t, torch.float64)
    lse, logp = lse_and_logprob_triton(x, t, torch.float32)
    assert float((lse.double() - lse_ref).abs().max()) < 1e-4
    assert float((logp.double() - logp_ref).abs().max()) < 1e-4
    v0 = vocab // 3
    gr = torch.randn(rows, device="cuda", generator=g)
    ref, got = x[:, v0:].clone(), x[:, v0:].clone()
    grad_logits_reference_(ref, lse, gr, t, v0)
    grad_logits_triton_(got, lse, gr, t, v0)
    assert float((got.float() - ref.float()).abs().max()) <= 2.0**-7 * max(float(ref.float().abs().max()), 1.0)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [True, False])
def test_target_logprobs_with_triton_kernels_matches_the_reference(compiled, monkeypatch):
    """Compiled path (against the Inductor-compiled reference) and eager callers such as `treepack.hf`'s
    head (against the eager reference): same log-probs and gradients within bf16 rounding."""
    from treepack.train import losses

    g = torch.Generator(device="cuda").manual_seed(0)
    R, D, V = 3000, 256, 151936
    h = (torch.randn(R, D, device="cuda", generator=g) * 0.5).requires_grad_()
    w = (torch.randn(V, D, device="cuda", generator=g) * 0.05).requires_grad_()
    t = torch.randint(0, V, (R,), device="cuda", generator=g)
    coef = torch.randn(R, device="cuda", generator=g)
    out = {}
    for kernels in ("inductor", "auto"):
        monkeypatch.setattr(losses, "LOGPROB_KERNELS", kernels)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logp = losses.target_logprobs(h, w, t, 1024, compiled=compiled)
        gh, gw = torch.autograd.grad((coef * logp).sum(), (h, w))
        out[kernels] = (logp.detach(), gh, gw)
    for a, b in zip(out["inductor"], out["auto"]):
        assert float((a - b).abs().max()) <= 1e-2 * max(float(a.abs().max()), 1e-6)


@cuda
@pytest.mark.gpu
def test_both_forward_paths_compile_at_the_first_call():
    """The first call for a vocabulary builds the whole-row kernel and the split-row pair, whichever it needs: a
    later chunk of few rows (split) after many (whole), or the other way round, compiles nothing in its step."""
    from treepack.kernels.logprobs import triton as K
    from treepack.train.compile_count import compiled_by_kind

    vocab = 50_021  # a vocabulary no other test uses: nothing built for it yet
    x = torch.randn(K.FWD_PROGRAMS + 3, vocab, device="cuda", dtype=torch.bfloat16)
    t = torch.randint(0, vocab, (x.shape[0],), device="cuda")
    lse_and_logprob_triton(x, t, torch.float32)  # whole rows; builds both paths
    before = compiled_by_kind()[1]
    for rows in (1, 7, 300):  # split rows
        lse, _ = lse_and_logprob_triton(x[:rows], t[:rows], torch.float32)
        lse_ref, _ = lse_and_logprob_reference(x[:rows].double(), t[:rows], torch.float64)
        assert float((lse.double() - lse_ref).abs().max()) < 1e-4
    assert compiled_by_kind()[1] == before
