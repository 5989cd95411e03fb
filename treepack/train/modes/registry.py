"""The mode registry: which execution modes exist, the attention family each runs, and how each is built.

A mode registers its name, its family (``tree``: the tree mask; ``causal``: independent sequences, the dense
baselines; `treepack.kernels.tree_attention.registry.FAMILIES`) and a factory ``factory(train, extras) ->
Mode`` that takes the ``[train]`` settings whole. This module imports no mode, so the config can ask it which
backends a mode may name (`mode_family`) while the modes read the config's dataclasses: the registrations
themselves are at the end of ``treepack/train/modes/__init__.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from treepack.errors import ConfigError
from treepack.kernels.tree_attention.registry import FAMILIES

__all__ = ["ModeExtras", "ModeSpec", "mode_family", "mode_names", "mode_spec", "register_mode"]


@dataclass(frozen=True)
class ModeExtras:
    """What a mode takes besides ``[train]``: objects, and switches with no config key (tests, benchmarks)."""

    speed_table: Any = None  # auto: its `SpeedTable` (None: train.speed_table, else built in for the device)
    sft_fast_path: bool = True  # tree, dfs: SFT token-mean through loss_weight (tests compare it with the rows)
    merge_pops: bool = True  # dfs: consecutive pops of one path in one call (off only to measure the gain)


@dataclass(frozen=True)
class ModeSpec:
    name: str
    family: str  # the attention family of its calls: "tree" (the tree mask) | "causal" (independent sequences)
    factory: Callable[..., Any]  # (TrainConfig, ModeExtras) -> Mode


_MODES: dict[str, ModeSpec] = {}


def register_mode(name: str, factory: Callable[..., Any], *, family: str) -> ModeSpec:
    """Add (or replace) the mode ``name``: ``factory(train, extras)`` builds it from the ``[train]`` settings."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {family!r}")
    spec = _MODES[name] = ModeSpec(name, family, factory)
    return spec


def mode_names() -> tuple[str, ...]:
    return tuple(_MODES)


def mode_spec(name: str) -> ModeSpec:
    if name not in _MODES:
        raise ConfigError(f"unknown mode {name!r} (modes: {', '.join(_MODES)})")
    return _MODES[name]


def mode_family(name: str) -> str:
    """The attention family mode ``name`` runs: which backends ``train.attention`` may name for it."""
    return mode_spec(name).family
