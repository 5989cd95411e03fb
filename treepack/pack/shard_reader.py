"""Reading packed shards: the trainer's reader (``read_packs`` -> ``Pack``) and the exact inverse of packing
(``unpack`` -> the input ``Rollouts``, in input order).

``read_packs`` rebuilds each sequence's path in O(its length) from the DFS layout (its new tokens are the
run after the previous leaf, hanging off the previous path) and falls back to walking ``parent`` when a
layout does not follow that order. The schema is described in `treepack.pack.shards`.

Every read is verified (`treepack.pack.integrity`): the manifest once, then each shard, in the manifest's
order, before its packs are used; ``check_packs`` (``treepack check``) verifies without reading the packs.
``unpack`` reads each shard once (the trainer's columns and the kept records together).
"""

from __future__ import annotations

import base64
import json
import os
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa

from treepack.errors import InputError
from treepack.io.extras import Extras
from treepack.io.ingest import is_pack_dir, read_rollouts
from treepack.io.rollouts import Progress, Rollouts, Source, ranges
from treepack.pack.integrity import (
    ShardCheck,
    ShardEntry,
    check_manifest,
    open_shard,
    shard_counts,
    unlisted_shards,
)
from treepack.pack.layout import Pack
from treepack.pack.shards import (
    EXTRA_PREFIX,
    FORMAT,
    MANIFEST,
    READABLE_VERSIONS,
    decode_keys,
)


def read_manifest(path: str | Path) -> dict:
    """The manifest of a packed directory, checked (`treepack.pack.integrity.check_manifest`): its format and
    schema version, every field the readers use, how its counts add up, no shard file left unlisted."""
    return _load(path)[1]


def _load(path: str | Path) -> tuple[Path, dict, list[ShardEntry]]:
    """(the directory, its manifest, its shards in the manifest's order), all checked but the shard files."""
    p = Path(path)
    if not p.exists():
        raise InputError(f"{p}: no such file or directory")
    f = p / MANIFEST if p.is_dir() else p
    if not f.exists() or f.name != MANIFEST:
        raise InputError(f"{p}: no {MANIFEST} (not a directory written by `treepack pack`)")
    try:
        m = json.loads(f.read_bytes())
    except json.JSONDecodeError as exc:
        raise InputError(f"{f}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    except UnicodeDecodeError:
        raise InputError(f"{f}: not valid JSON (not UTF-8)") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise InputError(f"{f}: not a treepack pack manifest")
    version = m.get("schema_version")
    if version not in READABLE_VERSIONS or isinstance(version, bool):
        raise InputError(f"{f}: schema version {json.dumps(version)} is not supported (this treepack reads "
                         f"{', '.join(map(str, READABLE_VERSIONS))})")
    entries = check_manifest(m, f)
    unlisted_shards(f.parent, entries)
    return f.parent, m, entries


def _paths(parent: np.ndarray, position: np.ndarray, leaf: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(seq_offsets [S+1], token_index [F]): each sequence's path, root to leaf.

    In DFS preorder, with sequences taken by leaf, a sequence's tokens after the previous leaf are a run
    ``(prev_leaf, leaf]`` hanging off the previous path at depth ``position[prev_leaf + 1]``; a layout that
    breaks this (checked) falls back to walking ``parent``.
    """
    S = len(leaf)
    lengths = position[leaf].astype(np.int64) + 1
    offsets = np.zeros(S + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    out = np.empty(int(offsets[-1]), dtype=np.int64)
    by_leaf = np.argsort(leaf, kind="stable").tolist()
    leaf_l = leaf.tolist()
    prev_leaf, prev = -1, np.zeros(0, dtype=np.int64)
    for s in by_leaf:
        q = leaf_l[s]
        a, e = int(offsets[s]), int(offsets[s + 1])
        if q == prev_leaf:
            path = prev
        else:
            start = prev_leaf + 1
            d = int(position[start]) if start <= q else -1
            run = np.arange(start, q + 1, dtype=np.int64)
            ok = (0 <= d <= len(prev) and d + len(run) == e - a
                  and (d == 0 and parent[start] == -1 or d > 0 and parent[start] == prev[d - 1])
                  and bool(np.all(parent[start + 1 : q + 1] == run[:-1])))
            path = np.concatenate([prev[:d], run]) if ok else _walk(parent, q, e - a)
        out[a:e] = path
        prev_leaf, prev = q, path
    return offsets, out


def _walk(parent: np.ndarray, q: int, length: int) -> np.ndarray:
    path = np.empty(length, dtype=np.int64)
    for j in range(length - 1, -1, -1):
        if q < 0:
            raise InputError("corrupt pack: a sequence's parent chain is shorter than its length")
        path[j] = q
        q = int(parent[q])
    if q != -1:
        raise InputError("corrupt pack: a sequence's parent chain is longer than its length")
    return path


def _list_column(table: pa.Table, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(values, int64 offsets) of a list column of a table."""
    arr = table.column(name).combine_chunks()
    offsets = np.asarray(arr.offsets, dtype=np.int64)
    values = arr.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
    vals = values.to_numpy(zero_copy_only=False) if not pa.types.is_string(values.type) else values.to_pylist()
    return (vals if isinstance(vals, list) else np.asarray(vals)), offsets - offsets[0]


# columns every pack shard has (docs/design.md §6): a Parquet file without them is not one
SHARD_COLUMNS = ("input_ids", "position_ids", "parent", "subtree_end", "scale", "loss_weight", "seq_leaf",
                 "seq_ids", "seq_index", "pack_index", "n_real")
_COUNTED = ("pack_index", "n_real", "seq_leaf")  # what the integrity checks read of each shard


def _shard_tables(path: Path, entries: list[ShardEntry], keep: Callable[[str], bool],
                  need: tuple[str, ...] = SHARD_COLUMNS) -> Iterator[tuple[Path, pa.Table]]:
    """Each shard in the manifest's order, verified (`treepack.pack.integrity`), as its columns ``keep`` names."""
    check = ShardCheck(path)
    for e in entries:
        shard = open_shard(path, e)
        missing = [n for n in need if n not in shard.names]
        if missing:
            shard.confirm()
            raise InputError(f"{shard.f}: not a treepack pack shard (no column {missing[0]!r})")
        table = shard.read([n for n in shard.names if keep(n) or n in _COUNTED])
        check.rows(e, *shard_counts(table))
        yield shard.f, table


def read_packs(path: str | Path) -> Iterator[Pack]:
    """Yield every pack of a packed directory as a ``Pack`` of numpy arrays, in the manifest's order; each shard
    is verified before its packs come (`treepack.pack.integrity`): a corrupt or incomplete directory raises
    ``InputError`` naming the shard and what differs."""
    path, manifest, entries = _load(path)
    for _, table in _shard_tables(path, entries, lambda n: not _is_record_column(n)):
        yield from _table_packs(table, manifest["id_encoding"])


def _table_packs(table: pa.Table, enc: dict) -> Iterator[Pack]:
    cols = {name: _list_column(table, name) for name in table.column_names
            if pa.types.is_list(table.schema.field(name).type) and not _is_record_column(name)}
    scalars = {name: table.column(name).to_pylist() for name in table.column_names
               if name not in cols and not _is_record_column(name)}
    for r in range(table.num_rows):
        yield _pack_from_row(_row_getter(cols, r), {k: v[r] for k, v in scalars.items()}, set(cols), enc)


def check_packs(path: str | Path) -> dict:
    """Verify a packed directory as every reader does, without reading its packs (``treepack check``): the
    manifest, then each shard's size, sha256 and rows, and the three small columns its counts and pack order
    come from (a directory written before sha256s: every column, so that every page is decoded). Returns a
    summary: ``path``, ``schema_version``, ``shards``, ``packs``, ``records``, ``tokens``, ``bytes``, ``sha256``
    (whether the shards had checksums to verify); raises ``InputError`` naming the shard and what differs."""
    path, manifest, entries = _load(path)
    hashed = all(e.sha256 is not None for e in entries)
    records = tokens = 0
    for _, table in _shard_tables(path, entries, lambda n: not hashed):
        _, n_real, n_seqs = shard_counts(table)
        records += n_seqs
        tokens += int(n_real.sum())
    return {"path": str(path), "schema_version": manifest["schema_version"], "shards": len(entries),
            "packs": manifest["counts"]["packs"], "records": records, "tokens": tokens,
            "bytes": sum(e.bytes for e in entries), "sha256": hashed}


def _is_record_column(name: str) -> bool:
    """Columns that keep every record for ``unpack`` (the trainer never reads them)."""
    return name in ("seq_carry", "seq_record") or name.startswith(EXTRA_PREFIX)


def _record_part(f: Path, table: pa.Table) -> tuple[np.ndarray, pa.Table]:
    """A shard's kept records (``seq_carry`` and the record columns), one entry per sequence in pack order."""
    if "seq_carry" not in table.column_names:
        raise InputError(f"{f}: not a treepack pack shard (no column 'seq_carry')")
    carry = np.asarray(table.column("seq_carry").combine_chunks().flatten(), dtype=np.uint8)
    names = [n for n in table.column_names if _is_record_column(n) and n != "seq_carry"]
    return carry, pa.table({n: table.column(n).combine_chunks().flatten() for n in names})


def _read_extras(rec: dict, parts: list[tuple[np.ndarray, pa.Table]], order: np.ndarray) -> Extras:
    """The kept records of a schema-2 directory, in input order (``order`` sorts the packed sequences)."""
    carry_all = np.concatenate([c for c, _ in parts])[order]
    table = pa.concat_tables([t for _, t in parts]).take(pa.array(order))
    if rec["kind"] == "json":
        return Extras(tokens_field=rec["tokens_field"], carry=carry_all,
                      templates=table.column("seq_record").to_pylist())
    schema = pa.ipc.read_schema(pa.py_buffer(base64.b64decode(rec["schema"])))
    table = table.rename_columns([n[len(EXTRA_PREFIX):] for n in table.column_names])
    return Extras(tokens_field=rec["tokens_field"], carry=carry_all, table=table, schema=schema)


def _row_getter(cols: dict, r: int) -> Callable:
    """``get(name)``: row r's slice of a list column."""

    def get(name: str) -> np.ndarray:
        v, o = cols[name]
        return v[o[r] : o[r + 1]]

    return get


def _pack_from_row(get: Callable, scalars: dict, names: set, enc: dict) -> Pack:
    parent = get("parent")
    position = get("position_ids")
    leaf = get("seq_leaf")
    seq_offsets, token_index = _paths(parent, position, leaf)
    mask = get("loss_mask")[token_index].astype(np.int16)
    mixed = mask < 0
    mask[mixed] = get("seq_loss_mask")
    logprobs = None
    if "logprobs" in names:
        logprobs = get("logprobs")[token_index].astype(np.float64)
        lp_mixed = get("logprobs_mixed")[token_index]
        logprobs[lp_mixed] = get("seq_logprobs")
    meta = {"pack_index": scalars["pack_index"]}
    for k in ("step", "rank"):
        if k in scalars:
            meta[k] = scalars[k]
    S = len(leaf)
    return Pack(
        input_ids=get("input_ids"),
        position_ids=position,
        parent=parent,
        subtree_end=get("subtree_end"),
        scale=get("scale"),
        loss_weight=get("loss_weight"),
        n_real=int(scalars["n_real"]),
        seq_ids=decode_keys(get("seq_ids"), enc["seq_ids"]),
        seq_index=get("seq_index"),
        seq_leaf=leaf,
        seq_offsets=seq_offsets,
        seq_token_index=token_index.astype(np.int32),
        seq_loss_mask=mask.astype(np.uint8),
        seq_logprobs=logprobs,
        advantages=get("advantages") if "advantages" in names else None,
        rewards=get("rewards") if "rewards" in names else None,
        seq_groups=decode_keys(get("tree_ids"), enc["tree_ids"]) if "tree_ids" in names else None,
        seq_steps=np.full(S, scalars["step"], dtype=np.int64) if "step" in scalars else None,
        meta=meta,
    )


def unpack(path: str | Path, *, records: bool = True) -> Rollouts:
    """Every packed record, rebuilt from the shards alone, in input order (the exact inverse of ``pack``).

    ``records``: also the fields kept for an exact round trip (``Rollouts.extras``; directories written by
    treepack 0.1 with schema version 1 have none: unknown fields were not kept). ``stats`` needs none."""
    path, manifest, entries = _load(path)
    fields = manifest["fields"]
    rec = manifest.get("records") if records else None
    parts: list[tuple[np.ndarray, pa.Table]] = []
    index, tokens, lengths, masks, lps, ids, groups, steps, advs, rews = ([] for _ in range(10))
    for pack in _unpack_packs(path, manifest, entries, rec, parts):
        index.append(pack.seq_index)
        tokens.append(pack.input_ids[pack.seq_token_index])
        lengths.append(pack.seq_lengths)
        masks.append(pack.seq_loss_mask)
        if pack.seq_logprobs is not None:
            lps.append(pack.seq_logprobs)
        ids.extend(pack.seq_ids)
        groups.extend(pack.seq_groups or [])
        for dst, src in ((steps, pack.seq_steps), (advs, pack.advantages), (rews, pack.rewards)):
            if src is not None:
                dst.append(src)
    if not index:
        return Rollouts(tokens=np.zeros(0, np.int32), offsets=np.zeros(1, np.int64), ids=[],
                        sources=_sources(manifest))
    seq_index = np.concatenate(index)
    lens = np.concatenate(lengths)
    flat_tok = np.concatenate(tokens)
    order = np.argsort(seq_index, kind="stable")
    if np.any(seq_index[order][1:] == seq_index[order][:-1]):
        raise InputError(f"{path}: a record appears in two packs")
    starts = np.cumsum(lens) - lens
    gather = ranges(starts[order], lens[order])
    offsets = np.zeros(len(order) + 1, dtype=np.int64)
    np.cumsum(lens[order], out=offsets[1:])

    group_codes = group_names = None
    if fields["tree_id"]:
        seen: dict = {}
        group_names = []
        group_codes = np.empty(len(order), dtype=np.int64)
        for k, g in enumerate(groups[i] for i in order.tolist()):
            key = (type(g).__name__, g)
            if key not in seen:
                seen[key] = len(group_names)
                group_names.append(g)
            group_codes[k] = seen[key]

    def cat(parts):
        return np.concatenate(parts)[order] if parts else None

    return Rollouts(
        tokens=flat_tok[gather].astype(np.int32),
        offsets=offsets,
        ids=[ids[i] for i in order.tolist()],
        loss_mask=np.concatenate(masks)[gather].astype(np.uint8) if fields["loss_mask"] else None,
        logprobs=np.concatenate(lps)[gather] if fields["logprobs"] else None,
        groups=group_codes,
        group_names=group_names,
        steps=cat(steps) if fields["step"] else None,
        advantages=cat(advs) if fields["advantage"] else None,
        rewards=cat(rews) if fields["reward"] else None,
        sources=_sources(manifest),
        skipped=Counter(manifest["counts"].get("skipped_reasons", {})),
        extras=_read_extras(rec, parts, order) if rec else None,
    )


def _unpack_packs(path: Path, manifest: dict, entries: list[ShardEntry], rec: dict | None,
                  parts: list) -> Iterator[Pack]:
    """Every pack, each shard read once: its kept records (when ``rec``) go to ``parts``."""
    for f, table in _shard_tables(path, entries, lambda n: rec is not None or not _is_record_column(n)):
        if rec is not None:
            parts.append(_record_part(f, table))
        yield from _table_packs(table, manifest["id_encoding"])


def _sources(manifest: dict) -> list[Source]:
    return [Source(path=s["path"], sha256=s["sha256"], n_records=s["n_records"], n_skipped=s["n_skipped"],
                   format=s["format"]) for s in manifest["sources"]]


def read_inputs(
    paths: str | os.PathLike | list[str | os.PathLike],
    *,
    tokens_field: str | None = None,
    on_error: str = "raise",
    progress: Progress | None = None,
    keep_token_fields: bool = True,
    keep_records: bool = False,
    skipped_files: list | None = None,
) -> Rollouts:
    """What every command reads: rollout files and directories (`treepack.io.ingest.read_rollouts`), or one
    directory written by ``treepack pack``, unpacked to the records it was packed from (so ``stats``,
    ``plot`` and ``report`` of a pack directory describe the original rollouts, not its packs).

    Records that are not in the packs are counted in ``Rollouts.skipped``: bad records skipped at packing
    time, and sequences over the capacity left out by ``--oversize skip``.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    paths = [str(p) for p in paths]
    dirs = [p for p in paths if pack_dir_of(p) is not None]
    if not dirs:
        return read_rollouts(paths, tokens_field=tokens_field, on_error=on_error, progress=progress,
                             keep_token_fields=keep_token_fields, keep_records=keep_records)
    if len(paths) > 1:
        raise InputError(f"{dirs[0]}: a directory written by `treepack pack` is read on its own, not together "
                         "with other inputs")
    where = pack_dir_of(dirs[0])
    manifest = read_manifest(where)
    r = unpack(where, records=keep_records)
    oversize = int(manifest["counts"].get("oversize_skipped", 0))
    if oversize:
        r.skipped[OVERSIZE_REASON] += oversize
    if not keep_token_fields:  # as read_rollouts: logprobs go, loss masks stay (the FLOP model counts targets)
        r.logprobs = None
    if progress is not None:
        progress(pack_dir_bytes(where))
    return r


OVERSIZE_REASON = "over the pack capacity (not in the packs)"


def pack_dir_of(path: str) -> Path | None:
    """The pack directory a path names (the directory itself or its manifest.json), else None."""
    if path == "-":
        return None
    p = Path(path)
    if is_pack_dir(p):
        return p
    if p.name == MANIFEST and is_pack_dir(p.parent):
        return p.parent
    return None


def pack_dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).glob("shard-*.parquet"))
