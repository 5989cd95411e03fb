"""dfs's auto block (`treepack.train.modes.dfs_memory`): the plan's arithmetic against a naive count, the path
cache's rows against the schedule's, the CPU fallback, and on a GPU a real call's peak against the plan."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_dfs import make_pack, random_sequences

from treepack.train.config import DfsConfig
from treepack.train.losses import BatchTotals, LossRows, Objective
from treepack.train.memory_limit import state_bytes
from treepack.train.model import Decoder, ModelArgs
from treepack.train.modes import make_mode
from treepack.train.modes.dfs import DfsMode
from treepack.train.modes.dfs_memory import (
    CPU_BLOCK,
    GRANULE,
    MARGIN,
    OVERHEAD_BYTES,
    BlockPlan,
    longest_path,
    path_row_bytes,
    plan_block,
    token_bytes,
)

ARGS = ModelArgs.for_family("qwen3", vocab_size=1000, hidden_size=64, intermediate_size=160, num_layers=3,
                            num_heads=4, num_kv_heads=2, head_dim=16)


@pytest.fixture(scope="module")
def model() -> Decoder:
    return Decoder.random_init(ARGS, seed=0, dtype=torch.float32)


def test_counts_follow_the_model_shape(model):
    n_params = sum(p.numel() for p in model.parameters())
    matrices = sum(p.numel() for p in model.parameters() if p.dim() >= 2)
    assert state_bytes(model, torch.float32) == 4 * 4 * n_params  # weights, grads, two AdamW moments
    assert state_bytes(model, torch.bfloat16) == 16 * n_params + 2 * matrices  # + bf16 working copies
    # per layer: bf16 normed inputs (2 D), q and the attention output (2 H E), k and v (2 K E), the MLP's 3 F;
    # float32 residual inputs of the two norms (2 D)
    layer = 2 * (2 * 64 + 2 * 64 + 2 * 32 + 3 * 160) + 4 * 2 * 64
    assert token_bytes(model, torch.bfloat16) == pytest.approx(MARGIN * 3 * layer)
    assert path_row_bytes(model, torch.bfloat16) == 3 * 2 * 2 * 16 * (2 + 4)  # K/V bf16, their grads float32
    assert path_row_bytes(model, torch.float64) == 3 * 2 * 2 * 16 * 16
    model.activation_checkpointing = True
    try:
        assert token_bytes(model, torch.bfloat16) == pytest.approx(MARGIN * (3 * 64 * 4 + layer))
    finally:
        model.activation_checkpointing = False


@given(available=st.integers(0, 10**10), path=st.integers(1, 50_000), chunk=st.integers(1, 8192),
       graphs=st.booleans(), extra=st.integers(0, 3000), most=st.one_of(st.none(), st.integers(1, 200_000)))
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_plan_is_the_largest_granule_that_fits(model, available, path, chunk, graphs, extra, most):
    plan = plan_block(model, path_tokens=path, chunk_rows=chunk, compute_dtype=torch.bfloat16, graphs=graphs,
                      available=available, extra_tokens=extra, most=most)
    per_token = token_bytes(model, torch.bfloat16) * (2 if graphs else 1)
    fixed = state_bytes(model, torch.bfloat16) + path * path_row_bytes(model, torch.bfloat16) + int(
        MARGIN * chunk * ARGS.vocab_size * 6) + OVERHEAD_BYTES
    assert (plan.state + plan.cache + plan.head, plan.per_token) == (fixed, pytest.approx(per_token))
    assert plan.tokens % GRANULE == 0 and plan.tokens >= GRANULE
    # naive: walk the granules up while the next one fits
    fits = GRANULE
    while fixed + (fits + GRANULE + extra) * per_token <= available:
        fits += GRANULE
    if most is not None:
        fits = min(fits, max(-(-most // GRANULE) * GRANULE, GRANULE))
    assert plan.tokens == fits
    assert plan.short == (fixed + (GRANULE + extra) * per_token > available)


def test_line_says_what_the_block_is_made_of():
    plan = BlockPlan(tokens=18432, available=int(67e9), state=int(10.4e9), cache=int(3.2e9), head=int(0.8e9),
                     per_token=1.5e6)
    assert plan.line() == ('dfs: calls of up to 18,432 tokens (dfs.block_size = "auto": 52.6 of 67.0 GB for a '
                           "call's activations at ~1.50 MB a token, after 10.4 GB of weights and optimizer state, "
                           "3.2 GB of path cache, 0.8 GB of logits and workspace)")
    short = BlockPlan(tokens=1024, available=int(12e9), state=int(10.4e9), cache=int(3.2e9), head=0, per_token=1.5e6)
    assert short.line().endswith("0.0 of 12.0 GB for a call's activations at ~1.50 MB a token, after 10.4 GB of "
                                 "weights and optimizer state, 3.2 GB of path cache, 0.0 GB of logits and workspace); memory is "
                                 "short: lower train.logits_chunk or turn on train.activation_checkpointing")


@given(seed=st.integers(0, 10**6), n=st.integers(1, 12))
@settings(max_examples=40, deadline=None)
def test_the_path_cache_estimate_covers_the_schedule(seed, n):
    """The auto block sizes the path cache from positions; the traversal allocates the schedule's max depth."""
    pack = make_pack(random_sequences(seed, n=n))
    assert longest_path(pack) >= DfsMode(dfs=DfsConfig(block_size=8)).schedule(pack).max_depth


def test_auto_off_a_gpu_is_the_cpu_block_and_the_same_gradients(model):
    pack = make_pack(random_sequences(3, n=8, grow=60))
    mode = make_mode("dfs", attention="reference")  # [train.dfs] block_size = "auto": the default
    assert mode.auto is not None and mode.block_for(model, pack) == CPU_BLOCK and mode.block_for(None, pack) == CPU_BLOCK
    assert mode.describe_block(model, [pack], torch.float32) == (
        'dfs: calls of up to 8,192 tokens (dfs.block_size = "auto" off a GPU)')
    assert mode.auto.plan(model, pack, chunk_rows=1024, graphs=False, extra_tokens=0) is None
    rows = LossRows.from_pack(pack)
    objective = Objective(kind="grpo")
    grads = []
    for block in ("auto", CPU_BLOCK):
        model.zero_grad(set_to_none=True)
        make_mode("dfs", attention="reference", dfs=DfsConfig(block_size=block))(model, pack, rows, objective,
                                                                     BatchTotals.of([rows])).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_train_prints_the_block_at_the_start(tmp_path):
    from cli_helpers import run as cli
    from test_train_cli import write_config

    r = cli("train", write_config(tmp_path, mode="dfs", out="dfs", steps=1))
    assert r.code == 0, r.err
    lines = r.out.splitlines()
    assert 'dfs: calls of up to 8,192 tokens (dfs.block_size = "auto" off a GPU)' in lines
    assert lines.index('dfs: calls of up to 8,192 tokens (dfs.block_size = "auto" off a GPU)') > next(
        i for i, line in enumerate(lines) if line.startswith("treepack train: dfs mode"))  # after the banner
    # graphs asked for where they cannot run: said on that line, not as a Python warning from inside a step
    r = cli("train", write_config(tmp_path, mode="dfs", out="g", steps=1, extra="[train.dfs]\ncuda_graphs = true\nblock_size = 64\n"))
    assert r.code == 0 and "RuntimeWarning" not in r.err
    assert "dfs: calls of up to 64 tokens (dfs.block_size); dfs.cuda_graphs is off: not on CUDA" in r.out.splitlines()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_call_at_the_auto_block_stays_under_the_plan():
    """A bf16-autocast dfs pass over a pack with long branches, its block planned for a small memory: the
    allocator's peak stays within what the plan counted (the plan errs large, by its margin)."""
    args = ModelArgs.for_family("qwen3", vocab_size=32000, hidden_size=512, intermediate_size=1536, num_layers=4,
                                num_heads=8, num_kv_heads=4, head_dim=64)
    model = Decoder.random_init(args, seed=0, dtype=torch.float32, device="cuda")
    rng = np.random.default_rng(0)
    trunk = rng.integers(0, 32000, 3000).tolist()
    pack = make_pack([trunk + rng.integers(0, 32000, int(rng.integers(2000, 6000))).tolist() for _ in range(4)])
    mode = make_mode("dfs", attention="auto", logits_chunk=1024, dfs=DfsConfig(block_size="auto"))
    plan0 = plan_block(model, path_tokens=longest_path(pack), chunk_rows=1024, compute_dtype=torch.bfloat16,
                       graphs=False, available=10**12)
    # memory for the state, the cache, the logits, the workspace, and 4,096 tokens of activations beside a
    # merged anchor's
    mode.auto.available = plan0.state + plan0.cache + plan0.head + int((4096.5 + mode.merge_anchor_tokens) * plan0.per_token)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        plan = mode.auto.plan(model, pack, chunk_rows=1024, graphs=False, extra_tokens=mode.merge_anchor_tokens)
        assert mode.block_for(model, pack) == plan.tokens
    assert plan.tokens == 4096
    rows = LossRows.from_pack(pack)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = mode(model, pack, rows, Objective(kind="grpo"), BatchTotals.of([rows]))
    out.backward()
    torch.cuda.synchronize()
    assert out.metrics["peak_graph_tokens"] <= 4096 + mode.merge_anchor_tokens
    # the state's AdamW moments do not exist yet: the peak must stay under the plan without them
    moments = 2 * sum(p.numel() * p.element_size() for p in model.parameters())
    assert torch.cuda.max_memory_allocated() <= mode.auto.available - moments
