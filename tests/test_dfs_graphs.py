"""dfs CUDA graphs on CPU: the padded inputs and scalars a graphed call reads, the config switch, and the
fallback (graphs need CUDA, compile and FA4: elsewhere the same eager dfs runs, with one warning).
Captures and replays themselves: tests/test_dfs_graphs_gpu.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_dfs import VOCAB, assert_same, make_pack, random_sequences, run

from treepack.train.config import DfsConfig, parse_config
from treepack.train.loop import build_mode
from treepack.train.losses import Objective
from treepack.train.model import Decoder
from treepack.train.modes import DfsMode, dfs_graphs
from treepack.train.modes.dfs_graphs import (
    PREFIX_BUCKET,
    TOKEN_BUCKET,
    CallGraphs,
    call_scalars,
    padded_inputs,
    rounded,
)
from treepack.train.modes.dfs_schedule import Step
from treepack.train.verify import tiny_model_args

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_rounded_buckets():
    assert [rounded(n, 128) for n in (1, 127, 128, 129)] == [128, 128, 128, 256]
    assert rounded(0, PREFIX_BUCKET) == 0 and rounded(9368, 1024) == 10240
    assert rounded(9368, PREFIX_BUCKET) >= 9368 and rounded(6093, TOKEN_BUCKET) >= 6093


def test_padding_sees_only_itself_and_reads_token_zero():
    """Padding goes last, reads a real token's id and position, and each pad's subtree ends right after it:
    by the mask contract ``k <= q < subtree_end[k]`` no real query sees a pad, and a pad sees no real token of
    the call."""
    chain = Step(kind="grad", lo=40, tokens_C=np.arange(100, 105), kv_grad=True)
    tokens, ends = padded_inputs(chain, 8)
    assert tokens.tolist() == [100, 101, 102, 103, 104, 0, 0, 0]
    assert ends.tolist() == [5, 5, 5, 5, 5, 6, 7, 8]
    tree = Step(kind="grad", lo=0, tokens_C=np.array([7, 8, 9]), kv_grad=False, subtree_end_C=np.array([3, 2, 3]),
                n_path=1)
    tokens, ends = padded_inputs(tree, 5)
    assert tokens.tolist() == [7, 8, 9, 0, 0] and ends.tolist() == [3, 2, 3, 4, 5]
    for q in range(5):  # no query q < 3 (real) sees a key k >= 3 (pad), no pad sees a real key
        for k in range(5):
            visible = k <= q < ends[k]
            assert not (visible and (q < 3) != (k < 3))


def test_call_scalars_name_the_rows_written_and_read():
    """(lo, first written, end written, gradient rows): an anchor writes all its rows, a grad call with a merged
    anchor writes the anchor's (at depth lo of the next path), a grad call reads the dK/dV of its path rows."""
    anchor = Step(kind="anchor", lo=12, tokens_C=np.arange(6), kv_grad=False)
    assert call_scalars(anchor, grad=False).tolist() == [12, 0, 6, 0]
    merged = Step(kind="grad", lo=3, tokens_C=np.arange(10), kv_grad=True, n_anchor=4)
    assert call_scalars(merged, grad=True).tolist() == [3, 6, 10, 10]
    tree = Step(kind="grad", lo=0, tokens_C=np.arange(4), kv_grad=True, subtree_end_C=np.array([4, 2, 4, 4]),
                n_path=2)
    assert call_scalars(tree, grad=True).tolist() == [0, 0, 0, 2]
    leaf = Step(kind="grad", lo=5, tokens_C=np.arange(4), kv_grad=False)
    assert call_scalars(leaf, grad=True).tolist() == [5, 0, 0, 0]


def test_config_switch_reaches_the_mode():
    base = '[data]\nshards = "p"\n[train]\nmode = "dfs"\n'
    assert not parse_config(base).train.dfs.cuda_graphs
    cfg = parse_config(base + "[train.dfs]\ncuda_graphs = true\n")
    mode = build_mode(cfg)
    assert isinstance(mode, DfsMode) and mode.cuda_graphs


def test_without_cuda_graphed_dfs_is_eager_dfs_with_one_warning():
    model = Decoder.random_init(tiny_model_args(VOCAB), seed=0, dtype=torch.float64)
    objective = Objective("grpo", "token")
    pack = make_pack(random_sequences(3), 3)
    ref_out, ref_grads = run(model, pack, "dfs", objective, dfs=DfsConfig(block_size=16))
    with pytest.warns(RuntimeWarning, match="dfs CUDA graphs are off: not on CUDA"):
        out, grads = run(model, pack, "dfs", objective, dfs=DfsConfig(block_size=16, cuda_graphs=True))
    assert_same(out, grads, ref_out, ref_grads)
    assert out.metrics["graph_calls"] == 0 and out.metrics["graph_pool_bytes"] == 0


def _shape_planner() -> CallGraphs:
    """A CallGraphs with only what `shapes` reads (its buffers need CUDA)."""
    g = CallGraphs.__new__(CallGraphs)
    g.token_bucket, g.prefix_bucket, g.seen, g.graphs = 128, 256, set(), {}
    return g


def test_shapes_are_captured_on_second_sight_exact_first():
    """A call shape met for the first time runs uncaptured at its own size; met again at its exact size (the same
    pack next epoch, or a repeat within a pack) it is captured at that size; a new exact shape whose buckets were
    met before is captured padded to them (a graph other packs replay). Calls of <= 128 tokens keep the bucket;
    with the graphs full, only shapes already captured."""
    steps = [Step(kind="anchor", lo=0, tokens_C=np.arange(300), kv_grad=False),
             Step(kind="grad", lo=300, tokens_C=np.arange(1000), kv_grad=True),
             Step(kind="grad", lo=300, tokens_C=np.arange(1000), kv_grad=True),
             Step(kind="release", lo=0, tokens_C=np.arange(5), kv_grad=False),
             Step(kind="grad", lo=1300, tokens_C=np.arange(100), kv_grad=False),
             Step(kind="grad", lo=310, tokens_C=np.arange(990), kv_grad=True)]
    g = _shape_planner()
    assert g.shapes(steps) == {0: (300, 0, False), 1: (1000, 300, False), 2: (1000, 300, True),
                               4: (128, 1536, False), 5: (1024, 512, True)}
    assert g.shapes(steps) == {0: (300, 0, True), 1: (1000, 300, True), 2: (1000, 300, True),
                               4: (128, 1536, True), 5: (990, 310, True)}
    full = _shape_planner()
    full.shapes(steps)
    full.graphs = {(True, 1000, 300, False, True, 1): None, **{("other", i): None for i in range(dfs_graphs.MAX_GRAPHS)}}
    assert full.shapes(steps) == {0: (300, 0, False), 1: (1000, 300, True), 2: (1000, 300, True),
                                  4: (128, 1536, False), 5: (990, 310, False)}


def test_shapes_without_exact_repeats_are_bucketed(monkeypatch):
    monkeypatch.setattr(dfs_graphs, "EXACT_REPEATS", False)
    steps = [Step(kind="grad", lo=300, tokens_C=np.arange(1000), kv_grad=False)] * 2
    assert _shape_planner().shapes(steps) == {0: (1024, 512, False), 1: (1024, 512, True)}
