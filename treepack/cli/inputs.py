"""What the commands that read rollouts share: their input options, reading with a progress bar, size options,
oversize notes.

Kept apart from the commands so that `stats`, `pack`, `plot` and `report` import it and never each other.
The input options (the files, ``--tokens-field``, ``--tokenizer`` and tokenize's rendering options,
``--on-error``, ``--quiet``: eleven parameters) are declared once, here: a command decorated with
`reads_inputs` declares ``inputs: Inputs`` where its ``--help`` lists them and gets them as one `Inputs`,
which checks the chat options (`Inputs.chat`) and reads the input (`Inputs.read`). Written out in each of
the four commands they had been 44 parameter lines and four copies of the two calls.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import ClassVar

import typer
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

from treepack.cli.common import CHAT_OPTIONS, F, Render, err_console, nothing_read
from treepack.errors import TreepackError
from treepack.io.ingest import expand_paths
from treepack.io.rollouts import Rollouts
from treepack.pack.shard_reader import pack_dir_bytes, pack_dir_of, read_inputs
from treepack.pack.strategies import Packing, describe_sequence
from treepack.sizes import parse_size

PROGRESS_MIN_BYTES = 64 << 20  # show a progress bar when the inputs are at least this big
TOKENIZER_HELP = ("Input is chat transcripts: render them with this tokenizer directory's chat template, one record "
                  "per assistant turn (as treepack tokenize does), with tokenize's rendering options (--turns, "
                  "--reasoning, --no-system, --no-tools, --template-arg, --keep-prefix-tokens).")
KEEP_PREFIX_HELP = ("With --tokenizer: each turn = the previous turn's tokens through its end-of-turn token + the "
                    "newly rendered rest (exact prefix sharing).")
FILES_HELP = "Rollout files: .jsonl, .jsonl.gz, .parquet, a directory, or - for stdin."
ON_ERROR = ("raise", "skip")
ON_ERROR_HELP = "raise: stop at the first bad record; skip: count and skip."


@dataclass(frozen=True)
class Inputs:
    """The input options of a command that reads rollouts (stats, pack, plot, report), as given."""

    files: list[str]  # rollout files, directories, a pack directory, or - (stdin)
    tokens_field: str | None  # --tokens-field: the column holding the token ids
    tokenizer: Path | None  # --tokenizer: chat transcripts in, rendered with this directory's template
    keep_prefix_tokens: bool  # --keep-prefix-tokens (with --tokenizer)
    turns: str  # tokenize's rendering options (`Render`), with --tokenizer
    reasoning: str
    no_system: bool
    no_tools: bool
    template_arg: list[str]
    on_error: str  # --on-error: raise or skip
    quiet: bool  # --quiet: no progress bar
    ctx: typer.Context | None = field(default=None, repr=False, compare=False)  # which options were typed
    # the values that need no option on a command line (`command_line`)
    DEFAULTS: ClassVar[dict] = {"--on-error": "raise", "--turns": Render.turns.default,
                                "--reasoning": Render.reasoning.default}

    def chat(self):
        """ChatOptions for --tokenizer, or None for token records (`chat_input`: usage errors name it)."""
        return chat_input(self.tokenizer, self.keep_prefix_tokens, self.tokens_field, self.ctx,
                          **{name: getattr(self, name) for name in CHAT_OPTIONS})

    def load(self, chat=None, **kwargs) -> Rollouts:
        """Read by `load_with_progress` (``chat``: what `chat` returned; ``kwargs``: what to keep)."""
        return load_with_progress(self.files, tokens_field=self.tokens_field, on_error=self.on_error,
                                  quiet=self.quiet, tokenizer=self.tokenizer, chat=chat, **kwargs)

    def read(self, what: str, chat=None, **kwargs) -> Rollouts:
        """`load`, refusing an input without sequences in one line (``what``: ``"sequences to plot"``)."""
        rollouts = self.load(chat, **kwargs)
        if len(rollouts) == 0:
            raise nothing_read(self.files, what, rollouts)
        return rollouts

    def command_line(self) -> dict:
        """The options as ``{flag: value}`` (None: not given; True: a flag), for a command line that redoes the
        run, in the order pack's manifest writes them; `Inputs.DEFAULTS` are the values that need no option."""
        return {"--tokens-field": self.tokens_field, "--on-error": self.on_error, "--tokenizer": self.tokenizer,
                "--keep-prefix-tokens": self.keep_prefix_tokens or None, "--turns": self.turns,
                "--reasoning": self.reasoning, "--no-system": self.no_system or None,
                "--no-tools": self.no_tools or None, "--template-arg": self.template_arg}


_OPTION_NAMES = tuple(f.name for f in fields(Inputs) if f.name != "ctx")


def reads_inputs(*, quiet: str, tokenizer: str = TOKENIZER_HELP) -> Callable[[F], F]:
    """Give a typer command the input options and call it with them as one `Inputs` (see the module doc).

    The command declares ``inputs: Inputs`` among its own parameters; its ``--help`` lists ``FILES`` first,
    then its own options with the input options where ``inputs`` stands, then ``--quiet`` (help ``quiet``).
    ``tokenizer``: the help of ``--tokenizer``."""
    keyword = inspect.Parameter.KEYWORD_ONLY

    def option(name: str, annotation, default) -> inspect.Parameter:
        return inspect.Parameter(name, keyword, annotation=annotation, default=default)

    block = [
        option("tokens_field", str | None,
               typer.Option(None, "--tokens-field", help="Column holding the token ids.")),
        option("tokenizer", Path | None, typer.Option(None, "--tokenizer", help=tokenizer)),
        option("keep_prefix_tokens", bool,
               typer.Option(False, "--keep-prefix-tokens", help=KEEP_PREFIX_HELP)),
        option("turns", str, Render.turns), option("reasoning", str, Render.reasoning),
        option("no_system", bool, Render.no_system), option("no_tools", bool, Render.no_tools),
        option("template_arg", list[str], Render.template_arg),
        option("on_error", str, typer.Option("raise", "--on-error", help=ON_ERROR_HELP)),
    ]

    def decorate(fn: F) -> F:
        own = inspect.signature(fn, eval_str=True).parameters
        if "inputs" not in own:
            raise TypeError(f"{fn.__name__} declares no 'inputs: Inputs' parameter")
        params = [inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context),
                  option("files", list[str], typer.Argument(..., help=FILES_HELP))]
        for p in own.values():
            params += block if p.name == "inputs" else [p.replace(kind=keyword)]
        params.append(option("quiet", bool, typer.Option(False, "--quiet", "-q", help=quiet)))

        @functools.wraps(fn)
        def command(ctx: typer.Context, **values):
            inputs = Inputs(ctx=ctx, **{name: values.pop(name) for name in _OPTION_NAMES})
            return fn(inputs=inputs, **values)

        command.__signature__ = inspect.Signature(params)  # what typer reads instead of fn's own
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command  # type: ignore[return-value]

    return decorate


def input_bytes(files: list[str]) -> int:
    """Bytes on disk of what ``files`` name (compressed sizes, shards of a pack directory; stdin: 0)."""
    total = 0
    for f in files:
        packs = pack_dir_of(f)
        if packs is not None:
            total += pack_dir_bytes(packs)
        elif f != "-":
            total += sum(os.path.getsize(p) for p in expand_paths([f]) if p != "-")
    return total


def load_with_progress(files: list[str], *, tokens_field: str | None, on_error: str, quiet: bool,
                       keep_token_fields: bool = True, keep_records: bool = False, tokenizer=None,
                       chat=None) -> Rollouts:
    """Read rollouts (or a pack directory's records), with a progress bar on stderr for big inputs (unless
    ``quiet``); the bar counts bytes read from disk, so compressed files end at 100%. Files a directory
    held that were not read are named on stderr. With ``tokenizer`` (a directory) the files are chat
    transcripts rendered with ``chat`` (ChatOptions)."""
    if tokenizer is not None:
        from treepack.cli.chat_inputs import load_chats

        recs = load_chats(files, tokenizer, chat, on_error=on_error, quiet=quiet)
        return recs.rollouts_with_records() if keep_records else recs.rollouts
    kwargs = {"tokens_field": tokens_field, "on_error": on_error, "keep_token_fields": keep_token_fields,
              "keep_records": keep_records}
    total = input_bytes(files)
    if quiet or total < PROGRESS_MIN_BYTES:
        r = read_inputs(files, **kwargs)
    else:
        with Progress(TextColumn("reading"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                      console=err_console, transient=True) as bar:
            task = bar.add_task("read", total=total)
            r = read_inputs(files, progress=lambda n: bar.advance(task, n), **kwargs)
    report_skipped_files(r)
    if r.n_duplicate_ids:
        err_console.print(f"warning: {r.n_duplicate_ids:,} record(s) repeat an id an earlier record has "
                          f"(first: {r.duplicate_example})", markup=False)
    return r


MAX_LISTED_FILES = 10  # files named on stderr (``--json`` lists them all)


def report_skipped_files(r: Rollouts) -> None:
    """One stderr line per file a directory held that was not read (the first ``MAX_LISTED_FILES``)."""
    if not r.skipped_files:
        return
    n = len(r.skipped_files)
    err_console.print(f"skipped {n} file{'s' if n != 1 else ''} not read as rollouts:", markup=False)
    for path, why in r.skipped_files[:MAX_LISTED_FILES]:
        err_console.print(f"  {path}: {why}", markup=False)
    if n > MAX_LISTED_FILES:
        err_console.print(f"  ... and {n - MAX_LISTED_FILES} more (--json lists them all)", markup=False)


def chat_input(tokenizer, keep_prefix_tokens: bool, tokens_field: str | None, ctx: typer.Context | None = None,
               **rendering):
    """ChatOptions for ``--tokenizer``, ``--keep-prefix-tokens`` and tokenize's rendering options (``rendering``:
    the values of `CHAT_OPTIONS` by parameter name). None: the input is token records, and any of those options
    given (on the command line, even at its default value, when the command's ``ctx`` is passed; else set to
    other than its default) is a usage error naming it."""
    if tokenizer is None:
        def given(name: str, value, default) -> bool:
            source = ctx.get_parameter_source(name) if ctx is not None else None
            return source.name != "DEFAULT" if source is not None else value != default

        if given("keep_prefix_tokens", keep_prefix_tokens, False):
            raise typer.BadParameter("needs --tokenizer", param_hint="--keep-prefix-tokens")
        for name, option in CHAT_OPTIONS.items():
            if given(name, rendering.get(name, option.default), option.default):
                raise typer.BadParameter("needs --tokenizer", param_hint=option.param_decls[0])
        return None
    if tokens_field is not None:
        raise typer.BadParameter("names a token column; --tokenizer reads chat transcripts", param_hint="--tokens-field")
    from treepack.cli.chat_inputs import chat_options

    return chat_options(keep_prefix_tokens=keep_prefix_tokens, **rendering)


def size_option(text: str, option: str, what: str) -> int:
    """Parse a size option or raise a usage error naming it."""
    try:
        return parse_size(text, what=what)
    except TreepackError as exc:
        raise typer.BadParameter(str(exc), param_hint=option) from None


MAX_DPI = 1200  # the largest figure (12 x 8 in) is then 14,400 x 9,600 px: ~0.7 GB and 5 s to draw


def check_dpi(dpi: int) -> None:
    """Usage error (exit 2) for a ``--dpi`` outside 10..MAX_DPI (beyond, the pixels of one figure exhaust memory)."""
    if not 10 <= dpi <= MAX_DPI:
        raise typer.BadParameter(f"must be between 10 and {MAX_DPI}, got {dpi}", param_hint="--dpi")


def report_skipped_records(r: Rollouts) -> None:
    """The stderr lines of ``--on-error skip`` on the bad records left out (stats' wording): the count by reason,
    then the first few, verbatim."""
    if r.n_skipped:
        reasons = ", ".join(f"{v} {k}" for k, v in r.skipped.most_common())
        err_console.print(f"skipped {r.n_skipped} bad record(s): {reasons}", markup=False)
        for ex in r.skipped_examples:
            err_console.print(f"  {ex}", markup=False)


def report_oversize(r: Rollouts, p: Packing) -> None:
    """One stderr line on the sequences dropped by ``--oversize skip``."""
    if not p.n_oversize_skipped:
        return
    i = int(p.oversize_skipped[0])
    err_console.print(
        f"skipped {p.n_oversize_skipped:,} sequence(s) longer than the capacity {p.capacity:,} "
        f"(first: {describe_sequence(r, i)}, {int(r.lengths[i]):,} tokens)",
        markup=False,
    )
