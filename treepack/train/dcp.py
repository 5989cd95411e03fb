"""Checkpoints of data-parallel runs: ``torch.distributed.checkpoint`` (DCP), resumable at any world size.

Layout of ``<output.dir>/checkpoint/`` after a data-parallel save:
- the DCP files (``.metadata`` + one ``__<rank>_0.distcp`` per rank): model and AdamW state as sharded
  tensors under their parameter names (`get_state_dict`), so a run of N ranks resumes on M ranks, or in
  one plain process, and DCP reshards on load;
- ``trainer.json``: ``"format": "dcp"``, the world size that wrote it, the step reached, the losses so far;
- at the end of a run, ``config.json`` + ``model.safetensors`` (the full model, gathered on rank 0): the
  same Hugging Face checkpoint a single-process run leaves, loadable by `Decoder.from_pretrained`.
A save writes ``checkpoint.tmp/`` and rank 0 renames it over ``checkpoint/`` once every rank has written
its shard, so a run killed mid-save keeps the previous checkpoint. A data-parallel run also resumes from a
single-process checkpoint (safetensors: every rank reads the full tensors and keeps its shard), and a
single-process run from a DCP checkpoint (`checkpoint.load_checkpoint`): the format never ties a run
to a world size.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from treepack.train.checkpoint import (
    CHECKPOINT_DIR,
    check_architecture,
    checkpoint_path,
    load_dcp,
    optimizer_state_by_name,
    saved_groups,
)
from treepack.train.model import Decoder

FORMAT = "dcp"


def is_dcp(path: str | Path) -> bool:
    """Whether a checkpoint directory holds a DCP checkpoint (its trainer.json says so)."""
    trainer = Path(path) / "trainer.json"
    return trainer.is_file() and json.loads(trainer.read_text()).get("format") == FORMAT


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def save_distributed(output_dir: str | Path, model: Decoder, optimizer: torch.optim.Optimizer, state: dict, *,
                     export_model: bool = False) -> Path:
    """Collective: every rank writes its shards; rank 0 writes trainer.json (and the full model when
    ``export_model``) and swaps the directory in. Returns the checkpoint directory."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    final = checkpoint_path(output_dir)
    tmp = final.with_name(CHECKPOINT_DIR + ".tmp")
    if _rank() == 0 and tmp.exists():
        shutil.rmtree(tmp)
    _barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    full = None
    if export_model:  # collective: every rank takes part in gathering, rank 0 keeps the tensors
        full, _ = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    _barrier()
    if _rank() == 0:
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        (tmp / "trainer.json").write_text(json.dumps({**state, "format": FORMAT, "world_size": world}, indent=2) + "\n")
        _write_hf(tmp, model, full)
        old = final.with_name(CHECKPOINT_DIR + ".old")
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        if old.exists():
            shutil.rmtree(old)
    _barrier()
    return final


def _write_hf(path: Path, model: Decoder, full: dict | None) -> None:
    """config.json always (resume checks the architecture against it); the weights when gathered."""
    from safetensors.torch import save_file

    dtype = model.dtype if full is None else next(iter(full.values())).dtype
    cfg = {**model.args.to_hf_config(), "torch_dtype": str(dtype).removeprefix("torch.")}
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if full is None:
        return
    save_file({k: v.contiguous() for k, v in full.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})


def load_distributed(output_dir: str | Path, model: Decoder, optimizer: torch.optim.Optimizer) -> dict:
    """Restore a sharded model and optimizer from ``output_dir``'s checkpoint, DCP or single-process;
    returns the trainer state (``step``, ``losses``, ...)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    path = checkpoint_path(output_dir)
    state = json.loads((path / "trainer.json").read_text())
    check_architecture(path, model)
    if state.get("format") == FORMAT:
        load_dcp(path, model, optimizer)
    else:  # a single-process checkpoint: full tensors on every rank, each keeps its shard
        model_sd, optim_sd = _full_state_from_safetensors(path, model, optimizer, state)
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd,
                       options=StateDictOptions(full_state_dict=True))
    state.pop("param_groups", None)
    return state


def _full_state_from_safetensors(path: Path, model: Decoder, optimizer: torch.optim.Optimizer,
                                 state: dict) -> tuple[dict, dict]:
    """The single-process checkpoint's tensors as full state dicts keyed like `get_state_dict`."""
    from safetensors.torch import load_file

    model_sd = load_file(str(path / "model.safetensors"))
    names = [n for n, _ in model.named_parameters()]
    if model.args.tie_embeddings:
        model_sd.pop("lm_head.weight", None)
    per_param = optimizer_state_by_name(path)
    groups = []
    for group, saved in zip(optimizer.param_groups, saved_groups(optimizer, state.get("param_groups", []))):
        ids = {id(p) for p in group["params"]}
        params = [n for n, p in model.named_parameters() if id(p) in ids]
        groups.append({**saved, "params": params})
    optim_sd = {"state": {n: per_param[n] for n in names if n in per_param}, "param_groups": groups}
    return model_sd, optim_sd
