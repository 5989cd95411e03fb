"""``treepack tokenize``: chat transcripts -> rollout records with the tokenizer's own chat template.

One record per trained assistant turn (the rendering of the conversation through that turn), loss_mask on
the tokens the turn generated, then a summary: records, tokens, C and POR as rendered and if consistent,
drift, speed; ``--drift`` adds the report per input with the first divergences, ``--verify N`` compares
the first N conversations with transformers' ``apply_chat_template``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import typer
from rich.table import Table

from treepack.chat.turns import ChatOptions, ChatRecords, write_chat_records
from treepack.cli.chat_inputs import (
    chat_options,
    drift_summary,
    load_chats,
    render_drift,
    rendering,
    share,
)
from treepack.cli.common import (
    Render,
    check_choice,
    check_output_path,
    console,
    err_console,
    handle_errors,
    nothing_read,
)
from treepack.cli.inputs import report_skipped_records
from treepack.errors import TreepackError

OUTPUT_SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet")


@handle_errors
def tokenize(
    files: list[str] = typer.Argument(..., help="Chat files: .jsonl, .jsonl.gz, .json (a record, an array, tau-bench or "
                                                "tau2 results), .parquet, a directory, or - for stdin."),
    tokenizer: Path = typer.Option(..., "--tokenizer", help="Tokenizer directory: tokenizer.json and a chat template."),
    output: Path | None = typer.Option(None, "--output", "-o", help="Records to write: .jsonl, .jsonl.gz or .parquet."),
    turns: str = Render.turns,
    reasoning: str = Render.reasoning,
    no_system: bool = Render.no_system,
    no_tools: bool = Render.no_tools,
    keep_prefix_tokens: bool = typer.Option(False, "--keep-prefix-tokens", help="Each turn = the previous turn's tokens "
                                            "through its end-of-turn token + the newly rendered rest (exact sharing)."),
    template_arg: list[str] = Render.template_arg,
    drift: bool = typer.Option(False, "--drift", help="Print the drift report per input and the first divergences."),
    verify: int = typer.Option(0, "--verify", help="Check the records of the first N conversations against "
                               "transformers' apply_chat_template (needs transformers)."),
    on_error: str = typer.Option("raise", "--on-error", help="raise: stop at the first bad record; skip: count and skip."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of tables."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
) -> None:
    """Render chat transcripts with the tokenizer's chat template: one record per assistant turn, exact loss masks."""
    check_choice(on_error, ("raise", "skip"), "--on-error")
    options = chat_options(turns=turns, reasoning=reasoning, no_system=no_system, no_tools=no_tools,
                           keep_prefix_tokens=keep_prefix_tokens, template_arg=template_arg)
    if output is not None and not str(output).endswith(OUTPUT_SUFFIXES):
        raise typer.BadParameter(f"{output.name!r}: the file name must end in .jsonl, .jsonl.gz or .parquet",
                                 param_hint="--output")
    if output is not None:
        check_output_path(output, files)
    if verify < 0:
        raise typer.BadParameter("must be at least 0", param_hint="--verify")
    if verify and "-" in files:
        raise typer.BadParameter("reads the input twice: not from stdin", param_hint="--verify")
    recs = load_chats(files, tokenizer, options, on_error=on_error, quiet=quiet, consistent=True)
    r = recs.rollouts
    if len(r) == 0:
        raise nothing_read(files, "conversations to tokenize", r)
    checked = 0
    if verify:
        checked = check_with_transformers(files, tokenizer, options, recs, verify)
    n_bytes = None
    if output is not None:
        n_bytes = write_chat_records(output, recs)
    summary = drift_summary(recs)
    summary["rendering"] = rendering(tokenizer, options)
    speed = recs.fresh.n_tokens / recs.seconds if recs.seconds > 0 else float("inf")
    if as_json:
        d = {
            "conversations": len(recs.conversation_ids), "records": len(r), "n_tokens": r.n_tokens,
            "n_trained_tokens": int(r.loss_mask.sum()), "keep_prefix_tokens": options.keep_prefix_tokens,
            "seconds": recs.seconds, "tokens_per_s": speed, "encoded_tokens": recs.encoded_tokens,
            "verified_records": checked, "output": str(output) if output is not None else None, "bytes": n_bytes,
            "skipped": dict(r.skipped), "dropped_fields": dict(recs.dropped_fields),
            "prompt_not_prefix": recs.prompt_not_prefix, "drift": summary,
        }
        console.file.write(json.dumps(d) + "\n")
    else:
        _render_summary(recs, summary, output, n_bytes, speed, checked)
        if drift:
            render_drift(summary)
    report_skipped_records(r)
    if recs.prompt_not_prefix:
        err_console.print(f"{recs.prompt_not_prefix:,} turn(s): the generation prompt is not a prefix of the turn's "
                          "rendering; their loss starts where the two first differ", markup=False)
    if recs.dropped_fields:
        names = ", ".join(f"{k!r} ({v:,} conversations)" for k, v in recs.dropped_fields.items())
        err_console.print(f"not carried into the records (they name record fields): {names}", markup=False)


def _render_summary(recs: ChatRecords, summary: dict, output, n_bytes, speed: float, checked: int) -> None:
    r = recs.rollouts
    kind = "keep-prefix: each turn extends the previous turn's tokens" if recs.options.keep_prefix_tokens \
        else "as the chat template renders each turn"
    t = Table(title="treepack tokenize" + (f" -> {output}" if output is not None else ""), title_justify="left",
              header_style="bold")
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_column("meaning", style="dim")
    rows = [
        ("records", f"{len(r):,}", f"assistant turns of {len(recs.conversation_ids):,} conversations; {kind}"),
        ("tokens", f"{r.n_tokens:,}", f"{int(r.loss_mask.sum()):,} of them trained (loss_mask 1)"),
        ("C / POR", f"{summary['compression']:.2f} / {summary['por']:.4f}", "as rendered, sharing per tree_id"),
        ("C / POR if consistent", f"{summary['consistent_compression']:.2f} / {summary['consistent_por']:.4f}",
         "each turn's history spliced from the turn before"),
        ("drift", share(summary["drifted"], summary["pairs"]),
         f"turn pairs; {summary['tokens_lost']:,} tokens of sharing lost (--drift for where)"),
        ("keep-prefix differs", share(summary["records_differ"], summary["records"]),
         "records whose --keep-prefix-tokens tokens differ from a fresh rendering"),
        ("speed", f"{speed / 1e6:,.2f}M tok/s", f"{recs.seconds:.2f}s; {recs.encoded_tokens:,} tokens encoded, the "
         "rest repeated pieces" + (f" (piece cache off: {recs.tokenizer_note})" if recs.tokenizer_note else "")),
    ]
    if checked:
        rows.append(("verified", f"{checked:,}", "records equal to transformers' apply_chat_template"))
    if n_bytes is not None:
        rows.append(("output", f"{n_bytes / 2**20:,.1f} MiB", str(output)))
    for row in rows:
        t.add_row(*row)
    console.print(t)


def check_with_transformers(paths, tokenizer_dir, options: ChatOptions, recs: ChatRecords, n_conversations: int) -> int:
    """Compare the fresh records of the first conversations with ``AutoTokenizer.apply_chat_template``.

    Raises `TreepackError` at the first record that differs; returns the number of records checked.
    """
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise TreepackError("--verify needs transformers: pip install transformers") from None
    from treepack.chat.conversations import RecordError, conversations_of, file_stem, iter_raw
    from treepack.chat.template import without_reasoning
    from treepack.chat.turns import expand_chat_paths

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    index = {rid: i for i, rid in enumerate(recs.fresh.ids)}
    checked = seen = 0
    for path in expand_chat_paths(paths if not isinstance(paths, (str, os.PathLike)) else [paths]):
        for where, i, rec, _ in iter_raw(path):
            if seen >= n_conversations:
                return checked
            if not isinstance(rec, dict):
                continue
            try:
                convs = conversations_of(rec, default_id=f"{file_stem(path)}:{i}", where=where)
            except RecordError:
                continue
            for conv in convs:
                seen += 1
                messages = [m for m in conv.messages if options.system or m.get("role") != "system"]
                assistant = [k for k, m in enumerate(messages) if m.get("role") == "assistant"]
                ordinal = {k: j for j, k in enumerate(assistant)}
                for k in assistant:
                    j = index.get(f"{conv.id}/turn{ordinal[k]}")
                    if j is None:
                        continue
                    view = messages[: k + 1]
                    if options.reasoning == "drop":
                        view = [without_reasoning(m) if m.get("role") == "assistant" else m for m in view[:-1]] + [view[-1]]
                    want = tok.apply_chat_template(view, tools=conv.tools if options.tools else None, tokenize=True,
                                                   return_dict=False, **options.template_kwargs)
                    got = recs.fresh.sequence(j).tolist()
                    if got != list(want):
                        p = next((q for q, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                        raise TreepackError(f"{path}: {where}: record {recs.fresh.ids[j]!r} differs from transformers' "
                                            f"apply_chat_template at token {p} ({len(got)} vs {len(want)} tokens)")
                    checked += 1
    return checked
