"""Packs you can trust: what ``manifest.json`` promises about its shards, and the checks every reader makes.

A pack directory is refused, with one line naming the file and what differs, when it is not what
``treepack pack`` wrote: a shard changed by one bit, cut short or replaced, a shard missing or one too many,
a manifest edited by hand or damaged. Written by ``write_shards`` (schema version 3), per shard:
``file``, ``packs`` (rows), ``first_pack``, ``bytes``, ``sha256`` (of the file), ``records`` (sequences)
and ``tokens`` (real pack tokens, padding excluded); the Parquet pages carry CRC32 checksums; the manifest
carries ``content_sha256``, the sha256 of its own content (canonical JSON of every other field).

Every reader (``read_packs``: train, verify, ``treepack.hf``; ``unpack``: stats, plot, report of a pack
directory) checks, before using a shard: its size, its sha256, its page checksums as the pages decode, its
rows, records and tokens, and ``pack_index`` strictly increasing in the manifest's order; and once, the
manifest: every field the readers use has its type, the counts add up (shards, packs, records, the skipped
ones), no ``shard-*.parquet`` is left unlisted, the content digest matches. ``check_packs`` (``treepack
check``) does all of it without decoding more than three small columns.

Cost, measured (benchmarks/results/2026-11-28-pack-integrity.md, 4.4M tokens of tau2 in 3.3 MiB of shards):
a shard is read from disk once, hashed (~1.4 GB/s) on a second thread while Parquet decodes it from memory,
and compared before any column is handed out: +0.7% wall time on ``unpack``, +1.6% on ``read_packs``. The
checks' CPU: sha256 2.5 ms, page checksums 0-2 ms, the manifest 0.26 ms (3-6% of a read's CPU). Directories written before schema version 3 have no sha256, record or
token counts and no page checksums: their sizes, rows, ``pack_index`` order and counts are checked.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from treepack.errors import InputError

DIGEST_KEY = "content_sha256"
FIELD_NAMES = ("loss_mask", "logprobs", "tree_id", "step", "advantage", "reward")
KEY_ENCODINGS = ("int", "str", "json")
RECORD_KINDS = ("json", "arrow")
COUNT_NAMES = ("records", "packed_sequences", "packs", "skipped", "oversize_skipped", "shards")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def content_digest(manifest: dict) -> str:
    """sha256 of the manifest's content: canonical JSON (sorted keys, no spaces) of every field but the digest."""
    body = {k: v for k, v in manifest.items() if k != DIGEST_KEY}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=True, ensure_ascii=True)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def _jtype(v) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null",
            int: "an integer", float: "a number"}.get(type(v), type(v).__name__)


class _Fields:
    """Typed look-ups into the manifest, each failure one line: ``FILE: field 'counts'.records must be ...``."""

    def __init__(self, f: Path):
        self.f = f

    def fail(self, where: str, what: str) -> InputError:
        return InputError(f"{self.f}: field {where} {what}")

    def get(self, obj: dict, key: str, where: str, *, optional: bool = False):
        if key not in obj:
            if optional:
                return None
            raise InputError(f"{self.f}: field {where} is missing")
        return obj[key]

    def obj(self, parent: dict, key: str, where: str, *, nullable: bool = False) -> dict | None:
        v = self.get(parent, key, where)
        if v is None and nullable:
            return None
        if not isinstance(v, dict):
            raise self.fail(where, f"must be an object{' or null' if nullable else ''}, got {_jtype(v)}")
        return v

    def count(self, parent: dict, key: str, where: str, *, optional: bool = False, least: int = 0) -> int | None:
        v = self.get(parent, key, where, optional=optional)
        if v is None and optional:
            return None
        if not isinstance(v, int) or isinstance(v, bool) or v < least:
            raise self.fail(where, f"must be an integer >= {least}, got {json.dumps(v)}")
        return v

    def choice(self, parent: dict, key: str, where: str, choices: tuple) -> str:
        v = self.get(parent, key, where)
        if v not in choices or not isinstance(v, str):
            raise self.fail(where, f"must be one of {', '.join(choices)}, got {json.dumps(v)}")
        return v


@dataclass
class ShardEntry:
    """One shard as the manifest lists it (``sha256``, ``records``, ``tokens``: None before schema version 3)."""

    file: str
    packs: int
    first_pack: int
    bytes: int
    sha256: str | None = None
    records: int | None = None
    tokens: int | None = None


def check_manifest(m: dict, f: Path) -> list[ShardEntry]:
    """Every field the readers use, and how the counts add up; returns the shards in the manifest's order.

    Raises ``InputError`` naming the manifest and the field (``'shards'[2].bytes``) on the first problem."""
    F = _Fields(f)
    version = m["schema_version"]
    fields = F.obj(m, "fields", "'fields'")
    for name in FIELD_NAMES:
        v = F.get(fields, name, f"'fields'.{name}")
        if not isinstance(v, bool):
            raise F.fail(f"'fields'.{name}", f"must be true or false, got {json.dumps(v)}")
    enc = F.obj(m, "id_encoding", "'id_encoding'")
    F.choice(enc, "seq_ids", "'id_encoding'.seq_ids", KEY_ENCODINGS)
    if fields["tree_id"]:
        F.choice(enc, "tree_ids", "'id_encoding'.tree_ids", KEY_ENCODINGS)
    if version >= 2:
        rec = F.obj(m, "records", "'records'", nullable=True)
        if rec is not None:
            kind = F.choice(rec, "kind", "'records'.kind", RECORD_KINDS)
            tf = F.get(rec, "tokens_field", "'records'.tokens_field")
            if tf is not None and not isinstance(tf, str):
                raise F.fail("'records'.tokens_field", f"must be a string or null, got {_jtype(tf)}")
            if kind == "arrow":
                _arrow_schema(F, rec)
    counts = F.obj(m, "counts", "'counts'")
    c = {name: F.count(counts, name, f"'counts'.{name}") for name in COUNT_NAMES}
    reasons = F.obj(counts, "skipped_reasons", "'counts'.skipped_reasons")
    for k, v in reasons.items():
        F.count(reasons, k, f"'counts'.skipped_reasons.{k}")
    sources = F.get(m, "sources", "'sources'")
    if not isinstance(sources, list):
        raise F.fail("'sources'", f"must be an array, got {_jtype(sources)}")
    for i, s in enumerate(sources):
        where = f"'sources'[{i}]"
        if not isinstance(s, dict):
            raise F.fail(where, f"must be an object, got {_jtype(s)}")
        for k in ("n_records", "n_skipped"):
            F.count(s, k, f"{where}.{k}")
        for k in ("path", "sha256", "format"):
            F.get(s, k, f"{where}.{k}")
    shards = _shard_entries(F, m, version)

    def differs(what: str, got: int, want_what: str, want: int) -> InputError:
        return InputError(f"{f}: {what} is {got:,} where {want_what} is {want:,}")

    if len(shards) != c["shards"]:
        raise differs("the number of shards listed", len(shards), "'counts'.shards", c["shards"])
    n_packs = sum(s.packs for s in shards)
    if n_packs != c["packs"]:
        raise differs("the sum of 'shards'[].packs", n_packs, "'counts'.packs", c["packs"])
    if all(s.records is not None for s in shards):
        n_rec = sum(s.records for s in shards)
        if n_rec != c["packed_sequences"]:
            raise differs("the sum of 'shards'[].records", n_rec, "'counts'.packed_sequences", c["packed_sequences"])
    if c["packed_sequences"] + c["oversize_skipped"] != c["records"]:
        raise differs("'counts'.packed_sequences + 'counts'.oversize_skipped",
                      c["packed_sequences"] + c["oversize_skipped"], "'counts'.records", c["records"])
    if sum(reasons.values()) != c["skipped"]:
        raise differs("the sum of 'counts'.skipped_reasons", sum(reasons.values()), "'counts'.skipped", c["skipped"])
    if sources and sum(s["n_records"] for s in sources) != c["records"]:
        raise differs("the sum of 'sources'[].n_records", sum(s["n_records"] for s in sources), "'counts'.records",
                      c["records"])
    stats = m.get("stats")
    if isinstance(stats, dict) and version >= 3:
        if stats.get("n_packs") != c["packs"]:
            raise differs("'stats'.n_packs", _num(stats.get("n_packs")), "'counts'.packs", c["packs"])
        n_tok = sum(s.tokens for s in shards)
        if stats.get("n_pack_tokens") != n_tok:
            raise differs("'stats'.n_pack_tokens", _num(stats.get("n_pack_tokens")), "the sum of 'shards'[].tokens",
                          n_tok)
    if version >= 3:
        digest = F.get(m, DIGEST_KEY, f"'{DIGEST_KEY}'")
        if digest != content_digest(m):
            raise InputError(f"{f}: its content differs from what `treepack pack` wrote ('{DIGEST_KEY}' does not "
                             "match: a field was edited or damaged)")
    return shards


def _num(v) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else -1


def _arrow_schema(F: _Fields, rec: dict) -> None:
    text = F.get(rec, "schema", "'records'.schema")
    try:
        pa.ipc.read_schema(pa.py_buffer(base64.b64decode(text, validate=True)))
    except (TypeError, ValueError, pa.ArrowException):
        raise F.fail("'records'.schema", "is not a base64 Arrow schema") from None


def _shard_entries(F: _Fields, m: dict, version: int) -> list[ShardEntry]:
    shards = F.get(m, "shards", "'shards'")
    if not isinstance(shards, list):
        raise F.fail("'shards'", f"must be an array, got {_jtype(shards)}")
    out: list[ShardEntry] = []
    seen: set[str] = set()
    first = 0
    for i, s in enumerate(shards):
        where = f"'shards'[{i}]"
        if not isinstance(s, dict):
            raise F.fail(where, f"must be an object, got {_jtype(s)}")
        name = F.get(s, "file", f"{where}.file")
        if not isinstance(name, str) or not name.endswith(".parquet") or "/" in name or "\\" in name \
                or name.startswith("."):
            raise F.fail(f"{where}.file", f"must be the name of a .parquet file in the directory, got {json.dumps(name)}")
        if name in seen:
            raise F.fail(f"{where}.file", f"names {name} a second time")
        seen.add(name)
        e = ShardEntry(file=name, packs=F.count(s, "packs", f"{where}.packs", least=1),
                       first_pack=F.count(s, "first_pack", f"{where}.first_pack"),
                       bytes=F.count(s, "bytes", f"{where}.bytes"))
        if e.first_pack != first:
            raise F.fail(f"{where}.first_pack", f"is {e.first_pack:,} where the shards before it hold {first:,} packs")
        first += e.packs
        new = version >= 3
        sha = F.get(s, "sha256", f"{where}.sha256", optional=not new)
        if sha is not None and (not isinstance(sha, str) or not _HEX64.match(sha)):
            raise F.fail(f"{where}.sha256", f"must be 64 lowercase hex digits, got {json.dumps(sha)}")
        e.sha256 = sha
        e.records = F.count(s, "records", f"{where}.records", optional=not new)
        e.tokens = F.count(s, "tokens", f"{where}.tokens", optional=not new)
        out.append(e)
    return out


def unlisted_shards(path: Path, shards: list[ShardEntry]) -> None:
    """A ``shard-*.parquet`` the manifest does not list: the manifest lost an entry (or the directory gained one)."""
    listed = {s.file for s in shards}
    extra = sorted(p.name for p in path.glob("shard-*.parquet") if p.name not in listed)
    if extra:
        raise InputError(f"{path / extra[0]}: a shard the manifest does not list ({len(listed):,} listed): the "
                         "manifest lost an entry, or the file does not belong here")


class OpenShard:
    """A shard's bytes, read once from disk and checked against the manifest's size; its sha256 is computed on a
    second thread while Parquet decodes (``hashlib`` releases the GIL), and compared before any column is handed
    out. The Parquet reader verifies every page's checksum as it decodes it."""

    def __init__(self, f: Path, data: bytes | None, e: ShardEntry | None):
        self.f, self.entry = f, e
        self._digest: list[str] = []
        self._hashing = None
        if data is None:  # benchmarks/integrity.py's baseline: Parquet reads the file itself, nothing checked
            self.pf = pq.ParquetFile(f)
            return
        if e is not None and e.sha256 is not None:
            self._hashing = threading.Thread(target=lambda: self._digest.append(hashlib.sha256(data).hexdigest()),
                                             daemon=True)
            self._hashing.start()
        try:
            self.pf = pq.ParquetFile(pa.BufferReader(data), page_checksum_verification=True)
        except (pa.ArrowException, OSError) as exc:
            self.confirm()
            raise InputError(f"{f}: not a readable Parquet shard ({str(exc).splitlines()[0]})") from None

    def confirm(self) -> None:
        """Raise if the file's sha256 is not the manifest's (waits for the hash)."""
        if self._hashing is None:
            return
        self._hashing.join()
        self._hashing = None
        got, want = self._digest[0], self.entry.sha256
        if got != want:
            raise InputError(f"{self.f}: sha256 {got[:12]}... where the manifest says {want[:12]}... (the file "
                             "was changed or damaged)")

    @property
    def names(self) -> list[str]:
        return self.pf.schema_arrow.names

    def read(self, columns: list[str]) -> pa.Table:
        """Columns of the shard, once its sha256 matched; a page whose checksum fails, or any other damage, is
        one line naming the shard."""
        try:
            table = self.pf.read(columns=columns)
        except (pa.ArrowException, OSError) as exc:
            self.confirm()
            msg = str(exc).splitlines()[0]
            if "CRC checksum verification failed" in msg:
                raise InputError(f"{self.f}: a Parquet page's checksum fails (the file was changed or damaged)"
                                 ) from None
            raise InputError(f"{self.f}: not a readable Parquet shard ({msg})") from None
        self.confirm()
        return table


def open_shard(path: Path, e: ShardEntry) -> OpenShard:
    """Open a shard the manifest lists: missing, or of another size, is refused here; its sha256, rows and
    pages as it is read (`OpenShard`)."""
    f = path / e.file
    if not f.exists():
        raise InputError(f"{f}: shard listed in the manifest is missing")
    data = f.read_bytes()
    if len(data) != e.bytes:
        raise InputError(f"{f}: {len(data):,} bytes where the manifest says {e.bytes:,} (the file was changed, "
                         "replaced or cut short)")
    shard = OpenShard(f, data, e)
    if shard.pf.metadata.num_rows != e.packs:
        shard.confirm()
        raise InputError(f"{f}: {shard.pf.metadata.num_rows:,} packs where the manifest says {e.packs:,}")
    return shard


class ShardCheck:
    """What each shard's rows must show, shard after shard in the manifest's order."""

    def __init__(self, path: Path):
        self.path = path
        self.last_pack = -1

    def rows(self, e: ShardEntry, pack_index: np.ndarray, n_real: np.ndarray, n_seqs: int) -> None:
        f = self.path / e.file
        idx = np.asarray(pack_index, dtype=np.int64)
        if len(idx):
            prev = np.concatenate([[self.last_pack], idx[:-1]])
            bad = np.flatnonzero(idx <= prev)
            if len(bad):
                r = int(bad[0])
                raise InputError(f"{f}: row {r}: pack_index {int(idx[r]):,} after {int(prev[r]):,} (packs must come "
                                 "in the manifest's order, pack_index strictly increasing)")
            if int(idx[0]) != e.first_pack:
                raise InputError(f"{f}: its first pack_index is {int(idx[0]):,} where the manifest says first_pack "
                                 f"{e.first_pack:,}")
            self.last_pack = int(idx[-1])
        if e.records is not None and n_seqs != e.records:
            raise InputError(f"{f}: {n_seqs:,} records where the manifest says {e.records:,}")
        tokens = int(np.asarray(n_real, dtype=np.int64).sum())
        if e.tokens is not None and tokens != e.tokens:
            raise InputError(f"{f}: {tokens:,} tokens where the manifest says {e.tokens:,}")


def shard_counts(table: pa.Table) -> tuple[np.ndarray, np.ndarray, int]:
    """(pack_index, n_real, number of sequences) of a table holding those columns and ``seq_leaf``."""
    n_seqs = pc.sum(pc.list_value_length(table.column("seq_leaf"))).as_py() or 0
    return (np.asarray(table.column("pack_index").to_numpy(), dtype=np.int64),
            np.asarray(table.column("n_real").to_numpy(), dtype=np.int64), n_seqs)
