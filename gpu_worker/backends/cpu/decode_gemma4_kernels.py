"""The ctypes side of csrc/decode_gemma4.c: the structs csrc/rivulet_kernels.h declares for it
(``gemma4_layer``, ``gemma4_dims``, ``gemma4_inputs``; abi.py checks them against the header at load)
and the binding of its two calls, a run of decoder layers (``decode``) and the step's inputs
(``inputs``). What fills the structs from a model: decode_gemma4.py (the layers) and
decode_gemma4_inputs.py (the tables and the per-layer projection)."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from gpu_worker.backends.cpu import abi
from gpu_worker.backends.cpu.decode_rows import DecodeRows
from gpu_worker.backends.cpu.decode_structs import DecodeLinear, fields

LINEARS = 6  # csrc/rivulet_kernels.h's GEMMA4_LINEARS: qkv, o, gate_up, down, per-layer gate, projection


class Gemma4Layer(ctypes.Structure):
    """csrc/rivulet_kernels.h's ``gemma4_layer``."""

    _fields_ = [
        *fields(ctypes.c_void_p, "input_norm", "attn_out_norm", "post_norm", "mlp_out_norm"),
        *fields(ctypes.c_void_p, "per_layer_norm", "q_norm", "k_norm", "v_norm"),
        ("linear", DecodeLinear * LINEARS),
        *fields(ctypes.c_void_p, "k_cache", "v_cache"),
        *fields(ctypes.c_int64, "heads", "kv_heads", "head_dim", "inner", "window", "rope_at"),
        *fields(ctypes.c_int64, "writes_kv", "k_eq_v", "per_layer"),
        *fields(ctypes.c_float, "scale", "layer_scalar"),
    ]


class Gemma4Dims(ctypes.Structure):
    """csrc/rivulet_kernels.h's ``gemma4_dims``."""

    _fields_ = [
        *fields(ctypes.c_int64, "hidden", "per_layer_dim", "per_layer_stride", "kv_dtype"),
        ("eps", ctypes.c_float),
    ]


class Gemma4Inputs(ctypes.Structure):
    """csrc/rivulet_kernels.h's ``gemma4_inputs``."""

    _fields_ = [
        *fields(ctypes.c_void_p, "embed", "per_layer_table", "per_layer_norm"),
        ("projection", DecodeLinear),
        *fields(ctypes.c_int64, "embed_type", "per_layer_type"),
        *fields(ctypes.c_float, "embed_scale", "per_layer_scale", "projection_scale", "mean_scale", "eps"),
    ]


class Gemma4Kernels:
    """ctypes binding of decode_gemma4.c in a built kernels library."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._decode = lib.decode_gemma4
        self._decode.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64]
        self._decode.restype = ctypes.c_int
        self._inputs = lib.decode_gemma4_inputs
        self._inputs.argtypes = [ptr, ptr, ptr, i64, ptr, ptr]
        self._inputs.restype = ctypes.c_int
        structs = {"decode_linear": DecodeLinear, "gemma4_layer": Gemma4Layer, "gemma4_dims": Gemma4Dims,
                   "gemma4_inputs": Gemma4Inputs}  # fmt: skip
        abi.check(abi.bound_functions(self), structs, {"GEMMA4_LINEARS": LINEARS})

    def decode(
        self, layers: ctypes.Array[Gemma4Layer], dims: Gemma4Dims, x: torch.Tensor, cos: torch.Tensor,
        sin: torch.Tensor, per_layer: torch.Tensor | None, rows: DecodeRows,
    ) -> None:  # fmt: skip
        """A run of layers over decode rows, x [T, hidden] in place; cos / sin the step's tables one
        after another (flat), per_layer [T, layers, dim] contiguous or None."""
        status = self._decode(
            ctypes.byref(layers), len(layers), ctypes.byref(dims), x.data_ptr(), x.data_ptr(), x.shape[0],
            cos.data_ptr(), sin.data_ptr(), None if per_layer is None else per_layer.data_ptr(), rows.q_rows,
            rows.req_pool_idx, rows.kv_lens, rows.page_table, rows.pt_stride, rows.page_size,
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"decode_gemma4 failed: {abi.status_text(status)}")

    def inputs(
        self, inputs: Gemma4Inputs, dims: Gemma4Dims, ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's x [T, hidden] and per-layer inputs [T, layers, dim] from int64 ids [T] (in both
        tables: the runner's batch checks), as ``Gemma4ForCausalLM.embedded`` computes them."""
        assert ids.dtype == torch.int64 and ids.dim() == 1 and ids.is_contiguous()
        rows = ids.shape[0]
        x = torch.empty((rows, dims.hidden), dtype=torch.float32)
        per_layer = torch.empty((rows, dims.per_layer_stride // dims.per_layer_dim, dims.per_layer_dim))
        status = self._inputs(
            ctypes.byref(inputs), ctypes.byref(dims), ids.data_ptr(), rows, x.data_ptr(), per_layer.data_ptr()
        )
        if status != 0:
            raise RuntimeError(f"decode_gemma4_inputs failed: {abi.status_text(status)}")
        return x, per_layer


@functools.cache
def gemma4_kernels(path: Path) -> Gemma4Kernels:
    """The bindings of the library at ``path`` (a CpuKernels' ``path``), bound once."""
    return Gemma4Kernels(path)
