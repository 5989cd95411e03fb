"""Host arrays to the device without a host sync.

Why: ``torch.tensor(array, device="cuda")`` copies from pageable memory and then waits for the stream, so
the host cannot queue a pack's work while the GPU still runs the previous pack's: each per-pack array is a
point where the GPU drains and idles until the host has launched again. A copy from pinned memory with
``non_blocking=True`` is queued like a kernel (torch's pinned-memory cache keeps the staging buffer until the
copy has run). Off CUDA it is a plain copy.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


def to_device(array: np.ndarray, device: torch.device | str, dtype: torch.dtype | None = None) -> Tensor:
    """A copy of ``array`` on ``device`` (as ``dtype``), queued without a host sync on CUDA."""
    device = torch.device(device)
    array = np.ascontiguousarray(array)
    if not array.flags.writeable:  # shard readers hand out read-only Arrow-backed arrays: torch must not alias them
        array = array.copy()
    host = torch.from_numpy(array)
    if dtype is not None and host.dtype != dtype:
        host = host.to(dtype)
    if device.type != "cuda":
        return host.to(device, copy=True)
    return host.pin_memory().to(device, non_blocking=True)
