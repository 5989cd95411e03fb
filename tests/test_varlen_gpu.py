"""GPU tests of the varlen causal backends (skipped without CUDA; fa4 also without flash-attn-4).

Tolerance relative to torch's own error (flash-attention's rule, as tests/test_tree_attention_gpu.py): the
kernel and a same-dtype run of the per-sequence reference are both compared with a float32 reference on the
same rounded inputs; the kernel's max error on the output and on every gradient must be at most 2x torch's,
plus the dtype's rounding at the values' magnitude.

Shape suffixes: T tokens, H query heads, K kv heads, E head dim.
"""

from __future__ import annotations

import pytest
import torch

from treepack.kernels.varlen import CausalBatch, causal_varlen_attention, varlen_unsupported_reason

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

LENGTHS = {
    "one_token": [1],
    "awkward": [1, 97, 128, 1025, 3],
    "many_short": [37] * 300,
    "one_long": [8192],
}


def _run(impl, q, k, v, lengths, dout):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = causal_varlen_attention(q, k, v, CausalBatch.of(lengths, q.device), impl=impl)
    out.backward(dout)
    return [out.detach().float(), q.grad.float(), k.grad.float(), v.grad.float()]


@pytest.mark.parametrize("impl", ["fa4", "flash"])
@pytest.mark.parametrize("shape", LENGTHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_varlen_matches_the_reference_within_torchs_error(impl, shape, dtype):
    lengths = LENGTHS[shape]
    T, H, K, E = sum(lengths), 16, 8, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(T, h, E, device="cuda", dtype=dtype, generator=g) for h in (H, K, K, H))
    reason = varlen_unsupported_reason(impl, q)
    if reason is not None:
        pytest.skip(reason)
    ref32 = _run("sdpa", q.float(), k.float(), v.float(), lengths, dout.float())
    same_dtype = _run("sdpa", q, k, v, lengths, dout)
    kernel = _run(impl, q, k, v, lengths, dout)
    eps = torch.finfo(dtype).eps
    for name, a, b, r in zip(("out", "dq", "dk", "dv"), kernel, same_dtype, ref32):
        err, torch_err = (a - r).abs().max().item(), (b - r).abs().max().item()
        print(f"{impl} {shape} {dtype} {name}: kernel {err:.3e} torch {torch_err:.3e}")
        assert err <= 2 * torch_err + eps * r.abs().max().item() + 1e-5, (name, err, torch_err)


@pytest.mark.parametrize("impl", ["fa4", "flash"])
def test_leaf_paths_match_the_tree_reference(impl):
    """Queries once over gathered ancestor keys (seqlen_q < seqlen_k, bottom-right causal) on a branchy pack."""
    from test_tree_attention import random_subtree_end

    from treepack.kernels.varlen.paths import DevicePaths, paths_attention, plan_paths

    end_T = random_subtree_end(3000, seed=7, branch=0.01)
    T, H, K, E = end_T.shape[0], 16, 8, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(T, h, E, device="cuda", dtype=torch.bfloat16, generator=g) for h in (H, K, K, H))
    if (reason := varlen_unsupported_reason(impl, q)) is not None:
        pytest.skip(reason)
    paths = DevicePaths.of(plan_paths(end_T.numpy()), "cuda")

    def run(fn, *xs):
        xs = [x.detach().clone().requires_grad_() for x in xs]
        out = fn(*xs)
        out.backward(dout.to(out.dtype))
        return [out.detach().float()] + [x.grad.float() for x in xs]

    ref32 = run(lambda a, b, c: paths_attention(a, b, c, paths, impl="sdpa"), q.float(), k.float(), v.float())
    same = run(lambda a, b, c: paths_attention(a, b, c, paths, impl="sdpa"), q, k, v)
    kern = run(lambda a, b, c: paths_attention(a, b, c, paths, impl=impl), q, k, v)
    for name, a, b, r in zip(("out", "dq", "dk", "dv"), kern, same, ref32):
        err, torch_err = (a - r).abs().max().item(), (b - r).abs().max().item()
        print(f"paths {impl} {name}: kernel {err:.3e} torch {torch_err:.3e}")
        assert err <= 2 * torch_err + torch.finfo(torch.bfloat16).eps * r.abs().max().item() + 1e-5, (name, err)
