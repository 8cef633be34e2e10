"""Qwen3.5 (dense and MoE) and Qwen3-Next: hybrid decoders whose layers are Gated DeltaNet linear
attention (gated_delta.py; three of every four) or gated full attention, per ``layer_types``.

Where they differ from Llama, each mirroring HF's op order:
- every RMSNorm scales by ``1 + w`` in float32 (Gemma's ``GemmaRMSNorm``), but the linear layers'
  gated norm, which scales by w;
- full attention: ``q_proj`` gives each head its query and an output gate (per head [q | gate]);
  q and k are RMS-normed per head, a quarter of each head rotates (partial rotary; Qwen3.5's
  multimodal rope gives text the same angle on all three axes, so text is plain rope here) and the
  attended heads are scaled by sigmoid(gate) before ``o_proj``;
- the MoE models' sparse block adds a shared expert, scaled by sigmoid(``shared_expert_gate``), to
  the routed experts (moe.py's, top-k renormalised).
A multimodal Qwen3.5 checkpoint's tower is loaded apart (image_encoder.py); its image embeddings
replace the image tokens' and those tokens rotate by their 3D positions (qwen35_positions.py).

KV pool: only the full-attention layers have K/V, numbered among themselves (``kv_layer_shapes``);
the linear layers' states live in the recurrent-state pool (``state_shape``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Protocol

import torch
from torch import nn

from gpu_worker.forward_context import PLAIN, ForwardContext, paged_attention
from gpu_worker.image_encoder import splice_images
from gpu_worker.models.contract import AttentionLayer, Layer, Split
from gpu_worker.models.gated_delta import GatedDeltaNet
from gpu_worker.models.gemma import GemmaNorm
from gpu_worker.models.layers import Embedding, Linear, MergedLinear, apply_rotary
from gpu_worker.models.llama import MLP, LlamaArgs, partial_rotary_factor
from gpu_worker.models.moe import MoeArgs, SparseMoeBlock
from gpu_worker.models.qwen35_positions import mrope_cos_sin
from gpu_worker.models.rope import rotary_cache
from gpu_worker.sampling.head_argmax import head_argmax

LINEAR = "linear_attention"


class HybridNorm(GemmaNorm):
    """Qwen3.5's ``1 + w`` norms: Gemma's (gemma.py), the backend's RMSNorm kernel on float32 rows
    over ``1 + w`` summed once when it attaches; its own type, so Gemma's one-call decode tables do
    not take it for theirs."""


def mlp_args(cfg: Any) -> LlamaArgs:
    """What Llama's ``MLP`` reads (a dense layer's, or a shared expert's with its own size)."""
    inner = getattr(cfg, "intermediate_size", None) or cfg.moe_intermediate_size
    return LlamaArgs(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=inner,
        num_layers=cfg.num_hidden_layers, num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, eps=cfg.rms_norm_eps,
        act=cfg.hidden_act, qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=True,
        tie_embeddings=False, context_len=cfg.max_position_embeddings,
        sliding_windows=(0,) * cfg.num_hidden_layers, rotary_dim=cfg.head_dim, fused_checkpoint=False,
    )  # fmt: skip


class GateOps(Protocol):
    """A backend's partial rotary (in place) and output gate (backends/cpu/decode_hybrid.py's), which
    its one-call decode runs too."""

    def partial_rotary_(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot_dim: int
    ) -> None: ...

    def sigmoid_gate(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor: ...


class GatedAttention(AttentionLayer):
    """Full attention with a sigmoid output gate; ``layer`` is its index among the KV layers.
    Kernel slot ``gate_ops``: a backend's rotary and gate for float32 activations (``GateOps``)."""

    kernel_slots = ("gate_ops",)
    gate_ops: GateOps | None = None

    def __init__(self, cfg: Any, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.rotary_dim = int(self.head_dim * partial_rotary_factor(cfg))
        q_out, kv_out = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = bool(getattr(cfg, "attention_bias", False))
        self.qkv_proj = MergedLinear(
            cfg.hidden_size, {"q_proj": 2 * q_out, "k_proj": kv_out, "v_proj": kv_out}, bias
        )
        self.o_proj = Linear(q_out, cfg.hidden_size, bias, Split.ROW)
        self.q_norm = HybridNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = HybridNorm(self.head_dim, cfg.rms_norm_eps)

    def options(self) -> dict[str, Any]:
        return {"output_gate": True, "partial_rotary": self.rotary_dim < self.head_dim}

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """The layer's output, or ``residual`` plus it (the add fused into ``o_proj`` where it can be)."""
        tokens, heads, kv_heads, dim = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q_gate, k, v = self.qkv_proj(x).split([2 * heads * dim, kv_heads * dim, kv_heads * dim], -1)
        q, gate = q_gate.view(tokens, heads, 2 * dim).chunk(2, dim=-1)
        q, k = self.q_norm(q), self.k_norm(k.view(tokens, kv_heads, dim))
        rd, ops = self.rotary_dim, self.gate_ops if q.dtype == torch.float32 else None
        if ops is not None:  # q and k are the norms' own tensors
            ops.partial_rotary_(q, cos.contiguous(), sin.contiguous(), rd)
            ops.partial_rotary_(k, cos.contiguous(), sin.contiguous(), rd)
        else:
            q = torch.cat((apply_rotary(q[..., :rd], cos, sin), q[..., rd:]), dim=-1)
            k = torch.cat((apply_rotary(k[..., :rd], cos, sin), k[..., rd:]), dim=-1)
        attended = paged_attention(self.layer, q, k, v.reshape(tokens, kv_heads, dim), ctx, PLAIN)
        if ops is not None:
            gated = ops.sigmoid_gate(attended.contiguous(), gate)
        else:
            gated = attended.flatten(1) * torch.sigmoid(gate.reshape(tokens, -1))
        return self.o_proj(gated) if residual is None else self.o_proj.add_to(residual, gated)


class SharedExpertMoe(SparseMoeBlock):
    """Routed experts plus a shared expert gated by sigmoid(``shared_expert_gate``)."""

    def __init__(self, cfg: Any, args: LlamaArgs, moe: MoeArgs) -> None:
        super().__init__(cfg.hidden_size, cfg.hidden_act, moe)
        self.shared_expert = MLP(replace(args, intermediate_size=cfg.shared_expert_intermediate_size))
        self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        shared = self.shared_expert.add_to(torch.zeros_like(x), x)
        routed = self.experts(x, self.route(x))
        return residual + (routed + torch.sigmoid(self.shared_expert_gate(x)) * shared)


class HybridDecoderLayer(Layer):
    """A token mixer (``linear_attn`` or ``self_attn``) and a feed-forward block, each pre-normed."""

    def __init__(self, cfg: Any, mixer: Layer, mlp: Layer) -> None:
        super().__init__()
        self.input_layernorm = HybridNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.linear = isinstance(mixer, GatedDeltaNet)
        if self.linear:
            self.linear_attn = mixer
        else:
            self.self_attn = mixer
        self.post_attention_layernorm = HybridNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        normed = self.input_layernorm(x)
        if self.linear:
            x = self.linear_attn(normed, ctx, residual=x)
        else:
            x = self.self_attn(normed, cos, sin, ctx, residual=x)
        return self.mlp.add_to(x, self.post_attention_layernorm(x))  # type: ignore[operator]


class HybridBody(nn.Module):
    def __init__(self, cfg: Any, layers: list[HybridDecoderLayer]) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = HybridNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen35ForCausalLM(nn.Module):
    """Qwen3.5 causal LM (dense): KV pool for its full-attention layers, state pool for the rest."""

    tensor_parallel: tuple[int, int] | None = None
    head_softcap = 0.0  # (head_argmax.py's GreedyHead)
    linear_layout = "split"  # how the checkpoint holds the linear layers' projections (gated_delta.py)
    checkpoint_renames = ((r"^model\.language_model\.", "model."),)
    checkpoint_skipped = r"^(model\.visual\.|mtp\.)"
    # The last hidden rows a backend's one-call decode returned and their final norm, computed in that
    # call (backends/cpu/decode_hybrid.py): compute_logits and compute_argmax of those very rows take
    # them instead of running the norm again.
    normed_rows: tuple[torch.Tensor, torch.Tensor] | None = None

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        cfg = hf_config.get_text_config()
        self.args = mlp_args(cfg)
        kinds = list(cfg.layer_types)
        linear_index = [kinds[:i].count(LINEAR) for i in range(len(kinds))]
        layers = [
            HybridDecoderLayer(cfg, self._mixer(cfg, kind, i, linear_index[i]), self.feed_forward(cfg, i))
            for i, kind in enumerate(kinds)
        ]
        self.model = HybridBody(cfg, layers)
        self.num_layers = len(kinds)
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        # The KV pool holds the full-attention layers alone (kv_cache.py's pool_layer_shapes).
        self.kv_layer_shapes = [(self.num_kv_heads, self.head_dim)] * (len(kinds) - kinds.count(LINEAR))
        self.context_len = cfg.max_position_embeddings
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, False, Split.VOCAB)
        if getattr(cfg, "tie_word_embeddings", False) or getattr(hf_config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = rotary_cache(cfg, int(cfg.head_dim * partial_rotary_factor(cfg)), self.context_len)
        # A checkpoint with a vision tower: its images' tokens take 3D positions (qwen35_positions.py).
        rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
        self.mrope_sections: list[int] = list(rope.get("mrope_section") or [])
        vision = getattr(hf_config, "vision_config", None)
        self.mrope_merge = int(getattr(vision, "spatial_merge_size", 0)) if self.mrope_sections else 0
        mixer = next(layer.linear_attn for layer in layers if layer.linear)
        assert isinstance(mixer, GatedDeltaNet)
        self.state_shape = mixer.state_shape(kinds.count(LINEAR))

    def _mixer(self, cfg: Any, kind: str, layer: int, linear_index: int) -> Layer:
        if kind == LINEAR:
            # A GGUF's config says how its converter laid them out (weights/gguf_hybrid.py).
            layout = getattr(cfg, "gguf_linear_layout", None) or self.linear_layout
            return GatedDeltaNet(
                cfg, linear_index, layout, bool(getattr(cfg, "linear_value_heads_tiled", False))
            )
        return GatedAttention(cfg, layer - linear_index)

    def feed_forward(self, cfg: Any, layer: int) -> Layer:
        return MLP(self.args)

    def decoder_layers(self) -> nn.ModuleList:
        return self.model.layers

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Hidden states [T, hidden] before the final norm."""
        if ctx.mrope is None:
            cos, sin = self.rotary(ctx.positions)
        else:
            cos, sin = mrope_cos_sin(self.rotary, ctx.mrope, self.mrope_sections)
        x = splice_images(self.model.embed_tokens(input_ids), ctx.images)
        for layer in self.model.layers:
            x = layer(x, cos, sin, ctx)
        return x

    def normed_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm of ``hidden``: ``normed_rows``' where hidden is the tensor the one-call decode
        returned (the same kernel on the same rows), else the norm module's."""
        done = self.normed_rows
        if done is not None and done[0] is hidden:
            return done[1]
        return self.model.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.normed_hidden(hidden))

    def compute_argmax(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """compute_logits' argmax per row, from the head's kernel without the logits (None: it has none)."""
        return head_argmax(self.lm_head, self.normed_hidden, hidden)


class Qwen35MoeForCausalLM(Qwen35ForCausalLM):
    """Qwen3.5-MoE: every layer's feed-forward block routed experts and a shared expert."""

    def feed_forward(self, cfg: Any, layer: int) -> Layer:
        moe = MoeArgs.from_hf(cfg)  # (Qwen3.5-MoE's config has no norm_topk_prob: HF always renormalises)
        if not moe.sparse_layers[layer]:
            return MLP(self.args)
        return SharedExpertMoe(cfg, self.args, moe)


class Qwen3NextForCausalLM(Qwen35MoeForCausalLM):
    """Qwen3-Next: Qwen3.5-MoE's decoder with the linear layers' projections fused and grouped per
    key head in its checkpoint, and dense layers where ``mlp_only_layers`` says."""

    linear_layout = "grouped"
