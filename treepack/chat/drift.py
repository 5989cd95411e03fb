"""Retokenization drift: where re-rendered history stops sharing the tokens of the turn before.

At turn t the model saw and produced the tokens R_t (turn t's record, rendered with the template). A trainer
that re-renders the conversation from text for turn t+1 gets R_{t+1}; prefix sharing across the two needs
R_t to be a prefix of R_{t+1}. Very often it is not:
- **text** drift: the template renders turn t differently once it is history. Qwen3 writes an empty
  ``<think>\\n\\n</think>\\n\\n`` into the last assistant turn and leaves it out of earlier ones, and drops the
  reasoning of turns before the last user message; other templates re-serialise tool-call JSON or strip
  whitespace;
- **tokens** drift: the text is a prefix but BPE merges across the old end differently.
On tau-bench retail with Qwen3 every one of the 1,672 turn pairs drifts at the turn's ``<think>``: C per
conversation falls from 9.04 (consistent tokens) to 6.82.

For each pair of consecutive rendered turns this module reports the first divergent token, where it lies
(in the history before turn t, in turn t's generated tokens, or after its end-of-turn token), the text on
both sides, and the tokens of R_t that R_{t+1} no longer shares (len(R_t) - divergence). It also builds the
**consistent** records, prime-rl style: turn t+1 = turn t's tokens through its end-of-turn token + the part
of R_{t+1} after the same end-of-turn token (found by counting that token: every message before it is the
same, so the template writes the same number of them). Consistent records share exactly by construction;
``--keep-prefix-tokens`` trains on them and the "if-consistent" POR is measured on them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

EXAMPLE_CONTEXT = 8  # tokens of shared context shown before a divergence
EXAMPLE_WIDTH = 12  # tokens shown on each side after it


@dataclass
class DriftEvent:
    """Turn t's record is not a prefix of turn t+1's."""

    conversation: str
    turn: int  # t, the assistant turn whose tokens turn t+1 no longer shares (0-based)
    position: int  # first token where R_{t+1} differs from R_t
    kind: str  # "text": turn t rendered differently as history; "tokens": same text, other tokens
    where: str  # "history" (before turn t's generation), "turn" (in it) or "after" (after its end-of-turn)
    lost: int  # len(R_t) - position: tokens turn t+1 would share if the tokens were consistent
    context: str = ""  # decoded, the shared tokens just before the divergence
    this_turn: str = ""  # decoded, R_t from the divergence
    next_turn: str = ""  # decoded, R_{t+1} from the divergence

    def to_dict(self) -> dict:
        return dict(vars(self))


@dataclass
class DriftStats:
    """Drift counts of one input (or all of them)."""

    conversations: int = 0
    turns: int = 0  # assistant turns rendered
    pairs: int = 0  # consecutive turn pairs compared
    drifted: int = 0  # pairs whose earlier record is not a prefix of the later one
    kinds: Counter = field(default_factory=Counter)
    wheres: Counter = field(default_factory=Counter)
    tokens_lost: int = 0
    unspliced: int = 0  # pairs where the consistent record could not be built (no end-of-turn token to count)
    records: int = 0  # records written
    records_differ: int = 0  # records whose consistent (keep-prefix) tokens differ from a fresh rendering
    examples: list[DriftEvent] = field(default_factory=list)

    def add(self, other: DriftStats, max_examples: int) -> None:
        for name in ("conversations", "turns", "pairs", "drifted", "tokens_lost", "unspliced", "records",
                     "records_differ"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.kinds.update(other.kinds)
        self.wheres.update(other.wheres)
        self.examples.extend(other.examples[: max(0, max_examples - len(self.examples))])

    def to_dict(self) -> dict:
        d = {k: v for k, v in vars(self).items() if k not in ("kinds", "wheres", "examples")}
        d["kinds"] = dict(self.kinds)
        d["wheres"] = dict(self.wheres)
        d["examples"] = [e.to_dict() for e in self.examples]
        return d


@dataclass
class Record:
    """A turn's tokens and the span it generated (loss_mask = 1 on ids[gen_start:gen_end])."""

    ids: np.ndarray
    gen_start: int
    gen_end: int


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def splice_point(prev, nxt, special_ids: set[int]) -> int | None:
    """Index in ``nxt.ids`` just after the end-of-turn token that closes ``prev``'s turn, or None.

    ``prev``'s end-of-turn token is the special token ending its generated span; the same number of those
    tokens precede the point in ``nxt`` (the messages before it are the same). None when the turn has no
    special end-of-turn token, ``nxt`` holds fewer of them, or the point falls after ``nxt``'s generation.
    """
    if prev.gen_end <= prev.gen_start:
        return None
    eot = int(prev.ids[prev.gen_end - 1])
    if eot not in special_ids:
        return None
    count = int(np.count_nonzero(prev.ids[: prev.gen_end] == eot))
    where = np.flatnonzero(nxt.ids == eot)
    if len(where) < count:
        return None
    q = int(where[count - 1]) + 1
    return q if q <= nxt.gen_start else None


def analyse(turns: list, *, conversation: str, ordinals: list[int], special_ids: set[int], decode=None,
            max_examples: int = 0, consistent: bool = True) -> tuple[DriftStats, list[Record] | None]:
    """Drift between consecutive ``turns`` (objects with ids/gen_start/gen_end/text) of one conversation.

    Returns the counts (``records`` fields left for the caller) and, with ``consistent``, each turn's
    consistent record. ``ordinals`` numbers the turns among the conversation's assistant messages;
    ``decode`` (ids -> str) fills the text of the first ``max_examples`` events.
    """
    st = DriftStats(conversations=1, turns=len(turns))
    records = [Record(turns[0].ids, turns[0].gen_start, turns[0].gen_end)] if consistent and turns else None
    for t in range(len(turns) - 1):
        a, b = turns[t], turns[t + 1]
        st.pairs += 1
        p = common_prefix(a.ids, b.ids)
        if p < len(a.ids):
            st.drifted += 1
            kind = "tokens" if b.text.startswith(a.text) else "text"
            where = "history" if p < a.gen_start else ("turn" if p < a.gen_end else "after")
            st.kinds[kind] += 1
            st.wheres[where] += 1
            st.tokens_lost += len(a.ids) - p
            if len(st.examples) < max_examples:
                ev = DriftEvent(str(conversation), ordinals[t], p, kind, where, len(a.ids) - p)
                if decode is not None:
                    ev.context = decode(a.ids[max(0, p - EXAMPLE_CONTEXT): p])
                    ev.this_turn = decode(a.ids[p: p + EXAMPLE_WIDTH])
                    ev.next_turn = decode(b.ids[p: p + EXAMPLE_WIDTH])
                st.examples.append(ev)
        if records is None:
            continue
        q = splice_point(a, b, special_ids)
        if q is None:
            st.unspliced += 1
            records.append(Record(b.ids, b.gen_start, b.gen_end))
            continue
        prev = records[-1]
        shift = prev.gen_end - q
        if shift == 0 and np.array_equal(prev.ids[: prev.gen_end], b.ids[:q]):
            records.append(Record(b.ids, b.gen_start, b.gen_end))  # consistent already: share the array
        else:
            records.append(Record(np.concatenate([prev.ids[: prev.gen_end], b.ids[q:]]), b.gen_start + shift,
                                  b.gen_end + shift))
    return st, records
