"""Gemma 2 and 3 decode steps in the one C call (csrc/decode_layers.c): what the call needs of a
Gemma model beyond a Llama (models/gemma.py).

- The norms scale by ``1 + w``: the call takes the weights ``GemmaNorm`` folds the 1 into when its
  kernel attaches (float32, the sum the torch path makes), so the modules and the call run the same
  RMSNorm kernel on the same weights.
- Four norms a layer: before and after attention, before and after the MLP (the ones after are the
  layer's ``attn_out_norm`` and ``mlp_out_norm``).
- GELU (tanh) gates the MLP (``gelu_tanh_mul``, the kernel ``GemmaMLP`` calls).
- The embedding is scaled by sqrt(hidden), as the model scales it; Gemma 3's local and global layers
  rotate by their own tables, passed stacked (a layer's ``rope`` picks one).
- The attention scale from ``query_pre_attn_scalar`` (one for every layer), Gemma 3's Q/K norms and
  each layer's window. Gemma 2's soft-capped attention keeps the modules (``GEMMA_C_LAYERS``).

float32 activations only: in bf16 GemmaRMSNorm rounds once, after the scale, which the kernel does not.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gpu_worker.backends.cpu.decode_structs import (
    DecodeDims,
    DecodeLayer,
    bias_missing,
    linear_fields,
    quant_linears,
)
from gpu_worker.backends.cpu.quant import QuantLinear
from gpu_worker.forward_context import PLAIN, AttentionOptions
from gpu_worker.models.gemma import GemmaAttention, GemmaDecoderLayer, GemmaForCausalLM, GemmaMLP, GemmaNorm
from gpu_worker.models.layers import gelu_tanh


def _any(value: object) -> bool:
    return True


def _gelu_tanh(act: object) -> bool:
    return act is gelu_tanh


def _gemma_attention(options: AttentionOptions) -> bool:
    """A window and a scale (the model's one: ``why_not_gemma``) beside PLAIN's other options: a
    soft-cap (Gemma 2's), sinks or an option added later keep the layer on its modules."""
    plain = dataclasses.replace(options, sliding_window=0, scale=None)
    return options.sinks is None and plain == PLAIN


# The Gemma layer kinds csrc/decode_layers.c computes, and their options (decode_layers.C_LAYERS).
GEMMA_C_LAYERS: dict[type[nn.Module], dict[str, Callable[[Any], bool]]] = {
    GemmaDecoderLayer: {},
    GemmaAttention: {"qk_norm": _any, "attention": _gemma_attention},
    GemmaMLP: {"act": _gelu_tanh},
    GemmaNorm: {},
}


def _norms(layer: GemmaDecoderLayer) -> list[GemmaNorm]:
    return [m for m in layer.modules() if isinstance(m, GemmaNorm)]


def _linears(layer: GemmaDecoderLayer) -> list[QuantLinear] | None:
    attn, mlp = layer.self_attn, layer.mlp
    return quant_linears([attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj])


def why_not_gemma(model: GemmaForCausalLM, dtype: torch.dtype) -> str | None:
    """What keeps a Gemma model (whose layers are of ``GEMMA_C_LAYERS``' kinds) off the one call."""
    if dtype != torch.float32:
        return f"Gemma on {dtype} activations (its norms round once, after the scale: torch's)"
    layers: list[Any] = list(model.decoder_layers())
    if len({layer.self_attn.attention.scale for layer in layers}) > 1:
        return "attention scales differing by layer"
    if len({norm.eps for layer in layers for norm in _norms(layer)}) > 1:
        return "norms of differing epsilons"
    return None


def gemma_kernels_missing(layer: GemmaDecoderLayer) -> str | None:
    """Why a Gemma layer of kinds the C decode implements still cannot run there."""
    norms = _norms(layer)
    if any(n.folded is None for n in norms) or layer.self_attn.fused is None or layer.mlp.fused is None:
        return "no fused kernels"
    impls = _linears(layer)
    if impls is None:
        return "a Linear not on GGUF blocks"
    return bias_missing(impls, torch.float32)  # (why_not_gemma: float32 activations alone)


def _folded(norm: Any) -> int:
    """The address of a norm's 1 + w (held while its kernel is attached: why_not's)."""
    assert isinstance(norm, GemmaNorm) and norm.folded is not None
    return norm.folded.data_ptr()


class GemmaDecode:
    """A Gemma model's part of the one call: its sizes, its layers' structs, its inputs."""

    def __init__(self, model: GemmaForCausalLM) -> None:
        self.model: Any = model

    def dims(self) -> DecodeDims:
        model, first = self.model, self.model.model.layers[0]
        scale = first.self_attn.attention.scale
        return DecodeDims(
            hidden=first.input_layernorm.weight.shape[0],
            heads=model.num_heads,
            kv_heads=model.num_kv_heads,
            head_dim=model.head_dim,
            inner=sum(first.mlp.gate_up_proj.sizes) // 2,
            eps=first.input_layernorm.eps,
            scale=model.head_dim**-0.5 if scale is None else scale,
            gelu=1,
        )

    def layer(self, layer: GemmaDecoderLayer) -> DecodeLayer:
        impls, attn = _linears(layer), layer.self_attn
        assert impls is not None  # why_not's
        return DecodeLayer(
            input_norm=_folded(layer.input_layernorm),
            post_norm=_folded(layer.pre_feedforward_layernorm),
            attn_out_norm=_folded(layer.post_attention_layernorm),
            mlp_out_norm=_folded(layer.post_feedforward_layernorm),
            **linear_fields(impls),
            q_norm=_folded(attn.q_norm) if attn.qk_norm else None,
            k_norm=_folded(attn.k_norm) if attn.qk_norm else None,
            window=attn.attention.sliding_window,
            rope=int(layer.local),
        )

    def inputs(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The scaled embedding rows, and cos / sin [2, T, head_dim]: the global table, the local."""
        model = self.model
        x = model.model.embed_tokens(input_ids) * model.embed_scale
        global_cos, global_sin = model.global_rotary(positions)
        local_cos, local_sin = model.local_rotary(positions)
        return x, torch.stack((global_cos, local_cos)), torch.stack((global_sin, local_sin))
