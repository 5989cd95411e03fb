"""Converters: the raw real-data sources of ``../shared/data/raw`` as chat-record files (the benchmarks'
inputs). ``treepack tokenize`` also reads these sources as they come (`treepack.chat.sources`, which
does the conversion of one record here too); tau-bench result files need no conversion at all. Sources:
- ToolBench DFSDT answer trees (``G*_answer/*.json``): every root-to-leaf path of the search tree is one
  conversation (system prompt and query from ``answer_generation.train_messages``, tool schemas from
  ``answer_generation.function``): a Thought node is assistant text, Action + Action Input an OpenAI tool call
  and the node's observation the tool result; ``tree_id`` = the query, so paths that branch share their
  prefix. Files without ``train_messages`` (no system prompt to render) are skipped and counted.
- hh-rlhf (``{"chosen", "rejected"}`` as ``\\n\\nHuman: ... \\n\\nAssistant: ...`` text): a TRL preference
  record, the dialogue before the last assistant reply as ``prompt`` messages.
- GSM8K model solutions: per question, 4 TRL prompt/completion records (one per model), ``reward`` =
  ``is_correct``, ``tree_id`` = the question (a GRPO-like group).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from treepack.chat.sources import gsm8k_solutions, hh_preference, toolbench_paths


def toolbench_records(path: str | Path) -> list[dict]:
    """Chat records (one per root-to-leaf path) of one ToolBench answer file; [] without train_messages."""
    path = Path(path)
    return toolbench_paths(json.loads(path.read_text(encoding="utf-8")), path.name.split("_ChatGPT")[0])


def hh_rlhf_records(path: str | Path) -> list[dict]:
    """TRL preference records of an hh-rlhf ``.jsonl.gz`` (pairs whose dialogue does not parse are skipped)."""
    out = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for i, line in enumerate(f):
            pair = json.loads(line)
            rec = hh_preference(pair["chosen"], pair["rejected"])
            if rec is not None:
                out.append({"id": f"pair{i}", **rec})
    return out


def gsm8k_records(path: str | Path) -> list[dict]:
    """TRL prompt/completion records: 4 model solutions per GSM8K question, reward = is_correct."""
    out = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            out += gsm8k_solutions(json.loads(line), f"q{i}")
    return out


def write_jsonl(records: list[dict], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    return path
