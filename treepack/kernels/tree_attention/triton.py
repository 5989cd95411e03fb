"""Tree attention in Triton: configuration, autotuning, launchers and the autograd function.

The kernels and their design (block schedule, online softmax in base 2, the split backward with no atomics,
the optional fused backward, measured speeds) are documented in `triton_kernels`. This module picks tile
shapes (``KernelConfig``: ``GPU_DEFAULT`` autotuned on GPU, ``PINNED`` for the tests and the interpreter),
launches the kernels, and registers them as ``torch.library`` ops with fake kernels and an autograd
formula that saves only the log-sum-exp, so ``torch.compile`` can trace a layer with the kernel inside.

Shape suffixes: T pack tokens, P prefix tokens, H query heads, K kv heads, D head dim, M query blocks of
the schedule, N key blocks of the schedule.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields

import torch
import triton
from torch import Tensor

from .blocks import TreeMaskInfo, prepare
from .ops import register_kernel_ops
from .triton_kernels import bwd_delta_kernel, bwd_dkdv_kernel, bwd_dq_kernel, fwd_kernel

__all__ = ["GPU_DEFAULT", "PINNED", "KernelConfig", "schedule_for", "tree_attention_triton"]

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class KernelConfig:
    """Tile shapes, warps and pipeline stages of the three kernels.

    ``autotune`` lets Triton pick the forward / dQ query block and every kernel's warps, stages and the
    dK/dV tiles on GPU; the schedule blocks (``sched_m``, ``sched_n``) are fixed by the TreeMaskInfo.
    ``fused_bwd`` computes dQ inside the dK/dV kernel (atomics; see the module docstring); that kernel
    then runs the ``dkdv_*`` tiles as given, also under ``autotune``.
    """

    sched_m: int = 128  # queries per schedule row (prepare's block_m)
    sched_n: int = 128  # keys per schedule block (prepare's block_n) = forward / dQ BLOCK_N
    fwd_block_m: int = 128  # forward queries per program, divides sched_m
    fwd_warps: int = 8
    fwd_stages: int = 3
    dq_block_m: int = 128  # dQ queries per program, divides sched_m
    dq_warps: int = 8
    dq_stages: int = 2
    dkdv_block_n: int = 128  # dK/dV keys per program
    dkdv_block_m: int = 64  # dK/dV queries per inner step
    dkdv_warps: int = 8
    dkdv_stages: int = 3
    autotune: bool = True
    # dQ by fp32 atomics from the dK/dV kernel instead of the dQ kernel; last, so that the lists of
    # `as_list` written before it existed still load (it takes its default)
    fused_bwd: bool = False

    def __post_init__(self):
        for name in ("sched_m", "sched_n", "fwd_block_m", "dq_block_m", "dkdv_block_n", "dkdv_block_m"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"KernelConfig.{name} must be a power of two >= 16, got {value}")
        for name in ("fwd_block_m", "dq_block_m"):
            if self.sched_m % getattr(self, name):
                raise ValueError(f"KernelConfig.{name}={getattr(self, name)} must divide sched_m={self.sched_m}")

    def as_list(self) -> list[int]:
        return [int(getattr(self, f.name)) for f in fields(self)]

    @staticmethod
    def from_list(values: list[int]) -> KernelConfig:
        kw = {f.name: v for f, v in zip(fields(KernelConfig), values)}
        for name in ("autotune", "fused_bwd"):
            if name in kw:
                kw[name] = bool(kw[name])
        return KernelConfig(**kw)


GPU_DEFAULT = KernelConfig()
# Small tiles: exercise ragged blocks, sub-blocks of a schedule row and several blocks per pack on tiny
# inputs; what the tests and the interpreter run.
PINNED = KernelConfig(
    sched_m=32, sched_n=16, fwd_block_m=16, fwd_warps=4, fwd_stages=1, dq_block_m=32, dq_warps=4, dq_stages=1,
    dkdv_block_n=32, dkdv_block_m=16, dkdv_warps=4, dkdv_stages=1, autotune=False,
)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# ----------------------------------------------------------------------------------------------------
# Autotuning (GPU only; the interpreter and tests run PINNED)
# ----------------------------------------------------------------------------------------------------


# Candidates, best first as measured on an H200 (benchmarks/NOTES-attention.md): shapes that lost by 1.5x
# or more there are left out; shapes that do not fit in shared memory are skipped by the autotuner.
def _fwd_configs():
    return [
        triton.Config({"BLOCK_M": bm}, num_warps=w, num_stages=s)
        for bm, w, s in [(128, 8, 3), (128, 8, 2), (64, 4, 3)]
    ]


def _dq_configs():
    return [
        triton.Config({"BLOCK_M": bm}, num_warps=w, num_stages=s)
        for bm, w, s in [(128, 8, 2), (64, 4, 3), (64, 8, 2)]
    ]


def _dkdv_configs():
    return [
        triton.Config({"BLOCK_N1": bn, "BLOCK_M1": bm}, num_warps=w, num_stages=s)
        for bn, bm, w, s in [(128, 64, 8, 3), (128, 32, 8, 3), (128, 64, 8, 2), (64, 32, 4, 2)]
    ]


_AUTOTUNED: dict[str, object] = {}


def _prune_block_m(configs, named_args, **kwargs):
    """Forward / dQ query blocks must divide the schedule row (SCHED_M)."""
    sched_m = kwargs.get("SCHED_M", named_args.get("SCHED_M", 128))
    kept = [c for c in configs if sched_m % c.kwargs["BLOCK_M"] == 0]
    return kept or [triton.Config({"BLOCK_M": sched_m}, num_warps=4, num_stages=2)]


def _autotuned(name: str):
    """Autotuned wrappers, built on first use (autotuning benchmarks on the GPU)."""
    if name not in _AUTOTUNED:
        key = ["HEAD_DIM", "GROUP", "T_BUCKET", "PRECISION", "HAS_PREFIX"]
        if name == "fwd":
            prune = {"early_config_prune": _prune_block_m}
            fn = triton.autotune(_fwd_configs(), key=[*key, "BLOCK_N"], prune_configs_by=prune)(fwd_kernel)
        elif name == "dq":
            prune = {"early_config_prune": _prune_block_m}
            fn = triton.autotune(_dq_configs(), key=[*key, "BLOCK_N"], prune_configs_by=prune)(bwd_dq_kernel)
        else:
            fn = triton.autotune(_dkdv_configs(), key=[*key[:-1], "IS_PREFIX"])(bwd_dkdv_kernel)
        _AUTOTUNED[name] = fn
    return _AUTOTUNED[name]


def _t_bucket(T: int) -> int:
    return 1 << max(T - 1, 1).bit_length()


# ----------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_index_range(T: int, H: int, D: int) -> None:
    if (T + 1) * H * D >= 2**31:
        raise ValueError(f"the triton backend indexes with int32: T*Hq*D must be < 2^31, got T={T}, Hq={H}, D={D}")


_STAGES_THAT_FIT: dict[tuple, int] = {}


def _launch_fitting(kernel, grid, args, const, stages: int, **meta) -> None:
    """Launch a pinned configuration with ``stages`` pipeline stages, or the most that fit in shared
    memory (bigger dtypes, a P = 1 prefix or another GPU can overflow a tile chosen for bf16 on Hopper).
    The answer is remembered per specialisation, so a failing compile is paid once."""
    from triton.runtime.errors import OutOfResources

    key = (kernel.fn.__name__, stages, tuple(sorted({**const, **meta}.items())), args[0].dtype)
    for s in range(_STAGES_THAT_FIT.get(key, stages), 0, -1):
        try:
            kernel[grid](*args, **const, **meta, num_stages=s)
        except OutOfResources:
            if s == 1:
                raise
            continue
        _STAGES_THAT_FIT[key] = s
        return


def _launch_fwd(
    q_THD, k_TKD, v_TKD, pk_PKD, pv_PKD, subtree_end_T, kv_list_MN, kv_full_M, kv_count_M, q_order_M,
    scale: float, cfg: KernelConfig, warp_specialize: bool = False,
):
    T, H, D = q_THD.shape
    K = k_TKD.shape[1]
    P = 0 if pk_PKD is None else pk_PKD.shape[0]
    o_THD = torch.empty_like(q_THD)
    lse_HT = torch.empty(H, T, device=q_THD.device, dtype=torch.float32)
    pk, pv = (pk_PKD, pv_PKD) if P else (k_TKD, v_TKD)
    args = (
        q_THD, k_TKD, v_TKD, pk, pv, o_THD, lse_HT, subtree_end_T, kv_list_MN, kv_full_M, kv_count_M, q_order_M,
        scale * LOG2E, T, P, _t_bucket(T),
        q_THD.stride(0), q_THD.stride(1), k_TKD.stride(0), k_TKD.stride(1), pk.stride(0), pk.stride(1),
        o_THD.stride(0), o_THD.stride(1), kv_list_MN.stride(0),
    )
    const = {
        "GROUP": H // K, "HEAD_DIM": D, "BLOCK_N": cfg.sched_n, "SCHED_M": cfg.sched_m, "HAS_PREFIX": P > 0,
        "PRECISION": _precision(q_THD.dtype), "WARP_SPEC": warp_specialize,
    }
    M = triton.cdiv(T, cfg.sched_m)  # programs cover whole schedule rows (launched in q_order)
    if cfg.autotune and not _interpreting():
        grid = lambda meta: (H, M * (cfg.sched_m // meta["BLOCK_M"]))
        _autotuned("fwd")[grid](*args, **const)
    else:
        grid = (H, M * (cfg.sched_m // cfg.fwd_block_m))
        _launch_fitting(
            fwd_kernel, grid, args, const, cfg.fwd_stages, BLOCK_M=cfg.fwd_block_m, num_warps=cfg.fwd_warps
        )
    return o_THD, lse_HT


def _launch_delta(o_THD, do_THD):
    T, H, D = o_THD.shape
    delta_HT = torch.empty(H, T, device=o_THD.device, dtype=torch.float32)
    block = 64
    bwd_delta_kernel[(H, triton.cdiv(T, block))](
        o_THD, do_THD, delta_HT, T, o_THD.stride(0), o_THD.stride(1), do_THD.stride(0), do_THD.stride(1),
        HEAD_DIM=D, BLOCK_M=block,
    )
    return delta_HT


def _launch_dkdv(
    do_THD, q_THD, keys_NKD, values_NKD, lse_HT, delta_HT, subtree_end_T, scale, is_prefix, cfg, dq_acc_THD=None
):
    """dK, dV of the pack's keys (is_prefix=False) or of the P prefix keys seen by all queries (True).

    With ``dq_acc_THD`` (float32 [T, Hq, D]; the fused backward) the kernel also adds its dS·K tiles into
    it, unscaled. That launch is never autotuned: the autotuner's trials would add into the accumulator,
    and its reset_to_zero would wipe what the pack launch added before the prefix launch (restore_value
    would be correct but copies the accumulator inside every timed trial). It runs cfg's dkdv tiles.
    """
    T, H, D = q_THD.shape
    n_keys, K = keys_NKD.shape[0], keys_NKD.shape[1]
    dk_NKD = torch.empty_like(keys_NKD)
    dv_NKD = torch.empty_like(values_NKD)
    fused = dq_acc_THD is not None
    dq = dq_acc_THD if fused else q_THD  # unused without ATOMIC_DQ
    args = (
        q_THD, keys_NKD, values_NKD, do_THD, lse_HT, delta_HT, dk_NKD, dv_NKD, dq, subtree_end_T,
        scale, scale * LOG2E, T, n_keys, _t_bucket(T),
        q_THD.stride(0), q_THD.stride(1), keys_NKD.stride(0), keys_NKD.stride(1), do_THD.stride(0),
        do_THD.stride(1), dk_NKD.stride(0), dk_NKD.stride(1), dq.stride(0), dq.stride(1),
    )
    const = {
        "GROUP": H // K, "HEAD_DIM": D, "IS_PREFIX": is_prefix, "ATOMIC_DQ": fused,
        "PRECISION": _precision(q_THD.dtype),
    }
    if cfg.autotune and not fused and not _interpreting():
        grid = lambda meta: (K, triton.cdiv(n_keys, meta["BLOCK_N1"]))
        _autotuned("dkdv")[grid](*args, **const)
    else:
        grid = (K, triton.cdiv(n_keys, cfg.dkdv_block_n))
        _launch_fitting(
            bwd_dkdv_kernel, grid, args, const, cfg.dkdv_stages,
            BLOCK_N1=cfg.dkdv_block_n, BLOCK_M1=cfg.dkdv_block_m, num_warps=cfg.dkdv_warps,
        )
    return dk_NKD, dv_NKD


def _launch_dq(
    do_THD, q_THD, k_TKD, v_TKD, pk_PKD, pv_PKD, lse_HT, delta_HT, subtree_end_T, kv_list_MN, kv_full_M,
    kv_count_M, q_order_M, scale, cfg,
):
    T, H, D = q_THD.shape
    K = k_TKD.shape[1]
    P = 0 if pk_PKD is None else pk_PKD.shape[0]
    dq_THD = torch.empty_like(q_THD)
    pk, pv = (pk_PKD, pv_PKD) if P else (k_TKD, v_TKD)
    args = (
        q_THD, k_TKD, v_TKD, pk, pv, do_THD, lse_HT, delta_HT, dq_THD, subtree_end_T,
        kv_list_MN, kv_full_M, kv_count_M, q_order_M,
        scale, scale * LOG2E, T, P, _t_bucket(T),
        q_THD.stride(0), q_THD.stride(1), k_TKD.stride(0), k_TKD.stride(1), pk.stride(0), pk.stride(1),
        do_THD.stride(0), do_THD.stride(1), dq_THD.stride(0), dq_THD.stride(1), kv_list_MN.stride(0),
    )
    const = {
        "GROUP": H // K, "HEAD_DIM": D, "BLOCK_N": cfg.sched_n, "SCHED_M": cfg.sched_m, "HAS_PREFIX": P > 0,
        "PRECISION": _precision(q_THD.dtype),
    }
    M = triton.cdiv(T, cfg.sched_m)
    if cfg.autotune and not _interpreting():
        grid = lambda meta: (H, M * (cfg.sched_m // meta["BLOCK_M"]))
        _autotuned("dq")[grid](*args, **const)
    else:
        grid = (H, M * (cfg.sched_m // cfg.dq_block_m))
        _launch_fitting(
            bwd_dq_kernel, grid, args, const, cfg.dq_stages, BLOCK_M=cfg.dq_block_m, num_warps=cfg.dq_warps
        )
    return dq_THD


def _launch_bwd(
    do_THD, q_THD, k_TKD, v_TKD, pk_PKD, pv_PKD, o_THD, lse_HT, subtree_end_T, kv_list_MN, kv_full_M,
    kv_count_M, q_order_M, scale: float, cfg: KernelConfig,
):
    K, D = k_TKD.shape[1], k_TKD.shape[2]
    delta_HT = _launch_delta(o_THD, do_THD)
    # fused: dQ accumulated by the dK/dV launches (pack keys, then prefix keys) instead of the dQ kernel
    dq_acc_THD = torch.zeros(q_THD.shape, device=q_THD.device, dtype=torch.float32) if cfg.fused_bwd else None
    dk_TKD, dv_TKD = _launch_dkdv(
        do_THD, q_THD, k_TKD, v_TKD, lse_HT, delta_HT, subtree_end_T, scale, False, cfg, dq_acc_THD
    )
    if pk_PKD is not None and pk_PKD.shape[0]:
        dpk_PKD, dpv_PKD = _launch_dkdv(
            do_THD, q_THD, pk_PKD, pv_PKD, lse_HT, delta_HT, subtree_end_T, scale, True, cfg, dq_acc_THD
        )
    else:
        dpk_PKD, dpv_PKD = k_TKD.new_empty(0, K, D), v_TKD.new_empty(0, K, D)
    if cfg.fused_bwd:
        dq_THD = dq_acc_THD.mul_(scale).to(q_THD.dtype)
    else:
        dq_THD = _launch_dq(
            do_THD, q_THD, k_TKD, v_TKD, pk_PKD, pv_PKD, lse_HT, delta_HT, subtree_end_T, kv_list_MN, kv_full_M,
            kv_count_M, q_order_M, scale, cfg,
        )
    return dq_THD, dk_TKD, dv_TKD, dpk_PKD, dpv_PKD


# ----------------------------------------------------------------------------------------------------
# torch.library ops + autograd
# ----------------------------------------------------------------------------------------------------


def _fwd(q: Tensor, k: Tensor, v: Tensor, prefix_k: Tensor | None, prefix_v: Tensor | None, subtree_end: Tensor,
         kv_list: Tensor, kv_full: Tensor, kv_count: Tensor, q_order: Tensor, scale: float,
         config: list[int]) -> tuple[Tensor, Tensor]:
    """Forward: returns (out [T, Hq, D], lse [Hq, T] float32, base 2)."""
    cfg = KernelConfig.from_list(config)
    return _launch_fwd(q, k, v, prefix_k, prefix_v, subtree_end, kv_list, kv_full, kv_count, q_order, scale, cfg)


def _fwd_fake(q, k, v, prefix_k, prefix_v, subtree_end, kv_list, kv_full, kv_count, q_order, scale, config):
    T, H, _ = q.shape
    return torch.empty_like(q), q.new_empty(H, T, dtype=torch.float32)


def _bwd(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, prefix_k: Tensor | None, prefix_v: Tensor | None,
         out: Tensor, lse: Tensor, subtree_end: Tensor, kv_list: Tensor, kv_full: Tensor, kv_count: Tensor,
         q_order: Tensor, scale: float, config: list[int]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Backward: returns (dq, dk, dv, dprefix_k, dprefix_v); the prefix grads are [0, Hkv, D] without one."""
    cfg = KernelConfig.from_list(config)
    return _launch_bwd(
        grad_out.contiguous(), q, k, v, prefix_k, prefix_v, out, lse, subtree_end, kv_list, kv_full, kv_count,
        q_order, scale, cfg,
    )


def _bwd_fake(grad_out, q, k, v, prefix_k, prefix_v, out, lse, subtree_end, kv_list, kv_full, kv_count, q_order,
              scale, config):
    K, D = k.shape[1], k.shape[2]
    dpk = torch.empty_like(prefix_k) if prefix_k is not None else k.new_empty(0, K, D)
    dpv = torch.empty_like(prefix_v) if prefix_v is not None else v.new_empty(0, K, D)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dpk, dpv


def _setup_context(ctx, inputs, output):
    q, k, v, prefix_k, prefix_v, subtree_end, kv_list, kv_full, kv_count, q_order, scale, config = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, prefix_k, prefix_v, out, lse, subtree_end, kv_list, kv_full, kv_count, q_order)
    ctx.scale = scale
    ctx.config = config
    ctx.has_prefix = prefix_k is not None


def _backward(ctx, grad_out, grad_lse):
    q, k, v, prefix_k, prefix_v, out, lse, subtree_end, kv_list, kv_full, kv_count, q_order = ctx.saved_tensors
    dq, dk, dv, dpk, dpv = tree_attention_bwd(
        grad_out, q, k, v, prefix_k, prefix_v, out, lse, subtree_end, kv_list, kv_full, kv_count, q_order,
        ctx.scale, ctx.config,
    )
    if not ctx.has_prefix:
        dpk = dpv = None
    return dq, dk, dv, dpk, dpv, None, None, None, None, None, None, None


# one Python kernel for every device: the CPU runs it under Triton's interpreter
tree_attention_fwd, tree_attention_bwd = register_kernel_ops(
    "tree_attention",
    "Tensor subtree_end, Tensor kv_list, Tensor kv_full, Tensor kv_count, Tensor q_order, float scale, int[] config",
    fwd=_fwd, fwd_fake=_fwd_fake, bwd=_bwd, bwd_fake=_bwd_fake, backward=_backward, setup_context=_setup_context,
    dispatch_key="CompositeExplicitAutograd")


# ----------------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------------


def schedule_for(subtree_end: Tensor | TreeMaskInfo, cfg: KernelConfig = GPU_DEFAULT) -> TreeMaskInfo:
    """The TreeMaskInfo matching ``cfg``'s schedule blocks: the given one, one cached on it, or a new one."""
    if isinstance(subtree_end, TreeMaskInfo):
        info = subtree_end
        if (info.block_m, info.block_n) == (cfg.sched_m, cfg.sched_n):
            return info
        key = ("schedule", cfg.sched_m, cfg.sched_n)
        if key not in info.cache:
            info.cache[key] = prepare(info.subtree_end_T, block_m=cfg.sched_m, block_n=cfg.sched_n, validate=False)
        return info.cache[key]
    return prepare(subtree_end, block_m=cfg.sched_m, block_n=cfg.sched_n)


def tree_attention_triton(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    subtree_end: Tensor | TreeMaskInfo,
    *,
    prefix_k: Tensor | None = None,
    prefix_v: Tensor | None = None,
    scale: float | None = None,
    config: KernelConfig | None = None,
) -> Tensor:
    """Triton backend of `tree_attention` (inputs validated by the api). ``config`` defaults to the
    autotuned GPU configuration, or `PINNED` under the Triton interpreter."""
    T, H, D = q.shape
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    if config is None:
        config = PINNED if _interpreting() else GPU_DEFAULT
    if T == 0:
        return q.new_empty(0, H, D)
    _check_index_range(T, H, D)
    info = schedule_for(subtree_end, config)
    if prefix_k is not None and prefix_k.shape[0] == 0:
        prefix_k = prefix_v = None
    if prefix_k is not None:
        prefix_k, prefix_v = prefix_k.contiguous(), prefix_v.contiguous()
    out, _ = tree_attention_fwd(
        q.contiguous(), k.contiguous(), v.contiguous(), prefix_k, prefix_v,
        info.subtree_end_T, info.kv_list_MN, info.kv_full_M, info.kv_count_M, info.q_order_M,
        float(scale), config.as_list(),
    )
    return out

