"""Validating Parquet tables at once: a row group's columns are checked with numpy in one pass (types,
lengths, negatives, int32 range), without a Python object per token; problems raise ``InputError`` naming
the row, or skip bad rows with a count (``--on-error skip``).

For an exact ``unpack`` (``Builder.keep_records``) every other column is read too and kept as Arrow columns
with their own types (`treepack.io.extras`); a row's ``loss_mask`` / ``logprobs`` come back from the packs
(carry bits), a null one stays null. JSON records are read by `treepack.io.jsonl`.
"""


from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from treepack.errors import InputError
from treepack.io.builder import Builder
from treepack.io.extras import CARRY_LOGPROBS, CARRY_MASK_BOOL, CARRY_MASK_INT, CARRY_TOKENS, template
from treepack.io.rollouts import GROUP_ALIASES, INT32_MAX, INT64_MAX, TOKEN_ALIASES


def _one_array(col: pa.ChunkedArray | pa.Array) -> pa.Array:
    """The column as one Array: a one-chunk column as it is (``combine_chunks`` would copy it)."""
    if isinstance(col, pa.ChunkedArray):
        return col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()
    return col


def _list_values(col: pa.ChunkedArray | pa.Array) -> tuple[pa.Array, np.ndarray]:
    """Flatten a list column into (values, int64 offsets) with any slicing resolved."""
    arr = _one_array(col)
    if pa.types.is_large_list(arr.type):
        arr = arr.cast(pa.list_(arr.type.value_type))
    offsets = np.asarray(arr.offsets, dtype=np.int64)
    values = arr.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
    return values, offsets - offsets[0]


def _ingest_table(
    name: str, table: pa.Table, tokens_field: str | None, builder: Builder, *,
    row_base: int, id_base: int, on_error: str = "raise",
    skipped: Counter | None = None, examples: list[str] | None = None, row_word: str = "row",
) -> int:
    """Validate a table's columns at once and add it; returns the number of rows kept."""
    cols = table.column_names
    names = (tokens_field,) if tokens_field else TOKEN_ALIASES
    tf = next((n for n in names if n in cols), None)

    n = table.num_rows
    drop = np.zeros(n, dtype=bool)
    reasons: list[tuple[str, np.ndarray, str]] = []
    first_error: list[tuple[int, str]] = []  # raise mode: the earliest bad row wins, whatever the check

    def row_problem(reason: str, rows: np.ndarray, message_of: Callable[[int], str]):
        if len(rows) == 0:
            return
        if on_error != "skip":
            r = int(rows[0])
            if not first_error or r < first_error[0][0]:
                first_error[:] = [(r, message_of(r))]
            drop[rows] = True
            return
        new = rows[~drop[rows]]
        drop[new] = True
        if len(new):
            reasons.append((reason, new, message_of(int(new[0]))))

    if tf is None:
        found = ", ".join(repr(c) for c in cols) or "none"
        want = repr(tokens_field) if tokens_field else "'input_ids' (or 'tokens', 'token_ids')"
        raise InputError(f"{name}: missing tokens field {want}; found fields: {found}")
    tok_col = table.column(tf)
    if not (pa.types.is_list(tok_col.type) or pa.types.is_large_list(tok_col.type)) or not pa.types.is_integer(
        tok_col.type.value_type
    ):
        raise InputError(f"{name}: field {tf!r} must be a list of integers, got {tok_col.type}")
    tok_arr = _one_array(tok_col)
    null_rows = np.flatnonzero(np.asarray(tok_arr.is_null(), dtype=bool))
    row_problem("missing tokens field", null_rows, lambda r: f"field {tf!r} is null")
    values, offsets = _list_values(tok_arr.fill_null(pa.scalar([], type=tok_arr.type)) if len(null_rows) else tok_arr)
    lens = np.diff(offsets)
    row_problem("empty sequence", np.flatnonzero((lens == 0) & ~drop), lambda r: f"field {tf!r} is empty")
    if values.null_count:
        vnull = np.asarray(values.is_null(), dtype=bool)
        rows = np.unique(np.searchsorted(offsets, np.flatnonzero(vnull), side="right") - 1)
        row_problem("non-integer token", rows, lambda r: f"field {tf!r} contains null")
    tok = np.asarray(values.fill_null(0) if values.null_count else values.to_numpy(zero_copy_only=False))
    # one reduction first: the index arrays below are only built for a column that has a bad token
    signed = np.issubdtype(tok.dtype, np.signedinteger)
    neg_at = np.flatnonzero(tok < 0) if signed and len(tok) and tok.min() < 0 else np.zeros(0, np.int64)
    if len(neg_at):
        rows = np.unique(np.searchsorted(offsets, neg_at, side="right") - 1)

        def neg_msg(r):
            j = int(np.flatnonzero(tok[offsets[r] : offsets[r + 1]] < 0)[0])
            return f"field {tf!r}[{j}] is negative ({int(tok[offsets[r] + j])})"

        row_problem("negative token", rows, neg_msg)
    wide = tok.dtype.itemsize > 4 or tok.dtype == np.uint32
    big_at = np.flatnonzero(tok > INT32_MAX) if wide and len(tok) and tok.max() > INT32_MAX else np.zeros(0, np.int64)
    if len(big_at):
        rows = np.unique(np.searchsorted(offsets, big_at, side="right") - 1)
        row_problem("token out of range", rows, lambda r: f"field {tf!r} has a token that does not fit int32")

    def per_token_list(field_name: str, check_values):
        if field_name not in cols:
            return None, None
        col = _one_array(table.column(field_name))
        if pa.types.is_null(col.type):
            return None, None
        if not (pa.types.is_list(col.type) or pa.types.is_large_list(col.type)):
            raise InputError(f"{name}: field {field_name!r} must be a list, got {col.type}")
        isnull = np.asarray(col.is_null(), dtype=bool)
        vals, offs = _list_values(col.fill_null(pa.scalar([], type=col.type)) if isnull.any() else col)
        mlen = np.diff(offs)
        mismatch = np.flatnonzero(~isnull & (mlen != lens) & ~drop)
        row_problem(
            f"{field_name} length mismatch", mismatch,
            lambda r: f"field {field_name!r} has length {int(mlen[r])} but {tf!r} has length {int(lens[r])}",
        )
        v = check_values(vals, offs, isnull)
        return v, isnull

    def mask_values(vals, offs, isnull):
        if not (pa.types.is_integer(vals.type) or pa.types.is_boolean(vals.type) or pa.types.is_floating(vals.type)):
            raise InputError(f"{name}: field 'loss_mask' must be a list of 0/1, got list<{vals.type}>")
        m = np.asarray(vals.fill_null(2) if vals.null_count else vals.to_numpy(zero_copy_only=False))
        in_range = m.dtype == bool or (m.dtype.kind in "iu" and (not len(m) or (m.min() >= 0 and m.max() <= 1)))
        badv = np.zeros(0, np.int64) if in_range else np.flatnonzero((m != 0) & (m != 1))
        if len(badv):
            rows = np.unique(np.searchsorted(offs, badv, side="right") - 1)

            def msg(r):
                seg = m[offs[r] : offs[r + 1]]
                j = int(np.flatnonzero((seg != 0) & (seg != 1))[0])
                null = vals.null_count and vals[int(offs[r]) + j].as_py() is None  # filled with 2 above
                return f"field 'loss_mask'[{j}] must be 0 or 1, got {'null' if null else seg[j]}"

            row_problem("bad loss_mask", rows, msg)
        return m.astype(np.uint8)

    def logprob_values(vals, offs, isnull):
        if not (pa.types.is_floating(vals.type) or pa.types.is_integer(vals.type)):
            raise InputError(f"{name}: field 'logprobs' must be a list of numbers, got list<{vals.type}>")
        x = np.asarray(vals.to_numpy(zero_copy_only=False))
        finite = x.dtype.kind in "iu" or bool(np.isfinite(x).all())
        badv = np.zeros(0, np.int64) if finite else np.flatnonzero(~np.isfinite(x))
        if len(badv):
            rows = np.unique(np.searchsorted(offs, badv, side="right") - 1)
            row_problem("bad logprobs", rows, lambda r: "field 'logprobs' has a non-finite value")
        return x.astype(np.float64, copy=False) if builder.keep_token_fields else None

    mask_flat, mask_null = per_token_list("loss_mask", mask_values)
    lp_flat, lp_null = per_token_list("logprobs", logprob_values)

    def scalar(field_name: str, kind: str):
        if field_name not in cols:
            return None
        col = table.column(field_name).combine_chunks()
        if pa.types.is_dictionary(col.type):  # pandas categoricals: the values are what counts
            col = col.dictionary_decode()
        if pa.types.is_null(col.type):
            return None
        ok = {
            "number": pa.types.is_floating(col.type) or pa.types.is_integer(col.type),
            "int": pa.types.is_integer(col.type),
            "key": pa.types.is_integer(col.type) or pa.types.is_string(col.type) or pa.types.is_large_string(col.type),
        }[kind]
        if not ok:
            want = {"number": "a number", "int": "an integer", "key": "a string or an integer"}[kind]
            raise InputError(f"{name}: field {field_name!r} must be {want}, got {col.type}")
        out = col.to_pylist()
        if kind == "number":
            arr = np.asarray([math.nan if v is None else v for v in out], dtype=np.float64)
            badrows = np.flatnonzero(~np.isfinite(arr) & np.asarray([v is not None for v in out]))
            row_problem(f"bad {field_name}", badrows, lambda r: f"field {field_name!r} must be a finite number")
        if kind == "int" and pa.types.is_uint64(col.type):  # steps are int64
            big = np.flatnonzero(np.asarray([v is not None and v > INT64_MAX for v in out], dtype=bool))
            row_problem(f"bad {field_name}", big, lambda r: f"field {field_name!r} does not fit int64 ({out[r]})")
        if kind == "int" and pa.types.is_signed_integer(col.type):  # -1 stands for "no step" inside
            neg = np.flatnonzero(np.asarray([v is not None and v < 0 for v in out], dtype=bool))
            row_problem(f"bad {field_name}", neg, lambda r: f"field {field_name!r} must be >= 0, got {out[r]}")
        return out

    ids = scalar("id", "key")
    group_field = next((g for g in GROUP_ALIASES if g in cols), None)
    groups = scalar(group_field, "key") if group_field else None
    steps = scalar("step", "int")
    advs = scalar("advantage", "number")
    rews = scalar("reward", "number")

    if first_error:
        r, message = first_error[0]
        raise InputError(f"{name}: {row_word} {row_base + r}: {message}")
    keep = ~drop
    kept = int(keep.sum())
    if reasons and skipped is not None:
        for reason, rows, msg in reasons:
            skipped[reason] += len(rows)
            if examples is not None and len(examples) < 5:
                examples.append(f"{name}: {row_word} {row_base + int(rows[0])}: {msg}")
    default_ids = list(range(id_base + row_base, id_base + row_base + n))
    if ids is None:
        ids, id_given = default_ids, [False] * n
    else:
        id_given = [v is not None for v in ids]
        ids = [d if v is None else v for v, d in zip(ids, default_ids)]
    carry = None
    if builder.keep_records:
        carry = np.full(n, CARRY_TOKENS, dtype=np.uint8)
        if mask_null is not None:
            carry[~mask_null] |= CARRY_MASK_INT
        if lp_null is not None:
            carry[~lp_null] |= CARRY_LOGPROBS
        if mask_null is not None and builder.record_kind == "json" and pa.types.is_boolean(
                table.schema.field("loss_mask").type.value_type):
            carry[~mask_null] ^= CARRY_MASK_INT | CARRY_MASK_BOOL  # JSON output: the booleans as booleans
        rest = table.drop_columns([c for c in (tf, "loss_mask", "logprobs") if c in cols])
    sel = np.arange(n)
    if drop.any():
        tok_keep = np.repeat(keep, lens)
        tok = tok[tok_keep]
        if mask_flat is not None:
            mask_flat = _pad_missing(mask_flat, mask_null, lens, fill=1, dtype=np.uint8)[tok_keep]
        if lp_flat is not None:
            lp_flat = _pad_missing(lp_flat, lp_null, lens, fill=np.nan, dtype=np.float64)[tok_keep]
        lens = lens[keep]
        sel = np.flatnonzero(keep)
        ids = [ids[i] for i in sel.tolist()]
        id_given = [id_given[i] for i in sel.tolist()]
        if carry is not None:
            carry, rest = carry[keep], rest.filter(pa.array(keep))
        groups = None if groups is None else [groups[i] for i in sel.tolist()]
        steps = None if steps is None else [steps[i] for i in sel.tolist()]
        advs = None if advs is None else [advs[i] for i in sel.tolist()]
        rews = None if rews is None else [rews[i] for i in sel.tolist()]
    else:
        if mask_flat is not None:
            mask_flat = _pad_missing(mask_flat, mask_null, lens, fill=1, dtype=np.uint8)
        if lp_flat is not None:
            lp_flat = _pad_missing(lp_flat, lp_null, lens, fill=np.nan, dtype=np.float64)
    builder.add_chunk(
        tokens=tok.astype(np.int32, copy=False),
        lengths=lens,
        loss_mask=mask_flat,
        logprobs=lp_flat,
        ids=ids,
        groups=groups if groups is not None and any(g is not None for g in groups) else None,
        steps=steps if steps is not None and any(s is not None for s in steps) else None,
        advantages=advs if advs is not None and any(a is not None for a in advs) else None,
        rewards=rews if rews is not None and any(r is not None for r in rews) else None,
        id_given=id_given, carry=carry, where=(name, lambda k: f"{row_word} {row_base + int(sel[k])}"),
        **(_records_of(rest, cols, tf, carry, builder) if carry is not None else {}),
    )
    return kept


def _records_of(rest: pa.Table, cols: list[str], tf: str, carry: np.ndarray, builder: Builder) -> dict:
    """What keeps the rows exact: the other columns as they are, or (mixed with JSON input) JSON templates
    in the table's column order (``default=str``: a timestamp or bytes value becomes its text)."""
    if builder.record_kind == "arrow":
        return {"table": rest}
    kept = set(rest.column_names)
    templates = [
        template({c: (row[c] if c in kept else None) for c in cols}, tf, int(c_k), default=str)
        for row, c_k in zip(rest.to_pylist(), carry.tolist())
    ]
    return {"templates": templates}


def _pad_missing(flat: np.ndarray, isnull: np.ndarray, lens: np.ndarray, *, fill, dtype) -> np.ndarray:
    """Expand a per-token column where some rows were null (no values) to one value per token."""
    if not isnull.any():
        return flat.astype(dtype, copy=False)
    out = np.full(int(lens.sum()), fill, dtype=dtype)
    present = np.repeat(~isnull, lens)
    out[present] = flat
    return out



def read_parquet(path, tokens_field, on_error, builder, skipped, examples, progress) -> None:
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise InputError(f"{path}: not a readable Parquet file ({exc})") from None
    cols = pf.schema_arrow.names
    names = (tokens_field,) if tokens_field else TOKEN_ALIASES
    if not any(n in cols for n in names):
        found = ", ".join(repr(c) for c in cols) or "none"
        want = repr(tokens_field) if tokens_field else "'input_ids' (or 'tokens', 'token_ids')"
        raise InputError(f"{path}: missing tokens field {want}; found fields: {found}")
    wanted = [c for c in cols if c in (*TOKEN_ALIASES, *((tokens_field,) if tokens_field else ()), "loss_mask",
                                       "logprobs", "id", *GROUP_ALIASES, "step", "advantage", "reward")]
    tf = next(n for n in names if n in cols)
    if builder.keep_records:  # every column: the ones treepack does not use come back from `unpack`
        wanted = None
        builder.schemas.append(pf.schema_arrow)
        builder.tokens_field = builder.tokens_field or tf
    leaf = pf.metadata.schema.to_arrow_schema().get_field_index(tf)
    if leaf >= 0:
        col_index = [pf.metadata.row_group(0).column(j).path_in_schema for j in range(pf.metadata.num_columns)]
        j = next((j for j, p in enumerate(col_index) if p.split(".")[0] == tf), None)
        if j is not None:
            builder.reserve(sum(pf.metadata.row_group(i).column(j).num_values for i in range(pf.metadata.num_row_groups)))
    row_base = 0
    bytes_per_row = os.path.getsize(path) / max(pf.metadata.num_rows, 1)
    # Row group by row group: as fast as reading the whole table (iter_batches re-slices nested columns
    # and was ~2x slower on token lists) while memory stays at one row group plus the flat output.
    for i in range(pf.metadata.num_row_groups):
        table = pf.read_row_group(i, columns=wanted, use_threads=False)
        _ingest_table(
            path, table, tokens_field, builder, row_base=row_base, id_base=0,
            on_error=on_error, skipped=skipped, examples=examples, row_word="row",
        )
        row_base += table.num_rows
        del table
        if progress is not None:
            progress(int(pf.metadata.row_group(i).num_rows * bytes_per_row))



