"""``train.memory_limit``: the most GPU memory a run's tensors may take.

A trainer often shares its GPU: a colocated rollout engine keeps its weights (and, asleep or not, part of its KV
cache) beside it, or two jobs share one card. Under a limit, for the run (`capped`; the earlier cap is restored
after it, so a notebook's next run is not held to it)
- torch's caching allocator is capped at it (``torch.cuda.set_per_process_memory_fraction``), so a run that needs
  more stops with an out-of-memory error at the limit instead of taking its neighbour's memory. What torch does
  not allocate comes on top: the CUDA context (~0.5 GB), NCCL's buffers. Under ``--nproc`` it is per rank (GPU).
  The cap is the process's: in a process that also hosts the engine, the engine's tensors count against it;
- dfs's auto block (`treepack.train.modes.dfs_memory`) plans its calls inside it, so dfs, whose memory follows
  its block, runs in the memory it is given;
- a limit that cannot hold the run's weights, gradients and optimizer state is refused before step 1.

A limit is written as ``"40GB"`` / ``"40GiB"`` (also MB, MiB, TB, TiB; in any case, ``"40gb"`` too) or ``"50%"``
of the GPU's total memory. A capital prefix before a lower-case ``b`` (``"40Gb"``, ``"512Mb"``) is the usual
way to write bits: it is refused with the byte forms to write instead.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from treepack.errors import ConfigError, TreepackError

_UNITS = {"mb": 10**6, "mib": 2**20, "gb": 10**9, "gib": 2**30, "tb": 10**12, "tib": 2**40, "%": None}
_LIMIT_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(mb|mib|gb|gib|tb|tib|%)\s*$", re.IGNORECASE | re.ASCII)
_APPLIED: dict[int, int] = {}  # CUDA device index -> the cap in bytes, while a run holds it (`capped`)


@dataclass(frozen=True)
class MemoryLimit:
    """A limit: ``amount`` bytes, or ``amount`` percent of the GPU's total when ``percent``; ``text`` as written."""

    amount: float
    percent: bool = False
    text: str = ""

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
    if m.group(2).endswith("b") and not m.group(2).islower():  # "40Gb": gigabits in common usage
        number, prefix = m.group(1), m.group(2)[0].upper()
        raise ConfigError(f'{what} must be in bytes, got {text!r} (a lower-case "b" is a bit): write '
                          f'"{number}{prefix}B" or "{number}{prefix}iB"')
    number, unit = float(m.group(1)), m.group(2).lower()
    if unit == "%":
        if not 0 < number <= 100:
            raise ConfigError(f"{what} must be a share in (0%, 100%], got {text!r}")
        return MemoryLimit(number, percent=True, text=str(text).strip())
    if number <= 0:
        raise ConfigError(f"{what} must be positive, got {text!r}")
    return MemoryLimit(number * _UNITS[unit], text=str(text).strip())


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
    """The cap a run holds on ``device`` (bytes), if any (`capped`)."""
    return _APPLIED.get(_index(device)) if device.type == "cuda" else None


class OutOfMemory(TreepackError, torch.OutOfMemoryError):
    """A CUDA out-of-memory error of a run, its message one line that says what lowers the mode's peak (still a
    ``torch.OutOfMemoryError`` for callers that catch that)."""


@contextlib.contextmanager
def capped(limit: MemoryLimit | None, device: torch.device, mode: str) -> Iterator[None]:
    """Hold ``limit`` on ``device`` for a run: the allocator capped there, and the earlier cap restored after;
    a CUDA out-of-memory error inside becomes `OutOfMemory`. Refuses a limit above the GPU's memory."""
    index = previous = None
    if limit is not None and device.type == "cuda":
        index = _index(device)
        total = torch.cuda.get_device_properties(index).total_memory
        cap = limit.bytes_of(total)
        if cap > total:
            raise ConfigError(f'train.memory_limit = "{limit.text}" is more than this GPU has ({total / 1e9:.1f} GB)')
        get = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        previous = get(index) if get is not None else 1.0
        torch.cuda.set_per_process_memory_fraction(cap / total, index)
        _APPLIED[index] = cap
    try:
        yield
    except torch.OutOfMemoryError as exc:
        if isinstance(exc, OutOfMemory):
            raise
        raise OutOfMemory(out_of_memory_message(exc, mode, device)) from None
    finally:
        if index is not None:
            _APPLIED.pop(index, None)
            torch.cuda.set_per_process_memory_fraction(previous, index)


def describe_memory_limit(limit: MemoryLimit | None, model: torch.nn.Module, device: torch.device,
                          compute_dtype: torch.dtype) -> str | None:
    """The start line of a run under ``limit`` (None without one); refuses a limit below the run's state
    (`state_bytes`), and says when less than the limit is free on the GPU now."""
    if limit is None:
        return None
    if device.type != "cuda":
        return f"train.memory_limit applies to CUDA GPUs: ignored on {device.type}"
    cap = applied_limit(device)
    total = torch.cuda.get_device_properties(_index(device)).total_memory
    state = state_bytes(model, compute_dtype)
    if state >= cap:
        raise ConfigError(f'train.memory_limit = "{limit.text}" ({cap / 1e9:.2f} GB) cannot hold the model\'s '
                          f"weights, gradients and AdamW state ({state / 1e9:.2f} GB)")
    free, _ = torch.cuda.mem_get_info(device)
    can = free + torch.cuda.memory_reserved(device)
    short = (f"; only {can / 1e9:.1f} GB of it is free now (other processes hold the rest)" if can < cap else "")
    return (f"memory: this run may take {cap / 1e9:.1f} of the GPU's {total / 1e9:.1f} GB (train.memory_limit), "
            f"{state / 1e9:.1f} GB of it for weights, gradients and optimizer state; beyond it the run stops{short}")


_TRIED_RE = re.compile(r"Tried to allocate ([\d.]+ [KMGT]?i?B)")

# what lowers each mode's peak, most effective first (README "Memory")
_REMEDIES = {
    "tree": 'lower data.capacity (a pack is the memory bound), use mode = "dfs" (its calls follow the memory), or '
            "turn on train.activation_checkpointing",
    "auto": 'lower data.capacity (a pack is the memory bound), use mode = "dfs" (its calls follow the memory), or '
            "turn on train.activation_checkpointing",
    "dense": "lower train.micro_batch_tokens, or turn on train.activation_checkpointing",
    "dense-leaf": "lower train.micro_batch_tokens, or turn on train.activation_checkpointing",
    "dfs": 'set train.dfs.block_size = "auto" or a smaller block, lower train.logits_chunk, or turn on '
           "train.activation_checkpointing",
}


def out_of_memory_message(exc: BaseException, mode: str, device: torch.device | None = None) -> str:
    """One line for a CUDA out-of-memory error in a run: how much was asked for, the run's limit when the error
    is at it (torch holds most of it) rather than at the GPU's free memory, and what lowers this mode's peak."""
    tried = _TRIED_RE.search(str(exc))
    what = f" (tried to allocate {tried.group(1)})" if tried else ""
    cap = applied_limit(device) if device is not None else None
    at_cap = cap is not None and torch.cuda.memory_reserved(device) >= 0.8 * cap
    where = f" within train.memory_limit ({cap / 1e9:.1f} GB)" if at_cap else ""
    return f"out of GPU memory{what}{where}: {_REMEDIES.get(mode, _REMEDIES['tree'])}"
