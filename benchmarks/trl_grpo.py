"""TRL's GRPO training step with and without treepack: milliseconds per step and peak memory on one GPU.

`treepack.hf.trl.TreeGRPOTrainer` is TRL's ``GRPOTrainer`` with its log-prob forward tree-packed: the G
completions of a prompt share the prompt once instead of G times, and the rows lose their padding. How much
that buys depends on the shape of a step: with prompts of 1K-4K tokens and completions of 256-1K, a group of
G = 8 is about 8 x 3.2K = 25.6K real tokens, padded by TRL to about 8 x 3.5K = 28K (more prompts per step pad
every row to the longest prompt), and 2.6K + 8 x 640 = 7.7K tree tokens: 3.6x fewer than TRL forwards; at
G = 16, 56.6K against 12.8K, 4.4x. This script measures what a TRL user gets from it.

Generation is the same with or without treepack (and a random model's 1K-token ``generate`` is slow and
meaningless), so each step is TRL's training work on a prepared batch: the dict that TRL 1.16's
``_generate_and_score_completions`` returns, built from synthetic tokens (each group of G rows shares one
prompt; prompts padded on the left and completions on the right, by TRL's own ``pad``; GRPO advantages from
random rewards, normalised per group). One timed step is

- **scoring**: the no-grad passes TRL runs before the loss, through the trainer's
  ``_get_per_token_logps_and_entropies`` with TRL's ``batch_size`` (= ``per_device_train_batch_size``): the
  old policy's log-probs (TRL computes them with vLLM importance sampling or ``num_iterations`` > 1;
  ``--no-old-logps`` leaves them out) and the reference model's (``beta`` > 0; ``--beta 0`` leaves them out);
- **train**: ``trainer.compute_loss(model, inputs)`` (TRL's default ``dapo`` loss, entropies included),
  ``accelerator.backward``, gradient clipping at ``max_grad_norm`` and the optimizer step (TRL's AdamW).

Both trainers load the same random-init checkpoint (Qwen3-0.6B shape: 28 layers, d 1024, 16/8 heads of 128,
FFN 3072, vocabulary 151,936, tied embeddings, SDPA attention; float32 weights and ``bf16=True``: TRL's
defaults, the model prepared by accelerate as ``trainer.train()`` does, so its forward runs under bf16
autocast) and score the same batch. Gradient checkpointing is off unless a config says ``:gc`` (TRL's own
default is on). Reported per config: median ms per step of the timed steps after the warm-up (CUDA
synchronised around each part), the peak of ``torch.cuda.max_memory_allocated`` over the timed steps (reset
per variant, each variant in its own trainer) and the memory held before them, tokens per step, the speed-up,
and agreement: the largest |difference| of the loss and of TRL's entropy metric over all steps, of the scored
log-probs (first step, completion tokens) and of the gradient norm (relative, over all steps).

Memory, measured on CPU with saved-tensor hooks: without checkpointing a Qwen3-0.6B forward under bf16
autocast keeps about 92 KB per token per layer for its backward, 2.6 MB per token over 28 layers, so 40K
padded tokens need about 105 GB on top of the 12 GB of weights, gradients, AdamW state and reference model.
The default GPU configs are sized for that: one prompt per step without checkpointing (seed 0 draws G 8: 37K
padded tokens, about 100 GB for TRL; G 16: 56K, about 145 GB, which may not fit for TRL: an out-of-memory
variant is reported as OOM and the run goes on), and 4 and 2 prompts with checkpointing (163K and 145K padded
tokens; about 4 KB per token per layer kept, plus one layer's activations while it is recomputed).

    python benchmarks/trl_grpo.py --out benchmarks/results/$(date +%F)-trl-grpo-h200.md
    python benchmarks/trl_grpo.py --configs 8x2,16x1:gc --steps 3   # GxPROMPTS[:gc], comma-separated
    python benchmarks/trl_grpo.py --tiny       # CPU smoke run: a tiny Qwen3, short prompts, float32
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import command_line, gpu_line, ratio, today, versions, write_report

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "treepack" / "datasets" / "samples" / "chat_tokenizer"
GPU_CONFIGS = "8x1,16x1,8x4:gc,16x2:gc"
TINY_CONFIGS = "4x2,8x1,4x2:gc"
GiB = 2**30


@dataclass(frozen=True)
class StepConfig:
    """One table block: G completions per prompt, ``prompts`` prompts per step, optional checkpointing."""

    G: int
    prompts: int
    checkpointing: bool

    @property
    def rows(self) -> int:
        return self.G * self.prompts

    @property
    def label(self) -> str:
        return f"G {self.G} x {self.prompts} prompt{'s' if self.prompts > 1 else ''}" + (
            ", checkpointing" if self.checkpointing else "")


def parse_configs(text: str) -> list[StepConfig]:
    """``8x1,16x2:gc`` -> StepConfigs (``:gc``: gradient checkpointing on)."""
    out = []
    for item in text.split(","):
        spec, _, flag = item.strip().partition(":")
        if flag not in ("", "gc"):
            raise argparse.ArgumentTypeError(f"config {item!r}: the only suffix is ':gc', got ':{flag}'")
        try:
            g, p = (int(x) for x in spec.lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"config {item!r}: expected GxPROMPTS like 8x2") from None
        if g < 2 or p < 1:
            raise argparse.ArgumentTypeError(f"config {item!r}: G must be >= 2 and PROMPTS >= 1")
        out.append(StepConfig(g, p, flag == "gc"))
    return out


def parse_range(text: str) -> tuple[int, int]:
    """``1K-4K`` or ``1024-4096`` -> (1024, 4096), inclusive."""
    def one(s: str) -> int:
        s = s.strip().upper()
        return int(float(s[:-1]) * 1024) if s.endswith("K") else int(s)

    try:
        lo, hi = (one(x) for x in text.split("-"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"length range {text!r}: expected LO-HI like 1K-4K") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"length range {text!r}: need 1 <= LO <= HI")
    return lo, hi


# --------------------------------------------------------------------------------------------------
# The model and the batch


def save_model(path: Path, tiny: bool, device: torch.device) -> tuple[Path, int, str]:
    """A random-init Qwen3 (0.6B shape, or tiny) saved with the bundled tokenizer; (path, vocab, shape)."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    if tiny:
        cfg = Qwen3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
        shape = f"tiny (2 layers, d 64, 4/2 heads of 16, FFN 128, vocab {len(tok):,}, tied)"
    else:
        cfg = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                          num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                          max_position_embeddings=40960, rope_theta=1_000_000.0)
        shape = "Qwen3-0.6B shape (28 layers, d 1024, 16/8 heads of 128, FFN 3072, vocab 151,936, tied)"
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM._from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    del model
    return path, cfg.vocab_size, shape


@dataclass
class Batch:
    """A step's rows as TRL pads them: prompts on the left, completions on the right."""

    prompt_ids_BP: torch.Tensor
    prompt_mask_BP: torch.Tensor
    completion_ids_BC: torch.Tensor
    completion_mask_BC: torch.Tensor
    advantages_B: torch.Tensor
    prompt_lengths: list[int]  # one per prompt
    completion_lengths: list[int]  # one per row

    @property
    def padded_tokens(self) -> int:
        return self.prompt_ids_BP.numel() + self.completion_ids_BC.numel()

    @property
    def real_tokens(self) -> int:
        return int(self.prompt_mask_BP.sum()) + int(self.completion_mask_BC.sum())

    def tree_tokens(self) -> int:
        """Tokens of the rows' prefix tree (what one tree forward over the whole step runs)."""
        from treepack.hf.batch import plan_packs

        ids = torch.cat([self.prompt_ids_BP, self.completion_ids_BC], 1).cpu()
        mask = torch.cat([self.prompt_mask_BP, self.completion_mask_BC], 1).bool().cpu()
        arrays = [row[m].numpy() for row, m in zip(ids, mask)]
        return sum(int(p.n_real) for p in plan_packs(arrays, None))


def make_batch(cfg: StepConfig, prompt_range, completion_range, vocab: int, pad_id: int, seed: int,
               device: torch.device) -> Batch:
    """Random tokens: ``cfg.prompts`` prompts (lengths uniform in ``prompt_range``), each repeated G times with
    G completions (lengths uniform in ``completion_range``); rewards N(0, 1) normalised per group as TRL does."""
    from trl.trainer.utils import pad

    rng = np.random.default_rng(seed)
    prompts, completions, prompt_lengths = [], [], []
    for _ in range(cfg.prompts):
        n = int(rng.integers(prompt_range[0], prompt_range[1] + 1))
        prompt_lengths.append(n)
        ids = torch.as_tensor(rng.integers(0, vocab, n))  # the masks, not the ids, mark padding
        for _ in range(cfg.G):
            m = int(rng.integers(completion_range[0], completion_range[1] + 1))
            prompts.append(ids)
            completions.append(torch.as_tensor(rng.integers(0, vocab, m)))
    reward_PG = torch.as_tensor(rng.standard_normal((cfg.prompts, cfg.G)), dtype=torch.float32)
    advantages_B = ((reward_PG - reward_PG.mean(1, keepdim=True)) / (reward_PG.std(1, keepdim=True) + 1e-4)).reshape(-1)
    ones = [torch.ones(len(x), dtype=torch.long) for x in prompts]
    c_ones = [torch.ones(len(x), dtype=torch.long) for x in completions]
    return Batch(prompt_ids_BP=pad(prompts, pad_id, "left").to(device),
                 prompt_mask_BP=pad(ones, 0, "left").to(device),
                 completion_ids_BC=pad(completions, pad_id, "right").to(device),
                 completion_mask_BC=pad(c_ones, 0, "right").to(device),
                 advantages_B=advantages_B.to(device), prompt_lengths=prompt_lengths,
                 completion_lengths=[len(c) for c in completions])


# --------------------------------------------------------------------------------------------------
# One variant: a trainer, its warm-up and timed steps


@dataclass
class Run:
    name: str
    scoring_ms: list[float] = field(default_factory=list)
    train_ms: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    entropies: list[float] = field(default_factory=list)  # TRL's logged entropy metric, one per loss call
    ref_logps: torch.Tensor | None = None  # first step's reference (or old-policy) log-probs, on the CPU
    held_gib: float | None = None  # allocated before the timed steps (weights, reference, optimizer state)
    peak_gib: float | None = None
    error: str = ""

    def median(self, values: list[float]) -> float | None:
        return statistics.median(values) if values else None

    @property
    def step_ms(self) -> float | None:
        return self.median([a + b for a, b in zip(self.scoring_ms, self.train_ms)])


def reward_zero(completions, **kwargs) -> list[float]:
    return [0.0] * len(completions)


def make_trainer(cls, model_dir: Path, cfg: StepConfig, args, out_dir: Path, device: torch.device):
    """A GRPOTrainer (or subclass) as a user builds one; its model prepared by accelerate as ``train()`` does."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig

    cuda = device.type == "cuda"
    config = GRPOConfig(output_dir=str(out_dir), per_device_train_batch_size=cfg.rows, num_generations=cfg.G,
                        max_completion_length=args.completion_len[1], beta=args.beta, learning_rate=args.lr,
                        bf16=cuda and not args.fp32, use_cpu=not cuda, gradient_checkpointing=cfg.checkpointing,
                        model_init_kwargs={"dtype": args.weights, "attn_implementation": "sdpa"},
                        report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True, seed=args.seed)
    dataset = Dataset.from_dict({"prompt": ["p"] * cfg.rows})
    trainer = cls(model=str(model_dir), reward_funcs=reward_zero, args=config, train_dataset=dataset,
                  processing_class=AutoTokenizer.from_pretrained(model_dir))
    model = trainer.model
    if cfg.checkpointing:  # what Trainer.train() does for gradient_checkpointing=True
        kwargs = dict(config.gradient_checkpointing_kwargs or {}) or None
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x's name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    trainer.create_optimizer()
    model, trainer.optimizer = trainer.accelerator.prepare(model, trainer.optimizer)
    trainer.current_gradient_accumulation_steps = config.gradient_accumulation_steps  # set by the training loop
    model.train()
    return trainer, model


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def one_step(trainer, model, batch: Batch, old_logps: bool, device: torch.device):
    """(scoring ms, train ms, loss, grad norm, first scored log-probs) of one GRPO step on ``batch``."""
    ids = torch.cat([batch.prompt_ids_BP, batch.completion_ids_BC], 1)
    mask = torch.cat([batch.prompt_mask_BP, batch.completion_mask_BC], 1)
    C, B = batch.completion_ids_BC.shape[1], ids.shape[0]
    inputs = {"prompt_ids": batch.prompt_ids_BP, "prompt_mask": batch.prompt_mask_BP,
              "completion_ids": batch.completion_ids_BC, "completion_mask": batch.completion_mask_BC,
              "advantages": batch.advantages_B, "num_items_in_batch": batch.completion_mask_BC.sum()}
    _sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():  # TRL's order: the old policy, then the reference
        if old_logps:
            inputs["old_per_token_logps"] = trainer._get_per_token_logps_and_entropies(
                trainer.model, ids, mask, C, batch_size=B)[0]
        if trainer.beta != 0.0:
            inputs["ref_per_token_logps"] = trainer._get_per_token_logps_and_entropies(
                trainer.ref_model, ids, mask, C, batch_size=B)[0]
    _sync(device)
    t1 = time.perf_counter()
    with trainer.compute_loss_context_manager():
        loss = trainer.compute_loss(model, inputs)
    trainer.accelerator.backward(loss)
    norm = trainer.accelerator.clip_grad_norm_(model.parameters(), trainer.args.max_grad_norm)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    _sync(device)
    t2 = time.perf_counter()
    scored = inputs.get("ref_per_token_logps", inputs.get("old_per_token_logps"))
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3, float(loss.detach()), float(norm), scored


def run_variant(name: str, cls, model_dir: Path, cfg: StepConfig, batch: Batch, args, device) -> Run:
    run = Run(name)
    trainer = model = None
    try:
        with tempfile.TemporaryDirectory() as out:
            trainer, model = make_trainer(cls, model_dir, cfg, args, Path(out), device)
            for i in range(args.warmup + args.steps):
                if i == args.warmup and device.type == "cuda":
                    _sync(device)
                    torch.cuda.reset_peak_memory_stats(device)
                    run.held_gib = torch.cuda.memory_allocated(device) / GiB
                s_ms, t_ms, loss, norm, scored = one_step(trainer, model, batch, args.old_logps, device)
                run.losses.append(loss)
                run.grad_norms.append(norm)
                if i == 0 and scored is not None:
                    run.ref_logps = scored.detach().float().cpu()
                if i >= args.warmup:
                    run.scoring_ms.append(s_ms)
                    run.train_ms.append(t_ms)
            if device.type == "cuda":
                run.peak_gib = torch.cuda.max_memory_allocated(device) / GiB
            run.entropies = [float(x) for x in trainer._metrics["train"].get("entropy", [])]
    except (torch.OutOfMemoryError, RuntimeError) as e:
        if not isinstance(e, torch.OutOfMemoryError) and "ALLOC_FAILED" not in str(e) and "out of memory" not in str(e):
            raise
        run.error = "OOM"
        if device.type == "cuda":
            run.peak_gib = torch.cuda.max_memory_allocated(device) / GiB
        print(f"{name}: out of memory ({str(e).splitlines()[0][:200]})", flush=True)
    finally:
        del trainer, model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return run


# --------------------------------------------------------------------------------------------------
# Report


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def agreement(runs: dict[str, Run], batch: Batch) -> dict[str, float | None]:
    """TRL against tree: the largest |loss difference| and |entropy difference| (TRL's logged metric: the mean
    entropy of the loss forward) over the steps both ran, the scored log-probs' max |diff| on completion tokens
    (first step) and the largest relative difference of the gradient norm (before clipping).

    The loss alone checks little: with the old log-probs taken from the same weights the ratio is 1 and the
    reference equals the policy on the first step, so its value is -sum(advantage x tokens) / tokens whatever the
    log-probs are; the entropy, the log-probs and the gradient norm carry the forward's and backward's numbers."""
    a, b = runs.get("trl"), runs.get("tree")
    out: dict[str, float | None] = {"loss": None, "entropy": None, "logp": None, "grad": None}
    if a is None or b is None or not a.losses or not b.losses:
        return out
    out["loss"] = max(abs(x - y) for x, y in zip(a.losses, b.losses))
    if a.entropies and b.entropies:
        out["entropy"] = max(abs(x - y) for x, y in zip(a.entropies, b.entropies))
    out["grad"] = max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a.grad_norms, b.grad_norms))
    if a.ref_logps is not None and b.ref_logps is not None:
        keep = batch.completion_mask_BC.bool().cpu()
        out["logp"] = float((a.ref_logps - b.ref_logps)[keep].abs().max())
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny model, short rows, float32")
    ap.add_argument("--configs", "--groups", type=parse_configs, default=None,
                    help=f"GxPROMPTS[:gc],... (default {GPU_CONFIGS}; --tiny: {TINY_CONFIGS})")
    ap.add_argument("--prompt-len", type=parse_range, default=None, help="LO-HI tokens (default 1K-4K)")
    ap.add_argument("--completion-len", type=parse_range, default=None, help="LO-HI tokens (default 256-1K)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per variant (default 5; --tiny 2)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (treepack's self-check runs here)")
    ap.add_argument("--beta", type=float, default=0.04, help="KL coefficient; > 0 adds the reference pass")
    ap.add_argument("--no-old-logps", dest="old_logps", action="store_false",
                    help="leave out the old-policy pass (TRL skips it without vLLM and with num_iterations 1)")
    ap.add_argument("--lr", type=float, default=1e-6, help="learning rate (TRL's default)")
    ap.add_argument("--fp32", action="store_true", help="no bf16 autocast on CUDA (bf16=False)")
    ap.add_argument("--weights", choices=("float32", "bfloat16"), default="float32",
                    help="the dtype TRL loads the policy and reference in (model_init_kwargs; TRL's default float32)")
    ap.add_argument("--variants", default="trl,tree", help="comma-separated subset of trl, tree")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="markdown report to write")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    if not variants or set(variants) - {"trl", "tree"}:
        ap.error(f"--variants: choose from trl, tree, got {args.variants!r}")
    if args.tiny:
        args.configs = args.configs or parse_configs(TINY_CONFIGS)
        args.prompt_len = args.prompt_len or (32, 64)
        args.completion_len = args.completion_len or (16, 32)
        args.steps = 2 if args.steps is None else args.steps
        args.warmup = min(args.warmup, 1)
    else:
        args.configs = args.configs or parse_configs(GPU_CONFIGS)
        args.prompt_len = args.prompt_len or (1024, 4096)
        args.completion_len = args.completion_len or (256, 1024)
        args.steps = 5 if args.steps is None else args.steps
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")

    import trl
    from trl import GRPOTrainer

    from treepack.hf.trl import TreeGRPOTrainer

    classes = {"trl": GRPOTrainer, "tree": TreeGRPOTrainer}
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    t_start = time.perf_counter()
    lines: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, vocab, shape = save_model(Path(tmp) / "model", args.tiny, device)
        from transformers import AutoTokenizer

        pad_id = AutoTokenizer.from_pretrained(model_dir).pad_token_id
        bf16 = device.type == "cuda" and not args.fp32
        passes = [p for p, on in (("old policy", args.old_logps), ("reference", args.beta != 0)) if on]
        lines += [f"# TRL's GRPO step with and without treepack, {today()}", "",
                  f"- hardware: 1x {gpu_line(device)}",
                  f"- versions: {versions('trl', 'transformers', 'accelerate')}",
                  f"- command: `{command_line(__file__, argv)}`",
                  f"- model: random-init Qwen3 {shape}, {args.weights} weights"
                  + (", bf16=True (bf16 autocast)" if bf16 else ", float32") + ", SDPA attention",
                  (f"- step: scoring passes under no_grad ({', '.join(passes) or 'none'}; batch_size = rows), then "
                   f"compute_loss (TRL's {getattr(trl.GRPOConfig, 'loss_type', 'default')} "
                   f"loss, beta {args.beta:g}) + backward + clip + AdamW step (lr {args.lr:g})"),
                  (f"- rows: prompts {args.prompt_len[0]:,}-{args.prompt_len[1]:,} tokens, completions "
                   f"{args.completion_len[0]:,}-{args.completion_len[1]:,} (uniform, seed {args.seed}); median of "
                   f"{args.steps} timed steps after {args.warmup} warm-up; peak = max_memory_allocated over the timed "
                   "steps, held = allocated before them"), ""]
        print("\n".join(lines), flush=True)
        table = [("| config | rows | padded tokens | real tokens | tree tokens | variant | scoring ms | train ms "
                  "| step ms | held GiB | peak GiB | speed-up |"), "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        checks = ["| config | loss max abs diff | entropy max abs diff | log-prob max abs diff | grad-norm rel diff |",
                  "|---|---|---|---|---|"]
        print("\n".join(table), flush=True)
        for k, cfg in enumerate(args.configs):
            batch = make_batch(cfg, args.prompt_len, args.completion_len, vocab, pad_id, args.seed + k, device)
            tree_tokens = batch.tree_tokens()
            runs = {v: run_variant(v, classes[v], model_dir, cfg, batch, args, device) for v in variants}
            base = runs.get("trl")
            for v, run in runs.items():
                speed = ratio(base.step_ms, run.step_ms) if base is not None and not base.error else "-"
                step = run.error or fmt(run.step_ms, ".1f")
                table.append(f"| {cfg.label} | {cfg.rows} | {batch.padded_tokens:,} | {batch.real_tokens:,} | "
                             f"{tree_tokens:,} | {v} | {fmt(run.median(run.scoring_ms), '.1f')} | "
                             f"{fmt(run.median(run.train_ms), '.1f')} | {step} | {fmt(run.held_gib, '.1f')} | "
                             f"{fmt(run.peak_gib, '.1f')} | {speed} |")
                print(table[-1], flush=True)
            agree = agreement(runs, batch)
            checks.append(f"| {cfg.label} | {fmt(agree['loss'], '.3e')} | {fmt(agree['entropy'], '.3e')} | "
                          f"{fmt(agree['logp'], '.3e')} | {fmt(agree['grad'], '.3e')} |")
            print(f"loss max abs diff: {fmt(agree['loss'], '.3e')} ({cfg.label})", flush=True)
            done = k + 1 == len(args.configs)
            write_report(Path(args.out) if args.out else None, report(lines, table, checks, t_start, done))
    print("\n".join(checks), flush=True)
    return 0


def report(lines: list[str], table: list[str], checks: list[str], t_start: float, done: bool) -> str:
    """The markdown report so far (rewritten after each config, so a run cut short keeps what it measured)."""
    return "\n".join([*lines, "## Time per step and memory", "", *table, "",
              ("padded tokens: what TRL's forward runs (rows x padded length); real: without padding; tree: the "
               "rows' prefix tree, what treepack's forward runs. speed-up: TRL's step ms / the variant's."), "",
              "## Agreement (TRL vs treepack, same weights and batch)", "", *checks, "",
              ("loss and entropy (TRL's logged metric of the loss forward): largest |difference| over all steps; "
               "log-prob: the first step's scored log-probs (reference pass, else old policy) on completion tokens; "
               "grad-norm: largest relative difference over all steps, before clipping. The loss alone checks "
               "little (ratio 1 and reference = policy on the first step make it -sum(advantage x tokens) / "
               "tokens)."), "",
              "Read: (left for the reader of the GPU run)", "",
              f"{'Total run time' if done else 'Unfinished; run time so far'} {time.perf_counter() - t_start:.0f} s.",
              ""])


if __name__ == "__main__":
    sys.exit(main())
