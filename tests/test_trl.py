"""TRL's real GRPOTrainer against treepack's TreeGRPOTrainer (treepack.hf.trl), on CPU with a tiny random Qwen3
saved to a temporary folder and the bundled chat tokenizer (nothing comes from a hub).

The two trainers start from the same weights and seed; completions are sampled identically, so every logged
metric must agree to float32 rounding. The override must also keep TRL's memory budget (its ``batch_size``
chunks) and dtype, and ``whole_groups`` must put every prompt's G completions into the same loss call.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
from hf_models import tiny_model
from transformers import AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

import treepack.hf.logprobs as hf_logprobs
from treepack.hf.trl import TreeGRPOTrainer, group_runs, shuffle_groups

TOKENIZER = Path(__file__).resolve().parents[1] / "treepack" / "datasets" / "samples" / "chat_tokenizer"
PROMPTS = ["add 2 and 3", "name a colour", "count to three", "say hi"]
G = 4


def reward_len(completions, **kwargs):
    return [float(len(c[0]["content"]) % 7) for c in completions]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Qwen3 with the sample tokenizer, saved where TRL loads policy and reference from."""
    path = tmp_path_factory.mktemp("tiny_qwen3")
    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    tiny_model("qwen3", dtype=torch.float32, vocab_size=len(tok), std=0.1).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def train(cls, model_dir, out, *, steps=3, spg=1, completion=8, spy=None, bf16=False, **kwargs):
    """Run ``cls`` for ``steps`` steps; (logged metrics per step, the trainer)."""
    args = GRPOConfig(output_dir=str(out), per_device_train_batch_size=8, num_generations=G,
                      gradient_accumulation_steps=spg, max_completion_length=completion, max_steps=steps, beta=0.04,
                      learning_rate=1e-2, logging_steps=1, report_to="none", use_cpu=True, bf16=bf16, seed=0,
                      save_strategy="no", disable_tqdm=True)
    dataset = datasets.Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in PROMPTS]})
    trainer = cls(model=str(model_dir), reward_funcs=reward_len, args=args, train_dataset=dataset,
                  processing_class=AutoTokenizer.from_pretrained(model_dir), **kwargs)
    if spy is not None:
        inner = trainer._get_per_token_logps_and_entropies

        def recorded(model, input_ids, attention_mask, logits_to_keep, batch_size=None, **kw):
            out = inner(model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size, **kw)
            spy.append({"rows": input_ids.shape[0], "batch_size": batch_size, "grad": torch.is_grad_enabled(),
                        "dtype": out[0].dtype, "per_prompt": completions_per_prompt(input_ids, attention_mask,
                                                                                    logits_to_keep)})
            return out

        trainer._get_per_token_logps_and_entropies = recorded
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h], trainer


def completions_per_prompt(input_ids, attention_mask, logits_to_keep) -> list[int]:
    P = input_ids.shape[1] - logits_to_keep
    prompts = [tuple(row[m.bool()].tolist()) for row, m in zip(input_ids[:, :P], attention_mask[:, :P])]
    return sorted(Counter(prompts).values())


def test_tree_grpo_trainer_logs_what_grpo_trainer_logs(model_dir, tmp_path):
    calls = []
    ref, _ = train(GRPOTrainer, model_dir, tmp_path / "trl")
    tree, trainer = train(TreeGRPOTrainer, model_dir, tmp_path / "tree", spy=calls)
    assert len(ref) == len(tree) == 3
    assert type(trainer)._get_per_token_logps_and_entropies is TreeGRPOTrainer._get_per_token_logps_and_entropies
    for step, (a, b) in enumerate(zip(ref, tree)):
        assert a["reward"] == b["reward"] and a["num_tokens"] == b["num_tokens"], step  # same completions
        for key in ("loss", "kl", "grad_norm", "entropy"):  # kl and loss: differences of log-probs near -8,
            # whose float32 rounding is ~1e-6 each (measured: at most 2.3e-6 here)
            assert math.isclose(a[key], b[key], rel_tol=1e-5, abs_tol=1e-5), (step, key, a[key], b[key])
    assert ref[1]["kl"] > 0 and ref[0]["grad_norm"] > 0  # it trained, against a reference model
    assert calls and all(c["dtype"] == torch.float32 for c in calls)


def test_tree_calls_keep_trls_batch_size_and_whole_groups_keep_prompts_together(model_dir, tmp_path, monkeypatch):
    forwards = []
    token_logprobs = hf_logprobs.token_logprobs

    def counted(model, sequences, **kw):
        forwards.append(len(sequences))
        return token_logprobs(model, sequences, **kw)

    monkeypatch.setattr(hf_logprobs, "token_logprobs", counted)
    rows, groups = [], []
    _, trainer = train(TreeGRPOTrainer, model_dir, tmp_path / "rows", steps=2, spg=2, completion=4, spy=rows)
    _, trainer = train(TreeGRPOTrainer, model_dir, tmp_path / "groups", steps=2, spg=2, completion=4, spy=groups,
                       whole_groups=True)
    # the reference pass scores 16 rows with TRL's batch_size 8: two tree forwards of 8 rows, never one of 16
    no_grad = [c for c in rows + groups if not c["grad"]]
    assert no_grad and all(c["rows"] == 16 and c["batch_size"] == 8 for c in no_grad)
    assert max(forwards) == 8
    # the loss calls: TRL's row shuffle splits groups; whole_groups keeps each prompt's 4 completions together
    loss_rows = [c["per_prompt"] for c in rows if c["grad"]]
    loss_groups = [c["per_prompt"] for c in groups if c["grad"]]
    assert len(loss_rows) == len(loss_groups) == 4
    assert all(p == [G, G] for p in loss_groups) and trainer.whole_group_fallbacks == 0
    assert any(p != [G, G] for p in loss_rows)


def test_bf16_mixed_precision_passes_the_self_check(model_dir, tmp_path):
    """accelerate wraps the float32 model's forward in bf16 autocast (TRL's bf16 = True): the self-check
    judges the tree by bf16's tolerance (it failed at float32's before)."""
    calls = []
    logs, _ = train(TreeGRPOTrainer, model_dir, tmp_path / "bf16", steps=1, completion=4, spy=calls, bf16=True)
    assert len(logs) == 1 and math.isfinite(logs[0]["loss"]) and logs[0]["grad_norm"] > 0
    assert calls and all(c["dtype"] == torch.float32 for c in calls)


def test_shuffle_groups_moves_whole_groups_and_every_value_alike():
    torch.manual_seed(0)
    batch = {"prompt_ids": torch.tensor([[1, 1], [1, 1], [2, 3], [2, 3], [4, 4], [4, 4]]),
             "prompt_mask": torch.ones(6, 2, dtype=torch.long), "names": list("aabbcc"),
             "num_items": torch.tensor(12), "old": None}
    assert group_runs(batch, 2) and not group_runs(batch, 3)
    out = shuffle_groups(batch, 2)
    assert group_runs(out, 2) and out["num_items"] is batch["num_items"] and out["old"] is None
    assert out["names"] == [{1: "a", 2: "b", 4: "c"}[int(r[0])] for r in out["prompt_ids"]]
    assert sorted(out["prompt_ids"][:, 1].tolist()) == sorted(batch["prompt_ids"][:, 1].tolist())
