"""DFS mode: AReaL-DTA's dynamic tree attention. Walk a pack's prefix tree depth first, keep only the
current path's keys/values, and bound the live autograd graph by ``block_size`` tokens. The schedule
(which segments, with or without grad, in which order) is `treepack.train.modes.dfs_schedule`; this module runs
it against the model, the path cache and the loss rows.

Exactness. The loss is a sum of terms: row (s, j) predicts ``path_s[j]`` from the hidden state of
``h = parent[path_s[j]]``, with weights fixed for the global batch before any forward. Each term is
attached to the one step that forwards ``h`` with grad: branch points' several targets, duplicates and
prefix-of-another sequences need no special case. A step sees exactly the keys/values a full forward
would give it (its tokens through its own mask, its ancestors through the cache), so its hidden states
and loss are exact. For gradients: a cached row's K/V are read by later steps as leaf tensors; their
gradients are summed into ``grad[layer, depth]`` (float32 for 16-bit models) and handed to the row's own
K/V outputs when the row is popped, as ``torch.autograd.backward([loss, K_l, V_l], [1, dK_l, dV_l])``.
Every reader of a row lies in its subtree and the traversal pops a row only when its subtree is done
(deepest first), so all of dK/dV has arrived by then: by the chain rule, each parameter receives exactly
the dense gradient, summed in another order (float64: ~1e-15 relative). Tokens whose subtree holds no
loss term (always a leaf's last token) are pruned first; they change nothing.

Memory. The path cache holds the longest path's K/V and their gradients: per token
``layers x 2 x kv_heads x head_dim`` values, in the model dtype plus float32 for the gradient (Qwen3-0.6B
in bf16: 112 KiB + 224 KiB per path token, 3.0 GiB for tau-bench's 9.4k-token path). The graph alive at
once is one call's (``block_size`` tokens) plus the kept pieces (``keep_tokens``); it does not grow with
the tree. A call's peak is the start of its backward, the loss's, with the whole graph alive: the
log-prob backward works in vocabulary blocks, in place, so it adds ~0.6 GiB there instead of 2.0 GiB.

Time. Each step is a full model call, so its host-side cost matters: ~2,100 kernel launches per call for
Qwen3-0.6B (28 layers, one compiled graph per layer, FA4's launches replayed per call shape); the
per-call path has no host sync, nor has a pack's start, whose uploads go through pinned memory
(tests/test_host_sync_gpu.py), yet a call of a few thousand tokens does not hide it. So the schedule makes
few calls (anchors merged into grad calls, pops of one path merged), the attention forward is not
recomputed under a memory budget, and each call's parameter gradients are summed with one multi-tensor add
(`_GradSum`; under working weights the matrices' by hooks, the embedding's and head's in place). On an H100 a
tau-bench step (144 records, B=8192, budget 0.7, 10 calls, attention auto) took 0.995-1.007 s at 12.66 GiB, the
GPU busy ~0.85-0.94 s of it (benchmarks/results/2026-11-26-dfs-host-h100.md).
With ``cuda_graphs`` (`[train.dfs] cuda_graphs`, `dfs_graphs`) a call shape met again is replayed from a CUDA
graph: the host queues a step in ~0.75 s of ~0.94, GPU-bound at 1.07x (exact shapes) to 1.12x (bucketed) tree
mode, ~1.8 GiB more (2026-11-26-dfs-bwd-order-h100.md). Each call's FA4 backward order is chosen from its
subtree ends on the host (the cached prefix's key blocks are the longest CTAs; `fa4.tail_share`).
Prefer the largest block the memory allows (``block_size="auto"``, the `treepack train` default, plans it per pack
from the GPU's memory: `dfs_memory`): a smaller one anchors each leaf's tail beyond one block and adds calls
(B=6144: 19 calls, 1.88 s; B=4096: 28 calls, 27% of the tokens anchored, 2.53 s on an H200;
2026-11-25-dfs-host-bound-h200.md); where memory is short, ``train.activation_memory_budget`` below 1 lets
the compiled layers recompute instead of saving, which costs less than a smaller block; a larger block at
a lower budget makes fewer calls (B=16384 at 0.4: 6 calls) but needed 17.27 GiB.

Legend: T pack tokens, C tokens of a step, X targets of a step, U target tokens of the pack, R loss
rows, L layers, P cached path rows, K kv heads, E head dim, D hidden size.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from torch import Tensor

from treepack.errors import ConfigError
from treepack.pack.layout import Pack
from treepack.train.attention import KV, AttentionContext
from treepack.train.config import DfsConfig
from treepack.train.losses import BatchTotals, LossRows, Objective, target_logprobs, token_weights_fast
from treepack.train.model import Decoder
from treepack.train.modes.base import LayoutError, Mode, ModeResult, row_dtype
from treepack.train.modes.dfs_graphs import CallGraphs, call_scalars, padded_inputs, unsupported_reason
from treepack.train.modes.dfs_memory import AutoBlock
from treepack.train.modes.dfs_schedule import Schedule, Step, plan
from treepack.train.transfer import to_device
from treepack.train.working_weights import head_copy

# --------------------------------------------------------------------------------------------------
# Execution


class _PathCache:
    """Per-layer keys/values of the current path by depth, and the dK/dV its rows have received.

    ``kv_2LPKE`` holds K/V in the model's compute dtype; ``grad_2LPKE`` accumulates the gradients that
    later segments send to cached rows, in float32 for 16-bit K/V (one rounding per row, as a dense
    backward has, instead of one per reading segment). Segments read rows through ``.data``, an alias with
    its own autograd version counter: a kept graph saves its prefix rows [0, lo), and later writes to
    deeper rows (which it never reads) must not look like an in-place change of what it saved.
    """

    def __init__(self, n_layers: int, rows: int, k_TKE: Tensor, *, zeros: bool = False) -> None:
        _, K, E = k_TKE.shape
        dt = k_TKE.dtype
        # zeros: rows a CUDA graph's call reads but hides from every query must hold finite values
        self.kv_2LPKE = (torch.zeros if zeros else torch.empty)(2, n_layers, rows, K, E, dtype=dt, device=k_TKE.device)
        self._read = self.kv_2LPKE.data
        acc = torch.float32 if dt in (torch.float16, torch.bfloat16) else dt
        self.grad_2LPKE = torch.zeros(2, n_layers, rows, K, E, dtype=acc, device=k_TKE.device)

    @property
    def nbytes(self) -> int:
        return self.kv_2LPKE.nbytes + self.grad_2LPKE.nbytes

    def write(self, lo: int, kv: list[KV]) -> None:
        with torch.no_grad():
            for layer, (k_TKE, v_TKE) in enumerate(kv):
                hi = lo + k_TKE.shape[0]
                self.kv_2LPKE[0, layer, lo:hi].copy_(k_TKE)
                self.kv_2LPKE[1, layer, lo:hi].copy_(v_TKE)

    def prefix(self, lo: int, *, grad: bool) -> list[KV] | None:
        """Rows [0, lo) per layer; with ``grad`` as leaves whose gradient is added into ``grad_2LPKE``."""
        if lo == 0:
            return None
        if not grad:
            return [(self._read[0, layer, :lo], self._read[1, layer, :lo]) for layer in range(self._read.shape[1])]
        past = []
        for layer in range(self._read.shape[1]):
            pair = []
            for j in (0, 1):
                leaf_PKE = self._read[j, layer, :lo].detach().requires_grad_()
                leaf_PKE.register_post_accumulate_grad_hook(self._accumulate(self.grad_2LPKE[j, layer, :lo]))
                pair.append(leaf_PKE)
            past.append((pair[0], pair[1]))
        return past

    @staticmethod
    def _accumulate(into_PKE: Tensor):
        def hook(leaf_PKE: Tensor) -> None:
            into_PKE.add_(leaf_PKE.grad)
            leaf_PKE.grad = None  # freed layer by layer as the backward proceeds

        return hook

    def outputs_and_grads(self, lo: int, kv: list[KV]) -> tuple[list[Tensor], list[Tensor]]:
        """The segment's own K/V (with graph) and the dK/dV its rows [lo, hi) received."""
        hi = lo + kv[0][0].shape[0]
        grad_2LCKE = self.grad_2LPKE[:, :, lo:hi].to(kv[0][0].dtype)  # one cast for every layer
        outs, grads = [], []
        for layer, (k_CKE, v_CKE) in enumerate(kv):
            outs += [k_CKE, v_CKE]
            grads += [grad_2LCKE[0, layer], grad_2LCKE[1, layer]]
        return outs, grads

    def clear(self, lo: int, hi: int) -> None:
        self.grad_2LPKE[:, :, lo:hi].zero_()


SUM_GRADS_AT_ONCE = True  # False: autograd adds into each .grad itself (the A/B baseline of benchmarks/dfs.py)


class _GradSum:
    """Sums each call's parameter gradients into ``.grad`` with one multi-tensor add per call instead of one
    add kernel per parameter.

    Why: a dfs step back-propagates many calls, and after the first each of them made autograd add into
    every existing ``.grad`` separately: 2,489 of the 23,406 kernels of a tau-bench step (144 records,
    B=8192), each a launch the host-bound step waits for (results/2026-11-26-dfs-host-h100.md). With the
    gradients set aside, autograd hands each call's fresh gradient over without a kernel, and
    ``torch._foreach_add_`` adds them all at once: the same ``old + new`` per element, so bit for bit the
    same sums. Only plain parameters: FSDP2's sharded ones keep their own accumulation.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        params = [p for p in model.parameters() if p.requires_grad]
        # FSDP2's parameters are DTensors (type DTensor, not Parameter): their gradients are left alone
        plain = SUM_GRADS_AT_ONCE and all(type(p) is torch.nn.Parameter for p in params)
        # and so are those the working weights write in place (hooks, the head's GEMMs, the embedding's rows)
        working = model.working_weights.params if getattr(model, "working_weights", None) is not None else set()
        self.params = [p for p in params if id(p) not in working] if plain else []
        self.held: list[Tensor | None] = []

    def __enter__(self) -> None:
        self.held = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None

    def __exit__(self, *exc) -> None:
        old, new = [], []
        for p, held in zip(self.params, self.held):
            if held is None:
                continue
            if p.grad is not None:
                old.append(held)
                new.append(p.grad)
            p.grad = held
        if old and exc[0] is None:
            torch._foreach_add_(old, new)
        self.held = []


class _Targets:
    """Which log-probs the pack needs, which step computes each, and which loss rows read them (numpy).

    A target token u's log-prob is read from the hidden state of ``parent[u]``, so it belongs to the one
    with-grad step that forwards ``parent[u]``: every loss term is attached exactly once.
    """

    def __init__(self, pack: Pack, rows: LossRows, totals: BatchTotals, objective: Objective, fast: bool) -> None:
        self.weight_U: np.ndarray | None = None  # float64 fast SFT path: loss = -sum_u w_u logp_u
        if fast:
            fast_U, fast_w_U = token_weights_fast(pack, rows, totals, objective.normalization)
            token_U = np.union1d(fast_U, rows.token_R)
            self.weight_U = np.zeros(token_U.shape[0], dtype=np.float64)
            self.weight_U[np.searchsorted(token_U, fast_U)] = fast_w_U
        else:
            token_U = np.unique(rows.token_R)
        self.token_U = token_U.astype(np.int64)  # pack tokens whose log-prob is needed, sorted
        self.parent_U = np.asarray(pack.parent, dtype=np.int64)[self.token_U]
        bad = (self.parent_U < 0) | (self.parent_U >= int(pack.n_real))
        if bad.any():
            u = int(np.argmax(bad))
            raise LayoutError(f"pack token {int(self.token_U[u])} is a training target but its parent is "
                              f"{int(self.parent_U[u])}")
        self.row_u_R = np.searchsorted(self.token_U, rows.token_R).astype(np.int64)  # each row's target in U
        self.local_U = np.zeros(0, dtype=np.int64)  # index of parent[u] inside its step (after `assign`)
        self.u_of_step: dict[int, np.ndarray] = {}  # step index -> its U indices (ascending)
        self.rows_of_step: dict[int, np.ndarray] = {}  # step index -> its loss rows (ascending)


    def assign(self, schedule: Schedule, n_real: int) -> None:
        """Attach each target to the step that forwards its parent with grad."""
        step_T = np.full(n_real, -1, dtype=np.int64)
        local_T = np.zeros(n_real, dtype=np.int64)
        for k, step in enumerate(schedule.steps):
            if step.kind in ("grad", "keep"):
                own_C = step.tokens_C[: step.n_own]  # a merged anchor's tokens get their loss later
                step_T[own_C] = k
                local_T[own_C] = np.arange(step.n_own)
        step_U = step_T[self.parent_U]
        self.local_U = local_T[self.parent_U]
        self.u_of_step = _group(step_U)
        self.rows_of_step = _group(step_U[self.row_u_R])


def needed_tokens(pack: Pack, rows: LossRows) -> np.ndarray:
    """bool [n_real]: tokens whose hidden state a loss row reads (its target's parent); what `plan` keeps."""
    needed = np.zeros(int(pack.n_real), dtype=bool)
    parent_R = np.asarray(pack.parent, dtype=np.int64)[rows.token_R]
    needed[parent_R[parent_R >= 0]] = True
    return needed


def _group(key_X: np.ndarray) -> dict[int, np.ndarray]:
    """Indices of ``key_X`` grouped by value (each group ascending)."""
    order = np.argsort(key_X, kind="stable")
    keys, starts = np.unique(key_X[order], return_index=True)
    bounds = np.append(starts, order.shape[0])
    return {int(k): order[bounds[i] : bounds[i + 1]] for i, k in enumerate(keys.tolist())}


class DfsMode(Mode):
    """AReaL-DTA's depth-first traversal with a bounded graph; gradients equal ``dense`` (module doc).

    The backward runs inside the call: the returned `ModeResult` has ``backward_done`` set and a
    detached loss, so callers use ``result.backward()`` (a no-op here) whatever the mode.
    """

    name = "dfs"

    def __init__(self, attention: str = "auto", *, chunk_rows: int = 4096, dfs: DfsConfig | None = None,
                 sft_fast_path: bool = True, merge_pops: bool = True) -> None:
        """``dfs``: the ``[train.dfs]`` settings, validated by `DfsConfig` (None: its defaults).
        ``merge_pops``: consecutive pops of one path in one call (off only to measure what it saves)."""
        dfs = DfsConfig() if dfs is None else dfs
        if not isinstance(dfs, DfsConfig):
            raise ConfigError(f"dfs settings must be a DfsConfig, got {type(dfs).__name__}")
        super().__init__(attention, chunk_rows=chunk_rows)
        block = dfs.block
        auto = block == "auto"
        self.block_size = None if auto else block or None
        self.keep_tokens = dfs.keep_tokens
        self.order = dfs.order
        self.sft_fast_path = sft_fast_path
        self.subtree_calls = dfs.subtree_calls
        self.merge_anchor_tokens = dfs.merge_anchor_tokens
        self.merge_pops = merge_pops
        self.cuda_graphs = dfs.cuda_graphs
        self._graphs: CallGraphs | None = None  # kept across packs: the captured calls and their buffers
        self._graphs_off: str | None = None
        self.auto = AutoBlock() if auto else None  # block_size "auto": planned per pack from the GPU's memory

    def block_for(self, model: Decoder | None, pack: Pack) -> int | None:
        """Most tokens one call of ``pack`` forwards with grad (None: unlimited)."""
        return self.block_size if self.auto is None else self.auto.tokens(
            model, pack, chunk_rows=self.chunk_rows, graphs=self.cuda_graphs,
            extra_tokens=self.merge_anchor_tokens + self.keep_tokens)

    def describe_block(self, model: Decoder, packs: list[Pack], compute_dtype: torch.dtype) -> str:
        """The start line (under the loop's autocast): the block, why for an auto one, and graphs that cannot run."""
        self._graphs_off = unsupported_reason(model, self.attention) if self.cuda_graphs else None
        off = f"; dfs.cuda_graphs is off: {self._graphs_off}" if self._graphs_off else ""
        if self.auto is None:
            return (f"dfs: calls of up to {self.block_size:,} tokens (dfs.block_size)" if self.block_size else
                    "dfs: each pack in one call (dfs.block_size = 0: unlimited)") + off
        return self.auto.describe(model, packs, chunk_rows=self.chunk_rows, graphs=self.cuda_graphs and not off,
                                  extra_tokens=self.merge_anchor_tokens + self.keep_tokens, compute_dtype=compute_dtype) + off

    def graphs_for(self, model: Decoder, schedule: Schedule) -> CallGraphs | None:
        """The CUDA graphs that run this pack's anchor and grad calls (None: they run eagerly; `dfs_graphs`)."""
        if not self.cuda_graphs or self._graphs_off is not None:
            return None
        reason = unsupported_reason(model, self.attention)
        if reason is not None:
            self._graphs_off = reason
            warnings.warn(f"dfs CUDA graphs are off: {reason}", RuntimeWarning, stacklevel=3)
            return None
        rows = max(schedule.max_depth, 1)
        tokens = max((step.n for step in schedule.steps), default=1)
        dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else model.dtype
        g = self._graphs
        if g is not None and g.failed:
            return None
        if g is None or not g.fits(model, rows, tokens, dtype):
            met = None
            if g is not None:  # a longer path or call than the graphs were sized for: room to grow
                rows, tokens = max(rows, g.rows), max(tokens, g.n_cap)
                met = g.history()  # the shapes met so far still count as met (captured on second sight)
            self._graphs = g = None  # the old graphs' pool goes before the new buffers are allocated
            g = self._graphs = CallGraphs(model, _PathCache, rows, tokens, dtype)
            if met is not None:
                g.inherit(*met)
        return g

    def schedule(self, pack: Pack, rows: LossRows | None = None, model: Decoder | None = None) -> Schedule:
        """The traversal of ``pack`` (numpy only). With ``rows``, subtrees whose tokens no loss row reads are
        pruned (`needed_tokens`); ``model`` sizes an auto block (none: ``CPU_BLOCK``)."""
        needed_T = None if rows is None else needed_tokens(pack, rows)
        try:
            return plan(np.asarray(pack.parent[: pack.n_real]), needed_T=needed_T,
                        block_size=self.block_for(model, pack),
                        keep_tokens=self.keep_tokens, order=self.order, subtree_calls=self.subtree_calls,
                        merge_anchor_tokens=self.merge_anchor_tokens, merge_pops=self.merge_pops)
        except ValueError as exc:
            raise LayoutError(f"dfs: {exc}") from None

    def __call__(self, model: Decoder, pack: Pack, rows: LossRows, objective: Objective,
                 totals: BatchTotals) -> ModeResult:
        return _Traversal(self, model, pack, rows, objective, totals).run()


class _Traversal:
    """One pack's DFS: runs the schedule's steps against the model, the path cache and the loss rows."""

    def __init__(self, mode: DfsMode, model: Decoder, pack: Pack, rows: LossRows, objective: Objective,
                 totals: BatchTotals) -> None:
        self.mode, self.model, self.objective = mode, model, objective
        self.dev = dev = model.device
        fast = mode.sft_fast_path and objective.kind == "sft"
        self.targets = _Targets(pack, rows, totals, objective, fast)
        self.schedule = mode.schedule(pack, rows, model)
        self.targets.assign(self.schedule, int(pack.n_real))
        self.graphs = mode.graphs_for(model, self.schedule)
        rows_dtype = row_dtype(model)
        # every upload through pinned memory (`to_device`): a copy from pageable memory waits for the GPU to
        # drain, so the host could not plan this pack while the previous pack or step still runs
        self.weight_U = None if not fast else to_device(self.targets.weight_U, dev, rows_dtype)
        self.tensors = {} if fast else objective.row_tensors(rows, totals, device=dev, dtype=rows_dtype)
        self.ids_T = to_device(np.asarray(pack.input_ids), dev, torch.long)
        self.pos_T = to_device(np.asarray(pack.position_ids), dev, torch.long)
        self.logp_U = torch.zeros(self.targets.token_U.shape[0], dtype=rows_dtype, device=dev)
        self.loss = torch.zeros((), dtype=torch.float64, device=dev)
        # each graphed call's (padded length, prefix rows read): exact for shapes met before (`CallGraphs.shapes`)
        self.shapes = self.graphs.shapes(self.schedule.steps) if self.graphs is not None else {}
        self.index = self._upload_indices()
        self.cache: _PathCache | None = self.graphs.cache if self.graphs is not None else None
        self.kept: dict[int, tuple[Tensor | None, list[KV]]] = {}  # lo -> (loss, K/V) of a kept segment
        self.contexts: dict[int, AttentionContext] = {}
        self.grad_sum = _GradSum(model)
        self.work = {"grad_tokens": 0, "anchor_tokens": 0, "backward_tokens": 0, "model_calls": 0, "graph_calls": 0}
        self.live = self.peak_live = 0  # tokens whose graph is alive (kept segments + the current call)

    def _upload_indices(self) -> dict[tuple[str, int], Tensor]:
        """Every step's index arrays, copied to the device in one transfer (through pinned memory, queued
        without a host sync)."""
        targets = self.targets
        arrays: dict[tuple[str, int], np.ndarray] = {}
        for k, step in enumerate(self.schedule.steps):
            arrays["tokens", k] = step.tokens_C
            if k in self.shapes:
                arrays["padded", k], arrays["padded_ends", k] = padded_inputs(step, self.shapes[k][0])
                arrays["scalars", k] = call_scalars(step, step.kind == "grad")
            if step.is_tree:
                arrays["subtree_end", k] = step.subtree_end_C
            u_idx = targets.u_of_step.get(k)
            if u_idx is None or step.kind not in ("grad", "keep"):
                continue
            arrays["u", k] = u_idx
            arrays["local", k] = targets.local_U[u_idx]
            arrays["target", k] = targets.token_U[u_idx]
            if self.weight_U is None:
                r_idx = targets.rows_of_step[k]
                arrays["rows", k] = r_idx
                arrays["at", k] = np.searchsorted(u_idx, targets.row_u_R[r_idx])
        arrays["row_u", -1] = targets.row_u_R
        flat = np.concatenate([np.asarray(a, dtype=np.int64) for a in arrays.values()]) if arrays else np.zeros(0, np.int64)
        flat_t = to_device(flat, self.dev)
        out, offset = {}, 0
        for key, a in arrays.items():
            out[key] = flat_t[offset : offset + a.shape[0]]
            offset += a.shape[0]
        return out

    def run(self) -> ModeResult:
        if self.graphs is None:
            return self._run()
        # With graphs the whole pack runs on their stream: a parameter's gradient accumulator remembers the
        # stream it was made on, and one made on another stream (and kept alive, e.g. by autocast's cache of
        # a cast weight) would make a captured backward wait on that stream, which a capture does not allow.
        main, side = torch.cuda.current_stream(self.dev), self.graphs.stream
        side.wait_stream(main)
        with torch.cuda.stream(side):
            self.graphs.ensure_grads()
            result = self._run()
        main.wait_stream(side)
        for t in (result.loss, result.logp_R, *result.metrics.values()):
            if isinstance(t, Tensor):
                t.record_stream(main)  # made on the side stream, read on the main one
        return result

    def _run(self) -> ModeResult:
        for k, step in enumerate(self.schedule.steps):
            getattr(self, "_" + step.kind)(k, step)
        dev = self.dev
        logp_R = self.logp_U[self.index["row_u", -1]]
        s = self.schedule
        metrics = {
            **self.work,
            "anchor_share": self.work["anchor_tokens"] / max(self.work["grad_tokens"] + self.work["anchor_tokens"], 1),
            "peak_graph_tokens": self.peak_live,
            "kv_rows": s.max_depth,
            "kv_cache_bytes": self.cache.nbytes if self.cache is not None else 0,
            "graph_pool_bytes": self.graphs.pool_bytes if self.graphs is not None else 0,
            "leaves": s.n_leaves,
            "pruned_tokens": s.n_pruned,
        }
        if dev.type == "cuda":
            metrics["cuda_peak_bytes"] = torch.cuda.max_memory_allocated(dev)
        if self.objective.kind == "grpo":
            metrics["clip_fraction"] = self.objective.clip_fraction(logp_R, self.tensors.get("behaviour_logp_R"))
        return ModeResult(loss=self.loss, logp_R=logp_R, forward_tokens=self.work["grad_tokens"] +
                          self.work["anchor_tokens"], metrics=metrics, backward_done=True)

    # -- the four step kinds ------------------------------------------------------------------------

    def _anchor(self, k: int, step: Step) -> None:
        if self.graphs is not None:
            self.graphs.forward(self._load(k, step, grad=False), capture=self.shapes[k][2])
            self.work["anchor_tokens"] += step.n
            return
        with torch.no_grad():
            out = self._forward(k, step, grad=False, return_kv=True)
        self._cache_for(out.kv).write(step.lo, out.kv)
        self.work["anchor_tokens"] += step.n

    def _keep(self, k: int, step: Step) -> None:
        out = self._forward(k, step, grad=True, return_kv=True)
        self._cache_for(out.kv).write(step.lo, out.kv)
        self.kept[step.lo] = (self._step_loss(k, out.hidden_TD), out.kv)
        self.work["grad_tokens"] += step.n
        self.live += step.n
        self.peak_live = max(self.peak_live, self.live)

    def _grad(self, k: int, step: Step) -> None:
        if self.graphs is not None:
            return self._graphed_grad(k, step)
        out = self._forward(k, step, grad=True, return_kv=step.kv_grad or step.n_anchor > 0)
        if step.n_anchor:  # a merged anchor: its rows [lo, lo + n_anchor) are read by the calls after this one
            self._cache_for(out.kv).write(step.lo, [(k_[step.n_own :], v_[step.n_own :]) for k_, v_ in out.kv])
            self.work["anchor_tokens"] += step.n_anchor
        self.work["grad_tokens"] += step.n_own
        self.peak_live = max(self.peak_live, self.live + step.n)
        self._backward(step, self._step_loss(k, out.hidden_TD), out.kv)

    def _graphed_grad(self, k: int, step: Step) -> None:
        """`_grad` through `CallGraphs`: the same call, its K/V writes and dK/dV inside the graphs."""
        hidden, pending = self.graphs.forward(self._load(k, step, grad=True), capture=self.shapes[k][2])
        if step.n_anchor:
            self.work["anchor_tokens"] += step.n_anchor
        self.work["grad_tokens"] += step.n_own
        self.peak_live = max(self.peak_live, self.live + step.n)
        loss = self._step_loss(k, hidden)
        with torch.autocast(self.dev.type, enabled=False):
            self.graphs.backward(pending, loss)
        if loss is not None or step.kv_grad:
            self.work["backward_tokens"] += step.n_own
        del hidden, loss, pending  # the eager call's autograd graph, before its capture
        self.graphs.capture_pending()

    def _load(self, k: int, step: Step, *, grad: bool) -> tuple:
        self.work["model_calls"] += 1
        self.work["graph_calls"] += 1
        return self.graphs.load(step, grad, self.shapes[k], self.ids_T, self.pos_T, self.index["padded", k],
                                self.index["padded_ends", k], self.index["scalars", k])

    def _release(self, k: int, step: Step) -> None:
        loss, kv = self.kept.pop(step.lo)
        self._backward(step, loss, kv)
        self.live -= step.n

    # -- helpers ------------------------------------------------------------------------------------

    def _cache_for(self, kv: list[KV]) -> _PathCache:
        if self.cache is None and self.graphs is not None:
            self.cache = self.graphs.cache
        if self.cache is None:
            self.cache = _PathCache(len(kv), max(self.schedule.max_depth, 1), kv[0][0])
        return self.cache

    def _context(self, k: int, step: Step) -> AttentionContext:
        """Causal attention over a chain of n tokens (every token's subtree ends at n), plus the prefix;
        or the mask of a whole tree forwarded in one call."""
        n = step.n
        ctx = None if step.is_tree else self.contexts.get(n)
        if ctx is None:
            if step.is_tree:
                subtree_end_T = self.index["subtree_end", k].to(torch.int32)
            else:
                subtree_end_T = torch.full((n,), n, dtype=torch.int32, device=self.dev)
            if self.dev.type == "cuda":  # valid by construction: skip prepare's host sync
                from treepack.kernels import prepare

                info = prepare(subtree_end_T, validate=False)
                # the ends on the host too: FA4's backward order is chosen per call from them (fa4_tail_share)
                info.cache["host_subtree_end"] = torch.from_numpy(step.local_ends.astype(np.int32))
                ctx = AttentionContext(kind="tree", impl=self.mode.attention, mask=info)
            else:
                ctx = AttentionContext.tree(subtree_end_T, self.mode.attention)
            if not step.is_tree:
                self.contexts[n] = ctx
        return ctx

    def _forward(self, k: int, step: Step, *, grad: bool, return_kv: bool):
        tok_C = self.index["tokens", k]
        past = self.cache.prefix(step.lo, grad=grad) if step.lo else None
        self.work["model_calls"] += 1
        return self.model(self.ids_T[tok_C], self.pos_T[tok_C], self._context(k, step), past_kv=past,
                          return_kv=return_kv)

    def _step_loss(self, k: int, hidden_CD: Tensor) -> Tensor | None:
        """This step's share of the loss: the rows whose hidden state (the target's parent) it computed."""
        if ("u", k) not in self.index:
            return None
        u_X, index = self.index["u", k], self.index
        logp_X = target_logprobs(hidden_CD[index["local", k]], self.model.head_weight, self.ids_T[index["target", k]],
                                 self.mode.chunk_rows, compiled=self.model.uses_compiled(self.dev),
                                 working=head_copy(self.model))
        self.logp_U[u_X] = logp_X.detach().to(self.logp_U.dtype)
        if self.weight_U is not None:
            loss = -(self.weight_U[u_X] * logp_X).sum()
        else:
            r_X = index["rows", k]
            loss = self.objective.loss(logp_X[index["at", k]], **{name: t[r_X] for name, t in self.tensors.items()})
        self.loss += loss.detach().to(torch.float64)
        return loss

    def _backward(self, step: Step, loss: Tensor | None, kv: list[KV]) -> None:
        """Back-propagate the step's loss and the dK/dV its cached rows received; then forget those rows."""
        outs: list[Tensor] = []
        grads: list[Tensor | None] = []
        if loss is not None:
            outs.append(loss)
            grads.append(None)
        if step.kv_grad:
            rows = step.path_rows
            kv_outs, kv_grads = self.cache.outputs_and_grads(step.lo, [(k_[:rows], v_[:rows]) for k_, v_ in kv])
            outs += kv_outs
            grads += kv_grads
        if outs:
            with torch.autocast(self.dev.type, enabled=False), self.grad_sum:
                torch.autograd.backward(outs, grads)
            self.work["backward_tokens"] += step.n_own
        if step.kv_grad:
            self.cache.clear(step.lo, step.lo + step.path_rows)


WORK_SUMS = ("grad_tokens", "anchor_tokens", "backward_tokens", "pruned_tokens", "model_calls", "graph_calls",
             "leaves")
WORK_PEAKS = ("peak_graph_tokens", "kv_rows", "kv_cache_bytes", "cuda_peak_bytes", "graph_pool_bytes")


def merge_work(total: dict, metrics: dict) -> dict:
    """Add one pack's dfs accounting (`DfsMode` metrics) to a running total: counts add, peaks take the
    maximum, ``anchor_share`` is recomputed. Metrics of other modes leave the total unchanged."""
    out = dict(total)
    for key in WORK_SUMS:
        if key in metrics:
            out[key] = out.get(key, 0) + metrics[key]
    for key in WORK_PEAKS:
        if key in metrics:
            out[key] = max(out.get(key, 0), metrics[key])
    if "anchor_tokens" in out:
        out["anchor_share"] = out["anchor_tokens"] / max(out["grad_tokens"] + out["anchor_tokens"], 1)
    return out
