"""What the commands that read chat transcripts share: options, reading with a progress bar, the drift report.

``treepack tokenize`` and ``--tokenizer DIR`` on ``stats``, ``pack``, ``plot`` and ``report`` go through
`load_chats` (one code path); `drift_summary` / `render_drift` give the drift report as data and as tables
(per input: turn pairs whose earlier record is not a prefix of the later one, where, tokens of sharing
lost, POR as rendered and if consistent).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import typer
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from treepack.chat.turns import (
    REASONING,
    TURNS,
    ChatOptions,
    ChatRecords,
    expand_chat_paths,
    tokenize_chats,
)
from treepack.cli.common import Render, check_choice, console, err_console
from treepack.io.rollouts import Rollouts

PROGRESS_MIN_BYTES = 1 << 20  # chat input renders at ~1-3 MB/s: show a bar from 1 MB on


PYTHON_SPELLINGS = {"True": True, "False": False, "None": None}  # enable_thinking=False is meant as false


def template_args(values: list[str]) -> dict:
    """``KEY=VALUE`` pairs: VALUE as JSON when it parses (true, 3, "x"), Python's True / False / None as those,
    else the plain string (a string "False" would be true in the template)."""
    out = {}
    for v in values:
        key, eq, raw = v.partition("=")
        if not eq:
            raise typer.BadParameter(f"expected KEY=VALUE, got {v!r}", param_hint="--template-arg")
        if not key.isidentifier():
            raise typer.BadParameter(f"the key of {v!r} must be a template variable name (letters, digits and _, "
                                     "not starting with a digit)", param_hint="--template-arg")
        if raw in PYTHON_SPELLINGS:
            out[key] = PYTHON_SPELLINGS[raw]
            continue
        try:
            out[key] = json.loads(raw)
        except ValueError:
            out[key] = raw
    return out


def chat_options(*, turns: str = Render.turns.default, reasoning: str = Render.reasoning.default,
                 no_system: bool = False, no_tools: bool = False, keep_prefix_tokens: bool = False,
                 template_arg: list[str] | None = None) -> ChatOptions:
    """ChatOptions of tokenize's rendering options (`CHAT_OPTIONS`); a bad value is a usage error (exit 2)."""
    check_choice(turns, TURNS, "--turns")
    check_choice(reasoning, REASONING, "--reasoning")
    return ChatOptions(turns=turns, reasoning=reasoning, system=not no_system, tools=not no_tools,
                       keep_prefix_tokens=keep_prefix_tokens, template_kwargs=template_args(template_arg or []))


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "chat_template.json")


def rendering(tokenizer: str | os.PathLike, options: ChatOptions) -> dict:
    """The tokenizer and rendering options that made a set of records, for ``--json`` outputs and pack's manifest:
    the directory, a sha256 over its vocabulary and chat template files (a re-run can check it renders with the
    same ones), and the options."""
    import hashlib

    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        path = Path(tokenizer) / name
        if path.is_file():
            digest.update(name.encode() + b"\0" + path.read_bytes())
    return {"tokenizer": str(tokenizer), "tokenizer_sha256": digest.hexdigest(), "turns": options.turns,
            "reasoning": options.reasoning, "system": options.system, "tools": options.tools,
            "keep_prefix_tokens": options.keep_prefix_tokens, "template_args": options.template_kwargs}


def load_chats(files: list[str], tokenizer: str | os.PathLike, options: ChatOptions, *, on_error: str, quiet: bool,
               consistent: bool = False) -> ChatRecords:
    """Chat files -> records, with a progress bar on stderr for inputs of 1 MB and more (unless ``quiet``)."""
    paths = expand_chat_paths(files)
    sizes = [os.path.getsize(p) if p != "-" else 0 for p in paths]
    if quiet or sum(sizes) < PROGRESS_MIN_BYTES:
        return tokenize_chats(paths, tokenizer, options, on_error=on_error, consistent=consistent)
    with Progress(TextColumn("tokenizing"), BarColumn(), DownloadColumn(), TimeRemainingColumn(), console=err_console,
                  transient=True) as bar:
        task = bar.add_task("tokenize", total=sum(sizes))
        return tokenize_chats(paths, tokenizer, options, on_error=on_error, consistent=consistent,
                              progress=lambda n: bar.advance(task, n))


def sharing(r: Rollouts, start: int = 0, stop: int | None = None) -> tuple[float, float]:
    """(C, POR) of records ``start:stop`` with sharing scoped to each tree_id (each conversation's tree)."""
    from treepack.tree import PrefixTree

    stop = len(r) if stop is None else stop
    if stop <= start:
        return float("nan"), float("nan")
    sub = r if (start, stop) == (0, len(r)) else r.select(list(range(start, stop)))
    tree = PrefixTree.build(sub, group_by="tree_id")
    return tree.n_flat_tokens / tree.n_tree_tokens, 1.0 - tree.n_tree_tokens / tree.n_flat_tokens


def drift_summary(recs: ChatRecords) -> dict:
    """The drift report as plain data: totals and per input, with POR as rendered and if consistent."""
    out = {"inputs": {}}
    start = 0
    for src in recs.fresh.sources:
        name = "<stdin>" if src.path == "-" else src.path
        stop = start + src.n_records
        d = recs.drift[name].to_dict()
        d["compression"], d["por"] = sharing(recs.fresh, start, stop)
        if recs.consistent is not None:
            d["consistent_compression"], d["consistent_por"] = sharing(recs.consistent, start, stop)
        out["inputs"][name] = d
        start = stop
    total = recs.total.to_dict()
    total["compression"], total["por"] = sharing(recs.fresh)
    if recs.consistent is not None:
        total["consistent_compression"], total["consistent_por"] = sharing(recs.consistent)
    out.update(total)
    return out


def share(a: int, b: int) -> str:
    return f"{a:,} of {b:,}" + (f" ({a / b:.0%})" if b else "")


def render_drift(summary: dict, *, examples: bool = True) -> None:
    """The drift report as tables: one row per input, then the first divergences with their text."""
    title = ("retokenization drift (turn t's record not a prefix of turn t+1's; POR shared within each "
             "conversation, whatever --group-by says)")
    heads = ("input", "conversations", "turn pairs drifted", "text / tokens", "in history / turn / after",
             "tokens lost", "POR as rendered", "POR if consistent", "keep-prefix records differ")
    rows = list(summary["inputs"].items())
    if len(rows) > 1:
        rows.append(("all", summary))
    cells = []
    for name, d in rows:
        k, w = d["kinds"], d["wheres"]
        cells.append([Path(name).name if name != "all" else "all", f"{d['conversations']:,}",
                      share(d["drifted"], d["pairs"]), f"{k.get('text', 0):,} / {k.get('tokens', 0):,}",
                      f"{w.get('history', 0):,} / {w.get('turn', 0):,} / {w.get('after', 0):,}", f"{d['tokens_lost']:,}",
                      f"{d['por']:.4f}", f"{d['consistent_por']:.4f}" if "consistent_por" in d else "-",
                      share(d["records_differ"], d["records"]) if "consistent_por" in d else "-"])
    wide = sum(max(len(h), *(len(c[i]) for c in cells)) + 3 for i, h in enumerate(heads)) + 1
    tall = max(map(len, heads)) + sum(max(map(len, c)) + 3 for c in cells) + 4
    if wide <= console.width:  # one row per input
        t = Table(title=title, title_justify="left", header_style="bold")
        for i, name in enumerate(heads):
            t.add_column(name, justify="left" if i == 0 else "right", overflow="fold")
        for row in cells:
            t.add_row(*row)
        tables = [t]
    else:  # a narrow terminal: one column per input (or a table per input), every number whole
        groups = [cells] if tall <= console.width else [[c] for c in cells]
        tables = []
        for group in groups:
            t = Table(title=title if not tables else None, title_justify="left", header_style="bold")
            t.add_column("", overflow="fold")
            for row in group:
                t.add_column(row[0], justify="right", no_wrap=True, overflow="fold")
            for i, name in enumerate(heads[1:], start=1):
                t.add_row(name, *(row[i] for row in group))
            tables.append(t)
    for t in tables:
        console.print(t)
    if not examples:
        return
    for ev in summary["examples"]:
        place = {"history": "in the history before turn", "turn": "in the generated tokens of turn",
                 "after": "after the end-of-turn token of turn"}[ev["where"]]
        console.print(f"{ev['conversation']}: {ev['kind']} drift at token {ev['position']:,}, {place} "
                      f"{ev['turn']} ({ev['lost']:,} tokens lost)", markup=False)
        console.print(f"  context   {json.dumps(ev['context'], ensure_ascii=False)}", markup=False, style="dim")
        console.print(f"  turn t    {json.dumps(ev['this_turn'], ensure_ascii=False)}", markup=False)
        console.print(f"  turn t+1  {json.dumps(ev['next_turn'], ensure_ascii=False)}", markup=False)


