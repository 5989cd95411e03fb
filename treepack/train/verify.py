"""`treepack verify`: run the modes on the same packs and prove they train identically.

For each pack, every mode computes its share of the batch loss and backpropagates from the same weights;
the gradients of every parameter are compared with the baseline (``dense``, or ``dense-leaf``):
``rel = max|g_mode - g_base| / max|g_base|`` per parameter (the reported maximum is over parameters and
packs; the mean uses ``mean|g_mode - g_base| / max|g_base|``; the denominator is floored at 1e-6 x the
largest gradient of the pack so that a parameter whose true gradient is 0 compares rounding noise with
the model's gradient scale, not with itself), plus the largest |log-prob| difference of any (sequence,
token) row and the loss (its gap relative to the baseline's ``sum_r w_r |loss_r|``: a GRPO loss's terms can
cancel to 0). Tolerance: float64, 1e-9 relative (measured: ~1e-15 on real packs); lower precisions compare
each mode's error against a higher-precision run of the baseline and pass when it is at most 2x the
same-dtype baseline's error (plus a small band), the flash-attention rule.

What makes a corrupted pack fail. Both baselines are rebuilt from the sequences' own fields
(``seq_token_index`` into ``input_ids``, positions 0..L-1) and never read ``parent``/``subtree_end``/
``position_ids``/``loss_weight``; tree mode reads exactly those. A wrong field therefore changes the tree
numbers and not the baseline's. ``dense-leaf`` checks the same thing with fewer tokens (one lane per leaf
path; on the first 16K pack ``treepack pack`` makes of the tau-bench retail sample, 16,853 tokens instead of
dense's 202,636). Independently, `check_pack` re-derives the tree fields from the paths: each path's
chain must equal the ``parent`` chain, positions must be depths, ``subtree_end`` must be the preorder
subtree end implied by ``parent``, ``scale``/``loss_weight`` must be the path counts.

Speed. Each mode is built once and each (mode, pack) run reports through ``progress`` as it starts. The
models run eagerly unless ``compile=True``: compiling the elementwise regions for each dtype (the check's
and the reference's) takes longer than a check of one pack on a GPU, and the compiled functions are
tested against the eager ones (tests/test_compiled_*). The dense modes forward micro-batches of at most
the pack's token count, so the baseline needs no more memory than tree mode.

The default model is tiny (2 layers, hidden 64, 4 query / 2 kv heads of 16, Qwen3 layout) and random,
on the CPU in float64. Its vocabulary covers the data: the largest id + 1, or, when that exceeds
`COMPACT_VOCAB_ABOVE` (a 151k Qwen vocabulary would make every log-prob a 151k-wide float64 softmax),
the ids present, remapped to 0..n-1: the same equivalence question on a smaller, equally valid model.

Legend: T pack tokens, F flat tokens, R loss rows, S sequences.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from treepack.errors import ConfigError, TreepackError
from treepack.pack.layout import Pack
from treepack.train.data import compact_vocab
from treepack.train.losses import BatchTotals, LossRows, Objective
from treepack.train.model import Decoder, ModelArgs
from treepack.train.modes import make_mode
from treepack.train.modes.dfs import merge_work

BASELINES = ("dense", "dense-leaf")  # modes that read only the sequences' own fields (see module doc)
COMPACT_VOCAB_ABOVE = 8192
TOLERANCE_FLOAT64 = 1e-9
LOW_PRECISION_BAND = 1e-6  # absolute slack on the 2x rule: both errors are ~0 when grads are tiny
DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
GRAD_SCALE_FLOOR = 1e-6  # relative differences are taken against max(max|g_param|, this x max|g_any|)
MAX_PROBLEMS = 20  # layout problems kept verbatim (all are counted)


# --------------------------------------------------------------------------------------------------
# Layout checks


def _subtree_end_from_parent(parent_T: np.ndarray, n_real: int) -> np.ndarray | None:
    """Preorder subtree ends implied by ``parent`` (None if parent is not a preorder forest)."""
    T = parent_T.shape[0]
    p_idx = np.arange(n_real)
    if np.any(parent_T[:n_real] >= p_idx):
        return None
    end_T = np.arange(1, T + 1, dtype=np.int64)
    parent = parent_T.tolist()
    end = end_T.tolist()
    for p in range(n_real - 1, -1, -1):
        q = parent[p]
        if q >= 0 and end[p] > end[q]:
            end[q] = end[p]
    return np.asarray(end, dtype=np.int64)


def check_pack(pack: Pack, name: str = "pack") -> tuple[list[str], int]:
    """Consistency of a pack's tree fields with its sequences' paths: (first problems, total count)."""
    problems: list[str] = []
    count = 0

    def bad(msg: str, n: int = 1) -> None:
        nonlocal count
        count += n
        if len(problems) < MAX_PROBLEMS:
            problems.append(f"{name}: {msg}")

    T = int(np.asarray(pack.input_ids).shape[0])
    for field_name in ("position_ids", "parent", "subtree_end", "scale", "loss_weight"):
        n = int(np.asarray(getattr(pack, field_name)).shape[0])
        if n != T:
            bad(f"{field_name} has {n} entries, input_ids {T}")
    if count:
        return problems, count
    n_real = int(pack.n_real)
    offsets_S1 = np.asarray(pack.seq_offsets, dtype=np.int64)
    index_F = np.asarray(pack.seq_token_index, dtype=np.int64)
    S = offsets_S1.shape[0] - 1
    if offsets_S1[0] != 0 or np.any(np.diff(offsets_S1) < 1) or offsets_S1[-1] != index_F.shape[0]:
        bad("seq_offsets do not split seq_token_index into non-empty sequences")
        return problems, count
    if np.any((index_F < 0) | (index_F >= n_real)):
        bad(f"seq_token_index points outside the real tokens [0, {n_real})")
        return problems, count
    parent_T = np.asarray(pack.parent, dtype=np.int64)
    lengths_S = np.diff(offsets_S1)
    seq_F = np.repeat(np.arange(S), lengths_S)
    j_F = np.arange(index_F.shape[0]) - offsets_S1[:-1][seq_F]
    expected_parent_F = np.where(j_F == 0, -1, np.roll(index_F, 1))
    wrong = np.flatnonzero(parent_T[index_F] != expected_parent_F)
    if wrong.size:
        f = int(wrong[0])
        bad(f"{wrong.size} path steps disagree with parent (sequence {pack.seq_ids[seq_F[f]]!r}, token {j_F[f]}: "
            f"parent[{index_F[f]}] = {parent_T[index_F[f]]}, its path says {expected_parent_F[f]})", wrong.size)
    pos_T = np.asarray(pack.position_ids, dtype=np.int64)
    wrong = np.flatnonzero(pos_T[index_F] != j_F)
    if wrong.size:
        f = int(wrong[0])
        bad(f"{wrong.size} position_ids disagree with the path depth (position_ids[{index_F[f]}] = "
            f"{pos_T[index_F[f]]}, depth {j_F[f]})", wrong.size)
    if np.any(np.asarray(pack.seq_leaf, dtype=np.int64) != index_F[offsets_S1[1:] - 1]):
        bad("seq_leaf is not the last token of each path")
    end_T = _subtree_end_from_parent(parent_T, n_real)
    if end_T is None:
        bad("parent is not a preorder forest (some parent[p] >= p)")
    else:
        wrong = np.flatnonzero(np.asarray(pack.subtree_end, dtype=np.int64) != end_T)
        if wrong.size:
            k = int(wrong[0])
            bad(f"{wrong.size} subtree_end entries disagree with parent (subtree_end[{k}] = "
                f"{int(pack.subtree_end[k])}, parent implies {int(end_T[k])})", wrong.size)
    scale_T = np.bincount(index_F, minlength=T)
    wrong = np.flatnonzero(np.asarray(pack.scale) != scale_T)
    if wrong.size:
        bad(f"{wrong.size} scale entries differ from the number of paths through the token", wrong.size)
    trains_F = (np.asarray(pack.seq_loss_mask) > 0) & (j_F > 0)
    weight_T = np.bincount(index_F[trains_F], minlength=T)
    predicted_T = parent_T >= 0
    wrong = np.flatnonzero((np.asarray(pack.loss_weight) != weight_T) & predicted_T)
    if wrong.size:
        bad(f"{wrong.size} loss_weight entries differ from the number of sequences training on the token",
            wrong.size)
    return problems, count


# --------------------------------------------------------------------------------------------------
# Reports


@dataclass
class ModeReport:
    mode: str
    # None in the four below (null in JSON): not measured, as the mode (or the baseline, for the last three)
    # could not run on every pack
    loss: float | None = 0.0  # batch loss (sum of the packs' shares)
    max_rel_grad_diff: float | None = 0.0  # vs dense: max over packs and parameters of max|d| / max|g_dense|
    mean_rel_grad_diff: float | None = 0.0  # vs dense: mean over packs and parameters of mean|d| / max|g_dense|
    max_logprob_diff: float | None = 0.0  # vs dense: max |logp_mode - logp_dense| over rows
    worst_param: str = ""  # parameter (and pack) of the max relative difference
    ref_rel_grad_diff: float | None = None  # low precision: max rel grad error vs the reference run
    forward_tokens: int = 0  # tokens through the model over all packs
    work: dict = field(default_factory=dict)  # dfs: tokens forwarded with/without grad, back-propagated, peaks
    seconds: float = 0.0
    error: str | None = None  # the mode could not run (e.g. a corrupted pack)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class VerifyReport:
    ok: bool
    dtype: str
    loss_kind: str
    tolerance: float  # float64: relative; low precision: the factor on dense's error
    packs: int
    sequences: int
    tree_tokens: int
    flat_tokens: int
    loss_tokens: int
    vocab: str  # e.g. "3,438 ids present of 151,667 (remapped)"
    advantages: str  # where GRPO advantages came from
    layout_problems: list[str]
    layout_problem_count: int
    modes: dict[str, ModeReport] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    baseline: str = "dense"  # the mode every other is compared with
    vocab_size: int = 0  # the model's vocabulary (rows of its embedding), as a number

    def _worst(self, attr: str) -> float | None:
        """The largest ``attr`` of the modes compared with the baseline; None when any of them was not measured
        (a mode that could not run is no 0.0)."""
        values = [getattr(m, attr) for k, m in self.modes.items() if k != self.baseline]
        return None if None in values else max(values, default=0.0)

    @property
    def max_rel_grad_diff(self) -> float | None:
        return self._worst("max_rel_grad_diff")

    @property
    def mean_rel_grad_diff(self) -> float | None:
        return self._worst("mean_rel_grad_diff")

    @property
    def max_logprob_diff(self) -> float | None:
        return self._worst("max_logprob_diff")

    def to_json(self) -> dict:
        return {
            "ok": self.ok,
            "baseline": self.baseline,
            "max_rel_grad_diff": self.max_rel_grad_diff,
            "mean_rel_grad_diff": self.mean_rel_grad_diff,
            "max_logprob_diff": self.max_logprob_diff,
            "losses": {k: m.loss for k, m in self.modes.items()},
            "tolerance": self.tolerance,
            "dtype": self.dtype,
            "loss": self.loss_kind,
            "packs": self.packs,
            "sequences": self.sequences,
            "tree_tokens": self.tree_tokens,
            "flat_tokens": self.flat_tokens,
            "loss_tokens": self.loss_tokens,
            "vocab": self.vocab,
            "vocab_size": self.vocab_size,
            "advantages": self.advantages,
            "layout_ok": self.layout_problem_count == 0,
            "layout_problems": self.layout_problems,
            "layout_problem_count": self.layout_problem_count,
            "modes": {k: m.to_json() for k, m in self.modes.items()},
            "failures": self.failures,
        }


# --------------------------------------------------------------------------------------------------
# The run


def tiny_model_args(vocab_size: int) -> ModelArgs:
    return ModelArgs.for_family("qwen3", vocab_size=vocab_size, hidden_size=64, intermediate_size=176,
                                num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)


def _synthetic_advantages(packs: list[Pack], seed: int) -> list[Pack]:
    rng = np.random.default_rng(seed)
    return [dataclasses.replace(p, advantages=rng.standard_normal(p.n_sequences)) for p in packs]


def _scale_floor(grads: dict[str, torch.Tensor]) -> float:
    """Smallest denominator of a relative gradient difference: `GRAD_SCALE_FLOOR` x the largest gradient
    of any parameter (a parameter whose true gradient is 0, e.g. q_proj when every query sees one key,
    carries rounding noise in one mode and an exact 0 in the other; noise / noise is not an error)."""
    top = max((float(g.double().abs().max()) for g in grads.values() if g.numel()), default=0.0)
    return max(GRAD_SCALE_FLOOR * top, 1e-300)


def _loss_magnitude(objective: Objective, rows: LossRows, totals: BatchTotals, logp_R: torch.Tensor) -> float:
    """``sum_r w_r |loss_r|`` of one pack's rows: the scale a loss gap is relative to (a sum's rounding is
    relative to its terms). An on-policy GRPO loss sums advantages that cancel (group advantages have mean 0):
    the batch loss is 0 in exact arithmetic and each mode's rounding, ~1e-17, is no error of the mode."""
    t = objective.row_tensors(rows, totals, device=logp_R.device, dtype=logp_R.dtype)
    logp_R = logp_R.to(t["weight_R"].dtype)
    terms_R = -logp_R if objective.kind == "sft" else objective.grpo_row_loss(
        logp_R, t["advantage_R"], t.get("behaviour_logp_R"), None)
    return float((t["weight_R"] * terms_R.abs()).sum())


def _grads(model: Decoder) -> dict[str, torch.Tensor]:
    return {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
            for n, p in model.named_parameters()}


def verify_packs(
    packs: list[Pack],
    *,
    modes: tuple[str, ...] = ("dense", "tree"),
    dtype: str = "float64",
    loss: str = "sft",
    normalization: str = "token",
    model: Decoder | None = None,
    attention: str = "auto",
    device: str = "cpu",
    seed: int = 0,
    progress: Callable[[int, int, str], None] | None = None,
    mode_options: dict | None = None,
    baseline: str = "dense",
    compile: bool = False,
) -> VerifyReport:
    """Run ``modes`` on ``packs`` (one global batch) and compare every gradient with ``baseline``.

    ``model`` None builds the tiny random model over the data's vocabulary (see module doc); a given model
    is copied to ``dtype`` and left unchanged. ``mode_options``: `make_mode` changes to the
    default ``[train]`` settings (``dfs=DfsConfig(...)``, ``micro_batch_tokens="32k"``). ``progress(done,
    total, label)`` is called as each (mode, pack) run starts and once at the end. ``compile``: run the
    compiled elementwise regions where training would (CUDA); off by default, since compiling for each
    dtype costs more than the check itself and the compiled functions are tested against the eager ones.
    """
    if not packs:
        raise TreepackError("nothing to verify: no packs")
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if baseline not in BASELINES:
        raise ConfigError(f"baseline must be one of {', '.join(BASELINES)}, got {baseline!r}")
    modes = tuple(dict.fromkeys((baseline,) + tuple(modes)))  # the baseline always runs, first
    for m in modes:
        make_mode(m, **(mode_options or {}))  # validates the name and options
    torch_dtype = DTYPES[dtype]

    problems, n_problems = [], 0
    for i, p in enumerate(packs):
        found, n = check_pack(p, f"pack {i}")
        problems.extend(found[: max(0, MAX_PROBLEMS - len(problems))])
        n_problems += n

    max_id = int(max(int(np.asarray(p.input_ids[: p.n_real]).max(initial=0)) for p in packs))
    if model is None:
        vocab = max_id + 1
        vocab_note = f"{vocab:,} (largest id + 1)"
        if vocab > COMPACT_VOCAB_ABOVE:
            packs, present = compact_vocab(packs)
            vocab = int(present.shape[0])
            vocab_note = f"{vocab:,} ids present of {max_id + 1:,} (remapped)"
        base = Decoder.random_init(tiny_model_args(vocab), seed=seed, dtype=torch.float64)
    else:
        if max_id >= model.args.vocab_size:
            raise ConfigError(f"token id {max_id} is outside the model's vocabulary ({model.args.vocab_size})")
        base = model
        vocab_note = f"{model.args.vocab_size:,} (the model's)"

    objective = Objective(kind=loss, normalization=normalization)
    adv_note = "-"
    if loss == "grpo":
        if all(p.advantages is not None for p in packs):
            adv_note = "from the data"
        else:
            packs = _synthetic_advantages(packs, seed)
            adv_note = "synthetic N(0, 1) per sequence (the data have none)"
    rows = [LossRows.from_pack(p) for p in packs]
    totals = BatchTotals.of(rows)

    def model_in(dt: torch.dtype) -> Decoder:
        with torch.device("meta"):
            m = Decoder(base.args)
        m = m.to_empty(device=device).to(dt)
        m.load_state_dict(base.state_dict())  # copies into m's dtype
        # Eager layers unless asked (--compile): verify is about numbers, and compiling costs more than it
        # saves on a few packs (one 14k-token tau-bench pack, bf16 on an H100: 4.6 s eager, 43.5 s compiled).
        m.compile = "auto" if compile else "off"
        return m

    runs = [(m, torch_dtype) for m in modes]
    ref_dtype = None
    if torch_dtype != torch.float64:
        ref_dtype = torch.float64 if torch_dtype == torch.float32 else torch.float32
        runs.append(("reference", ref_dtype))
    models = {dt: model_in(dt) for dt in {dt for _, dt in runs}}
    reports = {m: ModeReport(mode=m) for m in modes}
    ref_err = {m: 0.0 for m in modes}
    total_steps, done = len(packs) * len(runs), 0
    rel_sums = {m: 0.0 for m in modes}
    rel_counts = {m: 0 for m in modes}
    loss_magnitude = 0.0  # the baseline's sum_r w_r |loss_r| (`_loss_magnitude`)
    ref_error = None  # the reference run's first error

    instances = {name: make_mode(baseline if name == "reference" else name, **(mode_options or {}),
                                 **({} if name in (baseline, "reference") else {"attention": attention}))
                 for name, _ in runs}
    for i, (pack, row) in enumerate(zip(packs, rows)):
        results: dict[str, tuple] = {}
        for name, dt in runs:
            if progress is not None:
                what = f"{baseline} in {str(dt).removeprefix('torch.')}" if name == "reference" else name
                progress(done, total_steps, f"{what}, pack {i + 1}/{len(packs)}")
            m = models[dt]
            mode = instances[name]
            m.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            try:
                out = mode(m, pack, row, objective, totals)
                out.backward()
            except (TreepackError, ValueError, RuntimeError, IndexError) as exc:
                if name in reports and reports[name].error is None:
                    reports[name].error = f"pack {i}: {exc}"
                elif name == "reference" and ref_error is None:
                    ref_error = f"pack {i}: {exc}"
                results[name] = None
            else:
                results[name] = (out.loss.item(), out.logp_R.double(), _grads(m))
                if name in reports:
                    reports[name].loss += out.loss.item()
                    reports[name].forward_tokens += out.forward_tokens
                    reports[name].work = merge_work(reports[name].work, out.metrics)
            if name in reports:
                reports[name].seconds += time.perf_counter() - t0
            done += 1
        dense = results.get(baseline)
        if dense is not None:
            loss_magnitude += _loss_magnitude(objective, row, totals, dense[1])
        for name in modes:
            res, rep = results.get(name), reports[name]
            if res is None or dense is None or name == baseline:
                continue
            if res[1].numel():
                rep.max_logprob_diff = max(rep.max_logprob_diff, float((res[1] - dense[1]).abs().max()))
            floor = _scale_floor(dense[2])
            for pname, g in res[2].items():
                gd = dense[2][pname].double()
                diff = (g.double() - gd).abs()
                scale = max(float(gd.abs().max()), floor)
                rel = float(diff.max()) / scale
                rel_sums[name] += float(diff.mean()) / scale
                rel_counts[name] += 1
                if not rep.worst_param or rel > rep.max_rel_grad_diff:
                    rep.max_rel_grad_diff, rep.worst_param = rel, f"{pname} (pack {i})"
        ref = results.get("reference")
        if ref is not None:
            floor = _scale_floor(ref[2])
            for name in modes:
                res = results.get(name)
                if res is None:
                    continue
                for pname, g in res[2].items():
                    gr = ref[2][pname].double()
                    err = float((g.double() - gr).abs().max())
                    ref_err[name] = max(ref_err[name], err / max(float(gr.abs().max()), floor))
    base_error = reports[baseline].error
    for name, rep in reports.items():
        if rel_counts[name]:
            rep.mean_rel_grad_diff = rel_sums[name] / rel_counts[name]
        if ref_dtype is not None:
            rep.ref_rel_grad_diff = None if rep.error or ref_error else ref_err[name]
        if rep.error:  # a partial sum or a comparison of some packs is no measurement: None (null), never 0.0
            rep.loss = None
        if rep.error or (base_error and name != baseline):
            rep.max_rel_grad_diff = rep.mean_rel_grad_diff = rep.max_logprob_diff = None

    failures = []
    if n_problems:
        failures.append(f"{n_problems} layout problem{'s' if n_problems != 1 else ''} "
                        "(the tree fields disagree with the sequences' paths)")
    for name, rep in reports.items():
        if rep.error:
            failures.append(f"{name}: could not run ({rep.error})")
    if ref_error:
        failures.append(f"reference ({baseline} in {str(ref_dtype).removeprefix('torch.')}): could not run "
                        f"({ref_error})")
    if torch_dtype == torch.float64:
        tolerance = TOLERANCE_FLOAT64
        dense_loss = reports[baseline].loss
        for name, rep in reports.items():
            if name == baseline or rep.error or base_error:
                continue
            if rep.max_rel_grad_diff > tolerance:
                failures.append(f"{name}: gradients differ from {baseline} by {rep.max_rel_grad_diff:.3g} relative "
                                f"(tolerance {tolerance:g}; worst {rep.worst_param})")
            loss_gap = abs(rep.loss - dense_loss) / max(abs(dense_loss), loss_magnitude, 1e-300)
            if loss_gap > tolerance:
                failures.append(f"{name}: loss differs from {baseline} by {loss_gap:.3g} relative")
    else:
        tolerance = 2.0
        bound = 2.0 * ref_err[baseline] + LOW_PRECISION_BAND
        for name, rep in reports.items():
            if name != baseline and not (rep.error or base_error or ref_error) and ref_err[name] > bound:
                failures.append(f"{name}: gradient error vs the {str(ref_dtype).removeprefix('torch.')} reference "
                                f"{ref_err[name]:.3g} exceeds 2x {baseline}'s {ref_err[baseline]:.3g}")
    if progress is not None:
        progress(total_steps, total_steps, "done")

    return VerifyReport(
        ok=not failures,
        dtype=dtype,
        loss_kind=loss,
        tolerance=tolerance,
        packs=len(packs),
        sequences=sum(p.n_sequences for p in packs),
        tree_tokens=sum(int(p.n_real) for p in packs),
        flat_tokens=sum(int(np.asarray(p.seq_offsets)[-1]) for p in packs),
        loss_tokens=totals.loss_tokens,
        vocab=vocab_note,
        vocab_size=int(base.args.vocab_size),
        advantages=adv_note,
        layout_problems=problems,
        layout_problem_count=n_problems,
        modes=reports,
        failures=failures,
        baseline=baseline,
    )
