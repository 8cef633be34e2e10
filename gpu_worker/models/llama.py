"""One decoder for the Llama family: Llama, SmolLM2, Mistral, Qwen2, Qwen3 (and Phi-3, phi3.py; the
mixtures of experts Qwen3-MoE and Mixtral, moe.py, swap the MLP of some layers: ``feed_forward``).

They differ only in flags read from the HF config: biases on q/k/v (Qwen2) or on
every projection (Llama's ``attention_bias``), an RMSNorm per head on q and k
before rotary (Qwen3), rotary scaling (rope.py), and sliding-window attention on
some or all layers (Mistral, Phi-3, Qwen with ``use_sliding_window``). Parameter names mirror the HF
checkpoint names so the loader can check them one for one; q/k/v and gate/up
are merged into one matmul each, whose row blocks carry the checkpoint's names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.forward_context import PLAIN, AttentionOptions, ForwardContext, paged_attention
from gpu_worker.models.contract import AttentionLayer, Layer, Split
from gpu_worker.models.layers import (
    Embedding,
    FusedOps,
    Linear,
    MergedLinear,
    RMSNorm,
    activation,
    apply_rotary,
)
from gpu_worker.models.rope import rotary_cache
from gpu_worker.sampling.head_argmax import head_argmax


@dataclass(frozen=True)
class LlamaArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    act: str
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_embeddings: bool
    context_len: int
    sliding_windows: tuple[int, ...]  # per layer; 0: full attention
    rotary_dim: int  # the leading dimensions of each head that rotate (Phi-4-mini: 3/4 of them)
    fused_checkpoint: bool  # q/k/v and gate/up one tensor each in the checkpoint (Phi-3)

    @classmethod
    def from_hf(cls, cfg: Any) -> LlamaArgs:
        model_type = cfg.model_type
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        attention_bias = bool(getattr(cfg, "attention_bias", False))
        return cls(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            eps=cfg.rms_norm_eps,
            act=cfg.hidden_act,
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type != "qwen2" and attention_bias,
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            context_len=cfg.max_position_embeddings,
            sliding_windows=sliding_windows(cfg),
            rotary_dim=int(head_dim * partial_rotary_factor(cfg)),
            fused_checkpoint=model_type == "phi3",
        )


def partial_rotary_factor(cfg: Any) -> float:
    """The share of each head's dimensions that rotate (transformers 5 keeps it in rope_parameters)."""
    params = getattr(cfg, "rope_parameters", None) or {}
    return float(params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None) or 1.0))


def sliding_windows(cfg: Any) -> tuple[int, ...]:
    """Each layer's window (0: full attention), as HF decides it: by ``layer_types`` where the config
    has them (Qwen's ``use_sliding_window`` sets them), else ``sliding_window`` on every layer
    (Mistral, Phi-3)."""
    window = int(getattr(cfg, "sliding_window", None) or 0)
    types = getattr(cfg, "layer_types", None)
    if types is not None:
        return tuple(window if t == "sliding_attention" else 0 for t in types)
    return (window,) * cfg.num_hidden_layers


class Attention(AttentionLayer):
    kernel_slots = ("fused",)
    fused: FusedOps | None = None  # a device backend's: rotary in place, one call

    def __init__(self, args: LlamaArgs, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.rotary_dim = args.rotary_dim
        hidden, q_out, kv_out = (
            args.hidden_size,
            args.num_heads * args.head_dim,
            args.num_kv_heads * args.head_dim,
        )
        # One matmul for q, k and v; the checkpoint's q_proj/k_proj/v_proj fill its row blocks.
        self.qkv_proj = MergedLinear(
            hidden,
            {"q_proj": q_out, "k_proj": kv_out, "v_proj": kv_out},
            args.qkv_bias,
            args.fused_checkpoint,
        )
        self.o_proj = Linear(q_out, hidden, args.o_bias, Split.ROW)
        if args.qk_norm:
            self.q_norm = RMSNorm(args.head_dim, args.eps)
            self.k_norm = RMSNorm(args.head_dim, args.eps)
        self.qk_norm = args.qk_norm

    def options(self) -> dict[str, Any]:
        return {"qk_norm": self.qk_norm, "partial_rotary": self.rotary_dim < self.head_dim}

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k and v [T, Hkv, D], rotated, of the normed hidden states ``x``."""
        tokens = x.shape[0]
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x).view(tokens, heads + 2 * kv_heads, head_dim)
        if self.qk_norm:
            q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
            if self.fused is not None and self.rotary_dim == head_dim:  # both normed heads, one rotary call
                qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
                self.fused.rotary_(qk, heads + kv_heads, cos, sin)
                q, k = qk[:, :heads], qk[:, heads:]
            else:
                q, k = apply_rotary(self.q_norm(q), cos, sin), apply_rotary(self.k_norm(k), cos, sin)
        elif self.rotary_dim < head_dim:  # partial rotary: the leading dimensions rotate, the rest pass
            rd = self.rotary_dim
            qk = qkv[:, : heads + kv_heads]
            qk = torch.cat((apply_rotary(qk[..., :rd], cos, sin), qk[..., rd:]), dim=-1)
            q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads :]
        elif self.fused is not None:  # in place: q and k stay views of qkv
            self.fused.rotary_(qkv, heads + kv_heads, cos, sin)
            q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
        else:
            # q and k rotate by the same angles: one rotary over their heads together.
            qk = apply_rotary(qkv[:, : heads + kv_heads], cos, sin)
            q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads :]
        return q, k, v


class MLP(Layer):
    kernel_slots = ("fused",)
    fused: FusedOps | None = None  # a device backend's: silu(gate) * up in one call

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        inner = args.intermediate_size
        self.gate_up_proj = MergedLinear(
            args.hidden_size, {"gate_proj": inner, "up_proj": inner}, args.mlp_bias, args.fused_checkpoint
        )
        self.down_proj = Linear(inner, args.hidden_size, args.mlp_bias, Split.ROW)
        self.act = activation(args.act)

    def options(self) -> dict[str, Any]:
        return {"act": self.act}

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``residual + mlp(x)``."""
        if self.fused is not None and self.act is F.silu:
            gated = self.gate_up_proj.silu_mul  # the backend's one call, where it has one
            act = self.fused.silu_mul(self.gate_up_proj(x)) if gated is None else gated(x)
            return self.down_proj.add_to(residual, act)
        gate_up = self.gate_up_proj(x)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj.add_to(residual, self.act(gate) * up)


class FeedForward(Protocol):
    """A layer's feed-forward block: ``MLP``, or a mixture of experts (moe.py)."""

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor: ...


class DecoderLayer(Layer):
    attention_type: ClassVar[type[Attention]] = Attention  # a family's own attention (gpt-oss's sinks)

    def __init__(self, args: LlamaArgs, layer: int, mlp: FeedForward) -> None:
        super().__init__()
        self.layer = layer
        window = args.sliding_windows[layer]
        self.attention = AttentionOptions(sliding_window=window) if window else PLAIN
        self.input_layernorm = RMSNorm(args.hidden_size, args.eps)
        self.self_attn = self.attention_type(args, layer)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.eps)
        self.mlp = mlp

    def options(self) -> dict[str, Any]:
        return {"attention": self.attention}

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        q, k, v = self.self_attn.project(self.input_layernorm(x), cos, sin)
        attended = paged_attention(self.layer, q, k, v, ctx, self.attention)
        x = self.self_attn.o_proj.add_to(x, attended.flatten(1))
        return self.mlp.add_to(x, self.post_attention_layernorm(x))


class LlamaBody(nn.Module):
    def __init__(
        self, args: LlamaArgs, feed_forward: Callable[[int], FeedForward], layer_type: type[DecoderLayer]
    ) -> None:
        super().__init__()
        self.embed_tokens = Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(layer_type(args, i, feed_forward(i)) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.eps)


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM over the paged KV pool."""

    tensor_parallel: tuple[int, int] | None = None  # (rank, world): tensor_parallel.shard's
    head_softcap = 0.0  # (head_argmax.py's GreedyHead)
    decoder_layer: ClassVar[type[DecoderLayer]] = DecoderLayer  # a family's own (gpt-oss's)

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        args = LlamaArgs.from_hf(hf_config)
        self.args = args
        self.num_layers, self.num_kv_heads, self.head_dim = args.num_layers, args.num_kv_heads, args.head_dim
        self.num_heads = args.num_heads
        self.context_len = args.context_len
        self.model = LlamaBody(args, lambda layer: self.feed_forward(hf_config, layer), self.decoder_layer)
        self.lm_head = Linear(args.hidden_size, args.vocab_size, False, Split.VOCAB)
        if args.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = rotary_cache(hf_config, args.rotary_dim, args.context_len)

    def feed_forward(self, hf_config: Any, layer: int) -> FeedForward:
        """Layer ``layer``'s feed-forward block: the dense MLP here (moe.py's models: experts)."""
        return MLP(self.args)

    def decoder_layers(self) -> nn.ModuleList:
        return self.model.layers

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Hidden states [T, hidden] before the final norm."""
        cos, sin = self.rotary(ctx.positions)
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin, ctx)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of the selected tokens' hidden states."""
        return self.lm_head(self.model.norm(hidden))

    def compute_argmax(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """compute_logits' argmax per row, from the head's kernel without the logits (None: it has none)."""
        return head_argmax(self.lm_head, self.model.norm, hidden)
