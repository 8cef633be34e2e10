"""Linears and embeddings computed on a GGUF's quantized blocks (csrc/quant*.c).

Each activation row is quantized to 16 bits per block of 32 (csrc/quant.h says why 16, not
llama.cpp's 8: the embedded model's outlier channels), and the kernel multiplies integers (16
products per AVX2 instruction), scaling once per block. The weight bytes are the file's (Q4_1:
0.625 bytes a weight against bf16's 2), and one-row decode is bound by them. The 16-bit rounding
of activations is the one error this adds (half a step of absmax / 32767 per value); the tests
bound it.

The output is summed in fp32 and rounded once to the activations' dtype, with the residual added
before that rounding where the caller fuses it (``add_to``). A merged Linear whose projections
differ in type (Q4_K_M files mix Q4_K and Q6_K) runs one kernel call per part.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpu_worker.cpu.kernels import CpuKernels
from gpu_worker.cpu.kind import CpuKind
from gpu_worker.gguf_weights import QuantizedWeight

# From how many rows a quantized Linear runs as dequantized float32 through torch's matmul (the
# weight dequantized for that call only and dropped after it: no dense copy is held), per CPU kind;
# None: the quantized kernel at every row count. Measured by bench/quant_matmul.py (see its
# numbers in docs/BENCHMARKS.md), committed here, never timed at start.
# AVX2 (EPYC Zen 3, 2 threads, SmolLM2's four Q4_1 Linears x 30, bf16 activations): quantized vs
# dequantized per call, ms: 32 rows 137 vs 240, 64: 197 vs 286, 128: 364 vs 368, 256: 749 vs 549.
# The AVX-512 kinds run the same (AVX2) integer kernels and oneDNN fp32 at least as fast: inferred,
# not measured (no such CPU this session). Portable: plain C integer dots, inferred.
DENSE_MIN_ROWS: dict[CpuKind, int | None] = {
    CpuKind.AVX512_BF16: 128,
    CpuKind.AVX512: 128,
    CpuKind.AVX2: 128,
    CpuKind.PORTABLE: 2,
}


class QuantLinear:
    """``x W^T (+ b)`` for a Linear whose weight is a ``QuantizedWeight``."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, kernels: CpuKernels) -> None:
        self.act_bytes = [
            kernels.quant_check(p.type, p.data, p.cols) for p in weight.parts
        ]  # raises if unfit
        self.weight = weight
        self.bias = None if bias is None else bias.detach()
        self.kernels = kernels
        self.out_features = weight.rows
        self.dense_min_rows = DENSE_MIN_ROWS[kernels.kind]

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
        if self.dense_min_rows is not None and x.shape[0] >= self.dense_min_rows:
            return self._dense_matmul(x, residual)
        parts = self.weight.parts
        fuse = residual is not None and self.bias is None and len(parts) == 1
        run = self.kernels.quant_matmul_checked
        if len(parts) == 1:
            part = parts[0]
            out = run(part.type, part.data, part.cols, x, residual if fuse else None, self.act_bytes[0])
        else:
            outs = [
                run(p.type, p.data, p.cols, x, None, b) for p, b in zip(parts, self.act_bytes, strict=True)
            ]
            out = torch.cat(outs, dim=1)
        if self.bias is not None:
            out = out + self.bias
        return out if residual is None or fuse else residual + out

    def _dense_matmul(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """Many rows where torch's fp32 matmul outruns the kernel: the weight dequantized for this call."""
        ids = torch.arange(max(p.rows for p in self.weight.parts))
        weight = torch.cat(
            [
                self.kernels.quant_get_rows(p.type, p.data, p.cols, ids[: p.rows], torch.float32)
                for p in self.weight.parts
            ]
        )
        bias = None if self.bias is None else self.bias.float()
        out = F.linear(x.float(), weight, bias)
        if residual is not None:
            out += residual
        return out.to(x.dtype)


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
