"""Install shape: the treepack.* namespace only, and a data path that runs without torch."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

BLOCK_TORCH = textwrap.dedent(
    """
    import sys
    class _NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torch", "triton"):
                raise ImportError(f"{name} is blocked in this test")
    sys.meta_path.insert(0, _NoTorch())
    """
)


def run_py(code, tmp_path, **kw):
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=False, **kw)


def test_no_top_level_cli_kernels_datasets(tmp_path):
    code = textwrap.dedent(
        """
        import importlib.util
        for name in ("cli", "kernels"):
            assert importlib.util.find_spec(name) is None, name
        spec = importlib.util.find_spec("datasets")
        assert spec is None or "treepack" not in (spec.origin or ""), spec
        import treepack.cli.app, treepack.kernels, treepack.datasets
        print("ok")
        """
    )
    out = run_py(code, tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_the_repository_root_shadows_no_package():
    """Run from a checkout's root (sys.path[0] == ''), Python must find no module of ours but ``treepack``: a
    top-level ``datasets/`` once hid Hugging Face's package (``import trl`` failed there)."""
    ours = sorted(p.name for p in ROOT.iterdir()
                  if (p.is_dir() and (p / "__init__.py").exists()) or (p.is_file() and p.suffix == ".py"))
    assert ours in (["treepack"], ["tests", "treepack"]), ours
    code = ("import importlib.util as u; s = u.find_spec('datasets'); "
            "print('none' if s is None else s.origin)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    origin = out.stdout.strip()
    # Hugging Face's own package may be installed (in a .venv inside the checkout too); never a folder of ours
    assert origin == "none" or "site-packages" in origin or not origin.startswith(str(ROOT)), origin


def test_stats_runs_without_torch(tmp_path):
    data = tmp_path / "r.jsonl"
    data.write_text('{"input_ids": [1, 2, 3]}\n{"input_ids": [1, 2, 4]}\n')
    code = BLOCK_TORCH + textwrap.dedent(
        f"""
        import sys
        sys.argv = ["treepack", "stats", {str(data)!r}, "--json"]
        from treepack.cli.app import main
        try:
            main()
        except SystemExit as e:
            assert not e.code, e.code
        assert "torch" not in sys.modules
        # only the command that runs is imported: not the trainer, the synthesiser or the plots
        loaded = [m for m in ("treepack.cli.train", "treepack.datasets.synth", "treepack.cli.plot") if m in sys.modules]
        assert not loaded, loaded
        """
    )
    out = run_py(code, tmp_path)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["n_tree_tokens"] == 4


def test_console_script_version(tmp_path):
    exe = sys.executable.rsplit("/", 1)[0] + "/treepack"
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, cwd=tmp_path, check=False)
    assert out.returncode == 0 and out.stdout.startswith("treepack ")


def test_cli_start_imports_no_heavy_library(tmp_path):
    """`treepack stats` must start fast: no torch, matplotlib or polars on the way in."""
    code = textwrap.dedent(
        """
        import sys
        import treepack.cli.app
        heavy = sorted(m for m in ("torch", "triton", "matplotlib", "polars", "networkx") if m in sys.modules)
        print(",".join(heavy))
        """
    )
    out = run_py(code, tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""
