"""A self-contained HTML report of a rollout batch: the stats tables, every packing strategy side by side
at one capacity, and the figures, in one file a CI job can keep as an artifact.

Design and trade-offs:
- One file, nothing external: figures are base64 PNGs in ``data:`` URIs, the CSS is inline, no script,
  no web font, no link to a file. PNG rather than inline SVG because the step curves of a 100k-position
  batch are ~0.3 MB of SVG path data but ~60 kB of PNG; at 110 dpi a report is ~0.3-0.6 MB.
- The figures are the ones ``treepack plot`` writes (``treepack.viz.plots``), so a number read off the report
  and one read off a saved figure never disagree; the tables format the same ``TreeStats`` that
  ``treepack stats --json`` prints.
- Packing is compared on the same tree for every strategy in ``treepack.pack.strategies.STRATEGIES``. A strategy
  that refuses the input (the exact DP above its size limit) gets a row saying why instead of failing the
  report (and the exponential DP only runs on steps of at most 16 sequences); sequences longer than the capacity are left out and counted (``oversize="skip"``) by default,
  because a report that cannot be written is worse than one that says what it dropped.
- Every value is escaped with ``html.escape``; the output parses with ``html.parser`` without errors.
"""

from __future__ import annotations

import base64
import html
from collections.abc import Sequence
from dataclasses import dataclass

from treepack import __version__
from treepack.errors import CapacityError, TreepackError
from treepack.io.rollouts import Rollouts
from treepack.pack.strategies import STRATEGIES, Packing, pack_sequences
from treepack.stats import DEFAULT_MODEL, TreeStats, compute_stats
from treepack.tree import PrefixTree
from treepack.viz.options import REPORT_CAPACITY as DEFAULT_CAPACITY
from treepack.viz.options import REPORT_DPI
from treepack.viz.plots import figure, png_bytes, source_label

_CSS = """
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, Helvetica, Arial, sans-serif;
       color: #1f2328; margin: 0 auto; max-width: 1380px; padding: 24px 32px 48px; }
h1 { font-size: 26px; margin: 0 0 4px; }
h2 { font-size: 20px; margin: 36px 0 10px; border-bottom: 1px solid #d0d7de; padding-bottom: 4px; }
p.sub { color: #57606a; margin: 0 0 18px; }
.cards { display: flex; flex-wrap: wrap; gap: 12px; margin: 18px 0; }
.card { border: 1px solid #d0d7de; border-radius: 8px; padding: 10px 16px; min-width: 150px; }
.card .v { font-size: 26px; font-weight: 600; }
.card .k { color: #57606a; font-size: 13px; }
table { border-collapse: collapse; margin: 8px 0 16px; font-variant-numeric: tabular-nums; }
th, td { padding: 5px 12px; border-bottom: 1px solid #eaeef2; text-align: left; vertical-align: top; }
th { background: #f6f8fa; font-weight: 600; }
td.n, th.n { text-align: right; }
td.m { color: #57606a; }
tr.best td { font-weight: 600; background: #f0f7ff; }
.grid { display: flex; flex-wrap: wrap; gap: 24px; align-items: flex-start; }
figure { margin: 8px 0 20px; }
figure img { max-width: 100%; height: auto; border: 1px solid #eaeef2; }
figcaption { color: #57606a; font-size: 13px; margin-top: 4px; max-width: 1300px; }
.note { color: #57606a; }
"""


@dataclass
class StrategyResult:
    """One row of the packing comparison: a packing, or why the strategy refused the input."""

    strategy: str
    packing: Packing | None = None
    error: str | None = None


def compare_strategies(
    rollouts: Rollouts,
    capacity: int,
    *,
    tree: PrefixTree | None = None,
    group_by: str | None = None,
    strategies: Sequence[str] = STRATEGIES,
    oversize: str = "skip",
) -> list[StrategyResult]:
    """Pack the same batch with every strategy; a strategy that raises gets its message instead.

    The exact DP (``optimal``) is exponential: ``pack_sequences`` refuses it above
    ``treepack.pack.strategies.OPTIMAL_MAX_SEQUENCES`` sequences per step (the same limit, and the same message, as ``treepack stats --compare-strategies``).
    """
    out = []
    for name in strategies:
        try:
            out.append(StrategyResult(name, pack_sequences(rollouts, capacity, strategy=name, group_by=group_by,
                                                           oversize=oversize, tree=tree)))
        except CapacityError:  # oversize="error": a sequence over the capacity stops the report, as in pack
            raise
        except TreepackError as exc:
            out.append(StrategyResult(name, error=str(exc)))
    return out


def stats_rows(st: TreeStats) -> list[tuple[str, str, str]]:
    """(metric, value, meaning) rows of ``treepack stats`` (the report compares packing separately)."""
    return st.rows(packing=False)


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], cols: str, *,
           row_classes: Sequence[str] | None = None) -> str:
    """An HTML table; ``cols`` has one letter per column: l(eft), n(umeric, right-aligned), m(uted)."""
    css = {"l": "", "n": ' class="n"', "m": ' class="m"'}
    head = "".join(f"<th{css[c] if c == 'n' else ''}>{html.escape(h)}</th>" for h, c in zip(headers, cols))
    body = []
    for i, row in enumerate(rows):
        cls = f' class="{row_classes[i]}"' if row_classes and row_classes[i] else ""
        cells = "".join(f"<td{css[c]}>{html.escape(str(v))}</td>" for v, c in zip(row, cols))
        body.append(f"<tr{cls}>{cells}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _figure_html(fig, alt: str, caption: str, dpi: int) -> str:
    data = base64.b64encode(png_bytes(fig, dpi=dpi)).decode("ascii")
    return (f'<figure><img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{html.escape(caption)}</figcaption></figure>")


def _packing_section(results: list[StrategyResult], capacity: int, por: float) -> tuple[str, Packing | None]:
    ok = [r for r in results if r.packing is not None]
    best = min(ok, key=lambda r: (r.packing.n_pack_tokens, r.packing.n_packs)) if ok else None
    rows, classes = [], []
    for r in results:
        if r.packing is None:
            rows.append([r.strategy, "–", "–", "–", "–", "–", "–", "–", r.error or ""])
            classes.append("")
            continue
        p = r.packing
        fill = p.n_pack_tokens / max(p.n_packs * capacity, 1)
        speedup = 1 / (1 - p.err) if p.err < 1 else float("inf")
        rows.append([r.strategy, f"{p.n_packs:,}", f"{p.n_pack_tokens:,}", f"{p.err:.4f}", f"{speedup:.2f}x",
                     f"{p.por - p.err:.4f}", f"{fill:.1%}", f"{p.seconds:.2f}",
                     f"{p.n_oversize_skipped:,} longer than the capacity left out" if p.n_oversize_skipped else ""])
        classes.append("best" if r is best else "")
    table = _table(["strategy", "packs", "N_pack", "ERR", "1/(1-ERR)", "POR - ERR", "mean fill", "seconds", "note"],
                   rows, "lnnnnnnnm", row_classes=classes)
    intro = (f"<p>Every strategy packs the same sequences into packs of at most <b>{capacity:,}</b> trie tokens. "
             f"N_pack counts a shared prefix once per pack that holds it; ERR = 1 - N_pack / N_flat can reach "
             f"POR = {por:.4f} only when no prefix is split across packs. The row in bold has the fewest tokens.</p>")
    return intro + table, best.packing if best else None


def build_report(
    rollouts: Rollouts,
    *,
    files: Sequence[str] = (),
    group_by: str | None = None,
    capacity: int | None = DEFAULT_CAPACITY,
    strategies: Sequence[str] = STRATEGIES,
    oversize: str = "skip",
    model: str = DEFAULT_MODEL,
    dpi: int = REPORT_DPI,
    rendering: dict | None = None,
) -> str:
    """The HTML text of the report (``capacity=None`` leaves packing out; ``rendering``: the tokenizer and options
    that made chat records, named under the title)."""
    if len(rollouts) == 0:
        raise TreepackError("no sequences to report on")
    tree = PrefixTree.build(rollouts, group_by=group_by)
    st = compute_stats(tree, rollouts=rollouts, model=model)
    source = source_label(files)
    esc = html.escape

    results = compare_strategies(rollouts, capacity, tree=tree, group_by=group_by, strategies=strategies,
                                 oversize=oversize) if capacity else []
    packing_html, best = _packing_section(results, capacity, st.por) if capacity else ("", None)

    cards = [("C", f"{st.compression:.2f}", "N_flat / N_tree"), ("POR", f"{st.por:.3f}", "prefix overlap rate"),
             ("ideal speedup", f"{st.ideal_speedup:.2f}x", "1 / (1 - POR)")]
    if best is not None:
        cards.append((f"ERR @ {capacity:,}", f"{best.err:.3f}", f"strategy {best.strategy}"))
    cards += [("sequences", f"{st.n_sequences:,}", f"{st.n_flat_tokens:,} tokens"),
              ("max length", f"{st.max_depth:,}", "tokens")]
    cards_html = "".join(f'<div class="card"><div class="k">{esc(k)}</div><div class="v">{esc(v)}</div>'
                         f'<div class="k">{esc(m)}</div></div>' for k, v, m in cards)

    scope = "each tree_id is its own tree" if group_by == "tree_id" else "the whole batch shares one forest"
    if rollouts.steps is not None:
        scope += "; trees never cross a step"
    inputs = _table(["file", "records", "skipped", "sha256"],
                    [[s.path, f"{s.n_records:,}", f"{s.n_skipped:,}", s.sha256[:16]] for s in rollouts.sources],
                    "lnnm") if rollouts.sources else ""

    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>treepack report: {esc(source or 'rollouts')}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>treepack report: {esc(source or 'rollouts')}</h1>",
        (f'<p class="sub">treepack {esc(__version__)} · sharing scope: {esc(scope)} · FLOP model {esc(st.model)}'
         f'{_rendering_note(rendering)}</p>'),
        f'<div class="cards">{cards_html}</div>',
        "<h2>Active sequences by position</h2>",
        _figure_html(figure("active", rollouts, tree=tree, group_by=group_by, source=source), "active sequences",
                     "Dense baseline (dashed) against the tree (solid): the areas are N_flat and N_tree, so their "
                     "ratio is C. The lower panel is the sharing at each position.", dpi),
        "<h2>Statistics</h2>",
        '<div class="grid"><div>',
        _table(["metric", "value", "meaning"], stats_rows(st), "lnm"),
        "</div><div>",
    ]
    if st.branching:
        items = sorted(st.branching.items())
        total = sum(st.branching.values())
        shown = [(str(k), v) for k, v in items if k <= 8]
        rest = sum(v for k, v in items if k > 8)
        if rest:
            shown.append(("9" if st.max_branching == 9 else f"9-{st.max_branching}", rest))
        parts += ["<h3>Branching (children per internal node)</h3>",
                  _table(["children", "nodes", "share"], [[k, f"{v:,}", f"{v / total:.1%}"] for k, v in shown], "nnn")]
    if st.groups:
        parts += [f"<h3>Top {len(st.groups)} scopes by saved tokens</h3>",
                  _table(["scope", "sequences", "N_flat", "N_tree", "C", "saved"],
                         [[g.group, f"{g.n_sequences:,}", f"{g.n_flat_tokens:,}", f"{g.n_tree_tokens:,}",
                           f"{g.compression:.2f}", f"{g.saved_tokens:,}"] for g in st.groups], "lnnnnn")]
    if inputs:
        parts += ["<h3>Inputs</h3>", inputs]
    parts.append("</div></div>")
    if st.n_skipped:
        reasons = ", ".join(f"{v:,} {k}" for k, v in sorted(st.skipped.items(), key=lambda kv: -kv[1]))
        parts.append(f'<p class="note">Skipped {st.n_skipped:,} bad record(s): {esc(reasons)}.</p>')
    if capacity:
        parts += [f"<h2>Packing at capacity {capacity:,}</h2>", packing_html]
        if best is not None and best.n_packs:
            parts.append(_figure_html(
                figure("packs", rollouts, tree=tree, group_by=group_by, packing=best, source=source), "pack fill",
                f"Tokens per pack for {best.strategy}: first-time trie tokens (blue) and prefix tokens that an "
                "earlier pack already computed (orange), against the capacity.", dpi))
    group_note = ("the group (tree_id) whose sharing saves the most tokens" if rollouts.groups is not None
                  else "the whole batch")
    parts += [
        "<h2>Prefix tree</h2>",
        _figure_html(figure("tree", rollouts, tree=tree, group_by=group_by, source=source), "prefix tree",
                     f"The compressed trie of {group_note}: bar width = tokens, colour = sequences sharing the node, "
                     "ticks = where sequences end; treepack plot --kind tree --group ID draws another group.", dpi),
        "<h2>Shape</h2>",
        _figure_html(figure("hist", rollouts, tree=tree, group_by=group_by, source=source), "histograms",
                     "Sequence lengths, children per internal node, positions of branch points, and C per group.", dpi),
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"


def _rendering_note(rendering: dict | None) -> str:
    """`` · chat transcripts rendered by DIR (sha256 ...): turns all, reasoning template, ...`` (HTML-escaped)."""
    if not rendering:
        return ""
    options = [f"turns {rendering['turns']}", f"reasoning {rendering['reasoning']}"]
    options += [text for key, text in (("system", "no system"), ("tools", "no tools")) if not rendering[key]]
    options += ["keep-prefix tokens"] if rendering["keep_prefix_tokens"] else []
    options += [f"{k}={v!r}" for k, v in rendering["template_args"].items()]
    return html.escape(f" · chat transcripts rendered by {rendering['tokenizer']} (sha256 "
                       f"{rendering['tokenizer_sha256'][:16]}): {', '.join(options)}")


def write_report(path, rollouts: Rollouts, **kwargs) -> int:
    """Write the report of ``build_report(rollouts, **kwargs)`` to ``path``; return its size in bytes."""
    text = build_report(rollouts, **kwargs)
    data = text.encode("utf-8")
    with open(path, "wb") as f:
        f.write(data)
    return len(data)
