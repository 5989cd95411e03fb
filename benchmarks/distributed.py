"""Data-parallel training throughput: ``treepack train`` under torchrun at world sizes 1, 2, 4, 8, against
the plain single-process run; runs unchanged on any number of GPUs (or CPU processes).

Every run is a real CLI run in its own process (``python -m treepack train`` for the plain baseline,
``python -m torch.distributed.run --standalone --nproc-per-node N -m treepack train`` for N ranks) on a
config written here, and is read back from its ``metrics.jsonl``: the first ``--warmup`` steps (Triton
autotuning, torch.compile) are dropped and the median of the rest is reported. Per row: seconds per step,
tokens/s (tokens the model forwarded, all ranks) and flat tokens/s, MFU (CUDA, bf16), the largest peak
memory of a rank, the balance's predicted imbalance, the measured one (rank compute times), the idle
share (ranks waiting for the slowest), scaling efficiency (tokens/s over N x the 1-rank tokens/s) and,
for the torchrun 1-rank run, its overhead over the plain run (step time, same config).

``--batch per-rank`` (default, weak scaling) gives each rank ``--packs-per-step`` packs (the global
batch grows with N); ``--batch global`` keeps the global batch fixed (strong scaling). ``--repeat R``
alternates the plain and torchrun runs R times (GPU clocks and caches warm alike) and pools their steps.

Usage (treepack installed, ``pip install -e .``; world sizes default to 1 and every power of two up to
the GPUs present):
    python benchmarks/distributed.py --modes tree --model qwen3-0.6b --out benchmarks/results/DATE-distributed.md
    python benchmarks/distributed.py --synth tau2:256 --capacity 32K --packs-per-step 4   # synthetic tau2 trees
    python benchmarks/distributed.py --nproc 1,2 --device cpu --layers 2 --steps 4    # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import command_line, cpu_line, gpu_line, today, write_report

SAMPLE = ROOT / "treepack" / "datasets" / "samples" / "tau_bench_slice.parquet"

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

[data]
rollouts = [{data}]
capacity = "{capacity}"
packs_per_step = {packs}

[train]
mode = "{mode}"
steps = {steps}
dtype = "{dtype}"
device = "{device}"
compile = "{compile}"
activation_checkpointing = {ac}

balance = "{balance}"
[train.loss]
kind = "grpo"

[output]
dir = "{out}"
save_every = 0
save_final = false
"""


def parse_args(argv: list[str]) -> argparse.Namespace:
    from treepack.stats import MODEL_SHAPES

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", default="auto", help="world sizes, e.g. 1,2,4,8 (auto: 1 and powers of two up to the GPUs)")
    p.add_argument("--no-plain", action="store_true", help="skip the plain single-process baseline")
    p.add_argument("--modes", default="tree", help="comma-separated modes (any of treepack's)")
    p.add_argument("--model", default="qwen3-0.6b", choices=sorted(MODEL_SHAPES), help="model shape (random init)")
    p.add_argument("--layers", type=int, default=0, help="override the shape's layer count (0: keep)")
    p.add_argument("--full-vocab", action="store_true", help="the shape's vocabulary instead of compact ids")
    p.add_argument("--data", nargs="+", default=[str(SAMPLE)], help="rollout files (default: the tau-bench slice)")
    p.add_argument("--synth", default="", metavar="KIND:TREES",
                   help="train on treepack synth's KIND (tau2, agentic-think, ...) with TREES trees instead of --data")
    p.add_argument("--capacity", default="16k")
    p.add_argument("--packs-per-step", type=int, default=2)
    p.add_argument("--batch", choices=("per-rank", "global"), default="per-rank",
                   help="per-rank: packs per step x N (weak scaling); global: fixed global batch")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of the medians")
    p.add_argument("--repeat", type=int, default=1, help="alternate plain and 1-rank runs this many times")
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    p.add_argument("--dtype", default="auto")
    p.add_argument("--compile", default="auto", choices=("auto", "on", "off"))
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--balance", default="auto", choices=("auto", "flops", "measured"), help="train.balance")
    p.add_argument("--overhead", action="store_true",
                   help="instead: the plain loop vs the data-parallel loop at world size 1, alternated --repeat "
                        "times in ONE torchrun process (same warm caches; the A/B of their per-step overhead)")
    p.add_argument("--overhead-worker", nargs=2, metavar=("CONFIG", "JSON"), help=argparse.SUPPRESS)
    p.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    p.add_argument("--out", type=Path, default=None, help="markdown report")
    p.add_argument("--json-out", type=Path, default=None)
    return p.parse_args(argv)


def world_sizes(spec: str, device: str) -> list[int]:
    if spec != "auto":
        return [int(x) for x in spec.split(",")]
    import torch

    n = torch.cuda.device_count() if device != "cpu" and torch.cuda.is_available() else 1
    return [1] + [w for w in (2, 4, 8, 16, 32, 64) if w <= n]


def write_config(directory: Path, args: argparse.Namespace, mode: str, world: int, tag: str) -> Path:
    from treepack.stats import MODEL_SHAPES

    m = MODEL_SHAPES[args.model]
    packs = args.packs_per_step * (world if args.batch == "per-rank" else 1)
    text = CONFIG.format(
        compact="false" if args.full_vocab else "true", d=m.d_model, ff=m.d_ff, layers=args.layers or m.n_layers,
        heads=m.n_heads, kv=m.n_kv_heads, hd=m.head_dim, tie="true" if m.d_model <= 2560 else "false",
        data=", ".join(json.dumps(str(Path(p).resolve())) for p in args.data), capacity=args.capacity, packs=packs,
        mode=mode, steps=args.steps, dtype=args.dtype, device=args.device, compile=args.compile,
        ac="true" if args.activation_checkpointing else "false", out=directory / tag, balance=args.balance)
    if args.full_vocab:
        text = text.replace("[model]\n", f"[model]\nvocab_size = {m.vocab}\n", 1)
    path = directory / f"{tag}.toml"
    path.write_text(text)
    return path


def synth_file(spec: str, directory: Path) -> str:
    """``KIND:TREES`` written by treepack synth (seed 0) into ``directory``; its path."""
    from treepack.datasets import synth

    kind, _, trees = spec.partition(":")
    path = directory / f"synth-{kind}-{trees or 64}.parquet"
    synth.write(kind, int(trees or 64), path, seed=0)
    return str(path)


def run_one(config: Path, world: int | None, timeout: int) -> list[dict]:
    """One run (None: plain process); its metrics lines. Raises with the run's stderr on failure."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if world is None:
        cmd = [sys.executable, "-m", "treepack", "train", str(config)]
    else:
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world)))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
               "-m", "treepack", "train", str(config)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[1:4])} ... failed ({done.returncode}):\n{done.stderr[-3000:]}")
    out = Path(config).with_suffix("")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def summarise(steps: list[dict], warmup: int) -> dict:
    timed = [s for s in steps if s["step"] > warmup] or steps[-1:]
    med = statistics.median

    def pick(key):
        vals = [s[key] for s in timed if key in s]
        return med(vals) if vals else None

    gaps = [100 * abs(s["imbalance_measured"] - s["imbalance_predicted"]) for s in timed
            if "imbalance_measured" in s and "imbalance_predicted" in s]

    return {"steps": len(timed), "seconds": pick("seconds"), "tok_per_s": pick("tok_per_s"),
            "flat_tok_per_s": pick("flat_tok_per_s"), "mfu": pick("mfu"), "mem_gb": max(s["mem_gb"] for s in timed),
            "imbalance_predicted": pick("imbalance_predicted"), "imbalance_measured": pick("imbalance_measured"),
            "idle_fraction": pick("idle_fraction"), "step_seconds": [s["seconds"] for s in timed],
            # steady steps: how far the measured imbalance was from the predicted one (percentage points)
            "imbalance_gap": med(gaps) if gaps else None,
            # every step of the run, warm-up included: slower than 1.3x the timed median, and what compiled
            "slow_steps": [s["step"] for s in steps if s["seconds"] > 1.3 * med([t["seconds"] for t in timed])],
            "compiled_steps": {s["step"]: s.get("rank_compiles", s.get("compiles")) for s in steps if s.get("compiles")},
            "rank_seconds": [s.get("rank_seconds") for s in timed]}  # per step: each rank's compute seconds


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def report(args, argv, rows: list[dict], hardware: str) -> str:
    lines = [f"# Data-parallel training (torchrun, FSDP2), {today()}", "",
             f"- hardware: {hardware}", f"- command: `{command_line(__file__, argv)}`",
             (f"- model: {args.model} shape{f', {args.layers} layers' if args.layers else ''}, random init, "
             f"{'full' if args.full_vocab else 'compact'} vocabulary; data: "
             f"{', '.join(Path(p).name for p in args.data)} packed at {args.capacity}; GRPO loss; "
             f"{args.packs_per_step} packs per step{' per rank' if args.batch == 'per-rank' else ''}; "
             f"compile {args.compile}; medians of steps {args.warmup + 1}-{args.steps}"), "",
             ("| mode | runner | ranks | s/step | tok/s | flat tok/s | MFU | peak GB | imbalance pred / meas | gap | idle "
             "| scaling eff. | vs plain | slow steps | compiled (per rank) |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['mode']} | {r['runner']} | {r['world']} | {r['seconds']:.4f} | {r['tok_per_s']:.0f} | "
            f"{r['flat_tok_per_s']:.0f} | {pct(r['mfu'])} | {r['mem_gb']:.1f} | "
            f"{pct(None if r['imbalance_predicted'] is None else r['imbalance_predicted'] - 1)} / "
            f"{pct(None if r['imbalance_measured'] is None else r['imbalance_measured'] - 1)} | "
            f"{'-' if r['imbalance_gap'] is None else format(r['imbalance_gap'], '.1f') + ' pts'} | "
            f"{pct(r['idle_fraction'])} | {r.get('efficiency', '-')} | {r.get('vs_plain', '-')} | "
            f"{', '.join(map(str, r['slow_steps'])) or '-'} | "
            f"{'; '.join(f'step {k}: {v}' for k, v in r['compiled_steps'].items()) or '-'} |")
    for r in rows:
        if r.get("paired_steps"):
            lines.append(f"\n{r['mode']}, torchrun at world size 1 over the plain loop, step by step on the same "
                         f"batches: median ratio {r['paired_median_ratio']:.4f} over {r['paired_steps']} steps; "
                         f"summed time {r['paired_sum_ratio']:.4f} over the {r['paired_calm_steps']} steps where "
                         "neither stalled (> 3x the median). The medians in the table pool different batches.")
    return "\n".join(lines) + "\n"


def overhead_worker(config: Path, out: Path, repeat: int) -> None:
    """Under torchrun at world size 1: ``repeat`` x (plain loop, data-parallel loop) on the same config,
    alternating which goes first; every run's metrics go to ``out`` (JSON)."""
    import dataclasses
    import gc

    import torch
    import torch.distributed as dist

    from treepack.train.config import load_config
    from treepack.train.loop import train
    from treepack.train.parallel import train_distributed

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    cfg = load_config(config)
    runs = []
    for i in range(repeat):
        for runner in (("plain", "torchrun") if i % 2 == 0 else ("torchrun", "plain")):
            c = dataclasses.replace(cfg, output=dataclasses.replace(cfg.output, dir=f"{cfg.output.dir}-{runner}-{i}"))
            fn = train if runner == "plain" else train_distributed
            result = fn(c, log=lambda line: None)
            runs.append({"runner": runner, "repeat": i, "steps": [s.to_json() for s in result.stats]})
            del result
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            print(f"{runner} {i}: {summarise(runs[-1]['steps'], 0)['seconds']:.4f} s/step, losses "
                  f"{[round(s['loss'], 5) for s in runs[-1]['steps']]}", flush=True)
    out.write_text(json.dumps(runs) + "\n")
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def overhead(args: argparse.Namespace, argv: list[str], directory: Path) -> list[dict]:
    rows = []
    for mode in args.modes.split(","):
        config = write_config(directory, args, mode, 1, f"{mode}-overhead")
        out = directory / f"{mode}-overhead.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", __file__,
               "--repeat", str(args.repeat), "--overhead-worker", str(config), str(out)]
        done = subprocess.run(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"}, capture_output=True, text=True,
                              timeout=args.timeout, check=False)
        print(done.stdout, end="", flush=True)
        if done.returncode != 0:
            raise RuntimeError(f"overhead worker failed ({done.returncode}):\n{done.stderr[-3000:]}")
        runs = json.loads(out.read_text())
        by = {r: [s for run in runs if run["runner"] == r for s in run["steps"]] for r in ("plain", "torchrun")}
        for runner in ("plain", "torchrun"):
            row = {"mode": mode, "runner": f"{runner} (same process)", "world": 1, **summarise(by[runner], args.warmup)}
            if runner == "torchrun":
                row.update(paired_overhead(runs, args.warmup))
                row["vs_plain"] = f"{100 * (row['paired_median_ratio'] - 1):+.1f}% time (paired)"
            rows.append(row)
    return rows


def paired_overhead(runs: list[dict], warmup: int) -> dict:
    """torchrun's step time over the plain loop's on the same batch: step s of repeat i runs the same packs
    in both (same config and seed), so each pair compares equal work. Medians of whole runs do not: batches
    of 16k packs take 0.49 or 0.68 s, and which ones fall in the timed window moves a median by 10%.
    Returns the median of the per-step ratios and the ratio of the summed times over the pairs where
    neither step stalled (> 3x the plain median: a compile or autotune inside the timed window)."""
    step_time = {(run["runner"], run["repeat"], s["step"]): s["seconds"] for run in runs for s in run["steps"]
                 if s["step"] > warmup}
    pairs = [(t, step_time[("torchrun", i, k)]) for (r, i, k), t in step_time.items()
             if r == "plain" and ("torchrun", i, k) in step_time]
    if not pairs:
        return {"paired_steps": 0, "paired_median_ratio": float("nan"), "paired_sum_ratio": float("nan")}
    typical = statistics.median(a for a, _ in pairs)
    calm = [(a, b) for a, b in pairs if max(a, b) <= 3 * typical] or pairs
    return {"paired_steps": len(pairs), "paired_median_ratio": statistics.median(b / a for a, b in pairs),
            "paired_sum_ratio": sum(b for _, b in calm) / sum(a for a, _ in calm), "paired_calm_steps": len(calm)}


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if args.overhead_worker:
        overhead_worker(Path(args.overhead_worker[0]), Path(args.overhead_worker[1]), args.repeat)
        return
    if args.overhead:
        with tempfile.TemporaryDirectory() as tmp:
            rows = overhead(args, argv, Path(tmp))
        finish(args, argv, rows)
        return
    worlds = world_sizes(args.nproc, args.device)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        if args.synth:
            args.data = [synth_file(args.synth, directory)]
        for mode in args.modes.split(","):
            pooled: dict[tuple, list[dict]] = {}
            order = [x for i in range(args.repeat) for x in ([(None, i)] if not args.no_plain else []) + [(1, i)]]
            order += [(w, 0) for w in worlds if w != 1]
            for world, i in order:
                tag = f"{mode}-{'plain' if world is None else f'w{world}'}-{i}"
                steps = run_one(write_config(directory, args, mode, world or 1, tag), world, args.timeout)
                pooled.setdefault((world,), []).extend(steps)
                print(f"{tag}: {summarise(steps, args.warmup)['seconds']:.4f} s/step", flush=True)
            for (world,), steps in pooled.items():
                row = {"mode": mode, "runner": "plain" if world is None else "torchrun", "world": world or 1,
                       **summarise(steps, args.warmup)}
                rows.append(row)
            one = next((r for r in rows if r["mode"] == mode and r["runner"] == "torchrun" and r["world"] == 1), None)
            plain = next((r for r in rows if r["mode"] == mode and r["runner"] == "plain"), None)
            for r in rows:
                if r["mode"] != mode or r["runner"] != "torchrun":
                    continue
                if one:
                    r["efficiency"] = f"{100 * r['tok_per_s'] / (r['world'] * one['tok_per_s']):.1f}%"
                if plain and r["world"] == 1:
                    r["vs_plain"] = f"{100 * (r['seconds'] / plain['seconds'] - 1):+.1f}% time"
    finish(args, argv, rows)


def finish(args: argparse.Namespace, argv: list[str], rows: list[dict]) -> None:
    import torch

    hardware = gpu_line() if args.device != "cpu" and torch.cuda.is_available() else f"{cpu_line()}; {gpu_line('cpu')}"
    text = report(args, argv, rows, hardware)
    print(text)
    write_report(args.out, text)
    if args.json_out:
        write_report(args.json_out, json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
