"""verl's real DataParallelPPOActor against treepack's TreeDataParallelPPOActor (treepack.hf.verl), on CPU in
float32 with a tiny random Qwen3 and a one-process gloo group: response log-probs and entropies where the
response mask is 1, the policy update's metrics (pg_loss, kl_loss, entropy, grad_norm) and the updated weights.

Skipped unless verl 0.6/0.7 is importable. What blocks it in the dev extra: ``pip install verl`` gives 0.9.1,
which (like 0.8.0) no longer has ``verl.workers.actor.dp_actor.DataParallelPPOActor`` (its FSDP engine
workers replaced it); 0.7.1, the last release with the actor, requires ``numpy<2.0.0`` (this project runs
numpy 2) and pulls ``ray[default]``, wandb and tensorboard. The actor itself runs on CPU with numpy 2 and
torch 2.13; to run this test, install what its imports need and nothing else (pyvers' metadata pins
packaging < 26, which it does not need)::

    pip install --no-deps verl==0.7.1 tensordict==0.10.0 ray==2.52.1 pyvers==0.1.0
    pip install codetiming hydra-core omegaconf orjson cloudpickle protobuf msgpack jsonschema requests \
        importlib_metadata
"""

from __future__ import annotations

import socket

import pytest
import torch

pytest.importorskip("verl.workers.actor.dp_actor", reason="needs verl 0.6/0.7 (see the module docstring)")
from hf_models import tiny_model
from tensordict import TensorDict
from verl import DataProto
from verl.workers.actor.dp_actor import DataParallelPPOActor
from verl.workers.config import FSDPActorConfig, FSDPEngineConfig

from treepack.hf.verl import RETURNS_DICT, TreeDataParallelPPOActor

B, P, R, N = 8, 7, 6, 2  # rows, prompt and response columns, rollout.n


@pytest.fixture(scope="module", autouse=True)
def process_group():
    if torch.distributed.is_initialized():
        yield
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()


def rollout_batch(seed: int = 0) -> TensorDict:
    """verl's layout: prompts padded on the left, responses of different lengths padded on the right; N
    responses per prompt, consecutive rows."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(B, P + R, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b in range(B):
        if b % N == 0:
            prompt = torch.randint(0, 40, (int(torch.randint(3, P + 1, (), generator=g)),), generator=g)
        response = torch.randint(0, 40, (R - b % 3,), generator=g)
        ids[b, P - len(prompt):P], mask[b, P - len(prompt):P] = prompt, 1
        ids[b, P:P + len(response)], mask[b, P:P + len(response)] = response, 1
    return TensorDict({"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
                       "responses": ids[:, P:], "response_mask": mask[:, P:],
                       "advantages": torch.randn(B, 1, generator=g).expand(B, R).contiguous(),
                       "ref_log_prob": -3 + 0.1 * torch.randn(B, R, generator=g)}, batch_size=[B])


def run(cls, batch: TensorDict):
    """compute_log_prob, then update_policy over 2 mini-batches of 2 micro-batches (off-policy ratios)."""
    config = FSDPActorConfig(strategy="fsdp", rollout_n=N, ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2,
                             use_torch_compile=False, fsdp_config=FSDPEngineConfig(dtype="fp32"), use_kl_loss=True,
                             kl_loss_type="low_var_kl", calculate_entropy=True, entropy_coeff=0.01, clip_ratio=0.2)
    model = tiny_model("qwen3", dtype=torch.float32)
    actor = cls(config, model, torch.optim.SGD(model.parameters(), lr=0.5))
    data = DataProto(batch=batch.clone(), meta_info={"micro_batch_size": 4, "temperature": 0.9,
                                                     "use_dynamic_bsz": False})
    scored = actor.compute_log_prob(data, calculate_entropy=True)
    if not isinstance(scored, dict):  # verl 0.6: (log_probs, entropys)
        scored = dict(zip(("log_probs", "entropys"), scored))
    train = batch.clone()
    train["old_log_probs"] = scored["log_probs"].detach() + 0.03 * torch.randn(B, R, generator=torch.Generator()
                                                                                   .manual_seed(1))
    metrics = actor.update_policy(DataProto(batch=train, meta_info={"temperature": 0.9}))
    return scored, metrics, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_tree_actor_scores_and_updates_like_verls_actor():
    batch = rollout_batch()
    (ref, ref_metrics, ref_weights), (tree, metrics, weights) = (run(cls, batch) for cls in
                                                                 (DataParallelPPOActor, TreeDataParallelPPOActor))
    real = batch["response_mask"].bool()  # verl scores padded columns too; every loss masks them out
    for key in ("log_probs", "entropys"):
        assert tree[key].shape == (B, R) and tree[key].dtype == ref[key].dtype == torch.float32, key
        assert float((tree[key] - ref[key])[real].abs().max()) <= 1e-5, key
    assert set(metrics) == set(ref_metrics)
    for key, want in ref_metrics.items():
        got = metrics[key]
        want, got = (want, got) if isinstance(want, list) else ([want], [got])
        assert all(abs(g - w) <= 1e-5 * max(1.0, abs(w)) for g, w in zip(got, want, strict=True)), (key, got, want)
    assert ref_metrics["actor/pg_clipfrac"] != [0.0] * len(ref_metrics["actor/pg_clipfrac"])  # ratios != 1 ran
    assert max(float((weights[n] - w).abs().max()) for n, w in ref_weights.items()) <= 1e-5
    start = dict(tiny_model("qwen3", dtype=torch.float32).named_parameters())
    assert max(float((w - start[n]).abs().max()) for n, w in ref_weights.items()) > 1e-3  # it trained


def test_tree_actor_answers_in_its_parents_form():
    actor = TreeDataParallelPPOActor(
        FSDPActorConfig(strategy="fsdp", rollout_n=N, ppo_micro_batch_size_per_gpu=2, use_torch_compile=False,
                        fsdp_config=FSDPEngineConfig(dtype="fp32")), tiny_model("qwen3", dtype=torch.float32))
    out = actor._forward_micro_batch(dict(rollout_batch().items()), temperature=1.0, calculate_entropy=False)
    if RETURNS_DICT:
        assert set(out) == {"log_probs"} and out["log_probs"].shape == (B, R)
    else:
        assert out[0] is None and out[1].shape == (B, R)
