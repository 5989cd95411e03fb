"""``treepack stats``: exact JSON keys, the gate's exit codes and messages, and input errors."""

import json
import subprocess
import sys

import pytest
from cli_helpers import run

REQUIRED = ("n_sequences", "n_flat_tokens", "n_tree_tokens", "compression", "por", "c_leaf", "c_attn",
            "n_nodes", "n_leaves", "max_depth")


@pytest.fixture
def small(tmp_path):
    path = tmp_path / "small.jsonl"
    recs = [
        {"id": "a", "tree_id": "t1", "input_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1]},
        {"id": "b", "tree_id": "t1", "input_ids": [1, 2, 3, 5], "loss_mask": [0, 0, 1, 1]},
        {"id": "c", "tree_id": "t2", "input_ids": [1, 2, 9], "loss_mask": [0, 1, 1]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def test_json_has_the_contract_keys(small):
    r = run("stats", small, "--json")
    assert r.code == 0, r.err
    d = json.loads(r.out)
    for k in REQUIRED:
        assert k in d and isinstance(d[k], (int, float)) and not isinstance(d[k], bool), k
    assert (d["n_sequences"], d["n_flat_tokens"], d["n_tree_tokens"], d["n_leaves"], d["max_depth"]) == (3, 11, 6, 3, 4)
    assert d["compression"] == 11 / 6 and d["por"] == pytest.approx(5 / 11)
    assert d["gate"] == {"passed": True, "failures": []}


def test_group_by_tree_id(small):
    d = json.loads(run("stats", small, "--json", "--group-by", "tree_id").out)
    assert d["n_tree_tokens"] == 8 and d["n_scopes"] == 2
    assert [g["group"] for g in d["groups"]] == ["t1", "t2"]


def test_err_with_oversize_skip_is_over_the_packed_sequences(small):
    """--oversize skip leaves 4-token sequences out of the packs: ERR's N_flat is that of the packed ones
    (the 3-token c alone: 3 flat, 3 packed, ERR 0), and the table and JSON say how many were left out."""
    r = run("stats", small, "--capacity", "3", "--oversize", "skip", "--json")
    assert r.code == 0, r.err
    d = json.loads(r.out)
    assert (d["n_flat_tokens"], d["n_pack_tokens"], d["err"], d["n_oversize_skipped"]) == (11, 3, 0.0, 2)
    assert d["n_packed_flat_tokens"] == 3  # ERR's N_flat, in the JSON too
    table = run("stats", small, "--capacity", "3", "--oversize", "skip")
    assert "1 - N_pack / N_flat of the packed sequences (2 longer than the capacity left out)" in " ".join(
        line.strip("│ ") for line in table.out.splitlines())
    assert "n_oversize_skipped" not in json.loads(run("stats", small, "--json").out)


def test_gate_fails_naming_every_threshold(small):
    r = run("stats", small, "--min-compression", "2", "--min-por", "0.5", "--max-seq-len", "3")
    assert r.code == 1
    assert r.err.splitlines() == [
        "gate failed: compression 1.8333 < --min-compression 2",
        "gate failed: por 0.4545 < --min-por 0.5",
        "gate failed: max sequence length 4 > --max-seq-len 3",
    ]


def test_gate_passes(small):
    r = run("stats", small, "--min-compression", "1.5", "--min-por", "0.4", "--max-seq-len", "4")
    assert r.code == 0
    assert r.out.rstrip().endswith("gate passed")
    assert "POR" in r.out and "0.4545" in r.out


def test_gate_in_json_mode(small):
    r = run("stats", small, "--json", "--min-por", "0.9")
    assert r.code == 1
    assert json.loads(r.out)["gate"] == {"passed": False, "failures": ["por 0.4545 < --min-por 0.9"]}


def test_bad_input_is_one_line_and_exit_1(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input_ids": [1, 2]}\n{"input_ids": [3, -4]}\n')
    r = run("stats", bad)
    assert r.code == 1
    assert r.err == f"Error: {bad}: line 2: field 'input_ids'[1] is negative (-4)\n"
    assert r.out == ""


def test_on_error_skip_reports_counts(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input_ids": [1, 2]}\n{"input_ids": [3, -4]}\nnot json\n')
    r = run("stats", bad, "--on-error", "skip", "--json")
    assert r.code == 0
    d = json.loads(r.out)
    assert d["n_sequences"] == 1 and d["n_skipped"] == 2
    assert d["skipped"] == {"negative token": 1, "malformed JSON": 1}
    assert r.err.splitlines()[0] == "skipped 2 bad record(s): 1 negative token, 1 malformed JSON"


def test_all_records_bad(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input_ids": []}\n')
    r = run("stats", bad, "--on-error", "skip")
    assert r.code == 1
    assert r.err == f"Error: {bad}: no sequences to analyse: 1 bad record(s) skipped (1 empty sequence)\n"


def test_missing_file_and_usage_errors(tmp_path):
    r = run("stats", tmp_path / "nope.jsonl")
    assert (r.code, r.err) == (1, f"Error: {tmp_path / 'nope.jsonl'}: no such file\n")
    assert run("stats", tmp_path / "nope.jsonl", "--on-error", "ignore").code == 2
    assert run("stats", tmp_path / "nope.jsonl", "--model", "gpt-9").code == 2


@pytest.mark.parametrize("args, message", [
    (("--min-por", "1.5"), "Invalid value for --min-por: must be in [0, 1], got 1.5"),
    (("--min-por", "nan"), "Invalid value for --min-por: must be in [0, 1], got nan"),
    (("--min-err", "-0.1", "--capacity", "8"), "Invalid value for --min-err: must be in [0, 1], got -0.1"),
    (("--min-compression", "0.5"), "Invalid value for --min-compression: must be in [1, inf], got 0.5"),
    (("--top", "-1"), "Invalid value for '--top'"),
])
def test_a_gate_that_can_never_pass_is_a_usage_error(small, args, message):
    r = run("stats", small, *args)
    assert r.code == 2 and message in r.err


def test_group_by_without_groups(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text('{"input_ids": [1]}\n')
    r = run("stats", p, "--group-by", "tree_id")
    assert (r.code, r.err) == (1, "Error: --group-by tree_id: the input has no 'tree_id' or 'group_id' field\n")


def test_stdin(small):
    r = run("stats", "-", "--json", input=small.read_text())
    assert r.code == 0 and json.loads(r.out)["n_sequences"] == 3


@pytest.mark.parametrize("extra", [[], ["--json"]])
def test_output_into_a_closed_pipe_exits_0(small, extra):
    """``treepack stats ... | head``: the reader leaving early is not an error (tables and JSON alike)."""
    p = subprocess.Popen([sys.executable, "-m", "treepack", "stats", str(small), *extra], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    p.stdout.close()  # before the command writes: its first write meets a closed pipe
    err = p.stderr.read()
    p.stderr.close()
    assert (p.wait(timeout=120), err) == (0, b"")


def test_flop_speedup_counts_the_loss_targets_as_the_heads_rows(tmp_path):
    """stats keeps the loss masks (not the log-probs): the FLOP model's head rows are the targets, per sequence
    flat and per distinct prefix in the tree (docs/design.md §9), checked against a count by hand."""
    from treepack.stats import MODEL_SHAPES

    recs = [{"input_ids": [1, 2, 3, 4, 5], "loss_mask": [0, 0, 1, 1, 1]},
            {"input_ids": [1, 2, 3, 6, 7], "loss_mask": [0, 0, 1, 1, 1]},
            {"input_ids": [1, 2, 8], "loss_mask": [0, 0, 1]}]
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    d = json.loads(run("stats", path, "--json", "-q").out)
    # flat: 3 + 3 + 1 targets; tree: [1,2,3] once, then 4, 5, 6, 7, and 8: 6 distinct target tokens
    m = MODEL_SHAPES[d["model"]]
    want = m.flops(13, 7, d["attention_pairs_flat"]) / m.flops(d["n_tree_tokens"], 6, d["attention_pairs_tree"])
    assert d["n_tree_tokens"] == 8 and d["flop_speedup"] == pytest.approx(want, rel=1e-12)
