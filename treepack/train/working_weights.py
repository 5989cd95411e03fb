"""Working weights: 16-bit copies of the decoder's matrix weights, made once an optimizer step, whose gradients
each model call adds straight into the float32 ``.grad``.

Why: under autocast every model call casts each float32 matrix weight to bf16 in its forward, casts the bf16
weight gradient back to float32 in its backward, and autograd then adds that float32 gradient into ``.grad``:
~26 bytes moved per parameter a call. A tree step makes one call per pack; a dfs step one per block of its walk
(6-10 for 144 tau-bench records at 8K blocks), and those casts and adds were ~25 ms of the ~55 ms a dfs step
spent above tree mode's on an H100 (benchmarks/results/2026-11-27-dfs-pack-uploads-h100.md). With the copies,
the weight is cast once a step, and a call's bf16 weight gradient is added into ``.grad`` by a hook on its
copy: ~12 bytes a parameter a call.

Exactness: the copy holds ``weight.to(bf16)``, the value autocast's cast gives, so the forward is unchanged,
and the hook adds the same bf16 gradient the cast-back would have turned into float32: ``.grad`` gets the
same sums, bit for bit (tests/test_working_weights.py).

Memory: 2 bytes per matrix parameter (0.88 GB for Qwen3-0.6B). A dfs run at the default activation budget
peaked no higher (31.1 GB against 31.3 without), as the per-call casts they replace took as much while a call's
graph was alive; under a low ``activation_memory_budget`` the compiled layers may have recomputed those casts
instead, and the copies would then add to the peak (not measured).

Scope: plain (unsharded) float32 parameters under a 16-bit autocast, the seven matrix weights of each layer.
The embedding and the head (tied or not) keep their float32 weight: the head's log-prob kernels accumulate its
gradient in float32 already. `train` makes the copies when its precision allows (`applies`) and refreshes them
after every optimizer step; ``ENABLED = False`` turns them off (the A/B of the benchmarks).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

ENABLED = True
MATRICES = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"), ("self_attn", "o_proj"),
            ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))


def applies(model: nn.Module, autocast_dtype: torch.dtype | None) -> bool:
    """Whether ``model`` can train through working weights: a treepack decoder with plain float32 parameters
    under a 16-bit autocast."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not ENABLED or autocast_dtype not in (torch.bfloat16, torch.float16) or layers is None:
        return False
    params = list(model.parameters())
    return bool(params) and all(type(p) is nn.Parameter and p.dtype == torch.float32 for p in params) and all(
        hasattr(layer, "working") for layer in layers)


class WorkingWeights:
    """The copies of one model. Each layer's ``working`` maps a projection's name to its copy, which the layer
    uses instead of the parameter; `refresh` writes the parameters' new values into the same buffers (CUDA
    graphs captured over them stay valid)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        self.model = model
        self.pairs: list[tuple[nn.Parameter, Tensor]] = []
        for layer in model.model.layers:
            copies = {}
            for block, name in MATRICES:
                param = getattr(getattr(layer, block), name).weight
                copy = param.detach().to(dtype).requires_grad_()
                copy.register_post_accumulate_grad_hook(_add_into(param))
                copies[name] = copy
                self.pairs.append((param, copy))
            layer.working = copies
        model.working_weights = self

    @property
    def params(self) -> set[int]:
        """ids of the parameters whose gradient the hooks write."""
        return {id(p) for p, _ in self.pairs}

    @property
    def copies(self) -> list[Tensor]:
        return [c for _, c in self.pairs]

    def refresh(self) -> None:
        """Copy the parameters' current values in (after an optimizer step, a checkpoint load)."""
        with torch.no_grad():
            torch._foreach_copy_(self.copies, [p for p, _ in self.pairs])

    def remove(self) -> None:
        for layer in self.model.model.layers:
            layer.working = None
        self.model.working_weights = None
        self.pairs = []


def _add_into(param: nn.Parameter):
    def hook(copy: Tensor) -> None:
        grad, copy.grad = copy.grad, None
        if param.grad is None:
            param.grad = grad.to(param.dtype)
        else:
            param.grad.add_(grad)

    return hook
