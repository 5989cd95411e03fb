"""What a synthetic workload looks like: ``SynthConfig`` (tree shape, turn and segment lengths, forks,
thinking), the five presets (``KINDS``) and ``key=value`` overrides with errors that name the key.

Length settings are ``LogNormal`` distributions (text lengths in LLM rollouts are close to log-normal);
the first four presets' parameters were fitted to real files (see `treepack.datasets.synth` for the measured
shapes). ``swe`` is not: no software-engineering agent trajectories were at hand, so its parameters are
assumptions read off published descriptions of such rollouts (SWE-Gym, SWE-smith, DeepSWE, SkyRL), to be
refitted when real files come.
The generator that turns a config into rollouts is `treepack.datasets.synth`.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from treepack.datasets.vocab import QWEN3_VOCAB, Vocab
from treepack.errors import ConfigError

KINDS = ("tau2", "grpo-math", "agentic-think", "low-overlap", "swe")


@dataclass(frozen=True)
class LogNormal:
    """A length distribution: ``round(median * exp(sigma * z))`` clipped to ``[lo, hi]``.

    Text lengths in LLM rollouts are close to log-normal (heavy right tail, no negative values).
    ``sigma = 0`` with ``lo = hi = median`` is a constant. As a string: ``"M"`` (constant M),
    ``"M,S"`` or ``"M,S,LO,HI"``.
    """

    median: float
    sigma: float = 0.0
    lo: int = 0
    hi: int = 1 << 20

    def __post_init__(self) -> None:
        if not self.median > 0 or not self.sigma >= 0 or not 0 <= self.lo <= self.hi:
            raise ConfigError(f"invalid length distribution {self}: need median > 0, sigma >= 0, lo <= hi")

    @classmethod
    def parse(cls, text: str) -> LogNormal:
        try:
            parts = [float(p) for p in text.split(",")]
        except ValueError:
            parts = []
        if len(parts) == 1:
            return cls(parts[0], 0.0, int(parts[0]), int(parts[0]))
        if len(parts) == 2:
            return cls(parts[0], parts[1])
        if len(parts) == 4:
            return cls(parts[0], parts[1], int(parts[2]), int(parts[3]))
        raise ConfigError(f"invalid length distribution {text!r}: expected M, 'M,SIGMA' or 'M,SIGMA,LO,HI'")

    def with_median(self, median: float) -> LogNormal:
        """Same spread, bounds scaled with the median (``--turns 5`` keeps the shape of the default 15)."""
        k = median / self.median
        lo = max(min(self.lo, 1), round(self.lo * k))
        return LogNormal(median, self.sigma, lo, max(lo, round(self.hi * k)))

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        z = rng.standard_normal(n)
        return np.clip(np.rint(self.median * np.exp(self.sigma * z)), self.lo, self.hi).astype(np.int64)


@dataclass(frozen=True)
class SynthConfig:
    """Shape of a synthetic rollout set. Defaults are the ``tau2`` preset; lengths count body tokens
    (chat-template framing is added: 3-9 tokens per message)."""

    group_size: int = 8  # samples per task (a GRPO group); they share the system prompt and the task prompt
    system_tokens: int = 1200  # the global system prompt with tool schemas, shared by every tree; 0 = none
    prompt: LogNormal = LogNormal(32, 0.4, 8, 1024)  # the task's first user message
    turns: LogNormal = LogNormal(15, 0.3, 2, 40)  # assistant turns per sample (a branch's length)
    response: LogNormal = LogNormal(85, 0.85, 4, 2048)  # an assistant answer, or the text before a tool call
    tool_args: LogNormal = LogNormal(30, 0.4, 8, 512)  # the JSON of a tool call
    tool_prob: float = 0.6  # P(a turn that is not a branch's last calls a tool); else it answers the user
    tool_ramp: int = 4  # turn t calls tools with tool_prob * min(1, t / tool_ramp): agents ask first
    observation: LogNormal = LogNormal(330, 0.8, 8, 8192)  # a tool response
    user_reply: LogNormal = LogNormal(35, 0.5, 2, 512)  # the simulated user's reply
    think: bool = False  # each turn opens with <think>...</think>, dropped from later turns' context
    thinking: LogNormal = LogNormal(300, 0.8, 8, 8192)  # reasoning per turn when `think`
    think_drop: str = "turn"  # reasoning leaves the context at the next turn ("turn": Tree Training Fig. 1)
    # or at the next user message ("user": Qwen3's chat template keeps it through tool calls)
    fork_prob: float = 0.0  # P(a turn forks into parallel branches: concurrent tools, sub-agents)
    fork_max: int = 3  # a fork has 2..fork_max branches; each keeps a uniform share of the turns left
    max_len: int = 16384  # context limit: a branch ends before its first record longer than this
    reward_beta: tuple[float, float] = (1.2, 0.9)  # task success rate ~ Beta(a, b); reward ~ Bernoulli(rate)
    vocab: int = QWEN3_VOCAB  # token ids in [0, vocab); Qwen3's template ids when 151669, else relocated
    logprobs: bool = False  # add per-token behaviour log-probs (0 outside the trained turn)
    steps: int | None = None  # add a `step` column: trees split into this many consecutive training steps

    def __post_init__(self) -> None:
        def need(ok: bool, what: str) -> None:
            if not ok:
                raise ConfigError(f"invalid synth setting: {what}")

        for name in ("group_size", "system_tokens", "tool_ramp", "fork_max", "max_len", "vocab", "steps"):
            value = getattr(self, name)
            is_int = isinstance(value, (int, np.integer)) and not isinstance(value, bool)
            need(is_int or (name == "steps" and value is None), f"{name} must be an integer, got {value!r}")
        need(self.group_size >= 1, f"group_size must be >= 1, got {self.group_size}")
        need(self.system_tokens == 0 or self.system_tokens >= 6,
             f"system_tokens must be 0 or >= 6 (its framing takes 5), got {self.system_tokens}")
        need(self.turns.lo >= 1, f"turns.lo must be >= 1, got {self.turns.lo}")
        need(0.0 <= self.tool_prob <= 1.0, f"tool_prob must be in [0, 1], got {self.tool_prob}")
        need(self.tool_ramp >= 0, f"tool_ramp must be >= 0, got {self.tool_ramp}")
        need(0.0 <= self.fork_prob <= 1.0, f"fork_prob must be in [0, 1], got {self.fork_prob}")
        need(self.fork_max >= 2, f"fork_max must be >= 2, got {self.fork_max}")
        need(self.think_drop in ("turn", "user"), f"think_drop must be turn or user, got {self.think_drop!r}")
        need(self.max_len >= 16, f"max_len must be >= 16, got {self.max_len}")
        need(len(self.reward_beta) == 2 and min(self.reward_beta) > 0,
             f"reward_beta must be two positive numbers, got {self.reward_beta}")
        need(self.steps is None or self.steps >= 1, f"steps must be >= 1, got {self.steps}")
        Vocab(self.vocab)


PRESETS: dict[str, dict[str, object]] = {
    # tau2-bench-like customer-service agent: long shared policy + tool schemas, chains of turns.
    "tau2": {},
    # Math GRPO: a short instruction, a short problem, 16 long independent reasoning answers.
    "grpo-math": {
        "group_size": 16,
        "system_tokens": 30,
        "prompt": LogNormal(110, 0.5, 16, 2048),
        "turns": LogNormal(1, 0.0, 1, 1),
        "response": LogNormal(250, 0.6, 8, 4096),
        "think": True,
        "thinking": LogNormal(1500, 0.6, 32, 12000),
        "max_len": 32768,
        "reward_beta": (0.6, 0.8),
    },
    # Terminal/coding agent (Tree Training Fig. 1 and 5): thinking dropped across turns, tool-heavy,
    # long observations, forks at several depths.
    "agentic-think": {
        "group_size": 4,
        "system_tokens": 3000,
        "prompt": LogNormal(250, 0.6, 16, 4096),
        "turns": LogNormal(10, 0.5, 2, 48),
        "response": LogNormal(110, 0.8, 4, 2048),
        "tool_prob": 0.9,
        "observation": LogNormal(300, 1.1, 4, 8192),
        "think": True,
        "thinking": LogNormal(350, 0.8, 8, 8192),
        "fork_prob": 0.1,
        "max_len": 32768,
        "reward_beta": (0.8, 1.2),
    },
    # SFT/preference-like pairs: no shared system prompt, two answers per prompt.
    "low-overlap": {
        "group_size": 2,
        "system_tokens": 0,
        "prompt": LogNormal(120, 0.7, 4, 4096),
        "turns": LogNormal(1, 0.0, 1, 1),
        "response": LogNormal(250, 0.8, 4, 4096),
        "reward_beta": (1.0, 1.0),
    },
    # Software-engineering agent (SWE-agent / OpenHands scaffolds as RL-trained in SWE-Gym, SWE-smith,
    # DeepSWE, SkyRL). Assumed, not fitted: no such trajectories were measured. A 2.5k-token system prompt
    # with the tool definitions; the task is the issue text (median 600, tail to several thousand); 8
    # samples per issue; ~30 turns (a few to 80), tool calls after the first one or two (thought + action
    # ~150 tokens, arguments ~60; 5% of turns call none and get the user's short "continue"); observations
    # (file views, grep, test output) heavy-tailed, median 700, up to 8k; no thinking and no forks, so a
    # sample is one chain; a 64K context ends the longest ones. Issues are mostly unsolved (mean rate 0.25).
    "swe": {
        "group_size": 8,
        "system_tokens": 2500,
        "prompt": LogNormal(600, 0.7, 64, 8192),
        "turns": LogNormal(30, 0.5, 3, 80),
        "response": LogNormal(150, 0.6, 8, 2048),
        "tool_args": LogNormal(60, 0.7, 8, 2048),
        "tool_prob": 0.95,
        "tool_ramp": 2,
        "observation": LogNormal(700, 1.0, 8, 8192),
        "max_len": 65536,
        "reward_beta": (0.5, 1.5),
    },
}


def preset(kind: str, **overrides: object) -> SynthConfig:
    """The configuration of ``kind`` with top-level fields replaced (``preset("tau2", think=True)``)."""
    if kind not in PRESETS:
        raise ConfigError(f"unknown synth kind {kind!r}: expected one of {', '.join(KINDS)}")
    return configure(SynthConfig(**PRESETS[kind]), overrides)  # type: ignore[arg-type]


def configure(cfg: SynthConfig, settings: Mapping[str, object]) -> SynthConfig:
    """Apply ``{"turns.median": "6", "think": True, ...}``: dotted keys reach into length distributions;
    string values are parsed by the field's type (how ``--set key=value`` lands here)."""
    fields = {f.name for f in dataclasses.fields(SynthConfig)}
    for key, value in settings.items():
        head, _, sub = key.partition(".")
        if head not in fields:
            raise ConfigError(_unknown(key, _setting_names()))
        current = getattr(cfg, head)
        if sub:
            if not isinstance(current, LogNormal) or sub not in ("median", "sigma", "lo", "hi"):
                raise ConfigError(_unknown(key, _setting_names()))
            sub_value = _parse(value, float if sub in ("median", "sigma") else int, key)
            value = dataclasses.replace(current, **{sub: sub_value})
        else:
            value = _parse(value, type(current) if current is not None else int, key)
        cfg = dataclasses.replace(cfg, **{head: value})
    return cfg


def _setting_names() -> list[str]:
    names = []
    for f in dataclasses.fields(SynthConfig):
        names.append(f.name)
        if isinstance(f.default, LogNormal):
            names += [f"{f.name}.{g.name}" for g in dataclasses.fields(LogNormal)]
    return names


def _unknown(key: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"valid: {', '.join(valid)}"
    return f"unknown synth setting {key!r}: {hint}"


def _parse(value: object, kind: type, key: str) -> object:
    if not isinstance(value, str):
        return value
    try:
        if kind is bool:
            if value.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError
            return value.lower() in ("1", "true", "yes")
        if kind is LogNormal:
            return LogNormal.parse(value)
        if kind is tuple:
            return tuple(float(v) for v in value.split(","))
        return kind(value)
    except ValueError:
        raise ConfigError(f"invalid value {value!r} for synth setting {key!r}") from None


# --- segments: the distinct pieces of text, each materialised once --------------------------------
# kind -> layout: template token names (tuples) and random bodies (0 = body, 1 = the tool-call JSON).
