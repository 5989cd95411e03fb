"""A tokenizer directory's chat template and tokenizer: each assistant turn rendered and tokenized exactly.

A trained turn's record is ``apply_chat_template(messages[:k+1])`` tokenized, the loss on what the turn
generated: after the generation prompt (``apply_chat_template(messages[:k], add_generation_prompt=True)``, a
prefix of the turn's text) through its end-of-turn token (the last special token of the turn's text when
only whitespace follows it). Token spans come from the tokenizer's character offsets, so a token that
straddles a boundary counts as generated.

Two things make this fast without changing a single token:
- **Rendering** uses jinja2 in the environment ``transformers`` builds for ``apply_chat_template`` (sandboxed,
  ``trim_blocks``/``lstrip_blocks``, its ``tojson``, ``raise_exception``, ``strftime_now``, ``namespace``,
  the ``{% generation %}`` tag) and prepares messages as it does (keys whose value is None dropped, reasoning
  under ``reasoning_content``/``thinking``), so ``transformers`` is not imported (its import pulls torch:
  ~5 s). The sandbox's attribute checks depend only on (type, attribute), so they are memoised, and a plain
  dict's keys are read without the AttributeError the sandbox raises first: rendering the 1,787 turns of
  tau-bench retail costs 0.18 s of CPU against 0.68 s through ``apply_chat_template``.
- **Tokenizing** cuts each text at the added tokens the Rust tokenizer itself isolates before anything else
  (non-normalised, no lstrip/rstrip/single_word), encodes each distinct piece once and concatenates. Turn
  t+1 repeats turn t's history and every conversation repeats the system prompt, so on tau-bench only
  615k of 6.67M tokens are encoded (cold BPE on this text runs at ~450k tokens/s per core). Tokenizers
  whose pre-tokenizer looks at the position in the whole input (Metaspace ``prepend_scheme="first"``) are
  encoded whole; the first texts are always checked against a whole encoding, and a mismatch switches the
  cache off. The Rust tokenizer releases the GIL: a chunk encodes in a background thread while the next
  one renders (`submit` / `collect`).
"""

from __future__ import annotations

import bisect
import json
import re
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import ClassVar

import numpy as np

from treepack.errors import TreepackError

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers' names for a message's reasoning
CACHE_MAX_TOKENS = 8_000_000  # the piece cache is emptied past this (~32 MB of ids + the piece strings)
CHECK_TOKENS = 64_000  # tokens of the first texts checked against a whole encoding
DICT_ATTRIBUTES = frozenset(dir(dict))
EXTRA = "pip install 'treepack[chat]'"


class ChatTemplateError(TreepackError):
    """The chat template raised while rendering a conversation (the message names the exception)."""


@dataclass
class Turn:
    """One assistant turn rendered as the last message: what the trainer sees at that turn."""

    message: int  # index of the assistant message in the conversation
    ids: np.ndarray  # int32 tokens of apply_chat_template(messages[:message + 1])
    gen_start: int  # first token the turn generated (after the generation prompt)
    gen_end: int  # one past the turn's end-of-turn token
    text: str  # the rendered text
    prompt_is_prefix: bool  # the generation-prompt rendering is a prefix of the text (else: common prefix)


def _require():
    try:
        import jinja2  # noqa: F401
        import tokenizers  # noqa: F401
    except ImportError as exc:
        raise TreepackError(f"chat input needs the optional packages 'tokenizers' and 'jinja2' ({exc.name} is "
                            f"missing): {EXTRA}") from None


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def prepare_messages(messages: list[dict]) -> list[dict]:
    """Messages as ``apply_chat_template`` hands them to the template: None-valued keys dropped, reasoning aliased."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def without_reasoning(message: dict) -> dict:
    """An assistant message without its reasoning (fields, and a leading ``<think>...</think>`` in content)."""
    m = {k: v for k, v in message.items() if k not in REASONING_FIELDS}
    content = m.get("content")
    if isinstance(content, str) and "</think>" in content:
        m["content"] = content.split("</think>")[-1].lstrip("\n")
    return m


def compile_template(source: str):
    """The template compiled in transformers' chat-template environment (sandboxed, memoised checks)."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):  # {% generation %}...{% endgeneration %}: renders its body
        tags: ClassVar[set[str]] = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class Environment(ImmutableSandboxedEnvironment):
        def __init__(self, **kw):
            super().__init__(**kw)
            self._safe: dict = {}

        def getattr(self, obj, attribute):
            # `message.content` on a plain dict: the base method first raises and catches AttributeError (the
            # key is no dict attribute), then subscripts. Same outcome, without the exception: 2x less rendering.
            if type(obj) is dict and attribute not in DICT_ATTRIBUTES:
                try:
                    return obj[attribute]
                except KeyError:
                    return self.undefined(obj=obj, name=attribute)
            return super().getattr(obj, attribute)

        def is_safe_attribute(self, obj, attr, value):  # depends on type(obj) and attr only
            key = (type(obj), attr)
            ok = self._safe.get(key)
            if ok is None:
                ok = self._safe[key] = super().is_safe_attribute(obj, attr, value)
            return ok

    class Namespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} starts with an underscore")

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = Environment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=TemplateDict(), namespace=Namespace)
    return env.from_string(source)


def _metaspace_first(node) -> bool:
    """A pre-tokenizer that treats the start of the whole input specially (pieces cannot be encoded alone)."""
    if isinstance(node, dict):
        if node.get("type") == "Metaspace" and node.get("prepend_scheme", "always") == "first":
            return True
        return any(_metaspace_first(v) for v in node.values())
    if isinstance(node, list):
        return any(_metaspace_first(v) for v in node)
    return False


class ChatTokenizer:
    """A tokenizer directory (``tokenizer.json`` + chat template): render and tokenize chat turns."""

    def __init__(self, directory: str | Path, *, template_kwargs: dict | None = None, segmented: bool = True):
        _require()
        import tokenizers

        d = Path(directory)
        if d.is_file():
            raise TreepackError(f"{d}: a file, not a tokenizer directory (the directory holding tokenizer.json "
                                "and the chat template)")
        if not d.is_dir():
            raise TreepackError(f"{d}: tokenizer directory not found")
        tj_path = d / "tokenizer.json"
        if not tj_path.is_file():
            raise TreepackError(f"{d}: no tokenizer.json (a fast tokenizer's file is needed)")
        cfg_path = d / "tokenizer_config.json"
        try:
            cfg = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}
            tj_text = tj_path.read_text(encoding="utf-8")
            tj = json.loads(tj_text)
            self.tokenizer = tokenizers.Tokenizer.from_str(tj_text)
        except Exception as exc:  # noqa: BLE001 - json, OS and the Rust tokenizer (plain Exception) alike
            raise TreepackError(f"{d}: cannot load the tokenizer ({type(exc).__name__}: {exc})") from None
        if (d / "special_tokens_map.json").is_file():
            for k, v in json.loads((d / "special_tokens_map.json").read_text(encoding="utf-8")).items():
                cfg.setdefault(k, v)
        self.directory = d
        self.templates = self._templates(d, cfg)
        self.special_tokens = {k: _token_text(cfg[k]) for k in SPECIAL_TOKEN_KEYS if cfg.get(k) is not None}
        self.template_kwargs = dict(template_kwargs or {})
        self._compiled: dict[str, object] = {}

        added = [t for t in tj.get("added_tokens", []) if t.get("content")]
        self.special_ids = {t["id"] for t in added if t.get("special")}
        raw = sorted((t for t in added if not t.get("normalized")), key=lambda t: -len(t["content"]))
        self._cut_ids = {t["content"]: t["id"] for t in raw
                         if not (t.get("lstrip") or t.get("rstrip") or t.get("single_word"))}
        self._special_text = sorted({t["content"] for t in added if t.get("special")}, key=len, reverse=True)
        self._all_cut = len(self._cut_ids) == len(raw)
        self._added_re = re.compile("(" + "|".join(re.escape(t["content"]) for t in raw) + ")") if raw else None
        self.segmented = segmented and not _metaspace_first(tj.get("pre_tokenizer")) \
            and not _metaspace_first(tj.get("normalizer"))
        self.segment_note = "" if self.segmented or not segmented else "the pre-tokenizer depends on the input start"
        self._cache: dict[str, np.ndarray] = {}  # piece -> its token ids
        self._offsets: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._cache_tokens = 0
        self._checked = 0
        self._inflight: set[str] = set()  # pieces a submitted chunk is encoding
        self._pool: ThreadPoolExecutor | None = None
        self.n_encoded_tokens = 0  # tokens the Rust tokenizer encoded (the rest came from the piece cache)

    # ----------------------------------------------------------------------------------------------
    # Rendering

    @staticmethod
    def _templates(d: Path, cfg: dict) -> dict[str, str]:
        tmpl = cfg.get("chat_template")
        if (d / "chat_template.jinja").is_file():
            tmpl = (d / "chat_template.jinja").read_text(encoding="utf-8")
        elif (d / "chat_template.json").is_file():
            tmpl = json.loads((d / "chat_template.json").read_text(encoding="utf-8")).get("chat_template", tmpl)
        if isinstance(tmpl, list):
            tmpl = {t["name"]: t["template"] for t in tmpl}
        if isinstance(tmpl, str):
            tmpl = {"default": tmpl}
        if not tmpl:
            raise TreepackError(f"{d}: the tokenizer has no chat template (tokenizer_config.json 'chat_template' "
                                f"or chat_template.jinja)")
        return tmpl

    def _template(self, tools):
        name = "tool_use" if tools is not None and "tool_use" in self.templates else "default"
        if name not in self.templates:
            raise TreepackError(f"{self.directory}: several chat templates and none named 'default' "
                                f"({', '.join(sorted(self.templates))})")
        t = self._compiled.get(name)
        if t is None:
            try:
                t = self._compiled[name] = compile_template(self.templates[name])
            except Exception as exc:  # noqa: BLE001 - jinja2.TemplateSyntaxError and friends
                raise TreepackError(f"{self.directory}: the chat template does not compile "
                                    f"({type(exc).__name__}: {exc})") from None
        return t

    def render(self, messages: list[dict], tools: list | None = None, *, add_generation_prompt: bool = False,
               prepared: bool = False) -> str:
        """``apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=...)``."""
        template = self._template(tools)
        if not prepared:
            messages = prepare_messages(messages)
        try:
            return template.render(messages=messages, tools=tools, documents=None,
                                   add_generation_prompt=add_generation_prompt,
                                   **{**self.special_tokens, **self.template_kwargs})
        except Exception as exc:  # noqa: BLE001 - a template can raise anything; it is the record's error
            text = " ".join(str(exc).split())
            raise ChatTemplateError(f"{type(exc).__name__}: {text}" if text else type(exc).__name__) from None

    # ----------------------------------------------------------------------------------------------
    # Tokenizing

    def _pieces(self, text: str) -> list[str]:
        """The text cut at the added tokens the tokenizer isolates first (tokens are pieces of their own)."""
        if self._added_re is None:
            return [text] if text else []
        parts = self._added_re.split(text)
        if self._all_cut:
            return [p for p in parts if p]
        out: list[str] = []
        buf = ""
        for j, p in enumerate(parts):
            if j % 2 and p in self._cut_ids:
                if buf:
                    out.append(buf)
                out.append(p)
                buf = ""
            else:
                buf += p
        if buf:
            out.append(buf)
        return out

    def _piece_offsets(self, piece: str) -> tuple[np.ndarray, np.ndarray]:
        off = self._offsets.get(piece)
        if off is None:
            o = np.asarray(self.tokenizer.encode(piece, add_special_tokens=False).offsets, np.int32).reshape(-1, 2)
            off = self._offsets[piece] = (o[:, 0].copy(), o[:, 1].copy())
        return off

    def _clear(self) -> None:
        self._cache.clear()
        self._offsets.clear()
        self._cache_tokens = 0

    def _assemble(self, pieces: list[list[str]]) -> list[Encoded]:
        cache = self._cache
        out = []
        for ps in pieces:
            parts = [cache[p] for p in ps]
            ids = np.concatenate(parts) if parts else np.zeros(0, np.int32)
            out.append(Encoded(ids, ps, [len(x) for x in parts], self._piece_offsets))
        return out

    def _whole(self, texts: list[str], encodings) -> list[Encoded]:
        out = []
        for text, enc in zip(texts, encodings):
            ids = np.asarray(enc.ids, dtype=np.int32)
            off = np.asarray(enc.offsets, dtype=np.int32).reshape(-1, 2)
            known = (off[:, 0].copy(), off[:, 1].copy())
            out.append(Encoded(ids, [text], [len(ids)], lambda _piece, known=known: known))
            self.n_encoded_tokens += len(ids)
        return out

    def _agrees(self, texts: list[str], encoded: list[Encoded]) -> bool:
        """The piece-wise tokens equal a whole encoding (checked on the first CHECK_TOKENS tokens)."""
        for text, enc in zip(texts, encoded):
            if self._checked >= CHECK_TOKENS:
                break
            whole = self.tokenizer.encode(text, add_special_tokens=False).ids
            self._checked += len(whole)
            if enc.ids.tolist() != whole:
                return False
        return True

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    # ----------------------------------------------------------------------------------------------
    # Turns

    def render_turns(self, messages: list[dict], tools: list | None = None, *,
                     turns: list[int] | None = None, drop_reasoning: bool = False) -> list[Turn]:
        """Every assistant message (or the indices ``turns``) rendered as the last message and tokenized.

        ``drop_reasoning``: earlier assistant messages lose their reasoning (``reasoning_content`` and a
        ``<think>...</think>`` opening their content) before rendering; the turn itself keeps its own.
        Raises `ChatTemplateError` when the template fails.
        """
        out = self.render_many([(messages, tools, turns)], drop_reasoning=drop_reasoning)[0]
        if isinstance(out, ChatTemplateError):
            raise out
        return out

    def render_many(self, items: list[tuple], *, drop_reasoning: bool = False) -> list[list[Turn] | ChatTemplateError]:
        """`render_turns` of many conversations ``(messages, tools, turns)`` with one tokenizer call.

        Small conversations (a GSM8K answer) tokenize ~2x faster in one batch of many than one by one: the
        Rust tokenizer spreads a batch over the cores. A conversation whose template fails gets its error.
        """
        return self.collect(self.submit(items, drop_reasoning=drop_reasoning))

    def submit(self, items: list[tuple], *, drop_reasoning: bool = False) -> _Job:
        """Render ``items`` now and start tokenizing them in a background thread; `collect` finishes.

        The Rust tokenizer releases the GIL, so the next chunk renders (Python) while this one encodes.
        """
        rendered: list = []
        for messages, tools, turns in items:
            messages = prepare_messages(messages)
            if turns is None:
                turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
            if drop_reasoning:
                bare = [without_reasoning(m) if m.get("role") == "assistant" else m for m in messages]
                views = [bare[:k] + [messages[k]] for k in turns]
            else:
                views = [messages[: k + 1] for k in turns]
            try:
                texts = [self.render(v, tools, prepared=True) for v in views]
                prompts = [self.render(v[:-1], tools, add_generation_prompt=True, prepared=True) for v in views]
            except ChatTemplateError as exc:
                rendered.append(exc)
                continue
            rendered.append((turns, texts, prompts))
        job = _Job(rendered, [t for r in rendered if not isinstance(r, ChatTemplateError) for t in r[1]])
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="treepack-tokenize")
        if self.segmented:
            if self._cache_tokens > CACHE_MAX_TOKENS and not self._inflight:
                self._clear()
            job.pieces = [self._pieces(t) for t in job.texts]
            todo = []
            for p in dict.fromkeys(p for ps in job.pieces for p in ps):
                if p in self._cache or p in self._inflight:
                    continue
                if p in self._cut_ids:
                    self._cache[p] = np.array([self._cut_ids[p]], np.int32)
                else:
                    todo.append(p)
                    self._inflight.add(p)
            job.todo = todo
            if todo:  # ids only: offsets are needed only where a turn starts or ends inside a piece (rare)
                batch = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)  # tokenizers>=0.21
                job.future = self._pool.submit(batch, todo, False)
        else:
            job.future = self._pool.submit(self.tokenizer.encode_batch, job.texts, False)
        return job

    def collect(self, job: _Job) -> list[list[Turn] | ChatTemplateError]:
        """The turns of a submitted chunk (waits for its tokens)."""
        result = job.future.result() if job.future is not None else []
        if job.pieces is None:  # whole texts
            encoded = self._whole(job.texts, result)
        else:
            for p, enc in zip(job.todo, result):
                ids = self._cache[p] = np.asarray(enc.ids, dtype=np.int32)
                self._inflight.discard(p)
                self._cache_tokens += len(ids)
                self.n_encoded_tokens += len(ids)
            encoded = self._assemble(job.pieces)
            if self._checked < CHECK_TOKENS and not self._agrees(job.texts, encoded):
                self.segmented = False
                self.segment_note = "pieces encoded alone differed from the whole text"
                self._clear()
                encoded = self._whole(job.texts, self.tokenizer.encode_batch(job.texts, add_special_tokens=False))
        encoded = iter(encoded)
        out: list = []
        for r in job.rendered:
            if isinstance(r, ChatTemplateError):
                out.append(r)
                continue
            turns_of = []
            for k, text, prompt in zip(*r):
                enc = next(encoded)
                is_prefix = text.startswith(prompt)
                g = len(prompt) if is_prefix else _common_prefix(text, prompt)
                e = self._end_of_turn(text, g)
                turns_of.append(Turn(k, enc.ids, enc.first_token_ending_after(g), enc.first_token_starting_at(e),
                                     text, is_prefix))
            out.append(turns_of)
        return out

    def _end_of_turn(self, text: str, start: int) -> int:
        """Character end of the turn: after its last special token if only whitespace follows, else the end."""
        tail = text[start:]
        stripped = tail.rstrip()
        for tok in self._special_text:
            if stripped.endswith(tok):
                return start + len(stripped)
        return len(text)


@dataclass
class _Job:
    """A chunk rendered and being tokenized: its texts, their pieces, the pieces sent to the tokenizer."""

    rendered: list  # per conversation: (turn indices, texts, prompts) or its ChatTemplateError
    texts: list[str]
    pieces: list[list[str]] | None = None  # None: whole texts (the piece cache is off)
    todo: list[str] = field(default_factory=list)
    future: Future | None = None


class Encoded:
    """Token ids of one text, and its pieces (chars, token counts) to map a character to a token index."""

    __slots__ = ("_char0", "_offsets", "_pieces", "_tok0", "ids")

    def __init__(self, ids: np.ndarray, pieces: list[str], counts: list[int], offsets):
        self.ids = ids
        self._pieces = pieces
        self._offsets = offsets  # piece text -> (token starts, token ends) in chars, computed on demand
        self._char0 = [0]
        self._tok0 = [0]
        for p, n in zip(pieces, counts):
            self._char0.append(self._char0[-1] + len(p))
            self._tok0.append(self._tok0[-1] + n)

    def _locate(self, x: int) -> tuple[int, int]:
        k = bisect.bisect_right(self._char0, x) - 1
        return k, x - self._char0[k]

    def first_token_ending_after(self, x: int) -> int:
        """Index of the first token whose characters end after char ``x`` (len(ids) if none)."""
        k, rel = self._locate(x)
        if k >= len(self._pieces):
            return len(self.ids)
        if rel == 0:
            return self._tok0[k]
        return self._tok0[k] + int(np.searchsorted(self._offsets(self._pieces[k])[1], rel, side="right"))

    def first_token_starting_at(self, x: int) -> int:
        """Index of the first token that starts at or after char ``x`` (len(ids) if none)."""
        k, rel = self._locate(x)
        if k >= len(self._pieces):
            return len(self.ids)
        if rel == 0:
            return self._tok0[k]
        return self._tok0[k] + int(np.searchsorted(self._offsets(self._pieces[k])[0], rel, side="left"))


def _common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix (binary search on slice equality: C speed)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
