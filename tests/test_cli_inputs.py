"""The input options of stats, pack, plot and report: declared once (`treepack.cli.inputs.reads_inputs`),
listed by each command's --help where they always stood, and handed to the command as one `Inputs`."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer
from cli_helpers import run
from typer.main import get_command
from typer.testing import CliRunner

from treepack.cli.app import build_app
from treepack.cli.inputs import Inputs, reads_inputs

SAMPLE = Path(__file__).resolve().parents[1] / "treepack" / "datasets" / "samples" / "grpo_math.jsonl.gz"
BLOCK = ["tokens_field", "tokenizer", "keep_prefix_tokens", "turns", "reasoning", "no_system", "no_tools",
         "template_arg", "on_error"]
# each command's parameters in --help's order, as they were when every command wrote them out itself
ORDER = {
    "stats": ["files", *BLOCK, "group_by", "model", "as_json", "top", "min_compression", "min_por",
              "max_seq_len", "capacity", "strategy", "min_err", "compare_strategies", "oversize", "plot_dir",
              "quiet"],
    "pack": ["files", "capacity", "output", "strategy", "pad_to", "shard_size", "balance", "balance_cost",
             "model", "oversize", "group_by", *BLOCK, "quiet"],
    "plot": ["files", "output", "kind", "group", "group_by", "capacity", "strategy", "oversize", "max_nodes",
             "dpi", *BLOCK, "quiet"],
    "report": ["files", "output", "capacity", "no_packing", "oversize", "group_by", "model", "dpi", *BLOCK,
               "quiet"],
}
WROTE = "No progress bar, no 'wrote' line."
QUIET = {"stats": "No progress bar.", "pack": "No progress bars.", "plot": WROTE, "report": WROTE}


def params(name: str) -> dict:
    return {p.name: p for p in get_command(build_app(name)).commands[name].params}


@pytest.mark.parametrize("name", list(ORDER))
def test_each_command_lists_the_input_options_where_they_stood(name):
    got = params(name)
    assert list(got) == ORDER[name]
    assert got["quiet"].help == QUIET[name]
    assert got["quiet"].opts == ["--quiet", "-q"]
    assert got["files"].help == "Rollout files: .jsonl, .jsonl.gz, .parquet, a directory, or - for stdin."


def test_the_input_options_read_the_same_on_every_command():
    helps = {name: {n: (tuple(p.opts), p.help, p.default) for n, p in params(name).items() if n in BLOCK}
             for name in ORDER}
    tokenizer = helps["stats"].pop("tokenizer")
    assert tokenizer[1].endswith(". Adds the drift report.")
    for name in ("pack", "plot", "report"):
        plain = tokenizer[1].removesuffix(" Adds the drift report.")
        assert helps[name].pop("tokenizer") == (tokenizer[0], plain, None)
        assert helps[name] == helps["stats"]
    on_error = "raise: stop at the first bad record; skip: count and skip."
    assert helps["stats"]["on_error"] == (("--on-error",), on_error, "raise")


@pytest.mark.parametrize("name, extra", [("stats", []), ("pack", ["-c", "8K", "-o", "packs"]),
                                         ("plot", ["-o", "x.png"]), ("report", ["-o", "x.html"])])
def test_a_rendering_option_without_a_tokenizer_is_a_usage_error_on_every_command(name, extra, tmp_path,
                                                                                  monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = run(name, SAMPLE, *extra, "--reasoning", "drop")
    assert (r.code, r.err.splitlines()[-1]) == (2, "Error: Invalid value for --reasoning: needs --tokenizer")
    assert list(tmp_path.iterdir()) == []  # refused before any output


def test_the_command_gets_one_inputs_with_what_was_typed():
    seen = {}

    @reads_inputs(quiet="Shh.")
    def command(top: int = typer.Option(3, "--top"), inputs: Inputs = None) -> None:
        seen["inputs"], seen["top"] = inputs, top

    app = typer.Typer()
    app.command("x")(command)
    app.command("y")(lambda: None)  # two commands: typer then names them
    r = CliRunner().invoke(app, ["x", "a.jsonl", "b.jsonl", "--top", "5", "--on-error", "skip", "-q",
                                 "--template-arg", "k=v", "--template-arg", "j=w"])
    assert r.exit_code == 0, r.output
    got = seen["inputs"]
    assert seen["top"] == 5
    assert (got.files, got.on_error, got.quiet, got.template_arg, got.tokenizer, got.turns) == (
        ["a.jsonl", "b.jsonl"], "skip", True, ["k=v", "j=w"], None, "all")
    with pytest.raises(typer.BadParameter, match="^needs --tokenizer$"):  # it was typed, without a tokenizer
        got.chat()
    assert {k: v for k, v in got.command_line().items() if v is not None and Inputs.DEFAULTS.get(k) != v} == {
        "--on-error": "skip", "--template-arg": ["k=v", "j=w"]}


def test_a_command_without_an_inputs_parameter_is_refused_at_import():
    with pytest.raises(TypeError, match="^command declares no 'inputs: Inputs' parameter$"):
        @reads_inputs(quiet="Shh.")
        def command(top: int = 3) -> None:
            pass
