"""Packs you can trust: every reader refuses a changed shard or manifest with one line naming it, packs come in
the manifest's order, `treepack check`; and the input faults that used to pass silently or crash (each with its
exact message and exit code)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from cli_helpers import run

from treepack.errors import InputError
from treepack.pack.integrity import DIGEST_KEY, content_digest
from treepack.pack.shard_reader import check_packs, read_manifest, read_packs, unpack

RECS = [{"id": f"r{i}", "tree_id": f"g{i % 3}", "input_ids": [1, 2, 3, i % 3, 4 + i, 5, 6 + i % 2],
         "loss_mask": [0, 0, 0, 1, 1, 1, 1], "reward": float(i % 2), "note": {"k": [i, "x"]}} for i in range(36)]


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """A pack of 18 shards (one pack each) and its source."""
    root = tmp_path_factory.mktemp("packed")
    src = root / "in.jsonl"
    src.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in RECS))
    r = run("pack", src, "-c", "10", "--group-by", "tree_id", "--shard-size", "1packs", "-o", root / "pk", "-q")
    assert r.code == 0, r.err
    assert read_manifest(root / "pk")["counts"]["shards"] == 18
    return root


@pytest.fixture
def pk(packed, tmp_path):
    """A fresh copy of the pack to damage."""
    shutil.copytree(packed / "pk", tmp_path / "pk")
    return tmp_path / "pk"


def edit_manifest(pk, change, *, digest=True):
    m = json.loads((pk / "manifest.json").read_text())
    change(m)
    if digest and DIGEST_KEY in m:
        m[DIGEST_KEY] = content_digest(m)
    (pk / "manifest.json").write_text(json.dumps(m, indent=1))
    return m


def readers(pk, tmp_path):
    """Every way a pack directory is read, each as (name, exit code, stderr)."""
    from treepack.train.data import load_packs

    out = []
    for args in (("unpack", pk, "-o", tmp_path / "x.jsonl"), ("stats", pk), ("check", pk),
                 ("plot", pk, "-o", tmp_path / "x.png"), ("report", pk, "-o", tmp_path / "x.html")):
        r = run(*args)
        out.append((args[0], r.code, r.err))
    for name, fn in (("read_packs", lambda: list(read_packs(pk))), ("unpack()", lambda: unpack(pk)),
                     ("load_packs", lambda: load_packs(pk))):
        try:
            fn()
            out.append((name, 0, ""))
        except InputError as exc:
            out.append((name, 1, f"Error: {exc}\n"))
    return out


def assert_all_refuse(pk, tmp_path, message):
    for name, code, err in readers(pk, tmp_path):
        assert (name, code, err) == (name, 1, f"Error: {message}\n")


# --------------------------------------------------------------------------------------------------
# shards


def test_an_intact_pack_checks_and_reads(packed, tmp_path):
    pk = packed / "pk"
    r = run("check", pk)
    assert (r.code, r.err) == (0, "")
    shards = read_manifest(pk)["shards"]
    tokens, size = sum(s["tokens"] for s in shards), sum(s["bytes"] for s in shards)
    assert r.out == (f"{pk}: ok: 18 shards, 18 packs, 36 records, {tokens:,} tokens, {size:,} bytes: sizes, sha256, "
                     "rows, records, tokens and pack order match the manifest\n")
    assert [p.meta["pack_index"] for p in read_packs(pk)] == list(range(18))
    m = read_manifest(pk)
    for s in m["shards"]:
        data = (pk / s["file"]).read_bytes()
        assert (s["bytes"], s["sha256"]) == (len(data), hashlib.sha256(data).hexdigest())
        meta = pq.ParquetFile(pk / s["file"]).metadata
        assert meta.num_rows == s["packs"]
    assert m[DIGEST_KEY] == content_digest(m)


@pytest.mark.parametrize("part", ["header", "pages", "footer"])
def test_a_flipped_bit_anywhere_in_a_shard_is_refused_by_every_reader(pk, tmp_path, part):
    shard = pk / "shard-00002.parquet"
    data = bytearray(shard.read_bytes())
    at = {"header": 5, "pages": len(data) // 2, "footer": len(data) - 12}[part]
    data[at] ^= 0x10
    shard.write_bytes(bytes(data))
    got = hashlib.sha256(bytes(data)).hexdigest()
    want = read_manifest(pk)["shards"][2]["sha256"]
    assert_all_refuse(pk, tmp_path, f"{shard}: sha256 {got[:12]}... where the manifest says {want[:12]}... (the file "
                                    "was changed or damaged)")


def test_a_shard_of_another_size_cut_or_missing_is_refused(pk, tmp_path):
    shard = pk / "shard-00003.parquet"
    good = shard.read_bytes()
    shard.write_bytes(good + b"\0")
    assert_all_refuse(pk, tmp_path, f"{shard}: {len(good) + 1:,} bytes where the manifest says {len(good):,} (the file "
                                    "was changed, replaced or cut short)")
    shard.unlink()
    assert_all_refuse(pk, tmp_path, f"{shard}: shard listed in the manifest is missing")


def test_the_hf_dataset_verifies_too(pk):
    pytest.importorskip("torch")
    from treepack.hf.data import PackDataset

    assert len(list(PackDataset(pk))) == 18
    shard = pk / "shard-00000.parquet"
    shard.write_bytes(shard.read_bytes()[:-1])
    with pytest.raises(InputError, match=r"shard-00000.parquet: [\d,]+ bytes where the manifest says"):
        list(PackDataset(pk))


def _without_checksums(pk):
    """The pack as treepack 0.1 wrote it: schema version 2, no sha256/records/tokens, no page checksums."""
    def change(m):
        m["schema_version"] = 2
        del m[DIGEST_KEY]
        for s in m["shards"]:
            table = pq.read_table(pk / s["file"])
            pq.write_table(table, pk / s["file"], row_group_size=64, compression="zstd")
            s["bytes"] = (pk / s["file"]).stat().st_size
            for k in ("sha256", "records", "tokens"):
                del s[k]
    edit_manifest(pk, change, digest=False)


def test_packs_written_before_checksums_still_read_with_what_their_manifest_has(packed, pk, tmp_path):
    _without_checksums(pk)
    assert run("unpack", pk, "-o", tmp_path / "old.jsonl").code == 0
    assert run("unpack", packed / "pk", "-o", tmp_path / "new.jsonl").code == 0
    assert (tmp_path / "old.jsonl").read_bytes() == (tmp_path / "new.jsonl").read_bytes()
    r = run("check", pk)
    assert r.code == 0 and r.out.endswith(": sizes, rows, page checksums and pack order match the manifest (schema "
                                          "version 2: written before sha256s)\n")
    shard = pk / "shard-00001.parquet"
    shard.write_bytes(shard.read_bytes()[:-1] + b"x")  # same size, footer magic gone: still named
    r = run("check", pk)
    assert r.code == 1 and r.err.startswith(f"Error: {shard}: not a readable Parquet shard (") and r.err.count("\n") == 1


def test_a_page_whose_checksum_fails_is_named(pk, tmp_path):
    """Page checksums are verified as pages decode (what catches damage where no sha256 is listed)."""
    def change(m):
        m["schema_version"] = 2
        del m[DIGEST_KEY]
        for s in m["shards"]:
            del s["sha256"]
    edit_manifest(pk, change, digest=False)
    shard = pk / "shard-00004.parquet"
    meta = pq.ParquetFile(shard).metadata
    rg = meta.row_group(0)
    col = next(rg.column(i) for i in range(rg.num_columns) if rg.column(i).path_in_schema.startswith("input_ids."))
    data = bytearray(shard.read_bytes())
    start = col.dictionary_page_offset if col.has_dictionary_page else col.data_page_offset
    data[start + col.total_compressed_size - 1] ^= 0x01  # the last byte of the column's last page
    shard.write_bytes(bytes(data))
    assert_all_refuse(pk, tmp_path, f"{shard}: a Parquet page's checksum fails (the file was changed or damaged)")


def test_shards_are_read_in_the_manifests_order_not_by_name(packed, pk, tmp_path):
    """p0 ... p17: sorted by name p0, p1, p10, p11, ..., p2 ...; the manifest's order is the packs' order."""
    def change(m):
        for i, s in enumerate(m["shards"]):
            os.rename(pk / s["file"], pk / f"p{i}.parquet")
            s["file"] = f"p{i}.parquet"
    edit_manifest(pk, change)
    assert sorted(p.name for p in pk.glob("*.parquet"))[:3] == ["p0.parquet", "p1.parquet", "p10.parquet"]
    assert [p.meta["pack_index"] for p in read_packs(pk)] == list(range(18))
    from treepack.train.data import load_packs

    assert [p.meta["pack_index"] for p in load_packs(pk)] == list(range(18))
    assert run("unpack", pk, "-o", tmp_path / "a.jsonl").code == 0
    assert run("unpack", packed / "pk", "-o", tmp_path / "b.jsonl").code == 0
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()

    def swap(m):  # the files of packs 1 and 2 trade places (entries follow their files, first_pack stays)
        a, b = m["shards"][1], m["shards"][2]
        os.rename(pk / "p1.parquet", pk / "tmp.parquet")
        os.rename(pk / "p2.parquet", pk / "p1.parquet")
        os.rename(pk / "tmp.parquet", pk / "p2.parquet")
        for k in ("bytes", "sha256", "records", "tokens"):
            a[k], b[k] = b[k], a[k]
    edit_manifest(pk, swap)
    assert_all_refuse(pk, tmp_path, f"{pk / 'p1.parquet'}: its first pack_index is 2 where the manifest says first_pack 1")


# --------------------------------------------------------------------------------------------------
# the manifest


def test_a_lost_shard_entry_and_edited_counts_are_refused(packed, pk, tmp_path):
    n = read_manifest(pk)["counts"]["packed_sequences"]
    edit_manifest(pk, lambda m: m["shards"].pop())  # item 2: records went missing silently
    assert_all_refuse(pk, tmp_path, f"{pk / 'manifest.json'}: the number of shards listed is 17 where 'counts'.shards "
                                    "is 18")
    shutil.rmtree(pk)
    shutil.copytree(packed / "pk", pk)
    edit_manifest(pk, lambda m: m["counts"].update(records=400))
    assert_all_refuse(pk, tmp_path, f"{pk / 'manifest.json'}: 'counts'.packed_sequences + 'counts'.oversize_skipped "
                                    f"is {n:,} where 'counts'.records is 400")


def test_deleting_the_last_shard_entry_and_fixing_every_count_still_fails(pk, tmp_path):
    def change(m):
        s = m["shards"].pop()
        c = m["counts"]
        c["shards"] -= 1
        c["packs"] -= 1
        c["packed_sequences"] -= s["records"]
        c["records"] -= s["records"]
        m["sources"][0]["n_records"] -= s["records"]
        m["stats"]["n_packs"] -= 1
        m["stats"]["n_pack_tokens"] -= s["tokens"]
    edit_manifest(pk, change)
    assert_all_refuse(pk, tmp_path, f"{pk / 'shard-00017.parquet'}: a shard the manifest does not list (17 listed): "
                                    "the manifest lost an entry, or the file does not belong here")


def test_a_damaged_records_kind_is_one_line(pk, tmp_path):
    edit_manifest(pk, lambda m: m["records"].update(kind="parquet"))  # item 3: was KeyError: 'schema'
    assert_all_refuse(pk, tmp_path, f"{pk / 'manifest.json'}: field 'records'.kind must be one of json, arrow, got "
                                    '"parquet"')


def _leaves(v, path=()):
    if isinstance(v, dict):
        for k, x in v.items():
            yield path + (k,)
            yield from _leaves(x, path + (k,))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            yield path + (i,)
            yield from _leaves(x, path + (i,))


def _edited(v):
    if isinstance(v, bool):
        return not v
    if isinstance(v, (int, float)):
        return v + 1
    if isinstance(v, str):
        return v + "x"
    if v is None:
        return 0
    return None  # a list or object: replaced by null


def test_every_manifest_field_deleted_or_edited_is_refused(packed, tmp_path):
    """Every key and list entry of the manifest, deleted, and every value edited (the digest kept as written):
    `treepack check` exits 1 with one line naming the manifest or a shard."""
    pk = packed / "pk"
    m0 = json.loads((pk / "manifest.json").read_text())
    paths = list(_leaves(m0))
    assert len(paths) > 150
    work = tmp_path / "pk"
    shutil.copytree(pk, work)
    for path in paths:
        for how in ("delete", "edit"):
            m = json.loads(json.dumps(m0))
            *parent, last = path
            owner = m
            for k in parent:
                owner = owner[k]
            if how == "delete":
                del owner[last]
            else:
                owner[last] = _edited(owner[last])
            (work / "manifest.json").write_text(json.dumps(m))
            r = run("check", work)
            assert r.code == 1 and r.out == "" and r.err.count("\n") == 1, (how, path, r.err)
            assert r.err.startswith(f"Error: {work}"), (how, path, r.err)


def test_check_reports_every_directory_and_exits_1_if_any_fails(packed, pk, tmp_path):
    edit_manifest(pk, lambda m: m.update(capacity=17), digest=False)
    r = run("check", packed / "pk", pk, tmp_path / "nope", "-q")
    assert r.code == 1 and r.out == ""
    assert r.err == (f"Error: {pk / 'manifest.json'}: its content differs from what `treepack pack` wrote "
                     f"('{DIGEST_KEY}' does not match: a field was edited or damaged)\n"
                     f"Error: {tmp_path / 'nope'}: no such file or directory\n")
    assert check_packs(packed / "pk")["records"] == 36


# --------------------------------------------------------------------------------------------------
# items 4-12 of the issue


SURROGATE = "holds a lone surrogate \\ud800 (not Unicode text: no UTF-8 output can hold it)"


@pytest.mark.parametrize("field", ["n2", "id", "tree_id"])
def test_a_lone_surrogate_is_refused_by_name_by_every_command(tmp_path, field):
    src = tmp_path / "s.jsonl"
    src.write_text(f'{{"input_ids":[1,2,3],"{field}":"\\ud800"}}\n{{"input_ids":[1,2,4],"{field}":"x"}}\n')
    want = f"Error: {src}: line 1: field '{field}' {SURROGATE}\n"
    for args in (("stats", src), ("pack", src, "-c", "8", "-o", tmp_path / "p"), ("plot", src, "-o", tmp_path / "a.png"),
                 ("report", src, "-o", tmp_path / "r.html")):
        r = run(*args)
        assert (args[0], r.code, r.err) == (args[0], 1, want)
    r = run("stats", src, "--on-error", "skip", "--json", "-q")
    assert r.code == 0 and json.loads(r.out)["skipped"] == {"lone surrogate": 1}


def test_a_surrogate_pair_is_one_character_and_kept_exactly(tmp_path):
    src = tmp_path / "s.jsonl"
    src.write_text('{"input_ids":[1,2,3],"t":"\\ud83d\\ude00"}\n')
    assert run("pack", src, "-c", "8", "-o", tmp_path / "p").code == 0
    assert run("unpack", tmp_path / "p", "-o", tmp_path / "b.jsonl").code == 0
    assert json.loads((tmp_path / "b.jsonl").read_text()) == {"input_ids": [1, 2, 3], "t": "\U0001f600"}


def test_a_surrogate_in_a_chat_transcript_is_one_line(tmp_path):
    pytest.importorskip("tokenizers")
    from treepack.datasets import SAMPLES_DIR

    src = tmp_path / "c.jsonl"
    src.write_text('{"messages":[{"role":"user","content":"hi \\ud800"},{"role":"assistant","content":"yo"}]}\n')
    r = run("tokenize", src, "--tokenizer", SAMPLES_DIR / "chat_tokenizer", "-o", tmp_path / "t.jsonl")
    assert (r.code, r.err) == (1, f"Error: {src}: line 1: field 'messages'[0].content {SURROGATE}\n")


def test_a_shard_named_directly_is_refused_by_name(packed, tmp_path):
    shard = packed / "pk" / "shard-00000.parquet"
    for command in ("stats", "pack"):
        r = run(command, shard, *(("-c", "8", "-o", tmp_path / "p") if command == "pack" else ()))
        want = (f"Error: {shard}: a shard of the pack directory {packed / 'pk'}, not rollouts: name {packed / 'pk'} to "
                "read the records packed in it\n")
        assert (r.code, r.err) == (1, want)
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(shard, bare)
    r = run("stats", bare)
    want = (f"Error: {bare / shard.name}: a shard written by `treepack pack`, not rollouts, and {bare} has no "
            "manifest.json (an incomplete pack directory: pack its rollouts again)\n")
    assert (r.code, r.err) == (1, want)


def test_stats_of_a_pack_keeps_the_loss_masks(packed):
    """Item 6: the FLOP model counts loss targets; the pack reader used to drop the masks (4.01x for 3.68x)."""
    direct = json.loads(run("stats", packed / "in.jsonl", "--json", "-q").out)
    via_pack = json.loads(run("stats", packed / "pk", "--json", "-q").out)
    assert via_pack["flop_speedup"] == direct["flop_speedup"]
    for key in ("n_flat_tokens", "n_tree_tokens", "compression", "por", "c_attn"):
        assert via_pack[key] == direct[key], key


def test_pack_refuses_a_directory_holding_rollouts(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"input_ids":[1,2]}\n')
    d = tmp_path / "d"
    (d / "sub").mkdir(parents=True)
    (d / "data.jsonl").write_text('{"input_ids":[3]}\n')
    (d / "sub" / "more.parquet").write_bytes(b"")
    (d / "notes.txt").write_text("mine")
    r = run("pack", src, "-c", "8", "-o", d)
    want = (f"Error: {d}: holds rollout files ({d / 'data.jsonl'} and 1 more), which every reader would pass over "
            "once it is a pack directory (it reads as its packs only); choose another output directory\n")
    assert (r.code, r.err) == (1, want)
    assert sorted(p.name for p in d.iterdir()) == ["data.jsonl", "notes.txt", "sub"]


@pytest.mark.parametrize(("text", "shown", "where"), [('1e400', "Infinity", "'x'"), ("NaN", "NaN", "'x'"),
                                                       ("-Infinity", "-Infinity", "'x'"),
                                                       ('{"a":[1,-1e999]}', "-Infinity", "'x'.a[1]")])
def test_non_finite_numbers_in_any_field_are_refused(tmp_path, text, shown, where):
    src = tmp_path / "n.jsonl"
    src.write_text(f'{{"input_ids":[1,2,3],"x":{text}}}\n')
    for args in (("stats", src), ("pack", src, "-c", "8", "-o", tmp_path / "p")):
        r = run(*args)
        want = (f"Error: {src}: line 1: field {where} must be a finite number, got {shown} (JSON has no NaN or "
                "Infinity, and numbers beyond 1.8e308 read as Infinity)\n")
        assert (r.code, r.err) == (1, want)
    src.write_text('{"input_ids":[1,2,3],"reward":NaN}\n')  # as before
    assert run("stats", src).err == f"Error: {src}: line 1: field 'reward' must be a finite number, got NaN\n"


def test_unpack_to_json_of_a_parquet_nan_is_valid_json(tmp_path):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"input_ids": [[1, 2, 3], [1, 2, 4]], "x": [float("nan"), float("-inf")],
                             "v": [[1.5, float("inf")], None]}), src)
    assert run("pack", src, "-c", "8", "-o", tmp_path / "p").code == 0
    r = run("unpack", tmp_path / "p", "-o", tmp_path / "b.jsonl")
    assert r.code == 0
    assert r.err.endswith("written as text: 3 value(s) JSON has no type for (float: 3); unpack to .parquet keeps them "
                          "exact\n")

    def strict(c):
        raise ValueError(c)

    lines = [json.loads(x, parse_constant=strict) for x in (tmp_path / "b.jsonl").read_text().splitlines()]
    assert lines == [{"input_ids": [1, 2, 3], "x": "NaN", "v": [1.5, "Infinity"]},
                     {"input_ids": [1, 2, 4], "x": "-Infinity", "v": None}]
    assert run("unpack", tmp_path / "p", "-o", tmp_path / "b.parquet").code == 0
    back = pq.read_table(tmp_path / "b.parquet").column("x").to_pylist()
    assert np.isnan(back[0]) and back[1] == float("-inf")


def _compress(data: bytes, kind: str) -> bytes:
    import bz2
    import lzma

    return {"bz2": bz2.compress, "xz": lzma.compress,
            "zst": lambda d: pa.compress(d, "zstd", asbytes=True)}[kind](data)


@pytest.mark.parametrize("kind", ["bz2", "xz", "zst"])
def test_bzip2_xz_and_zstd_read_as_gzip_does(tmp_path, kind):
    text = "".join(json.dumps(r) + "\n" for r in RECS).encode()
    plain = tmp_path / "in.jsonl"
    plain.write_bytes(text)
    packed = tmp_path / f"in.jsonl.{kind}"
    packed.write_bytes(_compress(text, kind) * 2)  # concatenated streams read as one
    want = json.loads(run("stats", plain, plain, "--json", "-q").out)
    got = json.loads(run("stats", packed, "--json", "-q").out)
    for key in ("n_sequences", "n_flat_tokens", "n_tree_tokens", "por"):
        assert got[key] == want[key]
    other = tmp_path / "renamed.data"  # recognised by its bytes, whatever the name
    other.write_bytes(_compress(text, kind))
    assert json.loads(run("stats", other, "--json", "-q").out)["n_sequences"] == len(RECS)
    folder = tmp_path / "dir"
    folder.mkdir()
    shutil.copy(packed, folder)
    assert json.loads(run("stats", folder, "--json", "-q").out)["n_sequences"] == 2 * len(RECS)


def test_a_cut_or_misnamed_compressed_file_is_one_line(tmp_path):
    big = "".join(json.dumps({"input_ids": list(range(i, i + 200))}) + "\n" for i in range(3000)).encode()
    names = {"bz2": "bzip2", "xz": "xz", "zst": "zstd"}
    for kind, name in names.items():
        cut = tmp_path / f"cut.jsonl.{kind}"
        blob = _compress(big, kind)
        cut.write_bytes(blob[: len(blob) // 2])
        r = run("stats", cut)
        assert r.code == 1 and r.err.startswith(f"Error: {cut}: line ")
        assert f": truncated {name} file (the compressed stream ends early, after " in r.err and r.err.count("\n") == 1
        wrong = tmp_path / f"plain.jsonl.{kind}"
        wrong.write_text('{"input_ids":[1]}\n')
        r = run("stats", wrong)
        want = f"Error: {wrong}: not a {name} file (the name ends in .{kind} but it starts with '{{\"input_')\n"
        assert (r.code, r.err) == (1, want)


def test_symbolic_links_that_loop_or_dangle_are_named(tmp_path):
    loop = tmp_path / "loop.jsonl"
    loop.symlink_to(loop.name)
    r = run("stats", loop)
    assert (r.code, r.err) == (1, f"Error: {loop}: a symbolic link that loops (Too many levels of symbolic links)\n")
    dangling = tmp_path / "d.jsonl"
    dangling.symlink_to("gone.jsonl")
    r = run("stats", dangling)
    assert (r.code, r.err) == (1, f"Error: {dangling}: a symbolic link to gone.jsonl, which does not exist\n")
    (tmp_path / "ok.jsonl").write_text('{"input_ids":[1]}\n')
    r = run("stats", tmp_path, "--json", "-q")
    assert r.code == 0
    assert json.loads(r.out)["skipped_files"] == [
        {"path": str(dangling), "reason": "a symbolic link to gone.jsonl, which does not exist"},
        {"path": str(loop), "reason": "a symbolic link that loops (Too many levels of symbolic links)"}]


def test_unpack_creates_the_output_directories(packed, tmp_path):
    for name in ("a/b/x.jsonl", "c/d/x.jsonl.gz"):
        r = run("unpack", packed / "pk", "-o", tmp_path / name)
        assert r.code == 0, r.err
        assert (tmp_path / name).is_file()


def test_the_drift_table_keeps_every_number_whole_at_80_columns(monkeypatch):
    from rich.console import Console

    import treepack.cli.chat_inputs as ci

    d = {"conversations": 8, "drifted": 116, "pairs": 116, "kinds": {"text": 116}, "wheres": {"turn": 116},
         "tokens_lost": 18213, "por": 0.85, "consistent_por": 0.885, "records_differ": 116, "records": 124}
    summary = {"inputs": {"tau_bench_chats.json.gz": d, "other.jsonl": d}, "examples": [], **d}
    for width in (80, 60, 200):
        buf = io.StringIO()
        monkeypatch.setattr(ci, "console", Console(file=buf, width=width, highlight=False))
        ci.render_drift(summary)
        text = buf.getvalue()
        assert "…" not in text
        for cell in ("18,213", "0.8500", "0.8850", "116 of 116 (100%)", "116 of 124 (94%)", "0 / 116 / 0"):
            assert text.count(cell) == 3, (width, cell)
        assert max(len(line) for line in text.splitlines()[1:]) <= width


def test_the_verification_benchmark_runs(tmp_path, monkeypatch):
    """benchmarks/integrity.py end to end on one small tree: its report names the machine and both readers."""
    import importlib.util
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    monkeypatch.syspath_prepend(str(bench))
    spec = importlib.util.spec_from_file_location("integrity_bench", bench / "integrity.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    module.main(["--trees", "1", "--repeats", "1", "--out", str(tmp_path)])
    (report,) = tmp_path.glob("*-pack-integrity.md")
    text = report.read_text()
    assert "Machine: 2-core CPU (" in text and "| unpack (stats, plot, report, unpack) |" in text
    assert "| read_packs (train, verify, treepack.hf) |" in text and "`check_packs`" in text
