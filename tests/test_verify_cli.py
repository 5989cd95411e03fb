"""``treepack verify`` options: the packs it builds from rollout files (those ``treepack pack`` writes),
``--compile`` where nothing compiles, and ``--dfs-keep-tokens`` sizes (exact output and exit codes)."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import pytest
import torch
from cli_helpers import run

import treepack.cli.verify as verify_cli
import treepack.train.verify as verify_lib
from treepack.cli.pack import pack as pack_command
from treepack.train.data import pack_rollouts, read_rollout_files

VERIFY_USAGE = "Usage: treepack verify [OPTIONS] {SHARDS_DIR}...\nTry 'treepack verify --help' for help.\n\n"

# 4 trees (tree_id) that share a 5-token system prompt, each 3 answers; `treepack pack` shares the prompt
# across trees (one forest), so it needs fewer packs than whole trees taken in input order.
SYSTEM = [1, 2, 3, 4, 5]
QUESTIONS = [[6, 7], [8, 9, 10], [11], [12, 13]]
ANSWERS = [[14, 15, 16], [17, 18], [14, 19, 20, 21]]


def write_rollouts(path: Path, *, steps: bool = False) -> Path:
    lines = []
    for t, question in enumerate(QUESTIONS):
        prompt = SYSTEM + question
        for a, answer in enumerate(ANSWERS):
            record = {"tree_id": t, "id": f"{t}/{a}", "input_ids": prompt + answer,
                      "loss_mask": [0] * len(prompt) + [1] * len(answer), "reward": float(a % 2)}
            if steps:
                record["step"] = t // 2
            lines.append(json.dumps(record))
    path.write_text("\n".join(lines) + "\n")
    return path


def without_times(out: dict) -> dict:
    """A verify --json object without what differs between two runs of the same packs (seconds)."""
    return {**out, "modes": {k: {f: v for f, v in m.items() if f != "seconds"} for k, m in out["modes"].items()}}


def test_verify_packs_rollouts_as_pack_does_by_default():
    assert verify_cli.PACK_STRATEGY == inspect.signature(pack_command).parameters["strategy"].default.default


@pytest.mark.parametrize("steps, first", [
    (False, "1 of 3 packs (--packs 1), 4 of 12 sequences"),  # trees share the prompt: 19 + 19 + 20 tokens
    (True, "1 of 4 packs (--packs 1), 3 of 12 sequences"),  # packs never cross a step: one tree each
])
def test_verify_counts_and_packs_match_treepack_pack(tmp_path, steps, first):
    data = write_rollouts(tmp_path / "r.jsonl", steps=steps)
    assert run("pack", data, "-c", "20", "-o", tmp_path / "packs").code == 0
    counts = json.loads((tmp_path / "packs" / "manifest.json").read_text())["counts"]
    assert (counts["packs"], counts["packed_sequences"]) == ((4, 12) if steps else (3, 12))
    # whole trees in input order (the packs `treepack train` builds from rollout files) take 4 packs: the
    # check below would not tell the two packings apart otherwise
    assert len(list(pack_rollouts(read_rollout_files([data]), 20))) == 4
    r = run("verify", data, "--capacity", "20")
    assert r.code == 0, r.err
    assert r.out.splitlines()[0] == f"treepack verify: {first}, float64, sft loss"
    tokens = 15 if steps else 19
    assert re.fullmatch(rf"verify: {first[:12]} \({tokens} tree tokens\) from .*r\.jsonl \(\d+\.\d s\)",
                        r.err.splitlines()[0])
    # the same packs, in the same order, as the directory pack wrote: the same report, number for number
    for n in ("1", "0"):
        a = json.loads(run("verify", data, "--capacity", "20", "--packs", n, "--json").out)
        b = json.loads(run("verify", tmp_path / "packs", "--packs", n, "--json").out)
        assert (a["packs_total"], a["sequences_total"]) == (counts["packs"], 12) == (b["packs_total"], 12)
        assert without_times(a) == without_times(b) and a["ok"] is True


def test_verify_compile_where_nothing_compiles_is_a_usage_error(tmp_path, monkeypatch):
    """--compile compiles what training compiles (CUDA, below float64): anywhere else it is refused, exit 2,
    before any work, as a tree kernel that cannot run here is."""
    data = write_rollouts(tmp_path / "r.jsonl")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    error = "Invalid value for --compile: CUDA is not available (training compiles on CUDA only)"
    r = run("verify", data, "--capacity", "20", "--compile")
    assert (r.code, r.out, r.err) == (2, "", f"{VERIFY_USAGE}Error: {error}\n")
    r = run("verify", data, "--capacity", "20", "--compile", "--device", "cuda")  # the device is named first
    assert (r.code, r.out, r.err) == (2, "", f"{VERIFY_USAGE}Error: Invalid value for --device: CUDA is not available\n")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the checks come before any CUDA call
    error = "Invalid value for --compile: needs --device cuda (training compiles on CUDA only)"
    r = run("verify", data, "--capacity", "20", "--compile")
    assert (r.code, r.out, r.err) == (2, "", f"{VERIFY_USAGE}Error: {error}\n")
    error = ("Invalid value for --compile: needs --dtype float32, bfloat16 or float16 (training compiles nothing "
             "in float64)")
    r = run("verify", data, "--capacity", "20", "--compile", "--device", "cuda")
    assert (r.code, r.out, r.err) == (2, "", f"{VERIFY_USAGE}Error: {error}\n")


@pytest.mark.parametrize("text, tokens", [("4096", 4096), ("8k", 8000), ("8K", 8192), ("1M", 1048576), ("0", 0),
                                          ("0k", 0)])
def test_verify_dfs_keep_tokens_takes_sizes(tmp_path, monkeypatch, text, tokens):
    seen = []
    real = verify_lib.make_mode

    def make_mode(name, **options):
        seen.append(options["dfs"].keep_tokens)
        return real(name, **options)

    monkeypatch.setattr(verify_lib, "make_mode", make_mode)
    r = run("verify", write_rollouts(tmp_path / "r.jsonl"), "--capacity", "20", "--modes", "dense,dfs",
            "--dfs-block-size", "4", "--dfs-keep-tokens", text, "--json")
    assert r.code == 0, r.err
    assert json.loads(r.out)["ok"] is True and seen and set(seen) == {tokens}


@pytest.mark.parametrize("text, error", [
    ("-1", "must be >= 0, got -1"),
    ("big", "must be a number of tokens such as 4096 or \"4K\" (0: off), got 'big'"),
    ("-4k", "must be a number of tokens such as 4096 or \"4K\" (0: off), got '-4k'"),
    ("1.5", "must be a number of tokens such as 4096 or \"4K\" (0: off), got '1.5'"),
    ("auto", "must be a number of tokens such as 4096 or \"4K\" (0: off), got 'auto'"),
])
def test_verify_dfs_keep_tokens_errors(tmp_path, text, error):
    r = run("verify", write_rollouts(tmp_path / "r.jsonl"), "--capacity", "20", "--modes", "dense,dfs",
            "--dfs-keep-tokens", text)
    assert (r.code, r.out, r.err) == (2, "", f"{VERIFY_USAGE}Error: Invalid value for --dfs-keep-tokens: {error}\n")
