"""The ``treepack`` attention implementation for Hugging Face models, and the mask function beside it.

``transformers`` routes every attention call of a modern model through ``AttentionInterface`` (keyed by
``config._attn_implementation``) and builds its masks through ``AttentionMaskInterface`` under the same
key. We register both under ``"treepack"``:

- the **mask function** returns the active `TreeMask` (the pack being forwarded), so the model's own
  mask-building code hands our mask object to every layer. An attention function registered *without* a
  mask function gets ``attention_mask=None`` silently; a monkey-patched mask arrives as something else.
  Either way, during a tree forward the attention function sees that the object is not the active tree
  and raises (outside the first-use self-check, which runs it anyway to report the numeric damage);
- the **attention function** takes the layer's q, k, v ([1, H, T, E] after RoPE at depth positions) and
  computes tree attention: query q sees key k iff ``k <= q < subtree_end[k]`` (an ancestor or itself),
  plus, when the layer asks, a sliding window in *depth* (``depth[q] - depth[k] < W``, what the model
  computes on each root-to-leaf path) and attention-logit soft-capping (Gemma 2). It raises on any
  keyword that would change the math and that it does not implement, instead of dropping it.

``treepack`` stays the model's implementation once installed (`install`): calls that carry no tree (a
per-sequence forward, ``generate``) go to the implementation the model had before (sdpa, eager, flex:
the *fallback*, mask function included), and a call that carries a `TreeMask` as its mask runs tree
attention even when no tree is active. That last case is activation checkpointing: transformers (and
``torch.utils.checkpoint``) recompute a decoder layer during backward, long after the forward returned,
with the mask object it was first given; an implementation switched back after the forward would get the
tree mask in the model's plain sdpa/eager function.

Backends: the Triton tree kernel (CUDA; bf16/fp16/fp32, head dims 32/64/128), FlexAttention (CUDA; any
head dim, plus sliding window and soft-capping as ``mask_mod``/``score_mod``), and pure torch (CPU: the
kernels' reference, or a masked reference here with window and soft-cap). Which one runs is the kernels'
registry's answer (`treepack.kernels.tree_attention.registry.resolve`, the same as training's): ``auto`` =
FA4 or Triton where they apply, else Flex on CUDA (any head dim: ``fallback="flex"``); Flex in 16-bit and
the masked reference otherwise for a window or soft-cap; reference on CPU. A window no path is long enough to reach (max depth < W)
is dropped exactly, so Mistral/Phi-3 style windows of 4k keep the Triton kernel on shorter packs.

Legend: T pack tokens, H query heads, K key/value heads, G = H // K, E head dim, C queries of a chunk,
S keys of a chunk.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from treepack.errors import TreepackError
from treepack.kernels.tree_attention import registry

IMPLEMENTATION = "treepack"  # the attn_implementation name registered with transformers
# Keywords models pass to attention functions that carry no math for a tree forward without a cache.
_INERT_KWARGS = frozenset({
    "position_ids", "cache_position", "use_cache", "output_attentions", "output_hidden_states", "return_dict",
    "past_key_values", "cache", "layer_idx", "is_causal", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
    "max_length_k", "logits_to_keep", "position_embeddings",
})
REFERENCE_SCORE_BUDGET = 1 << 26  # score elements per query chunk of the masked reference


class TreeAttentionError(TreepackError):
    """The tree forward can not be run as asked (a foreign mask, an unsupported attention feature)."""


@dataclass(eq=False)
class TreeMask:
    """The tree of one pack on the model's device, handed to every layer through the mask function.

    ``subtree_end_T`` (int32) is the mask; ``depth_T`` (int64) the position of each token, for sliding
    windows. ``calls`` counts the attention calls of the current forward (one per attention layer);
    ``probe`` is set by the self-check to compare every layer's output with per-sequence attention.
    ``window`` is set on the `windowed` copies the mask function hands to layers whose model asked for a
    sliding-window mask (``base``: the pack's mask, which counts the calls).
    """

    subtree_end_T: Tensor
    depth_T: Tensor
    impl: str = "auto"
    max_depth: int = 0
    calls: int = 0
    probe: object | None = None  # treepack.hf.check.AttentionProbe during the self-check
    foreign: list = field(default_factory=list)  # descriptions of foreign masks seen (self-check only)
    window: int | None = None
    base: TreeMask | None = None
    _cache: dict = field(default_factory=dict)

    @classmethod
    def build(cls, subtree_end_T: Tensor, depth_T: Tensor, impl: str = "auto") -> TreeMask:
        try:
            registry.check("tree", impl)
        except registry.BackendError as exc:
            raise TreeAttentionError(str(exc)) from None
        max_depth = int(depth_T.max()) if depth_T.numel() else 0
        return cls(subtree_end_T.to(torch.int32), depth_T.to(torch.int64), impl, max_depth)

    def windowed(self, window: int | None) -> TreeMask:
        """This tree under a sliding window: some models (PhiMoE, Qwen2-MoE) pass their window only through
        the mask they build, not as the attention function's ``sliding_window``."""
        if window is None:
            return self
        key = ("window", int(window))
        if key not in self._cache:
            self._cache[key] = TreeMask(self.subtree_end_T, self.depth_T, self.impl, self.max_depth,
                                        window=int(window), base=self)
        return self._cache[key]

    @property
    def n_tokens(self) -> int:
        return int(self.subtree_end_T.shape[0])

    def plain_context(self, impl: str):
        """`treepack.train.attention.AttentionContext` for the kernels' tree attention (built once)."""
        key = ("context", impl)
        if key not in self._cache:
            from treepack.train.attention import AttentionContext

            self._cache[key] = AttentionContext.tree(self.subtree_end_T, impl)
        return self._cache[key]


_ACTIVE: contextvars.ContextVar[TreeMask | None] = contextvars.ContextVar("treepack_tree_mask", default=None)


@contextlib.contextmanager
def active_tree(mask: TreeMask) -> Iterator[TreeMask]:
    """Make ``mask`` the tree that the ``treepack`` mask function hands out, for one forward."""
    mask.calls = 0
    token = _ACTIVE.set(mask)
    try:
        yield mask
    finally:
        _ACTIVE.reset(token)


_FALLBACKS: dict[int, str] = {}  # id(config) -> the implementation the model had before treepack


def fallback_implementation(config) -> str:
    """What a call without a tree runs for this config (what the model had before `install`)."""
    name = _FALLBACKS.get(id(config))
    if name is None:  # a model loaded with attn_implementation="treepack" directly
        name = "eager" if getattr(config, "attn_logit_softcapping", None) else "sdpa"
    return name


def install(config) -> None:
    """Make ``treepack`` the config's attention implementation, remembering the current one as fallback."""
    import weakref

    current = config._attn_implementation
    if current != IMPLEMENTATION:
        _FALLBACKS[id(config)] = current or "eager"
        weakref.finalize(config, _FALLBACKS.pop, id(config), None)
        config._attn_implementation_internal = IMPLEMENTATION


def tree_mask_function(*args, **kwargs):
    """``AttentionMaskInterface`` entry: the active tree, whatever mask kind the model asked for (causal, or
    sliding: ``local_size`` is its window; chunked masks are Llama 4's, refused by name); with no tree active,
    the fallback implementation's mask."""
    mask = _ACTIVE.get()
    if mask is None:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

        fallback = fallback_implementation(kwargs.get("config"))
        return ALL_MASK_ATTENTION_FUNCTIONS[fallback](*args, **kwargs)
    q_length = kwargs.get("q_length")
    if isinstance(q_length, int) and q_length != mask.n_tokens:
        raise TreeAttentionError(f"the model asked for a mask over {q_length} queries; the tree has {mask.n_tokens}")
    return mask.windowed(kwargs.get("local_size"))


def _fallback_attention(module, *args, **kwargs):
    """The model's previous attention function for a call that carries no tree."""
    import importlib

    from transformers import AttentionInterface

    name = fallback_implementation(module.config)
    if name == "eager":  # every modeling file defines its own (Gemma 2's soft-caps, most upcast softmax)
        return importlib.import_module(type(module).__module__).eager_attention_forward(module, *args, **kwargs)
    return AttentionInterface()[name](module, *args, **kwargs)


def _describe(obj) -> str:
    if obj is None:
        return "None (no mask: a causal or full attention)"
    if isinstance(obj, Tensor):
        return f"a {obj.dtype} tensor of shape {list(obj.shape)}"
    return f"a {type(obj).__name__}"


def tree_attention_forward(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, *,
                           scaling: float | None = None, dropout: float = 0.0, sliding_window: int | None = None,
                           softcap: float | None = None, **kwargs) -> tuple[Tensor, None]:
    """``AttentionInterface`` entry: query [1, H, T, E], key/value [1, K, T, E] -> ([1, T, H, E], None)."""
    active = _ACTIVE.get()
    if isinstance(attention_mask, TreeMask):
        # a tree forward, or a layer recomputed in backward (activation checkpointing)
        mask = attention_mask.base or attention_mask
        if sliding_window is None:
            sliding_window = attention_mask.window
        elif attention_mask.window not in (None, sliding_window):
            raise TreeAttentionError(f"{type(module).__name__} passes sliding_window={sliding_window} beside a mask "
                                     f"built with a window of {attention_mask.window}")
        if active is not None and active is not mask:
            raise TreeAttentionError("a layer received the tree mask of another pack than the one being forwarded")
    elif active is None:  # no tree: the model's previous implementation, untouched
        return _fallback_attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                   sliding_window=sliding_window, softcap=softcap, **kwargs)
    else:
        mask = active
    extra = sorted(k for k, v in kwargs.items()
                   if v is not None and k not in _INERT_KWARGS and not k.startswith(("output_", "return_")))
    if extra:
        raise TreeAttentionError(
            f"{type(module).__name__} passes {', '.join(repr(k) for k in extra)} to its attention function: "
            "treepack's tree attention does not implement it (refusing rather than ignoring it)"
        )
    if dropout and module.training:
        raise TreeAttentionError(f"{type(module).__name__}: attention dropout ({dropout}) is not supported "
                                 "in tree attention; set attention_dropout = 0 or call model.eval()")
    if query.dim() != 4 or query.shape[0] != 1 or query.shape[2] != mask.n_tokens:
        raise TreeAttentionError(f"expected queries [1, H, {mask.n_tokens}, E], got {list(query.shape)}")
    mask.calls += 1
    foreign = not isinstance(attention_mask, TreeMask) or (attention_mask.base or attention_mask) is not mask
    if foreign:
        what = _describe(attention_mask)
        if mask.probe is None:
            raise TreeAttentionError(
                f"{type(module).__name__} received {what} as its attention mask instead of treepack's tree "
                "mask: something replaced the mask function (a patched create_causal_mask, a wrapper that "
                "builds its own mask); the tree forward would be silently wrong"
            )
        mask.foreign.append(what)
    E = query.shape[-1]
    scale = float(scaling) if scaling is not None else 1.0 / math.sqrt(E)
    q_THE = query[0].transpose(0, 1)
    k_TKE = key[0].transpose(0, 1)
    v_TKE = value[0].transpose(0, 1)
    # Under autocast, norms after the projections (Qwen3's q/k norms) hand back float32 q/k beside a bf16 v;
    # SDPA would run in the autocast dtype, so do we. Otherwise keep v's dtype (what eager matmuls give).
    dev = q_THE.device.type
    common = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else v_TKE.dtype
    q_THE, k_TKE, v_TKE = q_THE.to(common), k_TKE.to(common), v_TKE.to(common)
    Ev = v_TKE.shape[-1]
    if Ev != E:  # MLA (DeepSeek V2/V3): value head dim != q/k's; zero columns change no score and no output
        qk, v = (0, max(Ev - E, 0)), (0, max(E - Ev, 0))
        pad = torch.nn.functional.pad
        q_THE, k_TKE, v_TKE = pad(q_THE, qk), pad(k_TKE, qk), pad(v_TKE, v)
    if foreign:  # self-check only: run what the patched mask says, so the check measures the damage
        o_THE = _foreign_attention(q_THE, k_TKE, v_TKE, attention_mask, scale, softcap)
    else:
        window = int(sliding_window) if sliding_window is not None and sliding_window <= mask.max_depth else None
        o_THE = tree_attention_any(q_THE, k_TKE, v_TKE, mask, scale=scale, window=window, softcap=softcap)
    if mask.probe is not None:
        mask.probe.record(module, q_THE, k_TKE, v_TKE, o_THE, scale=scale, sliding_window=sliding_window,
                          softcap=softcap)
    # contiguous as transformers' own implementations return it (JetMoE .view()s it)
    return o_THE[None, ..., :Ev].contiguous(), None


def tree_attention_any(q_THE: Tensor, k_TKE: Tensor, v_TKE: Tensor, mask: TreeMask, *, scale: float,
                       window: int | None = None, softcap: float | None = None) -> Tensor:
    """Tree attention with optional depth window and soft-cap, on the backend the registry resolves
    ``mask.impl`` to for this call (``auto``: see the module doc)."""
    from treepack.kernels import tree_attention

    plain = window is None and softcap is None
    call = registry.AttentionCall.of(q_THE, k_TKE, v_TKE, window=window is not None, softcap=softcap is not None,
                                     fallback="flex")
    try:
        impl = registry.resolve("tree", mask.impl, call).name
    except registry.BackendError as exc:
        raise TreeAttentionError(f"attention={mask.impl!r}: {exc.reason}") from None
    if impl == "flex":
        return _flex(q_THE, k_TKE, v_TKE, mask, scale, window, softcap)
    if mask.impl == "auto" and impl in ("triton", "fa4"):
        impl = "auto"  # the kernels choose per call between the two, sized by the pack's visible pairs
    if impl == "reference" and not plain:
        return masked_reference(q_THE, k_TKE, v_TKE, mask.subtree_end_T, mask.depth_T, scale=scale, window=window,
                                softcap=softcap)
    ctx = mask.plain_context(impl)
    q_THE, k_TKE, v_TKE = q_THE.contiguous(), k_TKE.contiguous(), v_TKE.contiguous()
    if len(ctx.segments) > 1:
        return torch.cat([tree_attention(q_THE[a:b], k_TKE[a:b], v_TKE[a:b], end, scale=scale, impl=impl)
                          for a, b, end in ctx.segments], dim=0)
    return tree_attention(q_THE, k_TKE, v_TKE, ctx.mask, scale=scale, impl=impl)


# --------------------------------------------------------------------------------------------------
# Masked reference (window, soft-cap) and FlexAttention


def _masked_chunk(q_CHE, k_TKE, v_TKE, subtree_end_T, depth_T, q0: int, scale: float, window, softcap):
    C, H, E = q_CHE.shape
    K = k_TKE.shape[1]
    q1 = q0 + C
    keys_SKE, values_SKE = k_TKE[:q1], v_TKE[:q1]
    q_KGCE = q_CHE.reshape(C, K, H // K, E).permute(1, 2, 0, 3)
    scores_KGCS = torch.einsum("kgce,ske->kgcs", q_KGCE, keys_SKE) * scale
    if softcap is not None:
        scores_KGCS = torch.tanh(scores_KGCS / softcap) * softcap
    pos_q_C = torch.arange(q0, q1, device=q_CHE.device)
    pos_k_S = torch.arange(q1, device=q_CHE.device)
    visible_CS = (pos_k_S[None, :] <= pos_q_C[:, None]) & (pos_q_C[:, None] < subtree_end_T[:q1][None, :].long())
    if window is not None:
        visible_CS &= (depth_T[q0:q1][:, None] - depth_T[:q1][None, :]) < window
    probs_KGCS = torch.softmax(scores_KGCS.masked_fill(~visible_CS, float("-inf")), dim=-1)
    out_KGCE = torch.einsum("kgcs,ske->kgce", probs_KGCS, values_SKE)
    return out_KGCE.permute(2, 0, 1, 3).reshape(C, H, E)


def masked_reference(q_THE: Tensor, k_TKE: Tensor, v_TKE: Tensor, subtree_end_T: Tensor, depth_T: Tensor, *,
                     scale: float, window: int | None = None, softcap: float | None = None) -> Tensor:
    """Pure-torch tree attention with a depth window and logit soft-cap (the oracle of those features):
    query chunks of at most `REFERENCE_SCORE_BUDGET` scores, each checkpointed when differentiable."""
    T, H, _ = q_THE.shape
    chunk = max(1, min(T, REFERENCE_SCORE_BUDGET // max(1, H * T)))
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q_THE, k_TKE, v_TKE))
    outs = []
    for q0 in range(0, T, chunk):
        args = (q_THE[q0 : q0 + chunk], k_TKE, v_TKE, subtree_end_T, depth_T, q0, scale, window, softcap)
        outs.append(checkpoint(_masked_chunk, *args, use_reentrant=False) if grad and T > chunk
                    else _masked_chunk(*args))
    return torch.cat(outs, dim=0) if len(outs) > 1 else outs[0]


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def _flex(q_THE, k_TKE, v_TKE, mask: TreeMask, scale: float, window, softcap) -> Tensor:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    key = ("flex", window)
    if key not in mask._cache:
        end_T, depth_T = mask.subtree_end_T, mask.depth_T

        def mask_mod(b, h, q_idx, kv_idx):
            visible = (kv_idx <= q_idx) & (q_idx < end_T[kv_idx])
            if window is not None:
                visible = visible & (depth_T[q_idx] - depth_T[kv_idx] < window)
            return visible

        T = mask.n_tokens
        mask._cache[key] = create_block_mask(mask_mod, None, None, T, T, device=end_T.device,
                                             _compile=end_T.device.type == "cuda")
    score_mod = None
    if softcap is not None:
        def score_mod(score, b, h, q_idx, kv_idx):
            return torch.tanh(score / softcap) * softcap

    q, k, v = (t.transpose(0, 1)[None] for t in (q_THE, k_TKE, v_TKE))
    fn = _compiled_flex() if q_THE.device.type == "cuda" else flex_attention
    out = fn(q, k, v, score_mod=score_mod, block_mask=mask._cache[key], scale=scale,
             enable_gqa=k.shape[1] != q.shape[1])
    return out[0].transpose(0, 1)


def _foreign_attention(q_THE, k_TKE, v_TKE, attention_mask, scale: float, softcap) -> Tensor:
    """Attention under a mask that is not ours (self-check only): None = causal over the layout, a 4-d
    boolean or additive tensor as given."""
    T, H = q_THE.shape[:2]
    G = H // k_TKE.shape[1]
    q, k, v = q_THE.transpose(0, 1), k_TKE.transpose(0, 1), v_TKE.transpose(0, 1)
    k, v = k.repeat_interleave(G, 0), v.repeat_interleave(G, 0)
    scores_HTS = q @ k.transpose(1, 2) * scale
    if softcap is not None:
        scores_HTS = torch.tanh(scores_HTS / softcap) * softcap
    if isinstance(attention_mask, Tensor) and attention_mask.dim() == 4:
        m = attention_mask[0, 0, :T, :T].to(q.device)
        scores_HTS = scores_HTS.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else scores_HTS + m
    else:
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        scores_HTS = scores_HTS.masked_fill(~causal, float("-inf"))
    return (torch.softmax(scores_HTS, -1) @ v).transpose(0, 1)


_REGISTERED = False


def register() -> None:
    """Register ``"treepack"`` in transformers' AttentionInterface and AttentionMaskInterface (idempotent)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(IMPLEMENTATION, tree_attention_forward)
    AttentionMaskInterface.register(IMPLEMENTATION, tree_mask_function)
    _REGISTERED = True
