"""Figures and the HTML report: every kind renders into a valid image of the expected size (bundled samples,
one sequence, one token, 10k sequences), the numbers behind them are exact, and the report is one valid,
self-contained HTML file. Renders use a low dpi: the pixel size is checked, not the pixels."""

from __future__ import annotations

import html.parser
import json
import struct
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import run
from hypothesis import given, settings
from strategies import rollouts_from, sequence_lists

from treepack.errors import InputError
from treepack.io.ingest import read_rollouts
from treepack.pack.strategies import pack_sequences
from treepack.tree import PrefixTree
from treepack.viz import curves, plots, tree_figure
from treepack.viz.report import build_report, compare_strategies

SAMPLE_DIR = Path(__file__).resolve().parents[1] / "treepack" / "datasets" / "samples"
SAMPLES = sorted([*SAMPLE_DIR.glob("*.jsonl.gz"), *SAMPLE_DIR.glob("*.parquet")])
DPI = 30
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from the IHDR chunk, after checking the signature."""
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR", "not a PNG"
    return struct.unpack(">II", data[16:24])


def expected_px(fig, dpi: int) -> tuple[int, int]:
    w, h = fig.get_size_inches()
    return round(w * dpi), round(h * dpi)


def render_ok(fig, tmp_path: Path, name: str, fmt: str = "png") -> Path:
    path = plots.save(fig, tmp_path / f"{name}.{fmt}", dpi=DPI)
    data = path.read_bytes()
    if fmt == "png":
        assert png_size(data) == expected_px(fig, DPI)
    elif fmt == "svg":
        assert data.lstrip().startswith(b"<?xml") and b"<svg" in data[:2000]
    else:
        assert data.startswith(b"%PDF-") and data.rstrip().endswith(b"%%EOF")
    return path


def grpo(n_groups: int, per_group: int, prompt: int, response: int, seed: int = 0):
    """GRPO-shaped rollouts: a shared template, one prompt per group, ``per_group`` sampled responses."""
    rng = np.random.default_rng(seed)
    template = list(range(1, 9))
    seqs, groups, ids = [], [], []
    for g in range(n_groups):
        p = template + rng.integers(100, 5000, prompt).tolist()
        for k in range(per_group):
            seqs.append(p + rng.integers(100, 5000, int(rng.integers(1, response + 1))).tolist())
            groups.append(f"q{g}")
            ids.append(f"q{g}/s{k}")
    return rollouts_from(seqs, groups=groups, ids=ids)


def packing_for(r, capacity, **kw):
    """A quick packing to draw (the strategies' quality is tested with the packer)."""
    return pack_sequences(r, capacity, strategy="dfs", oversize="skip", **kw)


# --------------------------------------------------------------------------------------------------
# every kind renders


EDGE = {
    "one-sequence": lambda: rollouts_from([[5, 6, 7, 8, 9]]),
    "one-token": lambda: rollouts_from([[42]]),
}


@pytest.mark.parametrize("case", sorted(EDGE))
@pytest.mark.parametrize("kind", plots.KINDS)
def test_edge_cases_render(case, kind, tmp_path):
    r = EDGE[case]()
    packing = packing_for(r, 8) if kind == "packs" else None
    render_ok(plots.figure(kind, r, packing=packing, source=case), tmp_path, f"{case}-{kind}")


@pytest.fixture(scope="module")
def big():
    """10k sequences in 1,250 groups of 8 (~0.5M tokens), its tree and a packing."""
    r = grpo(1250, 8, 24, 40, seed=1)
    tree = PrefixTree.build(r)
    return r, tree, packing_for(r, 4096, tree=tree)


@pytest.mark.parametrize("kind", plots.KINDS)
def test_ten_thousand_sequences_render(big, kind, tmp_path):
    r, tree, packing = big
    render_ok(plots.figure(kind, r, tree=tree, packing=packing), tmp_path, kind)


@pytest.mark.skipif(not SAMPLES, reason="no bundled samples in treepack/datasets/samples")
@pytest.mark.parametrize("sample", SAMPLES, ids=lambda p: p.name)
def test_bundled_samples_render(sample, tmp_path):
    r = read_rollouts([sample])
    tree = PrefixTree.build(r)
    cap = int(max(r.lengths.max(), 4096))
    packing = packing_for(r, cap, tree=tree)
    for kind in plots.KINDS:
        render_ok(plots.figure(kind, r, tree=tree, packing=packing, source=sample.name), tmp_path, kind)


@pytest.mark.parametrize("fmt", ["svg", "pdf"])  # every other test writes PNG
def test_vector_formats(fmt, tmp_path):
    r = rollouts_from([[1, 2, 3], [1, 2, 3], [1, 2], [1, 2, 3, 4, 5], [1, 2, 7], [9]], groups=list("aaaabb"))
    render_ok(plots.figure("tree", r, group="a"), tmp_path, "tree", fmt)


def test_save_rejects_unknown_suffix(tmp_path):
    with pytest.raises(plots.TreepackError, match=r"must end in \.png, \.svg or \.pdf"):
        plots.save(plots.figure("active", grpo(2, 2, 3, 3)), tmp_path / "x.jpg")


# --------------------------------------------------------------------------------------------------
# the numbers behind the figures


@settings(max_examples=60, deadline=None)
@given(sequence_lists(max_seqs=14, max_len=9, vocab=3))
def test_active_areas_are_n_flat_and_n_tree(seqs):
    tree = PrefixTree.build(rollouts_from(seqs))
    dense, in_tree = curves.active_by_position(tree)
    assert dense.sum() == tree.n_flat_tokens and in_tree.sum() == tree.n_tree_tokens
    assert np.all(in_tree <= dense) and np.all(in_tree[dense > 0] >= 1)
    depth = tree.token_depth()
    assert np.array_equal(in_tree, np.bincount(depth, minlength=len(dense)))


@settings(max_examples=60, deadline=None)
@given(sequence_lists(max_seqs=14, max_len=9, vocab=3))
def test_subset_trie_sizes_match_a_rebuild(seqs):
    r = rollouts_from(seqs)
    labels = np.arange(len(seqs)) % 3 - (np.arange(len(seqs)) % 5 == 4)  # three subsets, some left out (-1)
    flat, trie = curves.subset_tree_tokens(PrefixTree.build(r), labels, 3)
    for k in range(3):
        idx = np.flatnonzero(labels == k)
        sub = PrefixTree.build(r.select(idx)) if len(idx) else None
        assert flat[k] == (sub.n_flat_tokens if sub else 0)
        assert trie[k] == (sub.n_tree_tokens if sub else 0)


@pytest.mark.parametrize("strategy", ["best", "first-fit", "dfs"])
def test_pack_breakdown_matches_the_packing(strategy):
    r = grpo(40, 6, 30, 50, seed=3)
    tree = PrefixTree.build(r)
    p = pack_sequences(r, 600, strategy=strategy, tree=tree)
    tokens, first_time = curves.pack_breakdown(tree, p)
    assert np.array_equal(tokens, p.pack_tokens)
    assert first_time.sum() == tree.n_tree_tokens == p.n_tree_tokens
    assert np.all(first_time <= tokens) and np.all(first_time >= 0)
    # a pack's first-time tokens = its trie minus what earlier packs cover (checked by explicit union)
    seen = np.zeros(tree.n_tree_tokens, dtype=bool)
    offs, path = tree.paths()
    where = np.empty(tree.n_sequences, dtype=np.int64)
    where[tree.order] = np.arange(tree.n_sequences)
    for k, members in enumerate(p.packs):
        mine = np.unique(np.concatenate([path[offs[where[i]]:offs[where[i] + 1]] for i in members]))
        assert len(mine) == tokens[k] and (~seen[mine]).sum() == first_time[k]
        seen[mine] = True


def test_packs_figure_refuses_a_tree_of_other_scopes():
    r = grpo(6, 3, 10, 10)
    p = pack_sequences(r, 200, group_by="tree_id")
    with pytest.raises(plots.TreepackError, match="same group_by"):
        plots.plot_packs(PrefixTree.build(r), p)  # no tree_id scoping: shares the template across groups


def test_oversize_sequences_left_out_of_the_packs_figure():
    r = rollouts_from([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3], [1, 2, 4]])
    tree = PrefixTree.build(r)
    p = pack_sequences(r, 5, oversize="skip", tree=tree)
    tokens, first_time = curves.pack_breakdown(tree, p)
    assert tokens.tolist() == [4] and first_time.tolist() == [4]
    fig = plots.plot_packs(tree, p)
    assert "left out" in fig.axes[0].get_title(loc="left")


def test_pick_group_default_saves_most_and_by_name():
    r = rollouts_from([[1, 2, 3], [1, 2, 4], [7, 8, 9, 10, 11], [7, 8, 9, 10, 12], [7, 8, 9, 10, 13]],
                      groups=["small", "small", "big", "big", "big"])
    idx, name = curves.pick_group(r)
    assert name == "big" and idx.tolist() == [2, 3, 4]
    idx, name = curves.pick_group(r, group="small")
    assert name == "small" and idx.tolist() == [0, 1]
    with pytest.raises(InputError, match=r"--group nope: no such tree_id in the input \(2 groups: big, small\)"):
        curves.pick_group(r, group="nope")
    with pytest.raises(InputError, match="has no 'tree_id'"):
        curves.pick_group(rollouts_from([[1]]), group="x")


def test_tree_summary_bounds_the_drawing(big):
    tree = big[1]  # one forest: a shared template, 1,250 prompts, 10k responses
    for max_nodes in (40, 120, 250):
        items, children, n_rows, threshold = tree_figure._tree_items(tree, max_nodes, max(6, max_nodes // 30))
        assert len(items) <= max_nodes and n_rows <= max(24, max_nodes // 4)
        drawn = [it for it in items if it["kind"] == "node"]
        wedged = sum(len(it["members"]) for it in items if it["kind"] == "wedge")
        # every sequence is under exactly one row: a drawn leaf, or a wedge
        under = sum(it["n_seqs"] for it in items if it["kind"] == "wedge")
        leaves = [it for i, it in enumerate(items) if not children[i] and it["kind"] == "node"]
        assert under + sum(it["count"] for it in leaves) == tree.n_sequences
        assert wedged and drawn and threshold > 0
    fig = plots.plot_tree(tree, max_nodes=60)
    assert "summarised" in fig.axes[0].get_title(loc="left")


def test_small_tree_is_drawn_whole_with_labels():
    r = rollouts_from([[1, 2, 3], [1, 2, 4], [1, 2], [5]], ids=["a", "b", "c", "d"])
    fig = plots.plot_tree(PrefixTree.build(r), ids=r.ids)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["a", "b", "d"]  # c is a prefix of a and b
    assert "summarised" not in ax.get_title(loc="left")


# --------------------------------------------------------------------------------------------------
# the HTML report


VOID = {"meta", "img", "br", "hr", "link", "input", "col", "area", "base", "source", "wbr"}


class Checker(html.parser.HTMLParser):
    """Tag nesting, and every reference a browser would fetch."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack, self.errors, self.refs, self.tags = [], [], [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        for k, v in attrs:
            if k in ("src", "href", "srcset", "data", "poster", "action") or (v and "url(" in v):
                self.refs.append(v or "")
        if tag not in VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if tag in VOID:
            return
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes <{self.stack[-1] if self.stack else None}>")
        else:
            self.stack.pop()

    def handle_data(self, data):
        if "url(" in data and self.stack and self.stack[-1] == "style":
            self.refs.append(data)


def check_html(text: str) -> Checker:
    c = Checker()
    c.feed(text)
    c.close()
    assert text.startswith("<!DOCTYPE html>")
    assert not c.errors and not c.stack, (c.errors, c.stack)
    assert "http://" not in text and "https://" not in text
    for ref in c.refs:
        assert ref.startswith("data:image/png;base64,"), ref[:60]
    return c


def test_report_is_valid_and_self_contained():
    r = grpo(4, 4, 30, 40, seed=5)  # 16 sequences: the exact DP runs too
    text = build_report(r, files=["batch.jsonl"], capacity=300)
    c = check_html(text)
    assert c.tags.count("img") == 4  # active, packs, tree, hist
    for strategy in ("best", "first-fit", "dfs", "optimal"):
        assert f"<td>{strategy}</td>" in text
    assert "Packing at capacity 300" in text and "N_flat" in text and "not run" not in text


def test_report_skips_the_exact_dp_on_big_steps():
    results = compare_strategies(grpo(6, 4, 10, 10), 200)
    assert [r.strategy for r in results] == ["best", "first-fit", "dfs", "optimal"]
    assert all(r.packing is not None for r in results[:3])
    assert results[3].packing is None and results[3].error == (  # the message and limit of `stats`
        "strategy 'optimal' is an exact exponential-time DP, limited to 20 sequences per step; this input has 24 "
        "sequences in one step (no 'step' field, or one value of it) (use strategy 'best')")


# --------------------------------------------------------------------------------------------------
# CLI


@pytest.fixture
def batch(tmp_path):
    r = grpo(5, 3, 12, 20, seed=7)
    path = tmp_path / "batch.jsonl"
    path.write_text("".join(
        json.dumps({"id": r.ids[i], "tree_id": r.group_names[int(r.groups[i])], "input_ids": r.sequence(i).tolist()})
        + "\n" for i in range(len(r))))
    return path


def test_cli_plot(batch, tmp_path):
    for kind, extra in (("tree", ["--group", "q3"]), ("packs", ["--capacity", "1k", "--strategy", "dfs"])):
        out = tmp_path / f"{kind}.png"
        res = run("plot", batch, "-o", out, "--kind", kind, "--dpi", DPI, *extra)
        assert res.code == 0, res.err
        w, h = png_size(out.read_bytes())
        assert res.out == f"wrote {out} ({w} x {h} px)\n" and w == 11 * DPI


def test_cli_plot_usage_errors(batch, tmp_path):
    res = run("plot", batch, "-o", tmp_path / "x.gif")
    assert res.code == 2 and "must end in .png, .svg or .pdf" in res.err
    res = run("plot", batch, "-o", tmp_path / "x.png", "--kind", "packs")
    assert res.code == 2 and "--kind packs needs --capacity" in res.err
    res = run("plot", batch, "-o", tmp_path / "x.png", "--kind", "pie")
    assert res.code == 2 and "must be one of tree, active, packs, hist" in res.err
    res = run("plot", batch, "-o", tmp_path / "x.png", "--kind", "packs", "--capacity", "ten")
    assert res.code == 2 and "invalid capacity 'ten'" in res.err


def test_cli_plot_input_errors(batch, tmp_path):
    res = run("plot", batch, "-o", tmp_path / "x.png", "--group", "q99")
    assert res.code == 1 and res.err.startswith("Error: --group q99: no such tree_id in the input (5 groups: q0,")
    res = run("plot", batch, "-o", tmp_path / "x.png", "--kind", "packs", "--capacity", "10")
    assert res.code == 1 and "> capacity 10" in res.err



def test_cli_report(batch, tmp_path):
    out = tmp_path / "report.html"
    res = run("report", batch, "-o", out, "--no-packing", "--dpi", DPI)
    assert res.code == 0, res.err
    assert res.out.startswith(f"wrote {out} (") and res.out.endswith(" kB)\n")
    text = out.read_text()
    assert check_html(text).tags.count("img") == 3 and "Packing" not in text
    res = run("report", batch, "-o", tmp_path / "r.txt")
    assert res.code == 2 and "must end in .html" in res.err


def test_cli_plot_and_report_report_skipped_records_as_stats_does(tmp_path, monkeypatch):
    """``--on-error skip``: plot and report name the bad records they left out, in stats' very words."""
    monkeypatch.chdir(tmp_path)
    Path("bad.jsonl").write_text('{"input_ids": [1, 2, 3]}\n{"input_ids": []}\n{"input_ids": [1, "a", 3]}\n'
                                 '{"input_ids": [1, 2, 4]}\n')
    skipped = ("skipped 2 bad record(s): 1 empty sequence, 1 non-integer token\n"
               "  bad.jsonl: line 2: field 'input_ids' is empty\n"
               "  bad.jsonl: line 3: field 'input_ids'[1] is not an integer: \"a\"\n")
    stats = run("stats", "bad.jsonl", "--on-error", "skip")
    assert (stats.code, stats.err) == (0, skipped)
    res = run("plot", "bad.jsonl", "-o", "tree.png", "--on-error", "skip", "--dpi", DPI)
    w, h = png_size(Path("tree.png").read_bytes())
    assert (res.code, res.out, res.err) == (0, f"wrote tree.png ({w} x {h} px)\n", skipped)
    res = run("plot", "bad.jsonl", "-o", "tree.png", "--on-error", "skip", "-q")  # counted even when quiet
    assert (res.code, res.out, res.err) == (0, "", skipped)
    res = run("report", "bad.jsonl", "-o", "report.html", "--on-error", "skip", "--no-packing", "--dpi", DPI)
    assert (res.code, res.err) == (0, skipped) and res.out.startswith("wrote report.html (")


@pytest.mark.parametrize("command, output", [("plot", "x.png"), ("report", "x.html")])
def test_cli_dpi_is_bounded(batch, tmp_path, command, output):
    """A resolution whose pixels would exhaust memory (std::bad_alloc at --dpi 100000) is a usage error."""
    for dpi in (100000, 1201, 9):
        res = run(command, batch, "-o", tmp_path / output, "--dpi", dpi)
        assert (res.code, res.out) == (2, "")
        assert res.err.splitlines()[-1] == f"Error: Invalid value for --dpi: must be between 10 and 1200, got {dpi}"
    assert not (tmp_path / output).exists()


def test_cli_stats_plot_dir(batch, tmp_path):
    res = run("stats", batch, "--json", "--capacity", "1k", "--plot", tmp_path / "figs", "--min-por", "0.99")
    assert res.code == 1  # the gate fails, and the figures are there anyway
    assert json.loads(res.out)["gate"]["passed"] is False
    assert res.err.startswith(f"wrote 4 figures to {tmp_path / 'figs'}: tree.png, active.png, packs.png, hist.png\n")
    for name in ("tree.png", "active.png", "hist.png", "packs.png"):
        png_size((tmp_path / "figs" / name).read_bytes())


@pytest.mark.parametrize("args,flag,message", [
    (["--capacity", "64"], "--capacity", "applies to --kind packs only, not tree"),
    (["--strategy", "dfs"], "--strategy", "applies to --kind packs only, not tree"),
    (["--kind", "active", "--group", "x"], "--group", "applies to --kind tree only, not active"),
    (["--kind", "hist", "--max-nodes", "9"], "--max-nodes", "applies to --kind tree only, not hist"),
])
def test_an_option_of_another_figure_is_a_usage_error(tmp_path, args, flag, message):
    """Options that only one figure reads were ignored without a word by the others."""
    src = tmp_path / "r.jsonl"
    src.write_text('{"input_ids": [1, 2, 3]}\n{"input_ids": [1, 2, 4]}\n')
    r = run("plot", src, "-o", tmp_path / "x.png", *args)
    assert r.code == 2 and flag in r.err and message in r.err
    assert not (tmp_path / "x.png").exists()
