"""Fixtures shared by several test modules, and the hooks of parallel runs (pytest-xdist, ``make test``)."""

from __future__ import annotations

import os
import sys

import pytest


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (``make test``): one worker per core, at most 8 (each imports the whole suite). None on a
    machine with CUDA: its tests measure the device's memory and time, which other workers' tests would
    share."""
    try:
        import torch
    except ImportError:
        return min(_cores(), 8)
    return 0 if torch.cuda.is_available() else min(_cores(), 8)


def pytest_configure(config):
    """Under pytest-xdist each worker gets its share of the cores for torch's intra-op threads (as torchrun
    gives each rank its share): two workers of two threads each on two cores spend their time waiting for one
    another. Set before the test modules import torch; the subprocesses the tests start inherit it."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not workers:
        return
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, _cores() // int(workers))))
    if "torch" in sys.modules:  # a plugin imported it before this hook
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_collection_modifyitems(config, items):
    """The files with a test marked ``slow`` first: ``--dist loadfile`` hands the files out in this order, so
    the longest ones start early instead of running last on one worker while the others wait. A run without
    xdist keeps the collection order."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)  # stable: the order within and among the rest is kept


@pytest.fixture(scope="module")
def one_torch_thread():
    """The tiny models' ops are microseconds long: intra-op threads only add synchronisation (10x slower on
    a busy 2-core machine). Modules opt in with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    torch = pytest.importorskip("torch")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
