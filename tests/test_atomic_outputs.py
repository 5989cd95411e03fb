"""Outputs appear whole or not at all: ``pack``, ``unpack`` and ``tokenize`` write under a hidden temporary name
and rename it into place at the end, so an error, Ctrl-C or SIGTERM in the middle of a write leaves neither a
cut-short output nor a temporary (and an output that was there before stays as it was). Also
`treepack.io.atomic` on its own: the rename never merges into a directory that holds files."""

from __future__ import annotations

import errno
import gzip
import json
import os
import signal
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest
from chat_testing import THINK, build_tokenizer
from cli_helpers import run

from treepack.chat import turns as chat_rollouts
from treepack.io import records
from treepack.io.atomic import atomic_dir, atomic_file
from treepack.io.ingest import read_rollouts
from treepack.pack import shards
from treepack.pack.shard_reader import read_manifest

# each record its own tokens: at capacity 64 one pack per record, so --shard-size 1packs writes a file per record
RECS = [{"id": f"r{i}", "tree_id": i % 3, "input_ids": [7, 8] + [100 + i] * 40} for i in range(12)]

# what the command ends with when the write fails: an error of the system (a full disk), Ctrl-C, a SIGTERM
FAULTS = [
    pytest.param(lambda: OSError(errno.ENOSPC, "No space left on device"),
                 (1, "Error: [Errno 28] No space left on device\n"), id="disk-full"),
    pytest.param(KeyboardInterrupt, (130, ""), id="ctrl-c"),
    pytest.param(lambda: SystemExit(143), (143, ""), id="sigterm"),
]


def listing(d) -> list[str]:
    """Every path under ``d``, hidden ones included, relative to it."""
    return sorted(str(p.relative_to(d)) for p in d.rglob("*"))


def write_input(d):
    path = d / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECS))
    return path


@pytest.fixture
def src(tmp_path):
    return write_input(tmp_path)


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    d = tmp_path_factory.mktemp("packed")
    assert run("pack", write_input(d), "-c", "64", "-o", d / "p", "-q").code == 0
    return d / "p"


# --------------------------------------------------------------------------------------------------
# pack


def fail_after_first_shard(monkeypatch, where, fault):
    """Make pack fail at its second pack, once the first shard is written into the hidden temporary directory."""
    build = shards.build_pack
    calls = []

    def build_then_fail(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            written = list(where.rglob("shard-*.parquet"))  # hidden directories included
            assert [(p.name, p.parent.name[:1], p.parent.suffix) for p in written] == [("shard-00000.parquet", ".",
                                                                                      ".tmp")]
            raise fault()
        return build(*args, **kwargs)

    monkeypatch.setattr(shards, "build_pack", build_then_fail)
    return calls


@pytest.mark.parametrize("fault, ends", FAULTS)
def test_pack_failing_mid_write_leaves_no_directory(src, tmp_path, monkeypatch, fault, ends):
    calls = fail_after_first_shard(monkeypatch, tmp_path, fault)
    r = run("pack", src, "-c", "64", "-o", tmp_path / "out" / "p", "--shard-size", "1packs", "-q")
    assert (r.code, r.err) == ends and len(calls) == 2
    assert listing(tmp_path) == ["in.jsonl"]  # no p/, no temporary, and out/ (made for it) removed again


@pytest.mark.parametrize("fault, ends", FAULTS)
def test_pack_into_an_existing_directory_failing_mid_write_leaves_it_as_it_was(src, tmp_path, monkeypatch, fault,
                                                                               ends):
    out = tmp_path / "p"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    fail_after_first_shard(monkeypatch, tmp_path, fault)
    r = run("pack", src, "-c", "64", "-o", out, "--shard-size", "1packs", "-q")
    assert (r.code, r.err) == ends
    assert listing(tmp_path) == ["in.jsonl", "p", "p/notes.txt"]


def test_pack_into_an_existing_directory_keeps_its_files(src, tmp_path):
    """As before: an existing directory without shards takes them next to what it holds (empty or not)."""
    for name, held in (("empty", []), ("notes", ["notes.txt"])):
        out = tmp_path / name
        out.mkdir()
        for f in held:
            (out / f).write_text("mine")
        r = run("pack", src, "-c", "64", "-o", out, "--shard-size", "5packs", "-q")
        assert r.code == 0, r.err
        assert listing(out) == sorted([*held, "manifest.json", "shard-00000.parquet", "shard-00001.parquet",
                                       "shard-00002.parquet"])
        assert read_manifest(out)["counts"]["packs"] == len(RECS)
    again = run("pack", src, "-c", "64", "-o", tmp_path / "notes", "-q")
    assert (again.code, again.err) == (1, (f"Error: {tmp_path / 'notes'}: already holds packed shards; remove them "
                                           "or choose another output directory\n"))


def test_pack_writes_a_new_directory_and_its_parents(src, tmp_path):
    r = run("pack", src, "-c", "64", "-o", tmp_path / "a" / "b" / "p", "-q")
    assert r.code == 0, r.err
    assert listing(tmp_path) == ["a", "a/b", "a/b/p", "a/b/p/manifest.json", "a/b/p/shard-00000.parquet", "in.jsonl"]
    assert oct((tmp_path / "a" / "b" / "p").stat().st_mode & 0o777) == oct(0o777 & ~_umask())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# --------------------------------------------------------------------------------------------------
# unpack


def fail_mid_write(monkeypatch, module, fault, parquet: bool):
    """JSONL: the first record written, then the fault; Parquet: the whole table written, then the fault."""
    if parquet:
        write = pq.write_table

        def write_then_fail(table, where, **kwargs):
            write(table, where, **kwargs)
            assert os.path.basename(where).startswith(".") and os.path.getsize(where) > 0
            raise fault()

        monkeypatch.setattr(pq, "write_table", write_then_fail)
        return
    name = "iter_records" if module is records else "iter_chat_records"
    produce = getattr(module, name)

    def first_then_fail(*args):
        yield next(iter(produce(*args)))
        raise fault()

    monkeypatch.setattr(module, name, first_then_fail)


@pytest.mark.parametrize("name", ["back.jsonl", "back.jsonl.gz", "back.parquet"])
@pytest.mark.parametrize("fault, ends", FAULTS)
def test_unpack_failing_mid_write_leaves_no_file(packs, tmp_path, monkeypatch, name, fault, ends):
    fail_mid_write(monkeypatch, records, fault, name.endswith(".parquet"))
    r = run("unpack", packs, "-o", tmp_path / name, "-q")
    assert (r.code, r.err) == ends
    assert listing(tmp_path) == []


def test_unpack_failing_mid_write_keeps_the_file_that_was_there(packs, tmp_path, monkeypatch):
    (tmp_path / "back.jsonl").write_text("before\n")
    fail_mid_write(monkeypatch, records, KeyboardInterrupt, False)
    assert run("unpack", packs, "-o", tmp_path / "back.jsonl").code == 130
    assert listing(tmp_path) == ["back.jsonl"] and (tmp_path / "back.jsonl").read_text() == "before\n"


def test_unpack_replaces_a_file_and_names_the_output_in_errors(packs, tmp_path):
    for name in ("back.jsonl", "back.jsonl.gz", "back.parquet"):
        (tmp_path / name).write_text("before\n")
        assert run("unpack", packs, "-o", tmp_path / name, "-q").code == 0
        assert read_rollouts(tmp_path / name).ids == [r["id"] for r in RECS]
    assert (tmp_path / "back.jsonl.gz").read_bytes()[10:20] == b"back.jsonl"  # the gzip header's file name
    assert listing(tmp_path) == ["back.jsonl", "back.jsonl.gz", "back.parquet"]
    (tmp_path / "d.parquet").mkdir()
    for name, why in (("d.parquet", "Is a directory"), ("back.jsonl/x.jsonl", "Not a directory")):
        r = run("unpack", packs, "-o", tmp_path / name)
        assert (r.code, r.err) == (1, f"Error: {tmp_path / name}: {why}\n")


# --------------------------------------------------------------------------------------------------
# tokenize


CONV = [{"role": "user", "content": "where is my order"}, {"role": "assistant", "content": "it shipped"},
        {"role": "user", "content": "when?"}, {"role": "assistant", "content": "yesterday"}]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok") / "think", THINK)


@pytest.fixture
def chats(tmp_path_factory):
    path = tmp_path_factory.mktemp("chats") / "c.jsonl"
    path.write_text("".join(json.dumps({"id": f"c{i}", "messages": CONV}) + "\n" for i in range(4)))
    return path


@pytest.mark.parametrize("name", ["t.jsonl", "t.jsonl.gz", "t.parquet"])
@pytest.mark.parametrize("fault, ends", FAULTS)
def test_tokenize_failing_mid_write_leaves_no_file(tok_dir, chats, tmp_path, monkeypatch, name, fault, ends):
    fail_mid_write(monkeypatch, chat_rollouts, fault, name.endswith(".parquet"))
    r = run("tokenize", chats, "--tokenizer", tok_dir, "-o", tmp_path / "new" / name, "-q", "--json")
    assert (r.code, r.err, r.out) == (*ends, "")
    assert listing(tmp_path) == []  # new/, made for the output, removed again


def test_tokenize_writes_whole_files(tok_dir, chats, tmp_path):
    for name in ("t.jsonl", "t.jsonl.gz", "t.parquet"):
        r = run("tokenize", chats, "--tokenizer", tok_dir, "-o", tmp_path / "new" / name, "-q", "--json")
        assert r.code == 0, r.err
        assert json.loads(r.out)["bytes"] == (tmp_path / "new" / name).stat().st_size
        assert len(read_rollouts(tmp_path / "new" / name)) == 8
    assert (tmp_path / "new" / "t.jsonl.gz").read_bytes()[10:17] == b"t.jsonl"
    assert listing(tmp_path) == ["new", "new/t.jsonl", "new/t.jsonl.gz", "new/t.parquet"]


# --------------------------------------------------------------------------------------------------
# A real SIGTERM, in a fresh process


def treepack(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "treepack", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def terminate_once(p: subprocess.Popen, written) -> tuple[int, bytes, bytes]:
    """SIGTERM ``p`` as soon as ``written()`` (its output half-written); its exit code, stdout and stderr."""
    try:
        deadline = time.monotonic() + 120
        while not written():
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()
            time.sleep(0.005)
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=120)
        return p.returncode, out, err
    finally:
        p.kill()  # a no-op once it has exited


def test_sigterm_mid_pack_leaves_nothing(tmp_path):
    src = tmp_path / "in.jsonl.gz"
    recs = [{"id": i, "input_ids": [1, 2] + [10 + i] * 300} for i in range(1500)]
    src.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in recs).encode(), compresslevel=1))
    p = treepack("pack", src, "-c", "512", "-o", tmp_path / "p", "--shard-size", "1packs", "-q")
    code, out, err = terminate_once(p, lambda: any(tmp_path.glob(f".p.{p.pid}.tmp/shard-00002.parquet")))
    assert (code, out, err) == (143, b"", b"")
    assert listing(tmp_path) == ["in.jsonl.gz"]


def test_sigterm_mid_unpack_leaves_nothing(tmp_path):
    src = tmp_path / "in.jsonl.gz"
    recs = [{"id": i, "tree_id": i % 4, "input_ids": [1, 2, 3] + [100 + i] * 40_000} for i in range(48)]
    src.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in recs).encode(), compresslevel=1))
    assert run("pack", src, "-c", "64K", "-o", tmp_path / "p", "-q").code == 0
    out = tmp_path / "o" / "back.jsonl.gz"
    out.parent.mkdir()
    p = treepack("unpack", tmp_path / "p", "-o", out)
    tmp = out.parent / f".{out.name}.{p.pid}.tmp"
    code, got, err = terminate_once(p, lambda: tmp.exists() and tmp.stat().st_size > 0)
    assert (code, got, err) == (143, b"", b"")
    assert listing(out.parent) == []


# --------------------------------------------------------------------------------------------------
# treepack.io.atomic


def test_atomic_file_renames_on_success_and_removes_on_failure(tmp_path):
    out = tmp_path / "x.txt"
    with atomic_file(out) as tmp:
        assert tmp == tmp_path / f".x.txt.{os.getpid()}.tmp"
        tmp.write_text("one")
        assert not out.exists()
    assert out.read_text() == "one"
    with pytest.raises(ValueError), atomic_file(out) as tmp:
        tmp.write_text("two")
        raise ValueError
    assert listing(tmp_path) == ["x.txt"] and out.read_text() == "one"
    with pytest.raises(PermissionError) as exc, atomic_file(out) as tmp:
        raise PermissionError(errno.EACCES, "Permission denied", str(tmp))
    assert exc.value.filename == str(out)  # the output's name, not its temporary's


def test_atomic_dir_never_merges_into_a_directory_that_took_the_name(tmp_path):
    out = tmp_path / "d"
    with pytest.raises(OSError) as exc, atomic_dir(out) as tmp:
        (tmp / "a").write_text("new")
        out.mkdir()
        (out / "b").write_text("someone else's")
    assert exc.value.errno in (errno.ENOTEMPTY, errno.EEXIST) and exc.value.filename == str(out)
    assert listing(tmp_path) == ["d", "d/b"]


def test_atomic_dir_into_an_existing_directory_replaces_no_file_and_moves_last_last(tmp_path, monkeypatch):
    out = tmp_path / "d"
    out.mkdir()
    moves = []
    replace = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (moves.append(os.path.basename(b)), replace(a, b)))
    with atomic_dir(out, last="m") as tmp:
        for name in ("z", "m", "a"):
            (tmp / name).write_text(name)
    assert moves == ["a", "z", "m"] and listing(tmp_path) == ["d", "d/a", "d/m", "d/z"]
    with pytest.raises(FileExistsError) as exc, atomic_dir(out, last="m") as tmp:
        (tmp / "b").write_text("new")
        (tmp / "m").write_text("new")
    assert exc.value.filename == str(out / "m")
    assert listing(tmp_path) == ["d", "d/a", "d/m", "d/z"] and (out / "m").read_text() == "m"


# ------------------------------------------------------------------------------------------------------------
# outputs that would overwrite what is still needed are refused before any work


def usage_error(r) -> str:
    assert r.code == 2, (r.code, r.out, r.err)
    return r.err.strip().splitlines()[-1]


def test_tokenize_refuses_its_own_input_as_output(tok_dir, chats, tmp_path):
    before = chats.read_bytes()
    assert usage_error(run("tokenize", chats, "--tokenizer", tok_dir, "-o", chats)) == (
        f"Error: Invalid value for --output: {str(chats)!r} is the input {chats}: write it elsewhere")
    link = tmp_path / "link.jsonl"
    link.symlink_to(chats)
    assert "is the input" in usage_error(run("tokenize", chats, "--tokenizer", tok_dir, "-o", link))
    inside = chats.parent / "out.jsonl"  # a rerun over the directory would read it as a conversation file
    assert usage_error(run("tokenize", chats.parent, "--tokenizer", tok_dir, "-o", inside)) == (
        f"Error: Invalid value for --output: {str(inside)!r} is inside the input {chats.parent}: write it elsewhere")
    assert chats.read_bytes() == before and not inside.exists()


def test_no_command_writes_a_file_into_a_pack_directory(tok_dir, chats, tmp_path):
    src = tmp_path / "r.jsonl"
    assert run("synth", "tau2", "-n", "1", "-o", src, "-q").code == 0
    assert run("pack", src, "-c", "64K", "-o", tmp_path / "p", "-q").code == 0
    shard = tmp_path / "p" / "shard-00000.parquet"
    before = shard.read_bytes()
    want = (f"Error: Invalid value for --output: {str(shard)!r}: write it outside the pack directory {tmp_path / 'p'} "
            "(a file there can replace one of its shards)")
    assert usage_error(run("synth", "tau2", "-n", "1", "-o", shard)) == want
    assert usage_error(run("tokenize", chats, "--tokenizer", tok_dir, "-o", shard)) == want
    assert shard.read_bytes() == before


def test_pack_refuses_a_stream_and_its_input_directory(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    assert run("synth", "tau2", "-n", "1", "-o", d / "r.jsonl", "-q").code == 0
    assert usage_error(run("pack", d, "-c", "64K", "-o", "-")) == (
        "Error: Invalid value for --output: pack writes a directory of shards, not a stream: name one")
    assert usage_error(run("pack", d, "-c", "64K", "-o", d)) == (
        f"Error: Invalid value for --output: {str(d)!r} is the input {d}: write it elsewhere")
    assert run("pack", d, "-c", "64K", "-o", d / "packs", "-q").code == 0  # readers skip a pack directory
    assert run("pack", d, "-c", "64K", "-o", tmp_path / "again", "-q").code == 0


def test_a_symlinked_output_is_written_through_and_long_names_work(tmp_path):
    src = tmp_path / "r.jsonl"
    assert run("synth", "tau2", "-n", "1", "-o", src, "-q").code == 0
    target, link = tmp_path / "target.jsonl", tmp_path / "link.jsonl"
    target.write_text("orig\n")
    link.symlink_to(target)
    assert run("synth", "tau2", "-n", "1", "-o", link, "-q").code == 0
    assert link.is_symlink() and target.read_bytes() == src.read_bytes()
    long = tmp_path / ("a" * 245 + ".jsonl")  # 251 bytes: valid, and so must its temporary be
    assert run("synth", "tau2", "-n", "1", "-o", long, "-q").code == 0
    assert long.read_bytes() == src.read_bytes() and sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
