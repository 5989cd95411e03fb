"""Golden output of ``treepack stats --json`` on a bundled sample (regenerate deliberately, never blindly)."""

import json
from pathlib import Path

from cli_helpers import run

ROOT = Path(__file__).resolve().parents[1]


def test_stats_json_matches_golden():
    r = run("stats", ROOT / "treepack" / "datasets" / "samples" / "tau2_think.jsonl.gz", "--json", "--group-by", "tree_id")
    assert r.code == 0, r.err
    golden = json.loads((ROOT / "tests" / "golden" / "stats_tau2_think.json").read_text())
    assert json.loads(r.out) == golden
