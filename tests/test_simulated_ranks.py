"""``treepack train --simulate-ranks N``: one process runs every rank's share of a data-parallel step, one rank
after the other. Its split is the ranks' (`every_share` against `shard_batch` of each rank, hypothesis), its
updates are the plain run's (float64 on CPU, every mode and a GRPO run, with packs cut when ranks outnumber
them), its step line and metrics are a data-parallel run's, and the measured balance fits its cost model from
the simulated ranks' times."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from cli_helpers import run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_balance import packs as pack_strategy
from test_distributed import TOL, losses, max_rel_diff, weights, write_config, write_rollouts

from treepack.pack.balance import KEEP_WHOLE
from treepack.pack.cost import FlopModel
from treepack.train.config import load_config
from treepack.train.distributed import every_share, shard_batch
from treepack.train.loop import train
from treepack.train.sync import PackTimer, SimulatedRanks

CPU = torch.device("cpu")
ATOL = 1e-12  # on-policy GRPO losses are 0 in exact arithmetic: rounding noise


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases=st.lists(pack_strategy(max_seqs=8), min_size=1, max_size=4), world=st.integers(1, 5),
       layout_mode=st.sampled_from(["tree", "dense", "dense-leaf"]), per_pair=st.integers(0, 3),
       per_call=st.integers(0, 50))
def test_every_share_is_each_ranks_shard(cases, world, layout_mode, per_pair, per_call):
    """One split, every rank's `RankShare`: the same packs (field by field), costs and loads as each rank's own
    `shard_batch`."""
    packs = [c[0] for c in cases]
    flops = FlopModel(per_token=2, per_predicted=1, per_pair=per_pair, per_call=per_call, name="t")
    shares = every_share(packs, flops=flops, mode=layout_mode, world_size=world)
    assert len(shares) == world
    for r, got in enumerate(shares):
        want = shard_batch(packs, flops=flops, mode=layout_mode, rank=r, world_size=world)
        assert (got.rank, got.world_size, got.index) == (r, world, want.index)
        assert (got.rank_cost, got.rank_packs, got.rank_work) == (want.rank_cost, want.rank_packs, want.rank_work)
        assert (got.totals, got.cut_tokens, got.layout, got.cost) == (want.totals, want.cut_tokens, want.layout,
                                                                      want.cost)
        assert len(got.packs) == len(want.packs) == want.rank_packs[r]
        for a, b in zip(got.packs, want.packs):
            for f in dataclasses.fields(b):
                x, y = getattr(a, f.name), getattr(b, f.name)
                if isinstance(y, np.ndarray):
                    np.testing.assert_array_equal(x, y, f.name)
                else:
                    assert x == y, f.name


def simulated(config, world: int, balance: str = "flops"):
    cfg = load_config(config)
    return train(cfg, log=lambda line: None, sync=SimulatedRanks(CPU, cfg.train.mode, world, balance))


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", ["tree", "dense", "dense-leaf", "dfs", "tree-grpo"])
def test_simulated_ranks_update_as_one_process(tmp_path, name, world):
    """The plain run's losses and weights after 2 steps; each step's metrics hold every rank's figures."""
    write_rollouts(tmp_path / "rollouts.jsonl")
    train(load_config(write_config(tmp_path, name)), log=lambda line: None)
    simulated(write_config(tmp_path, name, out=f"{name}-sim{world}"), world)
    ref, sim = tmp_path / name, tmp_path / f"{name}-sim{world}"
    np.testing.assert_allclose(losses(sim), losses(ref), rtol=TOL, atol=ATOL)
    assert max_rel_diff(weights(sim), weights(ref)) < TOL
    metrics = [json.loads(line) for line in (sim / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert (m["world_size"], m["simulated"]) == (world, True)
        for key in ("rank_tokens", "rank_cost", "rank_packs", "rank_seconds", "rank_predicted_seconds"):
            assert len(m[key]) == world, key
        assert min(m["rank_seconds"]) > 0 and sum(m["rank_seconds"]) <= m["seconds"]
        assert m["imbalance_measured"] == pytest.approx(max(m["rank_seconds"]) * world / sum(m["rank_seconds"]))
        assert sum(m["rank_predicted_seconds"]) == pytest.approx(sum(m["rank_seconds"]))
    if world == 3:  # 2 packs a step over 3 ranks: a pack is cut rather than a rank left idle
        assert max(m["split_packs"] for m in metrics) > 0


def test_measured_balance_learns_from_the_simulated_ranks(tmp_path):
    """balance = measured: from the third observed step the fitted cost model is in the metrics (the split
    then follows it), and the losses are still the plain run's."""
    write_rollouts(tmp_path / "rollouts.jsonl")
    train(load_config(write_config(tmp_path, "tree", steps=6)), log=lambda line: None)
    simulated(write_config(tmp_path, "tree", steps=6, out="sim"), 2, balance="measured")
    rows = [json.loads(line) for line in (tmp_path / "sim" / "metrics.jsonl").open()]
    assert [("cost_fit_error" in m) for m in rows] == [False] * 3 + [True] * 3
    for m in rows[3:]:
        assert m["cost_attention_factor"] > 0 and m["cost_call_flops"] >= 0
    np.testing.assert_allclose(losses(tmp_path / "sim"), losses(tmp_path / "tree"), rtol=TOL, atol=ATOL)


def test_pack_timer_marks_each_simulated_rank():
    """A mark at the start and at each rank's end, ranks without packs included (0 seconds)."""
    timer = PackTimer(CPU, rank_ends=[0, 2, 2, 3])
    assert len(timer.marks) == 2  # rank 0 ran nothing
    for _ in range(3):
        timer.pack_done()
    timer.stop()
    got = timer.intervals()
    assert got.shape == (4,) and got[0] == got[2] == 0.0 and got[1] > 0 and got[3] > 0
    assert timer.seconds() == pytest.approx(got.sum())
    plain = PackTimer(CPU)
    plain.pack_done()
    plain.stop()
    assert plain.intervals().shape == (1,)


def test_cli_simulate_ranks(tmp_path, monkeypatch):
    """The step line of a data-parallel run, marked simulated; the split printed at the first step; errors."""
    monkeypatch.chdir(tmp_path)
    write_rollouts(tmp_path / "rollouts.jsonl")
    config = write_config(tmp_path, "tree", out="cli")
    r = run("train", config, "--simulate-ranks", "3")
    assert r.code == 0, r.err
    lines = r.out.splitlines()
    assert any(line.startswith("simulated data parallel: 3 ranks") for line in lines)
    assert any(line.startswith("split of step 1 over 3 ranks") for line in lines)
    steps = [line for line in lines if line.startswith("step ")]
    assert len(steps) == 2 and all(" | simulated dp 3 | imbalance " in line for line in steps)
    for args, message in ((("--simulate-ranks", "0"), "must be >= 1, got 0"),
                          (("--simulate-ranks", "2", "--nproc", "2"), "not with --nproc or under torchrun")):
        r = run("train", config, *args)
        assert r.code == 2 and message in r.err, r.err


def test_benchmark_reports_the_rehearsed_balance(tmp_path, monkeypatch):
    """`benchmarks/simulated_ranks.py` on the tiny config: the report's row carries the run's own figures."""
    import importlib.util
    import sys
    from pathlib import Path

    bench_dir = Path(__file__).resolve().parents[1] / "benchmarks"
    monkeypatch.syspath_prepend(str(bench_dir))
    spec = importlib.util.spec_from_file_location("simulated_ranks_bench", bench_dir / "simulated_ranks.py")
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)
    spec.loader.exec_module(bench)
    write_rollouts(tmp_path / "rollouts.jsonl")
    steps = bench.rehearse(write_config(tmp_path, "tree", steps=6, out="bench"), 3, "measured")
    row = {"data": "tiny", "world": 3, "balance": "measured", **bench.summarise(steps, warmup=4)}
    assert row["steps"] == 2 and row["attention_factor"] is not None
    last = steps[-1]
    assert row["gap_max"] == pytest.approx(max(100 * abs(s["imbalance_measured"] - s["imbalance_predicted"])
                                                for s in steps[4:]))
    assert row["cut"] == sum(s["split_packs"] for s in steps[4:])
    args = bench.parse_args(["--data", "tiny=x.jsonl", "--steps", "6", "--warmup", "4"])
    text = bench.report(args, ["--data", "tiny=x.jsonl"], [row], "CPU")
    assert f"| tiny | 3 | measured | {100 * row['predicted']:.1f}% / {100 * row['measured']:.1f}% |" in text
    assert f"{last['cost_attention_factor']:.2f}" in text


def test_a_piece_is_routed_as_its_whole_pack(monkeypatch):
    """Tree mode tells the attention the size of the pack a piece was cut from (a whole pack: 0), so `auto`
    runs the kernel the whole packs run instead of building another mid-run (`backends.pick_backend`)."""
    from types import SimpleNamespace

    from treepack.io.rollouts import Rollouts
    from treepack.pack.balance import sub_pack
    from treepack.pack.layout import build_pack
    from treepack.train.modes import tree as tree_mode

    seen = []

    class Stop(Exception):
        pass

    def tree(subtree_end_T, impl="auto", *, host=None, whole_tokens=0):
        seen.append(whole_tokens)
        raise Stop

    monkeypatch.setattr(tree_mode.AttentionContext, "tree", staticmethod(tree))
    seqs = [[1, 2, 3, 4], [1, 2, 3, 5, 6], [1, 7]]
    r = Rollouts(tokens=np.concatenate(seqs).astype(np.int32), offsets=np.cumsum([0] + [len(s) for s in seqs]),
                 ids=["a", "b", "c"], loss_mask=np.ones(sum(map(len, seqs)), dtype=np.uint8))
    pack = build_pack(r)
    model = SimpleNamespace(device=CPU)
    for p, want in ((pack, 0), (sub_pack(pack, 1, 3), pack.n_real)):
        with pytest.raises(Stop):
            tree_mode.TreeMode()(model, p, None, None, None)
        assert seen[-1] == want


def test_the_split_says_when_packs_are_too_few_to_balance():
    """Two packs of very different cost on 2 ranks: the first split's table says more packs a step would help;
    an even split, or one with many packs a rank, does not."""
    from strategies import rollouts_from
    from test_balance import TOKENS

    from treepack.pack.layout import build_pack

    big = build_pack(rollouts_from([list(range(1, 40)), list(range(1, 30)) + [99]]))
    small = build_pack(rollouts_from([[5, 6, 7]]))
    table = shard_batch([big, small], flops=TOKENS, rank=0, world_size=2, min_gain=KEEP_WHOLE).table(1)
    assert table[-1] == "  2 packs over 2 ranks leave the balance little room: more packs a step let it even the ranks out"
    even = shard_batch([small, small], flops=TOKENS, rank=0, world_size=2).table(1)
    assert even[-1].startswith("  imbalance 0.0%")
    many = shard_batch([big, small, small, small], flops=TOKENS, rank=0, world_size=2, min_gain=KEEP_WHOLE)
    assert many.imbalance > 1.5 and many.table(1)[-1].startswith("  imbalance ")  # 2 packs a rank: no hint
