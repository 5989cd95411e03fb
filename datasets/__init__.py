"""Rollout datasets: seeded synthetic rollouts with the prefix-tree shapes of real RL workloads
(``synth``), their token layout (``vocab``), a streaming JSONL/Parquet writer (``writer``), and small
bundled samples (``SAMPLES_DIR``, listed in its README)."""

from pathlib import Path

from treepack.datasets.synth import (
    KINDS,
    LogNormal,
    SynthConfig,
    WriteResult,
    configure,
    generate,
    iter_batches,
    preset,
    write,
)

SAMPLES_DIR = Path(__file__).parent / "samples"

__all__ = [
    "KINDS",
    "SAMPLES_DIR",
    "LogNormal",
    "SynthConfig",
    "WriteResult",
    "configure",
    "generate",
    "iter_batches",
    "preset",
    "write",
]
