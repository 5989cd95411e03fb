"""Broken compressed chat files, read by ``treepack tokenize`` and ``--tokenizer`` on the other commands: one line
naming the file and the line where the stream broke, exit 1, with ``--on-error skip`` too, as the token-record
reader has it (tests/test_input_faults.py), and no output written."""

from __future__ import annotations

import gzip
import json
import zlib

import pytest
from chat_testing import THINK, build_tokenizer
from cli_helpers import run

from treepack.chat.conversations import iter_raw
from treepack.errors import InputError

CONV = [{"role": "system", "content": "help"}, {"role": "user", "content": "where is my order"},
        {"role": "assistant", "content": "let me look"}, {"role": "user", "content": "thanks"}]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok") / "think", THINK)


def chat_lines(n: int = 60) -> bytes:
    return "".join(json.dumps({"id": f"c{i}", "messages": [*CONV, {"role": "assistant", "content": "ok " * i}]}) + "\n"
                   for i in range(n)).encode()


def cut_in_half(path, data: bytes) -> int:
    """Write ``data`` gzip-compressed and cut in the middle of its stream; the whole lines that survive."""
    full = gzip.compress(data, compresslevel=1)
    cut = full[: len(full) // 2]
    path.write_bytes(cut)
    return zlib.decompressobj(31).decompress(cut).count(b"\n")


COMMANDS = {
    "tokenize": lambda src, tok, out: ("tokenize", src, "--tokenizer", tok, "-o", out / "t.jsonl"),
    "stats": lambda src, tok, out: ("stats", src, "--tokenizer", tok),
    "pack": lambda src, tok, out: ("pack", src, "--tokenizer", tok, "-c", "4K", "-o", out / "p"),
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("extra", [(), ("--on-error", "skip")])
def test_a_chat_jsonl_gz_cut_in_half_is_one_line_naming_file_and_line(tok_dir, tmp_path, command, extra):
    src = tmp_path / "chats.jsonl.gz"
    whole = cut_in_half(src, chat_lines())
    assert 0 < whole < 60
    r = run(*COMMANDS[command](src, tok_dir, tmp_path), *extra)
    assert (r.code, r.out) == (1, "")
    assert r.err == (f"Error: {src}: line {whole + 1}: truncated gzip file (the compressed stream ends early, "
                     f"after {whole:,} complete lines)\n")
    assert [p.name for p in tmp_path.iterdir()] == [src.name]  # nothing written


def test_a_json_array_cut_short_names_the_line_too(tok_dir, tmp_path):
    src = tmp_path / "chats.json.gz"
    text = json.dumps([json.loads(line) for line in chat_lines().splitlines()], indent=1).encode()
    whole = cut_in_half(src, text)
    r = run("tokenize", src, "--tokenizer", tok_dir, "--on-error", "skip")
    assert (r.code, r.err) == (1, (f"Error: {src}: line {whole + 1}: truncated gzip file (the compressed stream ends "
                                   f"early, after {whole:,} complete lines)\n"))
    with pytest.raises(InputError, match=rf"^{src}: line {whole + 1}: truncated gzip file"):
        list(iter_raw(str(src)))


def test_a_bad_checksum_and_a_file_that_is_not_gzip(tok_dir, tmp_path):
    crc = tmp_path / "crc.jsonl.gz"
    full = bytearray(gzip.compress(chat_lines(5)))
    full[-8] ^= 0xFF  # the CRC-32 of the trailer: every line inflates, the check at the end fails
    crc.write_bytes(bytes(full))
    r = run("tokenize", crc, "--tokenizer", tok_dir)
    assert (r.code, r.err) == (1, (f"Error: {crc}: line 6: corrupt gzip data (incorrect data check, after 5 complete "
                                   "lines)\n"))
    plain = tmp_path / "plain.jsonl.gz"
    plain.write_bytes(chat_lines(2))
    r = run("stats", plain, "--tokenizer", tok_dir, "--on-error", "skip")
    assert (r.code, r.err) == (1, (f"Error: {plain}: not a gzip file (the name ends in .gz but it starts with "
                                   "'{\"id\": \"')\n"))


def test_gzip_is_recognised_by_its_bytes(tok_dir, tmp_path):
    """As for token records: a gzip file read whatever its name, the same records as the plain file."""
    plain, packed = tmp_path / "c.jsonl", tmp_path / "z.jsonl"
    plain.write_bytes(chat_lines(3))
    packed.write_bytes(gzip.compress(chat_lines(3)))
    a, b = (run("tokenize", p, "--tokenizer", tok_dir, "--json") for p in (plain, packed))
    assert (a.code, b.code) == (0, 0)
    assert json.loads(a.out)["n_tokens"] == json.loads(b.out)["n_tokens"] > 0
