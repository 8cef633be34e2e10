"""A dense Qwen3.5 model's decode steps in one C call (csrc/decode_hybrid.c), and the small ops its
gated attention runs through in the modules too (the ``gate_ops`` slot), so both compute alike.

A one-row step of the layer-by-layer path makes ~15 module calls a layer around its matmuls, a large
share of the step. Where every row of a float32 step decodes one token (no checkpoint inside it, no
image), every layer is of the kinds and options the C code implements (``HYBRID_C_LAYERS``: a positive
list over the layer contract, as decode_layers.py's ``C_LAYERS``: an unknown kind or option keeps the
model on its modules) and every Linear is a ``QuantLinear`` without bias, the layers run as one call
making the same kernel calls in the same order, so the hidden states equal the modules' bit for bit
(tests/gpu_worker/test_decode_hybrid.py). Qwen3.5-MoE and Qwen3-Next keep their modules (their sparse
block's shared expert and gate are not in the C code), as does a bf16 step (the Gated DeltaNet
block's fused kernel is float32).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.backends.cpu import abi
from gpu_worker.backends.cpu.decode_common import anything, not_listed, off, runs_as_one_call
from gpu_worker.backends.cpu.decode_rows import DecodeRows
from gpu_worker.backends.cpu.decode_structs import MAX_PARTS, DecodeLinear, fields, quant_linears
from gpu_worker.backends.cpu.kernels import DTYPE_CODES, KV_DTYPE_CODES, CpuKernels
from gpu_worker.backends.cpu.layouts import kernel_type
from gpu_worker.backends.cpu.quant import QuantEmbedding, QuantLinear
from gpu_worker.forward_context import ForwardContext
from gpu_worker.models.gated_delta import CausalConv1d, GatedDeltaNet, GatedRMSNorm
from gpu_worker.models.layers import Linear, MergedLinear
from gpu_worker.models.llama import MLP
from gpu_worker.models.qwen35 import GatedAttention, HybridDecoderLayer, HybridNorm, Qwen35ForCausalLM

logger = logging.getLogger(__name__)

IN_LINEARS = 2  # csrc/rivulet_kernels.h's HYBRID_IN_LINEARS


# What csrc/decode_hybrid.c computes, as the layer contract states it (decode_layers.py's C_LAYERS).
HYBRID_C_LAYERS: dict[type[nn.Module], dict[str, Callable[[Any], bool]]] = {
    HybridDecoderLayer: {},
    HybridNorm: {},
    GatedDeltaNet: {"layout": lambda v: v == "split", "tiled_values": anything, "conv_kernel": anything},
    CausalConv1d: {},
    GatedRMSNorm: {},
    GatedAttention: {"output_gate": lambda v: v is True, "partial_rotary": anything},
    MergedLinear: {"bias": off},
    Linear: {"bias": off},
    MLP: {"act": lambda act: act is F.silu},
}


class HybridLayer(ctypes.Structure):
    """csrc/rivulet_kernels.h's ``hybrid_layer``."""

    _fields_ = [
        *fields(ctypes.c_void_p, "input_norm", "post_norm"),
        ("in_proj", DecodeLinear * IN_LINEARS),
        *fields(DecodeLinear, "out_proj", "gate_up", "down"),
        ("linear", ctypes.c_int64),
        *fields(ctypes.c_void_p, "k_cache", "v_cache", "q_norm", "k_norm", "conv_w", "conv_state", "state"),
        *fields(ctypes.c_void_p, "a_log", "dt_bias", "norm_w"),
    ]


class HybridDims(ctypes.Structure):
    """csrc/rivulet_kernels.h's ``hybrid_dims``."""

    _fields_ = [
        *fields(ctypes.c_int64, "hidden", "inner", "heads", "kv_heads", "head_dim"),
        *fields(ctypes.c_int64, "rotary_dim", "kv_dtype", "k_heads", "v_heads", "dk", "dv"),
        *fields(ctypes.c_int64, "conv_kernel", "tiled", "linear_in", "pool_slots"),
        *fields(ctypes.c_float, "eps", "attn_scale", "delta_scale"),
    ]


@dataclass(frozen=True)
class StepInputs:
    """The tables decode_hybrid.c looks a step's inputs up in: the embedding's blocks (``embed`` 0:
    not blocks, the caller looks the rows up) and the rotary cache's float32 cos / signed sin
    [table_rows, rotary_dim], pointers into tensors the model holds."""

    embed: int
    embed_type: int
    vocab: int
    cos: int
    sin: int
    table_rows: int


@dataclass(frozen=True)
class FinalNorm:
    """The model's final norm as decode_hybrid.c runs it after the layers: its folded weight (``1 + w``,
    float32, a pointer into the tensor the norm holds) and epsilon."""

    weight: int
    eps: float


class HybridKernels:
    """ctypes bindings of decode_hybrid.c in a built kernels library; also the ``gate_ops`` slot of
    models/qwen35.py's ``GatedAttention`` (its partial rotary and output gate)."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        i64, i32, ptr, f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float
        self._decode = lib.decode_hybrid
        self._decode.argtypes = [
            ptr, i64, ptr, ptr, ptr, i32, i64, ptr, i64, ptr, ptr,  # layers .. dims, ids, embed .. sin
            ptr, i64, ptr, ptr, ptr, ptr, ptr, i64, i64,  # out, rows, slots .. page_size
            ptr, f32, ptr,  # final_norm, final_eps, normed
        ]  # fmt: skip
        self._decode.restype = i32
        self._rotary = lib.partial_rotary
        self._rotary.argtypes = [ptr, i64, i64, i32, i32, i32, ptr, ptr, i32]
        self._rotary.restype = None
        self._gate = lib.sigmoid_gate_mul
        self._gate.argtypes = [ptr, ptr, i64, i64, ptr, i64, i32, i32, i32]
        self._gate.restype = None
        structs = {"decode_linear": DecodeLinear, "hybrid_layer": HybridLayer, "hybrid_dims": HybridDims}
        abi.check(abi.bound_functions(self), structs, {"HYBRID_IN_LINEARS": IN_LINEARS})

    def decode(
        self, layers: ctypes.Array[HybridLayer], dims: HybridDims, inputs: StepInputs, ids: torch.Tensor,
        positions: torch.Tensor, out: torch.Tensor, slots: int, rows: DecodeRows,
        final: FinalNorm | None = None, normed: torch.Tensor | None = None,
    ) -> None:  # fmt: skip
        """Every layer over decode rows (csrc/decode_hybrid.c): out [T, hidden] from the rows' token
        ``ids`` and ``positions`` (int64 [T]), looked up in ``inputs``' tables (where it holds no
        embedding blocks, out holds the embedding rows already), each row's state-pool slot at
        ``slots`` (a pointer to int64 [T]); then, given ``final``, the final norm of out into ``normed``
        [T, hidden]."""
        count = out.shape[0]
        for t in (ids, positions):
            assert t.dtype == torch.int64 and t.is_contiguous() and t.shape == (count,)
        assert rows.rows == count, "the attention's rows are the step's"
        if final is not None:
            assert normed is not None and normed.shape == out.shape and normed.is_contiguous()
        status = self._decode(
            ctypes.byref(layers), len(layers), ctypes.byref(dims), ids.data_ptr(), inputs.embed,
            inputs.embed_type, inputs.vocab, positions.data_ptr(), inputs.table_rows, inputs.cos, inputs.sin,
            out.data_ptr(), count, slots, rows.q_rows, rows.req_pool_idx, rows.kv_lens,
            rows.page_table, rows.pt_stride, rows.page_size, 0 if final is None else final.weight,
            0.0 if final is None else final.eps, None if normed is None else normed.data_ptr(),
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"decode_hybrid failed: {abi.status_text(status)}")

    def partial_rotary_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot_dim: int) -> None:
        """Rotate each head's first ``rot_dim`` dims of x [T, H, D] (heads contiguous) in place;
        cos / signed sin [T, 1, rot_dim] contiguous, x's dtype (small_ops.c's rotary, per head)."""
        assert x.stride(2) == 1 and x.stride(1) == x.shape[2] and x.dtype in DTYPE_CODES
        assert cos.is_contiguous() and sin.is_contiguous() and cos.shape[-1] == rot_dim == sin.shape[-1]
        self._rotary(
            x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], x.shape[2], rot_dim, cos.data_ptr(),
            sin.data_ptr(), DTYPE_CODES[x.dtype],
        )  # fmt: skip

    def sigmoid_gate(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x * sigmoid(gate) -> [T, H D]: x [T, H, D] contiguous, gate [T, H, D] in x's dtype, each
        head's D contiguous (a view of the projection's [q | gate] heads)."""
        rows, heads, dim = x.shape
        assert x.is_contiguous() and gate.shape == x.shape and gate.stride(2) == 1 and gate.dtype == x.dtype
        out = torch.empty((rows, heads * dim), dtype=x.dtype)
        self._gate(
            x.data_ptr(), gate.data_ptr(), gate.stride(0), gate.stride(1), out.data_ptr(), rows, heads, dim,
            DTYPE_CODES[x.dtype],
        )  # fmt: skip
        return out


@functools.cache
def load(path: Path) -> HybridKernels:
    """The bindings of the library at ``path`` (a CpuKernels' ``path``), bound once."""
    return HybridKernels(path)


def attach(model: nn.Module, kernels: CpuKernels) -> None:
    """The ``gate_ops`` slot of every gated attention layer (its float32 rotary and output gate)."""
    for module in model.modules():
        if isinstance(module, GatedAttention):
            module.attach(gate_ops=load(kernels.path))


def _linears(layer: HybridDecoderLayer) -> list[QuantLinear] | None:
    """The layer's input projection's QuantLinear (up to IN_LINEARS * MAX_PARTS parts), then its
    output projection's, gate_up's and down's (up to MAX_PARTS each), each without bias."""
    mixer: Any = layer.linear_attn if layer.linear else layer.self_attn
    first = mixer.in_proj if layer.linear else mixer.qkv_proj
    out = mixer.out_proj if layer.linear else mixer.o_proj
    mlp: Any = layer.mlp
    impl = first.impl
    if not isinstance(impl, QuantLinear) or impl.bias is not None:
        return None
    if len(impl.weight.parts) > IN_LINEARS * MAX_PARTS:
        return None
    rest = quant_linears([out, mlp.gate_up_proj, mlp.down_proj])
    return None if rest is None else [impl, *rest]


def _kernels_missing(layer: Any) -> str | None:
    """Why a layer of kinds the C decode implements still cannot run there."""
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    if layer.linear:
        if layer.linear_attn.decode_step is None:
            return "no fused Gated DeltaNet step"
    else:
        attn = layer.self_attn
        norms += [attn.q_norm, attn.k_norm]
        if attn.gate_ops is None:
            return "no gated attention kernels"
    if any(n.folded is None for n in norms) or layer.mlp.fused is None:  # type: ignore[union-attr]
        return "no fused kernels"
    if _linears(layer) is None:
        return "a Linear not on GGUF blocks"
    return None


def why_not(model: nn.Module, dtype: torch.dtype) -> str | None:
    """Why a hybrid model's decode steps cannot run as one call (None: they can)."""
    if type(model) is not Qwen35ForCausalLM:
        return f"{type(model).__name__}: only dense Qwen3.5 runs in the one-call decode"
    if model.tensor_parallel is not None:
        return "tensor parallel"
    if dtype != torch.float32:
        return f"activations in {dtype} (the Gated DeltaNet step's kernel is float32)"
    tables = (model.rotary.cos, model.rotary.sin)
    if any(t.dtype != torch.float32 or not t.is_contiguous() for t in tables):
        return "rotary tables not contiguous float32"
    if not CpuKernels.supports(model.num_heads, model.num_kv_heads, model.head_dim, dtype):
        return f"{model.num_heads} heads of {model.head_dim} (KV {model.num_kv_heads}): beyond its attention"
    layers: list[Any] = list(model.decoder_layers())
    for layer in layers:
        reason = not_listed(HYBRID_C_LAYERS, layer) or _kernels_missing(layer)
        if reason is not None:
            return reason
    norms = [m for layer in layers for m in layer.modules() if isinstance(m, HybridNorm | GatedRMSNorm)]
    if len({norm.eps for norm in norms}) > 1:
        return "norms of differing epsilons"
    return None


def _decode_linears(impl: QuantLinear, count: int) -> list[DecodeLinear]:
    """A Linear's parts as ``count`` decode_linears, MAX_PARTS parts each in order (the rest empty)."""
    parts = impl.weight.parts
    out = []
    for i in range(count):
        span = slice(i * MAX_PARTS, (i + 1) * MAX_PARTS)
        piece = DecodeLinear.of_parts(parts[span], impl.dense_min_rows[span], impl.a8_min_rows[span])
        out.append(piece if parts[span] else DecodeLinear())
    return out


def _ptr(t: torch.Tensor) -> int:
    assert t.dtype == torch.float32 and t.is_contiguous(), "the one-call decode's tensors: contiguous float32"
    return t.data_ptr()


class HybridDecode:
    """Runs a dense Qwen3.5 model's decoder layers for float32 steps whose rows all decode one
    token, as one kernel call."""

    def __init__(self, model: Qwen35ForCausalLM, kernels: CpuKernels) -> None:
        self.model: Any = model
        self.kernels = load(kernels.path)
        layers: list[Any] = list(model.model.layers)
        lin = next(layer.linear_attn for layer in layers if layer.linear)
        attn = next((layer.self_attn for layer in layers if not layer.linear), None)
        head_dim = model.head_dim
        self.dims = HybridDims(
            hidden=model.args.hidden_size, inner=model.args.intermediate_size, heads=model.num_heads,
            kv_heads=model.num_kv_heads, head_dim=head_dim,
            rotary_dim=model.rotary.cos.shape[1], k_heads=lin.key_heads,
            v_heads=lin.value_heads, dk=lin.d_k, dv=lin.d_v, conv_kernel=lin.conv_kernel,
            tiled=int(lin.tiled_values and lin.key_heads < lin.value_heads),
            linear_in=lin.in_proj.impl.out_features, eps=layers[0].input_layernorm.eps,
            attn_scale=head_dim**-0.5, delta_scale=lin.d_k**-0.5,
        )  # fmt: skip
        self._layers: ctypes.Array[HybridLayer] | None = None
        self._pools: tuple[int, ...] = ()  # the pools' pointers _layers was built for
        embed, rotary = model.model.embed_tokens.impl, model.rotary
        assert attn is None or attn.rotary_dim == self.dims.rotary_dim, "the rotary table's width"
        table = embed.table if isinstance(embed, QuantEmbedding) and embed.dtype == torch.float32 else None
        self.inputs = StepInputs(
            embed=0 if table is None else table.data.data_ptr(),
            embed_type=0 if table is None else kernel_type(table), vocab=0 if table is None else table.rows,
            cos=rotary.cos.data_ptr(), sin=rotary.sin.data_ptr(), table_rows=rotary.cos.shape[0],
        )  # fmt: skip
        # The final norm in the call where the model's runs the kernels' RMSNorm (float32 rows), so the
        # model's compute_logits / compute_argmax take its rows (Qwen35ForCausalLM.normed_rows) instead
        # of running it on caches the next weights' stream has emptied; None: the model runs it.
        norm = model.model.norm
        folded = norm.folded if norm.fused is not None else None
        self.final = None if folded is None else FinalNorm(_ptr(folded), norm.eps)

    def _layer(self, layer: Any, ctx: ForwardContext) -> HybridLayer:
        impls = _linears(layer)
        assert impls is not None  # why_not's
        first, out, gate_up, down = impls
        mixer = layer.linear_attn if layer.linear else layer.self_attn
        struct = HybridLayer(
            input_norm=_ptr(layer.input_layernorm.folded),
            post_norm=_ptr(layer.post_attention_layernorm.folded),
            in_proj=(DecodeLinear * IN_LINEARS)(*_decode_linears(first, IN_LINEARS)),
            out_proj=DecodeLinear.of(out), gate_up=DecodeLinear.of(gate_up), down=DecodeLinear.of(down),
            linear=int(layer.linear),
        )  # fmt: skip
        if layer.linear:
            pool = ctx.recurrent.pool  # type: ignore[union-attr]
            struct.conv_w, struct.conv_state = _ptr(mixer.conv1d.weight), _ptr(pool.conv[mixer.index])
            struct.state, struct.norm_w = _ptr(pool.recurrent[mixer.index]), _ptr(mixer.norm.weight)
            struct.a_log, struct.dt_bias = _ptr(mixer.A_log), _ptr(mixer.dt_bias)
        else:
            kv = mixer.layer
            struct.k_cache, struct.v_cache = ctx.k_cache[kv].data_ptr(), ctx.v_cache[kv].data_ptr()
            struct.q_norm, struct.k_norm = _ptr(mixer.q_norm.folded), _ptr(mixer.k_norm.folded)
        return struct

    def _layer_array(self, ctx: ForwardContext) -> ctypes.Array[HybridLayer]:
        pool = ctx.recurrent.pool  # type: ignore[union-attr]
        pools = (ctx.k_cache[0].data_ptr(), ctx.v_cache[0].data_ptr(), pool.recurrent[0].data_ptr())
        if self._layers is not None and pools == self._pools:
            return self._layers
        layers = self.model.model.layers
        self._layers = (HybridLayer * len(layers))(*(self._layer(layer, ctx) for layer in layers))
        self._pools = pools
        self.dims.kv_dtype = KV_DTYPE_CODES[ctx.k_cache[0].dtype]
        self.dims.pool_slots = pool.recurrent[0].shape[0]
        return self._layers

    def __call__(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor | None:
        """Hidden states [T, hidden] before the final norm, as ``model(input_ids, ctx)`` gives them;
        None where some row does not decode one token (the caller runs the modules)."""
        batch, paged = ctx.recurrent, ctx.attn.paged_decode
        if batch is None or not batch.steps_whole or not ctx.attn.in_order or paged is None:
            return None
        if ctx.images is not None or ctx.mrope is not None or not ctx.k_cache:
            return None
        rows = input_ids.shape[0]
        final, shape = self.final, (rows, self.dims.hidden)
        out = torch.empty(shape, dtype=torch.float32)
        normed = None if final is None else torch.empty(shape, dtype=torch.float32)
        if not self.inputs.embed:
            out.copy_(self.model.model.embed_tokens(input_ids))
        layers = self._layer_array(ctx)
        # Each row's state slot is its req_pool_idx (recurrent_state.py), and the rows are in token
        # order (in_order): the attention rows' req_pool_idx, where step_slots would build it again.
        rows_of = paged.rows
        self.kernels.decode(
            layers, self.dims, self.inputs, input_ids, ctx.positions, out, rows_of.req_pool_idx, rows_of,
            final, normed,
        )  # fmt: skip
        # (past nn.Module's __setattr__, which checks a tuple against parameters, modules and buffers)
        object.__setattr__(self.model, "normed_rows", None if normed is None else (out, normed))
        return out


def hybrid_decode(
    model: Qwen35ForCausalLM, kernels: CpuKernels | None, dtype: torch.dtype
) -> HybridDecode | None:
    """A Qwen3.5 model's one-call decode, or None (logged why) where its modules must run."""
    if kernels is None or not runs_as_one_call(logger, why_not(model, dtype), "csrc/decode_hybrid.c"):
        return None
    return HybridDecode(model, kernels)
