"""Launch replay for FlashAttention-4: the compiled kernels FA4 launches for one call, relaunched directly for
later calls of the same shapes, skipping FA4's per-call Python.

Why: FA4's entry points (``flash_attn.cute.interface``) rebuild their whole launch plan in Python on every call
(~1,300 lines of argument checks, tile configuration, block-sparsity normalisation and compile-key hashing)
before calling an already compiled kernel: 1.3-1.6 ms of host time per forward + backward of a small call
(benchmarks/results/2026-11-25-attention-fa4-h100.md). A pack-sized tree call hides that behind its GPU work;
dfs mode's calls of a few thousand tokens do not: its GPU idled 27% of a step waiting for the host
(2026-11-25-dfs-host-bound-h200.md). Within one model call every layer calls FA4 with the same shapes, so the
plan of the first layer serves the other 27.

How: per signature (entry point, scalar arguments, and shape / stride / dtype / 16-byte alignment of every
tensor the caller passes, outputs preallocated by the caller), the first call runs FA4 as is (it may compile),
the second runs it under a recorder, and later calls replay what was recorded:

* a spy on every ``compile_cache`` of the module records each compiled launch and its arguments;
* a ``TorchDispatchMode`` records every tensor operation FA4 runs around them.

The recording becomes a plan only if it can be replayed exactly: every operation is an allocation (``empty``
or ``zeros``, replayed the same way), a view, or the zeroing of a fresh allocation; every tensor in a launch
argument is a view of a caller tensor or of such an allocation (rebuilt with ``as_strided`` on the new call's
storage); the arguments are otherwise plain values (None, numbers, strings, tuples, named tuples); and nothing
compiled during the recorded call. Anything else (a copy, a data-dependent read, a tensor FA4 keeps between
calls) leaves the signature on FA4's own path, with the reason counted in `ReplayStats`. Replay then costs one
Python pass over the recorded arguments per launch.

``TREEPACK_FA4_REPLAY=0`` turns replay off; ``=check`` also runs FA4's own path after every replay and raises
if the outputs differ (beyond float32 atomics' reordering): the GPU tests use it, and
``benchmarks/dfs.py --fa4-replay check`` runs whole steps so.
"""

from __future__ import annotations

import os
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["LaunchReplay", "ReplayStats", "replay_setting"]

_ALLOC_EMPTY = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"}
_ALLOC_ZEROS = {"zeros", "zeros_like", "new_zeros"}
_ZEROING = {"zero_", "fill_"}  # fill_ only with 0
_PLAIN = (type(None), bool, int, float, str)


def replay_setting() -> str:
    """``TREEPACK_FA4_REPLAY``: "on" (default), "off" (also "0") or "check"."""
    value = os.environ.get("TREEPACK_FA4_REPLAY", "on").strip().lower()
    return {"0": "off", "false": "off", "1": "on", "true": "on"}.get(value, value)


@dataclass
class ReplayStats:
    """What happened to the calls: replayed, recorded, run plainly, and why recordings were refused."""

    replayed: int = 0
    recorded: int = 0
    plain: int = 0
    refused: Counter = field(default_factory=Counter)

    def line(self) -> str:
        total = self.replayed + self.recorded + self.plain
        why = "; ".join(f"{n}x {reason}" for reason, n in self.refused.most_common(3))
        return (f"{self.replayed}/{total} FA4 calls replayed, {self.recorded} recorded, {self.plain} plain"
                + (f" (refused: {why})" if why else ""))


@dataclass(frozen=True)
class _View:
    """A launch argument that is a view of buffer ``source`` (the caller's tensors, then the plan's
    allocations), rebuilt on the new call's storage."""

    source: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # elements from the source tensor's own storage offset
    whole: bool = False  # the source itself (same dtype, shape, strides, offset): passed as is


@dataclass(frozen=True)
class _Empty:
    """A launch argument with no elements (its address means nothing)."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class _Alloc:
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    zeros: bool


@dataclass
class _Launch:
    """One compiled launch, its arguments split for a fast rebuild: the constant ones in place, and where the
    caller's or the plan's buffers go (passed as is, as a strided view, or inside a tuple)."""

    fn: Callable
    static: list
    whole: list[tuple[int, int]]  # (argument, buffer)
    views: list[tuple[int, _View]]
    nested: list[tuple[int, Any]]  # (argument, template with _View / _Empty inside)

    @classmethod
    def of(cls, fn: Callable, args: list) -> _Launch:
        static, whole, views, nested = list(args), [], [], []
        for i, a in enumerate(args):
            if isinstance(a, _View) and a.whole:
                static[i] = None
                whole.append((i, a.source))
            elif isinstance(a, _View):
                static[i] = None
                views.append((i, a))
            elif _dynamic(a):
                static[i] = None
                nested.append((i, a))
        return cls(fn, static, whole, views, nested)


@dataclass
class _Plan:
    allocs: list[_Alloc]
    launches: list[_Launch]


def _dynamic(x) -> bool:
    return isinstance(x, (_View, _Empty)) or (isinstance(x, (list, tuple)) and any(_dynamic(y) for y in x))


class _Refused(Exception):
    pass


def _signature(tensors: Sequence[Tensor | None]) -> tuple:
    return tuple(None if t is None else (t.shape, t.stride(), t.dtype, t.get_device(), t.data_ptr() & 15 == 0)
                 for t in tensors)


class _Recorder(TorchDispatchMode):
    """Logs tensor operations, numbers the allocations, and turns each launch's arguments into a template
    at launch time (a freed allocation's address may be reused by a later one)."""

    def __init__(self, tensors: Sequence[Tensor | None]):
        super().__init__()
        self.tensors = tensors
        self.callers: dict[int, list[int]] = {}
        for i, t in enumerate(tensors):
            if t is not None and t.numel():
                self.callers.setdefault(t.untyped_storage().data_ptr(), []).append(i)
        self.allocs: list[list] = []  # [base tensor, zeros]
        self.live: dict[int, int] = {}  # storage address -> index into allocs
        self.launches: list[tuple[Callable, Any]] = []
        self.refusal: str | None = None
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.paused or self.refusal is not None:
            return out
        name = func.overloadpacket.__name__
        if name in _ALLOC_EMPTY or name in _ALLOC_ZEROS:
            self.live[out.untyped_storage().data_ptr()] = len(self.allocs)
            self.allocs.append([out, name in _ALLOC_ZEROS])
        elif name in _ZEROING:
            t = args[0]
            i = self.live.get(t.untyped_storage().data_ptr())
            value = args[1] if name == "fill_" else 0
            whole = t.numel() * t.element_size() == t.untyped_storage().nbytes()
            if i is not None and whole and not isinstance(value, Tensor) and value == 0:
                self.allocs[i][1] = True
            else:
                self.refusal = f"aten.{name} on a tensor that is not a fresh allocation"
        elif not _is_view(func):
            self.refusal = f"aten.{name}"
        return out

    def launch(self, fn, args) -> None:
        if self.refusal is None:
            try:
                self.launches.append((fn, self._template(list(args))))
            except _Refused as e:
                self.refusal = str(e)

    def _template(self, x):
        return _map(x, self._leaf)

    def _leaf(self, x):
        if isinstance(x, Tensor):
            if x.numel() == 0:
                return _Empty(tuple(x.shape), tuple(x.stride()), x.dtype)
            ptr = x.untyped_storage().data_ptr()
            if ptr in self.callers:
                owners = [i for i in self.callers[ptr] if self.tensors[i].data_ptr() == x.data_ptr()]
                owners = owners or self.callers[ptr]
                if len(owners) != 1:
                    raise _Refused("a launch tensor shares storage with several caller tensors")
                i = owners[0]
                return _View(i, x.dtype, tuple(x.shape), tuple(x.stride()),
                             x.storage_offset() - self.tensors[i].storage_offset(), _same(x, self.tensors[i]))
            if ptr in self.live:
                i = self.live[ptr]
                base = self.allocs[i][0]
                if base.dtype != x.dtype:
                    raise _Refused("a launch tensor reinterprets an allocation's dtype")
                return _View(-1 - i, x.dtype, tuple(x.shape), tuple(x.stride()),
                             x.storage_offset() - base.storage_offset(), _same(x, base))
            raise _Refused("a launch tensor FA4 keeps between calls")
        if isinstance(x, _PLAIN):
            return x
        raise _Refused(f"a launch argument of type {type(x).__name__}")

    def plan(self) -> _Plan:
        """The launches with allocations renumbered after the caller's tensors, unused ones dropped."""
        used: dict[int, int] = {}
        launches = [_Launch.of(fn, _renumber(args, len(self.tensors), used)) for fn, args in self.launches]
        allocs = [None] * len(used)
        for i, j in used.items():
            base, zeros = self.allocs[i]
            allocs[j] = _Alloc(tuple(base.shape), tuple(base.stride()), base.dtype, zeros)
        return _Plan(allocs, launches)


# Module-level recursion, not closures: a recursive closure is a reference cycle, and one holding the call's
# tensors keeps them (GiBs in dfs mode) until Python's cycle collector runs.
def _map(x, leaf: Callable):
    """``x`` with every leaf replaced by ``leaf(leaf_value)``, through lists, tuples and named tuples."""
    if isinstance(x, list):
        return [_map(y, leaf) for y in x]
    if isinstance(x, tuple):
        items = [_map(y, leaf) for y in x]
        return type(x)(*items) if hasattr(x, "_fields") else tuple(items)
    return leaf(x)


def _renumber(x, n: int, used: dict[int, int]):
    def leaf(v):
        if isinstance(v, _View) and v.source < 0:
            i = used.setdefault(-1 - v.source, len(used))
            return _View(n + i, v.dtype, v.size, v.stride, v.offset, v.whole)
        return v

    return _map(x, leaf)


def _build(x, buffers: list[Tensor], device: torch.device):
    def leaf(v):
        if isinstance(v, _View):
            src = buffers[v.source]
            return src if v.whole else src.as_strided(v.size, v.stride, src.storage_offset() + v.offset)
        if isinstance(v, _Empty):
            return torch.empty_strided(v.size, v.stride, dtype=v.dtype, device=device)
        return v

    return _map(x, leaf)


def _same(x: Tensor, src: Tensor) -> bool:
    return (x.dtype == src.dtype and x.shape == src.shape and x.stride() == src.stride()
            and x.storage_offset() == src.storage_offset())


def _is_view(func) -> bool:
    schema = func._schema
    return (len(schema.returns) == 1 and schema.returns[0].alias_info is not None
            and not schema.returns[0].alias_info.is_write)


class _CacheSpy:
    """Stands in for one ``compile_cache`` while recording: launches are templated by the recorder."""

    def __init__(self, cache, recorder: _Recorder):
        self.cache, self.recorder = cache, recorder
        self.compiled = False

    def __contains__(self, key):
        return key in self.cache

    def __setitem__(self, key, fn):
        self.compiled = True
        self.cache[key] = fn

    def __getitem__(self, key):
        fn = self.cache[key]

        def launch(*args):
            self.recorder.launch(fn, args)
            self.recorder.paused = True
            try:
                return fn(*args)
            finally:
                self.recorder.paused = False

        return launch

    def __getattr__(self, name):
        return getattr(self.cache, name)


class LaunchReplay:
    """Replays FA4's compiled launches per signature (see the module docstring). One per entry point.

    ``modules`` (a sequence, or a function returning one at each recording) hold the functions whose
    ``compile_cache`` FA4 launches through (all loaded ``flash_attn.cute`` modules); ``max_plans`` bounds the
    plans kept (least recently used dropped; a plan holds no tensors)."""

    def __init__(self, modules, *, max_plans: int = 4096):
        self.modules = modules
        self.max_plans = max_plans
        self.plans: OrderedDict[tuple, _Plan | str | int] = OrderedDict()  # plan, refusal, or calls seen
        self.stats = ReplayStats()

    def __call__(self, key: tuple, tensors: Sequence[Tensor | None], run: Callable[[], Any],
                 outputs: Sequence[Tensor] = ()) -> None:
        """Run ``run()`` (FA4 on ``tensors``, writing into the caller's preallocated ``outputs``, which are
        among ``tensors``) or replay its recorded launches on ``tensors``."""
        mode = replay_setting()
        if mode == "off":
            self.stats.plain += 1
            run()
            return
        sig = (key, _signature(tensors))
        entry = self.plans.get(sig)
        if isinstance(entry, _Plan):
            self.plans.move_to_end(sig)
            self.stats.replayed += 1
            self._replay(entry, tensors)
            if mode == "check":
                self._check(tensors, run, outputs)
            return
        if isinstance(entry, str):  # refused
            self.stats.plain += 1
            run()
            return
        if entry is None:  # first call: FA4 as is (it may compile)
            self._remember(sig, 1)
            self.stats.plain += 1
            run()
            return
        self.stats.recorded += 1
        try:
            plan = self._record(tensors, run)
        except _Refused as e:
            self.stats.refused[str(e)] += 1
            self._remember(sig, str(e))
            return
        self._remember(sig, plan)

    def _remember(self, sig, entry) -> None:
        self.plans[sig] = entry
        self.plans.move_to_end(sig)
        while len(self.plans) > self.max_plans:
            self.plans.popitem(last=False)

    def _record(self, tensors: Sequence[Tensor | None], run: Callable[[], Any]) -> _Plan:
        """Run FA4 once under the recorder; the plan, or `_Refused` (after FA4's call has completed)."""
        recorder = _Recorder(tensors)
        modules = self.modules() if callable(self.modules) else self.modules
        owners = list({id(f): f for m in modules for f in vars(m).values()
                       if callable(f) and hasattr(f, "compile_cache")}.values())
        spies = [(f, f.compile_cache, _CacheSpy(f.compile_cache, recorder)) for f in owners]
        for f, _, spy in spies:
            f.compile_cache = spy
        try:
            with recorder:
                run()
        finally:
            for f, cache, _ in spies:
                f.compile_cache = cache
        if any(spy.compiled for _, _, spy in spies):
            raise _Refused("compiled during the recorded call")
        if recorder.refusal is not None:
            raise _Refused(recorder.refusal)
        if not recorder.launches:
            raise _Refused("no compiled launch")
        return recorder.plan()

    def _replay(self, plan: _Plan, tensors: Sequence[Tensor | None]) -> None:
        device = next(t.device for t in tensors if t is not None)
        buffers = list(tensors)
        for a in plan.allocs:
            buf = torch.empty_strided(a.size, a.stride, dtype=a.dtype, device=device)
            buffers.append(buf.zero_() if a.zeros else buf)

        for launch in plan.launches:
            args = launch.static.copy()
            for i, j in launch.whole:
                args[i] = buffers[j]
            for i, v in launch.views:
                src = buffers[v.source]
                args[i] = src.as_strided(v.size, v.stride, src.storage_offset() + v.offset)
            for i, t in launch.nested:
                args[i] = _build(t, buffers, device)
            launch.fn(*args)

    def _check(self, tensors, run, outputs: Sequence[Tensor]) -> None:
        replayed = [o.clone() for o in outputs]
        run()
        for i, (a, b) in enumerate(zip(replayed, outputs)):
            if a.dtype.is_floating_point:
                ok = torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2, equal_nan=True)
            else:
                ok = torch.equal(a, b)
            if not ok:
                raise RuntimeError(f"FA4 launch replay differs from FA4's own path in output {i} "
                                   f"(max abs diff {(a.float() - b.float()).abs().max().item():.3g})")
