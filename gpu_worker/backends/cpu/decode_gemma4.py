"""Gemma 4's decode steps through the one C call (csrc/decode_gemma4.c), run by run: which layers
the call takes, and the step that runs them between the other layers' modules.

What a Gemma 4 layer computes beyond Gemma 3's (decode_gemma.py): its own heads, KV heads, head size,
MLP width and rotary table; a KV-shared layer projects q alone and attends over its source's pool
layer, written earlier in the step, without writing; v RMS-normed without a scale (from k's
projection where k = v); the per-layer input gated by ``gelu_tanh_mul`` on a [gate | input] row,
projected, normed and added; the output times the layer's scalar. The call takes a run of
consecutive layers (the E4B shape's: all 12, its 512-wide global heads within the attention kernel's
MAX_HEAD_DIM, one call a step): a layer it does not take (heads past the kernel's limits; a MoE
block) keeps its modules between two runs, and so does the source of a KV-shared module layer
(the modules pass a source's K/V in ``shared``, not through the pool). A layer runs in C only where
every part of it is on ``GEMMA4_C_LAYERS``' positive list and on the kernels the modules call
(float32 activations, QuantLinears without a bias), so the hidden states equal the modules' bit for
bit (tests/gpu_worker/test_decode_gemma4.py). The step's inputs: decode_gemma4_inputs.py; the
call's structs and binding: decode_gemma4_kernels.py.
"""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from gpu_worker.backends.cpu.decode_common import anything, not_listed, off
from gpu_worker.backends.cpu.decode_gemma4_inputs import StepInputs
from gpu_worker.backends.cpu.decode_gemma4_kernels import LINEARS, Gemma4Dims, Gemma4Layer, gemma4_kernels
from gpu_worker.backends.cpu.decode_structs import DecodeLinear, quant_linears
from gpu_worker.backends.cpu.kernels import KV_DTYPE_CODES, CpuKernels
from gpu_worker.backends.cpu.quant import QuantLinear
from gpu_worker.forward_context import PLAIN, AttentionOptions, ForwardContext
from gpu_worker.models.gemma4 import Gemma4Attention, Gemma4DecoderLayer, Gemma4ForCausalLM, SharedKV
from gpu_worker.models.gemma4_blocks import Gemma4MLP, Gemma4RMSNorm
from gpu_worker.models.layers import Linear, MergedLinear, RotaryCache, gelu_tanh

logger = logging.getLogger(__name__)


def _plain_or_window(options: AttentionOptions) -> bool:
    """A window and a scale (the layer's own, passed) beside PLAIN's other options: a soft-cap, sinks
    or an option added later keep the layer on its modules."""
    return options.sinks is None and dataclasses.replace(options, sliding_window=0, scale=None) == PLAIN


def _gelu_tanh(act: object) -> bool:
    return act is gelu_tanh


# What csrc/decode_gemma4.c computes, as the layer contract states it (decode_layers.py's C_LAYERS).
GEMMA4_C_LAYERS: dict[type[nn.Module], dict[str, Callable[[Any], bool]]] = {
    Gemma4DecoderLayer: {"moe": off, "per_layer": anything},
    Gemma4Attention: {"shares_kv": anything, "k_eq_v": anything, "attention": _plain_or_window},
    Gemma4RMSNorm: {"with_scale": anything},
    Gemma4MLP: {"act": _gelu_tanh},
    MergedLinear: {"bias": off},
    Linear: {"bias": off},
}


def _norms(layer: nn.Module) -> list[Gemma4RMSNorm]:
    return [m for m in layer.modules() if isinstance(m, Gemma4RMSNorm)]


def _linears(layer: Gemma4DecoderLayer) -> list[Linear]:
    attn, mlp = layer.self_attn, layer.mlp
    out: list[Linear] = [attn.q_proj if attn.shares_kv else attn.qkv_proj, attn.o_proj]
    out += [mlp.gate_up_proj, mlp.down_proj]
    if layer.per_layer:
        out += [layer.per_layer_input_gate, layer.per_layer_projection]
    return out


def why_not_layer(layer: Gemma4DecoderLayer, kernels: CpuKernels) -> str | None:
    """Why a decoder layer keeps its modules (None: csrc/decode_gemma4.c computes it as they do)."""
    reason = not_listed(GEMMA4_C_LAYERS, layer)
    if reason is not None:
        return reason
    attn = layer.self_attn
    if not kernels.supports(attn.num_heads, attn.num_kv_heads, attn.head_dim, torch.float32):
        return (
            f"{attn.num_heads} heads of {attn.head_dim} (KV {attn.num_kv_heads}): past the attention kernel's"
        )
    if any(n.scale32 is None for n in _norms(layer)) or attn.fused is None or layer.mlp.fused is None:
        return "no fused kernels"
    if layer.per_layer and (layer.fused is None or layer.act is not gelu_tanh):
        return "a per-layer input not gated by gelu_tanh_mul"
    if quant_linears(_linears(layer)) is None:
        return "a Linear not on GGUF blocks"
    if layer.layer_scalar.dtype != torch.float32:
        return f"a layer scalar in {layer.layer_scalar.dtype}"
    return None


def why_not(model: nn.Module, dtype: torch.dtype) -> str | None:
    """Why no layer of the model can run in the call (None: some can)."""
    if not isinstance(model, Gemma4ForCausalLM):
        return "not a Gemma 4 model"
    if model.tensor_parallel is not None:
        return "tensor parallel: o and down sum over the ranks"
    if dtype != torch.float32:
        return f"Gemma 4 on {dtype} activations (its norms round once, after the scale: torch's)"
    if len({norm.eps for norm in _norms(model.model.layers)}) > 1:
        return "norms of differing epsilons"
    return None


def c_layers(model: Gemma4ForCausalLM, kernels: CpuKernels) -> list[bool]:
    """Per decoder layer, whether it runs in the call: those ``why_not_layer`` takes, less the
    sources of KV-shared layers that keep their modules (which read the source's K/V from
    ``shared``, filled by its modules)."""
    layers: list[Any] = list(model.model.layers)
    in_c = [why_not_layer(layer, kernels) is None for layer in layers]
    for layer, runs_c in zip(layers, in_c, strict=True):
        if not runs_c and layer.self_attn.shares_kv:
            in_c[layer.self_attn.kv_slot] = False
    return in_c


class RopeTable(NamedTuple):
    """A layer type's rotary table and where its rows sit in the step's flat cos / sin."""

    cache: RotaryCache
    at: int  # the widths of the tables before it (its layers' rope_at)
    width: int

    def span(self, rows: int) -> slice:
        """Its rows' span of the flat cos / sin of a step of ``rows`` rows."""
        return slice(rows * self.at, rows * (self.at + self.width))


def rope_tables(model: Gemma4ForCausalLM) -> dict[str, RopeTable]:
    """Each layer type's table, in their order in the step's flat cos / sin (sorted by type)."""
    rotary: Any = model.rotary
    tables, at = {}, 0
    for kind in sorted(rotary.keys()):
        width = rotary[kind].cos.shape[-1]
        tables[kind] = RopeTable(rotary[kind], at, width)
        at += width
    return tables


class Gemma4Decode:
    """Gemma 4's decode steps: runs of layers in the one call, the other layers' modules between."""

    def __init__(self, model: Gemma4ForCausalLM, kernels: CpuKernels, in_c: list[bool]) -> None:
        self.model: Any = model
        self.kernels = kernels
        self.c_kernels = gemma4_kernels(kernels.path)
        self.in_c = in_c
        body: Any = model.model
        first = body.layers[0]
        self.dims = Gemma4Dims(
            hidden=first.input_layernorm.dim, per_layer_dim=body.per_layer_dim,
            per_layer_stride=len(body.layers) * body.per_layer_dim, eps=first.input_layernorm.eps,
        )  # fmt: skip
        self.tables = rope_tables(model)
        self.rope_width = sum(table.width for table in self.tables.values())
        self._runs: list[tuple[int, int, ctypes.Array[Gemma4Layer]]] | None = None  # [first, end) and structs
        self._pool: tuple[int, int] = (0, 0)
        self.inputs = StepInputs(model, self.c_kernels, self.dims)

    def _layer(self, layer: Any, ctx: ForwardContext) -> Gemma4Layer:
        attn, mlp = layer.self_attn, layer.mlp
        scale = attn.attention.scale  # None: the kernel's 1 / sqrt(head_dim), as the modules pass it
        impls: list[QuantLinear] | None = quant_linears(_linears(layer))
        assert impls is not None  # why_not_layer's
        linears = [DecodeLinear.of(impl) for impl in impls] + [DecodeLinear()] * (LINEARS - len(impls))
        k_cache, v_cache = ctx.k_cache[attn.kv_slot], ctx.v_cache[attn.kv_slot]
        assert tuple(k_cache.shape[1:]) == (attn.num_kv_heads, attn.head_dim), "a pool layer of other heads"
        return Gemma4Layer(
            input_norm=_scale(layer.input_layernorm),
            attn_out_norm=_scale(layer.post_attention_layernorm),
            post_norm=_scale(layer.pre_feedforward_layernorm),
            mlp_out_norm=_scale(layer.post_feedforward_layernorm),
            per_layer_norm=_scale(layer.post_per_layer_input_norm) if layer.per_layer else None,
            q_norm=_scale(attn.q_norm), k_norm=None if attn.shares_kv else _scale(attn.k_norm),
            v_norm=None if attn.shares_kv else _scale(attn.v_norm),
            linear=(DecodeLinear * LINEARS)(*linears), k_cache=k_cache.data_ptr(), v_cache=v_cache.data_ptr(),
            heads=attn.num_heads, kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
            inner=sum(mlp.gate_up_proj.sizes) // 2, window=attn.attention.sliding_window,
            rope_at=self.tables[str(layer.layer_type)].at, writes_kv=int(not attn.shares_kv),
            k_eq_v=int(attn.k_eq_v), per_layer=layer.self_attn.layer if layer.per_layer else -1,
            scale=attn.head_dim**-0.5 if scale is None else scale, layer_scalar=float(layer.layer_scalar),
        )  # fmt: skip

    def _layer_runs(self, ctx: ForwardContext) -> list[tuple[int, int, ctypes.Array[Gemma4Layer]]]:
        """The runs of consecutive C layers, [first, end) with their structs (built again when the KV
        pool moves)."""
        pool = (ctx.k_cache[0].data_ptr(), ctx.v_cache[0].data_ptr())
        if self._runs is not None and pool == self._pool:
            return self._runs
        layers, runs = self.model.model.layers, []
        for in_c, group in itertools.groupby(range(len(layers)), key=lambda i: self.in_c[i]):
            run = list(group)
            if in_c:
                structs = (Gemma4Layer * len(run))(*(self._layer(layers[i], ctx) for i in run))
                runs.append((run[0], run[-1] + 1, structs))
        self._runs, self._pool = runs, pool
        self.dims.kv_dtype = KV_DTYPE_CODES[ctx.k_cache[0].dtype]
        return runs

    def __call__(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor | None:
        """Hidden states [T, hidden] before the final norm, as ``model(input_ids, ctx)`` gives them;
        None when some row of the step does not decode (the caller runs the modules)."""
        paged = ctx.attn.paged_decode
        if not ctx.attn.in_order or paged is None or ctx.images is not None:
            return None
        x, per_layer = self.inputs(input_ids, ctx)
        x = x.contiguous()
        assert x.dtype == torch.float32 and (per_layer is None or per_layer.is_contiguous())
        cos, sin = self._rotary_rows(ctx.positions)
        runs = self._layer_runs(ctx)
        if len(runs) == 1 and runs[0][:2] == (0, len(self.in_c)):  # every layer in the call
            self.c_kernels.decode(runs[0][2], self.dims, x, cos, sin, per_layer, paged.rows)
            return x
        rotary = self._module_rotary(cos, sin, ctx.positions.shape[0])
        layers = self.model.model.layers
        shared: SharedKV = {}
        at = 0
        for first, end, structs in runs:
            for i in range(at, first):
                x = self._module_layer(layers[i], x, per_layer, rotary, ctx, shared)
            x = x.contiguous()
            self.c_kernels.decode(structs, self.dims, x, cos, sin, per_layer, paged.rows)
            at = end
        for i in range(at, len(layers)):
            x = self._module_layer(layers[i], x, per_layer, rotary, ctx, shared)
        return x

    def _rotary_rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's cos and sin, each table's rows at the positions one table after another (flat),
        looked up straight into them."""
        rows = positions.shape[0]
        dtype = next(iter(self.tables.values())).cache.cos.dtype
        cos, sin = (torch.empty(rows * self.rope_width, dtype=dtype) for _ in range(2))
        for table in self.tables.values():
            span, width = table.span(rows), table.width
            torch.index_select(table.cache.cos, 0, positions, out=cos[span].view(rows, width))
            torch.index_select(table.cache.sin, 0, positions, out=sin[span].view(rows, width))
        return cos, sin

    def _module_rotary(
        self, cos: torch.Tensor, sin: torch.Tensor, rows: int
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The modules' (cos, sin) [T, 1, D] per layer type (RotaryCache's lookup), views of the
        step's flat rows (only where some layer keeps its modules)."""
        return {
            kind: (cos[t.span(rows)].view(rows, 1, t.width), sin[t.span(rows)].view(rows, 1, t.width))
            for kind, t in self.tables.items()
        }

    @staticmethod
    def _module_layer(
        layer: Any, x: torch.Tensor, per_layer: torch.Tensor | None, rotary: dict[str, Any],
        ctx: ForwardContext, shared: SharedKV,
    ) -> torch.Tensor:  # fmt: skip
        layer_input = per_layer[:, layer.self_attn.layer] if per_layer is not None else None
        return layer(x, layer_input, rotary[str(layer.layer_type)], ctx, shared)


def _scale(norm: Any) -> int:
    """The address of a norm's kernel weight (w, or ones without a scale; held while attached)."""
    assert isinstance(norm, Gemma4RMSNorm) and norm.scale32 is not None
    return norm.scale32.data_ptr()


def gemma4_decode(model: nn.Module, kernels: CpuKernels | None, dtype: torch.dtype) -> Gemma4Decode | None:
    """The model's decode through csrc/decode_gemma4.c, or None (logged why) where its modules run."""
    reason = "no C kernels" if kernels is None else why_not(model, dtype)
    if reason is not None or kernels is None or not isinstance(model, Gemma4ForCausalLM):
        logger.info("decode steps run layer by layer: %s", reason)
        return None
    in_c = c_layers(model, kernels)
    if not any(in_c):
        layers: Any = model.model.layers
        logger.info(
            "decode steps run layer by layer: %s", why_not_layer(layers[0], kernels) or "no layer in C"
        )
        return None
    modules = [i for i, c in enumerate(in_c) if not c]
    logger.info(
        "decode steps run in one C call a run of layers (csrc/decode_gemma4.c)%s",
        f", layers {modules} on their modules" if modules else "",
    )
    return Gemma4Decode(model, kernels, in_c)
