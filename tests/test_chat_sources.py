"""Published raw layouts read as they come: ToolBench answer trees, Anthropic hh-rlhf dialogue text, GSM8K model
solutions (`treepack.chat.sources`, wired into `treepack.chat.conversations.conversations_of`).

Small records written here check the conversion field by field; on the real files next to the repository,
``treepack tokenize`` of a raw file gives the same token records as of the file `treepack.datasets.chats`
converts it to."""

from __future__ import annotations

import gzip
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from chat_testing import QWEN3
from cli_helpers import run

from treepack.chat.conversations import RecordError, conversations_of
from treepack.datasets import chats as converters

RAW = Path(__file__).resolve().parents[2] / "shared" / "data" / "raw"


def node(kind: str, text: str, children=(), observation=None) -> dict:
    return {"node_type": kind, "description": text, "depth": 1, "children": list(children),
            **({"observation": observation} if observation is not None else {})}


def toolbench_answer(train_messages=True) -> dict:
    """A search tree: a thought, a call with its observation, then two branches (a final answer, a retry)."""
    call = node("Action", "lookup", [node("Action Input", '{"q": "x"}', [
        node("Thought", "found it"), node("Thought", "try again", [node("Thought", "still no")])],
        observation='{"hit": 1}')])
    gen = {"function": [{"name": "lookup", "parameters": {}}],
           "train_messages": [[{"role": "system", "content": "sys"}, {"role": "user", "content": "find x"}]]
           if train_messages else []}
    return {"win": True, "answer_generation": gen,
            "tree": {"tree": {"node_type": "root", "depth": 0, "children": [node("Thought", "plan", [call])]}}}


def test_toolbench_answer_tree_is_one_conversation_per_path():
    convs = conversations_of(toolbench_answer(), default_id="G1_answer__1:0", where="line 1")
    assert [c.id for c in convs] == ["G1_answer__1:0/path0", "G1_answer__1:0/path1"]
    assert {c.tree_id for c in convs} == {"G1_answer__1:0"} and all(c.tools[0]["function"]["name"] == "lookup" for c in convs)
    head = [{"role": "system", "content": "sys"}, {"role": "user", "content": "find x"},
            {"role": "assistant", "content": "plan", "tool_calls": [{"id": "call_0", "type": "function", "function": {
                "name": "lookup", "arguments": '{"q": "x"}'}}]},
            {"role": "tool", "tool_call_id": "call_0", "name": "lookup", "content": '{"hit": 1}'}]
    assert convs[0].messages == [*head, {"role": "assistant", "content": "found it"}]
    assert convs[1].messages == [*head, {"role": "assistant", "content": "try again"},
                                 {"role": "assistant", "content": "still no"}]
    assert "win" not in convs[0].fields and "tree" not in convs[0].fields  # the search tree is not carried along


def test_toolbench_answer_without_train_messages_is_a_named_record_error():
    with pytest.raises(RecordError) as err:
        conversations_of(toolbench_answer(train_messages=False), default_id="f:0", where="line 1")
    assert err.value.reason == "ToolBench answer without train_messages"
    assert str(err.value.message) == ("field 'answer_generation' has no train_messages (the system prompt and query "
                                      "to render)")


def test_hh_dialogue_text_is_a_preference_pair():
    shared = "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: a joke?"
    convs = conversations_of({"chosen": shared + "\n\nAssistant: sure", "rejected": shared + "\n\nAssistant: no"},
                             default_id="hh:3", where="line 4")
    assert [c.id for c in convs] == ["hh:3/chosen", "hh:3/rejected"] and {c.tree_id for c in convs} == {"hh:3"}
    prompt = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
              {"role": "user", "content": "a joke?"}]
    assert convs[0].messages == [*prompt, {"role": "assistant", "content": "sure"}] and convs[0].turns == [3]
    assert convs[1].messages[-1] == {"role": "assistant", "content": "no"} and convs[1].turns == [3]
    # the two sides differ before the last reply: the implicit-prompt form, last assistant message trained
    convs = conversations_of({"chosen": "\n\nHuman: a\n\nAssistant: b", "rejected": "\n\nHuman: c\n\nAssistant: d"},
                             default_id="hh:4", where="line 5")
    assert [c.messages[0]["content"] for c in convs] == ["a", "c"] and [c.turns for c in convs] == [[1], [1]]
    with pytest.raises(RecordError, match="must end with an '\\\\n\\\\nAssistant: ' reply on both sides"):
        conversations_of({"chosen": "\n\nHuman: a\n\nAssistant: b", "rejected": "\n\nHuman: c"},
                         default_id="hh:5", where="line 6")


def test_gsm8k_model_solutions_are_a_rewarded_group():
    rec = {"question": "2+2?", "ground_truth": "4", "small": {"solution": "5", "is_correct": False},
           "large": {"solution": "4", "is_correct": True}}
    convs = conversations_of(rec, default_id="gsm:7", where="line 8")
    assert [c.id for c in convs] == ["gsm:7/small", "gsm:7/large"] and {c.tree_id for c in convs} == {"gsm:7"}
    assert [c.fields["reward"] for c in convs] == [0.0, 1.0]
    assert convs[1].messages == [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]


def token_rows(path: Path) -> list[tuple]:
    t = pq.read_table(path).to_pylist()
    return sorted((tuple(r["input_ids"]), tuple(r["loss_mask"])) for r in t)


def raw_slice(src: Path, lines: int, tmp_path: Path) -> Path:
    """The first ``lines`` records of a JSONL(.gz) file, in the same format."""
    opener = gzip.open if src.suffix == ".gz" else open
    with opener(src, "rt", encoding="utf-8") as f:
        head = [next(f) for _ in range(lines)]
    out = tmp_path / f"raw{''.join(src.suffixes)}"
    with opener(out, "wt", encoding="utf-8") as f:
        f.writelines(head)
    return out


@pytest.mark.skipif(not (RAW.is_dir() and QWEN3.is_dir()), reason="needs the real data next to the repository")
@pytest.mark.parametrize("source", ["toolbench", "hh", "gsm8k"])
def test_tokenize_reads_the_raw_file_as_its_converted_records(tmp_path, source):
    if source == "toolbench":  # includes a file without train_messages: skipped (counted) by the reader
        raw = sorted((RAW / "toolbench_dfs").glob("*.json"))[:6]
        records = [r for f in raw for r in converters.toolbench_records(f)]
    elif source == "hh":
        raw = [raw_slice(RAW / "hh_rlhf_harmless_test" / "harmless-base_test.jsonl.gz", 150, tmp_path)]
        records = converters.hh_rlhf_records(raw[0])
    else:
        raw = [raw_slice(RAW / "gsm8k_model_solutions" / "example_model_solutions.jsonl", 100, tmp_path)]
        records = converters.gsm8k_records(raw[0])
    converted = converters.write_jsonl(records, tmp_path / "converted.jsonl")
    a = run("tokenize", *raw, "--tokenizer", QWEN3, "-o", tmp_path / "a.parquet", "--on-error", "skip", "-q")
    b = run("tokenize", converted, "--tokenizer", QWEN3, "-o", tmp_path / "b.parquet", "-q")
    assert a.code == 0 and b.code == 0, (a.err, b.err)
    rows = token_rows(tmp_path / "a.parquet")
    assert len(rows) >= len(records) and rows == token_rows(tmp_path / "b.parquet")
