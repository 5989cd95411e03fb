"""A Qwen3 / Qwen2 / Llama decoder in pure torch, driven by ``position_ids`` and an attention context.

Design and trade-offs:
- **No batch dimension.** The model reads one flat stream of T tokens: a pack of tree tokens (DFS preorder)
  or the concatenation of whole sequences (the dense baseline). Which tokens see each other is the
  attention context's business, not the tensor shape's, so one code path serves every mode and no token
  is ever padded to a rectangle.
- **Positions are inputs.** RoPE angles come from ``position_ids`` (a token's depth in its tree = its offset
  in the original sequence), never from the layout index. Restoring the original positions is what makes
  tree and dense forwards compute the same function (Tree Training §3.2.3, eq. 16).
- **One attention context per forward.** `attention.AttentionContext` is built once from the pack and
  handed to each layer: which keys each query sees (``tree`` or ``causal``) and the attention call.
- **Cached prefixes (DFS mode).** ``forward(past_kv=...)`` takes per-layer keys/values of a prefix that
  every query of the segment sees, and ``return_kv=True`` returns the segment's own per-layer keys/values
  (post-RoPE), so a depth-first mode can forward a suffix over its cached path.
- **Logits are not computed here.** ``forward`` returns the final-normed hidden states [T, D]; the losses
  gather the rows they need and compute log-probs in chunks (losses.py). For Qwen3's 151,936-entry
  vocabulary a 32k-token pack would otherwise hold 19 GB of float32 logits.
- **Hugging Face names.** Modules are named as in ``transformers`` (``model.layers.0.self_attn.q_proj``),
  so a local checkpoint loads with ``load_state_dict(strict=True)`` and ours load back into
  ``transformers``. RMSNorm upcasts bf16/fp16 to float32 like HF; float64 stays float64 (the equivalence
  tests run there).

Families: ``qwen3`` (per-head q_norm/k_norm, no biases), ``qwen2`` (q/k/v biases), ``llama`` (optional
``attention_bias``/``mlp_bias``); RoPE types default, linear and llama3; tied or untied output head.

Legend (shape suffixes): T segment tokens, P cached-prefix tokens, D hidden size, H query heads,
K key/value heads, E head dim, F MLP width, V vocabulary, S sequences.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from treepack.errors import ConfigError
from treepack.kernels.norm_rope import apply_rope, norm_rope, rms_norm
from treepack.train.architecture import ModelArgs
from treepack.train.attention import KV, AttentionContext, KernelSchedule
from treepack.train.compiled import activation_memory_budget, pick, use_compiled, varying
from treepack.train.compiled import compiled as compiled_fn
from treepack.train.working_weights import embed

# --------------------------------------------------------------------------------------------------
# Layers


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_inv_freq(args: ModelArgs, dtype: torch.dtype, device: torch.device | None = None) -> Tensor:
    """Inverse frequencies [E/2]; float32 computed exactly as ``transformers`` does, float64 natively."""
    E = args.head_dim
    idx = torch.arange(0, E, 2, dtype=torch.int64, device=device).to(dtype)
    inv_freq = 1.0 / (args.rope_theta ** (idx / E))
    scaling = args.rope_scaling or {}
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif rope_type == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


def rope_cos_sin(args: ModelArgs, position_ids_T: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin [T, E] at the given positions (float64 for float64 models, else float32)."""
    rope_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    inv_freq = rope_inv_freq(args, rope_dtype, position_ids_T.device)
    freqs_TE2 = position_ids_T.to(rope_dtype)[:, None] * inv_freq[None, :]
    emb_TE = torch.cat([freqs_TE2, freqs_TE2], dim=-1)
    return emb_TE.cos(), emb_TE.sin()


class Attention(nn.Module):
    """The attention weights (names as in ``transformers``); the math is `attention_inputs` and
    `attention_output_and_mlp`, run by `DecoderLayer`."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        D, H, K, E = args.hidden_size, args.num_heads, args.num_kv_heads, args.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = H, K, E
        self.q_proj = nn.Linear(D, H * E, bias=args.qkv_bias)
        self.k_proj = nn.Linear(D, K * E, bias=args.qkv_bias)
        self.v_proj = nn.Linear(D, K * E, bias=args.qkv_bias)
        self.o_proj = nn.Linear(H * E, D, bias=args.o_bias)
        if args.qk_norm:
            self.q_norm = RMSNorm(E, args.rms_norm_eps)
            self.k_norm = RMSNorm(E, args.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None


class MLP(nn.Module):
    """The SwiGLU weights; the math is in `attention_output_and_mlp`."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        D, F_ = args.hidden_size, args.intermediate_size
        self.gate_proj = nn.Linear(D, F_, bias=args.mlp_bias)
        self.up_proj = nn.Linear(D, F_, bias=args.mlp_bias)
        self.down_proj = nn.Linear(F_, D, bias=args.mlp_bias)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args)
        # projection name -> its 16-bit working copy, used instead of the weight (`working_weights`)
        self.working: dict[str, Tensor] | None = None

    def forward(self, x_TD: Tensor, cos_TE: Tensor, sin_TE: Tensor, attn: AttentionContext,
                past: KV | None, compiled: bool = False, schedule: KernelSchedule | None = None,
                return_kv: bool = True) -> tuple[Tensor, KV | None]:
        """Compiled with a fused tree kernel (``schedule`` given: Triton or FA4): the whole layer is one compiled
        graph with the kernel's custom op inside it; with ``return_kv=False`` only the hidden states leave that
        graph (and the layer returns no keys and values). Otherwise two elementwise-heavy regions (compiled on
        CUDA) around the attention call, which stays eager."""
        a, m = self.self_attn, self.mlp
        w = self.working or {}
        q_w, k_w, v_w, o_w = (w[n] if n in w else getattr(a, n).weight for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
        gate_w, up_w, down_w = (w[n] if n in w else getattr(m, n).weight for n in ("gate_proj", "up_proj", "down_proj"))
        q_norm_w = a.q_norm.weight if a.q_norm is not None else None
        k_norm_w = a.k_norm.weight if a.k_norm is not None else None
        if past is not None and past[0].shape[0] == 0:
            past = None
        if compiled and schedule is not None and (past is None or past[0].shape[0] > 1):  # P = 1: a recompile
            out = compiled_fn(layer_with_tree_kernel if return_kv else layer_with_tree_kernel_hidden)(
                x_TD, self.input_layernorm.weight, self.input_layernorm.eps,
                q_w, a.q_proj.bias, k_w, a.k_proj.bias, v_w, a.v_proj.bias,
                q_norm_w, k_norm_w, cos_TE, sin_TE, a.num_heads, a.num_kv_heads, a.head_dim,
                None if past is None else past[0], None if past is None else past[1], schedule.op, schedule.tensors,
                schedule.config, o_w, a.o_proj.bias, self.post_attention_layernorm.weight,
                self.post_attention_layernorm.eps, gate_w, m.gate_proj.bias, up_w,
                m.up_proj.bias, down_w, m.down_proj.bias,
            )
            return (out[0], (out[1], out[2])) if return_kv else (out, None)
        q_THE, k_TKE, v_TKE = pick(attention_inputs, compiled)(
            x_TD, self.input_layernorm.weight, self.input_layernorm.eps,
            q_w, a.q_proj.bias, k_w, a.k_proj.bias, v_w, a.v_proj.bias,
            q_norm_w, k_norm_w, cos_TE, sin_TE, a.num_heads, a.num_kv_heads, a.head_dim,
        )
        if past is not None:
            past = (past[0].to(v_TKE.dtype), past[1].to(v_TKE.dtype))
        # one layout for the compiled region: a backend may return [T, H, E] as a transposed [H, T, E] view,
        # and a stride the region has not met is a recompile (the reshape inside would copy it anyway)
        o_THE = attn.attend(q_THE, k_TKE, v_TKE, past).contiguous()
        x_TD = pick(attention_output_and_mlp, compiled)(
            x_TD, o_THE, o_w, a.o_proj.bias, self.post_attention_layernorm.weight,
            self.post_attention_layernorm.eps, gate_w, m.gate_proj.bias, up_w,
            m.up_proj.bias, down_w, m.down_proj.bias,
        )
        return x_TD, (k_TKE, v_TKE)


@varying("x_TD", "cos_TE", "sin_TE")
def attention_inputs(x_TD: Tensor, norm_w_D: Tensor, eps: float, q_w: Tensor, q_b: Tensor | None, k_w: Tensor,
                     k_b: Tensor | None, v_w: Tensor, v_b: Tensor | None, q_norm_w: Tensor | None,
                     k_norm_w: Tensor | None, cos_TE: Tensor, sin_TE: Tensor, H: int, K: int, E: int
                     ) -> tuple[Tensor, Tensor, Tensor]:
    """Pre-norm, q/k/v projections, Qwen3's per-head q/k norms and RoPE: the kernel's inputs.

    Under autocast the projections come out in the autocast dtype while norms may promote: the kernel
    takes one dtype, that of v (a plain projection)."""
    T = x_TD.shape[0]
    h_TD = rms_norm(x_TD, norm_w_D, eps)
    q_THE = F.linear(h_TD, q_w, q_b).view(T, H, E)
    k_TKE = F.linear(h_TD, k_w, k_b).view(T, K, E)
    v_TKE = F.linear(h_TD, v_w, v_b).view(T, K, E)
    if q_norm_w is not None:  # one fused kernel each on CUDA (kernels/norm_rope), the reference elsewhere
        q_THE, k_TKE = norm_rope(q_THE, q_norm_w, cos_TE, sin_TE, eps), norm_rope(k_TKE, k_norm_w, cos_TE, sin_TE, eps)
    else:
        q_THE, k_TKE = apply_rope(q_THE, cos_TE, sin_TE), apply_rope(k_TKE, cos_TE, sin_TE)
    return q_THE.to(v_TKE.dtype), k_TKE.to(v_TKE.dtype), v_TKE


@varying("x_TD", "o_THE")
def attention_output_and_mlp(x_TD: Tensor, o_THE: Tensor, o_w: Tensor, o_b: Tensor | None, norm_w_D: Tensor,
                             eps: float, gate_w: Tensor, gate_b: Tensor | None, up_w: Tensor, up_b: Tensor | None,
                             down_w: Tensor, down_b: Tensor | None) -> Tensor:
    """Output projection and residual, then the post-norm SwiGLU MLP and its residual."""
    x_TD = x_TD + F.linear(o_THE.reshape(x_TD.shape[0], -1), o_w, o_b)
    h_TD = rms_norm(x_TD, norm_w_D, eps)
    return x_TD + F.linear(F.silu(F.linear(h_TD, gate_w, gate_b)) * F.linear(h_TD, up_w, up_b), down_w, down_b)


def layer_with_tree_kernel(x_TD: Tensor, norm_w_D: Tensor, eps: float, q_w: Tensor, q_b: Tensor | None, k_w: Tensor,
                           k_b: Tensor | None, v_w: Tensor, v_b: Tensor | None, q_norm_w: Tensor | None,
                           k_norm_w: Tensor | None, cos_TE: Tensor, sin_TE: Tensor, H: int, K: int, E: int,
                           prefix_k: Tensor | None, prefix_v: Tensor | None, op: str, schedule: tuple[Tensor, ...],
                           config: list[int], o_w: Tensor, o_b: Tensor | None, post_norm_w_D: Tensor,
                           post_eps: float, gate_w: Tensor, gate_b: Tensor | None, up_w: Tensor,
                           up_b: Tensor | None, down_w: Tensor, down_b: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """A whole decoder layer around a fused tree kernel's custom op (``op``: triton | fa4), for one compiled
    graph per layer call (forward and backward) instead of two regions plus an eager op: a third of the host
    time per layer, which is what a DFS walk of many small model calls is bound by. Same math as the split path.

    Compiled with every size and integer symbolic (not `varying`): ``config`` holds what the kernel picks per
    pack (FA4's backward block and grid order), and as graph constants a new value recompiled the whole layer
    graph on whichever rank met it first (an integer list: 3 graphs for 3 values against 1, on CPU)."""
    q_THE, k_TKE, v_TKE = attention_inputs(x_TD, norm_w_D, eps, q_w, q_b, k_w, k_b, v_w, v_b, q_norm_w, k_norm_w,
                                           cos_TE, sin_TE, H, K, E)
    if prefix_k is not None:
        prefix_k, prefix_v = prefix_k.to(v_TKE.dtype).contiguous(), prefix_v.to(v_TKE.dtype).contiguous()
    if op == "fa4":  # FlashAttention-4 (kernels/tree_attention/fa4.py); its op is registered when fa4_tables ran
        o_THE, _ = torch.ops.treepack.tree_attention_fa4_fwd(q_THE.contiguous(), k_TKE.contiguous(), v_TKE.contiguous(),
                                                             prefix_k, prefix_v, *schedule, 1.0 / math.sqrt(E),
                                                             config[0], config[1])
    else:
        o_THE, _ = torch.ops.treepack.tree_attention_fwd(q_THE.contiguous(), k_TKE.contiguous(), v_TKE.contiguous(),
                                                         prefix_k, prefix_v, *schedule, 1.0 / math.sqrt(E), config)
    x_TD = attention_output_and_mlp(x_TD, o_THE, o_w, o_b, post_norm_w_D, post_eps, gate_w, gate_b, up_w, up_b,
                                    down_w, down_b)
    return x_TD, k_TKE, v_TKE


def layer_with_tree_kernel_hidden(*args) -> Tensor:
    """`layer_with_tree_kernel` for callers that keep no keys and values (tree mode): only the hidden states
    are the graph's output. Returned but unused, keys and values each cost a zero-filled gradient and an add
    in every layer's backward (2.5 ms of fills and 3.6 ms of adds a ToolBench step on an H100)."""
    return layer_with_tree_kernel(*args)[0]


class DecoderBody(nn.Module):
    """What ``transformers`` calls ``model``: embeddings, layers, final norm."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


@dataclass
class DecoderOutput:
    hidden_TD: Tensor  # final-normed hidden states; logits = hidden @ head_weight.T
    kv: list[KV] = field(default_factory=list)  # per layer, the segment's (keys, values) when requested


class Decoder(nn.Module):
    """The causal LM: ``forward`` gives hidden states, ``head_weight`` [V, D] maps them to logits."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model = DecoderBody(args)
        self.lm_head = None if args.tie_embeddings else nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.activation_checkpointing = False  # recompute each layer in backward (saves activations)
        self.compile = "auto"  # auto | on | off: torch.compile the elementwise regions (auto = on CUDA)
        # share of a compiled layer's saved activations kept for backward (`activation_memory_budget`)
        self.activation_memory_budget = 1.0
        self.working_weights = None  # `working_weights.WorkingWeights`: 16-bit copies of the weights
        self.fsdp_units: list[nn.Module] | None = None  # one module per FSDP unit (`fsdp.shard_model`)

    @property
    def head_weight(self) -> Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def forward(
        self,
        input_ids_T: Tensor,
        position_ids_T: Tensor,
        attn: AttentionContext,
        *,
        past_kv: Sequence[KV] | None = None,
        return_kv: bool = False,
    ) -> DecoderOutput:
        """Hidden states of T tokens. ``past_kv``: per layer (keys [P, K, E], values [P, K, E]) of a
        cached prefix visible to every token (its positions precede ``position_ids_T``)."""
        if past_kv is not None and len(past_kv) != self.args.num_layers:
            raise ValueError(f"past_kv must have one (k, v) per layer ({self.args.num_layers}), got {len(past_kv)}")
        if self.working_weights is not None and self.working_weights.in_place:  # gradient into .grad in place
            x_TD = embed(input_ids_T, self.model.embed_tokens.weight)
        else:
            x_TD = self.model.embed_tokens(input_ids_T)
        cos_TE, sin_TE = rope_cos_sin(self.args, position_ids_T, x_TD.dtype)
        compiled = self.uses_compiled(x_TD.device)
        schedule = None
        if compiled and x_TD.shape[0] > 0:
            dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else self.dtype
            P = 0 if past_kv is None or not past_kv else past_kv[0][0].shape[0]
            schedule = attn.kernel_schedule(x_TD.device, dtype, self.args.num_heads, self.args.head_dim, P)
        kv_out: list[KV] = []
        with activation_memory_budget(self.activation_memory_budget if compiled else 1.0):
            for i, layer in enumerate(self.model.layers):
                past = None if past_kv is None else past_kv[i]
                if self.activation_checkpointing and torch.is_grad_enabled():
                    x_TD, kv = checkpoint(
                        layer, x_TD, cos_TE, sin_TE, attn, past, compiled, schedule, return_kv, use_reentrant=False
                    )
                else:
                    x_TD, kv = layer(x_TD, cos_TE, sin_TE, attn, past, compiled, schedule, return_kv)
                if return_kv:
                    kv_out.append(kv)
        return DecoderOutput(hidden_TD=self.model.norm(x_TD), kv=kv_out)

    def embeddings(self, input_ids_T: Tensor) -> Tensor:
        """The input embeddings alone, through no layer: under FSDP2 the cheapest forward of the root
        module, whose backward still ends in the root's gradient sync of every unit (`fsdp.Accumulation`)."""
        return self.model.embed_tokens(input_ids_T)

    def uses_compiled(self, device: torch.device) -> bool:
        """Whether forwards (and the losses over them) run the compiled elementwise regions here."""
        return use_compiled(self.compile, device, self.dtype)

    def logits(self, hidden_ND: Tensor) -> Tensor:
        """Full-vocabulary logits of a few rows (tests, sampling); losses use chunked log-probs instead."""
        return hidden_ND @ self.head_weight.T

    # ---------------------------------------------------------------------------------------------
    # Construction

    @classmethod
    def random_init(cls, args: ModelArgs, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu", draw_on_device: bool = False) -> Decoder:
        """Random weights as ``transformers`` initialises them (normal(0, init_std), zero biases, unit
        norms), drawn from ``seed`` in parameter order on the CPU in float64: identical on every device.
        ``draw_on_device``: draw in ``dtype`` on ``device`` instead (a 1.7B model in a second rather than
        half a minute; the values then depend on the device: for benchmarks)."""
        draw_device = torch.device(device) if draw_on_device else torch.device("cpu")
        with torch.device("meta"):
            model = cls(args)
        model.to_empty(device=draw_device)
        if draw_on_device:
            model.to(dtype=dtype)
        gen = torch.Generator(device=draw_device).manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith(".bias"):
                    p.zero_()
                elif draw_on_device:
                    p.normal_(0.0, args.init_std, generator=gen)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * args.init_std)
        return model.to(device=device, dtype=dtype)

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: torch.dtype = torch.float32,
                        device: torch.device | str = "cpu") -> Decoder:
        """Load a local Hugging Face checkpoint directory (``config.json`` + ``*.safetensors``)."""
        from safetensors import safe_open

        path = Path(path)
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise ConfigError(f"{path}: no config.json (expected a Hugging Face checkpoint directory)")
        try:
            cfg = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{cfg_path}: not valid JSON ({exc})") from None
        args = ModelArgs.from_hf_config(cfg, source=str(cfg_path))
        index = path / "model.safetensors.index.json"
        if index.is_file():  # sharded: the index names the files
            files = [path / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
        else:  # model.safetensors, model-00001-of-00002.safetensors, ... (never other *.safetensors)
            files = sorted(path.glob("model*.safetensors")) or sorted(path.glob("*.safetensors"))
        if not files:
            raise ConfigError(f"{path}: no *.safetensors weights")
        with torch.device("meta"):
            model = cls(args)
        expected = dict(model.state_dict())
        state: dict[str, Tensor] = {}
        for f in files:
            with safe_open(str(f), framework="pt", device="cpu") as sf:
                for key in sf.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    name = _hf_key(key, expected)
                    if name is None:
                        continue
                    if name not in expected:
                        raise ConfigError(f"{f}: unexpected tensor {key!r} for a {args.family} model")
                    t = sf.get_tensor(key)
                    if tuple(t.shape) != tuple(expected[name].shape):
                        raise ConfigError(
                            f"{f}: tensor {key!r} has shape {list(t.shape)}, "
                            f"config.json implies {list(expected[name].shape)}"
                        )
                    state[name] = t.to(device=device, dtype=dtype)
        missing = sorted(set(expected) - set(state))
        if missing:
            more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
            raise ConfigError(f"{path}: checkpoint lacks {', '.join(missing[:3])}{more}")
        model.load_state_dict(state, strict=True, assign=True)
        return model

    def save_pretrained(self, path: str | Path) -> None:
        """Write ``config.json`` + ``model.safetensors`` (loadable by `from_pretrained` and transformers)."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        cfg = {**self.args.to_hf_config(), "torch_dtype": str(self.dtype).removeprefix("torch.")}
        (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})


def _hf_key(key: str, expected: dict) -> str | None:
    """Our parameter name for a checkpoint key; None for keys to skip (rotary buffers, a tied head)."""
    if key.endswith("rotary_emb.inv_freq"):
        return None
    if key not in expected and not key.startswith(("model.", "lm_head.")) and "model." + key in expected:
        key = "model." + key  # saved from the bare ``*Model`` instead of ``*ForCausalLM``
    if key == "lm_head.weight" and "lm_head.weight" not in expected:
        return None  # tied: the head is the embedding
    return key

