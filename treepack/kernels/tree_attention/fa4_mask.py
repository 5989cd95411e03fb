"""The tree mask inside FA4's partial blocks, read once per key column instead of once per score.

Why: FA4 evaluates a ``mask_mod`` for every score of a partial block, so our tree mask reads ``key_end[n]``
once per (query, key) pair a thread holds. Its Hopper backward computes S^T, so a thread holds many query
rows of a few keys, and the same few ``key_end`` entries are loaded again for every row. Sized with a mask
that skips the read (wrong results, same block lists), the per-score read was 10.5-17% of FA4's fwd+bwd on
ToolBench packs and 7% on tau-bench (1x H100, results/2026-11-26-fa4-gqa-mask-h100.md).

How: a key's visible queries are one interval, ``n - P <= m < key_end[n]``. `patch_fa4_mask` wraps FA4's
``AttentionMask.apply_mask`` so that, for a ``mask_mod`` marked ``__key_interval__`` (our tree mask), it loads
the interval's end once per key column of the thread's tile and compares each row against it; every other
``mask_mod`` (and causal, local, PackGQA) goes to FA4's own code unchanged. The mask_mod itself stays a
complete per-score mask, so where the wrapper cannot be installed (a flash-attn-4 whose ``apply_mask`` has a
different signature) FA4 evaluates it per score and results are the same. ``apply_mask`` is the mask loop of
FA4's Hopper (sm90) kernels; its Blackwell kernels have their own loops, untouched here (per score there).

Measured (1x H100, results/2026-11-26-fa4-mask-per-key-h100.md): FA4's fwd+bwd 0.85x on a ToolBench pack,
0.92x on tau-bench, as fast as a mask with no read at all; out, dK and dV bit for bit.

Key end: ``aux_tensors[0]``, int32, one entry per key padded with zeros to a multiple of 128 keys; entries
past ``seqlen_k`` are never read (a column past it is masked). Every entry is <= seqlen_q, so query rows past
seqlen_q are masked by the interval test itself.
"""

from __future__ import annotations

import functools
import inspect

__all__ = ["KEY_INTERVAL_ATTR", "patch_fa4_mask"]

KEY_INTERVAL_ATTR = "__key_interval__"  # set True on a mask_mod whose visible queries per key are an interval
# FA4's apply_mask parameters this wrapper was written against (flash-attn-4 4.0.0b36)
_PARAMETERS = ("self", "acc_S", "batch_idx", "head_idx", "m_block", "n_block", "thr_mma", "mask_seqlen",
               "mask_causal", "mask_local", "mask_mod", "aux_data", "fastdiv_mods")


@functools.cache
def patch_fa4_mask() -> str:
    """Install the per-column tree mask into FA4's ``AttentionMask`` (once per process). Returns "" when
    installed, else why not (FA4 then evaluates the mask_mod per score)."""
    import cutlass
    from cutlass import Float32, const_expr, cute
    from cutlass.cutlass_dsl import max as dsl_max
    from cutlass.cutlass_dsl import min as dsl_min
    from flash_attn.cute import mask as fa_mask
    from flash_attn.cute.utils import AuxData
    from quack import layout_utils

    library = fa_mask.AttentionMask.__dict__.get("apply_mask")
    try:
        names = tuple(inspect.signature(inspect.unwrap(library)).parameters)
    except (TypeError, ValueError):
        names = ()
    if names != _PARAMETERS:
        return f"flash-attn-4's AttentionMask.apply_mask takes {names}, not {_PARAMETERS}"

    no_aux = AuxData()

    @cute.jit
    def apply_mask(self, acc_S, batch_idx, head_idx, m_block, n_block, thr_mma,
                   mask_seqlen: cutlass.Constexpr[bool], mask_causal: cutlass.Constexpr[bool],
                   mask_local: cutlass.Constexpr[bool] = False, mask_mod: cutlass.Constexpr = None,
                   aux_data: AuxData = no_aux, fastdiv_mods=(None, None)) -> None:
        if const_expr(mask_mod is None or not getattr(mask_mod, KEY_INTERVAL_ATTR, False) or mask_causal
                      or mask_local or self.qhead_per_kvhead_packgqa != 1):
            library(self, acc_S, batch_idx, head_idx, m_block, n_block, thr_mma, mask_seqlen, mask_causal,
                    mask_local, mask_mod, aux_data, fastdiv_mods)
        else:
            # the same index maps as FA4's mask_mod branch: rows are queries, columns keys, also when the
            # tile is computed transposed (swap_AB, the Hopper backward)
            acc_S_mn = layout_utils.reshape_acc_to_mn(acc_S, transpose=self.swap_AB)
            acc_shape = (self.tile_m, self.tile_n)
            cS = cute.make_identity_tensor(acc_shape if const_expr(not self.swap_AB) else acc_shape[::-1])
            tScS_mn = layout_utils.reshape_acc_to_mn(thr_mma.partition_C(cS), transpose=self.swap_AB)
            t0ScS_mn = layout_utils.reshape_acc_to_mn(thr_mma.get_slice(0).partition_C(cS),
                                                      transpose=self.swap_AB)
            ROW = 0 if const_expr(not self.swap_AB) else 1
            COL = 1 if const_expr(not self.swap_AB) else 0
            key_end = aux_data.tensors[0]
            offset = self.seqlen_k - self.seqlen_q  # cached prefix keys before the call's own
            col0 = tScS_mn[0][COL] + dsl_max(n_block, 0) * self.tile_n  # FA4 reads n_block < 0 as 0
            row0 = m_block * self.tile_m
            for c in cutlass.range_constexpr(cute.size(tScS_mn.shape[1])):
                n = col0 + t0ScS_mn[0, c][COL]
                end = key_end[dsl_min(n, self.seqlen_k - 1)]
                end = end if n < self.seqlen_k else cutlass.Int32(0)  # past the keys: no query sees it
                _mask_column(acc_S_mn, tScS_mn, ROW, row0, c, n - offset, end)

    @cute.jit
    def _mask_column(acc_S_mn, tScS_mn, ROW: cutlass.Constexpr[int], row0, c: cutlass.Constexpr[int], lo, end):
        """Rows (queries) outside [lo, end) of column ``c`` to -inf."""
        for r in cutlass.range_constexpr(cute.size(tScS_mn.shape[0])):
            m = row0 + tScS_mn[r, 0][ROW]
            keep = (m >= lo) and (m < end)
            acc_S_mn[r, c] = acc_S_mn[r, c] if keep else -Float32.inf

    fa_mask.AttentionMask.apply_mask = apply_mask
    return ""
