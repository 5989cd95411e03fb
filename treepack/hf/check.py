"""First-use self-check: one small pack run as a tree and per sequence; raise if they disagree.

Silent wrong masks are the field's most reported failure (a flash path that sets the mask to None, a
patch that swaps the custom mask for a causal one). Before the first tree forward of a model (per dtype,
device and attention backend) `ensure_checked` builds a small pack from the caller's own token ids with a
branch point, a duplicate, a prefix-of-another sequence and a second root, and compares two things:

1. **every attention layer**: the tree attention output against plain causal attention over each
   sequence's own path, recomputed from the same q, k, v in float64 (float32 on GPU half precision)
   with the layer's window and soft-cap (`AttentionProbe`): this sees a wrong mask whatever the weights;
2. **the log-probs** of the tree forward against the model's own per-sequence forward through its
   configured attention implementation (sdpa, eager, flash...): this sees wrong positions, a wrong head
   or anything else outside attention.

Tolerances (`TOLERANCES`, max abs difference; attention relative to max |v|): float64 1e-8 / 1e-9,
float32 2e-3 / 1e-4, bf16 0.25 / 4e-2, fp16 0.05 / 5e-3. The log-prob tolerance is float32's when the
reference is ``eager`` (it upcasts softmax to float32, also for float64 models). A mask that arrives
as something other than treepack's (a patched mask function) is computed as given during the check, so
the error shows the damage it does, and names what arrived.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch
from torch import Tensor, nn

from treepack.errors import TreepackError
from treepack.hf.batch import TreeBatch, plan_packs
from treepack.hf.forward import logprob_dtype, model_device_dtype, pack_logprobs, prepare_model
from treepack.hf.support import attention_implementation

TOLERANCES = {  # dtype: (log-prob max abs, attention output max abs / max |v|)
    torch.float64: (1e-8, 1e-9),
    torch.float32: (2e-3, 1e-4),
    torch.bfloat16: (0.25, 4e-2),
    torch.float16: (0.05, 5e-3),
}
CHECK_TOKENS = 12  # trunk length of the check pack


class SelfCheckError(TreepackError):
    """The tree forward disagrees with the model's per-sequence forward beyond the dtype's tolerance."""


_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def check_sequences(arrays: list[np.ndarray], seed: int = 0) -> list[np.ndarray]:
    """A small pack drawn from the caller's token ids: trunk + two branches, a duplicate, a prefix of
    another sequence, and an unrelated root."""
    pool = np.unique(np.concatenate([a[:4096] for a in arrays if len(a)]))
    rng = np.random.default_rng(seed)

    def draw(n):
        return rng.choice(pool, n).astype(np.int64)

    trunk = draw(CHECK_TOKENS)
    a = np.concatenate([trunk, draw(5)])
    b = np.concatenate([trunk[:8], draw(6)])
    if len(pool) > 1 and b[8] == trunk[8]:
        b[8] = pool[(np.searchsorted(pool, trunk[8]) + 1) % len(pool)]
    return [a, b, a.copy(), trunk[:5], draw(7), np.concatenate([b, draw(3)])]


class AttentionProbe:
    """Per layer: tree attention output vs plain causal attention over each sequence's path."""

    def __init__(self, paths: list[Tensor], dtype: torch.dtype) -> None:
        self.paths = paths  # pack token indices of each sequence, root to leaf
        self.ref_dtype = torch.float64 if dtype in (torch.float64, torch.float32) or not torch.cuda.is_available() \
            else torch.float32
        self.worst: tuple[float, str] = (0.0, "")
        self.layers = 0
        self.computed: torch.dtype | None = None  # what attention received (autocast inside a wrapped forward)

    @torch.no_grad()
    def record(self, module, q_THE, k_TKE, v_TKE, o_THE, *, scale, sliding_window, softcap) -> None:
        self.layers += 1
        self.computed = q_THE.dtype
        G = q_THE.shape[1] // k_TKE.shape[1]
        vmax = float(v_TKE.abs().max()) or 1.0
        for s, path in enumerate(self.paths):
            q = q_THE[path].to(self.ref_dtype).transpose(0, 1)
            k = k_TKE[path].to(self.ref_dtype).transpose(0, 1).repeat_interleave(G, 0)
            v = v_TKE[path].to(self.ref_dtype).transpose(0, 1).repeat_interleave(G, 0)
            scores = q @ k.transpose(1, 2) * scale
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            L = path.shape[0]
            i = torch.arange(L, device=q.device)
            visible = i[None, :] <= i[:, None]
            if sliding_window is not None:
                visible &= (i[:, None] - i[None, :]) < sliding_window
            ref = (torch.softmax(scores.masked_fill(~visible, float("-inf")), -1) @ v).transpose(0, 1)
            diff = float((o_THE[path].to(self.ref_dtype) - ref).abs().max()) / vmax
            if diff > self.worst[0]:
                self.worst = (diff, f"layer {self.layers - 1} ({type(module).__name__}), check sequence {s}")


def effective_dtype(hf: nn.Module) -> tuple[torch.device, torch.dtype]:
    """(device, the precision the forward computes in): the autocast dtype under autocast, else the weights'."""
    device, dtype = model_device_dtype(hf)
    if torch.is_autocast_enabled(device.type):
        dtype = torch.get_autocast_dtype(device.type)
    return device, dtype


def _reference_implementation(hf: nn.Module) -> str:
    """The model's own implementation (what it ran before treepack was installed)."""
    from treepack.hf.attention import IMPLEMENTATION, fallback_implementation

    impl = hf.config._attn_implementation
    impl = fallback_implementation(hf.config) if impl in (None, IMPLEMENTATION) else impl
    if getattr(hf.config, "attn_logit_softcapping", None) and impl not in ("eager", "flex_attention"):
        # transformers releases before 5.2x ran Gemma 2 on sdpa and dropped the soft-capping there: the
        # model's definition (and treepack's tree) is the soft-capped one, which eager computes
        return "eager"
    return impl


def self_check(model: nn.Module, arrays: list[np.ndarray], *, attention: str = "auto") -> dict:
    """Run the check (see the module docstring); returns the measured differences, raises
    `SelfCheckError` beyond tolerance."""
    prep = prepare_model(model)
    hf = prep.hf
    device, dtype = effective_dtype(hf)
    seqs = check_sequences(arrays)
    if prep.max_length is not None:  # length-dependent RoPE: stay on the short side of its switch
        seqs = [s[: prep.max_length] for s in seqs]
    (pack,) = plan_packs(seqs, None)
    batch = TreeBatch.from_pack(pack)
    paths = [torch.as_tensor(np.asarray(pack.path(s)), dtype=torch.long, device=device)
             for s in range(pack.n_sequences)]
    probe = AttentionProbe(paths, dtype)
    reference = _reference_implementation(hf)
    was_training = hf.training
    hf.eval()
    try:
        with torch.no_grad():
            res = pack_logprobs(model, batch, attention=attention, _probe=probe)
            tree = res.per_sequence()
            acc = logprob_dtype(dtype)
            diffs = []
            with attention_implementation(hf, reference):  # the model's own forward, logits and all
                for s, seq_pos in enumerate(pack.seq_index.tolist()):
                    ids = torch.as_tensor(seqs[seq_pos], device=device)[None]
                    logits = hf(input_ids=ids, use_cache=False).logits[0, :-1].to(acc)
                    ref = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0]
                    diffs.append(float((tree[s].to(acc) - ref).abs().max()) if ref.numel() else 0.0)
    finally:
        hf.train(was_training)
    if probe.computed is not None and probe.computed.itemsize < dtype.itemsize:
        dtype = probe.computed  # a forward wrapped in autocast (accelerate's mixed precision: TRL's bf16 = True)
    tol_lp, tol_attn = TOLERANCES.get(dtype, TOLERANCES[torch.float32])
    if reference == "eager" and dtype == torch.float64:
        tol_lp = TOLERANCES[torch.float32][0]  # eager upcasts softmax to float32
    worst_lp = max(diffs)
    result = {"logprob_max_abs_diff": worst_lp, "attention_max_rel_diff": probe.worst[0],
              "tolerance": (tol_lp, tol_attn), "reference": reference, "dtype": str(dtype).removeprefix("torch."),
              "foreign_masks": sorted(set(res.extra.get("foreign", [])))}
    mask_foreign = result["foreign_masks"]
    problems = []
    if mask_foreign:
        problems.append(f"the attention layers received {mask_foreign[0]} instead of treepack's tree mask "
                        "(something replaced the mask function)")
    if probe.worst[0] > tol_attn:
        problems.append(f"attention output differs from per-sequence causal attention by {probe.worst[0]:.3g} "
                        f"(relative to max |v|; tolerance {tol_attn:g}) at {probe.worst[1]}")
    if worst_lp > tol_lp:
        problems.append(f"log-probs differ from the model's own per-sequence forward ({reference}) by "
                        f"max |diff| = {worst_lp:.3g} (tolerance {tol_lp:g} for {result['dtype']})")
    if problems:
        raise SelfCheckError(f"treepack.hf self-check failed for {type(hf).__name__}: " + "; ".join(problems))
    return result


def ensure_checked(model: nn.Module, arrays: list[np.ndarray], *, attention: str = "auto") -> dict | None:
    """`self_check` once per (model, dtype, device, attention); later calls return None."""
    hf = prepare_model(model).hf
    device, dtype = effective_dtype(hf)
    key = (dtype, device.type, attention)
    done = _CHECKED.setdefault(hf, set())
    if key in done or not any(len(a) for a in arrays):
        return None
    result = self_check(model, arrays, attention=attention)
    done.add(key)
    return result


# --------------------------------------------------------------------------------------------------
# float64 that stays float64


_LOW_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


class exact_float64(torch.overrides.TorchFunctionMode):
    """Inside this block a float64 tensor is never cast down to float32/16.

    transformers computes RMSNorm, RoPE angles and eager softmax "in float32" (``x.to(torch.float32)``,
    ``softmax(..., dtype=torch.float32)``): for float64 models that is a downcast. Forward values stay
    identical between a tree and a per-sequence run (same inputs, same ops), but backward rounds each
    gradient to float32 where the cast was, and a shared token's gradient is summed *before* that rounding
    in the tree and *after* it per sequence: the two gradients then differ by float32 rounding (~1e-7
    relative) although both are correct to that precision. Under this mode both are float64 end to end
    and agree to ~1e-15 (tests/test_hf_equivalence.py runs the 1e-9 gradient checks in it).

    Integer and boolean tensors cast to a low float become float64 too: rotary embeddings multiply the
    (float64) inverse frequencies by ``position_ids.float()``, which would otherwise be float32.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        x = args[0] if args else None
        if isinstance(x, torch.Tensor) and (x.dtype == torch.float64 or not x.is_floating_point()):
            if func is torch.Tensor.float:
                return x.double()
            if func is torch.Tensor.type_as and args[1].dtype in _LOW_FLOATS:
                return x.double()
            if func is torch.Tensor.type and (args[1:2] or [kwargs.get("dtype")])[0] in _LOW_FLOATS:
                return x.double()  # DeepSeek's routers: x.type(torch.float32)
            if func is torch.Tensor.to:
                args = tuple(torch.float64 if isinstance(a, torch.dtype) and a in _LOW_FLOATS else a for a in args)
                if kwargs.get("dtype") in _LOW_FLOATS:
                    kwargs["dtype"] = torch.float64
            if func in _SOFTMAXES and kwargs.get("dtype") in _LOW_FLOATS:
                kwargs["dtype"] = torch.float64
        return func(*args, **kwargs)


_SOFTMAXES = {torch.softmax, torch.log_softmax, torch.nn.functional.softmax, torch.nn.functional.log_softmax,
              torch.Tensor.softmax, torch.Tensor.log_softmax}
