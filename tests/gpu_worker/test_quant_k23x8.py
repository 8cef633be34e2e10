"""Q2_K and Q3_K with rows interleaved by 8 (csrc/quant_k23x8.c): the layout (layouts.py) and its
dequantization, the 16-bit tile (few rows) and the 8-bit tile (many rows; act_block8) against float64
products over gguf-py's dequantization, on every CPU kind this machine runs; the 8-bit tiles' bits
alike on every kind that has them, a row's output whatever rows are beside it, and QuantLinear taking
them from A8_MIN_ROWS rows."""

from __future__ import annotations

import ctypes
import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from gpu_worker.backends.cpu import kernels as cpu_kernels
from gpu_worker.backends.cpu.kind import CpuKind
from gpu_worker.backends.cpu.layouts import A8, kernel_type
from gpu_worker.backends.cpu.quant import A8_MIN_ROWS, NEVER, QuantLinear, a8_min_rows
from gpu_worker.weights.formats import QuantBlocks, QuantizedWeight
from tests.gpu_worker.a8_checks import check_dense, check_layout, check_rows_alone, interleaved
from tests.gpu_worker.helpers import KINDS
from tests.gpu_worker.quant_reference import EPS32, HALF_STEP, activations, check_quant_matmul
from tests.gpu_worker.test_quant_a8 import quantized, values
from tests.gpu_worker.test_quant_k23 import weights

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler to build the kernels"
)

K23 = [Q.Q2_K, Q.Q3_K]
# one group; two groups; three groups of 5 blocks
SHAPES = [(8, 256), (16, 512), (24, 1280)]
CASES = [(t, n, k) for t in K23 for n, k in SHAPES]
IDS = [f"{t.name}-{n}x{k}" for t, n, k in CASES]


def held(qtype: Q, n: int, k: int) -> tuple[QuantBlocks, np.ndarray, np.ndarray]:
    """(blocks interleaved, float64 dequantization, per-weight bound on the terms the tiles sum)."""
    blocks, deq, bound = weights(qtype, n, k)
    return interleaved(qtype, blocks, k), deq, bound


@pytest.mark.parametrize(("qtype", "n", "k"), CASES, ids=IDS)
def test_layout_round_trips_and_dequantizes_exactly(
    kernels: cpu_kernels.CpuKernels, qtype: Q, n: int, k: int
) -> None:
    x8, deq, _ = held(qtype, n, k)
    check_layout(kernels, x8, deq, qtype)


@pytest.mark.parametrize(("qtype", "n", "k"), CASES, ids=IDS)
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_16_bit_tile_matches_float64(
    kernels: cpu_kernels.CpuKernels, qtype: Q, n: int, k: int, rows: int
) -> None:
    x8, deq, bound = held(qtype, n, k)
    x = activations(rows, k, torch.bfloat16, rows * 7 + n)
    residual = torch.randn(rows, n).bfloat16() if rows % 2 else None
    y = kernels.quant_matmul(kernel_type(x8), x8.data, k, x, residual)
    assert y.shape == (rows, n) and y.dtype == torch.bfloat16
    check_quant_matmul(y, x, residual, deq, bound, 2 * k // 32, HALF_STEP)
    check_dense(kernels, x8, x, deq)


@pytest.mark.parametrize(("qtype", "n", "k"), CASES, ids=IDS)
@pytest.mark.parametrize("rows", [1, 5, 8, 33])
def test_8_bit_tile_matches_float64(
    kernels: cpu_kernels.CpuKernels, qtype: Q, n: int, k: int, rows: int
) -> None:
    """(a) Against float64 of the activations as the kernel quantized them (the integer sums exact,
    each sub-block's terms a float32 product and sum), then the output's rounding; (b) against the
    unquantized ones: (a) plus what the rounding moved, |x - xq| |w|. The portable build's plain-C
    tile (a reference quant.py never routes to) alike."""
    x8, deq, bound = held(qtype, n, k)
    x = activations(rows, k, torch.float32, rows * 5 + n)
    x[0, 7] = 400.0  # a block far above the rest: the residual pass
    residual = torch.randn(rows, n) if rows % 2 else None
    assert kernels.quant_supported(kernel_type(x8) | A8)
    y = kernels.quant_matmul(kernel_type(x8) | A8, x8.data, k, x, residual)
    got = y.double().numpy()
    xq = values(quantized(kernels, x))
    res64 = residual.double().numpy() if residual is not None else np.zeros((rows, n))
    ref_q = res64 + xq @ deq.T
    tol_a = (
        (6 * k / 32 + 16) * EPS32 * (np.abs(xq) @ bound.T) + EPS32 * (np.abs(ref_q) + np.abs(res64)) + 1e-30
    )
    assert (np.abs(got - ref_q) <= tol_a).all(), f"tight: worst {np.max(np.abs(got - ref_q) / tol_a):.3g}"
    x64 = x.double().numpy()
    tol_b = np.abs(x64 - xq) @ np.abs(deq).T + tol_a
    assert (np.abs(got - (res64 + x64 @ deq.T)) <= tol_b).all()


@pytest.mark.parametrize("qtype", K23, ids=[t.name for t in K23])
def test_a_rows_output_does_not_depend_on_the_rows_beside_it(
    kernels: cpu_kernels.CpuKernels, qtype: Q
) -> None:
    check_rows_alone(kernels, held(qtype, 24, 1024)[0], 1024)


@pytest.mark.parametrize("qtype", K23, ids=[t.name for t in K23])
def test_every_kind_gives_the_8_bit_tiles_bits(qtype: Q) -> None:
    """vpdpbusd (the VNNI builds), maddubs + madd (AVX-512 without VNNI, AVX2) and the portable
    plain-C reference sum the same integers in the same order."""
    x8, _, _ = held(qtype, 40, 1024)
    libs = [cpu_kernels.CpuKernels(cpu_kernels.build(kind), kind) for kind in KINDS]
    if len(libs) < 2:
        pytest.skip("fewer than two kinds here")
    x = activations(19, 1024, torch.bfloat16, 11)
    x[3, 100] = 900.0
    outs = [lib.quant_matmul(kernel_type(x8) | A8, x8.data, 1024, x) for lib in libs]
    assert all(torch.equal(out, outs[0]) for out in outs[1:])


@pytest.mark.parametrize(("qtype", "switch_name"), [(Q.Q2_K, "k23_row16"), (Q.Q3_K, "k23_row16_q3")])
@pytest.mark.parametrize(("n", "k"), [(8, 256), (16, 512), (24, 1280), (40, 2048)])
def test_one_row_form_gives_the_16_bit_tiles_bits(
    kernels: cpu_kernels.CpuKernels, qtype: Q, switch_name: str, n: int, k: int
) -> None:
    """One activation row (csrc/quant_k23x8.c's row16_q2, row16_q3: the integers a power of four apart,
    shifted back; two groups a zmm, Q2_K's odd last group a ymm) gives tile16's bits: the library's
    switch at 0 runs tile16 for that row."""
    switch = ctypes.c_int.in_dll(ctypes.CDLL(str(kernels.path)), switch_name)
    x8, _, _ = held(qtype, n, k)
    x = activations(1, k, torch.float32, n + k)
    x[0, 37] = 900.0  # a block far above the rest
    try:
        ys = []
        for on in (0, 1):
            switch.value = on
            ys.append(kernels.quant_matmul(kernel_type(x8), x8.data, k, x))
    finally:
        switch.value = 1
    assert torch.equal(ys[0], ys[1])


def test_quant_linear_takes_8_bits_from_the_tables_rows(kernels: cpu_kernels.CpuKernels) -> None:
    """A merged Linear of Q2_K, Q3_K, Q3_K: 16-bit below its type's A8_MIN_ROWS, 8-bit from it; never
    on portable."""
    parts = [held(qtype, 16, 512)[0] for qtype in (Q.Q2_K, Q.Q3_K, Q.Q3_K)]
    linear = QuantLinear(QuantizedWeight(tuple(parts)), None, kernels)
    table = A8_MIN_ROWS[kernels.kind]
    want_at = [table.get(Q(p.type), NEVER) for p in parts]
    assert linear.a8_min_rows == want_at == [a8_min_rows(kernels, p) for p in parts]
    if kernels.kind == CpuKind.PORTABLE:
        assert want_at == [NEVER] * 3
        return
    for rows in sorted({at for at in want_at} | {at - 1 for at in want_at}):
        x = activations(rows, 512, torch.bfloat16, rows)
        outs = [
            kernels.quant_matmul(kernel_type(p) | (A8 if rows >= at else 0), p.data, 512, x)
            for p, at in zip(parts, want_at, strict=True)
        ]
        assert torch.equal(linear(x), torch.cat(outs, dim=1))
