"""``treepack train`` on a Hugging Face model (``model.source = "hf"``): the model and its execution modes.

`HFCausalLM` holds a ``transformers`` causal LM loaded from a local checkpoint directory and gives the
training loop what it reads from our own `Decoder`: ``args`` (the shape docs/design.md §9's FLOP model needs),
``dtype``/``device``, ``save_pretrained``/``from_pretrained`` (checkpoints stay Hugging Face directories)
and ``activation_checkpointing`` (transformers' gradient checkpointing). Two modes over the same packs,
rows and objective as ours (`treepack.train.modes`):

- `HFTreeMode`: one tree forward per pack through the model's own modules (`pack_logprobs`), log-probs
  for the pack tokens the loss rows target, rows gather them; SFT token-mean reads ``loss_weight``;
- `HFDenseMode`: the baseline, every sequence on its own through the model's configured attention
  (one forward per sequence), no tree field read.

This module registers the ``hf`` model source (`treepack.train.model_source`) when imported; the trainer imports
it by name the first time a config asks for that source, so ``treepack.train`` never imports ``treepack.hf``.

``model.source = "auto"`` (the default) picks our decoder wherever it loads the checkpoint (random init,
or a qwen3 / qwen2 / llama checkpoint) and this path otherwise. Both compute the same function (tests:
losses equal to 1e-9 in float64); ours is the default because on CUDA it compiles norms, RoPE and SwiGLU
around the tree kernel and fuses the loss softmax (benchmarks/results/2026-11-21-train-step-h200.md), while
transformers' modules run eagerly; ``benchmarks/hf.py`` times the two side by side on the same packs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from treepack.errors import ConfigError
from treepack.hf.batch import TreeBatch
from treepack.hf.forward import pack_logprobs, prepare_model, sequence_logprobs
from treepack.train.losses import BatchTotals, LossRows, Objective, token_weights_fast
from treepack.train.model_source import register_model_source
from treepack.train.modes.base import LayoutError, Mode, ModeResult


@dataclass(frozen=True)
class ModelShape:
    """What the FLOP model reads from a model (the names of `treepack.train.model.ModelArgs`)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    non_embedding_params: int

    def num_params(self, *, embeddings: bool = True) -> int:
        return self.non_embedding_params + (self.vocab_size * self.hidden_size if embeddings else 0)

    @classmethod
    def of(cls, hf: nn.Module) -> ModelShape:
        cfg = hf.config
        heads = int(cfg.num_attention_heads)
        emb = {id(p) for m in (hf.get_input_embeddings(), hf.get_output_embeddings()) if m is not None
               for p in m.parameters()}
        body = sum(p.numel() for p in hf.parameters() if id(p) not in emb)
        return cls(vocab_size=int(cfg.vocab_size), hidden_size=int(cfg.hidden_size),
                   num_layers=int(cfg.num_hidden_layers), num_heads=heads,
                   head_dim=int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads),
                   non_embedding_params=int(body))


class HFCausalLM(nn.Module):
    """A transformers causal LM behind the interface `treepack.train.loop` uses (see the module doc and
    `treepack.train.model_source`)."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.hf = hf
        self.args = ModelShape.of(hf)
        self.compile = "off"
        self.activation_memory_budget = 1.0
        self._checkpointing = False
        prepare_model(hf)  # refuse unsupported models before any training step

    @property
    def activation_checkpointing(self) -> bool:
        return self._checkpointing

    @activation_checkpointing.setter
    def activation_checkpointing(self, on: bool) -> None:
        """transformers' checkpointing of each decoder layer (``activation_checkpointing_enable`` since v5.x,
        ``gradient_checkpointing_enable`` before), non-reentrant so gradients reach every parameter."""
        was = self._checkpointing
        self._checkpointing = bool(on)
        new_api = hasattr(self.hf, "activation_checkpointing_enable")
        if on and new_api:
            self.hf.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        elif on:
            self.hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        elif was:
            (self.hf.activation_checkpointing_disable if new_api else self.hf.gradient_checkpointing_disable)()

    @property
    def dtype(self) -> torch.dtype:
        return self.hf.get_input_embeddings().weight.dtype

    @property
    def device(self) -> torch.device:
        return self.hf.get_input_embeddings().weight.device

    def uses_compiled(self, device: torch.device) -> bool:
        return False

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: torch.dtype = torch.float32,
                        device: torch.device | str = "cpu") -> HFCausalLM:
        from transformers import AutoModelForCausalLM

        path = Path(path)
        if not (path / "config.json").is_file():
            raise ConfigError(f"{path}: no config.json (expected a Hugging Face checkpoint directory)")
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)  # its default attention: the baseline
        if dtype == torch.float64 and hasattr(hf, "set_experts_implementation"):
            hf.set_experts_implementation("eager")  # grouped matmuls have no float64 kernel
        return cls(hf.to(device).train())

    def save_pretrained(self, path: str | Path) -> None:
        self.hf.save_pretrained(str(path))


class HFTreeMode(Mode):
    """One tree forward per pack through the transformers model (see the module docstring)."""

    name = "tree"

    def __init__(self, attention: str = "auto", *, chunk_rows: int = 4096, sft_fast_path: bool = True) -> None:
        super().__init__(attention, chunk_rows=chunk_rows)
        self.sft_fast_path = sft_fast_path

    def __call__(self, model: HFCausalLM, pack, rows: LossRows, objective: Objective,
                 totals: BatchTotals) -> ModeResult:
        dev = model.device
        fast = self.sft_fast_path and objective.kind == "sft"
        if fast:
            fast_U, fast_w_U = token_weights_fast(pack, rows, totals, objective.normalization)
            token_U = np.union1d(fast_U, rows.token_R)
        else:
            token_U = np.unique(rows.token_R)
        parent_U = np.asarray(pack.parent, dtype=np.int64)[token_U]
        if (parent_U < 0).any():
            u = int(token_U[np.argmax(parent_U < 0)])
            raise LayoutError(f"pack token {u} is a training target but has no parent")
        out = pack_logprobs(model.hf, TreeBatch.from_pack(pack), attention=self.attention,
                            tokens=torch.as_tensor(token_U, device=dev), chunk_rows=self.chunk_rows)
        logp_U = out.logp_T[torch.as_tensor(token_U, device=dev)]
        logp_R = logp_U[torch.as_tensor(np.searchsorted(token_U, rows.token_R), device=dev)]
        row_dtype = logp_U.dtype
        loss, tensors = None, {}
        if fast:
            weight_U = np.zeros(token_U.shape[0], dtype=np.float64)
            weight_U[np.searchsorted(token_U, fast_U)] = fast_w_U
            loss = -(torch.as_tensor(weight_U, dtype=row_dtype, device=dev) * logp_U).sum()
        else:
            tensors = objective.row_tensors(rows, totals, device=dev, dtype=row_dtype)
        return self._finish(objective, logp_R, tensors, loss, pack.n_tokens)


class HFDenseMode(Mode):
    """Every sequence on its own through the model's configured attention (the baseline): one forward per
    sequence, positions 0..L-1, no tree field read."""

    name = "dense"

    def __call__(self, model: HFCausalLM, pack, rows: LossRows, objective: Objective,
                 totals: BatchTotals) -> ModeResult:
        dev = model.device
        per_seq = sequence_logprobs(model.hf, TreeBatch.from_pack(pack), chunk_rows=self.chunk_rows)
        targets = torch.cat(per_seq)  # sequence s's target j (j >= 1) sits at flat index - s - 1
        logp_R = targets[torch.as_tensor(rows.flat_R - rows.seq_R - 1, device=dev)]
        tensors = objective.row_tensors(rows, totals, device=dev, dtype=logp_R.dtype)
        return self._finish(objective, logp_R, tensors, None, int(np.asarray(pack.seq_offsets)[-1]))


def make_hf_mode(name: str, *, attention: str | None = None, chunk_rows: int = 4096) -> Mode:
    """The mode ``name`` for a `HFCausalLM` (tree or dense; dfs needs our own decoder's cached-prefix calls)."""
    if name == "tree":
        return HFTreeMode(attention or "auto", chunk_rows=chunk_rows)
    if name == "dense":
        return HFDenseMode(attention or "sdpa", chunk_rows=chunk_rows)
    raise ConfigError(f"train.mode = '{name}' is not available with model.source = 'hf' (tree or dense)")


def _load(m, *, vocab_size: int, seed: int, dtype: torch.dtype, device: torch.device) -> HFCausalLM:
    """The ``hf`` source's loader: the checkpoint ``m.checkpoint`` (its own vocabulary and weights)."""
    return HFCausalLM.from_pretrained(m.checkpoint, dtype=dtype, device=device)


register_model_source("hf", _load, make_mode=make_hf_mode)
