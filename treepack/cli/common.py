"""What every command shares: error mapping, consoles, choice checks, the chat rendering options.

Library errors (``TreepackError``) and the system's (``OSError``: ``FILE: Permission denied``) become
``Error: <message>`` on stderr and exit 1; usage errors are typer's (exit 2). Commands never print
tracebacks for bad input. A reader that leaves early (``treepack synth ... -o - | head -c 100``) ends the
command quietly with exit 0: no summary, no error, nothing from Python at exit (`whole_stdout_writes`).
`CHAT_OPTIONS` are tokenize's rendering options, defined here once for it and for every command that takes
``--tokenizer`` (kept out of ``chat_inputs``, which loads the chat reader).
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import sys
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import TypeVar

import typer
from rich.console import Console

from treepack.errors import InputError, TreepackError

F = TypeVar("F", bound=Callable)


class _Console(Console):
    """rich's Console, but a closed pipe (``treepack stats ... | head``) is no error: rich exits 1 itself."""

    def on_broken_pipe(self) -> None:
        _to_devnull(sys.stdout.fileno())  # as rich does: no error at exit either
        raise BrokenPipeError  # handle_errors ends the command with exit 0


def _to_devnull(fd: int) -> None:
    """Point ``fd`` (stdout, whose reader has gone) at /dev/null: what is still buffered, and Python's flush at
    exit, go nowhere instead of raising again ("Exception ignored ... BrokenPipeError")."""
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, fd)
    os.close(null)


class _WholeWrites(io.RawIOBase):
    """A file descriptor whose writes are whole: each returns once every byte is written, or raises
    (``BrokenPipeError`` when the reader has gone). Python's buffered stdout returns a short count instead when
    the reader leaves in the middle of a large write, which writers (and ``TextIOWrapper``) do not check: the
    output was cut short and the command went on as if it had all been written."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self._fd = fd

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            done += os.write(self._fd, view[done:])
        return done


@contextlib.contextmanager
def whole_stdout_writes() -> Iterator[None]:
    """Within the block, ``sys.stdout`` (and ``sys.stdout.buffer``) write whole or raise ``BrokenPipeError``, which
    `handle_errors` turns into a quiet exit 0. For commands that write their output to stdout (``-o -``); a
    stdout without a file descriptor (a test's capture) is left as it is."""
    saved = sys.stdout
    try:
        fd = saved.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both
        yield
        return
    saved.flush()
    sys.stdout = io.TextIOWrapper(_WholeWrites(fd), encoding=saved.encoding, errors=saved.errors)
    try:
        yield
        sys.stdout.flush()
    except BrokenPipeError:
        _to_devnull(fd)  # before the wrapper is dropped: its buffered rest then goes nowhere
        raise
    finally:
        sys.stdout = saved


console = _Console(highlight=False, soft_wrap=True)
err_console = _Console(stderr=True, highlight=False, soft_wrap=True)


def fail(message: str, code: int = 1) -> typer.Exit:
    """Print ``Error: message`` on stderr (one line, no markup) and return the exit to raise."""
    message = message.removeprefix("Error ").removeprefix("Error: ")  # a library's own "Error no file named ..."
    sys.stderr.write(f"Error: {message}\n")
    sys.stderr.flush()
    return typer.Exit(code)


def handle_errors(fn: F) -> F:
    """Map library exceptions to one-line errors with exit code 1."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except TreepackError as exc:
            raise fail(str(exc)) from None
        except BrokenPipeError:  # `treepack stats ... | head`, `treepack synth ... -o - | head -c 100`
            sys.stderr.close()
            raise typer.Exit(0) from None
        except OSError as exc:  # what the system refuses: an output under a file, no permission, a full disk
            raise fail(f"{exc.filename}: {exc.strerror}" if exc.filename and exc.strerror else str(exc)) from None

    return wrapper  # type: ignore[return-value]


def nothing_read(files: list[str], what: str, r) -> InputError:
    """The error when the input gave no records: names the input, and what was skipped if anything."""
    names = ", ".join("<stdin>" if f == "-" else str(f) for f in files[:3]) + (" ..." if len(files) > 3 else "")
    reasons = ", ".join(f"{v} {k}" for k, v in r.skipped.most_common())
    detail = f": {r.n_skipped} bad record(s) skipped ({reasons})" if reasons else " (the input holds no records)"
    return InputError(f"{names}: no {what}{detail}")


def check_choice(value: str, choices: Collection[str], option: str) -> None:
    """Usage error (exit 2) naming the option, its valid values and the value given."""
    if value not in choices:
        raise typer.BadParameter(f"must be one of {', '.join(choices)}, got {value!r}", param_hint=option)


class Render:
    """tokenize's rendering options, the same (names, defaults, help) on every command with --tokenizer: a command
    takes them as ``turns: str = Render.turns`` (typer copies an option object for each command that uses it)."""

    turns = typer.Option("all", "--turns", help="A record for every assistant turn (all) or the last only (last).")
    reasoning = typer.Option("template", "--reasoning", help="Earlier turns' reasoning: template (as the chat template "
                             "renders it), drop, or keep (as generated: implies --keep-prefix-tokens).")
    no_system = typer.Option(False, "--no-system", help="Leave system messages out.")
    no_tools = typer.Option(False, "--no-tools", help="Do not pass the records' tool schemas to the template.")
    template_arg = typer.Option([], "--template-arg", help="KEY=VALUE template variable, e.g. enable_thinking=false "
                                "(repeatable).")


CHAT_OPTIONS = {name: getattr(Render, name) for name in ("turns", "reasoning", "no_system", "no_tools", "template_arg")}


def check_output_path(output: str | os.PathLike, inputs: Collection[str] = (), *, inside_inputs: bool = False
                      ) -> None:
    """Refuse, before any work, an output that would overwrite what the command or its user still needs: one of
    its own inputs (``tokenize in.jsonl -o in.jsonl``), a place inside an input directory (a rerun would read
    it as input; ``inside_inputs``: allowed, for pack's directories, which the readers skip), or a file inside a
    pack directory (it could replace a shard; ``unpack`` says the same). A usage error naming ``--output``."""
    if str(output) == "-":
        return
    out = Path(output).resolve()
    for src in inputs:
        if src == "-" or not Path(src).exists():
            continue
        path = Path(src).resolve()
        if out == path or (not inside_inputs and path.is_dir() and path in out.parents):
            where = "is" if out == path else "is inside"
            raise typer.BadParameter(f"{str(output)!r} {where} the input {src}: write it elsewhere", param_hint="--output")
    if (out.parent / "manifest.json").is_file():
        raise typer.BadParameter(f"{str(output)!r}: write it outside the pack directory {out.parent} (a file there can "
                                 "replace one of its shards)", param_hint="--output")


def check_stdout(output: str) -> None:
    """``-o -`` with standard output closed (``treepack synth ... -o - >&-``): one line, not a traceback."""
    if output == "-" and sys.stdout is None:
        raise InputError("-o -: standard output is closed")
