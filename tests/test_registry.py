"""The attention backend registry and the mode registry: one table of names, one resolution of ``auto``, one
check of which backends serve which modes, read by the eager API, ``treepack.hf``, the config and the CLI."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from treepack.errors import ConfigError
from treepack.kernels import tree_attention
from treepack.kernels.tree_attention import registry
from treepack.kernels.tree_attention.registry import AttentionCall, BackendError, check, names, resolve
from treepack.train.attention import AttentionContext
from treepack.train.config import TrainConfig, parse_config
from treepack.train.modes import MODES, Mode, make_mode, mode_family, mode_names, register_mode

CPU = torch.device("cpu")


def call(dtype=torch.float64, **kw) -> AttentionCall:
    return AttentionCall(kw.pop("device", CPU), dtype, kw.pop("heads", 4), kw.pop("head_dim", 16), **kw)


@pytest.fixture
def scratch_registry(monkeypatch):
    """The registry's tables, restored after the test (a test may register a backend or a mode)."""
    import treepack.train.modes.registry as mode_registry

    monkeypatch.setattr(registry, "_TABLE", {f: dict(t) for f, t in registry._TABLE.items()})
    monkeypatch.setattr(mode_registry, "_MODES", dict(mode_registry._MODES))


def test_names_exist_once_and_everyone_reads_them():
    assert names("tree") == ("auto", "reference", "flex", "triton", "fa4")
    assert names("causal") == ("auto", "reference", "flex", "triton", "fa4", "sdpa", "flash-varlen", "fa4-varlen")
    assert names() == ("auto", "reference", "flex", "triton", "fa4", "sdpa", "flash-varlen", "fa4-varlen")
    assert MODES == mode_names() == ("tree", "dense", "dense-leaf", "dfs", "auto")
    assert [mode_family(m) for m in MODES] == ["tree", "causal", "causal", "tree", "tree"]
    with pytest.raises(ConfigError) as err:
        parse_config("[data]\nshards = 'p'\n[train]\nattention = 'fast'\n")
    assert str(err.value) == ("config.toml: train.attention must be one of auto, reference, flex, triton, fa4, sdpa, "
                              "flash-varlen, fa4-varlen, got 'fast'")


def test_sdpa_is_refused_for_tree_modes_in_one_place_with_one_sentence():
    with pytest.raises(BackendError) as err:
        check("tree", "sdpa")
    assert str(err.value) == ("attention 'sdpa' runs independent causal sequences; tree attention needs auto, "
                              "reference, flex, triton or fa4")
    for mode in ("tree", "dfs", "auto"):
        with pytest.raises(ConfigError) as err:
            make_mode(mode, attention="sdpa")
        assert str(err.value) == (f"train.attention = 'sdpa' runs independent causal sequences; train.mode = "
                                  f"'{mode}' needs auto, reference, flex, triton or fa4")
    with pytest.raises(ConfigError) as err:
        AttentionContext.tree(torch.tensor([1], dtype=torch.int32), "sdpa")
    assert str(err.value) == ("attention 'sdpa' runs independent causal sequences; tree attention needs auto, "
                              "reference, flex, triton or fa4")
    for mode in ("dense", "dense-leaf"):
        assert make_mode(mode, attention="sdpa").attention == "sdpa"
    with pytest.raises(BackendError, match=r"^attention must be one of auto, reference, flex, triton, fa4, got 'x'$"):
        check("tree", "x")


def test_auto_off_cuda_is_the_reference_and_sdpa():
    assert resolve("tree", "auto", call()).name == "reference"
    assert resolve("tree", "auto", call(torch.bfloat16, window=True)).name == "reference"
    assert resolve("tree", "auto", call(fallback="flex")).name == "reference"  # treepack.hf's auto on a CPU
    assert resolve("causal", "auto", call()).name == "sdpa"  # the dense baselines, bit for bit as before


def test_named_backends_that_cannot_run_say_why():
    with pytest.raises(BackendError) as err:
        resolve("tree", "flex", call(torch.float32, grad=True))
    assert err.value.reason == "torch's FlexAttention has no backward on CPU; use 'reference' or 'auto' there"
    assert resolve("tree", "flex", call(torch.float32)).name == "flex"  # forward only: fine on a CPU
    assert registry.unsupported_reason("tree", "fa4", call(torch.bfloat16)) == "the fa4 backend needs CUDA tensors, got cpu"
    assert registry.unsupported_reason("tree", "triton", call(window=True)) == (
        "the triton tree kernel has no sliding window or soft-capping; use attention='flex' (CUDA) or 'auto'")
    assert registry.unsupported_reason("tree", "reference", call(window=True, softcap=True)) is None


def test_auto_on_cuda_follows_the_measured_table(monkeypatch, scratch_registry):
    """No GPU needed: the table's answer and the fallbacks around it, with the kernels' checks faked."""
    from treepack.kernels.tree_attention import backends

    cuda = torch.device("cuda")
    picks, ok = {}, {"fa4": None, "triton": None}
    monkeypatch.setattr(backends, "pick_backend", lambda *a, **k: picks["next"])
    for name in ok:
        registry.register_backend("tree", name, supports=registry._plain_only(name, lambda c, n=name: ok[n]),
                                  run="unused:run")
    for pick in ("fa4", "triton"):
        picks["next"] = pick
        assert resolve("tree", "auto", call(torch.bfloat16, device=cuda)).name == pick
    picks["next"] = "reference"  # no fused kernel takes the call (float64, an odd head dim)
    assert resolve("tree", "auto", call(device=cuda)).name == "reference"
    assert resolve("tree", "auto", call(device=cuda, fallback="flex")).name == "flex"  # treepack.hf's choice
    assert resolve("tree", "auto", call(torch.bfloat16, device=cuda, softcap=True)).name == "flex"
    assert resolve("tree", "auto", call(torch.float32, device=cuda, window=True)).name == "reference"
    picks["next"], ok["triton"] = "triton", "triton is not installed"  # the table's answer cannot run
    assert resolve("tree", "auto", call(torch.bfloat16, device=cuda)).name == "reference"
    with pytest.raises(BackendError, match="^triton is not installed$"):
        resolve("tree", "triton", call(torch.bfloat16, device=cuda))


def test_a_new_causal_backend_is_one_registration(scratch_registry):
    """What the varlen kernels do: register for the causal family with a rank; auto takes the highest rank
    that supports the call, and per-sequence SDPA stays the catch-all (every CPU run)."""
    seen = []

    def run(q, k, v, batch):
        seen.append(tuple(batch.lengths))
        return q * 0

    registry.register_backend("causal", "mine", supports=lambda c: None if c.dtype == torch.float32 else "f32 only",
                              run=run, auto=True, rank=5)
    assert names("causal")[-1] == "mine" and "mine" not in names("tree")
    assert resolve("causal", "auto", call(torch.float32)).name == "mine"
    assert resolve("causal", "auto", call(torch.float64)).name == "sdpa"
    ctx = AttentionContext.causal([2, 3], "auto")
    q = torch.randn(5, 4, 16)
    assert torch.equal(ctx.attend(q, q[:, :2], q[:, :2], None), q * 0) and seen == [(2, 3)]
    assert TrainConfig(mode="dense", attention="mine").attention == "mine"
    with pytest.raises(ConfigError, match="^train.attention = 'mine' runs independent causal sequences; "):
        TrainConfig(mode="tree", attention="mine")


def test_a_new_mode_is_one_registration(scratch_registry):
    class Twice(Mode):
        name = "twice"

        def __call__(self, model, pack, rows, objective, totals):
            raise NotImplementedError

    register_mode("twice", lambda train, extras: Twice(train.attention, chunk_rows=train.logits_chunk),
                  family="tree")
    mode = make_mode("twice", attention="reference", logits_chunk=64)
    assert isinstance(mode, Twice) and (mode.attention, mode.chunk_rows) == ("reference", 64)
    assert parse_config("[data]\nshards = 'p'\n[train]\nmode = 'twice'\n").train.mode == "twice"
    with pytest.raises(ConfigError, match="^unknown mode 'thrice' \\(modes: tree, dense, dense-leaf, dfs, auto, twice\\)$"):
        make_mode("thrice")


def test_make_mode_takes_the_train_settings_whole():
    train = parse_config("[data]\nshards = 'p'\n[train]\nmode = 'dfs'\nattention = 'reference'\nlogits_chunk = 128\n"
                         "[train.dfs]\nblock_size = '1k'\nkeep_tokens = 64\norder = 'layout'\nsubtree_calls = false\n"
                         "merge_anchor_tokens = 7\n").train
    dfs = make_mode("dfs", train)
    assert (dfs.attention, dfs.chunk_rows, dfs.block_size, dfs.keep_tokens, dfs.order, dfs.subtree_calls,
            dfs.merge_anchor_tokens, dfs.cuda_graphs) == ("reference", 128, 1000, 64, "layout", False, 7, False)
    dense = make_mode("dense-leaf", dataclasses.replace(train, micro_batch_tokens="32"))
    assert (dense.name, dense.attention, dense.micro_batch_tokens) == ("dense-leaf", "reference", 32)
    with pytest.raises(TypeError, match="dfs_block_size"):  # the flat keywords are gone
        make_mode("dfs", dfs_block_size=8)


def test_the_eager_api_runs_what_resolve_names(monkeypatch):
    ran = []
    real = registry.Backend.run.fget

    def spy(self):
        ran.append(self.name)
        return real(self)

    monkeypatch.setattr(registry.Backend, "run", property(spy))
    q = torch.randn(3, 2, 16, dtype=torch.float64)
    tree_attention(q, q, q, torch.tensor([3, 3, 3], dtype=torch.int32))
    assert ran == ["reference"]
