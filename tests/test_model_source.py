"""Model sources (`treepack.train.model_source`): the loop builds its model through the registry, ``hf`` registers
itself from ``treepack.hf.trainer`` when a config asks for it (train never imports hf), unknown names are one
line."""

from __future__ import annotations

import subprocess
import sys

import pytest
from test_train_cli import write_config

import treepack.train.model_source as ms
from treepack.errors import ConfigError
from treepack.train import loop
from treepack.train.config import load_config


def test_train_imports_hf_only_when_a_config_asks_for_it():
    code = (
        "import sys\n"
        "from treepack.train import loop, parallel\n"
        "assert not [m for m in sys.modules if m.startswith('treepack.hf')], 'train imported hf'\n"
        "from treepack.train.model_source import model_source\n"
        "source = model_source('hf')\n"
        "from treepack.hf.trainer import _load, make_hf_mode\n"
        "assert (source.name, source.load, source.make_mode) == ('hf', _load, make_hf_mode)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]


def test_an_unknown_source_is_one_line():
    with pytest.raises(ConfigError) as info:
        ms.model_source("nope")
    assert str(info.value) == "model.source = 'nope' is not a registered model source (hf, treepack)"


def test_a_registered_source_is_what_the_loop_trains(tmp_path, monkeypatch):
    """A source registered under a new name builds the run's model: here our decoder through a loader that
    records its call, so the run equals the treepack source's."""
    monkeypatch.setattr(ms, "_SOURCES", dict(ms._SOURCES))  # the registration goes with the test
    calls = []

    def load(m, **kwargs):
        calls.append(kwargs)
        return ms.model_source("treepack").load(m, **kwargs)

    ms.register_model_source("recorded", load)
    assert ms.registered_sources() == ["hf", "recorded", "treepack"]
    cfg = load_config(write_config(tmp_path, steps=2, out="recorded"))
    cfg.model.source = "recorded"  # past the config's own list of names, as a plugin's would be
    got = loop.train(cfg, log=lambda line: None)
    (call,) = calls
    assert call["seed"] == 0 and str(call["dtype"]) == "torch.float64" and call["vocab_size"] == 24
    want = loop.train(load_config(write_config(tmp_path, steps=2, out="plain")), log=lambda line: None)
    assert got.losses == want.losses
