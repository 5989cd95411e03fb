"""Data-parallel training on 2 GPUs (NCCL, FSDP2; skipped without 2 CUDA devices): 2 ranks give the
single-process run's losses and weights in float32, and a run saved by 2 ranks after step 2 resumes to
the uninterrupted run's weights. On CUDA both use the fused AdamW kernel, over DTensor shards at 2 ranks,
and the step count lives on the GPU: the resume round-trips it through a DCP checkpoint. In bf16 with the
compiled regions, 2 ranks compute under autocast as one process does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from test_distributed import losses, max_rel_diff, weights, write_rollouts

from treepack.train.config import load_config
from treepack.train.loop import train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs 2 CUDA devices")

CONFIG = """\
[model]
hidden_size = 64
intermediate_size = 96
num_layers = 2
num_heads = 4
num_kv_heads = 2
head_dim = 16

[data]
rollouts = ["rollouts.jsonl"]
capacity = "60"
packs_per_step = 2

[train]
mode = "{mode}"
steps = {steps}
lr = 0.003
dtype = "{dtype}"
device = "cuda"
compile = "{compile}"

[output]
dir = "{out}"
save_every = {save_every}
"""


def write_config(directory: Path, out: str, *, mode: str = "tree", steps: int = 4, save_every: int = 0,
                 dtype: str = "float32", compile: str = "off") -> Path:
    path = directory / f"{out}.toml"
    path.write_text(CONFIG.format(mode=mode, steps=steps, out=out, save_every=save_every, dtype=dtype, compile=compile))
    return path


def torchrun(config: Path, cwd: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NCCL_NVLS_ENABLE": "0"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "treepack",
           "train", str(config)]
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


@pytest.mark.parametrize("mode", ["tree", "dfs"])
def test_two_gpus_match_one_and_resume(tmp_path, mode):
    write_rollouts(tmp_path / "rollouts.jsonl")
    train(load_config(write_config(tmp_path, "one", mode=mode)), log=lambda line: None)
    torchrun(write_config(tmp_path, "two", mode=mode), tmp_path)
    torchrun(write_config(tmp_path, "resumed", mode=mode, steps=2, save_every=1), tmp_path)
    torchrun(write_config(tmp_path, "resumed", mode=mode, steps=4, save_every=1), tmp_path)
    one, two, resumed = (tmp_path / name for name in ("one", "two", "resumed"))
    assert len(losses(two)) == len(losses(resumed)) == 4
    # float32 on GPUs: the ranks' sums and the reduce-scatter add in another order than one process
    assert max_rel_diff(weights(two), weights(one)) < 1e-4
    assert max_rel_diff(weights(resumed), weights(two)) < 1e-4
    for a, b in zip(losses(two), losses(one)):
        assert abs(a - b) <= 1e-4 * max(abs(b), 1.0)


@pytest.mark.parametrize("mode", ["tree", "dfs"])
def test_two_gpus_bf16_compiled_as_one_process(tmp_path, mode):
    """bf16 with the compiled regions: every rank computes under autocast over float32 parameters, as one
    process does (the Triton kernels may tune to other configurations in another process: bf16 noise)."""
    write_rollouts(tmp_path / "rollouts.jsonl")
    kw = {"mode": mode, "dtype": "bfloat16", "compile": "auto"}
    train(load_config(write_config(tmp_path, "one", **kw)), log=lambda line: None)
    torchrun(write_config(tmp_path, "two", **kw), tmp_path)
    one, two = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert len(one) == len(two) == 4
    assert abs(two[0] - one[0]) <= 1e-3 * abs(one[0])
    for a, b in zip(two, one):
        assert abs(a - b) <= 1e-2 * abs(b)
