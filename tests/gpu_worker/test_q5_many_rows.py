"""Q5_0 and Q5_1's 8-bit tile at many rows (csrc/quant_sub32x8.c's q5_tile8 on AVX2: a block's chunks
assembled once for up to 16 rows, each row's sums made whole in turn) against the tile of few rows:
every row of a call the bits that row has alone (one row: tile8's sums in registers), at the row
counts where the passes split (3, 5, 16, 17, 40), with the residual pass in some rows' blocks and not
in others'; and the bits alike on every kind that has the 8-bit tiles."""

from __future__ import annotations

import shutil

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from gpu_worker.backends.cpu import kernels as cpu_kernels
from gpu_worker.backends.cpu.layouts import A8, kernel_type
from gpu_worker.weights.formats import QuantBlocks
from tests.gpu_worker.a8_checks import a8_kinds, interleaved
from tests.gpu_worker.quant_reference import activations
from tests.gpu_worker.test_quant_sub32 import weights

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler to build the kernels"
)

Q5 = [Q.Q5_0, Q.Q5_1]
K = 640  # Gemma 3 270M's


def held(qtype: Q, n: int) -> QuantBlocks:
    return interleaved(qtype, weights(qtype, n, K)[0], K)


def spread_rows(rows: int, seed: int) -> torch.Tensor:
    """x [rows, K] where row 1's block 9 and every fourth row's block 2 take the residual pass
    (one value far above the rest) and the other rows' blocks do not."""
    x = activations(rows, K, torch.float32, seed)
    x[:, 3] /= 20  # activations() puts an outlier in every row's block 0: not here
    if rows > 1:
        x[1, 9 * 32 + 5] = 300.0
    x[::4, 2 * 32 + 17] = -80.0
    return x


@pytest.mark.parametrize("qtype", Q5, ids=[t.name for t in Q5])
@pytest.mark.parametrize("rows", [2, 3, 4, 5, 16, 17, 40])
def test_each_row_has_the_bits_it_has_alone(kernels: cpu_kernels.CpuKernels, qtype: Q, rows: int) -> None:
    x8 = held(qtype, 24)
    t = kernel_type(x8) | A8
    if not kernels.quant_supported(t):
        pytest.skip("no 8-bit tile on this kind")
    x = spread_rows(rows, rows)
    together = kernels.quant_matmul(t, x8.data, K, x)
    for i in range(rows):
        assert torch.equal(kernels.quant_matmul(t, x8.data, K, x[i : i + 1]), together[i : i + 1]), i


@pytest.mark.parametrize("qtype", Q5, ids=[t.name for t in Q5])
def test_every_kind_gives_the_same_bits_at_many_rows(qtype: Q) -> None:
    x8 = held(qtype, 40)
    libs = [cpu_kernels.CpuKernels(cpu_kernels.build(kind), kind) for kind in a8_kinds()]
    if len(libs) < 2:
        pytest.skip("fewer than two kinds with the 8-bit tiles here")
    for rows in (3, 17, 40):
        x = spread_rows(rows, 100 + rows)
        outs = [lib.quant_matmul(kernel_type(x8) | A8, x8.data, K, x) for lib in libs]
        assert all(torch.equal(out, outs[0]) for out in outs[1:]), rows
