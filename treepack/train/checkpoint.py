"""Save and resume a training run: model, optimizer and trainer state, all in safetensors + JSON.

Layout of ``<output.dir>/checkpoint/``:
- ``config.json`` + ``model.safetensors``: the model as a Hugging Face checkpoint (our parameter names are
  theirs), loadable by `Decoder.from_pretrained` and by ``transformers``;
- ``optimizer.safetensors``: AdamW's per-parameter state keyed ``<param name>.<state key>`` (exp_avg,
  exp_avg_sq, step), so it survives reordering of ``model.parameters()``;
- ``trainer.json``: the step reached, the optimizer's param-group hyper-parameters, the losses so far.
A save writes ``checkpoint.tmp/`` and renames it over ``checkpoint/``: a run killed mid-save keeps the
previous checkpoint intact. The data order is a pure function of (seed, step), so nothing else is needed
to resume the exact run.
"""

from __future__ import annotations

import json
import math
import shutil
import warnings
from pathlib import Path

import torch

from treepack.errors import ConfigError
from treepack.train.model import Decoder

CHECKPOINT_DIR = "checkpoint"


def checkpoint_path(output_dir: str | Path) -> Path:
    return Path(output_dir) / CHECKPOINT_DIR


def has_checkpoint(output_dir: str | Path) -> bool:
    return (checkpoint_path(output_dir) / "trainer.json").is_file()


def save_checkpoint(output_dir: str | Path, model: Decoder, optimizer: torch.optim.Optimizer, state: dict) -> Path:
    """Write the checkpoint atomically (tmp dir + rename); returns its directory."""
    from safetensors.torch import save_file

    final = checkpoint_path(output_dir)
    tmp = final.with_name(CHECKPOINT_DIR + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(tmp)
    names = {id(p): n for n, p in model.named_parameters()}
    tensors = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, value in optimizer.state.get(p, {}).items():
                t = value if torch.is_tensor(value) else torch.tensor(value)
                tensors[f"{names[id(p)]}.{key}"] = t.detach().contiguous().cpu()
    save_file(tensors, str(tmp / "optimizer.safetensors"))
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    (tmp / "trainer.json").write_text(json.dumps({**state, "param_groups": groups}, indent=2) + "\n")
    old = final.with_name(CHECKPOINT_DIR + ".old")
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    if old.exists():
        shutil.rmtree(old)
    return final


def load_checkpoint(output_dir: str | Path, model: Decoder, optimizer: torch.optim.Optimizer) -> dict:
    """Restore model weights and optimizer state in place; returns the trainer state (``step``, ...)."""
    path = checkpoint_path(output_dir)
    state = json.loads((path / "trainer.json").read_text())
    if state.get("format") == "dcp":  # written by a data-parallel run (treepack.train.dcp)
        check_architecture(path, model)
        load_dcp(path, model, optimizer)
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


def open_metrics(path: Path, start: int):
    """``metrics.jsonl`` opened for appending the steps after ``start`` (0: a new file). Lines of later steps
    are dropped first: a run that stopped after its last checkpoint had logged steps it now runs again."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not start:
        return open(path, "w")
    if path.is_file():
        lines = path.read_text().splitlines(keepends=True)
        kept = [line for line in lines if _logged_step(line) <= start]
        if len(kept) < len(lines):
            path.write_text("".join(kept))
    return open(path, "a")


def _logged_step(line: str) -> float:
    """The step of one metrics line; a line cut short by a killed run counts as past every checkpoint."""
    try:
        return json.loads(line).get("step", 0)
    except ValueError:
        return math.inf
