"""The legacy GGUF types held with their rows interleaved by 8 (csrc/quant_x8.c, made by
backends/cpu/layouts.py): the layout itself, and every kernel that reads it (the integer path at
any row count, the dense path, the row lookup) against float64 on gguf-py's dequantization of the
file's blocks, on every CPU kind this machine runs."""

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
from tests.gpu_worker.test_quant_kernels import LEGACY, weights

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler to build the kernels"
)

# (n, k): one group, three, a thread split of 8 groups, and several panels per thread; k one block,
# three, and SmolLM2's widths.
SHAPES = [(8, 32), (24, 96), (64, 576), (1000, 128), (16, 1536)]


def held(qtype: Q, n: int, k: int) -> tuple[QuantBlocks, np.ndarray, np.ndarray]:
    """(the blocks interleaved, their float64 dequantization, the per-weight bound) for ``weights``."""
    blocks, deq, bound = weights(qtype, n, k)
    x8 = interleave_rows(QuantBlocks(int(qtype), torch.from_numpy(blocks), k))
    assert x8.layout == X8_LAYOUT and kernel_type(x8) == int(qtype) | X8
    return x8, deq, bound


@pytest.mark.parametrize("qtype", LEGACY, ids=[t.name for t in LEGACY])
def test_layout_is_the_one_the_kernels_read(qtype: Q) -> None:
    """Per group and block: the 8 rows' fp16 d (Q4_1: then their m), then 2 quant bytes per row in
    turn; same bytes, and undone exactly."""
    blocks, _, _ = weights(qtype, 16, 64)
    x8 = interleave_rows(QuantBlocks(int(qtype), torch.from_numpy(blocks), 64))
    assert x8.data.shape == blocks.shape and torch.equal(deinterleave_rows(x8), torch.from_numpy(blocks))
    head = 4 if qtype == Q.Q4_1 else 2
    bb = blocks.shape[1] // 2
    group1_block1 = x8.data.numpy()[8:16].reshape(-1)[8 * bb : 16 * bb]  # group 1, block 1
    rows = blocks[8:16, bb : 2 * bb]  # the file's rows 8..15, block 1
    assert (group1_block1[:16] == rows[:, :2].reshape(-1)).all()  # d
    if qtype == Q.Q4_1:
        assert (group1_block1[16:32] == rows[:, 2:4].reshape(-1)).all()  # m
    chunks = group1_block1[8 * head :].reshape(-1, 8, 2)  # [chunk, row, 2 bytes]
    assert (chunks.transpose(1, 0, 2).reshape(8, -1) == rows[:, head:]).all()
    odd = QuantBlocks(int(qtype), torch.from_numpy(weights(qtype, 7, 96)[0]), 96)
    assert interleave_rows(odd) is odd, "7 rows stay as the file holds them"


@pytest.mark.parametrize("qtype", LEGACY, ids=[t.name for t in LEGACY])
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 32, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_integer_path_matches_float64(
    kernels: cpu_kernels.CpuKernels, qtype: Q, n: int, k: int, rows: int, dtype: torch.dtype
) -> None:
    x8, deq, bound = held(qtype, n, k)
    x = activations(rows, k, dtype, rows * 7 + n)
    residual = torch.randn(rows, n).to(dtype) if rows % 2 else None
    y = kernels.quant_matmul(kernel_type(x8), x8.data, k, x, residual)
    assert y.shape == (rows, n) and y.dtype == dtype
    check_quant_matmul(y, x, residual, deq, bound, k // 32, HALF_STEP)


@pytest.mark.parametrize("qtype", LEGACY, ids=[t.name for t in LEGACY])
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("rows", [1, 8, 33])
def test_dense_path_matches_float64(
    kernels: cpu_kernels.CpuKernels, qtype: Q, n: int, k: int, rows: int
) -> None:
    """W dequantized a group of 8 rows at a time (the chunks transposed back): float32 sums of exact
    products, within (k / 8 + 8) float32 roundings of the sum of |x w| (test_quant_dense.py's bound)."""
    x8, deq, _ = held(qtype, n, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows + n))
    residual = torch.randn(rows, n, generator=torch.Generator().manual_seed(rows))
    y = kernels.quant_matmul(kernel_type(x8), x8.data, k, x, residual, dense=True).double().numpy()
    x64, res64 = x.double().numpy(), residual.double().numpy()
    ref = res64 + x64 @ deq.T
    tol = (k / 8 + 8) * EPS32 * (np.abs(x64) @ np.abs(deq).T) + EPS32 * (np.abs(ref) + np.abs(res64))
    assert (np.abs(y - ref) <= tol + 1e-30).all()


@pytest.mark.parametrize("qtype", LEGACY, ids=[t.name for t in LEGACY])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_row_lookup_is_bit_exact(kernels: cpu_kernels.CpuKernels, qtype: Q, dtype: torch.dtype) -> None:
    """Rows of every slot of several groups equal gguf's dequantization of the file's blocks."""
    x8, _, _ = held(qtype, 24, 576)
    expected = torch.from_numpy(gguf.quants.dequantize(weights(qtype, 24, 576)[0], qtype))
    ids = torch.tensor([5, 0, 23, 8, 15, 16, 7, 5], dtype=torch.int64)
    got = kernels.quant_get_rows(kernel_type(x8), x8.data, 576, ids, dtype)
    assert torch.equal(got, expected[ids].to(dtype))
    assert torch.equal(dequantize(x8), expected)


def test_rows_not_a_multiple_of_8_are_refused(kernels: cpu_kernels.CpuKernels) -> None:
    blocks, _, _ = weights(Q.Q8_0, 7, 96)
    x = torch.randn(2, 96)
    for dense in (False, True):
        with pytest.raises(ValueError, match=r"RV_ERR_X8_ROWS \(5\)"):
            kernels.quant_matmul(int(Q.Q8_0) | X8, torch.from_numpy(blocks), 96, x, dense=dense)


X86_KINDS = [kind for kind in KINDS if kind != CpuKind.PORTABLE]  # portable: a tile of its own


@pytest.mark.skipif(len(X86_KINDS) < 2, reason="this CPU runs one x86 kind: nothing to compare")
@pytest.mark.parametrize("qtype", LEGACY, ids=[t.name for t in LEGACY])
@pytest.mark.parametrize("rows", [1, 3, 4, 8, 9, 17])
def test_every_kind_gives_the_same_bits(qtype: Q, rows: int) -> None:
    """The AVX-512 kinds' tile takes 16 weight rows and 8 activation rows a pass, the AVX2 one 8 and
    4; each output lane does the same integer sums and float operations in the same order, so every
    kind this CPU runs (portable aside: its own tile) gives the same bits, odd groups included."""
    n, k = 40, 576  # two pairs of groups and an odd one
    x8, _, _ = held(qtype, n, k)
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
