"""gpt-oss decode steps in the one C call (csrc/decode_layers.c): what the call needs of a gpt-oss
model (models/gpt_oss.py) beyond a Llama's.

- A learned sink logit per head in every softmax: the layer's ``sinks``, float32, passed to the paged
  attention kernel as the modules' attention passes them (backends/cpu/attention.py).
- Biases on q/k/v and o: the Linears' own (decode_structs.linear_fields), added after each matmul as
  QuantLinear adds them.
- The router (a bias, the softmax of each row's top-k logits): csrc/moe.c's moe_route_topk, which the
  modules route by too (clamped_experts.py's TopKRouter).
- The experts' biases and clamped SwiGLU: moe_experts_clamped, ClampedQuantExperts' call, on its
  biases, alpha and limit.
- Sliding and full layers alternating (each layer's window), YaRN in the model's rotary table: as a
  Llama's.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gpu_worker.backends.cpu.clamped_experts import ClampedQuantExperts, TopKRouter
from gpu_worker.backends.cpu.decode_structs import DecodeLayer
from gpu_worker.backends.cpu.experts import MoeProjection
from gpu_worker.models.gpt_oss import ClampedSwigluExperts, SinkAttention, TopKSoftmaxMoeBlock


def _any(value: object) -> bool:
    return True


def _off(value: object) -> bool:
    return not value


def _top_k_softmax(value: object) -> bool:
    return value == "top_k"


def _clamped_swiglu(value: object) -> bool:
    return value == "clamped_swiglu"


# The gpt-oss layer kinds csrc/decode_layers.c computes, and their options (decode_layers.C_LAYERS,
# which names SinkDecoderLayer: its attention options are a Llama layer's, the sinks joining them in
# its forward from SinkAttention's option ``sinks``).
GPT_OSS_C_LAYERS: dict[type[nn.Module], dict[str, Callable[[Any], bool]]] = {
    SinkAttention: {"qk_norm": _any, "partial_rotary": _off, "sinks": _any},
    TopKSoftmaxMoeBlock: {"top_k": _any, "softmax": _top_k_softmax},
    ClampedSwigluExperts: {"act": _clamped_swiglu, "alpha": _any, "limit": _any, "bias": _any},
}


def gpt_oss_moe_missing(mlp: TopKSoftmaxMoeBlock) -> str | None:
    """Why a gpt-oss sparse block cannot run in the one call (None: it can)."""
    experts = mlp.experts
    if not isinstance(mlp.router, TopKRouter) or not isinstance(experts.impl, ClampedQuantExperts):
        return "gpt-oss experts whose router or experts are not in C"
    if experts.num_experts < experts.routed_experts:
        return "gpt-oss experts split over ranks"
    return None


def sinks_field(attn: SinkAttention, held: list[torch.Tensor]) -> int:
    """The address of the layer's sinks as the attention kernel reads them (float32), kept in ``held``."""
    sinks = attn.sinks.detach().to(torch.float32).contiguous()
    held.append(sinks)
    return sinks.data_ptr()


def fill_gpt_oss_moe(out: DecodeLayer, mlp: TopKSoftmaxMoeBlock) -> None:
    """A layer struct's router and experts fields from gpt-oss's sparse block (``gpt_oss_moe_missing``
    said it fits)."""
    router, impl = mlp.router, mlp.experts.impl
    assert isinstance(router, TopKRouter) and isinstance(impl, ClampedQuantExperts)
    blocks, clamped = impl.blocks, impl.clamped
    out.router, out.router_bias = router.weight.data_ptr(), router.bias.data_ptr()
    out.n_experts, out.top_k, out.norm_topk = router.weight.shape[0], router.top_k, 1
    out.experts = ctypes.cast(blocks.projections, ctypes.POINTER(MoeProjection))
    out.expert_inner = blocks.inner
    out.gate_up_bias, out.down_bias = clamped.gate_up_bias.data_ptr(), clamped.down_bias.data_ptr()
    out.swiglu_alpha, out.swiglu_limit = clamped.alpha, clamped.limit
