"""The order in which FA4's Hopper forward runs a tree pack's query blocks: FA4's own, or longest first.

Why: FA4 gives a forward with a ``mask_mod`` (our tree mask) its plain tile scheduler, one CTA per (query
block, head) in launch order: query block 0, 1, ... of head 0, then head 1, and so on. In a pack laid out in
DFS order a query block sees more keys the later it lies (causal-like), so the last heads' last blocks, the
longest tiles of the call, start last and the SMs wait on them. FA4's causal forward avoids that tail with its
LPT scheduler (longest-processing-time first: query blocks in reverse, heads grouped so that their keys stay
in L2), but ``mask_mod`` turns ``causal`` off and with it that scheduler.

How: `fa4_forward_order` swaps the plain scheduler of FA4's sm90 forward module for the LPT one (``lpt`` set)
while our forward runs; FA4 reads it when it compiles a kernel, and a compiled kernel keeps its own. Only
the tree kernel's forward is built this way (every other FA4 call in the process keeps FA4's choice), and
its mask_mod carries the order in its hash (FA4's compile caches do not key on the scheduler). The schedule
changes which CTA computes a tile when, not what a tile computes (the benchmark's errors against the Triton
kernel were the same in both orders).

Measured (1x H200, first 32K pack of each source, FA4 forward of the tree kernel, one process per order;
benchmarks/results/2026-11-29-modes-h200.md): 1.117 -> 1.054 ms on tau2 (two long leaves: the tail it
removes), level on tau-bench (1.520 / 1.517) and ToolBench (0.860 / 0.856), and slower on the packs of many
short groups, GSM8K 0.480 -> 0.507 and hh-rlhf 0.463 -> 0.483, whose query blocks carry about equal work. So
FA4's own order stays the default, and ``TREEPACK_FA4_FWD_ORDER=lpt`` turns this on for a run; choosing per
pack from the forward's block lists (as `fa4.bwd_order` does for the backward) is not built.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import warnings

__all__ = ["FA4_FWD_ORDER", "fa4_forward_order", "longest_first_unavailable"]

FA4_FWD_ORDER = os.environ.get("TREEPACK_FA4_FWD_ORDER", "fa4").strip().lower() or "fa4"
if FA4_FWD_ORDER not in ("lpt", "fa4"):
    warnings.warn(f"TREEPACK_FA4_FWD_ORDER={FA4_FWD_ORDER!r} is not lpt or fa4: using fa4", RuntimeWarning,
                  stacklevel=1)
    FA4_FWD_ORDER = "fa4"


@functools.cache
def longest_first_unavailable() -> str:
    """Why this flash-attn-4 cannot take the longest-first forward order ("" when it can)."""
    from flash_attn.cute import flash_fwd_sm90
    from flash_attn.cute import tile_scheduler as schedulers

    names = ("SingleTileScheduler", "SingleTileLPTScheduler", "TileSchedulerArguments")
    if any(getattr(schedulers, n, None) is None for n in names):
        return "flash-attn-4's tile_scheduler lacks one of " + ", ".join(names)
    if getattr(flash_fwd_sm90, "SingleTileScheduler", None) is not schedulers.SingleTileScheduler:
        return "flash-attn-4's sm90 forward does not take SingleTileScheduler from tile_scheduler"
    if "lpt" not in {f.name for f in dataclasses.fields(schedulers.TileSchedulerArguments)}:
        return "flash-attn-4's TileSchedulerArguments has no lpt field"
    return ""


@functools.cache
def _longest_first():
    from flash_attn.cute.tile_scheduler import SingleTileLPTScheduler

    class LongestFirst(SingleTileLPTScheduler):
        """FA4's LPT scheduler with ``lpt`` forced on, where the forward would take the plain one."""

        @staticmethod
        def to_underlying_arguments(args, **kwargs):
            return SingleTileLPTScheduler.to_underlying_arguments(dataclasses.replace(args, lpt=True), **kwargs)

    return LongestFirst


@contextlib.contextmanager
def fa4_forward_order(order: str):
    """FA4's sm90 forward built with ``order``'s scheduler (lpt | fa4) while this is open."""
    if order == "fa4" or longest_first_unavailable():
        yield
        return
    import flash_attn.cute.flash_fwd_sm90 as sm90

    library = sm90.SingleTileScheduler
    sm90.SingleTileScheduler = _longest_first()
    try:
        yield
    finally:
        sm90.SingleTileScheduler = library
