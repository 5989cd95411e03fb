"""Save and resume a training run, one process or many: one save path (`save_checkpoint`), one loader
(`load_checkpoint`), whichever world size wrote the checkpoint and whichever resumes it.

Layout of ``<output.dir>/checkpoint/``, by format:
- single process (``safetensors``): ``config.json`` + ``model.safetensors``, the model as a Hugging Face
  checkpoint (our parameter names are theirs), loadable by `Decoder.from_pretrained` and by ``transformers``;
  ``optimizer.safetensors``, AdamW's per-parameter state keyed ``<param name>.<state key>`` (exp_avg, exp_avg_sq,
  step), so it survives reordering of ``model.parameters()``;
- data-parallel (``dcp``, ``torch.distributed.checkpoint``): ``.metadata`` + one ``__<rank>_0.distcp`` per rank,
  model and AdamW state as sharded tensors under their parameter names (`get_state_dict`), resharded on load;
  ``config.json`` always (resume checks the architecture against it) and, at the end of a run, the full model as
  ``model.safetensors`` (gathered on rank 0): the same Hugging Face checkpoint a single-process run leaves;
- both: ``trainer.json``, the step reached, the losses so far, and the format: the optimizer's param-group
  hyper-parameters (safetensors) or ``"format": "dcp"`` and the world size that wrote it.

A save writes a hidden directory beside ``checkpoint/`` and swaps it in once every file is written, on every rank
(`treepack.io.atomic.replaced_dir`; rank 0 owns the swap): a run killed mid-save keeps the previous checkpoint, and
the next save removes what a killed one left. Any checkpoint resumes any run: DCP into one plain process or any
number of ranks, safetensors into a sharded model (every rank reads the full tensors and keeps its shard). The data
order is a pure function of (seed, step), so nothing else is needed to resume the exact run.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from treepack.errors import ConfigError
from treepack.io.atomic import replaced_dir
from treepack.train.model import Decoder

CHECKPOINT_DIR = "checkpoint"
DCP = "dcp"  # trainer.json's "format" of a data-parallel checkpoint


def checkpoint_path(output_dir: str | Path) -> Path:
    return Path(output_dir) / CHECKPOINT_DIR


def has_checkpoint(output_dir: str | Path) -> bool:
    return (checkpoint_path(output_dir) / "trainer.json").is_file()


def is_dcp(path: str | Path) -> bool:
    """Whether a checkpoint directory holds a DCP checkpoint (its trainer.json says so)."""
    trainer = Path(path) / "trainer.json"
    return trainer.is_file() and json.loads(trainer.read_text()).get("format") == DCP


def _in_group() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _in_group() else 0


def save_checkpoint(output_dir: str | Path, model: Decoder, optimizer: torch.optim.Optimizer, state: dict, *,
                    distributed: bool = False, export_model: bool = True) -> Path:
    """Write the checkpoint and swap it in for the previous one; returns its directory. ``distributed``: the DCP
    format, a collective every rank of the process group calls (``export_model``: also gather the full model
    into ``model.safetensors``, as a run's last save does); else one process writes safetensors."""
    final = checkpoint_path(output_dir)
    with _staged(final, collective=distributed and _in_group()) as tmp:
        if distributed:
            _write_dcp(tmp, model, optimizer, state, export_model=export_model)
        else:
            _write_safetensors(tmp, model, optimizer, state)
    return final


@contextlib.contextmanager
def _staged(final: Path, *, collective: bool) -> Iterator[Path]:
    """The directory a save writes into, swapped in for ``final`` when the block ends (`replaced_dir`). In a
    collective save rank 0 owns it, the other ranks write into it too (its name broadcast), and the swap waits
    for every rank's files; no rank leaves before the swap."""
    if not collective or _rank() == 0:
        for stale in [*final.parent.glob(f".{final.name}.*.tmp"), *final.parent.glob(f".{final.name}.*.old")]:
            shutil.rmtree(stale, ignore_errors=True)  # left by a save that was killed
        with replaced_dir(final) as tmp:
            if collective:
                dist.broadcast_object_list([str(tmp)], src=0)
                _every_rank_sees(tmp, final)
            yield tmp
            if collective:
                dist.barrier()  # every rank has written its files
    else:
        name = [None]
        dist.broadcast_object_list(name, src=0)
        _every_rank_sees(Path(name[0]), final)
        yield Path(name[0])
        dist.barrier()
    if collective:
        dist.barrier()  # the swap is done


# how long a rank waits to see rank 0's new directory (network file systems lag); TREEPACK_SHARED_DIR_WAIT_S
SHARED_DIR_WAIT_S = float(os.environ.get("TREEPACK_SHARED_DIR_WAIT_S", "10"))


def _every_rank_sees(tmp: Path, final: Path) -> None:
    """Refuse a collective save whose directory some rank cannot see: with ``output.dir`` on one node's local
    disk, the other nodes' shards would land where rank 0 never looks, and the checkpoint could not resume.
    Every rank answers, so all of them stop together with one line."""
    deadline = time.monotonic() + SHARED_DIR_WAIT_S
    while not tmp.is_dir() and time.monotonic() < deadline:
        time.sleep(0.2)
    seen: list = [None] * dist.get_world_size()
    dist.all_gather_object(seen, tmp.is_dir())
    blind = [rank for rank, ok in enumerate(seen) if not ok]
    if blind:
        ranks = ", ".join(str(r) for r in blind)
        raise ConfigError(f"output.dir {final.parent} is not one directory for every rank: rank{'s' if len(blind) > 1 else ''} "
                          f"{ranks} cannot see the checkpoint rank 0 is writing ({tmp.name}); on several nodes put "
                          "output.dir on storage every node mounts at the same path")


def _write_safetensors(path: Path, model: Decoder, optimizer: torch.optim.Optimizer, state: dict) -> None:
    from safetensors.torch import save_file

    model.save_pretrained(path)
    names = {id(p): n for n, p in model.named_parameters()}
    tensors = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, value in optimizer.state.get(p, {}).items():
                t = value if torch.is_tensor(value) else torch.tensor(value)
                tensors[f"{names[id(p)]}.{key}"] = t.detach().contiguous().cpu()
    save_file(tensors, str(path / "optimizer.safetensors"))
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    (path / "trainer.json").write_text(json.dumps({**state, "param_groups": groups}, indent=2) + "\n")


def _write_dcp(path: Path, model: Decoder, optimizer: torch.optim.Optimizer, state: dict, *,
               export_model: bool) -> None:
    """Every rank writes its shards; rank 0 trainer.json and the Hugging Face files."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    with warnings.catch_warnings():  # "no process group: saving in a single process" is the intent there
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))
    full = None
    if export_model:  # collective: every rank takes part in gathering, rank 0 keeps the tensors
        full, _ = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if _rank() == 0:
        world = dist.get_world_size() if _in_group() else 1
        (path / "trainer.json").write_text(json.dumps({**state, "format": DCP, "world_size": world}, indent=2) + "\n")
        _write_hf(path, model, full)


def load_checkpoint(output_dir: str | Path, model: Decoder, optimizer: torch.optim.Optimizer) -> dict:
    """Restore model weights and optimizer state in place from ``output_dir``'s checkpoint, whichever format
    wrote it, into a plain or an FSDP-sharded model; returns the trainer state (``step``, ``losses``, ...)."""
    from torch.distributed.fsdp import FSDPModule

    path = checkpoint_path(output_dir)
    state = json.loads((path / "trainer.json").read_text())
    if state.get("format") == DCP:
        check_architecture(path, model)
        load_dcp(path, model, optimizer)
        return state
    if isinstance(model, FSDPModule):  # full tensors on every rank, each keeps its shard
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        check_architecture(path, model)
        model_sd, optim_sd = _full_state_from_safetensors(path, model, optimizer, state)
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd,
                       options=StateDictOptions(full_state_dict=True))
        state.pop("param_groups", None)
        return state
    saved = type(model).from_pretrained(path, dtype=model.dtype, device=model.device)  # Decoder or HFCausalLM
    if saved.args != model.args:
        raise ConfigError(f"{path}: the checkpoint's architecture differs from the configured model "
                          "(use a new output.dir or set output.resume = false)")
    with torch.no_grad():
        for (name, p), (_, q) in zip(model.named_parameters(), saved.named_parameters()):
            p.copy_(q)
    per_param = optimizer_state_by_name(path)  # on the CPU: the optimizer's loader moves each tensor below
    names = {id(p): n for n, p in model.named_parameters()}
    # torch's own loader puts each state tensor where this optimizer's implementation needs it (AdamW's
    # step count on the CPU, or on the parameter's device for the fused and capturable kernels)
    index, state_by_index, groups = 0, {}, []
    for group, saved in zip(optimizer.param_groups, saved_groups(optimizer, state.pop("param_groups", []))):
        ids = []
        for p in group["params"]:
            if names[id(p)] in per_param:
                state_by_index[index] = per_param[names[id(p)]]
            ids.append(index)
            index += 1
        groups.append({**saved, "params": ids})
    optimizer.load_state_dict({"state": state_by_index, "param_groups": groups})
    return state


def optimizer_state_by_name(path: Path) -> dict[str, dict]:
    """``optimizer.safetensors`` as {parameter name: {state key: tensor}}, on the CPU."""
    from safetensors.torch import load_file

    per_param: dict[str, dict] = {}
    for key, t in load_file(str(path / "optimizer.safetensors")).items():
        name, sub = key.rsplit(".", 1)
        per_param.setdefault(name, {})[sub] = t
    return per_param


# Optimizer settings that choose an implementation for this run's devices, not hyper-parameters: a run
# saved on a GPU (fused AdamW) resumes on a CPU or sharded, and the other way round.
IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable", "differentiable")


def saved_groups(optimizer: torch.optim.Optimizer, saved: list[dict]) -> list[dict]:
    """The saved param groups' hyper-parameters (lr, betas, weight decay, ...) over ``optimizer``'s own
    groups, keeping this optimizer's implementation settings; without ``params``."""
    out = []
    for group, old in zip(optimizer.param_groups, saved + [{}] * (len(optimizer.param_groups) - len(saved))):
        merged = {k: v for k, v in group.items() if k != "params"}
        merged.update({k: tuple(v) if isinstance(v, list) else v for k, v in old.items()
                       if k not in IMPLEMENTATION_KEYS and k != "params"})
        out.append(merged)
    return out


def check_architecture(path: Path, model: Decoder) -> None:
    """Refuse a checkpoint whose config.json describes another architecture than ``model``'s."""
    from treepack.train.architecture import ModelArgs

    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        return
    if ModelArgs.from_hf_config(json.loads(cfg_file.read_text()), source=str(cfg_file)) != model.args:
        raise ConfigError(f"{path}: the checkpoint's architecture differs from the configured model "
                          "(use a new output.dir or set output.resume = false)")


def load_dcp(path: Path, model: Decoder, optimizer: torch.optim.Optimizer) -> None:
    """Model and AdamW state from a torch.distributed.checkpoint directory, resharded to ``model``'s
    placement: FSDP-sharded on any number of ranks, or whole in one plain process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    both = {"model": model_sd, "optim": optim_sd}
    with warnings.catch_warnings():  # "no process group: loading in a single process" is the intent here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(both, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=both["model"], optim_state_dict=both["optim"])


def _write_hf(path: Path, model: Decoder, full: dict | None) -> None:
    """config.json always (resume checks the architecture against it); the weights when gathered."""
    from safetensors.torch import save_file

    dtype = model.dtype if full is None else next(iter(full.values())).dtype
    cfg = {**model.args.to_hf_config(), "torch_dtype": str(dtype).removeprefix("torch.")}
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if full is None:
        return
    save_file({k: v.contiguous() for k, v in full.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})


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
