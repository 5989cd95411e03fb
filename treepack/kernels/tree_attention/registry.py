"""The attention backends, in one table: which names exist, which calls each can run, and what ``auto`` runs.

Every attention call in treepack, the eager API (`api.tree_attention`), the compiled layer path
(`treepack.train.attention.AttentionContext.kernel_schedule`), ``treepack.hf``'s attention function, config
validation (``train.attention``) and ``treepack verify --attention``, asks this module: `names` for the valid
spellings, `check` for a name against a family before any tensor exists, and `resolve` for the backend
of one call (or the one-line reason it cannot run). Before it, the names were written out five times and
``auto`` was resolved in three places that had drifted apart.

A backend serves one *family* of masks per registration:

* ``tree``: the mask ``k <= q < subtree_end[k]`` over a pack in DFS preorder (tree, dfs, auto modes);
  ``run(q, k, v, subtree_end, *, prefix_k, prefix_v, scale)``, subtree_end an int32 [T] tensor or a
  `TreeMaskInfo`;
* ``causal``: independent causal sequences laid back to back, what the dense baselines run;
  ``run(q, k, v, lengths)``. The tree kernels serve it too, over a forest of chains (``chains=True``:
  ``AttentionContext.causal`` builds the chains mask and the call runs as a tree call).

``auto``: for ``tree`` the measured table of `backends.pick_backend` (fa4 for calls of at least
``FA4_MIN_FLOPS`` and whole packs of at least ``FA4_MIN_TOKENS``, else triton, on CUDA), then the call's
``fallback`` (reference; ``treepack.hf`` asks for flex, which takes any head dim), and reference off CUDA; a
call with a sliding window or a soft-cap takes flex in 16-bit on CUDA and the reference elsewhere. For
``causal``: the first ``auto`` candidate by rank whose `supports` accepts the call; per-sequence SDPA (rank 0)
accepts every call, so a CPU run is bit for bit what it always was.

Adding a backend is one module (its run function, and a cheap ``supports(call) -> reason | None`` that
imports nothing heavy) plus one `register_backend` line: the built-in lines are at the end of this file,
and the causal (varlen) ones. Run and supports functions may be given as
``"module:function"`` strings, imported on first use, so that importing treepack needs neither triton nor
flash-attn.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from treepack.errors import TreepackError

__all__ = ["FAMILIES", "AttentionCall", "Backend", "BackendError", "backend", "check", "names", "register_backend",
           "resolve", "unsupported_reason"]

FAMILIES = {"tree": "tree attention", "causal": "independent causal sequences"}
HALF = (torch.bfloat16, torch.float16)


class BackendError(TreepackError, ValueError):
    """An attention backend that does not exist, serves another family, or cannot run this call.

    ``reason`` is the sentence without the name; callers prefix what the user wrote (``impl='triton': ``,
    ``train.attention = 'triton': ``)."""

    def __init__(self, impl: str, reason: str) -> None:
        super().__init__(reason)
        self.impl, self.reason = impl, reason


@dataclass(frozen=True)
class AttentionCall:
    """What `resolve` needs to know about one call: shapes and flags, no tensors (config checks have none)."""

    device: torch.device
    dtype: torch.dtype
    heads: int  # query heads
    head_dim: int
    tokens: int = 0  # queries of the call (0: not known yet)
    prefix: int = 0  # cached keys visible to every query (dfs)
    pairs: int | None = None  # visible (query, key) pairs when known (a pack's `visible_pairs`)
    grad: bool = False  # the call will be back-propagated
    window: bool = False  # a sliding window in depth (treepack.hf: Mistral, Gemma 2)
    softcap: bool = False  # attention-logit soft-capping (treepack.hf: Gemma 2)
    fallback: str = "reference"  # tree ``auto`` on CUDA when no fused kernel takes a plain call
    whole_tokens: int = 0  # a piece of a cut pack: the whole pack's tokens (routed as that pack), else 0

    @classmethod
    def of(cls, q_THE: Tensor, *tensors: Tensor | None, prefix: int = 0, pairs: int | None = None,
           window: bool = False, softcap: bool = False, fallback: str = "reference",
           whole_tokens: int = 0) -> AttentionCall:
        """The call of queries ``q_THE`` ([T, H, E]); ``tensors``: the other inputs whose gradient counts."""
        grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q_THE, *tensors))
        return cls(q_THE.device, q_THE.dtype, int(q_THE.shape[1]), int(q_THE.shape[-1]), int(q_THE.shape[0]),
                   prefix, pairs, grad, window, softcap, fallback, whole_tokens)

    @property
    def plain(self) -> bool:
        return not (self.window or self.softcap)


def _import(ref: str) -> Callable:
    """``"module:function"`` looked up at each call (a dict lookup once imported), so that a test or a benchmark
    that patches the module's function is what runs."""
    module, _, attr = ref.partition(":")
    return getattr(sys.modules.get(module) or importlib.import_module(module), attr)


def _load(ref: Callable | str) -> Callable:
    """A function given as itself or as ``"module:function"`` (imported on first use)."""
    return _import(ref) if isinstance(ref, str) else ref


@dataclass(frozen=True)
class Backend:
    """One registration: ``name`` in ``family``; ``supports(call)`` the reason it cannot run, or None."""

    name: str
    family: str
    supports_ref: Callable[[AttentionCall], str | None] | str = field(repr=False)
    run_ref: Callable[..., Tensor] | str = field(repr=False)
    about: str = ""  # one line: what it is and where it runs
    chains: bool = False  # causal: runs as the tree kernel over a forest of chains
    auto: bool = False  # causal: a candidate of ``auto``
    rank: int = 0  # causal: ``auto`` tries higher ranks first

    def supports(self, call: AttentionCall) -> str | None:
        return _load(self.supports_ref)(call)

    @property
    def run(self) -> Callable[..., Tensor]:
        return _load(self.run_ref)


_TABLE: dict[str, dict[str, Backend]] = {family: {} for family in FAMILIES}


def register_backend(family: str, name: str, *, supports: Callable | str, run: Callable | str, about: str = "",
                     chains: bool = False, auto: bool = False, rank: int = 0) -> Backend:
    """Add (or replace, keeping its place in `names`) the backend ``name`` of ``family``."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {family!r}")
    if name == "auto" or not name:
        raise ValueError(f"{name!r} cannot name a backend")
    b = Backend(name, family, supports, run, about, chains, auto, rank)
    _TABLE[family][name] = b
    return b


def names(family: str | None = None) -> tuple[str, ...]:
    """``auto`` and the registered names of ``family`` (None: of every family), in registration order."""
    families = FAMILIES if family is None else (family,)
    return ("auto", *dict.fromkeys(n for f in families for n in _TABLE[f]))


def _or_list(items: tuple[str, ...]) -> str:
    return ", ".join(items[:-1]) + f" or {items[-1]}" if len(items) > 1 else "".join(items)


def check(family: str, impl: str, *, label: str = "attention", who: str | None = None) -> None:
    """Raise `BackendError` unless ``impl`` names a backend of ``family`` (or ``auto``): the one place where
    "sdpa runs independent causal sequences, not a tree mask" is decided. ``label``: how the message names the
    setting; ``who``: what needs the family (default: the family's own words)."""
    if impl in _TABLE[family] or impl == "auto":
        return
    if impl in names():
        other = next(f for f in FAMILIES if impl in _TABLE[f])
        raise BackendError(impl, f"{label} '{impl}' runs {FAMILIES[other]}; {who or FAMILIES[family]} needs "
                                 f"{_or_list(names(family))}")
    raise BackendError(impl, f"{label} must be one of {', '.join(names(family))}, got {impl!r}")


def backend(family: str, impl: str) -> Backend:
    """The registration of a named backend (not ``auto``), after `check`."""
    check(family, impl)
    return _TABLE[family][impl]


def _auto_tree(call: AttentionCall) -> str:
    from .backends import pick_backend

    if call.device.type != "cuda":
        return "reference"
    if not call.plain:
        # FlexAttention implements window and soft-cap as mask_mod / score_mod; in float32 its compiled kernels
        # failed to lower for a soft-capped Gemma 2 (torch 2.11, H100), so float32 takes the chunked reference
        return "flex" if call.dtype in HALF else "reference"
    name = pick_backend(call.tokens, call.heads, call.head_dim, call.dtype, call.device, prefix_len=call.prefix,
                        pairs=call.pairs, whole_tokens=call.whole_tokens)
    return call.fallback if name == "reference" else name


def resolve(family: str, impl: str, call: AttentionCall) -> Backend:
    """The backend that runs ``call`` under ``impl`` (``auto`` or a name), or `BackendError` with the reason."""
    check(family, impl)
    table = _TABLE[family]
    if impl == "auto":
        if family == "tree":
            candidates = [table[_auto_tree(call)], table["reference"]]
        else:
            candidates = sorted((b for b in table.values() if b.auto), key=lambda b: -b.rank)
        for b in candidates:
            if b.supports(call) is None:
                return b
        raise BackendError(impl, f"no {FAMILIES[family]} backend runs {call}")
    b = table[impl]
    reason = b.supports(call)
    if reason is not None:
        raise BackendError(impl, reason)
    return b


def unsupported_reason(family: str, impl: str, call: AttentionCall) -> str | None:
    """Why ``impl`` cannot run ``call`` (None: it can)."""
    try:
        resolve(family, impl, call)
    except BackendError as exc:
        return exc.reason
    return None


# --------------------------------------------------------------------------------------------------
# Who can run what


def _anything(call: AttentionCall) -> str | None:
    return None


def flex_supports(call: AttentionCall) -> str | None:
    if call.device.type != "cuda" and call.grad:
        return "torch's FlexAttention has no backward on CPU; use 'reference' or 'auto' there"
    return None


def _plain_only(name: str, supports: Callable[[AttentionCall], str | None]) -> Callable[[AttentionCall], str | None]:
    def check_call(call: AttentionCall) -> str | None:
        if not call.plain:
            return (f"the {name} tree kernel has no sliding window or soft-capping; use attention='flex' (CUDA) "
                    "or 'auto'")
        return supports(call)

    return check_call


def _triton_supports(call: AttentionCall) -> str | None:
    from .backends import triton_supports

    return triton_supports(call)


def _fa4_supports(call: AttentionCall) -> str | None:
    from .fa4 import fa4_supports

    return fa4_supports(call)


def _chains(name: str) -> Callable[..., Tensor]:
    """The causal-family run of tree backend ``name``: the tree mask of a forest of chains."""

    def run(q_THE: Tensor, k_TKE: Tensor, v_TKE: Tensor, batch) -> Tensor:
        from .blocks import chains_subtree_end

        end_T = chains_subtree_end(getattr(batch, "lengths", batch), device=q_THE.device)
        scale = 1.0 / float(q_THE.shape[-1]) ** 0.5
        return _TABLE["tree"][name].run(q_THE, k_TKE, v_TKE, end_T, prefix_k=None, prefix_v=None, scale=scale)

    return run


_PKG = "treepack.kernels.tree_attention"
# What registers (one line each): the tree kernels of this package, for tree masks and, over chains, for
# independent causal sequences. Below them, the varlen kernels of treepack.kernels.varlen.
for _name, _supports, _run, _about in (
    ("reference", _anything, f"{_PKG}.reference:run_reference", "pure torch, any device and dtype: the oracle"),
    ("flex", flex_supports, f"{_PKG}.flex:tree_attention_flex", "torch's FlexAttention (backward on CUDA only)"),
    ("triton", _plain_only("triton", _triton_supports), f"{_PKG}.triton:tree_attention_triton",
     "fused Triton kernels (CUDA; bf16 / fp16 / fp32; head dims 32, 64, 128)"),
    ("fa4", _plain_only("fa4", _fa4_supports), f"{_PKG}.fa4:tree_attention_fa4",
     "FlashAttention-4 (Hopper / Blackwell; bf16 / fp16; head dims 64, 128; treepack[fa4])"),
):
    register_backend("tree", _name, supports=_supports, run=_run, about=_about)
    register_backend("causal", _name, supports=_supports, run=_chains(_name), about=f"{_about}, over chains",
                     chains=True)

# Independent causal sequences laid back to back (treepack.kernels.varlen): what the dense baselines run, one call
# per layer per micro-batch. auto takes the highest rank that runs the call: FA4's varlen kernel, then torch's
# flash varlen, then SDPA per sequence (any device and dtype: a CPU run is what it always was).
_VARLEN = "treepack.kernels.varlen.api"
register_backend("causal", "sdpa", supports=_anything, run=f"{_VARLEN}:run_sdpa", auto=True, rank=0,
                 about="SDPA per sequence (any device and dtype): the reference, and the CPU path")
register_backend("causal", "flash-varlen", supports=f"{_VARLEN}:supports_flash", run=f"{_VARLEN}:run_flash",
                 auto=True, rank=10, about="torch's flash varlen kernel, one call (CUDA; bf16 / fp16)")
register_backend("causal", "fa4-varlen", supports=f"{_VARLEN}:supports_fa4", run=f"{_VARLEN}:run_fa4",
                 auto=True, rank=20, about="FlashAttention-4's varlen kernel, one call (Hopper / Blackwell; bf16 / "
                                           "fp16; head dims 64, 128; treepack[fa4])")
