"""The way back out: a ``Rollouts`` batch as plain records, an Arrow table, or a JSONL / Parquet file.

``iter_records`` and ``to_arrow`` give the input format back (one record per sequence, design §3), so a
batch read by `treepack.io.ingest` and written here reads back equal. `treepack unpack` uses
``write_rollouts`` on the batch rebuilt from the shards.
"""


from __future__ import annotations

import contextlib
import gzip
import io
import json
import math
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from treepack.errors import TreepackError
from treepack.io.atomic import atomic_file
from treepack.io.extras import CARRY_LOGPROBS, CARRY_MASK_BOOL, CARRY_MASK_INT, fill
from treepack.io.rollouts import INT64_MAX, INT64_MIN, TOKEN_ALIASES, Rollouts


def key_encoding(values: list) -> str:
    """How ids / tree ids are stored: all ints within int64 -> int64, all strings -> string, a mix (or a JSON
    integer beyond int64) -> JSON strings."""
    if all(isinstance(v, int) and not isinstance(v, bool) and INT64_MIN <= v <= INT64_MAX for v in values):
        return "int"
    if all(isinstance(v, str) for v in values):
        return "str"
    return "json"


def to_arrow(r: Rollouts) -> pa.Table:
    """The batch as an Arrow table in the input format (one row per sequence).

    With the records kept at reading (``Rollouts.extras``): Parquet input comes back with its own schema
    (column order and types); JSON input as the table of its records (types inferred by Arrow: an absent
    key becomes null, which a Parquet column can not tell apart)."""
    if r.extras is not None and r.extras.kind == "arrow":
        return _arrow_exact(r)
    if r.extras is not None:
        rows = list(iter_records(r))
        keys = list(dict.fromkeys(k for row in rows for k in row))  # every key, in first-seen order
        try:
            return pa.table({k: pa.array([row.get(k) for row in rows]) for k in keys})
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError) as exc:  # Overflow: an integer beyond int64
            raise TreepackError(f"the records do not fit one Parquet schema ({exc}); write .jsonl instead") from None
    cols: dict[str, pa.Array] = {}
    off32 = pa.array(r.offsets, type=pa.int64())
    cols["id"] = pa.array(r.ids)
    if r.groups is not None:
        cols["tree_id"] = pa.array([r.group_names[g] for g in r.groups.tolist()])
    if r.steps is not None:
        cols["step"] = pa.array(r.steps)
    cols["input_ids"] = pa.LargeListArray.from_arrays(off32, pa.array(r.tokens, type=pa.int32()))
    if r.loss_mask is not None:
        cols["loss_mask"] = pa.LargeListArray.from_arrays(off32, pa.array(r.loss_mask.astype(np.int8)))
    if r.logprobs is not None:
        cols["logprobs"] = pa.LargeListArray.from_arrays(off32, pa.array(r.logprobs))
    if r.advantages is not None:
        cols["advantage"] = pa.array(r.advantages, from_pandas=True)  # NaN (absent) -> null
    if r.rewards is not None:
        cols["reward"] = pa.array(r.rewards, from_pandas=True)
    return pa.table(cols)


def iter_records(r: Rollouts) -> Iterator[dict]:
    """The batch as plain records (for JSONL output and tests): with ``Rollouts.extras``, each record exactly
    as it was read (every field, its JSON type, its key order)."""
    ex = r.extras
    if ex is not None and ex.kind == "json":
        names = (ex.tokens_field,) if ex.tokens_field else TOKEN_ALIASES
        mask, lp = r.loss_mask, r.logprobs
        for i in range(len(r)):
            a, b = int(r.offsets[i]), int(r.offsets[i + 1])
            yield fill(ex.templates[i], names, int(ex.carry[i]), r.tokens[a:b],
                       None if mask is None else mask[a:b], None if lp is None else lp[a:b])
        return
    if ex is not None:
        yield from to_arrow(r).to_pylist()
        return
    for i in range(len(r)):
        rec: dict = {"id": r.ids[i]}
        if r.groups is not None:
            rec["tree_id"] = r.group_names[int(r.groups[i])]
        if r.steps is not None:
            rec["step"] = int(r.steps[i])
        rec["input_ids"] = r.sequence(i).tolist()
        if r.loss_mask is not None:
            rec["loss_mask"] = r.loss_mask_of(i).tolist()
        if r.logprobs is not None:
            rec["logprobs"] = r.logprobs[r.offsets[i] : r.offsets[i + 1]].tolist()
        if r.advantages is not None and not math.isnan(r.advantages[i]):
            rec["advantage"] = float(r.advantages[i])
        if r.rewards is not None and not math.isnan(r.rewards[i]):
            rec["reward"] = float(r.rewards[i])
        yield rec


def _list_column(offsets: np.ndarray, values: np.ndarray, present: np.ndarray | None, typ: pa.DataType) -> pa.Array:
    """One list per row from flat values split by offsets; rows where ``present`` is False are null."""
    lens = np.diff(offsets)
    if present is not None and not present.all():
        values = values[np.repeat(present, lens)]
        lens = np.where(present, lens, 0)
    offs = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=offs[1:])
    mask = None if present is None or present.all() else pa.array(~present)
    arr = pa.LargeListArray.from_arrays(pa.array(offs), pa.array(values), mask=mask)
    return arr.cast(typ)


def _arrow_exact(r: Rollouts) -> pa.Table:
    """Parquet input's table: the kept columns plus the carried lists, in the input schema."""
    ex = r.extras
    cols = []
    for f in ex.schema:
        if f.name == ex.tokens_field:
            cols.append(_list_column(r.offsets, r.tokens, None, f.type))
        elif f.name == "loss_mask" and f.name not in ex.table.column_names:
            values = r.loss_mask if r.loss_mask is not None else np.ones(r.n_tokens, np.uint8)
            values = values.astype(bool) if pa.types.is_boolean(f.type.value_type) else values
            cols.append(_list_column(r.offsets, values, (ex.carry & (CARRY_MASK_INT | CARRY_MASK_BOOL)) > 0, f.type))
        elif f.name == "logprobs" and f.name not in ex.table.column_names:
            values = r.logprobs if r.logprobs is not None else np.full(r.n_tokens, np.nan)
            cols.append(_list_column(r.offsets, values, (ex.carry & CARRY_LOGPROBS) > 0, f.type))
        else:
            cols.append(ex.table.column(f.name).cast(f.type))
    return pa.Table.from_arrays(cols, schema=ex.schema)


def write_rollouts(r: Rollouts, path: str) -> Counter:
    """Write a batch as JSONL (``.jsonl``, ``.jsonl.gz``, ``-`` for stdout) or Parquet (``.parquet``).

    A file appears whole or not at all (`treepack.io.atomic`): written under a hidden temporary name, renamed
    into place when done, removed on any failure or interruption; missing directories above it are created
    (as ``pack``, ``tokenize`` and ``plot`` do), and removed again on failure. Returns the values JSON has no type for
    (bytes, timestamps, decimals of a Parquet input), written as their text, counted by type: empty for
    Parquet output, which keeps them exact."""
    as_text: Counter = Counter()

    def text(value) -> str:
        as_text[type(value).__name__] += 1
        return str(value)

    if path.endswith((".parquet", ".pq")):
        for what, keys in (("ids", r.ids), ("tree ids", r.group_names or [])) if r.extras is None else ():
            if key_encoding(keys) == "json":
                raise TreepackError(f"{path}: the {what} mix strings and integers (or exceed int64), which a Parquet "
                                    "column can not hold; write .jsonl instead")
        with atomic_file(path, make_parents=True) as tmp:
            pq.write_table(to_arrow(r), tmp, compression="zstd")
        return as_text
    with contextlib.ExitStack() as stack:
        if path == "-":
            fh = sys.stdout
        else:
            tmp = stack.enter_context(atomic_file(path, make_parents=True))  # entered first: renamed after the file is closed
            raw = stack.enter_context(open(tmp, "wb"))
            if path.endswith(".gz"):  # level 6, gzip's own default: unpacking 24M tokens took 7.1 s of CPU, 10.2 s
                # at gzip.open's level 9 for a 0.3% smaller file; the header names the output, not its temporary
                raw = stack.enter_context(gzip.GzipFile(Path(path).name, "wb", compresslevel=6, fileobj=raw))
            fh = stack.enter_context(io.TextIOWrapper(raw, encoding="utf-8"))
        for rec in iter_records(r):
            try:
                line = json.dumps(rec, separators=(",", ":"), ensure_ascii=False, default=text, allow_nan=False)
            except ValueError:  # NaN or Infinity (a Parquet input's float): JSON has none, written as text
                line = json.dumps(_finite(rec, as_text), separators=(",", ":"), ensure_ascii=False, default=text)
            fh.write(line + "\n")
    return as_text


def _finite(value, as_text: Counter):
    """``value`` with NaN and +-Infinity floats as the strings JavaScript spells them, counted as text."""
    if isinstance(value, float) and not math.isfinite(value):
        as_text["float"] += 1
        return "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"
    if isinstance(value, dict):
        return {k: _finite(v, as_text) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v, as_text) for v in value]
    return value
