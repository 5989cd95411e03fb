"""The bytes of an input file, in bounded blocks: plain files, gzip, bzip2, xz and zstd (each by its magic
bytes, whatever the name), stdin; every way a compressed file can be broken becomes one ``InputError`` line
naming the file.

Design and trade-offs:
- Blocks, never the whole file: a reader holds one block of whole lines (``BLOCK_BYTES``, 8 MiB) at a
  time, so 100M tokens of JSONL (~600 MB of text) stream through ~30 MB of buffers instead of being
  decompressed into one ``bytes`` object (the old reader: 16x the int32 token bytes at its peak).
- gzip is inflated by ``zlib`` on a second thread (``zlib`` releases the GIL): on the 2-core benchmark
  machine it inflates ~550 MB/s, so the parser on the main thread never waits for it.
- Damage is named, not crashed on: a file whose name ends in ``.gz`` but is not gzip, a damaged deflate
  stream (``zlib.error``) and a stream that ends early (truncated download, ``head -c``) each raise
  ``StreamError`` with the decompressed line where reading stopped, an error even under ``--on-error skip``
  (what came after the break is unknown). Concatenated gzip members (``cat a.gz b.gz``) read as one stream.
- bzip2 and xz inflate with the standard library (``bz2``, ``lzma``), zstd with the libzstd that pyarrow
  already ships (``pyarrow.CompressedInputStream``: no extra dependency), on the main thread, read as gzip
  is, damage and early ends named the same way. Text out per CPU second, 4.8 MB of tau2 JSONL on the 2-core
  machine: bzip2 23 MB/s, xz 125 MB/s, gzip 437 MB/s, zstd 1.66 GB/s (plain 890 MB/s: zstd's bigger blocks).
- Progress counts the bytes read from disk (compressed bytes for gzip), so a bar whose total is the file
  size ends at 100%.
"""

from __future__ import annotations

import bz2
import io
import lzma
import queue
import sys
import threading
import zlib
from collections.abc import Callable, Iterator

import pyarrow as pa

BLOCK_BYTES = 8 << 20  # whole lines handed to the parser at a time
READ_BYTES = 4 << 20  # bytes read from disk at a time
GZIP_MAGIC = b"\x1f\x8b"
# the other compressed formats: (magic bytes, name in messages, the file name suffixes that promise it)
OTHER_FORMATS = ((b"BZh", "bzip2", (".bz2",)), (b"\xfd7zXZ\x00", "xz", (".xz",)),
                 (b"\x28\xb5\x2f\xfd", "zstd", (".zst", ".zstd")))
COMPRESSED_SUFFIXES = (".gz",) + tuple(x for _, _, sfx in OTHER_FORMATS for x in sfx)


def strip_compression(name: str) -> str:
    """The name without its compression suffix: ``a.json.zst`` -> ``a.json``."""
    for sfx in COMPRESSED_SUFFIXES:
        if name.endswith(sfx):
            return name[: -len(sfx)]
    return name


class StreamError(Exception):
    """A compressed stream that can not be read to its end: ``message`` says why, ``fatal`` when nothing of
    the file could be read (not gzip at all), else the lines before it were delivered."""

    def __init__(self, reason: str, message: str, *, fatal: bool = False):
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.fatal = fatal
        self.partial = 0  # bytes of an incomplete last line dropped at the break


def _raw(path: str):
    return sys.stdin.buffer if path == "-" else open(path, "rb")


def _inflate(fh, first: bytes, out: queue.Queue, consumed: list[int], hasher, stop: threading.Event) -> None:
    """Inflate every gzip member of ``fh`` (``first`` = bytes already read) into ``out``; ends with None or a
    StreamError. Runs on its own thread, until the end or until ``stop`` is set."""
    try:
        d = zlib.decompressobj(16 + zlib.MAX_WBITS)
        pending = first
        while not stop.is_set():
            raw = pending or fh.read(READ_BYTES)
            if raw and not pending and hasher is not None:
                hasher.update(raw)
            pending = b""
            if not raw:
                break
            consumed[0] += len(raw)
            while raw:
                backup = d.copy()
                try:
                    data = d.decompress(raw)
                except zlib.error as exc:  # the magic bytes were right: the data after them is damaged
                    _salvage(backup, raw, out)
                    detail = str(exc).split(": ", 1)[-1]
                    out.put(StreamError("corrupt gzip data", f"corrupt gzip data ({detail})"))
                    return
                if data:
                    out.put(data)
                raw = b""
                if d.eof:  # a member ended: another may follow (concatenated .gz files)
                    rest = d.unused_data
                    if rest.strip(b"\0"):
                        d = zlib.decompressobj(16 + zlib.MAX_WBITS)
                        raw = rest
                    else:
                        d = None
                        break
            if d is None:
                break
        if d is not None and not d.eof:
            tail = d.flush()
            if tail:
                out.put(tail)
            out.put(StreamError("truncated file", "truncated gzip file (the compressed stream ends early)"))
            return
        out.put(None)
    except BaseException as exc:  # noqa: BLE001 (an OSError reading the file: the consumer raises it)
        out.put(exc)


def _salvage(d, raw: bytes, out: queue.Queue, piece: int = 1 << 12) -> None:
    """Re-inflate the read that failed in small pieces: what came before the damage still comes out (a failed
    ``decompress`` call returns nothing, so a bad checksum at the end would otherwise lose the whole read)."""
    for i in range(0, len(raw), piece):
        before = d.copy()
        try:
            data = d.decompress(raw[i : i + piece])
        except zlib.error:  # the damage is in this piece: byte by byte up to it
            for j in range(i, min(i + piece, len(raw))):
                try:
                    data = before.decompress(raw[j : j + 1])
                except zlib.error:
                    return
                if data:
                    out.put(data)
            return
        if data:
            out.put(data)


def iter_blocks(path: str, *, progress: Callable[[int], None] | None = None, hasher=None,
                block_bytes: int = BLOCK_BYTES) -> Iterator[bytes]:
    """Blocks of whole lines of a file (the last one may lack its newline), decompressed if gzip.

    Raises ``StreamError`` after the last good block when a compressed stream breaks off; ``progress`` gets
    the bytes read from disk since its last call; ``hasher`` (``hashlib``) is updated with those bytes.
    """
    fh = _raw(path)
    try:
        first = fh.read(READ_BYTES)
        if hasher is not None:
            hasher.update(first)
        if first[:2] == GZIP_MAGIC:
            yield from _gzip_blocks(fh, first, progress, block_bytes, hasher)
            return
        for magic, kind, _ in OTHER_FORMATS:
            if first.startswith(magic):
                yield from _lines(_other_stream(fh, first, kind, progress, hasher), block_bytes)
                return
        for sfx, kind in ((".gz", "gzip"), *((x, k) for _, k, names in OTHER_FORMATS for x in names)):
            if path.endswith(sfx) and first:  # an empty .gz file reads as empty, as gzip.open has it
                shown = first[:8].decode("utf-8", "replace")
                raise StreamError(f"not {kind}", f"not a {kind} file (the name ends in {sfx} but it starts with "
                                  f"{shown!r})", fatal=True)
        yield from _plain_blocks(fh, first, progress, block_bytes, hasher)
    finally:
        if fh is not sys.stdin.buffer:
            fh.close()


def _plain_blocks(fh, first: bytes, progress, block_bytes: int, hasher) -> Iterator[bytes]:
    buf = first
    if progress is not None and first:
        progress(len(first))
    while True:
        raw = fh.read(max(block_bytes, READ_BYTES))
        if progress is not None and raw:
            progress(len(raw))
        if hasher is not None and raw:
            hasher.update(raw)
        if not raw:
            break
        buf += raw
        if len(buf) >= block_bytes:
            cut = buf.rfind(b"\n") + 1
            if cut:
                yield buf[:cut]
                buf = buf[cut:]
    if buf:
        yield buf


def _gzip_blocks(fh, first: bytes, progress, block_bytes: int, hasher) -> Iterator[bytes]:
    out: queue.Queue = queue.Queue(maxsize=4)  # bounded: the inflater runs at most 4 reads ahead
    consumed = [0]
    stop = threading.Event()  # set when the reader stops early (an error on line 3 of a 10 GB file)
    worker = threading.Thread(target=_inflate, args=(fh, first, out, consumed, hasher, stop), daemon=True)
    worker.start()
    try:
        yield from _lines(_queued(out, consumed, progress), block_bytes, tail_before_error=True)
    finally:
        stop.set()
        while worker.is_alive():  # unblock and join the inflater if the consumer stopped early
            try:
                out.get_nowait()
            except queue.Empty:
                worker.join(0.01)


def _queued(out: queue.Queue, consumed: list[int], progress) -> Iterator[bytes]:
    """The inflater's chunks as they come (its error raised where it stopped), reporting the compressed bytes
    it has read."""
    reported = 0
    while True:
        item = out.get()
        if progress is not None and consumed[0] > reported:
            progress(consumed[0] - reported)
            reported = consumed[0]
        if item is None:
            return
        if isinstance(item, BaseException):
            raise item
        yield item


def _lines(chunks: Iterator[bytes], block_bytes: int, *, tail_before_error: bool = False) -> Iterator[bytes]:
    """Blocks of whole lines from decompressed chunks; a ``StreamError`` from the chunks comes after the whole
    lines before it, with ``partial`` = the bytes of the line it cut. ``tail_before_error``: any other error of
    the chunks comes after everything read before it, the last partial line included."""
    parts: list[bytes] = []
    size = 0
    try:
        for data in chunks:
            parts.append(data)
            size += len(data)
            if size >= block_bytes:
                buf = b"".join(parts)
                cut = buf.rfind(b"\n") + 1
                if cut:
                    yield buf[:cut]
                    parts, size = [buf[cut:]], len(buf) - cut
                else:
                    parts = [buf]
    except StreamError as err:
        buf = b"".join(parts)
        cut = buf.rfind(b"\n") + 1
        if cut:
            yield buf[:cut]
        err.partial = len(buf) - cut
        raise
    except GeneratorExit:  # the consumer stopped early: nothing more to give
        raise
    except BaseException:
        buf = b"".join(parts)
        if tail_before_error and buf:
            yield buf
        raise
    buf = b"".join(parts)
    if buf:
        yield buf


class _Counted(io.RawIOBase):
    """The raw file as pyarrow reads it: ``first`` (already read) then the rest; progress and hash as it goes."""

    def __init__(self, fh, first: bytes, progress, hasher):
        super().__init__()
        self.fh, self.pending, self.progress, self.hasher = fh, first, progress, hasher
        if progress is not None and first:
            progress(len(first))

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        if self.pending:
            data, self.pending = self.pending[: len(buf)], self.pending[len(buf):]
        else:
            data = self.fh.read(len(buf))
            if data and self.progress is not None:
                self.progress(len(data))
            if data and self.hasher is not None:
                self.hasher.update(data)
        buf[: len(data)] = data
        return len(data)


def _other_stream(fh, first: bytes, kind: str, progress, hasher) -> Iterator[bytes]:
    """Decompressed chunks of a bzip2, xz or zstd file (concatenated streams as one), or a ``StreamError``."""
    if kind == "zstd":
        stream = pa.CompressedInputStream(pa.PythonFile(_Counted(fh, first, progress, hasher), mode="r"), "zstd")
        while True:
            try:
                data = stream.read(READ_BYTES)
            except (OSError, pa.ArrowException) as exc:
                detail = str(exc).splitlines()[0]
                if "runcated" in detail:
                    raise StreamError("truncated file", "truncated zstd file (the compressed stream ends early)"
                                      ) from None
                raise StreamError("corrupt zstd data", f"corrupt zstd data ({detail})") from None
            if not data:
                return
            yield data
    new = bz2.BZ2Decompressor if kind == "bzip2" else lambda: lzma.LZMADecompressor(lzma.FORMAT_XZ)
    d = None  # the stream being inflated; None between streams
    pending = first
    if progress is not None and first:
        progress(len(first))
    while True:
        raw, pending = pending or fh.read(READ_BYTES), b""
        if not raw:
            break
        if raw is not first:
            if progress is not None:
                progress(len(raw))
            if hasher is not None:
                hasher.update(raw)
        while raw:
            if d is None:
                if not raw.strip(b"\0"):  # padding after the last stream
                    break
                d = new()
            try:
                data = d.decompress(raw)
            except (OSError, EOFError, ValueError, lzma.LZMAError) as exc:
                raise StreamError(f"corrupt {kind} data", f"corrupt {kind} data ({exc})") from None
            if data:
                yield data
            raw = b""
            if d.eof:  # a stream ended: another may follow (concatenated files)
                raw, d = d.unused_data, None
    if d is not None:
        raise StreamError("truncated file", f"truncated {kind} file (the compressed stream ends early)")
