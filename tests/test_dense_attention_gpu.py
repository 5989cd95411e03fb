"""The dense baselines' attention on CUDA (`treepack.train.attention._causal_fast`): cuDNN per sequence for few
long sequences, one varlen flash call for many short ones, both without repeating the kv heads. Each path against
float32 causal attention per sequence (the kv heads repeated by hand), forward and backward, in bf16 and fp16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from treepack.train import attention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def reference(q, k, v, lengths):
    """float32 causal attention of each sequence, GQA by repeating the kv heads."""
    groups = q.shape[1] // k.shape[1]
    outs, start = [], 0
    for n in lengths:
        qs, ks, vs = (x[start : start + n].float().transpose(0, 1) for x in (q, k, v))
        ks, vs = ks.repeat_interleave(groups, 0), vs.repeat_interleave(groups, 0)
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1))
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("path", ["cudnn", "varlen"])
@pytest.mark.parametrize("lengths", [[700], [300, 1, 900, 64], [2048, 129]])
def test_fast_causal_attention_matches_float32(monkeypatch, dtype, path, lengths):
    if path == "varlen" and attention._varlen_attention() is None:
        pytest.skip("this torch has no varlen attention")
    monkeypatch.setattr(attention, "CUDNN_MIN_MEAN_LENGTH", 1 << 30 if path == "varlen" else 0)
    g = torch.Generator(device="cuda").manual_seed(len(lengths))
    T, H, K, E = sum(lengths), 8, 2, 128
    q, k, v = (torch.randn(T, h, E, device="cuda", dtype=dtype, generator=g).requires_grad_()
               for h in (H, K, K))
    dout = torch.randn(T, H, E, device="cuda", dtype=dtype, generator=g)
    out = attention._causal_sdpa(q, k, v, lengths)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    qr, kr, vr = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = reference(qr, kr, vr, lengths)
    ref_grads = torch.autograd.grad(ref, (qr, kr, vr), dout.float())
    assert out.dtype == dtype and out.shape == (T, H, E)
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    for got, want in [(out, ref), *zip(grads, ref_grads)]:
        err = (got.float() - want).abs().max() / want.abs().max()
        assert err < tol, (path, float(err))


def test_float32_keeps_the_per_sequence_path():
    """Only 16-bit inputs take the fast kernels (varlen and cuDNN have no float32): float32 is as before."""
    q = torch.randn(96, 4, 64, device="cuda")
    k, v = torch.randn(96, 2, 64, device="cuda"), torch.randn(96, 2, 64, device="cuda")
    out = attention._causal_sdpa(q, k, v, [32, 64])
    assert torch.allclose(out, reference(q, k, v, [32, 64]), atol=1e-5, rtol=1e-5)
