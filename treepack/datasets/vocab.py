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
  frequency): two independent draws agree 0.7% of the time (uniform ids: 0.0007%; exponent 2: 40%), so
  sibling answers diverge within a few tokens, and accidental shared prefixes stay rare, as in real
  rollouts. Sampling is integer-only, so a seed gives the same ids on every CPU (float ``exp`` would
  not: SIMD and libm results differ in the last bit): the high 16 bits of a raw 32-bit draw pick one
  of 65,536 equal-probability rank buckets, the low 16 bits a rank inside it. ~50M tokens/s on one
  core, ~2x a gather through a 4M-entry inverse-CDF table (its random reads miss the cache) and ~4x
  float64 ``exp`` per token.
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
_BUCKET_BITS = 16
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
        lo, width = _buckets(self.n_text)
        bits = rng.bit_generator.random_raw((n + 1) // 2).view(np.uint32)[:n]
        bucket = bits >> np.uint32(32 - _BUCKET_BITS)
        bits &= np.uint32((1 << (32 - _BUCKET_BITS)) - 1)
        bits *= width[bucket]
        bits >>= np.uint32(32 - _BUCKET_BITS)
        bits += lo[bucket]
        return bits.view(np.int32)


@functools.lru_cache(maxsize=8)
def _buckets(n_text: int) -> tuple[np.ndarray, np.ndarray]:
    """Rank buckets of equal probability under the continuous log-uniform rank r = exp(u ln(n+1)) - 1,
    whose density ~1/(r+1) is Zipf with exponent 1: (first rank, number of ranks) per bucket, uint32."""
    q = np.arange((1 << _BUCKET_BITS) + 1, dtype=np.float64) / (1 << _BUCKET_BITS)
    edges = np.minimum(np.floor(np.expm1(q * np.log(n_text + 1.0))), n_text).astype(np.int64)
    edges[-1] = n_text
    lo, width = edges[:-1].astype(np.uint32), np.diff(edges).astype(np.uint32)
    lo.flags.writeable = width.flags.writeable = False
    return lo, width

