"""``treepack pack --on-error skip`` says what it skipped as ``stats`` does: the count by reason, then the file and
line of the first bad records, verbatim (one report, `report_skipped_records`)."""

from __future__ import annotations

import json

from chat_testing import THINK, build_tokenizer
from cli_helpers import run

from treepack.pack.shard_reader import read_manifest


def test_pack_names_the_first_bad_records_as_stats_does(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input_ids": [1, 2]}\n{"input_ids": [3, -4]}\nnot json\n{"input_ids": [1, 2, 5]}\n')
    report = [
        "skipped 2 bad record(s): 1 negative token, 1 malformed JSON",
        f"  {bad}: line 2: field 'input_ids'[1] is negative (-4)",
        f"  {bad}: line 3: malformed JSON (Expecting value at column 1)",
    ]
    stats = run("stats", bad, "--on-error", "skip", "--json")
    assert (stats.code, stats.err.splitlines()) == (0, report)
    r = run("pack", bad, "-c", "8", "-o", tmp_path / "p", "--on-error", "skip", "-q")
    assert (r.code, r.err.splitlines()) == (0, report)
    m = read_manifest(tmp_path / "p")
    assert m["counts"]["skipped"] == 2 and m["counts"]["packed_sequences"] == 2


def test_pack_with_a_tokenizer_names_the_first_bad_chat_records(tmp_path):
    tok = build_tokenizer(tmp_path / "tok", THINK)
    src = tmp_path / "chats.jsonl"
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    src.write_text("\n".join(json.dumps(r) for r in (good, {"messages": [{"role": "bot", "content": "x"}]}, good)))
    r = run("pack", src, "--tokenizer", tok, "-c", "1K", "-o", tmp_path / "p", "--on-error", "skip", "-q")
    assert (r.code, r.err.splitlines()) == (0, [
        "skipped 1 bad record(s): 1 unknown role",
        f"  {src}: line 2: field 'messages'[0].role: unknown role 'bot' (system, developer, user, assistant, tool)",
    ])
