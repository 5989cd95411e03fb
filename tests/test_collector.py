"""Python's collector in the training loop (`treepack.train.collector`): collections are timed and counted,
the first step's survivors are frozen once and given back when training returns, and every step's metrics
carry the pauses."""

from __future__ import annotations

import gc

from test_train_cli import metrics, write_config

from treepack.train import loop
from treepack.train.collector import Pauses, freeze_warmup, thaw
from treepack.train.config import load_config


def test_pauses_time_and_count_full_collections():
    pauses = Pauses()
    pauses.start()
    try:
        gc.collect()  # a full collection
        gc.collect(0)
        seconds, full = pauses.take()
        assert seconds > 0 and full == 1
        assert pauses.take() == (0.0, 0)
    finally:
        pauses.stop()
    assert pauses._on_collection not in gc.callbacks
    gc.collect()
    assert pauses.take() == (0.0, 0)  # stopped: nothing counted


def test_freeze_and_thaw():
    thaw()
    assert gc.get_freeze_count() == 0
    freeze_warmup()
    try:
        assert gc.get_freeze_count() > 0
    finally:
        thaw()
    assert gc.get_freeze_count() == 0


def test_training_freezes_after_the_first_step_and_reports_pauses(tmp_path, monkeypatch):
    monkeypatch.setattr(loop, "_manages_gc", lambda model, device: True)
    frozen_at = []

    def freeze():
        frozen_at.append(len(metrics(tmp_path / "run")))  # steps logged before the freeze
        freeze_warmup()

    monkeypatch.setattr(loop, "freeze_warmup", freeze)
    cfg = load_config(write_config(tmp_path, steps=3))
    result = loop.train(cfg, log=lambda line: None)
    assert frozen_at == [1]  # once, after the first step
    assert gc.get_freeze_count() == 0  # given back on return
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3] and len(result.losses) == 3
    for r in rows:
        assert r["gc_seconds"] >= 0 and isinstance(r["gc_full"], int)


def test_eager_cpu_training_leaves_the_collector_alone(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(loop, "freeze_warmup", lambda: calls.append(1))
    cfg = load_config(write_config(tmp_path, steps=2))
    loop.train(cfg, log=lambda line: None)
    assert calls == [] and "gc_seconds" not in metrics(tmp_path / "run")[0]
