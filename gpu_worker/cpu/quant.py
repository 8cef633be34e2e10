"""Linears and embeddings computed on a GGUF's quantized blocks (csrc/quant*.c).

Each activation row is quantized to 8 bits per block of the weight type (as llama.cpp does), and
the kernel multiplies integers, scaling once per block: on AVX2 a 32-byte multiply-add covers 32
weights where widening them to fp32 first takes 4 conversions and 4 FMAs. The weight bytes are
the file's (Q4_1: 0.625 bytes a weight against bf16's 2), and one-row decode is bound by them.
The int8 rounding of activations is the one error this adds; the tests bound it.

The output is summed in fp32 and rounded once to the activations' dtype, with the residual added
before that rounding where the caller fuses it (``add_to``). A merged Linear whose projections
differ in type (Q4_K_M files mix Q4_K and Q6_K) runs one kernel call per part.
"""

from __future__ import annotations

import torch

from gpu_worker.cpu.kernels import CpuKernels
from gpu_worker.gguf_weights import QuantizedWeight


class QuantLinear:
    """``x W^T (+ b)`` for a Linear whose weight is a ``QuantizedWeight``."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, kernels: CpuKernels) -> None:
        for part in weight.parts:
            assert kernels.quant_supported(part.type), f"no kernel for ggml type {part.type}"
        self.weight = weight
        self.bias = None if bias is None else bias.detach()
        self.kernels = kernels
        self.out_features = weight.rows

    def tensors(self) -> list[torch.Tensor]:
        """What this Linear holds (for the worker's count of weight bytes)."""
        held = [part.data for part in self.weight.parts]
        return held if self.bias is None else [*held, self.bias]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, None)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``residual + x W^T + b``, with one rounding where there is one part and no bias."""
        return self._matmul(x, residual)

    def _matmul(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        if x.shape[0] == 0:  # a batch none of whose rows samples has no logits to compute
            return x.new_empty((0, self.out_features))
        x = x if x.stride(-1) == 1 else x.contiguous()
        parts = self.weight.parts
        fuse = residual is not None and self.bias is None and len(parts) == 1
        if len(parts) == 1:
            part = parts[0]
            out = self.kernels.quant_matmul(part.type, part.data, part.cols, x, residual if fuse else None)
        else:
            out = torch.cat([self.kernels.quant_matmul(p.type, p.data, p.cols, x) for p in parts], dim=1)
        if self.bias is not None:
            out = out + self.bias
        return out if residual is None or fuse else residual + out


class QuantEmbedding:
    """Rows of a quantized embedding table, dequantized on lookup into the model's dtype."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype, kernels: CpuKernels) -> None:
        assert len(weight.parts) == 1, "an embedding table is one tensor"
        self.table = weight.parts[0]
        assert kernels.quant_supported(self.table.type), f"no kernel for ggml type {self.table.type}"
        self.dtype = dtype
        self.kernels = kernels

    def tensors(self) -> list[torch.Tensor]:
        return [self.table.data]

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        rows = self.kernels.quant_get_rows(
            self.table.type, self.table.data, self.table.cols, flat, self.dtype
        )
        return rows.reshape(*ids.shape, self.table.cols)
