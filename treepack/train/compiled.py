"""``torch.compile`` for the elementwise work between the matmuls and the attention kernel.

Why: in eager mode every RMSNorm, RoPE, SwiGLU, residual add, autocast copy and loss softmax is its own
kernel reading and writing whole [T, D] (or [rows, V]) tensors in float32; on an H200 that was half the GPU
time of a Qwen3-0.6B training step, three times the matmuls (benchmarks/results/2026-11-21-train-step-h200.md).
Inductor fuses each region into a few kernels and saves fewer intermediates for backward.

What is compiled: pure functions of tensors (the layer math in `model`, the loss chunks in `losses`), never
modules, so one compilation serves every layer. A function declares which arguments change length from call
to call (`varying`: the token dimension of hidden states, RoPE tables, a DFS call's cached prefix); only those
dimensions are compiled as symbols, so every pack and DFS chunk length runs one graph, and the weights' sizes
(hidden, heads, FFN) stay constants the kernels are specialised for. Compiled with every dimension symbolic
(``dynamic=True``, before), Dynamo guarded on relations between sizes (a stride equal to heads x head size)
and recompiled on steps that met new shapes: the step lines' "slow steps after start". With the Triton tree kernel the whole layer is one function, the
kernel an opaque custom op inside it (`model.layer_with_tree_kernel`): one compiled call per layer instead
of two plus an eager op, which is what a DFS walk of many small model calls pays for in host time. Other
attention backends run between two compiled regions. The eager and compiled paths run the same function: CPU and float64 (the equivalence
tests) stay eager; CUDA uses the compiled one unless the config says ``compile = "off"``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import warnings
from collections.abc import Callable

import torch

_compiled: dict[tuple[Callable, bool], Callable] = {}

MARK_VARYING = True  # False: declared functions compile with every dimension symbolic, as before (A/B runs)


def varying(*names: str, signature_of: Callable | None = None) -> Callable[[Callable], Callable]:
    """Declare the arguments of a compiled function whose first dimension changes between calls (tokens,
    rows, cached prefix); a tuple of tensors (a kernel's block schedule) changes in every dimension.
    ``signature_of``: the function whose parameter list locates the names (for a wrapper taking ``*args``)."""

    def declare(fn: Callable) -> Callable:
        params = list(inspect.signature(signature_of or fn).parameters)
        missing = [n for n in names if n not in params]
        if missing:
            raise TypeError(f"{fn.__name__} has no argument {missing[0]!r}")
        fn.__varying__ = tuple(params.index(n) for n in names)
        return fn

    return declare


def _mark_varying(positions: tuple[int, ...], args: tuple) -> None:
    """Mark the declared dimensions dynamic for this call (sizes 0 and 1 stay specialised, as Dynamo does
    anyway; marking them would be refused)."""
    from torch._dynamo import maybe_mark_dynamic

    for i in positions:
        if i >= len(args):
            continue
        group = isinstance(args[i], tuple | list)
        for t in args[i] if group else (args[i],):
            if isinstance(t, torch.Tensor):
                for d in range(t.dim() if group else min(t.dim(), 1)):
                    if t.shape[d] >= 2:
                        maybe_mark_dynamic(t, d)


def _compile_errors() -> tuple[type[BaseException], ...]:
    """Errors that mean "this function could not be compiled here" (not a failure of the computation)."""
    from torch._dynamo import exc

    return exc.BackendCompilerFailed, exc.Unsupported, exc.InternalTorchDynamoError


def _recompile_limit_errors() -> tuple[type[BaseException], ...]:
    from torch._dynamo import exc

    return (exc.FailOnRecompileLimitHit,) if hasattr(exc, "FailOnRecompileLimitHit") else ()


@functools.cache
def inductor_options() -> dict[str, object]:
    """Inductor settings for every compiled region.

    ``triton.mix_order_reduction_non_strict_mode``: Inductor fuses a norm's backward (per-row reduction for the
    input's gradient, per-column one for the weight's) into one kernel only from 5 x 2^20 elements and twice as
    many rows as columns, and it decides that on the token count at compile time as a guard: for Qwen3-0.6B's
    1024 columns, ``T >= 5120``. A later call on fewer tokens (a dense micro-batch, the last pack, a DFS chunk)
    failed the guard and compiled the region again mid-run (tau-bench dense-leaf step 5, 2 graphs,
    results/2026-11-28-modes-h200.md). The non-strict mode skips those two size checks, so the fusion never
    depends on the token count: no mode compiled after step 1 on five workloads (results/2026-11-29-modes-h200.md).
    Absent from a torch without the option."""
    import torch._inductor.config as inductor_config

    triton = getattr(inductor_config, "triton", None)
    if triton is not None and hasattr(triton, "mix_order_reduction_non_strict_mode"):
        return {"triton.mix_order_reduction_non_strict_mode": True}
    return {}


def compiled(fn: Callable, dynamic: bool = True) -> Callable:
    """The compiled twin of ``fn`` (built once per ``dynamic``, shared by every caller).

    ``dynamic=False`` compiles one graph per input shape: for a function its callers feed a few fixed
    shapes, so each shape gets the kernel configuration Inductor tunes for it (a dynamic graph keeps the
    one tuned at its first launch, whatever the shapes after).

    Compilation happens at the first call of each new input signature, before anything is computed;
    if it fails there (no working compiler toolchain, an unsupported torch/triton pair), ``fn`` runs
    eagerly from then on, with one warning, instead of the training run stopping: same results, slower."""
    out = _compiled.get((fn, dynamic))
    if out is None:
        positions = getattr(fn, "__varying__", None) if dynamic and MARK_VARYING else None
        fast = torch.compile(fn, dynamic=None if positions is not None else dynamic, fullgraph=True,
                             options=dict(inductor_options()) or None)
        broken: list[BaseException] = []
        over_limit: list[BaseException] = []

        @functools.wraps(fn)
        def out(*args, **kwargs):
            if broken:
                return fn(*args, **kwargs)
            try:
                if positions:
                    _mark_varying(positions, args)
                return fast(*args, **kwargs)
            except _recompile_limit_errors() as error:
                # One more input variant than Dynamo keeps compiled graphs for: this call runs eagerly,
                # the variants already compiled stay compiled.
                if not over_limit:
                    over_limit.append(error)
                    warnings.warn(f"torch.compile: {fn.__name__} has more input variants than "
                                  "torch._dynamo.config.recompile_limit; running the others eagerly",
                                  RuntimeWarning, stacklevel=2)
                return fn(*args, **kwargs)
            except _compile_errors() as error:
                broken.append(error)
                first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
                warnings.warn(
                    f"torch.compile failed for {fn.__name__} ({first_line}); running it eagerly "
                    "(set train.compile = \"off\" to skip compiling)",
                    RuntimeWarning,
                    stacklevel=2,
                )
                return fn(*args, **kwargs)

        _compiled[(fn, dynamic)] = out
    return out


WEIGH_KERNEL_OPS = True  # False: custom kernel ops count as free to recompute (torch's default; for A/B runs)


def activation_memory_budget(budget: float) -> contextlib.AbstractContextManager:
    """Compile under this activation memory budget (torch's min-cut partitioner: the share of the saved
    activations a compiled forward keeps for its backward; below 1 it recomputes cheap ops instead).

    Why: a DFS call's graph is most of its memory (~10 GiB of 16.6 for an 8k-token Qwen3-0.6B call); at 0.7 a
    tau-bench step took 13.1 GiB instead of 16.6, 1.15x the time (H200, results/2026-11-21-dfs-matched-h200.md).
    The budget is read when a graph is compiled, the first call of each input signature; graphs already
    compiled in the process keep the budget they were compiled under.

    The tree-attention ops are weighed by their FLOP formulas (``kernels/tree_attention/ops.py``; functorch's
    ``is_non_builtin_to_include``): as custom ops they would otherwise count as free to recompute, and the
    partitioner re-ran the attention forward in backward, ~11% of a dfs step's kernel time at 0.7
    (results/2026-11-25-dfs-memory-h200.md). Weighed, a tau-bench dfs step at 0.7 took 1.04 s instead of
    1.15-1.18 s at 12.66 GiB instead of 11.87 (1x H100, results/2026-11-26-dfs-host-h100.md)."""
    if budget >= 1.0:
        return contextlib.nullcontext()
    import torch._functorch.config as functorch_config

    return functorch_config.patch(activation_memory_budget=budget, is_non_builtin_to_include=WEIGH_KERNEL_OPS)


def use_compiled(mode: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``mode`` (auto | on | off) compiles on this device and dtype: auto = CUDA, 16/32-bit."""
    if mode == "off":
        return False
    if mode == "on":
        return True
    return device.type == "cuda" and dtype != torch.float64


def pick(fn: Callable, enabled: bool, dynamic: bool = True) -> Callable:
    return compiled(fn, dynamic) if enabled else fn
