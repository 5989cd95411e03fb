"""FSDP2 for treepack's decoder: sharding, mixed precision, and one step of gradient accumulation over
ranks that do different work.

Sharding: runs of consecutive decoder layers are ``fully_shard`` units of at most `UNIT_BYTES` of float32
gradients each (a layer alone when it is larger), the root (embeddings, final norm, head) another;
parameters, gradients and AdamW state live sharded between steps (1/N of each per rank). A step gathers and
reduce-scatters every unit once (below), so units buy no overlap here, and each costs host time: ~1 ms to
gather and ~1 ms to reduce-scatter on an H100 host, 29 units for Qwen3-0.6B with one per layer, 3 at
`UNIT_BYTES`. The bound keeps the reduce-scatter's float32 input buffer, one per unit, small.

Precision: parameters are gathered in their own dtype (float32 under bf16 training) and a bf16 run computes
under autocast, as one process does: the residual stream, the norms and the embedding stay float32, and
gradients reduce in float32. So N ranks compute what one process computes (on 2 H100s the same step-1 loss,
and 15x closer to the one-process run over 30 steps than FSDP2's bf16 ``MixedPrecisionPolicy``, which casts
every parameter and runs without autocast: benchmarks/results/2026-11-27-distributed-units-2xh100.md). The
price: the gather moves float32, twice a bf16 gather's bytes, once a step, and autocast casts the matrices to
bf16 once per model call.

The accumulation protocol (`Accumulation`). Ranks run different numbers of packs, and a pack makes a
data-dependent number of model calls (dfs: one per segment, each with its own backward), so FSDP's usual
per-call all-gather/reduce-scatter would need every rank to make the same calls in the same order: it
would deadlock. Instead, at the start of a step every rank all-gathers every unit once (the same
collectives in the same order everywhere), keeps the parameters gathered (``reshard_after_forward`` and
``reshard_after_backward`` off) with gradient sync off, runs its packs with no collective at all, and then
runs one tiny *sync* pass with gradient sync on: the embedding of one token through the root module alone
(`Decoder.embeddings`, registered as an FSDP forward method), with a zero loss. Its backward ends in FSDP's
root callback, which runs the post-backward of every unit the pass did not reach, so each unit
reduce-scatters the gradients accumulated over the step (summed over ranks, ``divide factor 1``; in
float32 under bf16) while every rank waits for the slowest (that wait is the idle time the trainer
reports). A sync pass through the whole decoder cost ~0.2 s of host time a step (28 layers' hooks, compiled
regions and kernels for one token) on an H100 host; the root alone costs the reduce-scatters
(benchmarks/results/2026-11-27-distributed-sync-2xh100.md).

Memory within a step is thus that of DDP/ZeRO-2 for parameters and gradients (gathered: 4 + 4 bytes per
parameter) with the parameters' shards and AdamW state sharded (12 bytes per parameter over N); a 1.7B model holds ~14 GB
gathered, as one process does.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn

from treepack.train.distributed import sum_gradients
from treepack.train.model import Decoder

# A decoder layer returns its keys/values (views of the projections) for dfs's path cache; nothing writes
# to them in place, which is what FSDP2's warning about view outputs is about.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPDecoderLayer(, FSDPDecoderLayer)*\) returned a view tensor")


def fsdp_modules(model: nn.Module) -> list[nn.Module]:
    """One ``fully_shard``-ed module per FSDP unit of ``model`` (a unit's first module), in a fixed order (the
    same on every rank): the units `shard_model` made, else every FSDP module."""
    from torch.distributed.fsdp import FSDPModule

    units = getattr(model, "fsdp_units", None)
    return list(units) if units else [m for m in model.modules() if isinstance(m, FSDPModule)]


UNIT_BYTES = 1 << 30  # float32 gradient bytes per FSDP unit of layers (its reduce-scatter's input buffer)


def layer_units(layers: list[nn.Module], unit_bytes: int | None = None) -> list[list[nn.Module]]:
    """Consecutive layers grouped into units of at most ``unit_bytes`` (default `UNIT_BYTES`) of float32
    parameters (a larger layer alone)."""
    unit_bytes = UNIT_BYTES if unit_bytes is None else unit_bytes
    units: list[list[nn.Module]] = []
    size = 0
    for layer in layers:
        n = 4 * sum(p.numel() for p in layer.parameters())
        if units and size + n <= unit_bytes:
            units[-1].append(layer)
            size += n
        else:
            units.append([layer])
            size = n
    return units


def shard_model(model: Decoder, mesh) -> Decoder:
    """``fully_shard`` the decoder's units of layers (`layer_units`) and the root over ``mesh`` (in place;
    returns the model), parameters gathered in their own dtype (bf16 compute is the caller's autocast)."""
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    units = layer_units(list(model.model.layers))
    for unit in units:
        fully_shard(unit if len(unit) > 1 else unit[0], mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    model.fsdp_units = [unit[0] for unit in units] + [model]
    register_fsdp_forward_method(model, "embeddings")  # the sync pass (`Accumulation.finish`)
    sum_gradients(model)
    for m in fsdp_modules(model):
        if hasattr(m, "set_reduce_scatter_unused_params"):  # torch >= 2.12: zero grads where a rank had none
            m.set_reduce_scatter_unused_params(True, recurse=False)
        if mesh.device_type == "cpu":  # gloo has no PREMUL_SUM, which FSDP picks for float32 / bf16 grads
            m.set_force_sum_reduction_for_comms(True)
    return model


class Accumulation:
    """One optimizer step: `begin` (gather once, sync off), the rank's packs, `finish` (reduce-scatter)."""

    def __init__(self, model: Decoder) -> None:
        self.model = model
        self.modules = fsdp_modules(model)

    def begin(self) -> None:
        if not self.modules:  # not sharded (one rank): a plain accumulation
            return
        model = self.model
        model.set_requires_gradient_sync(False)
        model.set_reshard_after_backward(False)
        handles = [m.unshard(async_op=True) for m in self.modules]
        for h in handles:
            if h is not None:
                h.wait()

    def finish(self) -> None:
        """The sync pass (the root module alone): reduce-scatter the step's gradients, then free the gathered
        parameters."""
        if not self.modules:
            return
        model = self.model
        model.set_requires_gradient_sync(True)
        ids = torch.zeros(1, dtype=torch.long, device=model.device)
        (model.embeddings(ids).sum() * 0).backward()  # FSDP's root callback reduce-scatters every unit
        for m in self.modules:
            m.reshard()


def grad_norm(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """The global gradient norm (over every rank's shards, a 0-d tensor on the gradients' device: reading it
    is the caller's host sync), clipping to ``max_norm`` when it is > 0.

    FSDP2 shards every gradient by rows over one mesh: the norm is the square root of the ranks' summed
    squared norms of their local shards, one all-reduce of one number. torch's ``clip_grad_norm_`` computes
    the same through DTensor dispatch of each multi-tensor op (13-16 ms of host time a step on an H100
    host against ~2 ms here); it stays the path for anything else (plain tensors, other placements)."""
    from torch.distributed.tensor import DTensor, Shard

    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    sharded = all(isinstance(g, DTensor) and g.device_mesh.ndim == 1 and g.placements == (Shard(0),) for g in grads)
    if not sharded:
        if max_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        else:
            norm = torch.nn.utils.get_total_norm(grads)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm
    local = [g.to_local() for g in grads]
    squared = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(local))) ** 2
    dist.all_reduce(squared, group=grads[0].device_mesh.get_group())
    norm = squared.sqrt()
    if max_norm > 0:  # as clip_grad_norm_: scale by max_norm / (norm + 1e-6) when that is below 1
        torch._foreach_mul_(local, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return norm
