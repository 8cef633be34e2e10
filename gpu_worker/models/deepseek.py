"""DeepSeek-V2, DeepSeek-V3 and GLM-4.7-Flash (``glm4_moe_lite``): latent attention (mla.py) and
DeepSeek's mixture of experts (deepseek_moe.py) in Llama's pre-norm decoder.

Their layers are dense (Llama's SwiGLU MLP) or sparse: DeepSeek's first ``first_k_dense_replace``
layers are dense, GLM's per ``mlp_layer_types``. The pool holds one latent row a token a layer
(``latent_kv``): ``num_kv_heads`` 1 of ``kv_lora_rank + qk_rope_head_dim`` dimensions. A
DeepSeek-V3 checkpoint's multi-token-prediction layers (past ``num_hidden_layers``) are not served.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from gpu_worker.forward_context import ForwardContext
from gpu_worker.models.contract import Layer, Split
from gpu_worker.models.deepseek_moe import DeepseekMoe, RouterArgs
from gpu_worker.models.layers import Embedding, Linear, RMSNorm
from gpu_worker.models.llama import MLP, FeedForward, LlamaArgs
from gpu_worker.models.mla import ComplexRotary, LatentAttention, MlaArgs, row_plan
from gpu_worker.models.mla_rows import RowPlan
from gpu_worker.models.rope import rope_inv_freq, rotary_cache


def sparse_layers(cfg: Any) -> tuple[bool, ...]:
    """Per layer: a mixture of experts (else the dense MLP)."""
    types = getattr(cfg, "mlp_layer_types", None)
    if types is not None:
        return tuple(t == "sparse" for t in types)
    first_dense = int(getattr(cfg, "first_k_dense_replace", None) or 0)
    return tuple(i >= first_dense for i in range(cfg.num_hidden_layers))


def dense_args(cfg: Any) -> LlamaArgs:
    """Llama's arguments for the dense MLPs (and, at another width, the shared experts)."""
    return LlamaArgs(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_layers=cfg.num_hidden_layers, num_heads=cfg.num_attention_heads, num_kv_heads=1,
        head_dim=int(cfg.qk_rope_head_dim), eps=cfg.rms_norm_eps, act=cfg.hidden_act, qkv_bias=False,
        o_bias=False, mlp_bias=bool(getattr(cfg, "mlp_bias", False)), qk_norm=False,
        tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        context_len=cfg.max_position_embeddings, sliding_windows=(0,) * cfg.num_hidden_layers,
        rotary_dim=int(cfg.qk_rope_head_dim), fused_checkpoint=False,
    )  # fmt: skip


def feed_forward(cfg: Any, layer: int) -> FeedForward:
    """Layer ``layer``'s feed-forward block."""
    args = dense_args(cfg)
    if not sparse_layers(cfg)[layer]:
        return MLP(args)
    inner = int(cfg.moe_intermediate_size)
    shared_count = int(getattr(cfg, "n_shared_experts", None) or 0)
    shared = MLP(replace(args, intermediate_size=inner * shared_count)) if shared_count else None
    return DeepseekMoe(cfg.hidden_size, inner, cfg.hidden_act, RouterArgs.from_hf(cfg), shared)


class DecoderLayer(Layer):
    def __init__(self, cfg: Any, mla: MlaArgs, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LatentAttention(mla, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = feed_forward(cfg, layer)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext, plan: RowPlan | None
    ) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(x), cos, sin, ctx, plan)
        x = self.self_attn.o_proj.add_to(x, attended)
        return self.mlp.add_to(x, self.post_attention_layernorm(x))


class DeepseekBody(nn.Module):
    def __init__(self, cfg: Any, mla: MlaArgs) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, mla, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekForCausalLM(nn.Module):
    """A latent-attention causal LM over the latent pool."""

    tensor_parallel: tuple[int, int] | None = None
    latent_kv = True

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        cfg = hf_config
        mla = MlaArgs.from_hf(cfg)
        self.num_layers, self.num_heads = cfg.num_hidden_layers, cfg.num_attention_heads
        self.num_kv_heads, self.head_dim = 1, mla.latent_dim
        self.context_len = cfg.max_position_embeddings
        self.model = DeepseekBody(cfg, mla)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, False, Split.VOCAB)
        if getattr(cfg, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight
        if mla.rotary == "complex":
            inv_freq, scaling = rope_inv_freq(cfg, mla.rope_dim)
            self.rotary: nn.Module = ComplexRotary(inv_freq, scaling, self.context_len)
        else:
            self.rotary = rotary_cache(cfg, mla.rope_dim, self.context_len)
        extra = int(getattr(cfg, "num_nextn_predict_layers", None) or 0)
        if extra:  # V3's multi-token-prediction layers
            numbers = "|".join(str(self.num_layers + i) for i in range(extra))
            self.checkpoint_skipped = rf"model\.layers\.({numbers})\."

    def decoder_layers(self) -> nn.ModuleList:
        return self.model.layers

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Hidden states [T, hidden] before the final norm."""
        cos, sin = self.rotary(ctx.positions)
        x = self.model.embed_tokens(input_ids)
        plan = row_plan(ctx)  # once for every layer
        for layer in self.model.layers:
            x = layer(x, cos, sin, ctx, plan)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(hidden))


class DeepseekV2ForCausalLM(DeepseekForCausalLM):
    """DeepSeek-V2 (and V2-Lite: no ``q_lora_rank``)."""


class DeepseekV3ForCausalLM(DeepseekForCausalLM):
    """DeepSeek-V3 (sigmoid routing, score-correction bias, group-limited top-k)."""


class Glm4MoeLiteForCausalLM(DeepseekForCausalLM):
    """GLM-4.7-Flash: DeepSeek-V3's layers, dense ones per ``mlp_layer_types``, K and V heads of
    different sizes."""
