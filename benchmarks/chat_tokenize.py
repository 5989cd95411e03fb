"""Benchmark ``treepack tokenize`` on real chat data against ``AutoTokenizer.apply_chat_template`` per turn.

Sources (``../shared/data/raw``, tokenizer ``../shared/data/tokenizer/qwen3``): tau-bench retail results as
they come, and ToolBench answer trees, hh-rlhf pairs and GSM8K solutions converted to chat records by
``treepack.datasets.chats`` (conversion not timed). Per source, in one run:
- ``tokenize_chats`` in-process (tokenizer already loaded, the drift analysis and consistent records on, as
  ``treepack tokenize`` runs it): wall and CPU seconds, tokens/s over the records' tokens;
- the CLI end to end in a fresh interpreter (start, tokenizer load, tokenize, write Parquet);
- the naive reference on the same turns: ``AutoTokenizer.apply_chat_template(messages[:k+1], tokenize=True)``
  for every trained turn, timed, and every record compared token for token (masks are not computed there,
  which favours it);
- records, tokens, C and POR per conversation tree as rendered and if consistent, drift counts.
Target: >= 1M tokens/s on 2 cores.

Usage: python benchmarks/chat_tokenize.py [--data ../shared/data] [--out benchmarks/results/DATE-tokenize.md]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import command_line, cpu_line, today, versions, write_report

ROOT = Path(__file__).resolve().parents[1]


def sources(data: Path, tmp: Path) -> dict[str, Path]:
    from treepack.datasets import chats

    raw = data / "raw"
    out = {"tau-bench retail (grok-3)": min((raw / "tau_bench_grok3_retail").glob("*.json"))}
    tb = [rec for f in sorted((raw / "toolbench_dfs").glob("*.json")) for rec in chats.toolbench_records(f)]
    out["ToolBench DFS (paths)"] = chats.write_jsonl(tb, tmp / "toolbench.jsonl")
    out["hh-rlhf harmless (pairs)"] = chats.write_jsonl(
        chats.hh_rlhf_records(raw / "hh_rlhf_harmless_test" / "harmless-base_test.jsonl.gz"), tmp / "hh.jsonl")
    out["GSM8K (4 solutions)"] = chats.write_jsonl(
        chats.gsm8k_records(raw / "gsm8k_model_solutions" / "example_model_solutions.jsonl"), tmp / "gsm8k.jsonl")
    return out


def sharing(r) -> tuple[float, float]:
    from treepack.tree import PrefixTree

    t = PrefixTree.build(r, group_by="tree_id")
    return t.n_flat_tokens / t.n_tree_tokens, 1 - t.n_tree_tokens / t.n_flat_tokens


def reference(path: Path, recs, tokenizer_dir: Path) -> tuple[float, float, int, int]:
    """apply_chat_template per trained turn: (wall s, CPU s, records compared, records that differ)."""
    from transformers import AutoTokenizer

    from treepack.chat.conversations import conversations_of, file_stem, iter_raw

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    index = {rid: i for i, rid in enumerate(recs.fresh.ids)}
    work = []
    for where, i, rec, _ in iter_raw(str(path)):
        if isinstance(rec, dict):
            for conv in conversations_of(rec, default_id=f"{file_stem(str(path))}:{i}", where=where):
                assistant = [k for k, m in enumerate(conv.messages) if m["role"] == "assistant"]
                trained = assistant if conv.turns is None else conv.turns
                for k in trained:
                    work.append((conv.messages[: k + 1], conv.tools, index[f"{conv.id}/turn{assistant.index(k)}"]))
    c0, t0 = time.process_time(), time.perf_counter()
    out = [tok.apply_chat_template(m, tools=tools, tokenize=True, return_dict=False) for m, tools, _ in work]
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    differ = sum(recs.fresh.sequence(j).tolist() != list(ids) for ids, (_, _, j) in zip(out, work))
    return seconds, cpu, len(work), differ


def cli_seconds(path: Path, tokenizer_dir: Path, tmp: Path) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "treepack", "tokenize", str(path), "--tokenizer", str(tokenizer_dir),
                    "-o", str(tmp / "out.parquet"), "--json", "-q"], check=True, capture_output=True)
    return time.perf_counter() - t0


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / f"{today()}-tokenize.md")
    args = ap.parse_args(argv)
    tokenizer_dir = args.data / "tokenizer" / "qwen3"
    from treepack.chat.template import ChatTokenizer
    from treepack.chat.turns import tokenize_chats

    load0 = os.getloadavg()[0]
    rows, totals = [], {"tokens": 0, "ours": 0.0, "ref": 0.0, "ours_cpu": 0.0, "ref_cpu": 0.0}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        t0 = time.perf_counter()
        ct = ChatTokenizer(tokenizer_dir)
        load_s = time.perf_counter() - t0
        for name, path in sources(args.data, tmp).items():
            c0, w0 = time.process_time(), time.perf_counter()
            recs = tokenize_chats(path, ct, consistent=True)
            wall, cpu = time.perf_counter() - w0, time.process_time() - c0
            r, d = recs.fresh, recs.total
            c, por = sharing(r)
            cc, cpor = sharing(recs.consistent)
            ref_s, ref_cpu, n_ref, differ = reference(path, recs, tokenizer_dir)
            cli = cli_seconds(path, tokenizer_dir, tmp)
            totals["tokens"] += r.n_tokens
            totals["ours"] += wall
            totals["ref"] += ref_s
            totals["ours_cpu"] += cpu
            totals["ref_cpu"] += ref_cpu
            rows.append({"source": name, "conversations": len(recs.conversation_ids), "records": len(r),
                         "tokens": r.n_tokens, "encoded": recs.encoded_tokens, "wall": wall, "cpu": cpu, "cli": cli,
                         "ref": ref_s, "ref_cpu": ref_cpu, "n_ref": n_ref, "differ": differ, "C": c, "POR": por, "C_cons": cc,
                         "POR_cons": cpor, "pairs": d.pairs, "drifted": d.drifted, "kinds": dict(d.kinds),
                         "wheres": dict(d.wheres), "lost": d.tokens_lost, "differs": d.records_differ,
                         "example": d.examples[0].to_dict() if d.examples else None})
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "example"}), flush=True)
    load1 = os.getloadavg()[0]
    write_report(args.out, report(rows, totals, load_s, (load0, load1), argv))
    print(f"wrote {args.out}")


def report(rows, totals, load_s, load, argv) -> str:
    def mtok(n, s):
        return f"{n / s / 1e6:.2f}M" if s else "-"

    lines = [
        f"# treepack tokenize on real chat data ({today()})", "",
        (f"- hardware: {cpu_line()} (load average {load[0]:.1f} before, {load[1]:.1f} after: other jobs shared the "
        "machine, so wall times are upper bounds)"),
        f"- versions: {versions('numpy', 'tokenizers', 'jinja2', 'transformers')}",
        f"- command: `{command_line(__file__, argv)}`",
        ("- tokenizer: Qwen3 (`../shared/data/tokenizer/qwen3`), its own chat template; loading it took "
        f"{load_s:.2f} s (not in the numbers below)"),
        ("- ours: `tokenize_chats` with the drift analysis and the consistent records on (what `treepack tokenize` "
        "does); reference: `AutoTokenizer.apply_chat_template(messages[:k+1], tokenize=True)` called per turn on "
        "the same turns (tokens only, no masks); tokens/s = the records' tokens over wall seconds, and over CPU "
        "seconds of the process (all its threads: what the work costs, whatever else runs on the machine)"),
        "",
        "## Speed and exactness",
        "",
        ("| source | conversations | records | tokens | encoded (not repeated) | ours wall (CPU) | ours tok/s "
         "(per CPU s) | CLI end to end | reference wall (CPU) | reference tok/s (per CPU s) | speedup wall (CPU) | "
         "records differing from reference |"),
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for x in rows:
        lines.append(
            f"| {x['source']} | {x['conversations']:,} | {x['records']:,} | {x['tokens']:,} | {x['encoded']:,} | "
            f"{x['wall']:.2f} s ({x['cpu']:.2f} s) | {mtok(x['tokens'], x['wall'])} "
            f"({mtok(x['tokens'], x['cpu'])}) | {x['cli']:.2f} s | {x['ref']:.2f} s ({x['ref_cpu']:.2f} s) | "
            f"{mtok(x['tokens'], x['ref'])} ({mtok(x['tokens'], x['ref_cpu'])}) | {x['ref'] / x['wall']:.1f}x "
            f"({x['ref_cpu'] / x['cpu']:.1f}x) | {x['differ']} of {x['n_ref']:,} |")
    t = totals
    lines.append(f"| **all** | | | {t['tokens']:,} | | {t['ours']:.2f} s ({t['ours_cpu']:.2f} s) | "
                 f"**{mtok(t['tokens'], t['ours'])}** ({mtok(t['tokens'], t['ours_cpu'])}) | | {t['ref']:.2f} s "
                 f"({t['ref_cpu']:.2f} s) | {mtok(t['tokens'], t['ref'])} ({mtok(t['tokens'], t['ref_cpu'])}) | "
                 f"{t['ref'] / t['ours']:.1f}x ({t['ref_cpu'] / t['ours_cpu']:.1f}x) | |")
    lines += [
        "", "## Sharing and drift (sharing scoped to each tree_id: a conversation, task, pair or question)", "",
        ("| source | C as rendered | POR as rendered | C if consistent | POR if consistent | turn pairs drifted | "
        "kind (text / tokens) | where (history / turn / after) | tokens of sharing lost | keep-prefix records "
        "that differ |"),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for x in rows:
        k, w = x["kinds"], x["wheres"]
        lines.append(
            f"| {x['source']} | {x['C']:.2f} | {x['POR']:.4f} | {x['C_cons']:.2f} | {x['POR_cons']:.4f} | "
            f"{x['drifted']:,} of {x['pairs']:,} | {k.get('text', 0):,} / {k.get('tokens', 0):,} | "
            f"{w.get('history', 0):,} / {w.get('turn', 0):,} / {w.get('after', 0):,} | {x['lost']:,} | "
            f"{x['differs']:,} of {x['records']:,} |")
    lines += ["", "First divergence per source (decoded; `turn t` = the earlier record, `turn t+1` = the later one):", ""]
    for x in rows:
        e = x["example"]
        if e:
            lines.append(f"- {x['source']}, {e['conversation']} turn {e['turn']}, token {e['position']:,} "
                         f"({e['kind']} drift in {e['where']}): context {json.dumps(e['context'])}; turn t "
                         f"{json.dumps(e['this_turn'])}; turn t+1 {json.dumps(e['next_turn'])}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main(sys.argv[1:])
