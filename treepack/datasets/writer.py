"""Streaming writer of rollout record batches: JSONL, gzip JSONL or Parquet, chosen by the extension.

Design and trade-offs:
- **Streaming, one batch at a time**: memory is one batch whatever the file size; Parquet gets one
  row group per batch, JSONL one line per record.
- **Parquet without dictionaries** (zstd, statistics on scalar columns only): token ids are nearly
  unique per column chunk, so dictionary encoding only costs; without it zstd sees the raw repeated
  prefixes and a 20M-token tau2 file shrinks from 15.9 MB to 4.5 MB (0.23 bytes/token) and writes
  2.4x faster. Parquet is the format for big outputs: on tau2 5x smaller than gzip JSONL and 5x
  faster to write; on low-overlap data (grpo-math) as small, still 4x faster.
- **JSON through polars' Rust encoder** (compact separators, shortest round-trip floats): ~3x the ids/s
  of ``json.dumps`` on Python lists; a token costs ~6 bytes of JSON (id and mask). gzip (level 6,
  ~5.4x smaller on tau2) is then what takes the time: ~1M tokens/s.
- **Byte-reproducible**: gzip headers carry no name and mtime 0, so the same records give the same
  bytes on every run and machine (bundled samples are checked in and must regenerate identically).
- **Atomic** (`treepack.io.atomic`): a file is written under a hidden temporary name and renamed on success,
  so an interrupted run never leaves a truncated file that looks complete. ``-`` streams JSONL to stdout.
"""

from __future__ import annotations

import gzip
import io
import sys
from pathlib import Path
from typing import BinaryIO

import pyarrow as pa
import pyarrow.parquet as pq
from typing_extensions import Self

from treepack.errors import TreepackError
from treepack.io.atomic import AtomicFile

GZIP_LEVEL = 6  # gzip's own default: 1.4x faster than Python's 9 for 0.2% more bytes on token JSON
FORMATS = {".jsonl": "jsonl", ".jsonl.gz": "jsonl.gz", ".parquet": "parquet"}


def output_format(path: str | Path) -> str:
    """``jsonl``, ``jsonl.gz`` or ``parquet`` from the file name; ``-`` (stdout) is ``jsonl``."""
    name = str(path)
    if name == "-":
        return "jsonl"
    for suffix, fmt in sorted(FORMATS.items(), key=lambda kv: -len(kv[0])):
        if name.endswith(suffix):
            return fmt
    raise TreepackError(
        f"cannot tell the output format of {name!r}: use .jsonl, .jsonl.gz or .parquet (or - for stdout)"
    )


class RolloutWriter:
    """Write record batches of one schema to ``path``; counts records and tokens (``input_ids``).

    Use as a context manager: the file appears under its name only when the block succeeds.
    """

    def __init__(self, path: str | Path, schema: pa.Schema, *, stdout: BinaryIO | None = None) -> None:
        self.path, self.schema = str(path), schema
        self.format = output_format(path)
        self.records = self.tokens = 0
        self._out: AtomicFile | None = None
        self._parquet: pq.ParquetWriter | None = None
        self._raw: BinaryIO | None = None
        self._stream: BinaryIO
        if self.path == "-":
            self._stream = stdout if stdout is not None else sys.stdout.buffer
            return
        parent = Path(self.path).parent
        if not parent.is_dir():
            raise TreepackError(f"cannot write {self.path}: directory {str(parent)!r} does not exist")
        if Path(self.path).is_dir():  # found before the work, not at the rename after it
            raise TreepackError(f"cannot write {self.path}: it is a directory")
        self._out = AtomicFile(self.path)
        tmp = str(self._out.tmp)
        if self.format == "parquet":
            scalars = [f.name for f in schema if not pa.types.is_list(f.type)]
            self._parquet = pq.ParquetWriter(
                tmp, schema, compression="zstd", use_dictionary=False, write_statistics=scalars
            )
        else:
            self._raw = open(tmp, "wb")  # noqa: SIM115 - closed by close(), the writer is a context manager
            self._stream = self._raw
            if self.format == "jsonl.gz":
                self._stream = gzip.GzipFile(  # type: ignore[assignment]
                    filename="", mode="wb", fileobj=self._raw, mtime=0, compresslevel=GZIP_LEVEL
                )

    def write(self, batch: pa.RecordBatch) -> None:
        if batch.schema != self.schema:
            raise TreepackError(f"record batch schema {batch.schema} differs from the file's {self.schema}")
        self.records += batch.num_rows
        if batch.num_rows:
            offsets = batch.column("input_ids").offsets
            self.tokens += offsets[-1].as_py() - offsets[0].as_py()
        if self._parquet is not None:
            self._parquet.write_batch(batch)
        elif batch.num_rows:
            import polars as pl  # here, not at the top: the CLI's start-up stays free of heavy imports

            buf = io.BytesIO()
            pl.from_arrow(pa.Table.from_batches([batch])).write_ndjson(buf)
            self._stream.write(buf.getbuffer())

    def close(self, *, ok: bool = True) -> None:
        """Finish the file: rename it into place when ``ok``, else delete it (also when finishing it fails)."""
        out, self._out = self._out, None
        try:
            if self._parquet is not None:
                self._parquet.close()
            elif self._raw is not None:
                if self._stream is not self._raw:
                    self._stream.close()
                self._raw.close()
            else:
                self._stream.flush()
        except BaseException:
            if out is not None:
                out.discard()
            raise
        if out is None:
            return
        if ok:
            out.commit()
        else:
            out.discard()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(ok=exc_type is None)
