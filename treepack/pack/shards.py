"""Packed shards on disk: Parquet files with one row per pack (docs/design.md §6) plus ``manifest.json``, and
``write_shards``. Reading them back (``read_packs`` -> ``Pack``, ``unpack`` -> ``Rollouts``) is
`treepack.pack.shard_reader`.

Row schema (T = tokens of the pack incl. padding, S = its sequences; list columns unless noted):
- ``input_ids, position_ids, parent, subtree_end`` int32 [T]; ``scale, loss_weight`` float32 [T] (§6 there);
- ``loss_mask`` int8 [T]: the loss mask every sequence through the token agrees on, or -1 where they
  differ (a multi-turn history: trained in the turn that wrote it, context in later turns); then
  ``seq_loss_mask`` int8 holds, sequence by sequence and root to leaf, the values at those tokens only;
- ``logprobs`` float64 [T] + ``logprobs_mixed`` bool [T] + ``seq_logprobs`` float64: the same scheme for
  behaviour log-probs (when the input had them; NaN where a record had none);
- ``seq_ids`` [S] (int64 or string, see the manifest's ``id_encoding``), ``seq_index`` int64 [S] (global
  record index: restores input order), ``seq_leaf`` int32 [S] (a sequence's path is the parent chain from
  its leaf), and when present ``tree_ids`` [S], ``advantages``/``rewards`` float64 [S];
- scalars: ``pack_index`` int64, ``n_real`` int32 (tokens [n_real, T) are padding), ``step`` int64 (when
  the input has steps: a pack never crosses one), ``rank`` int32 (with ``balance``);
- every record, for an exact ``unpack`` (schema version 2, `treepack.io.extras`): ``seq_carry`` int8 [S]
  (which lists the packs give back, and in which JSON form) and ``seq_record`` string [S] (JSON input: the
  record with those lists as null), or one ``extra:NAME`` list column per other input column (Parquet
  input: the input's own types; the manifest's ``records.schema`` is the input schema). The trainer never
  reads these columns.
A sequence's tokens are ``input_ids`` along its path, so nothing per sequence repeats the shared tokens:
the real tau-bench file (6.66M flat tokens, C = 11) packs at 16k into 0.77 MB of zstd Parquet (1.3 bytes
per pack token), of which the per-sequence columns are 2.7% and ``input_ids``/``parent``/``position_ids``
94%.

Shards are cut by size (``256M``: uncompressed bytes of the rows, so files come out smaller) or by count
(``1000packs``). ``read_packs`` rebuilds each sequence's path in O(its length) from the DFS layout (its
new tokens are the run after the previous leaf, hanging off the previous path) and falls back to walking
``parent`` when a layout does not follow that order.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from treepack import __version__
from treepack.errors import TreepackError
from treepack.io.atomic import atomic_dir
from treepack.io.extras import Extras
from treepack.io.ingest import rollout_files
from treepack.io.records import key_encoding
from treepack.io.rollouts import Rollouts
from treepack.pack.balance import Balance, balance_packs, pack_costs
from treepack.pack.integrity import DIGEST_KEY, content_digest
from treepack.pack.layout import Pack, build_pack
from treepack.pack.strategies import Packing
from treepack.sizes import parse_size
from treepack.stats import DEFAULT_MODEL, TreeStats
from treepack.tree import scope_codes

SCHEMA_VERSION = 3  # 2: every record kept (``records``, ``seq_carry``, ``seq_record`` / ``extra:*``); 3: integrity
READABLE_VERSIONS = (1, 2, 3)  # (per shard sha256, records, tokens; page checksums; the manifest's content_sha256)
EXTRA_PREFIX = "extra:"  # Parquet input: the column NAME of a record is the per-sequence list column extra:NAME
FORMAT = "treepack.packs"
MANIFEST = "manifest.json"
DEFAULT_SHARD_SIZE = "256M"
_SHARD_NAME = "shard-{:05d}.parquet"
_PACKS_RE = re.compile(r"^\s*(\d+)\s*packs?\s*$")
MAX_LISTED_SKIPPED = 1000  # the manifest names at most this many oversize sequences (counts has them all)


def parse_shard_size(text: str | int) -> tuple[str, int]:
    """``256M`` -> ("bytes", 268435456); ``1000packs`` -> ("packs", 1000)."""
    if isinstance(text, int):
        return "bytes", parse_size(text, what="shard size")
    m = _PACKS_RE.match(str(text))
    if m:
        n = int(m.group(1))
        if n <= 0:
            raise TreepackError(f"invalid shard size {text!r}: must be positive")
        return "packs", n
    try:
        return "bytes", parse_size(text, what="shard size")
    except TreepackError:
        raise TreepackError(
            f"invalid shard size {text!r}: expected bytes (e.g. 256M) or a number of packs (e.g. 1000packs)"
        ) from None


def encode_keys(values: list, enc: str) -> pa.Array:
    if enc == "int":
        return pa.array(values, type=pa.int64())
    if enc == "str":
        return pa.array(values, type=pa.string())
    return pa.array([json.dumps(v) for v in values], type=pa.string())


def decode_keys(values, enc: str) -> list:
    values = values.tolist() if isinstance(values, np.ndarray) else list(values)
    return [json.loads(v) for v in values] if enc == "json" else values


# --------------------------------------------------------------------------------------------------
# Writing


class _ShardWriter:
    """Accumulates pack rows column by column and flushes a Parquet file when the shard is full."""

    def __init__(self, out: Path, schema: pa.Schema, limit: tuple[str, int]):
        self.out, self.schema, self.limit = out, schema, limit
        self.files: list[dict] = []
        self._reset()

    def _reset(self) -> None:
        self.cols: dict[str, list] = {f.name: [] for f in self.schema}
        self.n_rows = 0
        self.bytes = 0
        self.first_pack = None
        self.records = self.tokens = 0

    def add(self, row: dict, pack_index: int) -> None:
        if self.first_pack is None:
            self.first_pack = pack_index
        for name in self.cols:
            v = row[name]
            self.cols[name].append(v)
            self.bytes += getattr(v, "nbytes", 8)
        self.n_rows += 1
        self.records += len(row["seq_index"])
        self.tokens += int(row["n_real"])
        kind, n = self.limit
        if (kind == "packs" and self.n_rows >= n) or (kind == "bytes" and self.bytes >= n):
            self.flush()

    def flush(self) -> None:
        if not self.n_rows:
            return
        arrays = []
        for f in self.schema:
            vals = self.cols[f.name]
            if pa.types.is_list(f.type):
                arrays.append(_list_array(vals, f.type))
            elif isinstance(vals[0], pa.Array):
                arrays.append(pa.concat_arrays(vals))
            else:
                arrays.append(pa.array(vals, type=f.type))
        table = pa.Table.from_arrays(arrays, schema=self.schema)
        name = _SHARD_NAME.format(len(self.files))
        sink = pa.BufferOutputStream()  # hashed in memory, written once
        pq.write_table(table, sink, row_group_size=64, compression="zstd", write_page_checksum=True)
        data = sink.getvalue()
        with open(self.out / name, "wb") as fh:
            fh.write(data)
        self.files.append({"file": name, "packs": self.n_rows, "first_pack": self.first_pack, "bytes": data.size,
                           "sha256": hashlib.sha256(data).hexdigest(), "records": self.records,
                           "tokens": self.tokens})
        self._reset()


def _list_array(values: list, typ: pa.DataType) -> pa.Array:
    """One list per row from per-row numpy arrays (or Arrow arrays for keys)."""
    lens = np.fromiter((len(v) for v in values), dtype=np.int64, count=len(values))
    offsets = np.zeros(len(values) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    if offsets[-1] >= 2**31:
        raise TreepackError("a shard exceeds 2^31 list entries: use a smaller --shard-size")
    if isinstance(values[0], pa.Array):
        flat = pa.concat_arrays(values) if values else pa.array([], type=typ.value_type)
    else:
        flat = pa.array(np.concatenate(values).astype(typ.value_type.to_pandas_dtype(), copy=False), type=typ.value_type)
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), flat, type=typ)


def _schema(fields: dict, enc: dict, balanced: bool, extras: Extras | None = None) -> pa.Schema:
    i32, f32, f64 = pa.list_(pa.int32()), pa.list_(pa.float32()), pa.list_(pa.float64())
    key = {"int": pa.list_(pa.int64()), "str": pa.list_(pa.string()), "json": pa.list_(pa.string())}
    cols = [("pack_index", pa.int64()), ("n_real", pa.int32())]
    if fields["step"]:
        cols.append(("step", pa.int64()))
    if balanced:
        cols.append(("rank", pa.int32()))
    cols += [("input_ids", i32), ("position_ids", i32), ("parent", i32), ("subtree_end", i32),
             ("scale", f32), ("loss_weight", f32), ("loss_mask", pa.list_(pa.int8())),
             ("seq_loss_mask", pa.list_(pa.int8())),
             ("seq_ids", key[enc["seq_ids"]]), ("seq_index", pa.list_(pa.int64())), ("seq_leaf", i32)]
    if fields["tree_id"]:
        cols.append(("tree_ids", key[enc["tree_ids"]]))
    if fields["advantage"]:
        cols.append(("advantages", f64))
    if fields["reward"]:
        cols.append(("rewards", f64))
    if fields["logprobs"]:
        cols += [("logprobs", f64), ("logprobs_mixed", pa.list_(pa.bool_())), ("seq_logprobs", f64)]
    if extras is not None:  # every record exactly (`treepack.io.extras`): read by unpack only
        cols.append(("seq_carry", pa.list_(pa.int8())))
        if extras.kind == "json":
            cols.append(("seq_record", pa.list_(pa.string())))
        else:
            cols += [(EXTRA_PREFIX + f.name, pa.list_(f.type)) for f in extras.table.schema]
    return pa.schema(cols)


def _extra_columns(extras: Extras, index: np.ndarray) -> dict:
    """Per-sequence record columns of one pack (``index``: its sequences' records, in pack order)."""
    row = {"seq_carry": extras.carry[index].astype(np.int8)}
    if extras.kind == "json":
        row["seq_record"] = pa.array([extras.templates[i] for i in index.tolist()], type=pa.string())
    else:
        taken = extras.table.take(pa.array(index))
        for name in taken.column_names:
            col = taken.column(name)
            row[EXTRA_PREFIX + name] = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    return row


def _consensus(tok: np.ndarray, values: np.ndarray, T: int, bits: np.ndarray | None = None):
    """Per pack token: the value all entries (sequence, position) on it agree on, a mixed flag, and the
    entries at mixed tokens in entry order. ``bits`` compares bit patterns (NaN-safe) instead of values."""
    F = len(tok)
    first = np.full(T, -1, dtype=np.int64)
    first[tok[::-1]] = np.arange(F - 1, -1, -1)
    cmp = values if bits is None else bits
    differs = cmp != cmp[first[tok]]
    mixed = np.bincount(tok, weights=differs, minlength=T) > 0
    has = first >= 0
    cons = np.zeros(T, dtype=values.dtype)
    cons[has] = values[first[has]]
    return cons, mixed, values[mixed[tok]], has


def _row(pack: Pack, pack_index: int, step, rank, enc: dict, fields: dict) -> dict:
    T = pack.n_tokens
    tok = pack.seq_token_index.astype(np.int64)
    mask_cons, mask_mixed, mask_exc, _ = _consensus(tok, pack.seq_loss_mask.astype(np.int8), T)
    loss_mask = mask_cons.astype(np.int8)
    loss_mask[mask_mixed] = -1
    row = {
        "pack_index": pack_index, "n_real": pack.n_real, "step": step, "rank": rank,
        "input_ids": pack.input_ids, "position_ids": pack.position_ids, "parent": pack.parent,
        "subtree_end": pack.subtree_end, "scale": pack.scale, "loss_weight": pack.loss_weight,
        "loss_mask": loss_mask, "seq_loss_mask": mask_exc.astype(np.int8),
        "seq_ids": encode_keys(pack.seq_ids, enc["seq_ids"]), "seq_index": pack.seq_index.astype(np.int64),
        "seq_leaf": pack.seq_leaf,
    }
    if fields["tree_id"]:
        row["tree_ids"] = encode_keys(pack.seq_groups, enc["tree_ids"])
    if fields["advantage"]:
        row["advantages"] = pack.advantages
    if fields["reward"]:
        row["rewards"] = pack.rewards
    if fields["logprobs"]:
        lp = pack.seq_logprobs.astype(np.float64)
        cons, mixed, exc, has = _consensus(tok, lp, T, bits=lp.view(np.int64))
        cons[~has] = np.nan  # padding
        row["logprobs"], row["logprobs_mixed"], row["seq_logprobs"] = cons, mixed, exc
    return row


def _records_entry(extras: Extras) -> dict:
    """How the shards keep every record: JSON templates, or Arrow columns with the input schema."""
    entry = {"kind": extras.kind, "tokens_field": extras.tokens_field}
    if extras.kind == "arrow":
        entry["schema"] = base64.b64encode(extras.schema.serialize().to_pybytes()).decode("ascii")
    return entry


def check_output_dir(out: Path) -> None:
    """Refuse an output path that is a file, already holds packed shards (never mix two packings), or holds
    rollout files: a pack directory reads as its packs only, so every reader would pass over them."""
    if out.exists() and not out.is_dir():
        raise TreepackError(f"{out}: exists and is not a directory")
    if out.is_dir() and ((out / MANIFEST).exists() or any(out.glob("shard-*.parquet"))):
        raise TreepackError(f"{out}: already holds packed shards; remove them or choose another output directory")
    held = rollout_files(out) if out.is_dir() else []
    if held:
        more = f" and {len(held) - 1:,} more" if len(held) > 1 else ""
        raise TreepackError(f"{out}: holds rollout files ({held[0]}{more}), which every reader would pass over once "
                            "it is a pack directory (it reads as its packs only); choose another output directory")


def write_shards(
    rollouts: Rollouts,
    packing: Packing,
    out_dir: str | Path,
    *,
    pad_to: int | None = None,
    shard_size: str | int = DEFAULT_SHARD_SIZE,
    balance: int | None = None,
    balance_cost: str = "tokens",
    model: str = DEFAULT_MODEL,
    group_by: str | None = None,
    stats: TreeStats | None = None,
    progress: Callable[[int], None] | None = None,
    command: str | None = None,
    rendering: dict | None = None,
) -> dict:
    """Write ``packing`` of ``rollouts`` as Parquet shards + ``manifest.json`` into ``out_dir``; return the manifest.

    ``pad_to`` pads each pack to a multiple of it (block alignment; ``n_real`` marks the real tokens).
    ``balance`` = K assigns each pack a data-parallel rank (``treepack.pack.balance``). ``group_by`` must be the
    one the packing used. ``stats``: the input's `TreeStats` for the manifest (computed here when None, as the
    CLI's stats of the same input). ``progress`` is called with 1 after each pack.

    The output appears whole or not at all (`treepack.io.atomic`): the files are written into a hidden directory
    and renamed into place at the end (into an existing ``out_dir``: moved in, ``manifest.json`` last); any
    failure or interruption removes them and leaves ``out_dir`` as it was.
    """
    out = Path(out_dir)
    check_output_dir(out)
    if pad_to is not None and pad_to <= 0:
        raise TreepackError(f"pad_to must be positive, got {pad_to}")
    limit = parse_shard_size(shard_size)
    with atomic_dir(out, last=MANIFEST) as tmp:
        return _write(rollouts, packing, tmp, limit, pad_to=pad_to, balance=balance, balance_cost=balance_cost,
                      model=model, group_by=group_by, stats=stats, progress=progress, command=command,
                      rendering=rendering)


def _write(rollouts: Rollouts, packing: Packing, out: Path, limit: tuple[str, int], *, pad_to: int | None,
           balance: int | None, balance_cost: str, model: str, group_by: str | None, stats: TreeStats | None,
           progress: Callable[[int], None] | None, command: str | None, rendering: dict | None) -> dict:
    """write_shards' files into the directory ``out``."""
    fields = {"loss_mask": rollouts.loss_mask is not None, "logprobs": rollouts.logprobs is not None,
              "tree_id": rollouts.groups is not None, "step": rollouts.steps is not None,
              "advantage": rollouts.advantages is not None, "reward": rollouts.rewards is not None}
    packed = np.concatenate(packing.packs) if packing.packs else np.zeros(0, np.int64)
    enc = {"seq_ids": key_encoding([rollouts.ids[i] for i in packed.tolist()])}
    if fields["tree_id"]:
        enc["tree_ids"] = key_encoding(rollouts.group_names)
    bal: Balance | None = None
    if balance is not None:
        costs = pack_costs(packing.pack_tokens, packing.pack_attention_pairs, balance_cost, model)
        bal = balance_packs(costs, packing.pack_steps, balance, cost=balance_cost, model=model)
    scope, _ = scope_codes(rollouts, group_by)
    extras = rollouts.extras
    writer = _ShardWriter(out, _schema(fields, enc, bal is not None, extras), limit)
    padding = 0
    for p, index in enumerate(packing.packs):
        pack = build_pack(rollouts, index, scope=scope, pad_to=pad_to)
        if pack.n_real != int(packing.pack_tokens[p]):  # another group_by than the packing's, or other rollouts
            raise TreepackError(f"pack {p}: its layout has {pack.n_real:,} tokens where the packing counted "
                                f"{int(packing.pack_tokens[p]):,}: write_shards needs the rollouts and the group_by "
                                "the packing was made from")
        padding += pack.n_tokens - pack.n_real
        step = None if packing.pack_steps is None else int(packing.pack_steps[p])
        rank = None if bal is None else int(bal.ranks[p])
        row = _row(pack, p, step, rank, enc, fields)
        if extras is not None:
            row.update(_extra_columns(extras, pack.seq_index))
        writer.add(row, p)
        if progress is not None:
            progress(1)
    writer.flush()

    if stats is None:  # the manifest holds the input's stats (docs/design.md §6) whoever calls
        from treepack.stats import compute_stats
        from treepack.tree import PrefixTree

        stats = compute_stats(PrefixTree.build(rollouts, group_by=group_by), rollouts=rollouts, model=model)
    st = stats.to_dict()
    st.update({"capacity": packing.capacity, "strategy": packing.strategy, "n_packs": packing.n_packs,
               "n_pack_tokens": packing.n_pack_tokens, "err": packing.err,
               "err_speedup": 1.0 / (1.0 - packing.err) if packing.err < 1 else math.inf,
               "packed_flat_tokens": packing.n_flat_tokens, "packed_tree_tokens": packing.n_tree_tokens,
               "packed_por": packing.por, "padding_tokens": padding,
               "fill": packing.n_pack_tokens / (packing.n_packs * packing.capacity) if packing.n_packs else 0.0,
               "packing_seconds": packing.seconds})
    manifest = {
        "format": FORMAT,
        "schema_version": SCHEMA_VERSION,
        "created_by": f"treepack {__version__}",
        "command": command,
        "rendering": rendering,  # chat input: the tokenizer (path, sha256) and rendering options, else None
        "capacity": packing.capacity,
        "strategy": packing.strategy,
        "pad_to": pad_to,
        "group_by": group_by or "none",
        "sources": [{"path": s.path, "sha256": s.sha256, "format": s.format, "n_records": s.n_records,
                     "n_skipped": s.n_skipped} for s in rollouts.sources],
        "skipped_files": [{"path": f, "reason": why} for f, why in rollouts.skipped_files],
        "counts": {"records": len(rollouts), "packed_sequences": len(packed), "packs": packing.n_packs,
                   "skipped": rollouts.n_skipped, "skipped_reasons": dict(rollouts.skipped),
                   "oversize_skipped": packing.n_oversize_skipped, "shards": len(writer.files)},
        "oversize_skipped": [{"record": int(i), "id": rollouts.ids[int(i)], "tokens": int(rollouts.lengths[int(i)])}
                             for i in packing.oversize_skipped[:MAX_LISTED_SKIPPED].tolist()],
        "fields": fields,
        "id_encoding": enc,
        "records": None if extras is None else _records_entry(extras),
        "stats": st,
        "balance": None if bal is None else bal.to_dict(),
        "shards": writer.files,
    }
    manifest = json.loads(json.dumps(manifest, allow_nan=True))  # as readers will see it (keys as strings)
    manifest[DIGEST_KEY] = content_digest(manifest)  # any later edit of a field is refused by the readers
    with open(out / MANIFEST, "w") as fh:
        json.dump(manifest, fh, indent=1, allow_nan=True)
        fh.write("\n")
    return manifest
