"""Python's garbage collector during training: its pauses counted per step, the warm-up's objects frozen.

Why: compiling the first steps (Dynamo, Inductor, Triton, FA4) leaves a large set of long-lived Python
objects (graphs, generated code, caches). CPython's full collections scan every object it tracks, and a
full collection that falls inside a step stops the host from queueing work, so the GPU waits: one took
0.54 s in a benchmark process after its warm-up (1x H100, benchmarks/results/2026-11-26-host-noise-h100.md).
`freeze_warmup` moves everything alive after the first step into the collector's permanent generation
(``gc.freeze``), so later collections only scan what later steps allocate. Collection itself stays on:
cycles made by a step are still freed.

`Pauses` times every collection (``gc.callbacks``), so a slow step can be told apart from a collection.
"""

from __future__ import annotations

import gc
import time


class Pauses:
    """Seconds spent in Python's collections, and how many were full (generation 2), since the last `take`."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.full = 0
        self._since: float | None = None

    def start(self) -> None:
        gc.callbacks.append(self._on_collection)

    def stop(self) -> None:
        if self._on_collection in gc.callbacks:
            gc.callbacks.remove(self._on_collection)

    def _on_collection(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._since = time.perf_counter()
        elif self._since is not None:
            self.seconds += time.perf_counter() - self._since
            self.full += info.get("generation") == 2
            self._since = None

    def take(self) -> tuple[float, int]:
        """(seconds, full collections) since the last call; resets both."""
        out = (self.seconds, self.full)
        self.seconds, self.full = 0.0, 0
        return out


def freeze_warmup() -> None:
    """Collect once, then exempt every surviving object from later collections (undone by `thaw`)."""
    gc.collect()
    gc.freeze()


def thaw() -> None:
    """Give the frozen objects back to the collector (a process may train again, or do something else)."""
    gc.unfreeze()
