"""Figures of a rollout batch: the prefix tree, active sequences by position, pack fill, histograms.

One function per figure kind, each returning a matplotlib ``Figure`` built from the PrefixTree's arrays:
- ``plot_tree``: one group's compressed trie as a dendrogram whose x axis is the token position, so a
  node's bar is exactly as wide as its token count and the figure shares its x axis with ``plot_active``;
  colour = sequences sharing the node, ticks = where sequences end, right-hand labels = sample ids;
- ``plot_active``: active sequences by position, dense baseline (dashed) vs tree (solid), as in Tree
  Training's Figure 5; the two areas are N_flat and N_tree exactly, so their ratio is C;
- ``plot_packs``: tokens per pack against the capacity, split into first-time trie tokens and prefix
  tokens that an earlier pack already computed (the gap between POR and ERR, pack by pack);
- ``plot_hist``: sequence lengths, branching factors, branch-point positions and per-group C.
``figure`` dispatches on the kind name, ``write_figures`` writes the standard set, ``save`` writes a file.

Design and trade-offs:
- Figures are built with ``matplotlib.figure.Figure``, never ``pyplot``: no global figure registry to
  leak, no GUI backend to pick, so everything renders headless (Agg for PNG, the SVG and PDF backends
  for those) and figures are garbage-collected like any object. Sizes are fixed (no tight bbox), so a
  figure of W x H inches at D dpi is exactly W*D x H*D pixels; constrained layout removes wasted space.
- No figure walks tokens in Python. Per-position curves are two ``bincount``s (O(n + max length)); pack
  and group sub-trie sizes use sum L_i - sum LCP(consecutive members in DFS order), each LCP a
  range-minimum over the adjacent-LCP array (a sparse table: O(n log n) build, O(1) a query); a pack's
  first-time tokens are node lengths attributed to the earliest pack among the node's sequences (also a
  range minimum). On 10k sequences (0.5M tokens, 11k nodes) all of that takes < 20 ms; matplotlib's
  layout and rasterisation dominate, 0.3-1 s of CPU a figure.
- The tree is laid out from its DFS preorder arrays (leaves take consecutive rows, a parent sits midway
  between its first and last child) instead of a networkx/graphviz layout: that keeps the token axis
  (a hierarchical graph layout would spend the x axis on depth in nodes, not tokens), needs no graphviz,
  and is O(V). Up to ``max_nodes`` (250) compressed nodes the whole tree is drawn. Above, it is
  summarised: a node is drawn only if its subtree holds at least T tokens and it is among the K largest
  children of its parent (K = 8 at 250), all its other children collapse into one hatched wedge reaching
  their longest sequence, and T is the smallest threshold that keeps nodes + wedges <= ``max_nodes`` and
  rows <= ``max_nodes // 4`` (binary search, each probe vectorised over all V nodes). The cap on
  children keeps a batch-wide template with a thousand prompts under it from becoming a thousand rows;
  the row cap keeps row height >= 0.1 in, where 7 pt labels still fit. The subtitle says what was cut.
"""

from __future__ import annotations

import functools
import io
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib
import numpy as np
from matplotlib.cm import ScalarMappable
from matplotlib.collections import LineCollection, PolyCollection
from matplotlib.colors import BoundaryNorm, LinearSegmentedColormap, LogNorm
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

from treepack.errors import InputError, TreepackError
from treepack.rollouts import Rollouts
from treepack.tree import PrefixTree

if TYPE_CHECKING:  # packing is optional for every figure but ``packs``
    from treepack.packing import Packing

from treepack.figure_options import DEFAULT_DPI, FORMATS, KINDS, MAX_TREE_NODES

MAX_TREE_LABELS = 64

TREE_COLOR = "#2166ac"  # tree / first-time tokens, in every figure
DENSE_COLOR = "#6b6b6b"  # dense baseline
DUP_COLOR = "#f4a261"  # prefix tokens recomputed by a later pack
CAP_COLOR = "#b2182b"  # capacity line
# count colormap: light yellow-green for an unshared node (1 sequence) to dark blue for the trunk
SHARE_CMAP = LinearSegmentedColormap.from_list("treepack_share", ["#d9ef8b", "#66bd63", "#1a9850", "#2166ac", "#053061"])

STYLE = {
    "font.size": 10,
    "axes.titlesize": 10,
    "axes.titleweight": "normal",
    "axes.labelsize": 10,
    "xtick.labelsize": 9,
    "ytick.labelsize": 9,
    "legend.fontsize": 9,
    "legend.title_fontsize": 9,
    "figure.titlesize": 13,
    "figure.titleweight": "bold",
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": False,
    "grid.color": "#e5e5e5",
    "grid.linewidth": 0.8,
}


# --------------------------------------------------------------------------------------------------
# Numbers behind the figures (vectorised, no matplotlib)


class RangeMin:
    """Minimum of ``a[lo:hi]`` for many (lo, hi) pairs at once: a sparse table, O(n log n) build, O(1) a query."""

    def __init__(self, a: np.ndarray):
        a = np.asarray(a)
        self.levels = [a]  # levels[j][i] = min(a[i : i + 2**j])
        k = 1
        while 2 * k <= len(a):
            prev = self.levels[-1]
            self.levels.append(np.minimum(prev[:-k], prev[k:]))
            k *= 2

    def __call__(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        lo = np.asarray(lo, dtype=np.int64)
        hi = np.asarray(hi, dtype=np.int64)
        out = np.empty(len(lo), dtype=self.levels[0].dtype)
        if not len(lo):
            return out
        if np.any(hi <= lo):
            raise ValueError("RangeMin needs non-empty ranges (hi > lo)")
        j = np.frexp((hi - lo).astype(np.float64))[1] - 1  # floor(log2(length)), exact for ints < 2**53
        for level in np.unique(j).tolist():
            m = j == level
            t = self.levels[level]
            out[m] = np.minimum(t[lo[m]], t[hi[m] - (1 << level)])
        return out


def subset_tree_tokens(tree: PrefixTree, labels: np.ndarray, n_labels: int) -> tuple[np.ndarray, np.ndarray]:
    """(N_flat, N_tree) of the trie of each subset of sequences; ``labels[i]`` is input sequence i's subset.

    Negative labels belong to no subset. Sharing follows the tree's scopes (the adjacent LCP is 0 at a
    scope start), so a subset spanning scopes gets one trie per scope, as ``PrefixTree.build`` would.
    """
    lab = np.asarray(labels, dtype=np.int64)[tree.order]  # label of each sorted position
    inside = np.flatnonzero(lab >= 0)
    flat = np.bincount(lab[inside], weights=tree.lengths[inside], minlength=n_labels)
    perm = inside[np.argsort(lab[inside], kind="stable")]  # grouped by label, DFS order inside a group
    lp = lab[perm]
    same = lp[1:] == lp[:-1]
    a, b = perm[:-1][same], perm[1:][same]
    shared = np.zeros(0, dtype=np.int64)
    if len(a):
        shared = RangeMin(tree.lcp.astype(np.int32, copy=False))(a + 1, b + 1).astype(np.int64)
    trie = flat - np.bincount(lp[1:][same], weights=shared, minlength=n_labels)
    return flat.astype(np.int64), np.rint(trie).astype(np.int64)


def active_by_position(tree: PrefixTree) -> tuple[np.ndarray, np.ndarray]:
    """(dense [P], tree [P]): sequences longer than p, and trie tokens at depth p, for p < max length.

    ``dense.sum() == N_flat`` and ``tree.sum() == N_tree``: each curve's area is what its method computes.
    """
    P = int(tree.lengths.max(initial=0))
    if P == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    ends = np.bincount(tree.lengths, minlength=P + 1)
    dense = tree.n_sequences - np.cumsum(ends)[:P]
    starts = np.bincount(tree.lcp, minlength=P + 1)
    in_tree = np.cumsum(starts - ends)[:P]  # sequence i adds the trie tokens at depths [lcp_i, L_i)
    return dense.astype(np.int64), in_tree.astype(np.int64)


def pack_breakdown(tree: PrefixTree, packing: Packing) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [n_packs], first_time [n_packs]) of each pack, in the packing's order.

    ``tokens[p]`` is the size of pack p's sub-trie; ``first_time[p]`` counts its trie tokens that no earlier
    pack holds, so ``tokens - first_time`` are prefix tokens recomputed because the tree was split and
    ``sum(first_time)`` is N_tree of the packed sequences. ``tree`` must share the packing's scopes.
    """
    n_packs = len(packing.packs)
    pack_of = np.full(tree.n_sequences, -1, dtype=np.int64)
    for p, members in enumerate(packing.packs):
        pack_of[np.asarray(members, dtype=np.int64)] = p
    _, tokens = subset_tree_tokens(tree, pack_of, n_packs)
    # the earliest pack among a node's sequences computes it first; unpacked sequences never do
    first_pack = np.where(pack_of < 0, n_packs, pack_of)[tree.order].astype(np.int32)
    ends = tree.seq_end_token
    lo = np.searchsorted(ends, tree.node_start, side="left")
    hi = np.searchsorted(ends, tree.node_end, side="left")
    first = RangeMin(first_pack)(lo, hi)
    first_time = np.bincount(first, weights=tree.node_len, minlength=n_packs + 1)[:n_packs]
    return tokens, np.rint(first_time).astype(np.int64)


def pick_group(rollouts: Rollouts, tree: PrefixTree | None = None, group: str | None = None) -> tuple[np.ndarray, str]:
    """(input indices, label) of the group to draw: ``group`` by tree_id, else the one saving most tokens.

    Without a tree_id field the whole batch is one group. ``tree`` (any scopes) saves a rebuild when the
    caller already has it.
    """
    if rollouts.groups is None:
        if group is not None:
            raise InputError(f"--group {group}: the input has no 'tree_id' or 'group_id' field")
        return np.arange(len(rollouts), dtype=np.int64), "all sequences"
    names = [str(g) for g in rollouts.group_names]
    if group is not None:
        try:
            code = names.index(str(group))
        except ValueError:
            shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
            raise InputError(f"--group {group}: no such tree_id in the input ({len(names)} groups: {shown})") from None
    else:
        tree = tree if tree is not None else PrefixTree.build(rollouts)
        flat, trie = subset_tree_tokens(tree, rollouts.groups, len(names))
        code = int(np.argmax(flat - trie))  # first group on a tie
    return np.flatnonzero(rollouts.groups == code), names[code]


# --------------------------------------------------------------------------------------------------
# Shared helpers


def _fig(width: float, height: float) -> Figure:
    return Figure(figsize=(width, height), layout="constrained")


def _tokens(n: float) -> str:
    """6664848 -> '6.66M', 737191 -> '737k', 512 -> '512'."""
    n = float(n)
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            v = n / scale
            return f"{v:.3g}{suffix}" if v < 1000 else f"{v:,.0f}{suffix}"
    return f"{n:,.0f}" if n == int(n) else f"{n:.3g}"


def _n(count: int, noun: str) -> str:
    """'1 sequence', '2,048 sequences'."""
    return f"{count:,} {noun}" + ("" if count == 1 else "s")


def _share(x: float) -> str:
    """0.2341 -> '23.4%', 0.000107 -> '0.011%': small shares keep two significant digits."""
    return f"{x:.1%}" if x >= 0.01 or x == 0 else f"{x * 100:.2g}%"


def _duration(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"


def _counts(nbins: int, **kw) -> MaxNLocator:
    """Integer ticks at 1, 2, 2.5 or 5 times a power of ten (100, 200, ... rather than 80, 160, ...)."""
    return MaxNLocator(nbins=nbins, integer=True, steps=[1, 2, 2.5, 5, 10], **kw)


_TICKS = FuncFormatter(lambda x, _pos: _tokens(x) if x == int(x) else f"{x:g}")


def _style(fn):
    """Build a figure under the house style (font sizes, spines) without touching the global rcParams."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with matplotlib.rc_context(STYLE):
            return fn(*args, **kwargs)

    return wrapper


def _headline(tree: PrefixTree) -> str:
    return (
        f"{_n(tree.n_sequences, 'sequence')} · N_flat {tree.n_flat_tokens:,} · N_tree {tree.n_tree_tokens:,} · "
        f"C = {tree.n_flat_tokens / max(tree.n_tree_tokens, 1):.2f}"
    )


def _suptitle(fig: Figure, title: str, source: str | None) -> None:
    """Bold left-aligned title naming the input (unless the title already names it, as group ids often do)."""
    named = bool(source) and " + " not in source and source.split(".")[0] in title
    fig.suptitle(title + (f" — {source}" if source and not named else ""), x=0.01, ha="left")


# --------------------------------------------------------------------------------------------------
# tree


def _summarise(tree: PrefixTree, max_nodes: int, max_children: int):
    """(kept [V] bool, threshold): which nodes to draw so that nodes + wedges <= max_nodes, in at most
    max(24, max_nodes // 4) rows (leaves + wedges: beyond that a summary stops being readable).

    Node v is drawn iff its subtree holds at least ``threshold`` tokens, it is among the ``max_children``
    largest children of its parent (roots: of the forest), and the same holds for every ancestor. The
    other children of a drawn node collapse into one wedge, so a node with a thousand small children
    (a batch-wide template prefix) costs two items, not a thousand. The smallest threshold that fits is
    found by binary search; each probe is O(V) numpy (ancestors via DFS-interval prefix sums).
    """
    V = tree.n_nodes
    size = tree.node_end - tree.node_start
    parent = tree.node_parent
    has_parent = parent >= 0
    if V <= max_nodes:
        return np.ones(V, dtype=bool), 0
    max_rows = max(24, max_nodes // 4)
    is_leaf = tree.node_children == 0
    by_sibling = np.lexsort((np.arange(V), -size, parent))  # per parent, largest subtree first
    p_sorted = parent[by_sibling]
    first = np.r_[0, np.flatnonzero(p_sorted[1:] != p_sorted[:-1]) + 1]
    rank = np.empty(V, dtype=np.int64)
    rank[by_sibling] = np.arange(V) - np.repeat(first, np.diff(np.r_[first, V]))
    sub_end = np.searchsorted(tree.node_start, tree.node_end, side="left")  # v's subtree: nodes [v, sub_end[v])

    def probe(threshold: int):
        eligible = (size >= threshold) & (rank < max_children)
        bad = np.flatnonzero(~eligible)
        diff = np.zeros(V + 1, dtype=np.int64)
        np.add.at(diff, bad + 1, 1)
        np.add.at(diff, sub_end[bad], -1)
        kept = eligible & (np.cumsum(diff)[:V] == 0)  # no ineligible ancestor
        parent_kept = np.ones(V, dtype=bool)
        parent_kept[has_parent] = kept[parent[has_parent]]
        wedges = len(np.unique(parent[~kept & parent_kept]))
        fits = kept.sum() + wedges <= max_nodes and (kept & is_leaf).sum() + wedges <= max_rows
        return bool(fits), kept

    sizes = np.unique(size)
    lo, hi = 0, len(sizes)  # smallest sizes[i] that fits; len(sizes) = collapse everything into one wedge
    while lo < hi:
        mid = (lo + hi) // 2
        if probe(int(sizes[mid]))[0]:
            hi = mid
        else:
            lo = mid + 1
    while lo < len(sizes) and not probe(int(sizes[lo]))[0]:  # guard: the counts are not strictly monotone
        lo += 1
    threshold = int(sizes[lo]) if lo < len(sizes) else int(sizes[-1]) + 1
    return probe(threshold)[1], threshold


def _tree_items(tree: PrefixTree, max_nodes: int, max_children: int):
    """Drawable items in layout order (drawn nodes and collapse wedges), with rows, x extents and children."""
    kept, threshold = _summarise(tree, max_nodes, max_children)
    V = tree.n_nodes
    parent = tree.node_parent
    has_parent = parent >= 0
    parent_kept = np.ones(V, dtype=bool)
    parent_kept[has_parent] = kept[parent[has_parent]]
    collapsed = np.flatnonzero(~kept & parent_kept)
    sub_end = np.searchsorted(tree.node_start, tree.node_end, side="left")
    items = []
    for v in np.flatnonzero(kept).tolist():
        items.append({"key": (float(v), 0), "kind": "node", "node": v, "parent_node": int(parent[v]),
                      "x0": int(tree.node_depth[v]), "x1": int(tree.node_depth[v] + tree.node_len[v]),
                      "count": int(tree.node_count[v])})
    if len(collapsed):
        ends = tree.seq_end_token
        lo = np.searchsorted(ends, tree.node_start[collapsed], side="left")
        hi = np.searchsorted(ends, tree.node_end[collapsed], side="left")
        deepest = -RangeMin(-tree.lengths)(lo, hi)  # longest sequence under each collapsed node
        groups = parent[collapsed]
        for p in np.unique(groups).tolist():
            m = groups == p
            members = collapsed[m]
            # after every drawn descendant of p; a deeper parent's wedge first when two end together
            key = (float(sub_end[p]) - 0.5, -int(tree.node_depth[p])) if p >= 0 else (V - 0.5, 1)
            items.append({"key": key, "kind": "wedge", "members": members, "parent_node": p,
                          "x0": int(tree.node_depth[members[0]]), "x1": int(deepest[m].max()),
                          "count": int(tree.node_count[members].max()),
                          "n_seqs": int(tree.node_count[members].sum())})
    items.sort(key=lambda it: it["key"])
    index_of_node = {it["node"]: i for i, it in enumerate(items) if it["kind"] == "node"}
    children: list[list[int]] = [[] for _ in items]
    for i, it in enumerate(items):
        p = it["parent_node"]
        it["parent"] = index_of_node[p] if p >= 0 else -1
        if p >= 0:
            children[it["parent"]].append(i)
    row = 0
    for i, it in enumerate(items):  # layout order: a subtree's rows are consecutive
        if not children[i]:
            it["y"] = float(row)
            row += 1
    for i in range(len(items) - 1, -1, -1):
        if children[i]:
            items[i]["y"] = (items[children[i][0]]["y"] + items[children[i][-1]]["y"]) / 2
    return items, children, row, threshold


def _leaf_label(tree: PrefixTree, it: dict, ids: Sequence | None) -> str:
    """A leaf's sample id (and how many equal sequences end with it); a wedge's contents."""
    if it["kind"] == "wedge":
        k, n = len(it["members"]), it["n_seqs"]
        return f"{k:,} subtree{'s' * (k > 1)} · {n:,} seq{'s' * (n > 1)}"
    v = it["node"]
    ends = tree.seq_end_token
    last = tree.node_start[v] + tree.node_len[v] - 1
    i = int(np.searchsorted(ends, last, side="left"))
    j = int(np.searchsorted(ends, last, side="right"))
    first_id = tree.order[i] if ids is None else ids[int(tree.order[i])]
    text = _middle_ellipsis(str(first_id), 34)
    return text + (f"  (×{j - i})" if j - i > 1 else "")


def _middle_ellipsis(text: str, width: int) -> str:
    """Shorten keeping both ends: sample ids tend to differ at the end ('r.0.0.1.0.0.0.1.0')."""
    if len(text) <= width:
        return text
    head = (width - 1) // 2
    return text[:head] + "…" + text[len(text) - (width - 1 - head):]


_SEPARATORS = ":/_-. |#"


def _strip_common(names: Sequence[str]) -> tuple[list[str], str, str]:
    """(short names, prefix, suffix): drop the prefix and suffix all names share, cut at separators, so
    'toolbench_dfs:G1_answer__10_ChatGPT_DFS_woFilter_w2' becomes 'G1_answer__10'."""
    if len(names) < 2:
        return list(names), "", ""
    lo, hi = min(names), max(names)
    p = 0
    while p < min(len(lo), len(hi)) and lo[p] == hi[p]:
        p += 1
    while p > 0 and lo[p - 1] not in _SEPARATORS:  # only cut right after a separator
        p -= 1
    rev = [n[p:][::-1] for n in names]
    lo, hi = min(rev), max(rev)
    q = 0
    while q < min(len(lo), len(hi)) and lo[q] == hi[q]:
        q += 1
    while q > 0 and lo[q - 1] not in _SEPARATORS:
        q -= 1
    if any(len(n) - p - q <= 0 for n in names):  # a name would vanish: keep the suffix
        q = 0
    short = [n[p:len(n) - q] for n in names]
    return short, names[0][:p], names[0][len(names[0]) - q:] if q else ""


def _count_norm(c_max: int):
    """Discrete colours for up to 12 sharing sequences, a log scale above."""
    if c_max <= 12:
        return BoundaryNorm(np.arange(0.5, c_max + 1.5), SHARE_CMAP.N)
    return LogNorm(vmin=1, vmax=c_max)


@_style
def plot_tree(
    tree: PrefixTree,
    *,
    ids: Sequence | None = None,
    name: str | None = None,
    source: str | None = None,
    max_nodes: int = MAX_TREE_NODES,
    max_labels: int = MAX_TREE_LABELS,
    max_children: int | None = None,
) -> Figure:
    """One prefix tree (or forest) as a dendrogram over token positions.

    ``tree`` should hold one group (see ``pick_group``); ``ids`` are sample ids in the tree's input order
    (right-hand labels, shown when there are at most ``max_labels`` rows). Above ``max_nodes`` compressed
    nodes the tree is summarised (see ``_summarise``; ``max_children`` defaults to max(6, max_nodes // 30))
    and the subtitle says how.
    """
    if max_nodes < 2:
        raise TreepackError(f"max_nodes must be at least 2, got {max_nodes}")
    max_children = max_children or max(6, max_nodes // 30)
    items, children, n_rows, threshold = _tree_items(tree, max_nodes, max_children)
    nodes = [it for it in items if it["kind"] == "node"]
    wedges = [it for it in items if it["kind"] == "wedge"]
    labelled = n_rows <= max_labels
    row_in = float(np.clip(7.0 / max(n_rows, 1), 0.085, 0.3))
    height = float(np.clip(n_rows * row_in + 2.1, 3.0, 26.0))
    pad_rows = max(0.0, ((height - 2.1) / row_in - n_rows) / 2)  # a short tree keeps thin bars, centred
    fig = _fig(11.0, height)
    ax = fig.add_subplot()
    x_max = max(int(tree.lengths.max()), 1)
    norm = _count_norm(max(it["count"] for it in items))

    bar_h = 0.66
    if nodes:
        ax.barh([it["y"] for it in nodes], [it["x1"] - it["x0"] for it in nodes], left=[it["x0"] for it in nodes],
                height=bar_h, color=SHARE_CMAP(norm([it["count"] for it in nodes])),
                edgecolor="white" if n_rows > 60 else "#404040", linewidth=0.3, zorder=2)
    if wedges:
        polys = [[(it["x0"], it["y"]), (it["x1"], it["y"] - bar_h / 2), (it["x1"], it["y"] + bar_h / 2)] for it in wedges]
        ax.add_collection(PolyCollection(polys, facecolors=SHARE_CMAP(norm([it["count"] for it in wedges])),
                                         edgecolors="#8c8c8c", linewidths=0.6, hatch="////", alpha=0.4, zorder=2))
    # elbow connectors: a child starts where its parent ends, so one vertical segment per child
    segs = [[(items[c]["x0"], it["y"]), (items[c]["x0"], items[c]["y"])]
            for i, it in enumerate(items) for c in children[i] if items[c]["y"] != it["y"]]
    if segs:
        ax.add_collection(LineCollection(segs, colors="#8c8c8c", linewidths=0.8, zorder=1))
    # where sequences end: a leaf always, an internal node when a sequence is a prefix of another
    ending = np.asarray(tree.node_count).copy()
    has_parent = tree.node_parent >= 0
    np.subtract.at(ending, tree.node_parent[has_parent], tree.node_count[has_parent])
    marks = [(it["x1"], it["y"]) for it in nodes if ending[it["node"]] > 0]
    if marks:
        mx, my = zip(*marks)
        ax.scatter(mx, my, marker="|", s=(row_in * 72 * 0.95) ** 2, c="#111111", linewidths=1.1, zorder=3)

    ax.set_xlim(0, x_max * 1.005)
    ax.set_ylim(n_rows - 0.5 + pad_rows, -0.5 - pad_rows)
    ax.xaxis.set_major_locator(_counts(10))
    ax.xaxis.set_major_formatter(_TICKS)
    ax.set_xlabel("position in sequence (tokens)")
    ax.spines["left"].set_visible(False)
    ax.grid(axis="x", zorder=0)
    ax.set_axisbelow(True)
    rows = [it for i, it in enumerate(items) if not children[i]]
    if labelled:
        ax.yaxis.tick_right()
        ax.set_yticks([it["y"] for it in rows], [_leaf_label(tree, it, ids) for it in rows],
                      fontsize=8 if n_rows <= 40 else 7)
        ax.tick_params(axis="y", length=0, pad=4)
        ax.hlines([it["y"] for it in rows], [it["x1"] for it in rows], x_max * 1.005,
                  colors="#c8c8c8", linestyles=(0, (1, 2)), linewidth=0.8, zorder=1)
    else:
        ax.set_yticks([])
    noun = ("leaf" if n_rows == 1 else "leaves") if not wedges else "leaves and collapsed subtrees"
    ax.set_ylabel(f"{n_rows:,} {noun} (DFS order)")

    cbar = fig.colorbar(ScalarMappable(norm=norm, cmap=SHARE_CMAP), ax=ax, pad=0.01,
                        shrink=min(1.0, 3.2 / height) if height > 4 else 0.9, aspect=18)
    cbar.set_label("sequences sharing the node")
    if isinstance(norm, BoundaryNorm):
        c_max = round(float(norm.boundaries[-1]) - 0.5)
        cbar.set_ticks(np.arange(1, c_max + 1, max(1, c_max // 6)))
    else:
        cbar.ax.yaxis.set_major_formatter(_TICKS)
        cbar.ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _p: _tokens(v) if f"{v:.0f}"[0] in "25" else ""))
    cbar.outline.set_visible(False)

    handles = [Line2D([], [], marker="|", linestyle="none", color="#111111", markersize=9, label="a sequence ends here")]
    if wedges:
        handles.append(Patch(facecolor="#bbbbbb", edgecolor="#555555", hatch="////",
                             label="collapsed subtrees (reaching their longest sequence)"))
    fig.legend(handles=handles, loc="outside lower right", ncols=len(handles), frameon=False)

    _suptitle(fig, f"Prefix tree of {name}" if name else "Prefix tree", source)
    sub = _headline(tree) + f" · {tree.n_nodes:,} nodes"
    if wedges:
        rules = [f"all but the {max_children} largest children of a node"]
        if threshold > int((tree.node_end - tree.node_start).min()):
            rules.insert(0, f"subtrees under {threshold:,} tokens")
        note = (f"summarised: {len(nodes):,} of {tree.n_nodes:,} nodes drawn; {' and '.join(rules)} collapsed "
                f"into {len(wedges):,} hatched wedge{'s' * (len(wedges) > 1)} (a larger max_nodes, --max-nodes, shows more)")
        sub += "\n" + textwrap.fill(note, 150)
    ax.set_title(sub, loc="left", color="#333333")
    return fig


# --------------------------------------------------------------------------------------------------
# active


def _active_x_end(dense: np.ndarray, n_flat: int, tail_share: float = 0.002) -> int:
    """Where the x axis of the active figure ends: at the longest sequence, unless the positions after the
    point holding all but ``tail_share`` of N_flat span over 40% of the axis (a few outliers would squeeze
    the curves into the left half); then 5% past that point."""
    P = len(dense)
    if P == 0:
        return 0
    tail = np.cumsum(dense[::-1])[::-1]  # tail[p] = tokens at positions >= p
    cut = int(np.argmax(tail <= tail_share * n_flat)) if tail[-1] <= tail_share * n_flat else P
    end = min(P, int(np.ceil(cut * 1.05)) + 1)
    return end if end < 0.6 * P else P


def _step_area(ax, values: np.ndarray, *, color: str, fill_alpha: float, label: str | None = None, **line) -> None:
    """Draw ``values[p]`` as a step over [p, p + 1) with a filled area under it.

    Only the change points are emitted (plateaus are long: a 100k-position curve has a few thousand),
    and the artists are a Line2D and a PolyCollection: ``Axes.stairs`` would build a StepPatch whose
    data-limit update walks every vertex in Python (seconds for 10k positions).
    """
    P = len(values)
    if P == 0:
        return
    change = np.flatnonzero(np.diff(values)) + 1
    x = np.r_[0, change, P].astype(np.float64)
    y = np.r_[values[0], values[change], values[-1]].astype(np.float64)
    if fill_alpha:
        ax.fill_between(x, y, step="post", color=color, alpha=fill_alpha, linewidth=0)
    ax.plot(x, y, drawstyle="steps-post", color=color, label=label, **line)


@_style
def plot_active(tree: PrefixTree, *, source: str | None = None, scope: str | None = None) -> Figure:
    """Active sequences by position: dense baseline (dashed, area N_flat) vs tree (solid, area N_tree).

    A lower panel shows their ratio at each position (log scale): how many sequences share each computed
    token there. C is its average weighted by the tree curve, drawn as a dotted line.
    """
    dense, in_tree = active_by_position(tree)
    P = len(dense)
    fig = _fig(11.0, 6.6)
    ax, ax_r = fig.subplots(2, 1, sharex=True, height_ratios=[3.0, 1.25])
    n_flat, n_tree = tree.n_flat_tokens, tree.n_tree_tokens
    c = n_flat / max(n_tree, 1)
    _step_area(ax, dense, color=DENSE_COLOR, fill_alpha=0.12, linestyle=(0, (5, 3)), linewidth=1.6,
               label=f"dense baseline: area = N_flat = {_n(n_flat, 'token')}")
    _step_area(ax, in_tree, color=TREE_COLOR, fill_alpha=0.30, linewidth=1.8,
               label=f"tree: area = N_tree = {_n(n_tree, 'token')}")
    x_end = _active_x_end(dense, n_flat)
    ax.set_xlim(0, max(x_end, 1))
    top = max(int(dense.max(initial=0)), 1)
    right = dense[int(x_end * 0.55):x_end]
    crowded = len(right) and right.mean() > 0.55 * top  # the legend's corner is under the curve: make room
    ax.set_ylim(0, top * (1.5 if crowded else 1.12))
    ax.yaxis.set_major_locator(_counts(8))
    ax.yaxis.set_major_formatter(_TICKS)
    ax.set_ylabel("active sequences\n(tokens computed at this position)")
    ax.grid(axis="y")
    ax.set_axisbelow(True)
    ax.legend(loc="upper right", title=f"C = N_flat / N_tree = {c:.2f}   (POR {1 - 1 / c if c else 0:.3f})",
              alignment="left", framealpha=0.95)

    ratio = dense / np.maximum(in_tree, 1)  # the tree has >= 1 token wherever a sequence is still active
    _step_area(ax_r, ratio, color=TREE_COLOR, fill_alpha=0.0, linewidth=1.4)
    ax_r.axhline(c, color="#222222", linestyle=(0, (1, 2)), linewidth=1.2, label=f"C = {c:.2f} (tree-weighted mean)")
    ax_r.set_yscale("log")
    ax_r.set_ylim(0.8, max(float(ratio.max(initial=1.0)) * 1.6, 2.0))
    ax_r.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0) if ratio.max(initial=1) < 100 else (1.0,)))
    ax_r.yaxis.set_minor_formatter(NullFormatter())
    ax_r.yaxis.set_major_formatter(FuncFormatter(lambda v, _p: f"{_tokens(v)}×"))
    ax_r.set_ylabel("sharing\n(dense / tree)")
    ax_r.set_xlabel("position in sequence (tokens)")
    ax_r.xaxis.set_major_locator(_counts(10))
    ax_r.xaxis.set_major_formatter(_TICKS)
    ax_r.grid(axis="y", which="major")
    ax_r.set_axisbelow(True)
    ax_r.legend(loc="best", framealpha=0.95)
    _suptitle(fig, "Active sequences by position", source)
    sub = _headline(tree) + (f" · sharing scope: {scope}" if scope else "")
    if x_end < P:
        beyond = int(dense[x_end])
        sub += (f"\nx axis ends at {x_end:,}: the {_n(beyond, 'longer sequence')} beyond it (up to {P:,} tokens) hold "
                f"{dense[x_end:].sum() / max(n_flat, 1):.2%} of N_flat")
    ax.set_title(sub, loc="left", color="#333333")
    return fig


# --------------------------------------------------------------------------------------------------
# packs


@_style
def plot_packs(tree: PrefixTree, packing: Packing, *, source: str | None = None) -> Figure:
    """Tokens per pack against the capacity; prefix tokens an earlier pack already computed stacked on top."""
    tokens, first_time = pack_breakdown(tree, packing)
    if packing.n_pack_tokens != int(tokens.sum()):
        raise TreepackError(
            f"pack sub-trie sizes ({int(tokens.sum()):,} tokens) disagree with the packing's N_pack "
            f"({packing.n_pack_tokens:,}): build the tree with the same group_by as the packing"
        )
    dup = tokens - first_time
    n = len(tokens)
    cap = packing.capacity
    fig = _fig(11.0, 5.2)
    ax = fig.add_subplot()
    x = np.arange(n)
    if n <= 200:
        kw = {"width": 0.8 if n <= 60 else 1.0, "linewidth": 0}
        ax.bar(x, first_time, color=TREE_COLOR, label="first-time tree tokens", **kw)
        ax.bar(x, dup, bottom=first_time, color=DUP_COLOR, label="duplicated prefix tokens (an earlier pack has them)", **kw)
        ax.set_xlim(-0.6, n - 0.4)
    else:  # thousands of bars: two filled step curves draw the same picture in two artists
        x_e = np.repeat(np.arange(n + 1) - 0.5, 2)[1:-1]  # each pack a flat top over [p - .5, p + .5]
        ax.fill_between(x_e, np.repeat(first_time, 2), color=TREE_COLOR, linewidth=0, label="first-time tree tokens")
        ax.fill_between(x_e, np.repeat(first_time, 2), np.repeat(tokens, 2), color=DUP_COLOR, linewidth=0,
                        label="duplicated prefix tokens (an earlier pack has them)")
        ax.set_xlim(-0.5, n - 0.5)
    ax.axhline(cap, color=CAP_COLOR, linestyle=(0, (6, 3)), linewidth=1.4, label=f"capacity {cap:,} tokens")
    ax.set_ylim(0, cap * 1.18)
    if n <= 12:
        ax.set_xticks(x)
    else:
        ax.xaxis.set_major_locator(_counts(12))
    ax.yaxis.set_major_locator(_counts(8))
    ax.yaxis.set_major_formatter(_TICKS)
    ax.set_xlabel("pack (in packing order)")
    ax.set_ylabel("tokens per pack")
    ax.grid(axis="y")
    ax.set_axisbelow(True)
    ax.legend(loc="upper right", ncols=3, framealpha=0.95)
    _suptitle(fig, f"Pack fill — {packing.strategy}, capacity {cap:,}: ERR {packing.err:.3f} vs POR {packing.por:.3f}",
              source)
    fill = tokens.sum() / max(n * cap, 1)
    ax.set_title(
        f"{_n(n, 'pack')} · N_pack {int(tokens.sum()):,} · mean fill {fill:.1%} of capacity · duplicated prefix tokens "
        f"{int(dup.sum()):,} ({_share(dup.sum() / max(tokens.sum(), 1))} of N_pack) · packing took {_duration(packing.seconds)}"
        + (f"\n{packing.n_oversize_skipped:,} sequences longer than the capacity were left out (oversize skip)"
           if packing.n_oversize_skipped else ""),
        loc="left", color="#333333",
    )
    return fig


# --------------------------------------------------------------------------------------------------
# hist


def _int_bars(ax, values: np.ndarray, color: str) -> None:
    """Bar per integer value when few distinct values, else log-spaced bins on a log x axis."""
    vmax = int(values.max())
    if vmax <= 40:
        counts = np.bincount(values, minlength=vmax + 1)
        ks = np.flatnonzero(counts)
        ax.bar(ks, counts[ks], width=0.8, color=color)
        ax.set_xlim(ks.min() - 0.6, vmax + 0.6)
        ax.xaxis.set_major_locator(_counts(12))
    else:
        bins = np.unique(np.round(np.geomspace(1, vmax + 1, 30))) - 0.5  # integer k falls in [k - .5, k + .5)
        ax.hist(values, bins=bins, color=color)
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(_TICKS)


def _value_hist(ax, values: np.ndarray, color: str, *, integer: bool = True) -> None:
    """Histogram with ~2 sqrt(n) bins (8-50), log-spaced on a log x axis when the values span over 30x;
    integer data with few distinct values gets one bar per integer."""
    lo, hi = float(values.min()), float(values.max())
    n_bins = int(np.clip(2 * np.sqrt(len(values)), 8, 50))
    if lo > 0 and hi / lo > 30:
        edges = np.geomspace(lo, hi * 1.0001, n_bins + 1)
        if integer:  # no bin narrower than one integer, none straddling one: no comb of empty slivers
            edges = np.unique(np.round(edges)) - 0.5
            edges = np.r_[edges, hi + 0.5] if edges[-1] < hi + 0.5 else edges
        ax.hist(values, bins=edges, color=color)
        ax.set_xscale("log")
    elif hi == lo:
        half = 0.5 if integer else max(abs(lo) * 0.05, 0.05)
        ax.hist(values, bins=1, range=(lo - half, hi + half), color=color)
    elif integer and hi - lo + 1 <= n_bins:
        ax.hist(values, bins=np.arange(lo - 0.5, hi + 1.5), color=color)
    else:
        ax.hist(values, bins=n_bins, color=color)
    if integer and ax.get_xscale() == "linear":
        ax.xaxis.set_major_locator(_counts(8, min_n_ticks=1))
    ax.xaxis.set_major_formatter(_TICKS)


def _log_counts_if_skewed(ax) -> None:
    heights = [p.get_height() for p in ax.patches if p.get_height() > 0]
    if heights and max(heights) / min(heights) > 30:
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_minor_formatter(NullFormatter())


@_style
def plot_hist(
    tree: PrefixTree,
    *,
    groups: np.ndarray | None = None,
    group_names: Sequence | None = None,
    source: str | None = None,
) -> Figure:
    """Sequence lengths, branching factors, branch-point positions and per-group C.

    ``groups`` (int per input sequence, e.g. ``Rollouts.groups``, named by ``group_names``) defines the
    per-group C panel; without it the tree's scopes (steps, tree_ids) are the groups; with a single group
    the panel is left out. Up to 30 groups get one named bar each, more a histogram.
    """
    if groups is not None:
        n_groups = int(groups.max()) + 1
        flat_g, trie_g = subset_tree_tokens(tree, groups, n_groups)
        label = "tree_id"
    elif tree.n_sequences and int(tree.scope.max()) > 0:
        codes = np.empty(tree.n_sequences, dtype=np.int64)
        codes[tree.order] = tree.scope
        n_groups = int(tree.scope.max()) + 1
        flat_g, trie_g = subset_tree_tokens(tree, codes, n_groups)
        label, group_names = "scope", tree.scope_names
    else:
        flat_g = trie_g = np.zeros(0, np.int64)
        label = ""
    present = np.flatnonzero(trie_g > 0)
    c_groups = flat_g[present] / trie_g[present]
    with_groups = len(c_groups) > 1
    fig = _fig(12.0, 8.0 if with_groups else 4.4)
    axes = fig.subplots(2, 2).ravel() if with_groups else fig.subplots(1, 3).ravel()

    ax = axes[0]
    L = tree.lengths
    _value_hist(ax, L, TREE_COLOR)
    med = float(np.median(L))
    ax.axvline(med, color="#222222", linestyle=(0, (4, 2)), linewidth=1.2, label=f"median {med:,.0f}")
    ax.axvline(float(L.max()), color=CAP_COLOR, linestyle=(0, (1, 2)), linewidth=1.2, label=f"max {int(L.max()):,}")
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("sequences")
    ax.set_ylim(top=ax.get_ylim()[1] * 1.15)  # room for the legend above the bars
    ax.set_title(f"Sequence length ({_n(tree.n_sequences, 'sequence')})", loc="left")
    ax.legend(loc="upper right")

    ax = axes[1]
    ch = tree.node_children
    internal = ch[ch > 0]
    if len(internal):
        _int_bars(ax, internal, "#5aae61")
        _log_counts_if_skewed(ax)
        n_branch = int((internal >= 2).sum())
        ax.set_title(f"Branching ({len(internal):,} internal nodes, {n_branch:,} branch points)", loc="left")
    else:
        _empty(ax, "no internal nodes:\nno sequence shares a prefix with another")
        ax.set_title("Branching", loc="left")
    ax.set_xlabel("children per internal node" + (" (1: a sequence ends mid-path)" if (internal == 1).any() else ""))
    ax.set_ylabel("internal nodes")

    ax = axes[2]
    branch = ch >= 2
    if branch.any():
        at = (tree.node_depth + tree.node_len)[branch]
        _value_hist(ax, at, "#8073ac")
        _log_counts_if_skewed(ax)
        ax.set_title("Where sequences branch", loc="left")
    else:
        _empty(ax, "no branch points:\nevery tree is a single chain\n(sharing comes from prefix-of-another\n"
                   "and duplicate sequences)" if len(internal) else "no branch points")
        ax.set_title("Where sequences branch", loc="left")
    ax.set_xlabel("branch-point position (tokens)")
    ax.set_ylabel("branch points")

    if with_groups:
        ax = axes[3]
        overall = tree.n_flat_tokens / max(tree.n_tree_tokens, 1)
        ax.set_title(f"Compression per {label} ({len(c_groups):,} groups, median C {np.median(c_groups):.2f})", loc="left")
        if len(c_groups) <= 30:  # one bar per group, from C = 1 (no sharing), sorted
            order = np.argsort(c_groups, kind="stable")
            names = [str(group_names[g]) if group_names is not None else str(g) for g in present[order]]
            names, prefix, suffix = _strip_common(names)
            ax.barh(np.arange(len(order)), c_groups[order] - 1, left=1, height=0.7, color="#d6604d")
            ax.set_yticks(np.arange(len(order)), [_middle_ellipsis(n, 22) for n in names],
                          fontsize=9 if len(order) <= 15 else 7)
            if prefix or suffix:
                ax.set_ylabel(_middle_ellipsis(f"{label}: {prefix}…{suffix}", 48), fontsize=9)
            pad = max(0.0, (5 - len(order)) / 2)  # a handful of groups keeps bars slim
            ax.set_ylim(-0.6 - pad, len(order) - 0.4 + pad)
            ax.set_xlim(1, max(float(c_groups.max()), overall) * 1.06)
            ax.set_xlabel(f"C of the {label}'s own tree (N_flat / N_tree; 1 = no sharing)")
            ax.axvline(overall, color="#222222", linestyle=(0, (4, 2)), linewidth=1.2, label=f"whole batch C {overall:.2f}")
            ax.legend(loc="lower right", framealpha=0.95)
            ax.grid(axis="x")
        else:
            _value_hist(ax, c_groups, "#d6604d", integer=False)
            ax.axvline(overall, color="#222222", linestyle=(0, (4, 2)), linewidth=1.2, label=f"whole batch C {overall:.2f}")
            ax.set_xlabel(f"C per {label} (N_flat / N_tree of the group's own tree)")
            ax.set_ylabel("groups")
            ax.legend(loc="best", framealpha=0.95)
            ax.yaxis.set_major_locator(_counts(8))
            ax.grid(axis="y")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _p: f"{x:g}"))
        ax.set_axisbelow(True)
    for a in axes[:3]:
        if a.get_gid() == "empty":
            continue
        if a.get_yscale() == "linear":
            a.yaxis.set_major_locator(_counts(8))
        a.yaxis.set_major_formatter(_TICKS)
        a.grid(axis="y")
        a.set_axisbelow(True)
    _suptitle(fig, "Shape of the prefix trees", source)
    return fig


def _empty(ax, text: str) -> None:
    """A panel with nothing to plot says why, without axes ticks."""
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", color="#555555")
    ax.set_xticks([])
    ax.set_yticks([])
    ax.spines["left"].set_visible(False)
    ax.set_gid("empty")


# --------------------------------------------------------------------------------------------------
# Dispatch and output


def figure(
    kind: str,
    rollouts: Rollouts,
    *,
    tree: PrefixTree | None = None,
    group_by: str | None = None,
    group: str | None = None,
    packing: Packing | None = None,
    source: str | None = None,
    max_nodes: int = MAX_TREE_NODES,
) -> Figure:
    """The figure of ``kind`` (one of ``KINDS``) for a batch.

    ``tree`` (built from ``rollouts`` with ``group_by``) is reused when given. ``tree`` draws the tree_id
    ``group`` (default: the group whose sharing saves the most tokens) up to ``max_nodes`` nodes;
    ``packs`` needs a ``packing`` of the same rollouts made with the same ``group_by``.
    """
    if kind not in KINDS:
        raise TreepackError(f"unknown figure kind {kind!r}; known: {', '.join(KINDS)}")
    if len(rollouts) == 0:
        raise InputError("no sequences to plot")
    if tree is None:
        tree = PrefixTree.build(rollouts, group_by=group_by)
    scope = "each tree_id" if group_by == "tree_id" else "whole batch"
    if rollouts.steps is not None:
        scope += ", per step"
    if kind == "tree":
        index, name = pick_group(rollouts, tree, group)
        sub = rollouts.select(index)
        label = f"group {name}" if rollouts.groups is not None else name
        return plot_tree(PrefixTree.build(sub), ids=sub.ids, name=label, source=source, max_nodes=max_nodes)
    if kind == "active":
        return plot_active(tree, source=source, scope=scope)
    if kind == "hist":
        return plot_hist(tree, groups=rollouts.groups, group_names=rollouts.group_names, source=source)
    if packing is None:
        raise TreepackError("the packs figure needs a packing (a capacity)")
    return plot_packs(tree, packing, source=source)


def save(fig: Figure, path: str | Path, *, dpi: int = DEFAULT_DPI) -> Path:
    """Write ``fig`` to ``path``; the format follows the suffix (.png, .svg, .pdf)."""
    path = Path(path)
    fmt = path.suffix.lower().lstrip(".")
    if fmt not in FORMATS:
        raise TreepackError(f"cannot write {path.name!r}: the file name must end in .png, .svg or .pdf")
    path.parent.mkdir(parents=True, exist_ok=True)
    _render(fig, path, fmt, dpi)
    return path


def png_bytes(fig: Figure, *, dpi: int = DEFAULT_DPI) -> bytes:
    """The figure as PNG bytes (for embedding)."""
    buf = io.BytesIO()
    _render(fig, buf, "png", dpi)
    return buf.getvalue()


def _render(fig: Figure, target, fmt: str, dpi: int) -> None:
    # ticks are created while drawing, so the house style must hold then too; no timestamp in the file
    # and fixed SVG ids, so the same data gives the same bytes (CI artifacts diff cleanly)
    metadata = {"png": {"Software": None}, "pdf": {"CreationDate": None}, "svg": {"Date": None}}[fmt]
    with matplotlib.rc_context({**STYLE, "svg.hashsalt": "treepack"}):
        fig.savefig(target, dpi=dpi, format=fmt, metadata=metadata)


def write_figures(
    out_dir: str | Path,
    rollouts: Rollouts,
    *,
    tree: PrefixTree | None = None,
    group_by: str | None = None,
    packing: Packing | None = None,
    source: str | None = None,
    fmt: str = "png",
    dpi: int = DEFAULT_DPI,
) -> list[Path]:
    """The standard set into ``out_dir``: tree, active, hist, and packs when a packing is given."""
    if fmt not in FORMATS:
        raise TreepackError(f"unknown figure format {fmt!r}; known: {', '.join(FORMATS)}")
    if tree is None:
        tree = PrefixTree.build(rollouts, group_by=group_by)
    kinds = [k for k in KINDS if k != "packs" or packing is not None]
    out = []
    for kind in kinds:
        fig = figure(kind, rollouts, tree=tree, group_by=group_by, packing=packing, source=source)
        out.append(save(fig, Path(out_dir) / f"{kind}.{fmt}", dpi=dpi))
    return out


def source_label(files: Sequence[str]) -> str:
    """Short name of the inputs for titles: 'a.parquet', 'a.parquet + 2 more', '<stdin>'."""
    names = [Path(f).name if f != "-" else "<stdin>" for f in files]
    if not names:
        return ""
    return names[0] + (f" + {len(names) - 1} more" if len(names) > 1 else "")
