"""CPU smoke runs of the benchmarks: ``train_step.py`` (a tiny model through the CPU runners, checking the FLOP
model's inputs against the data and that the report carries every table), ``hf.py``, ``fa4_blocks.py`` and
``dfs.py`` (the GPU numbers come from `make bench-gpu`)."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "train_step.py"


def load_bench(monkeypatch):
    spec = importlib.util.spec_from_file_location("train_step_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses resolve annotations there
    spec.loader.exec_module(module)
    return module


def test_train_step_benchmark_cpu_smoke(tmp_path, monkeypatch):
    bench = load_bench(monkeypatch)
    out, raw = tmp_path / "report.md", tmp_path / "raw.json"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: threads only add contention
    try:
        rc = bench.main(["--device", "cpu", "--configs", "tiny:tau-bench:2K", "--tau-records", "2",
                         "--runners", "dense,dense-leaf,tree/reference", "--repeats", "1",
                         "--child-order", "largest-first", "--out", str(out), "--json-out", str(raw)])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    results = {r["runner"]: r for r in json.loads(raw.read_text())["results"]}
    assert set(results) == {"dense", "dense-leaf", "tree/reference"}
    assert all(r["seconds"] > 0 and r["note"] == "" for r in results.values())
    # The first two records of the sample: a 1,308-token record and its 1,399-token extension (a chain).
    dense, leaf, tree = results["dense"], results["dense-leaf"], results["tree/reference"]
    assert dense["tokens"] == 1308 + 1399 and leaf["tokens"] == tree["tokens"] == 1399
    chain = 1399 * 1400 // 2  # visible pairs of one causal sequence of 1,399 tokens
    assert dense["pairs"] == 1308 * 1309 // 2 + chain and tree["pairs"] == leaf["pairs"] == chain
    assert tree["flops"] < dense["flops"]
    text = out.read_text()
    needles = ("- tree packs: tokens in `largest-first` DFS order", "GPU path check: tiny:", "## tiny on tau-bench: 2 sequences", "| tree/reference | 2K | 1 |",
               "## Targets (design §9)", "- tiny tau-bench 2K tree/reference: >= 90% of the ideal speedup")
    for needle in needles:
        assert needle in text


def test_hf_benchmark_cpu_smoke(tmp_path, monkeypatch):
    """benchmarks/hf.py end to end on a tiny model: agreement, self-check (the planted patch is caught),
    backends, and the speed table of each workload."""
    pytest.importorskip("transformers")
    spec = importlib.util.spec_from_file_location("hf_bench", BENCH.parent / "hf.py")
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)
    spec.loader.exec_module(bench)
    out = tmp_path / "hf.md"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rc = bench.main(["--tiny", "--reps", "1", "--runners", "hf-seq,hf-tree", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    text = out.read_text()
    assert rc == 0 and "**PASS**" in text
    assert "- planted `create_causal_mask -> None` patch: caught: treepack.hf self-check failed" in text
    assert "| gemma2 (soft-cap 2.0, window 4) | reference | module |" in text
    assert "### tau-bench: 8 sequences" in text and "### grpo-math: 6 sequences" in text
    assert text.count("| hf-tree |") == 2 and "skipped" not in text


def test_fa4_blocks_orders_are_dfs_layouts_of_the_same_tree(monkeypatch):
    """benchmarks/fa4_blocks.py: ``lex`` is the pack's own layout, ``size-desc`` the trainer's
    ``largest-first`` relayout, and ``size-asc`` a valid layout (nested subtrees) of the same tree (the
    same subtree sizes) whose children come smallest first."""
    import numpy as np
    from strategies import rollouts_from

    from treepack.pack.layout import build_pack, relayout

    monkeypatch.syspath_prepend(str(BENCH.parent))
    spec = importlib.util.spec_from_file_location("fa4_blocks_bench", BENCH.parent / "fa4_blocks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 50, 40).tolist()
    seqs = [prompt[: int(rng.integers(5, 40))] + rng.integers(0, 50, int(rng.integers(1, 30))).tolist() for _ in range(12)]
    pack = build_pack(rollouts_from(seqs), pad_to=16)
    T = pack.n_real
    end = np.asarray(pack.subtree_end[:T], np.int64)
    size = end - np.arange(T)
    assert np.array_equal(module.layout_subtree_end(pack, "lex"), end)
    assert np.array_equal(module.layout_subtree_end(pack, "size-desc"), relayout(pack, "largest-first").subtree_end[:T])
    se = module.layout_subtree_end(pack, "size-asc")
    assert sorted((se - np.arange(T)).tolist()) == sorted(size.tolist())
    assert np.all(se > np.arange(T)) and np.all(se <= T)
    for k in range(T):  # nested: every token inside k's subtree ends within it; children smallest first
        assert np.all(se[k + 1 : se[k]] <= se[k])
        kids, c = [], k + 1
        while c < se[k]:
            kids.append(int(se[c] - c))
            c = int(se[c])
        assert kids == sorted(kids)


def test_dfs_benchmark_cpu_smoke(tmp_path, monkeypatch):
    """benchmarks/dfs.py on a tiny model: the dfs row, the settings it ran under, and the host profile."""
    spec = importlib.util.spec_from_file_location("dfs_bench", BENCH.parent / "dfs.py")
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)
    spec.loader.exec_module(bench)
    from treepack.kernels.tree_attention import fa4

    monkeypatch.setenv("TREEPACK_FA4_REPLAY", "on")  # the benchmark sets both for its run: restored after
    monkeypatch.setattr(fa4, "FA4_BWD_BLOCK_Q", fa4.FA4_BWD_BLOCK_Q)
    from treepack.train import compiled
    from treepack.train.modes import dfs as dfs_mode

    monkeypatch.setattr(compiled, "WEIGH_KERNEL_OPS", compiled.WEIGH_KERNEL_OPS)
    monkeypatch.setattr(dfs_mode, "SUM_GRADS_AT_ONCE", dfs_mode.SUM_GRADS_AT_ONCE)
    out = tmp_path / "dfs.md"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        bench.main(["--workloads", "tau-bench", "--modes", "dfs", "--dfs", "2048", "--model", "tiny",
                    "--device", "cpu", "--tau-records", "4", "--repeats", "1", "--gc", "freeze", "--cprofile",
                    "--compile", "off", "--fa4-replay", "off", "--child-order", "largest-first", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    text = out.read_text()
    assert "(FA4 launch replay off, backward query blocks of 128 rows); attention recompute costed; BLAS default; gradient sums per call on; dfs anchors merged up to 512 tokens, pops merged on; pack child order largest-first; Python gc freeze" in text
    n_tree = int(re.search(r"N_tree ([\d,]+),", text).group(1).replace(",", ""))
    rows = [line.split("|") for line in text.splitlines() if line.startswith("| dfs B=2048 | 1 | ")]
    assert n_tree <= 2048 and len(rows) == 1  # the whole forest fits one block: one model call
    calls, graph_tokens = rows[0][-3].strip(), int(rows[0][-2].strip().replace(",", ""))
    assert calls == "1" and 0 < graph_tokens <= n_tree
    assert re.search(r"- dfs B=2048: queued in [\d.]+ s of [\d.]+ s; steps [\d.]+; alloc retries 0; "
                     r"Python's gc \d+ ms \(\d+ full collections\)", text)
    assert "dfs B=2048: cProfile of one step" in text and "| function | calls | own s | cumulative s |" in text


def test_modes_benchmark_cpu_smoke(tmp_path, monkeypatch):
    """benchmarks/modes.py in one process on a tiny file of GRPO groups: every mode's run on the same packs, the
    per-workload ratios, and the steps table; a workload whose records exceed the capacity fails alone."""
    rng = np.random.default_rng(0)
    records = []
    for group in range(4):  # 4 prompts of 40 tokens, 3 sampled answers of 10-20 tokens each
        prompt = rng.integers(5, 60, 40).tolist()
        for k in range(3):
            answer = rng.integers(5, 60, int(rng.integers(10, 21))).tolist()
            records.append({"id": f"{group}/{k}", "tree_id": str(group), "input_ids": prompt + answer,
                            "loss_mask": [0] * 40 + [1] * len(answer), "reward": float(k)})
    data = tmp_path / "groups.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    spec = importlib.util.spec_from_file_location("modes_bench", BENCH.parent / "modes.py")
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)
    spec.loader.exec_module(bench)
    out, raw = tmp_path / "modes.md", tmp_path / "modes.json"
    bench.main(["--device", "cpu", "--layers", "1", "--compact-vocab", "--steps", "2", "--warmup", "1",
                "--capacity", "128", "--packs-per-step", "1", "--data", f"groups={data}", "--also", "groups:dense",
                "--data", f"long={BENCH.parent.parent / 'treepack/datasets/samples/tau_bench_slice.parquet'}",
                "--out", str(out), "--json-out", str(raw)])
    runs = json.loads(raw.read_text())["runs"]
    groups = {r["mode"]: r for r in runs if r["workload"] == "groups"}
    assert list(groups) == ["tree", "dense-leaf", "auto", "dense"]
    for r in groups.values():
        assert "failed" not in r and [s["step"] for s in r["steps"]] == [1, 2]
    # the same packs: dense forwards every sequence, dense-leaf and tree share the prompts' tokens less or not at all
    tokens = {m: r["steps"][0]["tokens"] for m, r in groups.items()}
    assert tokens["tree"] < tokens["dense-leaf"] <= tokens["dense"]
    assert len({r["steps"][0]["flat_tokens"] for r in groups.values()}) == 1
    assert all("CapacityError" in r["failed"] for r in runs if r["workload"] == "long")
    text = out.read_text()
    assert "| groups | tree |" in text and "| groups | dense |" in text and "| long | tree | failed: CapacityError" in text
    ratio_row = next(line for line in text.splitlines() if line.startswith("| groups | grpo | 1 |"))
    assert float(ratio_row.split("|")[4]) > 1  # C = flat / tree tokens
