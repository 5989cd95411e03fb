"""Working weights (`treepack.train.working_weights`): 16-bit copies of the weights give the same forward and the
same float32 gradients as autocast's per-call casts in every mode and across packs: the matrices' bit for bit,
the embedding's and the head's (written into ``.grad`` in place) up to the order of float32 additions."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from cli_helpers import run
from test_equivalence import make_pack, random_sequences
from test_train_cli import metrics, write_config
from torch.utils._python_dispatch import TorchDispatchMode

from treepack.train import working_weights
from treepack.train.config import DfsConfig
from treepack.train.losses import BatchTotals, LossRows, Objective
from treepack.train.model import Decoder, ModelArgs
from treepack.train.modes import make_mode
from treepack.train.working_weights import WorkingWeights, applies

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


def model_on(device: str, family: str = "qwen3") -> Decoder:
    args = ModelArgs.for_family(family, vocab_size=72, hidden_size=64, intermediate_size=128, num_layers=2,
                                num_heads=4, num_kv_heads=2, head_dim=16)
    model = Decoder.random_init(args, seed=3, dtype=torch.float32, device=device)
    model.compile = "off"
    return model


def grads_after(model: Decoder, mode_name: str, packs, objective: Objective, device: str) -> dict[str, torch.Tensor]:
    """Parameter gradients after forward and backward of every pack (summed, as a step's packs are)."""
    mode = make_mode(mode_name, attention="reference", dfs=DfsConfig(block_size=9))  # deterministic on every device
    rows = [LossRows.from_pack(p) for p in packs]
    totals = BatchTotals.of(rows)
    model.zero_grad(set_to_none=True)
    for pack, row in zip(packs, rows):
        with torch.autocast(device, dtype=torch.bfloat16):
            out = mode(model, pack, row, objective, totals)
        out.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode_name", ["tree", "dfs", "dense-leaf"])
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_the_same_gradients_bit_for_bit(device, mode_name, family):
    rng = np.random.default_rng(7)
    packs = [make_pack(random_sequences(rng, 10), seed) for seed in (0, 1)]
    objective = Objective("grpo", "token")
    model = model_on(device, family)
    assert applies(model, torch.bfloat16)
    torch.manual_seed(0)
    plain = grads_after(model, mode_name, packs, objective, device)
    working = WorkingWeights(model, torch.bfloat16)
    assert len(working.pairs) == 7 * model.args.num_layers
    torch.manual_seed(0)
    copied = grads_after(model, mode_name, packs, objective, device)
    assert plain.keys() == copied.keys()
    in_place = {id(p) for p in working.in_place}
    read = torch.zeros(model.args.vocab_size, dtype=torch.bool, device=device)  # embedding rows the packs look up
    for pack in packs:
        read[torch.as_tensor(np.asarray(pack.input_ids[: pack.n_real]), device=device)] = True
    for name, param in model.named_parameters():
        if id(param) not in in_place:
            assert torch.equal(plain[name], copied[name]), name
            continue
        # the head's GEMM and the embedding's rows are added into .grad one after the other, not summed first
        scale = plain[name].abs().max()
        assert (copied[name] - plain[name]).abs().max() <= 1e-6 * scale, name
        if name == "model.embed_tokens.weight":  # rows no lookup reads hold the head's terms alone: same bits
            assert torch.equal(copied[name][~read], plain[name][~read]), name
    assert all(c.grad is None for c in working.copies)  # each call's bf16 gradient is handed on, not kept
    with torch.no_grad():  # the layers read the copies: changed copies change the gradients
        torch._foreach_mul_(working.copies, 0.5)
    torch.manual_seed(0)
    assert not torch.equal(grads_after(model, mode_name, packs, objective, device)["model.norm.weight"],
                           plain["model.norm.weight"])


class _VocabSized(TorchDispatchMode):
    """Records the ops that return a new [V, D] tensor (a dense gradient of the embedding or the head)."""

    def __init__(self, shape: tuple[int, int]) -> None:
        super().__init__()
        self.shape, self.ops = shape, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func._schema.is_mutable and not func.is_view and isinstance(out, torch.Tensor) and tuple(out.shape) == self.shape:
            self.ops.append(func.__name__)
        return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode_name", ["tree", "dfs"])
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_head_and_embedding_gradients_go_into_grad_in_place(device, mode_name, family):
    """Once ``.grad`` exists, a call makes no dense [V, D] gradient: the head's GEMMs accumulate into ``.grad``
    and the embedding adds its rows. Without working weights each call makes them (the A/B)."""
    rng = np.random.default_rng(7)
    packs = [make_pack(random_sequences(rng, 10), seed) for seed in (0, 1)]
    objective = Objective("grpo", "token")
    rows = [LossRows.from_pack(p) for p in packs]
    totals = BatchTotals.of(rows)
    mode = make_mode(mode_name, attention="reference", dfs=DfsConfig(block_size=9))
    made = {}
    for working in (False, True):
        model = model_on(device, family)
        if working:
            WorkingWeights(model, torch.bfloat16)
        args = model.args
        with torch.autocast(device, dtype=torch.bfloat16):
            mode(model, packs[0], rows[0], objective, totals).backward()  # the first call makes .grad
            record = _VocabSized((args.vocab_size, args.hidden_size))
            with record:
                mode(model, packs[1], rows[1], objective, totals).backward()
        made[working] = record.ops
    # on the CPU the GEMM has no float32 output for 16-bit inputs: it forms its product in bf16, then casts it
    gemm = {"mm.default", "_to_copy.default"} if device == "cpu" else set()
    assert set(made[True]) <= gemm, made[True]
    assert {"embedding_dense_backward.default", "empty_like.default"} <= set(made[False]), made[False]


def test_refresh_writes_the_new_values_into_the_same_buffers():
    model = model_on("cpu")
    working = WorkingWeights(model, torch.bfloat16)
    before = [c.data_ptr() for c in working.copies]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.125)
    working.refresh()
    assert [c.data_ptr() for c in working.copies] == before
    assert all(torch.equal(c, p.to(torch.bfloat16)) for p, c in working.pairs)
    assert torch.equal(working.head, model.head_weight.to(torch.bfloat16))
    working.remove()
    assert model.working_weights is None and all(layer.working is None for layer in model.model.layers)


def test_where_working_weights_apply(monkeypatch):
    model = model_on("cpu")
    assert applies(model, torch.bfloat16) and applies(model, torch.float16)
    assert not applies(model, None)  # full precision: nothing is cast
    assert not applies(model.to(torch.float64), torch.bfloat16)  # the parameters are not float32
    monkeypatch.setattr(working_weights, "ENABLED", False)
    assert not applies(model_on("cpu"), torch.bfloat16)


@pytest.mark.parametrize("mode_name", ["tree", "dfs"])
def test_a_bf16_run_logs_the_same_steps_with_and_without(tmp_path, monkeypatch, mode_name):
    """`treepack train` in bf16 autocast (the copies refreshed after every optimizer step) against the same run
    with the copies off: the same losses and gradient norms at every step."""
    runs = {}
    for name, enabled in (("on", True), ("off", False)):
        monkeypatch.setattr(working_weights, "ENABLED", enabled)
        extra = "[train.dfs]\nblock_size = 4\n" if mode_name == "dfs" else ""
        r = run("train", write_config(tmp_path, mode=mode_name, steps=4, out=name, dtype="bfloat16", extra=extra))
        assert r.code == 0, r.err
        runs[name] = [(m["loss"], m["grad_norm"]) for m in metrics(tmp_path / name)]
    assert runs["on"] == runs["off"]
