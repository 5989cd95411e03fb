"""Synthetic rollouts: determinism, schema, the tree shape of each kind (against the naive dict trie of
``oracle.py``), the ``treepack synth`` command, and the bundled samples regenerating byte for byte."""

from __future__ import annotations

import dataclasses
import gzip
import itertools
import json
import re
import shlex
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from cli_helpers import run
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import naive_stats

from treepack.cli.synth import Kind
from treepack.datasets import SAMPLES_DIR, LogNormal, generate, iter_batches, preset
from treepack.datasets.synth import KINDS, trees_per_chunk
from treepack.datasets.vocab import QWEN3_VOCAB, Vocab
from treepack.errors import ConfigError

IM_START, ASSISTANT = 151644, 77091
SMALL = {"tau2": 2, "grpo-math": 4, "agentic-think": 2, "low-overlap": 64, "swe": 1}  # trees of each kind
# ... at settings that keep them at 0.06-0.7M tokens: a swe tree holds ~6M at its 64K context, ~0.5M at 12K.
SHORT: dict[str, dict[str, object]] = {"swe": {"max_len": 12288}}


def tables_equal(a: pa.Table, b: pa.Table) -> bool:
    return a.combine_chunks().equals(b.combine_chunks())


def by_sample(table: pa.Table) -> dict[tuple[int, int], list[list[int]]]:
    """input_ids per (tree, sample), in record order (ids are tree/sample/k)."""
    out: dict = {}
    for rid, ids in zip(table.column("id").to_pylist(), table.column("input_ids").to_pylist()):
        tree, sample, k = map(int, rid.split("/"))
        rows = out.setdefault((tree, sample), [])
        assert k == len(rows), f"record {rid} out of order"
        rows.append(ids)
    return out


def without_own_think(ids: list[int], v: Vocab = Vocab()) -> list[int]:  # noqa: B008 - Vocab is immutable
    """The record as later turns see it: its trained turn's <think>...</think>\\n\\n removed."""
    start = len(ids) - 1 - ids[::-1].index(v.id("think"))
    end = ids.index(v.id("think_end"), start)
    assert ids[end + 1] == v.id("nl2")
    return ids[:start] + ids[end + 2 :]


def is_prefix(a: list[int], b: list[int]) -> bool:
    return len(a) <= len(b) and b[: len(a)] == a


# --- determinism --------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_same_seed_same_table_other_seed_differs(kind):
    short = SHORT.get(kind, {})
    a = generate(kind, SMALL[kind], seed=7, **short)
    assert tables_equal(a, generate(kind, SMALL[kind], seed=7, **short))
    b = generate(kind, SMALL[kind], seed=8, **short)
    assert a.column("input_ids").to_pylist() != b.column("input_ids").to_pylist()


def test_output_does_not_depend_on_chunking_or_flags():
    # Short answers: 4096 trees per chunk, so 4100 trees span two chunks, each from its own seed stream.
    cfg = preset("low-overlap", prompt=LogNormal(4, 0.5, 1, 8), response=LogNormal(4, 0.5, 1, 8))
    assert trees_per_chunk(cfg) == 4096
    batches = list(iter_batches(cfg, 4100, seed=3))
    assert len(batches) == 2
    whole = generate(cfg, 4100, seed=3)
    assert tables_equal(pa.Table.from_batches(batches), whole)
    # logprobs are drawn last and steps only label trees: every other column is unchanged.
    extra = generate(cfg, 4100, seed=3, logprobs=True, steps=4)
    assert tables_equal(extra.drop_columns(["logprobs", "step"]), whole)


# --- schema -------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("vocab", [QWEN3_VOCAB, 1000])
def test_schema_and_values(kind, vocab):
    n, short = SMALL[kind], SHORT.get(kind, {})
    t = generate(kind, n, seed=1, vocab=vocab, logprobs=True, steps=2, **short)
    names = ["id", "tree_id", "step", "input_ids", "loss_mask", "reward", "advantage", "logprobs"]
    assert t.schema.names == names
    assert t.schema.field("input_ids").type == pa.list_(pa.int32())
    assert t.schema.field("loss_mask").type == pa.list_(pa.int8())
    assert t.schema.field("logprobs").type == pa.list_(pa.float32())
    lens = t.column("input_ids").combine_chunks().value_lengths().to_numpy()
    for col in ("loss_mask", "logprobs"):
        assert np.array_equal(t.column(col).combine_chunks().value_lengths().to_numpy(), lens)
    ids = t.column("input_ids").combine_chunks().values.to_numpy()
    assert ids.min() >= 0 and ids.max() < vocab
    assert lens.max() <= preset(kind, **short).max_len
    assert len(set(t.column("id").to_pylist())) == t.num_rows

    v = Vocab(vocab)
    for ids, mask, lp in zip(*(t.column(c).to_pylist()[:50] for c in ("input_ids", "loss_mask", "logprobs"))):
        m = np.array(mask)
        assert set(m.tolist()) <= {0, 1} and m.sum() > 0
        on = np.flatnonzero(m)
        # Only the record's own turn trains: one run through <|im_end|>, then the trailing newline.
        assert on[-1] == len(m) - 2 and np.all(np.diff(on) == 1)
        assert ids[-2:] == [v.id("im_end"), v.id("nl")]
        assert ids[on[0] - 3 : on[0]] == [v.id("im_start"), v.id("assistant"), v.id("nl")]
        lp = np.array(lp)
        assert np.all(lp[m == 0] == 0) and np.all(lp <= 0) and np.all(lp > -31)

    tree = t.column("tree_id").to_numpy()
    assert np.array_equal(np.unique(tree), np.arange(n))
    assert np.array_equal(t.column("step").to_numpy(), tree * 2 // n)
    reward, adv = t.column("reward").to_numpy(), t.column("advantage").to_numpy()
    assert set(np.unique(reward)) <= {0.0, 1.0}
    first = np.unique([rid.rsplit("/", 1)[0] for rid in t.column("id").to_pylist()], return_index=True)[1]
    for k in range(n):  # GRPO: advantages of a group's samples sum to zero
        assert abs(adv[first][tree[first] == k].sum()) < 1e-6


# --- shapes -------------------------------------------------------------------------------------
def test_tau2_turns_chain():
    """Without thinking, each turn's record is the previous one plus the next message and turn."""
    t = generate("tau2", SMALL["tau2"], seed=0)
    samples = by_sample(t)
    assert len(samples) == SMALL["tau2"] * preset("tau2").group_size
    for recs in samples.values():
        assert len(recs) >= 2
        assert all(len(a) < len(b) and is_prefix(a, b) for a, b in itertools.pairwise(recs))
    st = naive_stats(t.column("input_ids").to_pylist())
    assert 8.0 <= st["compression"] <= 13.0, st  # real tau-bench retail: 11.14; 12 seeds here: 8.4-12.6
    assert st["c_leaf"] < 1.5  # every record but the last of a sample is a prefix of another


def test_tau2_think_branches():
    """With thinking, turn t+1 sees turn t without its <think> block: every record is its own branch."""
    t = generate("tau2", SMALL["tau2"], seed=0, think=True)
    for recs in by_sample(t).values():
        for a, b in itertools.pairwise(recs):
            assert not is_prefix(a, b)
            assert is_prefix(without_own_think(a), b)
    st = naive_stats(t.column("input_ids").to_pylist())
    assert 4.0 <= st["compression"] <= 6.5, st  # AReaL-DTA's tau2 leaf-only rate: 5.56
    assert st["n_leaves"] == t.num_rows


def test_think_kept_until_the_next_user_message():
    """Qwen3's rule: reasoning stays in context through tool calls, leaves at the next user message."""
    t = generate("tau2", 2, seed=0, think=True, think_drop="user", group_size=4)
    v = Vocab()
    chained = branched = 0
    for recs in by_sample(t).values():
        for a, b in itertools.pairwise(recs):
            after = b[len(a) : len(a) + 4]
            tool_reply = after == [v.id("im_start"), v.id("user"), v.id("nl"), v.id("tool_response")]
            assert is_prefix(a, b) == tool_reply
            chained += tool_reply
            branched += not tool_reply
    assert chained and branched


def test_agentic_think_forks_at_several_depths():
    t = generate("agentic-think", SMALL["agentic-think"], seed=0)
    fork_turns = set()
    for recs in by_sample(t).values():
        for a, b in itertools.pairwise(recs):
            a = without_own_think(a)
            if not is_prefix(a, b):  # b starts a sibling branch: it shares a's context up to the fork
                lcp = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
                fork_turns.add(sum(1 for i in range(lcp - 1) if a[i] == IM_START and a[i + 1] == ASSISTANT))
    assert len(fork_turns) >= 2, fork_turns
    st = naive_stats(t.column("input_ids").to_pylist())
    assert 4.0 <= st["compression"] <= 8.0, st


def test_swe_chains_of_tool_calls():
    """swe at its own settings: 8 samples per issue behind one shared 2.5k-token system prompt, each a single
    chain of ~30 turns (every record extends the sample's previous one), a plain first turn and tool calls
    from the third turn on, contexts past 32K but never past 64K."""
    v = Vocab()
    t = generate("swe", 4, seed=0)
    col = t.column("input_ids").combine_chunks()
    ids, off = col.values.to_numpy(), col.offsets.to_numpy()
    mask = t.column("loss_mask").combine_chunks().values.to_numpy()
    key = np.array([tuple(map(int, rid.split("/"))) for rid in t.column("id").to_pylist()])  # tree, sample, k
    assert [int(np.unique(key[key[:, 0] == tree, 1]).size) for tree in range(4)] == [8] * 4

    system = ids[: int(np.flatnonzero(ids[: off[1]] == v.id("im_end"))[0]) + 2]
    assert 2000 <= system.size <= 3000 and list(system[[0, -1]]) == [v.id("im_start"), v.id("nl")]
    lead: dict[int, np.ndarray] = {}
    for r, (tree, _, _) in enumerate(key):  # every record: the system prompt, then its tree's issue
        rec = ids[off[r] : off[r + 1]]
        assert np.array_equal(rec[: system.size], system)
        if tree not in lead:
            end = system.size + int(np.flatnonzero(rec[system.size :] == v.id("im_end"))[0]) + 2
            lead[tree] = rec[:end]
        assert np.array_equal(rec[: lead[tree].size], lead[tree])
    assert len({a.tobytes() for a in lead.values()}) == 4  # four issues, one per tree

    turns, calls, late = [], 0, 0
    for r in range(len(key)):
        rec = ids[off[r] : off[r + 1]]
        called = v.id("tool_call") in rec[mask[off[r] : off[r + 1]] == 1]
        last = r + 1 == len(key) or tuple(key[r + 1, :2]) != tuple(key[r, :2])
        if key[r, 2] == 0:
            assert not called  # the first turn is plain text: tool_ramp
        else:  # a chain: the previous turn's record is a strict prefix of this one
            assert tuple(key[r - 1]) == (key[r, 0], key[r, 1], key[r, 2] - 1)
            prev = ids[off[r - 1] : off[r]]
            assert prev.size < rec.size and np.array_equal(rec[: prev.size], prev)
        if key[r, 2] >= 2 and not last:
            late += 1
            calls += called
        if last:
            turns.append(key[r, 2] + 1)
    assert calls >= 0.9 * late, (calls, late)
    assert len(turns) == 32 and 20 <= np.median(turns) <= 40 and max(turns) >= 40, sorted(turns)
    assert 32768 < np.diff(off).max() <= 65536


@pytest.mark.parametrize("kind, lo, hi", [("grpo-math", 1.0, 1.3), ("low-overlap", 1.0, 1.5)])
def test_low_compression_kinds(kind, lo, hi):
    t = generate(kind, SMALL[kind], seed=0)
    st = naive_stats(t.column("input_ids").to_pylist())
    assert lo <= st["compression"] <= hi, st
    groups = by_sample(t)
    assert all(len(recs) == 1 for recs in groups.values())  # single turn: one record per sample
    assert len(groups) == SMALL[kind] * preset(kind).group_size


def test_max_len_ends_branches_before_the_limit():
    t = generate("tau2", 2, seed=0, max_len=4000)
    assert t.column("input_ids").combine_chunks().value_lengths().to_numpy().max() <= 4000
    assert generate("low-overlap", 3, seed=0, max_len=16).num_rows == 0  # no first turn fits


@st.composite
def small_configs(draw):
    """Any mix of the engine's knobs, at sizes a dict trie checks in milliseconds."""
    sigma = st.sampled_from([0.0, 0.5, 1.0])
    length = st.builds(lambda m, s: LogNormal(m, s, 0, 40), st.integers(1, 20), sigma)
    return preset(
        draw(st.sampled_from(KINDS)),
        group_size=draw(st.integers(1, 4)),
        system_tokens=draw(st.sampled_from([0, 6, 40])),
        prompt=draw(length), response=draw(length), observation=draw(length), user_reply=draw(length),
        tool_args=draw(length), thinking=draw(length),
        turns=LogNormal(draw(st.integers(1, 6)), draw(st.sampled_from([0.0, 0.5])), 1, 8),
        tool_prob=draw(st.sampled_from([0.0, 0.5, 1.0])), tool_ramp=draw(st.integers(0, 3)),
        think=draw(st.booleans()), think_drop=draw(st.sampled_from(["turn", "user"])),
        fork_prob=draw(st.sampled_from([0.0, 0.3])), fork_max=draw(st.integers(2, 4)),
        max_len=draw(st.integers(40, 400)), vocab=draw(st.sampled_from([64, 1000, QWEN3_VOCAB])),
    )


@settings(max_examples=40, deadline=None)
@given(cfg=small_configs(), n=st.integers(1, 3), seed=st.integers(0, 2**32 - 1))
def test_any_config_gives_well_formed_trees(cfg, n, seed):
    t = generate(cfg, n, seed=seed)
    v = Vocab(cfg.vocab)
    head = [v.id("im_start"), v.id("assistant"), v.id("nl")]
    samples = by_sample(t) if t.num_rows else {}
    for (tree, _), recs in samples.items():
        assert 0 <= tree < n
        for ids in recs:
            assert len(ids) <= cfg.max_len and all(0 <= x < cfg.vocab for x in ids)
        if cfg.fork_prob == 0 and not (cfg.think and cfg.think_drop == "user"):
            for a, b in itertools.pairwise(recs):  # one branch per sample: each turn extends the last
                assert is_prefix(without_own_think(a, v) if cfg.think else a, b)
    for ids, mask in zip(t.column("input_ids").to_pylist(), t.column("loss_mask").to_pylist()):
        on = np.flatnonzero(mask)
        assert on.size and on[-1] == len(ids) - 2 and np.all(np.diff(on) == 1)
        assert ids[on[0] - 3 : on[0]] == head and ids[-2] == v.id("im_end")
    leads: dict = {}
    for (tree, _), recs in samples.items():  # a tree's records all open with its system prompt and task
        ends = [i for i, x in enumerate(recs[0]) if x == v.id("im_end")]
        lead = leads.setdefault(tree, recs[0][: ends[1 if cfg.system_tokens else 0] + 2])
        assert all(is_prefix(lead, r) for r in recs)


# --- configuration ------------------------------------------------------------------------------
def test_config_errors_name_the_setting():
    with pytest.raises(ConfigError, match=r"unknown synth setting 'turn': did you mean 'turns'\?"):
        preset("tau2", turn=3)
    with pytest.raises(ConfigError, match="tool_prob must be in"):
        preset("tau2", tool_prob=1.5)
    with pytest.raises(ConfigError, match="unknown synth kind 'tau3'"):
        preset("tau3")
    with pytest.raises(ConfigError, match="n .number of trees. must be a positive integer"):
        generate("tau2", 0)
    assert LogNormal.parse("12") == LogNormal(12, 0.0, 12, 12)
    assert preset("tau2").turns.with_median(5) == LogNormal(5, 0.3, 1, 13)


# --- the command --------------------------------------------------------------------------------
SUMMARY = re.compile(
    r"^synth low-overlap: 3 trees, (\d+) records, ([\d,]+) tokens -> (\S+) "
    r"\(\d+\.\d s, [\d.]+[kMG]? tokens/s\)\n$"
)


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".parquet"])
def test_cli_writes_each_format(tmp_path, suffix):
    out = tmp_path / f"r{suffix}"
    r = run("synth", "low-overlap", "-n", "3", "-o", out, "--seed", "5", "--logprobs", "--steps", "3")
    assert r.code == 0 and r.out == ""
    m = SUMMARY.match(r.err)
    assert m and m.group(3) == str(out), r.err
    want = generate("low-overlap", 3, seed=5, logprobs=True, steps=3)
    assert int(m.group(1)) == want.num_rows
    assert int(m.group(2).replace(",", "")) == len(want.column("input_ids").combine_chunks().values)
    if suffix == ".parquet":
        assert pq.read_table(out).equals(want)
    else:
        data = out.read_bytes()
        text = (gzip.decompress(data) if suffix.endswith(".gz") else data).decode()
        assert text.endswith("}\n") and ", " not in text and '": ' not in text  # compact separators
        rows = [json.loads(line) for line in text.splitlines()]
        rest = want.drop_columns("logprobs").to_pylist()
        assert [{k: v for k, v in r.items() if k != "logprobs"} for r in rows] == rest
        for row, lp in zip(rows, want.column("logprobs").to_pylist()):  # float32, written shortest round-trip
            assert np.array_equal(np.float32(row["logprobs"]), np.float32(lp))
    assert [p.name for p in tmp_path.iterdir()] == [out.name]  # no temporary file left behind


def test_cli_stdout_and_quiet():
    r = run("synth", "low-overlap", "-n", "3", "-o", "-", "--quiet")
    assert r.code == 0 and r.err == ""
    want = generate("low-overlap", 3).to_pylist()
    assert [json.loads(line) for line in r.out.splitlines()] == want


def test_cli_offers_every_kind():
    assert [kind.value for kind in Kind] == list(KINDS)


def test_cli_same_seed_same_bytes(tmp_path):
    paths = [tmp_path / f"{name}.jsonl.gz" for name in ("a", "b", "c")]
    for path, seed in zip(paths, ("1", "1", "2")):
        r = run("synth", "tau2", "--think", "-n", "1", "-g", "2", "--turns", "4", "--seed", seed, "-o", path)
        assert r.code == 0
    a, b, c = (p.read_bytes() for p in paths)
    assert a == b and a != c


def test_cli_options_reach_the_config(tmp_path):
    out = tmp_path / "r.parquet"
    args = ["-g", "3", "--turns", "2", "--system-tokens", "0", "--max-len", "2K", "--vocab", "5000"]
    args += ["--set", "turns.sigma=0", "--set", "fork_prob=0.5", "-q"]
    r = run("synth", "tau2", "-n", "2", "-o", out, *args)
    assert r.code == 0, r.err
    cfg = preset("tau2", group_size=3, system_tokens=0, max_len=2048, vocab=5000, fork_prob=0.5)
    cfg = dataclasses.replace(cfg, turns=LogNormal(2, 0.0, 1, 5))
    assert pq.read_table(out).equals(generate(cfg, 2))


@pytest.mark.parametrize(
    "args, code, message",
    [
        (["synth", "tau3", "-o", "x.jsonl"], 2, "Invalid value for 'kind'"),
        (["synth", "tau2", "-o", "x.txt"], 2,
         "cannot tell the output format of 'x.txt': use .jsonl, .jsonl.gz or .parquet (or - for stdout)"),
        (["synth", "tau2", "-o", "x.jsonl", "--max-len", "abc"], 2, "invalid --max-len 'abc'"),
        (["synth", "tau2", "-o", "x.jsonl", "--set", "turn.median=3"], 1,
         "Error: unknown synth setting 'turn.median': did you mean 'turns.median'?\n"),
        (["synth", "tau2", "-o", "x.jsonl", "--set", "tool_prob=lots"], 1,
         "Error: invalid value 'lots' for synth setting 'tool_prob'\n"),
        (["synth", "tau2", "-o", "x.jsonl", "--set", "turns"], 2, "expected key=value, got 'turns'"),
        (["synth", "tau2", "-o", "no/such/dir/x.jsonl"], 1,
         "Error: cannot write no/such/dir/x.jsonl: directory 'no/such/dir' does not exist\n"),
        (["synth", "tau2", "-n", "3", "--max-len", "1K", "-o", "x.jsonl"], 1,
         ("Error: no record fits max_len = 1,024 tokens: the shared prompt and the first turn need more (1,200 "
          "system tokens); raise max_len\n")),
        (["synth", "tau2", "-o", "x.jsonl", "--seed", "-1"], 2, "Invalid value for '--seed'"),
        (["synth", "tau2", "-o", "x.jsonl", "--turns", "inf"], 2, "must be a finite number, got inf"),
        (["synth", "tau2", "-o", "x.jsonl", "--vocab", str(2**32)], 2, "Invalid value for '--vocab'"),
        (["synth", "low-overlap", "-n", "2", "--steps", "5", "-o", "x.jsonl"], 2,
         "5 steps need at least as many trees, got -n 2 (a tree is in one step)"),
    ],
)
def test_cli_errors(tmp_path, monkeypatch, args, code, message):
    monkeypatch.chdir(tmp_path)
    r = run(*args)
    assert r.code == code
    if code == 1:
        assert r.err == message
    else:
        assert message in r.err
    assert list(tmp_path.iterdir()) == []


def test_cli_refuses_a_directory_before_the_work(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dir.jsonl").mkdir()
    r = run("synth", "tau2", "-o", "dir.jsonl")
    assert (r.code, r.err) == (1, "Error: cannot write dir.jsonl: it is a directory\n")
    assert [p.name for p in tmp_path.iterdir()] == ["dir.jsonl"]  # no temporary file left


def test_samples_over_max_len_are_counted_and_left_out_of_their_groups(tmp_path):
    """grpo-math at a 2K context: samples whose first turn does not fit have no record, the line says how many,
    and each group's advantages are over the samples written (zero mean, as GRPO's over a group)."""
    out = tmp_path / "k.jsonl"
    r = run("synth", "grpo-math", "-n", "4", "--max-len", "2K", "-o", out, "-q")
    records = [json.loads(line) for line in out.read_text().splitlines()]
    samples = {tuple(rec["id"].split("/")[:2]): rec for rec in records}
    assert r.code == 0 and r.err == (
        f"left out: {64 - len(samples)} of 64 samples, whose first turn does not fit max_len = 2,048 tokens "
        "(0 trees without any); their groups' advantages are over the samples written\n")
    assert 0 < len(samples) < 64
    for tree in {t for t, _ in samples}:
        group = np.array([rec["reward"] for (t, _), rec in samples.items() if t == tree])
        adv = np.array([rec["advantage"] for (t, _), rec in samples.items() if t == tree])
        np.testing.assert_allclose(adv, (group - group.mean()) / (group.std() + 1e-6), rtol=1e-12, atol=1e-12)
    assert run("synth", "grpo-math", "-n", "4", "-o", tmp_path / "full.jsonl", "-q").err == ""  # default: none


# --- bundled samples ----------------------------------------------------------------------------
def sample_commands() -> list[tuple[str, list[str]]]:
    text = (SAMPLES_DIR / "README.md").read_text()
    found = []
    for cmd in re.findall(r"`(treepack synth [^`]+)`", text):
        argv = shlex.split(cmd)[1:]
        out = argv[argv.index("-o") + 1]
        found.append((Path(out).name, argv))
    return found


def test_samples_are_small_and_documented():
    files = sorted(p.name for p in SAMPLES_DIR.iterdir() if p.name != "README.md")
    assert sum((SAMPLES_DIR / f).stat().st_size for f in files) <= 5 << 20
    readme = (SAMPLES_DIR / "README.md").read_text()
    assert all(f"`{f}`" in readme for f in files)
    generated = {name for name, _ in sample_commands()}
    assert {"tau2_think.jsonl.gz", "tau2.jsonl.gz", "grpo_math.jsonl.gz", "agentic_think.jsonl.gz",
            "low_overlap.jsonl.gz"} <= generated
    chat = {"tau_bench_chats.json.gz", "chat_tokenizer"}  # chat input and its tokenizer: tests/test_tokenize_cli.py
    assert generated | {"tau_bench_slice.parquet"} | chat == set(files)


@pytest.mark.parametrize("name, argv", sample_commands(), ids=[n for n, _ in sample_commands()])
def test_samples_regenerate_byte_for_byte(tmp_path, name, argv):
    argv = list(argv)
    argv[argv.index("-o") + 1] = str(tmp_path / name)
    r = run(*argv, "-q")
    assert r.code == 0, r.err
    assert (tmp_path / name).read_bytes() == (SAMPLES_DIR / name).read_bytes()


def test_cli_summary_counts_in_the_singular_too(tmp_path):
    r = run("synth", "low-overlap", "-n", "1", "-g", "1", "-o", tmp_path / "one.jsonl")
    assert r.code == 0 and r.err.startswith("synth low-overlap: 1 tree, 1 record, "), r.err
