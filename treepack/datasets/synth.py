"""Seeded synthetic RL rollouts with the prefix-tree shapes of real agent and reasoning workloads.

One engine, five presets (``KINDS``). A *tree* is one task: a global system prompt shared by every
tree, the task's first user message, and a GRPO group of ``group_size`` samples. A sample is a
trajectory of assistant turns; after each turn comes a tool response or a user reply; a turn may fork
into parallel branches (concurrent tools, sub-agents). One record per assistant turn = the context the
model saw + that turn's response, ``loss_mask`` 1 on the response through ``<|im_end|>``, rendered in
Qwen3's ChatML like the real ``samples/tau_bench_slice.parquet``. With ``think``, every turn opens
with ``<think>...</think>``, trained in its own record and dropped from later turns' context, so a
sample is a comb of branches, not a chain (Tree Training's Figure 1); ``think_drop="user"`` keeps it
until the next user message instead (Qwen3's chat template), mixing chains and branches.

Measured at defaults (``-n 64``, seed 0; whole file, ``treepack stats``):

    kind                    shape                                            C      POR    C_leaf  tokens/tree
    tau2                    sys 1.2k; 8 samples x ~15 turns; prefix chains   11.43  0.913  1.20    573k
    tau2 think              thinking dropped at every turn: all leaves        5.16  0.806  5.16    618k
    tau2 think, drop=user   thinking kept through tool calls                  4.76  0.790  2.32    664k
    agentic-think           sys 3k; 4 samples x ~10 turns; forks p=0.1        6.38  0.843  6.38    473k
    grpo-math               16 answers of ~2k tokens to one prompt            1.07  0.065  1.07     37k
    low-overlap             2 answers per prompt, no system prompt            1.19  0.159  1.19      1k
    swe (assumed, not fit)  sys 2.5k; 8 samples x ~30 turns; 64K context     19.81  0.950  1.08    6.1M

Real reference (same definitions): tau-bench retail 11.14 (one sample per task), ToolBench DFS 10.88,
AReaL-DTA's tau2-bench 9.43 (leaf-only 5.56), GSM8K 4-answer groups 1.40, hh-rlhf pairs 1.67. tau2's
per-turn lengths are fitted to the real tau-bench file (response median 87, mean 136 tokens; turns
5-28, median 15; short user exchanges first, tool outputs of ~300-600 tokens from turn ~4 on, hence
``tool_ramp``): with its 1,212-token system prompt and one sample per task, 115 synthetic trees give
1,778 records and C 11.33 against the real 1,787 records and C 11.14. ``swe`` has no real reference: its
parameters are assumptions (see ``synth_config``) for software-engineering agents' RL rollouts (SWE-Gym,
SWE-smith, DeepSWE, SkyRL), not fits. Its 64 trees above are 512 chains of 31 turns at the median (5th-95th
percentile 13-51, at most 65: the 64K context ends the 80-turn tail), records up to 65,461 tokens, 0.3M
distinct tokens per tree; written to Parquet in 19 s, measured by ``treepack stats`` in 42 s and 5.5 GB.

Design and trade-offs:
- **Vectorised by turn depth, never by token.** Lengths and decisions are drawn for all live branches
  of a chunk at once (one Python iteration per turn depth); each distinct piece of text (a *segment*)
  is materialised once into a pool of ~N_tree tokens; records are lists of segment ids, expanded into
  the flat ``int32`` buffer by one gather. One core makes ~85M tokens/s of tau2 and agentic-think
  (ids, masks, Arrow lists) and ~40-50M of grpo-math and low-overlap, whose pool is as large as the
  output (text sampling dominates); 100M tokens take 1-3 s. Writing them (JSON, Parquet) costs more.
- **Deterministic and chunk-stable.** Trees are made in chunks of ~8M tokens (~180 MB of arrays);
  chunk k draws from ``SeedSequence(seed, spawn_key=(0, k))`` and the system prompt from its own
  stream, so a seed gives byte-identical output however it is consumed (``generate``,
  ``iter_batches``, a file) and streaming memory stays at one chunk. Log-probs are drawn last, so
  ``logprobs=True`` adds a column and changes nothing else; ``steps`` only labels trees.
- **A context limit, not truncation.** A branch ends before its first record longer than ``max_len``
  (as a rollout engine stops at the context limit), so no record is ever cut mid-turn.
- Rewards are Bernoulli per sample with a per-task success rate ~ Beta; advantages are GRPO's
  ``(r - mean_group) / (std_group + 1e-6)`` (population std) over the group's samples that have records,
  shared by every record of a sample. A sample whose first turn does not fit ``max_len`` has none; `write`
  counts them.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from treepack.datasets.synth_config import KINDS, LogNormal, SynthConfig, configure, preset  # noqa: F401 (re-exported)
from treepack.datasets.vocab import Vocab
from treepack.datasets.writer import RolloutWriter
from treepack.errors import ConfigError

_CHUNK_TOKENS = 1 << 23  # target flat tokens per chunk: bounds streaming memory (~18 bytes/token)


_SYS, _HEAD, _PROMPT, _USER, _TOOL, _THINK, _TEXT, _CALL = range(8)
_LAYOUT: dict[int, tuple] = {
    _SYS: (("im_start", "system", "nl"), 0, ("im_end", "nl")),
    _HEAD: (("im_start", "assistant", "nl"),),
    _PROMPT: (("im_start", "user", "nl"), 0, ("im_end", "nl")),
    _USER: (("im_start", "user", "nl"), 0, ("im_end", "nl")),
    _TOOL: (("im_start", "user", "nl", "tool_response", "nl"), 0,
            ("nl", "tool_response_end", "im_end", "nl")),
    _THINK: (("think", "nl"), 0, ("nl", "think_end", "nl2")),
    _TEXT: (0, ("im_end", "nl")),
    _CALL: (0, ("nl", "tool_call", "nl"), 1, ("nl", "tool_call_end", "im_end", "nl")),
}
# Trained span of a segment when it is the turn a record trains on: [start + a, end - b).
_TRAINED = {_THINK: (0, 0), _TEXT: (0, 1), _CALL: (0, 1)}
_FRAME = np.array([sum(len(p) for p in _LAYOUT[k] if isinstance(p, tuple)) for k in range(8)], dtype=np.int64)


class _Segments:
    """Append-only registry of segments (kind + body lengths); ids are positions."""

    def __init__(self) -> None:
        self.kind: list[np.ndarray] = []
        self.body: list[np.ndarray] = []
        self.args: list[np.ndarray] = []
        self.n = 0

    def add(self, kind: np.ndarray | int, body: np.ndarray, args: np.ndarray | None = None) -> np.ndarray:
        body = np.asarray(body, dtype=np.int64)
        self.kind.append(np.broadcast_to(np.asarray(kind, dtype=np.int8), body.shape))
        self.body.append(body)
        self.args.append(np.zeros_like(body) if args is None else np.asarray(args, dtype=np.int64))
        ids = np.arange(self.n, self.n + body.size, dtype=np.int64)
        self.n += body.size
        return ids

    def materialize(self, vocab: Vocab, rng: np.random.Generator, system_ids: np.ndarray | None = None):
        """Pool of all segment tokens: (tokens int32, trained-span mask int8, start, length).

        ``system_ids``: the global system prompt's tokens, copied over every ``_SYS`` segment.
        """
        kind = np.concatenate(self.kind)
        body, args = np.concatenate(self.body), np.concatenate(self.args)
        length = _FRAME[kind] + body + np.where(kind == _CALL, args, 0)
        start = np.zeros_like(length)
        np.cumsum(length[:-1], out=start[1:])
        total = int(start[-1] + length[-1])
        pool = vocab.text(rng, total)
        delta = np.zeros(total + 1, dtype=np.int8)
        for k, layout in _LAYOUT.items():
            sel = np.flatnonzero(kind == k)
            if sel.size == 0:
                continue
            pos = start[sel].copy()
            for part in layout:
                if isinstance(part, tuple):
                    for j, tok in enumerate(vocab.ids(*part)):
                        pool[pos + j] = tok
                    pos += len(part)
                else:
                    pos += (body if part == 0 else args)[sel]
            if k in _TRAINED:
                a, b = _TRAINED[k]
                delta[start[sel] + a] += 1
                delta[start[sel] + length[sel] - b] -= 1
        if system_ids is not None:
            for s in np.flatnonzero(kind == _SYS):
                pool[start[s] : start[s] + length[s]] = system_ids
        return pool, np.cumsum(delta[:-1], dtype=np.int8), start, length


def _system_prompt(cfg: SynthConfig, vocab: Vocab, seed: int) -> np.ndarray:
    """The global system prompt, from its own stream so every chunk (and every n) shares it."""
    rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(1,)))
    seg = _Segments()
    seg.add(_SYS, np.array([cfg.system_tokens - _FRAME[_SYS]]))
    return seg.materialize(vocab, rng)[0]


# --- the engine ------------------------------------------------------------------------------------
@dataclass
class _Turns:
    """Turn nodes of a chunk (one record each), in creation order (depth-major)."""

    parent: np.ndarray
    sample: np.ndarray
    depth: np.ndarray
    env: np.ndarray  # segment of the message before the turn (-1 at a sample's first turn)
    think: np.ndarray  # -1 without think
    answer: np.ndarray
    user_depth: np.ndarray  # depth of the latest user message on the path (the prompt is one, at depth 0)


def _grow(cfg: SynthConfig, rng: np.random.Generator, seg: _Segments, base_len: np.ndarray) -> _Turns:
    """Grow all samples' turn trees, one depth per iteration; ``base_len`` = tokens before turn 0."""
    n_samples = base_len.size
    cols: dict[str, list[np.ndarray]] = {f.name: [] for f in dataclasses.fields(_Turns)}
    sample = np.arange(n_samples)
    parent = np.full(n_samples, -1)
    ctx, budget = base_len.copy(), cfg.turns.sample(rng, n_samples)
    pending = np.zeros(n_samples, dtype=np.int64)  # kept thinking in the context (think_drop="user")
    keep_think = cfg.think and cfg.think_drop == "user"
    after_call = np.zeros(n_samples, dtype=bool)
    user_depth = np.zeros(n_samples, dtype=np.int64)
    n_nodes, depth, head = 0, 0, _FRAME[_HEAD]
    while sample.size:
        m = sample.size
        env_body = np.where(after_call, cfg.observation.sample(rng, m), cfg.user_reply.sample(rng, m))
        env_kind = np.where(after_call, _TOOL, _USER).astype(np.int8)
        env_len = (_FRAME[env_kind] + env_body) if depth else np.zeros(m, np.int64)
        think_body = cfg.thinking.sample(rng, m) if cfg.think else np.zeros(m, np.int64)
        think_len = (_FRAME[_THINK] + think_body) if cfg.think else think_body
        p_call = cfg.tool_prob * min(1.0, depth / cfg.tool_ramp) if cfg.tool_ramp else cfg.tool_prob
        is_call = (budget > 1) & (rng.random(m) < p_call)
        body, args = cfg.response.sample(rng, m), cfg.tool_args.sample(rng, m)
        ans_kind = np.where(is_call, _CALL, _TEXT).astype(np.int8)
        ans_len = _FRAME[ans_kind] + body + np.where(is_call, args, 0)
        pending = np.where(after_call, pending, 0)  # a user message drops the kept thinking
        keep = np.flatnonzero(ctx + pending + env_len + head + think_len + ans_len <= cfg.max_len)

        k = keep.size
        cols["parent"].append(parent[keep])
        cols["sample"].append(sample[keep])
        cols["depth"].append(np.full(k, depth))
        cols["env"].append(seg.add(env_kind[keep], env_body[keep]) if depth else np.full(k, -1))
        cols["think"].append(seg.add(_THINK, think_body[keep]) if cfg.think else np.full(k, -1))
        cols["answer"].append(seg.add(ans_kind[keep], body[keep], args[keep]))
        user_depth = np.where(after_call, user_depth, depth)[keep]
        cols["user_depth"].append(user_depth)
        ids = np.arange(n_nodes, n_nodes + k)
        n_nodes += k

        # Children: one per continuing branch, 2..fork_max at a fork, each with its own next message.
        b, child_ctx = budget[keep], (ctx + env_len + head + ans_len)[keep]
        fork = (b > 1) & (rng.random(k) < cfg.fork_prob)
        width = np.where(fork, rng.integers(2, cfg.fork_max + 1, size=k), 1) * (b > 1)
        b_c, fork_c = np.repeat(b, width), np.repeat(fork, width)
        share = 1 + np.floor(rng.random(b_c.size) * (b_c - 1)).astype(np.int64)
        budget = np.where(fork_c, share, b_c - 1)
        parent, sample = np.repeat(ids, width), np.repeat(sample[keep], width)
        pending = np.repeat((pending + think_len)[keep] if keep_think else pending[keep], width)
        ctx, after_call = np.repeat(child_ctx, width), np.repeat(is_call[keep], width)
        user_depth = np.repeat(user_depth, width)
        depth += 1
    return _Turns(**{k: np.concatenate(v) for k, v in cols.items()})


def _records(turns: _Turns, head_seg: int, lead: np.ndarray, keep_think_since_user: bool):
    """Each turn's record as segment ids, DFS-ordered per sample.

    An earlier turn enters the context as [message before it][header][answer]; its thinking too while no
    user message has come since (``keep_think_since_user``, Qwen3's rule). The turn itself is
    [message][header][thinking][answer], the last two trained.

    ``lead`` = segments before a sample's first turn (system, prompt; -1 = none), one row per sample.
    Returns (order, segment matrix [R, W] with -1 holes, trained-column flags [W]).
    """
    n, d_max = turns.depth.size, int(turns.depth.max()) + 1
    anc = np.full((n, d_max), -1, dtype=np.int64)  # anc[v, j] = v's ancestor at depth j
    anc[np.arange(n), turns.depth] = np.arange(n)
    for j in range(d_max - 1, 0, -1):
        rows = np.flatnonzero(anc[:, j] >= 0)
        anc[rows, j - 1] = turns.parent[anc[rows, j]]
    order = np.lexsort(anc.T[::-1])  # root first: sample-major DFS preorder (parents sort before children)

    cols = [lead[turns.sample]]
    for j in range(d_max - 1):
        a = anc[:, j]
        ctx = (a >= 0) & (turns.depth > j)
        kept = ctx & (turns.user_depth <= j) if keep_think_since_user else np.zeros_like(ctx)
        cols += [np.where(ctx, turns.env[a], -1), np.where(ctx, head_seg, -1),
                 np.where(kept, turns.think[a], -1), np.where(ctx, turns.answer[a], -1)]
    cols += [turns.env[:, None], np.full((n, 1), head_seg), turns.think[:, None], turns.answer[:, None]]
    mat = np.concatenate([c if c.ndim == 2 else c[:, None] for c in cols], axis=1)[order]
    trained = np.zeros(mat.shape[1], dtype=np.int8)
    trained[-2:] = 1
    return order, mat, trained


def _chunk(cfg: SynthConfig, vocab: Vocab, system_ids: np.ndarray, rng: np.random.Generator,
           tree_lo: int, tree_hi: int, n_total: int) -> pa.RecordBatch:
    """Trees ``[tree_lo, tree_hi)`` of ``n_total`` as one record batch, all draws from ``rng``."""
    n_trees, g = tree_hi - tree_lo, cfg.group_size
    seg = _Segments()
    sys_seg = seg.add(_SYS, np.array([system_ids.size - _FRAME[_SYS]]))[0] if cfg.system_tokens else -1
    head_seg = seg.add(_HEAD, np.zeros(1, np.int64))[0]
    prompt_body = cfg.prompt.sample(rng, n_trees)
    prompt_seg = seg.add(_PROMPT, prompt_body)
    rate = rng.beta(*cfg.reward_beta, size=n_trees)
    sample_tree = np.repeat(np.arange(n_trees), g)
    reward = (rng.random(n_trees * g) < rate[sample_tree]).astype(np.float64)

    base = system_ids.size + _FRAME[_PROMPT] + prompt_body
    turns = _grow(cfg, rng, seg, base[sample_tree])
    if turns.depth.size == 0:  # every first turn is over max_len
        return pa.RecordBatch.from_pylist([], schema=schema(cfg)), 0, 0
    lead = np.stack([np.full(n_trees * g, sys_seg), prompt_seg[sample_tree]], axis=1)
    order, mat, trained = _records(turns, head_seg, lead, cfg.think and cfg.think_drop == "user")
    pool, pool_mask, seg_start, seg_len = seg.materialize(vocab, rng, system_ids)

    # Expand records into the flat buffer: one gather from the pool.
    valid = mat >= 0
    run = mat[valid]
    run_len = seg_len[run]
    run_trained = np.broadcast_to(trained, mat.shape)[valid]
    rec_len = np.where(valid, seg_len[np.maximum(mat, 0)], 0).sum(axis=1)
    total = int(rec_len.sum())
    if total >= 1 << 31:
        raise ConfigError(f"trees {tree_lo}..{tree_hi - 1} hold {total:,} tokens: over an Arrow list's 2**31")
    out_start = np.cumsum(run_len) - run_len
    idx = np.repeat(seg_start[run] - out_start, run_len) + np.arange(total, dtype=np.int64)
    tokens = pool[idx]
    mask = pool_mask[idx] * np.repeat(run_trained, run_len)
    offsets = np.zeros(rec_len.size + 1, dtype=np.int32)
    np.cumsum(rec_len, out=offsets[1:])

    sample = turns.sample[order]
    tree = sample // g
    k = np.arange(sample.size) - np.searchsorted(sample, sample)  # record index within its sample
    advantage = _advantages(reward, sample_tree, np.bincount(sample, minlength=n_trees * g) > 0, n_trees)

    tree_id = tree + tree_lo
    id_parts = (pa.array(x).cast(pa.string()) for x in (tree_id, sample % g, k))
    cols: dict[str, pa.Array] = {
        "id": pc.binary_join_element_wise(*id_parts, "/"),  # tree/sample/record
        "tree_id": pa.array(tree_id, pa.int64()),
    }
    if cfg.steps is not None:
        cols["step"] = pa.array(tree_id * cfg.steps // n_total, pa.int64())
    off = pa.array(offsets)
    cols["input_ids"] = pa.ListArray.from_arrays(off, pa.array(tokens, pa.int32()))
    cols["loss_mask"] = pa.ListArray.from_arrays(off, pa.array(mask, pa.int8()))
    cols["reward"] = pa.array(reward[sample], pa.float64())
    cols["advantage"] = pa.array(advantage[sample], pa.float64())
    if cfg.logprobs:  # drawn last: the other columns do not depend on this flag
        # Sampled tokens' log-probs: mostly near 0 with a heavy tail (-0.1 E^2, E ~ Exp(1): median -0.05).
        lp = np.zeros(pool.size, dtype=np.float32)
        hot = np.flatnonzero(pool_mask)
        lp[hot] = np.maximum(-0.1 * rng.standard_exponential(hot.size, dtype=np.float32) ** 2, -30.0)
        lp_flat = np.where(mask, lp[idx], np.float32(0))
        cols["logprobs"] = pa.ListArray.from_arrays(off, pa.array(lp_flat, pa.float32()))
    n_samples = len(np.unique(sample))
    return pa.RecordBatch.from_pydict(cols, schema=schema(cfg)), n_samples, len(np.unique(tree))


def _advantages(reward: np.ndarray, sample_tree: np.ndarray, present: np.ndarray, n_trees: int) -> np.ndarray:
    """GRPO's ``(r - mean_group) / (std_group + 1e-6)`` (population std) over the samples of each group that
    have records (``present``): a sample whose first turn is over ``max_len`` is not part of the group."""
    count = np.bincount(sample_tree, present, n_trees)
    mean = np.bincount(sample_tree, reward * present, n_trees) / np.maximum(count, 1)
    var = np.bincount(sample_tree, present * (reward - mean[sample_tree]) ** 2, n_trees) / np.maximum(count, 1)
    return (reward - mean[sample_tree]) / (np.sqrt(var)[sample_tree] + 1e-6)


def schema(cfg: SynthConfig) -> pa.Schema:
    """The record columns treepack reads; ``step`` and ``logprobs`` only when the config asks for them."""
    fields = [pa.field("id", pa.string()), pa.field("tree_id", pa.int64())]
    if cfg.steps is not None:
        fields.append(pa.field("step", pa.int64()))
    fields += [
        pa.field("input_ids", pa.list_(pa.int32())),
        pa.field("loss_mask", pa.list_(pa.int8())),
        pa.field("reward", pa.float64()),
        pa.field("advantage", pa.float64()),
    ]
    if cfg.logprobs:
        fields.append(pa.field("logprobs", pa.list_(pa.float32())))
    return pa.schema(fields)


def trees_per_chunk(cfg: SynthConfig) -> int:
    """Trees per chunk, from the config's expected tokens per tree (never from ``n``: output is stable)."""
    env = cfg.tool_prob * cfg.observation.median + (1 - cfg.tool_prob) * cfg.user_reply.median
    per_turn = cfg.response.median + env
    think = cfg.thinking.median if cfg.think else 0.0
    t = cfg.turns.median * (1 + cfg.fork_prob * (cfg.fork_max - 1))
    per_record = cfg.system_tokens + cfg.prompt.median + t * per_turn / 2 + think + 16
    return int(np.clip(_CHUNK_TOKENS // max(1.0, cfg.group_size * t * per_record), 1, 4096))


def _resolve(kind: str | SynthConfig, overrides: Mapping[str, object]) -> SynthConfig:
    if isinstance(kind, SynthConfig):
        return configure(kind, overrides)
    return preset(kind, **overrides)


def iter_batches(
    kind: str | SynthConfig, n: int, *, seed: int = 0, **overrides: object
) -> Iterator[pa.RecordBatch]:
    """Yield the rollouts of ``n`` trees (tasks) as Arrow record batches, one per chunk of trees.

    ``kind``: a name of ``KINDS`` or a ``SynthConfig``; ``overrides``: top-level ``SynthConfig`` fields.
    Memory stays at one chunk (~8M tokens), so any size can be streamed to a file.
    """
    cfg = _resolve(kind, overrides)
    for batch, _, _ in _chunks(cfg, n, seed):
        yield batch


def _chunks(cfg: SynthConfig, n: int, seed: int) -> Iterator[tuple[pa.RecordBatch, int, int]]:
    """(batch, samples with records, trees with records) per chunk of trees."""
    if not isinstance(n, (int, np.integer)) or n < 1:
        raise ConfigError(f"n (number of trees) must be a positive integer, got {n!r}")
    vocab = Vocab(cfg.vocab)
    system_ids = _system_prompt(cfg, vocab, seed) if cfg.system_tokens else np.empty(0, np.int32)
    per = trees_per_chunk(cfg)
    for k, lo in enumerate(range(0, n, per)):
        rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(0, k)))
        yield _chunk(cfg, vocab, system_ids, rng, lo, min(n, lo + per), n)


def generate(kind: str | SynthConfig, n: int, *, seed: int = 0, **overrides: object) -> pa.Table:
    """All rollouts of ``n`` trees as one ``pyarrow.Table`` (``generate("tau2", 16, seed=1, think=True)``)."""
    cfg = _resolve(kind, overrides)
    return pa.Table.from_batches(list(iter_batches(cfg, n, seed=seed)), schema=schema(cfg))


class WriteResult(NamedTuple):
    path: str
    trees: int  # asked for
    records: int
    tokens: int
    seconds: float
    samples: int = 0  # samples written: those whose first turn fits max_len
    samples_asked: int = 0  # trees x group_size
    trees_written: int = 0  # trees with at least one sample written


def write(kind: str | SynthConfig, n: int, path: str | Path, *, seed: int = 0,
          progress: Callable[[int], None] | None = None, **overrides: object) -> WriteResult:
    """Stream the rollouts of ``n`` trees to ``path``: ``.jsonl``, ``.jsonl.gz``, ``.parquet`` or ``-``.

    ``progress(trees_done)`` is called after each chunk. Samples whose first turn does not fit ``max_len`` have
    no record and are counted (`WriteResult`); when no record fits, nothing is written and it is an error.
    """
    cfg = _resolve(kind, overrides)
    start = time.perf_counter()
    samples = trees_written = 0
    with RolloutWriter(path, schema(cfg)) as out:
        per = trees_per_chunk(cfg)
        for k, (batch, kept, kept_trees) in enumerate(_chunks(cfg, n, seed)):
            out.write(batch)
            samples, trees_written = samples + kept, trees_written + kept_trees
            if progress is not None:
                progress(min(n, (k + 1) * per))
        if out.records == 0:  # raised inside the block: the file is not created
            raise ConfigError(f"no record fits max_len = {cfg.max_len:,} tokens: the shared prompt and the first "
                              f"turn need more ({cfg.system_tokens:,} system tokens); raise max_len")
    return WriteResult(str(path), n, out.records, out.tokens, time.perf_counter() - start, samples,
                       n * cfg.group_size, trees_written)
