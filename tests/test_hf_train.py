"""``treepack train`` with ``model.source = "hf"``: a transformers checkpoint directory trained through
treepack.hf. Tree and dense runs follow the same trajectory (float64), our decoder and transformers'
modules agree on a qwen3 checkpoint, ``auto`` picks our decoder where it loads the checkpoint, resume works,
and dfs (our decoder's cached-prefix calls) is refused with a clear message."""

from __future__ import annotations

import contextlib

import pytest
from cli_helpers import run
from hf_models import tiny_model
from test_train_cli import write_rollouts

from treepack.errors import ConfigError
from treepack.hf import exact_float64
from treepack.train.config import parse_config
from treepack.train.loop import train

BODY = """\
[model]
checkpoint = "{ckpt}"
source = "{source}"

[data]
rollouts = ["rollouts.jsonl"]
capacity = "40"
packs_per_step = 2

[train]
mode = "{mode}"
steps = {steps}
lr = 0.003
dtype = "float64"
device = "cpu"

activation_checkpointing = {ckpt_layers}

[train.loss]
kind = "{loss}"

[output]
dir = "{out}"
metrics = ""
"""


def checkpoint(tmp_path, arch: str):
    path = tmp_path / f"ckpt-{arch}"
    if not path.exists():
        tiny_model(arch, std=0.05).save_pretrained(str(path))
    return path


def run_train(tmp_path, *, arch="gemma2", source="hf", mode="tree", steps=2, loss="grpo", out="run",
              ckpt_layers=False, exact=True):
    write_rollouts(tmp_path / "rollouts.jsonl")
    text = BODY.format(ckpt=checkpoint(tmp_path, arch), source=source, mode=mode, steps=steps, loss=loss, out=out,
                       ckpt_layers=str(ckpt_layers).lower())
    cfg = parse_config(text, base_dir=tmp_path)
    with exact_float64() if exact else contextlib.nullcontext():
        return train(cfg, log=lambda line: None)


@pytest.mark.parametrize("loss", ["sft", "grpo"])
def test_tree_and_dense_follow_the_same_trajectory(tmp_path, loss):
    tree = run_train(tmp_path, mode="tree", loss=loss, out="tree").losses
    dense = run_train(tmp_path, mode="dense", loss=loss, out="dense").losses
    # a GRPO loss whose advantages cancel is 0 in exact arithmetic: float64 round-off (~1e-17) in either mode,
    # whose tokens are summed in another order (tree packs are laid out largest subtree first)
    assert len(tree) == 2 and all(abs(a - b) <= 1e-9 * max(abs(b), 1e-6) for a, b in zip(tree, dense)), (tree, dense)


def test_activation_checkpointing_recomputes_tree_layers(tmp_path):
    """transformers recomputes each decoder layer in backward with the tree mask it was given in forward
    (the ``treepack`` implementation stays installed for that): same trajectory as without checkpointing.
    (exact_float64 is a forward-time mode, not active in the recompute: plain float64 on both sides.)"""
    plain = run_train(tmp_path, out="plain", exact=False).losses
    layers = run_train(tmp_path, out="ckpt", ckpt_layers=True, exact=False).losses
    assert all(abs(a - b) <= 1e-12 * abs(b) for a, b in zip(plain, layers)), (plain, layers)


def test_our_decoder_and_transformers_agree_and_auto_picks_ours(tmp_path):
    ours = run_train(tmp_path, arch="qwen3", source="treepack", out="ours").losses
    hf = run_train(tmp_path, arch="qwen3", source="hf", out="hf").losses
    assert all(abs(a - b) <= 1e-9 * abs(b) for a, b in zip(ours, hf)), (ours, hf)
    write_rollouts(tmp_path / "rollouts.jsonl")
    q = parse_config(BODY.format(ckpt=checkpoint(tmp_path, "qwen3"), source="auto", mode="tree", steps=1,
                                 loss="sft", out="x", ckpt_layers="false"), base_dir=tmp_path)
    g = parse_config(BODY.format(ckpt=checkpoint(tmp_path, "gemma2"), source="auto", mode="tree", steps=1,
                                 loss="sft", out="x", ckpt_layers="false"), base_dir=tmp_path)
    assert q.model.resolved_source() == "treepack" and g.model.resolved_source() == "hf"


def test_resume_continues_the_same_run(tmp_path):
    whole = run_train(tmp_path, steps=3, out="whole").losses
    run_train(tmp_path, steps=1, out="cut")
    resumed = run_train(tmp_path, steps=3, out="cut").losses
    assert all(abs(a - b) <= 1e-12 * abs(b) for a, b in zip(whole, resumed)), (whole, resumed)


def test_dfs_and_missing_checkpoint_are_config_errors(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="train.mode = 'dfs' is not available with model.source = 'hf'"):
        run_train(tmp_path, mode="dfs")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.toml").write_text("[model]\nsource = 'hf'\n[data]\nshards = 'p'\n")
    r = run("train", "config.toml")
    message = "Error: config.toml: model.source = 'hf' needs model.checkpoint (a local Hugging Face checkpoint dir)\n"
    assert (r.code, r.err) == (1, message)
