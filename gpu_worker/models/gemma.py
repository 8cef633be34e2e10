"""Gemma 2 and Gemma 3 (the text model; of a multimodal Gemma 3 checkpoint, its language model).

Where they differ from Llama, each mirroring HF's op order (float64 runs match it to ~1e-12):
- RMSNorm scales by ``1 + w`` and rounds once, after the scale (``GemmaRMSNorm``); four norms a
  layer: before and after attention, before and after the MLP ("sandwich" norms).
- The embedding is scaled by sqrt(hidden) (that number rounded to float32, then to the model's dtype,
  as HF's buffer holds it).
- GELU (tanh) gates the MLP; attention scores are scaled by ``query_pre_attn_scalar ** -0.5``.
- Layers alternate sliding-window and global attention (``layer_types``); Gemma 2 soft-caps the
  attention scores and the final logits (``softcap * tanh(x / softcap)``); Gemma 3 RMS-norms q and k
  per head before rotary and gives local and global layers their own rope base (and scaling).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gpu_worker.forward_context import PLAIN, AttentionOptions, ForwardContext, paged_attention
from gpu_worker.image_encoder import splice_images
from gpu_worker.models.contract import AttentionLayer, Layer, Split
from gpu_worker.models.layers import (
    Embedding,
    FusedOps,
    Linear,
    MergedLinear,
    activation,
    apply_rotary,
    gelu_tanh,
)
from gpu_worker.models.rope import rotary_cache
from gpu_worker.sampling.head_argmax import head_argmax

SLIDING = "sliding_attention"


class GemmaRMSNorm(Layer):
    """``norm(x) * (1 + w)``, the statistics and the scale in float32, rounded once to x's dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


class GemmaNorm(GemmaRMSNorm):
    """Gemma 2/3's decoder norms, with a ``fused`` slot: a device backend's RMSNorm kernel, on float32
    activations, over the weight ``1 + w`` (summed in float32 once, when the kernel attaches, as the
    torch path sums it each call). In bf16 the torch path runs (it rounds once, after the scale)."""

    kernel_slots = ("fused",)
    fused: FusedOps | None = None
    folded: torch.Tensor | None = None  # 1 + w in float32, while a kernel is attached

    def attach(self, **kernels: Any) -> None:
        super().attach(**kernels)
        folded = (1.0 + self.weight.float()).contiguous() if self.fused is not None else None
        object.__setattr__(self, "folded", folded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is None or self.folded is None or x.dtype != torch.float32:
            return super().forward(x)
        if x.dim() == 2:  # (the reshapes below are no-ops there, and a final norm's step pays for them)
            return self.fused.rms_norm(x, self.folded, self.eps)
        return self.fused.rms_norm(x.reshape(-1, x.shape[-1]), self.folded, self.eps).view(x.shape)


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(x / cap) * cap


class GemmaAttention(AttentionLayer):
    kernel_slots = ("fused",)
    fused: FusedOps | None = None  # a device backend's: rotary in place, one call

    def __init__(self, cfg: Any, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        q_out, kv_out = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = bool(getattr(cfg, "attention_bias", False))
        self.qkv_proj = MergedLinear(
            cfg.hidden_size, {"q_proj": q_out, "k_proj": kv_out, "v_proj": kv_out}, bias
        )
        self.o_proj = Linear(q_out, cfg.hidden_size, bias, Split.ROW)
        self.qk_norm = cfg.model_type.startswith("gemma3")
        if self.qk_norm:
            self.q_norm = GemmaNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = GemmaNorm(self.head_dim, cfg.rms_norm_eps)
        sliding = cfg.layer_types[layer] == SLIDING
        scalar = cfg.query_pre_attn_scalar  # head_dim but in the 27B models: then the default scale
        options = AttentionOptions(
            scale=None if scalar == self.head_dim else scalar**-0.5,
            sliding_window=int(cfg.sliding_window or 0) if sliding else 0,
            logit_softcap=float(getattr(cfg, "attn_logit_softcapping", None) or 0.0),
        )
        self.attention = PLAIN if options == PLAIN else options  # the backends test PLAIN by identity

    def options(self) -> dict[str, Any]:
        return {"qk_norm": self.qk_norm, "attention": self.attention}

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        tokens = x.shape[0]
        heads, kv_heads = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(tokens, heads + 2 * kv_heads, self.head_dim)
        q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.fused is not None:  # q and k rotate by the same angles: one call over their heads
            qk = torch.cat((q, k), dim=1)
            self.fused.rotary_(qk, heads + kv_heads, cos, sin)
            q, k = qk[:, :heads], qk[:, heads:]
        else:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        attended = paged_attention(self.layer, q, k, v, ctx, self.attention)
        return self.o_proj(attended.flatten(1))


class GemmaMLP(Layer):
    kernel_slots = ("fused",)
    fused: FusedOps | None = None  # a device backend's: gelu_tanh(gate) * up in one call (float32)

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        inner = cfg.intermediate_size
        self.gate_up_proj = MergedLinear(cfg.hidden_size, {"gate_proj": inner, "up_proj": inner}, False)
        self.down_proj = Linear(inner, cfg.hidden_size, False, Split.ROW)
        self.act = activation(cfg.hidden_activation)

    def options(self) -> dict[str, Any]:
        return {"act": self.act}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.fused is not None and self.act is gelu_tanh and gate_up.dtype == torch.float32:
            return self.down_proj(self.fused.gelu_tanh_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class GemmaDecoderLayer(Layer):
    def __init__(self, cfg: Any, layer: int) -> None:
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.local = cfg.layer_types[layer] == SLIDING
        self.input_layernorm = GemmaNorm(hidden, eps)
        self.self_attn = GemmaAttention(cfg, layer)
        self.post_attention_layernorm = GemmaNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaNorm(hidden, eps)
        self.mlp = GemmaMLP(cfg)
        self.post_feedforward_layernorm = GemmaNorm(hidden, eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, ctx))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaBody(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(GemmaDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class GemmaForCausalLM(nn.Module):
    """Gemma 2 / Gemma 3 causal LM over the paged KV pool."""

    tensor_parallel: tuple[int, int] | None = None  # (rank, world): tensor_parallel.shard's

    # A multimodal Gemma 3 checkpoint: its language model under language_model. (or
    # model.language_model.), beside its vision tower (loaded apart: models/vision.py).
    checkpoint_renames = (
        (r"^language_model\.model\.", "model."),
        (r"^model\.language_model\.", "model."),
        (r"^language_model\.lm_head\.", "lm_head."),
    )
    checkpoint_skipped = r"^(model\.)?(vision_tower|multi_modal_projector)\."

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        cfg = hf_config.get_text_config()
        self.num_layers, self.num_heads = cfg.num_hidden_layers, cfg.num_attention_heads
        self.num_kv_heads, self.head_dim = cfg.num_key_value_heads, cfg.head_dim
        self.context_len = cfg.max_position_embeddings
        self.model = GemmaBody(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, False, Split.VOCAB)
        if getattr(hf_config, "tie_word_embeddings", True):
            self.lm_head.weight = self.model.embed_tokens.weight
        self.final_softcap = float(getattr(cfg, "final_logit_softcapping", None) or 0.0)
        self.head_softcap = self.final_softcap  # (head_argmax.py's GreedyHead)
        # sqrt(hidden) as HF's buffer holds it: rounded to float32, then to the model's dtype.
        scale = torch.tensor(cfg.hidden_size**0.5, dtype=torch.float32).to(torch.get_default_dtype())
        self.register_buffer("embed_scale", scale, persistent=False)
        self.global_rotary = rotary_cache(
            cfg, self.head_dim, self.context_len, _layer_type(cfg, "full_attention")
        )
        self.local_rotary = rotary_cache(cfg, self.head_dim, self.context_len, _layer_type(cfg, SLIDING))

    def decoder_layers(self) -> nn.ModuleList:
        return self.model.layers

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Hidden states [T, hidden] before the final norm."""
        global_cos, global_sin = self.global_rotary(ctx.positions)
        local_cos, local_sin = self.local_rotary(ctx.positions)
        x = splice_images(self.model.embed_tokens(input_ids) * self.embed_scale, ctx.images)
        for layer in self.model.layers:
            if layer.local:
                x = layer(x, local_cos, local_sin, ctx)
            else:
                x = layer(x, global_cos, global_sin, ctx)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of the selected tokens' hidden states (soft-capped where the config says)."""
        logits = self.lm_head(self.model.norm(hidden))
        return softcap(logits, self.final_softcap) if self.final_softcap else logits

    def compute_argmax(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """compute_logits' argmax per row, from the head's kernel without the logits (None: it has none,
        or the logits are soft-capped, which torch's tanh does here, not the kernel's operations)."""
        return None if self.final_softcap else head_argmax(self.lm_head, self.model.norm, hidden)


def _layer_type(cfg: Any, layer_type: str) -> str | None:
    """Gemma 3 keys its rope by layer type; Gemma 2 has one rope for all layers."""
    params = getattr(cfg, "rope_parameters", None) or {}
    return layer_type if isinstance(params.get(layer_type), dict) else None
