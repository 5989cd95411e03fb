"""Outputs that appear whole or not at all: a file (``atomic_file``) or a directory of files (``atomic_dir``) is
written under a hidden temporary name beside its final one and renamed into place only when the writing
succeeded. On any failure or interruption (an exception, Ctrl-C, the ``SystemExit`` of a SIGTERM handler)
the temporary is removed and nothing is left under the final name, so a later reader never takes a cut-short
output for a complete one. A hard kill (SIGKILL, a lost machine) leaves only a hidden ``.NAME.PID.tmp``,
which directory readers skip.

- A file: ``.NAME.PID.tmp`` in the same directory (the same file system, so ``os.replace`` is atomic),
  created with the permissions the file would have had; it replaces an existing file of that name, as
  writing the file in place did.
- A directory that does not exist yet: ``.NAME.PID.tmp`` beside it, renamed onto the name at the end. The
  rename never merges: if a directory holding files took the name meanwhile, it fails and the temporary goes.
- A directory that exists (empty or holding other files): the files are written into a hidden subdirectory
  of it and moved in one by one once all are written, ``last`` (a manifest) after the others, so the
  directory holds the manifest only when every file it names is there. A file already in the directory is
  never replaced.
- A directory replaced whole (``replaced_dir``: a training checkpoint): written under ``.NAME.PID.tmp`` beside
  it, then swapped in for the old one, which is removed once the new one has the name.

Errors name the output, not its temporary (``out.jsonl: Permission denied``).
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

TMP_SUFFIX = ".tmp"


NAME_MAX = 255  # bytes of a file name on the common file systems


def temporary_name(path: str | os.PathLike) -> Path:
    """The hidden temporary name of the output ``path``: ``.NAME.PID.tmp`` in the same directory, NAME cut so the
    whole stays within `NAME_MAX` bytes (an output name near the limit is valid; its temporary must be too)."""
    path = Path(path)
    tail = f".{os.getpid()}{TMP_SUFFIX}"
    name = path.name.encode()[: NAME_MAX - 1 - len(tail)].decode(errors="ignore")
    return path.parent / f".{name}{tail}"


def check_writable_name(path: str | os.PathLike) -> None:
    """Raise, before any work, what writing ``path`` in place would raise: its directory missing or a file, or
    ``path`` itself a directory (the rename at the end would find it only after the work)."""
    path = Path(path)
    try:
        os.stat(path.parent)
    except OSError as exc:
        raise type(exc)(exc.errno, exc.strerror, str(path)) from None
    if not path.parent.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(path))
    if path.is_dir():
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))


def _name_the_output(exc: BaseException, tmp: Path, path: Path) -> None:
    """An error about the temporary names the output instead: the user never chose the temporary's name."""
    if not isinstance(exc, OSError):
        return
    old, new = str(tmp), str(path)
    for attr in ("filename", "filename2"):
        value = getattr(exc, attr, None)
        if isinstance(value, (str, os.PathLike)) and os.fspath(value).startswith(old):
            setattr(exc, attr, new + os.fspath(value)[len(old):])
    if isinstance(exc.strerror, str) and old in exc.strerror:  # pyarrow's "Failed to open local file '...'"
        exc.strerror = exc.strerror.replace(old, new)
    if exc.errno is None and exc.args and isinstance(exc.args[0], str) and old in exc.args[0]:
        exc.args = (exc.args[0].replace(old, new), *exc.args[1:])


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _make_parents(path: Path) -> list[Path]:
    """Create the missing directories above ``path`` as ``mkdir -p`` does; return them, deepest first. A file in
    the way is ``path``'s error (``out/x: Not a directory``), as when writing ``path`` itself."""
    created = [p for p in path.parents if not p.exists()]
    if created:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except NotADirectoryError as exc:
            raise NotADirectoryError(exc.errno, exc.strerror, str(path)) from None
    return created


def _remove_created(created: list[Path]) -> None:
    """Remove the directories a call created above its output (deepest first), as long as they are empty."""
    for p in created:
        try:
            p.rmdir()
        except OSError:
            return


class AtomicFile:
    """``tmp``: the name to write ``path`` under; ``commit()`` renames it into place, ``discard()`` removes it.

    As a context manager it gives ``tmp``, commits when the block succeeds and discards when it fails::

        with AtomicFile("out.parquet") as tmp:
            pq.write_table(table, tmp)
    """

    def __init__(self, path: str | os.PathLike) -> None:
        # a symbolic link is written through, as an in-place write would: the rename replaces its target
        self.path = Path(os.path.realpath(path)) if os.path.islink(path) else Path(path)
        check_writable_name(self.path)
        self.tmp = temporary_name(self.path)

    def commit(self) -> None:
        try:
            os.replace(self.tmp, self.path)
        except BaseException as exc:
            self.discard()
            _name_the_output(exc, self.tmp, self.path)
            raise

    def discard(self) -> None:
        _remove(self.tmp)

    def __enter__(self) -> Path:
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.discard()
            _name_the_output(exc, self.tmp, self.path)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, *, make_parents: bool = False) -> Iterator[Path]:
    """The temporary name to write the file ``path`` under: renamed into place when the ``with`` block succeeds,
    removed when it fails. ``make_parents``: create missing directories above ``path`` (removed again on failure)."""
    path = Path(path)
    created = _make_parents(path) if make_parents else []
    try:
        with AtomicFile(path) as tmp:
            yield tmp
    except BaseException:
        _remove_created(created)
        raise


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike, *, last: str | None = None) -> Iterator[Path]:
    """A directory to write the files of the output directory ``path`` into: they appear under ``path`` only when
    the ``with`` block succeeds (see the module docstring). Missing directories above ``path`` are created, as
    ``mkdir -p`` does, and removed again on failure. ``last``: the file moved into an existing directory after
    every other one."""
    path = Path(path)
    if path.is_dir():
        tmp = _fresh_dir(path, ".treepack", path)
        try:
            yield tmp
            _move_files_in(tmp, path, last)
        except BaseException as exc:
            _name_the_output(exc, tmp, path)
            raise
        finally:
            _remove(tmp)
        return
    created = _make_parents(path)
    tmp = None
    try:
        tmp = _fresh_dir(path.parent, f".{path.name}", path)
        yield tmp
        os.rename(tmp, path)  # onto a missing or empty directory only: never merged into one holding files
    except BaseException as exc:
        if tmp is not None:
            _remove(tmp)
            _name_the_output(exc, tmp, path)
        _remove_created(created)
        raise


@contextlib.contextmanager
def replaced_dir(path: str | os.PathLike) -> Iterator[Path]:
    """A directory to write the whole new content of the directory ``path`` into (a checkpoint): when the ``with``
    block succeeds it takes ``path``'s name, the directory there before (if any) renamed aside first and removed
    after; when it fails, the temporary goes and ``path`` is left as it was. Between the two renames a kill leaves
    the old directory under the hidden ``.NAME.PID.old`` beside the new one's hidden temporary."""
    path = Path(path)
    created = _make_parents(path)
    tmp = old = None
    try:
        tmp = _fresh_dir(path.parent, f".{path.name}", path)
        yield tmp
        if path.is_dir() and not path.is_symlink():
            old = path.parent / f".{path.name}.{os.getpid()}.old"
            _remove(old)
            os.rename(path, old)
        os.rename(tmp, path)
    except BaseException as exc:
        if tmp is not None:
            _remove(tmp)
            _name_the_output(exc, tmp, path)
        if old is not None and old.exists() and not path.exists():
            os.rename(old, path)  # the swap failed halfway: the old directory goes back
        _remove_created(created)
        raise
    if old is not None:
        _remove(old)


def _fresh_dir(parent: Path, stem: str, output: Path) -> Path:
    """A new directory ``STEM.PID.tmp`` in ``parent`` (a counter added if a stale one has the name); errors name
    ``output``."""
    for k in itertools.count():
        tmp = parent / f"{stem}.{os.getpid()}{f'-{k}' if k else ''}{TMP_SUFFIX}"
        try:
            tmp.mkdir()  # the permissions the output directory itself would get
            return tmp
        except FileExistsError:
            continue
        except OSError as exc:  # the output's directory is a file, not writable, ...
            raise type(exc)(exc.errno, exc.strerror, str(output)) from None
    raise AssertionError("unreachable")  # pragma: no cover


def _move_files_in(tmp: Path, path: Path, last: str | None) -> None:
    """Move every file of ``tmp`` into ``path``, ``last`` after the others, replacing none already there; on a
    failure the files moved so far are removed again."""
    names = sorted((p.name for p in tmp.iterdir()), key=lambda n: (n == last, n))
    for name in names:
        if os.path.lexists(path / name):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(path / name))
    moved: list[Path] = []
    try:
        for name in names:
            os.replace(tmp / name, path / name)
            moved.append(path / name)
    except BaseException:
        for p in moved:
            with contextlib.suppress(OSError):
                p.unlink()
        raise
