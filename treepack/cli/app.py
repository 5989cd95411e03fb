"""The typer application: one command per module of ``treepack.cli``.

Each entry of `COMMANDS` is (command name, module, function). The console script imports only the module
of the command it runs (``treepack stats`` never loads the packing writer, the synthesiser or the
plotting code), and heavy dependencies (torch, matplotlib) are imported inside the command functions.
``app``, the application with every command, is built on first use (tests, ``treepack --help``).
A SIGTERM (``kill``, a job scheduler's stop) ends the commands that write files (`CLEAN_ON_SIGTERM`) as Ctrl-C
does, cleaning up on the way out (synth's temporary file goes), and quietly with exit code 143 (128 + 15,
as a shell reports a process SIGTERM killed).
"""

from __future__ import annotations

import importlib
import signal
import sys

import typer

COMMANDS: list[tuple[str, str, str]] = [
    ("stats", "treepack.cli.stats", "stats"),
    ("tokenize", "treepack.cli.tokenize", "tokenize"),
    ("pack", "treepack.cli.pack", "pack"),
    ("unpack", "treepack.cli.unpack", "unpack"),
    ("check", "treepack.cli.check", "check"),
    ("plot", "treepack.cli.plot", "plot"),
    ("report", "treepack.cli.report", "report"),
    ("synth", "treepack.cli.synth", "synth"),
    ("train", "treepack.cli.train", "train"),
    ("verify", "treepack.cli.verify", "verify"),
]


CLEAN_ON_SIGTERM = {"synth", "pack", "unpack", "tokenize"}  # train keeps the default (its ranks, launchers)
SIGTERM_EXIT = 128 + signal.SIGTERM  # 143


def _on_sigterm(signum, frame) -> None:
    """Unwind as Ctrl-C does (``with`` blocks and ``finally`` clauses run: temporary files are removed), exit 143."""
    raise SystemExit(SIGTERM_EXIT)


def _version(value: bool) -> None:
    if value:
        from treepack import __version__

        typer.echo(f"treepack {__version__}")
        raise typer.Exit()


def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """Find and exploit shared prefixes in LLM RL rollouts: stats, packing, tree-attention training."""


def build_app(only: str | None = None) -> typer.Typer:
    """The application with every command, or with only the command ``only`` (what one run needs)."""
    application = typer.Typer(
        name="treepack",
        help="Find and exploit shared prefixes in LLM RL rollouts: stats, packing, tree-attention training.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
        rich_markup_mode=None,
    )
    application.callback()(_root)
    for name, module, attr in COMMANDS:
        if only is None or name == only:
            application.command(name)(getattr(importlib.import_module(module), attr))
    return application


def __getattr__(name: str) -> typer.Typer:
    if name == "app":  # the full application, built once on first access
        globals()["app"] = application = build_app()
        return application
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main() -> None:
    names = {name for name, _, _ in COMMANDS}
    words = [a for a in sys.argv[1:] if not a.startswith("-")]
    command = words[0] if words and words[0] in names else None
    if command in CLEAN_ON_SIGTERM:
        signal.signal(signal.SIGTERM, _on_sigterm)
    build_app(command)()
