"""pack -> unpack gives every record back exactly: every field, known or unknown, with its JSON type (null
stays null, booleans stay booleans, absent stays absent), in input order and key order; Parquet input comes
back with its own schema. Random records (hypothesis) and third-party files."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from cli_helpers import run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from treepack.io.ingest import read_rollouts
from treepack.io.records import iter_records, write_rollouts
from treepack.pack.shard_reader import read_manifest, unpack
from treepack.pack.shards import write_shards
from treepack.pack.strategies import pack_sequences

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
SETTINGS = settings(max_examples=25, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40),
                         st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=6))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)), max_leaves=8)


@st.composite
def records(draw):
    """JSON records: tokens that share prefixes, known fields in every JSON form, unknown nested fields."""
    n = draw(st.integers(1, 8))
    out = []
    for i in range(n):
        base = out[draw(st.integers(0, i - 1))]["input_ids"] if i and draw(st.booleans()) else []
        toks = base[: draw(st.integers(0, len(base)))] + draw(st.lists(st.integers(0, 9), min_size=1, max_size=6))
        rec: dict = {}
        fields = draw(st.permutations(["id", "tree_id", "loss_mask", "reward", "advantage", "logprobs", "extra",
                                       "messages", "uid"]))
        for name in fields[: draw(st.integers(0, len(fields)))]:
            if name == "id":
                rec[name] = draw(st.one_of(st.integers(0, 3), st.text(max_size=3), st.just(2**64)))
            elif name == "tree_id":
                rec[name] = draw(st.one_of(st.none(), st.integers(0, 2), st.sampled_from(["a", "b", -2**70])))
            elif name == "loss_mask":
                rec[name] = draw(st.one_of(
                    st.none(), st.lists(st.integers(0, 1), min_size=len(toks), max_size=len(toks)),
                    st.lists(st.booleans(), min_size=len(toks), max_size=len(toks)),
                    st.lists(st.sampled_from([0.0, 1.0]), min_size=len(toks), max_size=len(toks))))
            elif name in ("reward", "advantage"):
                rec[name] = draw(st.one_of(st.none(), st.integers(-3, 3), st.floats(-5, 5, allow_nan=False)))
            elif name == "logprobs":
                rec[name] = draw(st.one_of(
                    st.none(), st.lists(st.floats(-20, 0, allow_nan=False), min_size=len(toks), max_size=len(toks)),
                    st.lists(st.integers(-3, 0), min_size=len(toks), max_size=len(toks))))
            else:
                rec[name] = draw(json_values)
        at = draw(st.integers(0, len(rec)))  # the tokens anywhere in the key order
        ordered = dict(list(rec.items())[:at] + [("input_ids", toks)] + list(rec.items())[at:])
        out.append(ordered)
    return out


def pack_and_unpack(paths, tmp: Path, capacity: int = 64):
    r = read_rollouts(paths, keep_records=True)
    out = tmp / "packs"
    write_shards(r, pack_sequences(r, capacity), out)
    return unpack(out)


def exact(rec) -> str:
    """Key order and JSON types included (1, 1.0 and true differ)."""
    return json.dumps(rec, ensure_ascii=False)


@SETTINGS
@given(records())
def test_jsonl_round_trip_is_exact(tmp_path_factory, recs):
    tmp = tmp_path_factory.mktemp("rt")
    path = tmp / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    back = pack_and_unpack(path, tmp)
    assert [exact(r) for r in iter_records(back)] == [exact(r) for r in recs]
    write_rollouts(back, str(tmp / "out.jsonl"))
    lines = (tmp / "out.jsonl").read_text(encoding="utf-8").split("\n")[:-1]  # not splitlines: U+0085 is text
    assert lines == [json.dumps(r, separators=(",", ":"), ensure_ascii=False) for r in recs]


@st.composite
def tables(draw):
    n = draw(st.integers(1, 8))
    toks = [draw(st.lists(st.integers(0, 5), min_size=1, max_size=6)) for _ in range(n)]
    cols = {"uid": pa.array([draw(st.one_of(st.none(), st.text(max_size=3))) for _ in range(n)], pa.string())}
    cols["input_ids"] = pa.array(toks, pa.list_(draw(st.sampled_from([pa.int32(), pa.int64()]))))
    if draw(st.booleans()):
        mtype = draw(st.sampled_from([pa.int8(), pa.bool_(), pa.int64()]))
        cols["loss_mask"] = pa.array([None if draw(st.booleans()) and k else
                                      [draw(st.integers(0, 1)) for _ in t] for k, t in enumerate(toks)],
                                     pa.list_(pa.int64())).cast(pa.list_(mtype))
    cols["meta"] = pa.array([{"k": draw(st.integers(0, 3)), "tags": draw(st.lists(st.text(max_size=2), max_size=2))}
                             for _ in range(n)])
    cols["reward"] = pa.array([draw(st.one_of(st.none(), st.floats(-1, 1))) for _ in range(n)], pa.float64())
    order = draw(st.permutations(list(cols)))
    return pa.table({c: cols[c] for c in order})


@SETTINGS
@given(tables())
def test_parquet_round_trip_keeps_the_schema(tmp_path_factory, table):
    tmp = tmp_path_factory.mktemp("pq")
    pq.write_table(table, tmp / "in.parquet")
    back = pack_and_unpack(tmp / "in.parquet", tmp)
    write_rollouts(back, str(tmp / "out.parquet"))
    got = pq.read_table(tmp / "out.parquet")
    assert got.schema == table.schema
    assert got.equals(table)
    assert list(iter_records(back)) == table.to_pylist()


def test_unpack_cli_parquet_and_jsonl(tmp_path):
    recs = [{"id": "a", "input_ids": [1, 2, 3], "loss_mask": [True, False, True], "reward": None, "x": {"y": [1]}},
            {"input_ids": [1, 2, 4], "reward": 1, "extra": None}]
    src = tmp_path / "in.jsonl.gz"
    src.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in recs).encode()))
    assert run("pack", src, "-c", "1K", "-o", tmp_path / "p", "-q").code == 0
    assert read_manifest(tmp_path / "p")["records"] == {"kind": "json", "tokens_field": None}
    r = run("unpack", tmp_path / "p", "-o", tmp_path / "back.jsonl")
    assert (r.code, r.err) == (0, f"wrote 2 records (6 tokens) to {tmp_path / 'back.jsonl'}\n")
    assert [json.loads(line) for line in (tmp_path / "back.jsonl").read_text().splitlines()] == recs
    assert run("unpack", tmp_path / "p", "-o", tmp_path / "back.parquet").code == 0
    assert pq.read_table(tmp_path / "back.parquet").column_names == ["id", "input_ids", "loss_mask", "reward", "x",
                                                                      "extra"]


def test_values_json_cannot_hold_are_counted_when_unpacked_to_jsonl(tmp_path):
    """Bytes, timestamps and decimals of a Parquet input come back exactly in Parquet; in JSONL they are written
    as their text, and the line after the summary says how many, even with --quiet."""
    import datetime
    import decimal

    when = datetime.datetime(2026, 11, 27, 12, 30)
    table = pa.table({"input_ids": [[1, 2, 3], [1, 2, 4]], "blob": [b"\x00\xff", b"ab"], "at": [when, when],
                      "price": pa.array([decimal.Decimal("1.50"), None], pa.decimal128(5, 2))})
    pq.write_table(table, tmp_path / "in.parquet")
    assert run("pack", tmp_path / "in.parquet", "-c", "1K", "-o", tmp_path / "p", "-q").code == 0
    r = run("unpack", tmp_path / "p", "-o", tmp_path / "back.parquet", "-q")
    assert (r.code, r.err) == (0, "")
    assert pq.read_table(tmp_path / "back.parquet").to_pylist() == table.to_pylist()
    for quiet in ([], ["-q"]):
        r = run("unpack", tmp_path / "p", "-o", tmp_path / "back.jsonl", *quiet)
        notice = ("written as text: 5 value(s) JSON has no type for (bytes: 2, datetime: 2, Decimal: 1); unpack to "
                  ".parquet keeps them exact\n")
        summary = "" if quiet else f"wrote 2 records (6 tokens) to {tmp_path / 'back.jsonl'}\n"
        assert (r.code, r.err) == (0, summary + notice)
    back = [json.loads(line) for line in (tmp_path / "back.jsonl").read_text().splitlines()]
    assert [(b["blob"], b["at"], b["price"]) for b in back] == [
        ("b'\\x00\\xff'", "2026-11-27 12:30:00", "1.50"), ("b'ab'", "2026-11-27 12:30:00", None)]


def test_ids_beyond_int64_round_trip(tmp_path):
    """JSON integers of any size are ids and tree ids like any other (shards keep them as JSON text)."""
    recs = [{"id": 2**64, "tree_id": -2**70, "input_ids": [1, 2]}, {"id": 1, "tree_id": 3, "input_ids": [1, 3]}]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in recs))
    r = run("pack", src, "-c", "1K", "-o", tmp_path / "p", "-q", "--group-by", "tree_id")
    assert (r.code, r.err) == (0, "")
    assert run("unpack", tmp_path / "p", "-o", tmp_path / "back.jsonl", "-q").code == 0
    assert (tmp_path / "back.jsonl").read_text() == "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in recs)


@pytest.mark.skipif(not (DATA / "rollouts" / "toolbench_dfs.parquet").exists(), reason="shared data absent")
def test_toolbench_round_trip(tmp_path):
    """Third-party records: 235 of 261 ToolBench rewards are null and stay null; schema and rows equal."""
    src = DATA / "rollouts" / "toolbench_dfs.parquet"
    assert run("pack", src, "-c", "64K", "-o", tmp_path / "p", "-q").code == 0
    for out in ("back.parquet", "back.jsonl"):
        assert run("unpack", tmp_path / "p", "-o", tmp_path / out, "-q").code == 0
    table = pq.read_table(src)
    back = pq.read_table(tmp_path / "back.parquet")
    assert back.schema == table.schema and back.equals(table)
    rows = [json.loads(line) for line in (tmp_path / "back.jsonl").read_text().splitlines()]
    assert rows == table.to_pylist()
    assert sum(r["reward"] is None for r in rows) == sum(r["reward"] is None for r in table.to_pylist())


RAW = [DATA / "raw" / "gsm8k_model_solutions" / "example_model_solutions.jsonl",
       DATA / "raw" / "hh_rlhf_harmless_test" / "harmless-base_test.jsonl.gz",
       *sorted((DATA / "raw" / "tau_bench_grok3_retail").glob("*.json"))]


@pytest.mark.parametrize("raw", RAW, ids=lambda p: p.parent.name)
def test_raw_third_party_records_round_trip(tmp_path, raw):
    """Real records of other projects (nested chats, tool calls, null fields), given tokens: exact round trip."""
    if not raw.exists():
        pytest.skip("shared data absent")
    opener = gzip.open if raw.suffix == ".gz" else open
    with opener(raw, "rt", encoding="utf-8") as fh:
        recs = json.load(fh) if raw.suffix == ".json" else [json.loads(line) for line in fh if line.strip()]
    recs = recs[:200]
    for i, rec in enumerate(recs):  # a shared prefix per 4 records, like a GRPO group
        rec["input_ids"] = [7, 8, i // 4, i % 4 + 10]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs), encoding="utf-8")
    back = pack_and_unpack(src, tmp_path)
    assert [exact(r) for r in iter_records(back)] == [exact(r) for r in recs]
