"""The typer application: registers one command per module of ``treepack.cli``.

Each entry is (command name, module, function); modules are imported here, but heavy dependencies
(torch) are imported inside the command functions so that ``treepack stats`` starts fast without torch.
"""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(
    name="treepack",
    help="Find and exploit shared prefixes in LLM RL rollouts: stats, packing, tree-attention training.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

COMMANDS: list[tuple[str, str, str]] = [
    ("stats", "treepack.cli.stats", "stats"),
    ("pack", "treepack.cli.pack", "pack"),
    ("unpack", "treepack.cli.unpack", "unpack"),
    ("plot", "treepack.cli.plot", "plot"),
    ("report", "treepack.cli.report", "report"),
    ("synth", "treepack.cli.synth", "synth"),
    ("train", "treepack.cli.train", "train"),
    ("verify", "treepack.cli.verify", "verify"),
]


def _version(value: bool) -> None:
    if value:
        from treepack import __version__

        typer.echo(f"treepack {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """Find and exploit shared prefixes in LLM RL rollouts: stats, packing, tree-attention training."""


def _register() -> None:
    for name, module, attr in COMMANDS:
        fn = getattr(importlib.import_module(module), attr)
        app.command(name)(fn)


_register()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
