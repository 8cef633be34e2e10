"""Gemma 4 (``gemma4_text``; of a multimodal ``gemma4`` checkpoint, its language model: the vision
and audio towers are not served).

Gemma 3's decoder (sandwich norms, GELU-tanh MLP, sliding and global layers with their own rope,
q/k RMS-normed per head) with, each mirroring HF's op order (float64 runs match it to ~1e-12):
- RMSNorm scales by w, not 1 + w; v is RMS-normed too (no scale), and scores are not scaled (1.0).
- Global layers have their own head size and KV head count (``per_layer_config``), a "proportional"
  rope that rotates only a leading share of each head, and with ``attention_k_eq_v`` no v
  projection: v is the k projection (before k's norm and rope).
- KV shared across layers (``num_kv_shared_layers``): each of the last N layers reads the KV of the
  last earlier layer of its type and computes no K/V of its own. The KV pool holds only the layers
  that own KV (``kv_layer_shapes``); a KV-shared layer attends over its source's pool layer. With
  ``use_double_wide_mlp`` those layers' MLPs are twice as wide.
- Per-layer input embeddings (``hidden_size_per_layer_input``): gemma4_blocks.py's ``per_layer``
  inputs, one [T, dim] slice per layer, gated into its residual stream after the feed-forward.
- An optional MoE block beside each MLP (``enable_moe_block``), a per-layer scalar on each layer's
  output, and soft-capped final logits.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gpu_worker.forward_context import AttentionOptions, ForwardContext, paged_attention
from gpu_worker.image_encoder import splice_images
from gpu_worker.models.contract import AttentionLayer, Layer, Split
from gpu_worker.models.gemma import SLIDING
from gpu_worker.models.gemma4_blocks import (
    Gemma4MLP,
    Gemma4RMSNorm,
    Gemma4Router,
    LogitSoftcap,
    StackedExperts,
    hf_scale,
)
from gpu_worker.models.layers import (
    Embedding,
    FusedOps,
    Linear,
    MergedLinear,
    activation,
    apply_rotary,
    gelu_tanh,
)
from gpu_worker.models.moe import ExpertGroups
from gpu_worker.models.rope import rotary_cache
from gpu_worker.sampling.head_argmax import head_argmax

SharedKV = dict[int, tuple[torch.Tensor, torch.Tensor]]  # a forward's K/V by the layer that made them
FUSED_ROTARY_HEAD_DIM = 512  # the widest head the fused rotary takes (the CPU kernels' MAX_HEAD_DIM)


def kv_sources(cfg: Any) -> tuple[int, ...]:
    """Per layer, the layer whose KV it attends over: its own, or for each of the last
    ``num_kv_shared_layers``, the last layer of its type before them (HF's ``kv_sharing_modes``)."""
    layers = cfg.num_hidden_layers
    first_shared = layers - int(getattr(cfg, "num_kv_shared_layers", 0) or 0)
    types = cfg.layer_types
    sources = list(range(first_shared))
    for layer in range(first_shared, layers):
        owners = [i for i in range(first_shared) if types[i] == types[layer]]
        if not owners:
            raise NotImplementedError(
                f"layer {layer} shares KV, but no earlier {types[layer]} layer owns any"
            )
        sources.append(owners[-1])
    return tuple(sources)


def layer_dims(cfg: Any, layer: int) -> tuple[int, int]:
    """(head_dim, KV heads) of ``layer``: global layers override both (``per_layer_config``)."""
    layer_cfg = cfg.per_layer_config[layer] if hasattr(cfg, "per_layer_config") else cfg
    return int(layer_cfg.head_dim), int(layer_cfg.num_key_value_heads)


class Gemma4Attention(AttentionLayer):
    """Attention over pool layer ``kv_slot``: its own K/V (q, k and v projected, normed, q and k
    rotated), or, KV-shared, a q projection alone over its source layer's K/V. Kernel slot
    ``fused``: a device backend's rotary in place (the same products and sum as ``apply_rotary``),
    on heads up to FUSED_ROTARY_HEAD_DIM wide."""

    kernel_slots = ("fused",)
    fused: FusedOps | None = None

    def __init__(self, cfg: Any, layer: int, kv_slot: int) -> None:
        super().__init__()
        self.layer, self.kv_slot, self.shares_kv = layer, kv_slot, kv_slot != layer
        sliding = cfg.layer_types[layer] == SLIDING
        self.head_dim, self.num_kv_heads = layer_dims(cfg, layer)
        self.num_heads = cfg.num_attention_heads
        self.k_eq_v = bool(getattr(cfg, "attention_k_eq_v", False)) and not sliding
        hidden, eps, bias = cfg.hidden_size, cfg.rms_norm_eps, bool(cfg.attention_bias)
        q_out, kv_out = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if self.shares_kv:
            self.q_proj = Linear(hidden, q_out, bias, Split.COLUMN)
        else:
            parts = {"q_proj": q_out, "k_proj": kv_out, **({} if self.k_eq_v else {"v_proj": kv_out})}
            self.qkv_proj = MergedLinear(hidden, parts, bias)
            self.k_norm = Gemma4RMSNorm(self.head_dim, eps)
            self.v_norm = Gemma4RMSNorm(self.head_dim, eps, with_scale=False)
        self.q_norm = Gemma4RMSNorm(self.head_dim, eps)
        self.o_proj = Linear(q_out, hidden, bias, Split.ROW)
        window = int(cfg.sliding_window or 0) if sliding else 0
        self.attention = AttentionOptions(scale=1.0, sliding_window=window)

    def options(self) -> dict[str, Any]:
        return {"shares_kv": self.shares_kv, "k_eq_v": self.k_eq_v, "attention": self.attention}

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext, shared: SharedKV
    ) -> torch.Tensor:
        tokens, heads, kv_heads = x.shape[0], self.num_heads, self.num_kv_heads
        if self.shares_kv:
            q = self.q_proj(x).view(tokens, heads, self.head_dim)
            # The source layer's K/V of this batch, already in the pool: attending "writes" them to
            # the same rows again (the same numbers), so every backend attends as for the source.
            k, v = shared[self.kv_slot]
        else:
            qkv = self.qkv_proj(x).view(tokens, -1, self.head_dim)
            q, k, *rest = qkv.split([heads, kv_heads, kv_heads][: len(self.qkv_proj.shards)], dim=1)
            v = self.v_norm(rest[0] if rest else k)  # k = v: the k projection before its norm and rope
            k = self._rotated(self.k_norm(k), cos, sin)
            shared[self.layer] = (k, v)
        q = self._rotated(self.q_norm(q), cos, sin)
        attended = paged_attention(self.kv_slot, q, k, v, ctx, self.attention)
        return self.o_proj(attended.flatten(1))

    def _rotated(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim] rotated: in place by the fused kernel where it takes the heads
        (x is then a norm's fresh output), else by torch into a new tensor."""
        if self.fused is None or self.head_dim > FUSED_ROTARY_HEAD_DIM or not x.is_contiguous():
            return apply_rotary(x, cos, sin)
        self.fused.rotary_(x, x.shape[1], cos.contiguous(), sin.contiguous())
        return x


class Gemma4DecoderLayer(Layer):
    """Attention and MLP between sandwich norms, the MoE block beside the MLP, the per-layer input
    gated in, the output times ``layer_scalar``. Parameter names are HF's (the loaders match them).
    Kernel slot ``fused``: the per-layer input's GELU-tanh gate and product in one call on float32
    (the MLP's ``gelu_tanh_mul``, so a C decode of the layer computes the gate as the modules do)."""

    kernel_slots = ("fused",)
    fused: FusedOps | None = None

    def __init__(self, cfg: Any, layer: int, kv_slot: int) -> None:
        super().__init__()
        hidden, eps, act = cfg.hidden_size, cfg.rms_norm_eps, cfg.hidden_activation
        self.layer_type = cfg.layer_types[layer]
        self.input_layernorm = Gemma4RMSNorm(hidden, eps)
        self.self_attn = Gemma4Attention(cfg, layer, kv_slot)
        self.post_attention_layernorm = Gemma4RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(hidden, eps)
        wide = bool(getattr(cfg, "use_double_wide_mlp", False)) and self.self_attn.shares_kv
        self.mlp = Gemma4MLP(hidden, cfg.intermediate_size * (2 if wide else 1), act)
        self.post_feedforward_layernorm = Gemma4RMSNorm(hidden, eps)
        self.moe = bool(getattr(cfg, "enable_moe_block", False))
        if self.moe:
            self.router = Gemma4Router(hidden, int(cfg.num_experts), int(cfg.top_k_experts), eps)
            self.experts = StackedExperts(int(cfg.num_experts), hidden, int(cfg.moe_intermediate_size), act)
            self.pre_feedforward_layernorm_2 = Gemma4RMSNorm(hidden, eps)
            self.post_feedforward_layernorm_1 = Gemma4RMSNorm(hidden, eps)
            self.post_feedforward_layernorm_2 = Gemma4RMSNorm(hidden, eps)
        per_layer = int(getattr(cfg, "hidden_size_per_layer_input", 0) or 0)
        self.per_layer = per_layer > 0
        if self.per_layer:
            self.per_layer_input_gate = Linear(hidden, per_layer, False)
            self.per_layer_projection = Linear(per_layer, hidden, False)
            self.post_per_layer_input_norm = Gemma4RMSNorm(hidden, eps)
            self.act = activation(act)
        self.layer_scalar = nn.Parameter(torch.empty(1), requires_grad=False)

    def options(self) -> dict[str, Any]:
        return {"moe": self.moe, "per_layer": self.per_layer}

    def forward(
        self,
        x: torch.Tensor,
        per_layer_input: torch.Tensor | None,
        rotary: tuple[torch.Tensor, torch.Tensor],
        ctx: ForwardContext,
        shared: SharedKV,
    ) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(x), *rotary, ctx, shared)
        x = x + self.post_attention_layernorm(attended)
        out = self.mlp(self.pre_feedforward_layernorm(x))
        if self.moe:
            out = self.post_feedforward_layernorm_1(out) + self._experts(x)
        x = x + self.post_feedforward_layernorm(out)
        if per_layer_input is not None:
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(self._gated(x, per_layer_input)))
        return x * self.layer_scalar

    def _gated(self, x: torch.Tensor, per_layer_input: torch.Tensor) -> torch.Tensor:
        """act(gate(x)) * the layer's per-layer input [T, dim]."""
        gate = self.per_layer_input_gate(x)
        if self.fused is not None and self.act is gelu_tanh and gate.dtype == torch.float32:
            return self.fused.gelu_tanh_mul(torch.cat((gate, per_layer_input), dim=-1))
        return self.act(gate) * per_layer_input

    def _experts(self, residual: torch.Tensor) -> torch.Tensor:
        """The MoE block: routed from the residual stream, the experts over its second pre-norm."""
        expert_ids, weights = self.router(residual)
        groups = ExpertGroups.of(expert_ids, weights.to(residual.dtype), self.experts.routed_experts)
        out = self.experts(self.pre_feedforward_layernorm_2(residual), groups)
        return self.post_feedforward_layernorm_2(out)


class Gemma4Body(nn.Module):
    """The embeddings (the main one and the per-layer one), the decoder layers, the final norm."""

    def __init__(self, cfg: Any, sources: tuple[int, ...]) -> None:
        super().__init__()
        hidden, layers = cfg.hidden_size, cfg.num_hidden_layers
        self.embed_tokens = Embedding(cfg.vocab_size, hidden)
        self.layers = nn.ModuleList(Gemma4DecoderLayer(cfg, i, sources[i]) for i in range(layers))
        self.norm = Gemma4RMSNorm(hidden, cfg.rms_norm_eps)
        self.register_buffer("embed_scale", hf_scale(hidden**0.5), persistent=False)
        self.per_layer_dim = int(getattr(cfg, "hidden_size_per_layer_input", 0) or 0)
        if self.per_layer_dim:
            width = layers * self.per_layer_dim
            self.embed_tokens_per_layer = Embedding(cfg.vocab_size_per_layer_input, width)
            self.per_layer_model_projection = Linear(hidden, width, False)
            self.per_layer_projection_norm = Gemma4RMSNorm(self.per_layer_dim, cfg.rms_norm_eps)
            self.register_buffer("per_layer_scale", hf_scale(self.per_layer_dim**0.5), persistent=False)

    def per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """[T, layers, dim]: each token's row of the per-layer table (times sqrt(dim)) averaged
        (times 1/sqrt(2)) with a projection of its scaled embedding (times 1/sqrt(hidden),
        RMS-normed per layer)."""
        # In place on each op's fresh output (the same roundings as new tensors): a one-row decode
        # step's allocations cost more than these ops' arithmetic.
        shape = (input_ids.shape[0], len(self.layers), self.per_layer_dim)
        own = self.embed_tokens_per_layer(input_ids).mul_(self.per_layer_scale).reshape(shape)
        projected = self.per_layer_model_projection(embeds).mul_(embeds.shape[-1] ** -0.5)
        projected = self.per_layer_projection_norm(projected.reshape(shape))
        return projected.add_(own).mul_(2.0**-0.5)


class Gemma4ForCausalLM(nn.Module):
    """Gemma 4 causal LM over the paged KV pool, whose layers are only those that own KV."""

    media_token_ids: torch.Tensor

    tensor_parallel: tuple[int, int] | None = None  # (rank, world): tensor_parallel.shard's

    # A multimodal checkpoint: its language model under model.language_model., beside towers we do
    # not serve.
    checkpoint_renames = ((r"^model\.language_model\.", "model."),)
    checkpoint_skipped = r"^model\.(vision_tower|audio_tower|embed_vision|embed_audio)\."

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        cfg = hf_config.get_text_config()
        if getattr(cfg, "use_bidirectional_attention", None) == "all":
            raise NotImplementedError("Gemma 4 with bidirectional attention over all tokens is not a decoder")
        sources = kv_sources(cfg)
        dims = [layer_dims(cfg, i) for i in range(cfg.num_hidden_layers)]
        self.num_layers, self.num_heads = cfg.num_hidden_layers, cfg.num_attention_heads
        self.head_dim, self.num_kv_heads = max(d for d, _ in dims), max(h for _, h in dims)
        self.context_len = cfg.max_position_embeddings
        self.model = Gemma4Body(cfg, sources)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, False, Split.VOCAB)
        if getattr(hf_config, "tie_word_embeddings", True):
            self.lm_head.weight = self.model.embed_tokens.weight
        cap = float(getattr(cfg, "final_logit_softcapping", None) or 0.0)
        self.final_softcap = LogitSoftcap(cap) if cap else None
        self.head_softcap = cap  # (head_argmax.py's GreedyHead)
        # A multimodal checkpoint's media placeholders: with no media given, HF embeds them as the pad
        # token (both embeddings); an image's positions then take the vision tower's embeddings.
        media = [getattr(hf_config, f"{kind}_token_id", None) for kind in ("image", "video", "audio")]
        media = [int(t) for t in media if t is not None] if hf_config is not cfg else []
        self.pad_token_id = int(getattr(cfg, "pad_token_id", None) or 0)
        self.register_buffer("media_token_ids", torch.tensor(media, dtype=torch.int64), persistent=False)
        self.rotary = nn.ModuleDict(
            {
                kind: rotary_cache(cfg, dims[cfg.layer_types.index(kind)][0], self.context_len, kind)
                for kind in sorted(set(cfg.layer_types))
            }
        )

    @property
    def kv_layer_shapes(self) -> list[tuple[int, int]]:
        """(KV heads, head_dim) of each pool layer: the layers that own KV (the first ones, a
        KV-shared layer's source among them), this rank's heads under tensor parallel."""
        attention = [layer.self_attn for layer in self.model.layers]
        owners = [a for a in attention if isinstance(a, Gemma4Attention) and not a.shares_kv]
        return [(a.num_kv_heads, a.head_dim) for a in owners]

    def decoder_layers(self) -> nn.ModuleList:
        return self.model.layers

    def step_inputs(
        self, input_ids: torch.Tensor, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        """The layers' inputs: ``embedded``'s, and each layer type's rotary (cos, sin)."""
        rotary = {kind: cache(ctx.positions) for kind, cache in self.rotary.items()}
        return *self.embedded(input_ids, ctx), rotary

    def embedded(
        self, input_ids: torch.Tensor, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The scaled embedding rows (an image's spliced in) and the per-layer inputs [T, layers, dim]
        (None without them)."""
        body = self.model
        if len(self.media_token_ids):
            placeholder = torch.isin(input_ids, self.media_token_ids)
            input_ids = torch.where(placeholder, self.pad_token_id, input_ids)
        x = body.embed_tokens(input_ids).mul_(body.embed_scale)  # a fresh lookup
        # As HF's: the per-layer table reads an image's positions as the pad token, its projection
        # the image's embeddings.
        x = splice_images(x, ctx.images)
        per_layer = body.per_layer_inputs(input_ids, x) if body.per_layer_dim else None
        return x, per_layer

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Hidden states [T, hidden] before the final norm."""
        body = self.model
        x, per_layer, rotary = self.step_inputs(input_ids, ctx)
        shared: SharedKV = {}
        # Where an image's tokens see each other both ways (the text config's "vision"), HF's mask
        # does so on sliding layers only: the global layers stay causal.
        causal = ctx if ctx.images is None else replace(ctx, images=replace(ctx.images, blocks={}))
        for i, layer in enumerate(body.layers):
            layer_input = per_layer[:, i] if per_layer is not None else None
            layer_ctx = ctx if layer.layer_type == SLIDING else causal
            x = layer(x, layer_input, rotary[str(layer.layer_type)], layer_ctx, shared)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of the selected tokens' hidden states (soft-capped where the config says)."""
        logits = self.lm_head(self.model.norm(hidden))
        return self.final_softcap(logits) if self.final_softcap is not None else logits

    def compute_argmax(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """compute_logits' argmax per row, from the head's kernel without the logits, soft-capped there
        by the fused soft-cap's operations (None: no such kernel, or the soft-cap runs in torch)."""
        cap = self.final_softcap
        if cap is not None and cap.fused is None:
            return None
        return head_argmax(self.lm_head, self.model.norm, hidden, cap.cap if cap is not None else 0.0)


def adopt_media_tokens(model: object, gguf_path: str) -> None:
    """Give a Gemma 4 loaded from a GGUF alone (its text config, no media ids) its vocabulary's
    media placeholders when it serves images, as HF's multimodal model has them."""
    from gpu_worker.weights.gguf_gemma4 import media_token_ids

    if isinstance(model, Gemma4ForCausalLM) and len(model.media_token_ids) == 0:
        model.media_token_ids = torch.tensor(media_token_ids(Path(gguf_path)), dtype=torch.int64)
