"""treepack.hf on a Hugging Face model: bf16 agreement, and speed against per-sequence and per-leaf SDPA.

One run on one GPU (random-init Qwen3-0.6B shape: 28 layers, d 1024, 16/8 heads of 128, vocab 151,936,
tied), bf16 autocast over float32 weights (what ``treepack train`` does), on real and synthetic rollouts:

- **agreement**: one pack's log-probs and the gradients of a GRPO loss, tree (``treepack.hf``) and
  per-sequence (the model's own SDPA forward) in bf16, each against the float32 per-sequence run; the
  tree's error must be within 2x the per-sequence run's (log-probs max and mean, gradient relative L2);
- **self-check**: the first-use check's measured differences in bf16, and that a planted causal-mask
  patch (``create_causal_mask`` returning None in the model's module) makes it fail;
- **speed**: forward + backward of the GRPO loss over a whole workload: ``hf-tree`` (treepack.hf packs
  at the capacity), ``hf-seq`` (each sequence alone through the model's SDPA forward), ``hf-leaf`` (only
  sequences that are not a prefix of another, their rows merged), and ``ours-tree`` (treepack's own
  decoder, same weights, tree mode) — the number behind ``model.source = "auto"``.

    python benchmarks/hf.py --out benchmarks/results/$(date +%F)-hf.md
    python benchmarks/hf.py --size small --out ...  # CPU: a 4-layer d-256 Qwen3, smaller workloads
    python benchmarks/hf.py --tiny        # CPU smoke run on a tiny model (what the test suite runs)
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import command_line, cpu_line, gpu_line, ratio, today, versions, write_report

ROOT = Path(__file__).resolve().parents[1]


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


@dataclass
class Workload:
    name: str
    r: object  # Rollouts
    note: str


def agreement_workload(tiny: bool) -> Workload:
    """A few real tau-bench records (one task's first turns: a chain of growing prefixes) as one pack."""
    from treepack.io.ingest import read_rollouts

    tb = read_rollouts([str(ROOT / "treepack/datasets/samples/tau_bench_slice.parquet")])
    lengths = tb.lengths
    idx = [i for i in range(len(tb)) if tb.groups[i] == 0]
    keep, total = [], 0
    for i in idx:
        if total + lengths[i] > (2_000 if tiny else 8_000):
            break
        keep.append(i)
        total += int(lengths[i])
    r = tb.select(np.asarray(keep or idx[:1]))
    return Workload("agreement", _crop(r, 96) if tiny else r, "tau-bench task 0, first turns")


def load_workloads(tiny: bool, small: bool = False) -> list[Workload]:
    from treepack.io.ingest import read_rollouts

    out = []
    tb = read_rollouts([str(ROOT / "treepack/datasets/samples/tau_bench_slice.parquet")])
    tasks = 1 if tiny or small else 3
    idx = np.flatnonzero(tb.groups < tasks)
    if tiny:
        idx = idx[:6]
    out.append(Workload("tau-bench", tb.select(idx), f"real tau-bench retail rollouts, first {tasks} tasks"))
    gm = read_rollouts([str(ROOT / "treepack/datasets/samples/grpo_math.jsonl.gz")])
    answers = 4 if tiny else 8 if small else 16
    out.append(Workload("grpo-math", gm.select(np.arange(answers)), f"synthetic math GRPO: one problem x {answers} answers"))
    if tiny:  # keep the smoke run small: crop every sequence
        for w in out:
            w.r = _crop(w.r, 96)
    return out


def _crop(r, n: int):
    from treepack.io.sequences import rollouts_of

    arrays = [r.sequence(i)[-n:].astype(np.int64) for i in range(len(r))]  # the ends differ
    arrays = arrays + [a[: n // 2] for a in arrays[:2]]  # plus prefix-of-another sequences
    out = rollouts_of(arrays)
    return out


def compact(workloads: list[Workload]) -> int:
    """Tiny runs: renumber token ids to 0..n-1 (a small vocabulary)."""
    ids = np.unique(np.concatenate([w.r.tokens for w in workloads]))
    for w in workloads:
        w.r.tokens = np.searchsorted(ids, w.r.tokens).astype(np.int32)
    return len(ids)


SHAPES = {
    "tiny": "tiny (2 layers, d 64)",
    "small": "small (4 layers, d 256, 8/4 heads of 32, FFN 768, vocabulary compacted to the data's ids, tied)",
    "0.6b": "0.6B shape (28 layers, d 1024, 16/8 heads of 128, vocab 151,936, tied)",
}


def build_model(size: str, vocab: int, dev: torch.device):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if size == "tiny":
        cfg = Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
    elif size == "small":
        cfg = Qwen3Config(vocab_size=vocab, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                          num_attention_heads=8, num_key_value_heads=4, head_dim=32, tie_word_embeddings=True)
    else:
        cfg = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                          num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                          max_position_embeddings=40960, rope_theta=1_000_000.0)
    torch.manual_seed(0)
    with torch.device(dev):
        model = Qwen3ForCausalLM._from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)
    return model.train()


# --------------------------------------------------------------------------------------------------
# Runners: one call = forward + backward of the GRPO loss (token mean, on-policy) over the workload


@dataclass
class Job:
    name: str
    packs: list  # treepack Packs of the workload at the capacity (every sequence once)
    seqs: list  # one single-sequence Pack per input sequence (the per-sequence runs)
    leaves: list  # (leaf Pack, input indices of the sequences whose tokens are a prefix of that leaf)
    totals: object  # BatchTotals over the workload
    flat_tokens: int
    tree_tokens: int
    leaf_tokens: int
    n_sequences: int


def make_job(w: Workload, capacity: int) -> Job:
    from treepack.hf.parallel import pack_totals
    from treepack.pack.layout import build_pack
    from treepack.pack.strategies import pack_sequences

    r = w.r
    r.advantages = np.random.default_rng(0).standard_normal(len(r))
    packs = [build_pack(r, idx) for idx in pack_sequences(r, capacity).packs]
    whole = build_pack(r)  # the workload as one tree: which sequences are leaves, which leaf covers which
    end = np.asarray(whole.subtree_end, dtype=np.int64)
    last = np.asarray(whole.seq_leaf, dtype=np.int64)
    leaf_rank, leaf_last = {}, []
    for s in np.flatnonzero(end[last] == last + 1).tolist():
        if int(last[s]) not in leaf_rank:
            leaf_rank[int(last[s])] = len(leaf_last)
            leaf_last.append(int(last[s]))
    leaf_last = np.asarray(leaf_last)
    covered = [[] for _ in leaf_last]
    for s in range(whole.n_sequences):  # the first leaf below s's last token has s's tokens as a prefix
        k = int(np.flatnonzero((leaf_last >= last[s]) & (leaf_last < end[last[s]]))[0])
        covered[k].append(int(whole.seq_index[s]))
    leaves = [(build_pack(r, [max(c, key=lambda i: r.lengths[i])]), c) for c in covered]
    return Job(name=w.name, packs=packs, seqs=[build_pack(r, [i]) for i in range(len(r))], leaves=leaves,
               totals=pack_totals(packs), flat_tokens=int(r.n_tokens),
               tree_tokens=sum(int(p.n_real) for p in packs),
               leaf_tokens=sum(int(p.n_real) for p, _ in leaves), n_sequences=len(r))


def _loss(lps, b, totals):
    from treepack.hf.losses import policy_loss

    return policy_loss(lps, None, b.advantages, b.loss_masks(), totals=totals)


def run_tree(model, job: Job, attention: str = "auto", keep: list | None = None) -> float:
    """One tree forward + backward per pack (``keep`` collects the detached log-probs by input index)."""
    from treepack.hf.batch import TreeBatch
    from treepack.hf.forward import pack_logprobs

    total = 0.0
    for p in job.packs:
        b = TreeBatch.from_pack(p)
        lps = pack_logprobs(model, b, attention=attention).per_sequence()
        loss = _loss(lps, b, job.totals)
        loss.backward()
        total += float(loss.detach())
        if keep is not None:
            keep += [(int(i), lp.detach()) for i, lp in zip(p.seq_index.tolist(), lps)]
    return total


def run_seq(model, job: Job, keep: list | None = None) -> float:
    """Every sequence alone through the model's own attention, one forward + backward each."""
    from treepack.hf.batch import TreeBatch
    from treepack.hf.forward import sequence_logprobs

    total = 0.0
    for i, p in enumerate(job.seqs):
        b = TreeBatch.from_pack(p)
        lps = sequence_logprobs(model, b)
        loss = _loss(lps, b, job.totals)
        loss.backward()
        total += float(loss.detach())
        if keep is not None:
            keep.append((i, lps[0].detach()))
    return total


def run_leaf(model, job: Job) -> float:
    """Only the leaf sequences, one forward + backward each; every sequence's rows read their leaf's
    log-probs (a prefix-of-another or duplicate sequence costs nothing more)."""
    from treepack.hf.batch import TreeBatch
    from treepack.hf.forward import sequence_logprobs
    from treepack.hf.losses import policy_loss

    total = 0.0
    for leaf, covered in job.leaves:
        (lp,) = sequence_logprobs(model, TreeBatch.from_pack(leaf))
        lps = [lp[: int(job.seqs[i].n_real) - 1] for i in covered]
        bs = [TreeBatch.from_pack(job.seqs[i]) for i in covered]
        loss = policy_loss(lps, None, torch.cat([b.advantages for b in bs]), [b.loss_masks()[0] for b in bs],
                           totals=job.totals)
        loss.backward()
        total += float(loss.detach())
    return total


def ours_model(hf, dev):
    """treepack's own decoder with the HF model's weights (same function, compiled regions on CUDA)."""
    from treepack.train.model import Decoder, ModelArgs

    args = ModelArgs.from_hf_config(hf.config.to_dict())
    with torch.device("meta"):
        dec = Decoder(args)
    state = {k: v for k, v in hf.state_dict().items() if k in dict(dec.state_dict())}
    dec.load_state_dict(state, strict=True, assign=True)
    return dec.to(dev)


def run_ours(dec, job: Job) -> float:
    from treepack.train.losses import LossRows, Objective
    from treepack.train.modes import make_mode

    mode, objective = make_mode("tree"), Objective("grpo", "token")
    total = 0.0
    for p in job.packs:
        out = mode(dec, p, LossRows.from_pack(p), objective, job.totals)
        out.backward()
        total += float(out.loss.detach())
    return total


def time_runners(fns: dict, dev, reps: int, deadline: float, reset) -> dict:
    """name -> (median seconds or None, calls timed, warm-up seconds). Every runner is warmed up (compiles,
    autotunes) first, then the timed calls go round robin, so that a slow phase of a shared machine hits
    every runner alike. ``reset`` runs after each call (drops gradients)."""
    out = {name: [None, [], 0.0] for name in fns}
    for name, fn in fns.items():
        if time.perf_counter() > deadline:
            break
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        reset()
        out[name][2] = time.perf_counter() - t0
    for _ in range(reps):
        for name, fn in fns.items():
            spent = out[name][1][-1] if out[name][1] else out[name][2]
            if not out[name][2] or time.perf_counter() + spent > deadline:
                continue
            t0 = time.perf_counter()
            fn()
            _sync(dev)
            out[name][1].append(time.perf_counter() - t0)
            reset()
    return {n: (float(np.median(t)) if t else None, len(t), w) for n, (_, t, w) in out.items()}


# --------------------------------------------------------------------------------------------------
# Agreement and self-check


def _grads(model) -> torch.Tensor:
    return torch.cat([p.grad.detach().float().flatten() for p in model.parameters() if p.grad is not None])


def agreement(model, job: Job, dev, low: torch.dtype) -> dict:
    """Log-probs and GRPO gradients of the job's first pack: tree and per-sequence in ``low`` precision
    (autocast), each against the per-sequence run in float32 (float64 on CPU)."""

    p = job.packs[0]

    def run(kind: str, autocast: bool):
        model.zero_grad(set_to_none=True)
        ctx = torch.autocast(dev.type, dtype=low) if autocast else contextlib.nullcontext()
        keep: list = []
        with ctx:
            (run_tree if kind == "tree" else run_seq)(model, job, keep=keep)
        lps = [lp for _, lp in sorted(keep, key=lambda x: x[0])]
        return torch.cat([lp.double() for lp in lps]), _grads(model)

    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        ref_lp, ref_g = run("seq", autocast=False)
    else:
        model.double()
        ref_lp, ref_g = run("seq", autocast=False)
        model.float()
    ref_g = ref_g.double()
    out = {"rows": int(ref_lp.numel()), "tokens": int(p.n_real), "flat": job.flat_tokens}
    autocast = dev.type == "cuda"
    for kind in ("seq", "tree"):
        lp, g = run(kind, autocast=autocast)
        err = (lp - ref_lp).abs()
        out[kind] = {"lp_max": float(err.max()), "lp_mean": float(err.mean()),
                     "grad_rel": float((g.double() - ref_g).norm() / ref_g.norm())}
    model.zero_grad(set_to_none=True)
    ok = all(out["tree"][k] <= 2 * out["seq"][k] + 1e-12 for k in ("lp_max", "lp_mean", "grad_rel"))
    out["ok"] = ok
    return out


def self_check_run(model, job: Job) -> dict:
    """The first-use self-check as users get it, then with a planted causal-mask patch."""
    import importlib

    from treepack.hf.check import SelfCheckError, self_check

    arrays = [np.asarray(p.sequence_tokens(s), dtype=np.int64) for p in job.packs[:1] for s in range(p.n_sequences)]
    res = {"clean": self_check(model, arrays)}
    mod = importlib.import_module(type(model).__module__)
    saved = mod.create_causal_mask
    mod.create_causal_mask = lambda *a, **k: None  # what a broken flash path / patch does
    try:
        self_check(model, arrays)
        res["planted"] = "NOT caught"
    except SelfCheckError as exc:
        res["planted"] = f"caught: {str(exc)[:300]}"
    finally:
        mod.create_causal_mask = saved
    return res


def paths_check(dev) -> list[str]:
    """Tiny float32 models through the backends ``auto`` picks on this device, against their own forward:
    Qwen3 with head dim 64 (Triton on CUDA), Gemma 2 with soft-capping and a 4-token window (FlexAttention
    on CUDA). Max |log-prob diff| and worst relative gradient diff."""
    import transformers

    from treepack.hf import token_logprobs

    out = []
    cases = {"qwen3 (head dim 64)": ("Qwen3Config", {"head_dim": 64}),
             "gemma2 (soft-cap 2.0, window 4)": ("Gemma2Config", {"head_dim": 64, "sliding_window": 4,
                                                                 "attn_logit_softcapping": 2.0,
                                                                 "final_logit_softcapping": 3.0})}
    rng = np.random.default_rng(0)
    trunk = rng.integers(0, 64, 40).tolist()
    seqs = [trunk + rng.integers(0, 64, 9).tolist(), trunk[:25] + rng.integers(0, 64, 30).tolist(), trunk[:12],
            rng.integers(0, 64, 20).tolist()]
    for label, (cls, extra) in cases.items():
        cfg = getattr(transformers, cls)(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, **extra)
        torch.manual_seed(0)
        # eager where the model soft-caps: some transformers releases run Gemma 2 on sdpa without the cap
        impl = "eager" if extra.get("attn_logit_softcapping") else None
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=impl).to(dev)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0, 0.1)
        model.zero_grad(set_to_none=True)
        tree = token_logprobs(model, seqs)
        sum(t.sum() for t in tree).backward()
        g_tree = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        ref = []
        for q in seqs:
            ids = torch.tensor(q, device=dev)[None]
            ref.append(torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1).gather(1, ids[0, 1:, None])[:, 0])
        sum(r.sum() for r in ref).backward()
        lp = max(float((t.detach() - r.detach()).abs().max()) for t, r in zip(tree, ref))
        g = max(float((g_tree[n] - p.grad).abs().max()) / max(float(p.grad.abs().max()), 1e-12)
                for n, p in model.named_parameters())
        from treepack.hf.forward import prepare_model
        from treepack.kernels.tree_attention.api import triton_unsupported_reason

        q = torch.zeros(1, 4, 64, device=dev)
        backend = ("reference" if dev.type != "cuda" or "gemma2" in label else  # float32 soft-cap: reference
                   ("triton" if triton_unsupported_reason(q) is None else "flex"))
        out.append(f"| {label} | {backend} | {prepare_model(model).head} | {lp:.2e} | {g:.2e} |")
    return out


# --------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run on a tiny model (= --size tiny)")
    ap.add_argument("--size", choices=list(SHAPES), default=None, help="model size (default: 0.6b on CUDA)")
    ap.add_argument("--capacity", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--deadline", type=float, default=400.0, help="seconds; timings past it are skipped")
    ap.add_argument("--runners", default="hf-seq,hf-leaf,hf-tree,ours-tree")
    ap.add_argument("--sections", default="agreement,check,backends,speed",
                    help="comma-separated subset of agreement, check, backends, speed")
    ap.add_argument("--logprob-kernels", default="auto", choices=("auto", "inductor"),
                    help="the head's log-prob passes: auto (Triton kernels on CUDA) or inductor (the reference; A/B)")
    ap.add_argument("--out", default=None)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(argv)
    from treepack.train import losses

    losses.LOGPROB_KERNELS = args.logprob_kernels
    t_start = time.perf_counter()
    deadline = t_start + args.deadline
    size = "tiny" if args.tiny else args.size or ("0.6b" if torch.cuda.is_available() else "small")
    dev = torch.device("cuda" if size == "0.6b" and torch.cuda.is_available() else "cpu")
    workloads = load_workloads(size == "tiny", size == "small")
    agree_w = agreement_workload(size == "tiny")
    vocab = 151936 if size == "0.6b" else compact([*workloads, agree_w])
    model = build_model(size, vocab, dev)
    capacity = 256 if size == "tiny" else args.capacity
    jobs = [make_job(w, capacity) for w in workloads]
    agree_job = make_job(agree_w, 10**9)
    shape = SHAPES[size]
    import transformers

    hardware = (f"1x {gpu_line(dev)}" if dev.type == "cuda" or size == "tiny"
                else f"{cpu_line()} (shared with other jobs); {versions('torch')}")
    lines = [f"# treepack.hf on a Hugging Face Qwen3 model, {today()}", "",
             f"- hardware: {hardware}, transformers {transformers.__version__}",
             f"- command: `{command_line(__file__, argv)}`",
             f"- model: random-init Qwen3 {shape}, float32 weights" + (", bf16 autocast" if dev.type == "cuda" else ""),
             "- workloads: " + "; ".join(f"{w.name}: {w.note}" for w in workloads)
             + " (treepack/datasets/samples/tau_bench_slice.parquet, treepack/datasets/samples/grpo_math.jsonl.gz)", ""]
    print("\n".join(lines), flush=True)
    low = torch.bfloat16 if dev.type == "cuda" else torch.float32
    sections = set(args.sections.split(","))
    agree = {"ok": True}
    if "agreement" in sections:
        agree = agreement(model, agree_job, dev, low)
        ref_name = "float32 (TF32 off)" if dev.type == "cuda" else "float64"
        lines += [(f"## Agreement: one pack of {agree['tokens']:,} tree tokens ({agree['flat']:,} flat, "
                  f"{agree['rows']:,} log-probs), GRPO loss gradients"), "",
                  (f"Errors against the per-sequence run in {ref_name}; pass = the tree's error within 2x the "
                  f"per-sequence run's in every column: **{'PASS' if agree['ok'] else 'FAIL'}**"), "",
                  "| run | log-prob max abs err | log-prob mean abs err | gradient rel L2 err |", "|---|---|---|---|"]
        for kind, label in (("seq", f"per-sequence, model's SDPA ({str(low).removeprefix('torch.')})"),
                            ("tree", f"treepack.hf tree ({str(low).removeprefix('torch.')})")):
            a = agree[kind]
            lines.append(f"| {label} | {a['lp_max']:.3e} | {a['lp_mean']:.3e} | {a['grad_rel']:.3e} |")
        print("\n".join(lines[-8:]), flush=True)
    ctx = torch.autocast(dev.type, dtype=low) if dev.type == "cuda" else contextlib.nullcontext()
    if "check" in sections:
        with ctx:
            check = self_check_run(model, agree_job)
        c = check["clean"]
        lines += ["", "## First-use self-check", "",
                  (f"- clean, {c['dtype']}: log-prob max |diff| {c['logprob_max_abs_diff']:.3e} (tolerance "
                  f"{c['tolerance'][0]:g}), attention max diff / max|v| {c['attention_max_rel_diff']:.3e} (tolerance "
                  f"{c['tolerance'][1]:g}), reference `{c['reference']}`"),
                  f"- planted `create_causal_mask -> None` patch: {check['planted']}"]
        print("\n".join(lines[-4:]), flush=True)
    if "backends" in sections:
        lines += ["", "## Backends on this device (tiny float32 models, tree vs the model's own forward)", "",
                  ("Checks the attention and head paths `auto` picks here (CUDA: Triton, FlexAttention for soft-cap "
                   "and windows; CPU: the pure-torch references)."), "",
                  "| model | attention backend | head | log-prob max abs diff | gradient max rel diff |",
                  "|---|---|---|---|---|", *paths_check(dev)]
        print("\n".join(lines[-6:]), flush=True)
    if "speed" not in sections:
        jobs = []
    runners = args.runners.split(",")
    dec = ours_model(model, dev) if "ours-tree" in runners else None
    lines += ["", "## Speed: forward + backward of a GRPO loss (token mean) over the whole workload", "",
              ("hf-seq: every sequence alone through the model's SDPA forward; hf-leaf: only sequences that are "
              "not a prefix of another (their rows merged); hf-tree: treepack.hf packs; ours-tree: treepack's "
              "own decoder (same weights, compiled regions on CUDA), tree mode. Median of the timed calls after "
              "one warm-up each; the timed calls go round robin over the runners."), ""]
    for job in jobs:
        lines += [(f"### {job.name}: {job.n_sequences} sequences, N_flat {job.flat_tokens:,}, tree tokens "
                  f"{job.tree_tokens:,} in {len(job.packs)} packs at {capacity:,}, leaf tokens {job.leaf_tokens:,}"),
                  "", "| runner | tokens forwarded | s/step (timed) | warm-up s | flat tok/s | vs hf-seq | vs hf-leaf |",
                  "|---|---|---|---|---|---|---|"]
        fns = {"hf-tree": lambda j=job: run_tree(model, j), "hf-seq": lambda j=job: run_seq(model, j),
               "hf-leaf": lambda j=job: run_leaf(model, j), "ours-tree": lambda j=job: run_ours(dec, j)}
        tokens = {"hf-tree": job.tree_tokens, "hf-seq": job.flat_tokens, "hf-leaf": job.leaf_tokens,
                  "ours-tree": job.tree_tokens}

        def reset():
            model.zero_grad(set_to_none=True)
            if dec is not None:
                dec.zero_grad(set_to_none=True)

        with ctx:
            timed = time_runners({n: fns[n] for n in runners}, dev, args.reps, deadline, reset)
        times = {n: t[0] for n, t in timed.items() if t[0] is not None}
        for name in runners:
            sec, n, warm = timed[name]
            if sec is None:
                lines.append(f"| {name} | {tokens[name]:,} | skipped (deadline) | | | | |")
            else:
                lines.append(f"| {name} | {tokens[name]:,} | {sec:.3f} ({n}) | {warm:.1f} | "
                             f"{job.flat_tokens / sec / 1e3:.1f}k | {ratio(times.get('hf-seq'), sec)} | "
                             f"{ratio(times.get('hf-leaf'), sec)} |")
            print(lines[-1], flush=True)
        lines.append("")
    lines.append(f"Total run time {time.perf_counter() - t_start:.0f} s.")
    write_report(Path(args.out) if args.out else None, "\n".join(lines) + "\n")
    return 0 if agree["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
