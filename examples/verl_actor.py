"""verl's FSDP actor with treepack computing the response log-probs of each micro-batch.

`treepack.hf.verl.TreeDataParallelPPOActor` is verl's ``DataParallelPPOActor`` (verl 0.6 and 0.7; 0.8 replaced
it with engine workers) with its micro-batch forward tree-packed: a GRPO group's prompt once per micro-batch,
the same log-probs, entropies and policy update (tests/test_verl.py runs both on a tiny model). Install it where
verl builds its actor, in code the worker process imports (verl runs workers as Ray actors), e.g. a module
listed in your runtime environment::

    import verl.workers.fsdp_workers as workers
    from treepack.hf.verl import TreeDataParallelPPOActor
    workers.DataParallelPPOActor = TreeDataParallelPPOActor   # before the worker builds its actor

Make micro-batches hold whole groups (``actor.ppo_micro_batch_size_per_gpu`` a multiple of ``rollout.n``).

    python examples/verl_actor.py      # score one padded micro-batch with verl's actor and with the tree (CPU)
"""

from __future__ import annotations

import socket

import torch


def main() -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from verl.workers.actor.dp_actor import DataParallelPPOActor
    from verl.workers.config import FSDPActorConfig, FSDPEngineConfig

    from treepack.hf.verl import TreeDataParallelPPOActor

    with socket.socket() as s:  # verl's actor asks for its rank: a one-process group
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8))
    config = FSDPActorConfig(strategy="fsdp", rollout_n=4, ppo_micro_batch_size_per_gpu=4, use_torch_compile=False,
                             fsdp_config=FSDPEngineConfig(dtype="fp32"))
    prompt, responses = torch.randint(0, 64, (6,)), torch.randint(0, 64, (4, 5))
    batch = {"input_ids": torch.cat([prompt.expand(4, 6), responses], 1), "responses": responses}
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    batch["position_ids"] = torch.arange(11).expand(4, 11)
    out = {}
    for cls in (DataParallelPPOActor, TreeDataParallelPPOActor):
        with torch.no_grad():
            res = cls(config, model)._forward_micro_batch(batch, temperature=1.0)
        out[cls.__name__] = res["log_probs"] if isinstance(res, dict) else res[1]
    diff = float((out["DataParallelPPOActor"] - out["TreeDataParallelPPOActor"]).abs().max())
    print(f"4 responses to one 6-token prompt: log-probs [4, 5], max |verl - tree| = {diff:.2e}")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
