"""MXFP4 blocks held with their rows interleaved by 8 (csrc/quant_mxfp4.c, made by
backends/cpu/layouts.py), the layout gpt-oss's experts are held in: the layout itself, and every
kernel that reads it (the integer path at one row and many, the dense path, the row lookup) against
float64 on gguf-py's dequantization of the file's blocks, on every CPU kind this machine runs."""

from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from gpu_worker.backends.cpu import kernels as cpu_kernels
from gpu_worker.backends.cpu.kind import CpuKind
from gpu_worker.backends.cpu.layouts import (
    X8,
    X8_LAYOUT,
    deinterleave_rows,
    dequantize,
    interleave_rows,
    kernel_type,
)
from gpu_worker.weights.formats import QuantBlocks
from tests.gpu_worker.helpers import KINDS
from tests.gpu_worker.quant_reference import EPS32, HALF_STEP, activations, check_quant_matmul
from tests.gpu_worker.test_mxfp4 import weights

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler to build the kernels"
)

# (n, k): one group, three, a pair of groups beside an odd one, several panels; k one block to past a
# 32-block chunk.
SHAPES = [(8, 32), (24, 96), (40, 640), (136, 1088)]


def held(n: int, k: int) -> tuple[QuantBlocks, np.ndarray]:
    """(the blocks of test_mxfp4's ``weights`` interleaved, their float64 dequantization)."""
    blocks, deq = weights(n, k)
    x8 = interleave_rows(QuantBlocks(int(Q.MXFP4), torch.from_numpy(blocks), k))
    assert x8.layout == X8_LAYOUT and kernel_type(x8) == int(Q.MXFP4) | X8
    return x8, deq


def test_layout_is_the_one_the_kernels_read() -> None:
    """Per group and block: the 8 rows' exponent bytes, then 2 nibble bytes per row in turn; same
    bytes, and undone exactly."""
    blocks, _ = weights(24, 96)
    x8 = interleave_rows(QuantBlocks(int(Q.MXFP4), torch.from_numpy(blocks), 96))
    assert x8.data.shape == blocks.shape and torch.equal(deinterleave_rows(x8), torch.from_numpy(blocks))
    group1_block1 = x8.data.numpy()[8:16].reshape(-1)[8 * 17 : 16 * 17]
    rows = blocks[8:16, 17:34]  # the file's rows 8..15, block 1
    assert (group1_block1[:8] == rows[:, 0]).all()
    chunks = group1_block1[8:].reshape(8, 8, 2)  # [chunk, row, 2 bytes]
    assert (chunks.transpose(1, 0, 2).reshape(8, 16) == rows[:, 1:]).all()
    odd = QuantBlocks(int(Q.MXFP4), torch.from_numpy(weights(7, 96)[0]), 96)
    assert interleave_rows(odd) is odd, "7 rows stay as the file holds them"


@pytest.mark.parametrize(("n", "k"), SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
@pytest.mark.parametrize("rows", [1, 2, 5, 9, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_integer_path_matches_float64(
    kernels: cpu_kernels.CpuKernels, n: int, k: int, rows: int, dtype: torch.dtype
) -> None:
    x8, deq = held(n, k)
    x = activations(rows, k, dtype, rows * 7 + n)
    residual = (
        torch.randn(rows, n, generator=torch.Generator().manual_seed(n)).to(dtype) if rows % 2 else None
    )
    y = kernels.quant_matmul(kernel_type(x8), x8.data, k, x, residual)
    assert y.shape == (rows, n) and y.dtype == dtype
    check_quant_matmul(y, x, residual, deq, np.abs(deq), k // 32, HALF_STEP)


@pytest.mark.parametrize(("n", "k"), SHAPES[1:], ids=[f"{n}x{k}" for n, k in SHAPES[1:]])
def test_dense_path_matches_float64(kernels: cpu_kernels.CpuKernels, n: int, k: int) -> None:
    """W dequantized a group at a time, met by unquantized float32 rows: within (k / 8 + 8) float32
    roundings of the sum of |x w|."""
    x8, deq = held(n, k)
    x = activations(9, k, torch.float32, n)
    y = kernels.quant_matmul(kernel_type(x8), x8.data, k, x, None, dense=True).double().numpy()
    x64 = x.double().numpy()
    tol = (k / 8 + 8) * EPS32 * (np.abs(x64) @ np.abs(deq).T) + 1e-30
    assert (np.abs(y - x64 @ deq.T) <= tol).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_row_lookup_is_bit_exact(kernels: cpu_kernels.CpuKernels, dtype: torch.dtype) -> None:
    """Rows of every slot of several groups (subnormal and large exponents among them) equal gguf's
    float32 dequantization of the file's blocks."""
    x8, _ = held(24, 96)
    expected = torch.from_numpy(gguf.quants.dequantize(weights(24, 96)[0], Q.MXFP4))
    ids = torch.tensor([5, 0, 23, 8, 15, 16, 7, 5], dtype=torch.int64)
    got = kernels.quant_get_rows(kernel_type(x8), x8.data, 96, ids, dtype)
    assert torch.equal(got, expected[ids].to(dtype))
    assert torch.equal(dequantize(x8), expected)


X86_KINDS = [kind for kind in KINDS if kind != CpuKind.PORTABLE]  # portable: a tile of its own


@pytest.mark.skipif(len(X86_KINDS) < 2, reason="this CPU runs one x86 kind: nothing to compare")
@pytest.mark.parametrize("rows", [1, 3, 9])
def test_every_kind_gives_the_same_bits(rows: int) -> None:
    """The AVX-512 kinds' tiles take 16 weight rows and 8 activation rows a pass (one row: two chunks a
    zmm), the AVX2 one 8 and 4; each output lane does the same integer sums and float operations in
    the same order, so every x86 kind this CPU runs gives the same bits, an odd group included (one
    row: 56 rows, a pass of four groups, a pair and the odd group)."""
    n, k = 56, 640
    x8, _ = held(n, k)
    x = activations(rows, k, torch.float32, rows + 3)
    outs = {
        kind: cpu_kernels.CpuKernels(cpu_kernels.build(kind), kind).quant_matmul(
            kernel_type(x8), x8.data, k, x
        )
        for kind in X86_KINDS
    }
    first = next(iter(outs.values()))
    for kind, y in outs.items():
        assert torch.equal(y, first), kind
