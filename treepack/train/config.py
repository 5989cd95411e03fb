"""Training configuration: a TOML file mapped one to one onto nested dataclasses.

``[model]``, ``[data]``, ``[train]`` (with ``[train.loss]``) and ``[output]`` are the dataclasses below;
every field carries a comment and every constraint is checked in ``__post_init__`` with a message that
names the key. Unknown keys are errors that name the nearest valid key (difflib), so a typo never
silently trains with a default: ``config.toml: unknown key 'train.lrr' (did you mean 'train.lr'?)``.
Relative paths in the file resolve against the file's directory, so a config runs from anywhere.

`EXAMPLE_CONFIG` is the commented template printed by ``treepack train --example-config``; a test
checks that it parses and that its values are the defaults.
"""

from __future__ import annotations

import difflib
import json
import math
import typing
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path

import treepack.train.attention  # noqa: F401 - registers the dense baseline's attention backend (sdpa)
from treepack.errors import ConfigError, TreepackError
from treepack.kernels.tree_attention import registry
from treepack.pack.layout import CHILD_ORDERS
from treepack.sizes import parse_size, parse_token_count
from treepack.train.memory_limit import MemoryLimit, parse_memory_limit

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the backport has the same API
    import tomli as tomllib

DFS_ORDERS = ("backward", "layout")
DTYPES = ("auto", "float32", "bfloat16", "float64")
DEVICES = ("auto", "cpu", "cuda")
SCHEDULES = ("constant", "cosine")
COMPILE_MODES = ("auto", "on", "off")
SOURCES = ("auto", "treepack", "hf")


def _positive(key: str, value, *, zero_ok: bool = False) -> None:
    if value < 0 or (value == 0 and not zero_ok):
        raise ConfigError(f"{key} must be {'>= 0' if zero_ok else '> 0'}, got {value}")


def _one_of(key: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(f"{key} must be one of {', '.join(allowed)}, got {value!r}")


@dataclass
class ModelConfig:
    checkpoint: str = ""  # local Hugging Face checkpoint dir (config.json + *.safetensors); "" = random init
    # which code runs the checkpoint: treepack (our decoder: qwen3/qwen2/llama) | hf (transformers' own modules
    # through treepack.hf, any supported architecture) | auto (treepack where it loads the checkpoint, else hf)
    source: str = "auto"
    family: str = "qwen3"  # random init: qwen3 (q/k norm) | qwen2 (qkv bias) | llama
    vocab_size: int = 0  # random init: embedding rows; 0 = max token id of the data + 1
    compact_vocab: bool = False  # random init: renumber the data's ids 0..n-1 (fast tiny CPU runs on 151k vocabs)
    hidden_size: int = 64  # random init: model width
    intermediate_size: int = 176  # random init: SwiGLU width
    num_layers: int = 2  # random init: decoder layers
    num_heads: int = 4  # random init: query heads
    num_kv_heads: int = 2  # random init: key/value heads (GQA)
    head_dim: int = 16  # random init: per-head width
    rope_theta: float = 1_000_000.0  # random init: RoPE base
    tie_embeddings: bool = False  # random init: output head shares the embedding matrix
    init_std: float = 0.02  # random init: std of the normal weight init
    # random init: draw the weights on the training device in its dtype (an 8B model in seconds instead of
    # minutes of float64 draws on one CPU thread a rank); the values then depend on the device
    init_on_device: bool = False

    def resolved_source(self) -> str:
        """``treepack`` or ``hf``: ``auto`` is our decoder for random init and qwen3/qwen2/llama checkpoints
        (compiled layer regions and fused loss on CUDA), transformers' modules otherwise."""
        if self.source != "auto":
            return self.source
        if not self.checkpoint:
            return "treepack"
        try:
            model_type = json.loads((Path(self.checkpoint) / "config.json").read_text()).get("model_type")
        except (OSError, ValueError):
            return "treepack"  # let the loader report the unreadable checkpoint
        return "treepack" if model_type in ("qwen3", "qwen2", "llama") else "hf"

    def __post_init__(self) -> None:
        _one_of("model.family", self.family, ("qwen3", "qwen2", "llama"))
        _one_of("model.source", self.source, SOURCES)
        if self.source == "hf" and not self.checkpoint:
            raise ConfigError("model.source = 'hf' needs model.checkpoint (a local Hugging Face checkpoint dir)")
        _positive("model.vocab_size", self.vocab_size, zero_ok=True)
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            _positive(f"model.{name}", getattr(self, name))
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"model.num_heads ({self.num_heads}) must be a multiple of "
                              f"model.num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"model.head_dim must be even (RoPE rotates pairs), got {self.head_dim}")
        _positive("model.rope_theta", self.rope_theta)
        _positive("model.init_std", self.init_std)


@dataclass
class DataConfig:
    shards: str = ""  # directory of packed shards (`treepack pack ... -o DIR`)
    rollouts: list[str] = field(default_factory=list)  # or rollout files (.jsonl[.gz], .parquet), packed here
    capacity: str = "16k"  # pack capacity in tree tokens when packing rollouts (60k, 64K, 65536)
    packs_per_step: int = 1  # packs per optimizer step: one global batch, gradients accumulated
    shuffle: bool = True  # visit packs in a seeded random order each epoch (else file order)
    # DFS order of each pack's tokens: lex (as packed) | largest-first (children by subtree size, largest first)
    # | auto (`RunConfig.child_order`). Same loss and gradients; FA4 visits 25% fewer partial blocks on ToolBench
    # (benchmarks/fa4_blocks.py) and its tree step takes 4% less time (results/2026-11-25-child-order-h200.md)
    child_order: str = "auto"

    def __post_init__(self) -> None:
        if bool(self.shards) == bool(self.rollouts):
            raise ConfigError("data: set exactly one of data.shards (a packed directory) or data.rollouts (files)")
        _one_of("data.child_order", self.child_order, ("auto", *CHILD_ORDERS))
        try:
            parse_size(self.capacity, what="data.capacity")
        except TreepackError as exc:
            raise ConfigError(str(exc)) from None
        _positive("data.packs_per_step", self.packs_per_step)

    @property
    def capacity_tokens(self) -> int:
        return parse_size(self.capacity, what="data.capacity")


@dataclass
class LossConfig:
    kind: str = "sft"  # sft (NLL on loss_mask tokens) | grpo (PPO-clip with per-sequence advantages)
    normalization: str = "token"  # token: mean over the batch's loss tokens | sequence: mean of per-sequence means
    clip_low: float = 0.2  # grpo: ratio clipped below at 1 - clip_low
    clip_high: float = 0.2  # grpo: ratio clipped above at 1 + clip_high (DAPO clip-higher: 0.28)
    kl_coef: float = 0.0  # grpo: weight of a k3 KL to the behaviour log-probs (0 = off)

    def __post_init__(self) -> None:
        _one_of("train.loss.kind", self.kind, ("sft", "grpo"))
        _one_of("train.loss.normalization", self.normalization, ("token", "sequence"))
        if not 0 <= self.clip_low < 1:
            raise ConfigError(f"train.loss.clip_low must be in [0, 1), got {self.clip_low}")
        _positive("train.loss.clip_high", self.clip_high, zero_ok=True)
        _positive("train.loss.kl_coef", self.kl_coef, zero_ok=True)


@dataclass
class DfsConfig:
    """``[train.dfs]``: AReaL-DTA's depth-first mode (`treepack.train.modes.dfs`), handed whole to `DfsMode`."""

    # most tokens forwarded with grad in one call: auto (the largest the GPU's memory allows, printed at the
    # start; treepack.train.modes.dfs_memory) | a size such as 8192 or "8k" | 0 (unlimited: a pack in one call)
    block_size: str = "auto"
    # shared segments kept with their graph instead of re-forwarded: tokens, 4096 or a size such as "4K" (0 = off)
    keep_tokens: int = 0
    order: str = "backward"  # leaf order, backward (AReaL-DTA Algorithm 1) | layout (the pack's)
    subtree_calls: bool = True  # pop subtrees that fit a block in one tree call (false: leaf by leaf)
    # an anchor (a shared segment forwarded without grad) of up to this many tokens rides in the grad call before
    # it: one model call fewer per anchor, at most this many tokens more in that call's graph (0 = off)
    merge_anchor_tokens: int = 512
    # a call shape met again is captured as a CUDA graph and replayed (FA4 and compile on CUDA; keep steps
    # stay eager): no host time per call, ~1.8 GiB more reserved (treepack.train.modes.dfs_graphs)
    cuda_graphs: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.block_size, int) and not isinstance(self.block_size, bool):
            self.block_size = str(self.block_size)  # as TOML's block_size = 8192 arrives
        self.block  # noqa: B018 - validates train.dfs.block_size
        self.keep_tokens = parse_dfs_keep(self.keep_tokens, "train.dfs.keep_tokens")
        _positive("train.dfs.merge_anchor_tokens", self.merge_anchor_tokens, zero_ok=True)
        _one_of("train.dfs.order", self.order, DFS_ORDERS)

    @property
    def block(self) -> int | str:
        """``block_size`` as `DfsMode` plans with it: "auto", or tokens (0: unlimited)."""
        return parse_dfs_block(self.block_size, "train.dfs.block_size")


@dataclass
class TrainConfig:
    mode: str = "tree"  # tree (tree attention over each pack) | dense (every sequence separately: the baseline)
    # | dense-leaf (only the sequences that are not a prefix of another; same loss) | dfs (AReaL-DTA: depth-first
    # over each pack's tree, cached path K/V, graph bounded by [train.dfs] block_size) | auto (per pack, the faster
    # of tree and dense-leaf by the FLOP model and the GPU's speed table; printed at the start)
    # attention backend (treepack.kernels.tree_attention.registry), resolved per call: auto | reference | flex |
    # triton | fa4; the dense modes also sdpa (their auto: per-sequence SDPA on a CPU)
    attention: str = "auto"
    steps: int = 100  # optimizer steps (global batches)
    lr: float = 3e-4  # peak AdamW learning rate
    schedule: str = "constant"  # constant | cosine (decays to min_lr_ratio * lr at the last step)
    warmup_steps: int = 0  # linear warm-up from 0 to lr over these steps
    min_lr_ratio: float = 0.1  # cosine floor as a fraction of lr
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    beta1: float = 0.9  # AdamW beta1
    beta2: float = 0.95  # AdamW beta2
    grad_clip: float = 1.0  # max global gradient norm (0 = no clipping)
    dtype: str = "auto"  # auto (bfloat16 on CUDA, float32 on CPU) | float32 | bfloat16 (autocast) | float64
    device: str = "auto"  # auto (cuda when present) | cpu | cuda
    seed: int = 0  # model init and pack order
    logits_chunk: int = 4096  # rows of full-vocabulary logits alive at a time in the loss
    # most GPU memory this run may take, e.g. beside a colocated rollout engine: "40GB", "40GiB" or "50%" of the GPU
    # ("" = all it can get); caps torch's allocator and sizes dfs's auto block (treepack.train.memory_limit)
    memory_limit: str = ""
    activation_checkpointing: bool = False  # recompute each layer in backward (less memory, ~1.3x compute)
    compile: str = "auto"  # torch.compile the elementwise regions: auto (on CUDA, not float64) | on | off
    # compiled layers: share of the saved activations the compiler may keep (1 = all it wants); below 1 it
    # recomputes cheap ops in backward instead: tau-bench dfs B=8192 on an H200, 0.7: 16.6 -> 13.1 GiB, 1.15x time
    activation_memory_budget: float = 1.0
    # dense, dense-leaf, auto: most tokens forwarded at once, micro-batches back-propagated one by one ("" = each
    # pack's own size, the memory of the tree step of the same pack; e.g. "32k")
    micro_batch_tokens: str = ""
    speed_table: str = ""  # auto: JSON speed table (benchmarks/speed_table.py); "" = the built-in one for the GPU
    # data parallel: what the split of a step's packs over the ranks balances: flops (design §9's FLOP model),
    # measured (that model fitted to the ranks' measured times: treepack.train.calibration), auto (measured on
    # CUDA, flops elsewhere: a CPU's times are too noisy to make splits reproducible)
    balance: str = "auto"
    loss: LossConfig = field(default_factory=LossConfig)
    dfs: DfsConfig = field(default_factory=DfsConfig)  # [train.dfs]: mode = "dfs"

    def __post_init__(self) -> None:
        from treepack.train.modes.registry import mode_family, mode_names

        _one_of("train.mode", self.mode, mode_names())
        _one_of("train.attention", self.attention, registry.names())
        try:  # the registry decides which backends serve the mode's family (sdpa: no tree mask)
            registry.check(mode_family(self.mode), self.attention, label="train.attention =",
                           who=f"train.mode = '{self.mode}'")
        except registry.BackendError as exc:
            raise ConfigError(str(exc)) from None
        if self.micro_batch_tokens:
            try:
                parse_size(self.micro_batch_tokens, what="train.micro_batch_tokens")
            except TreepackError as exc:
                raise ConfigError(str(exc)) from None
        self.memory  # noqa: B018 - validates train.memory_limit
        _positive("train.steps", self.steps)
        _positive("train.seed", self.seed, zero_ok=True)
        _positive("train.lr", self.lr)
        _one_of("train.schedule", self.schedule, SCHEDULES)
        _positive("train.warmup_steps", self.warmup_steps, zero_ok=True)
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"train.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        _positive("train.weight_decay", self.weight_decay, zero_ok=True)
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"train.{name} must be in [0, 1), got {getattr(self, name)}")
        _positive("train.grad_clip", self.grad_clip, zero_ok=True)
        _one_of("train.dtype", self.dtype, DTYPES)
        _one_of("train.device", self.device, DEVICES)
        _one_of("train.compile", self.compile, COMPILE_MODES)
        _one_of("train.balance", self.balance, ("auto", "flops", "measured"))
        if not 0 < self.activation_memory_budget <= 1:
            raise ConfigError(f"train.activation_memory_budget must be in (0, 1], got {self.activation_memory_budget}")
        _positive("train.logits_chunk", self.logits_chunk)

    @property
    def memory(self) -> MemoryLimit | None:
        return parse_memory_limit(self.memory_limit)

    @property
    def micro_batch_token_count(self) -> int | None:
        return parse_size(self.micro_batch_tokens, what="train.micro_batch_tokens") if self.micro_batch_tokens else None


@dataclass
class OutputConfig:
    dir: str = "runs/train"  # run directory: checkpoint/, metrics.jsonl
    save_every: int = 0  # save a checkpoint every N steps (0 = only at the end)
    save_final: bool = True  # save one at the end of the run (false: benchmarks, smoke runs of large models)
    resume: bool = True  # continue from dir/checkpoint when it exists
    metrics: str = "metrics.jsonl"  # per-step metrics (JSON lines), relative to dir (an absolute path as is); "" = none
    log_every: int = 1  # print the step line every N steps
    # also write the step numbers as TensorBoard events in dir/tensorboard (tensorboard --logdir DIR/tensorboard);
    # needs the tensorboard package
    tensorboard: bool = False
    wandb: bool = False  # also log to Weights & Biases, offline, in dir/wandb (`wandb sync` uploads it); needs wandb
    wandb_project: str = "treepack"  # the W&B project the run is filed under

    def __post_init__(self) -> None:
        if not self.dir:
            raise ConfigError("output.dir must not be empty")
        _positive("output.save_every", self.save_every, zero_ok=True)
        _positive("output.log_every", self.log_every)
        if self.wandb and not self.wandb_project.strip():
            raise ConfigError("output.wandb_project must not be empty")


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=lambda: DataConfig(shards="packs"))
    train: TrainConfig = field(default_factory=TrainConfig)
    output: OutputConfig = field(default_factory=OutputConfig)

    @property
    def child_order(self) -> str:
        """The pack layout the run uses: ``data.child_order``, where ``auto`` is largest-first for the modes that
        run tree attention over whole packs (tree, auto: 4.1-4.2% off ToolBench's step, no change on tau-bench's
        chains) and lex for dfs (largest-first was 2-4% slower there: results/2026-11-25-dfs-memory-h200.md)
        and the dense modes (which never read the layout)."""
        if self.data.child_order != "auto":
            return self.data.child_order
        return "largest-first" if self.train.mode in ("tree", "auto") else "lex"


# --------------------------------------------------------------------------------------------------
# TOML -> dataclasses


def _type_name(tp) -> str:
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, str(tp))


def parse_dfs_block(value, what: str) -> int | str:
    """A dfs block as written (``train.dfs.block_size``, ``verify --dfs-block-size``): "auto", or tokens as an
    integer or a size such as "8K", 0 for unlimited."""
    if value == "auto":
        return value
    return parse_token_count(value, what, 'must be a number of tokens such as 8192 or "8K", 0 (unlimited) or "auto", got {value!r}',
                        'must be >= 0 (0: unlimited) or "auto", got {tokens}')


def parse_dfs_keep(value, what: str) -> int:
    """dfs keep tokens as written (``train.dfs.keep_tokens``, ``verify --dfs-keep-tokens``): an integer or a size
    such as "4K", 0 for off; negatives refused."""
    return parse_token_count(value, what, 'must be a number of tokens such as 4096 or "4K" (0: off), got {value!r}',
                        "must be >= 0, got {tokens}")


# keys that take a token count as an integer or a string such as "64K"
SIZE_KEYS = {"data.capacity": 'a size such as 65536 or "64K"', "train.micro_batch_tokens": 'a size such as 32768 or "32K"',
             "train.dfs.block_size": 'a size such as 8192 or "8K", or "auto"',
             "train.dfs.keep_tokens": 'a size such as 4096 or "4K"'}
# keys that moved: refused with the new place, never read silently as defaults
MOVED_KEYS = {f"train.dfs_{name}": f"[train.dfs] {name}" for name in (
    "block_size", "keep_tokens", "order", "subtree_calls", "merge_anchor_tokens", "cuda_graphs")}


def _coerce(key: str, value, tp):
    """Check one TOML value against the annotated type (ints are fine where floats are expected)."""
    origin = typing.get_origin(tp)
    if origin is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, list):
            plural = {int: "integers", float: "numbers", str: "strings"}.get(item, str(item))
            raise ConfigError(f"{key} must be a list of {plural}, got {_toml_repr(value)}")
        return [_coerce(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
    if tp is bool:
        ok = isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        ok = ok or (key in SIZE_KEYS and isinstance(value, str))  # keep_tokens = "4K": parsed in __post_init__
    elif tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
        if ok and not math.isfinite(value):  # TOML has nan and inf; no setting means either
            raise ConfigError(f"{key} must be a finite number, got {_toml_repr(value)}")
    elif tp is str:
        ok = isinstance(value, str)
        if key in SIZE_KEYS and isinstance(value, int) and not isinstance(value, bool):
            ok, value = True, str(value)  # capacity = 65536 as well as "64K"
    else:  # pragma: no cover - every field type is listed above
        raise TypeError(tp)
    if not ok:
        what = SIZE_KEYS.get(key) or _type_name(tp)
        raise ConfigError(f"{key} must be {what}, got {_toml_repr(value)}")
    return value


def _toml_repr(value) -> str:
    """A value as the user wrote it in TOML: ``true``, not Python's ``True``."""
    return str(value).lower() if isinstance(value, bool) else repr(value)


def _all_keys(cls, prefix: str = "") -> list[str]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in fields(cls):
        key = prefix + f.name
        out.append(key)
        if is_dataclass(hints[f.name]):
            out.extend(_all_keys(hints[f.name], key + "."))
    return out


def _unknown_keys(cls, data: dict, prefix: str = "") -> list[str]:
    """Every key of ``data`` (nested tables included) that ``cls`` does not have, each with its nearest
    valid key: a config with three typos is fixed in one go, not three runs."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in fields(cls)}
    out = []
    for key, value in data.items():
        full = prefix + key
        if key not in names:
            here = [prefix + n for n in names]
            # the same name in another table first: a key written below the wrong [table] header
            guess = [k for k in _all_keys(RunConfig) if k.rsplit(".", 1)[-1] == key][:1]
            guess = guess or difflib.get_close_matches(full, here, n=1, cutoff=0.6) or difflib.get_close_matches(
                full, _all_keys(RunConfig), n=1, cutoff=0.6
            )
            hint = f" (did you mean '{guess[0]}'?)" if guess else f" (valid keys: {', '.join(sorted(here))})"
            out.append(f"'{full}'{hint}")
        elif is_dataclass(hints[key]) and isinstance(value, dict):
            out.extend(_unknown_keys(hints[key], value, full + "."))
    return out


def _build(cls, data: dict, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    if not prefix:
        train = data.get("train")
        moved = [f"train.{k} moved to {MOVED_KEYS['train.' + k]}" for k in train or ()
                 if f"train.{k}" in MOVED_KEYS] if isinstance(train, dict) else []
        if moved:
            raise ConfigError(", ".join(moved))
        unknown = _unknown_keys(cls, data)
        if unknown:
            raise ConfigError(f"unknown key{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}")
    kwargs = {}
    for name, value in data.items():
        tp, key = hints[name], prefix + name
        if is_dataclass(tp):
            if not isinstance(value, dict):
                raise ConfigError(f"{key} must be a table ([{key}]), got {value!r}")
            kwargs[name] = _build(tp, value, key + ".")
        else:
            kwargs[name] = _coerce(key, value, tp)
    if cls is RunConfig and "data" not in kwargs:
        raise ConfigError("missing [data] section (data.shards or data.rollouts)")
    return cls(**kwargs)


def _resolve(path: str, base: Path) -> str:
    return path if not path or Path(path).is_absolute() else str(base / path)


def parse_config(text: str, *, source: str = "config.toml", base_dir: str | Path | None = None) -> RunConfig:
    """A `RunConfig` from TOML text; errors read ``<source>: <message>``. Paths resolve against base_dir."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: invalid TOML ({exc})") from None
    try:
        cfg = _build(RunConfig, data)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    if base_dir is not None:
        base = Path(base_dir)
        cfg.model.checkpoint = _resolve(cfg.model.checkpoint, base)
        cfg.data.shards = _resolve(cfg.data.shards, base)
        cfg.data.rollouts = [_resolve(p, base) for p in cfg.data.rollouts]
        cfg.output.dir = _resolve(cfg.output.dir, base)
        cfg.train.speed_table = _resolve(cfg.train.speed_table, base)
    return cfg


def load_config(path: str | Path) -> RunConfig:
    """Read a TOML config file (relative paths inside resolve against its directory)."""
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read ({exc})") from None
    cfg = parse_config(text, source=str(path), base_dir=p.parent)
    checkpoint = Path(cfg.model.checkpoint)
    if cfg.model.checkpoint and not checkpoint.is_dir():  # else the loader's "no config.json" misleads
        what = "not a directory" if checkpoint.exists() else "no such directory"
        raise ConfigError(f"{path}: model.checkpoint: {what}: {cfg.model.checkpoint}")
    return cfg


EXAMPLE_CONFIG = """\
# treepack training config (treepack train config.toml). Every key is optional except a data source;
# the values below are the defaults. Relative paths resolve against this file's directory.

[model]
checkpoint = ""             # local Hugging Face checkpoint dir (config.json + *.safetensors); "" = random init
source = "auto"             # treepack (our decoder) | hf (transformers' modules via treepack.hf) | auto (ours if it loads)
# Random-init architecture (ignored with a checkpoint):
family = "qwen3"            # qwen3 (q/k norm) | qwen2 (qkv bias) | llama
vocab_size = 0              # 0 = max token id of the data + 1
compact_vocab = false       # renumber the ids present in the data 0..n-1 (tiny CPU runs; ids saved to vocab.json)
init_on_device = false      # random init drawn on the GPU (fast for large models; values depend on the device)
hidden_size = 64
intermediate_size = 176
num_layers = 2
num_heads = 4
num_kv_heads = 2            # GQA: num_heads must be a multiple
head_dim = 16
rope_theta = 1000000.0
tie_embeddings = false
init_std = 0.02

[data]
shards = "packs"            # packed shards (treepack pack ROLLOUTS -o packs) ...
# rollouts = ["rollouts.jsonl"]   # ... or rollout files, packed on the fly (set exactly one of the two)
capacity = "16k"            # pack capacity in tree tokens when packing rollouts
packs_per_step = 1          # packs per optimizer step (one global batch; gradients accumulated exactly)
shuffle = true              # seeded random pack order each epoch
child_order = "auto"        # token order in each pack: lex | largest-first (same gradients, fewer partial
                            # attention blocks on ToolBench-like packs) | auto (largest-first for tree and auto
                            # modes, lex for dfs and the dense modes)

[train]
mode = "tree"               # tree (tree attention over each pack)
                            # | dense (each sequence separately: the naive baseline)
                            # | dense-leaf (only sequences that are not a prefix of another, duplicates once:
                            #   the strongest simple baseline; same loss, same gradients)
                            # | dfs (depth first, graph bounded by [train.dfs] block_size)
                            # | auto (per pack, the faster of tree and dense-leaf by the FLOP model and the
                            #   GPU's speed table; the choice and why are printed at the start)
attention = "auto"          # auto | reference | flex | triton | fa4 (dense modes also: sdpa, what their auto runs on a CPU)
steps = 100
lr = 0.0003
schedule = "constant"       # constant | cosine (to min_lr_ratio * lr)
warmup_steps = 0
min_lr_ratio = 0.1
weight_decay = 0.0
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0             # 0 = off
dtype = "auto"              # auto (bfloat16 autocast on CUDA, float32 on CPU) | float32 | bfloat16 | float64
device = "auto"             # auto | cpu | cuda
seed = 0
logits_chunk = 4096         # rows of full-vocabulary logits alive at a time
memory_limit = ""           # most GPU memory this run may take: "40GB", "40GiB", "50%" ("" = all it can get)
activation_checkpointing = false
compile = "auto"            # torch.compile norms/RoPE/SwiGLU/loss softmax: auto (on CUDA) | on | off
activation_memory_budget = 1.0  # compiled layers keep this share of saved activations, recompute the rest (0, 1]
micro_batch_tokens = ""     # dense, dense-leaf, auto: most tokens per micro-batch ("" = each pack's size; "32k")
speed_table = ""            # auto: JSON from benchmarks/speed_table.py ("" = built in for the GPU)
balance = "auto"            # --nproc: split by flops | measured (FLOP model fitted to rank times) | auto (measured on CUDA)

[train.loss]
kind = "sft"                # sft | grpo (PPO-clip; advantages from the data, else group-normalised rewards)
normalization = "token"     # token (mean over the global batch's loss tokens) | sequence (mean of sequence means)
clip_low = 0.2
clip_high = 0.2
kl_coef = 0.0               # k3 KL to the behaviour log-probs; 0 = off

[train.dfs]                 # mode = "dfs" only
block_size = "auto"         # most tokens forwarded with grad at once: auto (from the GPU's memory) | 8192 | 0 (unlimited)
keep_tokens = 0             # shared segments kept with their graph instead of re-forwarded: 4096 | "4K" | 0 (off)
order = "backward"          # leaf order, backward (AReaL-DTA Algorithm 1) | layout
subtree_calls = true        # a subtree that fits a block is one tree call (false: AReaL-DTA, leaf by leaf)
merge_anchor_tokens = 512   # an anchor of up to this many tokens rides in the grad call before it (0 = off)
cuda_graphs = false         # replay call shapes met again as CUDA graphs (needs FA4 and compile on CUDA)

[output]
dir = "runs/train"          # checkpoint/ (safetensors) and metrics.jsonl go here
save_every = 0              # steps between checkpoints; 0 = at the end only
save_final = true           # a checkpoint at the end of the run (false: benchmark runs)
resume = true               # continue from dir/checkpoint when present
metrics = "metrics.jsonl"   # "" = no metrics file
log_every = 1
tensorboard = false         # TensorBoard events in dir/tensorboard: tensorboard --logdir runs/train/tensorboard
wandb = false               # Weights & Biases, offline, in dir/wandb (needs wandb; `wandb sync` uploads)
wandb_project = "treepack"
"""


TINY_CONFIG = """\
# treepack training config, size tiny: a few steps on a 2-core CPU in well under a minute, to see the whole
# path work (treepack train tiny.toml). Data: short rollouts, e.g.
#     treepack synth tau2 -n 4 --max-len 2K -o small.jsonl.gz
# On a GPU start from `treepack train --example-config` instead: a Hugging Face checkpoint (model.checkpoint),
# packs of 16k-64K tokens, bfloat16 autocast and compiled kernels (the defaults on CUDA), many more steps.

[model]
compact_vocab = true        # renumber the ids the data uses 0..n-1: a small embedding instead of 151k rows
hidden_size = 64
intermediate_size = 176
num_layers = 2
num_heads = 4
num_kv_heads = 2
head_dim = 16

[data]
rollouts = ["small.jsonl.gz"]   # packed on the fly; a path relative to this file
capacity = "2K"             # small packs: attention on a CPU grows with the square of a pack's tokens

[train]
mode = "tree"
steps = 6
device = "cpu"
dtype = "float32"

[output]
dir = "runs/tiny"
"""
EXAMPLE_CONFIGS = {"full": EXAMPLE_CONFIG, "tiny": TINY_CONFIG}
