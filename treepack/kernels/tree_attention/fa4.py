"""Tree attention through FlashAttention-4 (``flash-attn-4``, CuTe DSL): Hopper and Blackwell, bf16 / fp16.

Why: FA4's Hopper kernels are FA3-class (two consumer warp groups in ping-pong around the softmax, TMA loads,
wgmma), which Triton 3.6 cannot express; our Triton kernel is FA2-style. On an H100 (bf16, Hq 16 x 128,
Hkv 8, fwd+bwd, FLOPs over visible pairs only) FA4 ran treepack's 32K packs (held-out tau-bench, ToolBench,
tau2, tau2-think, agentic-think) at 313-441 TFLOP/s against 258-336 for the Triton kernel and 230-348 for the
fastest dense backend over the leaf sequences: 1.21-1.49x per pair
(benchmarks/results/2026-11-25-attention-fa4-h100.md). Its per-call host cost is higher (1.3-1.6 ms per
fwd+bwd of a small call), so `backends.pick_backend` sends small calls to the Triton kernel, and calls of a
shape seen before replay FA4's compiled launches without its Python (`fa4_replay`: 1.17-1.18x on a dfs step,
benchmarks/results/2026-11-25-fa4-replay-h200.md).

How: FA4 takes one [1, S, H, D] problem with
* block sparsity at 128 x 128 (query block x key block): per query block the key blocks that are *full*
  (no mask evaluated) and *partial* (mask_mod evaluated per score), and the transposed lists for the
  backward (per key block its query blocks). Built here once per pack (and prefix length) from the same
  min / max tests as `blocks.prepare`, cached on the `TreeMaskInfo`, no host sync;
* a ``mask_mod`` reading one int32 per key, ``key_end``: key n of the S = P + T keys ([cached prefix | pack])
  is visible to query m iff ``n - P <= m < key_end[n]``, with ``P = seqlen_k - seqlen_q`` (so prefix keys,
  ``key_end = T``, are visible to all queries and pack key n - P has ``key_end = subtree_end[n - P]``). With
  P = 0 this is the contract ``k <= q < subtree_end[k]``.
FA4 evaluates a mask_mod per score of a partial block; `fa4_mask` installs into FA4's mask loop a version that
reads ``key_end`` once per key column of a tile (a key's visible queries are one interval): FA4's fwd+bwd 0.85x
on a ToolBench pack, 0.92x on tau-bench, the same bits (results/2026-11-26-fa4-mask-per-key-h100.md).
``TREEPACK_FA4_MASK=per-score`` keeps FA4's own loop, for comparison.
The prefix is concatenated in front of the pack's keys (a copy of (P + T) x Hkv x D per call, ~1% of the
attention time at P = T) and its gradient split off again.

Exactness: same function as the reference (tests compare out and every gradient with float32 / float64
references on random trees, with and without a prefix); FA4's backward accumulates dQ with float32 atomics,
so dQ is not bitwise deterministic (like the fused Triton backward).

The registered op (``torch.ops.treepack.tree_attention_fa4_fwd``) keeps FA4 opaque to ``torch.compile`` (a
compiled decoder layer calls it like the Triton op).
FA4 compiles its kernels on first use (10-15 s for forward + backward on an H100) and caches them per process.
FA4's ``FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1`` keeps them on disk across runs, but with it a second
`treepack train` on the same machine ran ToolBench steps at 27-31% MFU instead of 44-50% (two machines; without
it back-to-back runs matched; cause not found, results/2026-11-26-fa4-bwd-order-h100.md): leave it off.

Shape suffixes: T pack tokens, P prefix tokens, S = P + T keys, H query heads, K kv heads, D head dim, M query
blocks, N key blocks.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import sys
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor

from .blocks import TreeMaskInfo
from .fa4_mask import KEY_INTERVAL_ATTR, patch_fa4_mask
from .fa4_order import FA4_FWD_ORDER, fa4_forward_order, longest_first_unavailable
from .fa4_replay import LaunchReplay, ReplayStats
from .ops import register_kernel_ops

__all__ = ["FA4_BLOCK", "FA4_BWD_ORDERS", "FA4_DTYPES", "FA4_HEAD_DIMS", "bwd_order", "fa4_importable",
           "fa4_supported_device", "fa4_supports", "fa4_tables", "fa4_tail_share", "fa4_unsupported_reason",
           "predicted_tail", "tail_share", "tree_attention_fa4"]

FA4_BLOCK = 128  # FA4's Hopper forward tile (hdim 128) and the block-sparsity granularity it requires there
# The backward's query blocks: FA4's Hopper backward runs 64-row tiles on 128-row and 64-row sparse blocks (two
# tiles a listed block, or one: then no half-block that the mask empties is visited), 80-row tiles (FA3's
# non-causal hdim-128 choice) on 80-row ones
FA4_BWD_BLOCKS_Q = (128, 80, 64)
FA4_BWD_BLOCK_Q = 128
FA4_DTYPES = (torch.bfloat16, torch.float16)
FA4_HEAD_DIMS = (64, 128)
FA4_ARCH_MAJORS = (9, 10)  # Hopper, Blackwell (datacenter)

# the tree mask read once per key column of a partial block (`fa4_mask`, the default) or, for comparison, FA4's
# own per-score evaluation: TREEPACK_FA4_MASK=per-key|per-score sets it for a run
FA4_MASK = os.environ.get("TREEPACK_FA4_MASK", "per-key").strip().lower() or "per-key"
if FA4_MASK not in ("per-key", "per-score"):
    warnings.warn(f"TREEPACK_FA4_MASK={FA4_MASK!r} is not per-key or per-score: using per-key", RuntimeWarning,
                  stacklevel=1)
    FA4_MASK = "per-key"
MASK_PER_KEY = FA4_MASK == "per-key"

_IMPORT_ERROR: list[str] = []


@functools.cache
def _fa4():
    """FA4's entry points and our mask_mod, imported on first use (the import itself takes ~10 s)."""
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch
    from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd

    # before any kernel is built: kernels built from here read key_end once per key column
    if MASK_PER_KEY and (reason := patch_fa4_mask()):
        warnings.warn(f"the tree mask runs per score in FA4 (same results, slower): {reason}", RuntimeWarning,
                      stacklevel=2)
    if FA4_FWD_ORDER == "lpt" and (reason := longest_first_unavailable()):
        warnings.warn(f"FA4's forward runs tree packs in its own order (same results, slower): {reason}",
                      RuntimeWarning, stacklevel=2)
    # the forward's order is mixed into the mask's hash: FA4's compile caches do not key on the scheduler
    return _flash_attn_fwd, _flash_attn_bwd, BlockSparseTensorsTorch, _tree_mask_mod(
        "fwd-lpt" if FA4_FWD_ORDER == "lpt" and not longest_first_unavailable() else "")


@functools.cache
def _tree_mask_mod(variant: str):
    """The mask_mod: key n visible to query m iff ``n - P <= m < key_end[n]``. A non-empty ``variant`` names
    a kernel built differently around the same mask (FA4 keys its compile caches, in memory and on disk, by
    the mask_mod's hash, not by our scheduler): it is mixed into the hash. Marked ``__key_interval__`` (when
    `MASK_PER_KEY`): `fa4_mask` evaluates it once per key column where it is installed."""
    import hashlib

    import cutlass
    from cutlass import cute
    from flash_attn.cute import utils

    @cute.jit
    def tree_mask_mod(batch, head, m_idx, n_idx, seqlen_info, aux_tensors):
        key_end = aux_tensors[0]
        end = utils.scalar_to_ssa(key_end[n_idx[0]], cutlass.Int32)
        offset = utils.scalar_to_ssa(seqlen_info.seqlen_k - seqlen_info.seqlen_q, cutlass.Int32)
        return (n_idx <= m_idx + offset) & (m_idx < end)

    setattr(tree_mask_mod, KEY_INTERVAL_ATTR, MASK_PER_KEY)
    base = utils.hash_callable(tree_mask_mod, set_cute_hash=False)
    tag = f"{variant}:per-key" if MASK_PER_KEY else variant
    if tag:
        tree_mask_mod.__cute_hash__ = hashlib.sha256(f"{base}:{tag}".encode()).hexdigest()
    return tree_mask_mod


@functools.cache
def _heads_fast_scheduler(group: int = 0):
    """FA4's one-tile-per-CTA scheduler with the heads varying fastest along the grid.

    Why: the Hopper backward runs one CTA per (key block, head) and loops over the key block's visible query
    blocks, so a key block of a shared prefix (seen by every query) is a long CTA and a key block in a short
    branch a short one. FA4's grid puts the key blocks fastest and the heads slowest, so the last head's
    long CTAs start only when ~15/16 of the work has started and run alone at the end. A list-scheduling
    model over 132 SMs puts ToolBench's one-forest 32K packs at 1.26-1.44x their balanced time in FA4's
    order and 1.00-1.01x heads fastest; measured (1x H100), FA4's time in that training step went from 0.151
    to 0.119 s. Heads fastest also spreads each head's queries over fewer concurrent CTAs (less L2 reuse):
    on a tau2-think pack, where the model predicts little tail, its backward was 1.17-1.21x slower; groups
    of 4 heads (``group=4``) sit between the two (results/2026-11-26-fa4-bwd-order-h100.md)."""
    import cutlass
    from cutlass import cute
    from flash_attn.cute.tile_scheduler import SingleTileScheduler

    class HeadsFastScheduler(SingleTileScheduler):
        @staticmethod
        def get_grid_shape(params, *, loc=None, ip=None):
            assert params.cluster_shape_mn == (1, 1), "heads-fast order is for one-CTA clusters"
            return (params.num_block * params.num_head * params.num_splits, cutlass.Int32(1), params.num_batch)

        @staticmethod
        def create(params, ctx=None, *, loc=None, ip=None):
            x, _, batch = cute.arch.block_idx()
            if group:  # groups of `group` heads one after another, heads fastest within a group
                per_group = params.num_block * group
                first, r = (x // per_group) * group, x % per_group
                return HeadsFastScheduler(params, (r // group, first + r % group, batch), loc=loc, ip=ip)
            heads = params.num_head * params.num_splits
            return HeadsFastScheduler(params, (x // heads, x % heads, batch), loc=loc, ip=ip)

        def __new_from_mlir_values__(self, values):
            base = super().__new_from_mlir_values__(values)
            out = HeadsFastScheduler(base.params, base._blk_coord, loc=self._loc)
            out._is_first_block = self._is_first_block
            return out

    return HeadsFastScheduler


@functools.cache
def _arch_major(index: int | None) -> int:
    return torch.cuda.get_device_capability(index)[0]


FA4_BWD_ORDERS = ("fa4", "heads-fast", "heads-4")  # op argument bwd_order: the index; heads-4: groups of 4 heads
# the backward grid's order on Hopper: auto (per pack, `bwd_order`) or one of FA4_BWD_ORDERS; the environment's
# TREEPACK_FA4_BWD_ORDER sets it for a run (`treepack train` has no option of its own for it)
FA4_BWD_ORDER = os.environ.get("TREEPACK_FA4_BWD_ORDER", "auto").strip().lower() or "auto"
if FA4_BWD_ORDER not in ("auto", *FA4_BWD_ORDERS):
    warnings.warn(f"TREEPACK_FA4_BWD_ORDER={FA4_BWD_ORDER!r} is not auto or one of {', '.join(FA4_BWD_ORDERS)}: "
                  "using auto", RuntimeWarning, stacklevel=1)
    FA4_BWD_ORDER = "auto"
# auto: heads fastest when FA4's order is predicted to take >= this x the balanced time. 1.15: tau-bench dfs calls
# over a cached prefix predicted at 1.17 ran their backward 5-7% faster heads fastest (1x H100,
# results/2026-11-26-dfs-bwd-order-h100.md); the packs measured before stay where they were (tau-bench 1.05 and
# tau2-think 1.09 in FA4's order, ToolBench 1.34-1.51 heads fastest)
HEADS_FAST_AT = 1.15


def predicted_tail(tail_share: float, heads: int) -> float:
    """FA4's order over a balanced schedule, predicted: the last head's CTAs start when (H - 1) / H of the
    work has started, so its longest CTA ends ``c_max`` after that (``tail_share`` = c_max x SMs / sum of
    c over one head's CTAs). Measured against a list-scheduling simulation of the same block lists:
    ToolBench packs 1.51 / 1.34 (simulated 1.44 / 1.26), tau2-think 1.09 (1.07), tau-bench 1.05 (1.05)."""
    return max(1.0, (heads - 1) / heads + tail_share / heads)


def bwd_order(tail_share: float | None, heads: int, device: torch.device) -> int:
    """The backward grid order (an index of FA4_BWD_ORDERS) for a call: `FA4_BWD_ORDER` if set, else
    heads fastest where FA4's own order is predicted to run >= HEADS_FAST_AT x the balanced time.

    Why per call: heads fastest took FA4's time in a ToolBench one-forest training step from 0.151 to 0.119 s
    (1x H100), but made a tau2-think pack's fwd+bwd 1.17-1.21x slower (its work is balanced; FA4's order
    keeps a head's queries in L2), results/2026-11-26-fa4-bwd-order-h100.md. A dfs call's cached prefix is
    seen by all its queries, so its key blocks are the longest CTAs (`tail_share`). Hopper only (sm100 has
    its own kernel)."""
    if device.type != "cuda" or _arch_major(device.index) != 9:
        return 0
    if FA4_BWD_ORDER != "auto":
        return FA4_BWD_ORDERS.index(FA4_BWD_ORDER)
    if tail_share is None:
        return 0
    return int(predicted_tail(tail_share, heads) >= HEADS_FAST_AT)


@contextlib.contextmanager
def _bwd_grid_order(order: str):
    """FA4's Hopper backward built with ``order``'s scheduler while this is open (it reads the scheduler
    when it compiles; a compiled kernel keeps its own grid and block decoding, so kernels of either order
    are exact)."""
    if order == "fa4":
        yield
        return
    import flash_attn.cute.flash_bwd_sm90 as sm90

    library = sm90.SingleTileScheduler
    sm90.SingleTileScheduler = _heads_fast_scheduler(4 if order == "heads-4" else 0)
    try:
        yield
    finally:
        sm90.SingleTileScheduler = library


def fa4_importable() -> bool:
    """Whether flash-attn-4 (``flash_attn.cute``) imports here; the answer is cached."""
    if _IMPORT_ERROR:
        return _IMPORT_ERROR[0] == ""
    try:
        _fa4()
        _IMPORT_ERROR.append("")
    except Exception as e:  # noqa: BLE001 - any import failure means "not available"
        _IMPORT_ERROR.append(f"{type(e).__name__}: {e}")
    return _IMPORT_ERROR[0] == ""


def fa4_supported_device(device: torch.device) -> bool:
    """A CUDA device of an architecture FA4 compiles for (Hopper sm90, datacenter Blackwell sm100)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] in FA4_ARCH_MAJORS


def _unsupported(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    if device.type != "cuda":
        return f"the fa4 backend needs CUDA tensors, got {device}"
    if not fa4_supported_device(device):
        major = torch.cuda.get_device_capability(device)[0]
        return f"the fa4 backend needs a Hopper or Blackwell GPU (sm90 / sm100), got sm{major}x"
    if dtype not in FA4_DTYPES:
        return f"the fa4 backend supports bfloat16 and float16, got {str(dtype).removeprefix('torch.')}"
    if head_dim not in FA4_HEAD_DIMS:
        return f"the fa4 backend supports head dims {', '.join(map(str, FA4_HEAD_DIMS))}, got D={head_dim}"
    if not fa4_importable():
        return f"flash-attn-4 is not importable ({_IMPORT_ERROR[0]}); install treepack[fa4]"
    return None


def fa4_supports(call) -> str | None:
    """Why the fa4 backend cannot run a `registry.AttentionCall`, or None if it can."""
    return _unsupported(call.device, call.dtype, call.head_dim)


def fa4_unsupported_reason(q: Tensor) -> str | None:
    """Why the fa4 backend cannot run on these (validated) inputs, or None if it can."""
    return _unsupported(q.device, q.dtype, q.shape[-1])


def _compact(mask_RC: Tensor) -> tuple[Tensor, Tensor]:
    """Per row the count and the ascending column indices packed left ([1, 1, R], [1, 1, R, C]); full
    width, so no host sync (FA4 reads only the first count entries of a row)."""
    C = mask_RC.shape[1]
    col_C = torch.arange(C, device=mask_RC.device, dtype=torch.int32)
    idx_RC = torch.where(mask_RC, col_C, C + col_C).sort(dim=1).values
    idx_RC = torch.where(idx_RC < C, idx_RC, 0).to(torch.int32)
    # through a flat view: a size-1 dimension (one query block) keeps whatever stride the sort left it, which
    # `contiguous()` does not touch and FA4 rejects (it requires stride 1 on the last dimension)
    return (mask_RC.sum(1, dtype=torch.int32).reshape(-1).view(1, 1, -1),
            idx_RC.contiguous().reshape(-1).view(1, 1, *idx_RC.shape))


def _block_masks(lo_S: Tensor, hi_S: Tensor, T: int, block_q: int) -> tuple[Tensor, Tensor]:
    """(partial, full) [M, N] for query blocks of ``block_q`` rows and FA4_BLOCK-key blocks, from each key's
    first visible query ``lo_S`` and exclusive end ``hi_S``."""
    S, dev = lo_S.numel(), lo_S.device
    M, N = -(-T // block_q), -(-S // FA4_BLOCK)
    pad = N * FA4_BLOCK - S
    lo_NB = F.pad(lo_S, (0, pad), value=T).view(N, FA4_BLOCK)  # a ragged key block is never full, never seen past S
    hi_NB = F.pad(hi_S, (0, pad), value=0).view(N, FA4_BLOCK)
    q0_M = torch.arange(M, device=dev, dtype=torch.int32) * block_q
    qlast_M = torch.clamp(q0_M + block_q, max=T) - 1
    nonempty_MN = (lo_NB.amin(1)[None, :] <= qlast_M[:, None]) & (hi_NB.amax(1)[None, :] > q0_M[:, None])
    full_MN = (lo_NB.amax(1)[None, :] <= q0_M[:, None]) & (hi_NB.amin(1)[None, :] > qlast_M[:, None])
    return nonempty_MN & ~full_MN, full_MN


def fa4_tables(subtree_end: Tensor | TreeMaskInfo, prefix_len: int = 0, *,
               bwd_block_q: int | None = None, prefix_valid: Tensor | None = None) -> tuple[Tensor, ...]:
    """FA4's inputs besides q, k, v for a pack and prefix length: (key_end [S padded to 128], forward block
    lists: partial count, partial index, full count, full index; backward (transposed, query blocks of
    ``bwd_block_q`` rows, default `FA4_BWD_BLOCK_Q`): the same four). Cached on a TreeMaskInfo per prefix
    length and block size. ~20 small torch ops on the pack's device.

    ``prefix_valid`` (an int tensor of one element, on the device): only the first ``prefix_valid`` of the
    ``prefix_len`` prefix keys are visible, the rest are hidden from every query (``key_end = 0``) and their
    blocks skipped. It lets a call of fixed shape (a CUDA graph) read a prefix of any length up to
    ``prefix_len`` without a host sync. Not cached (the tables depend on the tensor's value)."""
    bwd_block_q = FA4_BWD_BLOCK_Q if bwd_block_q is None else int(bwd_block_q)
    if bwd_block_q not in FA4_BWD_BLOCKS_Q:
        raise ValueError(f"bwd_block_q must be one of {FA4_BWD_BLOCKS_Q}, got {bwd_block_q}")
    info = subtree_end if isinstance(subtree_end, TreeMaskInfo) else None
    key = ("fa4", int(prefix_len), bwd_block_q)
    if info is not None and prefix_valid is None and key in info.cache:
        return info.cache[key]
    se_T = (info.subtree_end_T if info is not None else subtree_end).to(torch.int32)
    T, P, dev = se_T.numel(), int(prefix_len), se_T.device
    S = P + T
    # per key: first query that sees it (lo) and the exclusive end of its queries (hi)
    lo_S = torch.cat([torch.zeros(P, device=dev, dtype=torch.int32), torch.arange(T, device=dev, dtype=torch.int32)])
    if prefix_valid is None:
        hi_P = torch.full((P,), T, device=dev, dtype=torch.int32)
    else:
        hi_P = torch.where(torch.arange(P, device=dev) < prefix_valid.reshape(()), T, 0).to(torch.int32)
    hi_S = torch.cat([hi_P, se_T])
    partial_MN, full_MN = _block_masks(lo_S, hi_S, T, FA4_BLOCK)
    if bwd_block_q != FA4_BLOCK:
        bpartial_MN, bfull_MN = _block_masks(lo_S, hi_S, T, bwd_block_q)
    else:
        bpartial_MN, bfull_MN = partial_MN, full_MN
    pad = -(-S // FA4_BLOCK) * FA4_BLOCK - S
    out = (F.pad(hi_S, (0, pad), value=0).contiguous(),
           *_compact(partial_MN), *_compact(full_MN),
           *_compact(bpartial_MN.T.contiguous()), *_compact(bfull_MN.T.contiguous()))
    if info is not None and prefix_valid is None:
        info.cache[key] = out
    return out


def fa4_tail_share(subtree_end: Tensor | TreeMaskInfo, prefix_len: int = 0, *,
                   bwd_block_q: int | None = None, prefix_visible: int | None = None) -> float | None:
    """`tail_share` of a call's backward block lists, from the host copy of ``subtree_end`` a TreeMaskInfo
    carries (``cache["host_subtree_end"]``: `AttentionContext.tree`'s ``host``, or a dfs call's own ends),
    cached on it per prefix. None without one: deciding from device tensors would cost a host sync per call
    (`tree_attention` called on device tensors alone keeps FA4's order)."""
    info = subtree_end if isinstance(subtree_end, TreeMaskInfo) else None
    if info is None or "host_subtree_end" not in info.cache:
        return None
    bwd_block_q = FA4_BWD_BLOCK_Q if bwd_block_q is None else int(bwd_block_q)
    key = ("fa4-tail", bwd_block_q) if not prefix_len else ("fa4-tail", bwd_block_q, int(prefix_len), prefix_visible)
    if key not in info.cache:
        dev = info.device
        sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 132
        info.cache[key] = tail_share(info.cache["host_subtree_end"], prefix_len, bwd_block_q=bwd_block_q,
                                     prefix_visible=prefix_visible, sms=sms)
    return info.cache[key]


def tail_share(subtree_end_T, prefix_len: int = 0, *, bwd_block_q: int | None = None,
               prefix_visible: int | None = None, sms: int = 132) -> float:
    """The longest backward CTA's work x SMs / one head's work (`predicted_tail`'s input), counted on the host
    from a call's ``subtree_end`` (numpy or CPU tensor) and its cached prefix: ``prefix_len`` keys before the
    call's, the first ``prefix_visible`` of them seen by every query (default all) and the rest hidden.

    Why prefixes count: a prefix key block is seen by every query, so its CTA is the longest of the grid, and in
    FA4's head-major order the last head's prefix CTAs end the kernel alone. On a tau-bench dfs call (T = 6,265
    over 1,212 cached rows, 1x H100) heads fastest took the backward from 1.056 to 1.006 ms; with the prefix read
    at a 2,048-row bucket, 836 rows hidden as a CUDA graph reads it, from 1.310 to 1.026 ms (the partially hidden
    key block is partial for every query block, the longest CTA of all)."""
    bwd_block_q = FA4_BWD_BLOCK_Q if bwd_block_q is None else int(bwd_block_q)
    se_T = torch.as_tensor(subtree_end_T).to(device="cpu", dtype=torch.int32)
    T, P = se_T.numel(), int(prefix_len)
    lo_S = torch.cat([torch.zeros(P, dtype=torch.int32), torch.arange(T, dtype=torch.int32)])
    hi_P = torch.full((P,), T, dtype=torch.int32)
    if prefix_visible is not None:
        hi_P[int(prefix_visible):] = 0
    partial_MN, full_MN = _block_masks(lo_S, torch.cat([hi_P, se_T]), T, bwd_block_q)
    # a CTA's work: its query tiles (two 64-row tiles per 128-row block, else one per block; a partial block's
    # mask costs ~1.5x) + 1
    tiles = 2 if bwd_block_q == 128 else 1
    cost_N = tiles * (full_MN.sum(0).float() + 1.5 * partial_MN.sum(0).float()) + 1.0
    return float(cost_N.max() * sms / cost_N.sum())


def _sparse(tables: tuple[Tensor, ...], bwd_block_q: int):
    BST = _fa4()[2]
    fwd = BST(mask_block_cnt=tables[0], mask_block_idx=tables[1], full_block_cnt=tables[2],
              full_block_idx=tables[3], block_size=(FA4_BLOCK, FA4_BLOCK))
    bwd = BST(mask_block_cnt=tables[4], mask_block_idx=tables[5], full_block_cnt=tables[6],
              full_block_idx=tables[7], block_size=(bwd_block_q, FA4_BLOCK))
    return fwd, bwd


def _keys(k: Tensor, prefix_k: Tensor | None) -> Tensor:
    return k if prefix_k is None else torch.cat([prefix_k, k])


def _flash_modules():
    return [m for name, m in list(sys.modules.items()) if name.startswith("flash_attn.cute") and m is not None]


_REPLAY_FWD = LaunchReplay(_flash_modules)
_REPLAY_BWD = LaunchReplay(_flash_modules)


def fa4_replay_stats() -> tuple[ReplayStats, ReplayStats]:
    """(forward, backward) counts of FA4 calls replayed, recorded and run plainly in this process."""
    return _REPLAY_FWD.stats, _REPLAY_BWD.stats


def _fwd(q: Tensor, k: Tensor, v: Tensor, prefix_k: Tensor | None, prefix_v: Tensor | None,
         key_end: Tensor, fcnt: Tensor, fidx: Tensor, ffull_cnt: Tensor, ffull_idx: Tensor,
         bcnt: Tensor, bidx: Tensor, bfull_cnt: Tensor, bfull_idx: Tensor, scale: float, bwd_block_q: int,
         bwd_order: int) -> tuple[Tensor, Tensor]:
    """Forward: (out [T, Hq, D], lse [Hq, T] float32)."""
    q4, k4, v4 = q[None], _keys(k, prefix_k)[None], _keys(v, prefix_v)[None]
    out4, lse3 = torch.empty_like(q4), q.new_empty(1, q.shape[1], q.shape[0], dtype=torch.float32)

    def run():
        fa_fwd, _, _, mask_mod = _fa4()
        fwd, _ = _sparse((fcnt, fidx, ffull_cnt, ffull_idx, bcnt, bidx, bfull_cnt, bfull_idx), bwd_block_q)
        with fa4_forward_order(FA4_FWD_ORDER):
            fa_fwd(q4, k4, v4, softmax_scale=scale, causal=False, pack_gqa=False, mask_mod=mask_mod,
                   block_sparse_tensors=fwd, return_lse=True, aux_tensors=[key_end], out=out4, lse=lse3)

    _REPLAY_FWD(("fwd", scale), (q4, k4, v4, out4, lse3, key_end, fcnt, fidx, ffull_cnt, ffull_idx), run,
                outputs=(out4, lse3))
    return out4[0], lse3[0]


def _fwd_fake(q, k, v, prefix_k, prefix_v, key_end, fcnt, fidx, ffull_cnt, ffull_idx, bcnt, bidx, bfull_cnt,
              bfull_idx, scale, bwd_block_q, bwd_order):
    T, H, _ = q.shape
    return torch.empty_like(q), q.new_empty(H, T, dtype=torch.float32)


_ORDERS_BUILT: set[tuple] = set()  # backward kernels whose every auto grid order is compiled


def _build_other_orders(order: str, key: tuple, run_other) -> None:
    """At the first backward of a kind of call (scale, block, dtype, heads, head dim, prefix or not), also run it
    in the other grid order `bwd_order` may pick per pack, into scratch, so FA4 compiles both kernels in that
    step. Without it the first pack of the other order compiled FA4's backward inside a later step (5-8 s), and
    under data parallelism on whichever rank met it first while the others waited (tau2, step 2 of a 1-GPU
    run: 3.8 s, against 0.99 s with both built: results/2026-11-28-modes-h200.md). Only where the order is chosen
    per pack (Hopper, `FA4_BWD_ORDER` auto); never while a CUDA graph is being captured."""
    if FA4_BWD_ORDER != "auto" or key in _ORDERS_BUILT or _arch_major(key[-1].index) != 9:
        return
    if torch.cuda.is_current_stream_capturing():
        return
    _ORDERS_BUILT.add(key)
    for other in FA4_BWD_ORDERS[:2]:  # the orders `bwd_order` chooses from (heads-4 only when set)
        if other != order:
            run_other(other)


def _bwd(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, prefix_k: Tensor | None, prefix_v: Tensor | None,
         out: Tensor, lse: Tensor, key_end: Tensor, fcnt: Tensor, fidx: Tensor, ffull_cnt: Tensor,
         ffull_idx: Tensor, bcnt: Tensor, bidx: Tensor, bfull_cnt: Tensor, bfull_idx: Tensor, scale: float,
         bwd_block_q: int, bwd_order: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Backward: (dq, dk, dv, dprefix_k, dprefix_v); the prefix grads are [0, Hkv, D] without a prefix.
    ``bwd_order``: the grid order, an index of `FA4_BWD_ORDERS` (`bwd_order` picks it)."""
    q4, k4, v4 = q[None], _keys(k, prefix_k)[None], _keys(v, prefix_v)[None]
    out4, do4, lse3 = out[None], grad_out.contiguous()[None], lse[None]
    dq4, dk4, dv4 = torch.empty_like(q4), torch.empty_like(k4), torch.empty_like(v4)

    order = FA4_BWD_ORDERS[bwd_order]
    if order == "heads-4" and q.shape[1] % 4:
        order = "heads-fast"  # groups of 4 need a multiple of 4 heads

    def run_in(grid_order: str, dq4: Tensor, dk4: Tensor, dv4: Tensor) -> None:
        fa_bwd = _fa4()[1]
        _, bwd = _sparse((fcnt, fidx, ffull_cnt, ffull_idx, bcnt, bidx, bfull_cnt, bfull_idx), bwd_block_q)
        with _bwd_grid_order(grid_order):
            fa_bwd(q4, k4, v4, out4, do4, lse3, softmax_scale=scale, causal=False,
                   mask_mod=_tree_mask_mod("" if grid_order == "fa4" else grid_order),
                   aux_tensors=[key_end], block_sparse_tensors=bwd, dq=dq4, dk=dk4, dv=dv4)

    _build_other_orders(order, (scale, bwd_block_q, q.dtype, q.shape[1], k.shape[1], q.shape[2], prefix_k is not None,
                                q.device), lambda other: run_in(other, *(torch.empty_like(t) for t in (dq4, dk4, dv4))))

    def run():
        run_in(order, dq4, dk4, dv4)

    _REPLAY_BWD(("bwd", scale, bwd_block_q, order),
                (q4, k4, v4, out4, do4, lse3, dq4, dk4, dv4, key_end, bcnt, bidx, bfull_cnt, bfull_idx), run,
                outputs=(dq4, dk4, dv4))
    dq, dk, dv = dq4[0], dk4[0], dv4[0]
    if prefix_k is None:
        return dq, dk, dv, k.new_empty(0, *k.shape[1:]), v.new_empty(0, *v.shape[1:])
    P = prefix_k.shape[0]  # outputs must not alias each other: the prefix part is copied
    return dq, dk[P:], dv[P:], dk[:P].clone(), dv[:P].clone()


def _bwd_fake(grad_out, q, k, v, prefix_k, prefix_v, out, lse, key_end, fcnt, fidx, ffull_cnt, ffull_idx, bcnt,
              bidx, bfull_cnt, bfull_idx, scale, bwd_block_q, bwd_order):
    K, D = k.shape[1], k.shape[2]
    dpk = torch.empty_like(prefix_k) if prefix_k is not None else k.new_empty(0, K, D)
    dpv = torch.empty_like(prefix_v) if prefix_v is not None else v.new_empty(0, K, D)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dpk, dpv


def _setup_context(ctx, inputs, output):
    q, k, v, prefix_k, prefix_v, *tables, scale, bwd_block_q, bwd_order = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, prefix_k, prefix_v, out, lse, *tables)
    ctx.scale = scale
    ctx.bwd_block_q = bwd_block_q
    ctx.bwd_order = bwd_order
    ctx.has_prefix = prefix_k is not None


def _backward(ctx, grad_out, grad_lse):
    q, k, v, prefix_k, prefix_v, out, lse, *tables = ctx.saved_tensors
    dq, dk, dv, dpk, dpv = torch.ops.treepack.tree_attention_fa4_bwd(grad_out, q, k, v, prefix_k, prefix_v, out,
                                                                      lse, *tables, ctx.scale, ctx.bwd_block_q,
                                                                      ctx.bwd_order)
    if not ctx.has_prefix:
        dpk = dpv = None
    return dq, dk, dv, dpk, dpv, *([None] * 9), None, None, None


tree_attention_fa4_fwd, tree_attention_fa4_bwd = register_kernel_ops(
    "tree_attention_fa4",
    "Tensor key_end, Tensor fcnt, Tensor fidx, Tensor ffull_cnt, Tensor ffull_idx, Tensor bcnt, Tensor bidx, "
    # SymInt, not int: an int argument makes Dynamo guard on its value, so a compiled layer recompiled for each
    # new backward grid order (0 / 1, chosen per pack; on an H200 tau2's step 2 took 8.8 s with that recompile and
    # FA4's compile of the other order, 3.8 s with FA4's alone: results/2026-11-28-modes-h200.md)
    "Tensor bfull_cnt, Tensor bfull_idx, float scale, SymInt bwd_block_q, SymInt bwd_order",
    fwd=_fwd, fwd_fake=_fwd_fake, bwd=_bwd, bwd_fake=_bwd_fake, backward=_backward, setup_context=_setup_context,
    dispatch_key="CUDA")


def tree_attention_fa4(
    q: Tensor, k: Tensor, v: Tensor, subtree_end: Tensor | TreeMaskInfo, *,
    prefix_k: Tensor | None = None, prefix_v: Tensor | None = None, scale: float | None = None,
) -> Tensor:
    """FA4 backend of `tree_attention` (inputs validated by the api)."""
    T, H, D = q.shape
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    if T == 0:
        return q.new_empty(0, H, D)
    if prefix_k is not None and prefix_k.shape[0] == 0:
        prefix_k = prefix_v = None
    P = 0 if prefix_k is None else prefix_k.shape[0]
    bwd_block_q = FA4_BWD_BLOCK_Q
    tables = fa4_tables(subtree_end, P, bwd_block_q=bwd_block_q)
    order = bwd_order(fa4_tail_share(subtree_end, P, bwd_block_q=bwd_block_q), H, q.device)
    if prefix_k is not None:
        prefix_k, prefix_v = prefix_k.contiguous(), prefix_v.contiguous()
    out, _ = tree_attention_fa4_fwd(q.contiguous(), k.contiguous(), v.contiguous(), prefix_k, prefix_v, *tables,
                                    float(scale), bwd_block_q, order)
    return out
