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
