"""Linears and embeddings computed on a GGUF's quantized blocks (csrc/quant*.c).

Two paths, by row count (``DENSE_MIN_ROWS``). Few rows (decode at few streams, bound by the weight
bytes, which are the file's: Q4_1 0.625 bytes a weight against bf16's 2): each activation row is
quantized to 16 bits per block of 32 (csrc/quant.h says why 16, not llama.cpp's 8: the embedded
model's outlier channels), and the kernel multiplies integers, scaling once per block; the 16-bit
rounding of activations is the error this adds (half a step of absmax / 32767 per value), and the
tests bound it. Many rows (bound by arithmetic): W is dequantized to float32 panel by panel, once
per call, and met by the unquantized rows with float32 FMAs (csrc/quant_dense.c).

The output is summed in fp32 and rounded once to the activations' dtype, with the residual added
before that rounding where the caller fuses it (``add_to``). A merged Linear whose projections
differ in type (Q4_K_M files mix Q4_K and Q6_K) runs one kernel call per part, each writing its
columns of the output in place (as csrc/decode_layers.c runs it).
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType

from gpu_worker.backends.cpu.kernels import CpuKernels
from gpu_worker.backends.cpu.kind import CpuKind
from gpu_worker.backends.cpu.layouts import X8_LAYOUT, kernel_type
from gpu_worker.weights.formats import QuantBlocks, QuantizedWeight

# From how many rows a quantized Linear takes the dense path (csrc/quant_dense.c: W dequantized to
# float32 panel by panel, x not quantized, float32 FMAs) rather than the integer one, per CPU kind,
# layout and type. Measured by bench/quant_matmul.py (its numbers in docs/benchmarks.md), committed
# here, never timed at start. Integer vs dense, ms per pass:
# - Rows interleaved by 8 (``X8_``, the layout the worker holds every weight whose rows are a multiple
#   of 8 in: csrc/quant_x8.c, csrc/quant_kx8.c). `--shapes 3072x2048,2048x2048,16384x2048,2048x8192
#   --layers 1 --threads 1 --paths '.*_x8.*'` (a Llama-3.2-1B layer) on a Zen 4 EPYC, each kind acted
#   as: avx512 (zmm madd) Q4_K 32 rows 35.2 vs 58.2, 256: 276 vs 374; Q6_K 32: 47.5 vs 58.8, 256:
#   372 vs 379; Q4_1 256: 264 vs 367; avx512_vnni and avx512_bf16 (vpdpwssd: 1.2-1.3x avx512's at 4
#   to 32 rows) alike: the integer tile at every row count. avx2 (ymm): Q4_K 32 rows 53.6 vs 57.6,
#   64: 106 vs 104; Q5_K 16: 37.7 vs 38.2, 32: 74.3 vs 60.4; Q6_K 8: 21.1 vs 26.2, 16: 41.5 vs 37.0;
#   Q4_1 256: 271 vs 370 (the legacy types never: 16 int16 products per madd against 8 per FMA; on a
#   Zen 3 EPYC, SmolLM2's shapes, Q4_1 256 rows 328 vs 392).
# - The file's layout (rows not a multiple of 8), AVX2 (Zen 3, SmolLM2's shapes x 30): Q4_1 4 rows
#   13.8 vs 17.0, 8: 23.5 vs 22.0, 16: 45.5 vs 33.1 (Q8_0 alike); K-quants (1024x768, 768x1536,
#   3072x768 x 30) Q4_K 16 rows 37.7 vs 39.7, 32: 72.5 vs 67.0; Q5_K 16: 45.6 vs 42.9; Q6_K 8: 36.3
#   vs 42.6, 16: 60.6 vs 45.3. The AVX-512 kinds run that (AVX2) code too.
# - AMX: the avx512_bf16 code, so its table; not measured here (no AMX CPU this session): `python -m
#   bench.quant_matmul --shapes ... --paths '.*_x8.*'` on one gives the numbers to commit.
# Portable (plain C both): Q4_1 1 row 25 vs 65 ms, 2 rows 42 vs 38; the other types inferred alike.
_Q = GGMLQuantizationType
NEVER = 1 << 62
_X86 = {_Q.Q4_0: 8, _Q.Q4_1: 8, _Q.Q8_0: 8, _Q.Q4_K: 32, _Q.Q5_K: 16, _Q.Q6_K: 16}
_X8_AVX512 = dict.fromkeys(_X86, NEVER)
_X8_AVX2 = {_Q.Q4_0: NEVER, _Q.Q4_1: NEVER, _Q.Q8_0: NEVER, _Q.Q4_K: 64, _Q.Q5_K: 32, _Q.Q6_K: 16}
DENSE_MIN_ROWS: dict[CpuKind, dict[GGMLQuantizationType, int]] = {
    CpuKind.AMX: _X86,
    CpuKind.AVX512_BF16: _X86,
    CpuKind.AVX512_VNNI: _X86,
    CpuKind.AVX512: _X86,
    CpuKind.AVX2: _X86,
    CpuKind.PORTABLE: dict.fromkeys(_X86, 2),
}
X8_DENSE_MIN_ROWS: dict[CpuKind, dict[GGMLQuantizationType, int]] = {
    CpuKind.AMX: _X8_AVX512,
    CpuKind.AVX512_BF16: _X8_AVX512,
    CpuKind.AVX512_VNNI: _X8_AVX512,
    CpuKind.AVX512: _X8_AVX512,
    CpuKind.AVX2: _X8_AVX2,
    CpuKind.PORTABLE: dict.fromkeys(_X86, 2),
}


def dense_min_rows(kind: CpuKind, part: QuantBlocks) -> int:
    """From how many activation rows ``part`` takes the dense path on this CPU kind."""
    table = X8_DENSE_MIN_ROWS if part.layout == X8_LAYOUT else DENSE_MIN_ROWS
    return table[kind][GGMLQuantizationType(part.type)]


class QuantLinear:
    """``x W^T (+ b)`` for a Linear whose weight is a ``QuantizedWeight``."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, kernels: CpuKernels) -> None:
        self.act_bytes = [
            kernels.quant_check(kernel_type(p), p.data, p.cols) for p in weight.parts
        ]  # raises if unfit
        self.weight = weight
        self.bias = None if bias is None else bias.detach()
        self.kernels = kernels
        self.out_features = weight.rows
        self.dense_min_rows = [dense_min_rows(kernels.kind, p) for p in weight.parts]

    def tensors(self) -> list[torch.Tensor]:
        """What this Linear holds (for the worker's count of weight bytes)."""
        held = [part.data for part in self.weight.parts]
        return held if self.bias is None else [*held, self.bias]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, None)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``residual + x W^T + b``, with one rounding where there is no bias."""
        return self._matmul(x, residual)

    def _matmul(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        if x.shape[0] == 0:  # a batch none of whose rows samples has no logits to compute
            return x.new_empty((0, self.out_features))
        x = x if x.stride(-1) == 1 else x.contiguous()
        fuse = residual is not None and self.bias is None
        out = torch.empty((x.shape[0], self.out_features), dtype=x.dtype)
        col, rows = 0, x.shape[0]
        plan = zip(self.weight.parts, self.act_bytes, self.dense_min_rows, strict=True)
        for part, act_bytes, dense_at in plan:
            cols = slice(col, col + part.rows)
            held = residual[:, cols] if fuse and residual is not None else None
            run = self.kernels.quant_matmul_checked
            run(kernel_type(part), part.data, part.cols, x, held, act_bytes, rows >= dense_at, out[:, cols])
            col += part.rows
        if self.bias is not None:
            out = out + self.bias
        return out if residual is None or fuse else residual + out


class QuantEmbedding:
    """Rows of a quantized embedding table, dequantized on lookup into the model's dtype."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype, kernels: CpuKernels) -> None:
        assert len(weight.parts) == 1, "an embedding table is one tensor"
        self.table = weight.parts[0]
        assert kernels.quant_supported(kernel_type(self.table)), f"no kernel for ggml type {self.table.type}"
        self.dtype = dtype
        self.kernels = kernels

    def tensors(self) -> list[torch.Tensor]:
        return [self.table.data]

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        rows = self.kernels.quant_get_rows(
            kernel_type(self.table), self.table.data, self.table.cols, flat, self.dtype
        )
        return rows.reshape(*ids.shape, self.table.cols)
