"""Where ``treepack train``'s model comes from: ``model.source`` names a registered model source.

A source is a loader (the ``[model]`` config, the data's vocabulary, seed, dtype and device -> the module the
loop trains) and, optionally, its own execution modes. What the loop reads from the module is small: ``args``
(the shape the FLOP model needs: layers, heads, head dim, hidden size, vocabulary, parameter counts),
``dtype``/``device``, ``save_pretrained``/``from_pretrained`` (checkpoints stay Hugging Face directories),
``activation_checkpointing``, ``compile``, ``activation_memory_budget`` and ``uses_compiled(device)``.

Two sources ship:
- ``treepack`` (registered here): our decoder (`treepack.train.model.Decoder`), a random init or a qwen3 /
  qwen2 / llama checkpoint, with every mode of `treepack.train.modes`;
- ``hf`` (registered by `treepack.hf.trainer` when it is imported): transformers' own modules behind the same
  interface, with its tree and dense modes (dfs needs our decoder's cached-prefix calls).

Why a registry: ``treepack.hf`` builds on ``treepack.train`` (its losses, modes and this registry), so train
importing hf would make a circle between the two packages of one stage. Instead `model_source` imports the
module that `PROVIDERS` names for a source the first time that source is asked for; no module under
``treepack/train/`` imports ``treepack.hf`` (tests/test_layout.py checks it). A new source is one module that
calls `register_model_source` plus one line in `PROVIDERS` (and its name in ``model.source``'s choices).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from treepack.errors import ConfigError

# source name -> the module that registers it when imported (sources outside this package)
PROVIDERS = {"hf": "treepack.hf.trainer"}


@dataclass(frozen=True)
class ModelSource:
    name: str
    # (model config, *, vocab_size: the data's largest id + 1, seed, dtype, device) -> the model to train
    load: Callable[..., nn.Module]
    # (mode name, *, attention, chunk_rows) -> the execution mode; None: the modes of treepack.train.modes
    make_mode: Callable[..., object] | None = None


_SOURCES: dict[str, ModelSource] = {}


def register_model_source(name: str, load: Callable[..., nn.Module], *,
                          make_mode: Callable[..., object] | None = None) -> ModelSource:
    """Register (or replace) the model source ``name``; returns it."""
    source = ModelSource(name=name, load=load, make_mode=make_mode)
    _SOURCES[name] = source
    return source


def model_source(name: str) -> ModelSource:
    """The registered source ``name``, importing its provider module (`PROVIDERS`) on first use."""
    if name not in _SOURCES and name in PROVIDERS:
        try:
            importlib.import_module(PROVIDERS[name])
        except ImportError as exc:  # e.g. transformers not installed
            raise ConfigError(f"model.source = '{name}' needs {PROVIDERS[name]}, which cannot be imported "
                              f"({exc})") from None
    if name not in _SOURCES:
        known = sorted({*_SOURCES, *PROVIDERS})
        raise ConfigError(f"model.source = '{name}' is not a registered model source ({', '.join(known)})")
    return _SOURCES[name]


def registered_sources() -> list[str]:
    """The names a run can ask for: those registered so far and those `PROVIDERS` can import."""
    return sorted({*_SOURCES, *PROVIDERS})


def _load_decoder(m, *, vocab_size: int, seed: int, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """Our decoder: the checkpoint ``m.checkpoint``, else a random init whose vocabulary is ``m.vocab_size`` (0:
    ``vocab_size``, the data's largest id + 1)."""
    from treepack.train.model import Decoder, ModelArgs

    if m.checkpoint:
        return Decoder.from_pretrained(m.checkpoint, dtype=dtype, device=device)
    args = ModelArgs.for_family(
        m.family, vocab_size=m.vocab_size or vocab_size, hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size, num_layers=m.num_layers, num_heads=m.num_heads,
        num_kv_heads=m.num_kv_heads, head_dim=m.head_dim, rope_theta=m.rope_theta,
        tie_embeddings=m.tie_embeddings, init_std=m.init_std,
    )
    return Decoder.random_init(args, seed=seed, dtype=dtype, device=device, draw_on_device=m.init_on_device)


register_model_source("treepack", _load_decoder)
