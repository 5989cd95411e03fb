"""The package layout as a contract: stages follow the data flow, no import circles, no oversized modules.

Every ``import`` under treepack/ (module level or inside functions) is read with ``ast``; the folder tree is
the import tree (``treepack/cli/x.py`` is ``treepack.cli.x``). A module may import its own package, lower
stages, and the packages of its own stage that `SAME_STAGE` declares (docs/design.md §2): base (errors,
sizes) < io, chat, datasets < tree, stats < pack, kernels < train, hf < viz < cli.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 600  # a module past this has a seam to split at (the house style aims at 100-500)

# (prefix, stage): the longest matching prefix decides; a module may import stages <= its own.
STAGES = [
    ("treepack", 0), ("treepack.errors", 0), ("treepack.sizes", 0),
    ("treepack.io", 1), ("treepack.chat", 1), ("treepack.datasets", 1),
    ("treepack.tree", 2), ("treepack.stats", 2),
    ("treepack.pack", 3), ("treepack.kernels", 3),
    ("treepack.train", 4), ("treepack.hf", 4),
    ("treepack.viz", 5),
    ("treepack.cli", 6), ("treepack.__main__", 6),
]
# The only imports allowed between different packages of one stage (importer -> imported): one direction
# each, so a stage's packages never lean on each other both ways. ``hf`` builds on ``train``'s losses,
# modes and model source registry; ``train`` reaches transformers' models only through that registry.
SAME_STAGE = {
    ("treepack.chat", "treepack.io"), ("treepack.datasets", "treepack.io"), ("treepack.datasets", "treepack.chat"),
    ("treepack.stats", "treepack.tree"),
    ("treepack.hf", "treepack.train"), ("treepack.__main__", "treepack.cli"),
}


def stage_prefix(module: str) -> str:
    return max((p for p, _ in STAGES if module == p or module.startswith(p + ".")), key=len)


def stage_of(module: str) -> int:
    return dict(STAGES)[stage_prefix(module)]


def source_modules() -> dict[str, Path]:
    out = {}
    for path in sorted((ROOT / "treepack").rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        out[".".join(p for p in rel.parts if p != "__init__")] = path
    return out


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """treepack modules that ``path`` imports (resolving relative imports and ``from pkg import submodule``)."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # `import treepack.io.rollouts` -> that module; attributes -> owner
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


@pytest.fixture(scope="module")
def graph() -> nx.DiGraph:
    mods = source_modules()
    g = nx.DiGraph()
    g.add_nodes_from(mods)
    for name, path in mods.items():
        for target in imports_of(name, path, set(mods)):
            g.add_edge(name, target)
    return g


def test_the_walk_sees_the_package(graph):
    assert {"treepack.io.ingest", "treepack.pack.strategies", "treepack.cli.app", "treepack.kernels.tree_attention.api",
            "treepack.chat.turns", "treepack.datasets.synth"} <= set(graph)
    assert graph.has_edge("treepack.pack.shards", "treepack.io.rollouts")
    assert graph.has_edge("treepack.kernels.tree_attention.api", "treepack.kernels.tree_attention.blocks")  # relative


def test_no_import_circles(graph):
    cycles = [c for c in nx.strongly_connected_components(graph) if len(c) > 1]
    assert not cycles, "import circles: " + "; ".join(" <-> ".join(sorted(c)) for c in cycles)


def test_lower_stages_never_import_higher_ones(graph):
    upward = [f"{a} -> {b}" for a, b in graph.edges if stage_of(b) > stage_of(a)]
    assert not upward, "upward imports:\n" + "\n".join(sorted(upward))


def test_packages_of_one_stage_import_each_other_only_as_declared(graph):
    sideways = sorted({
        f"{stage_prefix(a)} -> {stage_prefix(b)} ({a} -> {b})" for a, b in graph.edges
        if stage_of(a) == stage_of(b) and stage_of(a) > 0 and stage_prefix(a) != stage_prefix(b)
        and (stage_prefix(a), stage_prefix(b)) not in SAME_STAGE
    })
    assert not sideways, "undeclared imports within a stage:\n" + "\n".join(sideways)


def test_data_path_needs_no_torch():
    heavy = ("torch", "triton", "transformers")
    mods = source_modules()
    offenders = []
    for name, path in mods.items():
        if stage_of(name) > 3 or name.startswith("treepack.kernels"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{name}: {n}" for n in names if n.split(".")[0] in heavy]
    assert not offenders, offenders


def test_modules_stay_small():
    big = {name: n for name, path in source_modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines: {big}"


def test_every_subpackage_says_what_it_owns():
    for name, path in source_modules().items():
        if path.name == "__init__.py":
            doc = ast.get_docstring(ast.parse(path.read_text()))
            assert doc and len(doc) > 40, f"{name}: __init__.py needs a docstring saying what the package owns"


def test_readme_file_tree_names_every_module():
    readme = (ROOT / "README.md").read_text()
    tree = readme[readme.index("## Layout"):]
    missing = [
        str(path.relative_to(ROOT)) for path in source_modules().values()
        if path.name not in ("__init__.py", "__main__.py") and path.name not in tree
    ]
    folders = {p.parent.relative_to(ROOT) for p in source_modules().values()}
    missing += [f"{f}/" for f in folders if f"{f.name}/" not in tree]
    assert not missing, f"README's Layout does not name: {missing}"
