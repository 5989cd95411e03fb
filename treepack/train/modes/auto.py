"""``mode = "auto"``: per pack, the fastest exact mode by the FLOP model and a measured speed table.

Every mode trains the same loss with the same gradients, so the choice is a question of time only, and
it may differ from pack to pack. The candidates are ``tree`` and ``dense-leaf`` (``dense`` is never faster
than dense-leaf, and dfs trades time for memory, which the capacity already bounds). For each pack the
work of each candidate is counted exactly from the pack (numpy, no model call):

- tree: T tokens, the distinct target tokens, the visible (query, key) pairs ``sum_k (subtree_end[k] -
  k)``, one model call and one attention call per layer;
- dense-leaf: the leaf lanes' tokens, their distinct targets, ``sum_l L_l (L_l + 1) / 2`` causal pairs,
  one model call per micro-batch and one attention call per lane per layer (`treepack.train.data.plan_dense`).

and priced with a `SpeedTable` of measured throughputs (docs/design.md §9's FLOP model split in two):
``seconds = (6 P tokens + 6 D V predicted) / matmul + 12 L H E pairs / attention[backend]
+ L (calls x layer_call_seconds + attention calls x attention_call_seconds)``, P the non-embedding
parameters. The attention term decides real data. Per visible pair the FA4 tree kernel runs at 1.21-1.49x
torch's best dense kernel on an H100 (benchmarks/results/2026-11-25-attention-fa4-h100.md), so where it
runs, tree wins even on chains with no branches (tree tokens = leaf tokens); the Triton kernel (small
packs, or no FA4 installed) runs at ~0.97x, so there a pack needs a few % more leaf than tree tokens.
Estimated with the built-in H200 table, Qwen3-0.6B's shape and FA4 installed, ``treepack train``'s packs at
16K: tree on every pack of grpo_math, agentic-think, tau2-think and low-overlap, all but the last (small)
pack of tau-bench and tau2 (its small last pack: dense-leaf); at 32K, tree on every pack of the held-out
tau-bench retail records (est. 0.71 s against 0.82 s) and ToolBench (0.52 s against 2.37 s).

A speed table plugs in three ways: ``SPEED_TABLES`` (built in, by device name), ``SpeedTable.load(path)``
(a JSON file, e.g. from ``benchmarks/speed_table.py``), or `make_mode(..., speed_table=...)`. A table
names its source; `AutoMode.describe` prints which table decided and why.

Legend: T pack tokens, Q dense-leaf lanes, L layers, H query heads, E head dim, D hidden size, V vocab.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from treepack.errors import ConfigError
from treepack.stats import ModelShape
from treepack.train.modes.base import Mode, ModeResult

CANDIDATES = ("tree", "dense-leaf")
SQUARE_SCORE_BACKENDS = ("reference",)  # compute every (query, key) score of a call, masked or not
SEGMENT_MIN_TOKENS = 1024  # as treepack.train.attention: the reference backend's calls per independent run


@dataclass(frozen=True)
class Work:
    """What one mode computes for one pack (forward + backward counted by the FLOP model)."""

    tokens: int  # tokens through every layer
    predicted: int  # log-probs through the output head
    pairs: int  # visible (query, key) attention pairs
    square_pairs: int  # scores a dense-score kernel computes (the reference backend: its calls' T^2)
    calls: int  # model calls
    attention_calls: int  # attention kernel calls per layer


@dataclass(frozen=True)
class SpeedTable:
    """Measured throughputs of one device and dtype: what a FLOP of each kind costs there.

    ``attention`` maps a backend name (triton, flex, reference, sdpa) to FLOP/s over the pairs it computes
    (visible pairs; for the reference backend every score of a call), forward and backward together."""

    name: str  # e.g. "H200 bf16"
    matmul: float  # FLOP/s of the linear layers and the output head, forward and backward
    attention: Mapping[str, float]  # FLOP/s per backend, forward and backward
    layer_call_seconds: float = 0.0  # fixed cost of one model call, per layer (launches, host work)
    attention_call_seconds: float = 0.0  # fixed cost of one more attention call, per layer
    source: str = ""  # where the numbers come from (a measured run: command, hardware, versions)

    def attention_speed(self, backend: str) -> float:
        if backend in self.attention:
            return float(self.attention[backend])
        return min(float(v) for v in self.attention.values())  # unmeasured backend: assume the slowest

    def seconds(self, work: Work, shape: ModelShape, backend: str) -> float:
        """Estimated forward + backward time of ``work`` with attention through ``backend``."""
        linear = 6.0 * shape.non_embedding_params * work.tokens + 6.0 * shape.d_model * shape.vocab * work.predicted
        pairs = work.square_pairs if backend in SQUARE_SCORE_BACKENDS else work.pairs
        attention = 12.0 * shape.n_layers * shape.n_heads * shape.head_dim * pairs
        host = shape.n_layers * (work.calls * self.layer_call_seconds
                                 + work.attention_calls * self.attention_call_seconds)
        return linear / self.matmul + attention / self.attention_speed(backend) + host

    def to_json(self) -> dict:
        return {**asdict(self), "attention": dict(self.attention)}

    @classmethod
    def from_json(cls, data: dict) -> SpeedTable:
        try:
            table = cls(name=str(data["name"]), matmul=float(data["matmul"]),
                        attention={str(k): float(v) for k, v in dict(data["attention"]).items()},
                        layer_call_seconds=float(data.get("layer_call_seconds", 0.0)),
                        attention_call_seconds=float(data.get("attention_call_seconds", 0.0)),
                        source=str(data.get("source", "")))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"speed table: needs name, matmul and attention {{backend: FLOP/s}} ({exc})") from None
        if table.matmul <= 0 or not table.attention or min(table.attention.values()) <= 0:
            raise ConfigError("speed table: matmul and every attention speed must be > 0")
        return table

    @classmethod
    def load(cls, path: str | Path) -> SpeedTable:
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such file") from None
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{path}: not a JSON speed table ({exc})") from None
        return cls.from_json(data)


# Built-in tables, by a substring of the device name ("cpu" for the CPU). The GPU attention rates are the
# kernels' own measured table, that GPU's row (`treepack.kernels.tree_attention.backends.MEASURED`: torch 2.11,
# triton 3.6, flash-attn-4 4.0.0b36, bf16, 16 q / 8 kv heads of 128, fwd+bwd over visible pairs of
# treepack's 32K packs), converted from its 14 FLOP per (pair, head, dim) (backward = 2.5 x forward) to the
# FLOP model's 12; flex from issue 17's H200 run (220 TFLOP/s x 12/14).
# The matmul rate is the bf16 8192^3 product measured on these machines (769-798 TFLOP/s). Host costs are
# not in it (0). benchmarks/speed_table.py measures a whole table on the GPU at hand (train.speed_table).
_TO_MODEL_FLOPS = 12.0 / 14.0


def _hopper_table(name: str) -> SpeedTable:
    from treepack.kernels.tree_attention.backends import MEASURED

    rates = {b: r.tflops * 1e12 * _TO_MODEL_FLOPS for b, r in MEASURED[name.split()[0]].items()}
    return SpeedTable(name=name, matmul=780e12, attention={**rates, "flex": 220e12 * _TO_MODEL_FLOPS},
                      source=(f"treepack.kernels.tree_attention.backends.MEASURED['{name.split()[0]}'] (torch 2.11, "
                              "triton 3.6, flash-attn-4 4.0.0b36) x 12/14; flex 220 TFLOP/s (1x H200); bf16 matmul "
                              "769-798 TFLOP/s (8192^3, same machines); host costs not measured"))


SPEED_TABLES: dict[str, SpeedTable] = {
    "H200": _hopper_table("H200 bf16"),
    "H100": _hopper_table("H100 bf16"),
    "cpu": SpeedTable(name="CPU", matmul=3.80e9, attention={"sdpa": 1.20e9, "reference": 1.39e9},
                      layer_call_seconds=1.15e-3, attention_call_seconds=2.9e-4,
                      source="benchmarks/speed_table.py --device cpu --hidden 64 --ffn 176 --heads 4 --kv-heads 2 "
                             "--head-dim 16 --tokens 4096 --sequences 4 (AMD EPYC, 2 threads, torch 2.13.0+cpu, "
                             "float64; benchmarks/results/2026-11-25-speed-table-cpu.md)"),
}


def default_table(device: torch.device) -> SpeedTable:
    """The built-in table for this device (a GPU without one: the H200's ratios)."""
    if device.type != "cuda":
        return SPEED_TABLES["cpu"]
    name = torch.cuda.get_device_name(device)
    return next((t for k, t in SPEED_TABLES.items() if k in name), SPEED_TABLES["H200"])


def model_shape(args) -> ModelShape:
    """The FLOP model's view of a `ModelArgs`."""
    return ModelShape(name=f"{args.family} {args.num_layers}x{args.hidden_size}", n_layers=args.num_layers,
                      d_model=args.hidden_size, n_heads=args.num_heads, n_kv_heads=args.num_kv_heads,
                      head_dim=args.head_dim, d_ff=args.intermediate_size, vocab=args.vocab_size)


def tree_backend(impl: str, device: torch.device, dtype: torch.dtype, heads: int, head_dim: int, tokens: int,
                 pairs: int) -> str:
    """The backend a tree attention call with ``impl`` over ``tokens`` queries and ``pairs`` visible pairs
    runs (the kernels' registry resolves ``auto``; a named one that cannot run is priced under its name)."""
    from treepack.kernels.tree_attention.registry import AttentionCall, BackendError, resolve

    try:
        return resolve("tree", impl, AttentionCall(device, dtype, heads, head_dim, tokens, pairs=pairs)).name
    except BackendError:
        return impl


def causal_backend(impl: str, device: torch.device, dtype: torch.dtype, heads: int, head_dim: int) -> str:
    """The backend a dense mode's attention ``impl`` runs with (``auto``: per-sequence SDPA on a CPU)."""
    from treepack.kernels.tree_attention.registry import AttentionCall, BackendError, resolve

    try:
        return resolve("causal", impl, AttentionCall(device, dtype, heads, head_dim)).name
    except BackendError:
        return impl


# --------------------------------------------------------------------------------------------------
# Work of a pack


def _square_pairs(subtree_end_T: np.ndarray) -> int:
    """sum of n^2 over the reference backend's calls (independent runs merged to SEGMENT_MIN_TOKENS)."""
    T = subtree_end_T.shape[0]
    if T == 0:
        return 0
    reach_T = np.maximum.accumulate(subtree_end_T)
    starts = (np.flatnonzero(reach_T[:-1] <= np.arange(1, T)) + 1).tolist()
    cuts = [0]
    for k in starts:
        if k - cuts[-1] >= SEGMENT_MIN_TOKENS:
            cuts.append(k)
    sizes = np.diff(np.asarray(cuts + [T], dtype=np.int64))
    return int((sizes * sizes).sum())


def tree_work(pack, rows) -> Work:
    """Tree mode's work on a pack: every pack token once, one log-prob per distinct target token."""
    end_T = np.asarray(pack.subtree_end, dtype=np.int64)
    pairs = int((end_T - np.arange(end_T.shape[0])).sum())
    return Work(tokens=pack.n_tokens, predicted=int(np.unique(rows.token_R).shape[0]), pairs=pairs,
                square_pairs=_square_pairs(end_T), calls=1, attention_calls=1)


def dense_work(plan, varlen: bool = False) -> Work:
    """A dense mode's work from its `DensePlan`: one attention call per lane (SDPA per sequence), or per
    micro-batch (``varlen``: the sequences laid back to back, one call)."""
    squares = int((plan.length_Q * plan.length_Q).sum())
    calls = plan.n_batches if varlen else int(plan.length_Q.shape[0])
    return Work(tokens=plan.tokens, predicted=plan.predicted, pairs=plan.pairs, square_pairs=squares,
                calls=plan.n_batches, attention_calls=calls)



# --------------------------------------------------------------------------------------------------
# The choice


@dataclass
class Choice:
    """auto's decision for one pack: the mode, and the estimate and work of every candidate."""

    mode: str
    seconds: dict[str, float]
    work: dict[str, Work]
    backends: dict[str, str]

    def reason(self) -> str:
        t, d = self.work["tree"], self.work["dense-leaf"]
        other = "dense-leaf" if self.mode == "tree" else "tree"
        gain = self.seconds[other] / max(self.seconds[self.mode], 1e-12)
        return (f"{self.mode}: est. {gain:.2f}x faster than {other} (dense-leaf forwards {d.tokens / max(t.tokens, 1):.2f}x "
                f"the tree's tokens and {d.pairs / max(t.pairs, 1):.2f}x its attention pairs; attention: "
                f"dense-leaf {self.backends['dense-leaf']}, tree {self.backends['tree']})")


def choose(works: dict[str, Work], backends: dict[str, str], shape: ModelShape, table: SpeedTable) -> Choice:
    """The candidate with the least estimated time (ties: tree, the first candidate)."""
    seconds = {m: table.seconds(works[m], shape, backends[m]) for m in CANDIDATES}
    best = min(CANDIDATES, key=lambda m: seconds[m])
    return Choice(mode=best, seconds=seconds, work=dict(works), backends=dict(backends))


class AutoMode(Mode):
    """Per pack, tree or dense-leaf, whichever the speed table says is faster (same loss, same gradients)."""

    name = "auto"

    def __init__(self, tree: Mode, leaf: Mode, table: SpeedTable | None = None) -> None:
        super().__init__(tree.attention, chunk_rows=tree.chunk_rows)
        self.tree, self.leaf, self.table = tree, leaf, table
        self.counts: Counter = Counter()  # packs run by each candidate so far
        self.planned: set[str] = set()  # the candidates `describe` found the run's packs need
        self._first_pack_done = False  # `_build_other_paths` acts at the first pack only

    def _table(self, device: torch.device) -> SpeedTable:
        return self.table or default_table(device)

    def choose(self, model, pack, rows, dtype: torch.dtype | None = None) -> Choice:
        """The decision for one pack under ``model`` (its shape and device) computing in ``dtype`` (None:
        the autocast dtype when autocast is on, else the model's)."""
        dev = model.device
        if dtype is None:
            dtype = torch.get_autocast_dtype(dev.type) if torch.is_autocast_enabled(dev.type) else model.dtype
        a = model.args
        leaf = causal_backend(self.leaf.attention, dev, dtype, a.num_heads, a.head_dim)
        works = {"tree": tree_work(pack, rows),
                 "dense-leaf": dense_work(self.leaf.plan(pack, rows), varlen=leaf.endswith("-varlen"))}
        tree = works["tree"]
        backends = {"tree": tree_backend(self.tree.attention, dev, dtype, a.num_heads, a.head_dim, tree.tokens,
                                         tree.pairs),
                    "dense-leaf": leaf}
        return choose(works, backends, model_shape(model.args), self._table(dev))

    def __call__(self, model, pack, rows, objective, totals) -> ModeResult:
        choice = self.choose(model, pack, rows)
        self._build_other_paths(choice.mode, model, pack, rows, objective, totals)
        self.counts[choice.mode] += 1
        out = (self.tree if choice.mode == "tree" else self.leaf)(model, pack, rows, objective, totals)
        work = choice.work[choice.mode]
        if out.predicted_tokens is None:
            out.predicted_tokens = work.predicted
        if out.attention_pairs is None:
            out.attention_pairs = work.pairs
        out.metrics["dense_leaf_share"] = float(choice.mode == "dense-leaf")
        return out

    def _build_other_paths(self, mode: str, model, pack, rows, objective, totals) -> None:
        """At the run's first pack, run it once more as each other candidate the run's plan holds, and drop that
        pass's gradients: every path the run takes compiles in step 1. Otherwise the first pack of the other mode
        compiled its graphs inside a later step (tau-bench: step 5, 4.4 s against 1.1 s a step; tau2: step 2;
        results/2026-11-28-modes-h200.md), and under data parallelism on one rank while the others waited.

        Only where that pass leaves no trace: no gradient accumulated yet (the first pack of a step), one process
        (a sharded model's extra backward would be a collective the other ranks do not make)."""
        if self._first_pack_done:
            return
        self._first_pack_done = True
        todo = [m for m in CANDIDATES if m in self.planned and m != mode]
        if not todo:
            return
        params = list(model.parameters())
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if any(p.grad is not None for p in params) or (distributed and torch.distributed.get_world_size() > 1):
            return
        for other in todo:
            out = (self.tree if other == "tree" else self.leaf)(model, pack, rows, objective, totals)
            if not out.backward_done:
                out.loss.backward()
        for p in params:
            p.grad = None

    def describe(self, model, packs, rows, dtype: torch.dtype | None = None) -> list[str]:
        """What auto will run on these packs and why (printed once at the start of training)."""
        choices = [self.choose(model, p, r, dtype) for p, r in zip(packs, rows)]
        self.planned = {c.mode for c in choices}
        table = self._table(model.device)
        by_mode = Counter(c.mode for c in choices)
        total = {m: sum(c.seconds[m] for c in choices) for m in CANDIDATES}
        mixed = sum(c.seconds[c.mode] for c in choices)
        lines = [f"mode auto ({table.name} speed table): "
                 + ", ".join(f"{m} on {by_mode[m]} pack{'s' if by_mode[m] != 1 else ''}" for m in CANDIDATES if by_mode[m])
                 + f"; est. {mixed:.3g} s per epoch vs {total['tree']:.3g} s all tree, "
                   f"{total['dense-leaf']:.3g} s all dense-leaf"]
        for m in CANDIDATES:
            mine = [c for c in choices if c.mode == m]
            if mine:
                typical = sorted(mine, key=lambda c: c.seconds["tree"] / max(c.seconds["dense-leaf"], 1e-12))[len(mine) // 2]
                lines.append(f"  {typical.reason()}" + (f" (median of {len(mine)})" if len(mine) > 1 else ""))
        if len(self.planned) > 1:
            lines.append("  step 1 also runs its first pack the other way (its gradients dropped), so that both paths "
                         "compile before training")
        return lines
