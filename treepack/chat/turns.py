"""Chat transcripts -> rollout records: one record per trained assistant turn, and the drift report.

A record is what the trainer sees at a turn: the chat template's rendering of the conversation through
that assistant message, ``loss_mask`` = 1 on the tokens the turn generated (through its end-of-turn token),
``tree_id`` = the conversation's scope (its task or group when the input names one), ``id`` =
``<conversation>/turn<j>``; reward and every other field of the input record ride along. Records come out
as a `Rollouts` batch (what ``stats``, ``pack``, ``plot`` and ``report`` take) or as JSONL / Parquet files
(what ``treepack tokenize`` writes).

Options are the usual choices: every assistant turn or the last only, earlier reasoning as the template
renders it or dropped, or kept exactly as generated (``keep``: each turn extends the previous turn's
tokens, the same as ``keep_prefix_tokens``), system messages and tool schemas in or out. The drift analysis
(`treepack.chat.drift`) runs on every conversation; its consistent records are built only when they are
wanted (``keep_prefix_tokens``, or ``consistent=True`` to measure the if-consistent POR).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import math
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from treepack.chat.conversations import (
    CHAT_SUFFIXES,
    Conversation,
    RecordError,
    conversations_of,
    file_stem,
    is_parquet,
    iter_raw,
)
from treepack.chat.drift import DriftStats, analyse
from treepack.chat.template import ChatTemplateError, ChatTokenizer
from treepack.errors import ConfigError, InputError
from treepack.io.atomic import atomic_file
from treepack.io.rollouts import Rollouts, Source

TURNS = ("all", "last")
REASONING = ("template", "drop", "keep")
RECORD_FIELDS = ("id", "tree_id", "conversation", "turn", "input_ids", "loss_mask")
TOKEN_FIELDS = ("tokens", "token_ids", "logprobs", "group_id")  # would be read back as record fields: not carried
MAX_EXAMPLES = 5
CHUNK_CHARS = 1 << 20  # conversations are rendered and tokenized in chunks of about this much text: one
#   chunk tokenizes (Rust, GIL released) while the next renders; 1 MB chunks: 1.35M tok/s on GSM8K, 0.9M at 4 MB
CHUNK_RECORDS = 256


@dataclass
class ChatOptions:
    """How conversations become records."""

    turns: str = "all"  # all: a record per assistant turn; last: the last assistant turn only
    reasoning: str = "template"  # template: as the chat template renders it; drop: removed from earlier
    #   turns first; keep: earlier turns keep their tokens as generated (implies keep_prefix_tokens)
    system: bool = True  # keep system messages
    tools: bool = True  # pass the record's tool schemas to the template
    keep_prefix_tokens: bool = False  # each turn = previous turn's tokens + the newly rendered suffix
    template_kwargs: dict = field(default_factory=dict)  # extra template variables (enable_thinking=False)

    def __post_init__(self):
        if self.turns not in TURNS:
            raise ConfigError(f"turns must be one of {', '.join(TURNS)}, got {self.turns!r}")
        if self.reasoning not in REASONING:
            raise ConfigError(f"reasoning must be one of {', '.join(REASONING)}, got {self.reasoning!r}")
        if self.reasoning == "keep":
            self.keep_prefix_tokens = True


@dataclass
class ChatRecords:
    """The records of some chat files, fresh and (when built) consistent, with what they carry."""

    fresh: Rollouts  # every record as the template renders it
    consistent: Rollouts | None  # the same records with each turn's history spliced from the turn before
    options: ChatOptions
    turn: np.ndarray  # int64 [n] assistant-turn ordinal of each record
    conversation: np.ndarray  # int64 [n] index into conversation_ids / fields
    conversation_ids: list[str]
    fields: list[dict]  # per conversation: fields carried into its records
    drift: dict[str, DriftStats]  # per input file
    seconds: float = 0.0
    encoded_tokens: int = 0  # tokens the tokenizer encoded (the rest came from repeated pieces)
    tokenizer_note: str = ""  # why the piece cache was off, if it was
    dropped_fields: Counter = field(default_factory=Counter)  # carried fields that would clash with a record's
    prompt_not_prefix: int = 0  # turns whose generation prompt is not a prefix of their text (loss from the
    #   common prefix on; a template whose add_generation_prompt changes earlier text)

    @property
    def rollouts(self) -> Rollouts:
        """The records to use: consistent with ``keep_prefix_tokens``, fresh otherwise."""
        return self.consistent if self.options.keep_prefix_tokens else self.fresh

    def rollouts_with_records(self) -> Rollouts:
        """`rollouts` with each record kept as `iter_chat_records` writes it (``Rollouts.extras``): what `pack`
        puts in its shards for `unpack`, the same records `treepack tokenize` writes."""
        from treepack.io.extras import CARRY_MASK_INT, CARRY_TOKENS, Extras, template

        r = self.rollouts
        carry = CARRY_TOKENS | CARRY_MASK_INT
        r.extras = Extras(tokens_field="input_ids", carry=np.full(len(r), carry, dtype=np.uint8),
                          templates=[template(rec, "input_ids", carry) for rec in iter_chat_records(self)])
        return r

    @property
    def total(self) -> DriftStats:
        out = DriftStats()
        for st in self.drift.values():
            out.add(st, MAX_EXAMPLES)
        return out


def expand_chat_paths(paths: Iterable[str]) -> list[str]:
    """Files to read: directories expand to their chat files (.jsonl[.gz], .json[.gz], .parquet), sorted."""
    out: list[str] = []
    for p in map(str, paths):
        path = Path(p)
        if p == "-" or path.is_file():
            out.append(p)
        elif path.is_dir():
            files = sorted(str(f) for f in path.iterdir() if f.is_file() and f.name.endswith(CHAT_SUFFIXES))
            if not files:
                raise InputError(f"{p}: directory has no .jsonl, .json or .parquet files")
            out.extend(files)
        else:
            raise InputError(f"{p}: no such file")
    if not out:
        raise InputError("no input files given")
    return out


class _Builder:
    def __init__(self, with_consistent: bool):
        self.fresh: list[np.ndarray] = []
        self.fresh_mask: list[np.ndarray] = []
        self.cons: list[np.ndarray] | None = [] if with_consistent else None
        self.cons_mask: list[np.ndarray] | None = [] if with_consistent else None
        self.ids: list[str] = []
        self.trees: list = []
        self.turn: list[int] = []
        self.conv: list[int] = []
        self.rewards: list = []
        self.advantages: list = []
        self.steps: list = []

    @staticmethod
    def mask(n: int, a: int, b: int) -> np.ndarray:
        m = np.zeros(n, dtype=np.uint8)
        m[a:b] = 1
        return m

    def rollouts(self, tokens, masks, sources, skipped, examples) -> Rollouts:
        lengths = np.fromiter((len(t) for t in tokens), dtype=np.int64, count=len(tokens))
        offsets = np.zeros(len(tokens) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        codes: dict = {}
        names: list = []
        groups = np.empty(len(self.trees), dtype=np.int64)
        for i, g in enumerate(self.trees):
            key = (type(g).__name__, g)
            c = codes.get(key)
            if c is None:
                c = codes[key] = len(names)
                names.append(g)
            groups[i] = c

        def floats(values):
            if all(v is None for v in values):
                return None
            return np.asarray([math.nan if v is None else float(v) for v in values], dtype=np.float64)

        return Rollouts(
            tokens=np.concatenate(tokens).astype(np.int32, copy=False) if tokens else np.zeros(0, np.int32),
            offsets=offsets,
            ids=list(self.ids),
            loss_mask=np.concatenate(masks) if masks else np.zeros(0, np.uint8),
            groups=groups,
            group_names=names,
            steps=(np.asarray([-1 if s is None else s for s in self.steps], dtype=np.int64)
                   if any(s is not None for s in self.steps) else None),
            advantages=floats(self.advantages),
            rewards=floats(self.rewards),
            sources=sources,
            skipped=skipped,
            skipped_examples=examples,
        )


def tokenize_chats(
    paths: str | os.PathLike | Iterable[str | os.PathLike],
    tokenizer: ChatTokenizer | str | os.PathLike,
    options: ChatOptions | None = None,
    *,
    on_error: str = "raise",
    progress: Callable[[int], None] | None = None,
    consistent: bool = False,
    max_examples: int = MAX_EXAMPLES,
) -> ChatRecords:
    """Render and tokenize every conversation of ``paths`` into records (see the module docstring).

    ``on_error``: ``"raise"`` stops at the first bad record with an `InputError` naming file, line (or row)
    and field; ``"skip"`` counts bad records per reason. ``progress`` is called with input bytes done.
    ``consistent``: also build the consistent records (always built with ``keep_prefix_tokens``).
    """
    options = options or ChatOptions()
    if on_error not in ("raise", "skip"):
        raise ConfigError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files = expand_chat_paths(paths)
    ct = tokenizer if isinstance(tokenizer, ChatTokenizer) else ChatTokenizer(tokenizer,
                                                                              template_kwargs=options.template_kwargs)
    with_consistent = consistent or options.keep_prefix_tokens
    state = _State(ct, options, with_consistent, on_error, max_examples)
    t0 = time.perf_counter()
    for path in files:
        name = "<stdin>" if path == "-" else path
        src = Source(path=path, sha256=_sha256(path), format="chat-parquet" if is_parquet(path) else "chat")
        state.start_file(name, src)
        stem = file_stem(path)
        for where, index, rec, span in iter_raw(path):
            if index < 0 and rec is None:  # a blank line
                state.pending.append((None, where, None, span))
            elif isinstance(rec, RecordError):
                state.pending.append((None, where, rec, span))
            else:
                try:
                    convs = conversations_of(rec, default_id=f"{stem}:{index}", where=where)
                except RecordError as err:
                    state.pending.append((None, where, err, span))
                else:
                    state.pending.append((convs, where, None, span))
                    state.pending_chars += sum(_size(c) for c in convs)
            if state.pending_chars >= CHUNK_CHARS or len(state.pending) >= CHUNK_RECORDS:
                state.flush(progress)
        state.flush(progress, last=True)
        state.sources.append(src)
    seconds = time.perf_counter() - t0
    b = state.b
    fresh = b.rollouts(b.fresh, b.fresh_mask, state.sources, state.skipped, state.examples)
    cons = b.rollouts(b.cons, b.cons_mask, state.sources, state.skipped, state.examples) if with_consistent else None
    return ChatRecords(
        fresh=fresh, consistent=cons, options=options, turn=np.asarray(b.turn, dtype=np.int64),
        conversation=np.asarray(b.conv, dtype=np.int64), conversation_ids=state.conv_ids, fields=state.conv_fields,
        drift=state.drift, seconds=seconds, encoded_tokens=ct.n_encoded_tokens - state.encoded_before,
        tokenizer_note=ct.segment_note, dropped_fields=state.dropped, prompt_not_prefix=state.prompt_not_prefix,
    )


def _size(conv: Conversation) -> int:
    """Characters of a conversation's contents (what rendering it costs, roughly)."""
    return sum(len(m["content"]) for m in conv.messages if isinstance(m.get("content"), str)) + 64 * len(conv.messages)


class _State:
    """The records built so far, and the records read but not yet rendered (rendered in chunks)."""

    def __init__(self, ct: ChatTokenizer, options: ChatOptions, with_consistent: bool, on_error: str,
                 max_examples: int):
        self.ct, self.options, self.on_error, self.max_examples = ct, options, on_error, max_examples
        self.with_consistent = with_consistent
        self.b = _Builder(with_consistent)
        self.conv_ids: list[str] = []
        self.conv_fields: list[dict] = []
        self.drift: dict[str, DriftStats] = {}
        self.sources: list[Source] = []
        self.skipped: Counter = Counter()
        self.examples: list[str] = []
        self.dropped: Counter = Counter()
        self.encoded_before = ct.n_encoded_tokens
        self.pending: list[tuple] = []  # (conversations | None, where, RecordError | None, input bytes)
        self.pending_chars = 0
        self.running: tuple | None = None  # the chunk being tokenized: (records, views, job)
        self.prompt_not_prefix = 0

    def start_file(self, name: str, src: Source) -> None:
        self.name, self.src = name, src
        self.st = self.drift[name] = DriftStats()

    def fail(self, where: str, err: RecordError) -> None:
        full = f"{self.name}: {where}: {err.message}"
        if self.on_error != "skip":
            raise InputError(full)
        self.skipped[err.reason] += 1
        self.src.n_skipped += 1
        if len(self.examples) < 5:
            self.examples.append(full)

    def flush(self, progress, *, last: bool = False) -> None:
        """Render the pending records and start their tokenization; finish the chunk before (pipelined)."""
        views = [_view(conv, self.options) for convs, _, _, _ in self.pending for conv in convs or ()]
        job = self.ct.submit([v[:3] for v in views], drop_reasoning=self.options.reasoning == "drop") if views else None
        if self.running is not None:
            self._finish(*self.running, progress)
        self.running = (self.pending, views, job)
        self.pending = []
        self.pending_chars = 0
        if last:  # a file's records are finished before the next file starts
            self._finish(*self.running, progress)
            self.running = None

    def _finish(self, pending: list, views: list, job, progress) -> None:
        results = iter(self.ct.collect(job) if job is not None else ())
        views_it = iter(views)
        for convs, where, err, span in pending:
            if err is not None:
                self.fail(where, err)
            elif convs is not None:
                done = [(conv, next(views_it), next(results)) for conv in convs]
                bad = next(((c, v, r) for c, v, r in done if isinstance(r, ChatTemplateError)), None)
                if bad is not None:
                    conv, view, err = bad
                    first = " (the turn to train is the first message, with no prompt before it)" if view[2][:1] == [0] else ""
                    self.fail(where, RecordError("template render failure",
                                                 f"field {conv.part!r}: the chat template failed to render: {err}{first}"))
                elif (empty := _empty_turn(done)) is not None:
                    self.fail(where, empty)
                else:
                    for conv, view, turns in done:
                        self.add(conv, turns, view[3], view[4])
            if progress is not None:
                progress(int(span))

    def add(self, conv: Conversation, turns: list, ordinals: list[int], trained: list[int]) -> None:
        b, st = self.b, self.st
        cst, recs = analyse(turns, conversation=conv.id, ordinals=ordinals, special_ids=self.ct.special_ids,
                            decode=self.ct.decode, max_examples=max(0, self.max_examples - len(st.examples)),
                            consistent=self.with_consistent)
        ci = len(self.conv_ids)
        self.conv_ids.append(conv.id)
        carried = {}
        for k, v in conv.fields.items():
            if k in RECORD_FIELDS or k in TOKEN_FIELDS:
                self.dropped[k] += 1
            else:
                carried[k] = v
        self.conv_fields.append(carried)
        for i in trained:
            t = turns[i]
            self.prompt_not_prefix += not t.prompt_is_prefix
            b.fresh.append(t.ids)
            b.fresh_mask.append(b.mask(len(t.ids), t.gen_start, t.gen_end))
            if recs is not None:
                r = recs[i]
                b.cons.append(r.ids)
                b.cons_mask.append(b.mask(len(r.ids), r.gen_start, r.gen_end))
                cst.records_differ += int(r.ids is not t.ids and not np.array_equal(r.ids, t.ids))
            b.ids.append(f"{conv.id}/turn{ordinals[i]}")
            b.trees.append(conv.tree_id)
            b.turn.append(ordinals[i])
            b.conv.append(ci)
            b.rewards.append(conv.fields.get("reward"))
            b.advantages.append(conv.fields.get("advantage"))
            b.steps.append(conv.fields.get("step"))
        cst.records = len(trained)
        st.add(cst, self.max_examples)
        self.src.n_records += len(trained)


def _empty_turn(done: list) -> RecordError | None:
    """A turn to train that the template rendered to nothing, or to no tokens of the turn's own (a template
    that drops assistant messages): an empty record, or one with nothing to learn, is the record's error."""
    for conv, view, turns in done:
        for i in view[4]:
            t = turns[i]
            if len(t.ids) == 0 or t.gen_end <= t.gen_start:
                what = "no tokens" if len(t.ids) == 0 else "none of the turn's own tokens (only its prompt)"
                return RecordError("empty render", f"field {conv.part!r}: turn {view[3][i]} renders {what} "
                                                   "with this chat template")
    return None


def _view(conv: Conversation, options: ChatOptions):
    """(messages, tools, rendered turn indices, their assistant ordinals, positions of the trained ones)."""
    messages, turns = conv.messages, conv.turns
    if not options.system:
        keep = [i for i, m in enumerate(messages) if m.get("role") != "system"]
        new = {old: new for new, old in enumerate(keep)}
        messages = [messages[i] for i in keep]
        turns = None if turns is None else [new[i] for i in turns]
    assistant = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    rendered = assistant if turns is None else turns
    ordinal = {k: j for j, k in enumerate(assistant)}
    trained = list(range(len(rendered))) if options.turns == "all" else [len(rendered) - 1]
    return messages, conv.tools if options.tools else None, rendered, [ordinal[k] for k in rendered], trained


def _sha256(path: str) -> str:
    if path == "-":
        return ""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


# --------------------------------------------------------------------------------------------------
# Writing records


def iter_chat_records(recs: ChatRecords):
    """The records as dicts: id, tree_id, conversation, turn, input_ids, loss_mask, then the carried fields."""
    r = recs.rollouts
    for i in range(len(r)):
        c = int(recs.conversation[i])
        rec = {"id": r.ids[i], "tree_id": r.group_names[int(r.groups[i])], "conversation": recs.conversation_ids[c],
               "turn": int(recs.turn[i]), "input_ids": r.sequence(i).tolist(), "loss_mask": r.loss_mask_of(i).tolist()}
        rec.update(recs.fields[c])
        yield rec


def write_chat_records(path: str | os.PathLike, recs: ChatRecords) -> int:
    """Write the records as JSONL (``.jsonl``, ``.jsonl.gz``) or Parquet; returns the bytes written. The file
    appears whole or not at all (`treepack.io.atomic`); missing directories above it are created."""
    path = str(path)
    if not path.endswith((".parquet", ".pq", ".jsonl.gz", ".jsonl")):
        raise ConfigError(f"{path}: the output name must end in .jsonl, .jsonl.gz or .parquet")
    with atomic_file(path, make_parents=True) as tmp:
        if path.endswith((".parquet", ".pq")):
            _write_parquet(str(tmp), recs)
        else:
            with open(tmp, "wb") as raw:
                gz = gzip.GzipFile(Path(path).name, "wb", compresslevel=6, fileobj=raw) if path.endswith(".gz") else None
                with io.TextIOWrapper(gz or raw, encoding="utf-8") as f:  # the gzip header names the output
                    for rec in iter_chat_records(recs):
                        f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    return os.path.getsize(path)


def _write_parquet(path: str, recs: ChatRecords) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    r = recs.rollouts
    off = pa.array(r.offsets, type=pa.int64())
    conv = recs.conversation
    names = r.group_names
    cols = {
        "id": pa.array(r.ids, type=pa.string()),
        "tree_id": _ids_column([names[g] for g in r.groups.tolist()]),
        "conversation": pa.array([recs.conversation_ids[c] for c in conv.tolist()], type=pa.string()),
        "turn": pa.array(recs.turn, type=pa.int32()),
        "input_ids": pa.LargeListArray.from_arrays(off, pa.array(r.tokens, type=pa.int32())),
        "loss_mask": pa.LargeListArray.from_arrays(off, pa.array(r.loss_mask.astype(np.int8))),
    }
    keys = list(dict.fromkeys(k for f in recs.fields for k in f))
    for k in keys:
        per_conv = [f.get(k) for f in recs.fields]
        cols[k] = _column([per_conv[c] for c in conv.tolist()])
    pq.write_table(pa.table(cols), path, compression="zstd")


def _ids_column(values: list):
    """tree ids as they are when they share a type (all strings or all integers), else as strings."""
    import pyarrow as pa

    if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return pa.array(values, type=pa.int64())
    return pa.array([v if isinstance(v, str) else str(v) for v in values], type=pa.string())


def _column(values: list):
    """A column of carried values: Arrow's own type when the values have one, else JSON text per value."""
    import pyarrow as pa

    if all(v is None or isinstance(v, (str, bool, int, float)) for v in values):
        try:
            return pa.array(values)
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
            pass
    return pa.array([None if v is None else json.dumps(v, ensure_ascii=False) for v in values], type=pa.string())
