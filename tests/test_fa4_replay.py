"""`LaunchReplay` on the CPU, against a stand-in for FA4's interface module: functions with a ``compile_cache``
whose "compiled kernels" are plain Python writing into their tensor arguments, and an entry point that
allocates temporaries (``empty`` filled by a kernel, ``zeros`` read by one), passes views and named tuples.

* Replayed calls give exactly what the entry point gives, over random shapes (hypothesis); the first call of a
  signature runs plainly, the second is recorded, later ones replay.
* A copy, a data-dependent read, a tensor kept between calls, or a compile during the recorded call leave
  the signature on the plain path with the reason counted.
* ``TREEPACK_FA4_REPLAY=off`` never replays; ``=check`` catches a replay that differs (hidden state).
* Strides and alignment are part of the signature.
(The GPU test with FA4 itself: test_fa4_gpu.py.)
"""

from __future__ import annotations

import gc
import os
import types
import weakref
from typing import NamedTuple
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treepack.kernels.tree_attention.fa4_replay import LaunchReplay


class Aux(NamedTuple):
    tensors: list | None = None
    scalars: tuple | None = None


def _kernel_prep(acc, k):  # fills an `empty` temporary
    acc.copy_(k * 2)


def _kernel_main(q, acc, out, lse, scale, blocks, aux):
    tmp, _ = blocks
    out.copy_(q * scale + acc + tmp.sum())
    lse.copy_(out.sum(-1) + aux.tensors[0].float().sum())
    tmp.add_(1.0)  # a zeros temporary the next kernel reads


def _kernel_post(tmp, out):
    out.add_(tmp.mean())


def make_fake(mode: str = "ok"):
    """A module like flash_attn.cute.interface; ``mode`` picks a behaviour replay must refuse or survive."""
    m = types.ModuleType("fake_interface")
    state = {"calls": 0, "kept": torch.ones(1)}

    def prep(acc, k):
        if "prep" not in prep.compile_cache:
            prep.compile_cache["prep"] = _kernel_prep
        prep.compile_cache["prep"](acc, k)

    def entry(q, k, out, lse, idx, scale):
        key = ("main", q.dtype, q.shape[-1])
        if key not in entry.compile_cache:
            entry.compile_cache[key] = _kernel_main
        acc = torch.empty(q.shape, dtype=q.dtype)
        tmp = torch.zeros(q.shape[0], 3, dtype=torch.float32)
        prep(acc, k.detach())
        s = scale
        if mode == "hidden":  # a value the recording cannot see changes per call
            state["calls"] += 1
            s = scale + state["calls"]
        aux = Aux([idx, state["kept"]] if mode == "kept" else [idx], None)
        entry.compile_cache[key](q.detach(), acc.view(acc.shape), out, lse, s, (tmp[:, :2], None), aux)
        post.compile_cache["post"](tmp, out)
        if mode == "copy":
            lse.add_(0.0)
        if mode == "item":
            float(q[0, 0])

    def post():
        pass

    entry.compile_cache, prep.compile_cache = {}, {}
    post.compile_cache = {"post": _kernel_post}
    m.entry, m.prep, m.post = entry, prep, post
    return m


def _call(replay: LaunchReplay, fake, q, k, idx, scale=0.5):
    out, lse = torch.empty_like(q), torch.empty(q.shape[:-1], dtype=torch.float32)
    replay(("fwd", scale), (q, k, out, lse, idx), lambda: fake.entry(q, k, out, lse, idx, scale),
           outputs=(out, lse))
    return out, lse


def _plain(fake, q, k, idx, scale=0.5):
    out, lse = torch.empty_like(q), torch.empty(q.shape[:-1], dtype=torch.float32)
    fake.entry(q, k, out, lse, idx, scale)
    return out, lse


def _primed(T: int, D: int, mode: str = "ok"):
    """A stand-in module, its LaunchReplay and one input, called twice (plain, then recorded)."""
    fake = make_fake(mode)
    replay = LaunchReplay([fake])
    q, k, idx = torch.randn(T, D), torch.randn(T, D), torch.arange(T, dtype=torch.int32)
    _call(replay, fake, q, k, idx)
    _call(replay, fake, q, k, idx)
    return fake, replay, q, k, idx


@settings(max_examples=20, deadline=None)
@given(shapes=st.lists(st.tuples(st.integers(1, 9), st.sampled_from([2, 4])), min_size=1, max_size=4),
       repeats=st.integers(1, 4), seed=st.integers(0, 1000))
def test_replay_gives_what_the_entry_point_gives(shapes, repeats, seed):
    g = torch.Generator().manual_seed(seed)
    fake = make_fake()
    replay = LaunchReplay([fake])
    with mock.patch.dict(os.environ, {"TREEPACK_FA4_REPLAY": "on"}):
        for _ in range(repeats):
            for T, D in shapes:
                q, k = torch.randn(T, D, generator=g), torch.randn(T, D, generator=g)
                idx = torch.randint(0, 9, (T,), generator=g, dtype=torch.int32)
                for got, want in zip(_call(replay, fake, q, k, idx), _plain(fake, q, k, idx)):
                    assert torch.equal(got, want)
    sigs = len(set(shapes))
    calls = repeats * len(shapes)
    stats = replay.stats
    assert stats.plain == sigs and stats.recorded == min(calls - sigs, sum(
        1 for s in set(shapes) if repeats * shapes.count(s) >= 2))
    assert stats.replayed == calls - stats.plain - stats.recorded and not stats.refused


def test_replay_uses_the_recorded_kernels_without_the_entry_point(monkeypatch):
    monkeypatch.setenv("TREEPACK_FA4_REPLAY", "on")
    fake, replay, q, k, idx = _primed(5, 4)
    entered = []
    real = fake.entry
    fake.entry = lambda *a: (entered.append(1), real(*a))
    out, lse = _call(replay, fake, q * 3, k, idx)
    assert not entered and replay.stats.replayed == 1
    want = _plain(make_fake(), q * 3, k, idx)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])


@pytest.mark.parametrize(("mode", "reason"), [
    ("copy", "aten.add_"),
    ("item", "aten._local_scalar_dense"),
    ("kept", "a launch tensor FA4 keeps between calls"),
])
def test_unreplayable_calls_stay_on_the_plain_path(mode, reason, monkeypatch):
    monkeypatch.setenv("TREEPACK_FA4_REPLAY", "on")
    fake = make_fake(mode)
    replay = LaunchReplay([fake])
    q, k, idx = torch.randn(6, 4), torch.randn(6, 4), torch.arange(6, dtype=torch.int32)
    for _ in range(4):
        got = _call(replay, fake, q, k, idx)
        want = _plain(fake, q, k, idx)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert replay.stats.replayed == 0 and replay.stats.refused[reason] == 1
    assert replay.stats.plain == 3 and reason in replay.stats.line()


def test_a_compile_during_the_recorded_call_is_not_replayed(monkeypatch):
    monkeypatch.setenv("TREEPACK_FA4_REPLAY", "on")
    fake = make_fake()
    replay = LaunchReplay([fake])
    q, k, idx = torch.randn(3, 2), torch.randn(3, 2), torch.arange(3, dtype=torch.int32)
    _call(replay, fake, q, k, idx)
    fake.entry.compile_cache.clear()
    _call(replay, fake, q, k, idx)
    assert replay.stats.refused["compiled during the recorded call"] == 1


def test_off_never_replays_and_check_catches_hidden_state(monkeypatch):
    q, k, idx = torch.randn(4, 2), torch.randn(4, 2), torch.arange(4, dtype=torch.int32)
    monkeypatch.setenv("TREEPACK_FA4_REPLAY", "off")
    replay = LaunchReplay([make_fake()])
    for _ in range(3):
        _call(replay, make_fake(), q, k, idx)
    assert replay.stats.plain == 3 and replay.stats.replayed == 0
    monkeypatch.setenv("TREEPACK_FA4_REPLAY", "check")
    fake = make_fake("hidden")
    replay = LaunchReplay([fake])
    _call(replay, fake, q, k, idx)
    _call(replay, fake, q, k, idx)
    with pytest.raises(RuntimeError, match="FA4 launch replay differs from FA4's own path in output 0"):
        _call(replay, fake, q, k, idx)
    fake = make_fake()
    replay = LaunchReplay([fake])
    for _ in range(4):
        _call(replay, fake, q, k, idx)
    assert replay.stats.replayed == 2


def test_strides_and_alignment_are_part_of_the_signature(monkeypatch):
    monkeypatch.setenv("TREEPACK_FA4_REPLAY", "on")
    fake, replay, _, k, idx = _primed(4, 2)
    q_t = torch.randn(2, 4).t()  # same shape, other strides
    got = _call(replay, fake, q_t, k, idx)
    assert replay.stats.replayed == 0 and replay.stats.plain == 2
    assert torch.equal(got[0], _plain(fake, q_t, k, idx)[0])
    shifted = torch.randn(9)[1:].view(4, 2)  # same shape and strides, 4-byte aligned only
    _call(replay, fake, shifted, k, idx)
    assert replay.stats.plain == 3


def test_plans_are_bounded(monkeypatch):
    monkeypatch.setenv("TREEPACK_FA4_REPLAY", "on")
    fake = make_fake()
    replay = LaunchReplay([fake], max_plans=3)
    for T in range(1, 8):
        q, k, idx = torch.randn(T, 2), torch.randn(T, 2), torch.arange(T, dtype=torch.int32)
        _call(replay, fake, q, k, idx)
        _call(replay, fake, q, k, idx)
    assert len(replay.plans) == 3


def test_a_reused_address_and_an_empty_tensor_replay_exactly(monkeypatch):
    """A temporary freed before the next is allocated (the allocator may hand out the same address) and a
    zero-element argument (its address means nothing)."""
    monkeypatch.setenv("TREEPACK_FA4_REPLAY", "on")
    m = types.ModuleType("fake_reuse")

    def fill(a, x):
        a.copy_(x.flatten()[: a.numel()].view(a.shape) + 1)

    def combine(b, out, nothing):
        out.copy_(b.sum() + out.shape[0] + nothing.numel())

    def entry(x, out):
        a = torch.empty(16)
        entry.compile_cache["fill"](a, x)
        del a
        b = torch.zeros(4, 4)
        entry.compile_cache["fill"](b, x)
        entry.compile_cache["combine"](b, out, torch.empty(0))

    entry.compile_cache = {"fill": fill, "combine": combine}
    m.entry = entry
    replay = LaunchReplay([m])
    for seed in range(5):
        x = torch.randn(16, generator=torch.Generator().manual_seed(seed))
        out = torch.empty(3)
        replay(("x",), (x, out), lambda x=x, out=out: entry(x, out), outputs=(out,))
        want = torch.empty(3)
        entry(x, want)
        assert torch.equal(out, want)
    assert replay.stats.replayed == 3 and not replay.stats.refused


def test_a_replay_keeps_no_tensor_alive(monkeypatch):
    """Tensors of a replayed call are freed when the caller drops them, without waiting for the cycle
    collector (a cycle holding them cost dfs mode 4 GiB of peak memory)."""
    monkeypatch.setenv("TREEPACK_FA4_REPLAY", "on")
    warm = LaunchReplay([make_fake()])  # a first recording in the process runs torch's lazy imports, whose
    for _ in range(2):  # frames may outlive it: not what this test is about
        _call(warm, make_fake(), torch.randn(2, 2), torch.randn(2, 2), torch.arange(2, dtype=torch.int32))
    fake = make_fake()
    replay = LaunchReplay([fake])
    refs = []
    gc.disable()
    try:
        for _ in range(4):
            q, k, idx = torch.randn(6, 4), torch.randn(6, 4), torch.arange(6, dtype=torch.int32)
            out, lse = _call(replay, fake, q, k, idx)
            refs += [weakref.ref(t) for t in (q, k, out, lse)]
            del q, k, idx, out, lse
        assert replay.stats.replayed == 2
        assert all(r() is None for r in refs)
    finally:
        gc.enable()
