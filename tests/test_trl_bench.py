"""CPU smoke run of ``benchmarks/trl_grpo.py`` (TRL's GRPO step with and without treepack): the tiny model
through both trainers, the report's table, and TRL and treepack agreeing on loss, entropy, log-probs and
gradient norm (the GPU numbers come from running the script on one GPU)."""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("trl")
pytest.importorskip("datasets")

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "trl_grpo.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("trl_grpo_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve annotations there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def test_trl_grpo_benchmark_cpu_smoke(bench, tmp_path, capsys):
    out = tmp_path / "report.md"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: threads only add contention
    try:
        rc = bench.main(["--tiny", "--configs", "4x2,8x1:gc", "--steps", "1", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    printed = capsys.readouterr().out
    diffs = [float(x) for x in re.findall(r"^loss max abs diff: (\S+) ", printed, re.MULTILINE)]
    assert len(diffs) == 2 and all(d < 1e-4 for d in diffs), printed
    text = out.read_text()
    # seed 0: prompts of 60 and 62 tokens, 4 completions each of 22-31 (8 rows x 93 padded, 4 x 122 + 218 real,
    # 122 + 218 in the tree); seed 1: one prompt of 47 tokens, 8 completions of 17-30
    for variant in ("trl", "tree"):
        assert f"| G 4 x 2 prompts | 8 | 744 | 706 | 340 | {variant} |" in text
        assert f"| G 8 x 1 prompt, checkpointing | 8 | 616 | 572 | 243 | {variant} |" in text
    assert "- command: `python benchmarks/trl_grpo.py --tiny --configs 4x2,8x1:gc --steps 1 --out report.md`" in text
    rows = re.findall(r"^\| (G [^|]+) \| (\S+) \| (\S+) \| (\S+) \| (\S+) \|$", text, re.MULTILINE)
    assert [r[0] for r in rows] == ["G 4 x 2 prompts", "G 8 x 1 prompt, checkpointing"]
    for _, loss, entropy, logp, grad in rows:  # float32 on CPU: rounding only
        assert float(loss) < 1e-4 and float(entropy) < 1e-5 and float(logp) < 1e-5 and float(grad) < 1e-5


def test_batch_shares_each_prompt_once_in_the_tree(bench):
    cfg = bench.StepConfig(G=4, prompts=3, checkpointing=False)
    batch = bench.make_batch(cfg, (20, 40), (5, 15), 5000, 0, 7, torch.device("cpu"))
    P, C = sum(batch.prompt_lengths), sum(batch.completion_lengths)
    assert batch.real_tokens == 4 * P + C
    assert batch.padded_tokens == 12 * (max(batch.prompt_lengths) + max(batch.completion_lengths))
    assert batch.tree_tokens() == P + C  # random completions branch at their first token
    # TRL's layout: prompts padded on the left, completions on the right; each group of 4 rows, one prompt
    assert bool(batch.prompt_mask_BP[:, -1].all()) and bool(batch.completion_mask_BC[:, 0].all())
    ids = batch.prompt_ids_BP.masked_fill(batch.prompt_mask_BP == 0, -1).view(3, 4, -1)
    assert bool((ids == ids[:, :1]).all())
    advantages = batch.advantages_B.view(3, 4)
    assert torch.allclose(advantages.mean(1), torch.zeros(3), atol=1e-6)


def test_config_and_range_errors_name_the_bad_value(bench):
    assert bench.parse_configs("8x1, 16x2:gc") == [bench.StepConfig(8, 1, False), bench.StepConfig(16, 2, True)]
    assert bench.parse_range("1K-4K") == (1024, 4096) and bench.parse_range("256-1024") == (256, 1024)
    cases = [(bench.parse_configs, "8x2:fast", "config '8x2:fast': the only suffix is ':gc', got ':fast'"),
             (bench.parse_configs, "8", "config '8': expected GxPROMPTS like 8x2"),
             (bench.parse_configs, "1x4", "config '1x4': G must be >= 2 and PROMPTS >= 1"),
             (bench.parse_range, "4K", "length range '4K': expected LO-HI like 1K-4K"),
             (bench.parse_range, "4K-1K", "length range '4K-1K': need 1 <= LO <= HI")]
    for parse, text, message in cases:
        with pytest.raises(argparse.ArgumentTypeError) as e:
            parse(text)
        assert str(e.value) == message


def test_an_out_of_memory_variant_is_reported_and_the_run_goes_on(bench, tmp_path, capsys, monkeypatch):
    one_step = bench.one_step

    def trl_runs_out(trainer, *args, **kwargs):
        if type(trainer).__name__ == "GRPOTrainer":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return one_step(trainer, *args, **kwargs)

    monkeypatch.setattr(bench, "one_step", trl_runs_out)
    out = tmp_path / "report.md"
    assert bench.main(["--tiny", "--configs", "4x2", "--steps", "1", "--out", str(out)]) == 0
    assert "trl: out of memory (CUDA out of memory. Tried to allocate 20.00 GiB)" in capsys.readouterr().out
    text = out.read_text()
    assert "| G 4 x 2 prompts | 8 | 744 | 706 | 340 | trl | - | - | OOM | - | - | - |" in text
    assert re.search(r"^\| G 4 x 2 prompts \| 8 \| 744 \| 706 \| 340 \| tree \| [\d.]+ \| [\d.]+ \| [\d.]+ \| - \| - \| - \|$",
                     text, re.MULTILINE)
    assert "| G 4 x 2 prompts | - | - | - | - |" in text and "Total run time" in text
