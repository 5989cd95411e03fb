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

The embedding and the head. Their float32 weight (one tensor when tied: 155.6M values for Qwen3-0.6B) is
not cast per call either: the head's log-prob kernels read a 16-bit copy of it (`head_copy`), made with the
others. Their gradients skip autograd's accumulation: the head's backward accumulates each vocabulary block's
float32 GEMM into ``.grad`` in place (``addmm`` with a float32 output), and the embedding's backward adds its
rows into ``.grad`` (`embed`). Before, each call wrote a dense [V, D] float32 gradient for the head and
another for the embedding, summed them and added the sum into ``.grad``: ~5 GB a call for Qwen3-0.6B, plus
two casts of the weight (~1.9 GB). The sums hold the same terms, added in another order (rows the embedding
reads in a call get ``(g + head) + rows`` instead of ``g + (head + rows)``, and cuBLAS may pick another kernel
for an accumulating GEMM): equal up to float32 rounding, not bit for bit. The copy costs 2 bytes a value
(0.31 GB); the dense gradients it replaces were ~1.2 GB alive at a call's backward.

Scope: plain (unsharded) float32 parameters under a 16-bit autocast. `train` makes the copies when its
precision allows (`applies`) and refreshes them after every optimizer step; ``ENABLED = False`` turns them off
(the A/B of the benchmarks). Data-parallel training keeps FSDP2's own accumulation (no copies).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

ENABLED = True
HEAD_IN_PLACE = True  # False: the embedding and the head keep per-call casts and autograd's accumulation (A/B)
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
        embedding, head = model.model.embed_tokens.weight, model.head_weight
        # read by the head's log-prob kernels (no grad of its own); the parameters whose gradients go in place
        self.head: Tensor | None = head.detach().to(dtype) if HEAD_IN_PLACE else None
        self.in_place: list[nn.Parameter] = [] if not HEAD_IN_PLACE else (
            [embedding] if head is embedding else [embedding, head])
        model.working_weights = self

    @property
    def params(self) -> set[int]:
        """ids of the parameters whose gradient the hooks, the head or the embedding write (not autograd)."""
        return {id(p) for p, _ in self.pairs} | {id(p) for p in self.in_place}

    @property
    def copies(self) -> list[Tensor]:
        return [c for _, c in self.pairs]

    def refresh(self) -> None:
        """Copy the parameters' current values in (after an optimizer step, a checkpoint load)."""
        with torch.no_grad():
            torch._foreach_copy_(self.copies, [p for p, _ in self.pairs])
            if self.head is not None:
                self.head.copy_(self.model.head_weight)

    def remove(self) -> None:
        for layer in self.model.model.layers:
            layer.working = None
        self.model.working_weights = None
        self.pairs, self.in_place, self.head = [], [], None


def _add_into(param: nn.Parameter):
    def hook(copy: Tensor) -> None:
        grad, copy.grad = copy.grad, None
        if param.grad is None:
            param.grad = grad.to(param.dtype)
        else:
            param.grad.add_(grad)

    return hook


def head_copy(model: nn.Module) -> Tensor | None:
    """The 16-bit copy of ``model``'s head weight when it trains through working weights (else None): the
    log-prob kernels read it, and add the weight's gradient into its ``.grad`` in place."""
    working = getattr(model, "working_weights", None)
    return None if working is None else working.head


def embed(ids_T: Tensor, weight_VD: Tensor) -> Tensor:
    """``F.embedding(ids_T, weight_VD)`` whose backward adds the looked-up rows' gradients into
    ``weight_VD.grad`` in place (a dense [V, D] gradient only while ``.grad`` does not exist yet)."""
    return _EmbeddingIntoGrad.apply(ids_T, weight_VD)


class _EmbeddingIntoGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids_T: Tensor, weight_VD: Tensor) -> Tensor:
        ctx.save_for_backward(ids_T)
        ctx.weight = weight_VD  # the parameter itself, for its .grad at backward time
        return F.embedding(ids_T, weight_VD)

    @staticmethod
    def backward(ctx, grad_TD: Tensor):
        (ids_T,) = ctx.saved_tensors
        weight = ctx.weight
        into = weight.grad
        fresh = into is None
        if fresh:
            into = torch.zeros_like(weight)
        rows = grad_TD.reshape(-1, weight.shape[1]).to(into.dtype)
        if into.device.type == "cuda":  # sorted by index, then summed: deterministic, no atomics
            into.index_put_((ids_T.reshape(-1),), rows, accumulate=True)
        else:
            into.index_add_(0, ids_T.reshape(-1), rows)
        return None, into if fresh else None
