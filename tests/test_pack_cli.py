"""``treepack pack`` / ``unpack`` and the packing options of ``treepack stats``: exact messages and exit codes."""

from __future__ import annotations

import json

import pytest
from cli_helpers import run

from treepack.io.ingest import read_rollouts
from treepack.pack.shard_reader import read_manifest, read_packs

RECS = [
    {"id": "a", "tree_id": "t1", "input_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1], "advantage": 0.5},
    {"id": "b", "tree_id": "t1", "input_ids": [1, 2, 3, 5], "loss_mask": [0, 0, 1, 1], "advantage": -0.5},
    {"id": "c", "tree_id": "t2", "input_ids": [1, 2, 9], "loss_mask": [0, 1, 1], "advantage": 0.0},
    {"id": "x", "tree_id": "t2", "input_ids": [1, 2, 9, 9, 9, 9, 9, 9], "loss_mask": [0] * 7 + [1], "advantage": 1.0},
]


@pytest.fixture
def small(tmp_path):
    path = tmp_path / "rollouts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECS))
    return path


def test_pack_then_unpack_is_exact(small, tmp_path):
    r = run("pack", small, "--capacity", "10", "-o", tmp_path / "packs", "--pad-to", "4", "--balance", "2")
    assert r.code == 0, r.err
    assert "ERR" in r.out and "packs" in r.out
    m = read_manifest(tmp_path / "packs")
    assert m["capacity"] == 8 and m["pad_to"] == 4  # 10 rounded down to a multiple of 4: padded packs fit
    assert m["command"] == f"treepack pack {small} --capacity 10 -o {tmp_path / 'packs'} --pad-to 4 --balance 2"
    assert all(p.n_tokens <= 8 and p.n_tokens % 4 == 0 for p in read_packs(tmp_path / "packs"))
    for out in ("back.jsonl", "back.parquet"):
        u = run("unpack", tmp_path / "packs", "-o", tmp_path / out)
        assert u.code == 0, u.err
        assert u.err == f"wrote 4 records (19 tokens) to {tmp_path / out}\n"
    back = [json.loads(line) for line in (tmp_path / "back.jsonl").read_text().splitlines()]
    assert back == RECS
    assert read_rollouts(tmp_path / "back.parquet").ids == ["a", "b", "c", "x"]


def test_the_manifest_command_reads_back_as_the_arguments_given(small, tmp_path):
    """Paths with spaces, quotes, $ and a newline come back from the recorded command through a POSIX shell's
    rules (shlex), and the command re-run in bash writes the same packs."""
    import shlex
    import subprocess
    import sys

    odd = tmp_path / "it's $HOME \"q\"\tx.jsonl"
    odd.write_bytes(small.read_bytes())
    out = tmp_path / "packs a\nb"
    assert run("pack", odd, "--capacity", "10", "-o", out, "-q").code == 0
    command = read_manifest(out)["command"]
    assert shlex.split(command) == ["treepack", "pack", str(odd), "--capacity", "10", "-o", str(out)]
    again = tmp_path / "again"
    treepack = f"{shlex.quote(sys.executable)} -m treepack"
    rerun = command.replace("treepack pack", f"{treepack} pack", 1).replace(shlex.quote(str(out)), str(again))
    done = subprocess.run(["bash", "-c", rerun + " -q"], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert [p.input_ids.tolist() for p in read_packs(again)] == [p.input_ids.tolist() for p in read_packs(out)]


def test_oversize_is_an_error_naming_the_sequence(small, tmp_path):
    r = run("pack", small, "--capacity", "6", "-o", tmp_path / "p")
    assert r.code == 1
    assert r.err == (f"Error: {small}: sequence id 'x' (record 3) has 8 tokens > capacity 6; "
                     "use --oversize skip to drop such sequences\n")
    assert not (tmp_path / "p").exists()


def test_oversize_skip_counts_and_reports(small, tmp_path):
    r = run("pack", small, "--capacity", "6", "-o", tmp_path / "p", "--oversize", "skip")
    assert r.code == 0, r.err
    assert r.err == (f"skipped 1 sequence(s) longer than the capacity 6 (first: {small}: sequence id 'x' "
                     "(record 3), 8 tokens)\n")
    m = read_manifest(tmp_path / "p")
    assert m["counts"]["oversize_skipped"] == 1 and m["oversize_skipped"] == [{"record": 3, "id": "x", "tokens": 8}]
    assert m["counts"]["packed_sequences"] == 3


def test_unpack_names_the_records_pack_left_out(small, tmp_path):
    assert run("pack", small, "--capacity", "6", "-o", tmp_path / "p", "--oversize", "skip", "-q").code == 0
    for where in (tmp_path / "p", tmp_path / "p" / "manifest.json"):
        u = run("unpack", where, "-o", tmp_path / "back.jsonl")
        assert u.code == 0, u.err
        assert u.err == (f"wrote 3 records (11 tokens) to {tmp_path / 'back.jsonl'}\n"
                         "not written: 1 input record(s) that pack left out: 1 over the pack capacity (not in the packs)\n")
    assert [json.loads(line) for line in (tmp_path / "back.jsonl").read_text().splitlines()] == RECS[:3]


def test_unpack_of_what_is_not_a_pack_directory(small, tmp_path):
    r = run("unpack", small, "-o", tmp_path / "x.jsonl")
    assert (r.code, r.err) == (1, f"Error: {small}: no manifest.json (not a directory written by `treepack pack`)\n")
    r = run("unpack", tmp_path / "nope", "-o", tmp_path / "x.jsonl")
    assert (r.code, r.err) == (1, f"Error: {tmp_path / 'nope'}: no such file or directory\n")


@pytest.mark.parametrize("args, message", [
    (["--capacity", "6x"], ("Invalid value for --capacity: invalid capacity '6x': expected an integer or a number "
                           "with k/K/M/G, e.g. 60k")),
    (["--capacity", "0"], "Invalid value for --capacity: invalid capacity '0': must be positive"),
    (["--capacity", "99999999999999999999"], ("Invalid value for --capacity: invalid capacity '99999999999999999999': "
                                              "too large (at most 2**62 = 4,611,686,018,427,387,904)")),
    (["--capacity", "8", "--group-by", "step"],  # sharing never crosses a step: not a scope to choose
     "Invalid value for --group-by: must be one of none, tree_id, got 'step'"),
    (["--capacity", "8", "--strategy", "greedy"],
     "Invalid value for --strategy: must be one of best, first-fit, dfs, optimal, got 'greedy'"),
    (["--capacity", "8", "--oversize", "drop"], "Invalid value for --oversize: must be one of error, skip, got 'drop'"),
    (["--capacity", "8", "--shard-size", "big"], ("Invalid value for --shard-size: invalid shard size 'big': expected "
                                                 "bytes (e.g. 256M) or a number of packs (e.g. 1000packs)")),
    (["--capacity", "8", "--pad-to", "16"], "Invalid value for --pad-to: --pad-to 16 is larger than the capacity 8"),
    (["--capacity", "8", "--balance", "0"], "Invalid value for --balance: must be positive, got 0"),
    (["--capacity", "8", "--balance-cost", "time"],
     "Invalid value for --balance-cost: must be one of tokens, flops, got 'time'"),
    (["--capacity", "8", "--balance-cost", "flops"],  # was ignored without --balance
     "Invalid value for --balance-cost: needs --balance (the cost it balances packs by)"),
])
def test_usage_errors(small, tmp_path, args, message):
    r = run("pack", small, "-o", tmp_path / "p", *args)
    assert r.code == 2
    assert r.err.rstrip().splitlines()[-1] == f"Error: {message}"


def test_output_errors(small, tmp_path):
    assert run("pack", small, "--capacity", "64", "-o", tmp_path / "p", "-q").code == 0
    again = run("pack", small, "--capacity", "64", "-o", tmp_path / "p")
    assert again.code == 1
    assert again.err == f"Error: {tmp_path / 'p'}: already holds packed shards; remove them or choose another output directory\n"
    (tmp_path / "f").write_text("")
    r = run("pack", small, "--capacity", "64", "-o", tmp_path / "f")
    assert (r.code, r.err) == (1, f"Error: {tmp_path / 'f'}: exists and is not a directory\n")
    r = run("unpack", tmp_path, "-o", tmp_path / "x.jsonl")
    assert (r.code, r.err) == (1, f"Error: {tmp_path}: no manifest.json (not a directory written by `treepack pack`)\n")
    for args in (("pack", small, "--capacity", "64", "-o", tmp_path / "f" / "p"),
                 ("unpack", tmp_path / "p", "-o", tmp_path / "f" / "x.jsonl")):  # under a file: the system refuses
        r = run(*args, "-q")
        assert (r.code, r.err) == (1, f"Error: {args[-1]}: Not a directory\n")
    r = run("unpack", tmp_path / "p", "-o", tmp_path / "x.csv")
    assert r.code == 2 and r.err.rstrip().endswith(
        f"Error: Invalid value for --output: '{tmp_path / 'x.csv'}': expected a .jsonl, .jsonl.gz or .parquet file, or -")


def test_flops_balance_and_group_by(small, tmp_path):
    r = run("pack", small, "--capacity", "64", "-o", tmp_path / "p", "--balance", "2", "--balance-cost", "flops",
            "--group-by", "tree_id", "--shard-size", "1packs")
    assert r.code == 0, r.err
    m = read_manifest(tmp_path / "p")
    assert m["balance"]["cost"] == "flops" and m["balance"]["model"] == "qwen3-1.7b" and m["group_by"] == "tree_id"
    assert m["stats"]["n_pack_tokens"] == 13  # t1: 1 2 3 {4, 5}; t2: 1 2 9 9 9 9 9 9 (groups share nothing)
    assert len(m["shards"]) == m["counts"]["packs"]


def test_stats_capacity_and_gate(small):
    r = run("stats", small, "--capacity", "8", "--json", "--min-err", "0.5")
    assert r.code == 1
    d = json.loads(r.out)
    assert (d["capacity"], d["strategy"], d["n_packs"], d["n_pack_tokens"]) == (8, "best", 2, 13)
    assert d["err"] == pytest.approx(1 - 13 / 19)  # x (8 tokens) fills a pack: {a, b} + {c, x}
    assert d["gate"]["failures"] == ["err 0.3158 < --min-err 0.5 (capacity 8)"]
    assert r.err == "gate failed: err 0.3158 < --min-err 0.5 (capacity 8)\n"
    ok = run("stats", small, "--capacity", "1K", "--min-err", "0.4")  # one pack: N_tree = 11, ERR = 0.42
    assert ok.code == 0 and "ERR" in ok.out and ok.out.rstrip().endswith("gate passed")


def test_stats_compare_strategies(small):
    r = run("stats", small, "--capacity", "8", "--compare-strategies", "--json")
    assert r.code == 0, r.err
    s = json.loads(r.out)["strategies"]
    assert list(s) == ["best", "first-fit", "dfs", "optimal"]
    assert s["best"]["n_pack_tokens"] == s["optimal"]["n_pack_tokens"] == 13
    assert all(set(v) == {"n_packs", "n_pack_tokens", "err", "seconds"} for v in s.values())
    table = run("stats", small, "--capacity", "8", "--compare-strategies")
    assert "packing strategies at capacity 8" in table.out and "first-fit" in table.out


@pytest.mark.parametrize("args, message", [
    (["--min-err", "0.3"], "Invalid value for --min-err: needs --capacity"),
    (["--compare-strategies"], "Invalid value for --compare-strategies: needs --capacity"),
    (["--capacity", "sixty"], ("Invalid value for --capacity: invalid capacity 'sixty': expected an integer or a "
                              "number with k/K/M/G, e.g. 60k")),
])
def test_stats_usage_errors(small, args, message):
    r = run("stats", small, *args)
    assert r.code == 2 and r.err.rstrip().splitlines()[-1] == f"Error: {message}"


def test_stats_oversize(small):
    r = run("stats", small, "--capacity", "6")
    assert (r.code, r.err) == (1, (f"Error: {small}: sequence id 'x' (record 3) has 8 tokens > capacity 6; "
                                  "use --oversize skip to drop such sequences\n"))
    r = run("stats", small, "--capacity", "6", "--oversize", "skip", "--json")
    assert r.code == 0 and json.loads(r.out)["n_packs"] == 1  # a, b, c: 1 2 3 4 5 9


def test_a_damaged_or_foreign_shard_and_an_output_inside_the_pack_directory(small, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = tmp_path / "packs"
    assert run("pack", small, "--capacity", "10", "-o", out).code == 0
    shard = out / read_manifest(out)["shards"][0]["file"]
    r = run("unpack", out, "-o", shard)  # would replace the shard it reads
    assert r.code == 2 and "write it outside the pack directory" in r.err
    good = shard.read_bytes()
    shard.write_bytes(good[:200])
    for command in (("unpack", out, "-o", tmp_path / "x.jsonl"), ("stats", out)):
        r = run(*command)
        want = f"Error: {shard}: 200 bytes where the manifest says {len(good):,} (the file was changed, replaced or cut short)\n"
        assert (r.code, r.err) == (1, want)
    pq.write_table(pa.table({"a": [1]}), shard)
    r = run("unpack", out, "-o", tmp_path / "x.jsonl")
    assert r.code == 1 and r.err.startswith(f"Error: {shard}: ") and r.err.endswith(" (the file was changed, replaced "
                                                                                       "or cut short)\n")


def test_unpack_to_parquet_of_an_integer_beyond_int64_is_one_line(tmp_path):
    src = tmp_path / "big.jsonl"
    src.write_text('{"input_ids": [1], "big": 123456789012345678901234567890}\n')
    assert run("pack", src, "--capacity", "8", "-o", tmp_path / "p").code == 0
    r = run("unpack", tmp_path / "p", "-o", tmp_path / "big.parquet")
    assert r.code == 1 and r.err.startswith("Error: the records do not fit one Parquet schema (")
    assert r.err.endswith("; write .jsonl instead\n")
    assert run("unpack", tmp_path / "p", "-o", tmp_path / "big.jsonl").code == 0


def test_report_with_oversize_error_stops_as_pack_does(small, tmp_path):
    r = run("report", small, "-o", tmp_path / "r.html", "--capacity", "6", "--oversize", "error")
    assert r.code == 1 and r.err.endswith("has 8 tokens > capacity 6; use --oversize skip to drop such sequences\n")
    assert not (tmp_path / "r.html").exists()


def test_a_dictionary_encoded_tree_id_column_reads_and_round_trips(tmp_path):
    """pandas writes categoricals as dictionary columns: their values are strings like any other tree_id."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    t = pa.table({"input_ids": [[1, 2, 3], [1, 2, 4], [5, 6]], "tree_id": pa.array(["a", "a", "b"]).dictionary_encode()})
    pq.write_table(t, tmp_path / "c.parquet")
    assert read_rollouts(tmp_path / "c.parquet").group_names == ["a", "b"]
    assert run("pack", tmp_path / "c.parquet", "-c", "100", "-o", tmp_path / "p").code == 0
    assert run("unpack", tmp_path / "p", "-o", tmp_path / "b.parquet").code == 0
    assert pq.read_table(tmp_path / "b.parquet").equals(t)
