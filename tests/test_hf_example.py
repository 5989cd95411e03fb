"""The examples run: the plain GRPO loop on a tiny random model (CPU, float64) trains exactly like the same
loop with per-sequence log-probs; the padded bridge TRL's and verl's actors call (`padded_logprobs`) gives the
model's own per-row log-probs in their [B, C] layout, in the caller's row chunks and dtype. The trainers
themselves run in tests/test_trl.py and tests/test_verl.py."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from hf_models import reference_logprobs, tiny_model

import treepack.hf.logprobs as hf_logprobs
from treepack.errors import TreepackError
from treepack.hf import exact_float64, padded_logprobs

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load(name: str, monkeypatch):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


def test_plain_grpo_loop_trains_like_per_sequence(monkeypatch):
    ex = load("hf_grpo", monkeypatch)
    prompts = [[2, 3, 5, 7], [11, 13]]
    runs = []
    for logprobs in (ex.token_logprobs, reference_logprobs):
        model = ex.tiny_model(dtype=torch.float64)
        lines = []
        with exact_float64():
            history = ex.train(model, prompts, steps=2, group_size=3, max_new_tokens=5, logprobs=logprobs,
                               log=lines.append)
        runs.append((history, {n: p.detach().clone() for n, p in model.named_parameters()}, lines))
    (h_tree, p_tree, lines), (h_ref, p_ref, _) = runs
    assert h_tree == h_ref and len(lines) == 2 and lines[0].startswith("step 001 | reward ")
    for name, p in p_ref.items():
        assert float((p_tree[name] - p).abs().max()) <= 1e-9 * max(float(p.abs().max()), 1e-6), name
    assert any(float((p_tree[n] - ex.tiny_model(dtype=torch.float64).state_dict()[n]).abs().max()) > 0
               for n in p_tree)  # it did train


def _padded_batch():
    prompts, comps = [[5, 6, 7], [9, 10, 11, 12]], [[1, 2, 3], [1, 2, 4, 5], [7], [3, 3, 3, 3]]
    P, C = 4, 4
    ids = torch.zeros(4, P + C, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, c in enumerate(comps):
        p = prompts[i // 2]
        ids[i, P - len(p):P], mask[i, P - len(p):P] = torch.tensor(p), 1
        ids[i, P:P + len(c)], mask[i, P:P + len(c)] = torch.tensor(c), 1
    return ids, mask, C


def _reference_rows(model, ids, mask, C, temperature):
    rows = []
    for b in range(ids.shape[0]):
        cols = torch.nonzero(mask[b])[:, 0]
        row = torch.zeros(C, dtype=torch.float64)
        lp = reference_logprobs(model, [ids[b, cols].tolist()], temperature=temperature)[0]
        keep = cols[1:] >= ids.shape[1] - C
        row[cols[1:][keep] - (ids.shape[1] - C)] = lp[keep]
        rows.append(row)
    return torch.stack(rows)


def test_padded_bridge_returns_the_trainers_layout_in_their_chunks_and_dtype(monkeypatch):
    model = tiny_model("qwen3")
    ids, mask, C = _padded_batch()
    forwards = []
    inner = hf_logprobs.token_logprobs
    monkeypatch.setattr(hf_logprobs, "token_logprobs",
                        lambda m, seqs, **kw: forwards.append(len(seqs)) or inner(m, seqs, **kw))
    with exact_float64():
        lp, ent = padded_logprobs(model, ids, mask, C, temperature=0.9, return_entropy=True)
        ref = _reference_rows(model, ids, mask, C, 0.9)
    lp3, ent3 = padded_logprobs(model, ids, mask, C, temperature=0.9, return_entropy=True, batch_size=3,
                                dtype=torch.float32)  # outside exact_float64, which keeps float64 from casting
    assert forwards == [4, 3, 1]  # all rows in one tree; then TRL's chunks of 3 rows: 3 + 1
    assert lp.shape == ent.shape == (4, C) and lp.dtype == torch.float64
    assert float((lp.detach() - ref).abs().max()) <= 1e-9
    assert lp3.dtype == ent3.dtype == torch.float32  # what TRL's fused head returns, whatever the model's dtype
    assert float((lp3 - lp).abs().max()) <= 1e-6 and float((ent3 - ent).abs().max()) <= 1e-6
    with pytest.raises(TreepackError) as e:
        padded_logprobs(model, ids, mask, C, batch_size=0)
    assert str(e.value) == "batch_size must be >= 1, got 0"


@pytest.mark.parametrize("arch", ["qwen3", "gemma2", "jetmoe"])  # the head: linear, soft-capped, the model's own
def test_entropy_carries_its_gradient_like_the_models_own_forward(arch):
    """verl's entropy_coeff trains on the entropy: its gradient must be the per-row forward's."""
    ids, mask, C = _padded_batch()
    grads = []
    for tree in (True, False):
        model = tiny_model(arch)
        with exact_float64():
            if tree:
                _, ent = padded_logprobs(model, ids, mask, C, return_entropy=True)
            else:
                ent = torch.zeros(ids.shape[0], C, dtype=torch.float64)
                for b in range(ids.shape[0]):
                    cols = torch.nonzero(mask[b])[:, 0]
                    logp = torch.log_softmax(model(input_ids=ids[b, cols][None]).logits[0, :-1], -1)
                    keep = cols[1:] >= ids.shape[1] - C
                    ent[b, cols[1:][keep] - (ids.shape[1] - C)] = -(logp.exp() * logp).sum(-1)[keep]
            (ent * torch.arange(1, C + 1)).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    tree_g, ref_g = grads
    assert max(float((tree_g[n] - g).abs().max()) / max(float(g.abs().max()), 1e-12) for n, g in ref_g.items()) <= 1e-9
