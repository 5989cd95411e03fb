"""Chat transcripts -> records: every record equals transformers' apply_chat_template of its turn, masks cover
exactly the turn's generated tokens, keep-prefix records extend the previous record, drift is found where it
is planted and nowhere else."""

from __future__ import annotations

import json

import numpy as np
import pytest
from chat_testing import CHATML, QWEN3, THINK, build_tokenizer, conversations, reference_records
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from treepack.chat.template import ChatTokenizer
from treepack.chat.turns import ChatOptions, tokenize_chats

pytest.importorskip("transformers")
FAST = settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
# no special end-of-turn token and no newline after the last message: a turn ending in a space
# tokenizes differently once "\n" follows (the tiny tokenizer merges " \n")
PLAIN = ("{%- for m in messages %}{%- if not loop.first %}{{ '\\n' }}{%- endif %}{{ m.role + ': ' + m.content }}"
         "{%- endfor %}{%- if add_generation_prompt %}{{ '\\nassistant: ' }}{%- endif %}")


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("tok")
    dirs = {"chatml": build_tokenizer(root / "chatml", CHATML), "think": build_tokenizer(root / "think", THINK),
            "plain": build_tokenizer(root / "plain", PLAIN), "meta": build_tokenizer(root / "meta", CHATML, metaspace=True)}
    if QWEN3.is_dir():
        dirs["qwen3"] = QWEN3
    return {k: (d, ChatTokenizer(d), AutoTokenizer.from_pretrained(str(d))) for k, d in dirs.items()}


def write(tmp_path, records, name="c.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def run(tmp_path, tok, records, **kw):
    options = ChatOptions(**{k: kw.pop(k) for k in list(kw) if k in ChatOptions.__dataclass_fields__})
    return tokenize_chats(write(tmp_path, records), tok, options, consistent=True, **kw)


@pytest.mark.parametrize("name", ["chatml", "think", "qwen3", "meta"])
def test_records_equal_apply_chat_template_and_masks_cover_the_turn(name, tokenizers, tmp_path_factory):
    if name not in tokenizers:
        pytest.skip("the Qwen3 tokenizer is not next to the repository")
    _, ct, tok = tokenizers[name]
    tmp = tmp_path_factory.mktemp(name)

    @FAST
    @given(conversations(), st.booleans())
    def check(messages, last_only):
        if name == "meta":  # its tiny alphabet: plain ASCII letters only
            messages = [{**m, "content": "".join(c for c in m.get("content", "") if c.isascii() and c.isalpha())}
                        for m in messages]
        recs = run(tmp, ct, [{"id": "c", "messages": messages}], turns="last" if last_only else "all")
        ref = reference_records(tok, messages)
        ref = ref[-1:] if last_only else ref
        r = recs.fresh
        assert len(r) == len(ref)
        for i, (ids, mask, _) in enumerate(ref):
            assert r.sequence(i).tolist() == ids
            assert r.loss_mask_of(i).tolist() == mask
        assert set(r.group_names) == {"c"}
        n_assistant = sum(m["role"] == "assistant" for m in messages)
        turns = [n_assistant - 1] if last_only else list(range(n_assistant))
        assert r.ids == [f"c/turn{j}" for j in turns]

    check()


def _eot_boundary(text: str, count: int, eot: str = "<|im_end|>") -> int:
    """Character position just after the ``count``-th ``eot`` of ``text`` (the naive text-level splice point)."""
    pos = -1
    for _ in range(count):
        pos = text.index(eot, pos + 1)
    return pos + len(eot)


@pytest.mark.parametrize("name", ["think", "qwen3"])
def test_keep_prefix_records_are_the_previous_record_plus_the_rendered_suffix(name, tokenizers, tmp_path_factory):
    if name not in tokenizers:
        pytest.skip("the Qwen3 tokenizer is not next to the repository")
    _, ct, tok = tokenizers[name]
    tmp = tmp_path_factory.mktemp(name)

    @FAST
    @given(conversations())
    def check(messages):
        recs = run(tmp, ct, [{"messages": messages}], keep_prefix_tokens=True)
        ref = reference_records(tok, messages)
        kept = recs.rollouts
        assert kept is recs.consistent and len(kept) == len(ref)
        prev = None
        for i, (ids, mask, text) in enumerate(ref):
            got, got_mask = kept.sequence(i).tolist(), kept.loss_mask_of(i).tolist()
            if prev is None:
                assert (got, got_mask) == (ids, mask)
            else:
                p_ids, p_mask, p_text = prev
                end = max(j for j, m in enumerate(p_mask) if m) + 1  # the previous turn's end-of-turn token
                cut = _eot_boundary(text, p_text.count("<|im_end|>"))  # same messages before: same count
                enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
                q = next(j for j, (a, _) in enumerate(enc["offset_mapping"]) if a >= cut)
                assert got == p_ids[:end] + ids[q:]
                assert got_mask == [0] * end + mask[q:]
            prev = (got, got_mask, text)

    check()


@FAST
@given(conversations())
def test_a_consistent_template_reports_no_drift(tokenizers, tmp_path_factory, messages):
    _, ct, _ = tokenizers["chatml"]
    recs = run(tmp_path_factory.mktemp("c"), ct, [{"messages": messages}])
    d = recs.total
    assert (d.drifted, d.tokens_lost, d.records_differ, d.unspliced) == (0, 0, 0, 0)
    assert d.pairs == d.turns - 1
    assert np.array_equal(recs.fresh.tokens, recs.consistent.tokens)


def _naive_drift(ref):
    """(turn, position, tokens lost) of each consecutive pair whose earlier record is not a prefix of the later."""
    out = []
    for t in range(len(ref) - 1):
        a, b = ref[t][0], ref[t + 1][0]
        p = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        if p < len(a):
            out.append((t, p, len(a) - p))
    return out


def test_planted_text_drift_is_found_at_the_think_block(tokenizers, tmp_path):
    _, ct, tok = tokenizers["think"]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"},
                {"role": "assistant", "content": "ok", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
                {"role": "tool", "content": "done"}, {"role": "assistant", "content": "bye"}]
    recs = run(tmp_path, ct, [{"id": "x", "messages": messages}], max_examples=5)
    ref = reference_records(tok, messages)
    naive = _naive_drift(ref)
    d = recs.total
    assert d.pairs == 2 and d.drifted == len(naive) == 2
    assert dict(d.kinds) == {"text": 2} and dict(d.wheres) == {"turn": 2}
    assert d.tokens_lost == sum(lost for _, _, lost in naive)
    assert [(e.turn, e.position, e.lost) for e in d.examples] == naive
    first = d.examples[0]
    assert first.conversation == "x"
    assert first.this_turn.startswith("<think>") and first.next_turn.startswith("hello")
    p = first.position
    assert first.context == tok.decode(ref[0][0][p - 8: p]) and first.context.endswith("sistant\n")
    assert recs.consistent is not None and d.records_differ == 2


def test_planted_token_drift_is_found_where_the_text_still_extends(tokenizers, tmp_path):
    _, ct, tok = tokenizers["plain"]
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "sure "},
                {"role": "user", "content": "and"}, {"role": "assistant", "content": "fine"}]
    recs = run(tmp_path, ct, [{"messages": messages}], max_examples=5)
    ids = [r.tolist() for r in (recs.fresh.sequence(0), recs.fresh.sequence(1))]
    text0 = tok.apply_chat_template(messages[:2], tokenize=False)
    assert tok.apply_chat_template(messages, tokenize=False).startswith(text0)  # the text is an extension ...
    assert ids[1][: len(ids[0])] != ids[0]  # ... the tokens are not
    d = recs.total
    assert d.drifted == 1 and dict(d.kinds) == {"tokens": 1} and dict(d.wheres) == {"turn": 1}
    assert [(e.turn, e.position, e.lost) for e in d.examples] == _naive_drift([(i,) for i in ids])
    assert d.unspliced == 1  # no special end-of-turn token to splice at: the record stays as rendered
    assert recs.consistent.sequence(1).tolist() == ids[1]


def test_dropped_reasoning_of_an_earlier_turn_is_drift_in_the_history(tokenizers, tmp_path):
    if "qwen3" not in tokenizers:
        pytest.skip("the Qwen3 tokenizer is not next to the repository")
    _, ct, tok = tokenizers["qwen3"]
    messages = [{"role": "user", "content": "order?"},
                {"role": "assistant", "content": "checking", "reasoning_content": "look it up",
                 "tool_calls": [{"function": {"name": "find", "arguments": {"q": 1}}}]},
                {"role": "tool", "content": "found"}, {"role": "assistant", "content": "it is here"},
                {"role": "user", "content": "thanks"}, {"role": "assistant", "content": "welcome"}]
    recs = run(tmp_path, ct, [{"messages": messages}], max_examples=5)
    naive = _naive_drift(reference_records(tok, messages))
    d = recs.total
    assert [(e.turn, e.position, e.lost) for e in d.examples] == naive
    wheres = [e.where for e in d.examples]
    assert wheres[-1] == "history"  # turn 2's context drops turn 0's reasoning: before turn 1's generation


def test_options_render_what_the_reference_renders_for_the_same_choices(tokenizers, tmp_path):
    _, ct, tok = tokenizers["chatml"]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "q"},
                {"role": "assistant", "content": "a", "reasoning_content": "r1"},
                {"role": "user", "content": "q2"}, {"role": "assistant", "content": "b", "reasoning_content": "r2"}]
    rec = {"messages": messages, "tools": tools}
    full = run(tmp_path, ct, [rec])
    assert [full.fresh.sequence(i).tolist() for i in range(2)] == [x[0] for x in reference_records(tok, messages, tools)]
    bare = run(tmp_path, ct, [rec], system=False, tools=False)
    assert [bare.fresh.sequence(i).tolist() for i in range(2)] == [x[0] for x in reference_records(tok, messages[1:])]
    dropped = run(tmp_path, ct, [rec], reasoning="drop")
    no_r1 = [*messages[:2], {"role": "assistant", "content": "a"}, *messages[3:]]
    assert dropped.fresh.sequence(1).tolist() == reference_records(tok, no_r1, tools)[1][0]
    assert dropped.fresh.sequence(0).tolist() == full.fresh.sequence(0).tolist()  # a turn keeps its own reasoning
    kept = run(tmp_path, ct, [rec], reasoning="keep")
    assert kept.options.keep_prefix_tokens and kept.rollouts is kept.consistent


def test_template_arguments_reach_the_template(tokenizers, tmp_path):
    if "qwen3" not in tokenizers:
        pytest.skip("the Qwen3 tokenizer is not next to the repository")
    _, _, tok = tokenizers["qwen3"]
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    recs = run(tmp_path, QWEN3, [{"messages": messages}], template_kwargs={"enable_thinking": False})
    (ids, mask, _), = reference_records(tok, messages, enable_thinking=False)
    assert recs.fresh.sequence(0).tolist() == ids and recs.fresh.loss_mask_of(0).tolist() == mask
    assert tok.decode([t for t, m in zip(ids, mask) if m]) == "a<|im_end|>"  # the empty think block is prompt


def test_pieces_are_off_for_a_tokenizer_that_reads_the_input_start_and_the_check_catches_a_forced_one(tokenizers):
    d, ct, tok = tokenizers["meta"]
    assert not ct.segmented and "input start" in ct.segment_note
    forced = ChatTokenizer(d)
    forced.segmented = True
    messages = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello you"}]
    (turn,) = forced.render_turns(messages)
    assert not forced.segmented and "differed" in forced.segment_note
    assert turn.ids.tolist() == reference_records(tok, messages)[0][0]


@pytest.mark.skipif(not QWEN3.is_dir(), reason="the Qwen3 tokenizer is not next to the repository")
def test_real_tau_bench_turns_equal_apply_chat_template_and_drift_at_every_think(tokenizers, tmp_path):
    raw = QWEN3.parents[1] / "raw" / "tau_bench_grok3_retail"
    files = sorted(raw.glob("*.json"))
    if not files:
        pytest.skip("tau-bench results are not next to the repository")
    data = json.loads(files[0].read_text())[:6]
    _, ct, tok = tokenizers["qwen3"]
    path = tmp_path / "tau.json"
    path.write_text(json.dumps(data))
    recs = tokenize_chats(path, ct, consistent=True)
    ids = {rid: i for i, rid in enumerate(recs.fresh.ids)}
    for conv in data[:3]:
        ref = reference_records(tok, conv["traj"])
        for j, (tokens, mask, _) in enumerate(ref):
            i = ids[f"task{conv['task_id']}/trial{conv['trial']}/turn{j}"]
            assert recs.fresh.sequence(i).tolist() == tokens and recs.fresh.loss_mask_of(i).tolist() == mask
    d = recs.total
    assert d.drifted == d.pairs > 0 and dict(d.wheres) == {"turn": d.pairs}
    assert all(e.this_turn.startswith("<think>") for e in d.examples)
    assert recs.fresh.rewards[0] == data[0]["reward"] and recs.fields[0]["info"] == data[0]["info"]
