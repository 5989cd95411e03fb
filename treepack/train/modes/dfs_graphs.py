"""CUDA graphs for dfs calls: a call of a shape seen before is two graph launches (forward, backward) instead of
~2,100 kernels queued one by one from Python.

Why: a dfs step makes ~10 model calls of a few thousand tokens each, and the host needs ~90-120 ms to queue one
(28 compiled layers forward and backward, FA4, the matmuls' extern calls, autograd): on H100s the host queued
0.97-1.20 s of a tau-bench step whose GPU work is ~0.85 s, so dfs ran 1.17-1.34x tree mode's time
(benchmarks/results/2026-11-26-host-noise-h100.md). Trimming the host's work moved nothing beyond the noise;
replaying a captured graph removes it.

How:

* Fixed shapes. A call runs at ``n_b`` tokens over the cached rows [0, ``P_b``): its exact n and lo when that
  shape was met before (a pack that comes back), else n rounded up to `TOKEN_BUCKET` and lo to `PREFIX_BUCKET`
  (`CallGraphs.shapes`; a shape is captured the second time it is met). Padding tokens go last, each seeing
  only the prefix and itself (``subtree_end = own index + 1``): by the mask contract no real query sees a later
  key, so they change nothing, and nothing reads their outputs. The prefix rows [lo, P_b) are hidden from every
  query by FA4's tables (`fa4_tables`' ``prefix_valid``, a device scalar), so a call reads exactly the rows its
  unpadded twin reads. The cache is zero-filled once, so hidden rows are finite. FA4's backward grid order is
  chosen per call on the host (`fa4.tail_share` with the hidden rows) and is part of the key.
* Fixed addresses. Everything a graph reads or writes outlives it: the path cache and its gradient (sized for
  the longest path, plus one row that takes the writes of padding and is never read), the call's inputs
  (ids, positions, subtree ends, and the scalars lo / written range / gradient rows), the hidden states handed
  to the loss and their gradient, and the parameters' gradients, which the captured backward adds into in
  place (`ensure_grads` keeps each ``.grad`` on its buffer).
* The loss stays eager (its rows differ per call): the forward graph's hidden states enter autograd through
  `_Replayed`, whose backward copies their gradient in and replays the backward graph. K/V rows the call
  caches are written, and the dK/dV its own rows received are read and cleared, inside the graphs.
* A call of a shape without a graph runs eagerly through the same code (which compiles and records what it
  needs); the second time a shape is met it is captured once that call's autograd graph is gone, and later
  calls of that shape replay. All graphs share one memory
  pool: each call's graph is dead before the next call runs (keep steps, whose graph outlives later calls,
  stay eager). A pack with graphs runs on their stream, so every autograd node it makes (a parameter's
  gradient accumulator too, which autocast's cast cache can keep alive) is on the stream the captures use.

Outcome (1x H100; benchmarks/results/2026-11-26-dfs-cuda-graphs-h100.md, 2026-11-26-dfs-bwd-order-h100.md):
the host queues a tau-bench step in ~0.75 s of ~0.94 and steps are steady. FA4's backward first ran 19% longer
than eagerly: the key block holding the last visible prefix rows and the first hidden ones is partial for every
query block, the longest CTA of the grid, and FA4's head-major order left it to finish alone; with the order
chosen per call (heads fastest there) the kernel takes 278 ms a step against 338 before (tree mode: 297). The
step is then GPU-bound at 1.10-1.12x tree mode on bucketed shapes, 1.07x on exact ones, where eager dfs ran
1.11-1.31x (the host), and under AReaL-DTA's 13.4 GiB (budget 0.45) 0.948-0.973 s. Off by default: it holds
~1.8 GiB more (the pool) and pays off only where call shapes come back.

Exactness: the graphs replay the padded call's kernels on the same values; the padded call equals the unpadded
one up to FA4's float32 atomics in dQ (tests/test_dfs_graphs_gpu.py compares whole steps with eager dfs).
"""

from __future__ import annotations

import contextlib
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from treepack.train.attention import AttentionContext, KernelSchedule

# a new call shape's length is rounded up to a multiple of TOKEN_BUCKET, its prefix to one of PREFIX_BUCKET
# (`CallGraphs.shapes`): padding and hidden rows cost GPU time, finer buckets cost captures; a tau-bench step
# 0.940 s at 256 / 1,024, 0.936 s at 128 / 256 (1x H100, results/2026-11-26-dfs-bwd-order-h100.md)
TOKEN_BUCKET = 128
PREFIX_BUCKET = 256
MAX_GRAPHS = 96  # shapes captured per run; calls of further shapes run eagerly
EXACT_REPEATS = True  # a call shape met before runs at its exact size (`CallGraphs.shapes`); False: always bucketed


def rounded(n: int, bucket: int) -> int:
    return -(-n // bucket) * bucket


def unsupported_reason(model, attention: str) -> str | None:
    """Why dfs calls cannot run as CUDA graphs on this model (None: they can)."""
    dev = model.device
    if dev.type != "cuda":
        return "not on CUDA"
    if not model.uses_compiled(dev):
        return "train.compile is off"
    if attention not in ("auto", "fa4"):
        return f"attention {attention!r} (graphs run FA4)"
    from treepack.kernels.tree_attention import fa4

    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else model.dtype
    if not fa4.fa4_importable() or not fa4.fa4_supported_device(dev):
        return "FA4 is not installed or not supported on this GPU"
    if dtype not in fa4.FA4_DTYPES or model.args.head_dim not in fa4.FA4_HEAD_DIMS:
        return f"FA4 does not run {dtype} at head dim {model.args.head_dim}"
    if any(type(p) is not torch.nn.Parameter for p in model.parameters() if p.requires_grad):
        return "sharded (FSDP) parameters"
    if getattr(model, "activation_checkpointing", False):
        return "activation checkpointing (not measured under capture)"
    return None


@dataclass
class _Graph:
    n_b: int
    fwd: torch.cuda.CUDAGraph
    bwd: torch.cuda.CUDAGraph | None


class _Replayed(torch.autograd.Function):
    """The forward graph's hidden states as an autograd output; backward replays the backward graph."""

    @staticmethod
    def forward(ctx, anchor: Tensor, graphs: CallGraphs, graph: _Graph) -> Tensor:
        graph.fwd.replay()
        ctx.graphs, ctx.graph = graphs, graph
        return graphs.hidden[: graph.n_b].clone()

    @staticmethod
    def backward(ctx, grad_hidden: Tensor):
        ctx.graphs.grad_hidden[: ctx.graph.n_b].copy_(grad_hidden)
        ctx.graph.bwd.replay()
        return None, None, None


@dataclass
class Pending:
    """A call that ran eagerly (a new shape): its graph pieces, for the backward and the capture after it."""

    key: tuple
    hidden: Tensor | None  # None when the call was replayed
    kv: list | None
    capture: bool = False  # capture the shape once this call's backward is done


class CallGraphs:
    """The captured calls of one model and their fixed buffers; lives across packs (`DfsMode` keeps it)."""

    def __init__(self, model, cache_cls, rows: int, tokens: int, k_dtype: torch.dtype) -> None:
        dev = model.device
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.ptrs = self._ptrs()
        self.token_bucket, self.prefix_bucket = TOKEN_BUCKET, PREFIX_BUCKET  # read once: benchmarks vary them
        self.n_cap = rounded(max(tokens, 1), self.token_bucket)
        self.rows = rounded(max(rows, 1), self.prefix_bucket)  # the longest path the cache holds (with headroom)
        self.trash = self.rows  # a row written by padding and hidden rows, never read
        args = model.args
        probe = torch.empty(0, args.num_kv_heads, args.head_dim, dtype=k_dtype, device=dev)
        self.cache = cache_cls(args.num_layers, self.trash + 1, probe, zeros=True)
        self.ids = torch.zeros(self.n_cap, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(self.n_cap, dtype=torch.int64, device=dev)
        self.subtree_end = torch.ones(self.n_cap, dtype=torch.int32, device=dev)
        self.scalars = torch.zeros(4, dtype=torch.int64, device=dev)  # lo, first written, end written, grad rows
        self.hidden: Tensor | None = None  # [n_cap, D], allocated after the first eager grad call (its dtype)
        self.grad_hidden: Tensor | None = None
        self.grads: list[Tensor] = []
        self.graphs: dict[tuple, _Graph] = {}
        self.seen: set[tuple] = set()  # call shapes met so far, exact and bucketed (`shapes`)
        self.failed: str | None = None  # a capture failed: every call runs eagerly from then on
        self.uncaptured: tuple | None = None  # the key of the call that ran eagerly, to capture
        self.pool = torch.cuda.graph_pool_handle()
        self.sms = torch.cuda.get_device_properties(dev).multi_processor_count
        self.stream = torch.cuda.Stream(dev)
        self.anchor = torch.zeros((), device=dev, requires_grad=True)  # gives `_Replayed` a grad input
        self.captures = self.replays = self.eager = 0
        self.pool_bytes = 0  # device memory the graphs' pool holds (not in max_memory_allocated after capture)

    def history(self) -> tuple[set[tuple], tuple[int, int, int]]:
        """The call shapes met and the (captures, replays, eager) counts, for the graphs that replace these."""
        return self.seen, (self.captures, self.replays, self.eager)

    def inherit(self, seen: set[tuple], counts: tuple[int, int, int]) -> None:
        """Take over the history of the graphs these replace (theirs were sized for smaller packs and go):
        without it, every pack met before the first larger one would start over at first sight."""
        self.seen |= seen
        self.captures, self.replays, self.eager = counts

    def _ptrs(self) -> tuple[int, ...]:
        working = getattr(self.model, "working_weights", None)  # the graphs read its copies, not those weights
        return tuple(p.data_ptr() for p in [*self.params, *(working.copies if working is not None else [])])

    def fits(self, model, rows: int, tokens: int, k_dtype: torch.dtype) -> bool:
        """Whether these graphs serve a pack of this model with paths of ``rows`` and calls of ``tokens``."""
        return (model is self.model and rows <= self.rows and rounded(max(tokens, 1), self.token_bucket) <= self.n_cap
                and self.cache.kv_2LPKE.dtype == k_dtype and self._ptrs() == self.ptrs)

    def ensure_grads(self) -> None:
        """Point every parameter's ``.grad`` at its fixed buffer (zeroed, or holding the gradient the parameter
        had), which the captured backwards add into. Once per pack; after ``zero_grad(set_to_none=True)`` it
        zeroes the buffers instead of allocating new gradients."""
        if not self.grads:
            self.grads = [torch.zeros_like(p) for p in self.params]
        zero, copy_to, copy_from = [], [], []
        for p, buf in zip(self.params, self.grads):
            if p.grad is buf:
                continue
            if p.grad is None:
                zero.append(buf)
            else:
                copy_to.append(buf)
                copy_from.append(p.grad)
            p.grad = buf
        if zero:
            torch._foreach_zero_(zero)
        if copy_to:
            torch._foreach_copy_(copy_to, copy_from)

    # -- one call ----------------------------------------------------------------------------------

    def shapes(self, steps) -> dict[int, tuple[int, int, bool]]:
        """Each anchor / grad call's (n_b, P_b, capture): the size it runs at and whether to capture that shape.

        A shape is captured the second time it is met, never the first: a call whose exact shape (tokens, cached
        rows) was met before runs at that size (packs that come back: a second epoch, several optimizer passes
        over one batch); else a call whose buckets (`TOKEN_BUCKET`, `PREFIX_BUCKET`) were met before runs padded
        to them (new packs with calls of similar sizes); else it runs eagerly at its own size, uncaptured.

        Why: padding and hidden prefix rows cost GPU time (a tau-bench step 0.939 s on bucketed graphs, 0.913 s
        on exact ones, tree mode 0.851 s; 1x H100, results/2026-11-26-dfs-bwd-order-h100.md), and capturing
        both for every call held 21 GiB instead of 14.4 in the graphs' pool. Shapes are captured while there is
        room (`MAX_GRAPHS`); calls of 128 tokens or fewer always use their bucket."""
        out = {}
        for k, step in enumerate(steps):
            if step.kind not in ("anchor", "grad"):
                continue
            grad = step.kind == "grad"
            flags = self._flags(step, grad)
            exact = (grad, step.n, step.lo, *flags)
            bucket = (grad, rounded(step.n, self.token_bucket), rounded(step.lo, self.prefix_bucket), *flags)
            if step.n <= 128 or not EXACT_REPEATS:
                exact = bucket
            if exact in self.seen and self._room_for(exact):
                out[k] = exact[1], exact[2], True
            elif bucket in self.seen and self._room_for(bucket):
                out[k] = bucket[1], bucket[2], True
            else:
                out[k] = exact[1], exact[2], False
            self.seen.update((exact, bucket))
        return out

    def _room_for(self, shape: tuple) -> bool:
        return len(self.graphs) < MAX_GRAPHS or any(key[:5] == shape for key in self.graphs)

    @staticmethod
    def _flags(step, grad: bool) -> tuple[bool, bool]:
        """(writes its K/V to the cache, reads the dK/dV its cached rows received)."""
        return not grad or step.n_anchor > 0, grad and step.kv_grad

    def key(self, step, grad: bool, shape: tuple[int, int, bool]) -> tuple:
        """What a captured call is specialised on: (grad, n_b, P_b, writes K/V, kv grad, FA4 backward order)."""
        n_b, p_b, _ = shape
        return grad, n_b, p_b, *self._flags(step, grad), self._bwd_order(step, n_b, p_b) if grad else 0

    def _bwd_order(self, step, n_b: int, p_b: int) -> int:
        """FA4's backward grid order for the padded call, from its ends on the host (`fa4.tail_share`): the prefix
        rows every query sees, and the bucket's hidden rows, make a few long CTAs that FA4's head-major order
        leaves to the end (results/2026-11-26-dfs-bwd-order-h100.md)."""
        from treepack.kernels.tree_attention import fa4

        dev = self.ids.device
        share = fa4.tail_share(padded_inputs(step, n_b)[1], p_b, prefix_visible=step.lo if p_b else None,
                               sms=self.sms)
        return fa4.bwd_order(share, self.model.args.num_heads, dev)

    def load(self, step, grad: bool, shape: tuple[int, int, bool], ids_T: Tensor, pos_T: Tensor, tokens_B: Tensor,
             subtree_end_B: Tensor, scalars: Tensor) -> tuple:
        """Copy the call's inputs (padded on the host to ``shape``: `padded_inputs`) into the fixed buffers; its
        key."""
        key = self.key(step, grad, shape)
        n_b = key[1]
        torch.index_select(ids_T, 0, tokens_B, out=self.ids[:n_b])
        torch.index_select(pos_T, 0, tokens_B, out=self.pos[:n_b])
        self.subtree_end[:n_b].copy_(subtree_end_B)
        self.scalars.copy_(scalars)
        return key

    def forward(self, key: tuple, capture: bool = True) -> tuple[Tensor | None, Pending]:
        """Run the loaded call: replay its graph, or run it eagerly (then, with ``capture``, capture it after its
        backward)."""
        grad = key[0]
        graph = self.graphs.get(key)
        if graph is not None:
            self.replays += 1
            if grad:
                return _Replayed.apply(self.anchor, self, graph), Pending(key, None, None)
            graph.fwd.replay()
            return None, Pending(key, None, None)
        self.eager += 1
        # the same autocast settings as its capture: compiled code guards on them, and a recompile inside a
        # capture would fail
        with self._no_autocast_cache(), contextlib.nullcontext() if grad else torch.no_grad():
            hidden, kv = self._forward_body(key)
        if not grad:
            if capture:
                self.capture(key)
            return None, Pending(key, None, None)
        return hidden, Pending(key, hidden, kv, capture)

    def backward(self, pending: Pending, loss: Tensor | None) -> None:
        """Back-propagate the call's loss and the dK/dV its cached rows received; clear those rows' gradients."""
        _, n_b, _, _, kv_grad, _ = pending.key
        if pending.hidden is None:  # replayed
            if loss is not None:
                torch.autograd.backward([loss])
            elif kv_grad:
                self.grad_hidden[:n_b].zero_()
                self.graphs[pending.key].bwd.replay()
            return
        head, head_grad = (loss, None) if loss is not None else (pending.hidden, torch.zeros_like(pending.hidden))
        if loss is not None or kv_grad:
            self._backward_body(pending.key, head, head_grad, pending.kv)
        if self.hidden is None:  # the fixed hidden states and their gradient, outside any graph's pool
            n_cap, D = self.n_cap, pending.hidden.shape[1]
            self.hidden = pending.hidden.new_empty(n_cap, D)
            self.grad_hidden = pending.hidden.new_zeros(n_cap, D)
        pending.hidden = pending.kv = None
        self.uncaptured = pending.key if pending.capture else None

    def capture_pending(self) -> None:
        """Capture the call that just ran eagerly. Only once its autograd graph is gone: a parameter's
        gradient accumulator is reused while any graph holds it, and one made on the eager call's stream
        would make the captured backward wait on that stream (not allowed while capturing)."""
        if self.uncaptured is not None:
            key, self.uncaptured = self.uncaptured, None
            self.capture(key)

    # -- the captured code -------------------------------------------------------------------------

    def _forward_body(self, key: tuple) -> tuple[Tensor, list]:
        from treepack.kernels.tree_attention import fa4

        grad, n_b, p_b, writes, _, order = key
        dev = self.ids.device
        se_B = self.subtree_end[:n_b]
        block_q = fa4.FA4_BWD_BLOCK_Q
        tables = fa4.fa4_tables(se_B, p_b, bwd_block_q=block_q, prefix_valid=self.scalars[0:1] if p_b else None)
        schedule = KernelSchedule(op="fa4", tensors=tables, config=[block_q, order])
        ctx = AttentionContext(kind="tree", impl="fa4", mask=se_B, schedule=schedule)
        past = self.cache.prefix(p_b, grad=grad) if p_b else None
        out = self.model(self.ids[:n_b], self.pos[:n_b], ctx, past_kv=past, return_kv=True)
        if writes:  # rows [w0, w1) of the call go to cache rows lo + (i - w0); the others to the trash row
            lo, w0, w1 = self.scalars[0], self.scalars[1], self.scalars[2]
            i_B = torch.arange(n_b, device=dev)
            dst_B = torch.where((i_B >= w0) & (i_B < w1), lo + i_B - w0, self.trash)
            with torch.no_grad():
                for layer, (k_BKE, v_BKE) in enumerate(out.kv):
                    self.cache.kv_2LPKE[0, layer].index_copy_(0, dst_B, k_BKE)
                    self.cache.kv_2LPKE[1, layer].index_copy_(0, dst_B, v_BKE)
        return out.hidden_TD, out.kv

    def _backward_body(self, key: tuple, head: Tensor, head_grad: Tensor | None, kv: list) -> None:
        _, n_b, p_b, _, kv_grad, _ = key
        dev = self.ids.device
        lo, rows = self.scalars[0], self.scalars[3]
        outs, grads = [head], [head_grad]
        if kv_grad:  # the dK/dV later calls sent to this call's rows [lo, lo + rows)
            i_B = torch.arange(n_b, device=dev)
            src_B = torch.where(i_B < rows, lo + i_B, self.trash)
            g = self.cache.grad_2LPKE
            for layer, (k_BKE, v_BKE) in enumerate(kv):
                outs += [k_BKE, v_BKE]
                grads += [g[0, layer].index_select(0, src_B).to(k_BKE.dtype),
                          g[1, layer].index_select(0, src_B).to(v_BKE.dtype)]
        with torch.autocast(dev.type, enabled=False):
            torch.autograd.backward(outs, grads)
        # rows [lo, P_b) (fewer than PREFIX_BUCKET) took the gradients of the hidden prefix rows, and this
        # call's rows [lo, lo + rows) are consumed: both back to zero (other indices land on the trash row)
        g = self.cache.grad_2LPKE
        if p_b:
            j_J = torch.arange(self.prefix_bucket, device=dev)
            g.index_fill_(2, torch.where(j_J < p_b - lo, lo + j_J, self.trash), 0)
        if kv_grad:
            g.index_fill_(2, src_B, 0)

    def capture(self, key: tuple) -> None:
        """Capture the call whose inputs are loaded, for replay by later calls of the same shape."""
        if self.failed or key in self.graphs or len(self.graphs) >= MAX_GRAPHS:
            return
        grad, n_b = key[0], key[1]
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # so that what the capture reserves is the pool's growth
        reserved = torch.cuda.memory_reserved()
        try:
            fwd = torch.cuda.CUDAGraph()
            with self._no_autocast_cache(), torch.cuda.graph(fwd, pool=self.pool, stream=self.stream):
                with contextlib.nullcontext() if grad else torch.no_grad():
                    hidden, kv = self._forward_body(key)
                if grad:
                    self.hidden[:n_b].copy_(hidden.detach())
            bwd = None
            if grad:
                bwd = torch.cuda.CUDAGraph()
                with self._no_autocast_cache(), torch.cuda.graph(bwd, pool=self.pool, stream=self.stream):
                    self._backward_body(key, hidden, self.grad_hidden[:n_b], kv)
            del hidden, kv
        except Exception as exc:  # noqa: BLE001 (any capture failure: run eagerly, say why once)
            while exc.__context__ is not None and isinstance(exc.__context__, Exception):
                exc = exc.__context__  # the first error, not the capture's end reporting it
            where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ is not None else None
            self.failed = (f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
                           + (f" at {Path(where.filename).name}:{where.lineno}" if where is not None else ""))
            torch.cuda.synchronize()  # an aborted capture leaves nothing queued
            warnings.warn(f"dfs CUDA graphs: capture failed ({self.failed}); running dfs calls eagerly",
                          RuntimeWarning, stacklevel=2)
            return
        self.graphs[key] = _Graph(n_b, fwd, bwd)
        self.captures += 1
        self.pool_bytes += max(torch.cuda.memory_reserved() - reserved, 0)

    def _no_autocast_cache(self) -> contextlib.AbstractContextManager:
        """Autocast's weight-cast cache must not cross a capture (a graph would read a freed cast)."""
        if torch.is_autocast_enabled("cuda"):
            return torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False)
        return contextlib.nullcontext()


def padded_inputs(step, n_b: int) -> tuple[np.ndarray, np.ndarray]:
    """A call's pack token indices and local subtree ends, padded to ``n_b``: padding reads token 0's id and
    position and sees only itself (and the prefix)."""
    n = step.n
    tokens_B = np.zeros(n_b, dtype=np.int64)
    tokens_B[:n] = step.tokens_C
    se_B = np.arange(1, n_b + 1, dtype=np.int64)
    se_B[:n] = step.local_ends
    return tokens_B, se_B


def call_scalars(step, grad: bool) -> np.ndarray:
    """(lo, first written, end written, gradient rows) of a call, for `CallGraphs._forward_body`."""
    if not grad:
        w0, w1 = 0, step.n
    elif step.n_anchor:
        w0, w1 = step.n_own, step.n
    else:
        w0 = w1 = 0
    return np.array([step.lo, w0, w1, step.path_rows if step.kv_grad else 0], dtype=np.int64)
