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

from treepack.train.config import DfsConfig
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
    options = {"dfs": DfsConfig(block_size=7)} if mode == "dfs" else {}
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


@pytest.mark.parametrize("weights", ["float32-autocast", "bfloat16"])
def test_logprob_backward_vocab_blocks_on_cuda(weights):
    """Several vocabulary blocks in backward, on cuBLAS's 16-bit-in, float32-out GEMM (float32 weights under
    autocast) or a plain bf16 GEMM (bf16 weights): log-probs and gradients within bf16 error of a float64
    reference, and the wide GEMM is used, not its fallback."""
    from treepack.train import losses

    torch.manual_seed(0)
    R, V, D = 700, 3000, 64
    dtype = torch.float32 if weights == "float32-autocast" else torch.bfloat16
    h = torch.randn(R, D, device="cuda", dtype=dtype, requires_grad=True)
    w = (0.3 * torch.randn(V, D, device="cuda")).to(dtype).requires_grad_()
    t = torch.randint(0, V, (R,), device="cuda")
    coef = torch.linspace(-1, 1, R, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.float32):
        lp = target_logprobs(h, w, t, chunk_rows=100, compiled=True)  # 7 row chunks, 6 vocabulary blocks
    (lp * coef).sum().backward()
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = torch.log_softmax(h64 @ w64.T, dim=-1).gather(1, t[:, None])[:, 0]
    (ref * coef.double()).sum().backward()
    assert losses.vocab_block(R, V, 100) < V and losses._WIDE_GEMM["cuda"]
    assert float((lp.double() - ref).abs().max()) <= 0.05 * float(ref.abs().max())
    for got, want in ((h.grad, h64.grad), (w.grad, w64.grad)):
        assert got.dtype == dtype
        assert float((got.double() - want).abs().max()) <= 0.02 * float(want.abs().max())
