"""How a data-parallel run balances on N GPUs, rehearsed on one: ``treepack train --simulate-ranks N``
(`treepack.train.sync.SimulatedRanks`) runs every rank's share of each step one rank after the other and
times each share. Per data file, world size and balance (``flops``: design §9's FLOP model; ``measured``:
that model fitted to the ranks' measured times, `treepack.train.calibration`), over the steady steps:

- the balance's predicted imbalance and the measured one (costliest rank / mean - 1), and their gap in
  points, step by step (median and worst);
- the compute a step would take on N GPUs (its slowest rank) over a perfect split (the ranks' mean);
- what the split cut (packs cut, tokens recomputed) and the fitted prices (attention against the FLOP
  model, seconds of a call in matmul FLOPs).

What a rehearsal does not show: collectives, each rank's own compiles, and N GPUs running at once (clocks,
memory bandwidth); those need the real run (`benchmarks/distributed.py`). Every run shares one process, so
kernels compile once; the first ``--warmup`` steps of each run are left out (the measured balance fits from
its third step on).

Usage (treepack installed; a GPU, or ``--device cpu`` for a smoke run):
    python benchmarks/simulated_ranks.py --data tau-bench=ROLLOUTS.parquet --synth tau2=tau2:256 \\
        --worlds 2,4 --capacity 32K --packs-per-rank 2 --steps 12 --out benchmarks/results/DATE-simulated-ranks.md
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import distributed as dp_bench
from common import command_line, cpu_line, gpu_line, today, write_report

from treepack.train.compile_count import KINDS

BALANCES = ("flops", "measured")


def parse_args(argv: list[str]) -> argparse.Namespace:
    from treepack.stats import MODEL_SHAPES

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", action="append", default=[], metavar="NAME=PATH", help="a rollout file (repeatable)")
    p.add_argument("--synth", action="append", default=[], metavar="NAME=KIND:TREES",
                   help="a treepack synth workload (repeatable)")
    p.add_argument("--worlds", default="2,4", help="simulated world sizes")
    p.add_argument("--balances", default=",".join(BALANCES))
    p.add_argument("--mode", default="tree")
    p.add_argument("--model", default="qwen3-0.6b", choices=sorted(MODEL_SHAPES))
    p.add_argument("--layers", type=int, default=0, help="override the shape's layer count (0: keep)")
    p.add_argument("--full-vocab", action="store_true")
    p.add_argument("--capacity", default="32K")
    p.add_argument("--packs-per-rank", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=4, help="first steps of each run left out")
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    p.add_argument("--dtype", default="auto")
    p.add_argument("--compile", default="auto", choices=("auto", "on", "off"))
    p.add_argument("--out", type=Path, default=None, help="markdown report")
    args = p.parse_args(argv)
    if not args.data and not args.synth:
        p.error("give at least one --data or --synth")
    return args


def workloads(args: argparse.Namespace, directory: Path) -> list[tuple[str, str]]:
    """(name, rollout file) for every --data and --synth."""
    out = []
    for spec in args.data:
        name, _, path = spec.partition("=")
        out.append((name, path) if path else (Path(name).stem, name))
    for spec in args.synth:
        name, _, kind = spec.partition("=")
        out.append((name, dp_bench.synth_file(kind or name, directory)))
    return out


def run_config(args: argparse.Namespace, directory: Path, data: str, world: int, balance: str, tag: str) -> Path:
    """The config `benchmarks/distributed.py` writes for ``world`` ranks (``--packs-per-rank`` packs each)."""
    cfg_args = argparse.Namespace(
        model=args.model, layers=args.layers, full_vocab=args.full_vocab, data=[data], capacity=args.capacity,
        packs_per_step=args.packs_per_rank, batch="per-rank", steps=args.steps, dtype=args.dtype,
        device=args.device, compile=args.compile, activation_checkpointing=False, balance=balance)
    return dp_bench.write_config(directory, cfg_args, args.mode, world, tag)


def rehearse(config: Path, world: int, balance: str) -> list[dict]:
    """One simulated run in this process; its steps' metrics."""
    import torch

    from treepack.train.config import load_config
    from treepack.train.loop import resolve_precision, train
    from treepack.train.sync import SimulatedRanks

    cfg = load_config(config)
    device = resolve_precision(cfg.train.device, cfg.train.dtype)[0]
    result = train(cfg, log=lambda line: None, sync=SimulatedRanks(device, cfg.train.mode, world, balance))
    steps = [s.to_json() for s in result.stats]
    del result
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return steps


def summarise(steps: list[dict], warmup: int) -> dict:
    """Medians over the steps after the warm-up (the last step if there are none)."""
    timed = [s for s in steps if s["step"] > warmup] or steps[-1:]
    med = statistics.median
    gaps = [100 * abs(s["imbalance_measured"] - s["imbalance_predicted"]) for s in timed]
    slowest = [max(s["rank_seconds"]) for s in timed]
    mean = [statistics.fmean(s["rank_seconds"]) for s in timed]
    last = timed[-1]
    return {
        "steps": len(timed), "seconds": med(s["seconds"] for s in timed),
        "predicted": med(s["imbalance_predicted"] for s in timed) - 1,
        "measured": med(s["imbalance_measured"] for s in timed) - 1,
        "gap": med(gaps), "gap_max": max(gaps),
        "slowest_s": med(slowest), "mean_s": med(mean), "over_perfect": med(a / b for a, b in zip(slowest, mean)) - 1,
        "cut": sum(s["split_packs"] for s in timed), "cut_tokens": sum(s["cut_tokens"] for s in timed),
        "attention_factor": last.get("cost_attention_factor"), "call_flops": last.get("cost_call_flops"),
        "fit_error": last.get("cost_fit_error"),
        # every step of the run that compiled, and what (graphs, Triton kernels, FA4 kernels: `compile_count.KINDS`)
        "compiled_steps": {s["step"]: ", ".join(f"{s[f'compiled_{k}']:.0f} {k}" for k in KINDS if s.get(f"compiled_{k}"))
                           for s in steps if s.get("compiles")},
    }


def report(args: argparse.Namespace, argv: list[str], rows: list[dict], hardware: str) -> str:
    pct = "{:.1f}%".format
    lines = [
        f"# Data-parallel balance rehearsed on one device (`--simulate-ranks`), {today()}", "",
        f"- hardware: {hardware}", f"- command: `{command_line(__file__, argv)}`",
        (f"- model: {args.model} shape{f', {args.layers} layers' if args.layers else ''}, random init; "
         f"{args.mode} mode; GRPO loss; packs of {args.capacity}, {args.packs_per_rank} per simulated rank a step; "
         f"medians of steps {args.warmup + 1}-{args.steps}"),
        ("- imbalance: costliest rank / mean - 1, predicted by the balance's cost model and measured (each rank's "
         "share timed on its own); gap: |measured - predicted| per step, median and worst; N-GPU compute: the "
         "slowest rank's seconds, over a perfect split (the ranks' mean)"), "",
        ("| data | ranks | balance | imbalance pred / meas | gap median / worst | N-GPU compute s | over perfect "
         "| packs cut (tokens) | fitted attention x, call FLOPs | compiled at steps |"),
        "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        fit = ("-" if r["attention_factor"] is None else
               f"{r['attention_factor']:.2f}, {r['call_flops'] / 1e9:.0f} GFLOP (fit err {pct(100 * r['fit_error'])})")
        compiled = "; ".join(f"step {k}: {v}" for k, v in r["compiled_steps"].items())
        lines.append(
            f"| {r['data']} | {r['world']} | {r['balance']} | {pct(100 * r['predicted'])} / {pct(100 * r['measured'])} "
            f"| {r['gap']:.1f} / {r['gap_max']:.1f} pts | {r['slowest_s']:.3f} | {pct(100 * r['over_perfect'])} "
            f"| {r['cut']} ({r['cut_tokens']}) | {fit} | {compiled or '-'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
    import torch

    args = parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        for name, data in workloads(args, directory):
            for world in (int(w) for w in args.worlds.split(",")):
                for balance in args.balances.split(","):
                    tag = f"{name}-w{world}-{balance}"
                    t0 = time.perf_counter()
                    steps = rehearse(run_config(args, directory, data, world, balance, tag), world, balance)
                    row = {"data": name, "world": world, "balance": balance, **summarise(steps, args.warmup)}
                    rows.append(row)
                    print(f"{tag}: imbalance {100 * row['predicted']:.1f}% pred / {100 * row['measured']:.1f}% meas, "
                          f"gap {row['gap']:.1f} pts ({time.perf_counter() - t0:.0f} s)", flush=True)
    cuda = args.device != "cpu" and torch.cuda.is_available()
    text = report(args, argv, rows, gpu_line() if cuda else f"{cpu_line()}; {gpu_line('cpu')}")
    print(text)
    write_report(args.out, text)


if __name__ == "__main__":
    main(sys.argv[1:])
