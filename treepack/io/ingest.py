"""Reading rollouts: JSONL, JSONL.gz, JSON arrays, stdin, Parquet files or directories into one validated
`Rollouts` batch.

- JSON records (`treepack.io.jsonl`) stream in bounded blocks (simdjson per line, ``json`` for the lines it
  does not take); Parquet (`treepack.io.arrow`) row group by row group with whole-column checks. Every error
  names file, line (or row, or record of a JSON array) and field exactly:
  ``bad.jsonl: line 3: field 'input_ids'[2] is negative (-5)``.
- A directory is read recursively, in sorted order: every file whose name ends in one of ``SUPPORTED``.
  Every other entry is named with the reason it was skipped (``Rollouts.skipped_files``; the commands print
  them and ``--json`` lists them): other suffixes, hidden files, and directories written by
  ``treepack pack`` (``manifest.json``), whose records are read only when the directory is named itself
  (`treepack.pack.inputs`: reading them here would count every record twice next to its source files).
Nothing is dropped silently: skipped records are counted per reason in ``Rollouts.skipped``.

Fields (design §3): ``input_ids`` (aliases ``tokens``, ``token_ids``, or ``--tokens-field``), ``loss_mask``,
``tree_id`` (alias ``group_id``), ``id``, ``advantage``, ``reward``, ``logprobs``, ``step``; every other
field is kept for an exact unpack when ``keep_records`` is on (`treepack.io.extras`).
"""


from __future__ import annotations

import errno
import hashlib
import os
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from treepack.errors import InputError
from treepack.io.arrow import read_parquet
from treepack.io.builder import Builder
from treepack.io.jsonl import read_json_file
from treepack.io.rollouts import Progress, Rollouts, Source
from treepack.io.streams import COMPRESSED_SUFFIXES, strip_compression

JSON_SUFFIXES = tuple(base + z for base in (".jsonl", ".ndjson", ".json") for z in ("", *COMPRESSED_SUFFIXES))
PARQUET_SUFFIXES = (".parquet", ".pq")
SUPPORTED = JSON_SUFFIXES + PARQUET_SUFFIXES
SUPPORTED_TEXT = ".jsonl, .ndjson, .json (each also .gz, .bz2, .xz, .zst), .parquet, .pq"  # in messages
MANIFEST = "manifest.json"  # the file that marks a directory written by `treepack pack`


def is_pack_dir(path: str | os.PathLike) -> bool:
    """A directory written by ``treepack pack`` (it holds ``manifest.json``)."""
    p = Path(path)
    return p.is_dir() and (p / MANIFEST).is_file()


def _walk(root: Path, skipped: list[tuple[str, str]], seen: set | None = None) -> list[str]:
    out: list[str] = []
    seen = seen if seen is not None else {root.resolve()}
    for entry in sorted(root.iterdir(), key=lambda e: e.name):
        if entry.name.startswith("."):
            skipped.append((str(entry), "hidden"))
        elif entry.is_symlink() and not entry.exists():
            skipped.append((str(entry), _broken_link(entry)))
        elif entry.is_dir():
            if is_pack_dir(entry):
                skipped.append((str(entry), "a directory written by `treepack pack` (name it to read its records)"))
            elif entry.resolve() in seen:
                skipped.append((str(entry), "a link to a directory already read"))
            else:
                seen.add(entry.resolve())
                out.extend(_walk(entry, skipped, seen))
        elif entry.name.endswith(SUPPORTED):
            out.append(str(entry))
        elif entry.name == MANIFEST:
            continue  # pragma: no cover - a pack directory is never walked
        else:
            suffix = "".join(entry.suffixes[-2:]) or "no suffix"
            skipped.append((str(entry), f"not a rollout file ({suffix}; reading {SUPPORTED_TEXT})"))
    return out


def rollout_files(root: str | os.PathLike) -> list[str]:
    """The files a reader takes from a directory (recursively, as `expand_paths` expands it)."""
    return _walk(Path(root), [])


def expand_paths(paths: Iterable[str], skipped_files: list[tuple[str, str]] | None = None) -> list[str]:
    """Files to read: directories expand (recursively, sorted) to their files with a supported suffix.

    Every directory entry left out is appended to ``skipped_files`` as (path, reason). A file named on its
    own is read whatever its name (Parquet is recognised by its magic bytes).
    """
    out: list[str] = []
    skipped = skipped_files if skipped_files is not None else []
    for p in paths:
        p = str(p)
        if p == "-":
            out.append(p)
            continue
        path = Path(p)
        if is_pack_dir(path) or (path.name == MANIFEST and is_pack_dir(path.parent)):
            raise InputError(f"{p}: a directory written by `treepack pack`: read it with treepack.pack.read_inputs "
                             "(as the commands do) or treepack.pack.unpack")
        if path.is_dir():
            before = len(skipped)
            files = _walk(path, skipped)
            if not files:
                why = "; ".join(f"{Path(f).relative_to(path)}: {r}" for f, r in skipped[before:][:5])
                raise InputError(f"{p}: directory has no rollout files ({SUPPORTED_TEXT})"
                                 + (f"; skipped {why}" if why else ""))
            out.extend(files)
        elif not path.exists():
            raise InputError(f"{p}: {_broken_link(path)}" if path.is_symlink() else f"{p}: no such file")
        else:
            out.append(p)
    if not out:
        raise InputError("no input files given")
    return out


def _broken_link(path: Path) -> str:
    """Why a symbolic link can not be read: it loops (to itself, or through others), or names nothing."""
    try:
        os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return f"a symbolic link that loops ({exc.strerror})"
    return f"a symbolic link to {os.readlink(path)}, which does not exist"


# the columns that make a Parquet file a shard written by `treepack pack` (treepack.pack.shards), not rollouts
SHARD_MARKS = ("pack_index", "subtree_end", "seq_leaf", "position_ids")


def refuse_shard(path: str) -> None:
    """A pack shard named as rollouts would read as a few long sequences of pack tokens: refused by name."""
    import pyarrow.parquet as pq

    try:
        names = pq.read_schema(path).names
    except Exception:  # noqa: BLE001 (not readable Parquet: read_parquet says what is wrong)
        return
    if not all(n in names for n in SHARD_MARKS):
        return
    where = Path(path).parent
    if is_pack_dir(where):
        raise InputError(f"{path}: a shard of the pack directory {where}, not rollouts: name {where} to read the "
                         "records packed in it")
    raise InputError(f"{path}: a shard written by `treepack pack`, not rollouts, and {where} has no {MANIFEST} (an "
                     "incomplete pack directory: pack its rollouts again)")


def is_parquet(path: str) -> bool:
    if path == "-":
        return False
    if path.endswith(PARQUET_SUFFIXES):
        return True
    with open(path, "rb") as f:
        return f.read(4) == b"PAR1"


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def read_rollouts(
    paths: str | os.PathLike | Iterable[str | os.PathLike],
    *,
    tokens_field: str | None = None,
    on_error: str = "raise",
    progress: Progress | None = None,
    keep_token_fields: bool = True,
    keep_records: bool = False,
) -> Rollouts:
    """Read rollout files into one ``Rollouts`` batch.

    ``on_error``: ``"raise"`` (default) raises ``InputError`` naming file, line/row and field at the first bad
    record; ``"skip"`` drops bad records and counts them per reason in ``Rollouts.skipped``.
    ``progress`` is called with the bytes read from disk as reading advances (compressed bytes for gzip;
    Parquet: pro rata by rows). ``keep_token_fields=False`` still validates ``logprobs`` but drops them
    (``stats`` needs tokens and loss masks: this saves 8 bytes a token of peak memory).
    ``keep_records=True`` keeps every other field for an exact unpack (``Rollouts.extras``; ``pack``).
    """
    if on_error not in ("raise", "skip"):
        raise InputError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    skipped_files: list[tuple[str, str]] = []
    files = expand_paths((str(p) for p in paths), skipped_files)
    builder = Builder(keep_token_fields, keep_records)
    parquet = [is_parquet(f) for f in files]
    builder.record_kind = "arrow" if all(parquet) else "json"
    if builder.record_kind == "json":
        builder.tokens_field = tokens_field
    sources: list[Source] = []
    skipped: Counter = Counter()
    examples: list[str] = []
    for path, pq_file in zip(files, parquet):
        name = "<stdin>" if path == "-" else path
        kept_before, skipped_before = builder.n, sum(skipped.values())
        if pq_file:
            refuse_shard(path)
            src = Source(path=path, sha256=_sha256_file(path), format="parquet")
            read_parquet(path, tokens_field, on_error, builder, skipped, examples, progress)
        else:
            h = hashlib.sha256()  # of the bytes on disk, hashed as they stream (stdin can be read only once)
            read_json_file(path, name, tokens_field, on_error, builder, skipped, examples, progress, hasher=h)
            src = Source(path=path, sha256=h.hexdigest(), format="json" if strip_compression(path).endswith(".json")
                         else "jsonl")
        src.n_records = builder.n - kept_before
        src.n_skipped = sum(skipped.values()) - skipped_before
        sources.append(src)
    r = builder.build(sources, skipped, examples)
    r.skipped_files = skipped_files
    return r
