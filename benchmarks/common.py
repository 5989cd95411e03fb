"""What every benchmark shares: hardware and version facts, timing, the command line, report files.

Each script in this folder writes a dated markdown report naming the hardware, the versions and the exact
command (`benchmarks/results/`); these helpers keep those lines the same everywhere. Scripts import this
module as ``common`` (``benchmarks/`` is on ``sys.path`` when a script runs); it needs neither torch nor a
GPU unless a function that measures one is called.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import importlib
import os
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

PATH_OPTIONS = ("--out", "--json-out", "--data", "--real", "--tau-bench", "--toolbench")  # their values are shown as file names only


def today() -> str:
    return dt.date.today().isoformat()


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def cpu_line() -> str:
    """``<model>, <n> cores`` as the reports print it."""
    return f"{cpu_model()}, {os.cpu_count()} cores"


def versions(*modules: str) -> str:
    """``Python 3.x, numpy a, pyarrow b, ...`` for the named importable modules (missing ones say so)."""
    parts = [f"Python {platform.python_version()}"]
    for name in modules:
        try:
            parts.append(f"{name} {importlib.import_module(name).__version__}")
        except ImportError:
            parts.append(f"{name} (not installed)")
    return ", ".join(parts)


def fa4_version() -> str:
    """``, flash-attn-4 x`` where the FA4 extra is installed, else empty."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f", flash-attn-4 {version('flash-attn-4')}"
    except PackageNotFoundError:
        return ""


def gpu_line(device=None) -> str:
    """``<GPU name>; torch a, triton b, Python c`` on CUDA, a CPU smoke-run line otherwise."""
    import torch

    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        return f"{torch.cuda.get_device_name(device)}; {versions('torch', 'triton')}{fa4_version()}"
    return f"CPU smoke run, numbers not meaningful ({platform.machine()}); {versions('torch')}"


def command_line(script: str, argv: Sequence[str]) -> str:
    """The command as typed, with the values of path options reduced to file names (no machine paths)."""
    shown = []
    for prev, a in zip(["", *argv], argv):
        if prev in PATH_OPTIONS:
            a = Path(a).name
        else:
            for opt in PATH_OPTIONS:
                if a.startswith(opt + "="):
                    a = f"{opt}={Path(a.split('=', 1)[1]).name}"
        shown.append(a)
    return " ".join(["python", f"benchmarks/{Path(script).name}", *shown])


def bench_ms(fn: Callable[[], object], warmup_ms: int = 50, rep_ms: int = 300) -> float:
    """Median milliseconds of ``fn`` (CUDA events through ``triton.testing.do_bench``; on CPU one timed call
    after one warm-up, which only serves dry runs of the GPU scripts)."""
    import torch

    if not torch.cuda.is_available():
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton

    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def events_ms(fn: Callable[[], object], repeats: int, warmup: int = 0) -> float:
    """Median milliseconds of ``repeats`` calls of ``fn``, each between two CUDA events and synchronised (no L2
    flush, unlike `bench_ms`: what a call costs when its inputs were just written), after ``warmup`` calls."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def gpu_kernels(fn: Callable[[], object], repeats: int, warmup: int = 3) -> list[tuple[str, float]]:
    """(name, ms) of every GPU kernel that ``repeats`` calls of ``fn`` ran (torch.profiler's CUDA activity), after
    ``warmup`` calls."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    return [(e.name, (e.time_range.end - e.time_range.start) / 1e3) for e in prof.events()
            if e.device_type == DeviceType.CUDA]


def kernel_ms(fn: Callable[[], object], repeats: int, warmup: int = 3) -> float:
    """Milliseconds of GPU kernel time per call of ``fn`` (`gpu_kernels`, summed and divided): what a call costs
    inside a step whose host runs ahead of the GPU. `events_ms` also counts the host's launch time whenever the
    GPU waits for it, which short kernels behind Python do."""
    return sum(ms for _, ms in gpu_kernels(fn, repeats, warmup)) / repeats


def ratio(reference: float | None, value: float | None) -> str:
    """``reference / value`` as ``1.23x`` (a speed-up when both are times), ``-`` when either is missing."""
    return f"{reference / value:.2f}x" if reference and value else "-"


def one_forest(r, seed: int):
    """A batch as one forest (no tree_id scoping) with GRPO advantages: from the data, else the rewards
    standardised over the batch, else N(0, 1)."""
    r = dataclasses.replace(r, groups=None, group_names=None)
    if r.advantages is None or np.isnan(r.advantages).any():
        if r.rewards is not None and not np.isnan(r.rewards).any():
            reward_S = np.asarray(r.rewards, dtype=np.float64)
            r.advantages = (reward_S - reward_S.mean()) / (reward_S.std() + 1e-6)
        else:
            r.advantages = np.random.default_rng(seed).standard_normal(len(r))
    return r


def write_report(path: Path | None, text: str) -> None:
    """Write a report (creating its folder); ``None`` writes nothing."""
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
