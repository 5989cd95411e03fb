"""Data-parallel training under torchrun with gloo on CPU, float64: 1, 2 and 3 processes give the
single-process run's losses and weights after 2 optimizer steps (1e-9 relative) in every mode, a GRPO run
included; bf16 ranks compute in one process's dtypes; a run saved by 2 ranks resumes on 3;
``treepack train --nproc`` end to end.

One torchrun launch per world size runs every config (tests/dist_worker.py), so the module costs three
launches plus one for the CLI."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.fsdp")
from safetensors.torch import load_file

from treepack.train.config import load_config
from treepack.train.loop import train
from treepack.train.modes import MODES

HERE = Path(__file__).resolve().parent
WORLDS = (1, 2, 3)
TOL = 1e-9
ATOL = 1e-12  # on-policy GRPO losses are 0 in exact arithmetic (advantages cancel): rounding noise

CONFIG = """\
[model]
hidden_size = 32
intermediate_size = 48
num_layers = 2
num_heads = 4
num_kv_heads = 2
head_dim = 8

[data]
rollouts = ["rollouts.jsonl"]
capacity = "60"
packs_per_step = 2

[train]
mode = "{mode}"
steps = {steps}
lr = 0.003
dtype = "{dtype}"
device = "cpu"
{extra}
[train.dfs]
block_size = 8

[output]
dir = "{out}"
save_every = {save_every}
"""

# name -> (mode, extra [train] lines): every mode with SFT token-mean; GRPO with sequence-mean on the tree
RUNS = {m: (m, "") for m in MODES}
RUNS["tree-grpo"] = ("tree", "[train.loss]\nkind = 'grpo'\nnormalization = 'sequence'\n")
RUNS["dfs-recompute"] = ("dfs", "activation_checkpointing = true\n")
# bf16 autocast over float32 parameters, as one process runs it (`test_bf16_computes_as_one_process`)
RUNS["tree-bf16"] = ("tree", "")
DTYPES = {"tree-bf16": "bfloat16"}


def write_rollouts(path: Path, seed: int = 0) -> None:
    """Trees of answers under shared prompts, some with a later turn that is context only."""
    rng = random.Random(seed)
    lines = []
    for t in range(8):
        prompt = [rng.randrange(1, 60) for _ in range(rng.randrange(4, 12))]
        for a in range(rng.randrange(2, 7)):
            answer = [rng.randrange(1, 60) for _ in range(rng.randrange(2, 9))]
            context = [rng.randrange(1, 60) for _ in range(rng.randrange(0, 6))]
            lines.append(json.dumps({
                "tree_id": t, "id": f"{t}/{a}", "input_ids": prompt + answer + context,
                "loss_mask": [0] * len(prompt) + [1] * len(answer) + [0] * len(context),
                "reward": float((7 * a + t) % 3)}))
    path.write_text("\n".join(lines) + "\n")


def write_config(directory: Path, name: str, *, steps: int = 2, out: str | None = None, save_every: int = 0) -> Path:
    mode, extra = RUNS[name]
    path = directory / f"{out or name}.toml"
    path.write_text(CONFIG.format(mode=mode, steps=steps, extra=extra, out=out or name, save_every=save_every,
                                  dtype=DTYPES.get(name, "float64")))
    return path


def torchrun(nproc: int, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600, check=False)


def weights(run_dir: Path) -> dict:
    return load_file(str(run_dir / "checkpoint" / "model.safetensors"))


def losses(run_dir: Path) -> list[float]:
    return json.loads((run_dir / "checkpoint" / "trainer.json").read_text())["losses"]


def max_rel_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-300)) for k in b)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Every config: in-process single-process reference, then torchrun at 1, 2 and 3 ranks; two runs are
    saved after step 1 and resumed for step 2 at another world size (1 -> 2 and 2 -> 3)."""
    root = tmp_path_factory.mktemp("dp")
    write_rollouts(root / "rollouts.jsonl")
    for name in RUNS:
        train(load_config(write_config(root, name)), log=lambda line: None)
    for world in WORLDS:
        configs = [write_config(root, name, out=f"{name}-w{world}", save_every=1) for name in RUNS]
        if world == 1:  # saved unsharded, resumed sharded
            configs.append(write_config(root, "tree", steps=1, out="resume-1-2"))
        if world == 2:
            configs.append(write_config(root, "tree", steps=2, out="resume-1-2"))
            configs.append(write_config(root, "tree", steps=1, out="resume-2-3"))
        if world == 3:
            configs.append(write_config(root, "tree", steps=2, out="resume-2-3"))
        done = torchrun(world, str(HERE / "dist_worker.py"), *map(str, configs), cwd=root)
        assert done.returncode == 0, done.stderr[-4000:]
    return root


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", [name for name in RUNS if name not in DTYPES])
def test_same_losses_and_weights_as_one_process(runs, name, world):
    ref, dp = runs / name, runs / f"{name}-w{world}"
    np.testing.assert_allclose(losses(dp), losses(ref), rtol=TOL, atol=ATOL)
    assert max_rel_diff(weights(dp), weights(ref)) < TOL
    metrics = [json.loads(line) for line in (dp / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["world_size"] == world
        for key in ("rank_tokens", "rank_cost", "rank_packs", "rank_seconds", "rank_idle_seconds",
                    "rank_predicted_seconds"):
            assert len(m[key]) == world, key
        assert min(m["rank_idle_seconds"]) == 0.0 and 0.0 <= m["idle_fraction"] < 1.0
        assert m["imbalance_predicted"] == pytest.approx(max(m["rank_cost"]) * world / sum(m["rank_cost"]))
        assert sum(m["rank_predicted_seconds"]) == pytest.approx(sum(m["rank_seconds"]))


@pytest.mark.parametrize("world", WORLDS)
def test_bf16_computes_as_one_process(runs, world):
    """Sharded bf16 runs the single process's dtypes: float32 parameters, residual stream, norms and
    embedding, matrices under autocast. Step 1's loss is then the same forward (FSDP2's bf16 parameter policy,
    bf16 everywhere, was 1.7e-5 off here). After it only the order of float32 gradient sums differs: the
    weights match where every pack ran on one rank (2.4e-2 off with the bf16 policy), and where a pack was
    cut its two bf16 halves round apart, which flips AdamW's first update on near-zero gradients."""
    ref, dp = runs / "tree-bf16", runs / f"tree-bf16-w{world}"
    got, want = losses(dp), losses(ref)
    assert abs(got[0] - want[0]) <= 1e-6 * abs(want[0])
    np.testing.assert_allclose(got, want, rtol=1e-4)
    cut = json.loads((dp / "metrics.jsonl").read_text().splitlines()[0])["rank_packs"]
    a, b = weights(dp), weights(ref)
    worst = max(float((a[k] - b[k]).norm() / b[k].norm()) for k in b)
    assert worst < (5e-2 if sum(cut) > 2 else 1e-6), (cut, worst)


def test_packs_are_cut_when_ranks_outnumber_them(runs):
    """2 packs per step on 3 ranks: the balance cuts a pack rather than idle a rank, and the update is
    still exact (the test above); 1 rank never cuts."""
    def cut(run: str) -> list[int]:
        return [json.loads(line)["split_packs"] for line in (runs / run / "metrics.jsonl").read_text().splitlines()]

    assert cut("tree-w1") == [0, 0]
    assert max(cut("tree-w3")) > 0


@pytest.mark.parametrize("saved,resumed", [(1, 2), (2, 3)])
def test_resume_on_another_world_size(runs, saved, resumed):
    """Saved (DCP) by one world size after step 1, resumed by another for step 2: the uninterrupted run's
    weights (world size 1 saves unsharded tensors, 2 and 3 FSDP shards)."""
    run = runs / f"resume-{saved}-{resumed}"
    state = json.loads((run / "checkpoint" / "trainer.json").read_text())
    assert (state["format"], state["world_size"], state["step"]) == ("dcp", resumed, 2)
    np.testing.assert_allclose(state["losses"], losses(runs / "tree"), rtol=TOL, atol=0)
    assert max_rel_diff(weights(run), weights(runs / "tree")) < TOL


def test_single_process_resumes_a_dcp_checkpoint(runs, tmp_path):
    """A plain `treepack train` continues a data-parallel run (DCP loaded into an unsharded model)."""
    import shutil

    shutil.copytree(runs / "tree-w2", tmp_path / "run")
    (tmp_path / "rollouts.jsonl").write_text((runs / "rollouts.jsonl").read_text())
    cfg = load_config(write_config(tmp_path, "tree", steps=3, out="run"))
    result = train(cfg, log=lambda line: None)
    assert result.first_step == 3 and len(result.losses) == 3
    reference = load_config(write_config(tmp_path, "tree", steps=3, out="straight"))
    straight = train(reference, log=lambda line: None)
    np.testing.assert_allclose(result.losses, straight.losses, rtol=TOL, atol=0)


def test_cli_nproc(tmp_path):
    """``treepack train --nproc 2``: rank 0 prints the split and one line per step; the weights are the
    single-process run's."""
    write_rollouts(tmp_path / "rollouts.jsonl", seed=1)
    config = write_config(tmp_path, "tree")
    plain = train(load_config(config), log=lambda line: None)
    board = importlib.util.find_spec("tensorboard") is not None
    if board:
        config.write_text(config.read_text() + "tensorboard = true\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "treepack", "train", "--nproc", "2", str(config), "-o", "dp"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "treepack train: tree mode on cpu (float64), 2 steps"  # one process's banner, then
    assert lines[3] == "data parallel: 2 ranks (gloo, cpu), FSDP2, float64"
    if board:
        assert lines.pop(4) == "tensorboard: tensorboard --logdir dp/tensorboard"
    assert lines[4].startswith("split of step 1 over 2 ranks (")
    rank_line = re.compile(r"^  rank [01]: \d+ packs \| [\d.]+k? tokens \| [\d.]+ [kMGTP]?FLOP \([\d.]+%\)$")
    assert rank_line.match(lines[5]) and rank_line.match(lines[6]), lines[5:7]
    assert lines[7].startswith("  imbalance ") and lines[7].endswith("% (costliest rank / mean - 1)")
    steps = [line for line in lines if line.startswith("step ")]
    assert len(steps) == 2 and all(" | dp 2 | imbalance " in s and "% meas | idle " in s for s in steps)
    assert lines[-1] == "saved dp/checkpoint (step 2)"
    assert max_rel_diff(weights(tmp_path / "dp"), weights(plain.output_dir)) < TOL
    np.testing.assert_allclose(losses(tmp_path / "dp"), plain.losses, rtol=TOL, atol=0)
    if board:  # rank 0's TensorBoard events: the step numbers over all ranks, and each rank's load
        from test_run_log import scalars

        got = scalars(tmp_path / "dp" / "tensorboard")
        metrics = [json.loads(line) for line in (tmp_path / "dp" / "metrics.jsonl").read_text().splitlines()]
        for r in (0, 1):
            seconds = [m["rank_seconds"][r] / np.mean(m["rank_seconds"]) for m in metrics]
            assert got[f"rank/load_measured/{r}"] == [(1, pytest.approx(seconds[0], rel=1e-6)),
                                                      (2, pytest.approx(seconds[1], rel=1e-6))]
        assert [v for _, v in got["train/loss"]] == pytest.approx(plain.losses, rel=1e-6)
        assert [s for s, _ in got["balance/imbalance_measured"]] == [1, 2]


def run_nodes(cwds: list[Path], config: str, *, nproc_per_node: int, env: dict | None = None
              ) -> tuple[list[int], list[tuple[str, str]]]:
    """One torchrun 'node' per working directory (``--nnodes len(cwds)``, a c10d rendezvous on 127.0.0.1 at a
    free port, gloo), each running ``treepack train config``: their exit codes and (stdout, stderr)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(cwds)), "--nproc-per-node",
           str(nproc_per_node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
           "--rdzv-id", f"nodes-{port}", "-m", "treepack", "train", config]
    nodes = [subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for cwd in cwds]
    try:
        outs = [node.communicate(timeout=300) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    return [node.returncode for node in nodes], outs


def test_two_nodes_give_the_single_process_run(tmp_path):
    """The README's multi-node launch, two 'nodes' on this host: two torchrun processes of 2 ranks each
    (``--nnodes 2``, a c10d rendezvous on 127.0.0.1 at a free port, gloo), the same config and data, the output
    directory shared (one working directory). World size 4: the single-process run's losses and weights to
    1e-9; global rank 0 alone prints, on whichever node the rendezvous made node 0."""
    write_rollouts(tmp_path / "rollouts.jsonl")
    config = write_config(tmp_path, "tree", out="nodes")
    codes, outs = run_nodes([tmp_path, tmp_path], config.name, nproc_per_node=2)
    assert codes == [0, 0], [err[-3000:] for _, err in outs]
    printed = [out for out, _ in outs if out]
    assert len(printed) == 1, outs
    lines = printed[0].splitlines()
    assert "data parallel: 4 ranks (gloo, cpu), FSDP2, float64" in lines
    assert lines[-1] == "saved nodes/checkpoint (step 2)"
    state = json.loads((tmp_path / "nodes" / "checkpoint" / "trainer.json").read_text())
    assert (state["format"], state["world_size"], state["step"]) == ("dcp", 4, 2)
    plain = train(load_config(write_config(tmp_path, "tree", out="plain")), log=lambda line: None)
    np.testing.assert_allclose(state["losses"], plain.losses, rtol=TOL, atol=0)
    assert max_rel_diff(weights(tmp_path / "nodes"), weights(plain.output_dir)) < TOL


def test_two_nodes_with_separate_output_dirs_are_refused_before_writing(tmp_path, monkeypatch):
    """Two 'nodes' whose output.dir is each its own local directory (a config copied into each node's working
    directory): the first save stops every rank with one line saying output.dir must be shared, instead of a
    checkpoint whose other node's shards rank 0 never sees. No rank waits the network file system's grace."""
    dirs = [tmp_path / f"node{i}" for i in range(2)]
    for d in dirs:
        d.mkdir()
        write_rollouts(d / "rollouts.jsonl")
        write_config(d, "tree", out="run")
    codes, outs = run_nodes(dirs, "run.toml", nproc_per_node=1, env={"TREEPACK_SHARED_DIR_WAIT_S": "0.5"})
    assert codes == [1, 1], [err[-3000:] for _, err in outs]
    # rank 0 prints the line; the other node's rank, which its own torchrun does not stop, prints it after a grace
    errors = sorted(line for _, err in outs for line in err.splitlines() if line.startswith("Error:"))
    assert errors[0].startswith("Error: output.dir run is not one directory for every rank: rank 1 cannot see the "
                                "checkpoint rank 0 is writing"), errors
    assert all(e.endswith("on several nodes put output.dir on storage every node mounts at the same path")
               for e in errors), errors
    assert len(errors) <= 2 and all(e.startswith("Error: rank 1: output.dir") for e in errors[1:]), errors
    for d in dirs:  # nothing half-written is left where a resume would look
        assert not (d / "run" / "checkpoint").exists()


def test_cli_nproc_errors(tmp_path):
    """A data error stops every rank; rank 0 alone prints it, exit 1. --nproc 0 is a usage error."""
    write_rollouts(tmp_path / "rollouts.jsonl")
    config = write_config(tmp_path, "tree")
    config.write_text(config.read_text().replace('capacity = "60"', 'capacity = "5"'))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "treepack", "train", "--nproc", "2", str(config)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr.endswith(f"Error: {tmp_path / 'rollouts.jsonl'}: sequence id '0/0' (record 0) has 19 tokens, "
                                "more than the capacity 5\n"), done.stderr
    assert done.stderr.count("Error:") == 1
    from cli_helpers import run

    r = run("train", str(config), "--nproc", "0")
    assert r.code == 2 and "--nproc" in r.err and "must be >= 1, got 0" in r.err


def test_cli_nproc_one_rank_out_of_memory(tmp_path):
    """An error of one rank alone (out of memory) is that rank's one line; the rank it leaves stranded says so in
    one line too, not with a gloo traceback."""
    write_rollouts(tmp_path / "rollouts.jsonl")
    config = write_config(tmp_path, "tree")
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('RANK') == '1':\n"
        "    import torch\n"
        "    def oom(*args, **kwargs):\n"
        "        raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 3.50 GiB. GPU 1 has ...')\n"
        "    torch.autograd.backward = oom\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(inject), *sys.path])}
    done = subprocess.run([sys.executable, "-m", "treepack", "train", "--nproc", "2", str(config)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 1 and "step 00001" not in done.stdout
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert errors[0] == ("Error: rank 1: out of GPU memory (tried to allocate 3.50 GiB): lower data.capacity (a pack "
                         'is the memory bound), use mode = "dfs" (its calls follow the memory), or turn on '
                         "train.activation_checkpointing"), done.stderr
    assert all(e.startswith("Error: rank 0: stopped, its process group broken by another rank's failure (")
               for e in errors[1:]), done.stderr
    assert "Traceback" not in done.stderr, done.stderr


@pytest.fixture
def one_rank_group(monkeypatch):
    """A gloo process group of one rank in this process (what torchrun --nproc-per-node 1 sets up)."""
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(key, value)
    dist.init_process_group("gloo")
    yield
    dist.destroy_process_group()


def test_the_data_parallel_loop_checks_as_the_plain_one(tmp_path, one_rank_group):
    """Before any step: a kernel that cannot run here, a KL without behaviour log-probs. On resume, metrics
    lines logged after the checkpoint are dropped (a subdirectory path works)."""
    from treepack.errors import ConfigError
    from treepack.train.parallel import train_distributed

    write_rollouts(tmp_path / "rollouts.jsonl")
    config = write_config(tmp_path, "tree", steps=2, out="dp", save_every=1)
    text = config.read_text()
    config.write_text(text.replace('device = "cpu"', 'device = "cpu"\nattention = "triton"'))
    with pytest.raises(ConfigError, match=r"train.attention = 'triton': the triton backend needs CUDA tensors"):
        train_distributed(load_config(config), log=lambda line: None)
    config.write_text(text.replace("[output]", "[train.loss]\nkind = 'grpo'\nkl_coef = 0.1\n\n[output]"))
    with pytest.raises(ConfigError, match=r"train.loss.kl_coef = 0.1 needs behaviour log-probs"):
        train_distributed(load_config(config), log=lambda line: None)
    config.write_text(text.replace("save_every = 1", "save_every = 1\nmetrics = 'logs/m.jsonl'"))
    train_distributed(load_config(config), log=lambda line: None)
    metrics = tmp_path / "dp" / "logs" / "m.jsonl"
    with metrics.open("a") as f:  # as if a run had logged step 3 and been killed before its checkpoint
        f.write(metrics.read_text().splitlines(keepends=True)[-1].replace('"step": 2', '"step": 3') + '{"step"')
    config.write_text(config.read_text().replace("steps = 2", "steps = 4"))
    train_distributed(load_config(config), log=lambda line: None)
    assert [json.loads(line)["step"] for line in metrics.open()] == [1, 2, 3, 4]


def test_one_rank_runs_the_plain_loop_ops(tmp_path, one_rank_group):
    """World size 1 under torchrun is not sharded: over two steps it dispatches exactly the plain loop's
    aten ops (it is the same loop), plus the one all-gather per step of the step's numbers."""
    import collections

    from torch.utils._python_dispatch import TorchDispatchMode

    from treepack.train.parallel import train_distributed

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    write_rollouts(tmp_path / "rollouts.jsonl")
    ops = {}
    for name, fn in (("plain", train), ("dp", train_distributed)):
        counts = []
        for steps in (1, 3):
            cfg = load_config(write_config(tmp_path, "tree", steps=steps, out=f"{name}{steps}"))
            with Count() as c:
                fn(cfg, log=lambda line: None)
            counts.append(c.ops)
        ops[name] = counts[1] - counts[0]  # steps 2 and 3 (the final save cancels out)
    assert ops["plain"] - ops["dp"] == collections.Counter()
    extra = ops["dp"] - ops["plain"]
    # the step's (loss, tokens, compute seconds, memory) as a tensor, gathered over the ranks
    gather = ("aten.lift_fresh", "aten.detach", "aten.empty_like", "c10d.allgather_", "aten.stack")
    assert extra == collections.Counter({op: 2 for op in gather}), extra


def test_layer_units_group_consecutive_layers_under_the_bound():
    from torch import nn

    from treepack.train.fsdp import layer_units

    layers = [nn.Linear(n, 1, bias=False) for n in (3, 4, 2, 9, 1, 1)]  # float32 bytes: 12 16 8 36 4 4
    units = layer_units(layers, unit_bytes=28)
    assert [[layers.index(m) for m in u] for u in units] == [[0, 1], [2], [3], [4, 5]]
    assert [m for u in layer_units(layers, unit_bytes=1 << 30) for m in u] == layers
    assert len(layer_units(layers, unit_bytes=1 << 30)) == 1


def test_sync_pass_reduces_every_unit_without_running_a_layer(monkeypatch):
    """`Accumulation.finish` runs the root module alone: no decoder layer runs in it, yet every unit's
    accumulated gradient reaches its sharded ``.grad`` (1 rank, float64: exactly an unsharded twin's)."""
    import socket

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from treepack.train.architecture import ModelArgs
    from treepack.train.attention import AttentionContext
    from treepack.train.fsdp import Accumulation, layer_units, shard_model
    from treepack.train.model import Decoder

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(key, value)
    args = ModelArgs(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
                     num_kv_heads=2, head_dim=8, qk_norm=True, tie_embeddings=True)
    ids = torch.tensor([3, 5, 7, 11, 13, 17])
    pos = torch.arange(6)

    def loss(model):
        return model(ids, pos, AttentionContext.causal([6], "sdpa")).hidden_TD.pow(2).sum()

    twin = Decoder.random_init(args, seed=1, dtype=torch.float64)
    for _ in range(2):  # two packs of one step
        loss(twin).backward()
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        model = Decoder.random_init(args, seed=1, dtype=torch.float64)
        layer_bytes = 4 * sum(p.numel() for p in model.model.layers[0].parameters())
        monkeypatch.setattr("treepack.train.fsdp.UNIT_BYTES", 2 * layer_bytes)
        assert [len(u) for u in layer_units(list(model.model.layers))] == [2, 1]
        shard_model(model, init_device_mesh("cpu", (1,)))
        assert len(model.fsdp_units) == 3  # two units of layers and the root
        accumulation = Accumulation(model)
        calls = []
        for layer in model.model.layers:
            layer.register_forward_pre_hook(lambda module, inputs: calls.append(module))
        accumulation.begin()
        for _ in range(2):
            loss(model).backward()
        assert len(calls) == 2 * args.num_layers
        accumulation.finish()
        assert len(calls) == 2 * args.num_layers  # the sync pass ran no layer
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            assert torch.equal(p.grad.full_tensor(), q.grad), name
    finally:
        dist.destroy_process_group()


def test_measured_balance_fits_rank_times_and_trains_the_same(tmp_path):
    """`train.balance = "measured"` on 2 ranks: from the third observed step on, every step logs the fitted
    cost model (the same on both ranks, or the run would hang or diverge), and the losses equal the FLOP
    balance's run (the split changes where gradients are computed, never what they sum to)."""
    write_rollouts(tmp_path / "rollouts.jsonl")
    for balance in ("flops", "measured"):
        config = write_config(tmp_path, "tree", steps=6, out=balance)
        config.write_text(config.read_text().replace('device = "cpu"', f'device = "cpu"\nbalance = "{balance}"'))
        r = torchrun(2, "-m", "treepack", "train", str(config), cwd=tmp_path)
        assert r.returncode == 0, r.stderr[-2000:]
    rows = {b: [json.loads(line) for line in (tmp_path / b / "metrics.jsonl").open()] for b in ("flops", "measured")}
    assert [("cost_fit_error" in m) for m in rows["measured"]] == [False] * 3 + [True] * 3
    assert not any("cost_fit_error" in m for m in rows["flops"])
    for m in rows["measured"][3:]:
        assert m["cost_attention_factor"] > 0 and m["cost_call_flops"] >= 0
    for m in rows["measured"]:  # what each rank compiled, by kind (nothing: a CPU run compiles no kernels)
        assert [m[f"rank_compiled_{k}"] for k in ("graphs", "triton", "fa4")] == [[0, 0]] * 3
        assert m["rank_compiles"] == [0, 0] and "compiled_graphs" not in m
    assert [m["loss"] for m in rows["measured"]] == pytest.approx([m["loss"] for m in rows["flops"]], rel=1e-9)
