"""One training step (forward, backward, AdamW) of Qwen3-shaped models: tree packs vs the dense baselines.

A step is what ``treepack train`` does for one global batch (`treepack.train.loop.train`'s inner loop):
for every pack of the workload, under bf16 autocast with float32 weights and AdamW state, the mode's
forward, the chunked target log-probs (never more than ``logits_chunk`` = 4,096 rows of full-vocabulary
logits at a time), the GRPO loss (token mean) and its backward; then gradient clipping at 1.0 and AdamW
(`make_optimizer`, the config defaults). The timed region runs from the step's first host-side work
(loss rows, pack tensors, the tree mask's block schedule) to the synchronised end of the optimizer step.

Runners, on the same rollouts (one forest: no ``tree_id`` scoping, so the system prompt is shared across
tasks as a trainer batching them would share it):
- ``dense``: every sequence on its own, in micro-batches of whole sequences up to ``--dense-tokens`` flat
  tokens (`DenseMode`: one causal SDPA call per sequence and layer, flash kernel);
- ``dense-leaf``: the same over the leaf sequences only (duplicates and prefixes of another dropped: the
  strongest simple baseline; on data where every record is a leaf it is ``dense`` and is not re-run);
- ``tree/triton`` and ``tree/flex``: `TreeMode` over the packs of `pack_rollouts` at each capacity, the
  Triton tree-attention kernel or FlexAttention with the same mask (both from one `TreeMaskInfo` built
  once per pack and reused by every layer; FlexAttention caches its BlockMask on it). ``--child-order
  largest-first`` lays those packs (and ``auto``'s) out children largest subtree first
  (`treepack.pack.layout.relayout`, ``data.child_order``): the same FLOPs, fewer partial FA4 blocks on
  ToolBench (benchmarks/results/2026-11-25-fa4-blocks.md).
Before the runs a *path check* forwards one pack through ``make_mode("tree")`` with the default
``attention="auto"`` and counts the calls into the kernels: on CUDA it must be one `prepare` per pack and
one Triton call per layer, no FlexAttention and no reference attention.

FLOP model (docs/design.md §9, `treepack.stats.ModelShape.flops`), counted per runner over what it computes:

    F = 6 · P · tokens  +  6 · d · V · predicted  +  12 · L · H · E · pairs

- P = non-embedding parameters (per layer d·E·(2H + 2K) attention + 3·d·F SwiGLU), tokens = tokens
  forwarded (flat tokens of the micro-batches for dense, N_pack = tree tokens of all packs for tree);
  6 = 2 FLOPs per multiply-add x (forward + backward = 3 forwards);
- d·V = the output head (tied to the embedding), predicted = rows whose log-prob the head computes (loss
  rows for dense; distinct predicted pack tokens for tree: a shared token is computed once);
- pairs = visible (query, key) pairs: sum over sequences of L(L+1)/2 for dense, sum over pack tokens of
  ``subtree_end[k] - k`` for tree; 12·E·H per pair and layer = (QK^T and PV, 2·2·E) x 3 for fwd+bwd.

Ideal speedup of tree over a baseline B = F_B / F_tree (the FLOPs it avoids), realised = t_B / t_tree,
and realised / ideal = tree's FLOP rate over B's: design §9 asks >= 90% over both baselines. MFU = F / t /
(the bf16 matmul rate measured in the same run: an 8192^3 ``torch.matmul`` on random data); the recompute
of activation checkpointing, where a runner needs it to fit, is not counted (model FLOPs, not hardware
FLOPs). Flat-equivalent tokens/s = the workload's N_flat / t for every runner.

Timing: per runner one warm-up step over all its packs (Triton compiles and autotunes per power-of-two
pack size, FlexAttention compiles, AdamW allocates its state, and every sequence length and micro-batch
shape has been seen once: a warm-up over one micro-batch per size left dense-leaf's first timed step 23%
slower than its second), then ``--repeats`` timed steps, stopping after the first one that takes longer
than ``--max-step-seconds``; the median is reported and every step's time kept. Peak memory =
``torch.cuda.max_memory_allocated`` over the timed steps (weights, gradients and AdamW state included).
A runner that runs out of memory is retried with activation checkpointing (and so is every later runner
of that model with forwards as large). Jobs run config by config, each config's runners in the order
dense-leaf, tree/triton, dense, tree/flex (the slowest to compile); ``--deadline`` skips the jobs that
would start after it. ``--profile`` adds, per model, the GPU time of one step over one pack by kernel
group (tree attention, cuBLAS, optimizer, the rest) and its longest kernels.

Measured (H200, bf16, benchmarks/results/2026-11-21-train-step-h200.md), with the elementwise regions
compiled (`train.compile = "auto"`): on 144 real tau-bench records (C 10.1) the Qwen3-0.6B tree step
takes 1.22 s at 16K packs (eager: 1.93 s), 95-97% of the FLOP-model ideal over dense-leaf and 99-101%
over dense; MFU 44-47% for the 0.6B model and 58% for the 1.7B (eager: 26-30%). The attention kernel is
now the largest share of the step's GPU time (54% of a 16K pack).

Usage:
    python benchmarks/train_step.py                               # the full comparison (CUDA)
    python benchmarks/train_step.py --configs qwen3-0.6b:tau-bench:16K,32K qwen3-1.7b:tau-bench:32K \\
        --out benchmarks/results/DATE-train-step-h200.md --deadline 300
    python benchmarks/train_step.py --device cpu --configs tiny:tau-bench:4K --tau-records 4 \\
        --runners dense,dense-leaf,tree/reference                # CPU smoke run (numbers meaningless)

Legend: T pack tokens, F flat tokens, S sequences.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import command_line, gpu_line, one_forest, today
from train_step_report import (
    KERNEL_GROUPS,
    OTHER_KERNELS,
    Result,
    cap_label,
    profile_table,
    section_table,
    summary,
)

TAU_BENCH = ROOT / "treepack" / "datasets" / "samples" / "tau_bench_slice.parquet"


def _import_treepack() -> None:
    try:
        import treepack
    except ImportError:  # a checkout that is not installed: the repository root maps onto treepack.*
        sys.path.insert(0, str(ROOT))
        import treepack  # noqa: F401


_import_treepack()

import torch

from treepack.errors import TreepackError
from treepack.io.ingest import read_rollouts
from treepack.io.rollouts import Rollouts
from treepack.pack.layout import CHILD_ORDERS, Pack, relayout
from treepack.sizes import parse_size
from treepack.stats import MODEL_SHAPES, ModelShape
from treepack.train import losses, working_weights
from treepack.train.config import RunConfig
from treepack.train.data import dense_batches, leaf_sequences, pack_rollouts
from treepack.train.loop import make_optimizer, resolve_precision
from treepack.train.losses import BatchTotals, LossRows, Objective
from treepack.train.model import Decoder, ModelArgs
from treepack.train.modes import make_mode
from treepack.tree import PrefixTree

QWEN3_VOCAB = 151936  # rows of Qwen3's embedding (151,669 used ids, padded)
MODELS = {  # Qwen3 shapes from the Hugging Face config.json files (tied embeddings); tiny = CPU smoke runs
    "qwen3-0.6b": {"hidden_size": 1024, "intermediate_size": 3072, "num_layers": 28, "num_heads": 16,
                   "num_kv_heads": 8, "head_dim": 128},
    "qwen3-1.7b": {"hidden_size": 2048, "intermediate_size": 6144, "num_layers": 28, "num_heads": 16,
                   "num_kv_heads": 8, "head_dim": 128},
    "tiny": {"hidden_size": 64, "intermediate_size": 176, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
             "head_dim": 16},
}
WORKLOADS = {
    "tau-bench": "real: the first --tau-records records of treepack/datasets/samples/tau_bench_slice.parquet "
                 "(tau-bench retail, agent and user grok-3, Qwen3 tokens)",
    "toolbench": "real: the --toolbench rollouts (ToolBench DFSDT answer trees, Qwen3 tokens), whole file",
    "tau2-think": "synthetic: treepack synth tau2 --think -n N (seed 0)",
    "agentic-think": "synthetic: treepack synth agentic-think -n N --max-len 16384 (seed 0)",
}
RUNNERS = ("dense", "dense-leaf", "tree/triton", "tree/fa4", "tree/flex", "tree/reference", "tree/auto", "auto")
RUN_ORDER = ("dense-leaf", "tree/triton", "tree/fa4", "tree/auto", "auto", "tree/reference", "dense", "tree/flex")
# model:workload:tree capacities (K = 1024)
DEFAULT_CONFIGS = ("qwen3-0.6b:tau-bench:16K,32K", "qwen3-0.6b:tau2-think:16K,32K",
                   "qwen3-1.7b:tau-bench:32K", "qwen3-1.7b:tau2-think:32K")


# --------------------------------------------------------------------------------------------------
# Workloads and what each runner computes


def load_workload(name: str, args: argparse.Namespace) -> Rollouts:
    if name == "tau-bench":
        r = read_rollouts([str(args.tau_bench)])
        return one_forest(r.select(np.arange(min(args.tau_records, len(r)))), args.seed)
    if name == "toolbench":
        return one_forest(read_rollouts([str(args.toolbench)]), args.seed)
    import pyarrow.parquet as pq

    from treepack.datasets import synth

    kind, overrides = {"tau2-think": ("tau2", {"think": True}),
                       "agentic-think": ("agentic-think", {"max_len": 16384})}[name]
    table = synth.generate(kind, args.synth_trees, seed=args.seed, **overrides)
    with tempfile.TemporaryDirectory() as d:  # through Parquet: the reader is the one `treepack train` uses
        path = os.path.join(d, f"{name}.parquet")
        pq.write_table(table, path)
        return one_forest(read_rollouts([path]), args.seed)


def compact_ids(r: Rollouts) -> tuple[Rollouts, int]:
    """Token ids renumbered 0..n-1 over the ids present (the tiny CPU model: a 151k-wide softmax per row
    would dominate its step). Returns the rollouts and the vocabulary size."""
    ids, inverse = np.unique(r.tokens, return_inverse=True)
    return dataclasses.replace(r, tokens=inverse.astype(np.int32)), int(ids.shape[0])


@dataclass
class Work:
    """What one runner computes in one step, for the FLOP model."""

    packs: list[Pack]
    tokens: int  # tokens through the model (flat tokens of the micro-batches, or tree tokens of the packs)
    predicted: int  # rows of the output head (loss rows, or distinct predicted pack tokens)
    pairs: int  # visible (query, key) pairs
    sequences: int
    dense: bool  # micro-batches of whole sequences (else tree packs)

    @classmethod
    def flat(cls, packs: list[Pack]) -> Work:
        """Micro-batches of whole sequences, each run as independent causal sequences."""
        lengths_S = np.concatenate([np.diff(np.asarray(p.seq_offsets, dtype=np.int64)) for p in packs])
        return cls(packs, tokens=int(lengths_S.sum()),
                   predicted=sum(LossRows.from_pack(p).n_rows for p in packs),
                   pairs=int((lengths_S * (lengths_S + 1) // 2).sum()), sequences=int(lengths_S.shape[0]),
                   dense=True)

    @classmethod
    def tree(cls, packs: list[Pack]) -> Work:
        """Tree packs (the mask of ``subtree_end``)."""
        pairs = 0
        for p in packs:
            end_T = np.asarray(p.subtree_end, dtype=np.int64)
            pairs += int((end_T - np.arange(end_T.shape[0])).sum())
        predicted = sum(int(np.unique(LossRows.from_pack(p).token_R).shape[0]) for p in packs)
        return cls(packs, tokens=sum(p.n_tokens for p in packs), predicted=predicted, pairs=pairs,
                   sequences=sum(p.n_sequences for p in packs), dense=False)

    @property
    def largest(self) -> int:
        """Tokens of the largest forward (a pack, or a micro-batch's flat tokens)."""
        return max(int(p.seq_offsets[-1]) if self.dense else p.n_tokens for p in self.packs)


# --------------------------------------------------------------------------------------------------
# Model, step, measurement


def model_args(name: str, vocab: int) -> ModelArgs:
    return ModelArgs.for_family("qwen3", vocab_size=vocab, tie_embeddings=True, **MODELS[name])


def model_shape(name: str, args: ModelArgs) -> ModelShape:
    shape = ModelShape(name, args.num_layers, args.hidden_size, args.num_heads, args.num_kv_heads,
                       args.head_dim, args.intermediate_size, args.vocab_size)
    if name in MODEL_SHAPES and MODEL_SHAPES[name] != shape:
        raise AssertionError(f"{name}: shape {shape} differs from treepack.stats' {MODEL_SHAPES[name]}")
    return shape


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Trainer:
    """The inner loop of `treepack.train.loop.train` for one global batch = all packs of a runner."""

    def __init__(self, model: Decoder, autocast_dtype: torch.dtype | None, adamw: str = "auto") -> None:
        cfg = RunConfig()
        self.model = model
        self.device = model.device
        self.optimizer = make_optimizer(model, cfg)
        if adamw == "foreach":  # the multi-tensor loop instead of make_optimizer's fused kernel
            for group in self.optimizer.param_groups:
                group["fused"], group["foreach"] = False, True
        self.grad_clip = cfg.train.grad_clip
        self.logits_chunk = cfg.train.logits_chunk
        self.objective = Objective(kind="grpo")
        self.params = list(model.parameters())
        self.autocast = ((lambda: torch.autocast(self.device.type, dtype=autocast_dtype)) if autocast_dtype
                         else contextlib.nullcontext)
        # bf16 copies of the matrix weights, cast once a step, as `train` keeps them (`--working-weights`)
        self.working = model.working_weights
        if self.working is None and working_weights.applies(model, autocast_dtype):
            self.working = working_weights.WorkingWeights(model, autocast_dtype)

    def step(self, packs: list[Pack], mode) -> float:
        rows = [LossRows.from_pack(p) for p in packs]
        totals = BatchTotals.of(rows)
        loss = 0.0
        for pack, row in zip(packs, rows):
            with self.autocast():
                out = mode(self.model, pack, row, self.objective, totals)
            out.backward()
            loss += out.loss.item()
        if self.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.working is not None:
            self.working.refresh()
        _sync(self.device)
        return loss

    def release(self) -> None:
        """Drop gradients and cached blocks after an out-of-memory error."""
        self.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def measure(trainer: Trainer, work: Work, mode, repeats: int, max_step_seconds: float,
            log: Callable[[str], None]) -> tuple[float, list[float], float, float]:
    """(warm-up seconds, timed step seconds, peak GiB, last loss) of one runner."""
    dev = trainer.device
    t0 = time.perf_counter()
    trainer.step(work.packs, mode)
    warm = time.perf_counter() - t0
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    times, loss = [], 0.0
    for _ in range(repeats):
        _sync(dev)
        t0 = time.perf_counter()
        loss = trainer.step(work.packs, mode)
        times.append(time.perf_counter() - t0)
        log(f"    step {len(times)}: {times[-1]:.3f} s")
        if times[-1] > max_step_seconds:
            break
    peak = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else 0.0
    return warm, times, peak, loss


def auto_work(mode, trainer: Trainer, work: Work, model: str) -> tuple[float, str]:
    """FLOPs of what ``mode = "auto"`` runs on these packs (its choice per pack) and a note saying it."""
    flops, chosen = 0.0, Counter()
    shape = model_shape(model, trainer.model.args)
    with trainer.autocast():
        for pack in work.packs:
            choice = mode.choose(trainer.model, pack, LossRows.from_pack(pack))
            w = choice.work[choice.mode]
            flops += shape.flops(w.tokens, w.predicted, w.pairs)
            chosen[choice.mode] += 1
    return flops, "auto: " + ", ".join(f"{m} on {n} pack{'s' if n != 1 else ''}" for m, n in sorted(chosen.items()))


def profile_step(trainer: Trainer, pack: Pack, mode, top: int = 15) -> tuple[dict[str, float], list]:
    """GPU seconds by kernel group (torch.profiler, CUDA activity only) of one step over one pack (its
    forward and backward, clipping and AdamW), plus the step's wall time under the profiler ("wall") and
    pack tokens; and the ``top`` kernels by GPU time as [name, group, seconds] (to check the grouping)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Profiler clears events.*")  # one cycle is all we record
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            trainer.step([pack], mode)
            wall = time.perf_counter() - t0
        events = prof.events()
    seconds: Counter = Counter()
    per_kernel: Counter = Counter()
    groups: dict[str, str] = {}
    for e in events:
        if e.device_type != DeviceType.CUDA:
            continue
        name = e.name.lower()
        group = next((g for g, keys in KERNEL_GROUPS if any(k in name for k in keys)), OTHER_KERNELS)
        seconds[group] += e.time_range.elapsed_us() / 1e6
        per_kernel[e.name] += e.time_range.elapsed_us() / 1e6
        groups[e.name] = group
    longest = [[name[:160], groups[name], t] for name, t in per_kernel.most_common(top)]
    return {**dict(seconds), "wall": wall, "tokens": float(pack.n_tokens)}, longest


def matmul_ceiling(device: torch.device, n: int = 8192, iters: int = 20) -> float:
    """FLOP/s of an n x n x n matmul on random data (bf16 on CUDA, float32 on CPU): median of ``iters``."""
    if device.type != "cuda":
        n, iters = 512, 5
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(iters):
        _sync(device)
        t0 = time.perf_counter()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            a @ b
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            a @ b
            times.append(time.perf_counter() - t0)
    return 2.0 * n**3 / statistics.median(times)


# --------------------------------------------------------------------------------------------------
# Path check: which kernels a tree-mode forward reaches with the library defaults


def path_check(trainer: Trainer, pack: Pack) -> dict:
    """Forward one pack through ``make_mode("tree")`` (attention "auto") and count kernel calls. Runs the
    layers uncompiled: a compiled layer calls the kernel's custom op from inside its graph, where no Python
    wrapper can count it (the compiled and eager layers take the same backend, `kernel_schedule`'s choice)."""
    import treepack.kernels
    from treepack.kernels.tree_attention import reference

    counts: Counter = Counter()
    dtypes: set[str] = set()
    chunks: list[tuple[int, int]] = []

    def counted(key: str, fn):
        def wrapper(*a, **kw):
            counts[key] += 1
            if key != "prepare":
                dtypes.add(str(a[0].dtype).removeprefix("torch."))
            return fn(*a, **kw)
        return wrapper

    apply = losses._TargetLogProb.apply

    def logprob_apply(hidden, weight, target, chunk, *rest):
        chunks.append((int(hidden.shape[0]), int(chunk)))
        return apply(hidden, weight, target, chunk, *rest)

    patches = [mock.patch.object(treepack.kernels, "prepare", counted("prepare", treepack.kernels.prepare)),
               mock.patch.object(reference, "tree_attention_reference",
                                 counted("reference", reference.tree_attention_reference)),
               mock.patch.object(losses._TargetLogProb, "apply", staticmethod(logprob_apply))]
    for key, module in (("triton", "triton"), ("fa4", "fa4"), ("flex", "flex")):
        try:
            mod = __import__(f"treepack.kernels.tree_attention.{module}", fromlist=["x"])
        except ImportError:  # no triton on this machine
            continue
        fn_name = f"tree_attention_{module}"
        patches.append(mock.patch.object(mod, fn_name, counted(key, getattr(mod, fn_name))))
    row = LossRows.from_pack(pack)
    compile_mode, trainer.model.compile = trainer.model.compile, "off"
    with contextlib.ExitStack() as stack:
        stack.callback(setattr, trainer.model, "compile", compile_mode)
        for p in patches:
            stack.enter_context(p)
        with torch.no_grad(), trainer.autocast():
            mode = make_mode("tree", logits_chunk=trainer.logits_chunk)  # attention: the default ("auto")
            mode(trainer.model, pack, row, trainer.objective, BatchTotals.of([row]))
    _sync(trainer.device)
    return {"tokens": int(pack.n_tokens), "layers": trainer.model.args.num_layers, "calls": dict(counts),
            "qkv_dtype": sorted(dtypes), "logprob_rows": [r for r, _ in chunks],
            "chunk_rows": sorted({c for _, c in chunks}), "chunk_limit": trainer.logits_chunk}


def path_check_line(check: dict, device: torch.device) -> tuple[str, bool]:
    c = check["calls"]
    rows = sum(check["logprob_rows"])
    chunk = max(check["chunk_rows"], default=0)
    line = (f"tree mode with the defaults (attention 'auto') on one pack of {check['tokens']:,} tokens, "
            f"{check['layers']} layers: prepare x{c.get('prepare', 0)}, triton x{c.get('triton', 0)}, "
            f"fa4 x{c.get('fa4', 0)}, flex "
            f"x{c.get('flex', 0)}, reference x{c.get('reference', 0)}; "
            f"q/k/v {', '.join(check['qkv_dtype'])}; "
            f"log-probs of {rows:,} rows in chunks of <= {chunk:,} rows")
    fused = c.get("triton", 0) + c.get("fa4", 0)  # auto: one fused kernel per layer, fa4 where installed
    on_triton = (c.get("prepare", 0) == 1 and fused == check["layers"] and not c.get("flex")
                 and not c.get("reference") and check["qkv_dtype"] == ["bfloat16"])
    ok = (device.type != "cuda" or on_triton) and 0 < chunk <= check["chunk_limit"]
    return line, ok


@dataclass
class WorkloadInfo:
    rollouts: Rollouts
    leaf_S: np.ndarray  # input indices of the leaf sequences
    n_tree: int  # tokens of the whole forest's trie (one pack of unlimited capacity)

    @classmethod
    def of(cls, r: Rollouts) -> WorkloadInfo:
        return cls(r, leaf_sequences(r), PrefixTree.from_arrays(r.tokens, r.offsets).n_tree_tokens)

    def describe(self) -> str:
        r = self.rollouts
        n_flat = int(r.offsets[-1])
        return (f"{len(r)} sequences, N_flat {n_flat:,}, N_tree {self.n_tree:,} "
                f"(C {n_flat / self.n_tree:.2f}), {len(self.leaf_S)} leaf sequences of "
                f"{int(r.lengths[self.leaf_S].sum()):,} tokens, longest {int(r.lengths.max()):,}")


# --------------------------------------------------------------------------------------------------
# Main


@dataclass
class Job:
    model: str
    workload: str
    runner: str
    capacity: int | None  # tree runners: pack capacity


def parse_config(text: str) -> tuple[str, str, list[int], list[str] | None]:
    """``MODEL:WORKLOAD:CAP[,CAP...][:RUNNER+...]`` -> (model, workload, capacities, runners or None)."""
    parts = text.split(":")
    if len(parts) not in (3, 4):
        raise argparse.ArgumentTypeError(f"config {text!r} must be MODEL:WORKLOAD:CAP[,CAP...][:RUNNER+...]")
    model, workload, caps = parts[:3]
    runners = parts[3].split("+") if len(parts) == 4 else None
    if model not in MODELS:
        raise argparse.ArgumentTypeError(f"unknown model {model!r} (models: {', '.join(MODELS)})")
    if workload not in WORKLOADS:
        raise argparse.ArgumentTypeError(f"unknown workload {workload!r} (workloads: {', '.join(WORKLOADS)})")
    for runner in runners or ():
        if runner not in RUNNERS:
            raise argparse.ArgumentTypeError(f"unknown runner {runner!r} (runners: {', '.join(RUNNERS)})")
    try:
        return model, workload, [parse_size(c, what="capacity") for c in caps.split(",")], runners
    except TreepackError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def plan(configs: list[tuple[str, str, list[int], list[str] | None]], runners: list[str]) -> list[Job]:
    """Jobs in run order: config by config, its runners (``runners`` unless the config names its own) in
    the order dense-leaf, tree, dense, tree/flex (the slowest to compile), the baselines once and the
    tree runners per capacity; a job already planned is not repeated. A ``--deadline`` therefore cuts
    the last configs first, and inside a config FlexAttention first."""
    jobs: dict[tuple, Job] = {}
    for model, workload, caps, own in configs:
        for runner in sorted(own or runners, key=RUN_ORDER.index):
            for cap in (caps if not runner.startswith("dense") else [None]):
                jobs.setdefault((model, workload, runner, cap), Job(model, workload, runner, cap))
    return list(jobs.values())


class Bench:
    """Runs the jobs; holds one model on the device at a time, and the workloads and packs built so far."""

    def __init__(self, args: argparse.Namespace, device: torch.device, autocast_dtype: torch.dtype | None,
                 log: Callable[[str], None]) -> None:
        self.args, self.device, self.autocast_dtype, self.log = args, device, autocast_dtype, log
        self.dense_tokens = parse_size(args.dense_tokens, what="--dense-tokens")
        self.workloads: dict[tuple[str, bool], WorkloadInfo] = {}
        self.works: dict[tuple, Work] = {}
        self.trainer: Trainer | None = None
        self.trainer_key: tuple | None = None
        self.oom_tokens: dict[str, int] = {}  # model -> smallest forward that ran out of memory
        self.results: list[Result] = []
        self.checks: list[str] = []
        self.checks_ok = True

    def workload(self, name: str, model: str) -> WorkloadInfo:
        """The workload's rollouts (ids renumbered for the tiny model) and its tree numbers."""
        key = (name, model == "tiny")
        if key not in self.workloads:
            r = load_workload(name, self.args)
            self.workloads[key] = WorkloadInfo.of(compact_ids(r)[0] if model == "tiny" else r)
        return self.workloads[key]

    def vocab(self, name: str, model: str) -> int:
        return int(self.workload(name, model).rollouts.tokens.max()) + 1 if model == "tiny" else QWEN3_VOCAB

    def work(self, job: Job) -> Work:
        kind = job.runner if job.runner.startswith("dense") else "tree"  # tree/* and auto: the same packs
        key = (job.workload, job.model == "tiny", kind, job.capacity)
        if key not in self.works:
            info = self.workload(job.workload, job.model)
            r = info.rollouts
            if job.runner == "dense":
                self.works[key] = Work.flat(dense_batches(r, np.arange(len(r)), self.dense_tokens))
            elif job.runner == "dense-leaf":
                self.works[key] = Work.flat(dense_batches(r, info.leaf_S, self.dense_tokens))
            else:
                self.works[key] = Work.tree([relayout(p, self.args.child_order) for p in pack_rollouts(r, job.capacity)])
        return self.works[key]

    def trainer_for(self, job: Job) -> Trainer:
        key = (job.model, self.vocab(job.workload, job.model))
        if self.trainer_key != key:
            self.trainer = self.trainer_key = None
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            t0 = time.perf_counter()
            model = Decoder.random_init(model_args(job.model, key[1]), seed=self.args.seed, device=self.device,
                                            draw_on_device=True)
            model.compile = self.args.compile
            self.trainer, self.trainer_key = Trainer(model, self.autocast_dtype, self.args.adamw), key
            self.log(f"{job.model}: initialised on {self.device} in {time.perf_counter() - t0:.1f} s")
        return self.trainer

    def run(self, job: Job, started: float) -> Result:
        res = Result(job.model, job.workload, job.runner, job.capacity)
        self.results.append(res)
        label = f"{job.model} {job.workload} {job.runner}"
        label += f" @ {cap_label(job.capacity)}" if job.capacity else ""
        if self.args.deadline is not None and time.perf_counter() - started > self.args.deadline:
            res.note = "skipped (deadline)"
            self.log(f"{label}: {res.note}")
            return res
        try:
            info = self.workload(job.workload, job.model)
            if job.runner == "dense-leaf" and len(info.leaf_S) == len(info.rollouts):
                res.note = "= dense (every sequence is a leaf)"
                self.log(f"{label}: {res.note}")
                return res
            work = self.work(job)
            trainer = self.trainer_for(job)
        except Exception as exc:  # noqa: BLE001 - a workload or model that cannot be built: report, go on
            res.note = f"error: {type(exc).__name__}: {exc}"[:200]
            self.log(f"{label}: {res.note}")
            return res
        res.packs, res.tokens = len(work.packs), work.tokens
        res.predicted, res.pairs = work.predicted, work.pairs
        res.flops = model_shape(job.model, trainer.model.args).flops(work.tokens, work.predicted, work.pairs)
        if not work.dense and not any(c.startswith(job.model + ":") for c in self.checks):
            line, passed = path_check_line(path_check(trainer, work.packs[0]), self.device)
            self.checks.append(f"{job.model}: {line}: {'OK' if passed else 'FAILED'}")
            self.checks_ok &= passed
            self.log(self.checks[-1])
        if job.runner == "auto":  # per pack tree or dense-leaf (micro-batches as the dense runners')
            mode = make_mode("auto", logits_chunk=trainer.logits_chunk, micro_batch_tokens=self.dense_tokens)
            res.flops, res.note = auto_work(mode, trainer, work, job.model)
            self.log(f"{label}: {res.note}")
        else:
            # dense: each micro-batch of dense_batches is one pack; its lanes in one call of <= --dense-tokens
            # flat tokens (the mode's default bound, the pack's trie tokens, would cut shared leaves into
            # several calls)
            mode = make_mode("dense" if work.dense else "tree", logits_chunk=trainer.logits_chunk,
                             **({} if work.dense else {"attention": job.runner.split("/")[1]}),
                             micro_batch_tokens=self.dense_tokens if work.dense else "")
        ckpt = work.largest >= self.oom_tokens.get(job.model, 1 << 62)
        self.log(f"{label}: {res.packs} packs, {res.tokens:,} tokens, {res.flops / 1e12:.0f} TFLOP"
                 + (" (activation checkpointing)" if ckpt else ""))
        while True:
            trainer.model.activation_checkpointing = ckpt
            oom = False
            try:
                res.warmup_seconds, res.times, res.peak_gib, res.loss = measure(
                    trainer, work, mode, self.args.repeats, self.args.max_step_seconds, self.log)
                res.seconds, res.checkpointing = statistics.median(res.times), ckpt
            except torch.cuda.OutOfMemoryError:
                oom = True  # released below, outside the handler (its traceback holds the graph)
            except Exception as exc:  # noqa: BLE001 - e.g. a backend that fails here: report, go on
                res.note = f"error: {type(exc).__name__}: {exc}"[:200]
                self.log(f"{label}: {res.note}")
            finally:
                trainer.model.activation_checkpointing = False
            if not oom:
                break
            trainer.release()
            if ckpt:
                res.note = "out of memory (also with activation checkpointing)"
                self.log(f"{label}: {res.note}")
                break
            self.oom_tokens[job.model] = min(self.oom_tokens.get(job.model, 1 << 62), work.largest)
            ckpt = True
            self.log(f"{label}: out of memory; again with activation checkpointing")
        if res.ok and self.args.profile and self.device.type == "cuda" and job.runner.startswith("tree/") \
                and not any(r.profile for r in self.results if r.model == job.model):
            trainer.model.activation_checkpointing = res.checkpointing
            try:
                res.profile, res.profile_top = profile_step(trainer, work.packs[0], mode)
            except Exception as exc:  # noqa: BLE001 - the profile is extra: report, go on
                self.log(f"{label}: profile failed: {type(exc).__name__}: {exc}")
            finally:
                trainer.model.activation_checkpointing = False
        if res.ok:
            rate = res.flops / res.seconds
            self.log(f"{label}: {res.seconds:.3f} s/step (warm-up {res.warmup_seconds:.1f} s), "
                     f"{rate / 1e12:.0f} TFLOP/s, peak {res.peak_gib:.1f} GiB")
        return res

    def report(self, header: list[str], ceiling: float) -> tuple[str, str]:
        """(the markdown report, the short summary)."""
        text = header + [f"- GPU path check: {c}" for c in self.checks] + [""]
        for model, wl in dict.fromkeys((r.model, r.workload) for r in self.results):
            info = self.workload(wl, model)
            m = model_args(model, self.vocab(wl, model))
            shape = (f"{m.num_layers} layers, d {m.hidden_size}, {m.num_heads}/{m.num_kv_heads} heads of "
                     f"{m.head_dim}, FFN {m.intermediate_size}, vocab {m.vocab_size:,} (tied); non-embedding "
                     f"parameters {model_shape(model, m).non_embedding_params / 1e6:,.1f}M.")
            text += [f"## {model} on {wl}: {info.describe()}", "", shape, "",
                     section_table([r for r in self.results if (r.model, r.workload) == (model, wl)],
                                   int(info.rollouts.offsets[-1]), ceiling)]
            text += [profile_table(r) for r in self.results
                     if (r.model, r.workload) == (model, wl) and r.profile]
        table, verdicts = summary(self.results, ceiling)
        title = "## Targets (design §9): tree >= 90% of the FLOP-model ideal speedup over both baselines, " \
                "MFU >= 45%"
        text += [title, "", table] + [f"- {v}" for v in verdicts]
        return "\n".join(text) + "\n", table + "\n".join(verdicts) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 epilog="Models: " + ", ".join(MODELS) + ". Workloads: " + "; ".join(
                                     f"{k} ({v})" for k, v in WORKLOADS.items()) + ".")
    ap.add_argument("--configs", nargs="+", type=parse_config,
                    default=[parse_config(c) for c in DEFAULT_CONFIGS],
                    metavar="MODEL:WORKLOAD:CAPS[:RUNNERS]",
                    help="e.g. qwen3-0.6b:tau-bench:16K,32K (tree capacities; K = 1024), optionally with "
                         "its own runners: qwen3-1.7b:tau-bench:32K:dense-leaf+tree/triton")
    ap.add_argument("--runners", default="dense,dense-leaf,tree/triton,tree/flex",
                    type=lambda s: [x.strip() for x in s.split(",") if x.strip()],
                    help=f"comma-separated, of: {', '.join(RUNNERS)}")
    ap.add_argument("--dense-tokens", default="32K", help="flat tokens per micro-batch of the dense runners")
    ap.add_argument("--tau-bench", type=Path, default=TAU_BENCH, help="real rollouts (Parquet or JSONL)")
    ap.add_argument("--tau-records", type=int, default=144, help="tau-bench: the first N records")
    ap.add_argument("--toolbench", type=Path, default=ROOT.parent / "shared" / "data" / "rollouts" / "toolbench_dfs.parquet",
                    help="ToolBench rollouts (workload toolbench)")
    ap.add_argument("--synth-trees", type=int, default=1, help="synthetic workloads: trees (tasks)")
    ap.add_argument("--repeats", type=int, default=2, help="timed steps per runner (after one warm-up)")
    ap.add_argument("--max-step-seconds", type=float, default=5.0,
                    help="stop timing a runner after a step longer than this (at least one timed step)")
    ap.add_argument("--deadline", type=float, default=None, help="no job starts after these seconds")
    ap.add_argument("--profile", action="store_true",
                    help="profile one step over the first pack of each model's first tree/triton run: "
                         "GPU time by kernel group")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run (tiny model)")
    ap.add_argument("--compile", default="auto", choices=("auto", "on", "off"),
                    help="torch.compile the elementwise regions (train.compile; auto = on CUDA)")
    ap.add_argument("--child-order", default="lex", choices=CHILD_ORDERS,
                    help="DFS order of the tree runners' pack tokens (treepack train's data.child_order): lex "
                         "(as packed) or largest-first (fewer partial FA4 blocks on ToolBench)")
    ap.add_argument("--adamw", default="auto", choices=("auto", "foreach"),
                    help="auto: make_optimizer's choice (fused on CUDA); foreach: the multi-tensor loop")
    ap.add_argument("--fa4-bwd-order", default="auto", choices=("auto", "fa4", "heads-fast", "heads-4"),
                    help="FA4's Hopper backward grid order: auto (per pack), fa4 (the library's), heads-fast")
    ap.add_argument("--logprob-kernels", default="auto", choices=("auto", "inductor"),
                    help="the language-model head's log-prob passes: auto (Triton kernels on CUDA) or inductor "
                         "(the reference, compiled where the step compiles; A/B)")
    ap.add_argument("--working-weights", default="on", choices=("on", "off"),
                    help="bf16 copies of the matrix weights cast once a step, as treepack train keeps them (on), "
                         "or autocast's cast in every model call (off; A/B)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="markdown report (rewritten after each job)")
    ap.add_argument("--json-out", type=Path, default=None, help="raw results (JSON), rewritten per job")
    args = ap.parse_args(argv)
    command = command_line(__file__, sys.argv[1:] if argv is None else argv)
    for runner in args.runners:
        if runner not in RUNNERS:
            ap.error(f"unknown runner {runner!r} (runners: {', '.join(RUNNERS)})")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("CUDA is not available: use --device cpu (a smoke run)")
    started = time.perf_counter()
    from treepack.kernels.tree_attention import fa4

    fa4.FA4_BWD_ORDER = args.fa4_bwd_order
    from treepack.train import losses

    losses.LOGPROB_KERNELS = args.logprob_kernels
    working_weights.ENABLED = args.working_weights == "on"

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    device, _, autocast_dtype = resolve_precision(args.device, "auto")
    ceiling = matmul_ceiling(device)
    if device.type == "cuda":
        hw = gpu_line(device)
        ceiling_line = ("- bf16 matmul ceiling (8192^3 torch.matmul, random data, median of 20): "
                        f"{ceiling / 1e12:.0f} TFLOP/s")
    else:
        hw = gpu_line(device)
        ceiling_line = f"- float32 matmul ceiling (512^3): {ceiling / 1e9:.1f} GFLOP/s"
    log(f"{hw}; {ceiling_line[2:]}")
    header = [f"# Training step: tree packs vs dense baselines, {today()}", "",
              f"- hardware: {hw}", ceiling_line,
              f"- command: `{command}`",
              (f"- step: GRPO loss (token mean), "
               f"{'bf16 autocast over float32 weights and AdamW state' if autocast_dtype else 'float32'}, "
               f"gradient clipping 1.0, AdamW ({args.adamw}); dense micro-batches <= {parse_size(args.dense_tokens):,} flat "
               f"tokens; {args.repeats} timed steps after one warm-up (fewer when a step takes over "
               f"{args.max_step_seconds:g} s), median"),
              (f"- tree packs: tokens in `{args.child_order}` DFS order (`--child-order`, `data.child_order`); "
               f"FA4 backward grid order {args.fa4_bwd_order}; log-prob kernels {args.logprob_kernels}; "
               f"working weights {args.working_weights}")]
    bench = Bench(args, device, autocast_dtype, log)

    def flush() -> None:
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(bench.report(header, ceiling)[0])
        if args.json_out:
            args.json_out.parent.mkdir(parents=True, exist_ok=True)
            raw = {"hardware": hw, "ceiling_flops": ceiling, "path_checks": bench.checks,
                   "results": [dataclasses.asdict(r) for r in bench.results]}
            args.json_out.write_text(json.dumps(raw, indent=1))

    for job in plan(args.configs, args.runners):
        bench.run(job, started)
        flush()
    full, short = bench.report(header, ceiling)
    print(short if args.out else full, end="")
    log(f"total {time.perf_counter() - started:.0f} s")
    return 0 if bench.checks_ok else 1


if __name__ == "__main__":
    sys.exit(main())
