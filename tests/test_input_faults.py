"""Input faults as a new user meets them: broken gzip, JSON arrays, directories, pack directories, repeated
ids. Each fault: the exact one-line message and exit code, and with ``--on-error skip`` what is kept and
counted (a broken compressed file is not a bad record: an error with skip too)."""

from __future__ import annotations

import gzip
import hashlib
import json
import re

import pytest
from cli_helpers import run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from treepack.errors import InputError
from treepack.io.ingest import SUPPORTED_TEXT, read_rollouts
from treepack.io.jsonl import iter_json_records

RECORDS = [{"id": f"r{i}", "tree_id": i % 3, "input_ids": [1, 2, 3, i + 4, i + 5] * 20} for i in range(60)]


def jsonl_bytes(records) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


def truncated_gz(tmp_path):
    """A .jsonl.gz cut in the middle of its compressed stream, and how many whole lines survive."""
    full = gzip.compress(jsonl_bytes(RECORDS), compresslevel=1)
    cut = full[: len(full) // 2]
    d = __import__("zlib").decompressobj(31)
    whole = d.decompress(cut).count(b"\n")
    path = tmp_path / "t.jsonl.gz"
    path.write_bytes(cut)
    return path, whole


def test_not_gzip_names_the_file_exit_1(tmp_path):
    path = tmp_path / "x.jsonl.gz"
    path.write_text('{"input_ids":[1]}\n')
    for extra in ((), ("--on-error", "skip")):  # nothing of the file can be read: skip can not help
        r = run("stats", path, *extra)
        assert r.code == 1
        assert r.err == f"Error: {path}: not a gzip file (the name ends in .gz but it starts with " + "'{\"input_')\n"


def test_truncated_gzip_is_one_line_not_aborted(tmp_path):
    path, whole = truncated_gz(tmp_path)
    r = run("stats", path)
    assert r.code == 1
    assert r.err == (f"Error: {path}: line {whole + 1}: truncated gzip file (the compressed stream ends early, "
                     f"after {whole:,} complete lines)\n")


@pytest.mark.parametrize("command", ["stats", "pack"])
@pytest.mark.parametrize("extra", [(), ("--on-error", "skip")])
def test_truncated_gzip_is_an_error_with_skip_too(tmp_path, command, extra):
    """A cut-short file is not a bad record: the records after the break are lost, and how many is unknown, so
    ``--on-error skip`` can not count them as skipped. One line naming the file and where it broke, exit 1, no
    output (pack writes no directory)."""
    path, whole = truncated_gz(tmp_path)
    args = ("-c", "1K", "-o", tmp_path / "packs") if command == "pack" else ()
    r = run(command, path, *args, *extra)
    assert (r.code, r.out) == (1, "")
    assert r.err == (f"Error: {path}: line {whole + 1}: truncated gzip file (the compressed stream ends early, "
                     f"after {whole:,} complete lines)\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]
    with pytest.raises(InputError, match=rf"^{path}: line {whole + 1}: truncated gzip file"):
        read_rollouts(path, on_error="skip")


def test_damaged_deflate_stream(tmp_path):
    full = bytearray(gzip.compress(jsonl_bytes(RECORDS), compresslevel=1))
    full[len(full) // 2: len(full) // 2 + 64] = bytes(64)  # zeros inside the deflate data
    path = tmp_path / "d.jsonl.gz"
    path.write_bytes(bytes(full))
    r = run("stats", path)
    assert r.code == 1 and r.err.count("\n") == 1 and r.err.startswith(f"Error: {path}: line ")
    assert "Traceback" not in r.err
    r = run("stats", path, "--on-error", "skip")  # skips the garbage lines the damage decodes to, then stops
    assert (r.code, r.out, r.err.count("\n")) == (1, "", 1)
    assert re.fullmatch(rf"Error: {re.escape(str(path))}: line \d+: corrupt gzip data \(.+, after \d+ complete "
                        r"lines\)\n", r.err)


def test_bad_gzip_checksum_is_named_with_skip_too(tmp_path):
    full = bytearray(gzip.compress(jsonl_bytes(RECORDS)))
    full[-8] ^= 0xFF  # the CRC-32 of the trailer: every line inflates, the check at the end fails
    path = tmp_path / "crc.jsonl.gz"
    path.write_bytes(bytes(full))
    r = run("stats", path)
    n = len(RECORDS)
    assert (r.code, r.err) == (1, (f"Error: {path}: line {n + 1}: corrupt gzip data (incorrect data check, after "
                                  f"{n} complete lines)\n"))
    assert run("stats", path, "--on-error", "skip", "--json") == r  # not a bad record: skip can not skip it


def test_concatenated_gzip_members_read_as_one(tmp_path):
    path = tmp_path / "cat.jsonl.gz"
    path.write_bytes(gzip.compress(jsonl_bytes(RECORDS[:7])) + gzip.compress(jsonl_bytes(RECORDS[7:])))
    r = read_rollouts(path)
    assert r.ids == [rec["id"] for rec in RECORDS]
    assert r.sources[0].sha256 == hashlib.sha256(path.read_bytes()).hexdigest()


def test_progress_counts_bytes_on_disk(tmp_path):
    """A .gz file's bar compares compressed bytes read with the compressed size: it ends at 100%."""
    path = tmp_path / "p.jsonl.gz"
    path.write_bytes(gzip.compress(jsonl_bytes(RECORDS * 50)))
    seen = []
    read_rollouts(path, progress=seen.append)
    assert sum(seen) == path.stat().st_size


def test_json_array_file_is_read_as_records(tmp_path):
    path = tmp_path / "a.json"
    path.write_text(json.dumps(RECORDS[:5], indent=2))
    r = read_rollouts(path)
    assert r.ids == [rec["id"] for rec in RECORDS[:5]]
    assert r.sources[0].format == "json"
    bad = tmp_path / "b.json"
    bad.write_text(json.dumps([RECORDS[0], {"input_ids": [1, -2]}]))
    r = run("stats", bad)
    assert (r.code, r.err) == (1, f"Error: {bad}: record 2: field 'input_ids'[1] is negative (-2)\n")
    chats = tmp_path / "chats.json"
    chats.write_text(json.dumps([{"task_id": 1, "traj": [{"role": "user", "content": "hi"}]}]))
    r = run("stats", chats)
    assert (r.code, r.err) == (1, (f"Error: {chats}: record 1: missing tokens field 'input_ids' (or 'tokens', "
                                  "'token_ids'); found fields: 'task_id', 'traj'\n"))


def test_byte_order_mark_is_not_data(tmp_path):
    """Windows editors start UTF-8 files with a BOM: a JSON array and JSONL read as without it."""
    for name, text in (("a.json", json.dumps(RECORDS[:3], indent=1)), ("a.jsonl", jsonl_bytes(RECORDS[:3]).decode())):
        path = tmp_path / name
        path.write_bytes(b"\xef\xbb\xbf" + text.encode())
        assert read_rollouts(path).ids == ["r0", "r1", "r2"]


def test_a_key_twice_in_a_json_array_record_is_that_records_error(tmp_path):
    path = tmp_path / "a.json"
    path.write_text('[{"input_ids": [1]}, {"input_ids": [2], "id": "x", "id": "y"}, {"input_ids": [3]}]')
    with pytest.raises(InputError, match=r"a.json: record 2: key 'id' appears twice in one object$"):
        read_rollouts(path)
    r = read_rollouts(path, on_error="skip")
    assert r.tokens.tolist() == [1, 3] and dict(r.skipped) == {"duplicate key": 1}


def test_broken_json_array(tmp_path):
    path = tmp_path / "a.json"
    path.write_text('[{"input_ids": [1]},\n {"input_ids": [2]')
    r = run("stats", path)
    assert r.code == 1
    assert r.err.startswith(f"Error: {path}: not a valid JSON array (") and r.err.count("\n") == 1


def test_iter_json_records_reads_jsonl_and_arrays(tmp_path):
    a = tmp_path / "a.json"
    a.write_text(json.dumps([{"x": 1}, {"y": [2]}]))
    b = tmp_path / "b.jsonl.gz"
    b.write_bytes(gzip.compress(b'{"x": 1}\n\nnot json\n'))
    assert [(r.where, r.value) for r in iter_json_records(str(a))] == [("record 1", {"x": 1}), ("record 2", {"y": [2]})]
    got = list(iter_json_records(str(b)))
    assert [r.where for r in got] == ["line 1", "line 3"]
    assert got[0].value == {"x": 1} and got[1].error.reason == "malformed JSON"
    cut, whole = truncated_gz(tmp_path)
    with pytest.raises(InputError, match=rf"^{cut}: line {whole + 1}: truncated gzip file"):
        list(iter_json_records(str(cut)))


def test_directory_reads_every_supported_file_and_names_the_rest(tmp_path):
    d = tmp_path / "data"
    (d / "sub").mkdir(parents=True)
    (d / "a.json").write_text(json.dumps(RECORDS[:2]))
    (d / "b.jsonl").write_bytes(jsonl_bytes(RECORDS[2:4]))
    (d / "sub" / "c.jsonl.gz").write_bytes(gzip.compress(jsonl_bytes(RECORDS[4:5])))
    (d / "notes.txt").write_text("hello")
    (d / ".hidden.jsonl").write_text("junk")
    r = run("stats", d, "--json")
    assert r.code == 0
    out = json.loads(r.out)
    assert out["n_sequences"] == 5
    assert out["skipped_files"] == [
        {"path": str(d / ".hidden.jsonl"), "reason": "hidden"},
        {"path": str(d / "notes.txt"), "reason": f"not a rollout file (.txt; reading {SUPPORTED_TEXT})"},
    ]
    assert r.err.splitlines() == [
        "skipped 2 files not read as rollouts:",
        f"  {d / '.hidden.jsonl'}: hidden",
        f"  {d / 'notes.txt'}: not a rollout file (.txt; reading {SUPPORTED_TEXT})",
    ]


def test_directory_without_rollouts(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    r = run("stats", tmp_path)
    assert r.code == 1
    assert r.err == (f"Error: {tmp_path}: directory has no rollout files ({SUPPORTED_TEXT}); skipped "
                     f"notes.txt: not a rollout file (.txt; reading {SUPPORTED_TEXT})\n")


@pytest.mark.parametrize("command, what", [
    (["stats"], "sequences to analyse"),
    (["pack", "-c", "1K", "-o", "packs"], "sequences to pack"),
    (["plot", "-o", "tree.png"], "sequences to plot"),
    (["report", "-o", "report.html"], "sequences to report on"),
])
def test_empty_file_is_named(tmp_path, monkeypatch, command, what):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty.jsonl").write_text("")
    r = run(command[0], "empty.jsonl", *command[1:])
    assert (r.code, r.err) == (1, f"Error: empty.jsonl: no {what} (the input holds no records)\n")


def test_pack_directory_stats_describe_the_original_rollouts(tmp_path):
    src = tmp_path / "r.jsonl"
    src.write_bytes(jsonl_bytes(RECORDS))
    assert run("pack", src, "-c", "1K", "-o", tmp_path / "packs", "-q").code == 0
    direct = json.loads(run("stats", src, "--json").out)
    packed = json.loads(run("stats", tmp_path / "packs", "--json").out)
    via_manifest = json.loads(run("stats", tmp_path / "packs" / "manifest.json", "--json").out)
    for key in ("n_sequences", "n_flat_tokens", "n_tree_tokens", "compression", "c_attn", "branching"):
        assert packed[key] == direct[key] == via_manifest[key], key
    assert packed["pack_directory"] == str(tmp_path / "packs")
    r = run("stats", tmp_path / "packs", src)
    assert (r.code, r.err) == (1, (f"Error: {tmp_path / 'packs'}: a directory written by `treepack pack` is read "
                                  "on its own, not together with other inputs\n"))
    # a pack directory inside a data directory is not read twice: it is named as skipped
    r = run("stats", tmp_path, "--json")
    assert json.loads(r.out)["n_sequences"] == len(RECORDS)
    assert json.loads(r.out)["skipped_files"] == [{"path": str(tmp_path / "packs"), "reason": (
        "a directory written by `treepack pack` (name it to read its records)")}]


def test_pack_directory_counts_what_is_not_in_the_packs(tmp_path):
    src = tmp_path / "r.jsonl"
    long = {"id": "long", "input_ids": list(range(50))}
    src.write_bytes(jsonl_bytes([{"id": i, "input_ids": [1, 2, i]} for i in range(4)] + [long]))
    assert run("pack", src, "-c", "40", "--oversize", "skip", "-o", tmp_path / "p", "-q").code == 0
    d = json.loads(run("stats", tmp_path / "p", "--json").out)
    assert d["n_sequences"] == 4 and d["skipped"] == {"over the pack capacity (not in the packs)": 1}


def test_duplicate_ids_are_reported(tmp_path):
    path = tmp_path / "dup.jsonl"
    path.write_bytes(jsonl_bytes([{"id": "a", "input_ids": [1]}, {"id": "b", "input_ids": [2]},
                                  {"id": "a", "input_ids": [3]}, {"id": "a", "tree_id": 1, "input_ids": [4]}]))
    r = run("stats", path, "--json")
    assert r.code == 0 and json.loads(r.out)["n_duplicate_ids"] == 1
    assert r.err == f"warning: 1 record(s) repeat an id an earlier record has (first: {path}: line 3: id 'a' repeats line 1)\n"


@pytest.mark.parametrize("line,message", [
    ('{"input_ids": [1, 2], "loss_mask": [true, 2]}', "field 'loss_mask'[1] must be 0 or 1, got 2"),
    ('{"input_ids": [1, 2], "loss_mask": [1, 257]}', "field 'loss_mask'[1] must be 0 or 1, got 257"),
    ('{"input_ids": [1, 2147483648]}', "field 'input_ids'[1] does not fit int32 (2147483648)"),
    ('{"input_ids": [1, 18446744073709551616]}', "field 'input_ids'[1] does not fit int32 (18446744073709551616)"),
    ('{"input_ids": [1], "logprobs": [NaN]}', "field 'logprobs'[0] is not a finite number: NaN"),
    ('{"input_ids": [1], "step": 1.5}', "field 'step' must be an integer, got 1.5"),
    ('{"input_ids": [1], "step": 9223372036854775808}', "field 'step' does not fit int64 (9223372036854775808)"),
    ('{"input_ids": [1], "step": -1}', "field 'step' must be >= 0, got -1"),  # -1 is "no step" inside
    ('{"input_ids": [1], "id": [1]}', "field 'id' must be a string or an integer, got array"),
    ('{"input_ids": [[1, 2], 3]}', "field 'input_ids'[0] is not an integer: [1, 2]"),
    ('{"input_ids": [1, 2], "loss_mask": [[1], 1]}', "field 'loss_mask'[0] must be 0 or 1, got [1]"),
    ('{"input_ids": [1, 2], "logprobs": [-0.5, [-0.25]]}', "field 'logprobs'[1] is not a finite number: [-0.25]"),
    ('{"tags": ["a"], "input_ids": [1, [2], 3]}', "field 'input_ids'[1] is not an integer: [2]"),
    ('{"input_ids": [[1], [2]], "meta": {"input_ids": [5]}}', "field 'input_ids'[0] is not an integer: [1]"),
    # a key twice: json keeps the last value, simdjson the first; neither is the record
    ('{"input_ids": [1, 2], "input_ids": [3]}', "key 'input_ids' appears twice in one object"),
    ('{"input_ids": [1, 2], "meta": [{"a": 1, "a": 2}]}', "key 'a' appears twice in one object"),
])
def test_fast_path_defers_to_the_precise_message(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"input_ids": [5, 6]}\n' + line + "\n")
    with pytest.raises(InputError) as exc:
        read_rollouts(path)
    assert str(exc.value) == f"{path}: line 2: {message}"


bad_or_good = st.one_of(
    st.fixed_dictionaries({"input_ids": st.lists(st.one_of(st.integers(-2, 2**31 + 1), st.just([7])), min_size=0,
                                                 max_size=5)},
                          optional={"loss_mask": st.lists(st.sampled_from([0, 1, 2, True, False, 1.0, -1, [1]]),
                                                          max_size=5),
                                    "logprobs": st.lists(st.sampled_from([-0.5, -1, 0.0, -2.25, [-0.5]]), max_size=5),
                                    "reward": st.sampled_from([None, 1, 0.5, "x", True]),
                                    "step": st.sampled_from([0, 1, 2.5, None]),
                                    "id": st.sampled_from(["a", 3, None, [1]]),
                                    "tree_id": st.sampled_from(["t", 0, None]),
                                    "tags": st.sampled_from([["x"], "[", {"input_ids": [1]}])}),
    st.sampled_from(["[1, 2]", "not json", '{"input_ids": [1, 2.0]}', '{"tokens": [4, 5]}',
                     '{"input_ids": [1], "input_ids": [2]}', '{"input_ids": [3], "m": {"k": 1, "k": 1}}']),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(bad_or_good, min_size=1, max_size=8), st.sampled_from(["raise", "skip"]))
def test_fast_path_equals_the_precise_path(tmp_path, monkeypatch, recs, on_error):
    """simdjson or not, the same records, the same values, the same errors and counts."""
    from treepack.io import jsonl

    path = tmp_path / "r.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in recs))

    def read():
        try:
            r = read_rollouts(path, on_error=on_error, keep_records=True)
        except InputError as exc:
            return str(exc)
        return json.dumps([  # NaN-safe comparison (rewards and log-probs of records without them are NaN)
            r.tokens.tolist(), r.offsets.tolist(), r.ids, None if r.loss_mask is None else r.loss_mask.tolist(),
            None if r.logprobs is None else r.logprobs.tolist(), r.group_names, dict(r.skipped),
            r.skipped_examples, r.extras.templates, r.extras.carry.tolist(),
            None if r.rewards is None else r.rewards.tolist(), None if r.steps is None else r.steps.tolist()])

    fast = read()
    monkeypatch.setattr(jsonl, "simdjson", None)
    assert read() == fast


def test_a_negative_step_is_refused_in_parquet_and_a_missing_one_is_named(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from treepack.stats import compute_stats
    from treepack.tree import PrefixTree

    path = tmp_path / "s.parquet"
    pq.write_table(pa.table({"input_ids": [[1, 2], [1, 3]], "step": [0, -2]}), path)
    with pytest.raises(InputError, match=r"s.parquet: row 1: field 'step' must be >= 0, got -2$"):
        read_rollouts(path)
    jl = tmp_path / "s.jsonl"
    jl.write_text('{"input_ids": [1, 2, 3]}\n{"input_ids": [1, 2, 4], "step": 2}\n')
    r = read_rollouts(jl)
    assert [g.group for g in compute_stats(PrefixTree.build(r), rollouts=r).groups] == ["no step", "step 2"]
