"""The dense baselines and ``auto``: same loss and gradients as dense/tree (float64, CPU), bounded memory.

``dense`` (every sequence, micro-batched) and ``dense-leaf`` (only the leaf sequences; duplicates and
prefixes of another sequence read their log-probs from a leaf lane) must equal ``dense`` in one piece to
1e-9 relative on random trees with branch points, duplicates, prefix-of-another sequences, loss masks,
behaviour log-probs and per-sequence advantages, for SFT and GRPO, both normalisations. Micro-batches
never exceed the budget (a longer lane alone) and each is back-propagated before the next forward.
`auto` picks by its speed table; its decision is checked on packs where the answer is known.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import rollouts_from, sequence_lists
from test_equivalence import OBJECTIVES, VOCAB, make_pack, random_sequences, rel_diffs, run

from treepack.errors import ConfigError, TreepackError
from treepack.pack.layout import build_pack
from treepack.stats import ModelShape
from treepack.train.data import plan_dense
from treepack.train.losses import BatchTotals, LossRows, Objective
from treepack.train.model import Decoder, ModelArgs
from treepack.train.modes import MODES, make_mode
from treepack.train.modes.auto import SPEED_TABLES, AutoMode, SpeedTable, Work, choose, dense_work, tree_work
from treepack.train.verify import tiny_model_args, verify_packs

TOL = 1e-9


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model() -> Decoder:
    return Decoder.random_init(tiny_model_args(VOCAB), seed=0, dtype=torch.float64)


def assert_same(model, packs, objective, mode, **options):
    loss_d, logp_d, g_d = run(model, packs, "dense", objective, micro_batch_tokens=10**9)  # one piece per pack
    loss_m, logp_m, g_m = run(model, packs, mode, objective, **options)
    assert abs(loss_m - loss_d) <= TOL * abs(loss_d)
    assert torch.allclose(logp_m, logp_d, rtol=0, atol=1e-12)
    rel = rel_diffs(g_m, g_d)
    worst = max(rel, key=rel.get)
    assert rel[worst] <= TOL, f"{mode} {options}: {worst}: {rel[worst]:.3g}"


# --------------------------------------------------------------------------------------------------
# Exactness


CASES = [("dense", {"micro_batch_tokens": 24}), ("dense-leaf", {}), ("dense-leaf", {"micro_batch_tokens": 9}),
         ("auto", {})]


@pytest.mark.parametrize("objective", OBJECTIVES, ids=lambda o: f"{o.kind}-{o.normalization}")
@pytest.mark.parametrize("seed", [0, 1])
def test_dense_modes_equal_dense(model, objective, seed):
    pack = make_pack(random_sequences(np.random.default_rng(seed), 12), seed)
    plan = plan_dense(pack, *_rows(pack), leaves=True, budget=pack.n_tokens)
    assert plan.seq_Q.shape[0] < pack.n_sequences  # duplicates / prefixes were collapsed
    for mode, options in CASES:
        assert_same(model, [pack], objective, mode, **options)


def test_several_packs_accumulate(model):
    """Normalisers span the batch: dense-leaf over two packs equals dense over one holding them all."""
    seqs = random_sequences(np.random.default_rng(3), 14)
    rng = np.random.default_rng(3)
    masks = [(rng.random(len(s)) < 0.6).astype(int).tolist() for s in seqs]
    r = rollouts_from(seqs, masks=masks, advantages=rng.standard_normal(len(seqs)))
    halves = [build_pack(r, np.arange(0, 7)), build_pack(r, np.arange(7, 14))]
    for objective in (Objective("sft", "token"), Objective("grpo", "sequence")):
        loss_w, _, g_w = run(model, [build_pack(r)], "dense", objective)
        loss_h, _, g_h = run(model, halves, "dense-leaf", objective, micro_batch_tokens=16)
        assert abs(loss_h - loss_w) <= TOL * abs(loss_w)
        assert max(rel_diffs(g_h, g_w).values()) <= TOL


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seqs=sequence_lists(max_seqs=8, max_len=10, vocab=3), seed=st.integers(0, 2**16),
       kind=st.sampled_from(["sft", "grpo"]), norm=st.sampled_from(["token", "sequence"]),
       budget=st.integers(1, 30))
def test_dense_leaf_equals_dense_property(model, seqs, seed, kind, norm, budget):
    pack = make_pack(seqs, seed)
    if LossRows.from_pack(pack).n_rows == 0:
        return  # nothing trains: every mode's loss is 0 (test_no_loss_rows)
    assert_same(model, [pack], Objective(kind, norm), "dense-leaf", micro_batch_tokens=budget)


def test_no_loss_rows(model):
    r = rollouts_from([[1, 2, 3], [1, 2]], masks=[[0, 0, 0], [1, 0]])
    pack = build_pack(r)
    for mode in ("dense", "dense-leaf"):
        loss, logp, _ = _one(model, pack, mode)
        assert loss == 0.0 and logp.numel() == 0


def _rows(pack):
    rows = LossRows.from_pack(pack)
    return rows.token_R, rows.seq_R, rows.flat_R


def _one(model, pack, mode, **options):
    rows = LossRows.from_pack(pack)
    model.zero_grad(set_to_none=True)
    out = make_mode(mode, **options)(model, pack, rows, Objective("sft", "token"), BatchTotals.of([rows]))
    out.backward()
    return out.loss.item(), out.logp_R, out


# --------------------------------------------------------------------------------------------------
# The plan: leaves, hosts, micro-batches (numpy only)


@settings(max_examples=60, deadline=None)
@given(seqs=sequence_lists(max_seqs=12, max_len=9, vocab=3), seed=st.integers(0, 2**16), budget=st.integers(1, 40),
       leaves=st.booleans())
def test_plan_invariants(seqs, seed, budget, leaves):
    pack = make_pack(seqs, seed)
    token_R, seq_R, flat_R = _rows(pack)
    plan = plan_dense(pack, token_R, seq_R, flat_R, leaves=leaves, budget=budget)
    offsets, index = np.asarray(pack.seq_offsets), np.asarray(pack.seq_token_index)
    # every row reads the hidden state just before its own target token, inside the forwarded part
    assert np.all((plan.pos_R >= 1) & (plan.pos_R <= plan.length_Q[plan.lane_R]))
    assert np.array_equal(index[offsets[plan.seq_Q[plan.lane_R]] + plan.pos_R], token_R)
    # micro-batches: a partition of the lanes, each within the budget unless it holds one lane
    sizes = np.add.reduceat(plan.length_Q, plan.batch_B1[:-1]) if plan.n_batches else np.zeros(0)
    counts = np.diff(plan.batch_B1)
    assert np.all((sizes <= budget) | (counts == 1)) and counts.sum() == plan.seq_Q.shape[0]
    assert sorted(np.concatenate(plan.batch_rows()).tolist()) == list(range(token_R.shape[0])) if plan.n_batches else True
    assert len(set(plan.seq_Q.tolist())) == plan.seq_Q.shape[0]
    if leaves:
        # lanes are distinct leaves: no lane's forwarded path is a prefix of another lane's path
        paths = [tuple(index[offsets[s] : offsets[s + 1]].tolist()) for s in plan.seq_Q.tolist()]
        assert all(not (a != b and b[: len(a)] == a) for a in paths for b in paths)
        dense = plan_dense(pack, token_R, seq_R, flat_R, leaves=False, budget=budget)
        assert plan.tokens <= dense.tokens and plan.predicted == np.unique(token_R).shape[0]


def test_plan_rejects_paths_that_are_not_a_trie():
    pack = make_pack([[1, 2, 3, 4], [1, 2, 5]], 0, logprobs=False)
    index = pack.seq_token_index.copy()
    index[5] = index[3]  # sequence 1's second token now names the pack token at depth 3
    bad = dataclasses.replace(pack, seq_token_index=index, seq_loss_mask=np.ones_like(pack.seq_loss_mask))
    with pytest.raises(TreepackError, match="is not a prefix of a leaf path"):
        plan_dense(bad, *_rows(bad), leaves=True, budget=100)


# --------------------------------------------------------------------------------------------------
# Memory: micro-batches within the budget, each back-propagated before the next forward


def test_micro_batches_are_bounded_and_interleaved(model):
    seqs = random_sequences(np.random.default_rng(5), 16)
    pack = make_pack(seqs, 5)
    events: list[tuple[str, int]] = []
    forward = model.forward

    def traced(ids_T, *args, **kwargs):
        out = forward(ids_T, *args, **kwargs)
        events.append(("forward", int(ids_T.shape[0])))
        out.hidden_TD.register_hook(lambda g: events.append(("backward", int(g.shape[0]))))
        return out

    budget = 30
    for mode in ("dense", "dense-leaf"):
        events.clear()
        model.forward = traced
        try:
            _, _, out = _one(model, pack, mode, micro_batch_tokens=budget)
        finally:
            del model.forward
        plan = make_mode(mode, micro_batch_tokens=budget).plan(pack, LossRows.from_pack(pack))
        assert plan.n_batches > 1 and out.metrics["micro_batches"] == plan.n_batches
        assert [e[0] for e in events] == ["forward", "backward"] * plan.n_batches
        longest = int(plan.length_Q.max())
        assert all(n <= max(budget, longest) for kind, n in events)
        assert out.forward_tokens == plan.tokens == sum(n for kind, n in events if kind == "forward")


def test_default_budget_is_the_pack(model):
    pack = make_pack(random_sequences(np.random.default_rng(8), 16), 8)
    plan = make_mode("dense").plan(pack, LossRows.from_pack(pack))
    sizes = np.add.reduceat(plan.length_Q, plan.batch_B1[:-1])
    assert plan.tokens > pack.n_tokens and plan.n_batches > 1  # the flat sequences outgrow the pack
    assert np.all(sizes <= pack.n_tokens)


# --------------------------------------------------------------------------------------------------
# auto


SHAPE = ModelShape("test", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=176, vocab=VOCAB)
TABLE = SpeedTable(name="test", matmul=1e12, attention={"triton": 1e11, "sdpa": 2e11})


def test_seconds_is_the_flop_model():
    w = Work(tokens=100, predicted=40, pairs=5000, square_pairs=10_000, calls=2, attention_calls=3)
    t = dataclasses.replace(TABLE, layer_call_seconds=1e-3, attention_call_seconds=1e-4)
    linear = 6.0 * SHAPE.non_embedding_params * 100 + 6.0 * 64 * VOCAB * 40
    attention = 12.0 * 2 * 4 * 16 * 5000
    assert t.seconds(w, SHAPE, "sdpa") == pytest.approx(linear / 1e12 + attention / 2e11 + 2 * (2e-3 + 3e-4))
    # the reference backend computes every score of its calls; an unmeasured backend is the slowest one
    assert t.seconds(w, SHAPE, "reference") == pytest.approx(linear / 1e12 + 2 * attention / 1e11 + 2 * (2e-3 + 3e-4))


def _choice(pack, table=TABLE):
    rows = LossRows.from_pack(pack)
    leaf = make_mode("dense-leaf").plan(pack, rows)
    return choose({"tree": tree_work(pack, rows), "dense-leaf": dense_work(leaf)},
                  {"tree": "triton", "dense-leaf": "sdpa"}, SHAPE, table)


def test_auto_picks_dense_leaf_on_chains_and_tree_where_sharing_pays():
    rng = np.random.default_rng(0)
    turns = [rng.integers(0, VOCAB, 30).tolist() for _ in range(4)]
    chain = [[t for turn in turns[: k + 1] for t in turn] for k in range(4)]  # multi-turn: each a prefix of the next
    c = _choice(make_pack(chain, 0))
    assert c.mode == "dense-leaf" and c.work["dense-leaf"].tokens <= c.work["tree"].tokens
    prompt = rng.integers(0, VOCAB, 200).tolist()
    group = [prompt + rng.integers(0, VOCAB, 10).tolist() for _ in range(8)]  # GRPO: one long prompt, 8 answers
    c = _choice(make_pack(group, 0))
    assert c.mode == "tree" and c.work["dense-leaf"].tokens > 5 * c.work["tree"].tokens
    assert c.reason().startswith("tree: est. ") and "faster than dense-leaf" in c.reason()
    # equal work at equal speed: ties go to tree
    w = Work(tokens=10, predicted=5, pairs=55, square_pairs=100, calls=1, attention_calls=1)
    even = SpeedTable(name="even", matmul=1e12, attention={"triton": 1e11, "sdpa": 1e11})
    assert choose({"tree": w, "dense-leaf": w}, {"tree": "triton", "dense-leaf": "sdpa"}, SHAPE, even).mode == "tree"


def test_auto_mode_runs_the_choice_and_says_why(model):
    rng = np.random.default_rng(1)
    chain_pack = make_pack([[1, 2, 3, 4, 5, 6], [1, 2, 3]], 1)
    prompt = rng.integers(0, VOCAB, 60).tolist()
    group_pack = make_pack([prompt + [int(a), int(b)] for a, b in rng.integers(0, VOCAB, (6, 2))], 1)
    mode = make_mode("auto", speed_table=SpeedTable(name="test", matmul=1e9, attention={"reference": 1e8, "sdpa": 2e8}))
    assert isinstance(mode, AutoMode) and "auto" in MODES
    packs = [chain_pack, group_pack]
    rows = [LossRows.from_pack(p) for p in packs]
    lines = mode.describe(model, packs, rows)
    assert lines[0].startswith("mode auto (test speed table): tree on 1 pack, dense-leaf on 1 pack; est. ")
    assert any(line.strip().startswith("dense-leaf: est. ") for line in lines[1:])
    assert [mode.choose(model, p, r).mode for p, r in zip(packs, rows)] == ["dense-leaf", "tree"]
    assert_same(model, packs, Objective("grpo", "token"), "auto",
                speed_table=SpeedTable(name="test", matmul=1e9, attention={"reference": 1e8, "sdpa": 2e8}))


def test_auto_builds_every_planned_path_at_its_first_pack_and_drops_that_pass(model):
    """When its plan holds both modes, auto runs the run's first pack the other way too, so both paths compile in step
    1; that pass leaves nothing behind: the step's losses and gradients are those of auto without it, bit for bit."""
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, VOCAB, 60).tolist()
    packs = [make_pack([[1, 2, 3, 4, 5, 6], [1, 2, 3]], 1),
             make_pack([prompt + [int(a), int(b)] for a, b in rng.integers(0, VOCAB, (6, 2))], 1)]
    rows = [LossRows.from_pack(p) for p in packs]
    objective, totals = Objective("grpo", "token"), BatchTotals.of(rows)
    table = SpeedTable(name="test", matmul=1e9, attention={"reference": 1e8, "sdpa": 2e8})

    class Counted:  # a candidate mode that counts its calls
        def __init__(self, inner, name, calls):
            self.inner, self.name, self.calls = inner, name, calls

        def __getattr__(self, attr):
            return getattr(self.inner, attr)

        def __call__(self, *args):
            self.calls[self.name] += 1
            return self.inner(*args)

    def counted(mode):
        calls = {"tree": 0, "dense-leaf": 0}
        mode.tree, mode.leaf = Counted(mode.tree, "tree", calls), Counted(mode.leaf, "dense-leaf", calls)
        return calls

    def step(mode):
        model.zero_grad(set_to_none=True)
        losses = []
        for p, r in zip(packs, rows):
            out = mode(model, p, r, objective, totals)
            if not out.backward_done:
                out.loss.backward()
            losses.append(float(out.loss))
        return losses, [p.grad.clone() for p in model.parameters()]

    plain, ahead = make_mode("auto", speed_table=table), make_mode("auto", speed_table=table)
    lines = ahead.describe(model, packs, rows)
    assert ahead.planned == {"tree", "dense-leaf"} and "both paths compile before training" in lines[-1]
    calls = counted(ahead)
    for _ in range(2):
        (loss_p, grad_p), (loss_a, grad_a) = step(plain), step(ahead)
        assert loss_a == loss_p and all(torch.equal(a, b) for a, b in zip(grad_a, grad_p))
    # step 1: the chain pack ran as dense-leaf, and once as tree ahead of the group pack; step 2: one each
    assert calls == {"tree": 3, "dense-leaf": 2}
    late = make_mode("auto", speed_table=table)
    late.describe(model, packs, rows)
    calls = counted(late)
    step(plain)  # leaves gradients: a pack that is not the step's first must not run another pass
    late(model, packs[1], rows[1], objective, totals)
    assert calls == {"tree": 1, "dense-leaf": 0}


def test_speed_table_json(tmp_path):
    t = SPEED_TABLES["H200"]
    path = tmp_path / "t.json"
    import json

    path.write_text(json.dumps(t.to_json()))
    assert SpeedTable.load(path) == t
    path.write_text('{"name": "x", "matmul": 1}')
    with pytest.raises(ConfigError, match=r"^speed table: needs name, matmul and attention"):
        SpeedTable.load(path)
    path.write_text('{"name": "x", "matmul": 1, "attention": {"sdpa": 0}}')
    with pytest.raises(ConfigError, match="^speed table: matmul and every attention speed must be > 0$"):
        SpeedTable.load(path)
    with pytest.raises(ConfigError, match="no such file"):
        SpeedTable.load(tmp_path / "missing.json")


def test_make_mode_names_and_attention():
    from treepack.kernels.tree_attention.registry import AttentionCall, resolve

    # the dense modes keep "auto" and resolve it per call: on a CPU, per-sequence SDPA, as they always ran
    assert make_mode("dense-leaf").attention == "auto" and make_mode("dense", attention="sdpa").attention == "sdpa"
    call = AttentionCall(torch.device("cpu"), torch.float64, heads=4, head_dim=8)
    assert resolve("causal", make_mode("dense").attention, call).name == "sdpa"
    assert make_mode("auto").leaf.attention == "auto" and make_mode("dense", attention="triton").attention == "triton"
    with pytest.raises(ConfigError, match="^train.attention = 'sdpa' runs independent causal sequences; "
                                          "train.mode = 'auto' needs auto, reference, flex, triton or fa4$"):
        make_mode("auto", attention="sdpa")
    with pytest.raises(ConfigError, match=r"^unknown mode 'flat' \(modes: tree, dense, dense-leaf, dfs, auto\)$"):
        make_mode("flat")


# --------------------------------------------------------------------------------------------------
# verify with dense-leaf as the baseline


def test_verify_with_dense_leaf_baseline():
    rng = np.random.default_rng(21)
    packs = [make_pack(random_sequences(rng, 8), 21 + i) for i in range(2)]
    seen = []
    report = verify_packs(packs, modes=("dense", "tree", "auto"), loss="grpo", baseline="dense-leaf",
                          progress=lambda done, total, label: seen.append((done, total, label)))
    assert report.ok, report.failures
    assert list(report.modes) == ["dense-leaf", "dense", "tree", "auto"] and report.to_json()["baseline"] == "dense-leaf"
    assert report.max_rel_grad_diff <= TOL
    assert seen[0] == (0, 8, "dense-leaf, pack 1/2") and seen[5] == (5, 8, "dense, pack 2/2")
    assert seen[-1] == (8, 8, "done")
    with pytest.raises(ConfigError, match="^baseline must be one of dense, dense-leaf, got 'tree'$"):
        verify_packs(packs, baseline="tree")


def test_other_family_dense_leaf():
    args = ModelArgs.for_family("llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_layers=2,
                                num_heads=4, num_kv_heads=1, head_dim=8, tie_embeddings=True)
    m = Decoder.random_init(args, seed=1, dtype=torch.float64)
    pack = make_pack(random_sequences(np.random.default_rng(5), 8), 5, pad_to=16)
    assert pack.n_tokens > pack.n_real
    assert_same(m, [pack], Objective("grpo", "token"), "dense-leaf", micro_batch_tokens=12)


# --------------------------------------------------------------------------------------------------
# treepack train / treepack verify


def test_train_dense_leaf_and_auto_follow_the_tree_trajectory(tmp_path):
    from cli_helpers import run as cli
    from test_train_cli import LINE, metrics, write_config

    assert cli("train", write_config(tmp_path, mode="tree", out="tree")).code == 0
    lt = [m["loss"] for m in metrics(tmp_path / "tree")]
    for mode, extra in (("dense-leaf", 'micro_batch_tokens = "12"'), ("dense", "micro_batch_tokens = 12"), ("auto", "")):
        r = cli("train", write_config(tmp_path, mode=mode, out=mode, extra=extra))
        assert r.code == 0, r.err
        got = metrics(tmp_path / mode)
        assert [m["loss"] for m in got] == pytest.approx(lt, rel=1e-9)
        steps = [line for line in r.out.splitlines() if line.startswith("step ")]
        assert len(steps) == 3 and all(LINE.match(line) for line in steps)
        if mode == "auto":
            assert r.out.splitlines()[3].startswith("mode auto (CPU speed table): ")  # after the banner
            assert all("dense_leaf_share" in m for m in got)
        else:
            assert all(m["micro_batches"] >= 2 for m in got)  # 12-token micro-batches


def test_train_config_keys(tmp_path):
    from treepack.train.config import EXAMPLE_CONFIG, parse_config

    base = "[data]\nshards = 'p'\n[train]\n"
    cfg = parse_config(base + "mode = 'dense-leaf'\nmicro_batch_tokens = 4096\nspeed_table = 't.json'\n",
                       base_dir=tmp_path)
    assert cfg.train.micro_batch_token_count == 4096 and cfg.train.speed_table == str(tmp_path / "t.json")
    with pytest.raises(ConfigError, match="^config.toml: train.attention = 'sdpa' runs independent causal sequences; "
                                          "train.mode = 'auto' needs auto, reference, flex, triton or fa4$"):
        parse_config(base + "mode = 'auto'\nattention = 'sdpa'\n")
    with pytest.raises(ConfigError, match="^config.toml: invalid train.micro_batch_tokens 'lots': expected an integer"):
        parse_config(base + "micro_batch_tokens = 'lots'\n")
    for mode in ("dense-leaf", "auto"):
        assert f"| {mode} (" in EXAMPLE_CONFIG


def test_verify_cli_progress_and_baseline(tmp_path):
    import re

    from cli_helpers import run as cli
    from test_train_cli import write_rollouts

    data = write_rollouts(tmp_path / "r.jsonl")
    r = cli("verify", data, "--capacity", "40", "--packs", "0", "--modes", "tree,dense-leaf,auto", "--dtype", "float32")
    assert r.code == 0, r.err
    lines = r.err.splitlines()
    assert re.fullmatch(r"verify: 2 packs \(\d+ tree tokens\) from .*r\.jsonl \(\d+\.\d s\)", lines[0])
    labels = [re.fullmatch(r"verify: \[(\d+)/10\] (.*) \(\d+\.\d s\)", line).group(2) for line in lines[1:-1]]
    assert labels == [f"{m}, pack {i}/2" for i in (1, 2) for m in ("dense", "tree", "dense-leaf", "auto",
                                                                  "dense in float64")]
    assert re.fullmatch(r"verify: 10 runs done \(\d+\.\d s\)", lines[-1])
    assert "OK: every mode matches dense within 2x the dense run's error vs the reference" in r.out
    r = cli("verify", data, "--capacity", "40", "--baseline", "dense-leaf", "--modes", "tree", "-q")
    assert r.code == 0 and r.err == "" and "OK: every mode matches dense-leaf within 1e-09 relative" in r.out
    r = cli("verify", data, "--baseline", "tree")
    assert r.code == 2 and "must be one of dense, dense-leaf, got 'tree'" in r.err


def test_each_hopper_table_reads_its_own_gpu_row():
    """The H200's table prices tree attention from the H200's measured row (FA4's tree kernel at 500 TFLOP/s
    per pair against 525 for its varlen kernel), not the H100's (425): on the bundled tau-bench slice, where
    the leaves repeat little of the tree, auto then runs the tree (measured faster on an H200), where the H100's
    row made it pick dense-leaf on every pack."""
    from treepack.io.ingest import read_rollouts
    from treepack.kernels.tree_attention.backends import MEASURED
    from treepack.pack import pack_rollouts
    from treepack.stats import MODEL_SHAPES

    h200, h100 = SPEED_TABLES["H200"], SPEED_TABLES["H100"]
    assert h200.attention["fa4"] / h200.attention["fa4-varlen"] == pytest.approx(500 / 525)
    assert h100.attention["fa4"] / h100.attention["fa4-varlen"] == pytest.approx(425 / 525)
    assert MEASURED["H200"]["fa4"].tflops == 500 and "MEASURED['H200']" in h200.source
    samples = Path(__file__).resolve().parents[1] / "treepack" / "datasets" / "samples"
    packs = pack_rollouts(read_rollouts(samples / "tau_bench_slice.parquet"), capacity=32768)
    leaf = make_mode("dense-leaf")
    picks = {}
    for name, table in (("H200", h200), ("H100", h100)):
        picks[name] = []
        for p in packs:
            rows = LossRows.from_pack(p)
            works = {"tree": tree_work(p, rows), "dense-leaf": dense_work(leaf.plan(p, rows), varlen=True)}
            picks[name].append(choose(works, {"tree": "fa4", "dense-leaf": "fa4-varlen"},
                                      MODEL_SHAPES["qwen3-0.6b"], table).mode)
    assert picks == {"H200": ["tree"] * 3, "H100": ["dense-leaf"] * 3}
