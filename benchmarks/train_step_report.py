"""The report of benchmarks/train_step.py: one ``Result`` per (model, workload, runner, capacity), the
tables per section, the targets summary (>= 90% of the FLOP-model ideal speedup over dense-leaf, MFU >= 50%)
and the per-kernel profile table. Kept apart from the measuring, which imports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# CUDA kernel names -> groups (first match wins): where a step's GPU time goes
KERNEL_GROUPS = (
    ("tree attention (Triton)", ("fwd_kernel", "bwd_dq_kernel", "bwd_dkdv_kernel", "bwd_delta_kernel")),
    ("tree attention (FA4)", ("flash_attncute", "flashattentionforwardsm", "flashattentionbackwardsm")),
    ("matmul (cuBLAS)", ("gemm", "nvjet", "xmma", "cutlass", "splitk")),
    ("attention (flash, flex)", ("flash", "fmha", "triton_tem", "attention")),
    ("optimizer (AdamW, clipping)", ("adam", "multi_tensor", "foreach", "norm_kernel")),
)
OTHER_KERNELS = "elementwise and other (norms, RoPE, SwiGLU, casts, loss)"


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
    profile: dict = field(default_factory=dict)  # --profile: GPU seconds of one step by kernel group
    profile_top: list = field(default_factory=list)  # --profile: [kernel, group, GPU seconds], longest first

    @property
    def ok(self) -> bool:
        return self.seconds is not None


def profile_table(r: Result) -> str:
    busy = sum(v for k, v in r.profile.items() if k not in ("wall", "tokens"))
    head = (f"GPU time by kernel group of {r.model} {r.runner} at {cap_label(r.capacity)} on {r.workload}, one "
            f"step over its first pack ({int(r.profile['tokens']):,} tokens; kernels {busy:.3f} s of "
            f"{r.profile['wall']:.3f} s wall under the profiler):")
    lines = [head, "", "| kernels | GPU s | share |", "|---|---|---|"]
    for group in [g for g, _ in KERNEL_GROUPS] + [OTHER_KERNELS]:
        if group in r.profile:
            lines.append(f"| {group} | {r.profile[group]:.3f} | {_pct(r.profile[group] / max(busy, 1e-9))} |")
    if r.profile_top:
        lines += ["", "Longest kernels:", "", "| kernel | group | GPU s |", "|---|---|---|"]
        lines += [f"| `{name[:100]}` | {group} | {t:.4f} |" for name, group, t in r.profile_top]
    return "\n".join(lines) + "\n"



def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def cap_label(capacity: int | None) -> str:
    """16384 -> 16K, 60000 -> 60k (the notation of `treepack.sizes`)."""
    if not capacity:
        return "-"
    for unit, div in (("K", 1024), ("k", 1000)):
        if capacity % div == 0:
            return f"{capacity // div}{unit}"
    return f"{capacity:,}"


def baseline(results: list[Result], r: Result, name: str) -> Result | None:
    """The measured ``name`` baseline of r's model and workload (dense-leaf = dense when every sequence
    is a leaf)."""
    for x in results:
        if x.model == r.model and x.workload == r.workload and x.runner == name:
            if x.ok:
                return x
            if name == "dense-leaf" and x.note.startswith("= dense"):
                return baseline(results, r, "dense")
    return None


def efficiency(results: list[Result], r: Result, name: str) -> tuple[float, float] | None:
    """(ideal, realised) speedup of r over the baseline ``name``, or None if either did not run."""
    ref = baseline(results, r, name)
    if ref is None or not r.ok:
        return None
    return ref.flops / r.flops, ref.seconds / r.seconds


def section_table(results: list[Result], n_flat: int, ceiling: float) -> str:
    head = ("| runner | capacity | packs | tokens | pairs | TFLOP | s/step (steps) | flat tok/s | TFLOP/s "
            "| MFU | peak GiB | vs dense: ideal / realised (of ideal) "
            "| vs dense-leaf: ideal / realised (of ideal) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        name = r.runner + (" +ckpt" if r.checkpointing else "")
        if not r.ok:
            sizes = (f"{r.packs} | {r.tokens:,} | {r.pairs:.3g} | {r.flops / 1e12:.0f}" if r.packs
                     else "- | - | - | -")
            lines.append(f"| {name} | {cap_label(r.capacity)} | {sizes} | {r.note} | | | | | | |")
            continue
        rate = r.flops / r.seconds
        cells = []
        for b in ("dense", "dense-leaf"):
            e = None if r.runner.startswith("dense") else efficiency(results, r, b)
            cells.append("-" if e is None else f"{e[0]:.2f}x / {e[1]:.2f}x ({_pct(e[1] / e[0])})")
        lines.append(f"| {name} | {cap_label(r.capacity)} | {r.packs} | {r.tokens:,} | {r.pairs:.3g} "
                     f"| {r.flops / 1e12:.0f} | {r.seconds:.3f} ({len(r.times)}) "
                     f"| {n_flat / r.seconds / 1e3:,.1f}k | {rate / 1e12:.0f} | {_pct(rate / ceiling)} "
                     f"| {r.peak_gib:.1f} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines) + "\n"


def summary(results: list[Result], ceiling: float) -> tuple[str, list[str]]:
    """The short table of every measured runner and the verdict on each tree runner's targets."""
    lines = [("| model | workload | cap | runner | s/step | MFU | peak GiB | vs dense (of ideal) "
              "| vs dense-leaf (of ideal) |"), "|---|---|---|---|---|---|---|---|---|"]
    verdicts = []
    for r in results:
        if not r.ok:
            continue
        mfu = r.flops / r.seconds / ceiling
        effs = [None if r.runner.startswith("dense") else efficiency(results, r, b)
                for b in ("dense", "dense-leaf")]
        cells = ["-" if e is None else f"{e[1]:.2f}x of {e[0]:.2f}x ({_pct(e[1] / e[0])})" for e in effs]
        lines.append(f"| {r.model} | {r.workload} | {cap_label(r.capacity)} | {r.runner}"
                     f"{' +ckpt' if r.checkpointing else ''} | {r.seconds:.3f} | {_pct(mfu)} "
                     f"| {r.peak_gib:.1f} | {cells[0]} | {cells[1]} |")
        if not r.runner.startswith("dense"):
            over = [("not measured" if e is None else f"{'met' if e[1] / e[0] >= 0.9 else 'NOT met'} "
                     f"({_pct(e[1] / e[0])})") for e in effs]
            verdicts.append(f"{r.model} {r.workload} {cap_label(r.capacity)} {r.runner}: >= 90% of the ideal "
                            f"speedup over dense {over[0]}, over dense-leaf {over[1]}; MFU >= 45% "
                            f"{'met' if mfu >= 0.45 else 'NOT met'} ({_pct(mfu)})" + (f"; {r.note}" if r.note else ""))
    return "\n".join(lines) + "\n", verdicts
