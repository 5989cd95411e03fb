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
  once per pack and reused by every layer; FlexAttention caches its BlockMask on it).
Before the runs a *path check* forwards one pack through ``make_mode("tree")`` with the default
``attention="auto"`` and counts the calls into the kernels: on CUDA it must be one `prepare` per pack and
one Triton call per layer, no FlexAttention and no reference attention.

FLOP model (DESIGN §9, `treepack.stats.ModelShape.flops`), counted per runner over what it computes:

    F = 6 · P · tokens  +  6 · d · V · predicted  +  12 · L · H · E · pairs

- P = non-embedding parameters (per layer d·E·(2H + 2K) attention + 3·d·F SwiGLU), tokens = tokens
  forwarded (flat tokens of the micro-batches for dense, N_pack = tree tokens of all packs for tree);
  6 = 2 FLOPs per multiply-add x (forward + backward = 3 forwards);
- d·V = the output head (tied to the embedding), predicted = rows whose log-prob the head computes (loss
  rows for dense; distinct predicted pack tokens for tree: a shared token is computed once);
- pairs = visible (query, key) pairs: sum over sequences of L(L+1)/2 for dense, sum over pack tokens of
  ``subtree_end[k] - k`` for tree; 12·E·H per pair and layer = (QK^T and PV, 2·2·E) x 3 for fwd+bwd.

Ideal speedup of tree over a baseline B = F_B / F_tree (the FLOPs it avoids), realised = t_B / t_tree,
and realised / ideal = tree's FLOP rate over B's: DESIGN §9 asks >= 90% over both baselines. MFU = F / t /
(the bf16 matmul rate measured in the same run: an 8192^3 ``torch.matmul`` on random data); the recompute
of activation checkpointing, where a runner needs it to fit, is not counted (model FLOPs, not hardware
FLOPs). Flat-equivalent tokens/s = the workload's N_flat / t for every runner.

Timing: per runner one warm-up step (Triton compiles and autotunes per power-of-two pack size,
FlexAttention compiles, AdamW allocates its state), over every pack for the tree runners and over one
micro-batch per power-of-two size for the dense ones (which have nothing to tune and take seconds per
step), then ``--repeats`` timed steps, stopping after the first one that takes longer than
``--max-step-seconds``; the median is reported. Peak memory = ``torch.cuda.max_memory_allocated`` over
the timed steps (weights, gradients and AdamW state included). A runner that runs out of memory is
retried with activation checkpointing (and so is every later runner of that model with packs as large).
Jobs run in order (configs as given, runners dense-leaf, tree/triton, dense, tree/flex), FlexAttention
after every other runner, and ``--deadline`` skips the jobs that would start after it.

Usage:
    python benchmarks/train_step.py                               # the full comparison (CUDA)
    python benchmarks/train_step.py --configs qwen3-0.6b:tau-bench:16k,32k qwen3-1.7b:tau-bench:32k \\
        --out benchmarks/results/DATE-train-step-h200.md --deadline 300
    python benchmarks/train_step.py --device cpu --configs tiny:tau-bench:4k --tau-records 4 \\
        --runners dense,dense-leaf,tree/reference                # CPU smoke run (numbers meaningless)

Legend: T pack tokens, F flat tokens, S sequences.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
TAU_BENCH = ROOT / "datasets" / "samples" / "tau_bench_slice.parquet"


def _import_treepack() -> None:
    try:
        import treepack  # noqa: F401
    except ImportError:  # a checkout that is not installed: the repository root maps onto treepack.*
        sys.path.insert(0, str(ROOT))
        import treepack  # noqa: F401


_import_treepack()

import torch  # noqa: E402

from treepack.layout import Pack, build_pack  # noqa: E402
from treepack.rollouts import Rollouts, read_rollouts  # noqa: E402
from treepack.sizes import parse_size  # noqa: E402
from treepack.stats import MODEL_SHAPES, ModelShape  # noqa: E402
from treepack.train import losses  # noqa: E402
from treepack.train.config import RunConfig  # noqa: E402
from treepack.train.data import pack_rollouts  # noqa: E402
from treepack.train.loop import make_optimizer, resolve_precision  # noqa: E402
from treepack.train.losses import BatchTotals, LossRows, Objective  # noqa: E402
from treepack.train.model import Decoder, ModelArgs  # noqa: E402
from treepack.train.modes import make_mode  # noqa: E402
from treepack.tree import PrefixTree  # noqa: E402

QWEN3_VOCAB = 151936  # rows of Qwen3's embedding (151,669 used ids, padded)
MODELS = {  # Qwen3 shapes from the Hugging Face config.json files (tied embeddings); tiny = CPU smoke runs
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16, num_kv_heads=8,
                       head_dim=128),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_layers=28, num_heads=16, num_kv_heads=8,
                       head_dim=128),
    "tiny": dict(hidden_size=64, intermediate_size=176, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16),
}
WORKLOADS = {
    "tau-bench": "real: the first --tau-records records of datasets/samples/tau_bench_slice.parquet "
                 "(tau-bench retail, agent and user grok-3, Qwen3 tokens)",
    "tau2-think": "synthetic: treepack synth tau2 --think -n N (seed 0)",
    "agentic-think": "synthetic: treepack synth agentic-think -n N --max-len 16384 (seed 0)",
}
RUNNERS = ("dense", "dense-leaf", "tree/triton", "tree/flex", "tree/reference", "tree/auto")
RUN_ORDER = ("dense-leaf", "tree/triton", "tree/auto", "tree/reference", "dense", "tree/flex")
DEFAULT_CONFIGS = ("qwen3-0.6b:tau-bench:16k,32k", "qwen3-0.6b:tau2-think:16k,32k", "qwen3-1.7b:tau-bench:32k",
                   "qwen3-1.7b:tau2-think:32k")


# --------------------------------------------------------------------------------------------------
# Workloads and what each runner computes


def _one_forest(r: Rollouts, seed: int) -> Rollouts:
    """No tree_id scoping (the batch is one forest); GRPO advantages from the data, else from the rewards
    standardised over the batch, else N(0, 1)."""
    r = dataclasses.replace(r, groups=None, group_names=None)
    if r.advantages is None or np.isnan(r.advantages).any():
        if r.rewards is not None and not np.isnan(r.rewards).any():
            reward_S = np.asarray(r.rewards, dtype=np.float64)
            r.advantages = (reward_S - reward_S.mean()) / (reward_S.std() + 1e-6)
        else:
            r.advantages = np.random.default_rng(seed).standard_normal(len(r))
    return r


def load_workload(name: str, args: argparse.Namespace) -> Rollouts:
    if name == "tau-bench":
        r = read_rollouts([str(args.tau_bench)])
        return _one_forest(r.select(np.arange(min(args.tau_records, len(r)))), args.seed)
    from treepack.datasets import synth
    import pyarrow.parquet as pq

    kind, overrides = {"tau2-think": ("tau2", {"think": True}),
                       "agentic-think": ("agentic-think", {"max_len": 16384})}[name]
    table = synth.generate(kind, args.synth_trees, seed=args.seed, **overrides)
    with tempfile.TemporaryDirectory() as d:  # through Parquet: the reader is the one `treepack train` uses
        path = os.path.join(d, f"{name}.parquet")
        pq.write_table(table, path)
        return _one_forest(read_rollouts([path]), args.seed)


def compact_ids(r: Rollouts) -> tuple[Rollouts, int]:
    """Token ids renumbered 0..n-1 over the ids present (the tiny CPU model: a 151k-wide softmax per row
    would dominate its step). Returns the rollouts and the vocabulary size."""
    ids, inverse = np.unique(r.tokens, return_inverse=True)
    return dataclasses.replace(r, tokens=inverse.astype(np.int32)), int(ids.shape[0])


def leaf_sequences(r: Rollouts) -> np.ndarray:
    """Input indices of one sequence per leaf of the trie (duplicates and prefixes of another dropped)."""
    tree = PrefixTree.from_arrays(r.tokens, r.offsets)
    return np.sort(tree.order[tree.is_leaf_seq])


def micro_batches(r: Rollouts, index: np.ndarray, budget: int) -> list[Pack]:
    """Whole sequences in input order, each micro-batch at most ``budget`` flat tokens (a longer one alone)."""
    packs, current, size = [], [], 0
    for i in index.tolist():
        n = int(r.lengths[i])
        if current and size + n > budget:
            packs.append(build_pack(r, np.asarray(current)))
            current, size = [], 0
        current.append(i)
        size += n
    if current:
        packs.append(build_pack(r, np.asarray(current)))
    return packs


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
    def dense(cls, packs: list[Pack]) -> Work:
        lengths_S = np.concatenate([np.diff(np.asarray(p.seq_offsets, dtype=np.int64)) for p in packs])
        return cls(packs, tokens=int(lengths_S.sum()), predicted=sum(LossRows.from_pack(p).n_rows for p in packs),
                   pairs=int((lengths_S * (lengths_S + 1) // 2).sum()), sequences=int(lengths_S.shape[0]), dense=True)

    @classmethod
    def tree(cls, packs: list[Pack]) -> Work:
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


def _t_bucket(T: int) -> int:
    """The Triton kernels' autotuning key of a pack size (next power of two)."""
    return 1 << max(T - 1, 1).bit_length()


def warmup_packs(packs: list[Pack], runner: str) -> list[Pack]:
    """Tree runners warm up on every pack; dense ones on the largest micro-batch of each size bucket."""
    if not runner.startswith("dense"):
        return packs
    largest: dict[int, Pack] = {}
    for p in packs:
        n = int(p.seq_offsets[-1])
        b = _t_bucket(n)
        if b not in largest or n > int(largest[b].seq_offsets[-1]):
            largest[b] = p
    return list(largest.values())


# --------------------------------------------------------------------------------------------------
# Model, step, measurement


def model_args(name: str, vocab: int) -> ModelArgs:
    return ModelArgs.for_family("qwen3", vocab_size=vocab, tie_embeddings=True, **MODELS[name])


def model_shape(name: str, args: ModelArgs) -> ModelShape:
    shape = ModelShape(name, args.num_layers, args.hidden_size, args.num_heads, args.num_kv_heads, args.head_dim,
                       args.intermediate_size, args.vocab_size)
    if name in MODEL_SHAPES and MODEL_SHAPES[name] != shape:
        raise AssertionError(f"{name}: benchmark shape {shape} differs from treepack.stats' {MODEL_SHAPES[name]}")
    return shape


def init_model(args: ModelArgs, device: torch.device, seed: int) -> Decoder:
    """Random float32 weights drawn on the device (`Decoder.random_init` draws 2B float64 values on the
    CPU for the 1.7B model: half a minute; the values do not matter for timing)."""
    with torch.device("meta"):
        model = Decoder(args)
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, args.init_std, generator=gen)
    return model


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Trainer:
    """The inner loop of `treepack.train.loop.train` for one global batch = all packs of a runner."""

    def __init__(self, model: Decoder, autocast_dtype: torch.dtype | None) -> None:
        cfg = RunConfig()
        self.model = model
        self.device = model.device
        self.optimizer = make_optimizer(model, cfg)
        self.grad_clip = cfg.train.grad_clip
        self.logits_chunk = cfg.train.logits_chunk
        self.objective = Objective(kind="grpo")
        self.params = list(model.parameters())
        self.autocast = ((lambda: torch.autocast(self.device.type, dtype=autocast_dtype)) if autocast_dtype
                         else contextlib.nullcontext)

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
        _sync(self.device)
        return loss

    def release(self) -> None:
        """Drop gradients and cached blocks after an out-of-memory error."""
        self.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


@dataclass
class Result:
    model: str
    workload: str
    runner: str
    capacity: int | None  # tree pack capacity (None for the dense runners)
    packs: int = 0
    tokens: int = 0
    predicted: int = 0
    pairs: int = 0
    flops: float = 0.0
    seconds: float | None = None  # median of the timed steps
    times: list[float] = field(default_factory=list)
    warmup_seconds: float = 0.0
    peak_gib: float = 0.0
    checkpointing: bool = False
    loss: float = 0.0
    note: str = ""  # why it did not run, or what it reuses

    @property
    def ok(self) -> bool:
        return self.seconds is not None


def measure(trainer: Trainer, work: Work, mode, runner: str, repeats: int, max_step_seconds: float,
            log: Callable[[str], None]) -> tuple[float, list[float], float, float]:
    """(warm-up seconds, timed step seconds, peak GiB, last loss) of one runner."""
    dev = trainer.device
    t0 = time.perf_counter()
    trainer.step(warmup_packs(work.packs, runner), mode)
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
    """Forward one pack through ``make_mode("tree")`` (attention "auto") and count kernel calls."""
    import treepack.kernels as kernels
    from treepack.kernels.tree_attention import api

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

    def logprob_apply(hidden, weight, target, chunk):
        chunks.append((int(hidden.shape[0]), int(chunk)))
        return apply(hidden, weight, target, chunk)

    patches = [mock.patch.object(kernels, "prepare", counted("prepare", kernels.prepare)),
               mock.patch.object(api, "tree_attention_reference", counted("reference", api.tree_attention_reference)),
               mock.patch.object(losses._TargetLogProb, "apply", staticmethod(logprob_apply))]
    for key, module in (("triton", "triton"), ("flex", "flex")):
        try:
            mod = __import__(f"treepack.kernels.tree_attention.{module}", fromlist=["x"])
        except ImportError:  # no triton on this machine
            continue
        fn_name = f"tree_attention_{module}"
        patches.append(mock.patch.object(mod, fn_name, counted(key, getattr(mod, fn_name))))
    row = LossRows.from_pack(pack)
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        with torch.no_grad(), trainer.autocast():
            make_mode("tree")(trainer.model, pack, row, trainer.objective, BatchTotals.of([row]))
    _sync(trainer.device)
    return {"tokens": int(pack.n_tokens), "layers": trainer.model.args.num_layers, "calls": dict(counts),
            "qkv_dtype": sorted(dtypes), "logprob_rows": [r for r, _ in chunks], "chunk_rows": sorted({c for _, c in chunks})}


def path_check_line(check: dict, device: torch.device) -> tuple[str, bool]:
    c = check["calls"]
    rows = sum(check["logprob_rows"])
    chunk = max(check["chunk_rows"], default=0)
    line = (f"tree mode with the defaults (attention 'auto') on one pack of {check['tokens']:,} tokens, "
            f"{check['layers']} layers: prepare x{c.get('prepare', 0)}, triton x{c.get('triton', 0)}, flex "
            f"x{c.get('flex', 0)}, reference x{c.get('reference', 0)}; q/k/v {', '.join(check['qkv_dtype'])}; "
            f"log-probs of {rows:,} rows in chunks of <= {chunk:,} rows")
    ok = (device.type != "cuda" or (c.get("prepare", 0) == 1 and c.get("triton", 0) == check["layers"]
                                     and not c.get("flex") and not c.get("reference")
                                     and check["qkv_dtype"] == ["bfloat16"])) and 0 < chunk <= 4096
    return line, ok


# --------------------------------------------------------------------------------------------------
# Report


def _gib(x: float) -> str:
    return f"{x:.1f}" if x else "-"


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def section_table(results: list[Result], n_flat: int, ceiling: float) -> str:
    base = {r.runner: r for r in results if r.runner in ("dense", "dense-leaf") and r.ok}
    head = ("| runner | capacity | packs | tokens | pairs | TFLOP | s/step | flat tok/s | TFLOP/s | MFU | peak GiB "
            "| vs dense: ideal / realised (%) | vs dense-leaf: ideal / realised (%) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        cap = f"{r.capacity // 1024}k" if r.capacity else "-"
        if not r.ok:
            lines.append(f"| {r.runner} | {cap} | {r.packs or '-'} | {r.tokens:,} | {r.pairs:.3g} | {r.flops / 1e12:.0f} "
                         f"| {r.note} | | | | | | |")
            continue
        rate = r.flops / r.seconds
        cells = []
        for b in ("dense", "dense-leaf"):
            ref = base.get(b)
            if ref is None or r.runner.startswith("dense"):
                cells.append("-")
                continue
            ideal, real = ref.flops / r.flops, ref.seconds / r.seconds
            cells.append(f"{ideal:.2f}x / {real:.2f}x ({_pct(real / ideal)})")
        steps = f"{r.seconds:.3f}" + (f" ({len(r.times)})" if len(r.times) != 1 else " (1)")
        ckpt = " +ckpt" if r.checkpointing else ""
        lines.append(f"| {r.runner}{ckpt} | {cap} | {r.packs} | {r.tokens:,} | {r.pairs:.3g} | {r.flops / 1e12:.0f} "
                     f"| {steps} | {n_flat / r.seconds / 1e3:,.1f}k | {rate / 1e12:.0f} | {_pct(rate / ceiling)} "
                     f"| {_gib(r.peak_gib)} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines) + "\n"


def summary(results: list[Result], ceiling: float) -> tuple[str, list[str]]:
    """Short table of the tree runners (targets) and the verdict lines."""
    lines = ["| model | workload | cap | runner | s/step | MFU | vs dense (realised/ideal) | vs dense-leaf "
             "(realised/ideal) | peak GiB |", "|---|---|---|---|---|---|---|---|---|"]
    verdicts = []
    for r in results:
        if not r.runner.startswith("tree") or not r.ok:
            continue
        effs = []
        for b in ("dense", "dense-leaf"):
            ref = next((x for x in results if x.model == r.model and x.workload == r.workload and x.runner == b
                        and x.ok), None)
            effs.append(None if ref is None else (ref.seconds / r.seconds) / (ref.flops / r.flops))
        mfu = r.flops / r.seconds / ceiling
        cap = f"{r.capacity // 1024}k"
        cells = ["-" if e is None else _pct(e) for e in effs]
        lines.append(f"| {r.model} | {r.workload} | {cap} | {r.runner}{' +ckpt' if r.checkpointing else ''} "
                     f"| {r.seconds:.3f} | {_pct(mfu)} | {cells[0]} | {cells[1]} | {_gib(r.peak_gib)} |")
        met = [e is not None and e >= 0.9 for e in effs]
        verdicts.append(f"{r.model} {r.workload} {cap} {r.runner}: >= 90% of the ideal speedup over dense "
                        f"{'met' if met[0] else 'NOT met' if effs[0] is not None else 'not measured'}, over "
                        f"dense-leaf {'met' if met[1] else 'NOT met' if effs[1] is not None else 'not measured'}; "
                        f"MFU >= 45% {'met' if mfu >= 0.45 else 'NOT met'} ({_pct(mfu)})")
    return "\n".join(lines) + "\n", verdicts


# --------------------------------------------------------------------------------------------------
# Main


@dataclass
class Job:
    model: str
    workload: str
    runner: str
    capacity: int | None


def parse_config(text: str) -> tuple[str, str, list[int]]:
    try:
        model, workload, caps = text.split(":")
    except ValueError:
        raise argparse.ArgumentTypeError(f"config {text!r} must be MODEL:WORKLOAD:CAP[,CAP...]") from None
    if model not in MODELS:
        raise argparse.ArgumentTypeError(f"unknown model {model!r} (models: {', '.join(MODELS)})")
    if workload not in WORKLOADS:
        raise argparse.ArgumentTypeError(f"unknown workload {workload!r} (workloads: {', '.join(WORKLOADS)})")
    return model, workload, [parse_size(c, what="capacity") for c in caps.split(",")]


def plan(configs: list[tuple[str, str, list[int]]], runners: list[str]) -> list[Job]:
    """Jobs in run order: per config its baselines once and the tree runners per capacity; FlexAttention
    (the slowest to compile, and the baseline that matters least here) after everything else."""
    jobs = []
    for model, workload, caps in configs:
        for runner in sorted(runners, key=RUN_ORDER.index):
            if runner == "tree/flex":
                continue
            for cap in (caps if runner.startswith("tree") else [None]):
                jobs.append(Job(model, workload, runner, cap))
    if "tree/flex" in runners:
        jobs += [Job(m, w, "tree/flex", cap) for m, w, caps in configs for cap in caps]
    return jobs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 epilog="Model shapes: " + ", ".join(MODELS) + ". Workloads: " + "; ".join(
                                     f"{k} ({v})" for k, v in WORKLOADS.items()))
    ap.add_argument("--configs", nargs="+", type=parse_config, default=[parse_config(c) for c in DEFAULT_CONFIGS],
                    metavar="MODEL:WORKLOAD:CAPS", help="e.g. qwen3-0.6b:tau-bench:16k,32k (tree capacities)")
    ap.add_argument("--runners", default="dense,dense-leaf,tree/triton,tree/flex",
                    type=lambda s: [x.strip() for x in s.split(",") if x.strip()])
    ap.add_argument("--dense-tokens", default="32k", help="flat tokens per micro-batch of the dense runners")
    ap.add_argument("--tau-bench", type=Path, default=TAU_BENCH, help="real rollouts (Parquet or JSONL)")
    ap.add_argument("--tau-records", type=int, default=144, help="tau-bench: the first N records")
    ap.add_argument("--synth-trees", type=int, default=1, help="synthetic workloads: trees (tasks) to generate")
    ap.add_argument("--repeats", type=int, default=2, help="timed steps per runner (after one warm-up)")
    ap.add_argument("--max-step-seconds", type=float, default=5.0,
                    help="stop timing a runner after a step longer than this (at least one timed step)")
    ap.add_argument("--deadline", type=float, default=None, help="seconds from start after which no job starts")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run (tiny model)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="write the markdown report here (rewritten after each job)")
    ap.add_argument("--json-out", type=Path, default=None, help="write the raw results (JSON) here")
    args = ap.parse_args(argv)
    for runner in args.runners:
        if runner not in RUNNERS:
            ap.error(f"unknown runner {runner!r} (runners: {', '.join(RUNNERS)})")
    dense_tokens = parse_size(args.dense_tokens, what="--dense-tokens")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("CUDA is not available: use --device cpu (smoke run)")
    start = time.perf_counter()

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    device, _, autocast_dtype = resolve_precision(args.device, "auto")
    ceiling = matmul_ceiling(device)
    if device.type == "cuda":
        import triton

        hw = (f"{torch.cuda.get_device_name(device)}; torch {torch.__version__}, triton {triton.__version__}, "
              f"Python {platform.python_version()}")
    else:
        hw = f"CPU smoke run ({platform.processor() or platform.machine()}); torch {torch.__version__}"
    log(f"{hw}; matmul ceiling {ceiling / 1e12:.0f} TFLOP/s")
    jobs = plan(args.configs, args.runners)

    workloads: dict[str, tuple[Rollouts, int]] = {}
    works: dict[tuple, Work] = {}
    results: list[Result] = []
    checks: list[str] = []
    oom_tokens: dict[str, int] = {}  # model -> smallest pack size that ran out of memory
    current: dict = {}  # the model on the device: {"name", "vocab", "trainer"}

    def workload(name: str) -> tuple[Rollouts, int]:
        if name not in workloads:
            r = load_workload(name, args)
            workloads[name] = (r, QWEN3_VOCAB)
        return workloads[name]

    def work_of(model: str, wl: str, runner: str, cap: int | None) -> Work:
        key = (model == "tiny", wl, "dense" if runner == "dense" else runner.split("/")[0], cap)
        if key not in works:
            r, _ = workload(wl)
            if model == "tiny":
                r, _ = compact_ids(r)
            if runner == "dense":
                works[key] = Work.dense(micro_batches(r, np.arange(len(r)), dense_tokens))
            elif runner == "dense-leaf":
                works[key] = Work.dense(micro_batches(r, leaf_sequences(r), dense_tokens))
            else:
                works[key] = Work.tree(list(pack_rollouts(r, cap)))
        return works[key]

    def trainer_for(model: str, wl: str) -> Trainer:
        vocab = compact_ids(workload(wl)[0])[1] if model == "tiny" else QWEN3_VOCAB
        if current.get("name") != model or current.get("vocab") != vocab:
            current.clear()
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            t0 = time.perf_counter()
            current.update(name=model, vocab=vocab,
                           trainer=Trainer(init_model(model_args(model, vocab), device, args.seed), autocast_dtype))
            log(f"{model}: initialised on {device} in {time.perf_counter() - t0:.1f} s")
        return current["trainer"]

    def report() -> tuple[str, str]:
        text = [f"# Training step: tree packs vs dense baselines — {dt.date.today().isoformat()}", "",
                f"- hardware: {hw}",
                f"- bf16 matmul ceiling (8192^3 torch.matmul, random data, median of 20): {ceiling / 1e12:.0f} TFLOP/s"
                if device.type == "cuda" else f"- matmul ceiling (float32, 512^3): {ceiling / 1e9:.1f} GFLOP/s",
                f"- command: `python benchmarks/train_step.py {' '.join(sys.argv[1:] if argv is None else argv)}`",
                f"- step: GRPO loss (token mean), {'bf16 autocast, float32 weights and AdamW state' if autocast_dtype else 'float32'}, "
                f"gradient clipping 1.0, AdamW; dense micro-batches <= {dense_tokens:,} flat tokens; "
                f"{args.repeats} timed steps after one warm-up (fewer when a step exceeds {args.max_step_seconds:g} s)",
                ""]
        text += [f"GPU path check: {c}" for c in checks] + ([""] if checks else [])
        for (model, wl) in dict.fromkeys((r.model, r.workload) for r in results):
            rs = [r for r in results if r.model == model and r.workload == wl]
            r0, _ = workload(wl)
            n_flat = int(r0.offsets[-1])
            leaf = leaf_sequences(r0)
            whole_tree = PrefixTree.from_arrays(r0.tokens, r0.offsets).n_tree_tokens
            args_m = model_args(model, QWEN3_VOCAB if model != "tiny" else current.get("vocab", 0) or 1)
            text += [f"## {model} on {wl}: {len(r0)} sequences, N_flat {n_flat:,}, N_tree {whole_tree:,} "
                     f"(C {n_flat / whole_tree:.2f}), {len(leaf)} leaf sequences of {int(r0.lengths[leaf].sum()):,} "
                     f"tokens, longest {int(r0.lengths.max()):,}", "",
                     f"{args_m.num_layers} layers, d {args_m.hidden_size}, {args_m.num_heads}/{args_m.num_kv_heads} "
                     f"heads of {args_m.head_dim}, FFN {args_m.intermediate_size}, vocab {args_m.vocab_size:,}, tied; "
                     f"non-embedding parameters {model_shape(model, args_m).non_embedding_params / 1e6:,.0f}M.", "",
                     section_table(rs, n_flat, ceiling)]
        table, verdicts = summary(results, ceiling)
        text += ["## Targets (DESIGN §9): tree >= 90% of the FLOP-model ideal speedup over both baselines; MFU >= 45%",
                 "", table] + [f"- {v}" for v in verdicts]
        return "\n".join(text) + "\n", table + "\n".join(verdicts)

    def flush() -> None:
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(report()[0])
        if args.json_out:
            args.json_out.parent.mkdir(parents=True, exist_ok=True)
            args.json_out.write_text(json.dumps({"hardware": hw, "ceiling_flops": ceiling, "path_checks": checks,
                                                 "results": [dataclasses.asdict(r) for r in results]}, indent=1))

    checked: set[str] = set()
    ok = True
    for job in jobs:
        model, wl, runner, cap = job.model, job.workload, job.runner, job.capacity
        label = f"{model} {wl} {runner}" + (f" @ {cap:,}" if cap else "")
        res = Result(model, wl, runner, cap)
        results.append(res)
        if args.deadline is not None and time.perf_counter() - start > args.deadline:
            res.note = "skipped (deadline)"
            log(f"{label}: skipped (deadline)")
            continue
        try:
            r, _ = workload(wl)
            if runner == "dense-leaf" and len(leaf_sequences(r)) == len(r):
                res.note = "= dense (every sequence is a leaf)"
                log(f"{label}: every sequence is a leaf, dense-leaf = dense")
                continue
            work = work_of(model, wl, runner, cap)
            trainer = trainer_for(model, wl)
        except Exception as exc:  # a workload or model that cannot be built: report, go on
            res.note = f"error: {type(exc).__name__}: {exc}"[:200]
            log(f"{label}: {res.note}")
            flush()
            continue
        shape = model_shape(model, trainer.model.args)
        res.packs, res.tokens, res.predicted, res.pairs = len(work.packs), work.tokens, work.predicted, work.pairs
        res.flops = shape.flops(work.tokens, work.predicted, work.pairs)
        if model not in checked and runner.startswith("tree"):
            checked.add(model)
            line, passed = path_check_line(path_check(trainer, work.packs[0]), device)
            checks.append(f"{model}: {line}: {'OK' if passed else 'FAILED'}")
            ok &= passed
            log(checks[-1])
        mode = make_mode("dense") if runner.startswith("dense") else make_mode("tree", attention=runner.split("/")[1])
        biggest = max(int(p.seq_offsets[-1]) if runner.startswith("dense") else p.n_tokens for p in work.packs)
        ckpt = biggest >= oom_tokens.get(model, 1 << 62)
        log(f"{label}: {res.packs} packs, {res.tokens:,} tokens, {res.flops / 1e12:.0f} TFLOP"
            + (" (activation checkpointing)" if ckpt else ""))
        while True:
            trainer.model.activation_checkpointing = ckpt
            oom = False
            try:
                res.warmup_seconds, res.times, res.peak_gib, res.loss = measure(
                    trainer, work, mode, runner, args.repeats, args.max_step_seconds, log)
                res.seconds = statistics.median(res.times)
                res.checkpointing = ckpt
            except torch.cuda.OutOfMemoryError:
                oom = True
            except Exception as exc:  # e.g. a backend that does not compile here: report, go on
                res.note = f"error: {type(exc).__name__}: {exc}"[:200]
                log(f"{label}: {res.note}")
            finally:
                trainer.model.activation_checkpointing = False
            if not oom:
                break
            trainer.release()
            if ckpt:
                res.note = "out of memory (also with activation checkpointing)"
                log(f"{label}: {res.note}")
                break
            oom_tokens[model] = min(oom_tokens.get(model, 1 << 62), biggest)
            ckpt = True
            log(f"{label}: out of memory; again with activation checkpointing")
        if res.ok:
            log(f"{label}: {res.seconds:.3f} s/step (warm-up {res.warmup_seconds:.1f} s), "
                f"{res.flops / res.seconds / 1e12:.0f} TFLOP/s, MFU {_pct(res.flops / res.seconds / ceiling)}, "
                f"peak {res.peak_gib:.1f} GiB")
        flush()
    full, short = report()
    print(full if not args.out else short)
    log(f"total {time.perf_counter() - start:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
