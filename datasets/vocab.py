"""Token ids for synthetic rollouts: the Qwen3 chat-template ids and a Zipf text sampler.

Design: a synthetic rollout only has to look like a real one to the code that consumes it (the trie,
the packer, the kernels), so tokens need the right *structure*, not meaning:

- **Chat-template tokens are the real ones.** With the default vocabulary (Qwen3, 151,669 ids) every
  turn is framed exactly as Qwen3's ChatML renders it: ``<|im_start|>`` 151644, ``<|im_end|>`` 151645,
  ``<tool_call>`` 151657, ``<tool_response>`` 151665, ``<think>`` 151667, ``</think>`` 151668, and the
  text tokens ``system`` 8948, ``user`` 872, ``assistant`` 77091, ``\\n`` 198, ``\\n\\n`` 271. Shared
  framing tokens are what makes sibling branches share a few tokens after a branch point in real data.
- **Other vocabulary sizes** keep Qwen3's layout: the 26 special ids sit at the top (``size - 26`` up),
  text tokens below; a template text id that does not fit wraps into the text range. Sizes from 64 up.
- **Text is Zipf-distributed** (p(rank) ~ 1/rank, rank = token id, as BPE merges roughly follow
  frequency): two independent samples then agree on a token ~1% of the time, as two different LLM
  answers do, so accidental shared prefixes stay as rare as in real rollouts (uniform ids would make
  them ~1e-5, a Zipf exponent of 2 ~60%). Sampling is one ``integers`` draw plus a gather through a
  4M-entry inverse-CDF table: ~150M tokens/s on one core; ``exp`` of a uniform per token is ~10x slower.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from treepack.errors import ConfigError

QWEN3_VOCAB = 151_669
_QWEN3_SPECIAL_BASE = 151_643  # <|endoftext|>: the first special id; 26 specials follow up to the top
_N_SPECIAL = QWEN3_VOCAB - _QWEN3_SPECIAL_BASE

# name -> Qwen3 id. Special ids are relocated to the top of other vocabularies; text ids wrap.
_SPECIAL = {
    "im_start": 151644,
    "im_end": 151645,
    "tool_call": 151657,
    "tool_call_end": 151658,
    "tool_response": 151665,
    "tool_response_end": 151666,
    "think": 151667,
    "think_end": 151668,
}
_TEXT = {"nl": 198, "nl2": 271, "system": 8948, "user": 872, "assistant": 77091}

_TABLE_BITS = 22  # inverse-CDF table resolution: ranks rarer than 2**-22 merge into neighbours
MIN_VOCAB = 64


@dataclass(frozen=True)
class Vocab:
    """A vocabulary size and the template token ids laid out in it (see the module docstring)."""

    size: int = QWEN3_VOCAB

    def __post_init__(self) -> None:
        if not isinstance(self.size, (int, np.integer)) or self.size < MIN_VOCAB:
            raise ConfigError(f"vocab must be an integer >= {MIN_VOCAB}, got {self.size!r}")

    @property
    def n_text(self) -> int:
        """Ids ``[0, n_text)`` are ordinary text tokens; the specials sit above them."""
        return self.size - _N_SPECIAL

    def id(self, name: str) -> int:
        """The id of a template token by name (``im_start``, ``nl``, ``assistant``, ...)."""
        if name in _SPECIAL:
            return _SPECIAL[name] - _QWEN3_SPECIAL_BASE + self.n_text
        return _TEXT[name] % self.n_text

    def ids(self, *names: str) -> tuple[int, ...]:
        return tuple(self.id(n) for n in names)

    def text(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` Zipf-distributed text token ids (int32), drawn from ``rng``."""
        table = _zipf_table(self.n_text)
        return table[rng.integers(0, table.size, size=n, dtype=np.int64)]


@functools.lru_cache(maxsize=4)
def _zipf_table(n_text: int) -> np.ndarray:
    """Inverse CDF of p(rank) ~ 1/rank over ``n_text`` ranks, sampled at 2**22 evenly spaced quantiles.

    For a continuous log-uniform rank r = exp(u ln(n+1)) - 1 the density is ~1/(r+1): Zipf with exponent 1.
    """
    u = (np.arange(1 << _TABLE_BITS, dtype=np.float64) + 0.5) / (1 << _TABLE_BITS)
    ranks = np.floor(np.expm1(u * np.log(n_text + 1.0))).astype(np.int32)
    np.minimum(ranks, n_text - 1, out=ranks)
    ranks.flags.writeable = False
    return ranks
