"""Chat transcripts in the forms people have them, read into `Conversation`s with exact error locations.

Files: JSONL (``.jsonl``, ``.jsonl.gz``, ``-``), JSON (one record, an array of records, or a tau2 results
object; ``.json``, ``.json.gz``) and Parquet; gzip is recognised by its bytes, and a compressed file that is
damaged or cut short is one error line naming it and the line where it broke (`treepack.io.streams`). Records:
- ``messages`` (+ ``tools``): OpenAI / TRL conversational; every assistant message is a turn;
- TRL ``prompt`` + ``completion`` (message lists, or strings: one user and one assistant message), and
  preference ``chosen`` / ``rejected`` with or without ``prompt`` (one conversation each, one tree per
  record): the completion's assistant messages are the turns, the prompt is context;
- tau-bench results (an array of ``{task_id, trial, reward, info, traj}``) and tau2-bench results
  (``{info, tasks, simulations: [{id, task_id, trial, messages, reward_info}]}``, tool calls as
  ``{id, name, arguments}``, tool results as ``{role: tool, id}``; the user simulator's own tool calls are
  not the agent's context and are left out; an agent turn's null content next to tool calls becomes "")
  as the benchmarks write them. tau2 keeps neither the agent's system prompt nor the tool schemas in its
  results: records render without them;
- ToolBench answer trees, Anthropic hh-rlhf dialogue text and GSM8K model solutions, as published
  (`treepack.chat.sources`).
Every other field is carried into the records. JSON files are walked element by element with
``json.JSONDecoder.raw_decode`` so that an error names the line where the bad record starts:
``chats.json: line 412: field 'messages'[3].role: unknown role 'bot' (system, developer, user, assistant, tool)``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from treepack.chat.sources import (
    gsm8k_solutions,
    hh_preference,
    is_gsm8k_solutions,
    is_hh_dialogue,
    is_toolbench_answer,
    toolbench_paths,
)
from treepack.errors import InputError
from treepack.io.json_values import unwritable
from treepack.io.jsonl import json_error_text
from treepack.io.streams import StreamError, iter_blocks

ROLES = ("system", "developer", "user", "assistant", "tool")
CONTENT_FIELDS = ("messages", "tools", "prompt", "completion", "chosen", "rejected", "traj")
ID_FIELDS = ("id", "tree_id", "group_id")
CHAT_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz", ".parquet", ".pq")


class RecordError(Exception):
    """A bad record: ``reason`` is the count key for ``--on-error skip``, ``message`` names the field."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass
class Conversation:
    """One conversation to render: which assistant messages are trained, and what every record carries."""

    messages: list[dict]
    tools: list | None
    id: str  # conversation id: records are "<id>/turn<j>"
    tree_id: str | int  # sharing scope (default: the conversation id)
    fields: dict = field(default_factory=dict)  # carried into every record of the conversation
    turns: list[int] | None = None  # message indices of the trained turns (None: every assistant message)
    where: str = ""  # "line 3" / "row 5" / "record 2"
    part: str = "messages"  # the record's field holding the trained turns (errors name it)


# --------------------------------------------------------------------------------------------------
# Validation


def _jtype(v) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null",
            int: "integer", float: "number"}.get(type(v), type(v).__name__)


def _json_value(v, name: str):
    """Lists given as JSON text (Parquet and HF datasets often store messages / tools that way)."""
    if isinstance(v, str) and v[:1] in ("[", "{"):
        try:
            return json.loads(v)
        except ValueError:
            raise RecordError(f"bad {name}", f"field {name!r} is a string but not valid JSON") from None
    return v


def check_messages(messages, name: str) -> list[dict]:
    if not isinstance(messages, list):
        raise RecordError("bad messages", f"field {name!r} must be an array of messages, got {_jtype(messages)}")
    if not messages:
        raise RecordError("no messages", f"field {name!r} is empty")
    for i, m in enumerate(messages):
        at = f"{name!r}[{i}]"
        if not isinstance(m, dict):
            raise RecordError("bad messages", f"field {at} must be an object, got {_jtype(m)}")
        role = m.get("role")
        if role not in ROLES:
            got = "missing" if role is None else f"{role!r}" if isinstance(role, str) else _jtype(role)
            raise RecordError("unknown role", f"field {at}.role: unknown role {got} ({', '.join(ROLES)})")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise RecordError("bad content", f"field {at}.content must be a string, an array of parts or null, "
                                             f"got {_jtype(content)}")
        calls = m.get("tool_calls")
        if calls is None:
            continue
        if not isinstance(calls, list):
            raise RecordError("bad tool_calls", f"field {at}.tool_calls must be an array, got {_jtype(calls)}")
        for j, call in enumerate(calls):
            if not isinstance(call, dict):
                raise RecordError("bad tool_calls", f"field {at}.tool_calls[{j}] must be an object, got {_jtype(call)}")
            fn = call.get("function", call)
            path = f"{at}.tool_calls[{j}]" + (".function" if "function" in call else "")
            if not isinstance(fn, dict):
                raise RecordError("bad tool_calls", f"field {path} must be an object, got {_jtype(fn)}")
            if not isinstance(fn.get("name"), str) or not fn["name"]:
                raise RecordError("tool call without a name", f"field {path}.name is missing" if fn.get("name") is None
                                  else f"field {path}.name must be a non-empty string, got {json.dumps(fn['name'])}")
    return messages


def _check_tools(tools):
    tools = _json_value(tools, "tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise RecordError("bad tools", f"field 'tools' must be an array of objects, got {_jtype(tools)}")
    return tools


def _check_scalars(rec: dict) -> None:
    for name in ID_FIELDS:
        v = rec.get(name)
        if v is not None and not (isinstance(v, str) or (isinstance(v, int) and not isinstance(v, bool))):
            raise RecordError(f"bad {name}", f"field {name!r} must be a string or an integer, got {_jtype(v)}")
    for name in ("reward", "advantage"):
        v = rec.get(name)
        if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)):
            raise RecordError(f"bad {name}", f"field {name!r} must be a finite number, got {json.dumps(v)}")
    v = rec.get("step")
    if v is not None and not (isinstance(v, int) and not isinstance(v, bool)):
        raise RecordError("bad step", f"field 'step' must be an integer, got {json.dumps(v)}")
    if v is not None and not 0 <= v <= 2**63 - 1:
        raise RecordError("bad step", f"field 'step' must be >= 0, got {v}" if v < 0 else f"field 'step' does not fit int64 ({v})")


# --------------------------------------------------------------------------------------------------
# Record forms -> conversations


def _as_messages(v, name: str, role: str) -> list[dict]:
    v = _json_value(v, name)
    if isinstance(v, str):
        return [{"role": role, "content": v}]
    return check_messages(v, name)


def _assistant(messages: list[dict], start: int = 0) -> list[int]:
    return [i for i in range(start, len(messages)) if messages[i].get("role") == "assistant"]


def _tau2_messages(messages) -> list[dict]:
    """tau2-bench's messages as OpenAI chat messages (the agent's view)."""
    if not isinstance(messages, list):
        raise RecordError("bad messages", f"field 'messages' must be an array of messages, got {_jtype(messages)}")
    out: list[dict] = []
    names: dict = {}
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RecordError("bad messages", f"field 'messages'[{i}] must be an object, got {_jtype(m)}")
        role = m.get("role")
        if role == "tool":
            if m.get("requestor", "assistant") != "assistant":
                continue
            out.append({"role": "tool", "tool_call_id": m.get("id"), "name": names.get(m.get("id")),
                        "content": m.get("content")})
            continue
        msg = {"role": role, "content": m.get("content")}
        calls = m.get("tool_calls")
        if calls and role == "assistant":
            msg["content"] = msg["content"] or ""  # tau2 writes null next to tool calls; most templates need a string
            if not isinstance(calls, list):
                raise RecordError("bad tool_calls", f"field 'messages'[{i}].tool_calls must be an array")
            conv = []
            for j, c in enumerate(calls):
                if not isinstance(c, dict) or not isinstance(c.get("name"), str) or not c["name"]:
                    raise RecordError("tool call without a name", f"field 'messages'[{i}].tool_calls[{j}].name is missing")
                names[c.get("id")] = c["name"]
                conv.append({"id": c.get("id"), "type": "function",
                             "function": {"name": c["name"], "arguments": c.get("arguments", {})}})
            msg["tool_calls"] = conv
        elif role == "user" and calls and not m.get("content"):
            continue  # the user simulator acting on its own tools: not part of the agent's context
        out.append(msg)
    return check_messages(out, "messages")


def conversations_of(rec, *, default_id: str, where: str) -> list[Conversation]:
    """The conversations of one record (two for a preference pair)."""
    if not isinstance(rec, dict):
        raise RecordError("not an object", f"expected a JSON object, got {_jtype(rec)}")
    if is_toolbench_answer(rec):  # a ToolBench answer tree: one conversation per root-to-leaf path
        paths = toolbench_paths(rec, default_id)
        if not paths:
            raise RecordError("ToolBench answer without train_messages",
                              "field 'answer_generation' has no train_messages (the system prompt and query to render)")
        return [c for r in paths for c in conversations_of(r, default_id=r["id"], where=where)]
    _check_scalars(rec)
    carried = {k: v for k, v in rec.items() if k not in CONTENT_FIELDS and k not in ID_FIELDS}
    tools = _check_tools(rec.get("tools"))
    rid = rec.get("id")
    tree = rec.get("tree_id", rec.get("group_id"))

    if "traj" in rec:  # tau-bench result
        messages = check_messages(_json_value(rec["traj"], "traj"), "traj")
        task, trial = rec.get("task_id"), rec.get("trial")
        cid = rid if rid is not None else (f"task{task}" + (f"/trial{trial}" if trial is not None else "")
                                           if task is not None else default_id)
        return [_conv(messages, tools, cid, tree if tree is not None else (f"task{task}" if task is not None
                                                                            else cid), carried, None, where)]
    if "messages" in rec and ("reward_info" in rec or "termination_reason" in rec) and "task_id" in rec:  # tau2
        messages = _tau2_messages(_json_value(rec["messages"], "messages"))
        info = rec.get("reward_info")
        if isinstance(info, dict) and "reward" not in rec and isinstance(info.get("reward"), (int, float)):
            carried = {"reward": info["reward"], **carried}
        carried.pop("ticks", None)
        cid = rid if rid is not None else default_id
        task = rec["task_id"]
        return [_conv(messages, tools, cid, tree if tree is not None else f"task{task}", carried, None, where)]
    if "messages" in rec:
        messages = check_messages(_json_value(rec["messages"], "messages"), "messages")
        cid = rid if rid is not None else default_id
        return [_conv(messages, tools, cid, tree if tree is not None else cid, carried, None, where)]
    if "chosen" in rec and "rejected" in rec and rec.get("prompt") is None and is_hh_dialogue(rec["chosen"]):
        pair = hh_preference(rec["chosen"], rec["rejected"]) if is_hh_dialogue(rec["rejected"]) else None
        if pair is None:
            raise RecordError("bad hh-rlhf dialogue", "fields 'chosen' / 'rejected': an hh-rlhf dialogue must end "
                                                      "with an '\\n\\nAssistant: ' reply on both sides")
        return conversations_of({**rec, **pair}, default_id=default_id, where=where)
    if "chosen" in rec and "rejected" in rec:  # preference, explicit or implicit prompt
        prompt = _as_messages(rec["prompt"], "prompt", "user") if rec.get("prompt") is not None else []
        cid = rid if rid is not None else default_id
        out = []
        for name in ("chosen", "rejected"):
            answer = _as_messages(rec[name], name, "assistant")
            messages = prompt + answer
            turns = _assistant(messages, len(prompt)) if prompt else _assistant(messages)[-1:]
            out.append(_conv(messages, tools, f"{cid}/{name}", tree if tree is not None else cid,
                             {**carried, "preference": name}, turns, where, name))
        return out
    if "prompt" in rec and "completion" in rec:
        prompt = _as_messages(rec["prompt"], "prompt", "user")
        messages = prompt + _as_messages(rec["completion"], "completion", "assistant")
        cid = rid if rid is not None else default_id
        return [_conv(messages, tools, cid, tree if tree is not None else cid, carried,
                      _assistant(messages, len(prompt)), where, "completion")]
    if is_gsm8k_solutions(rec):  # GSM8K model solutions: one conversation per model, rewarded
        qid = str(rid if rid is not None else default_id)
        return [c for r in gsm8k_solutions(rec, qid) for c in conversations_of(r, default_id=r["id"], where=where)]
    found = ", ".join(repr(k) for k in rec) or "none"
    raise RecordError("no messages", "no chat messages: expected 'messages' (or 'prompt' + 'completion', "
                                     f"'chosen' + 'rejected', tau-bench 'traj', a ToolBench answer tree, GSM8K "
                                     f"model solutions); found fields: {found}")


def _conv(messages, tools, cid, tree, carried, turns, where, part: str = "messages") -> Conversation:
    trained = turns if turns is not None else _assistant(messages)
    if not trained:
        roles = ", ".join(dict.fromkeys(str(m.get("role")) for m in messages))
        raise RecordError("no assistant message", f"field {part!r} has no assistant message to train on "
                                                  f"(roles: {roles})")
    return Conversation(messages, tools, str(cid), tree, carried, turns, where, part)


# --------------------------------------------------------------------------------------------------
# Files


def _read_bytes(path: str) -> bytes:
    """The whole file, decompressed if gzip (by its bytes, as the token-record reader has it). A compressed stream
    that is damaged or cut short is an ``InputError`` naming the file and the line where it broke
    (``chats.jsonl.gz: line 51: truncated gzip file (the compressed stream ends early, after 50 complete
    lines)``), with ``--on-error skip`` too: what came after the break is unknown."""
    name = "<stdin>" if path == "-" else path
    blocks: list[bytes] = []
    try:
        blocks.extend(iter_blocks(path))  # the blocks before a break stay: their lines are counted
    except StreamError as err:
        if err.fatal:  # not gzip at all: nothing of the file was read
            raise InputError(f"{name}: {err.message}") from None
        n = sum(b.count(b"\n") for b in blocks)
        raise InputError(f"{name}: line {n + 1}: {err.message[:-1]}, after {n:,} complete lines)") from None
    return blocks[0] if len(blocks) == 1 else b"".join(blocks)


def file_stem(path: str) -> str:
    """A file's name without its chat suffix: the default conversation ids are ``<stem>:<record index>``."""
    name = Path(path).name if path != "-" else "stdin"
    for suffix in CHAT_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def is_parquet(path: str) -> bool:
    if path == "-":
        return False
    if path.endswith((".parquet", ".pq")):
        return True
    with open(path, "rb") as f:
        return f.read(4) == b"PAR1"


Raw = tuple[str, int, object, float]  # (where, record index, record or a RecordError, input bytes it spans)


def iter_raw(path: str) -> Iterator[Raw]:
    """Every record of a chat file with its location; a malformed record comes as a RecordError."""
    if is_parquet(path):
        yield from _iter_parquet(path)
        return
    data = _read_bytes(path)
    size = len(data) if path == "-" else Path(path).stat().st_size
    try:
        text = data.decode("utf-8-sig")  # a byte order mark (Windows editors write one) is not JSON
    except UnicodeDecodeError as exc:
        yield (f"byte {exc.start}", 0, RecordError("malformed JSON", "not UTF-8"), size)
        return
    del data
    scale = size / max(len(text), 1)
    first = text.lstrip()[:1]
    as_json = path.endswith((".json", ".json.gz")) or (first == "[" and not path.endswith((".jsonl", ".jsonl.gz")))
    records = _iter_json(text) if as_json else _iter_jsonl(text)
    for where, index, rec, span in records:
        bad = unwritable(rec) if isinstance(rec, dict) else None  # NaN, Infinity, a lone surrogate: refused by name
        yield where, index, RecordError(*bad) if bad else rec, span * scale


def _iter_jsonl(text: str) -> Iterator[Raw]:
    index = 0
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            yield (f"line {lineno}", -1, None, len(line) + 1)
            continue
        try:
            rec = json.loads(line)
        except ValueError as exc:
            rec = RecordError("malformed JSON", json_error_text(exc))
        yield (f"line {lineno}", index, rec, len(line) + 1)
        index += 1


class _JsonWalker:
    """Values of a JSON document decoded one at a time, each with the line where it starts."""

    def __init__(self, text: str):
        self.text = text
        self.dec = json.JSONDecoder()
        self.pos = 0
        self.line = 1
        self._counted = 0

    def line_at(self, pos: int) -> int:
        self.line += self.text.count("\n", self._counted, pos)
        self._counted = pos
        return self.line

    def skip(self) -> str:
        n = len(self.text)
        while self.pos < n and self.text[self.pos] in " \t\r\n":
            self.pos += 1
        return self.text[self.pos] if self.pos < n else ""

    def error(self, what: str) -> RecordError:
        return RecordError("malformed JSON", f"malformed JSON ({what} at column "
                                             f"{self.pos - self.text.rfind(chr(10), 0, self.pos)})")

    def value(self):
        try:
            v, self.pos = self.dec.raw_decode(self.text, self.pos)
        except json.JSONDecodeError as exc:
            self.pos = exc.pos
            raise self.error(exc.msg) from None
        return v

    def elements(self) -> Iterator[tuple[int, object, int]]:
        """The elements of the array at the current position: (line, value or RecordError, chars spanned)."""
        self.pos += 1  # "["
        if self.skip() == "]":
            self.pos += 1
            return
        while True:
            self.skip()
            line, start = self.line_at(self.pos), self.pos
            try:
                yield line, self.value(), self.pos - start
            except RecordError as err:
                yield line, err, len(self.text) - start
                return
            c = self.skip()
            self.pos += 1
            if c == "]":
                return
            if c != ",":
                self.pos -= 1
                yield self.line_at(self.pos), self.error("expected ',' or ']'"), 0
                return


def _iter_json(text: str) -> Iterator[Raw]:
    w = _JsonWalker(text)
    c = w.skip()
    if c == "[":
        for index, (line, v, span) in enumerate(w.elements()):
            yield (f"line {line}", index, v, span)
        if w.skip():
            yield (f"line {w.line_at(w.pos)}", -1, w.error("extra data after the array"), 0)
        return
    if c == "{":  # a tau2 results file: walk its "simulations"
        sims = _find_key(w, "simulations")
        if sims:
            for index, (line, v, span) in enumerate(w.elements()):
                yield (f"line {line}", index, v, span)
            return
    w.pos = 0
    w.skip()
    line = w.line_at(w.pos)
    try:
        rec = w.value()
    except RecordError as err:
        yield (f"line {line}", 0, err, len(text))
        return
    if w.skip():  # more than one value: JSON Lines under another name
        yield from _iter_jsonl(text)
        return
    yield (f"line {line}", 0, rec if isinstance(rec, dict) else
           RecordError("not an object", f"expected a JSON object or an array of objects, got {_jtype(rec)}"), len(text))


def _find_key(w: _JsonWalker, wanted: str) -> bool:
    """Move to the array value of top-level key ``wanted`` (True), or give up at anything unexpected."""
    w.pos += 1
    try:
        while w.skip() == '"':
            key = w.value()
            if w.skip() != ":":
                return False
            w.pos += 1
            if key == wanted and w.skip() == "[":
                return True
            w.skip()
            w.value()
            if w.skip() != ",":
                return False
            w.pos += 1
    except RecordError:
        return False
    return False


def _iter_parquet(path: str) -> Iterator[Raw]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise InputError(f"{path}: not a readable Parquet file ({exc})") from None
    size = Path(path).stat().st_size / max(pf.metadata.num_rows, 1)
    row = 0
    for g in range(pf.metadata.num_row_groups):
        for rec in pf.read_row_group(g).to_pylist():
            yield (f"row {row}", row, rec, size)
            row += 1
