"""A decode step's decoder layers in one C call (csrc/decode_layers.c), for Llama models on GGUF blocks.

At one stream a step of the embedded model makes ~270 kernel calls, each a module call, a ctypes call
and an output tensor in Python: a large share of the step around its matmuls (docs/benchmarks.md, the
one-call decode). When every row of a step decodes, every layer is of kinds and options the C code
implements (``C_LAYERS``: a positive list over the layer contract, so a layer kind or option it does not
know runs the modules) and every Linear of every layer is a ``QuantLinear`` (its bias, where it has one,
added after the matmul as ``QuantLinear`` adds it: Qwen2's q/k/v, gpt-oss's q/k/v and o), the layers run
as one call that makes the same kernel calls in the same order, so the hidden states equal the modules'
bit for bit (tests/gpu_worker/test_decode_layers.py). A merged Linear whose projections differ in type
(a Q4_K_M file's q/k in Q4_K beside v in Q6_K) is passed as its parts, each run on its own columns, as
``QuantLinear`` runs them. Qwen3's per-head Q/K norms (float32 activations: in bf16 the modules norm
with torch) and a mixture of experts in place of the MLP (experts on blocks, routed by the
``QuantRouter`` the modules route with too) and sliding windows, each layer its own (Mistral's, a
per-layer pattern's sliding layers), run in the one call as well. Any other step, or model, runs
the modules: prefill chunks and mixed batches, bf16 or fp32 weights, --compile. Gemma 2
and 3 run in it too, on float32 activations, with their own norms, GELU and rotary tables
(decode_gemma.py), and gpt-oss with its sinks, biased top-k router and clamped experts
(decode_gpt_oss.py).
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.backends.cpu.decode_common import not_listed, runs_as_one_call
from gpu_worker.backends.cpu.decode_gemma import (
    GEMMA_C_LAYERS,
    GemmaDecode,
    gemma_kernels_missing,
    why_not_gemma,
)
from gpu_worker.backends.cpu.decode_gpt_oss import (
    GPT_OSS_C_LAYERS,
    fill_gpt_oss_moe,
    gpt_oss_moe_missing,
    sinks_field,
)
from gpu_worker.backends.cpu.decode_structs import (
    DecodeDims,
    DecodeLayer,
    bias_missing,
    linear_fields,
    quant_linears,
)
from gpu_worker.backends.cpu.experts import MoeProjection, QuantExperts, QuantRouter
from gpu_worker.backends.cpu.kernels import DTYPE_CODES, KV_DTYPE_CODES, CpuKernels
from gpu_worker.backends.cpu.quant import QuantLinear
from gpu_worker.forward_context import PLAIN, AttentionOptions, ForwardContext
from gpu_worker.models.gemma import GemmaDecoderLayer, GemmaForCausalLM
from gpu_worker.models.gpt_oss import SinkAttention, SinkDecoderLayer, TopKSoftmaxMoeBlock
from gpu_worker.models.layers import Linear, MergedLinear, RMSNorm
from gpu_worker.models.llama import MLP, Attention, DecoderLayer, LlamaForCausalLM
from gpu_worker.models.moe import Experts, SparseMoeBlock

logger = logging.getLogger(__name__)


def _any(value: object) -> bool:
    return True


def _off(value: object) -> bool:
    return not value


def _silu(act: object) -> bool:
    return act is F.silu


def _window_only(options: AttentionOptions) -> bool:
    """Plain attention, or with a sliding window (the layer's own): every other option PLAIN's, so a
    softcap, a scale, sinks or an option added later keeps the layer on its modules."""
    return options.sinks is None and dataclasses.replace(options, sliding_window=0) == PLAIN


# What csrc/decode_layers.c computes, as the layer contract (models/contract.py) states it: each layer
# type it implements, and for each the options it implements, with the values it takes. Exact types:
# a subclass may compute otherwise. A type or an option not named here (a new one) keeps the model on
# its modules, which compute everything the model declares.
C_LAYERS: dict[type[nn.Module], dict[str, Callable[[Any], bool]]] = {
    DecoderLayer: {"attention": _window_only},
    SinkDecoderLayer: {"attention": _window_only},  # its sinks: SinkAttention's (GPT_OSS_C_LAYERS)
    Attention: {"qk_norm": _any, "partial_rotary": _off},
    MergedLinear: {"bias": _any},
    Linear: {"bias": _any},
    RMSNorm: {},
    MLP: {"act": _silu},
    SparseMoeBlock: {"top_k": _any, "norm_topk_prob": _any},
    Experts: {"act": _silu},
    **GEMMA_C_LAYERS,
    **GPT_OSS_C_LAYERS,
}


# The model-wide arguments (``LlamaArgs``) the C decode accounts for: shapes it takes (``DecodeDims``),
# options its layers carry into ``C_LAYERS`` through ``options()``, or what it does not read (the
# vocabulary, the checkpoint's layout). A new argument keeps the model on its modules until it is
# placed here, with its C code where it changes what a layer computes.
C_ARGS = frozenset(
    {
        *("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"),
        *("head_dim", "eps", "act", "qkv_bias", "o_bias", "mlp_bias", "qk_norm", "tie_embeddings"),
        *("context_len", "sliding_windows", "rotary_dim", "fused_checkpoint"),
    }
)


def not_in_c(layer: nn.Module) -> str | None:
    """The first part of a decoder layer that csrc/decode_layers.c does not implement (None: all are)."""
    return not_listed(C_LAYERS, layer)


def _linears(layer: DecoderLayer) -> list[QuantLinear] | None:
    """The layer's Linears' QuantLinears (q/k/v, o, and the MLP's gate/up and down where it has an MLP),
    if each is one (of up to MAX_PARTS parts)."""
    modules = [layer.self_attn.qkv_proj, layer.self_attn.o_proj]
    if isinstance(layer.mlp, MLP):
        modules += [layer.mlp.gate_up_proj, layer.mlp.down_proj]
    return quant_linears(modules)


def _one_call_experts(mlp: SparseMoeBlock) -> bool:
    """Whether a sparse block's router and experts run in C (QuantRouter, QuantExperts' one call)."""
    impl = mlp.experts.impl
    return isinstance(mlp.router, QuantRouter) and isinstance(impl, QuantExperts) and impl.one_call


def _kernels_missing(layer: DecoderLayer, dtype: torch.dtype) -> str | None:
    """Why a layer of kinds the C decode implements still cannot run there: its kernels (the slots the
    backend filled) are not the C decode's."""
    attn, mlp = layer.self_attn, layer.mlp
    if isinstance(mlp, TopKSoftmaxMoeBlock):
        reason = gpt_oss_moe_missing(mlp)
        if reason is not None:
            return reason
    elif isinstance(mlp, SparseMoeBlock):
        if not _one_call_experts(mlp) or mlp.experts.num_experts < mlp.experts.routed_experts:
            return "mixture-of-experts layers whose router or experts are not in C"
    elif isinstance(mlp, MLP) and mlp.fused is None:
        return "no fused kernels"
    if attn.qk_norm and (dtype != torch.float32 or attn.q_norm.fused is None):
        return "Q/K norms on bf16 activations (normed by torch there)"
    if layer.input_layernorm.fused is None or attn.fused is None:
        return "no fused kernels"
    impls = _linears(layer)
    if impls is None:
        return "a Linear not on GGUF blocks"
    return bias_missing(impls, dtype)


def why_not(model: nn.Module, dtype: torch.dtype) -> str | None:
    """Why the model's decode steps cannot run as one call (None: they can): every decoder layer must
    be of the kinds in ``C_LAYERS``, and on the kernels the C decode calls."""
    gemma = isinstance(model, GemmaForCausalLM)
    if not isinstance(model, LlamaForCausalLM) and not gemma:
        return "not a Llama or Gemma model"
    if model.tensor_parallel is not None:
        return "tensor parallel: o and down sum over the ranks"
    if dtype not in DTYPE_CODES:
        return f"activations in {dtype}"
    if not CpuKernels.supports(model.num_heads, model.num_kv_heads, model.head_dim, dtype):
        return f"{model.num_heads} heads of {model.head_dim} (KV {model.num_kv_heads}): beyond its attention"
    if isinstance(model, LlamaForCausalLM):
        unknown = sorted(f.name for f in dataclasses.fields(model.args) if f.name not in C_ARGS)
        if unknown:
            return f"model arguments the C decode does not know: {', '.join(unknown)}"
    for layer in model.decoder_layers():
        reason = not_in_c(layer)
        if reason is None and isinstance(layer, GemmaDecoderLayer):
            reason = gemma_kernels_missing(layer)
        elif reason is None:
            assert isinstance(layer, DecoderLayer)
            reason = _kernels_missing(layer, dtype)
        if reason is not None:
            return reason
    return why_not_gemma(model, dtype) if isinstance(model, GemmaForCausalLM) else None


class Family(Protocol):
    """What the one call needs of a model family: its sizes, a layer's struct (without its KV
    pool's pointers), and a step's embedding rows and rotary tables."""

    model: Any

    def dims(self) -> DecodeDims: ...

    def layer(self, layer: Any) -> DecodeLayer: ...

    def inputs(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]: ...


class LlamaDecode:
    """The Llama family's part of the one call."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model: Any = model  # (its submodules typed as nn.Module's attributes are: Tensor | Module)
        self.held: list[torch.Tensor] = []  # what the layers' structs point into, beside the model's own

    def dims(self) -> DecodeDims:
        args = self.model.args
        return DecodeDims(
            hidden=args.hidden_size,
            heads=args.num_heads,
            kv_heads=args.num_kv_heads,
            head_dim=args.head_dim,
            inner=args.intermediate_size,
            eps=args.eps,
            scale=args.head_dim**-0.5,
        )

    def layer(self, layer: DecoderLayer) -> DecodeLayer:
        impls = _linears(layer)
        assert impls is not None
        attn, mlp = layer.self_attn, layer.mlp
        out = DecodeLayer(
            input_norm=layer.input_layernorm.weight.data_ptr(),
            post_norm=layer.post_attention_layernorm.weight.data_ptr(),
            **linear_fields(impls),
            q_norm=attn.q_norm.weight.data_ptr() if attn.qk_norm else None,
            k_norm=attn.k_norm.weight.data_ptr() if attn.qk_norm else None,
            window=layer.attention.sliding_window,
        )
        if isinstance(attn, SinkAttention):
            out.sinks = sinks_field(attn, self.held)
        if isinstance(mlp, TopKSoftmaxMoeBlock):
            fill_gpt_oss_moe(out, mlp)
        elif isinstance(mlp, SparseMoeBlock):
            experts, router = mlp.experts.impl, mlp.router
            assert isinstance(experts, QuantExperts) and isinstance(router, QuantRouter)  # why_not's
            out.router = router.weight.data_ptr()
            out.experts = ctypes.cast(experts.projections, ctypes.POINTER(MoeProjection))
            out.n_experts, out.top_k = router.weight.shape[0], router.top_k
            out.norm_topk, out.expert_inner = int(router.norm_topk), experts.inner
        return out

    def inputs(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        cos, sin = self.model.rotary(positions)
        return self.model.model.embed_tokens(input_ids), cos, sin


class FusedDecode:
    """Runs a model's decoder layers for steps whose rows all decode, as one kernel call."""

    def __init__(self, family: Family, kernels: CpuKernels, dtype: torch.dtype) -> None:
        self.family = family
        self.model: Any = family.model
        self.kernels = kernels
        self.dims = family.dims()
        self.dims.dtype = self.dims.kv_dtype = DTYPE_CODES[dtype]  # kv_dtype: the pool's, at the first step
        self.dtype = dtype
        self._layers: ctypes.Array[DecodeLayer] | None = None
        self._pool: tuple[int, int] = (0, 0)  # the KV pool's pointers _layers was built for

    def _layer_array(self, ctx: ForwardContext) -> ctypes.Array[DecodeLayer]:
        pool = (ctx.k_cache[0].data_ptr(), ctx.v_cache[0].data_ptr())
        if self._layers is not None and pool == self._pool:
            return self._layers
        layers = self.model.model.layers
        array = (DecodeLayer * len(layers))()
        for i, layer in enumerate(layers):
            array[i] = self.family.layer(layer)
            array[i].k_cache, array[i].v_cache = ctx.k_cache[i].data_ptr(), ctx.v_cache[i].data_ptr()
        self._layers, self._pool = array, pool
        self.dims.kv_dtype = KV_DTYPE_CODES[ctx.k_cache[0].dtype]
        return array

    def __call__(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor | None:
        """Hidden states [T, hidden] before the final norm, as ``model(input_ids, ctx)`` gives them;
        None when some row of the step does not decode (the caller runs the modules)."""
        paged = ctx.attn.paged_decode
        if not ctx.attn.in_order or paged is None or ctx.images is not None:
            return None
        x, cos, sin = self.family.inputs(input_ids, ctx.positions)
        out = torch.empty_like(x)
        assert x.is_contiguous() and x.dtype == self.dtype and cos.is_contiguous() and sin.is_contiguous()
        layers = self._layer_array(ctx)
        self.kernels.decode_layers(layers, len(layers), self.dims, x, out, cos, sin, paged.rows)
        return out


def fused_decode(model: nn.Module, kernels: CpuKernels | None, dtype: torch.dtype) -> FusedDecode | None:
    """The model's one-call decode, or None (logged why) where its modules must run."""
    if kernels is None or not runs_as_one_call(logger, why_not(model, dtype), "csrc/decode_layers.c"):
        return None
    if isinstance(model, GemmaForCausalLM):
        return FusedDecode(GemmaDecode(model), kernels, dtype)
    assert isinstance(model, LlamaForCausalLM)
    return FusedDecode(LlamaDecode(model), kernels, dtype)
