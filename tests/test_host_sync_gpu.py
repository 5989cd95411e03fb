"""No host sync on the per-call path (CUDA only).

A host sync (``.item()``, a Python scalar written into a CUDA tensor, a copy from pageable memory) makes
the CPU wait until the GPU's queue is empty, so the next call's kernel launches cannot overlap the work
still queued. The dfs mode makes one model call per step of its schedule: one sync per call cost ~45 ms a
call on an H200 (Qwen3-0.6B, B=4096, tau-bench: 28 calls). These tests run the per-call path under
``torch.cuda.set_sync_debug_mode("error")``, which raises on any synchronizing CUDA operation.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from test_equivalence import make_pack, random_sequences

from treepack.kernels import prepare, tree_attention
from treepack.train.config import DfsConfig
from treepack.train.losses import BatchTotals, LossRows, Objective
from treepack.train.model import Decoder, ModelArgs
from treepack.train.modes.dfs import DfsMode, _Traversal

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@contextlib.contextmanager
def no_sync():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def small_model(dtype: torch.dtype) -> Decoder:
    """A 2-layer Qwen3-shaped decoder on the GPU, eager (what a sync check needs: every launch visible)."""
    args = ModelArgs.for_family("qwen3", vocab_size=13, hidden_size=128, intermediate_size=256, num_layers=2,
                                num_heads=4, num_kv_heads=2, head_dim=64)
    model = Decoder.random_init(args, seed=0, dtype=dtype, device="cuda")
    model.compile = "off"
    return model


def small_pack():
    """A pack of 16 random sequences and its loss rows."""
    pack = make_pack(random_sequences(np.random.default_rng(5), 16), 0)
    return pack, LossRows.from_pack(pack)


@pytest.mark.parametrize("T", [1, 128, 1000, 4097])
def test_prepare_without_validation_does_not_sync(T):
    subtree_end = torch.full((T,), T, dtype=torch.int32, device="cuda")
    with no_sync():
        info = prepare(subtree_end, validate=False)
    assert int(info.kv_min_N[-1]) == (0 if T % 128 else T)  # a ragged last block is never full


def test_tree_attention_call_does_not_sync():
    T, P = 300, 70
    q = torch.randn(T, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(T, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(T, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    pk = torch.randn(P, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    pv = torch.randn(P, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    info = prepare(torch.full((T,), T, dtype=torch.int32, device="cuda"))
    tree_attention(q, k, v, info, prefix_k=pk, prefix_v=pv, impl="triton").sum().backward()  # compile first
    with no_sync():
        tree_attention(q, k, v, info, prefix_k=pk, prefix_v=pv, impl="triton").sum().backward()


def test_dfs_steps_do_not_sync():
    """A pack's whole walk: its uploads (through pinned memory), every model call, loss chunk and backward."""
    model = small_model(torch.bfloat16)
    pack, rows = small_pack()
    objective = Objective("sft", "token")
    for subtree_calls in (True, False):
        mode = DfsMode("triton", dfs=DfsConfig(block_size=7, subtree_calls=subtree_calls))
        _Traversal(mode, model, pack, rows, objective, BatchTotals.of([rows])).run()  # compile first
        with no_sync():
            walk = _Traversal(mode, model, pack, rows, objective, BatchTotals.of([rows]))
            walk.run()
        assert walk.schedule.steps and sum(s.kind == "anchor" for s in walk.schedule.steps) > 0


def test_dfs_steps_with_working_weights_do_not_sync():
    """Under bf16 autocast with working weights: the head's GEMMs accumulating into .grad and the embedding's rows
    added into it (`index_put_` with accumulate, sorted on the device) queue without a sync too."""
    from treepack.train.working_weights import WorkingWeights

    model = small_model(torch.float32)
    WorkingWeights(model, torch.bfloat16)
    pack, rows = small_pack()
    mode = DfsMode("triton", dfs=DfsConfig(block_size=7))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        _Traversal(mode, model, pack, rows, Objective("sft", "token"), BatchTotals.of([rows])).run()  # .grad made
        embedding = model.model.embed_tokens.weight
        assert embedding.grad is not None
        before = embedding.grad.clone()
        with no_sync():
            _Traversal(mode, model, pack, rows, Objective("sft", "token"), BatchTotals.of([rows])).run()
    assert not torch.equal(embedding.grad, before)  # the second walk added into it


def test_clip_fraction_stays_on_the_device():
    """GRPO's clip fraction is read back with the step's loss, not per pack."""
    logp_R = torch.randn(1000, device="cuda", dtype=torch.float64)
    behaviour_R = logp_R + 0.3 * torch.randn(1000, device="cuda", dtype=torch.float64)
    with no_sync():
        frac = Objective("grpo", "token").clip_fraction(logp_R, behaviour_R)
    ratio = (logp_R - behaviour_R).exp().cpu()
    assert float(frac) == pytest.approx(float(((ratio < 0.8) | (ratio > 1.2)).double().mean()))


@pytest.mark.parametrize("mode_name", ["tree", "dense-leaf", "dense"])
def test_pack_modes_do_not_sync(mode_name):
    """A pack through tree, dense-leaf and dense mode (GRPO rows, bf16, varlen attention for the dense modes): the
    uploads of every micro-batch go through pinned memory, so the host queues the next micro-batch while the GPU
    runs this one (a pageable copy per micro-batch left an H200 idle 32% of a GSM8K dense-leaf step)."""
    from treepack.train.modes import make_mode

    model = small_model(torch.bfloat16)
    pack, rows = small_pack()
    objective = Objective("grpo", "token")
    mode = make_mode(mode_name, attention="auto", micro_batch_tokens=str(pack.n_tokens // 2))
    mode(model, pack, rows, objective, BatchTotals.of([rows]))  # kernels compiled, allocator warm
    with no_sync():
        result = mode(model, pack, rows, objective, BatchTotals.of([rows]))
    assert torch.isfinite(result.loss).item()
