"""The columnar builder every reader fills: validated chunks in, one ``Rollouts`` batch out.

Readers (`treepack.io.jsonl` for JSON records, `treepack.io.arrow` for Parquet) validate records or whole
columns and hand them over as chunks. Tokens (and loss masks) go straight into one growing buffer: an
anonymous private mapping that ``mremap`` enlarges in place (Linux), so the tokens are never held twice and
never concatenated at the end; where the total is known up front (Parquet metadata) ``reserve`` sizes it
once. Peak memory is ~1x the int32 token bytes plus one chunk (the old list-of-chunks + ``concatenate``
held 2x at the end). Where the mapping can not grow in place the buffer doubles with one copy.

The builder also keeps, when asked (``keep_records``), what `treepack unpack` needs to give every record
back exactly (`treepack.io.extras`), and notices ids that repeat within a tree_id (``n_duplicate_ids``):
a sample id should name one record, and a repeat is reported, not silently accepted.
"""


from __future__ import annotations

import math
import mmap
from collections import Counter

import numpy as np
import pyarrow as pa

from treepack.errors import InputError
from treepack.io.extras import Extras
from treepack.io.rollouts import Rollouts, Source

_PAGE = mmap.PAGESIZE
_PREFAULT_MIN_BYTES = 64 << 20  # below this, lazily faulted pages cost too little to matter


class GrowingArray:
    """An append-only 1-D array in an anonymous mapping that grows without holding two copies."""

    def __init__(self, dtype, capacity: int = 0, *, populate: bool = False) -> None:
        self.dtype = np.dtype(dtype)
        self.n = 0
        self._mm: mmap.mmap | None = None
        self._np: np.ndarray | None = None  # fallback when the mapping can not be resized
        self._populate = populate
        self._reserve(max(int(capacity), 1 << 16))

    def _reserve(self, items: int) -> None:
        nbytes = -(-items * self.dtype.itemsize // _PAGE) * _PAGE
        if self._mm is None and self._np is None and hasattr(mmap, "MAP_ANONYMOUS"):
            # MAP_POPULATE (a known size): the pages are mapped in one go; faulting 100M tokens' pages in one
            # by one cost 0.25-1.2 s on the 2-core benchmark machine
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
            if self._populate and nbytes >= _PREFAULT_MIN_BYTES:
                flags |= getattr(mmap, "MAP_POPULATE", 0)
            self._mm = mmap.mmap(-1, nbytes, flags=flags)
            return
        if self._mm is not None:
            try:
                self._mm.resize(nbytes)  # mremap: grows in place or moves pages, never copies them
                return
            except (OSError, SystemError, ValueError, BufferError):
                pass
        old = self.view() if self.n else np.zeros(0, self.dtype)
        grown = np.empty(items, self.dtype)
        grown[: self.n] = old
        self._np, self._mm = grown, None

    @property
    def capacity(self) -> int:
        return (len(self._mm) // self.dtype.itemsize) if self._mm is not None else len(self._np)

    def append(self, values: np.ndarray | int, count: int | None = None) -> None:
        """Append an array, or ``count`` copies of a scalar."""
        k = len(values) if count is None else count
        if self.n + k > self.capacity:
            self._reserve(max(self.n + k, 2 * self.capacity))
        a, b = self.n, self.n + k
        if self._mm is not None:
            dst = np.frombuffer(self._mm, dtype=self.dtype, count=b - a, offset=a * self.dtype.itemsize)
            dst[:] = values
            del dst  # no export may outlive the call: the mapping must stay resizable
        else:
            self._np[a:b] = values
        self.n = b

    def view(self) -> np.ndarray:
        """The array so far (the mapping can not grow while a view of it is alive)."""
        if self._mm is not None:
            return np.frombuffer(self._mm, dtype=self.dtype, count=self.n)
        return self._np[: self.n]


class Builder:
    """Accumulates validated chunks from any number of files, then builds one batch."""

    def __init__(self, keep_token_fields: bool = True, keep_records: bool = False) -> None:
        self.keep_token_fields = keep_token_fields  # False: log-probs are validated, not kept (masks always are)
        self.keep_records = keep_records  # True: templates / other columns for an exact unpack
        self.record_kind = "json"  # how records are kept: "json" templates, or "arrow" (all input is Parquet)
        self.tokens = GrowingArray(np.int32)
        self.mask = GrowingArray(np.uint8)  # 1 byte a token: stats' FLOP model counts the loss targets
        self.logprobs: GrowingArray | None = None  # created at the first chunk that has log-probs
        self.lengths: list[np.ndarray] = []
        self.ids: list = []
        self.group_values: list = []  # raw tree_id per record (None where absent)
        self.steps: list = []
        self.advantages: list = []
        self.rewards: list = []
        self.has = Counter()  # which optional fields appeared at all
        self.n = 0
        # exact unpack
        self.carry: list[np.ndarray] = []
        self.templates: list[str | None] = []
        self.tables: list[pa.Table] = []  # Parquet: the other columns of each chunk
        self.schemas: list[pa.Schema] = []  # Parquet: each file's schema
        self.tokens_field: str | None = None
        # duplicate ids
        self._seen: dict = {}
        self.n_duplicate_ids = 0
        self.duplicate_example: str | None = None

    def reserve(self, n_tokens: int) -> None:
        """Room for ``n_tokens`` more tokens in one allocation (the count is known from Parquet metadata)."""
        need = self.tokens.n + int(n_tokens)
        if self.tokens.n == 0:
            self.tokens = GrowingArray(np.int32, need, populate=True)
            self.mask = GrowingArray(np.uint8, need, populate=True) if self.mask is not None else None
        elif need > self.tokens.capacity:
            self.tokens._reserve(need)
            if self.mask is not None:
                self.mask._reserve(need)

    def add_chunk(self, *, tokens, lengths, loss_mask, logprobs, ids, groups, steps, advantages, rewards,
                  id_given=None, templates=None, table: pa.Table | None = None, carry=None, where=None) -> None:
        n = len(lengths)
        lengths = np.asarray(lengths, dtype=np.int64)
        n_tok = int(lengths.sum())
        self.tokens.append(np.asarray(tokens))
        if self.mask is not None:
            if loss_mask is None:
                self.mask.append(1, count=n_tok)
            else:
                self.mask.append(np.asarray(loss_mask))
                self.has["loss_mask"] += 1
        if self.keep_token_fields and logprobs is not None:
            if self.logprobs is None:
                self.logprobs = GrowingArray(np.float64, self.tokens.capacity)
                self.logprobs.append(np.nan, count=self.tokens.n - n_tok)
            self.logprobs.append(np.asarray(logprobs, dtype=np.float64))
            self.has["logprobs"] += 1
        elif self.logprobs is not None:
            self.logprobs.append(np.nan, count=n_tok)
        self.lengths.append(lengths)
        self._check_ids(ids, id_given, groups, where)
        self.ids.extend(ids)
        for name, values, store in (
            ("group", groups, self.group_values),
            ("step", steps, self.steps),
            ("advantage", advantages, self.advantages),
            ("reward", rewards, self.rewards),
        ):
            if values is None:
                store.extend([None] * n)
            else:
                store.extend(values)
                self.has[name] += 1
        if self.keep_records:
            self.carry.append(np.asarray(carry, dtype=np.uint8))
            if table is not None:
                self.tables.append(table)
            else:
                self.templates.extend(templates)
        self.n += n

    def _check_ids(self, ids: list, given, groups, where) -> None:
        """Count ids given in the input that an earlier record of the same tree_id already has (ids name a
        sample within its tree, as in every real data set at hand; default ids never count).

        ``where`` = (file name, k -> location of record k of the chunk), asked only for a repeat."""
        seen = self._seen
        groups = groups if groups is not None else [None] * len(ids)
        for k, (rid, g, tree) in enumerate(zip(ids, given if given is not None else [True] * len(ids), groups)):
            if not g:
                continue
            key = (type(tree) is str, tree, type(rid) is str, rid)
            first = seen.get(key)
            if first is None:
                seen[key] = (where, k)
                continue
            self.n_duplicate_ids += 1
            if self.duplicate_example is None and where is not None:
                (file0, at0), k0 = first
                earlier = at0(k0) if file0 == where[0] else f"{file0} {at0(k0)}"
                within = "" if tree is None else f" of tree_id {tree!r}"
                self.duplicate_example = f"{where[0]}: {where[1](k)}: id {rid!r}{within} repeats {earlier}"

    def build(self, sources: list[Source], skipped: Counter, examples: list[str]) -> Rollouts:
        lengths = np.concatenate(self.lengths) if self.lengths else np.zeros(0, dtype=np.int64)
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        tokens = self.tokens.view()
        loss_mask = self.mask.view() if self.mask is not None and self.has["loss_mask"] else None
        logprobs = self.logprobs.view() if self.logprobs is not None else None

        groups = group_names = None
        if self.has["group"]:
            codes: dict = {}
            group_names = []
            out = np.empty(self.n, dtype=np.int64)
            for i, g in enumerate(self.group_values):
                key = (type(g).__name__, g)
                c = codes.get(key)
                if c is None:
                    c = codes[key] = len(group_names)
                    group_names.append(g)
                out[i] = c
            groups = out
        steps = np.asarray([-1 if s is None else s for s in self.steps], dtype=np.int64) if self.has["step"] else None

        def floats(values, present):
            if not present:
                return None
            return np.asarray([math.nan if v is None else v for v in values], dtype=np.float64)

        r = Rollouts(
            tokens=tokens,
            offsets=offsets,
            ids=self.ids,
            loss_mask=loss_mask,
            logprobs=logprobs,
            groups=groups,
            group_names=group_names,
            steps=steps,
            advantages=floats(self.advantages, self.has["advantage"]),
            rewards=floats(self.rewards, self.has["reward"]),
            sources=sources,
            skipped=skipped,
            skipped_examples=examples,
        )
        r.n_duplicate_ids = self.n_duplicate_ids
        r.duplicate_example = self.duplicate_example
        if self.keep_records:
            r.extras = self._extras()
        return r

    def _extras(self) -> Extras:
        carry = np.concatenate(self.carry) if self.carry else np.zeros(0, np.uint8)
        if self.record_kind == "json":
            return Extras(tokens_field=self.tokens_field, carry=carry, templates=self.templates)
        try:
            schema = pa.unify_schemas(self.schemas)
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise InputError(f"the Parquet files have conflicting schemas ({exc}); pack them separately") from None
        tables = [t.cast(pa.schema([schema.field(c) for c in t.column_names])) for t in self.tables]
        table = pa.concat_tables(tables, promote_options="default") if tables else schema.empty_table()
        return Extras(tokens_field=self.tokens_field, carry=carry, table=table, schema=schema)
