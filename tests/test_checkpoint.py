"""Checkpoints (`treepack.train.checkpoint`): a saved run resumes bit for bit, whichever AdamW implementation
the saving and the resuming process use (torch's fused kernel on CUDA keeps its step count on the GPU, the
multi-tensor loop on the CPU); hyper-parameters come from the checkpoint, the implementation from the
resuming run."""

from __future__ import annotations

import pytest
import torch

from treepack.train.checkpoint import load_checkpoint, save_checkpoint
from treepack.train.config import RunConfig
from treepack.train.loop import make_optimizer
from treepack.train.model import Decoder, ModelArgs

ARGS = ModelArgs.for_family("qwen3", vocab_size=17, hidden_size=32, intermediate_size=64, num_layers=2,
                            num_heads=4, num_kv_heads=2, head_dim=8)


def _step(model: Decoder, optimizer: torch.optim.Optimizer, seed: int) -> None:
    """One AdamW step on a fixed random gradient per parameter."""
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype).to(p.device)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _use(opt: torch.optim.AdamW, implementation: str) -> torch.optim.AdamW:
    """Switch ``opt`` to torch's fused kernel or its multi-tensor loop (the step counts where each needs them)."""
    for group in opt.param_groups:  # make_optimizer's choice is fused on CUDA, the loop elsewhere
        group["fused"] = True if implementation == "fused" else None
        group["foreach"] = True if implementation == "foreach" else None
        for p in group["params"]:
            if "step" in opt.state.get(p, {}):
                opt.state[p]["step"] = opt.state[p]["step"].to(p.device if implementation == "fused" else "cpu")
    return opt


def _resume_matches(tmp_path, device: str, saved_with: str, resumed_with: str) -> None:
    whole = Decoder.random_init(ARGS, seed=1, device=device)
    opt = _use(make_optimizer(whole, RunConfig()), saved_with)
    for group in opt.param_groups:
        group["lr"] = 3e-3  # a value the resumed optimizer must take from the checkpoint
    for seed in range(2):
        _step(whole, opt, seed)
    save_checkpoint(tmp_path, whole, opt, {"step": 2})
    _step(whole, _use(opt, resumed_with), 2)  # the two implementations round differently

    resumed = Decoder.random_init(ARGS, seed=9, device=device)
    opt2 = _use(make_optimizer(resumed, RunConfig()), resumed_with)
    assert load_checkpoint(tmp_path, resumed, opt2) == {"step": 2}
    for group in opt2.param_groups:
        assert group["lr"] == 3e-3
        assert (group["fused"], group["foreach"]) == ((True, None) if resumed_with == "fused" else (None, True))
    for p in resumed.parameters():
        step = opt2.state[p]["step"]
        assert step.device == (p.device if resumed_with == "fused" else torch.device("cpu"))
        assert int(step) == 2
    _step(resumed, opt2, 2)
    for (name, a), (_, b) in zip(whole.named_parameters(), resumed.named_parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("saved_with,resumed_with", [("foreach", "foreach"), ("fused", "foreach"),
                                                     ("foreach", "fused"), ("fused", "fused")])
def test_resume_on_cpu_with_either_adamw(tmp_path, saved_with, resumed_with):
    _resume_matches(tmp_path, "cpu", saved_with, resumed_with)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("saved_with,resumed_with", [("fused", "fused"), ("foreach", "fused"), ("fused", "foreach")])
def test_resume_on_cuda_with_either_adamw(tmp_path, saved_with, resumed_with):
    """The fused kernel needs its step count on the GPU: a checkpoint's counts went to the CPU and the
    first resumed step failed ("state_steps is on cpu")."""
    _resume_matches(tmp_path, "cuda", saved_with, resumed_with)


def _saved(tmp_path) -> tuple[Decoder, torch.optim.AdamW]:
    model = Decoder.random_init(ARGS, seed=1, dtype=torch.float64)
    opt = make_optimizer(model, RunConfig())
    _step(model, opt, 0)
    return model, opt


def test_a_failed_save_keeps_the_previous_checkpoint_and_leaves_nothing(tmp_path, monkeypatch):
    """The save writes a hidden directory and swaps it in only when every file is written."""
    model, opt = _saved(tmp_path)
    save_checkpoint(tmp_path, model, opt, {"step": 1})
    before = {p.name: p.read_bytes() for p in (tmp_path / "checkpoint").iterdir()}

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("safetensors.torch.save_file", disk_full)
    _step(model, opt, 1)
    with pytest.raises(OSError, match="No space left on device"):
        save_checkpoint(tmp_path, model, opt, {"step": 2})
    assert {p.name: p.read_bytes() for p in (tmp_path / "checkpoint").iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint"]


def test_a_save_removes_what_a_killed_save_left(tmp_path):
    for name in (".checkpoint.999.tmp", ".checkpoint.998.old"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"cut short")
    model, opt = _saved(tmp_path)
    save_checkpoint(tmp_path, model, opt, {"step": 1})
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint"]


@pytest.mark.parametrize("distributed", [False, True])
def test_both_formats_save_through_the_atomic_swap_and_resume_a_plain_model(tmp_path, monkeypatch, distributed):
    """One save path for safetensors and DCP (`treepack.io.atomic.replaced_dir`); either loads into a plain model
    bit for bit (DCP written by one process without a process group)."""
    from treepack.train import checkpoint

    swaps = []
    real = checkpoint.replaced_dir
    monkeypatch.setattr(checkpoint, "replaced_dir", lambda path: swaps.append(path) or real(path))
    model, opt = _saved(tmp_path)
    save_checkpoint(tmp_path, model, opt, {"step": 1, "losses": [2.5]}, distributed=distributed)
    save_checkpoint(tmp_path, model, opt, {"step": 1, "losses": [2.5]}, distributed=distributed)  # over the first
    assert swaps == [tmp_path / "checkpoint"] * 2 and [p.name for p in tmp_path.iterdir()] == ["checkpoint"]
    resumed = Decoder.random_init(ARGS, seed=9, dtype=torch.float64)
    opt2 = make_optimizer(resumed, RunConfig())
    state = load_checkpoint(tmp_path, resumed, opt2)
    assert (state["step"], state["losses"], state.get("format")) == (1, [2.5], "dcp" if distributed else None)
    for (name, a), b in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name
        assert torch.equal(opt.state[a]["exp_avg"], opt2.state[b]["exp_avg"]), name
