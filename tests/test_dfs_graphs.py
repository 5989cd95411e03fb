"""dfs CUDA graphs on CPU: the padded inputs and scalars a graphed call reads, the config switch, and the
fallback (graphs need CUDA, compile and FA4: elsewhere the same eager dfs runs, with one warning).
Captures and replays themselves: tests/test_dfs_graphs_gpu.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_dfs import VOCAB, assert_same, make_pack, random_sequences, run

from treepack.train.config import parse_config
from treepack.train.loop import build_mode
from treepack.train.losses import Objective
from treepack.train.model import Decoder
from treepack.train.modes import DfsMode
from treepack.train.modes.dfs_graphs import PREFIX_BUCKET, TOKEN_BUCKET, call_scalars, padded_inputs, rounded
from treepack.train.modes.dfs_schedule import Step
from treepack.train.verify import tiny_model_args

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_rounded_buckets():
    assert [rounded(n, TOKEN_BUCKET) for n in (1, 255, 256, 257)] == [256, 256, 256, 512]
    assert rounded(0, PREFIX_BUCKET) == 0 and rounded(9368, PREFIX_BUCKET) == 10240


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
    assert not parse_config(base).train.dfs_cuda_graphs
    cfg = parse_config(base + "dfs_cuda_graphs = true\n")
    mode = build_mode(cfg)
    assert isinstance(mode, DfsMode) and mode.cuda_graphs


def test_without_cuda_graphed_dfs_is_eager_dfs_with_one_warning():
    model = Decoder.random_init(tiny_model_args(VOCAB), seed=0, dtype=torch.float64)
    objective = Objective("grpo", "token")
    pack = make_pack(random_sequences(3), 3)
    ref_out, ref_grads = run(model, pack, "dfs", objective, dfs_block_size=16)
    with pytest.warns(RuntimeWarning, match="dfs CUDA graphs are off: not on CUDA"):
        out, grads = run(model, pack, "dfs", objective, dfs_block_size=16, dfs_cuda_graphs=True)
    assert_same(out, grads, ref_out, ref_grads)
    assert out.metrics["graph_calls"] == 0 and out.metrics["graph_pool_bytes"] == 0
