"""Q5_0, Q5_1, IQ4_NL and IQ4_XS with rows interleaved by 8 (csrc/quant_sub32x8.c): the layout
(layouts.py) and its dequantization, the 16-bit tile (few rows) and the 8-bit tile (many rows; its
activations per 32 values, so a k of 640 takes it) against float64 products over gguf-py's
dequantization, on every CPU kind this machine runs; the 8-bit tiles' bits alike on every kind that
has them, a row's output whatever rows are beside it, and QuantLinear taking them from A8_MIN_ROWS
rows."""

from __future__ import annotations

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
from tests.gpu_worker.a8_checks import (
    SPREAD,
    a8_kinds,
    check_a8_unquantized,
    check_dense,
    check_layout,
    check_rows_alone,
    interleaved,
)
from tests.gpu_worker.quant_reference import HALF_STEP, activations, check_quant_matmul
from tests.gpu_worker.test_quant_sub32 import weights

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler to build the kernels"
)

SUB = [Q.Q5_0, Q.Q5_1, Q.IQ4_NL, Q.IQ4_XS]
# one group; two groups (one 16-row tile); a lone group after a pair, Gemma 3 270M's k; 34 blocks
# (IQ4_XS: k whole blocks of 256)
SHAPES = [(8, 32), (16, 96), (24, 640), (40, 1088)]
XS_SHAPES = [(8, 256), (24, 512), (40, 1280)]
CASES = [(t, n, k) for t in SUB for n, k in (XS_SHAPES if t == Q.IQ4_XS else SHAPES)]
IDS = [f"{t.name}-{n}x{k}" for t, n, k in CASES]


def k_of(qtype: Q) -> int:
    """The k the tests below take for ``qtype``: Gemma 3 270M's 640, IQ4_XS's 1024."""
    return 1024 if qtype == Q.IQ4_XS else 640


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
@pytest.mark.parametrize("rows", [1, 3, 8, 33])
def test_16_bit_tile_matches_float64(
    kernels: cpu_kernels.CpuKernels, qtype: Q, n: int, k: int, rows: int
) -> None:
    x8, deq, bound = held(qtype, n, k)
    x = activations(rows, k, torch.bfloat16, rows * 7 + n)
    residual = torch.randn(rows, n).bfloat16() if rows % 2 else None
    y = kernels.quant_matmul(kernel_type(x8), x8.data, k, x, residual)
    assert y.shape == (rows, n) and y.dtype == torch.bfloat16
    check_quant_matmul(y, x, residual, deq, bound, k // 32, HALF_STEP)
    check_dense(kernels, x8, x, deq)


@pytest.mark.parametrize(("qtype", "n", "k"), CASES, ids=IDS)
@pytest.mark.parametrize("rows", [1, 3, 8, 33])
def test_8_bit_tile_matches_float64(
    kernels: cpu_kernels.CpuKernels, qtype: Q, n: int, k: int, rows: int
) -> None:
    """Against the unquantized activations: what the 8-bit rounding moved (a8_step per value times
    |w|), plus float32 roundings of the terms (as test_quant_a8.py's tight bound), plus the output's."""
    x8, deq, bound = held(qtype, n, k)
    x = activations(rows, k, torch.float32, rows * 5 + n)
    x[0, 7] = 400.0  # a block far above the rest: the residual pass
    residual = torch.randn(rows, n) if rows % 2 else None
    assert kernels.quant_supported(kernel_type(x8) | A8)
    y = kernels.quant_matmul(kernel_type(x8) | A8, x8.data, k, x, residual)
    check_a8_unquantized(y, x, residual, deq, bound)


@pytest.mark.parametrize("qtype", SUB, ids=[t.name for t in SUB])
def test_a_rows_output_does_not_depend_on_the_rows_beside_it(
    kernels: cpu_kernels.CpuKernels, qtype: Q
) -> None:
    k = k_of(qtype)
    check_rows_alone(kernels, held(qtype, 24, k)[0], k)


def half_with_the_residual_pass(rows: int, k: int, seed: int) -> torch.Tensor:
    """Activations whose 32-value blocks take the residual pass at random, about half of them (as the
    down projection's input does): one value of such a block far above the rest."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * torch.rand(rows, 1, generator=g) * 3
    blocks = x.view(rows, k // 32, 32)
    spike = torch.rand(rows, k // 32, generator=g) < 0.5
    blocks[..., 7] += spike * 40.0 * blocks.abs().mean(dim=-1)
    a = blocks.bfloat16().float().abs()  # (the tiles' input, as quant_matmul rounds it)
    two = a.amax(dim=-1) * 32.0 > SPREAD * a.sum(dim=-1)
    assert torch.equal(two, spike), "the spikes decide which blocks take the pass"
    return x


@pytest.mark.parametrize("qtype", SUB, ids=[t.name for t in SUB])
def test_rows_with_and_without_the_residual_pass_beside_each_other(
    kernels: cpu_kernels.CpuKernels, qtype: Q
) -> None:
    """29 rows (tiles of 8, 4 and 1 rows), each block's residual pass on for a random half of them:
    each row's 8-bit output is the bits it has alone (the pass made for the rows that have it only)."""
    k = k_of(qtype)
    x8 = held(qtype, 40, k)[0]
    x = half_with_the_residual_pass(29, k, 17)
    t = kernel_type(x8) | A8
    together = kernels.quant_matmul(t, x8.data, k, x)
    for i in range(29):
        assert torch.equal(kernels.quant_matmul(t, x8.data, k, x[i : i + 1]), together[i : i + 1]), i
    order = torch.randperm(29, generator=torch.Generator().manual_seed(3))
    assert torch.equal(kernels.quant_matmul(t, x8.data, k, x[order]), together[order])


@pytest.mark.parametrize("qtype", SUB, ids=[t.name for t in SUB])
def test_every_kind_with_the_8_bit_tiles_gives_the_same_bits(qtype: Q) -> None:
    k = k_of(qtype)
    x8, _, _ = held(qtype, 40, k)
    libs = [cpu_kernels.CpuKernels(cpu_kernels.build(kind), kind) for kind in a8_kinds()]
    if len(libs) < 2:
        pytest.skip("fewer than two kinds with the 8-bit tiles here")
    for x in (activations(19, k, torch.bfloat16, 11), half_with_the_residual_pass(19, k, 23)):
        outs = [lib.quant_matmul(kernel_type(x8) | A8, x8.data, k, x) for lib in libs]
        assert all(torch.equal(out, outs[0]) for out in outs[1:])


def test_quant_linear_takes_8_bits_from_the_tables_rows(kernels: cpu_kernels.CpuKernels) -> None:
    """A merged q/k/v of Q5_0, Q5_1, IQ4_NL at k = 640 (not whole blocks of 256): 16-bit below its
    type's A8_MIN_ROWS, 8-bit from it; never on portable."""
    parts = [held(qtype, 16, 640)[0] for qtype in SUB[:3]]
    linear = QuantLinear(QuantizedWeight(tuple(parts)), None, kernels)
    table = A8_MIN_ROWS[kernels.kind]
    want_at = [table.get(Q(p.type), NEVER) for p in parts]
    assert linear.a8_min_rows == want_at == [a8_min_rows(kernels, p) for p in parts]
    if kernels.kind == CpuKind.PORTABLE:
        assert want_at == [NEVER] * 3
        return
    for rows in sorted({at for at in want_at} | {at - 1 for at in want_at}):
        x = activations(rows, 640, torch.bfloat16, rows)
        outs = [
            kernels.quant_matmul(kernel_type(p) | (A8 if rows >= at else 0), p.data, 640, x)
            for p, at in zip(parts, want_at, strict=True)
        ]
        assert torch.equal(linear(x), torch.cat(outs, dim=1))
