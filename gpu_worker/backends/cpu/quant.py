"""Linears and embeddings computed on a GGUF's quantized blocks (csrc/quant*.c).

Two paths, by row count (``DENSE_MIN_ROWS``). Few rows (decode at few streams, bound by the weight
bytes, which are the file's: Q4_1 0.625 bytes a weight against bf16's 2): each activation row is
quantized to 16 bits per block of 32 (csrc/quant.h says why 16, not llama.cpp's 8: the embedded
model's outlier channels), and the kernel multiplies integers, scaling once per block; the 16-bit
rounding of activations is the error this adds (half a step of absmax / 32767 per value), and the
tests bound it. Many rows (bound by arithmetic): on the AVX-512 builds the interleaved rows meet 8-bit
activations from ``A8_MIN_ROWS`` rows (csrc/quant.h's act_block8: 8 bits per 32 values, llama.cpp's
precision, with a second 8-bit pass where a block's absmax stands far above its mean, so outlier
channels keep ~14 bits), twice the products per instruction; elsewhere W is dequantized to float32
panel by panel, once per call, and met by the unquantized rows with float32 FMAs
(csrc/quant_dense.c), where that is the faster (``DENSE_MIN_ROWS``).

The output is summed in fp32 and rounded once to the activations' dtype, with the residual added
before that rounding where the caller fuses it (``add_to``). A merged Linear whose projections
differ in type (Q4_K_M files mix Q4_K and Q6_K) runs one kernel call per part, each writing its
columns of the output in place (as csrc/decode_layers.c runs it).
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType

from gpu_worker.backends.cpu.head_screen import HeadScreen
from gpu_worker.backends.cpu.kernels import CpuKernels
from gpu_worker.backends.cpu.kind import CpuKind
from gpu_worker.backends.cpu.layouts import A8, X8_LAYOUT, kernel_type
from gpu_worker.weights.formats import QuantBlocks, QuantizedWeight

# From how many rows a quantized Linear takes the dense path (csrc/quant_dense.c: W dequantized to
# float32 panel by panel, x not quantized, float32 FMAs) rather than the integer one, per CPU kind,
# layout and type. Measured by ``python -m bench.quant_matmul`` on each kind and committed here, never
# timed at start; the integer-vs-dense numbers behind each row and their commands are in
# docs/benchmarks-history.md ("Numbers behind the code's choices"). In short:
# - Rows interleaved by 8 (``X8_``, the layout the worker holds every weight whose rows are a multiple
#   of 8 in: csrc/quant_x8.c, csrc/quant_kx8.c): the integer tile wins at every row count, on the
#   AVX-512 kinds (avx512_vnni and avx512_bf16 run vpdpwssd, faster than avx512's madd, so alike)
#   and on avx2, whose K-quants meet 8-bit activations from A8_MIN_ROWS (maddubs: 1.3-1.5x the dense
#   path's pace at 32 and 128 rows, acting as avx2 on a Zen 5); its legacy types never did (16 int16
#   products per madd against 8 per FMA).
# - The file's layout (rows not a multiple of 8), AVX2 code on every x86 kind: the dense path wins
#   from 8 rows for the legacy types, 16 or 32 for the K-quants.
# - AMX: the avx512_bf16 code, so its table; not yet measured on an AMX CPU: `python -m
#   bench.quant_matmul --shapes ... --paths '.*_x8.*'` on one gives the numbers to commit.
# - Portable (plain C both): the dense path from 2 rows (measured for Q4_1, the other types alike).
_Q = GGMLQuantizationType
NEVER = 1 << 62
# Q5_0, Q5_1, IQ4_NL, IQ4_XS, MXFP4 in the file's layout (csrc/quant_sub32.c: where their rows are not a
# multiple of 8, else interleaved: csrc/quant_sub32x8.c, quant_mxfp4.c, the X8 tables): the
# legacy types' tile, so their crossing; not yet measured for these (`python -m bench.quant_matmul
# --types q5_0,q5_1,iq4_nl,iq4_xs --shapes 896x640,...`).
_SUB32 = {_Q.Q5_0: 8, _Q.Q5_1: 8, _Q.IQ4_NL: 8, _Q.IQ4_XS: 8, _Q.MXFP4: 8}
_K23 = {_Q.Q2_K: 8, _Q.Q3_K: 8}  # csrc/quant_k23.c: the same tile's shape, so the same crossing
# F16 and BF16 weights (csrc/quant_f16.c): from 2 rows the dense path, which widens a panel at a time
# and runs its float tiles over it; the one-row tile widens in registers (BF16 on AVX-512: below).
_SIXTEEN = {_Q.F16: 2, _Q.BF16: 2}
_X86 = {_Q.Q4_0: 8, _Q.Q4_1: 8, _Q.Q8_0: 8, _Q.Q4_K: 32, _Q.Q5_K: 16, _Q.Q6_K: 16}
_X86 |= _SUB32 | _K23 | _SIXTEEN
_X8_X86 = dict.fromkeys(_X86, NEVER)
# BF16 never the dense path on the AVX-512 kinds: where the build has vdpbf16ps many rows take its tile
# (BF16X_MIN_ROWS below); on avx512 and avx512_vnni quant_f16.c's float32 tile (the one-row tile's code,
# weights widened in registers, x as it is), 1.5-2x the dense path's pace at 2-128 rows
# (docs/benchmarks-history.md, "BF16 many rows on vdpbf16ps"). avx2: that tile on ymm up to 11 rows,
# the dense path from 12, where they cross (the same section).
_X86_BF16 = _X86 | {_Q.BF16: NEVER}
DENSE_MIN_ROWS: dict[CpuKind, dict[GGMLQuantizationType, int]] = {
    CpuKind.AMX: _X86_BF16,
    CpuKind.AVX512_BF16: _X86_BF16,
    CpuKind.AVX512_VNNI: _X86_BF16,
    CpuKind.AVX512: _X86_BF16,
    CpuKind.AVX2: _X86 | {_Q.BF16: 12},
    CpuKind.PORTABLE: dict.fromkeys(_X86, 2),
}
X8_DENSE_MIN_ROWS: dict[CpuKind, dict[GGMLQuantizationType, int]] = {
    CpuKind.AMX: _X8_X86,
    CpuKind.AVX512_BF16: _X8_X86,
    CpuKind.AVX512_VNNI: _X8_X86,
    CpuKind.AVX512: _X8_X86,
    CpuKind.AVX2: _X8_X86,
    CpuKind.PORTABLE: dict.fromkeys(_X86, 2),
}


# From how many rows an interleaved Linear meets 8-bit activations (csrc/quant.h's act_block8,
# csrc/quant_kx8.c's vpdpbusd tiles; its k a multiple of 256) rather than 16-bit ones, per CPU kind:
# the AVX-512 builds have those tiles (vpdpbusd with VNNI, maddubs without, where Q8_0 has none),
# and AVX2 (maddubs on ymm, no Q8_0, slower there than its 16-bit tile: docs/benchmarks-history.md,
# "Q8_0 on AVX2"; the AVX-512 builds' bits), from the same rows, so a row count
# gets the same activation precision on every kind; portable never takes them. Below the threshold
# a step streams its weights once and the 16-bit tile, which reads them in place, is the faster;
# from it, twice the products per instruction win (AVX2 at one row too: docs/benchmarks-history.md,
# "AVX2's one row on 8 bits").
# Measured by ``python -m bench.quant_matmul --paths '.*_x8(_a8)?$'`` (docs/benchmarks-history.md,
# "8-bit activations").
A8_BLOCK = 256  # act_block8's values: a Linear's k must be a multiple
# Q4_K and Q6_K from 5 rows, Q5_K from 4, Q4_0 and Q8_0 from 2: up to 8-16 rows their tiles read the
# blocks where they lie (csrc/quant_kx8.c's tile8_direct; docs/benchmarks-history.md, "Few rows on 8 bits").
_A8_ZMM = {_Q.Q4_K: 5, _Q.Q5_K: 4, _Q.Q6_K: 5, _Q.Q4_0: 2}
# Q5_0, Q5_1, IQ4_NL interleaved (csrc/quant_sub32x8.c): their 8-bit activations come per 32 values
# (act8_32), so any k takes them (their odd-width files are why these types are in a K-quant file:
# Gemma 3 270M's k = 640). Thread CPU time a call, one thread, on Gemma 3 270M's q/k/v/gate/up (k 640;
# docs/benchmarks-history.md, "Q5_0, Q5_1, IQ4_NL interleaved"): from 2 rows the 8-bit tile is the
# faster on avx2 and avx512 for all three and on avx512_bf16 for Q5_1 (Q5_0 there: alike at 2-3 rows);
# IQ4_NL from 4 (avx512_bf16 slower below). One threshold a type for every kind, as the others.
A8_PER_32 = frozenset({_Q.Q5_0, _Q.Q5_1, _Q.IQ4_NL, _Q.IQ4_XS, _Q.MXFP4})
_A8_ZMM |= {_Q.Q5_0: 2, _Q.Q5_1: 2, _Q.IQ4_NL: 4, _Q.IQ4_XS: 4}  # IQ4_XS (k 1280) as IQ4_NL
# MXFP4 interleaved (csrc/quant_mxfp4.c; gpt-oss's experts, k 2880, a few rows each at 32 streams) on
# the same per-32 activations, from 2 rows on every kind (docs/benchmarks-history.md, "Thresholds of
# the 8-bit tiles for MXFP4, Q2_K and Q3_K"); one threshold a type for every kind.
_A8_ZMM |= {_Q.MXFP4: 2}
# Q2_K, Q3_K interleaved (csrc/quant_k23x8.c; act_block8, k whole blocks of 256): from 2 rows the 8-bit
# tile is the faster (the same section of docs/benchmarks-history.md).
_A8_ZMM |= {_Q.Q2_K: 2, _Q.Q3_K: 2}
# Q4_1 is left on 16 bits: the one Q4_1 file in use is the embedded SmolLM2, whose MLP inputs carry
# channels far above the rest; on 8 bits its prefill moved the logits by 4.5e-3 of their spread
# (tests/exactness/test_smollm2_gguf.py holds them within 1e-3; 16 bits: 1e-4). Its tiles are built
# and tested (bench.quant_matmul's q4_1_x8_a8: from 2 rows the faster on avx512_bf16).
_A8_VNNI = {**_A8_ZMM, _Q.Q8_0: 2}
# Q8_0 takes them at any k (a multiple of 32; csrc/quant_x8.c: the rest past the last whole 256 on the
# 16-bit tile, added): Gemma 3's 640-wide head, 262k rows of Q8_0 in a Q4_K_M file, is most of a
# 32-row step's multiplies. At such widths only from more rows than one request's speculative verify
# pass (1 + 7 drafts): the embedded SmolLM2's 576-wide Q8_0 head ran 16 bits at every row count, and a
# lone request's kept drafts keep the logprobs of its plain decode (tests/integration/test_speculative).
A8_ANY_K = frozenset({_Q.Q8_0})
A8_ANY_K_MIN_ROWS = 9
A8_MIN_ROWS: dict[CpuKind, dict[GGMLQuantizationType, int]] = {
    CpuKind.AMX: _A8_VNNI,
    CpuKind.AVX512_BF16: _A8_VNNI,
    CpuKind.AVX512_VNNI: _A8_VNNI,
    CpuKind.AVX512: _A8_ZMM,
    CpuKind.AVX2: _A8_ZMM,
    CpuKind.PORTABLE: {},
}


# BF16 weights (the file's layout) at many rows on vdpbf16ps where the build has it (the avx512_bf16
# and amx kinds; csrc/quant_bf16x.c, the type code BF16 | A8): the activations rounded to bf16, as
# llama.cpp meets BF16 weights, products exact and summed in float32. From 2 rows: there the tile
# already ran ahead of quant_f16.c's float32 tile and the dense path, thread CPU time a call
# (docs/benchmarks-history.md, "BF16 many rows on vdpbf16ps").
BF16X_MIN_ROWS = 2


def a8_min_rows(kernels: CpuKernels, part: QuantBlocks) -> int:
    """From how many activation rows ``part`` meets 8-bit activations, or BF16's bf16 ones (NEVER:
    not on this build)."""
    if part.type == _Q.BF16:
        return BF16X_MIN_ROWS if kernels.quant_supported(part.type | A8) else NEVER
    if (
        part.layout != X8_LAYOUT
        or (part.cols % A8_BLOCK and part.type not in A8_ANY_K | A8_PER_32)
        or not kernels.quant_supported(kernel_type(part) | A8)
    ):
        return NEVER
    rows = A8_MIN_ROWS[kernels.kind].get(GGMLQuantizationType(part.type), NEVER)
    return max(rows, A8_ANY_K_MIN_ROWS) if part.cols % A8_BLOCK and part.type in A8_ANY_K else rows


def dense_min_rows(kind: CpuKind, part: QuantBlocks) -> int:
    """From how many activation rows ``part`` takes the dense path on this CPU kind."""
    table = X8_DENSE_MIN_ROWS if part.layout == X8_LAYOUT else DENSE_MIN_ROWS
    return table[kind][GGMLQuantizationType(part.type)]


class QuantLinear:
    """``x W^T (+ b)`` for a Linear whose weight is a ``QuantizedWeight``."""

    def __init__(
        self,
        weight: QuantizedWeight,
        bias: torch.Tensor | None,
        kernels: CpuKernels,
        screen: HeadScreen | None = None,
    ) -> None:
        self.act_bytes = [
            kernels.quant_check(kernel_type(p), p.data, p.cols) for p in weight.parts
        ]  # raises if unfit
        self.weight = weight
        self.bias = None if bias is None else bias.detach()
        self.kernels = kernels
        self.out_features = weight.rows
        self.dense_min_rows = [dense_min_rows(kernels.kind, p) for p in weight.parts]
        self.a8_min_rows = [a8_min_rows(kernels, p) for p in weight.parts]
        # head_screen.py: a 16-bit head's one-row argmax from its int8 copy, where one row takes the
        # one-row tile (neither the dense path nor 8-bit activations: the screen's exact values are that
        # tile's)
        one_row_tile = screen is not None and self.dense_min_rows[0] > 1 and self.a8_min_rows[0] > 1
        self.screen = screen if one_row_tile else None

    def tensors(self) -> list[torch.Tensor]:
        """What this Linear holds (for the worker's count of weight bytes)."""
        held = [part.data for part in self.weight.parts]
        held += [] if self.screen is None else self.screen.tensors()
        return held if self.bias is None else [*held, self.bias]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.bias is None and len(self.weight.parts) == 1 and rows and x.stride(-1) == 1:
            # One part, nothing added (an LM head, a plain projection): the kernel's own output, no
            # column views (at one row _matmul's steps cost more than their work: benchmarks-history.md).
            part = self.weight.parts[0]
            type = kernel_type(part) | (A8 if rows >= self.a8_min_rows[0] else 0)
            run = self.kernels.quant_matmul_checked
            return run(type, part.data, part.cols, x, None, self.act_bytes[0], rows >= self.dense_min_rows[0])
        return self._matmul(x, None)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``residual + x W^T + b``, with one rounding where there is no bias."""
        return self._matmul(x, residual)

    def argmax_fits(self, rows: int, dtype: torch.dtype, cap: float) -> bool:
        """Whether ``argmax`` takes ``rows`` rows of ``dtype`` with this soft-cap (0: none): one part,
        no bias (an LM head), float32 or bfloat16 rows, a cap on float32 alone (the model caps others
        in torch, not by softcap_f32's operations)."""
        one_part = self.bias is None and len(self.weight.parts) == 1
        return one_part and rows > 0 and (dtype == torch.float32 or (dtype == torch.bfloat16 and not cap))

    def argmax(self, x: torch.Tensor, cap: float = 0.0) -> torch.Tensor:
        """The greedy draw from this head's logits, without the logits: int64 [rows], each row's first
        index of the largest of ``self(x)`` soft-capped as softcap_f32 caps it (``cap`` > 0), the same
        kernel and path as ``self(x)``, folded panel by panel (csrc/quant.c's quant_matmul_argmax), or
        at one row without a cap screened by the head's int8 copy (head_screen.py), the same token.
        Only where ``argmax_fits``."""
        rows = x.shape[0]
        assert self.argmax_fits(rows, x.dtype, cap), "argmax: a one-part head, float32 or bf16 without a cap"
        x = x if x.stride(-1) == 1 else x.contiguous()
        if rows == 1 and not cap and self.screen is not None:
            return self.screen.argmax(x)
        part = self.weight.parts[0]
        type = kernel_type(part) | (A8 if rows >= self.a8_min_rows[0] else 0)
        dense = rows >= self.dense_min_rows[0]
        return self.kernels.quant_matmul_argmax(type, part.data, part.cols, x, self.act_bytes[0], dense, cap)

    def _matmul(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        rows = x.shape[0]
        if rows == 0:  # a batch none of whose rows samples has no logits to compute
            return x.new_empty((0, self.out_features))
        x = x if x.stride(-1) == 1 else x.contiguous()
        fuse = residual is not None and self.bias is None
        out = torch.empty((x.shape[0], self.out_features), dtype=x.dtype)
        col = 0
        plan = zip(self.weight.parts, self.act_bytes, self.dense_min_rows, self.a8_min_rows, strict=True)
        for part, act_bytes, dense_at, a8_at in plan:
            cols = slice(col, col + part.rows)
            held = residual[:, cols] if fuse and residual is not None else None
            type = kernel_type(part) | (A8 if rows >= a8_at else 0)
            run = self.kernels.quant_matmul_checked
            run(type, part.data, part.cols, x, held, act_bytes, rows >= dense_at, out[:, cols])
            col += part.rows
        if self.bias is not None:
            out = out + self.bias
        return out if residual is None or fuse else residual + out


class QuantGated:
    """``silu(x W_gate^T) * (x W_up^T)`` of a gate|up ``QuantLinear`` (two equal halves, no bias) in
    one call (csrc/quant.c's quant_matmul_gated: the [rows, 2 inner] output never written), where its
    rows take the integer path; else the Linear's output, then ``silu_mul``. The same bits either way."""

    def __init__(self, linear: QuantLinear, gate: QuantBlocks, up: QuantBlocks, act_bytes: int) -> None:
        self.linear, self.gate, self.up, self.act_bytes = linear, gate, up, act_bytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows, linear = x.shape[0], self.linear
        if rows == 0 or rows >= linear.dense_min_rows[0]:
            return linear.kernels.silu_mul(linear(x))
        x = x if x.stride(-1) == 1 else x.contiguous()
        type = kernel_type(self.gate) | (A8 if rows >= linear.a8_min_rows[0] else 0)
        run = linear.kernels.quant_matmul_gated
        return run(type, self.gate.data, self.up.data, self.gate.cols, x, self.act_bytes, False)


def gated(linear: QuantLinear) -> QuantGated | None:
    """A ``QuantGated`` of ``linear`` where its two halves are gate and up for it: no bias, one part
    (its rows split in two) or two parts of one type, size, layout and row-count thresholds."""
    parts = linear.weight.parts
    if linear.bias is not None or len(parts) > 2 or linear.out_features % 2:
        return None
    inner = linear.out_features // 2
    if len(parts) == 1:
        part = parts[0]
        if part.layout == X8_LAYOUT and inner % 8:
            return None  # rows interleaved by 8: each half must be whole groups
        halves = (part.data[:inner], part.data[inner:])
        gate, up = (QuantBlocks(part.type, half, part.cols, part.layout) for half in halves)
        return QuantGated(linear, gate, up, linear.act_bytes[0])
    gate, up = parts
    same = (gate.type, gate.rows, gate.cols, gate.layout) == (up.type, up.rows, up.cols, up.layout)
    alike = (
        linear.dense_min_rows[0] == linear.dense_min_rows[1]
        and linear.a8_min_rows[0] == linear.a8_min_rows[1]
    )
    return QuantGated(linear, gate, up, linear.act_bytes[0]) if same and alike else None


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
