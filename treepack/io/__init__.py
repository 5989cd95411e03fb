"""Rollouts in and out: reading and validating JSONL / Parquet input into one `Rollouts` batch (flat tokens
+ offsets), and writing a batch back as records, Arrow or files.

- `rollouts`: the ``Rollouts`` batch and its ``Source`` files;
- `ingest`: ``read_rollouts`` / ``expand_paths``, the entry points; `streams` (a file's bytes in bounded
  blocks, gzip on a thread), `jsonl` (JSON records: simdjson fast path, precise checks; ``iter_json_records``
  reads the records of any JSONL / JSON-array file for other readers), `arrow` (Parquet, column at once),
  `builder` (the columnar builder both fill), `extras` (what an exact unpack needs);
- `records`: the way back out (``iter_records``, ``to_arrow``, ``write_rollouts``);
- `sequences`: token lists in memory -> a checked batch (``rollouts_from_sequences``), and the checks the
  library's entry points run on a hand-made one (``check_rollouts``);
- chat transcripts in: `chats` (record forms), `chat_template` (rendering + tokenizing turns), `drift`,
  `chat_rollouts` (``tokenize_chats``: one record per assistant turn). They need ``tokenizers`` and
  ``jinja2`` (``treepack[chat]``), imported only when used.
Needs numpy and pyarrow only.
"""

from treepack.io.ingest import expand_paths, read_rollouts
from treepack.io.jsonl import JsonRecord, iter_json_records
from treepack.io.records import iter_records, to_arrow, write_rollouts
from treepack.io.rollouts import GROUP_ALIASES, TOKEN_ALIASES, Progress, Rollouts, Source
from treepack.io.sequences import check_rollouts, rollouts_from_sequences

__all__ = [
    "GROUP_ALIASES",
    "TOKEN_ALIASES",
    "JsonRecord",
    "Progress",
    "Rollouts",
    "Source",
    "check_rollouts",
    "expand_paths",
    "iter_json_records",
    "iter_records",
    "read_rollouts",
    "rollouts_from_sequences",
    "to_arrow",
    "write_rollouts",
]
