"""The README's Quickstart is a test: every command of its block runs, on a CPU, in a temporary directory
(``.venv`` and ``treepack`` linked in, as the repository root has them), and none may exit non-zero or
leave a file in the repository."""

from __future__ import annotations

import gzip
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


ASSIGNMENT = re.compile(r"^[A-Za-z_]\w*=\S*(;\s*[A-Za-z_]\w*=\S*)*$")


def quickstart_commands() -> list[str]:
    """The Quickstart block's lines without their comments (a comment-only line continues the one above)."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Quickstart"):]
    section = section[: section.index("\n## ", 4)]
    block = re.search(r"\n((?: {4}.*\n)+)", section).group(1)
    commands = []
    for line in block.splitlines():
        code = re.sub(r"\s+# .*$", "", line.strip())
        if code and not code.startswith("#"):
            commands.append(code)
    return commands


def test_the_block_is_found():
    commands = quickstart_commands()
    assert commands[0] == "T=.venv/bin/treepack"
    assert all(c.startswith("$T ") or ASSIGNMENT.match(c) for c in commands[1:]), commands
    assert any("train" in c for c in commands) and any(c.startswith("$T unpack") for c in commands)


def root_entries() -> list[str]:
    """The repository root's entries but Hypothesis's cache (``.hypothesis``, which no Quickstart command
    writes): in a fresh clone the first property test creates it, and under ``make test`` one may run beside
    this test."""
    return sorted(p.name for p in ROOT.iterdir() if p.name != ".hypothesis")


@pytest.mark.slow
def test_every_quickstart_command_runs(tmp_path):
    venv = ROOT / ".venv"
    if not (venv / "bin" / "treepack").exists():
        pytest.skip("no .venv with treepack installed (make install)")
    (tmp_path / ".venv").symlink_to(venv)
    (tmp_path / "treepack").symlink_to(ROOT / "treepack")  # the bundled samples
    before = root_entries()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # every line must run on a CPU
    commands = quickstart_commands()
    setup = []  # variable lines (`T=...`, `C=...; TOK=...`) hold for the lines after them
    for cmd in commands:
        if ASSIGNMENT.match(cmd):
            setup.append(cmd)
            continue
        proc = subprocess.run(["bash", "-c", f"set -o pipefail; {'; '.join(setup)}; {cmd}"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=600, check=False)
        assert proc.returncode == 0, f"`{cmd}` exited {proc.returncode}:\n{proc.stderr[-2000:]}"
    assert root_entries() == before, "the Quickstart left files in the repository"
    # unpack gave back the very bytes synth wrote (decompressed)
    assert gzip.decompress((tmp_path / "back.jsonl.gz").read_bytes()) == gzip.decompress(
        (tmp_path / "tau2.jsonl.gz").read_bytes())


def test_the_python_example_runs_as_printed(tmp_path):
    """The README's numpy-only example ("In Python") runs, prints the POR its comment says, and writes packs."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## In Python"):]
    section = section[: section.index("\n## ", 4)]
    block = re.search(r"\n\n((?:(?: {4}.*)?\n)+)", section).group(1)  # blank lines inside the block too
    code = "\n".join(line[4:] for line in block.splitlines())
    import sys

    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert float(done.stdout) == pytest.approx(1 - 6 / 11)
    assert (tmp_path / "packs" / "manifest.json").is_file()
