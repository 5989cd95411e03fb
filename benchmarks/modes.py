"""Training modes side by side in ONE process: tree, dense-leaf and auto on the same packs, per workload, with the
per-pair attention table of each workload's first pack.

Why one process: the GPU's clocks, the allocator and the compilers' caches are then the same for every mode, so
"tree is faster than dense-leaf" or "auto is within 2% of the faster" is not a comparison between two machines.

Per workload (a rollout file, or treepack synth's KIND:TREES) and per mode, one `treepack.train.loop.train` run
(the function ``treepack train`` calls) on a config written here: Qwen3 shape, random init, full vocabulary, GRPO
loss (SFT on a file without a reward for every record), ``--capacity`` packs, ``--packs-per-step`` a step; every mode trains on the same packs in the same order
(dense-leaf forwards each pack's leaf sequences back to back through one varlen call per layer: the field's
padding-free baseline). Between runs the compiled graphs are dropped (`torch._dynamo.reset`), so every run
compiles its own step 1 as a fresh ``treepack train`` does; the disk caches of Triton and Inductor are kept.
Reported per run from its ``metrics.jsonl``: the median over steps after ``--warmup`` of seconds a step, tokens/s,
flat tokens/s and MFU (model FLOPs over the bf16 matmul rate measured at start), and every step that compiled.
Per workload: dense-leaf's step time over tree's (>1: tree faster), and auto's over the faster of the two.

``--kernels`` adds, per workload, the first pack's attention alone (fwd+bwd, Hq 16 / Hkv 8 / D 128, bf16):
treepack's FA4 tree kernel against FA4's varlen kernel over the pack's leaf sequences (`attention_backends.run_pack`),
in TFLOP/s per visible pair and in time. ``--profile WORKLOAD:MODE`` records one steady step of that run under
torch.profiler: GPU kernel time by kind and the GPU's busy share of the step's wall time.

Usage (GPU, FA4 installed as benchmarks/README.md says):
    python benchmarks/modes.py --data tau-bench=tau_bench_grok3_retail.parquet --data gsm8k=gsm8k.parquet \\
        --synth tau2=tau2:256 --kernels --out benchmarks/results/DATE-modes-h200.md
    python benchmarks/modes.py --device cpu --layers 1 --compact-vocab --steps 2 --warmup 1 --capacity 8K \
        --synth math=grpo-math:8 --packs-per-step 1   # CPU smoke run
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import command_line, gpu_line, today, write_report

SAMPLE = ROOT / "treepack" / "datasets" / "samples" / "tau_bench_slice.parquet"
MODES = ("tree", "dense-leaf", "auto")

CONFIG = """\
[model]
family = "qwen3"
compact_vocab = {compact}
hidden_size = {d}
intermediate_size = {ff}
num_layers = {layers}
num_heads = {heads}
num_kv_heads = {kv}
head_dim = {hd}
tie_embeddings = {tie}
init_on_device = true

[data]
rollouts = [{data}]
capacity = "{capacity}"
packs_per_step = {packs}

[train]
mode = "{mode}"
steps = {steps}
device = "{device}"

[train.loss]
kind = "{loss}"

[output]
dir = "{out}"
resume = false
save_every = 0
save_final = false
"""

# GPU kernels by kind, first match wins (names as torch.profiler reports them)
KERNEL_KINDS = (
    ("norm + rope", ("norm_rope",)),  # before attention: its kernels end in _fwd_kernel / _bwd_kernel too
    ("attention", ("flash", "fmha", "attn", "tree_attention", "_fwd_kernel", "_bwd_kernel", "cutlass_kernel")),
    ("log-probs", ("logprob", "lse", "_head_")),
    ("matmul", ("gemm", "nvjet", "xmma", "sm90_", "cublas", "cutlass")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("compiled (Inductor)", ("triton_",)),
)


def parse_args(argv: list[str]) -> argparse.Namespace:
    from treepack.stats import MODEL_SHAPES

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", action="append", default=[], metavar="NAME=FILE", help="a rollout file (repeatable)")
    p.add_argument("--synth", action="append", default=[], metavar="NAME=KIND:TREES",
                   help="treepack synth's KIND with TREES trees, seed 0 (repeatable)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--also", action="append", default=[], metavar="WORKLOAD:MODE",
                   help="one more run after that workload's modes, e.g. gsm8k:dense (repeatable)")
    p.add_argument("--model", default="qwen3-0.6b", choices=sorted(MODEL_SHAPES))
    p.add_argument("--layers", type=int, default=0, help="override the shape's layer count (0: keep)")
    p.add_argument("--compact-vocab", action="store_true",
                   help="the data's own token ids as the vocabulary, not the shape's 151,936 (CPU smoke runs)")
    p.add_argument("--capacity", default="32K")
    p.add_argument("--packs-per-step", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians")
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    p.add_argument("--kernels", action="store_true", help="also the first pack's attention, tree vs FA4 varlen")
    p.add_argument("--profile", action="append", default=[], metavar="WORKLOAD:MODE",
                   help="profile one steady step of this run (repeatable)")
    p.add_argument("--deadline", type=float, default=0, help="seconds after which no new run starts (0: none)")
    p.add_argument("--out", type=Path, default=None, help="markdown report")
    p.add_argument("--json-out", type=Path, default=None, help="every run's steps, written after each run")
    args = p.parse_args(argv)
    if not args.data and not args.synth:
        args.data = [f"tau-bench-slice={SAMPLE}"]
    return args


def workloads(args: argparse.Namespace, directory: Path) -> dict[str, Path]:
    """NAME -> rollout file, synth files written into ``directory``."""
    from treepack.datasets import synth

    found = {}
    for spec in args.data:
        name, sep, path = spec.partition("=")
        found[name if sep else Path(spec).stem] = Path(path if sep else spec).resolve()
    for spec in args.synth:
        name, _, kind_trees = spec.partition("=")
        kind, _, trees = (kind_trees or name).partition(":")
        path = directory / f"synth-{kind}-{trees or 64}.parquet"
        synth.write(kind, int(trees or 64), path, seed=0)
        found[name] = path
    return found


def loss_kind(data: Path) -> str:
    """grpo where every record has a reward or an advantage, else sft (ToolBench's file has rewards on a few)."""
    import pyarrow.parquet as pq

    if data.suffix != ".parquet":
        return "grpo"
    table = pq.read_table(data)
    for column in ("advantage", "reward"):
        if column in table.column_names and table.column(column).null_count == 0:
            return "grpo"
    return "sft"


def pack_count(data: Path, capacity: str) -> int:
    from treepack.sizes import parse_size
    from treepack.train.data import load_packs

    return len(load_packs(str(data), capacity=parse_size(capacity, what="capacity")))


def config_text(args: argparse.Namespace, data: Path, mode: str, out: Path, packs: int) -> str:
    from treepack.stats import MODEL_SHAPES

    m = MODEL_SHAPES[args.model]
    text = CONFIG.format(
        compact="true" if args.compact_vocab else "false", d=m.d_model, ff=m.d_ff, layers=args.layers or m.n_layers, heads=m.n_heads, kv=m.n_kv_heads,
        hd=m.head_dim, tie="true" if m.d_model <= 2560 else "false", data=json.dumps(str(data)),
        capacity=args.capacity, packs=packs, mode=mode, steps=args.steps, device=args.device, out=out,
        loss=loss_kind(data))
    return text if args.compact_vocab else text.replace("[model]\n", f"[model]\nvocab_size = {m.vocab}\n", 1)


class StepProfiler:
    """Starts torch.profiler at one step line and stops at the next: the GPU work of about one steady step."""

    def __init__(self, at_step: int):
        self.at_step, self.prof, self.wall, self.t0 = at_step, None, 0.0, 0.0

    def on_line(self, line: str) -> None:
        if not line.startswith("step "):
            return
        step = int(line.split()[1])
        if step == self.at_step and self.prof is None:
            import torch
            from torch.profiler import ProfilerActivity, profile

            torch.cuda.synchronize()
            self.prof = profile(activities=[ProfilerActivity.CUDA])
            self.prof.start()
            self.t0 = time.perf_counter()
        elif step == self.at_step + 1 and self.prof is not None and not self.wall:
            import torch

            torch.cuda.synchronize()
            self.wall = time.perf_counter() - self.t0
            self.prof.stop()

    def summary(self) -> dict | None:
        from torch.autograd import DeviceType

        if self.prof is None or not self.wall:
            return None
        spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in self.prof.events()
                       if e.device_type == DeviceType.CUDA)
        by_kind: dict[str, float] = {}
        by_name: dict[str, float] = {}
        busy, end = 0.0, float("-inf")
        for start, stop, name in spans:
            ms = (stop - start) / 1e3
            low = name.lower()
            kind = next((k for k, keys in KERNEL_KINDS if any(s in low for s in keys)), "other")
            by_kind[kind] = by_kind.get(kind, 0.0) + ms
            by_name[name[:90]] = by_name.get(name[:90], 0.0) + ms
            if stop > end:  # union of the kernels' intervals: the GPU's busy time
                busy += (stop - max(start, end)) / 1e3
                end = stop
        top = sorted(by_name.items(), key=lambda kv: -kv[1])[:12]
        return {"wall_ms": 1e3 * self.wall, "busy_ms": busy, "by_kind_ms": by_kind, "top_kernels_ms": top,
                "kernels": len(spans)}


def run(args: argparse.Namespace, name: str, data: Path, mode: str, directory: Path, packs: int) -> dict:
    import torch

    from treepack.train.config import parse_config
    from treepack.train.loop import train

    out = directory / f"{name}-{mode}"
    cfg = parse_config(config_text(args, data, mode, out, packs))
    lines: list[str] = []
    wanted = f"{name}:{mode}" in args.profile and torch.cuda.is_available() and args.device != "cpu"
    profiler = StepProfiler(args.warmup + 2) if wanted else None  # GPU kernel times: CUDA only

    def log(line: str) -> None:
        lines.append(line)
        print(f"[{name} {mode}] {line}", flush=True)
        if profiler is not None:
            profiler.on_line(line)

    started = time.perf_counter()
    row = {"workload": name, "mode": mode, "packs_per_step": packs, "loss": cfg.train.loss.kind}
    try:
        train(cfg, log=log)
        row["steps"] = [json.loads(s) for s in (out / "metrics.jsonl").read_text().splitlines()]
    except Exception as exc:  # noqa: BLE001 - one failed run is reported, the others go on
        row["failed"] = f"{type(exc).__name__}: {str(exc)[:400]}"
        print(f"[{name} {mode}] FAILED {row['failed']}", flush=True)
    row["wall_s"] = time.perf_counter() - started
    row["auto_plan"] = [line.strip() for line in lines if line.startswith("mode auto")][:1]
    if profiler is not None:
        row["profile"] = profiler.summary()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    torch._dynamo.reset()  # the next run compiles its own graphs, as a fresh process would
    return row


def summarise(row: dict, warmup: int) -> dict:
    steps = row.get("steps") or []
    timed = [s for s in steps if s["step"] > warmup] or steps[-1:]
    if not timed:
        return {}
    med = statistics.median
    pick = lambda key: med([s[key] for s in timed if s.get(key) is not None]) if any(s.get(key) is not None for s in timed) else None
    return {"seconds": pick("seconds"), "tok_per_s": pick("tok_per_s"), "flat_tok_per_s": pick("flat_tok_per_s"),
            "mfu": pick("mfu"), "mem_gb": max(s["mem_gb"] for s in timed), "timed": [s["step"] for s in timed],
            "step_seconds": [round(s["seconds"], 3) for s in timed],
            "compiled": {s["step"]: s["compiles"] for s in steps if s.get("compiles")},
            "tokens": med([s["tokens"] for s in timed]), "flat_tokens": med([s["flat_tokens"] for s in timed])}


def kernel_row(name: str, data: Path, capacity: int) -> dict:
    """The first pack's attention alone, laid out as tree mode trains it (children largest subtree first,
    ``data.child_order = "auto"``): FA4 tree kernel vs FA4 varlen over the leaves (and the Triton tree kernel)."""
    from attention_backends import first_pack, largest_first, run_pack

    se = largest_first(first_pack(data, capacity, exclude_slice=False))
    return run_pack(name, se, 16, 8, 128, ["tree/fa4", "tree/triton", "dense/fa4-varlen"],
                    {"warmup_ms": 50, "rep_ms": 250})


def fmt(x, spec: str = ".2f", scale: float = 1.0) -> str:
    return "-" if x is None else format(scale * x, spec)


def report(args, argv, rows: list[dict], kernels: list[dict], hardware: str, started: float) -> str:
    from treepack.sizes import parse_size

    lines = [f"# Training modes side by side, one process, {today()}", "",
             f"- hardware: {hardware}", f"- command: `{command_line(__file__, argv)}`",
             (f"- model: {args.model} shape{f', {args.layers} layers' if args.layers else ''}, random init, "
              f"{'compact' if args.compact_vocab else 'full'} vocabulary, bf16 autocast, compiled regions; GRPO loss (SFT where a file has no rewards); {args.capacity} packs, {args.packs_per_step} "
              f"a step, {args.steps} steps; medians of steps {args.warmup + 1}-{args.steps}; the run took "
              f"{time.time() - started:.0f} s"), "",
             "| workload | mode | s/step | tok/s | flat tok/s | MFU | peak GB | steps that compiled (after step 1) |",
             "|---|---|---|---|---|---|---|---|"]
    by = {}
    for row in rows:
        s = summarise(row, args.warmup)
        by[(row["workload"], row["mode"])] = s
        if row.get("failed"):
            lines.append(f"| {row['workload']} | {row['mode']} | failed: {row['failed'][:120]} | | | | | |")
            continue
        later = {k: v for k, v in s.get("compiled", {}).items() if k > 1}
        lines.append(f"| {row['workload']} | {row['mode']} | {fmt(s.get('seconds'), '.3f')} | "
                     f"{fmt(s.get('tok_per_s'), ',.0f')} | {fmt(s.get('flat_tok_per_s'), ',.0f')} | "
                     f"{fmt(s.get('mfu'), '.1f', 100)}% | {fmt(s.get('mem_gb'), '.1f')} | "
                     f"{', '.join(f'{k} ({v:.0f})' for k, v in later.items()) or 'none'} |")
    lines += ["", "Per workload (step times of the same packs):", "",
              "| workload | loss | packs a step | C (flat / tree tokens) | dense-leaf s / tree s | auto s / faster of the two | auto's plan |",
              "|---|---|---|---|---|---|---|"]
    for name in dict.fromkeys(r["workload"] for r in rows):
        tree, leaf, auto = (by.get((name, m), {}).get("seconds") for m in MODES)
        t = by.get((name, "tree"), {})
        c = t["flat_tokens"] / t["tokens"] if t.get("tokens") else None
        best = min(x for x in (tree, leaf) if x) if (tree or leaf) else None
        plan = next((r.get("auto_plan") for r in rows if r["workload"] == name and r["mode"] == "auto"), None) or []
        pps, loss = next((r["packs_per_step"], r["loss"]) for r in rows if r["workload"] == name)
        lines.append(f"| {name} | {loss} | {pps} | {fmt(c)} | {fmt(leaf / tree if tree and leaf else None, '.3f')} | "
                     f"{fmt(auto / best if auto and best else None, '.3f')} | {'; '.join(plan)[:160]} |")
    profiled = [r for r in rows if r.get("profile")]
    for r in profiled:
        p = r["profile"]
        lines += ["", f"Profile, {r['workload']} {r['mode']}, one steady step: wall {p['wall_ms']:.0f} ms, GPU busy "
                      f"{p['busy_ms']:.0f} ms ({100 * p['busy_ms'] / p['wall_ms']:.0f}%), {p['kernels']} kernels; by kind: "
                      + ", ".join(f"{k} {v:.0f} ms" for k, v in sorted(p["by_kind_ms"].items(), key=lambda kv: -kv[1])),
                  "", "| kernel | ms |", "|---|---|"]
        lines += [f"| `{n}` | {ms:.1f} |" for n, ms in p["top_kernels_ms"]]
    if kernels:
        capacity = parse_size(args.capacity, what="capacity")
        lines += ["", (f"Attention alone, each workload's first pack at {capacity:,} tokens, laid out as tree mode "
                       "trains it (children largest subtree first) (fwd+bwd, bf16, Hq 16 / Hkv 8 / D 128; TFLOP/s "
                       "per visible pair: 14 x pairs x D x Hq):"), "",
                  ("| workload | T | leaf seqs | C_attn | tree/fa4 ms | dense/fa4-varlen ms | tree/fa4 TFLOP/s | "
                   "varlen TFLOP/s | per pair tree / varlen | time varlen / tree | tree/triton TFLOP/s |"),
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for k in kernels:
            ms, tf = k["ms"], k["tflops"]
            lines.append(
                f"| {k['pack']} | {k['T']:,} | {k['paths']} | {k['pairs_dense'] / k['pairs_tree']:.2f} | "
                f"{fmt(ms.get('tree/fa4'), '.3f')} | {fmt(ms.get('dense/fa4-varlen'), '.3f')} | "
                f"{fmt(tf.get('tree/fa4'), '.0f')} | {fmt(tf.get('dense/fa4-varlen'), '.0f')} | "
                f"{fmt(tf['tree/fa4'] / tf['dense/fa4-varlen'] if 'tree/fa4' in tf and 'dense/fa4-varlen' in tf else None)} | "
                f"{fmt(ms['dense/fa4-varlen'] / ms['tree/fa4'] if 'tree/fa4' in ms and 'dense/fa4-varlen' in ms else None)} | "
                f"{fmt(tf.get('tree/triton'), '.0f')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
    import torch

    args = parse_args(argv)
    started = time.time()
    modes = args.modes.split(",")
    rows: list[dict] = []
    kernels: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        files = workloads(args, directory)
        for name, path in files.items():
            try:
                packs = min(args.packs_per_step, pack_count(path, args.capacity))  # a small file has fewer packs
            except Exception as exc:  # noqa: BLE001 - e.g. a record over the capacity: every mode fails alike
                failed = f"{type(exc).__name__}: {str(exc)[:400]}"
                print(f"[{name}] FAILED {failed}", flush=True)
                rows += [{"workload": name, "mode": mode, "packs_per_step": 0, "loss": "-", "failed": failed}
                         for mode in modes]
                continue
            if args.kernels and torch.cuda.is_available():
                from treepack.sizes import parse_size

                kernels.append(kernel_row(name, path, parse_size(args.capacity, what="capacity")))
            for mode in modes + [m for w, _, m in (a.partition(":") for a in args.also) if w == name]:
                if args.deadline and time.time() - started > args.deadline:
                    print(f"deadline: {name} {mode} not run", flush=True)
                    continue
                rows.append(run(args, name, path, mode, directory, packs))
                if args.json_out:
                    write_report(args.json_out, json.dumps({"runs": rows, "kernels": kernels}, indent=1))
    device = "cuda" if torch.cuda.is_available() and args.device != "cpu" else "cpu"
    text = report(args, argv, rows, kernels, gpu_line(device), started)
    print(text)
    write_report(args.out, text)


if __name__ == "__main__":
    main(sys.argv[1:])
