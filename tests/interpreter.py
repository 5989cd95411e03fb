"""Running a kernel test's script under Triton's interpreter: a fresh Python (TRITON_INTERPRET must be set before
triton loads) whose JSON lines are the results."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch


def run_interpreted(script: str, *args: str, timeout: int = 300) -> list[dict]:
    """``script`` run with ``args`` under the interpreter; the JSON objects it printed, one a line. Skips where
    triton is missing, and on CUDA machines, whose tests run the compiled kernels instead."""
    pytest.importorskip("triton", reason="triton is not installed")
    if torch.cuda.is_available():
        pytest.skip("CUDA: the compiled kernels are tested instead")
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env,
                         timeout=timeout, check=False)
    assert res.returncode == 0, res.stderr[-4000:]
    return [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
