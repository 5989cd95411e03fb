"""``train.memory_limit``: the most GPU memory a run may take.

A trainer often shares its GPU: a colocated rollout engine keeps its weights (and, asleep or not, part of its KV
cache) beside it, or two jobs share one card. Under a limit
- torch's caching allocator is capped at it (``torch.cuda.set_per_process_memory_fraction``), so a run that needs
  more stops with an out-of-memory error at the limit instead of taking its neighbour's memory;
- dfs's auto block (`treepack.train.modes.dfs_memory`) plans its calls inside it, so dfs, whose memory follows
  its block, runs in the memory it is given;
- a limit that cannot hold the run's weights, gradients and optimizer state is refused before step 1.

A limit is written as ``"40GB"`` / ``"40GiB"`` (also MB, MiB, TB, TiB) or ``"50%"`` of the GPU's total memory.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from treepack.errors import ConfigError

_UNITS = {"mb": 10**6, "mib": 2**20, "gb": 10**9, "gib": 2**30, "tb": 10**12, "tib": 2**40, "%": None}
_LIMIT_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(mb|mib|gb|gib|tb|tib|%)\s*$", re.IGNORECASE)
_APPLIED: dict[int, int] = {}  # CUDA device index -> the limit in bytes (the allocator's cap is per process too)


@dataclass(frozen=True)
class MemoryLimit:
    """A limit as written: ``amount`` bytes, or ``amount`` percent of the GPU's total when ``percent``."""

    amount: float
    percent: bool = False

    def bytes_of(self, total: int) -> int:
        return int(total * self.amount / 100) if self.percent else int(self.amount)


def parse_memory_limit(text: str, what: str = "train.memory_limit") -> MemoryLimit | None:
    """``"40GB"``, ``"37.5GiB"``, ``"50%"`` -> a limit; ``""`` -> none."""
    if not str(text).strip():
        return None
    m = _LIMIT_RE.match(str(text))
    if not m:
        raise ConfigError(f'{what} must be a size such as "40GB" or "40GiB", or a share of the GPU such as "50%" '
                          f'("" for no limit), got {text!r}')
    number, unit = float(m.group(1)), m.group(2).lower()
    if unit == "%":
        if not 0 < number <= 100:
            raise ConfigError(f"{what} must be a share in (0%, 100%], got {text!r}")
        return MemoryLimit(number, percent=True)
    if number <= 0:
        raise ConfigError(f"{what} must be positive, got {text!r}")
    return MemoryLimit(number * _UNITS[unit])


def state_bytes(model: torch.nn.Module, compute_dtype: torch.dtype) -> int:
    """This process's weights, gradients and AdamW's two moments (4x the parameters' bytes; a sharded
    parameter counts its local shard), plus 16-bit working copies of the matrices under 16-bit autocast."""
    params = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    total = 4 * sum(p.numel() * p.element_size() for p in params)
    if torch.finfo(compute_dtype).bits < torch.finfo(model.dtype).bits:
        total += sum(p.numel() for p in params if p.dim() >= 2) * (torch.finfo(compute_dtype).bits // 8)
    return total


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def applied_limit(device: torch.device) -> int | None:
    """The limit set on ``device`` by `apply_memory_limit` (bytes), if any."""
    return _APPLIED.get(_index(device)) if device.type == "cuda" else None


def apply_memory_limit(limit: MemoryLimit | None, model: torch.nn.Module, device: torch.device,
                       compute_dtype: torch.dtype) -> str | None:
    """Cap this process's allocator on ``device`` at ``limit``; the start line saying so (None without a limit).
    Refuses a limit above the GPU's memory or below the run's state (`state_bytes`). Without a limit, one an
    earlier run of this process set is lifted."""
    if device.type != "cuda":
        return None if limit is None else f"train.memory_limit applies to CUDA GPUs: ignored on {device.type}"
    index = _index(device)
    if limit is None:
        if _APPLIED.pop(index, None) is not None:
            torch.cuda.set_per_process_memory_fraction(1.0, index)
        return None
    total = torch.cuda.get_device_properties(index).total_memory
    cap = limit.bytes_of(total)
    if cap > total:
        raise ConfigError(f"train.memory_limit ({cap / 1e9:.1f} GB) is more than this GPU has ({total / 1e9:.1f} GB)")
    state = state_bytes(model, compute_dtype)
    if state >= cap:
        raise ConfigError(f"train.memory_limit ({cap / 1e9:.1f} GB) cannot hold the model's weights, gradients and "
                          f"AdamW state ({state / 1e9:.1f} GB)")
    torch.cuda.set_per_process_memory_fraction(cap / total, index)
    _APPLIED[index] = cap
    return (f"memory: this run may take {cap / 1e9:.1f} of the GPU's {total / 1e9:.1f} GB (train.memory_limit), "
            f"{state / 1e9:.1f} GB of it for weights, gradients and optimizer state; beyond it the run stops")


_TRIED_RE = re.compile(r"Tried to allocate ([\d.]+ [KMGT]?i?B)")

# what lowers each mode's peak, most effective first (README "Memory")
_REMEDIES = {
    "tree": 'lower data.capacity (a pack is the memory bound), use mode = "dfs" (its calls follow the memory), or '
            "turn on train.activation_checkpointing",
    "auto": 'lower data.capacity (a pack is the memory bound), use mode = "dfs" (its calls follow the memory), or '
            "turn on train.activation_checkpointing",
    "dense": "lower train.micro_batch_tokens, or turn on train.activation_checkpointing",
    "dense-leaf": "lower train.micro_batch_tokens, or turn on train.activation_checkpointing",
    "dfs": 'set train.dfs_block_size = "auto" or a smaller block, lower train.logits_chunk, or turn on '
           "train.activation_checkpointing",
}


def out_of_memory_message(exc: BaseException, mode: str, limit: MemoryLimit | None) -> str:
    """One line for a CUDA out-of-memory error in a run: how much was asked for, the limit if one was set, and
    what lowers this mode's peak."""
    tried = _TRIED_RE.search(str(exc))
    what = f" (tried to allocate {tried.group(1)})" if tried else ""
    capped = list(_APPLIED.values())
    where = f" within train.memory_limit ({capped[0] / 1e9:.1f} GB)" if limit is not None and capped else ""
    return f"out of GPU memory{what}{where}: {_REMEDIES.get(mode, _REMEDIES['tree'])}"
