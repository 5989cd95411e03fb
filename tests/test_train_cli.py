"""``treepack train`` and ``treepack verify`` from the command line: config errors (exact message and exit
code), the example config, a 3-step CPU run against a golden loss curve, memorisation, resume, verify."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_helpers import run

from treepack.train import loop
from treepack.train.config import EXAMPLE_CONFIG, RunConfig, load_config, parse_config

GOLDEN = Path(__file__).resolve().parent / "golden" / "train_loss.json"
LINE = re.compile(r"^step \d{5} \| loss \d+\.\d{3} \| tokens [\d.]+[kMG]? \| tok/s [\d.]+[kMG]? \| "
                  r"flat tok/s [\d.]+[kMG]? \| mem \d+\.\d GB$")

# A memorisation set: 3 prompts x 3 answers sharing the prompt (and one duplicate), small vocabulary.
PROMPTS = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [9, 10, 11]]
ANSWERS = [[12, 13, 14, 15], [16, 17, 18, 19, 20], [12, 13, 21, 22, 23]]


def write_rollouts(path: Path) -> Path:
    lines = []
    for t, prompt in enumerate(PROMPTS):
        for a, answer in enumerate(ANSWERS + [ANSWERS[0]]):
            lines.append(json.dumps({"tree_id": t, "id": f"{t}/{a}", "input_ids": prompt + answer,
                                     "loss_mask": [0] * len(prompt) + [1] * len(answer), "reward": float(a % 2)}))
    path.write_text("\n".join(lines) + "\n")
    return path


CONFIG = """\
[model]
hidden_size = 32
intermediate_size = 64
num_layers = 2
num_heads = 4
num_kv_heads = 2
head_dim = 8

[data]
rollouts = ["rollouts.jsonl"]
capacity = "40"
packs_per_step = 2
{data_extra}
[train]
mode = "{mode}"
steps = {steps}
lr = {lr}
dtype = "{dtype}"
device = "{device}"
seed = 0
{extra}
[output]
dir = "{out}"
{output_extra}
"""


def write_config(tmp_path: Path, *, mode="tree", steps=3, lr=3e-3, dtype="float64", out="run", extra="",
                 output_extra="", data_extra="", device="cpu") -> Path:
    write_rollouts(tmp_path / "rollouts.jsonl")
    path = tmp_path / "config.toml"
    path.write_text(CONFIG.format(mode=mode, steps=steps, lr=lr, dtype=dtype, out=out, extra=extra,
                                  output_extra=output_extra, data_extra=data_extra, device=device))
    return path


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# --------------------------------------------------------------------------------------------------
# config errors: exact messages, exit code 1


@pytest.mark.parametrize("body,message", [
    ("[data]\nshards = 'p'\n[train]\nlrr = 0.1\n", "config.toml: unknown key 'train.lrr' (did you mean 'train.lr'?)"),
    ("[data]\nshards = 'p'\n[train.loss]\nkind = 'sft'\nclip_hihg = 0.3\n",
     "config.toml: unknown key 'train.loss.clip_hihg' (did you mean 'train.loss.clip_high'?)"),
    ("[data]\nshards = 'p'\n[modle]\n", "config.toml: unknown key 'modle' (did you mean 'model'?)"),
    ("[data]\nshards = 'p'\n[train.loss]\nkind = 'grpo'\nsteps = 3\n",  # a key under the table above it
     "config.toml: unknown key 'train.loss.steps' (did you mean 'train.steps'?)"),
    ("[data]\nshards = 'p'\n[train]\nlr = 'fast'\n", "config.toml: train.lr must be a number, got 'fast'"),
    ("[data]\nshards = 'p'\n[train]\nsteps = true\n", "config.toml: train.steps must be an integer, got true"),
    ("[data]\nshards = 'p'\n[train]\nsteps = 0\n", "config.toml: train.steps must be > 0, got 0"),
    ("[data]\nshards = 'p'\n[train]\nmode = 'flat'\n",
     "config.toml: train.mode must be one of tree, dense, dense-leaf, dfs, auto, got 'flat'"),
    ("[train]\nsteps = 3\n", "config.toml: missing [data] section (data.shards or data.rollouts)"),
    ("[data]\nshards = 'p'\nrollouts = ['r.jsonl']\n",
     "config.toml: data: set exactly one of data.shards (a packed directory) or data.rollouts (files)"),
    ("[data]\nshards = 'p'\ncapacity = '12q'\n",
     "config.toml: invalid data.capacity '12q': expected an integer or a number with k/K/M/G, e.g. 60k"),
    ("[data]\nshards = 'p'\nchild_order = 'size'\n",
     "config.toml: data.child_order must be one of auto, lex, largest-first, got 'size'"),
    ("[data]\nrollouts = 'r.jsonl'\n", "config.toml: data.rollouts must be a list of strings, got 'r.jsonl'"),
    ("[data]\nshards = 'p'\n[train]\nweight_decay = nan\n", "config.toml: train.weight_decay must be a finite number, got nan"),
    ("[data]\nshards = 'p'\n[train]\nlr = inf\n", "config.toml: train.lr must be a finite number, got inf"),
    ("[data]\nshards = 'p'\n[train]\nseed = -1\n", "config.toml: train.seed must be >= 0, got -1"),
    ("[data\nshards = 'p'\n", None),
])
def test_config_errors(tmp_path, monkeypatch, body, message):
    monkeypatch.chdir(tmp_path)
    Path("config.toml").write_text(body)
    r = run("train", "config.toml")
    assert r.code == 1 and r.out == ""
    if message is None:
        assert r.err.startswith("Error: config.toml: invalid TOML (")
    else:
        assert r.err == f"Error: {message}\n"


def test_checkpoint_that_is_no_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("file").write_text("")
    for checkpoint, what in (("nope", "no such directory"), ("file", "not a directory")):
        Path("config.toml").write_text(f"[model]\ncheckpoint = '{checkpoint}'\n[data]\nshards = 'p'\n")
        r = run("train", "config.toml")
        assert (r.code, r.out, r.err) == (1, "", f"Error: config.toml: model.checkpoint: {what}: {checkpoint}\n")


def test_missing_config_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = run("train", "nope.toml")
    assert (r.code, r.err) == (1, "Error: nope.toml: no such file\n")


@pytest.mark.parametrize("attention,reason", [
    ("triton", "the triton backend needs CUDA tensors (or TRITON_INTERPRET=1 on CPU), got cpu"),
    ("fa4", "the fa4 backend needs CUDA tensors, got cpu"),
    ("flex", "torch's FlexAttention has no backward on CPU; use 'reference' or 'auto' there"),
])
def test_a_named_kernel_that_cannot_run_stops_before_the_first_step(tmp_path, monkeypatch, attention, reason):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    r = run("train", write_config(tmp_path, dtype="float32", extra=f"attention = '{attention}'\n"))
    assert (r.code, r.out) == (1, "")
    assert r.err == f"Error: train.attention = '{attention}': {reason}\n"


def test_example_config_is_the_defaults():
    r = run("train", "--example-config")
    assert r.code == 0 and r.out == EXAMPLE_CONFIG
    assert parse_config(EXAMPLE_CONFIG) == RunConfig()


# --------------------------------------------------------------------------------------------------
# training runs


def test_save_final_false_writes_no_checkpoint(tmp_path):
    """A benchmark run of a large model need not write its checkpoint: the steps run, metrics are kept,
    no checkpoint directory and no 'saved' line."""
    r = run("train", write_config(tmp_path, steps=2, output_extra="save_final = false"))
    assert r.code == 0, r.err
    assert not (tmp_path / "run" / "checkpoint").exists()
    assert not [line for line in r.out.splitlines() if line.startswith("saved ")]
    assert [m["step"] for m in metrics(tmp_path / "run")] == [1, 2]


def test_three_step_run_matches_golden(tmp_path):
    cfg = write_config(tmp_path)
    r = run("train", cfg)
    assert r.code == 0, r.err
    lines = r.out.splitlines()
    banner, steps = lines[:3], [line for line in lines[3:] if not line.startswith("eta ")]
    assert banner[0] == "treepack train: tree mode on cpu (float64), 3 steps"
    assert banner[1].startswith("model: random init (qwen3), ") and banner[2].startswith("data: ")
    eta = [line for line in lines if line.startswith("eta ")]
    assert len(eta) == 1 and re.fullmatch(r"eta \d+s: 1 more step at \d+\.\d\d s/step \(the first step took "
                                          r"\d+\.\d\d s\)", eta[0]), eta
    assert lines.index(eta[0]) == 5  # right after the second step's line
    assert all(LINE.match(line) for line in steps[:3]), lines
    assert steps[3] == f"saved {tmp_path / 'run' / 'checkpoint'} (step 3)"
    got = {"losses": [m["loss"] for m in metrics(tmp_path / "run")],
           "tokens": [m["tokens"] for m in metrics(tmp_path / "run")],
           "flat_tokens": [m["flat_tokens"] for m in metrics(tmp_path / "run")]}
    if os.environ.get("TREEPACK_UPDATE_GOLDEN"):
        GOLDEN.write_text(json.dumps({"config": cfg.read_text(), **got}, indent=2) + "\n")
    golden = json.loads(GOLDEN.read_text())
    assert got["tokens"] == golden["tokens"] and got["flat_tokens"] == golden["flat_tokens"]
    assert got["losses"] == pytest.approx(golden["losses"], rel=1e-6)
    assert (tmp_path / "run" / "checkpoint" / "model.safetensors").is_file()


def test_dense_and_tree_runs_follow_one_trajectory(tmp_path):
    tree = write_config(tmp_path, mode="tree", out="tree")
    assert run("train", tree).code == 0
    dense = write_config(tmp_path, mode="dense", out="dense")
    assert run("train", dense).code == 0
    lt = [m["loss"] for m in metrics(tmp_path / "tree")]
    ld = [m["loss"] for m in metrics(tmp_path / "dense")]
    assert lt == pytest.approx(ld, rel=1e-9)
    mt, md = metrics(tmp_path / "tree"), metrics(tmp_path / "dense")
    assert all(a["tokens"] < b["tokens"] for a, b in zip(mt, md))  # tree forwards fewer tokens
    assert [m["flat_tokens"] for m in mt] == [m["flat_tokens"] for m in md]


@pytest.mark.parametrize("mode", ["tree", "dfs"])
def test_child_order_largest_first_trains_the_same(tmp_path, monkeypatch, mode):
    """data.child_order = "largest-first" lays out every pack again (this data has a branch whose larger
    child is not the first lexicographically) and the run's losses equal the lex run's; dfs walks it."""
    from treepack.pack.layout import relayout
    from treepack.train import data

    assert parse_config("[data]\nshards = 'p'\nchild_order = 'largest-first'\n").data.child_order == "largest-first"
    orders = []

    def spy(pack, child_order):
        orders.append(child_order)
        return relayout(pack, child_order)

    monkeypatch.setattr(data, "relayout", spy)
    extra = "[train.dfs]\nblock_size = 4\n" if mode == "dfs" else ""
    lex = write_config(tmp_path, mode=mode, out="lex", extra=extra, data_extra='child_order = "lex"')
    assert run("train", lex).code == 0
    n = len(orders)
    big = write_config(tmp_path, mode=mode, out="big", extra=extra, data_extra='child_order = "largest-first"')
    r = run("train", big)
    assert r.code == 0, r.err
    assert n > 0 and orders == ["lex"] * n + ["largest-first"] * n
    packs = data.load_packs(tmp_path / "rollouts.jsonl", capacity=40)
    moved = [relayout(p, "largest-first") for p in packs]
    assert any(not np.array_equal(a.subtree_end, b.subtree_end) for a, b in zip(packs, moved))
    a, b = metrics(tmp_path / "lex"), metrics(tmp_path / "big")
    assert [m["loss"] for m in b] == pytest.approx([m["loss"] for m in a], rel=1e-9)
    assert [m["tokens"] for m in b] == [m["tokens"] for m in a]


@pytest.mark.parametrize(("mode", "order"), [("tree", "largest-first"), ("auto", "largest-first"), ("dfs", "lex"),
                                             ("dense", "lex"), ("dense-leaf", "lex")])
def test_child_order_auto_is_largest_first_where_tree_attention_reads_the_layout(tmp_path, monkeypatch, mode, order):
    """The default ``data.child_order = "auto"``: largest-first for tree and auto, lex for dfs and the dense modes;
    an explicit order is kept whatever the mode."""
    from treepack.pack.layout import relayout
    from treepack.train import data

    base = f"[data]\nshards = 'p'\n[train]\nmode = '{mode}'\n"
    assert parse_config(base).data.child_order == "auto" and parse_config(base).child_order == order
    for explicit in ("lex", "largest-first"):
        cfg = parse_config(base.replace("[train]", f"child_order = '{explicit}'\n[train]"))
        assert cfg.child_order == explicit
    orders = []

    def spy(pack, child_order):
        orders.append(child_order)
        return relayout(pack, child_order)

    monkeypatch.setattr(data, "relayout", spy)
    r = run("train", write_config(tmp_path, mode=mode, steps=1, extra="[train.dfs]\nblock_size = 4\n" if mode == "dfs" else ""))
    assert r.code == 0, r.err
    assert orders and set(orders) == {order}


def test_memorisation_lowers_the_loss(tmp_path):
    cfg = write_config(tmp_path, steps=40, lr=1e-2, dtype="float32")
    r = run("train", cfg)
    assert r.code == 0, r.err
    losses = [m["loss"] for m in metrics(tmp_path / "run")]
    assert losses[-1] < 0.2 * losses[0], losses


def test_grpo_run_uses_group_advantages(tmp_path):
    cfg = write_config(tmp_path, steps=2, extra="[train.loss]\nkind = 'grpo'\nclip_high = 0.28\n")
    r = run("train", cfg)
    assert r.code == 0, r.err
    assert all("clip_fraction" in m for m in metrics(tmp_path / "run"))


def test_grpo_without_a_reward_stops_before_the_first_step(tmp_path):
    """A record without a reward fails at the start, named, not at the (late) step that batches it."""
    cfg = write_config(tmp_path, steps=3, extra="[train.loss]\nkind = 'grpo'\n")
    lines = (tmp_path / "rollouts.jsonl").read_text().splitlines()
    last = json.loads(lines[-1])
    del last["reward"]
    (tmp_path / "rollouts.jsonl").write_text("\n".join(lines[:-1] + [json.dumps(last)]) + "\n")
    r = run("train", cfg)
    assert (r.code, r.out) == (1, "")
    assert r.err == (f"Error: {tmp_path / 'rollouts.jsonl'}: record 11 (id '2/3'): no 'reward' (nor 'advantage'); "
                     "the grpo loss needs one for every sequence (1 of 12 have neither)\n")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_grpo_kl_without_behaviour_logprobs_is_refused(tmp_path):
    """The KL is to the data's behaviour log-probs: without any it is 0 and kl_coef would do nothing."""
    r = run("train", write_config(tmp_path, steps=1, extra="[train.loss]\nkind = 'grpo'\nkl_coef = 0.04\n"))
    assert (r.code, r.out) == (1, "")
    assert r.err == ("Error: train.loss.kl_coef = 0.04 needs behaviour log-probs ('logprobs' of the records), "
                     "which the data have none of: the KL to them would be 0\n")


def test_resume_continues_the_same_run(tmp_path):
    full = write_config(tmp_path, steps=4, out="full")
    assert run("train", full).code == 0
    part = write_config(tmp_path, steps=4, out="part", output_extra="save_every = 2")
    assert run("train", part, "--steps", "2").code == 0
    r = run("train", part)
    assert r.code == 0 and r.out.splitlines()[3] == f"resumed from {tmp_path / 'part' / 'checkpoint'} at step 2"
    a = [m["loss"] for m in metrics(tmp_path / "full")]
    b = [m["loss"] for m in metrics(tmp_path / "part")]
    assert b == pytest.approx(a, rel=1e-12)
    r = run("train", part)
    assert r.out.splitlines()[-1] == f"nothing to do: {tmp_path / 'part'} already holds step 4"
    r = run("train", part, "--steps", "2")  # fewer steps than the checkpoint holds: it names the step it holds
    assert r.out.splitlines()[-1] == f"nothing to do: {tmp_path / 'part'} already holds step 4"


def test_resume_applies_the_configs_adamw_settings_and_says_so(tmp_path):
    """torch's optimizer loader takes the saved betas and weight decay; the config's win, the log says which
    changed, and the next checkpoint holds them."""
    assert run("train", write_config(tmp_path, steps=4, out="part"), "--steps", "2").code == 0
    changed = write_config(tmp_path, steps=4, out="part", extra="beta2 = 0.99\nweight_decay = 0.1\n")
    r = run("train", changed)
    assert r.code == 0, r.err
    assert r.out.splitlines()[4] == ("resumed with the config's AdamW settings, not the checkpoint's: "
                                     "train.beta2 0.95 -> 0.99, train.weight_decay 0 -> 0.1")
    groups = json.loads((tmp_path / "part" / "checkpoint" / "trainer.json").read_text())["param_groups"]
    assert [(g["betas"], g["weight_decay"]) for g in groups] == [([0.9, 0.99], 0.1), ([0.9, 0.99], 0.0)]
    same = run("train", write_config(tmp_path, steps=6, out="part", extra="beta2 = 0.99\nweight_decay = 0.1\n"))
    assert same.code == 0 and not any("AdamW settings" in line for line in same.out.splitlines())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_a_step_read_back_during_the_next_one_logs_what_its_end_would(tmp_path, device):
    """`train` reads a step's loss and gradient norm back once the next step's first pack is queued (on CUDA
    through a non-blocking copy and events); a checkpoint at every step makes it read each step at its own
    end: same steps, values and lines, in order."""
    keys = ("step", "loss", "lr", "grad_norm", "tokens", "flat_tokens", "loss_tokens")
    runs = {}
    for name, output_extra in (("later", ""), ("at-end", "save_every = 1")):
        r = run("train", write_config(tmp_path, steps=5, out=name, output_extra=output_extra, device=device))
        assert r.code == 0, r.err
        steps = [line[:10] for line in r.out.splitlines() if line.startswith("step ")]
        assert steps == [f"step {i:05d}" for i in range(1, 6)]
        runs[name] = [{k: m[k] for k in keys} for m in metrics(tmp_path / name)]
    assert runs["later"] == runs["at-end"]


@pytest.mark.parametrize("mode", ["tree", "dfs"])
def test_grpo_clip_fraction_is_read_back_with_its_step(tmp_path, mode):
    """The clip fraction stays a device tensor until its step is read back: the same value whether that is
    during the next step or at the step's own end (a checkpoint every step), and not always zero."""
    extra = ("[train.dfs]\nblock_size = 4\n" if mode == "dfs" else "") + "[train.loss]\nkind = 'grpo'\n"
    fractions = {}
    for name, output_extra in (("later", ""), ("at-end", "save_every = 1")):
        cfg = write_config(tmp_path, mode=mode, steps=4, out=name, extra=extra, output_extra=output_extra)
        records = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
        for i, rec in enumerate(records):  # behaviour log-probs far enough from the policy's to clip some rows
            rec["logprobs"] = [-0.5 * ((i + j) % 7) for j in range(len(rec["input_ids"]))]
        (tmp_path / "rollouts.jsonl").write_text("".join(json.dumps(rec) + "\n" for rec in records))
        r = run("train", cfg)
        assert r.code == 0, r.err
        fractions[name] = [m["clip_fraction"] for m in metrics(tmp_path / name)]
    assert fractions["later"] == fractions["at-end"]
    assert all(isinstance(f, float) and 0 <= f <= 1 for f in fractions["later"])
    assert any(f > 0 for f in fractions["later"])


def fail_at_step_4(monkeypatch) -> None:
    """The run's 4th step (index 3) raises before it runs, as an out-of-memory error would."""
    real = loop.step_batch

    def failing(step, *args):
        if step == 3:
            raise RuntimeError("out of memory, say")
        return real(step, *args)

    monkeypatch.setattr(loop, "step_batch", failing)


def test_a_failing_step_still_logs_the_step_before(tmp_path, monkeypatch):
    fail_at_step_4(monkeypatch)
    cfg = load_config(write_config(tmp_path, steps=5))
    cfg.output.dir = str(tmp_path / "run")
    lines: list[str] = []
    with pytest.raises(RuntimeError, match="out of memory, say"):
        loop.train(cfg, log=lines.append)
    assert [line[:10] for line in lines if line.startswith("step ")] == [f"step {i:05d}" for i in (1, 2, 3)]
    assert [m["step"] for m in metrics(tmp_path / "run")] == [1, 2, 3]


def test_resume_after_a_failure_records_each_step_once(tmp_path, monkeypatch):
    """A run stopped after its last checkpoint logged steps it runs again on resume: metrics.jsonl keeps
    one line per step, the resumed run's."""
    fail_at_step_4(monkeypatch)
    cfg = load_config(write_config(tmp_path, steps=5, output_extra="save_every = 2"))
    with pytest.raises(RuntimeError, match="out of memory, say"):
        loop.train(cfg, log=lambda line: None)
    assert [m["step"] for m in metrics(tmp_path / "run")] == [1, 2, 3]
    monkeypatch.undo()  # step 4 runs again
    loop.train(cfg, log=lambda line: None)
    assert [m["step"] for m in metrics(tmp_path / "run")] == [1, 2, 3, 4, 5]


def test_metrics_file_in_a_subdirectory(tmp_path):
    r = run("train", write_config(tmp_path, steps=1, output_extra="metrics = 'logs/metrics.jsonl'"))
    assert r.code == 0, r.err
    assert [json.loads(line)["step"] for line in (tmp_path / "run" / "logs" / "metrics.jsonl").open()] == [1]


# --------------------------------------------------------------------------------------------------
# verify


def test_verify_cli_on_rollouts(tmp_path):
    data = write_rollouts(tmp_path / "r.jsonl")
    r = run("verify", data, "--capacity", "40", "--packs", "0", "--json", "--loss", "grpo")
    assert r.code == 0, r.err
    out = json.loads(r.out)
    assert out["ok"] is True and out["layout_ok"] is True
    assert out["max_rel_grad_diff"] <= 1e-9 and set(out["losses"]) == {"dense", "tree"}
    assert out["packs"] == 2 and out["sequences"] == 12  # trees 0 + 1 (32 tokens, sharing 1,2,3) fit 40, tree 2 alone
    r = run("verify", data, "--capacity", "40")
    assert r.code == 0 and "OK: every mode matches dense within 1e-09 relative" in r.out


def test_verify_cli_errors(tmp_path):
    r = run("verify", tmp_path / "missing.jsonl")
    assert (r.code, r.err) == (1, f"Error: {tmp_path / 'missing.jsonl'}: no such file or directory\n")
    data = write_rollouts(tmp_path / "r.jsonl")
    r = run("verify", data, "--capacity", "5")
    assert (r.code, r.err) == (1, f"Error: {data}: sequence id '0/0' (record 0) has 10 tokens, more than the capacity 5\n")
    r = run("verify", data, "--modes", "dense,flat")
    assert (r.code, r.out, r.err) == (2, "", VERIFY_USAGE + "Error: Invalid value for --modes: must be one of tree, "
                                      "dense, dense-leaf, dfs, auto, got 'flat'\n")
    for option in ("--capacity", "--micro-batch-tokens"):  # usage errors, as in pack and stats: exit 2
        r = run("verify", data, option, "-5")
        assert r.code == 2 and f"Invalid value for {option}: invalid " in r.err and "'-5'" in r.err
    r = run("verify", data, "--attention", "fast")  # before any work, not a FAIL row after it
    assert r.code == 2 and r.out == ""
    assert "Invalid value for --attention: must be one of auto, reference, flex, triton, fa4, got 'fast'" in r.err
    r = run("verify", data, "--device", "gpu")
    assert r.code == 2 and "Invalid value for --device: must be one of cpu, cuda, got 'gpu'" in r.err


VERIFY_USAGE = "Usage: treepack verify [OPTIONS] {SHARDS_DIR}...\nTry 'treepack verify --help' for help.\n\n"


@pytest.mark.parametrize("args, error", [
    (["--modes", "bogus"], "--modes: must be one of tree, dense, dense-leaf, dfs, auto, got 'bogus'"),
    (["--modes", "dense,dfs", "--dfs-keep-tokens", "-1"], "--dfs-keep-tokens: must be >= 0, got -1"),
    (["--normalization", "bogus"], "--normalization: must be one of token, sequence, got 'bogus'"),
    (["--attention", "flex"], ("--attention: 'flex' cannot run here: torch's FlexAttention has no backward on CPU; "
                               "use 'reference' or 'auto' there")),
    (["--attention", "triton"], ("--attention: 'triton' cannot run here: the triton backend needs CUDA tensors (or "
                                 "TRITON_INTERPRET=1 on CPU), got cpu")),
    (["--attention", "fa4"], "--attention: 'fa4' cannot run here: the fa4 backend needs CUDA tensors, got cpu"),
])
def test_verify_usage_errors_come_before_any_work(tmp_path, monkeypatch, args, error):
    """Exit 2 and the one error, with no progress line before it: not a FAIL after the baseline ran."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    r = run("verify", write_rollouts(tmp_path / "r.jsonl"), "--capacity", "40", *args)
    assert (r.code, r.out, r.err) == (2, "", f"{VERIFY_USAGE}Error: Invalid value for {error}\n")


def test_verify_says_what_it_left_out(tmp_path):
    data = write_rollouts(tmp_path / "r.jsonl")  # 2 packs at 40: trees 0 + 1 (8 sequences), tree 2 (4)
    r = run("verify", data, "--capacity", "40")
    assert r.code == 0, r.err
    assert r.out.splitlines()[0] == "treepack verify: 1 of 2 packs (--packs 1), 8 of 12 sequences, float64, sft loss"
    assert re.fullmatch(r"verify: 1 of 2 packs \(32 tree tokens\) from .*r\.jsonl \(\d+\.\d s\)",
                        r.err.splitlines()[0])
    out = json.loads(run("verify", data, "--capacity", "40", "--json").out)
    assert [out[k] for k in ("packs", "packs_total", "sequences", "sequences_total")] == [1, 2, 8, 12]
    assert isinstance(out["vocab_size"], int) and out["vocab"].startswith(f"{out['vocab_size']:,} ")
    r = run("verify", data, "--capacity", "40", "--packs", "0", "-q")
    assert r.out.splitlines()[0] == "treepack verify: 2 packs, 12 sequences, float64, sft loss"
    r = run("verify", data, "--capacity", "64", "-q")  # one pack holds all: nothing left out
    assert r.out.splitlines()[0] == "treepack verify: 1 pack, 12 sequences, float64, sft loss"
    assert run("pack", data, "-c", "40", "-o", tmp_path / "packs").code == 0  # a pack directory: its manifest counts
    counts = json.loads((tmp_path / "packs" / "manifest.json").read_text())["counts"]
    out = json.loads(run("verify", tmp_path / "packs", "--json").out)
    assert (out["packs"], out["packs_total"], out["sequences_total"]) == (1, counts["packs"], 12)


def test_verify_names_the_files_a_directory_held_and_did_not_read(tmp_path):
    from treepack.io.ingest import SUPPORTED_TEXT

    d = tmp_path / "data"
    d.mkdir()
    write_rollouts(d / "r.jsonl")
    (d / "notes.txt").write_text("hello")
    why = f"not a rollout file (.txt; reading {SUPPORTED_TEXT})"
    r = run("verify", d, "--capacity", "40", "-q")
    assert r.code == 0 and r.err == f"skipped 1 file not read as rollouts:\n  {d / 'notes.txt'}: {why}\n"
    r = run("verify", d, "--capacity", "40", "--json")
    assert r.err == f"skipped 1 file not read as rollouts:\n  {d / 'notes.txt'}: {why}\n"
    assert json.loads(r.out)["skipped_files"] == [{"path": str(d / "notes.txt"), "reason": why}]


def test_verify_json_reports_null_for_a_mode_that_could_not_run(tmp_path, monkeypatch):
    """A mode that fails (here: fa4 on a CPU, past the usage check) has no loss and no difference: null, not 0.0."""
    import treepack.cli.verify as verify_cli

    monkeypatch.setattr(verify_cli, "check_kernel", lambda *args: None)
    data = write_rollouts(tmp_path / "r.jsonl")
    r = run("verify", data, "--capacity", "40", "--attention", "fa4", "--json")
    assert r.code == 1
    out = json.loads(r.out)
    assert out["failures"] == ["tree: could not run (pack 0: impl='fa4': the fa4 backend needs CUDA tensors, got cpu)"]
    tree = out["modes"]["tree"]
    assert [tree[k] for k in ("loss", "max_rel_grad_diff", "mean_rel_grad_diff", "max_logprob_diff")] == [None] * 4
    assert out["losses"]["tree"] is None and out["losses"]["dense"] > 0
    assert out["max_rel_grad_diff"] is None and out["mean_rel_grad_diff"] is None and out["max_logprob_diff"] is None
    r = run("verify", data, "--capacity", "40", "--attention", "fa4", "-q")
    assert r.code == 1 and re.search(r"^  tree +error +- +- +- +$", r.out, re.MULTILINE), r.out
    assert r.out.splitlines()[-1] == ("FAIL: tree: could not run (pack 0: impl='fa4': the fa4 backend needs CUDA "
                                      "tensors, got cpu)")


def test_verify_fails_when_its_reference_run_could_not_run(tmp_path, monkeypatch):
    """Low precision: a reference run that failed measured no error; every mode's must not pass as 0."""
    import treepack.train.verify as verify_lib
    from treepack.train.data import load_packs

    real = verify_lib.make_mode

    def make_mode(name, **options):
        mode = real(name, **options)

        def run_mode(model, *args):
            if next(model.parameters()).dtype == torch.float64:  # --dtype float32: only the reference
                raise RuntimeError("boom")
            return mode(model, *args)
        return run_mode

    monkeypatch.setattr(verify_lib, "make_mode", make_mode)
    report = verify_lib.verify_packs(load_packs(write_rollouts(tmp_path / "r.jsonl"), capacity=40), dtype="float32")
    assert (report.ok, report.failures) == (False, ["reference (dense in float64): could not run (pack 0: boom)"])
    assert [m.ref_rel_grad_diff for m in report.modes.values()] == [None, None]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error of a machine without CUDA")
def test_verify_on_cuda_without_cuda(tmp_path):
    r = run("verify", write_rollouts(tmp_path / "r.jsonl"), "--device", "cuda")
    assert r.code == 2 and r.out == "" and "Invalid value for --device: CUDA is not available" in r.err


def _corrupt_shard(directory: Path, column: str) -> None:
    """Rewrite one pack of a shard with a wrong ``parent`` (a token re-hung under another node of its
    parent's depth: chains keep their lengths) or a wrong ``subtree_end`` (one subtree widened)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = next(directory.glob("*.parquet"))
    t = pq.read_table(f)
    rows = t.column(column).to_pylist()
    parent, pos = t.column("parent").to_pylist()[0], t.column("position_ids").to_pylist()[0]
    r = rows[0]
    if column == "parent":
        q = next(q for q in range(len(r) - 1, 0, -1)
                 if r[q] >= 0 and any(pos[i] == pos[r[q]] and i != r[q] for i in range(q)))
        r[q] = next(i for i in range(q) if pos[i] == pos[parent[q]] and i != parent[q])
    else:
        k = next(k for k in range(len(r)) if r[k] < len(r))
        r[k] += 1
    rows[0] = r
    t = t.set_column(t.schema.get_field_index(column), column, pa.array(rows, type=t.schema.field(column).type))
    pq.write_table(t, f)


@pytest.mark.parametrize("column", ["parent", "subtree_end"])
def test_verify_fails_on_corrupted_shards(tmp_path, column):
    data = write_rollouts(tmp_path / "r.jsonl")
    assert run("pack", data, "-c", "40", "-o", tmp_path / "packs").code == 0
    r = run("verify", tmp_path / "packs", "--packs", "0", "--json")
    assert r.code == 0 and json.loads(r.out)["ok"] is True
    _corrupt_shard(tmp_path / "packs", column)
    r = run("verify", tmp_path / "packs", "--packs", "0", "--json")
    assert r.code == 1
    out = json.loads(r.out)
    assert out["ok"] is False
    assert out.get("error") or (not out["layout_ok"] and out["max_rel_grad_diff"] > 1e-9)
    r = run("verify", tmp_path / "packs", "--packs", "0")
    shard = tmp_path / "packs" / "shard-00000.parquet"  # the manifest's integrity check names the changed shard
    assert r.code == 1 and ("FAIL: " in r.out or r.err.startswith(("Error: corrupt pack", f"Error: {shard}: ")))


def test_compact_vocab_resume_refuses_other_token_ids_and_keeps_the_map(tmp_path):
    """A resume with model.compact_vocab must see the ids its checkpoint learned: shifted ids (as many distinct
    ones) would silently hand every embedding row to another token; vocab.json stays as the checkpoint's."""
    def config(steps):
        path = write_config(tmp_path, steps=steps, out="cv")
        path.write_text(path.read_text().replace("[model]\n", "[model]\ncompact_vocab = true\n", 1))
        return path

    assert run("train", config(4), "--steps", "2").code == 0
    vocab = (tmp_path / "cv" / "vocab.json").read_text()
    data = tmp_path / "rollouts.jsonl"
    shifted = [{**rec, "input_ids": [t + 1 for t in rec["input_ids"]]} for rec in map(json.loads, data.read_text().splitlines())]
    cfg = config(4)  # rewrites rollouts.jsonl: shift it after
    data.write_text("".join(json.dumps(rec) + "\n" for rec in shifted))
    r = run("train", cfg)
    assert r.code == 1 and r.err.startswith(f"Error: {tmp_path / 'cv' / 'vocab.json'}: model.compact_vocab: the data's "
                                            "token ids are not the ones the checkpoint was trained on")
    assert (tmp_path / "cv" / "vocab.json").read_text() == vocab
    same = run("train", config(4))  # the checkpoint's own data resumes
    assert same.code == 0 and same.out.splitlines()[3].startswith("resumed from")


def test_vocab_too_small_names_the_key_and_resume_false_says_it_starts_over(tmp_path):
    small = write_config(tmp_path, steps=1, out="v")
    small.write_text(small.read_text().replace("[model]\n", "[model]\nvocab_size = 5\n", 1))
    r = run("train", small)
    assert r.code == 1 and r.err.startswith("Error: the data has token id ")
    assert r.err.endswith(", more than model.vocab_size holds (5); set it higher, or 0 for the data's largest id + 1\n")
    assert run("train", write_config(tmp_path, steps=1, out="again")).code == 0
    r = run("train", write_config(tmp_path, steps=1, out="again", output_extra="resume = false"))
    assert r.code == 0 and (f"output.resume = false: starting over; the checkpoint in {tmp_path / 'again' / 'checkpoint'} "
                            "will be replaced") in r.out.splitlines()
    r = run("train", write_config(tmp_path, steps=1), "-o", "")
    assert r.code == 2 and "Invalid value for --output-dir: must not be empty" in r.err
