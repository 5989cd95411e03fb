"""Measure a `SpeedTable` for ``mode = "auto"`` on this device: what a FLOP of each kind costs here.

``auto`` prices each pack's tree and dense-leaf work with docs/design.md §9's FLOP model split in two
(`treepack.train.modes.auto`): linear FLOPs (``6 x params x tokens + 6 x d_model x vocab x predicted``)
at the ``matmul`` rate and attention FLOPs (``12 x layers x heads x head_dim x pairs``) at the rate of
the backend that runs them, plus fixed host costs per model call and per attention call. This script
measures each rate the way the modes run it, forward and backward, after warm-up, median of repeats:

- ``matmul``: a SwiGLU MLP block (gate/up/down, ``--hidden`` x ``--ffn``) over ``--tokens`` tokens;
- ``attention[sdpa]``: `AttentionContext.causal` (one SDPA call per sequence: the dense modes' path)
  over ``--sequences`` equal causal sequences of ``--tokens`` tokens in all;
- ``attention[reference|flex|triton|fa4]``: `AttentionContext.tree` over the same sequences laid out as a
  forest of chains (the tree kernels on the dense modes' exact pairs; the reference backend's rate is
  over every score of its calls, the others' over visible pairs);
- ``layer_call_seconds`` / ``attention_call_seconds``: a one-layer model call on 8 tokens, and one more
  8-token SDPA call, forward and backward (the host's share of small calls).

Usage: python benchmarks/speed_table.py [--device cuda] [--dtype bfloat16] [--out table.json]
Then ``train.speed_table = "table.json"`` (or add it to ``SPEED_TABLES``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import cpu_model, fa4_version, versions

from treepack.train.attention import AttentionContext
from treepack.train.model import Decoder, ModelArgs
from treepack.train.modes.auto import SpeedTable

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn()`` after two warm-up calls (compiles, autotunes, allocator)."""
    fn()
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_rate(args, device, dtype) -> float:
    x = torch.randn(args.tokens, args.hidden, device=device, dtype=dtype, requires_grad=True)
    w = [torch.randn(a, b, device=device, dtype=dtype, requires_grad=True) * 0.02
         for a, b in ((args.hidden, args.ffn), (args.hidden, args.ffn), (args.ffn, args.hidden))]
    w = [t.detach().requires_grad_() for t in w]

    def step():
        y = (torch.nn.functional.silu(x @ w[0]) * (x @ w[1])) @ w[2]
        y.sum().backward()

    return 6.0 * 3 * args.hidden * args.ffn * args.tokens / timed(step, device, args.repeats)


def attention_rate(backend: str, args, device, dtype) -> float:
    n = args.tokens // args.sequences
    lengths = [n] * args.sequences
    T = n * args.sequences
    q = torch.randn(T, args.heads, args.head_dim, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(T, args.kv_heads, args.head_dim, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(T, args.kv_heads, args.head_dim, device=device, dtype=dtype, requires_grad=True)
    ctx = AttentionContext.causal(lengths, "sdpa" if backend == "sdpa" else backend, device=device)

    def step():
        ctx.attend(q, k, v, None).sum().backward()

    pairs = args.sequences * (n * n if backend == "reference" else n * (n + 1) // 2)
    return 12.0 * args.heads * args.head_dim * pairs / timed(step, device, args.repeats)


def host_costs(args, device, dtype) -> tuple[float, float]:
    margs = ModelArgs.for_family("qwen3", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=1,
                                 num_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=args.head_dim)
    model = Decoder.random_init(margs, dtype=dtype if dtype != torch.bfloat16 else torch.float32, device=device)
    ids = torch.arange(8, device=device) % 64

    def call(sequences: int):
        def step():
            with torch.autocast(device.type, dtype=dtype, enabled=dtype == torch.bfloat16):
                attn = AttentionContext.causal([8] * sequences, "sdpa", device=device)
                model(ids.repeat(sequences), torch.arange(8, device=device).repeat(sequences), attn).hidden_TD.sum().backward()
        return step

    one = timed(call(1), device, max(args.repeats, 20))
    two = timed(call(2), device, max(args.repeats, 20))
    return one, max(two - one, 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="float64 | float32 | bfloat16 (default: bf16 on CUDA, float64 on CPU)")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per measurement (default 16384 CUDA, 2048 CPU)")
    ap.add_argument("--sequences", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=3072)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--backends", default=None, help="comma-separated (default: sdpa,triton,flex and fa4 where installed on CUDA; sdpa,reference on CPU)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--name", default=None)
    ap.add_argument("--out", type=Path, default=None, help="write the table as JSON here")
    args = ap.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype_name = args.dtype or ("bfloat16" if cuda else "float64")
    dtype = DTYPES[dtype_name]
    args.tokens = args.tokens or (16384 if cuda else 2048)
    if args.backends:
        backends = args.backends.split(",")
    elif cuda:
        from treepack.kernels.tree_attention.fa4 import fa4_importable

        backends = ["sdpa", "triton", "flex"] + (["fa4"] if fa4_importable() else [])
    else:
        backends = ["sdpa", "reference"]
    where = torch.cuda.get_device_name(device) if cuda else f"{cpu_model()}, {torch.get_num_threads()} threads"
    t0 = time.perf_counter()
    matmul = matmul_rate(args, device, dtype)
    attention = {b: attention_rate(b, args, device, dtype) for b in backends}
    layer_call, attention_call = host_costs(args, device, dtype)
    table = SpeedTable(
        name=args.name or f"{torch.cuda.get_device_name(device) if cuda else 'CPU'} {dtype_name}",
        matmul=matmul, attention=attention, layer_call_seconds=layer_call, attention_call_seconds=attention_call,
        source=(f"benchmarks/speed_table.py on {where}, {versions('torch', 'triton') + fa4_version() if cuda else versions('torch')}, "
                f"{dtype_name}, {args.tokens} tokens "
                f"in {args.sequences} sequences, {args.heads}/{args.kv_heads} heads of {args.head_dim}, "
                f"MLP {args.hidden}x{args.ffn}, median of {args.repeats}"))
    print(f"{table.name} ({time.perf_counter() - t0:.1f} s): matmul {matmul / 1e12:.4g} TFLOP/s; attention "
          + ", ".join(f"{b} {r / 1e12:.4g}" for b, r in attention.items())
          + f" TFLOP/s; host {layer_call * 1e3:.3g} ms per layer call, {attention_call * 1e3:.3g} ms per attention call")
    print(json.dumps(table.to_json()))
    if args.out:
        args.out.write_text(json.dumps(table.to_json(), indent=2) + "\n")


if __name__ == "__main__":
    main()
