"""What ``treepack train`` says before the first step and after the first steps: the start banner (model,
device, data, tokens per step, what to expect) and one ETA line.

A run that prints nothing for minutes looks hung: a 151k-vocabulary model on 32K packs takes ~7 minutes a
step on a 2-core CPU, and the first CUDA steps compile for 20-50 s. The banner says what was built and how
big a step is before any of that starts; on a CPU with a step that big it points at the tiny configuration
(``treepack train --example-config --size tiny``). The ETA comes after the second step of a run, the first
one being slower (compilation, allocator warm-up), and uses the steps after the first.
"""

from __future__ import annotations

import numpy as np

from treepack.pack.layout import Pack

CPU_HINT_TOKEN_PARAMS = 2e11  # params x tokens per step above this: minutes per step on a 2-core CPU


def _si(x: float) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.3g}{unit}"
    return f"{x:.0f}"


def banner(cfg, model, packs: list[Pack], device, param_dtype, autocast_dtype) -> list[str]:
    """The start lines: what runs where, on how much data, and a CPU hint when a step will be slow."""
    a = model.args
    params = a.num_params()
    source = cfg.model.checkpoint or f"random init ({cfg.model.family})"
    tokens = np.array([int(p.n_real) for p in packs], dtype=np.int64)
    flat = np.array([int(np.asarray(p.seq_offsets)[-1]) for p in packs], dtype=np.int64)
    per_step = cfg.data.packs_per_step
    dtype = str(autocast_dtype or param_dtype).replace("torch.", "")
    lines = [
        (f"treepack train: {cfg.train.mode} mode on {device.type} ({dtype}{', autocast' if autocast_dtype else ''}),"
        f" {cfg.train.steps:,} steps"),
        (f"model: {source}, {_si(params)} parameters ({a.num_layers} layers, hidden {a.hidden_size},"
        f" {a.num_heads} heads, vocab {a.vocab_size:,})"),
        (f"data: {len(packs):,} packs ({_si(tokens.sum())} tree tokens, {_si(flat.sum())} flat), {per_step} per"
        f" step: ~{_si(tokens.mean() * per_step)} tokens a step (largest pack {_si(tokens.max())})"),
    ]
    work = params * tokens.mean() * per_step
    if device.type == "cpu" and work > CPU_HINT_TOKEN_PARAMS:
        lines.append("this is a big step for a CPU (minutes each): `treepack train --example-config --size tiny` "
                     "prints a configuration that runs in seconds here; on a GPU keep this one")
    return lines


def eta_line(seconds: list[float], done: int, total: int) -> str | None:
    """``eta ...`` after the second step of a run: the remaining steps at the mean of those after the first."""
    if len(seconds) != 2 or done >= total:
        return None
    per = float(np.mean(seconds[1:]))
    left = (total - done) * per
    minutes, secs = divmod(round(left), 60)
    hours, minutes = divmod(minutes, 60)
    when = f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"
    left = total - done
    return (f"eta {when}: {left:,} more step{'s' if left != 1 else ''} at {per:.2f} s/step "
            f"(the first step took {seconds[0]:.2f} s)")
