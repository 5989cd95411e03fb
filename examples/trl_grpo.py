"""TRL's GRPOTrainer with treepack computing the policy's and reference's token log-probs.

`treepack.hf.trl.TreeGRPOTrainer` is TRL's ``GRPOTrainer`` with its log-prob forward tree-packed (the G
completions of a prompt share the prompt once): same arguments, same logged numbers (tests/test_trl.py runs
both on a tiny model and compares loss, kl, grad_norm and entropy). Use it in place of ``GRPOTrainer``::

    from treepack.hf.trl import TreeGRPOTrainer
    trainer = TreeGRPOTrainer(model="path/to/Qwen3-0.6B", reward_funcs=my_reward, args=GRPOConfig(...),
                              train_dataset=dataset, whole_groups=True)
    trainer.train()

``whole_groups=True`` keeps each prompt's completions in one step when ``steps_per_generation`` > 1 (TRL
shuffles rows otherwise: about 2 completions per prompt per loss call instead of G). Give TRL steps that
hold whole groups (``per_device_train_batch_size`` a multiple of ``num_generations``). Needs ``trl>=1.7,<2``.

    python examples/trl_grpo.py --tiny               # CPU: a tiny random Qwen3 and the bundled tokenizer
    python examples/trl_grpo.py --model path/to/checkpoint --steps 100
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

TOKENIZER = Path(__file__).resolve().parents[1] / "treepack" / "datasets" / "samples" / "chat_tokenizer"
PROMPTS = ["add 2 and 3", "name a colour", "count to three", "say hi", "spell cat", "what is 7 x 6?"]


def reward_short(completions, **kwargs) -> list[float]:
    """A toy reward: shorter answers score higher (plug in your own)."""
    return [1.0 / (1 + len(c[0]["content"])) for c in completions]


def tiny_checkpoint(path: Path) -> Path:
    """A random two-layer Qwen3 with the bundled chat tokenizer, saved at ``path`` (no hub)."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="local Hugging Face checkpoint directory (with its tokenizer)")
    ap.add_argument("--tiny", action="store_true", help="a tiny random model on CPU")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--group-size", type=int, default=4)
    args = ap.parse_args(argv)
    if not (args.model or args.tiny):
        ap.error("give --model DIR or --tiny")
    from datasets import Dataset
    from trl import GRPOConfig

    from treepack.hf.trl import TreeGRPOTrainer

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(tiny_checkpoint(Path(tmp) / "tiny"))
        config = GRPOConfig(output_dir=str(Path(tmp) / "out"), per_device_train_batch_size=2 * args.group_size,
                            num_generations=args.group_size, gradient_accumulation_steps=2,
                            max_completion_length=16, max_steps=args.steps, beta=0.04, logging_steps=1,
                            report_to="none", use_cpu=args.tiny, bf16=not args.tiny, save_strategy="no")
        dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in PROMPTS]})
        trainer = TreeGRPOTrainer(model=model, reward_funcs=reward_short, args=config, train_dataset=dataset,
                                  whole_groups=True)
        trainer.train()


if __name__ == "__main__":
    main()
