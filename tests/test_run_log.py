"""Where ``treepack train``'s step numbers go (`treepack.train.run_log`): TensorBoard's event files read back hold
metrics.jsonl's numbers step for step, a resumed run's included; W&B gets the same tags, offline; a logger whose
package is missing is one error line before any work."""

from __future__ import annotations

import importlib.util
import json
import sys
import types

import pytest
from cli_helpers import run
from test_train_cli import fail_at_step_4, metrics, write_config

from treepack.errors import ConfigError
from treepack.train import loop
from treepack.train.config import load_config
from treepack.train.run_log import tags

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def scalars(directory) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series of the event files in ``directory``: tag -> [(step, value)], as TensorBoard shows it."""
    acc = event_accumulator.EventAccumulator(str(directory), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tags_of_a_data_parallel_record():
    record = {"step": 7, "loss": 1.5, "lr": 0.01, "tok_per_s": 200.0, "mfu": 0.4, "mem_gb": 1.25, "world_size": 2,
              "rank_seconds": [1.0, 3.0], "rank_cost": [30, 10], "imbalance_measured": 1.5, "clip_fraction": 0.25,
              "gc_full": 0, "note": "text"}
    assert tags(record) == {
        "train/loss": 1.5, "train/lr": 0.01, "speed/tok_per_s": 200.0, "speed/mfu": 0.4, "memory/peak_gb": 1.25,
        "balance/world_size": 2.0, "balance/imbalance_measured": 1.5, "extra/clip_fraction": 0.25, "extra/gc_full": 0.0,
        "rank/seconds/0": 1.0, "rank/seconds/1": 3.0, "rank/cost/0": 30.0, "rank/cost/1": 10.0,
        "rank/load_measured/0": 0.5, "rank/load_measured/1": 1.5, "rank/load_predicted/0": 1.5,
        "rank/load_predicted/1": 0.5,
    }


def test_tensorboard_events_hold_the_step_numbers(tmp_path):
    r = run("train", write_config(tmp_path, steps=3, output_extra="tensorboard = true"))
    assert r.code == 0, r.err
    board = tmp_path / "run" / "tensorboard"
    assert f"tensorboard: tensorboard --logdir {board}" in r.out.splitlines()
    rows = metrics(tmp_path / "run")
    got = scalars(board)
    for key, tag in (("loss", "train/loss"), ("lr", "train/lr"), ("grad_norm", "train/grad_norm"),
                     ("tok_per_s", "speed/tok_per_s"), ("flat_tok_per_s", "speed/flat_tok_per_s"),
                     ("mem_gb", "memory/peak_gb"), ("tokens", "data/tokens")):
        assert [s for s, _ in got[tag]] == [1, 2, 3], tag
        assert [v for _, v in got[tag]] == pytest.approx([m[key] for m in rows], rel=1e-6), tag  # float32 events


def test_a_resumed_run_shows_each_step_once_in_tensorboard(tmp_path, monkeypatch):
    """Killed at step 4 after logging step 3 (checkpoint at 2), then resumed: TensorBoard drops the first run's
    step 3 (``purge_step``) and shows steps 1-5 once, with the resumed run's values, as metrics.jsonl does."""
    fail_at_step_4(monkeypatch)
    cfg = load_config(write_config(tmp_path, steps=5, output_extra="save_every = 2\ntensorboard = true"))
    with pytest.raises(RuntimeError, match="out of memory, say"):
        loop.train(cfg, log=lambda line: None)
    board = tmp_path / "run" / "tensorboard"
    assert [s for s, _ in scalars(board)["train/loss"]] == [1, 2, 3]
    monkeypatch.undo()
    loop.train(cfg, log=lambda line: None)
    got = scalars(board)["train/loss"]
    assert [s for s, _ in got] == [1, 2, 3, 4, 5]
    assert [v for _, v in got] == pytest.approx([m["loss"] for m in metrics(tmp_path / "run")], rel=1e-6)
    # starting over removes the old curves
    cfg.output.resume = False
    cfg.train.steps = 2
    loop.train(cfg, log=lambda line: None)
    assert [s for s, _ in scalars(board)["train/loss"]] == [1, 2]


@pytest.mark.parametrize("key,package", [("tensorboard", "tensorboard"), ("wandb", "wandb")])
def test_a_logger_whose_package_is_missing_is_one_line(tmp_path, monkeypatch, key, package):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == package else real(name, *a))
    r = run("train", write_config(tmp_path, steps=1, output_extra=f"{key} = true"))
    assert (r.code, r.out) == (1, "")
    assert r.err == (f"Error: output.{key} = true needs the {package} package (pip install {package}), "
                     "which is not installed\n")
    assert not (tmp_path / "run").exists()  # refused before any work


def test_an_empty_wandb_project_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="output.wandb_project must not be empty"):
        load_config(write_config(tmp_path, output_extra="wandb = true\nwandb_project = ''"))


class FakeWandb(types.ModuleType):
    """What `treepack.train.run_log` calls of ``wandb``: init (kwargs kept), a run's log and finish."""

    def __init__(self) -> None:
        super().__init__("wandb")
        self.inits: list[dict] = []
        self.logged: list[tuple[int, dict]] = []
        self.finished = 0

    def init(self, **kwargs):
        self.inits.append(kwargs)
        return types.SimpleNamespace(log=lambda values, step: self.logged.append((step, values)),
                                     finish=lambda: setattr(self, "finished", self.finished + 1))


def test_wandb_offline_gets_the_tags_and_a_resumed_run_continues_its_run(tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "wandb" else real(name, *a))
    path = write_config(tmp_path, steps=4, output_extra="save_every = 2\nwandb = true\nwandb_project = 'mine'")
    assert run("train", path, "--steps", "2").code == 0
    assert run("train", path).code == 0  # resumes at step 2
    first, second = fake.inits
    run_dir = tmp_path / "run"
    assert first["mode"] == second["mode"] == "offline" and first["project"] == "mine"
    assert first["dir"] == str(run_dir) and first["id"] == second["id"] and second["resume"] == "allow"
    assert first["config"]["train"]["steps"] == 2 and first["config"]["output"]["wandb"] is True
    assert (run_dir / "wandb" / "run-id").read_text().strip() == first["id"]
    rows = metrics(run_dir)
    assert [s for s, _ in fake.logged] == [m["step"] for m in rows] == [1, 2, 3, 4]
    assert [values for _, values in fake.logged] == [tags(m) for m in rows]
    assert fake.finished == 2
    assert json.loads((run_dir / "checkpoint" / "trainer.json").read_text())["step"] == 4
