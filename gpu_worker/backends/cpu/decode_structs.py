"""The one-call decode's structs (csrc/rivulet_kernels.h's ``decode_linear``, ``decode_layer``,
``decode_dims``; abi.py checks them against the header), and the Linears they can carry.

decode_layers.py fills them for the Llama family, decode_gemma.py for Gemma 2 and 3."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import torch

from gpu_worker.backends.cpu.experts import MoeProjection
from gpu_worker.backends.cpu.layouts import kernel_type
from gpu_worker.backends.cpu.quant import QuantLinear
from gpu_worker.models.layers import Linear
from gpu_worker.weights.formats import QuantBlocks

LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
MAX_PARTS = 3  # csrc/rivulet_kernels.h's (abi.py checks): q, k, v of three types


def fields(ctype: type[Any], *names: str) -> list[tuple[str, type[Any]]]:
    """A struct's run of fields of one C type, in the header's order."""
    return [(name, ctype) for name in names]


class DecodeLinear(ctypes.Structure):
    """csrc/rivulet_kernels.h's ``decode_linear``: a Linear's parts (unused ones have n = 0)."""

    _fields_ = [
        ("w", ctypes.c_void_p * MAX_PARTS),
        ("type", ctypes.c_int64 * MAX_PARTS),
        ("n", ctypes.c_int64 * MAX_PARTS),
        ("dense_min_rows", ctypes.c_int64 * MAX_PARTS),
        ("a8_min_rows", ctypes.c_int64 * MAX_PARTS),
    ]

    @classmethod
    def of(cls, impl: QuantLinear) -> DecodeLinear:
        return cls.of_parts(impl.weight.parts, impl.dense_min_rows, impl.a8_min_rows)

    @classmethod
    def of_parts(
        cls, parts: Sequence[QuantBlocks], dense_min_rows: Sequence[int], a8_min_rows: Sequence[int]
    ) -> DecodeLinear:
        """Up to MAX_PARTS parts of a QuantLinear, with their row thresholds."""
        pad = MAX_PARTS - len(parts)
        return cls(
            w=(ctypes.c_void_p * MAX_PARTS)(*(p.data.data_ptr() for p in parts), *[None] * pad),
            type=(ctypes.c_int64 * MAX_PARTS)(*(kernel_type(p) for p in parts), *[0] * pad),
            n=(ctypes.c_int64 * MAX_PARTS)(*(p.rows for p in parts), *[0] * pad),
            dense_min_rows=(ctypes.c_int64 * MAX_PARTS)(*dense_min_rows, *[0] * pad),
            a8_min_rows=(ctypes.c_int64 * MAX_PARTS)(*a8_min_rows, *[0] * pad),
        )


class DecodeLayer(ctypes.Structure):
    """csrc/rivulet_kernels.h's ``decode_layer``."""

    _fields_ = [
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("linear", DecodeLinear * 4),
        ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p),
        ("q_norm", ctypes.c_void_p),
        ("k_norm", ctypes.c_void_p),
        ("router", ctypes.c_void_p),
        ("experts", ctypes.POINTER(MoeProjection)),
        ("n_experts", ctypes.c_int64),
        ("top_k", ctypes.c_int64),
        ("norm_topk", ctypes.c_int64),
        ("expert_inner", ctypes.c_int64),
        ("window", ctypes.c_int64),
        ("attn_out_norm", ctypes.c_void_p),
        ("mlp_out_norm", ctypes.c_void_p),
        ("rope", ctypes.c_int64),
        ("bias", ctypes.c_void_p * 4),
        ("sinks", ctypes.c_void_p),
        ("router_bias", ctypes.c_void_p),
        ("gate_up_bias", ctypes.c_void_p),
        ("down_bias", ctypes.c_void_p),
        ("swiglu_alpha", ctypes.c_float),
        ("swiglu_limit", ctypes.c_float),
    ]


class DecodeDims(ctypes.Structure):
    """csrc/rivulet_kernels.h's ``decode_dims``."""

    _fields_ = [
        ("hidden", ctypes.c_int64),
        ("heads", ctypes.c_int64),
        ("kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("inner", ctypes.c_int64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("dtype", ctypes.c_int64),
        ("kv_dtype", ctypes.c_int64),
        ("gelu", ctypes.c_int64),
    ]


def quant_linears(modules: Sequence[Linear]) -> list[QuantLinear] | None:
    """The Linears' QuantLinears, if each is one (of up to MAX_PARTS parts) whose bias, where it has
    one, is a contiguous vector of the activations' dtype (``linear_fields`` passes it)."""
    impls = [m.impl for m in modules]
    fit = all(isinstance(i, QuantLinear) and len(i.weight.parts) <= MAX_PARTS for i in impls)
    return impls if fit else None  # type: ignore[return-value]


def bias_missing(impls: Sequence[QuantLinear], dtype: torch.dtype) -> str | None:
    """Why a Linear's bias cannot be added by the one call (None: each can, or there is none)."""
    for impl in impls:
        if impl.bias is not None and (impl.bias.dtype != dtype or not impl.bias.is_contiguous()):
            return f"a Linear's bias in {impl.bias.dtype}, not the activations' {dtype}"
    return None


def linear_fields(impls: Sequence[QuantLinear]) -> dict[str, ctypes.Array[Any]]:
    """A layer's ``linear`` and ``bias`` fields from its (up to 4) QuantLinears, in LINEARS' order."""
    pad = 4 - len(impls)
    linears = [DecodeLinear.of(impl) for impl in impls] + [DecodeLinear() for _ in range(pad)]
    biases = [None if impl.bias is None else impl.bias.data_ptr() for impl in impls] + [None] * pad
    return {"linear": (DecodeLinear * 4)(*linears), "bias": (ctypes.c_void_p * 4)(*biases)}
