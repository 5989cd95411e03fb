"""Run the treepack CLI in-process and capture stdout, stderr and the exit code separately."""

from __future__ import annotations

from dataclasses import dataclass

from typer.testing import CliRunner

from treepack.cli.app import app


@dataclass
class Result:
    code: int
    out: str
    err: str


def run(*args: str, input: str | None = None) -> Result:
    r = CliRunner().invoke(app, [str(a) for a in args], input=input)
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception
    return Result(r.exit_code, r.stdout, r.stderr)
