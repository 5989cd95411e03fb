"""GPU tests of the Triton tree-attention kernels (skipped without CUDA).

Tolerance relative to torch's own error (flash-attention's rule): the kernel (bf16/fp16) and a same-dtype
torch run of the reference are both compared with a float32 reference on the same (rounded) inputs; the
kernel's max error on the output and on every gradient must be at most 2x torch's, plus the dtype's
rounding error at the magnitude of the values and 1e-5 (where torch is exact: the gradients of a row
with a single key are 0, which the kernel's delta = rowsum(dO·O) on the rounded O misses by ~1e-6). Max and mean errors are printed (pytest -s).

Shape suffixes: T pack tokens, P prefix tokens, H query heads, K kv heads, D head dim.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from test_tree_attention import (
    chains_subtree_end,
    make_qkv,
    padded_subtree_end,
    random_subtree_end,
    star_subtree_end,
)

from treepack.kernels import prepare, tree_attention
from treepack.kernels.tree_attention.reference import tree_attention_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

DEV = "cuda"

TREES = {
    "one_token": lambda: torch.tensor([1], dtype=torch.int32),
    "random_97": lambda: random_subtree_end(97, seed=1),
    "random_128": lambda: random_subtree_end(128, seed=2, branch=0.4),
    "random_1025": lambda: random_subtree_end(1025, seed=3, branch=0.05),
    "deep_chain_4096": lambda: chains_subtree_end([4096]),
    "star_500_siblings": lambda: star_subtree_end(root_len=700, n_leaves=500, leaf_len=3),
    "padded_to_128": lambda: padded_subtree_end(random_subtree_end(1000, seed=4, branch=0.02), 128),
    "forest_of_chains": lambda: chains_subtree_end([1, 130, 500, 64, 300]),
    "random_32k": lambda: random_subtree_end(32768, seed=5, branch=0.003, new_root=0.0),
}


def _tri():
    from treepack.kernels.tree_attention import triton as tri

    return tri


def _pinned(fused_bwd=False):
    # the GPU tile shapes without autotuning: tests run one fixed configuration
    return replace(_tri().GPU_DEFAULT, autotune=False, fused_bwd=fused_bwd)


# split backward (dQ kernel) and fused backward (dQ by atomics from the dK/dV kernel)
FUSED = pytest.mark.parametrize("fused", [False, True], ids=["split", "fused"])


def _run(fn, inputs, dout):
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*inputs)
    grads = torch.autograd.grad(out, inputs, dout)
    return [out.detach(), *grads]


def check_against_torch(subtree_end_T, H, K, D, P=0, dtype=torch.bfloat16, config=None, seed=0):
    T = subtree_end_T.numel()
    q, k, v, pk, pv = make_qkv(T, H, K, D, dtype=dtype, seed=seed, P=P, device=DEV)
    inputs = [t for t in (q, k, v, pk, pv) if t is not None]
    subtree_end_T = subtree_end_T.to(DEV)
    info = prepare(subtree_end_T)
    scale = 1 / math.sqrt(D)
    g = torch.Generator(device=DEV).manual_seed(seed + 1)
    dout = torch.randn(T, H, D, device=DEV, generator=g).to(dtype)

    def kernel(q, k, v, pk=None, pv=None):
        return _tri().tree_attention_triton(q, k, v, info, prefix_k=pk, prefix_v=pv, scale=scale, config=config or _pinned())

    def torch_ref(q, k, v, pk=None, pv=None):
        return tree_attention_reference(q, k, v, subtree_end_T, prefix_k_PKD=pk, prefix_v_PKD=pv, scale=scale)

    ours = _run(kernel, inputs, dout)
    same_dtype = _run(torch_ref, inputs, dout)
    fp32 = _run(torch_ref, [t.float() for t in inputs], dout.float())
    names = ["out", "dq", "dk", "dv", "dprefix_k", "dprefix_v"]
    failures = []
    for name, a, b, ref in zip(names, ours, same_dtype, fp32):
        assert a.isfinite().all(), f"{name}: non-finite values"
        err, err_torch = (a.float() - ref).abs(), (b.float() - ref).abs()
        rounding = ((ref + 0.3 - 0.3).to(dtype).float() - ref).abs().max().item()
        bound = 2 * err_torch.max().item() + 2 * rounding + 1e-5
        print(
            f"T={T} H={H} K={K} D={D} P={P} {dtype} {name:9s} kernel max {err.max().item():.2e} "
            f"mean {err.mean().item():.2e} | torch max {err_torch.max().item():.2e} mean {err_torch.mean().item():.2e}"
        )
        if not err.max().item() <= bound:
            failures.append(f"{name}: {err.max().item():.3e} > {bound:.3e}")
    assert not failures, "; ".join(failures)


@FUSED
@pytest.mark.parametrize("tree", list(TREES))
@pytest.mark.parametrize("D", [64, 128])
def test_trees_bf16(tree, D, fused):
    H, K = (4, 2) if tree == "random_32k" else (4, 4)
    check_against_torch(TREES[tree](), H=H, K=K, D=D, config=_pinned(fused))


@FUSED
@pytest.mark.parametrize("tree", ["random_97", "random_1025", "star_500_siblings"])
def test_fp16(tree, fused):
    check_against_torch(TREES[tree](), H=4, K=2, D=128, dtype=torch.float16, config=_pinned(fused))


@FUSED
@pytest.mark.parametrize("heads", [(8, 1), (8, 2), (6, 3)])
def test_gqa(heads, fused):
    check_against_torch(TREES["random_1025"](), H=heads[0], K=heads[1], D=128, config=_pinned(fused))


@FUSED
@pytest.mark.parametrize("P", [1, 100, 1000])
@pytest.mark.parametrize("tree", ["random_97", "random_1025"])
def test_prefix(P, tree, fused):
    check_against_torch(TREES[tree](), H=4, K=2, D=128, P=P, config=_pinned(fused))


def test_autotune_configs_are_each_correct():
    tri = _tri()
    fwd, dq, dkdv = tri._fwd_configs(), tri._dq_configs(), tri._dkdv_configs()
    for i in range(max(len(fwd), len(dq), len(dkdv))):
        f, d, b = fwd[i % len(fwd)], dq[i % len(dq)], dkdv[i % len(dkdv)]
        cfg = replace(
            _pinned(),
            fwd_block_m=f.kwargs["BLOCK_M"], fwd_warps=f.num_warps, fwd_stages=f.num_stages,
            dq_block_m=d.kwargs["BLOCK_M"], dq_warps=d.num_warps, dq_stages=d.num_stages,
            dkdv_block_n=b.kwargs["BLOCK_N1"], dkdv_block_m=b.kwargs["BLOCK_M1"],
            dkdv_warps=b.num_warps, dkdv_stages=b.num_stages,
        )
        check_against_torch(TREES["random_1025"](), H=4, K=2, D=128, P=50, config=cfg, seed=i)


@FUSED
@pytest.mark.parametrize("tree", ["random_1025", "star_500_siblings", "padded_to_128"])
def test_schedule_128x128(tree, fused):
    cfg = replace(_pinned(fused), sched_n=128)
    check_against_torch(TREES[tree](), H=4, K=2, D=128, P=30, config=cfg)


def test_fused_bwd_dkdv_tiles_are_each_correct():
    # the fused kernel runs cfg's dkdv tiles (never autotuned): each candidate tile, with a ragged prefix
    for i, b in enumerate(_tri()._dkdv_configs()):
        cfg = replace(
            _pinned(fused_bwd=True), dkdv_block_n=b.kwargs["BLOCK_N1"], dkdv_block_m=b.kwargs["BLOCK_M1"],
            dkdv_warps=b.num_warps, dkdv_stages=b.num_stages,
        )
        check_against_torch(TREES["random_1025"](), H=4, K=2, D=128, P=50, config=cfg, seed=i)


def test_fused_bwd_with_autotune_on():
    # autotune=True: forward autotuned, the fused dK/dV launch pinned (its dQ accumulator is not reset)
    cfg = replace(_tri().GPU_DEFAULT, fused_bwd=True)
    check_against_torch(TREES["random_1025"](), H=4, K=2, D=128, P=100, config=cfg)


def test_autotuned_default_path():
    subtree_end_T = TREES["random_1025"]().to(DEV)
    q, k, v, _, _ = make_qkv(1025, 4, 2, 128, dtype=torch.bfloat16, device=DEV)
    out = tree_attention(q, k, v, prepare(subtree_end_T))  # auto -> triton, autotuned
    ref = tree_attention(q.float(), k.float(), v.float(), subtree_end_T, impl="reference")
    assert (out.float() - ref).abs().max().item() < 2e-2


def test_auto_dispatch_and_fallback():
    subtree_end_T = TREES["random_97"]().to(DEV)
    q, k, v, _, _ = make_qkv(97, 2, 2, 80, dtype=torch.bfloat16, device=DEV)  # D=80: no triton kernel
    out = tree_attention(q, k, v, subtree_end_T)
    assert torch.equal(out, tree_attention(q, k, v, subtree_end_T, impl="reference"))
    with pytest.raises(ValueError, match=r"^impl='triton': the triton backend supports head dims 32, 64, 128, got D=80$"):
        tree_attention(q, k, v, subtree_end_T, impl="triton")


def test_flex_matches_reference():
    pytest.importorskip("torch.nn.attention.flex_attention")
    subtree_end_T = TREES["random_1025"]().to(DEV)
    q, k, v, pk, pv = make_qkv(1025, 4, 2, 64, dtype=torch.float32, device=DEV, P=7)
    out = tree_attention(q, k, v, prepare(subtree_end_T), prefix_k=pk, prefix_v=pv, impl="flex")
    ref = tree_attention(q, k, v, subtree_end_T, prefix_k=pk, prefix_v=pv, impl="reference")
    assert (out - ref).abs().max().item() < 1e-2  # flex may run the matmuls in tf32


def test_torch_compile_traces_the_custom_op():
    subtree_end_T = TREES["random_97"]().to(DEV)
    info = prepare(subtree_end_T)
    q, k, v, _, _ = make_qkv(97, 4, 2, 64, dtype=torch.bfloat16, device=DEV)
    q.requires_grad_()

    def layer(q, k, v):
        return tree_attention(q, k, v, info, impl="triton").float().square().sum()

    eager = torch.autograd.grad(layer(q, k, v), q)[0]
    compiled = torch.autograd.grad(torch.compile(layer)(q, k, v), q)[0]
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


def test_deterministic():
    subtree_end_T = TREES["star_500_siblings"]().to(DEV)
    T = subtree_end_T.numel()
    q, k, v, _, _ = make_qkv(T, 4, 2, 128, dtype=torch.bfloat16, device=DEV)
    info = prepare(subtree_end_T)
    runs = [_run(lambda q, k, v: tree_attention(q, k, v, info, impl="triton"), [q, k, v], torch.ones_like(q)) for _ in range(2)]
    for a, b in zip(*runs):
        assert torch.equal(a, b)
