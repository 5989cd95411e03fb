"""How the commands that write output end early, run as a user runs them (a fresh process, a real pipe, a real
signal): a reader that leaves (``treepack synth ... -o - | head -c 100``) ends the command quietly with exit 0,
and a SIGTERM mid-write ends it as Ctrl-C does, leaving no temporary file, with exit code 143 (128 + 15: what a
shell reports for a process SIGTERM killed; Ctrl-C gives 130)."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from cli_helpers import run


def treepack(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "treepack", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def read_then_leave(p: subprocess.Popen, n: int) -> tuple[int, bytes, bytes]:
    """``| head -c n``: the first ``n`` bytes of the command's stdout, then the pipe closed under it; its exit
    code and stderr."""
    try:
        got = p.stdout.read(n)
        p.stdout.close()
        err = p.stderr.read()
        p.stderr.close()
        return p.wait(timeout=120), got, err
    finally:
        p.kill()  # a no-op once it has exited


@pytest.mark.parametrize("n", [0, 100])
def test_synth_into_a_pipe_closed_early_ends_quietly(n):
    """Megabytes of JSONL into a reader that takes ``n`` bytes: exit 0, and nothing on stderr (no summary of an
    output that was cut short, no traceback, no "Exception ignored" from Python at exit)."""
    code, got, err = read_then_leave(treepack("synth", "tau2", "-n", "8", "-o", "-"), n)
    assert (code, len(got), err) == (0, n, b"")
    assert got == run("synth", "tau2", "-n", "8", "-o", "-", "-q").out.encode()[:n]  # what it wrote is the output


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    """A pack directory of records big enough that one record is more than a pipe holds (64 KiB)."""
    d = tmp_path_factory.mktemp("packs")
    recs = [{"id": i, "tree_id": i % 4, "input_ids": [1, 2, 3] + [100 + i] * 30_000} for i in range(24)]
    src = d / "in.jsonl.gz"
    src.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in recs).encode()))
    assert run("pack", src, "-c", "64K", "-o", d / "p", "-q").code == 0
    return d / "p"


@pytest.mark.parametrize("n", [0, 100])
def test_unpack_into_a_pipe_closed_early_ends_quietly(packs, n):
    code, got, err = read_then_leave(treepack("unpack", packs, "-o", "-"), n)
    assert (code, len(got), err) == (0, n, b"")
    assert got == run("unpack", packs, "-o", "-", "-q").out.encode()[:n]


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
@pytest.mark.parametrize("suffix", [".jsonl.gz"])  # streamed: a Parquet file gets its bytes at the end
def test_a_signal_mid_write_leaves_no_temporary_file(tmp_path, sig, code, suffix):
    """synth writes under a hidden temporary name and renames it when done: SIGTERM (a scheduler's stop,
    ``kill``) removes it as Ctrl-C (SIGINT) does, and ends quietly."""
    out = tmp_path / f"r{suffix}"
    p = treepack("synth", "tau2", "-n", "5000", "-o", out)  # minutes of output: it is killed long before
    try:
        tmp = tmp_path / f".{out.name}.{p.pid}.tmp"
        deadline = time.monotonic() + 120
        while not (tmp.exists() and tmp.stat().st_size > 0):  # mid-write: the first records are in the file
            assert p.poll() is None and time.monotonic() < deadline, p.stderr.read()
            time.sleep(0.02)
        p.send_signal(sig)
        got, err = p.communicate(timeout=120)
        assert (p.returncode, got, err) == (code, b"", b"")
        assert list(tmp_path.iterdir()) == []
    finally:
        p.kill()


@pytest.mark.parametrize("command", [("synth", "tau2", "-n", "1"), ("unpack", "PACKS")])
def test_a_closed_stdout_is_one_line(packs, command):
    """``-o -`` with standard output closed (``>&-``): one line naming it, exit 1, no traceback."""
    args = [str(packs) if a == "PACKS" else a for a in command]
    p = subprocess.run([sys.executable, "-m", "treepack", *args, "-o", "-"], stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, preexec_fn=lambda: os.close(1), check=False)
    assert (p.returncode, p.stderr) == (1, b"Error: -o -: standard output is closed\n")
