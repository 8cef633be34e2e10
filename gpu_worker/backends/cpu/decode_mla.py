"""A latent-attention model's decode step in one C call (csrc/decode_mla.c): DeepSeek-V2's layers on
GGUF blocks.

A DeepSeek layer run module by module makes some 35 Python-level calls at one row (its projections,
norms, the complex rotary in torch, the absorbed products, the attention, the router, the experts and
the shared experts), each a module call, a ctypes call or a torch op and a tensor: a large share of a
one-row step beside its reads. When every row of a step decodes, every layer is of kinds and options
the C code implements (``C_MLA_LAYERS``: a positive list over the layer contract, so an option or a
kind it does not know keeps the model on its modules) and its kernels are the C decode's (Linears on
blocks without bias, kv_b as the file's attn_k_b / attn_v_b blocks, the router csrc/moe.c's softmax
top-k, the experts' one call), the layers run as one call that makes the same kernel calls in the
same order, so the hidden states equal the modules' bit for bit (tests/gpu_worker/test_decode_mla.py).

Left to the modules: DeepSeek-V3's and GLM's routers (sigmoid, the correction bias, groups) and rotary
(interleaved pairs), tensor parallel, biases, prompt rows (the expanded form), and more rows than
``LatentHeads.max_rows`` (where the modules' absorbed products take torch's bmm).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.backends.cpu import abi
from gpu_worker.backends.cpu.build import LATENT_KV_DTYPE_CODES
from gpu_worker.backends.cpu.decode_common import anything, not_listed, off, runs_as_one_call
from gpu_worker.backends.cpu.decode_layers import FusedDecode, fused_decode
from gpu_worker.backends.cpu.decode_structs import DecodeLinear, fields, quant_linears
from gpu_worker.backends.cpu.experts import MoeProjection, QuantExperts, QuantRouter
from gpu_worker.backends.cpu.kernels import DTYPE_CODES, CpuKernels
from gpu_worker.backends.cpu.latent_heads import LatentHeads
from gpu_worker.forward_context import ForwardContext
from gpu_worker.models.deepseek import DecoderLayer, DeepseekForCausalLM
from gpu_worker.models.deepseek_moe import DeepseekMoe, DeepseekRouter
from gpu_worker.models.layers import Linear, MergedLinear, RMSNorm
from gpu_worker.models.llama import MLP
from gpu_worker.models.mla import LATENT_NORM_EPS, ComplexRotary, LatentAttention, LatentProjection, MlaArgs
from gpu_worker.models.moe import Experts

logger = logging.getLogger(__name__)

LINEARS = ("q_a", "q", "kv_a", "o", "gate_up", "down")  # csrc's MLA_LINEARS, in order


def _is(wanted: object) -> Callable[[object], bool]:
    return lambda value: value == wanted


# What csrc/decode_mla.c computes, as the layer contract (models/contract.py) states it: each layer
# type and, for each, the options it implements with the values it takes (exact types).
C_MLA_LAYERS: dict[type[nn.Module], dict[str, Callable[[Any], bool]]] = {
    DecoderLayer: {},
    LatentAttention: {"rotary": _is("complex"), "q_lora": anything, "scale": anything},
    LatentProjection: {},
    Linear: {"bias": off},
    MergedLinear: {"bias": off},
    RMSNorm: {},
    MLP: {"act": lambda act: act is F.silu},
    DeepseekMoe: {"shared": anything},
    DeepseekRouter: {
        **{"top_k": anything, "scoring": _is("softmax"), "num_groups": _is(1), "topk_groups": anything},
        **{"group_score": anything, "bias": off, "norm_topk_prob": off, "scaling": anything},
    },
    Experts: {"act": lambda act: act is F.silu},
}

# MlaArgs' fields the C decode accounts for (a new one keeps the model on its modules until placed here).
C_MLA_ARGS = frozenset(
    {"hidden_size", "num_heads", "q_lora_rank", "kv_lora_rank", "nope_dim", "rope_dim", "v_dim", "bias"}
    | {"scale", "rotary"}
)


class MlaLayer(ctypes.Structure):
    """csrc/rivulet_kernels.h's ``mla_layer``."""

    _fields_ = [
        *fields(ctypes.c_void_p, "input_norm", "post_norm"),
        ("linear", DecodeLinear * len(LINEARS)),
        *fields(ctypes.c_void_p, "q_a_norm", "kv_a_norm", "k_b", "v_b"),
        *fields(ctypes.c_int64, "k_b_type", "v_b_type"),
        *fields(ctypes.c_void_p, "cache", "router"),
        ("experts", ctypes.POINTER(MoeProjection)),
        *fields(ctypes.c_int64, "n_experts", "top_k", "expert_inner"),
        ("route_scale", ctypes.c_float),
        ("inner", ctypes.c_int64),
    ]


class MlaDims(ctypes.Structure):
    """csrc/rivulet_kernels.h's ``mla_dims``."""

    _fields_ = [
        *fields(ctypes.c_int64, "hidden", "heads", "q_lora_rank", "kv_lora_rank"),
        *fields(ctypes.c_int64, "nope_dim", "rope_dim", "v_dim"),
        *fields(ctypes.c_float, "eps", "latent_eps", "scale"),
        *fields(ctypes.c_int64, "dtype", "kv_dtype"),
    ]


def _mlps(layer: DecoderLayer) -> list[MLP]:
    mlp = layer.mlp
    if isinstance(mlp, DeepseekMoe):
        return [mlp.shared_experts] if mlp.has_shared else []
    assert isinstance(mlp, MLP)
    return [mlp]


def _attention_linears(attn: LatentAttention) -> list[Linear]:
    q = [attn.q_a_proj, attn.q_b_proj] if attn.args.q_lora_rank else [attn.q_proj]
    return [*q, attn.kv_a_proj_with_mqa, attn.o_proj]


def _kernels_missing(layer: DecoderLayer) -> str | None:
    """Why a layer of kinds the C decode implements still cannot run there: its kernels (the slots the
    backend filled) are not the C decode's."""
    attn, mlp = layer.self_attn, layer.mlp
    norms = [layer.input_layernorm, layer.post_attention_layernorm, attn.kv_a_layernorm]
    norms += [attn.q_a_layernorm] if attn.args.q_lora_rank else []
    mlps = _mlps(layer)
    if any(n.fused is None for n in norms) or any(m.fused is None for m in mlps):
        return "no fused kernels"
    if attn.pooled_attention is not None or not isinstance(attn.kv_b_proj.heads, LatentHeads):
        return "latent projections not on the file's attn_k_b / attn_v_b blocks"
    linears = _attention_linears(attn) + [p for m in mlps for p in (m.gate_up_proj, m.down_proj)]
    if quant_linears(linears) is None:
        return "a Linear not on GGUF blocks"
    if isinstance(mlp, DeepseekMoe):
        experts = mlp.experts
        impl = experts.impl
        one_call = isinstance(impl, QuantExperts) and impl.one_call
        if not isinstance(mlp.gate.route, QuantRouter) or not one_call:
            return "mixture-of-experts layers whose router or experts are not in C"
        if experts.num_experts < experts.routed_experts:
            return "experts split over ranks"
    return None


def _first_layer(model: DeepseekForCausalLM) -> DecoderLayer:
    layer = model.model.layers[0]
    assert isinstance(layer, DecoderLayer)
    return layer


def why_not(model: nn.Module, dtype: torch.dtype) -> str | None:
    """Why the model's decode steps cannot run as one call (None: they can)."""
    if not isinstance(model, DeepseekForCausalLM):
        return "not a latent-attention model"
    if model.tensor_parallel is not None:
        return "tensor parallel: o and down sum over the ranks"
    if dtype not in DTYPE_CODES:
        return f"activations in {dtype}"
    if not isinstance(model.rotary, ComplexRotary):
        return "a rotary other than DeepSeek-V2's complex pairs"
    args = _first_layer(model).self_attn.args
    unknown = sorted(f.name for f in dataclasses.fields(MlaArgs) if f.name not in C_MLA_ARGS)
    if unknown:
        return f"latent-attention arguments the C decode does not know: {', '.join(unknown)}"
    if args.rope_dim > 256 or args.rope_dim % 32 or args.latent_dim > 1024:
        # torch's complex product rounds as the C code only on whole runs of 16 pairs (its vector
        # path; the rest by an FMA it compiled in): V2's keys are 64
        return f"a pool row of {args.kv_lora_rank} + {args.rope_dim}: outside the C decode's"
    for layer in model.decoder_layers():
        assert isinstance(layer, DecoderLayer)
        reason = not_listed(C_MLA_LAYERS, layer) or _kernels_missing(layer)
        if reason is not None:
            return reason
    return None


def _linear(module: Linear | None) -> DecodeLinear:
    if module is None:
        return DecodeLinear()
    impls = quant_linears([module])
    assert impls is not None  # why_not's
    return DecodeLinear.of(impls[0])


def _layer(layer: DecoderLayer) -> MlaLayer:
    """A layer's struct, without its pool."""
    attn, mlp = layer.self_attn, layer.mlp
    heads = attn.kv_b_proj.heads
    assert isinstance(heads, LatentHeads)
    lora = attn.args.q_lora_rank > 0
    mlps = _mlps(layer)
    dense = mlps[0] if mlps else None
    out = MlaLayer(
        input_norm=layer.input_layernorm.weight.data_ptr(),
        post_norm=layer.post_attention_layernorm.weight.data_ptr(),
        q_a_norm=attn.q_a_layernorm.weight.data_ptr() if lora else None,
        kv_a_norm=attn.kv_a_layernorm.weight.data_ptr(),
        k_b=heads.k_b.data.data_ptr(),
        v_b=heads.v_b.data.data_ptr(),
        k_b_type=heads.k_b.type,
        v_b_type=heads.v_b.type,
        route_scale=1.0,
        inner=0 if dense is None else dense.gate_up_proj.sizes[0],
    )
    q = [attn.q_a_proj, attn.q_b_proj] if lora else [None, attn.q_proj]
    ffn = [None, None] if dense is None else [dense.gate_up_proj, dense.down_proj]
    linears = [*q, attn.kv_a_proj_with_mqa, attn.o_proj, *ffn]
    for i, module in enumerate(linears):
        out.linear[i] = _linear(module)
    if isinstance(mlp, DeepseekMoe):
        experts, router = mlp.experts.impl, mlp.gate.route
        assert isinstance(experts, QuantExperts) and isinstance(router, QuantRouter)  # why_not's
        out.router = router.weight.data_ptr()
        out.experts = ctypes.cast(experts.projections, ctypes.POINTER(MoeProjection))
        out.n_experts, out.top_k, out.expert_inner = router.weight.shape[0], router.top_k, experts.inner
        out.route_scale = mlp.gate.args.scaling
    return out


class _Binding:
    """``decode_mla`` in a built kernels library, its structs checked against the header."""

    def __init__(self, path: Path) -> None:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._decode_mla = ctypes.CDLL(str(path)).decode_mla
        self._decode_mla.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr, ptr, i64, i64]
        self._decode_mla.restype = ctypes.c_int
        structs = {"mla_layer": MlaLayer, "mla_dims": MlaDims, "decode_linear": DecodeLinear}
        abi.check(abi.bound_functions(self), {**structs, "moe_projection": MoeProjection}, {"MLA_LINEARS": 6})

    def __call__(self, *args: Any) -> int:
        return int(self._decode_mla(*args))


@functools.cache
def _load(path: Path) -> _Binding:
    return _Binding(path)


class MlaDecode:
    """Runs a latent-attention model's decoder layers for steps whose rows all decode, as one call."""

    def __init__(self, model: DeepseekForCausalLM, kernels: CpuKernels, dtype: torch.dtype) -> None:
        self.model: Any = model
        self.call = _load(kernels.path)
        self.dtype = dtype
        first = _first_layer(model)
        args = first.self_attn.args
        self.max_rows = LatentHeads.max_rows  # past it the modules' products are torch's bmm
        self.dims = MlaDims(
            hidden=args.hidden_size, heads=args.num_heads, q_lora_rank=args.q_lora_rank,
            kv_lora_rank=args.kv_lora_rank, nope_dim=args.nope_dim, rope_dim=args.rope_dim, v_dim=args.v_dim,
            eps=first.input_layernorm.eps, latent_eps=LATENT_NORM_EPS, scale=args.scale,
            dtype=DTYPE_CODES[dtype], kv_dtype=DTYPE_CODES[dtype],
        )  # fmt: skip
        self._layers: ctypes.Array[MlaLayer] | None = None
        self._pool = 0  # the pool's pointer _layers was built for

    def _layer_array(self, ctx: ForwardContext) -> ctypes.Array[MlaLayer]:
        pool = ctx.k_cache[0].data_ptr()
        if self._layers is not None and pool == self._pool:
            return self._layers
        layers = self.model.model.layers
        array = (MlaLayer * len(layers))()
        for i, layer in enumerate(layers):
            array[i] = _layer(layer)
            array[i].cache = ctx.k_cache[i].data_ptr()
        self._layers, self._pool = array, pool
        self.dims.kv_dtype = LATENT_KV_DTYPE_CODES[ctx.k_cache[0].dtype]
        return array

    def __call__(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor | None:
        """Hidden states [T, hidden] before the final norm, as ``model(input_ids, ctx)`` gives them;
        None where the modules must run the step."""
        paged, batch = ctx.attn.paged_decode, ctx.rows
        if not ctx.attn.in_order or paged is None or ctx.images is not None or ctx.latent_form == "expanded":
            return None
        if batch is not None and max(batch.extend_lens) > 1:
            return None  # prompt rows: the modules expand them (models/mla.py's row_plan)
        rows = paged.rows
        if rows.rows != len(input_ids) or rows.rows > self.max_rows:
            return None  # past it the modules' products are torch's bmm
        factors, _ = self.model.rotary(ctx.positions)
        rope = torch.view_as_real(factors).reshape(len(input_ids), -1).contiguous()
        x = self.model.model.embed_tokens(input_ids)
        out = torch.empty_like(x)
        assert x.is_contiguous() and x.dtype == self.dtype
        layers = self._layer_array(ctx)
        status = self.call(
            ctypes.byref(layers), len(layers), ctypes.byref(self.dims), x.data_ptr(), out.data_ptr(),
            rows.rows, rope.data_ptr(), rows.q_rows, rows.req_pool_idx, rows.kv_lens, rows.page_table,
            rows.pt_stride, rows.page_size,
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"decode_mla failed: {abi.status_text(status)}")
        return out


def mla_decode(model: nn.Module, kernels: CpuKernels | None, dtype: torch.dtype) -> MlaDecode | None:
    """The latent-attention model's one-call decode, or None (logged why) where its modules must run."""
    if kernels is None or not runs_as_one_call(logger, why_not(model, dtype), "csrc/decode_mla.c"):
        return None
    assert isinstance(model, DeepseekForCausalLM)
    return MlaDecode(model, kernels, dtype)


def one_call_decode(
    model: nn.Module, kernels: CpuKernels | None, dtype: torch.dtype
) -> FusedDecode | MlaDecode | None:
    """The model's one-call decode: csrc/decode_mla.c's for a latent-attention model, else
    csrc/decode_layers.c's (each None, logged why, where its modules must run)."""
    if isinstance(model, DeepseekForCausalLM):
        return mla_decode(model, kernels, dtype)
    return fused_decode(model, kernels, dtype)
