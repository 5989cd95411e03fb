"""Values a JSON record can carry that no JSON output can hold: refused by name when read, not written broken.

- NaN, Infinity and numbers beyond float64 (``1e400`` reads as Infinity): Python's ``json`` takes them, JSON
  does not; passed through, ``unpack`` wrote ``Infinity`` and ``NaN``, lines no strict parser reads. ``reward``
  and ``logprobs`` were already refused; every other field now is too: ``field 'x' must be a finite number``.
- lone surrogates (``"\\ud800"``, or their CESU bytes): valid JSON escapes, not Unicode text, so no UTF-8
  output (Parquet, JSONL) can hold them, and matplotlib can not draw them: refused as ``field 'x' holds a
  lone surrogate \\ud800``. A surrogate pair (``"\\ud83d\\ude00"``) is one character and reads as it.
simdjson (the fast path) rejects all of these, so only the lines the precise path reads are searched, and
of those only the ones whose bytes could hold one (a regex over the line, ~1 GB/s): ~0 cost on clean data.
"""

from __future__ import annotations

import math
import re

# bytes that may spell a value of the kinds above: NaN, Infinity, a 3-digit exponent, a surrogate escape or bytes
_SUSPECT = re.compile(rb"NaN|Infinity|[eE]\+?[0-9]{3}|\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def suspect(raw: bytes | None) -> bool:
    """Whether a line's bytes may hold such a value (None: not known, so yes)."""
    return raw is None or _SUSPECT.search(raw) is not None


def _shown_float(x: float) -> str:
    return "NaN" if math.isnan(x) else "Infinity" if x > 0 else "-Infinity"


def unwritable(rec: dict, skip: tuple[str, ...] = ()) -> tuple[str, str] | None:
    """(reason, message) for the first value of ``rec`` in document order that JSON output can not hold, the
    fields ``skip`` (already checked) aside; None when there is none."""
    for key, value in rec.items():
        if key in skip:
            continue
        found = _key(key, None) or _value(value, repr(key))
        if found:
            return found
    return None


def _key(key: str, where: str | None) -> tuple[str, str] | None:
    m = _SURROGATE.search(key)
    if m:
        owner = "the record" if where is None else f"field {where}"
        return "lone surrogate", (f"a key of {owner} holds a lone surrogate \\u{ord(m.group()):04x} (not Unicode "
                                  "text: no UTF-8 output can hold it)")
    return None


def _value(v, where: str) -> tuple[str, str] | None:
    if isinstance(v, float):
        if not math.isfinite(v):
            return "non-finite number", (f"field {where} must be a finite number, got {_shown_float(v)} (JSON has "
                                         "no NaN or Infinity, and numbers beyond 1.8e308 read as Infinity)")
    elif isinstance(v, str):
        m = _SURROGATE.search(v)
        if m:
            return "lone surrogate", (f"field {where} holds a lone surrogate \\u{ord(m.group()):04x} (not Unicode "
                                      "text: no UTF-8 output can hold it)")
    elif isinstance(v, dict):
        for k, x in v.items():
            found = _key(k, where) or _value(x, f"{where}.{k}")
            if found:
                return found
    elif isinstance(v, list):
        for i, x in enumerate(v):
            found = _value(x, f"{where}[{i}]")
            if found:
                return found
    return None
