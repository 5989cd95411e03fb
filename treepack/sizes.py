"""Human sizes on the command line: ``60k``, ``64K``, ``1M``, ``65536``.

Lower-case suffixes are decimal (``60k`` = 60,000; ``1m`` = 1,000,000), upper-case ones binary
(``64K`` = 65,536; ``1M`` = 1,048,576; ``1G`` = 2**30), so ``32K`` gives the power-of-two context lengths
trainers use while ``60k`` never packs more than the 60,000 tokens a reader would expect.
"""

from __future__ import annotations

import re
from fractions import Fraction

from treepack.errors import ConfigError, TreepackError

_UNITS = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "K": 1024, "M": 1024**2, "G": 1024**3}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*$")
MAX_SIZE = 2**62  # sizes meet int64 arithmetic (capacity minus depth, sums of lengths): keep them clear of it


def parse_size(text: str | int, *, what: str = "size") -> int:
    """Parse ``60k`` -> 60000, ``64K`` -> 65536, ``65536`` -> 65536; reject anything else."""
    if isinstance(text, int):
        value = text
    else:
        m = _SIZE_RE.match(str(text))
        if not m:
            raise TreepackError(f"invalid {what} {text!r}: expected an integer or a number with k/K/M/G, e.g. 60k")
        value = Fraction(m.group(1)) * _UNITS[m.group(2)]  # exact: 9007199254740993 stays itself
        if value.denominator != 1:
            raise TreepackError(f"invalid {what} {text!r}: not a whole number of tokens")
        value = int(value)
    if value <= 0:
        raise TreepackError(f"invalid {what} {text!r}: must be positive")
    if value > MAX_SIZE:
        raise TreepackError(f"invalid {what} {text!r}: too large (at most 2**62 = {MAX_SIZE:,})")
    return value


def parse_token_count(value, what: str, bad: str, negative: str) -> int:
    """Tokens as an integer or a size such as "8K" (`parse_size`; "0k" is 0); negatives refused, with
    `ConfigError`s that read ``{what} {bad}`` and ``{what} {negative}`` (formatted with ``value`` and ``tokens``)."""
    if isinstance(value, int) and not isinstance(value, bool):
        tokens = value
    else:
        text = str(value).strip()
        if text.lstrip("-").isdigit():
            tokens = int(text)
        else:
            try:
                tokens = parse_size(text, what=what)
            except TreepackError:
                if text[:1] == "0" and text.rstrip("kKMG").strip("0.") == "":
                    return 0
                raise ConfigError(f"{what} {bad.format(value=value)}") from None
    if tokens < 0:
        raise ConfigError(f"{what} {negative.format(tokens=tokens)}")
    return tokens
