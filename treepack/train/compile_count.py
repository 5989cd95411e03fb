"""How many things this process has compiled so far: graphs (torch.compile), kernel variants (Triton, FA4).

Why: a step that meets a shape, dtype or alignment the process has not compiled for stops for the compiler
(seconds a graph, ~1 s a Triton variant, 5-15 s an FA4 kernel), and on several ranks the slowest rank's
compile sets everyone's step time. The step line shows ``compiled N`` for such a step (data-parallel: the
most any rank compiled, and metrics.jsonl has each rank's count), so a slow step says why it was slow.

Counted: Dynamo's compiled frames; the variants our Triton kernels hold (one per specialisation, one
autotuning result per key); FA4's in-memory compile caches. Each source is read through attributes those
libraries do not promise to keep: one that is missing counts 0, never an error.
"""

from __future__ import annotations

import sys


def _dynamo_graphs() -> int:
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # pragma: no cover - torch without Dynamo
        return 0
    return int(counters["stats"].get("unique_graphs", 0))


def _triton_variants(fn) -> int:
    """Compiled variants of one ``triton.jit`` function, or tuning results of a ``triton.autotune`` one."""
    cache = getattr(fn, "cache", None)  # an Autotuner: key -> best config (its trials are its kernel's variants)
    if isinstance(cache, dict):
        return len(cache)
    n = 0
    for caches in (getattr(fn, "device_caches", None) or {}).values():
        first = caches[0] if isinstance(caches, tuple) and caches else caches
        n += len(first) if isinstance(first, dict) else 0
    return n


_TRITON_MODULES = ("treepack.kernels.logprobs.triton", "treepack.kernels.norm_rope.triton",
                   "treepack.kernels.tree_attention.triton_kernels")


def _triton_kernels() -> int:
    n = 0
    for name in _TRITON_MODULES:
        module = sys.modules.get(name)
        for value in vars(module).values() if module is not None else ():
            if type(value).__name__ in ("JITFunction", "Autotuner"):
                n += _triton_variants(value)
    tuned = sys.modules.get("treepack.kernels.tree_attention.triton")
    for fn in (getattr(tuned, "_AUTOTUNED", None) or {}).values():
        n += _triton_variants(fn)
    return n


def _fa4_kernels() -> int:
    n = 0
    fa4 = sys.modules.get("flash_attn.cute.interface")
    for value in vars(fa4).values() if fa4 is not None else ():
        cache = getattr(getattr(value, "compile_cache", None), "cache", None)
        n += len(cache) if isinstance(cache, dict) else 0
    return n


KINDS = ("graphs", "triton", "fa4")


def compiled_by_kind() -> tuple[int, int, int]:
    """(graphs, Triton kernel variants, FA4 kernels) compiled in this process until now (`KINDS`)."""
    return _dynamo_graphs(), _triton_kernels(), _fa4_kernels()


def compiled_so_far() -> int:
    """Graphs and kernel variants compiled in this process until now (the difference over a step is what
    that step compiled)."""
    return sum(compiled_by_kind())
