"""dfs calls as CUDA graphs (`treepack.train.modes.dfs_graphs`): whole steps against eager dfs and float64.

A shape runs eagerly the first time it is met, is captured the second time, and replays after that. Every step's loss and gradients
must be as close to the float64 reference as eager dfs with the same kernel (FA4's dQ atomics make neither
bitwise reproducible), and replays must have happened.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_equivalence import make_pack
from test_fa4_gpu import _fa4_ready, _long_branches, autocast_step

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _fa4_ready(), reason="needs CUDA sm90/sm100 and flash-attn-4")]


def _deep_branches(rng: np.random.Generator) -> list[list[int]]:
    """A 1,300-token trunk with branches: prefixes of several buckets, anchors and merged anchors at block 256."""
    trunk = rng.integers(0, 13, 1300).tolist()
    seqs = [trunk + rng.integers(0, 13, int(rng.integers(100, 400))).tolist() for _ in range(3)]
    seqs += [seqs[1][:1500] + rng.integers(0, 13, 120).tolist(), trunk[:600] + rng.integers(0, 13, 50).tolist()]
    return seqs


@pytest.mark.parametrize(("objective_kind", "exact", "working"),
                         [("grpo", True, False), ("sft", True, False), ("grpo", False, False), ("grpo", True, True)])
def test_graphed_dfs_steps_are_as_close_as_eager(objective_kind, exact, working, monkeypatch):
    """Shapes are captured the second time they are met: with ``exact`` (the default) at their exact sizes (steps
    1-2 capture, step 3 replays), without at their buckets. With ``working``, the 16-bit models read working
    weights, whose gradient hooks run inside the captured backwards."""
    from treepack.train.config import DfsConfig
    from treepack.train.losses import Objective
    from treepack.train.model import Decoder, ModelArgs
    from treepack.train.modes import dfs_graphs, make_mode
    from treepack.train.working_weights import WorkingWeights

    args = ModelArgs.for_family("qwen3", vocab_size=13, hidden_size=256, intermediate_size=512, num_layers=2,
                                num_heads=4, num_kv_heads=2, head_dim=64)
    packs = [make_pack(_long_branches(np.random.default_rng(5)), 0), make_pack(_deep_branches(np.random.default_rng(7)), 1)]
    objective = Objective(objective_kind, "token")
    monkeypatch.setattr(dfs_graphs, "EXACT_REPEATS", exact)

    def steps(dtype, attention, compile_mode, graphs, n_steps):
        model = Decoder.random_init(args, seed=0, dtype=dtype, device="cuda")
        model.compile = compile_mode
        if working and dtype == torch.float32:
            WorkingWeights(model, torch.bfloat16)
        mode = make_mode("dfs", attention=attention, dfs=DfsConfig(block_size=256, cuda_graphs=graphs))
        out_steps, counts = [], []
        for _ in range(n_steps):
            model.zero_grad(set_to_none=True)
            out_steps.append(autocast_step(model, mode, packs, objective))
            g = mode._graphs
            counts.append((g.captures, g.replays, g.eager) if g is not None else None)
        return out_steps, mode, counts

    def error(step, ref):
        loss, grads = step
        ref_loss, ref_grads = ref
        return (abs(loss - ref_loss) / abs(ref_loss),
                max(float((grads[n] - ref_grads[n]).abs().max()) / max(float(ref_grads[n].abs().max()), 1e-12)
                    for n in ref_grads))

    (ref,), _, _ = steps(torch.float64, "reference", "off", False, 1)
    (eager,), _, _ = steps(torch.float32, "fa4", "on", False, 1)
    graphed, mode, counts = steps(torch.float32, "fa4", "on", True, 3)
    g = mode._graphs
    assert g is not None and g.failed is None
    assert g.captures > 0 and g.replays > 0, (g.captures, g.replays)
    eager_err = error(eager, ref)
    for k, step in enumerate(graphed):
        err = error(step, ref)
        for i, what in enumerate(("loss", "grad")):
            # an exact-equivalent call differs only by FA4's float32 atomics; a lost or misplaced dK/dV row or a
            # padding token leaking into a real one is of the order of the gradient itself
            assert err[i] <= 1.5 * eager_err[i] + 2e-3, f"step {k} {what}: graphs {err[i]:.3g}, eager {eager_err[i]:.3g}"
    # every shape of the third step was met twice before: it replays graphs only, no capture, no eager call
    (captures_2, replays_2, eager_2), (captures_3, replays_3, eager_3) = counts[1], counts[2]
    assert (captures_3, eager_3) == (captures_2, eager_2) and replays_3 > replays_2, counts
    padded = [key[1] % g.token_bucket == 0 and key[2] % g.prefix_bucket == 0 for key in g.graphs]
    assert (not all(padded)) if exact else all(padded)
