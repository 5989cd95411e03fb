"""Data-parallel training: ``torchrun --nproc-per-node N -m treepack train config.toml`` (or ``treepack train
--nproc N``): the process group, and the one training loop run on it.

`train_distributed` runs `treepack.train.loop.train` (the same config, batches, losses, optimizer, start-up,
resume and step line as one process) with the `treepack.train.sync.DataParallel` gradient sync: every rank
builds the same global batch of step s, takes its share (`distributed.shard_batch`: the sharing-aware balance,
normalisers over the whole batch), accumulates its gradients with no collective (`fsdp.Accumulation`), and one
reduce-scatter per step sums them; AdamW then updates each rank's shard. The update is the single-process one up
to the order of float sums (float64: ~1e-15 relative), whatever N. Only rank 0 prints; its step line adds
``dp N | imbalance P% pred / M% meas | idle I%`` (`treepack.train.sync` says what each figure is).

Process group: NCCL on CUDA (one GPU per local rank), gloo on CPU (the tests: float64, any N on one host).
`launch` is ``treepack train --nproc N``: torchrun on this host.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable

import torch
import torch.distributed as dist

from treepack.errors import ConfigError, TreepackError
from treepack.pack.layout import Pack
from treepack.train.config import RunConfig
from treepack.train.loop import TrainResult, train
from treepack.train.sync import DataParallel


class ProcessGroup:
    """The default process group (initialised here from torchrun's environment unless it already is),
    its device (one GPU per local rank on CUDA) and a 1-D device mesh over every rank."""

    def __init__(self, device: str) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
        if use_cuda:
            if not torch.cuda.is_available():
                raise ConfigError("train.device = 'cuda' but CUDA is not available")
            if local_rank >= torch.cuda.device_count():
                raise ConfigError(f"local rank {local_rank} has no GPU of its own ({torch.cuda.device_count()} "
                                  "visible): run at most one process per GPU")
            torch.cuda.set_device(local_rank)
            self.device = torch.device("cuda", local_rank)
        else:
            self.device = torch.device("cpu")
        self.owned = not dist.is_initialized()
        if self.owned:
            dist.init_process_group("nccl" if use_cuda else "gloo", device_id=self.device if use_cuda else None)
        self.backend = dist.get_backend()
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.mesh = init_device_mesh(self.device.type, (self.world_size,))

    def close(self, *, ok: bool = True) -> None:
        """Free FSDP's state while the interpreter is alive (its gloo work objects otherwise race the
        teardown and can abort a successful run), then leave the group if we made it. After a failure no
        barrier: the other ranks may be stuck in a collective, and torchrun stops them when this one exits."""
        gc.collect()
        if self.owned and dist.is_initialized():
            if ok:
                dist.barrier()
            dist.destroy_process_group()


def train_distributed(cfg: RunConfig, *, packs: list[Pack] | None = None,
                      log: Callable[[str], None] = print) -> TrainResult:
    """Run (or resume) the configured training on every rank of torchrun's world; only rank 0 logs."""
    group = ProcessGroup(cfg.train.device)
    try:
        result = train(cfg, packs=packs, log=log if group.rank == 0 else (lambda line: None),
                       sync=DataParallel(group, cfg.train.mode, balance=cfg.train.balance))
    except BaseException:
        group.close(ok=False)
        raise
    group.close()
    return result


def launch(nproc: int, args: list[str]) -> int:
    """``treepack train --nproc N ARGS``: torchrun on this host (standalone rendezvous on a free port) running
    ``python -m treepack ARGS`` on N ranks. Returns the exit code: 1 when the ranks failed with their own
    ``Error:`` line (rank 0 prints it), a `TreepackError` naming the rank when one died otherwise."""
    import logging

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    for name in ("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(logging.CRITICAL)  # its failure report repeats the ranks' errors
    try:
        run(parse_args(["--standalone", f"--nproc-per-node={nproc}", "--module", "treepack", *args]))
    except ChildFailedError as exc:
        codes = {int(r): f.exitcode for r, f in exc.failures.items()}
        if 1 in codes.values():  # a rank failed with its Error line; torchrun then stopped the others
            return 1
        rank, code = min(codes.items())
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        raise TreepackError(f"rank {rank} of {nproc} {how}") from None
    return 0
