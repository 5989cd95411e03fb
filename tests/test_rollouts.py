"""Ingest: formats, aliases, and the exact one-line error for each kind of bad record."""

import gzip
import json
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from treepack.errors import InputError
from treepack.io.ingest import read_rollouts
from treepack.io.records import iter_records, to_arrow

GOOD = [
    {"id": "a", "tree_id": "g1", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1], "reward": 1.0, "step": 0},
    {"id": "b", "tree_id": "g1", "input_ids": [1, 2, 4], "loss_mask": [0, 0, 1], "advantage": -0.5, "step": 0},
    {"id": "c", "tree_id": "g2", "input_ids": [5], "loss_mask": [1], "step": 1},
]


def write_jsonl(path, records, *, raw_lines=()):
    lines = [json.dumps(r) for r in records] + list(raw_lines)
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wt") as f:
        f.write("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_reads_jsonl(tmp_path, suffix):
    r = read_rollouts(write_jsonl(tmp_path / f"r{suffix}", GOOD))
    assert len(r) == 3 and r.n_tokens == 7
    assert r.tokens.dtype == np.int32 and r.offsets.tolist() == [0, 3, 6, 7]
    assert r.ids == ["a", "b", "c"]
    assert r.loss_mask.tolist() == [0, 1, 1, 0, 0, 1, 1]
    assert [r.group_names[g] for g in r.groups] == ["g1", "g1", "g2"]
    assert r.steps.tolist() == [0, 0, 1]
    assert np.isnan(r.rewards[1]) and r.rewards[0] == 1.0
    assert r.sources[0].n_records == 3 and len(r.sources[0].sha256) == 64


def test_parquet_and_directory_roundtrip(tmp_path):
    r = read_rollouts(write_jsonl(tmp_path / "r.jsonl", GOOD))
    d = tmp_path / "dir"
    d.mkdir()
    pq.write_table(to_arrow(r), d / "part-0.parquet")
    back = read_rollouts(d)
    assert list(iter_records(back)) == list(iter_records(r))


def test_aliases_defaults_and_tokens_field(tmp_path):
    recs = [{"tokens": [1, 2]}, {"token_ids": [3]}, {"group_id": 7, "input_ids": [4, 4]}]
    r = read_rollouts(write_jsonl(tmp_path / "a.jsonl", recs))
    assert r.tokens.tolist() == [1, 2, 3, 4, 4]
    assert r.ids == [0, 1, 2]  # default id: 0-based record index in its file
    assert r.loss_mask is None
    r2 = read_rollouts(write_jsonl(tmp_path / "b.jsonl", [{"ids": [9, 8]}]), tokens_field="ids")
    assert r2.tokens.tolist() == [9, 8]


def test_stdin(tmp_path):
    path = write_jsonl(tmp_path / "r.jsonl", GOOD)
    code = "from treepack.io import read_rollouts; r = read_rollouts('-'); print(len(r), r.n_tokens)"
    with open(path) as stdin:
        out = subprocess.run([sys.executable, "-c", code], stdin=stdin, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["3", "7"]


BAD_LINES = [
    ('{"input_ids": [1, 2.5]}', "field 'input_ids'[1] is not an integer: 2.5"),
    ('{"input_ids": [1, -3]}', "field 'input_ids'[1] is negative (-3)"),
    ('{"input_ids": [1, "x"]}', "field 'input_ids'[1] is not an integer: \"x\""),
    ('{"input_ids": []}', "field 'input_ids' is empty"),
    ('{"input_ids": "1 2"}', "field 'input_ids' must be a list of integers, got string"),
    ('{"input_ids": [1, 2], "loss_mask": [1]}', "field 'loss_mask' has length 1 but 'input_ids' has length 2"),
    ('{"input_ids": [1, 2], "loss_mask": [1, 2]}', "field 'loss_mask'[1] must be 0 or 1, got 2"),
    ('{"input_ids": [1, 2], "logprobs": [-0.1]}', "field 'logprobs' has length 1 but 'input_ids' has length 2"),
    ('{"input_ids": [1], "reward": "high"}', "field 'reward' must be a finite number, got \"high\""),
    ('{"input_ids": [1], "step": 1.5}', "field 'step' must be an integer, got 1.5"),
    ('{"text": "hi", "label": 1}', "missing tokens field 'input_ids' (or 'tokens', 'token_ids'); found fields: 'text', 'label'"),
    ('{"input_ids": [1, 2]', "malformed JSON (Expecting ',' delimiter at column 21)"),
    ('{"input_ids": [1], "id": "a}', "malformed JSON (Unterminated string starting at column 26)"),
    ("[1, 2, 3]", "expected a JSON object, got array"),
]


@pytest.mark.parametrize("line,message", BAD_LINES)
def test_bad_record_names_file_line_and_field(tmp_path, line, message):
    path = write_jsonl(tmp_path / "bad.jsonl", GOOD[:2], raw_lines=[line])
    with pytest.raises(InputError) as exc:
        read_rollouts(path)
    assert str(exc.value) == f"{path}: line 3: {message}"


def test_skip_counts_every_bad_record(tmp_path):
    lines = [bad for bad, _ in BAD_LINES]
    path = write_jsonl(tmp_path / "bad.jsonl", GOOD, raw_lines=lines)
    r = read_rollouts(path, on_error="skip")
    assert len(r) == 3
    assert r.n_skipped == len(BAD_LINES)
    assert r.skipped["negative token"] == 1 and r.skipped["malformed JSON"] == 2
    assert r.sources[0].n_skipped == len(BAD_LINES)
    assert r.skipped_examples[0] == f"{path}: line 4: {BAD_LINES[0][1]}"


def test_parquet_errors_name_the_row(tmp_path):
    t = pa.table({"input_ids": pa.array([[1, 2], [3, -1], []], type=pa.list_(pa.int64()))})
    pq.write_table(t, tmp_path / "bad.parquet")
    with pytest.raises(InputError) as exc:
        read_rollouts(tmp_path / "bad.parquet")
    assert str(exc.value) == f"{tmp_path / 'bad.parquet'}: row 1: field 'input_ids'[1] is negative (-1)"
    r = read_rollouts(tmp_path / "bad.parquet", on_error="skip")
    assert r.tokens.tolist() == [1, 2] and dict(r.skipped) == {"negative token": 1, "empty sequence": 1}
    pq.write_table(pa.table({"text": ["x"]}), tmp_path / "none.parquet")
    with pytest.raises(InputError, match=r"none.parquet: missing tokens field .* found fields: 'text'$"):
        read_rollouts(tmp_path / "none.parquet")
    pq.write_table(pa.table({"input_ids": pa.array([[1.5]])}), tmp_path / "float.parquet")
    with pytest.raises(InputError, match=r"field 'input_ids' must be a list of integers, got list<element: double>"):
        read_rollouts(tmp_path / "float.parquet")
    nulls = pa.table({"input_ids": [[1, 2], [3, 4]], "loss_mask": pa.array([[1, 0], [1, None]], pa.list_(pa.int8()))})
    pq.write_table(nulls, tmp_path / "nulls.parquet")
    with pytest.raises(InputError) as exc:
        read_rollouts(tmp_path / "nulls.parquet")
    assert str(exc.value) == f"{tmp_path / 'nulls.parquet'}: row 1: field 'loss_mask'[1] must be 0 or 1, got null"
    steps = pa.table({"input_ids": [[1], [2]], "step": pa.array([1, 2**63], pa.uint64())})
    pq.write_table(steps, tmp_path / "steps.parquet")
    with pytest.raises(InputError) as exc:
        read_rollouts(tmp_path / "steps.parquet")
    assert str(exc.value) == f"{tmp_path / 'steps.parquet'}: row 1: field 'step' does not fit int64 (9223372036854775808)"
    r = read_rollouts(tmp_path / "steps.parquet", on_error="skip")
    assert r.steps.tolist() == [1] and dict(r.skipped) == {"bad step": 1}


def test_missing_file(tmp_path):
    with pytest.raises(InputError, match=r"nope.jsonl: no such file"):
        read_rollouts(tmp_path / "nope.jsonl")


def test_select_keeps_fields(tmp_path):
    r = read_rollouts(write_jsonl(tmp_path / "r.jsonl", GOOD))
    s = r.select(np.array([2, 0]))
    assert s.ids == ["c", "a"] and s.tokens.tolist() == [5, 1, 2, 3] and s.loss_mask.tolist() == [1, 0, 1, 1]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_logprobs_validated_but_not_kept_and_masks_kept(tmp_path, fmt):
    r = read_rollouts(write_jsonl(tmp_path / "r.jsonl", [{**g, "logprobs": [-0.5] * len(g["input_ids"])} for g in GOOD]))
    path = tmp_path / "r.jsonl"
    if fmt == "parquet":
        path = tmp_path / "r.parquet"
        pq.write_table(to_arrow(r), path)
    lean = read_rollouts(path, keep_token_fields=False)
    assert lean.logprobs is None and r.logprobs is not None  # 8 bytes a token stats does not need
    assert lean.loss_mask.tolist() == r.loss_mask.tolist()  # 1 byte a token: the FLOP model's loss targets
    assert lean.tokens.tolist() == r.tokens.tolist() and lean.ids == r.ids
    bad = write_jsonl(tmp_path / "bad.jsonl", GOOD[:1], raw_lines=['{"input_ids": [1, 2], "loss_mask": [1]}'])
    with pytest.raises(InputError, match="line 2: field 'loss_mask' has length 1"):
        read_rollouts(bad, keep_token_fields=False)
