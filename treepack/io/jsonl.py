"""Reading JSON rollout records: JSONL (``.jsonl``, ``.jsonl.gz``, stdin) and JSON-array files, streamed in
bounded blocks, each record validated with a message that names file, line and field exactly:
``bad.jsonl: line 3: field 'input_ids'[2] is negative (-5)``.

Two parsers, one contract:
- the fast path parses each line with simdjson (``pysimdjson``) and takes the token lists as int64
  buffers without a Python object per token; the block's tokens are then range-checked at once with numpy.
  Measured on 2 cores, 100M tokens of tau2 JSONL.gz (benchmarks/results/*-stats.md): simdjson 0.4 s per
  24M tokens (with masks) where orjson + numpy took 1.4 s, msgspec 1.7 s, pyarrow.json 1.7 s (threads) at
  2.5x the memory, polars 4.3 s, ``json`` 3.7 s;
- the precise path (``json`` + `_check_record`) re-reads only the lines the fast path does not accept, so
  every error message comes from one place. Without simdjson every line takes the precise path.
A ``.json`` file whose text starts with ``[`` is an array of records (``record N`` in messages). Records
that are not objects, or lack a tokens field, are errors like any other; a JSON array of chat transcripts
is for ``--tokenizer`` (`treepack.io.chat`), which reads it with ``iter_json_records``.
Nothing is dropped silently: skipped records are counted per reason. A compressed file that breaks off (cut
short, damaged, a bad checksum) is an error naming the file and the line where it broke, with ``--on-error skip``
too: what came after the break is unknown, so it can not be counted as a number of records skipped (a file that
is not gzip at all is an error either way too).
"""


from __future__ import annotations

import codecs
import json
import math
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from treepack.errors import InputError
from treepack.io.builder import Builder
from treepack.io.extras import (
    CARRY_LOGPROBS,
    CARRY_MASK_INT,
    CARRY_TOKENS,
    logprobs_carry,
    mask_carry,
    template,
)
from treepack.io.json_keys import Duplicated, pairs_to_dict, repeated_key, repeats_a_key
from treepack.io.json_values import suspect, unwritable
from treepack.io.rollouts import GROUP_ALIASES, INT32_MAX, INT64_MAX, TOKEN_ALIASES, Progress
from treepack.io.streams import StreamError, iter_blocks, strip_compression

try:  # optional at import, a dependency of the package: without it every line takes the precise path
    import simdjson
except ImportError:  # pragma: no cover - exercised by the fallback test through monkeypatching
    simdjson = None

# --------------------------------------------------------------------------------------------------
# Record validation (the precise path): one dict -> validated python values, or a _RecordError


class _RecordError(Exception):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return (isinstance(x, (int, float)) and not isinstance(x, bool)) and math.isfinite(x)


def _want(tokens_field: str | None) -> str:
    return repr(tokens_field) if tokens_field else "'input_ids' (or 'tokens', 'token_ids')"


def _check_record(rec, tokens_field: str | None):
    if not isinstance(rec, dict):
        raise _RecordError("not an object", f"expected a JSON object, got {_jtype(rec)}")
    names = (tokens_field,) if tokens_field else TOKEN_ALIASES
    tf = next((n for n in names if n in rec), None)
    if tf is None:
        found = ", ".join(repr(k) for k in rec) or "none"
        raise _RecordError("missing tokens field", f"missing tokens field {_want(tokens_field)}; found fields: {found}")
    toks = rec[tf]
    if not isinstance(toks, list):
        raise _RecordError("bad tokens", f"field {tf!r} must be a list of integers, got {_jtype(toks)}")
    if not toks:
        raise _RecordError("empty sequence", f"field {tf!r} is empty")
    for j, t in enumerate(toks):
        if not _is_int(t):
            raise _RecordError("non-integer token", f"field {tf!r}[{j}] is not an integer: {json.dumps(t)}")
        if t < 0:
            raise _RecordError("negative token", f"field {tf!r}[{j}] is negative ({t})")
        if t > INT32_MAX:
            raise _RecordError("token out of range", f"field {tf!r}[{j}] does not fit int32 ({t})")
    n = len(toks)
    mask = rec.get("loss_mask")
    if mask is not None:
        if not isinstance(mask, list):
            raise _RecordError("bad loss_mask", f"field 'loss_mask' must be a list of 0/1, got {_jtype(mask)}")
        if len(mask) != n:
            raise _RecordError(
                "loss_mask length mismatch", f"field 'loss_mask' has length {len(mask)} but {tf!r} has length {n}"
            )
        for j, m in enumerate(mask):
            if m not in (0, 1) or isinstance(m, float) and not m.is_integer():
                raise _RecordError("bad loss_mask", f"field 'loss_mask'[{j}] must be 0 or 1, got {json.dumps(m)}")
    lp = rec.get("logprobs")
    if lp is not None:
        if not isinstance(lp, list):
            raise _RecordError("bad logprobs", f"field 'logprobs' must be a list of numbers, got {_jtype(lp)}")
        if len(lp) != n:
            raise _RecordError(
                "logprobs length mismatch", f"field 'logprobs' has length {len(lp)} but {tf!r} has length {n}"
            )
        for j, x in enumerate(lp):
            if not _is_number(x):
                raise _RecordError("bad logprobs", f"field 'logprobs'[{j}] is not a finite number: {json.dumps(x)}")
    _check_scalars(rec)
    group = rec.get("tree_id", rec.get("group_id"))
    return tf, toks, mask, lp, rec.get("id"), group, rec.get("step"), rec.get("advantage"), rec.get("reward")


def _check_scalars(rec) -> None:
    for name in ("advantage", "reward"):
        v = rec.get(name)
        if v is not None and not _is_number(v):
            raise _RecordError(f"bad {name}", f"field {name!r} must be a finite number, got {json.dumps(v)}")
    step = rec.get("step")
    if step is not None and not _is_int(step):
        raise _RecordError("bad step", f"field 'step' must be an integer, got {json.dumps(step)}")
    if step is not None and not 0 <= step <= INT64_MAX:  # -1 stands for "no step" inside; steps count from 0
        raise _RecordError("bad step", f"field 'step' must be >= 0, got {step}" if step < 0
                           else f"field 'step' does not fit int64 ({step})")
    for name in ("id", *GROUP_ALIASES):
        v = rec.get(name)
        if v is not None and not (isinstance(v, str) or _is_int(v)):
            raise _RecordError(f"bad {name}", f"field {name!r} must be a string or an integer, got {_jtype(v)}")


def _jtype(v) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(v), type(v).__name__
    )


def json_error_text(exc: ValueError) -> str:
    """``malformed JSON (<what> at column <n>)``; json's own "... starting at" messages end where the column goes."""
    if not isinstance(exc, json.JSONDecodeError):
        return f"malformed JSON ({'not UTF-8' if isinstance(exc, UnicodeDecodeError) else exc})"
    at = " column" if exc.msg.endswith(" at") else " at column"
    return f"malformed JSON ({exc.msg}{at} {exc.colno})"


def duplicate_error(value) -> _RecordError | None:
    """The record's error if it holds an object naming a key twice (`treepack.io.json_keys`)."""
    key = repeated_key(value)
    return None if key is None else _RecordError("duplicate key", f"key '{key}' appears twice in one object")


def _loads(raw: bytes, *, whole: bool = True):
    """One JSON value; with ``whole`` (a line, one record) a key named twice anywhere in it is the record's
    error; without (a file's array of records) each record is checked by `duplicate_error` later."""
    found: list = []

    def hook(pairs):
        d = pairs_to_dict(pairs)
        if type(d) is Duplicated:
            found.append(d)
        return d

    try:
        value = json.loads(raw, object_pairs_hook=hook)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _RecordError("malformed JSON", json_error_text(exc)) from None
    if found and whole:
        raise duplicate_error(found[0])
    return value


# --------------------------------------------------------------------------------------------------
# Generic JSON records (shared with the chat-transcript reader)


@dataclass
class JsonRecord:
    """One record of a JSON input file: where it is (``line 3`` / ``record 3``) and its value or error."""

    where: str
    value: object = None
    error: _RecordError | None = None
    raw: bytes | None = None  # JSONL: the line's bytes


def _is_array_file(path: str, first_block: bytes) -> bool:
    """A ``.json``/``.json.gz`` file whose first non-blank character (after a UTF-8 byte order mark, which
    ``json.loads`` of bytes skips) is ``[`` holds an array of records."""
    return strip_compression(path).endswith(".json") and first_block.removeprefix(codecs.BOM_UTF8).lstrip()[:1] == b"["


def iter_json_records(path: str, *, progress: Progress | None = None, parse: bool = True) -> Iterator[JsonRecord]:
    """Every record of a JSONL file (one per non-blank line) or a JSON-array file, in order.

    Malformed lines come as ``JsonRecord(error=...)``; a compressed stream that breaks off raises
    ``InputError`` (``FILE: line N: truncated gzip file ...``) after the records before it. ``parse=False``
    (JSONL only) leaves ``value`` unset and gives ``raw``.
    """
    seen = [0]
    try:
        yield from _iter_json_records(path, progress, parse, seen)
    except StreamError as err:
        where = "" if err.fatal else f"line {seen[0] + 1}: "
        raise InputError(f"{path}: {where}{err.message}") from None


def _iter_json_records(path: str, progress, parse: bool, seen: list[int]) -> Iterator[JsonRecord]:
    blocks = iter_blocks(path, progress=progress)
    first = next(blocks, b"")
    if _is_array_file(path, first):
        text = first + b"".join(blocks)
        try:
            values = _loads(text, whole=False)
        except _RecordError as err:
            raise InputError(f"{path}: {err.message.replace('malformed JSON', 'not a valid JSON array', 1)}") from None
        if not isinstance(values, list):  # pragma: no cover - a text starting with "[" parses to a list
            raise InputError(f"{path}: expected a JSON array of records")
        for i, v in enumerate(values, start=1):
            err = duplicate_error(v) or _unwritable(v, None)
            yield JsonRecord(f"record {i}", None if err else v, error=err)
        return
    lineno = 0
    for block in _chain(first, blocks):
        lines = block.split(b"\n")
        for k, raw in enumerate(lines):
            if k == len(lines) - 1 and not raw:
                break  # the block ended with a newline
            lineno += 1
            seen[0] = lineno
            if not raw or raw.isspace():
                continue
            if not parse:
                yield JsonRecord(f"line {lineno}", raw=raw)
                continue
            try:
                value = _loads(raw)
                err = _unwritable(value, raw)
                yield JsonRecord(f"line {lineno}", None if err else value, error=err, raw=raw)
            except _RecordError as err:
                yield JsonRecord(f"line {lineno}", error=err, raw=raw)


def _unwritable(value, raw: bytes | None) -> _RecordError | None:
    """A chat record's NaN, Infinity or lone surrogate (`treepack.io.json_values`), as its error."""
    bad = unwritable(value) if isinstance(value, dict) and suspect(raw) else None
    return _RecordError(*bad) if bad else None


def _chain(first: bytes, rest: Iterator[bytes]) -> Iterator[bytes]:
    if first:
        yield first
    yield from rest


# --------------------------------------------------------------------------------------------------
# Reading a file into a Builder


@dataclass
class _Block:
    """Validated records of one block, handed to the builder at once."""

    toks: list = field(default_factory=list)  # int64 arrays (fast path) or lists
    lens: list = field(default_factory=list)
    masks: list = field(default_factory=list)
    lps: list = field(default_factory=list)
    ids: list = field(default_factory=list)
    id_given: list = field(default_factory=list)
    groups: list = field(default_factory=list)
    steps: list = field(default_factory=list)
    advs: list = field(default_factory=list)
    rews: list = field(default_factory=list)
    templates: list = field(default_factory=list)
    carry: list = field(default_factory=list)
    where: list = field(default_factory=list)  # location of each record (for late checks)
    raws: list = field(default_factory=list)  # its line (None for array records)
    rejects: list = field(default_factory=list)  # (position among the records, error, where), skip mode


class _Reader:
    """One file's records into a Builder: fast path per record, precise path for what it rejects."""

    def __init__(self, name: str, tokens_field: str | None, on_error: str, builder: Builder,
                 skipped: Counter, examples: list[str]):
        self.name, self.tokens_field, self.on_error = name, tokens_field, on_error
        self.builder, self.skipped, self.examples = builder, skipped, examples
        self.names = (tokens_field,) if tokens_field else TOKEN_ALIASES
        self.keep_records = builder.keep_records
        self.parser = simdjson.Parser() if simdjson is not None else None
        self.kept = self.n_skipped = 0
        self.record_index = 0  # records seen in this file, skipped included (default ids)

    # -- one record ---------------------------------------------------------------------------------

    def add_raw(self, b: _Block, raw: bytes, where: str) -> None:
        """A JSONL line: the fast path, else the precise one."""
        if self.parser is not None:
            try:
                self._fast(b, raw, where)
                return
            except _Slow:
                pass
        try:
            self.add_value(b, _loads(raw), where, raw)
        except _RecordError as err:
            self.reject(err, where, b)

    def add_value(self, b: _Block, rec, where: str, raw: bytes | None = None) -> None:
        """A parsed record (the precise path)."""
        tf, toks, mask, lp, rid, group, step, adv, rew = _check_record(rec, self.tokens_field)
        bad = unwritable(rec, (tf, "loss_mask", "logprobs")) if suspect(raw) else None
        if bad:  # NaN, Infinity, a lone surrogate: no JSON or UTF-8 output can hold it (treepack.io.json_values)
            raise _RecordError(*bad)
        carry = CARRY_TOKENS
        if mask is not None:
            carry |= mask_carry(mask)
        if lp is not None:
            carry |= logprobs_carry(lp)
        self._append(b, np.asarray(toks, dtype=np.int64), None if mask is None else np.asarray(mask, np.uint8),
                     None if lp is None else np.asarray(lp, np.float64), rid, group, step, adv, rew,
                     template(rec, tf, carry) if self.keep_records else None, carry, where, raw)

    def _parse(self, raw: bytes):
        try:
            return self.parser.parse(raw)
        except RuntimeError:  # an element of the last document is still alive: a fresh parser
            self.parser = simdjson.Parser()
            return self.parser.parse(raw)

    def _fast(self, b: _Block, raw: bytes, where: str) -> None:
        try:
            obj = self._parse(raw)
        except Exception:  # noqa: BLE001 (malformed, NaN, huge numbers, ...: the precise path says what)
            raise _Slow from None
        try:
            # a key named twice anywhere: the precise path says which (the token lists are checked by as_buffer)
            if not isinstance(obj, simdjson.Object) or repeats_a_key(obj, (*self.names, "loss_mask", "logprobs")):
                raise _Slow
            tf = next((n for n in self.names if n in obj), None)
            if tf is None:
                raise _Slow
            toks = np.frombuffer(obj[tf].as_buffer(of_type="i"), dtype=np.int64)
            if not len(toks):
                raise _Slow
            carry = CARRY_TOKENS
            mask = lp = None
            m = obj.get("loss_mask")
            if m is not None:
                try:
                    mask = np.frombuffer(m.as_buffer(of_type="i"), dtype=np.int64)
                    carry |= CARRY_MASK_INT
                except (TypeError, ValueError, AttributeError):
                    raise _Slow from None  # booleans, floats, not a list: rare, the precise path
                if len(mask) != len(toks) or mask.min() < 0 or mask.max() > 1:
                    raise _Slow
            x = obj.get("logprobs")
            if x is not None:
                try:
                    lp = np.frombuffer(x.as_buffer(of_type="d"), dtype=np.float64)
                except (TypeError, ValueError, AttributeError):
                    raise _Slow from None
                if len(lp) != len(toks) or not np.isfinite(lp).all():
                    raise _Slow
                if (lp == np.floor(lp)).any():  # maybe written as integers: the precise path decides the form
                    raise _Slow
                carry |= CARRY_LOGPROBS
            if _nested(raw, [k for k, a in ((tf, toks), ("loss_mask", m), ("logprobs", x)) if a is not None]):
                raise _Slow
            scalars = {k: obj.get(k) for k in ("id", "tree_id", "group_id", "step", "advantage", "reward")}
            if any(isinstance(v, (simdjson.Object, simdjson.Array)) for v in scalars.values()):
                raise _Slow
            try:
                _check_scalars(scalars)
            except _RecordError:
                raise _Slow from None
            tmpl = None
            if self.keep_records:
                rec = {}
                for k in obj.keys():  # noqa: SIM118 (a simdjson Object, not a dict)
                    v = obj[k]
                    rec[k] = v.as_list() if isinstance(v, simdjson.Array) else v.as_dict() if isinstance(
                        v, simdjson.Object) else v
                    del v
                tmpl = template(rec, tf, carry)
            group = scalars["tree_id"] if "tree_id" in obj else scalars["group_id"]
        except (TypeError, ValueError, AttributeError, KeyError):  # wrong types, huge numbers: the precise path
            raise _Slow from None
        try:
            # copies: the parser's buffers are reused by the next line
            self._append(b, toks.copy(), None if mask is None else mask.astype(np.uint8),
                         None if lp is None else lp.copy(), scalars["id"], group, scalars["step"],
                         scalars["advantage"], scalars["reward"], tmpl, carry, where, raw)
        finally:
            obj = None

    def _append(self, b, toks, mask, lp, rid, group, step, adv, rew, tmpl, carry, where, raw) -> None:
        b.toks.append(toks)
        b.lens.append(len(toks))
        b.masks.append(mask)
        b.lps.append(lp)
        b.id_given.append(rid is not None)
        b.ids.append(self.record_index if rid is None else rid)
        b.groups.append(group)
        b.steps.append(step)
        b.advs.append(adv)
        b.rews.append(rew)
        b.templates.append(tmpl)
        b.carry.append(carry)
        b.where.append(where)
        b.raws.append(raw)
        self.record_index += 1

    def reject(self, err: _RecordError, where: str, b: _Block | None = None) -> None:
        """A bad record: raise, or (skip) count it when its block is flushed, in input order."""
        if self.on_error != "skip":
            raise InputError(f"{self.name}: {where}: {err.message}")
        self.record_index += 1
        if b is not None:
            b.rejects.append((len(b.lens) - 0.5, err, where))  # before the block's next record
        else:
            self._count(err, where)

    def _count(self, err: _RecordError, where: str) -> None:
        self.skipped[err.reason] += 1
        if len(self.examples) < 5:
            self.examples.append(f"{self.name}: {where}: {err.message}")
        self.n_skipped += 1

    # -- one block ----------------------------------------------------------------------------------

    def flush(self, b: _Block, pending: InputError | None = None) -> None:
        """Check the block's token ranges at once, then hand the good records to the builder.

        ``pending``: the error that stopped the block (raise mode); an earlier bad record wins over it.
        """
        if not b.lens:
            for _, err, where in b.rejects:
                self._count(err, where)
            if pending is not None:
                raise pending
            return
        lens = np.asarray(b.lens, dtype=np.int64)
        flat = np.concatenate(b.toks) if len(b.toks) > 1 else np.asarray(b.toks[0])
        bad = np.zeros(len(lens), dtype=bool)
        if flat.min() < 0 or flat.max() > INT32_MAX:
            starts = np.cumsum(lens) - lens
            tok_bad = (flat < 0) | (flat > INT32_MAX)
            bad |= np.add.reduceat(tok_bad, starts) > 0
        rejects = list(b.rejects)
        if bad.any():
            # the precise path names the exact problem of each bad record
            for i in np.flatnonzero(bad).tolist():
                try:
                    _check_record(_loads(b.raws[i]), self.tokens_field)
                except _RecordError as err:
                    if self.on_error != "skip":
                        raise InputError(f"{self.name}: {b.where[i]}: {err.message}") from None
                    rejects.append((i, err, b.where[i]))
        for _, err, where in sorted(rejects, key=lambda x: x[0]):  # counted in input order
            self._count(err, where)
        if bad.any():
            keep = np.flatnonzero(~bad).tolist()
            flat = flat[np.repeat(~bad, lens)]
            lens = lens[keep]
            b = _Block(**{k: [getattr(b, k)[i] for i in keep] for k in _Block.__dataclass_fields__
                          if k not in ("toks", "lens", "rejects")})
        if pending is not None:
            raise pending
        n = len(lens)
        if not n:
            return
        mask_flat = lp_flat = None
        if any(m is not None for m in b.masks):
            mask_flat = np.concatenate([m if m is not None else np.ones(k, np.uint8) for m, k in zip(b.masks, lens)])
        if self.builder.keep_token_fields and any(p is not None for p in b.lps):
            lp_flat = np.concatenate([p if p is not None else np.full(k, np.nan) for p, k in zip(b.lps, lens)])

        def present(values):
            return values if any(v is not None for v in values) else None

        self.builder.add_chunk(
            tokens=flat, lengths=lens, loss_mask=mask_flat, logprobs=lp_flat, ids=b.ids,
            groups=present(b.groups), steps=present(b.steps), advantages=present(b.advs), rewards=present(b.rews),
            id_given=b.id_given, templates=b.templates if self.keep_records else None,
            carry=np.asarray(b.carry, dtype=np.uint8), where=(self.name, b.where.__getitem__),
        )
        self.kept += n


class _Slow(Exception):
    """The fast path does not take this record: the precise path does."""


def _nested(raw: bytes, names: list[str]) -> bool:
    """Whether a line's arrays ``names`` (numbers for simdjson) may hold arrays, which ``as_buffer`` flattens
    into their values (``[[1, 2], 3]`` -> 1, 2, 3). A line with no more ``[`` than these arrays has none
    (memchr speed); else every ``"name": [`` of the line (the record's own key among them, unless written with
    escapes) must open an array with no ``[`` before its first ``]``."""
    at = -1
    for _ in range(len(names) + 1):
        at = raw.find(b"[", at + 1)
        if at < 0:
            return False
    for name in names:
        key = b'"' + name.encode() + b'"'
        found = False
        at = raw.find(key)
        while at >= 0:
            m = _OPENS_ARRAY.match(raw, at + len(key))
            if m:
                end = raw.find(b"]", m.end())
                if raw.find(b"[", m.end(), len(raw) if end < 0 else end) >= 0:
                    return True
                found = True
            at = raw.find(key, at + 1)
        if not found:
            return True
    return False


_OPENS_ARRAY = re.compile(rb"\s*:\s*\[")


def read_json_file(path: str, name: str, tokens_field: str | None, on_error: str, builder: Builder,
                   skipped: Counter, examples: list[str], progress: Progress | None, *,
                   hasher=None) -> tuple[int, int]:
    """Read a JSONL / JSON-array file into ``builder``; returns (records kept, records skipped).

    ``hasher`` (a ``hashlib`` object) is updated with the file's bytes as they are read."""
    reader = _Reader(name, tokens_field, on_error, builder, skipped, examples)
    blocks = iter_blocks(path, progress=progress, hasher=hasher)
    lineno = 0
    try:
        first = next(blocks, b"")
        if _is_array_file(path, first):
            _read_array(reader, first + b"".join(blocks))
            return reader.kept, reader.n_skipped
        for block in _chain(first, blocks):
            b = _Block()
            pending = None
            lines = block.split(b"\n")
            for k, raw in enumerate(lines):
                if k == len(lines) - 1 and not raw:
                    break  # the block ended with a newline
                lineno += 1
                if not raw or raw.isspace():
                    continue
                try:
                    reader.add_raw(b, raw, f"line {lineno}")
                except InputError as exc:  # raise mode: an earlier record of the block may be worse
                    pending = exc
                    break
            reader.flush(b, pending)
    except StreamError as err:
        if err.fatal:  # nothing of the file could be read: no record to keep or count
            raise InputError(f"{name}: {err.message}") from None
        # not a bad record for --on-error skip: the records after the break are lost, and how many is unknown
        raise InputError(f"{name}: line {lineno + 1}: {err.message[:-1]}, after {lineno:,} complete lines)") from None
    return reader.kept, reader.n_skipped


def _read_array(reader: _Reader, text: bytes) -> None:
    try:
        values = _loads(text, whole=False)
    except _RecordError as err:
        raise InputError(f"{reader.name}: not a valid JSON array ({err.message.split('(', 1)[-1]}") from None
    b = _Block()
    for i, rec in enumerate(values, start=1):
        try:
            err = duplicate_error(rec)
            if err is not None:
                raise err
            reader.add_value(b, rec, f"record {i}")
        except _RecordError as err:
            reader.reject(err, f"record {i}", b)
    reader.flush(b)
