"""``treepack tokenize`` and ``--tokenizer`` on the other commands: the input forms, the output files, exact
error messages and exit codes, and the same records on every path."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from chat_testing import CHATML, THINK, build_tokenizer, reference_records
from cli_helpers import run

from treepack.chat.turns import tokenize_chats
from treepack.io.ingest import read_rollouts
from treepack.pack.shard_reader import read_manifest

ROOT = Path(__file__).resolve().parents[1]

TOOLS = [{"type": "function", "function": {"name": "find", "parameters": {"type": "object"}}}]
CONV = [{"role": "system", "content": "help"}, {"role": "user", "content": "where is my order"},
        {"role": "assistant", "content": "let me look",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "find", "arguments": '{"q":1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "shipped"}, {"role": "assistant", "content": "it shipped"}]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok") / "think", THINK)


def jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# --------------------------------------------------------------------------------------------------
# Input forms


def test_forms_trl_preference_tau_bench_tau2_parquet(tok_dir, tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    prompt = [{"role": "user", "content": "2+2?"}]
    jsonl(tmp_path / "trl.jsonl", [
        {"id": "p", "prompt": "2+2?", "completion": "4", "reward": 1.0},
        {"id": "c", "prompt": prompt, "completion": [{"role": "assistant", "content": "4"}], "tree_id": "g"},
        {"id": "pair", "prompt": prompt, "chosen": [{"role": "assistant", "content": "4"}],
         "rejected": [{"role": "assistant", "content": "5"}]},
        {"chosen": [*prompt, {"role": "assistant", "content": "4"}], "rejected": [*prompt, {"role": "assistant", "content": "5"}]},
    ])
    r = tokenize_chats(tmp_path / "trl.jsonl", tok_dir).fresh
    assert r.ids == ["p/turn0", "c/turn0", "pair/chosen/turn0", "pair/rejected/turn0", "trl:3/chosen/turn0",
                     "trl:3/rejected/turn0"]
    assert [r.group_names[g] for g in r.groups] == ["p", "g", "pair", "pair", "trl:3", "trl:3"]
    four = reference_records(tok, [*prompt, {"role": "assistant", "content": "4"}])[0]
    for i in (0, 1, 2, 4):
        assert (r.sequence(i).tolist(), r.loss_mask_of(i).tolist()) == four[:2]
    assert r.rewards[0] == 1.0 and bool(np.isnan(r.rewards[1:]).all())  # NaN where a record had none

    tau = [{"task_id": 7, "trial": 1, "reward": 0.5, "info": {"k": [1]}, "traj": CONV}]
    (tmp_path / "tau.json").write_text(json.dumps(tau, indent=1))
    recs = tokenize_chats(tmp_path / "tau.json", tok_dir)
    assert recs.fresh.ids == ["task7/trial1/turn0", "task7/trial1/turn1"] and recs.fresh.group_names == ["task7"]
    assert recs.fields[0] == {"task_id": 7, "reward": 0.5, "info": {"k": [1]}, "trial": 1}
    ref = reference_records(tok, CONV)
    assert [recs.fresh.sequence(i).tolist() for i in range(2)] == [x[0] for x in ref]

    tau2_msgs = [{"role": "user", "content": "where is my order", "turn_idx": 0},
                 {"role": "assistant", "content": None, "tool_calls": [
                     {"id": "c1", "name": "find", "arguments": {"q": 1}, "requestor": "assistant"}], "cost": 0.1},
                 {"role": "tool", "id": "c1", "content": "shipped", "requestor": "assistant", "error": False},
                 {"role": "user", "content": None, "tool_calls": [{"id": "u", "name": "toggle", "arguments": {},
                                                                    "requestor": "user"}]},
                 {"role": "tool", "id": "u", "content": "on", "requestor": "user"},
                 {"role": "assistant", "content": "it shipped"}]
    tau2 = {"timestamp": "t", "info": {"x": 1}, "tasks": [{"id": "7"}], "simulations": [
        {"id": "sim-a", "task_id": "7", "trial": 0, "termination_reason": "user_stop", "reward_info": {"reward": 1.0},
         "messages": tau2_msgs}]}
    (tmp_path / "tau2.json").write_text(json.dumps(tau2))
    recs = tokenize_chats(tmp_path / "tau2.json", tok_dir)
    agent_view = [{"role": "user", "content": "where is my order"},
                  {"role": "assistant", "content": "", "tool_calls": [
                      {"id": "c1", "type": "function", "function": {"name": "find", "arguments": {"q": 1}}}]},
                  {"role": "tool", "tool_call_id": "c1", "name": "find", "content": "shipped"},
                  {"role": "assistant", "content": "it shipped"}]
    assert recs.fresh.ids == ["sim-a/turn0", "sim-a/turn1"] and recs.fresh.group_names == ["task7"]
    assert [recs.fresh.sequence(i).tolist() for i in range(2)] == [x[0] for x in reference_records(tok, agent_view)]
    assert recs.fresh.rewards.tolist() == [1.0, 1.0]

    table = pa.table({"id": ["a"], "messages": [CONV], "tools": [json.dumps(TOOLS)], "score": [3]})
    pq.write_table(table, tmp_path / "chats.parquet")
    recs = tokenize_chats(tmp_path / "chats.parquet", tok_dir)
    assert [recs.fresh.sequence(i).tolist() for i in range(2)] == [x[0] for x in reference_records(tok, CONV, TOOLS)]
    assert recs.fields[0] == {"score": 3}


# --------------------------------------------------------------------------------------------------
# The command, its files and the other commands on chat input


def test_tokenize_writes_records_that_read_back_and_stats_pack_plot_report_take_chats(tok_dir, tmp_path):
    src = jsonl(tmp_path / "chats.jsonl", [{"id": "a", "messages": CONV, "tools": TOOLS, "reward": 0.5, "meta": {"x": 1}},
                                           {"id": "b", "messages": CONV[:3] + [{"role": "tool", "content": "late"},
                                                                              {"role": "assistant", "content": "sorry"}]}])
    recs = tokenize_chats(src, tok_dir, consistent=True)
    for name in ("out.jsonl", "out.jsonl.gz", "out.parquet"):
        res = run("tokenize", src, "--tokenizer", tok_dir, "-o", tmp_path / name, "--json", "-q")
        assert res.code == 0, res.err
        summary = json.loads(res.out)
        assert summary["records"] == 4 and summary["drift"]["drifted"] == summary["drift"]["pairs"] == 2
        back = read_rollouts(tmp_path / name)
        assert back.ids == recs.fresh.ids and back.tokens.tolist() == recs.fresh.tokens.tolist()
        assert back.loss_mask.tolist() == recs.fresh.loss_mask.tolist()
        assert [back.group_names[g] for g in back.groups] == ["a", "a", "b", "b"]
        assert back.rewards[:2].tolist() == [0.5, 0.5]
    with gzip.open(tmp_path / "out.jsonl.gz", "rt") as f:
        first = json.loads(f.readline())
    assert first["meta"] == {"x": 1} and first["conversation"] == "a" and first["turn"] == 0
    assert pq.read_table(tmp_path / "out.parquet").column("meta").to_pylist()[:2] == ['{"x": 1}'] * 2

    kept = run("tokenize", src, "--tokenizer", tok_dir, "-o", tmp_path / "kept.jsonl", "--keep-prefix-tokens", "-q")
    assert kept.code == 0, kept.err
    assert read_rollouts(tmp_path / "kept.jsonl").tokens.tolist() == recs.consistent.tokens.tolist()

    stats = run("stats", src, "--tokenizer", tok_dir, "--group-by", "tree_id", "--json", "-q")
    assert stats.code == 0, stats.err
    d, direct = json.loads(stats.out), json.loads(run("stats", tmp_path / "out.jsonl", "--group-by", "tree_id",
                                                      "--json").out)
    assert d["n_flat_tokens"] == direct["n_flat_tokens"] and d["compression"] == direct["compression"]
    assert d["drift"]["drifted"] == 2 and d["drift"]["consistent_por"] > d["drift"]["por"]
    assert run("stats", src, "--tokenizer", tok_dir, "--keep-prefix-tokens", "--json").code == 0
    tables = run("stats", src, "--tokenizer", tok_dir, "-q")
    assert tables.code == 0 and "retokenization drift" in tables.out and "2 of 2" in tables.out

    assert run("pack", src, "--tokenizer", tok_dir, "--capacity", "4K", "-o", tmp_path / "packs", "-q").code == 0
    assert run("unpack", tmp_path / "packs", "-o", tmp_path / "back.jsonl").code == 0
    back = read_rollouts(tmp_path / "back.jsonl")
    assert back.ids == recs.fresh.ids and back.tokens.tolist() == recs.fresh.tokens.tolist()
    assert run("plot", src, "--tokenizer", tok_dir, "-o", tmp_path / "t.png", "-q").code == 0
    assert run("report", src, "--tokenizer", tok_dir, "-o", tmp_path / "r.html", "--no-packing", "-q").code == 0

    table = run("tokenize", src, "--tokenizer", tok_dir, "--drift", "-q")
    assert table.code == 0 and "a: text drift at token" in table.out and "turn t+1" in table.out


def test_verify_compares_with_transformers(tok_dir, tmp_path):
    pytest.importorskip("transformers")
    src = jsonl(tmp_path / "c.jsonl", [{"messages": CONV}])
    res = run("tokenize", src, "--tokenizer", tok_dir, "--verify", "5", "--json", "-q")
    assert res.code == 0, res.err
    assert json.loads(res.out)["verified_records"] == 2


# --------------------------------------------------------------------------------------------------
# Errors


BAD = [
    ({"id": 1, "prompt_text": "x"}, "no messages",
     ("no chat messages: expected 'messages' (or 'prompt' + 'completion', 'chosen' + 'rejected', tau-bench "
      "'traj', a ToolBench answer tree, GSM8K model solutions); found fields: 'id', 'prompt_text'")),
    ({"chosen": "\n\nHuman: hi\n\nAssistant: yes", "rejected": "\n\nHuman: hi"}, "bad hh-rlhf dialogue",
     "fields 'chosen' / 'rejected': an hh-rlhf dialogue must end with an '\\n\\nAssistant: ' reply on both sides"),
    ({"answer_generation": {"train_messages": []}, "tree": {"tree": {}}}, "ToolBench answer without train_messages",
     "field 'answer_generation' has no train_messages (the system prompt and query to render)"),
    ({"messages": [{"role": "bot", "content": "x"}]}, "unknown role",
     "field 'messages'[0].role: unknown role 'bot' (system, developer, user, assistant, tool)"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "",
                                                       "tool_calls": [{"function": {"arguments": "{}"}}]}]},
     "tool call without a name", "field 'messages'[1].tool_calls[0].function.name is missing"),
    ({"messages": [{"role": "developer", "content": "x"}, {"role": "assistant", "content": "y"}]},
     "template render failure",
     "field 'messages': the chat template failed to render: TemplateError: developer messages are not supported"),
    ({"chosen": "Human: hi Assistant: yo", "rejected": "Human: hi Assistant: no"}, "template render failure",
     ("field 'chosen': the chat template failed to render: UndefinedError: list object has no element 0 (the turn "
      "to train is the first message, with no prompt before it)")),
    ({"messages": [{"role": "user", "content": "x"}]}, "no assistant message",
     "field 'messages' has no assistant message to train on (roles: user)"),
]


@pytest.mark.parametrize("record, reason, message", BAD, ids=[b[1] for b in BAD])
def test_a_bad_record_is_one_line_naming_file_line_and_field(tok_dir, tmp_path, record, reason, message):
    good = {"messages": CONV}
    src = jsonl(tmp_path / "bad.jsonl", [good, record])
    res = run("tokenize", src, "--tokenizer", tok_dir)
    assert res.code == 1 and res.err == f"Error: {src}: line 2: {message}\n"
    arr = tmp_path / "bad.json"
    arr.write_text("[\n" + json.dumps(good) + ",\n\n  " + json.dumps(record) + "\n]")
    assert run("tokenize", arr, "--tokenizer", tok_dir).err == f"Error: {arr}: line 4: {message}\n"
    skip = run("tokenize", src, "--tokenizer", tok_dir, "--on-error", "skip", "--json")
    assert skip.code == 0
    assert json.loads(skip.out)["skipped"] == {reason: 1} and json.loads(skip.out)["records"] == 2
    assert skip.err.startswith(f"skipped 1 bad record(s): 1 {reason}\n  {src}: line 2: {message}")


@pytest.mark.parametrize("name", ["c.json", "c.jsonl"])
def test_byte_order_mark_is_not_data(tok_dir, tmp_path, name):
    src = tmp_path / name
    text = json.dumps([{"messages": CONV}]) if name.endswith(".json") else json.dumps({"messages": CONV}) + "\n"
    src.write_bytes(b"\xef\xbb\xbf" + text.encode())
    res = run("tokenize", src, "--tokenizer", tok_dir, "-o", tmp_path / "t.jsonl", "--json")
    assert (res.code, json.loads(res.out)["conversations"]) == (0, 1)


def test_parquet_rows_malformed_json_and_usage_errors(tok_dir, tmp_path):
    pq.write_table(pa.table({"messages": [json.dumps(CONV), json.dumps([{"role": "user"}])]}), tmp_path / "c.parquet")
    res = run("tokenize", tmp_path / "c.parquet", "--tokenizer", tok_dir)
    assert res.err == f"Error: {tmp_path / 'c.parquet'}: row 1: field 'messages' has no assistant message to train on (roles: user)\n"
    bad = tmp_path / "m.jsonl"
    bad.write_text(json.dumps({"messages": CONV}) + "\n{oops\n")
    assert run("tokenize", bad, "--tokenizer", tok_dir).err.startswith(f"Error: {bad}: line 2: malformed JSON (")
    bad.write_text(json.dumps({"messages": CONV}) + '\n{"messages": "[{\n')
    assert run("tokenize", bad, "--tokenizer", tok_dir).err == (
        f"Error: {bad}: line 2: malformed JSON (Unterminated string starting at column 14)\n")
    missing = run("tokenize", bad, "--tokenizer", tmp_path / "nope")
    assert missing.code == 1 and missing.err == f"Error: {tmp_path / 'nope'}: tokenizer directory not found\n"
    a_file = run("tokenize", bad, "--tokenizer", tok_dir / "tokenizer.json")
    assert a_file.code == 1 and a_file.err == (f"Error: {tok_dir / 'tokenizer.json'}: a file, not a tokenizer "
                                               "directory (the directory holding tokenizer.json and the chat template)\n")
    no_template = build_tokenizer(tmp_path / "plain", CHATML)
    (no_template / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    assert run("tokenize", bad, "--tokenizer", no_template).err == (
        f"Error: {no_template}: the tokenizer has no chat template (tokenizer_config.json 'chat_template' or "
        "chat_template.jinja)\n")
    assert run("tokenize", bad, "--tokenizer", tok_dir, "-o", tmp_path / "x.csv").code == 2
    assert run("tokenize", bad, "--tokenizer", tok_dir, "--turns", "some").code == 2
    assert run("stats", bad, "--keep-prefix-tokens").code == 2
    assert run("stats", bad, "--tokenizer", tok_dir, "--tokens-field", "ids").code == 2


def test_tokenize_needs_neither_torch_nor_transformers_and_says_what_is_missing(tok_dir, tmp_path):
    src = jsonl(tmp_path / "c.jsonl", [{"messages": CONV}])
    block = textwrap.dedent(
        """
        import sys
        class _Block:
            def __init__(self, names): self.names = names
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in self.names:
                    raise ImportError(f"No module named {name!r}", name=name)
        sys.meta_path.insert(0, _Block(NAMES))
        sys.argv = ["treepack", "tokenize", SRC, "--tokenizer", TOK, "--json", "-q"]
        from treepack.cli.app import main
        try:
            main()
        except SystemExit as e:
            code = e.code
        else:
            code = 0
        assert not any(m in sys.modules for m in ("torch", "transformers")), "heavy import"
        sys.exit(code)
        """
    )

    def go(names):
        code = block.replace("NAMES", repr(names)).replace("SRC", repr(str(src))).replace("TOK", repr(str(tok_dir)))
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, check=False)

    ok = go(("torch", "transformers"))
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["records"] == 2
    missing = go(("tokenizers",))
    assert missing.returncode == 1
    assert missing.stderr == ("Error: chat input needs the optional packages 'tokenizers' and 'jinja2' (tokenizers is "
                              "missing): pip install 'treepack[chat]'\n")


def test_a_consistent_template_gives_identical_fresh_and_keep_prefix_files(tmp_path):
    d = build_tokenizer(tmp_path / "chatml", CHATML)
    src = jsonl(tmp_path / "c.jsonl", [{"messages": CONV, "tools": TOOLS}])
    for flag in ((), ("--keep-prefix-tokens",)):
        assert run("tokenize", src, "--tokenizer", d, "-o", tmp_path / f"o{len(flag)}.jsonl", "-q", *flag).code == 0
    assert (tmp_path / "o0.jsonl").read_text() == (tmp_path / "o1.jsonl").read_text()


def test_bundled_chat_sample_regenerates_byte_for_byte(tmp_path):
    from chat_testing import QWEN3

    from treepack.datasets.chat_sample import main

    raw = sorted((QWEN3.parents[1] / "raw" / "tau_bench_grok3_retail").glob("*.json"))
    if not QWEN3.is_dir() or not raw:
        pytest.skip("tau-bench results and the Qwen3 tokenizer are not next to the repository")
    main([str(raw[0]), str(QWEN3), str(tmp_path)])
    samples = ROOT / "treepack" / "datasets" / "samples"
    for name in ("tau_bench_chats.json.gz", "chat_tokenizer/tokenizer.json", "chat_tokenizer/tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (samples / name).read_bytes(), name
    res = run("tokenize", samples / "tau_bench_chats.json.gz", "--tokenizer", samples / "chat_tokenizer", "--json", "-q")
    d = json.loads(res.out)
    assert (d["conversations"], d["records"], d["n_tokens"]) == (8, 124, 519_380)  # the README's table
    assert (round(d["drift"]["compression"], 2), round(d["drift"]["consistent_compression"], 2)) == (6.66, 8.69)


@pytest.mark.parametrize("template, what", [
    ("{{ '' }}", "no tokens"),
    ("{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}{% endif %}{% endfor %}",
     "none of the turn's own tokens (only its prompt)"),
])
def test_a_template_that_renders_a_turn_to_nothing_is_the_records_error(tmp_path, template, what):
    """An empty record, or one whose loss mask would be all zeros, is not passed on (stats divided by zero)."""
    tok = build_tokenizer(tmp_path / "tok", template)
    src = jsonl(tmp_path / "c.jsonl", [{"messages": CONV}])
    message = f"Error: {src}: line 1: field 'messages': turn 0 renders {what} with this chat template\n"
    for command in ("tokenize", "stats"):
        res = run(command, src, "--tokenizer", tok)
        assert (res.code, res.err) == (1, message)
    skip = run("stats", src, "--tokenizer", tok, "--on-error", "skip", "-q")
    assert (skip.code, skip.err) == (1, f"Error: {src}: no sequences to analyse: 1 bad record(s) skipped (1 empty render)\n")


def test_pack_with_a_tokenizer_keeps_every_field_tokenize_writes(tok_dir, tmp_path):
    """pack --tokenizer renders as tokenize does, and unpack gives tokenize's records back, carried fields too."""
    src = jsonl(tmp_path / "c.jsonl", [{"messages": CONV, "task_id": 7, "info": {"k": [1, "x"]}, "reward": 0.5},
                                       {"messages": CONV[:3], "task_id": 8, "trial": "t1"}])
    assert run("tokenize", src, "--tokenizer", tok_dir, "-o", tmp_path / "tk.jsonl").code == 0
    assert run("pack", src, "--tokenizer", tok_dir, "-c", "4K", "-o", tmp_path / "packs").code == 0
    assert run("unpack", tmp_path / "packs", "-o", tmp_path / "back.jsonl").code == 0
    read = lambda p: [json.loads(line) for line in p.read_text().splitlines()]
    tokenized, back = read(tmp_path / "tk.jsonl"), read(tmp_path / "back.jsonl")
    assert back == tokenized and [list(r) for r in back] == [list(r) for r in tokenized]
    assert {"task_id", "info", "reward", "conversation", "turn"} <= set(back[0])


# --------------------------------------------------------------------------------------------------
# tokenize's rendering options on every command with --tokenizer: the same records as tokenize writes

SAMPLES = ROOT / "treepack" / "datasets" / "samples"
CHAT_SAMPLE, CHAT_TOKENIZER = SAMPLES / "tau_bench_chats.json.gz", SAMPLES / "chat_tokenizer"
DEFAULTS = {"sample": (124, 519_380, 18_619), "thinking": (124, 523_380, 20_123)}  # tokenize's, no options
RENDERINGS = [  # (input, options, tokenize's (records, n_tokens, n_trained_tokens) with them)
    # enable_thinking=false puts Qwen3's empty <think> block into the generation prompt: out of the loss
    ("sample", ("--reasoning", "drop", "--template-arg", "enable_thinking=false"), (124, 519_380, 18_123)),
    ("thinking", ("--reasoning", "drop"), (124, 520_884, 20_123)),  # earlier turns' reasoning out of the history
    ("sample", ("--turns", "last", "--no-system", "--no-tools"), (8, 50_060, 522)),
    ("sample", ("--reasoning", "keep"), (124, 523_152, 18_619)),  # keep-prefix records: each extends the last
]


@pytest.fixture(scope="module")
def chat_inputs(tmp_path_factory):
    """The bundled chat sample, and the same with reasoning in every assistant turn (the sample has none)."""
    with gzip.open(CHAT_SAMPLE, "rt") as f:
        results = json.load(f)
    turns = [m for r in results for m in r["traj"] if m.get("role") == "assistant"]
    for i, m in enumerate(turns):
        m["reasoning_content"] = f"step {i + 1}: what the customer needs next"
    thinking = tmp_path_factory.mktemp("chats") / "thinking.json"
    thinking.write_text(json.dumps(results))
    return {"sample": CHAT_SAMPLE, "thinking": thinking}


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_renderings_compared_differ_from_the_default_one(chat_inputs):
    for name, src in chat_inputs.items():
        d = json.loads(run("tokenize", src, "--tokenizer", CHAT_TOKENIZER, "--json", "-q").out)
        assert (d["records"], d["n_tokens"], d["n_trained_tokens"]) == DEFAULTS[name]
    assert all(counts != DEFAULTS[name] for name, _, counts in RENDERINGS)


@pytest.mark.parametrize("name, options, counts", RENDERINGS, ids=[" ".join(r[1]) for r in RENDERINGS])
def test_stats_and_pack_with_a_tokenizer_take_tokenizes_rendering_options(chat_inputs, tmp_path, name, options, counts):
    src, tok = chat_inputs[name], CHAT_TOKENIZER
    res = run("tokenize", src, "--tokenizer", tok, *options, "-o", tmp_path / "tk.jsonl", "--json", "-q")
    assert res.code == 0, res.err
    summary = json.loads(res.out)
    assert (summary["records"], summary["n_tokens"], summary["n_trained_tokens"]) == counts
    assert summary["keep_prefix_tokens"] == ("keep" in options)

    chat = run("stats", src, "--tokenizer", tok, *options, "--group-by", "tree_id", "--json", "-q")
    records = run("stats", tmp_path / "tk.jsonl", "--group-by", "tree_id", "--json", "-q")
    assert chat.code == records.code == 0, chat.err + records.err
    d, direct = json.loads(chat.out), json.loads(records.out)
    assert (d["n_sequences"], d["n_flat_tokens"]) == counts[:2]
    assert d.pop("drift")["records"] == counts[0]
    assert d == direct  # every number: tree tokens, C, POR, the FLOP model (which counts the loss targets) ...

    packs = tmp_path / "packs"
    assert run("pack", src, "--tokenizer", tok, *options, "-c", "16K", "-o", packs, "-q").code == 0
    m = json.loads((packs / "manifest.json").read_text())
    assert m["stats"]["packed_flat_tokens"] == counts[1] and m["counts"]["packed_sequences"] == counts[0]
    assert m["command"] == " ".join(["treepack pack", str(src), "--capacity 16K", f"-o {packs}", f"--tokenizer {tok}",
                                     *options])
    assert run("unpack", packs, "-o", tmp_path / "back.jsonl").code == 0
    back, tokenized = read_jsonl(tmp_path / "back.jsonl"), read_jsonl(tmp_path / "tk.jsonl")
    assert back == tokenized and [list(r) for r in back] == [list(r) for r in tokenized]


def test_report_takes_the_rendering_options(tmp_path):
    opts = ("--turns", "last", "--no-system", "--template-arg", "enable_thinking=false", "-q")
    res = run("report", CHAT_SAMPLE, "--tokenizer", CHAT_TOKENIZER, "-o", tmp_path / "r.html", "--no-packing", *opts)
    assert res.code == 0, res.err
    text = (tmp_path / "r.html").read_text()
    assert "50,060" in text  # N_flat: the 8 last turns without the system prompt
    assert (f" · chat transcripts rendered by {CHAT_TOKENIZER} (sha256 " in text
            and "): turns last, reasoning template, no system, enable_thinking=False</p>" in text)


@pytest.mark.parametrize("option", [("--turns", "last"), ("--reasoning", "drop"), ("--no-system",), ("--no-tools",),
                                    ("--template-arg", "enable_thinking=false"), ("--keep-prefix-tokens",),
                                    ("--turns", "all"), ("--reasoning", "template")],  # defaults, given: refused too
                         ids=lambda o: " ".join(o))
def test_a_rendering_option_without_tokenizer_is_a_usage_error_naming_it(tmp_path, option):
    src = jsonl(tmp_path / "r.jsonl", [{"id": "a", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}])
    for command, args in (("stats", ()), ("pack", ("-c", "4K", "-o", tmp_path / "packs")),
                          ("plot", ("-o", tmp_path / "t.png")), ("report", ("-o", tmp_path / "r.html"))):
        res = run(command, src, *args, *option)
        assert (res.code, res.out) == (2, ""), command
        assert res.err.splitlines()[-1] == f"Error: Invalid value for {option[0]}: needs --tokenizer", command
    assert not any((tmp_path / name).exists() for name in ("packs", "t.png", "r.html"))
    chats = run("stats", src, *option, "--tokenizer", CHAT_TOKENIZER)  # with it: read as chats (none here)
    assert chats.code == 1 and chats.err.startswith(f"Error: {src}: line 1: no chat messages")


def test_template_args_parse_as_json_and_python_spellings():
    from treepack.cli.chat_inputs import template_args

    assert template_args(["enable_thinking=false", "a=False", "b=True", "c=None", "n=3", 's="x"', "t=plain",
                          "e="]) == {"enable_thinking": False, "a": False, "b": True, "c": None, "n": 3, "s": "x",
                                     "t": "plain", "e": ""}


@pytest.mark.parametrize("value,message", [
    ("novalue", "expected KEY=VALUE, got 'novalue'"),
    ("1x=2", "the key of '1x=2' must be a template variable name (letters, digits and _, not starting with a digit)"),
    ("a-b=1", ("the key of 'a-b=1' must be a template variable name (letters, digits and _, not starting with a "
               "digit)")),
])
def test_a_bad_template_arg_is_a_usage_error_naming_the_problem(value, message):
    import typer

    from treepack.cli.chat_inputs import template_args

    with pytest.raises(typer.BadParameter) as info:
        template_args([value])
    assert info.value.message == message


def test_json_outputs_say_which_tokenizer_and_options_made_the_records(tmp_path):
    import hashlib

    digest = hashlib.sha256()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "chat_template.json"):
        if (CHAT_TOKENIZER / name).is_file():
            digest.update(name.encode() + b"\0" + (CHAT_TOKENIZER / name).read_bytes())
    want = {"tokenizer": str(CHAT_TOKENIZER), "tokenizer_sha256": digest.hexdigest(), "turns": "last",
            "reasoning": "drop", "system": False, "tools": True, "keep_prefix_tokens": False,
            "template_args": {"enable_thinking": False}}
    opts = ("--tokenizer", CHAT_TOKENIZER, "--turns", "last", "--reasoning", "drop", "--no-system",
            "--template-arg", "enable_thinking=false", "-q")
    for command in ("tokenize", "stats"):
        r = run(command, CHAT_SAMPLE, *opts, "--json")
        assert r.code == 0, r.err
        assert json.loads(r.out)["drift"]["rendering"] == want
    assert run("pack", CHAT_SAMPLE, *opts, "-c", "64K", "-o", tmp_path / "p").code == 0
    assert read_manifest(tmp_path / "p")["rendering"] == want
    assert run("pack", CHAT_SAMPLE, "--tokenizer", CHAT_TOKENIZER, "-c", "64K", "-o", tmp_path / "q", "-q").code == 0
    assert read_manifest(tmp_path / "q")["rendering"]["turns"] == "all"
