"""The compiled elementwise regions (`treepack.train.compiled`) compute the eager model's function.

On CUDA only (compile = "auto" is off elsewhere): a bf16-autocast step with ``compile = "on"`` must be as
close to a float64 reference as the eager bf16 step is (within 2x its error plus a small floor), for
tree, dense and dfs modes, loss, log-probs and every parameter gradient; and both must agree with each
other. Also checks that the dynamic-shape compilation serves packs and chunks of new lengths.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_equivalence import make_pack, random_sequences

from treepack.train.losses import BatchTotals, LossRows, Objective, target_logprobs
from treepack.train.model import Decoder, ModelArgs
from treepack.train.modes import make_mode

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

VOCAB = 13


def _args() -> ModelArgs:
    return ModelArgs.for_family("qwen3", vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_layers=2,
                                num_heads=4, num_kv_heads=2, head_dim=64)


def _step(model: Decoder, packs, mode: str, objective: Objective, autocast: bool, **options):
    rows = [LossRows.from_pack(p) for p in packs]
    totals = BatchTotals.of(rows)
    model.zero_grad(set_to_none=True)
    m = make_mode(mode, **options)
    loss, logps = 0.0, []
    for p, r in zip(packs, rows):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            out = m(model, p, r, objective, totals)
        out.backward()
        loss += float(out.loss)
        logps.append(out.logp_R.detach().double())
    return loss, torch.cat(logps), {n: p.grad.detach().double() for n, p in model.named_parameters()}


def _max_rel(grads, ref) -> float:
    return max(float((grads[n] - ref[n]).abs().max()) / max(float(ref[n].abs().max()), 1e-12) for n in ref)


@pytest.mark.parametrize("mode", ["tree", "dense", "dfs"])
def test_compiled_matches_eager_error(mode):
    seqs = random_sequences(np.random.default_rng(3), 24)
    packs = [make_pack(seqs[:12], 0), make_pack(seqs[12:], 1)]  # two lengths: no recompile needed
    objective = Objective("grpo", "token")
    options = {"dfs_block_size": 7} if mode == "dfs" else {}
    ref_model = Decoder.random_init(_args(), seed=0, dtype=torch.float64, device="cuda")
    ref_model.compile = "off"
    ref = _step(ref_model, packs, mode, objective, False, attention="reference", **options)
    results = {}
    for compile_mode in ("off", "on"):
        model = Decoder.random_init(_args(), seed=0, dtype=torch.float32, device="cuda")
        model.compile = compile_mode
        results[compile_mode] = _step(model, packs, mode, objective, True, **options)
    errs = {}
    for key, (loss, logp, grads) in results.items():
        errs[key] = (abs(loss - ref[0]) / abs(ref[0]), float((logp - ref[1]).abs().max()), _max_rel(grads, ref[2]))
    for i, what in enumerate(("loss", "logp", "grad")):
        assert errs["on"][i] <= 2 * errs["off"][i] + 1e-3, f"{mode} {what}: compiled {errs['on'][i]:.3g}, eager {errs['off'][i]:.3g}"


def test_compiled_logprobs_match_eager():
    torch.manual_seed(0)
    h = torch.randn(300, 64, device="cuda", requires_grad=True)
    w = torch.randn(1000, 64, device="cuda", requires_grad=True)
    t = torch.randint(0, 1000, (300,), device="cuda")
    outs = []
    for compiled in (False, True):
        for n in (300, 97):  # a second length: the dynamic-shape compilation serves it
            h.grad = w.grad = None
            with torch.autocast("cuda", dtype=torch.bfloat16):
                lp = target_logprobs(h[:n], w, t[:n], chunk_rows=128, compiled=compiled)
            (lp * torch.linspace(-1, 1, n, device="cuda")).sum().backward()
            outs.append((lp.detach(), h.grad.clone(), w.grad.clone()))
    for eager, comp in zip(outs[:2], outs[2:]):
        for a, b in zip(eager, comp):
            assert torch.allclose(a, b, rtol=2e-2, atol=2e-2 * float(a.abs().max())), float((a - b).abs().max())
