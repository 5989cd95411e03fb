"""Rollout datasets: seeded synthetic rollouts with the prefix-tree shapes of real RL workloads
(``synth``, configured by ``synth_config``), their token layout (``vocab``), a streaming JSONL/Parquet writer (``writer``), and small
bundled samples (``SAMPLES_DIR``, listed in its README); converters of real chat data to chat records (``chats``) and the
bundled chat sample with its demo tokenizer (``chat_sample``)."""

from pathlib import Path

from treepack.datasets.synth import WriteResult, generate, iter_batches, write
from treepack.datasets.synth_config import KINDS, LogNormal, SynthConfig, configure, preset

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
